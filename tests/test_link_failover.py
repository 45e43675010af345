"""Link failover through real processes, over every transport a link runs on (issue 23).

The kill-and-count scenarios of sbus-link, each run over TCP with the shared key, over TLS with
client certificates and over a unix stream socket (`transport`): a publisher sends numbered
messages at a steady rate (`test_failover.run_flow`), a link process is killed with
``kill -9`` mid-flow (placed by an event: the far subscriber got message K), and the far
subscriber's count plus what the links counted as lost must equal what was sent.

A restarted half claims a ``server/session`` on its bus (docs/deploy.md): what its bus
published while it was dead is counted by its successor as ``lost["restart"]``.
"""

from __future__ import annotations

import fcntl
import json
import operator
import re
import signal
import socket
import ssl
import struct
import subprocess
import termios
import threading
import uuid

import pytest

from helpers import SERVICE_TIMEOUT, child_env, connect, msg, recv, send, sub, sync, wait_until
from test_lossless import HARD_BLOCK
from test_failover import (AFTER_KILL, DONE_TIMEOUT, LINK_TAKEOVER, WATCHING, Receiver, far_subscriber,
                           marker_across, run_flow, service_stats)
from test_link import FramedPeer, pki  # noqa: F401  (fixture)
from test_topology_services import TWISTD, settled, services  # noqa: F401  (fixture)

from sbus.client.blocking import connect as sbus_connect

TRANSPORTS = ["key", "tls", "unix"]
RESUMED = re.compile(r"resumed session .*?: (\d+) message\(s\).*gap ([0-9.]+) s")


def free_port() -> int:
    """A loopback port nobody listens on now (a restarted listening half must find it again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TransportLink:
    """The two processes of one link over `transport` ("key": loopback TCP with a shared key,
    "tls": TLS with client certificates, "unix": a unix stream socket): `listen` on bus a,
    `connect` on bus b. `restart(half)` starts a half again with the same arguments (the
    listening one on the same port or path)."""

    def __init__(self, services, tmp_path, transport: str, a: str, b: str, pki=None, *extra,
                 start=("listen", "connect")):
        self.services, self.transport = services, transport
        common = ["--initial-delay", "0.05", "--max-delay", "0.5", "--stats-interval", "1", *extra]
        if transport == "key":
            key = tmp_path / "link.key"
            if not key.exists():
                key.write_text(uuid.uuid4().hex * 2)
                key.chmod(0o600)
            common += ["--key-file", str(key)]
            port = free_port()
            listen, connect = f"tcp:{port}:interface=127.0.0.1", f"tcp:host=127.0.0.1:port={port}"
        elif transport == "tls":
            (server_cert, server_key), (client_cert, client_key) = pki["server"], pki["client"]
            port = free_port()
            listen = (f"ssl:{port}:interface=127.0.0.1:privateKey={server_key}:certKey={server_cert}"
                      f":caCertsDir={pki['cadir']}")
            connect = (f"ssl:host=127.0.0.1:port={port}:caCertsDir={pki['cadir']}:hostname=localhost"
                       f":certKey={client_cert}:privateKey={client_key}")
        else:
            path = tmp_path / f"link-{uuid.uuid4().hex[:6]}.sock"
            listen = connect = f"unix:{path}"
        self.port, self.path = (None, str(path)) if transport == "unix" else (port, None)
        self.argv = {"listen": ["--bus", a, "--listen", listen, *common],
                     "connect": ["--bus", b, "--connect", connect, *common]}
        self.listen = self.connect = None
        for half in start:
            self.restart(half)

    @property
    def halves(self):
        return [self.listen, self.connect]

    def start(self, half: str):
        return self.services("sbus-link", *self.argv[half])

    def restart(self, half: str):
        new = self.start(half)
        setattr(self, half, new)
        if half == "listen":
            new.wait_log("listening on")
        return new

    def forwarding(self) -> bool:
        return all(h.state() == "forwarding" for h in self.halves)


def lost_on(*addresses) -> dict[str, int]:
    """The links' `lost` counters on these buses, summed by reason."""
    total: dict[str, int] = {}
    for address in addresses:
        for st in service_stats(address, "sbus-link"):
            for reason, count in st["stats"]["lost"].items():
                total[reason] = total.get(reason, 0) + count
    return total


def in_order(name, received, n) -> None:
    assert all(x < y for x, y in zip(received, received[1:])), f"{name}: duplicated or out of order"


def restart_after(link: TransportLink, half: str, pub, messages: int = 400):
    """kill -9 the `half` of `link`, let `messages` more be published (0.2 s at the flow's
    rate), and start it again: the new process."""
    getattr(link, half).proc.kill()
    dead_at = pub.sent
    wait_until(lambda: pub.sent >= dead_at + messages, f"{messages} more published", DONE_TIMEOUT)
    return link.restart(half)


def lossy_flow(pub_address: str, far_address: str, victim, after: int = AFTER_KILL) -> tuple[int, int]:
    """`run_flow` where `victim` may lose messages: (sent, received), nothing twice, in order.
    The last message must be published after the victim's last successor carries (else it is
    lost in a gap, counted, and never arrives)."""
    got = {}

    def check(name, received, n):
        in_order(name, received, n)
        got.update(n=n, received=len(received))

    run_flow(pub_address, {"far": far_address}, victim, 1000, after=after, check=check)
    return got["n"], got["received"]


