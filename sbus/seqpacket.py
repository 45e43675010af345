"""SOCK_SEQPACKET for Twisted: a listening port and a connected transport.

Twisted has no SEQPACKET support and its stream transports join writes, so
this is a small transport of our own on the public reactor API
(`addReader`/`addWriter`). Each `write` is one packet and one `send`
(SEQPACKET sends are all or nothing); each wakeup reads several packets,
up to a cap, so one busy client cannot starve the others; oversized packets
are detected with MSG_TRUNC, never silently cut.

Shared by the server (`sbus.server`), the Twisted client and the services;
it imports nothing from `sbus.server`.

Closing peers: Linux reports ``ECONNRESET`` on the next ``recv`` when the
peer closed with packets of ours still unread, *before* the packets it sent
us; so a read error is not the end: packets are read until ``recv`` returns
end of file. Likewise a failed ``send`` (the peer is gone) stops output but
not input: what the peer sent before it went is read and delivered first.

The transport only moves bytes. What it sends comes from one queue
(`sbus.core.flood.Outbox`, given by the protocol with `useQueue` or its own):
`flush` sends from its front until it is empty or the socket is full, and
when the socket refuses with packets left it tells the queue (`refused`),
through the protocol's `sendRefused` if it has one, where the flood policy
decides. After each wakeup's reads it calls the protocol's `readBatchDone`
(if it has one): the server flushes there what the batch routed. A batch
accelerator (`BatchSeqPacketTransport`: recvmmsg and sendmmsg) changes how
many system calls that takes, never what is sent.
"""

from __future__ import annotations

import errno
import fcntl
import select
import socket
import struct
import termios

from twisted.internet import error, interfaces, main
from twisted.logger import Logger
from twisted.python import failure
from zope.interface import implementer

from sbus import speedups
from sbus.address import peer_credentials, size_buffers
from sbus.core.credentials import Credentials
from sbus.core.flood import Outbox
from sbus.core.limits import DEFAULT_DRAIN_CAP, DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_PACKETS, MAX_PACKET
from sbus.interfaces import ILeanReactor, IPacketTransport

log = Logger()

_MSG_TRUNC = socket.MSG_TRUNC
#: Never SIGPIPE, whatever the embedding program did with the signal: a gone peer is EPIPE.
_NOSIGNAL = socket.MSG_NOSIGNAL
#: A send error that concerns the packet, not the connection: drop that packet, keep the peer.
_PACKET_ERRORS = (errno.EMSGSIZE,)
#: After a failed send, at most this many packets still waiting from the peer are read.
_DRAIN_AFTER_SEND_FAILURE = 1 << 16
_ACCEPT_CAP = 64
#: SO_SNDBUF of every connection the server accepts (the kernel doubles it: 128 KiB): what one
#: client that never reads can pin in the server's kernel send queue, about twice this. It is
#: raised only to send one packet that does not fit, and set back at once (`_sendGrown`): sized
#: to the packet limit, 400 connections of one uid that never read pinned 453 MiB (issue 33.7).
#: Not smaller: at 16 KiB a 1 -> 1 stream of 4 KiB messages lost up to half its rate
#: (docs/performance.md "Kernel send buffers").
SERVER_SNDBUF = 64 << 10
#: SO_SNDBUF of a connection whose uid has no room left for SERVER_SNDBUF in its budget (the
#: kernel raises it to its minimum, about 4.5 KiB counted): what is reserved then (issue 33.7).
SERVER_SNDBUF_LEAST = 2048


