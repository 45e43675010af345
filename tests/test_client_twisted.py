"""The Twisted client against a real server process.

Needs the pytest-twisted plugin active (``-p pytest_twisted`` or
``pytest_plugins = ["pytest_twisted"]`` in the root conftest).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import pytest_twisted
from twisted.internet import defer, threads

from sbus.client import ConnectionClosed
from sbus.client.twisted import ReconnectingClient, SbusProtocol, connect, parse_whoami
from sbus.core import codec

# An upper bound on an event, never a wait: a child process that starts Python, connects and
# exits can take more than 10 s on a loaded CI machine (CI: child.ended timed out at 10 s).
TIMEOUT = 30.0


def reactor():
    from twisted.internet import reactor as r

    return r


def own_whoami() -> bytes:
    return b"!/cred/%d/%d/%d" % (os.getgid(), os.getuid(), os.getpid())


def within(d, timeout=TIMEOUT):
    """Wait for a Deferred, failing the test after `timeout` seconds instead of hanging."""
    return d.addTimeout(timeout, reactor())


class Clients:
    """Connections made in a test, closed at its end."""

    def __init__(self, address):
        self.address = address
        self.made = []

    async def __call__(self, factory=SbusProtocol):
        p = await within(connect(reactor(), self.address, factory))
        self.made.append(p)
        return p

    async def close(self):
        for p in self.made:
            await within(p.close())


@pytest.fixture
def clients(bus):
    c = Clients(bus.address)
    yield c
    pytest_twisted.blockon(defer.ensureDeferred(c.close()))


@pytest.fixture(autouse=True)
def clean_reactor():
    """Fail a test that leaves connections or timers behind."""
    r = reactor()
    readers, writers = set(r.getReaders()), set(r.getWriters())
    yield
    left = [c for c in r.getDelayedCalls() if c.active()]
    # (the reactor's own wakers appear when it starts during the first test)
    new_readers = {x for x in set(r.getReaders()) - readers if not type(x).__name__.endswith("Waker")}
    new_writers = set(r.getWriters()) - writers
    assert not left and not new_readers and not new_writers, (left, new_readers, new_writers)


def test_parse_whoami():
    assert parse_whoami(b"!/cred/100/1000/1111") == (b"", (1111, 1000, 100))
    prefix, cred = parse_whoami(b"!/cred/100/1000/1111/!/cred/1000/1000/19211")
    assert prefix == b"!/cred/100/1000/1111/" and cred.pid == 19211
    assert parse_whoami(b"nonsense") is None


@pytest_twisted.ensureDeferred
async def test_publish_subscribe_callbacks(clients):
    sub, pub = await clients(), await clients()
    qa, qb = defer.DeferredQueue(), defer.DeferredQueue()

    def cb_b(key, payload):
        qb.put((key, payload))

    sub.subscribe("sensors/", lambda k, p: qa.put((k, p)))
    sub.subscribe("sensors/*/temp", cb_b)
    sub.subscribe("sensors/", cb_b)  # cb_b under two patterns: still once per message
    await within(sub.sync())
    pub.publish("sensors/x/temp", b"21.5")
    pub.publish("elsewhere", b"no")
    pub.publish("sensors/y", "text")
    assert await within(qa.get()) == (b"sensors/x/temp", b"21.5")
    assert await within(qb.get()) == (b"sensors/x/temp", b"21.5")
    assert await within(qa.get()) == (b"sensors/y", b"text")
    assert await within(qb.get()) == (b"sensors/y", b"text")
    sub.unsubscribe("sensors/", cb_b)
    await within(sub.sync())
    pub.publish("sensors/z", b"only a")
    assert await within(qa.get()) == (b"sensors/z", b"only a")
    assert not qb.pending  # dispatch is synchronous: cb_b would have run by now
    assert [p for p, _ in sub.subscriptions] == [b"sensors/", b"sensors/*/temp"]


@pytest_twisted.ensureDeferred
async def test_whoami_and_stats(clients):
    p = await clients()
    assert p.credentials == own_whoami()  # connect() asked already
    assert await within(p.whoami()) == own_whoami()
    stats = await within(p.stats())
    assert stats["clients"] >= 1 and "queues" in stats


@pytest_twisted.ensureDeferred
async def test_a_session_claimed_by_a_successor_says_what_it_missed(clients):
    first, pub = await clients(), await clients()
    first.subscribe("svc/", lambda k, p: None)
    assert (await within(first.session(b"tw", 30))).state == "new"
    await within(first.close())
    await within(pub.sync())
    while (await within(pub.stats()))["sessions"]["lingering"] != 1:
        await within(pub.sync())  # the server learns of the close in its own time
    for i in range(5):
        pub.publish("svc/x", b"%d" % i)
    await within(pub.sync())
    successor = await clients()
    successor.subscribe("svc/", lambda k, p: None)
    reply = await within(successor.session(b"tw", 30))
    assert (reply.state, reply.missed, reply.linger) == ("resumed", 5, 30.0), reply
    with pytest.raises(ValueError):
        successor.session(b"", 30)


@pytest_twisted.ensureDeferred
async def test_message_received_hook(clients):
    seen = defer.DeferredQueue()

    class Relay(SbusProtocol):
        def messageReceived(self, key, payload, packet):
            seen.put((key, payload, packet))

    relay, pub = await clients(Relay), await clients()
    relay.subscribe("", None)
    await within(relay.sync())
    pub.publish("a/b", b"\0raw")
    assert await within(seen.get()) == (b"a/b", b"\0raw", b"MSG a/b\0\0raw")


CHILD = textwrap.dedent(r"""
    import sys
    import sbus.client
    address, peer = sys.argv[1], sys.argv[2].encode()
    with sbus.client.connect(address) as bus:
        bus.subscribe("!/cred////inbox/")
        print(bus.whoami(10).decode(), flush=True)
        secret = bus.receive(timeout=10)
        bus.publish(peer + b"/reply", secret.payload[::-1])
        bus.sync(10)
    print("done", flush=True)