#: Either half over the key transport, one half each over the others (CI's time: each run is a
#: flow of several seconds).
PARALLEL = [("key", "listen"), ("key", "connect"), ("tls", "connect"), ("unix", "listen")]


@pytest.mark.parametrize("transport,half", PARALLEL)
def test_parallel_links_kill_a_half_of_the_forwarding_one_loses_nothing(start_bus, services, tmp_path,
                                                                        pki, transport, half):  # noqa: F811
    """kill -9 of either process of the forwarding link, with a publisher on each bus: the
    standing-by half of the other link forwards what the dead path had not delivered, both
    ways, and nothing twice."""
    a, b = start_bus(), start_bus()
    links = [TransportLink(services, tmp_path, transport, a.address, b.address, pki) for _ in range(2)]
    settled([h for link in links for h in link.halves], forwarding=3)
    for h in links[0].halves + links[1].halves:
        h.wait_log(WATCHING)
    active = next(link for link in links if link.forwarding())
    standby = next(link for link in links if link is not active)
    run_flow(a.address, {"b": b.address}, getattr(active, half), 1000, after=6000,
             also=(b.address, {"a": a.address}))
    takeovers = [[int(x) for x in found] for h in standby.halves for found in LINK_TAKEOVER.findall(h.log())]
    print(f"{transport}: the standby link's takeovers (published, gap): {takeovers}")
    assert takeovers and all(gap == 0 for _, gap in takeovers), takeovers
    st = [s["stats"] for s in service_stats(a.address, "sbus-link") + service_stats(b.address, "sbus-link")]
    assert sum(s["standby"]["replayed_at_takeover"]["from_remote"] for s in st) == sum(n for n, _ in takeovers)
    assert all("failover_gap" not in s["lost"] for s in st), [s["lost"] for s in st]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_single_link_kill_of_the_connecting_side_counts_what_it_held(start_bus, services, tmp_path, pki,
                                                                     transport):  # noqa: F811
    """The connecting side is stopped (its peer keeps sending until the connection's buffers are
    full) and killed: what the listening side sent that was never published is counted as lost
    (``in_flight``, from the peer's acknowledgements), and what it read afterwards as
    ``peer_down``: sent = received + lost (within 1 %)."""
    a, b = start_bus(), start_bus()
    link = TransportLink(services, tmp_path, transport, a.address, b.address, pki)
    settled(link.halves, forwarding=2)
    kill_at, n = 1000, 8000

    def stop_fill_kill(pub):
        link.connect.proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: pub.sent >= kill_at + 2000, "2,000 more published", DONE_TIMEOUT)
        link.connect.proc.kill()

    got, counted = {}, {}

    def read_all():
        (st,) = service_stats(a.address, "sbus-link")
        counted.update(st["stats"]["lost"])
        return st["stats"]["to_remote"] + st["stats"]["drops"].get("peer_down", 0) >= n

    def check(name, received, total):
        wait_until(read_all, "the listening side read all", DONE_TIMEOUT)
        in_order(name, received, total)
        got[name] = len(received)

    run_flow(a.address, {"b": b.address}, stop_fill_kill, kill_at, after=n - kill_at, check=check,
             wait_all=False)
    print(f"{transport}: sent {n}, received {got['b']}, counted lost {counted}")
    assert abs(n - got["b"] - sum(counted.values())) <= n // 100, \
        f"sent {n} != received {got['b']} + lost {counted} (+-1%)"


RESTARTS = [("key", "connect"), ("key", "listen"), ("tls", "connect"), ("tls", "listen"), ("unix", "connect")]


@pytest.mark.parametrize("transport,half", RESTARTS)
def test_single_link_half_killed_and_restarted_counts_what_its_bus_published_meanwhile(
        start_bus, services, tmp_path, pki, transport, half):  # noqa: F811
    """The issue's row: kill -9 of one half of a single link, its own bus keeps publishing, a new
    process is started 400 messages (0.2 s) later. What the dead half's bus published while it
    was dead is counted by the successor (its bus session: ``lost["restart"]``, with the gap in
    one log line); what the other half had sent and the dead one never published is
    ``in_flight``, what it read with no peer ``peer_down``: sent = received + lost (within 1 %),
    nothing twice, in order."""
    a, b = start_bus(), start_bus()
    link = TransportLink(services, tmp_path, transport, a.address, b.address, pki)
    settled(link.halves, forwarding=2)
    own, far = (b, a) if half == "connect" else (a, b)
    new = {}

    def kill_restart(pub):
        new["half"] = restart_after(link, half, pub)
        settled(link.halves, forwarding=2, timeout=DONE_TIMEOUT)

    n, received = lossy_flow(own.address, far.address, kill_restart)
    lost = lost_on(a.address, b.address)
    print(f"{transport}/{half}: sent {n}, received {received}, counted lost {lost}")
    assert abs(n - received - sum(lost.values())) <= n // 100, \
        f"sent {n} != received {received} + lost {lost} (+-1%)"
    found = RESUMED.search(new["half"].wait_log(RESUMED))   # one line says it, with the gap
    assert lost.get("restart", 0) == int(found.group(1)) > 0, (lost, found.group(0))
    assert float(found.group(2)) > 0