def kernel_send_floor() -> int:
    """The smallest send buffer this kernel gives a socket, as it counts it (SERVER_SNDBUF_LEAST
    asked: SOCK_MIN_SNDBUF, 4,608 bytes on x86-64): what each connection pins at least."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SERVER_SNDBUF_LEAST)
        return a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)


_ACCEPT_ERRORS_BACKOFF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

_buffers: dict[int, memoryview] = {}

#: Linux 6.5+: a pidfd for the process that connected (not in Python 3.11's socket module).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


def receive_buffer(size: int) -> memoryview:
    """One buffer per size for the whole process: the reactor reads one socket at a time."""
    buf = _buffers.get(size)
    if buf is None:
        buf = _buffers[size] = memoryview(bytearray(size))
    return buf


@implementer(interfaces.IAddress)
class SeqPacketAddress:
    """The peer of a connection: its socket name and its credentials."""

    __slots__ = ("name", "cred")

    def __init__(self, name, cred: Credentials | None = None):
        self.name = name
        self.cred = cred

    def __repr__(self):
        if self.cred:
            return f"<SeqPacketAddress pid={self.cred.pid} uid={self.cred.uid} gid={self.cred.gid}>"
        return f"<SeqPacketAddress {self.name!r}>"


@implementer(
    interfaces.IReadWriteDescriptor,
    interfaces.ITransport,
    interfaces.IPushProducer,
    interfaces.IConsumer,
    IPacketTransport,
)
class SeqPacketTransport:
    """A connected SOCK_SEQPACKET socket driving one protocol."""

    __slots__ = (
        "socket", "protocol", "reactor", "peer", "outbox", "max_packet", "drain_cap",
        "connected", "disconnecting", "_fd", "_reading", "_writing",
        "_buf", "_producer", "_producerPaused", "_streaming", "_host", "packets_in", "packets_out",
        "bytes_out", "packets_unsendable", "_aborted", "_closing", "_batchDone", "_sendRefused",
        "_drainLeft", "_drainReason", "_paused", "_sndbuf", "_grown", "_stash", "_many", "__weakref__",
    )

    def __init__(self, sock, protocol, reactor, *, max_packet, drain_cap=DEFAULT_DRAIN_CAP,
                 queue_bytes=DEFAULT_QUEUE_BYTES, queue_packets=DEFAULT_QUEUE_PACKETS, peer=None):
        sock.setblocking(False)
        size_buffers(sock, max_packet)
        self.socket = sock
        self._fd = sock.fileno()
        self.protocol = protocol
        self.reactor = reactor
        self.peer = peer
        self.outbox = Outbox(queue_bytes, queue_packets)
        self.max_packet = max_packet
        self.drain_cap = drain_cap
        self.connected = True
        self.disconnecting = False
        self._reading = self._writing = False
        # MSG_TRUNC makes recv_into report a bigger packet's real size, so one spare byte is not needed.
        self._buf = receive_buffer(max_packet)
        self._producer = None
        self._producerPaused = False
        self._streaming = True
        self._host = None
        #: Packets handed to the protocol (end of file not counted): what a session's holder
        #: acknowledges (`server/session-ack`), as the peer's `packets_out` counts them.
        self.packets_in = 0
        self.packets_out = 0
        self.bytes_out = 0
        #: Packets dropped because the kernel refused them (EMSGSIZE), not because the peer left.
        self.packets_unsendable = 0
        #: Whether the protocol has the optional hooks (looked up once; a flag, not a bound method,
        #: which would cost every idle connection 64 bytes): after a wakeup's reads
        #: (`readBatchDone`); when the socket refuses (`sendRefused`).
        self._batchDone = hasattr(protocol, "readBatchDone")
        self._sendRefused = hasattr(protocol, "sendRefused")
        #: After a failed send: how many more packets the peer may still have us read.
        self._drainLeft = 0
        #: A drain held paused (the protocol's flood control): why the connection ends after it.
        self._drainReason = None
        #: Paused as a producer (`pauseProducing`): the protocol holds it.
        self._paused = False
        self._aborted = False
        #: The delayed call that will finish the connection (abort, failed send), if any.
        self._closing = None
        #: The send buffer as the kernel counts it (twice SO_SNDBUF, at least its floor) while kept
        #: small (`keepSendBufferSmall`): what a bigger packet's send raises for a moment, and what
        #: the server reserves for it (`sendBufferCharge`); 0: not kept small.
        self._sndbuf = 0
        #: What the kernel counts for the one big packet `_sendGrown` sent through the small
        #: buffer, charged to the peer's uid (`sendBufferCharged`) until the peer has read it; 0: none.
        self._grown = 0
        #: The rest of a read batch, held back while the protocol holds this peer (`_route`).
        self._stash = None
        #: The protocol takes a run of packets at once (`packetsReceived`).
        self._many = hasattr(protocol, "packetsReceived")

    def keepSendBufferSmall(self, size: int = SERVER_SNDBUF) -> None:
        """Keep this socket's SO_SNDBUF at `size` (the server's side of every connection): a
        peer that does not read then pins about twice that of kernel memory, not twice the
        packet limit. A packet too big for it is still sent whole (`_sendGrown`)."""
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            self._sndbuf = self.socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        except OSError:
            return

    def sendBufferCharge(self) -> int:
        """What this socket may hold in the kernel, as the kernel counts it: what the server
        reserves for it from its uid's budget (issue 33.7). Twice its buffer (itself twice
        SO_SNDBUF): Linux takes a packet while the buffer is not full, and a packet that fits is
        at most the buffer's size, so one may reach past it. Plus a big packet sent whole and not
        read yet (`_sendGrown`). The same after the socket is closed (given back then); 0: not
        kept small."""
        return 2 * self._sndbuf + self._grown

    def _sendGrown(self, packet: bytes, exc: OSError) -> bool | None:
        """The kernel refused `packet` (EMSGSIZE). On a socket kept small, raise SO_SNDBUF to fit
        it, send it, and set it back: the kernel then holds it and takes nothing more until the
        peer has read it. Raised only while the peer reads: while more than a quarter of the small
        buffer is still unread (where the kernel stops calling it writable), the packet waits as
        for a full socket, so a peer that does not read pins at most one big packet; and only if
        the protocol lets it (`mayGrowSendBuffer`: the peer's uid has room for it, issue 33.7),
        which charges what the kernel counts for it (`sendBufferCharged`) until the peer has read
        it, and else wakes this transport (`startWriting`) when it may try again. True: sent, or
        dropped as unsendable (`_unsendable`); False: wait to write; None: the send failed, the
        peer is gone (`_sendFailed`)."""
        if self._sndbuf and len(packet) <= self.max_packet:
            sock = self.socket
            unread = self.unreadBytes()
            if unread * 4 > self._sndbuf:  # (writable at a quarter of what the kernel counts)
                self.startWriting()
                return False
            if self._grown:  # the last big packet has been read
                self._grownRead()
            protocol = self.protocol
            may = getattr(protocol, "mayGrowSendBuffer", None)
            if may is not None and not may(len(packet)):
                self.stopWriting()  # (writable, but its uid has no room: woken when it may have)
                return False
            size_buffers(sock, len(packet))
            try:
                sock.send(packet, _NOSIGNAL)
            except BlockingIOError:
                self.startWriting()
                return False
            except OSError as e:
                exc = e
            else:
                self.packets_out += 1
                self.bytes_out += len(packet)
                if may is not None:
                    self._grown = max(self.unreadBytes() - unread, len(packet))
                    protocol.sendBufferCharged(self._grown)
                    self.startWriting()  # writable again once the peer has read it: given back then
                return True
            finally:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._sndbuf // 2)
            if exc.errno not in _PACKET_ERRORS:
                self._sendFailed(exc)
                return None
        self._unsendable(packet, exc)
        return True

    def _grownRead(self) -> None:
        """The peer has read the big packet `_sendGrown` sent: give its charge back."""
        grown, self._grown = self._grown, 0
        self.protocol.sendBufferCharged(-grown)

    def unreadBytes(self) -> int:
        """Bytes this socket has sent that the peer has not read yet, as the kernel counts them
        (SIOCOUTQ: the packets' memory, not their length). The simulator's kernel answers it."""
        try:
            return struct.unpack("i", fcntl.ioctl(self._fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    def peerClosed(self) -> bool:
        """Has the peer closed its end (the kernel reports a hang-up), while what it sent may
        still wait unread? Asked by `server/session-held`, never on the hot path."""
        try:
            poller = select.poll()
            poller.register(self._fd, 0)  # (POLLHUP is always reported)
            return any(ev & select.POLLHUP for _, ev in poller.poll(0))
        except (OSError, ValueError):
            return False

    # -- startup / descriptors

    def startReading(self):
        if not self._reading and self.connected:
            self._reading = True
            self.reactor.addReader(self)

    def stopReading(self):
        if self._reading:
            self._reading = False
            self.reactor.removeReader(self)

    def startWriting(self):
        if not self._writing and self.connected:
            self._writing = True
            self.reactor.addWriter(self)

    def stopWriting(self):
        if self._writing:
            self._writing = False
            self.reactor.removeWriter(self)

    def fileno(self):
        return self._fd

    def logPrefix(self):
        return self.protocol.__class__.__name__

    # -- reading

    def doRead(self):
        """One wakeup's worth: up to `drain_cap` packets read at once (`recvBatch`) and handed
        to the protocol one by one, then its `readBatchDone`. None, or why the connection ended.

        If the protocol pauses this transport in the middle of a batch (flood control holds
        this publisher), the rest of the batch waits here unrouted (`_stash`), as unread packets
        wait in the kernel, and is handed over first when reading resumes. Both I/O paths read
        this way, one system call or many, so they leave the kernel and the server in the same
        state: the simulator checks that they give one transcript for a seed."""
        if self._stash is not None:
            stash, self._stash = self._stash, None
            why = self._route(stash)
            if why is not None or not self._reading or self._stash is not None:
                # Held again in it (and perhaps released at its end): the rest of it goes
                # first, at the next read; a new batch now would overtake and replace it.
                return why
        for _ in range(2):
            try:
                packets = self.recvBatch(self.drain_cap)
            except (InterruptedError, ConnectionResetError):
                # The peer closed with our packets unread: Linux says so (once) before handing
                # us the packets it sent. Read on.
                continue
            except OSError:
                return main.CONNECTION_LOST
            if not packets:
                return None
            return self._route(packets)
        return None

    # -- the kernel's edge: one call each (the accelerator and the simulator's fake kernel
    # answer these instead)

    def recvBatch(self, count: int) -> list:
        """Up to `count` waiting packets (bytes; an int for one over the size limit, its size;
        b"" for end of file, last); [] when none waits. Raises OSError, as recvmmsg does, only
        when it read nothing."""
        recv_into = self.socket.recv_into
        buf = self._buf
        limit = self.max_packet
        out = []
        while len(out) < count:
            try:
                n = recv_into(buf, limit, _MSG_TRUNC)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError:
                if out:
                    break  # recvmmsg returns what it read; a lasting error comes again
                raise
            if n == 0:
                # A zero-length packet reads exactly like end of file: the peer closed.
                out.append(b"")
                break
            out.append(buf[:n].tobytes() if n <= limit else n)
        return out

    def _route(self, packets: list):
        """Hand `packets` to the protocol until it pauses this transport (the rest: `_stash`)."""
        protocol = self.protocol
        deliver = protocol.packetReceived
        # A protocol that takes several at once (`packetsReceived`) is offered the rest after a
        # packet for which `packetReceived` returned True (the broker: a run is open).
        many = protocol.packetsReceived if self._many else None
        why = None
        i = 0
        n = len(packets)
        while i < n:
            packet = packets[i]
            i += 1
            if packet.__class__ is int:
                protocol.packetTooLarge(packet)
            elif not packet:
                # A zero-length packet reads exactly like end of file: the peer closed. Nothing
                # after it is read (`connectionLost` finishes at once, no drain).
                why = main.CONNECTION_DONE
                self.disconnecting = True
                break
            elif deliver(packet) is True and many is not None and i < n and self._reading:
                i = many(packets, i)  # it said it takes more at once: offer it the rest
            if not self._reading and (self._paused or self._aborted or not self._drainLeft):
                if i < n and self.connected and not self._aborted:
                    self._stash = packets[i:]  # paused: the rest waits, as unread packets do
                break
        self.packets_in += i if why is None else i - 1
        if self._batchDone:
            protocol.readBatchDone()
        return why

    # -- writing

    def useQueue(self, outbox) -> None:
        """Send from `outbox` (the protocol's one queue for this peer) from now on."""
        self.outbox = outbox

    def flush(self) -> bool:
        """Send from the front of the queue until it is empty (True) or the socket is full
        (False: writing goes on when it is writable; the caller tells the queue, `refused`)."""
        outbox = self.outbox
        send = self.socket.send
        while outbox.nbytes:
            packet = outbox.peek()
            try:
                send(packet, _NOSIGNAL)
            except BlockingIOError:
                self.startWriting()
                return False
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno not in _PACKET_ERRORS:
                    self._sendFailed(e)
                    return True
                sent = self._sendGrown(packet, e)
                if sent is None:
                    return True
                if not sent:  # (it waits for the socket or for its uid's room: `_sendGrown`)
                    return False
                outbox.pop()
                continue
            outbox.pop()
            self.packets_out += 1
            self.bytes_out += len(packet)
        return True

    def _refused(self) -> None:
        """The socket is full with packets nobody judged yet: let the queue (through the
        protocol, if it keeps one with a policy) decide about what it did not take."""
        if not self.outbox.blocked:
            if self._sendRefused:
                self.protocol.sendRefused()
            else:
                self.outbox.refused()

    def sendLast(self, packet: bytes) -> None:
        """Send now, ahead of anything queued, if the socket takes it (the connection is closing)."""
        if self.connected:
            try:
                self.socket.send(packet, _NOSIGNAL)
            except OSError:
                return
            self.packets_out += 1
            self.bytes_out += len(packet)

    def queued(self) -> int:
        return len(self.outbox)

    def queuedBytes(self) -> int:
        return self.outbox.nbytes

    def hasRoom(self) -> bool:
        """Is the queue under its limits (and its uid's and the server's)?"""
        return not self.outbox.full()

    def peerPidfd(self) -> int:
        """A new pidfd (the caller closes it) of the process that connected: SO_PEERPIDFD, Linux
        6.5+, always that process whenever asked. Raises OSError (ENOPROTOOPT: older kernels)."""
        return self.socket.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)

    def enqueue(self, packet: bytes) -> None:
        self.outbox.push(packet)
        self.startWriting()
        producer = self._producer
        if producer is not None and not self._producerPaused and self.outbox.nbytes > self.outbox.max_bytes:
            self._producerPaused = True
            producer.pauseProducing()

    def write(self, packet: bytes) -> None:
        """ITransport.write: one packet; queued, never dropped, if it cannot go now."""
        if not packet:
            raise ValueError("an empty SEQPACKET packet reads as end of file; refusing to send one")
        if not self.connected or self.disconnecting:
            return
        if not self.outbox.nbytes:  # nothing queued before it (no packet is empty): try now
            try:
                self.socket.send(packet, _NOSIGNAL)
            except BlockingIOError:
                pass
            except OSError as e:
                if e.errno in _PACKET_ERRORS:
                    self._unsendable(packet, e)
                else:
                    self._sendFailed(e)
                return
            else:
                self.packets_out += 1
                self.bytes_out += len(packet)
                if self._producer is not None and not self._streaming:
                    self.startWriting()  # a pull producer is asked for more from doWrite
                return
        self.enqueue(packet)

    def writeSequence(self, seq):
        """The items of `seq` form ONE packet (SEQPACKET has no streams to join them into)."""
        self.write(b"".join(seq))

    def doWrite(self):
        """Send queued packets until the kernel says EAGAIN or the queue is empty."""
        if self._grown and self.unreadBytes() * 4 <= self._sndbuf:
            self._grownRead()  # (writable again: the peer has read the big packet)
        if not self.flush():
            self._refused()
            return None
        self.outbox.writable()
        if not self._grown:  # (else watched until the peer has read it)
            self.stopWriting()
        if self.disconnecting:
            if self._closing is not None or self._drainReason is not None:
                return None  # a failed send (or an abort) finishes it, after reading what is left
            return main.CONNECTION_DONE if self.connected else None
        producer = self._producer
        if producer is not None and (self._producerPaused or not self._streaming):
            self._producerPaused = False
            producer.resumeProducing()
            if not self.connected:
                return None
        drained = getattr(self.protocol, "outboxDrained", None)
        if drained is not None:
            drained()
        return None

    def _unsendable(self, packet: bytes, exc: OSError) -> None:
        """The kernel refused this packet (EMSGSIZE: bigger than our SO_SNDBUF allows). It is the
        packet's fault, not the peer's: drop it, keep the connection, say so once."""
        self.packets_unsendable += 1
        hook = getattr(self.protocol, "packetUnsendable", None)
        if hook is not None:
            hook(packet, exc)
        elif self.packets_unsendable == 1:
            log.warn("{who}: dropped a {n}-byte packet the kernel refuses to send ({err}); "
                     "the socket buffer is too small for the packet size limit",
                     who=self.logPrefix(), n=len(packet), err=exc.strerror)

    def _sendFailed(self, exc):
        """The peer is gone (EPIPE, ECONNRESET, ...): stop sending, but first read and deliver
        what it sent before it went (it is in our receive queue already), then finish the
        connection, from the reactor rather than from inside a routing loop."""
        if self.connected and not self.disconnecting:
            self.disconnecting = True
            self.outbox.clear()
            self.stopWriting()
            self._drainLeft = _DRAIN_AFTER_SEND_FAILURE
            self._closing = self.reactor.callLater(
                0, self._drainThenLose, failure.Failure(error.ConnectionLost(str(exc))))

    def _drainThenLose(self, reason):
        """Read what the gone peer sent, `drain_cap` packets per reactor turn (others get theirs
        in between), at most `_DRAIN_AFTER_SEND_FAILURE` in all: a peer that only shut its
        reading side and keeps sending is cut off there. While the protocol holds it paused
        (flood control), what is left waits in the kernel, as for a live peer, and the drain
        goes on when it is resumed (`resumeProducing`)."""
        self._closing = None
        if not self.connected:
            return
        drained = getattr(self.protocol, "outboxDrained", None)
        if drained is not None:
            # Its queue is gone for good (cleared at the failed send): what waited for it to
            # drain (publishers it held, itself among them) must not wait for ever.
            drained()
        if self._paused and not self._aborted:
            self._drainReason = reason  # held: `resumeProducing` goes on
            return
        got, done = self._drainSome(min(self.drain_cap, self._drainLeft))
        self._drainLeft -= got
        if not self.connected or self._aborted:
            return
        if self._paused:
            self._drainReason = reason  # held by what it just sent
            return
        if not done and self._drainLeft > 0:
            self._closing = self.reactor.callLater(0, self._drainThenLose, reason)
            return
        self.stopReading()
        self._lose(reason)

    def _drainSome(self, count: int) -> tuple[int, bool]:
        """After a failed send: the rest of a held-back batch first (it was read before
        anything still in the kernel), then up to `count` packets, stopping where the protocol
        pauses this transport: (how many, whether the peer has nothing more)."""
        stash, self._stash = self._stash, None
        packets = stash if stash is not None else []
        for _ in range(2):  # ECONNRESET comes once, before what the peer sent: read again
            if len(packets) >= count:
                break
            try:
                packets += self.recvBatch(count - len(packets))
                break
            except (InterruptedError, ConnectionResetError):
                continue
            except OSError:
                if packets:
                    self._route(packets)
                return len(packets), True
        if not packets:
            return 0, True
        self._route(packets)
        # Done at end of file, unless held in the middle: the rest (with its end) waits.
        return len(packets), self._stash is None and not packets[-1] and packets[-1].__class__ is bytes

    # -- closing

    def loseConnection(self, _reason=None):
        """Close after everything queued has been sent."""
        if not self.connected or self.disconnecting:
            return
        self.disconnecting = True
        self.stopReading()
        self.startWriting()

    def abortConnection(self):
        """Close now, throwing away anything queued."""
        if not self.connected or self._aborted:
            return
        self._aborted = True
        self.disconnecting = True
        self._stash = None
        self.outbox.clear()
        self.stopReading()
        self.stopWriting()
        closing = self._closing
        if closing is not None and closing.active():
            closing.cancel()
        self._closing = self.reactor.callLater(0, self._lose, failure.Failure(error.ConnectionAborted()))

    def _lose(self, reason):
        self._closing = None
        if self.connected:
            self._finish(reason)

    def readConnectionLost(self, reason):
        self._finish(reason)

    def connectionLost(self, reason):
        """The reactor says the connection is gone. What the peer sent before it went may still
        wait in our receive queue, as after a failed send, and is read first (`_sendFailed`,
        when the hold ends if it is held by flood control): the hang-up may have been seen while
        we were not reading (held, or writing only) and reach us after the hold ended, in the
        same turn; the rest of a batch held back (`_stash`) goes first. (Found by the simulator:
        a hold ending between the reactor's poll and its hand-over lost what was unread.)"""
        if self.connected and not self.disconnecting:
            self._sendFailed(reason.value if isinstance(reason, failure.Failure) else reason)
            return
        self._finish(reason)

    def _finish(self, reason):
        if not self.connected:
            return
        self._stash = None
        closing, self._closing = self._closing, None
        if closing is not None and closing.active():
            closing.cancel()
        self.stopReading()
        self.stopWriting()
        self.connected = False
        self.outbox.clear()
        try:
            self.socket.close()
        except OSError:
            pass
        self._fd = -1
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.stopProducing()
        if self._grown:  # (the kernel freed it with the socket)
            self._grownRead()
        self.protocol.connectionLost(reason)

    # -- ITransport odds and ends

    def getPeer(self):
        return SeqPacketAddress(self._peerName(), self.peer)

    def getHost(self):
        if self._host is None:
            self._host = SeqPacketAddress(self.socket.getsockname())
        return self._host

    def _peerName(self):
        try:
            return self.socket.getpeername()
        except OSError:
            return None

    # -- IPushProducer: pausing stops reading, which back-pressures the peer

    def pauseProducing(self):
        """Stop reading. A peer that hangs up meanwhile is noticed when reading resumes: what it
        sent waits in the kernel, where it waited before, not in anyone's queue (a held
        publisher that goes away must not grow the queue that held it past its limits)."""
        if self.connected:
            self._paused = True
            self.stopReading()

    def resumeProducing(self):
        self._paused = False
        if not self.connected or self._aborted:
            return
        if not self.disconnecting:
            self.startReading()
            if self._stash is not None:
                # The socket may have nothing more to read, so the reactor would not call doRead.
                self.reactor.callLater(0, self._resumed)
        elif self._drainReason is not None:  # a drain after a failed send, held: go on
            reason, self._drainReason = self._drainReason, None
            if self._closing is None:
                self._closing = self.reactor.callLater(0, self._drainThenLose, reason)

    def _resumed(self):
        if self._reading and self.connected and self._stash is not None:
            stash, self._stash = self._stash, None
            why = self._route(stash)
            if why is not None:
                self._finish(failure.Failure(why))

    def stopProducing(self):
        self.loseConnection()

    # -- IConsumer

    def registerProducer(self, producer, streaming):
        if self._producer is not None:
            raise RuntimeError(f"cannot register producer {producer!r}: {self._producer!r} is registered")
        if not self.connected:
            producer.stopProducing()
            return
        self._producer = producer
        self._producerPaused = False
        self._streaming = bool(streaming)
        if not streaming:
            # A pull producer writes once per resumeProducing: doWrite asks again each time
            # the queue is empty, as long as it stays registered.
            self.startWriting()

    def unregisterProducer(self):
        self._producer = None
        self._streaming = True


@implementer(interfaces.IListeningPort, interfaces.IReadDescriptor)
class SeqPacketPort:
    """Accepts SEQPACKET connections on a bound socket and hands them to a factory.

    The factory's `buildProtocol(addr)` sees the peer's credentials as
    `addr.cred`; returning None refuses the connection. Closing the port never
    unlinks a socket file: whoever bound the path owns it.
    """

    def __init__(self, sock: socket.socket, factory, reactor=None, *, max_packet: int | None = None,
                 drain_cap: int | None = None, queue_bytes: int | None = None, queue_packets: int | None = None,
                 busy_poll: float | None = None):
        if reactor is None:
            from twisted.internet import reactor
        self.socket = sock
        self.factory = factory
        self.reactor = reactor
        self.connected = False
        self._backoff = None
        self._fd = sock.fileno()
        # Per-connection settings: explicit ones win, else the factory's ServerConfig, else defaults.
        cfg = getattr(factory, "config", None)
        self._settings = {
            name: value if value is not None else getattr(cfg, name, default)
            for name, value, default in (
                ("max_packet", max_packet, MAX_PACKET), ("drain_cap", drain_cap, DEFAULT_DRAIN_CAP),
                ("queue_bytes", queue_bytes, DEFAULT_QUEUE_BYTES),
                ("queue_packets", queue_packets, DEFAULT_QUEUE_PACKETS),
            )
        }
        #: Seconds the reactor may poll before sleeping (`sbus.reactor`); the factory's config's.
        self._busyPoll = busy_poll if busy_poll is not None else getattr(cfg, "busy_poll", 0.0)
        self._held = False

    def startListening(self):
        sock = self.socket
        sock.setblocking(False)
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.listen(socket.SOMAXCONN)
        if ILeanReactor.providedBy(self.reactor):  # sbus.reactor: lean dispatch, busy polling
            self.reactor.serve(ServerTransport if ServerTransport is not SeqPacketTransport else None,
                               self._busyPoll)
        self.factory.doStart()
        self.connected = True
        if not self._held:
            self.reactor.addReader(self)

    def pauseProducing(self):
        """Stop accepting: connections wait in the kernel's backlog, as connected as before (a
        service that does not know yet whom it admits holds them rather than refusing them)."""
        self._held = True
        if self.connected:
            self.reactor.removeReader(self)

    def resumeProducing(self):
        self._held = False
        if self.connected and self._backoff is None:
            self.reactor.addReader(self)

    def stopListening(self):
        from twisted.internet import defer

        if self.connected:
            self.connected = False
            self.reactor.removeReader(self)
            if self._backoff is not None and self._backoff.active():
                self._backoff.cancel()
            self.socket.close()
            self._fd = -1
            self.factory.doStop()
        return defer.succeed(None)

    loseConnection = stopListening

    def connectionLost(self, reason):
        self.stopListening()

    def fileno(self):
        return self._fd

    def logPrefix(self):
        return "SeqPacketPort"

    def getHost(self):
        return SeqPacketAddress(self.socket.getsockname())

    def doRead(self):
        for _ in range(_ACCEPT_CAP):
            try:
                conn, name = self.socket.accept()
            except BlockingIOError:
                return None
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in _ACCEPT_ERRORS_BACKOFF:
                    self._pauseAccepting(e)
                    return None
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                log.error("accept failed: {err}", err=e)
                return None
            try:
                cred = peer_credentials(conn)
            except OSError as e:
                log.warn("refused a connection: cannot read its credentials ({err})", err=e)
                conn.close()
                continue
            self._connect(conn, name, cred)
        return None

    def _connect(self, conn, name, cred) -> None:
        """Give one accepted socket its protocol and transport. An exception here costs that
        one connection (logged, closed), never the listener (as twisted's tcp.Port does)."""
        transport = None
        try:
            protocol = self.factory.buildProtocol(SeqPacketAddress(name, cred))
            if protocol is None:
                conn.close()
                return
            transport = ServerTransport(conn, protocol, self.reactor, peer=cred, **self._settings)
            small = getattr(self.factory, "smallSendBuffer", None)
            if small is None or small(cred.uid):
                transport.keepSendBufferSmall()
            protocol.makeConnection(transport)
            transport.startReading()
        except Exception:
            log.failure("could not set up the connection of pid {pid} uid {uid}; closed it, still listening",
                        pid=cred.pid, uid=cred.uid)
            if transport is not None and transport.connected:
                try:  # let the protocol forget what it set up; it failed once, stay quiet
                    transport.readConnectionLost(failure.Failure(error.ConnectionAborted()))
                except Exception:
                    transport.stopReading()
                    transport.stopWriting()
            conn.close()

    def _pauseAccepting(self, exc):
        """Out of descriptors or memory: stop accepting for a moment instead of spinning."""
        self.reactor.removeReader(self)
        log.warn("accept failed ({err}); not accepting for 0.5 s", err=exc.strerror)

        def resume():
            self._backoff = None
            if self.connected and not self._held:
                self.reactor.addReader(self)

        self._backoff = self.reactor.callLater(0.5, resume)


def connectSeqPacket(reactor, address, protocol, *, max_packet: int = MAX_PACKET,
                     drain_cap: int = DEFAULT_DRAIN_CAP, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                     queue_packets: int = DEFAULT_QUEUE_PACKETS) -> SeqPacketTransport:
    """Connect `protocol` to the SEQPACKET socket at `address` (a path, or bytes
    starting with NUL for an abstract name); the client side of the same transport.

    Unix-domain connects finish at once or fail at once (a full backlog gives
    EAGAIN, reported like a refusal), so this is synchronous and raises OSError.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        size_buffers(sock, max_packet)
        sock.setblocking(False)
        sock.connect(address)
        peer = peer_credentials(sock)
    except BaseException:
        sock.close()
        raise
    transport = SeqPacketTransport(
        sock, protocol, reactor, max_packet=max_packet, drain_cap=drain_cap,
        queue_bytes=queue_bytes, queue_packets=queue_packets, peer=peer,
    )
    protocol.makeConnection(transport)
    transport.startReading()
    return transport


# -- batch I/O (the accelerator): recvmmsg/sendmmsg through sbus._speedups ----------------------
#
# The server side reads a publisher's waiting packets with one recvmmsg, routes them all, and
# sends each recipient its share with one sendmmsg when the batch is done (docs/performance.md).
# Clients see no difference: per publisher, packets reach each subscriber in the order sent;
# what a subscriber's socket does not take goes through the broker's flood control exactly as a
# refused send does on the pure path. SBUS_PURE_PYTHON=1 (or no compiler at install) keeps the
# pure-Python transport above.


_speedups = speedups.load()
#: True when the server's connections use batch I/O (the C extension is there and not disabled).
BATCH_IO = _speedups is not None


class BatchSeqPacketTransport(SeqPacketTransport):
    """The server's transport with batch receive and batch send; nothing else differs.

    `recvBatch` is one recvmmsg, and `flush` sends from the queue with sendmmsg, `drain_cap`
    packets a call, when it drains front to back: fewer system calls, the same packets, the
    same kernel state after each call (reading and holding back are the base class's)."""

    __slots__ = ()

    def flush(self) -> bool:
        outbox = self.outbox
        cap = self.drain_cap
        while outbox.nbytes:
            batch = outbox.head(cap)
            if batch is None:  # another order: one packet at a time
                return SeqPacketTransport.flush(self)
            try:
                n = self.sendBatch(batch)
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in _PACKET_ERRORS:  # the first packet's fault (EMSGSIZE): too big for now
                    sent = self._sendGrown(batch[0], e)
                    if sent is None:
                        return True
                    if not sent:  # (it waits for the socket or for its uid's room: `_sendGrown`)
                        return False
                    outbox.pop()  # sent with a bigger buffer, or dropped
                    continue
                self._sendFailed(e)
                return True
            if n == 0:  # EAGAIN: the socket is full
                self.startWriting()
                return False
            self.packets_out += n
            self.bytes_out += outbox.sent(n)
        return True

    def recvBatch(self, count: int) -> list:
        return _speedups.recv_batch(self._fd, count, self.max_packet)

    def sendBatch(self, batch: list) -> int:
        """Send the packets of `batch` from the first; how many the socket took (0: full)."""
        return _speedups.send_batch(self._fd, batch)


#: The class the server's port uses for the connections it accepts.
ServerTransport = BatchSeqPacketTransport if BATCH_IO else SeqPacketTransport