""")


@pytest_twisted.ensureDeferred
async def test_secret_key_between_processes(bus, clients):
    me, spy = await clients(), await clients()
    replies, leaked = defer.DeferredQueue(), []
    # empty fields: the client fills them in (as the server does) to match the callback
    me.subscribe("!/cred////reply", lambda k, p: replies.put((k, p)))
    spy.subscribe("", lambda k, p: leaked.append(k))
    spy.subscribe("!/", lambda k, p: leaked.append(k))
    await within(me.sync())
    await within(spy.sync())
    # A plain subprocess read and reaped from threads: Twisted's spawnProcess learns of the exit
    # from SIGCHLD, which a loaded CI run once missed (the test waited 30 s for a child that ended).
    child = subprocess.Popen([sys.executable, "-c", CHILD, bus.address, me.credentials.decode()],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        theirs = (await within(threads.deferToThread(child.stdout.readline))).strip()
        assert theirs.startswith(b"!/cred/") and theirs != me.credentials, theirs
        me.publish(theirs + b"/inbox/x", b"secret")
        assert await within(replies.get()) == (me.credentials + b"/reply", b"terces")
        assert (await within(threads.deferToThread(child.stdout.readline))).strip() == b"done"
        assert await within(threads.deferToThread(child.wait)) == 0
    finally:
        child.kill()
        _, err = child.communicate()
        assert not err, err.decode()[-500:]
    await within(spy.sync())
    assert not [k for k in leaked if k.startswith(theirs)]


@pytest_twisted.ensureDeferred
async def test_echo_off(clients):
    me, other = await clients(), await clients()
    q = defer.DeferredQueue()
    me.subscribe("chat/", lambda k, p: q.put(k))
    me.echo(False)
    me.publish("chat/me", b"x")
    await within(me.sync())
    other.publish("chat/other", b"y")
    assert await within(q.get()) == b"chat/other"
    assert me.echoOn is False


@pytest_twisted.ensureDeferred
async def test_flood_soft_discard(clients):
    reader, writer = await clients(), await clients()
    q = defer.DeferredQueue()
    reader.subscribe("flood/", lambda k, p: q.put(len(p)))
    reader.flood(soft="discard")
    await within(reader.sync())
    reader.transport.pauseProducing()  # a reader that does not read
    chunk = b"x" * 100_000
    for _ in range(100):
        writer.publish("flood/x", chunk)
    stats = await within(writer.stats())
    assert sum(stats["drops"].values()) > 0
    reader.transport.resumeProducing()
    assert await within(q.get()) == len(chunk)
    # the server tells what it dropped (server/dropped): dropNotice is called, `dropped` sums it
    notices = []
    reader.dropNotice = lambda count, first, last: notices.append((count, first, last))
    await within(reader.sync())
    while reader.dropped < sum(stats["drops"].values()):
        await within(reader.sync())
    assert reader.dropped == sum(stats["drops"].values())
    assert all(first == last == b"flood/x" for _, first, last in notices)


@pytest_twisted.ensureDeferred
async def test_connect_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        await within(connect(reactor(), str(tmp_path / "missing.socket")))


@pytest_twisted.ensureDeferred
async def test_server_disconnect(clients):
    p = await clients()
    lost = p.whenLost()
    p.subscribe(b"!/cred/1/2/3/not-mine")  # not our secret space: the server disconnects us
    with pytest.raises(ConnectionClosed) as info:
        await within(p.whoami())
    assert "forbidden_subscription" in str(info.value)  # the server's server/disconnect reason
    why = await within(lost)
    assert "forbidden_subscription" in str(why)
    assert p.disconnectReason.reason == "forbidden_subscription"
    assert not p.connected
    with pytest.raises(ConnectionClosed):
        p.publish("a", b"b")


@pytest_twisted.ensureDeferred
async def test_a_reconnecting_client_with_a_session_is_told_what_it_missed_while_away(bus):
    replies = defer.DeferredQueue()

    class Client(ReconnectingClient):
        def sessionClaimed(self, reply):
            ReconnectingClient.sessionClaimed(self, reply)
            replies.put(reply)

    rc = Client(reactor(), bus.address, initialDelay=60.0, maxDelay=60.0)
    rc.subscribe("s/", lambda k, p: None)
    rc.holdSession(b"rc", 30)
    rc.start()
    other = await within(connect(reactor(), bus.address))
    try:
        first = await within(rc.whenConnected())
        assert (await within(replies.get())).state == "new"
        lost = first.whenLost()
        first.transport.loseConnection()
        await within(lost)
        while (await within(other.stats()))["sessions"]["lingering"] != 1:
            await within(other.sync())
        for _ in range(3):
            other.publish("s/x", b"")
        await within(other.sync())
        assert rc.retryNow()  # (its back-off would wait a minute)
        reply = await within(replies.get())
        assert (reply.state, reply.missed) == ("resumed", 3), reply
    finally:
        await within(rc.stop())
        await within(other.close())


@pytest_twisted.ensureDeferred
async def test_reconnecting_client(start_bus, tmp_path):
    path = str(tmp_path / "re.socket")
    bus = start_bus(address=path)
    rc = ReconnectingClient(reactor(), path, initialDelay=0.02, maxDelay=0.2)
    q = defer.DeferredQueue()
    rc.subscribe("t/", lambda k, p: q.put(k))
    rc.echo(False)
    rc.flood(soft="discard")
    assert rc.publish("t/early", b"") is False  # not connected yet: dropped
    rc.start()
    other = None
    try:
        first = await within(rc.whenConnected())
        other = await within(connect(reactor(), path))
        other.publish("t/1", b"")
        assert await within(q.get()) == b"t/1"
        lost = first.whenLost()
        await within(other.close())
        bus.stop()
        await within(lost)
        assert not rc.connected
        bus = start_bus(address=path)
        second = await within(rc.whenConnected())
        assert second is not first and rc.attempts >= 2
        other = await within(connect(reactor(), path))
        assert rc.publish("t/self", b"") is True  # echo off was re-applied
        await within(rc.sync())
        other.publish("t/2", b"")
        assert await within(q.get()) == b"t/2"  # the subscription was re-applied
        stats = await within(other.stats())
        mine = [c for c in stats["queues"] if c.get("subscriptions") == 1]
        if mine and "soft" in mine[0]:
            assert mine[0]["soft"] == "discard" and mine[0]["echo"] is False
    finally:
        await within(rc.stop())
        if other is not None:
            await within(other.close())
    assert not rc.connected


def older_server(path):
    """A server from before `server/session-confirm`, as far as sessions go: it refuses a claim
    with a third field (as the parser of that version did) and holds one without. Answers
    whoami. One connection, in a thread; returns (thread, the claims it read)."""
    import socket
    import threading

    from sbus.core import codec

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    claims = []

    def serve():
        conn, _ = listener.accept()
        listener.close()
        with conn:
            while True:
                p = conn.recv(65536)
                if not p:
                    return
                if p.startswith(b"CMSG " + codec.WHOAMI):
                    conn.send(b"CMSG %s\0%s" % (codec.WHOAMI, own_whoami()))
                elif p.startswith(b"CMSG %s\0" % codec.SESSION):
                    fields = p.split(b"\0")[1:]
                    claims.append(fields)
                    state = b"refused" if len(fields) != 2 else b"new"
                    conn.send(codec.session_reply(fields[0], state, linger=30.0 if state == b"new" else 0.0))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t, claims


@pytest_twisted.ensureDeferred
async def test_a_claim_that_confirms_falls_back_to_the_old_form_on_an_older_server(tmp_path):
    """Version skew: services ask to confirm; a server of the version before refuses the flag.
    The client asks again without it, so the session is still held (and counted) there."""
    path = str(tmp_path / "old.socket")
    thread, claims = older_server(path)
    p = await within(connect(reactor(), path))
    reply = await within(p.session(b"svc", 30, confirm=True))
    assert (reply.state, reply.linger) == ("new", 30.0), reply
    assert claims == [[b"svc", b"30", b"confirm"], [b"svc", b"30"]], claims
    await within(p.close())
    thread.join(TIMEOUT)


@pytest_twisted.ensureDeferred
async def test_a_request_forgotten_is_never_answered(clients):
    """A server that does not know a request never answers it (the reference server ignores
    ``server/session-held``), which shows when a later round trip is back: the asker forgets
    it (the bridge at each takeover), and an answer under that key afterwards is unsolicited."""
    got = defer.DeferredQueue()

    class Watcher(SbusProtocol):
        def unsolicitedControl(self, key, payload):
            got.put((key, payload))

    me = await clients(Watcher)
    ask = me.server_request(codec.SERVER_ID)
    me.forgetRequest(codec.SERVER_ID, ask)
    me.forgetRequest(codec.SERVER_ID, ask)          # twice: nothing more to forget
    key, payload = await within(got.get())
    assert key == codec.SERVER_ID and payload, (key, payload)
    assert not ask.called
