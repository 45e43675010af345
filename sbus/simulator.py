"""A deterministic simulator of the server: checked, not sampled (docs/reliability.md).

The anchors are FoundationDB's simulation testing and TigerBeetle's VOPR. The real broker
(`BrokerFactory`/`BrokerProtocol`: flood queues, accounting, router, interest, sessions) and
the real transports of both I/O paths (`SeqPacketTransport`, `BatchSeqPacketTransport`) run
in this process on a seeded scheduler. Only the kernel's edge is fake: `FakeSocket` is one
end of a SEQPACKET pair with a receive queue of a chosen size (a send is all or nothing;
ECONNRESET before the last packets of a peer that closed with ours unread; EPIPE to a peer
gone or shut; end of file), epoll's readiness is computed from it as Linux does (a hang-up is
reported whatever the mask, input only when asked for), processes can exit while their
socket lives on (`SimOwners`, for secret keys), and the clock is Twisted's `task.Clock`.

Random clients do what a client may (SUB/UNSUB of aliasing and secret patterns, MSG with echo
on and off, every request, every flood mode and order and switches between them, extensions,
sessions, reading in bursts, stopping, half-closing, hanging up); after every step the
invariants of `Checker` are checked. A failing seed replays exactly: ``python -m
sbus.simulator --seed N --path pure`` (the failure names the command). With both paths, each
seed runs on both and their transcripts (every packet each client read, and every choice the
scheduler made) must be the same (invariant 9).
"""

from __future__ import annotations

import argparse
import errno
import os
import random
import socket
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from twisted.internet import main as reasons
from twisted.internet.task import Clock
from twisted.python import failure

from sbus import speedups
from sbus.core import codec
from sbus.core.credentials import SECRET_ROOT, CredentialError, Credentials, check_pattern, secret_prefix
from sbus.core.patterns import reaches
from sbus.seqpacket import BatchSeqPacketTransport, SeqPacketAddress, SeqPacketTransport
from sbus.server.broker import BrokerFactory, BrokerProtocol
from sbus.server.config import ServerConfig

__all__ = ["Simulation", "Violation", "run", "main"]

IN, OUT, HUP = 1, 4, 16
_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
#: SO_SNDBUF as the fake kernel reports it: twice what is set, at least SOCK_MIN_SNDBUF (4608 on
#: x86-64), divided by 128: the simulator's caps are kilobytes where the server's are megabytes, so
#: a uid's first connections reserve their buffer (1 KiB) and the rest the floor (issue 33.7).
KERNEL_SCALE = 128
KERNEL_MIN_SNDBUF = 4608 // KERNEL_SCALE
#: SO_SNDBUFFORCE (what `size_buffers` falls back on): the size of a buffer raised for one big packet.
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)


class Violation(AssertionError):
    """An invariant broke: the text names it, the seed and the step."""


# -- the kernel's edge -------------------------------------------------------------------------


