"""The SOCK_SEQPACKET transport (`sbus.seqpacket`), shared by server and clients.

Layering is checked in a fresh interpreter: the client package and the
transport import with the server package blocked.
"""

from __future__ import annotations

import subprocess
import sys

from helpers import child_env

_BLOCK_SERVER = r"""
import importlib, sys

class BlockServer:
    def find_spec(self, name, path=None, target=None):
        if name == "sbus.server" or name.startswith("sbus.server."):
            raise ImportError("the client side imported " + name)

sys.meta_path.insert(0, BlockServer())
for name in sys.argv[1:]:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.startswith("sbus.server"))
assert not leaked, leaked
print("ok")
"""

CLIENT_SIDE = [
    "sbus.seqpacket", "sbus.address", "sbus.interfaces", "sbus.client", "sbus.client.address",
    "sbus.client.blocking", "sbus.client.twisted", "sbus.client.asyncio", "sbus.cli", "sbus.top",
]


def test_client_package_never_imports_the_server_package():
    out = subprocess.run([sys.executable, "-c", _BLOCK_SERVER, *CLIENT_SIDE], env=child_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ---------------------------------------------------------------- in-process, over socketpair

import errno
import os
import signal
import socket
import textwrap
import uuid

import pytest
import pytest_twisted
from twisted.internet import defer

from helpers import BIG_BUF, cmsg, connect, msg, recv, send, sub, sync, WHOAMI

from sbus.seqpacket import SeqPacketPort, SeqPacketTransport, connectSeqPacket

TIMEOUT = 10.0


def reactor():
    from twisted.internet import reactor as r

    return r


def within(d, timeout=TIMEOUT):
    return d.addTimeout(timeout, reactor())


class Recorder:
    """A packet protocol that keeps what it gets; `lost` fires with the reason when it ends."""

    def __init__(self):
        self.transport = None
        self.packets: list[bytes] = []
        self.too_large: list[int] = []
        self.unsendable: list[int] = []
        self.lost = defer.Deferred()
        self.waiting: list[tuple[int, defer.Deferred]] = []

    def makeConnection(self, transport):
        self.transport = transport

    def packetReceived(self, packet):
        self.packets.append(packet)
        for n, d in list(self.waiting):
            if len(self.packets) >= n:
                self.waiting.remove((n, d))
                d.callback(None)

    def packetTooLarge(self, size):
        self.too_large.append(size)

    def connectionLost(self, reason):
        self.reason = reason
        self.lost.callback(None)

    def received(self, n) -> defer.Deferred:
        if len(self.packets) >= n:
            return defer.succeed(None)
        d = defer.Deferred()
        self.waiting.append((n, d))
        return within(d)


def pair(max_packet=65536, protocol=None, **kw):
    """Our transport on one end of a SEQPACKET socketpair (reading), a plain socket on the other."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    proto = protocol or Recorder()
    t = SeqPacketTransport(ours, proto, reactor(), max_packet=max_packet, **kw)
    proto.makeConnection(t)
    return t, proto, theirs


@pytest.fixture(autouse=True)
def clean_reactor():
    """Fail a test that leaves connections or timers behind."""
    r = reactor()
    readers, writers = set(r.getReaders()), set(r.getWriters())
    yield
    left = [c for c in r.getDelayedCalls() if c.active()]
    new_readers = {x for x in set(r.getReaders()) - readers if not type(x).__name__.endswith("Waker")}
    new_writers = set(r.getWriters()) - writers
    assert not left and not new_readers and not new_writers, (left, new_readers, new_writers)


@pytest_twisted.ensureDeferred
async def test_closing_peer_with_unread_packets_loses_nothing():
    """Linux says ECONNRESET before the packets a closing peer sent; they must still arrive."""
    t, proto, theirs = pair()
    t.write(b"an echo the peer never reads")
    for i in range(50):
        theirs.send(msg("k", str(i)))
    theirs.close()
    t.startReading()
    await within(proto.lost)
    assert proto.packets == [msg("k", str(i)) for i in range(50)]


@pytest_twisted.ensureDeferred
async def test_failed_send_still_reads_what_the_peer_sent():
    """A send that finds the peer gone (EPIPE) must not throw away the packets it sent before."""
    t, proto, theirs = pair()
    for i in range(50):
        theirs.send(msg("k", str(i)))
    theirs.close()
    t.write(b"to a closed peer")  # EPIPE, before any read
    t.startReading()
    await within(proto.lost)
    assert len(proto.packets) == 50
    assert t.packets_out == 0


@pytest_twisted.ensureDeferred
async def test_emsgsize_drops_the_packet_not_the_connection():
    """A packet bigger than SO_SNDBUF allows is refused by the kernel (EMSGSIZE): that is the
    packet's fault; the peer stays connected and gets the next packet."""
    t, proto, theirs = pair(max_packet=4096)
    t.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    limit = t.socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    theirs.settimeout(TIMEOUT)
    t.write(b"x" * (limit + 1))
    t.write(b"after")
    assert theirs.recv(1 << 20) == b"after"
    assert t.connected and not t.disconnecting and t.packets_unsendable == 1
    theirs.close()
    t.startReading()
    await within(proto.lost)


@pytest_twisted.ensureDeferred
async def test_emsgsize_while_draining_the_queue():
    t, proto, theirs = pair(max_packet=4096)
    t.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    limit = t.socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    t.outbox.push(b"x" * (limit + 1))  # queued: goes out from doWrite
    t.write(b"after")
    t.startWriting()
    theirs.setblocking(False)
    got = defer.Deferred()

    def poll():
        try:
            got.callback(theirs.recv(1 << 20))
        except BlockingIOError:
            reactor().callLater(0.01, poll)

    poll()
    assert await within(got) == b"after"
    assert t.connected and t.packets_unsendable == 1
    theirs.close()
    t.startReading()
    await within(proto.lost)


def test_send_never_raises_sigpipe():
    """A program that restored SIGPIPE's default action must not die writing to a gone peer."""
    code = textwrap.dedent("""
        import signal, socket
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        from twisted.internet import reactor
        from sbus.seqpacket import SeqPacketTransport

        class P:
            def makeConnection(self, t): pass
            def connectionLost(self, reason): pass
            def packetReceived(self, p): pass

        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        b.close()
        t = SeqPacketTransport(a, P(), reactor, max_packet=4096)
        t.write(b"into the void")
        print("alive")
    """)
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "alive", (out.returncode, out.stderr)


@pytest_twisted.ensureDeferred
async def test_pull_producer_is_asked_again_and_again():
    """A non-streaming producer writes once per resumeProducing; it must be asked until done."""
    t, proto, theirs = pair()
    theirs.setblocking(False)

    class Pull:
        def __init__(self):
            self.n = 0

        def resumeProducing(self):
            self.n += 1
            t.write(b"chunk %d" % self.n)
            if self.n == 20:
                t.unregisterProducer()

        def stopProducing(self):
            pass

    t.registerProducer(Pull(), False)
    got = []
    done = defer.Deferred()

    def poll():
        while True:
            try:
                got.append(theirs.recv(4096))
            except BlockingIOError:
                break
        if len(got) >= 20:
            done.callback(None)
        else:
            reactor().callLater(0.01, poll)

    poll()
    await within(done)
    assert got == [b"chunk %d" % i for i in range(1, 21)]
    theirs.close()
    t.startReading()
    await within(proto.lost)


@pytest_twisted.ensureDeferred
async def test_a_paused_transport_whose_peer_closes_stays_paused_then_reads_it_all():
    """Pausing holds: a peer that hangs up while paused is read only when reading resumes
    (what it sent waits in the kernel, not in anyone's queue: issue 20, fault 6)."""
    t, proto, theirs = pair()
    t.startReading()
    t.pauseProducing()
    theirs.send(b"last words")
    theirs.close()
    assert proto.packets == [] and t.connected
    t.resumeProducing()
    await within(proto.lost)
    assert proto.packets == [b"last words"]


@pytest_twisted.ensureDeferred
async def test_accept_failure_costs_one_connection_not_the_listener():
    """An exception while setting up one connection must not stop the port (as tcp.Port)."""

    class Factory:
        built = 0
        served = defer.Deferred()

        def doStart(self):
            pass

        def doStop(self):
            pass

        def buildProtocol(self, addr):
            self.built += 1
            if self.built == 1:
                raise RuntimeError("boom, for one connection")
            proto = Recorder()
            self.served.callback(proto)
            return proto

    name = b"\0sbus-test-" + uuid.uuid4().hex.encode()
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lsock.bind(name)
    factory = Factory()
    port = SeqPacketPort(lsock, factory, reactor())
    port.startListening()
    first = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        first.connect(name)
        first.settimeout(TIMEOUT)
        closed = defer.Deferred()
        reactor().callInThread(lambda: reactor().callFromThread(closed.callback, first.recv(16)))
        assert await within(closed) == b""  # the server closed that one
        proto = Recorder()
        client = connectSeqPacket(reactor(), name, proto, max_packet=4096)
        server_side = await within(factory.served)
        assert port.connected and factory.built == 2
        client.write(b"hello")
        await server_side.received(1)
        client.loseConnection()
        await within(proto.lost)
        await within(server_side.lost)
    finally:
        first.close()
        await port.stopListening()
    assert not port.connected


@pytest.mark.parametrize("run", range(5))
def test_closing_publisher_loses_nothing_through_sbusd(bus, run):
    """Through a real server: a publisher with unread packets waiting (its own echoes, a
    whoami reply) publishes 50 messages and closes at once; the subscriber gets all 50."""
    key = f"close/{uuid.uuid4().hex[:8]}"
    subscriber = connect(bus.address, big=True)
    send(subscriber, sub(key + "/"))
    sync(subscriber)
    publisher = connect(bus.address, big=True)
    send(publisher, sub(key + "/"), WHOAMI)  # its own echoes and a reply pile up unread
    sync_key = key + "/"
    for i in range(50):
        send(publisher, msg(f"{sync_key}{i}", str(i)))
    publisher.close()
    got = [recv(subscriber) for _ in range(50)]
    assert got == [msg(f"{sync_key}{i}", str(i)) for i in range(50)]
    subscriber.close()


def test_bus_service_builds_its_factory_on_its_own_reactor():
    """BusService(reactor=r): the broker's timers and readers go to r, not the global reactor."""
    from twisted.internet.epollreactor import EPollReactor

    from sbus.server.config import ServerConfig
    from sbus.server.service import BusService

    own = EPollReactor()  # never run, never installed
    try:
        bus = BusService("/dev/unix/abstract", ServerConfig(), reactor=own)
        bus.startService()
        try:
            assert bus.factory.reactor is own and bus.port.reactor is own
            assert bus.port in own.getReaders() and bus.port not in reactor().getReaders()
        finally:
            bus.stopService()
    finally:
        for r in own.getReaders():
            own.removeReader(r)
        own._poller.close()