# ---------------------------------------------------------------- attacks


def tls_context(pki, cert="client") -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=f"{pki['cadir']}/ca.pem")
    ctx.load_cert_chain(*pki[cert])
    return ctx


def reset(sock: socket.socket) -> None:
    """Close as a killed process's kernel does with data unread: a TCP reset."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def peer_socket(link: TransportLink, pki, tmp_path) -> socket.socket:
    """A hand-made link peer connected to `link`'s listening half, past its transport's
    authentication (TLS handshake, shared key, or nothing more for unix)."""
    if link.transport == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(link.path)
        return sock
    if link.transport == "key":
        return FramedPeer(link.port, str(tmp_path / "link.key")).sock
    sock = tls_context(pki).wrap_socket(socket.create_connection(("127.0.0.1", link.port), timeout=DONE_TIMEOUT),
                                        server_hostname="localhost")
    return sock


def unsent(sock: socket.socket) -> int:
    """Bytes in the socket's send queue the other end has not acknowledged (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def frame(packet: bytes) -> bytes:
    return struct.pack(">I", len(packet)) + packet


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_peer_that_closes_with_data_unread_has_all_it_sent_published(start_bus, services, tmp_path, pki,
                                                                       transport):  # noqa: F811
    """A peer streams messages and is reset (killed) with the link's frames unread, while the link
    is still behind (stopped, then continued): every message that reached this host is published,
    once. The code before lost what it had not read yet at its next write to the dead peer (the
    reactor drops the connection on the write error, unread data with it)."""
    bus = start_bus()
    link = TransportLink(services, tmp_path, transport, bus.address, bus.address, pki, "--no-spanning-tree",
                         start=("listen",))
    watcher = connect(bus.address, big=True)
    send(watcher, HARD_BLOCK, sub(b"u/"))
    sync(watcher)
    peer = peer_socket(link, pki, tmp_path)
    hello = {"version": 1, "whoami": None, "max_packet": 65536, "ack": True, "patterns": ["u/"]}
    peer.sendall(frame(b"CMSG link/hello\0" + json.dumps(hello).encode()))
    link.listen.wait_log("link up")

    def stream(first: int, n: int) -> list[int]:
        peer.sendall(b"".join(frame(msg(b"u/%d" % i, b"x" * 100)) for i in range(first, first + n)))
        return list(range(first, first + n))

    def published(n: int) -> list[int]:
        got = []
        try:
            while len(got) < n:
                p = recv(watcher, SERVICE_TIMEOUT)
                if p.startswith(b"MSG u/"):
                    got.append(int(p[6:p.index(b"\0")]))
        except TimeoutError:
            pass
        return got

    sent = stream(0, 30000)      # the link's receive window grows to take what follows at once
    assert published(len(sent)) == sent
    link.listen.proc.send_signal(signal.SIGSTOP)
    if transport == "unix":      # queued at the receiver at once: no more than its socket takes
        sent = stream(30000, 1200)
    else:
        sent = stream(30000, 3000)
        # all of it reached the link's kernel (what a reset discards from our own send queue
        # never arrives: the sender's to count)
        wait_until(lambda: unsent(peer) == 0, "the peer's send queue empty", DONE_TIMEOUT)
    reset(peer)
    link.listen.proc.send_signal(signal.SIGCONT)
    got = published(len(sent))
    assert got == sent, f"{transport}: {len(got)} of {len(sent)} published after the reset"
    link.listen.wait_log(re.compile(r"link to .* down"))
    assert sync(watcher) == []