class FakeSocket:
    """One end of a SOCK_SEQPACKET pair, as the transports and the clients use it."""

    def __init__(self, kernel: "Kernel", capacity: int):
        self.kernel = kernel
        self.fd = kernel.next_fd()
        self.peer: FakeSocket | None = None
        self.queue: deque = deque()  # packets waiting for us to read
        self.nbytes = 0
        self.capacity = capacity  # bytes our receive queue takes (one packet always fits an empty one)
        self.closed = False
        self.shut_rd = False  # we shut our reading side: sends to us fail
        self.shut_wr = False  # we shut our writing side: the peer reads end of file
        self.reset = False  # ECONNRESET once: the peer closed with packets of ours unread
        #: SO_SNDBUF as the kernel counts it (0: never set): a packet bigger is refused (EMSGSIZE),
        #: none is taken while our unread bytes reach it, and we are writable at a quarter of it.
        self.sndbuf = 0

    # what the transport asks of a socket
    def setblocking(self, flag):
        pass

    def fileno(self):
        return -1 if self.closed else self.fd

    def getsockopt(self, level, opt, *args):
        if opt == _SO_PEERPIDFD:
            raise OSError(errno.ENOPROTOOPT, "no SO_PEERPIDFD here")
        if opt == socket.SO_SNDBUF and self.sndbuf:
            return self.sndbuf
        return 1 << 24

    def setsockopt(self, level, opt, value, *args):
        """SO_SNDBUF counts twice what is set, at least the floor, as Linux does, scaled down
        (KERNEL_SCALE) for the sizes the server asks for (1 KiB and up); a smaller value is one
        the transport read back and halves to set it again (`_sendGrown`), already scaled.
        SO_SNDBUFFORCE raises it for one big packet, unscaled."""
        if opt == socket.SO_SNDBUF:
            scale = KERNEL_SCALE if value >= 1024 else 1
            self.sndbuf = max(2 * value // scale, KERNEL_MIN_SNDBUF)
        elif opt == _SO_SNDBUFFORCE:
            self.sndbuf = 2 * value

    def unread(self) -> int:
        """What we sent that the peer has not read (SIOCOUTQ)."""
        return 0 if self.closed else self.peer.nbytes

    def getpeername(self):
        return ""

    def getsockname(self):
        return ""

    def close(self):
        if self.closed:
            return
        self.closed = True
        peer = self.peer
        if peer is not None and not peer.closed:
            if self.queue:
                peer.reset = True  # it is told before it reads what we sent
        self.queue.clear()
        self.nbytes = 0

    def shutdown(self, how):
        if how in (socket.SHUT_RD, socket.SHUT_RDWR):
            self.shut_rd = True
        if how in (socket.SHUT_WR, socket.SHUT_RDWR):
            self.shut_wr = True

    def _check_send(self, packet: bytes):
        if self.closed:
            raise OSError(errno.EBADF, "closed")
        sndbuf = self.sndbuf
        if sndbuf and len(packet) > sndbuf:
            raise OSError(errno.EMSGSIZE, "Message too long")
        peer = self.peer
        if self.shut_wr or peer.closed or peer.shut_rd:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        if peer.queue and (peer.nbytes + len(packet) > peer.capacity or (sndbuf and peer.nbytes >= sndbuf)):
            raise BlockingIOError(errno.EAGAIN, "full")

    def send(self, packet, flags=0) -> int:
        packet = bytes(packet)
        self._check_send(packet)
        peer = self.peer
        peer.queue.append(packet)
        peer.nbytes += len(packet)
        self.kernel.sent(self, packet)
        return len(packet)

    def _take(self):
        """The next packet, b"" for end of file, None when nothing waits."""
        if self.closed:
            raise OSError(errno.EBADF, "closed")
        if self.reset:
            self.reset = False
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        if self.queue:
            packet = self.queue.popleft()
            self.nbytes -= len(packet)
            return packet
        peer = self.peer
        if peer.closed or peer.shut_wr or self.shut_rd:
            return b""
        return None

    def recv_into(self, buf, n, flags=0) -> int:
        packet = self._take()
        if packet is None:
            raise BlockingIOError(errno.EAGAIN, "nothing waits")
        size = len(packet)
        k = min(size, n)
        buf[:k] = packet[:k]
        return size  # MSG_TRUNC: the real size

    def recv(self, n=1 << 20) -> bytes:
        packet = self._take()
        if packet is None:
            raise BlockingIOError(errno.EAGAIN, "nothing waits")
        return packet

    def recv_batch(self, count: int, size: int) -> list:
        out = []
        while len(out) < count:
            try:
                packet = self._take()
            except ConnectionResetError:
                if out:
                    self.reset = True  # reported by the next call
                    break
                raise
            if packet is None:
                break
            out.append(packet if len(packet) <= size else len(packet))
            if not packet:
                break
        return out

    def send_batch(self, batch: list) -> int:
        n = 0
        for packet in batch:
            try:
                self.send(packet)
            except BlockingIOError:
                break
            except OSError:
                if n:
                    break
                raise
            n += 1
        return n

    # readiness, as epoll computes it
    def events(self) -> int:
        ev = 0
        peer = self.peer
        if self.queue or self.reset or peer.closed or peer.shut_wr or self.shut_rd:
            ev |= IN
        if peer.closed or peer.shut_rd or not peer.queue or (
                peer.nbytes < peer.capacity and (not self.sndbuf or peer.nbytes * 4 <= self.sndbuf)):
            ev |= OUT
        if peer.closed:
            ev |= HUP
        return ev


class Kernel:
    def __init__(self):
        self._fd = 100
        self.on_sent = None

    def next_fd(self) -> int:
        self._fd += 1
        return self._fd

    def pair(self, server_capacity: int, client_capacity: int) -> tuple[FakeSocket, FakeSocket]:
        a, b = FakeSocket(self, server_capacity), FakeSocket(self, client_capacity)
        a.peer, b.peer = b, a
        return a, b

    def sent(self, sock, packet):
        if self.on_sent is not None:
            self.on_sent(sock, packet)


class SimTransport(SeqPacketTransport):
    """The transport with its SIOCOUTQ answered by the fake socket."""

    __slots__ = ()

    def unreadBytes(self) -> int:
        return self.socket.unread()

    def peerClosed(self) -> bool:
        return bool(self.socket.events() & HUP)


class SimBatchTransport(BatchSeqPacketTransport):
    """The batch transport with its kernel calls answered by the fake socket."""

    __slots__ = ()

    def recvBatch(self, count: int) -> list:
        return self.socket.recv_batch(count, self.max_packet)

    def sendBatch(self, batch: list) -> int:
        return self.socket.send_batch(batch)

    def unreadBytes(self) -> int:
        return self.socket.unread()

    def peerClosed(self) -> bool:
        return bool(self.socket.events() & HUP)


class SimReactor(Clock):
    """What the transports and the broker ask of a reactor: descriptors and timers. Which
    ready descriptor is served next is the scheduler's choice (`ready`, `serve`)."""

    def __init__(self):
        super().__init__()
        self.readers: dict = {}
        self.writers: dict = {}

    def advance(self, amount: float) -> None:
        """Run the calls due now, but not those they schedule for now: those wait for the next
        turn, as in Twisted's reactor (`task.Clock` would run them at once, in a loop)."""
        self.rightNow += amount
        now = self.seconds()
        for call in [c for c in self.calls if c.getTime() <= now]:
            if call.cancelled or call.called or call not in self.calls:
                continue
            self.calls.remove(call)
            call.called = 1
            call.func(*call.args, **call.kw)

    def addReader(self, r):
        self.readers[id(r)] = r

    def removeReader(self, r):
        self.readers.pop(id(r), None)

    def addWriter(self, w):
        self.writers[id(w)] = w

    def removeWriter(self, w):
        self.writers.pop(id(w), None)

    def ready(self) -> list:
        out = []
        seen = set()
        for table in (self.readers, self.writers):
            for key, sel in table.items():
                if key in seen:
                    continue
                seen.add(key)
                mask = (IN if key in self.readers else 0) | (OUT if key in self.writers else 0)
                ev = sel.socket.events() & (mask | HUP)
                if ev:
                    out.append((sel, ev))
        return out

    def serve(self, sel, ev) -> None:
        """One event to one descriptor, as Twisted's epoll reactor hands it over (a hang-up
        without input is a loss; an exception escapes to the caller: the checker's). Events are
        polled once for a whole round: one for a descriptor that an earlier hand-over in the
        round took out of both tables is skipped, as Twisted's epoll reactor skips an fd no longer
        among its selectables. (Found by seed 477000854985: a publisher held while its queue was
        written saw its send fail in the round; the stale hang-up then cut off the drain of what
        it had sent.)"""
        key = id(sel)
        if key not in self.readers and key not in self.writers:
            return
        inRead = False
        why = None
        if ev & HUP and not ev & IN:
            if id(sel) in self.readers:
                inRead, why = True, reasons.CONNECTION_DONE
            else:
                why = reasons.CONNECTION_LOST
        else:
            if ev & IN:
                why = sel.doRead()
                inRead = True
            if not why and ev & OUT and id(sel) in self.writers:
                why = sel.doWrite()
                inRead = False
        if why:
            self.removeReader(sel)
            self.removeWriter(sel)
            reason = why if isinstance(why, failure.Failure) else failure.Failure(why)
            sel.connectionLost(reason)


class SimBrokerProtocol(BrokerProtocol):
    """The real protocol, hashed by its connection's number instead of its address: the sets
    of recipients the router keeps iterate in the same order in every run of a seed."""

    __slots__ = ("sim_n",)

    def __hash__(self):
        return self.sim_n


class SimOwner:
    """`Owner` for a simulated process: alive until the process exits."""

    __slots__ = ("proc", "told")

    def __init__(self, proc):
        self.proc = proc
        self.told = False

    def alive(self) -> bool:
        return self.proc.alive

    def close(self):
        pass


class SimOwners:
    def __init__(self, sim):
        self.sim = sim

    def take(self, transport, pid: int):
        proc = self.sim.procs.get(pid)
        if proc is None or not proc.alive:
            return f"the process that connected (pid {pid}) has already exited"
        return SimOwner(proc)


class WorkClock:
    """The clock that measures a request's work: each reading advances it by `tick`."""

    def __init__(self, tick: float):
        self.t = 0.0
        self.tick = tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


# -- clients and the model ---------------------------------------------------------------------


@dataclass
class Proc:
    pid: int
    uid: int
    gid: int
    alive: bool = True


@dataclass
class Client:
    n: int
    proc: Proc
    sock: FakeSocket
    proto: object = None
    cred: Credentials = None
    # the model, as the server processes the client's packets
    subs: Counter = field(default_factory=Counter)
    echo: bool = True
    extensions: bool = False
    expected: int = 0  # messages that matched while subscribed (counted by the server's view)
    sent_msgs: int = 0  # messages the server's socket took for it
    sent_all: int = 0  # packets of any kind the server's socket took for it
    acked: int | None = None  # the last `server/session-ack` count the server took from it
    seq: int = 0  # its own messages published
    session: bytes | None = None
    # what the client saw
    requests: deque = field(default_factory=deque)
    got: int = 0
    read_packets: int = 0  # every packet it read
    told_dropped: int = 0
    last_seq: dict = field(default_factory=dict)
    seen: set = field(default_factory=set)
    reading: bool = True
    hung_up: bool = False
    gone: bool = False  # the server let it go
    sent_packets: int = 0  # what its socket took
    subscriptions_before: int = 0  # the server's count before its packet being processed
    processed: int = 0  # what the server handled of it
    drops_untold: int = 0  # drops before it asked for extensions (no notice tells those)
    claimed: dict = field(default_factory=dict)  # session name -> missed count the model expects
    held_asked: deque = field(default_factory=deque)  # `server/session-held` answers the model expects


KEYS = [b"a", b"a/b", b"a/b/c", b"ab/c", b"x/y", b"xy/z", b"b/1", b"b/2", b"*", b"sbus/topology/t"]
PATTERNS = [b"", b"a", b"a/", b"a/*", b"a/b", b"*", b"*/", b"x*/", b"x**/", b"**/", b"b/*", b"ab/c", b"x/y",
            b"a/b/", b"sbus/"]
SOFT = [b"queue", b"discard", b"block", b"error"]
HARD = [b"discard", b"block", b"error"]
ORDERS = [b"queue", b"stack", b"random"]


def _reply_kind(packet: bytes) -> bytes:
    return packet[5:].split(b"\0", 1)[0]


class Simulation:
    """One seeded scenario: a server, its clients, a scheduler, the invariants."""

    def __init__(self, seed: int, path: str = "pure", steps: int = 300, trace: bool = False):
        self.seed = seed
        self.path = path
        self.steps = steps
        self.rng = random.Random(seed)
        #: Draws for operations added later (`server/session-held`), from a stream of their own so
        #: that the seeds kept as tests still play the scenarios they were found with.
        self.rng_more = random.Random(seed ^ 0x5E55)
        self.rng_ack = random.Random(seed ^ 0xACC)  # (`server/session-ack`, later still)
        self.trace = [] if trace else None
        self.transcript: list = []
        #: What the server did in this step that may add holds to the interest table: packets
        #: processed, patterns a stand-in took over (invariant 10).
        self.step_packets = 0
        rng = self.rng
        self.config = ServerConfig(
            queue_bytes=rng.choice([600, 2000, 8000]), queue_packets=rng.choice([4, 16, 64]),
            max_uid_queue_bytes=rng.choice([3000, 12000]), max_queue_bytes=rng.choice([8000, 40000]),
            queue_control_bytes=rng.choice([300, 2000]), stall_timeout=rng.choice([0.5, 3.0]),
            max_subscriptions=rng.choice([6, 40]), max_uid_subscriptions=rng.choice([10, 200]),
            max_uid_connections=rng.choice([3, 8]), drain_cap=rng.choice([1, 4, 64]),
            max_session_linger=5.0, busy_poll=0.0,
        )
        self.reactor = SimReactor()
        self.kernel = Kernel()
        self.kernel.on_sent = self._sent
        self.work = WorkClock(rng.choice([1e-4, 0.02]))
        self.procs: dict[int, Proc] = {}
        self.factory = BrokerFactory(self.config, reactor=self.reactor, owners=SimOwners(self),
                                     work_clock=self.work, kernel_floor=KERNEL_MIN_SNDBUF)
        self.factory.protocol = SimBrokerProtocol
        #: Holds the interest table's build may add in one turn (invariant 10).
        self.interest_slice = self.factory.interest_slice = rng.choice([1, 3, 10_000])
        self.transport_class = SimBatchTransport if path == "batch" else SimTransport
        self.clients: list[Client] = []
        self.by_server_sock: dict[int, Client] = {}
        self.ghosts: dict[tuple, int] = {}  # (uid, session name) -> messages its stand-in counted (model)
        self.ghost_subs: dict[tuple, Counter] = {}
        self.holders: dict[tuple, Client] = {}  # (uid, session name) -> the client holding it (model)
        self.step = 0
        self._pid = 1000
        self.uids = [(0, 0), (1000, 1000), (1001, 1000), (1002, 1002)]
        self.max_payload = rng.choice([40, 300, 1500])
        #: Each uid's work budget as last seen (invariant 7: not forgotten while in debt).
        self.work_seen: dict = {}

    # -- the server's side of a connection

    def connect(self, proc: Proc, capacity: int | None = None) -> Client | None:
        """Connect `proc`; `capacity`: both sockets' receive queues (else drawn by the seed)."""
        cred = Credentials(proc.pid, proc.uid, proc.gid)
        proto = self.factory.buildProtocol(SeqPacketAddress(None, cred))
        if proto is None:
            self.note("refused", proc.pid)
            return None
        proto.sim_n = len(self.clients)
        rng = self.rng
        ours, theirs = self.kernel.pair(capacity or rng.choice([300, 3000, 1 << 20]),
                                        capacity or rng.choice([200, 1500, 20000, 1 << 20]))
        client = Client(len(self.clients), proc, theirs, proto, cred)
        observed = Observed(proto, self, client)
        cfg = self.config
        t = self.transport_class(ours, observed, self.reactor, max_packet=cfg.max_packet, drain_cap=cfg.drain_cap,
                                 queue_bytes=cfg.queue_bytes, queue_packets=cfg.queue_packets, peer=cred)
        if self.factory.smallSendBuffer(cred.uid):  # as `SeqPacketPort` does at accept
            t.keepSendBufferSmall()
        proto.makeConnection(t)
        t.startReading()
        self.clients.append(client)
        self.by_server_sock[id(ours)] = client
        self.note("connect", client.n, proc.pid, proc.uid)
        return client

    def _sent(self, sock, packet: bytes) -> None:
        client = self.by_server_sock.get(id(sock))
        if client is not None:
            client.sent_all += 1
            if packet[:4] == b"MSG ":
                client.sent_msgs += 1

    # -- the model: what the server does with each packet it processes, in its order

    def processing(self, client: Client, packet: bytes):
        """Before the server processes `packet` from `client`: a message's recipients."""
        if packet[:4] != b"MSG ":
            client.subscriptions_before = client.proto.subscriptions
            return None
        end = packet.find(b"\0", 4)
        if end < 0:
            return None
        key = packet[4:end]
        secret = key.startswith(SECRET_ROOT)
        for d in self.clients:
            if d.gone:
                continue
            if d is client and not d.echo:
                continue
            if not any(reaches(p, key) for p in d.subs):
                continue
            if secret and not (key.startswith(secret_prefix(b"", d.cred)) and d.proc.alive):
                continue
            d.expected += 1
        if not secret:
            for name, subs in self.ghost_subs.items():
                if any(reaches(p, key) for p in subs):
                    self.ghosts[name] += 1
        return None

    def processed(self, client: Client, packet: bytes) -> None:
        """After the server processed `packet` from `client`."""
        self.step_packets += 1
        kind = packet[:4]
        if kind == b"SUB " and client.proto.subscriptions > client.subscriptions_before:  # taken
            try:
                pattern = check_pattern(packet[4:], client.cred)
            except CredentialError:
                return
            client.subs[pattern] += 1
        elif packet[:6] == b"UNSUB ":
            try:
                pattern = check_pattern(packet[6:], client.cred)
            except CredentialError:
                return
            if client.subs[pattern] > 0:
                client.subs[pattern] -= 1
                if not client.subs[pattern]:
                    del client.subs[pattern]
        elif packet[:5] == b"CMSG ":
            key = packet[5:].split(b"\0", 1)[0]
            if key == codec.ECHO_OFF:
                client.echo = False
            elif key == codec.ECHO_ON:
                client.echo = True
            elif key == codec.EXTENSIONS and not client.extensions:
                client.extensions = True
                drops = client.proto.drops
                client.drops_untold = sum(drops.values()) if drops else 0  # before it asked
            elif key == codec.SESSION_HELD:
                name = packet[5 + len(key) + 1:]
                holder = self.holders.get((client.cred.uid, name))
                if not name:
                    client.held_asked.append((name, codec.HELD_REFUSED))
                elif holder is None or holder.gone:
                    client.held_asked.append((name, codec.HELD_FREE))
                else:  # closing: its peer hung up, the server has not read to its end of file
                    client.held_asked.append((name, codec.HELD_CLOSING if holder.hung_up else codec.HELD_LIVE))
            elif key == codec.SESSION_ACK:
                name, _, count = packet[5 + len(key) + 1:].partition(b"\0")
                if self.holders.get((client.cred.uid, name)) is client and count.isdigit():
                    client.acked = int(count)
            elif key == codec.SESSION:
                name = (client.cred.uid, packet[5 + len(key) + 1:].split(b"\0", 1)[0])
                holder = self.holders.get(name)
                if holder is None or holder.gone:
                    self.holders[name] = client
                if name in self.ghosts:  # claimed now: what its stand-in counted is the answer
                    client.claimed[name[1]] = self.ghosts.pop(name)
                    self.ghost_subs.pop(name, None)

    # -- the client's side

    def publish(self, c: Client):
        rng = self.rng
        key = rng.choice(KEYS)
        if rng.random() < 0.15:
            other = rng.choice(self.clients)
            key = secret_prefix(b"", other.cred) + b"k"
        c.seq += 1
        body = b"%d:%d:" % (c.n, c.seq)
        payload = body + b"." * rng.randrange(self.max_payload)
        self.send(c, b"MSG " + key + b"\0" + payload)

    def send(self, c: Client, packet: bytes) -> bool:
        try:
            c.sock.send(packet)
        except BlockingIOError:
            return False
        except OSError:
            return False
        self.note("send", c.n, packet[:60])
        c.sent_packets += 1
        return True

    def request(self, c: Client, key: bytes, payload: bytes | None = None, kind: bytes | None = None):
        packet = b"CMSG " + key + (b"\0" + payload if payload is not None else b"")
        if self.send(c, packet):
            c.requests.append(kind or key)

    def act(self, c: Client) -> None:
        rng = self.rng
        r = rng.random()
        if r < 0.30:
            for _ in range(rng.choice([1, 1, 3, 10])):
                self.publish(c)
        elif r < 0.42:
            pattern = rng.choice(PATTERNS)
            q = rng.random()
            if q < 0.12:
                pattern = secret_prefix(b"", c.cred) + rng.choice([b"", b"k", b"*"])
            elif q < 0.16:
                pattern = b"!/cred////" + rng.choice([b"", b"k"])
            elif q < 0.17:
                other = rng.choice(self.clients)
                pattern = secret_prefix(b"", other.cred)
            self.send(c, b"SUB " + pattern)
        elif r < 0.48:
            held = list(c.subs)
            pattern = rng.choice(held) if held and rng.random() < 0.8 else rng.choice(PATTERNS)
            self.send(c, b"UNSUB " + pattern)
        elif r < 0.60:
            what = rng.choice([codec.WHOAMI, codec.SERVER_ID, codec.STATS, codec.WHOAMI])
            more = self.rng_more
            if more.random() < 0.2:  # is a session held, and is its holder's peer gone?
                self.request(c, codec.SESSION_HELD, more.choice([b"s0", b"s1", b"s2", b""]))
            else:
                self.request(c, what)
        elif r < 0.68:
            key = rng.choice([b"blocking/soft/" + rng.choice(SOFT), b"blocking/hard/" + rng.choice(HARD),
                              b"order/" + rng.choice(ORDERS)])
            self.send(c, b"CMSG " + key)
        elif r < 0.71:
            self.send(c, b"CMSG " + rng.choice([codec.ECHO_OFF, codec.ECHO_ON]))
        elif r < 0.73:
            self.send(c, b"CMSG " + codec.EXTENSIONS)
        elif r < 0.745:
            self.send(c, b"CMSG " + codec.INTEREST)  # its listing is no reply: not in `requests`
        elif r < 0.76 and c.session is None:
            name = b"s%d" % rng.randrange(3)
            if self.send(c, b"CMSG " + codec.SESSION + b"\0" + name + b"\0" + b"2"):
                c.requests.append(codec.SESSION)
                c.session = name
        elif r < 0.90:
            self.read(c, rng.choice([1, 4, 100]))
        elif r < 0.93:
            c.reading = not c.reading
        elif r < 0.945:
            self.hang_up(c)
        elif r < 0.95:
            c.sock.shutdown(rng.choice([socket.SHUT_RD, socket.SHUT_WR]))
            self.note("shutdown", c.n)
        elif r < 0.955:
            c.proc.alive = False  # the process exits; a child keeps the socket
            self.note("owner exits", c.n)
        else:
            self.read(c, 1000)

    def read(self, c: Client, n: int) -> None:
        for _ in range(n):
            try:
                packet = c.sock.recv()
            except OSError:  # (BlockingIOError, ConnectionResetError among them)
                break
            if not packet:
                break
            c.read_packets += 1
            self.received(c, packet)
        more = self.rng_ack
        if c.session is not None and not c.hung_up and more.random() < 0.3:
            # It acknowledges what it read (or an older count, or more than it read, or a name
            # it does not hold): at its close the server counts what it sent past that.
            count, name = c.read_packets, c.session
            q = more.random()
            if q < 0.2:
                count = max(0, count - more.randrange(1, 5))
            elif q < 0.25:
                count += more.randrange(1, 50)
            elif q < 0.3:
                name = more.choice([b"s0", b"s1", b"s2"])
            self.send(c, codec.session_ack(name, count))

    def received(self, c: Client, packet: bytes) -> None:
        self.transcript.append((c.n, packet if packet[:4] == b"MSG " else _reply_kind(packet)))
        if packet[:4] == b"MSG ":
            end = packet.index(b"\0", 4)
            key = packet[4:end]
            if key.startswith(SECRET_ROOT) and not key.startswith(secret_prefix(b"", c.cred)):
                self.fail(5, f"client {c.n} ({c.cred}) got another's secret key {key!r}")
            n, seq, _ = packet[end + 1:].split(b":", 2)
            ident = (int(n), int(seq))
            if ident in c.seen:
                self.fail(4, f"client {c.n} got message {ident} twice")
            c.seen.add(ident)
            c.got += 1
            return
        kind = _reply_kind(packet)
        if kind == codec.DROPPED:
            c.told_dropped += codec.parse_drop_notice(packet[5 + len(kind) + 1:]).count
            return
        if kind in (codec.INTEREST, codec.DISCONNECT):
            return
        if not c.requests:
            self.fail(3, f"client {c.n} got a reply {kind!r} it did not ask for")
        want = c.requests.popleft()
        if want != kind:
            self.fail(3, f"client {c.n} got reply {kind!r} where {want!r} was due (replies out of order)")
        if kind == codec.SESSION_HELD:
            got = codec.parse_session_held(packet[5 + len(kind) + 1:])
            want = c.held_asked.popleft()
            if got != want:
                self.fail(8, f"client {c.n} asked whether session {want[0]!r} is held: told {got[1]}, "
                             f"the model says {want[1]}")
        if kind == codec.SESSION:
            reply = codec.parse_session_reply(packet[5 + len(kind) + 1:])
            name = (c.cred.uid, reply.name)
            if reply.state == "resumed":
                want_missed = c.claimed.pop(reply.name, None)
                if want_missed is not None and reply.missed != want_missed:
                    self.fail(8, f"client {c.n} resumed session {reply.name!r}: told {reply.missed} missed, "
                                 f"the model counts {want_missed}")
            elif reply.state != "new":
                c.session = None

    def hang_up(self, c: Client) -> None:
        read_first = self.rng.random() < 0.5
        if read_first:
            self.read(c, 1 << 30)
        c.sock.close()
        c.hung_up = True
        self.note("hang up", c.n, read_first)

    # -- the scheduler

    def note(self, *what):
        if self.trace is not None:
            self.trace.append((self.step,) + what)

    def fail(self, invariant: int, text: str):
        raise Violation(f"invariant {invariant}: {text} (seed {self.seed}, {self.path} path, step {self.step}; "
                        f"replay: python -m sbus.simulator --seed {self.seed} --path {self.path} "
                        f"--steps {self.steps} --trace)")

    def run(self) -> "Simulation":
        rng = self.rng
        if self.path == "batch":
            self._probe_edge()
        for _ in range(rng.randrange(2, 6)):
            self.new_client()
        for self.step in range(self.steps):
            r = rng.random()
            table = self.factory.interest
            holds = table.holds() if table is not None else 0
            self.step_packets = 0
            try:
                if r < 0.45:
                    live = [c for c in self.clients if not c.hung_up]
                    if live:
                        self.act(rng.choice(live))
                    else:
                        self.new_client()
                elif r < 0.85:
                    ready = self.reactor.ready()
                    if ready:
                        sel, ev = ready[rng.randrange(len(ready))]
                        self.reactor.serve(sel, ev)
                elif r < 0.95:
                    calls = self.reactor.getDelayedCalls()
                    if calls:
                        self.reactor.advance(max(0.0, min(c.getTime() for c in calls) - self.reactor.seconds()))
                    else:
                        self.reactor.advance(rng.choice([0.01, 0.3]))
                else:
                    self.new_client()
            except Violation:
                raise
            except Exception as e:  # invariant 6: nothing escapes the broker or the transport
                self.fail(6, f"{type(e).__name__} escaped: {e}")
            self.check()
            self._check_turn(holds)
        self.settle()
        return self

    def new_client(self) -> None:
        rng = self.rng
        live = [c for c in self.clients if not c.hung_up]
        if rng.random() < 0.3 and live:
            proc = rng.choice(live).proc  # another connection of a running process
        else:
            uid, gid = rng.choice(self.uids)
            self._pid += 1
            proc = self.procs[self._pid] = Proc(self._pid, uid, gid)
        self.connect(proc)

    def settle(self) -> None:
        """Quiescence: every live client reads everything, timers run, until nothing moves."""
        for c in self.clients:
            c.reading = True
        for round_ in range(2000):
            moved = False
            for c in self.clients:
                if not c.hung_up and (c.sock.queue or c.sock.reset):
                    self.read(c, 1 << 30)
                    moved = True
            ready = self.reactor.ready()
            for sel, ev in ready:
                try:
                    self.reactor.serve(sel, ev)
                except Exception as e:
                    self.fail(6, f"{type(e).__name__} escaped while settling: {e}")
                moved = True
            if not moved:
                calls = self.reactor.getDelayedCalls()
                if not calls:
                    break
                self.reactor.advance(max(0.0, min(c.getTime() for c in calls) - self.reactor.seconds()))
            self.check()
        self.check(final=True)

    # -- the invariants

    def check(self, final: bool = False) -> None:
        factory = self.factory
        cfg = self.config
        per_uid = Counter()
        slack = Counter()
        total = 0
        for c in self.clients:
            proto = c.proto
            if final and proto.reason == "closed" and c.processed != c.sent_packets:
                # nothing a publisher's socket took is lost uncounted (it was not cut off)
                self.fail(2, f"client {c.n}: sent {c.sent_packets} packets, the server handled {c.processed} "
                             f"({'gone' if c.gone else 'connected'})")
            if c.gone:
                continue
            out = proto.outbox
            n_ctl, ctl_bytes = out.controls()
            msg_bytes = out.nbytes - ctl_bytes
            if out.ctl_bytes != ctl_bytes or msg_bytes < 0:
                self.fail(1, f"client {c.n}: queue accounting says {out.ctl_bytes} control bytes of {out.nbytes}, "
                             f"{ctl_bytes} are queued")
            if msg_bytes > cfg.queue_bytes and len(out) - n_ctl > 1:  # (one goes alone)
                self.fail(1, f"client {c.n}: {msg_bytes} message bytes queued over its cap of {cfg.queue_bytes} "
                             f"({out.soft}/{out.hard}/{out.order})")
            # A uid's and the server's caps: passed at most by the read batch each queue had
            # taken before its socket refused (docs/protocol.md, "The exact slack of the caps").
            batch = max(cfg.queue_bytes // 2, self.max_payload + 64)
            per_uid[c.cred.uid] += msg_bytes
            slack[c.cred.uid] += batch
            total += msg_bytes
            if out.closed:
                continue  # going (its peer is gone, or it is cut off): what it held is lost with it
            # conservation: matched = received by its socket + counted as dropped + still queued
            drops = sum(proto.drops.values()) if proto.drops else 0
            queued = len(out) - n_ctl + len(out.waiting or ())
            if c.expected != c.sent_msgs + drops + queued:
                self.fail(2, f"client {c.n}: {c.expected} messages matched, {c.sent_msgs} sent + {drops} dropped "
                             f"+ {queued} queued")
            if c.extensions and final and not c.hung_up and c.told_dropped + proto.dropped != drops - c.drops_untold:
                self.fail(2, f"client {c.n}: drop notices say {c.told_dropped} (+{proto.dropped} untold), "
                             f"the server counted {drops}")
            if final and not c.hung_up and c.requests and proto.transport.connected:
                    self.fail(3, f"client {c.n}: {len(c.requests)} requests never answered ({list(c.requests)[:3]})")
        lingering = {(g.uid, g.name) for g in factory.sessions.lingering()}
        for name in [n for n in self.ghosts if n not in lingering]:  # expired
            del self.ghosts[name]
            self.ghost_subs.pop(name, None)
        for uid, queued in per_uid.items():
            if queued > cfg.max_uid_queue_bytes + slack[uid]:
                self.fail(1, f"uid {uid}: {queued} message bytes queued over its cap of {cfg.max_uid_queue_bytes} "
                             f"and the slack of {slack[uid]}")
        if total > cfg.max_queue_bytes + sum(slack.values()):
            self.fail(1, f"server: {total} message bytes queued over its cap of {cfg.max_queue_bytes}")
        for uid, user in factory.users.items():
            if user.queue.used < 0:
                self.fail(1, f"uid {uid}: negative queued bytes {user.queue.used}")
        if factory.queue_budget.used < 0:
            self.fail(1, f"server: negative queued bytes {factory.queue_budget.used}")
        self._check_kernel_reserved()
        self._check_budgets()

    def _probe_edge(self) -> None:
        """The one part of the batch path the fake kernel replaces: the accelerator's two calls.
        Handed a descriptor number no kernel gives (past a C int), they must refuse it, never
        act on a truncated one (issue 32 fault 10: `recv_batch(2**40)` read fd 0). Invariant 6."""
        accel = speedups.load()
        if accel is None:
            return
        for fd in (2 ** 32 + 1, 2 ** 40):
            for name, call in (("recv_batch", lambda: accel.recv_batch(fd, 1, 64)),
                               ("send_batch", lambda: accel.send_batch(fd, [b"x"]))):
                try:
                    call()
                except (OverflowError, ValueError):
                    continue
                except OSError as e:
                    self.fail(6, f"the accelerator's {name} took descriptor {fd} to the kernel as another "
                                 f"number ({e.strerror})")
                self.fail(6, f"the accelerator's {name} acted on descriptor {fd}, which no kernel gave")

    def _check_turn(self, holds: int) -> None:
        """Invariant 10: one turn adds at most `interest_slice` holds to the interest table
        beyond what its packets subscribed (fault 8: the first watcher's build, over every
        pattern of every client, ran in one turn and stopped the bus)."""
        table = self.factory.interest
        if table is None:
            return
        added = table.holds() - holds
        if added > self.interest_slice + self.step_packets:
            self.fail(10, f"one turn put {added} holds into the interest table (slice "
                          f"{self.interest_slice}, {self.step_packets} packets or patterns taken over)")

    def _check_kernel_reserved(self) -> None:
        """Invariant 1, the kernel's part (issue 33.7): each live connection's send buffer is
        reserved from its uid's budget, within the cap but for one big packet; what a
        uid has reserved is exactly its live connections' buffers (a gone one gave its back)."""
        reserved = Counter()
        live = Counter()
        for c in self.clients:
            proto = c.proto
            if c.gone:   # (the server's `clientGone` ran: `left`)
                continue
            charge = proto.transport.sendBufferCharge()
            reserved[c.cred.uid] += charge
            live[c.cred.uid] += 1
            held = proto.transport.unreadBytes()
            if charge and held > charge:
                self.fail(1, f"client {c.n}: {held} bytes unread in the kernel, {charge} reserved for it")
        cap = self.config.max_uid_queue_bytes
        for uid, n in reserved.items():
            # (the cap, and one big packet sent through a raised buffer: a connection for which not
            # even the kernel's minimum fits is refused)
            if n > cap + self.config.max_packet:
                self.fail(1, f"uid {uid}: {n} kernel bytes reserved for {live[uid]} connections over its cap of {cap}")
        for uid, user in self.factory.users.items():
            if user.kernel != reserved.get(uid, 0):
                self.fail(1, f"uid {uid}: {user.kernel} kernel bytes reserved, its live connections' "
                             f"buffers are {reserved.get(uid, 0)} (one that went kept its reservation?)")
            if user.queue.used < user.kernel:
                self.fail(1, f"uid {uid}: {user.kernel} kernel bytes reserved, its budget holds {user.queue.used}")
            if not 0 <= user.grown <= user.kernel:
                self.fail(1, f"uid {uid}: {user.grown} bytes of big packets charged, {user.kernel} reserved in all")

    def _check_budgets(self) -> None:
        now = self.reactor.seconds()
        seen = self.work_seen
        for uid, user in self.factory.users.items():
            seen[uid] = user.work
        for uid, work in list(seen.items()):
            user = self.factory.users.get(uid)
            if user is None or user.work is not work:
                if work.owed(now) > 0:
                    self.fail(7, f"uid {uid}'s work budget, {work.owed(now):.3f} s in debt, was forgotten "
                                 f"(its last connection closed)")
                del seen[uid]

    def left(self, c: Client) -> None:
        """`c`'s connection is gone at the server: what it missed goes to its session's stand-in."""
        c.gone = True
        self.note("gone", c.n)
        self.step_packets += len(c.subs)  # a stand-in takes its patterns over (invariant 10)
        if c.session is not None and self.holders.get((c.cred.uid, c.session)) is c:
            # (a claim whose answer, busy, was never read leaves `c.session` set: the stand-in
            # is its holder's, found by seed 1068361570750)
            name = (c.cred.uid, c.session)
            ghost = self.factory.sessions.lingering()
            standing = [g for g in ghost if (g.uid, g.name) == name]
            if standing:
                drops = sum(c.proto.drops.values()) if c.proto.drops else 0
                self.ghosts[name] = c.expected - c.sent_msgs - drops
                if c.acked is not None:  # what it read past its last word counts too
                    self.ghosts[name] += max(0, c.sent_all - c.acked)
                self.ghost_subs[name] = Counter({p: n for p, n in c.subs.items() if not p.startswith(SECRET_ROOT)})


class Observed:
    """The protocol as the transport sees it, telling the model each packet in the server's
    order (before and after the real protocol handles it); everything else is the protocol's."""

    def __init__(self, proto, sim: Simulation, client: Client):
        self.__dict__.update(_p=proto, _sim=sim, _c=client)

    def packetReceived(self, packet):
        sim, c = self._sim, self._c
        c.processed += 1
        sim.processing(c, packet)
        result = self._p.packetReceived(packet)
        sim.processed(c, packet)
        return result

    def packetsReceived(self, packets, start):
        end = self._p.packetsReceived(packets, start)
        self._c.processed += end - start
        for packet in packets[start:end]:
            self._sim.processing(self._c, packet)
        return end

    def connectionLost(self, reason=None):
        self._p.connectionLost(reason)
        self._sim.left(self._c)

    def __getattr__(self, name):
        return getattr(self._p, name)


def run(seeds, path: str, steps: int, budget: float | None = None, out=sys.stdout) -> tuple[int, int, list]:
    """Run `seeds` on `path` until done or `budget` seconds; (scenarios, steps, failures)."""
    counts, failures = run_paths(seeds, [path], steps, budget, out)
    return counts[path][0], counts[path][1], failures


def run_paths(seeds, paths, steps: int, budget: float | None = None, out=sys.stdout) -> tuple[dict, list]:
    """Run each seed on every path of `paths` until done or `budget` seconds a path; with two
    paths, a seed whose transcripts differ fails invariant 9. ({path: [scenarios, steps]},
    failures)."""
    start = time.monotonic()
    counts = {path: [0, 0] for path in paths}
    failures = []
    for seed in seeds:
        if budget is not None and time.monotonic() - start > budget * len(paths):
            break
        seen = []
        for path in paths:
            sim = Simulation(seed, path, steps)
            try:
                sim.run()
            except Violation as e:
                failures.append((seed, str(e)))
                print(f"FAIL {e}", file=out)
            counts[path][0] += 1
            counts[path][1] += sim.step + 1
            seen.append((path, sim))
        if len(seen) == 2 and not any(f[0] == seed for f in failures):
            text = _differ(seen[0][1], seen[1][1])
            if text is not None:
                failures.append((seed, text))
                print(f"FAIL {text}", file=out)
    return counts, failures


def _differ(a: Simulation, b: Simulation) -> str | None:
    """Invariant 9: the same seed on both paths, one transcript; None, or where they part."""
    if a.transcript == b.transcript and a.rng.getstate() == b.rng.getstate() and a.step == b.step:
        return None
    i = next((i for i, (x, y) in enumerate(zip(a.transcript, b.transcript)) if x != y),
             min(len(a.transcript), len(b.transcript)))
    what = (f"packet {i} read: {a.path} {a.transcript[i:i + 1]!r}, {b.path} {b.transcript[i:i + 1]!r}"
            if a.transcript != b.transcript else "the scheduler's choices")
    return (f"invariant 9: the two paths part at {what} (seed {a.seed}; replay: python -m sbus.simulator "
            f"--seed {a.seed} --steps {a.steps} --trace)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sbus.simulator", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, action="append",
                   help="a seed to run (again for more; with --trace, one: print its steps)")
    p.add_argument("--seeds", default="0:200", help="a range START:END of seeds (default 0:200)")
    p.add_argument("--random-start", action="store_true", help="start the range at a random seed (printed)")
    p.add_argument("--path", choices=["pure", "batch", "both"], default="both")
    p.add_argument("--steps", type=int, default=300, help="steps per scenario (default 300)")
    p.add_argument("--budget", type=float, help="stop after this many seconds per path")
    p.add_argument("--trace", action="store_true", help="print the scenario's steps (with --seed)")
    args = p.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0":
        # Sets of keys iterate by their hashes: one hash seed for every run, or a seed would not
        # replay in another process.
        os.execve(sys.executable, [sys.executable, "-m", "sbus.simulator"] + list(sys.argv[1:] if argv is None else argv),
                  dict(os.environ, PYTHONHASHSEED="0"))
    if args.trace and args.seed is not None and len(args.seed) > 1:
        p.error("--trace prints the steps of one --seed")
    if args.seed is not None:
        seeds = args.seed
    else:
        try:
            a, b = (int(x) for x in args.seeds.split(":"))
        except ValueError:
            p.error(f"--seeds: not START:END: {args.seeds!r}")
        if args.random_start:
            a, b = (lambda s: (s, s + b - a))(random.SystemRandom().randrange(1 << 40))
        seeds = range(a, b)
    paths = ["pure", "batch"] if args.path == "both" else [args.path]
    failed = False
    if args.trace and args.seed is not None:
        sims, (seed,) = [], args.seed
        for path in paths:
            sim = Simulation(seed, path, args.steps, trace=True)
            try:
                sim.run()
                print(f"seed {seed} ({path}): no invariant broke")
            except Violation as e:
                print(f"FAIL {e}")
                failed = True
            for row in sim.trace[-200:]:
                print(*row)
            sims.append(sim)
        if len(sims) == 2 and (text := _differ(*sims)) is not None:
            print(f"FAIL {text}")
            failed = True
        return 1 if failed else 0
    t0 = time.monotonic()
    counts, failures = run_paths(seeds, paths, args.steps, args.budget)
    first = seeds[0] if len(seeds) else 0
    elapsed = time.monotonic() - t0
    for path in paths:
        n, steps = counts[path]
        which = (", ".join(map(str, seeds[:n])) if args.seed is not None else f"{first}..{first + n - 1}")
        print(f"simulator ({path} path): {n} scenarios, {steps} steps, seeds {which}, "
              f"{sum(1 for f in failures if f'{path} path' in f[1] or 'invariant 9' in f[1])} failed, "
              f"{elapsed:.1f} s for {' and '.join(paths)}")
    if len(paths) == 2:
        print(f"simulator: both paths gave one transcript for {counts[paths[1]][0] - sum(1 for f in failures if 'invariant 9' in f[1])} "
              f"of {counts[paths[1]][0]} seeds (invariant 9)")
    failed = bool(failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