def half_handshake(port: int, pki) -> None:
    """A TLS client killed mid-handshake: its ClientHello sent, the server's first flight read,
    then a reset (the kernel of a killed process, with data unread)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = tls_context(pki).wrap_bio(incoming, outgoing, server_hostname="localhost")
    sock = socket.create_connection(("127.0.0.1", port), timeout=DONE_TIMEOUT)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    sock.sendall(outgoing.read())
    assert sock.recv(65536)[:1] == b"\x16", "no TLS handshake record from the server"
    reset(sock)


def test_tls_handshakes_cut_by_a_kill_on_either_side_then_the_link_carries(start_bus, services, tmp_path,
                                                                            pki):  # noqa: F811
    """kill -9 in the middle of a TLS handshake, on either side: the connecting half, whose
    server vanished after reading its ClientHello, retries; the listening half, whose client
    vanished after reading its answer, forgets it (one line each, nothing counted); then the
    link comes up and carries every message once, in order."""
    a, b = start_bus(), start_bus()
    link = TransportLink(services, tmp_path, "tls", a.address, b.address, pki, start=())
    with socket.create_server(("127.0.0.1", link.port)) as stand_in:
        stand_in.settimeout(DONE_TIMEOUT)
        link.restart("connect")
        conn, _ = stand_in.accept()
        conn.settimeout(DONE_TIMEOUT)
        assert conn.recv(5)[:1] == b"\x16", "no ClientHello"
        reset(conn)
    link.connect.wait_log("closed before the link was up")
    link.restart("listen")
    half_handshake(link.port, pki)
    link.listen.wait_log("closed before the link was up")
    settled(link.halves, forwarding=2, timeout=DONE_TIMEOUT)
    run_flow(a.address, {"b": b.address}, lambda pub: None, 500, after=1500, also=(b.address, {"a": a.address}))
    for h in link.halves:
        assert "Traceback" not in h.log() and "Unhandled" not in h.log(), h.log()[-2000:]
    assert lost_on(a.address, b.address) == {}


def last_stats(service) -> dict:
    """The last statistics line a link process logged (its stop line, once it stopped)."""
    return json.loads(service.log().rsplit("sbus-link stats: ", 1)[1].splitlines()[0])


#: Messages published after the first kill of `test_two_kills_in_a_row_each_gap_is_counted` (12 s):
#: two kill-restart-carry cycles fit in them on a loaded 2-core machine, where each took 3 to 4 s
#: (a process start, the spanning tree's forward delay, a stats line), with seconds to spare.
TWO_KILLS_AFTER = 24000


@pytest.mark.parametrize("transport", ["key", "tls"])
def test_two_kills_in_a_row_each_gap_is_counted(start_bus, services, tmp_path, pki, transport):  # noqa: F811
    """The connecting half killed, restarted 0.2 s later, and its successor killed as soon as it
    carries (and logged its resume and a stats line), restarted 0.2 s later again: each successor
    counts its own gap, the second one the second gap only. sent = received + counted (the live
    processes' stats, the dead successor's last stats line) within 1 %."""
    a, b = start_bus(), start_bus()
    link = TransportLink(services, tmp_path, transport, a.address, b.address, pki)
    settled(link.halves, forwarding=2)
    successors = []

    def kill_twice(pub):
        for _ in range(2):
            new = restart_after(link, "connect", pub)
            settled(link.halves, forwarding=2, timeout=DONE_TIMEOUT)
            new.wait_log(RESUMED)
            new.wait_log("sbus-link stats: ", count=new.log().count("sbus-link stats: ") + 1)
            successors.append(new)
            # the flow's tail must be carried by the last successor: a tail published while a
            # half is dead is counted (restart) and never arrives, and the test would wait for it
            assert pub.sent < pub.n - 400, (f"the flow ended (published {pub.sent} of {pub.n}) before "
                                            f"successor {len(successors)} carried: raise TWO_KILLS_AFTER")

    n, received = lossy_flow(b.address, a.address, kill_twice, after=TWO_KILLS_AFTER)
    lost = lost_on(a.address, b.address)
    for reason, count in last_stats(successors[0])["lost"].items():
        lost[reason] = lost.get(reason, 0) + count
    gaps = [int(RESUMED.search(s.log()).group(1)) for s in successors]
    print(f"{transport}: sent {n}, received {received}, counted lost {lost}; gaps {gaps}")
    assert all(g >= 400 for g in gaps), gaps
    assert lost["restart"] == sum(gaps), (lost, gaps)
    assert abs(n - received - sum(lost.values())) <= n // 100, \
        f"sent {n} != received {received} + lost {lost} (+-1%)"


#: The burst after the takeover, 1 KiB each: more than bus a's server holds for the far subscriber
#: and the listening half holds for bus a (4 MiB each), so the old connecting half held its own
#: 1 MiB (~1,000) unsent and more in its socket; now it holds at most `link.MAX_UNACKED`
#: unacknowledged.
HELD_BURST, HELD_PAYLOAD = 20000, b"x" * 1000


class BulkPublisher(threading.Thread):
    """Publishes ``PREFIX<i>`` (1 KiB payload) for i < n as fast as the bus takes them; a held
    publisher waits in `publish`."""

    def __init__(self, address, prefix: bytes, n: int):
        super().__init__(daemon=True)
        self.client, self.prefix, self.n = sbus_connect(address), prefix, n
        self.sent, self.error = 0, None

    def run(self):
        try:
            for i in range(self.n):
                self.client.publish(self.prefix + b"%d" % i, HELD_PAYLOAD)
                self.sent += 1
        except Exception as e:  # noqa: BLE001
            self.error = e

    def held(self, still: list) -> bool:
        """True once `sent` stayed the same over three polls (`still` keeps them): the bus holds
        the publisher, everything between it and the far subscriber is full."""
        still.append(self.sent)
        return self.sent < self.n and len(still) >= 3 and len(set(still[-3:])) == 1


def test_killed_right_after_its_takeover_what_it_held_for_its_peer_is_counted(start_bus, services,
                                                                               tmp_path):  # noqa: F811
    """Attack: the connecting half killed once, its successor killed (-9) right after it took over,
    while bus a's far subscriber does not read (hard block): everything between is full. The old
    half read its bus until 1 MiB waited for its peer; the kill lost that with nobody counting it
    (its in_flight count died with it, its session counted only what bus b still held). Now it
    stops reading its bus at `MAX_UNACKED` unacknowledged: the rest waits in bus b's server,
    whose session counts it for the next successor."""
    a, b = start_bus(), start_bus()
    prefix = b"f/held/"
    far = far_subscriber(a.address, prefix)
    link = TransportLink(services, tmp_path, "key", a.address, b.address)
    settled(link.halves, forwarding=2)
    link.connect.wait_log("holding session")
    dead = [link.connect]
    dead[0].proc.kill()
    dead.append(link.restart("connect"))
    settled(link.halves, forwarding=2, timeout=DONE_TIMEOUT)
    dead[1].wait_log(RESUMED)
    pub = BulkPublisher(b.address, prefix, HELD_BURST)
    pub.start()
    still: list[int] = []
    wait_until(lambda: pub.held(still), "the publisher held by bus b", DONE_TIMEOUT, interval=0.5)
    dead[1].proc.kill()
    receiver = Receiver(far, prefix)
    receiver.start()
    pub.join(DONE_TIMEOUT)
    assert pub.error is None and pub.sent == HELD_BURST, (pub.error, pub.sent)
    last = link.restart("connect")
    last.wait_log(RESUMED)
    settled(link.halves, forwarding=2, timeout=DONE_TIMEOUT)
    got = marker_across(b.address, prefix, HELD_BURST, receiver)
    in_order("far", got, HELD_BURST)
    lost = lost_on(a.address, b.address)
    for reason, count in last_stats(dead[1])["lost"].items():
        lost[reason] = lost.get(reason, 0) + count
    uncounted = HELD_BURST - len(got) - sum(lost.values())
    print(f"sent {HELD_BURST}, received {len(got)}, counted lost {lost}, uncounted {uncounted}")
    # left: bus b's socket buffer toward the dead half (the kernel's, 256-384 measured); the old
    # half lost its own 1 MiB and more besides (5,952)
    assert uncounted <= HELD_BURST // 40, f"{uncounted} lost and counted by nobody"


def test_a_restarted_half_of_a_standing_by_link_counts_its_gap_as_carried_not_lost(start_bus, services,
                                                                                   tmp_path):  # noqa: F811
    """Two parallel links; the standing-by one's connecting half is killed and restarted while
    its bus publishes: the active link delivers everything, and the successor, told by its peer
    that the link stood by when the old process died, does not count the gap as lost."""
    a, b = start_bus(), start_bus()
    links = [TransportLink(services, tmp_path, "key", a.address, b.address) for _ in range(2)]
    settled([h for link in links for h in link.halves], forwarding=3)
    standby = next(link for link in links if not link.forwarding())
    new = {}

    def kill_restart(pub):
        new["half"] = restart_after(standby, "connect", pub)
        new["half"].wait_log("went another way (not lost)", timeout=DONE_TIMEOUT)

    run_flow(b.address, {"a": a.address}, kill_restart, 1000)
    found = RESUMED.search(new["half"].log())
    (st,) = [s["stats"] for s in service_stats(b.address, "sbus-link")
             if s["stats"]["session"]["restart_standing_by"]]
    assert st["session"]["restart_standing_by"] == int(found.group(1)) >= 400, (st["session"], found.group(0))
    assert "restart" not in lost_on(a.address, b.address)


def answer_syncs_until(peer: FramedPeer, last) -> None:
    """Read the link's frames, answering each ``link/sync`` as its peer half does, up to and
    including the first frame for which `last(frame)` is true."""
    while True:
        frame = peer.recv()
        if frame.startswith(b"CMSG link/sync\0"):
            peer.send(b"CMSG link/synced\0" + frame.split(b"\0", 1)[1])
        if last(frame):
            return


@pytest.mark.parametrize("active_goes_on", [True, False], ids=["active goes on", "active stops"])
def test_what_the_other_path_delivered_before_a_new_peer_s_hello_is_not_replayed(start_bus, services, tmp_path,
                                                                                active_goes_on):  # noqa: F811
    """The race of a restarted half of a standing-by link (a loaded CI run: 9,005 received of
    9,000, 5 duplicated, 1 out of order; 15 of 9,000 in a loaded rerun): the restarted half
    (here a hand-made peer) streams messages it read from its bus just after the link came up,
    whose copies by the active path this half read before the peer's hello, unwatched. Its
    window kept them as undelivered and published them again when the link took over (the
    restarted half's new node id had moved the tree onto this link). What a new peer streams
    before it answers the window's first `link/sync` waits apart: at the takeover, only what
    follows the last of it the active path delivered is published (it delivers in order)."""
    bus = start_bus()
    link = TransportLink(services, tmp_path, "key", bus.address, bus.address, None, "--no-spanning-tree",
                         start=("listen",))
    spy = connect(bus.address)
    send(spy, sub(b"x/"))
    sync(spy)
    active_path = connect(bus.address)   # another path's copies, published on the link's bus

    def delivered(i: int) -> None:
        send(active_path, msg(b"x/%d" % i, b"%d" % i))
        sync(active_path)

    peer = FramedPeer(link.port, str(tmp_path / "link.key"))   # connected, no hello yet
    delivered(0)
    (st,) = [s["stats"] for s in service_stats(bus.address, "sbus-link")]   # asked after x/0: read
    assert st["drops"] == {"peer_down": 1}, st["drops"]
    hello = {"version": 1, "whoami": None, "max_packet": 65536, "ack": True, "patterns": ["x/"]}
    peer.send(b"CMSG link/hello\0" + json.dumps(hello).encode())
    peer.send(b'CMSG link/state\0{"forwarding": false}')
    peer.send(b"CMSG link/seen\0x/0\x000")     # read from its bus a moment after the link came up
    peer.send(b"CMSG link/sync\0standing-by")
    asked = []                                   # the link's own link/sync requests, answered later
    while (frame := peer.recv()) != b"CMSG link/synced\0standing-by":
        if frame.startswith(b"CMSG link/sync\0"):
            asked.append(frame.split(b"\0", 1)[1])
    delivered(1)                                 # read by the link while it stands by
    for i in (1, 2):
        peer.send(b"CMSG link/seen\0x/%d\0%d" % (i, i))
    for n in asked:
        peer.send(b"CMSG link/synced\0" + n)
    peer.send(b"CMSG link/sync\0probe")
    answer_syncs_until(peer, lambda f: f == b"CMSG link/synced\0probe")
    if active_goes_on:                           # else it stops after x/1
        delivered(2)
        delivered(3)
    last = 4 if active_goes_on else 3            # the active path never delivers it
    for i in range(3, last + 1):
        peer.send(b"CMSG link/seen\0x/%d\0%d" % (i, i))
    peer.send(b'CMSG link/state\0{"forwarding": true}')
    answer_syncs_until(peer, lambda f: f.startswith(b"CMSG link/sync\0"))   # the takeover's
    got = []
    while b"x/%d" % last not in got:
        p = recv(spy, DONE_TIMEOUT)
        assert p, "the bus closed the spy"
        if p.startswith(b"MSG "):
            got.append(p[4:p.index(b"\0")])
    got += [p[4:p.index(b"\0")] for p in sync(spy) if p.startswith(b"MSG ")]
    assert got == [b"x/%d" % i for i in range(last + 1)], f"published: {got} (x/0 twice: replayed though delivered)"
    link.listen.wait_log("taking over: published %d message(s) from the peer's bus that the old path had "
                         "not delivered; failover gap 0" % (1 if active_goes_on else 2))


def test_a_killed_half_acknowledged_exactly_what_left_it_for_its_bus(start_bus, services, tmp_path):  # noqa: F811
    """What the survivor counts when its peer half dies (``in_flight``: what it sent less what the
    peer acknowledged) is exact only if an acknowledgement says what has left the dead half for
    its bus: the bus reads a killed writer's socket to its end. Here the bus is stopped while a
    hand-made peer streams to the link: what fits in the link's socket to its bus is handed on
    and must be acknowledged, what waits in the link's own queue must not; the link is killed,
    the bus continued, and the bus publishes exactly what was acknowledged. The code before
    acknowledged after a round trip through the bus (none here: every message the bus then
    published counted lost too; under load, a stopped half's last round trips, 119 of 8,000
    counted twice)."""
    bus = start_bus()
    # (a packet limit of 64 KiB: the link's socket to its bus keeps the kernel's default size)
    link = TransportLink(services, tmp_path, "key", bus.address, bus.address, None, "--no-spanning-tree",
                         "--session", "acked", "--max-packet", "65536", "--keepalive", "0", start=("listen",))
    spy = connect(bus.address, big=True)
    send(spy, HARD_BLOCK, sub(b"x/"))
    sync(spy)
    peer = FramedPeer(link.port, str(tmp_path / "link.key"))
    hello = {"version": 1, "whoami": None, "max_packet": 65536, "ack": True, "patterns": ["x/"]}
    peer.send(b"CMSG link/hello\0" + json.dumps(hello).encode())
    link.listen.wait_log("link up")
    acked = [0]

    def read_until(done) -> None:
        while not done():
            frame = peer.recv()
            if frame.startswith(b"CMSG link/ack\0"):
                acked.append(int(frame.split(b"\0", 1)[1]))

    def said_hello(i: int) -> None:
        """Every frame sent before this one has been read and handled by the link (its log says)."""
        who = b"!/cred/0/0/%d" % (4000 + i)
        peer.send(b"CMSG link/hello\0" + json.dumps(dict(hello, whoami=who.decode())).encode())
        link.listen.wait_log(f"is now {who.decode()} on its bus")

    bus.proc.send_signal(signal.SIGSTOP)
    try:
        for i in range(50):          # all fit in the link's socket to its (stopped) bus
            peer.send(msg(b"x/%d" % i, b"y" * 100))
        peer.sock.settimeout(SERVICE_TIMEOUT)
        try:
            read_until(lambda: acked[-1] == 50)
        except TimeoutError:
            pytest.fail(f"50 messages handed to the stopped bus's socket, acknowledged: {acked[-1]}")
        for i in range(50, 1050):    # more than it takes: the rest waits in the link's queue
            peer.send(msg(b"x/%d" % i, b"y" * 100))
        said_hello(1)
        said_hello(2)                # (the acknowledgements of the first one's read went out before)
        link.listen.proc.kill()
        with pytest.raises((ConnectionError, OSError)):
            read_until(lambda: False)
    finally:
        bus.proc.send_signal(signal.SIGCONT)
    # the bus has read the dead link's socket to its end once its session lingers (it answers a
    # claim of it `resumed`); then everything routed to the spy is ahead of the spy's sync answer
    claimer = connect(bus.address)

    def resumed() -> bool:
        send(claimer, b"CMSG server/session\0acked\0" + b"0")
        answer = recv(claimer, DONE_TIMEOUT)
        return answer.split(b"\0")[2] == b"resumed"

    wait_until(resumed, "the dead link's session lingering", DONE_TIMEOUT)
    published = [int(p[6:p.index(b"\0")]) for p in [recv(spy, DONE_TIMEOUT)] + sync(spy)
                 if p.startswith(b"MSG x/")]
    assert published == list(range(len(published))), "out of order"
    assert 50 < acked[-1] < 1050, acked[-5:]     # some left it, some did not
    assert len(published) == acked[-1], (f"the bus published {len(published)}, the link acknowledged "
                                         f"{acked[-1]}: the survivor would count {acked[-1] - len(published)} "
                                         f"too few or too many")


def test_what_its_bus_held_for_a_killed_half_is_counted_by_its_successor(start_bus, services, tmp_path):  # noqa: F811
    """Issue 34, "restarts counted end to end": a link's half stopped (SIGSTOP) while its bus
    sends it 2,000 messages, then killed (-9) and started again. The bus's kernel held some of
    them for it, unread (about 1,150 small packets for a half of the same uid), its queue the
    rest. The half tells its bus what the peer acknowledged (`server/session-ack`), so its
    session counts both, and the successor reports all 2,000 lost (restart). The code before
    counted only the queue."""
    from test_lossless import routed

    a, b = start_bus(), start_bus()
    link = TransportLink(services, tmp_path, "key", a.address, b.address)
    settled(link.halves, forwarding=2)
    link.listen.wait_log("holding session")
    n, prefix = 2000, b"held/"
    s = far_subscriber(b.address, prefix)
    routed(a.address, s, prefix)
    link.listen.proc.send_signal(signal.SIGSTOP)
    try:
        with connect(a.address) as pub:
            send(pub, *[msg(prefix + b"%d" % i, b"x") for i in range(n)])
            sync(pub)   # all routed to the stopped half: its queue on bus a, or its socket
    finally:
        link.listen.proc.kill()
    s.close()
    new = link.restart("listen")
    found = RESUMED.search(new.wait_log(RESUMED))
    # (a few more: what else the bus sent the stopped half counts too; 3 more in a loaded CI run)
    assert n <= int(found.group(1)) <= n + 10, f"counted {found.group(1)} of the {n} the killed half never read"


@pytest.mark.parametrize("args,needle", [
    (["--session", ""], "--session: a session name is 1 to 200 bytes, not 0"),
    (["--session", "x" * 201], "--session: a session name is 1 to 200 bytes, not 201"),
    (["--session-linger", "-1"], "--session-linger: must be positive"),
    (["--session-linger", "inf"], "--session-linger: not a finite number"),
    (["--session-linger", "soon"], "--session-linger: not a number"),
])
def test_session_usage_errors_are_one_line(tmp_path, args, needle):
    res = subprocess.run([*TWISTD, "sbus-link", "--bus", "x", "--listen", "unix:l.socket", *args],
                         capture_output=True, timeout=SERVICE_TIMEOUT, cwd=tmp_path, env=child_env())
    out = (res.stderr + res.stdout).decode()
    assert res.returncode != 0 and needle in out and "Traceback" not in out, out[-500:]


def test_two_links_given_one_session_name_the_second_says_so_and_carries(start_bus, services,
                                                                         tmp_path):  # noqa: F811
    """An operator's mistake: two links on one bus with the same --session. The second is told
    `busy`: one line naming the name and the fix; it runs without a session, and carries."""
    a, b = start_bus(), start_bus()
    first = TransportLink(services, tmp_path, "unix", a.address, b.address, None, "--session", "same")
    first.listen.wait_log("holding session same on the bus")
    second = TransportLink(services, tmp_path, "unix", a.address, b.address, None, "--session", "same",
                           start=("listen",))
    second.listen.wait_log("another process of our uid holds session same on the bus")
    second.restart("connect")
    settled(first.halves + second.halves, forwarding=3)
    assert run_flow(a.address, {"b": b.address}, lambda pub: None, 300, after=700) == [{"b": 1000}]
    busy = [ln for ln in second.listen.log().splitlines() if "holds session same" in ln]
    assert len(busy) == 1 and "--session" in busy[0], busy  # one line, naming the fix
    assert "holds session same" not in first.listen.log(), "the first one lost its session"



#: Messages of the held-back cases below: more than bus b's server queues for a subscriber that
#: does not read (16,384) and its socket, so the active link's writes to b wait unread in b.
HELD_BACK_BURST = 40000
LINK_WAITED_OR_TOOK_OVER = re.compile(r"taking over: (published \d+|our bus's server has not yet read)")
LINK_WAITED = "our bus's server has not yet read what a dead link half wrote to it"


def held_link_half_killed(start_bus, services, tmp_path, *options):
    """The bridges' held-back case (test_failover's `held_active_killed`) for links: two parallel
    links (with `options`) between buses a and b; a subscriber on b in hard/block that does not
    read; a publisher on a as fast as it goes, until b holds the forwarding link's half on b with
    what it wrote unread in b's socket; then that half is killed (-9). Returns (b, the standby
    link, the blocker's Receiver, not started, the publisher)."""
    from test_failover import held_by_a_blocker

    a, b = start_bus(), start_bus()
    links = [TransportLink(services, tmp_path, "key", a.address, b.address, None, *options) for _ in range(2)]
    settled([h for link in links for h in link.halves], forwarding=3)
    for h in links[0].halves + links[1].halves:
        h.wait_log(WATCHING)
    active = next(link for link in links if link.forwarding())
    standby = next(link for link in links if link is not active)
    active.connect.wait_log("holding session")
    receiver, pub = held_by_a_blocker(a, b, HELD_BACK_BURST, "active link")
    active.connect.proc.kill()
    return a, b, standby, receiver, pub


def standby_half_on_b(b, standby) -> dict:
    """The stats of the standby link's half on b; asked on b after the marker: it has read all
    b routed to it before."""
    (st,) = [s["stats"] for s in service_stats(b.address, "sbus-link") if s["pid"] == standby.connect.proc.pid]
    return st


def test_parallel_links_takeover_waits_until_the_dead_halfs_unread_writes_are_routed(start_bus, services,
                                                                                      tmp_path):  # noqa: F811
    """The forwarding link's half on b is killed (-9) while b holds its connection paused, what it
    wrote unread in b's socket. The standby link's half on b published its window after its round
    trips, before b had read those writes: b routed them twice once the subscriber read (567, 673
    and 1,171 of 40,000 in three runs), and the copies b read late were routed to the standby's half
    too, which sent them back to a, where they came from (673 and 1,171 in the last two). Now it waits (at
    most --takeover-wait) until the dead half's session on b is no longer ``closing``
    (server/session-held; each half tells the others on its bus its session's name), and what
    b routes to it meanwhile that pairs with the peer's stream never goes back: every message
    arrives once, in order, and nothing returns to a."""
    from test_failover import check_once_in_order

    a, b, standby, receiver, pub = held_link_half_killed(start_bus, services, tmp_path)
    standby.connect.wait_log(LINK_WAITED_OR_TOOK_OVER, timeout=DONE_TIMEOUT)
    receiver.start()
    pub.join(DONE_TIMEOUT)
    assert pub.error is None and pub.sent == HELD_BACK_BURST, (pub.error, pub.sent)
    got = marker_across(a.address, pub.prefix, HELD_BACK_BURST, receiver)
    st = standby_half_on_b(b, standby)
    print(f"received {len(got)} of {HELD_BACK_BURST} ({len(got) - len(set(got))} duplicated); sent to a by "
          f"the standby's half on b: {st['to_remote']}; old path's copies: {st['standby'].get('old_path_copies')}")
    check_once_in_order("b", got, HELD_BACK_BURST)
    assert st["to_remote"] == 0, f"{st['to_remote']} message(s) from a sent back to a"
    takeovers = [[int(x) for x in found] for found in LINK_TAKEOVER.findall(standby.connect.log())]
    assert takeovers and all(gap == 0 for _, gap in takeovers), takeovers
    assert LINK_WAITED in standby.connect.log()


def test_a_link_takeover_waits_at_most_takeover_wait_and_sends_nothing_back(start_bus, services,
                                                                             tmp_path):  # noqa: F811
    """The same with ``--takeover-wait 1``, the subscriber reading only after it: the standby's
    half on b waits 1 s, then publishes its window with one warning line. Nothing is lost; what b
    held of the dead half may arrive twice, as the line says, but its late copies, routed to the
    standby's half too, are recognised (``standby.old_path_copies``) and never sent back to a."""
    a, b, standby, receiver, pub = held_link_half_killed(start_bus, services, tmp_path, "--takeover-wait", "1")
    standby.connect.wait_log(LINK_WAITED, timeout=DONE_TIMEOUT)
    warned = standby.connect.wait_log(re.compile(r"after 1 s \(session .* closing\); publishing the window now: "
                                                 r"messages it wrote there may arrive twice"), timeout=DONE_TIMEOUT)
    assert warned.count("may arrive twice") == 1
    receiver.start()
    pub.join(DONE_TIMEOUT)
    assert pub.error is None and pub.sent == HELD_BACK_BURST, (pub.error, pub.sent)
    got = marker_across(a.address, pub.prefix, HELD_BACK_BURST, receiver)
    missing = set(range(HELD_BACK_BURST)) - set(got)
    st = standby_half_on_b(b, standby)
    print(f"--takeover-wait 1: {len(got) - HELD_BACK_BURST} duplicated, {len(missing)} missing; sent to a: "
          f"{st['to_remote']}; old path's copies: {st['standby']['old_path_copies']}")
    assert not missing, f"{len(missing)} lost (first {sorted(missing)[:5]})"
    assert st["to_remote"] == 0, f"{st['to_remote']} message(s) from a sent back to a"
    assert st["standby"]["old_path_copies"]["from_remote"] == len(got) - HELD_BACK_BURST, st["standby"]
