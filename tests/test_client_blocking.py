"""The blocking client against a real server process (the `bus` fixture)."""

from __future__ import annotations

import fcntl
import os
import select
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import sbus.client
from sbus.client import ConnectionClosed, Control, Message, ProtocolError, address
from sbus.core.codec import MAX_PACKET

TIMEOUT = 10.0


@pytest.fixture
def clients(bus):
    """Factory: clients(n=1) -> connected Clients, closed at teardown."""
    made = []

    def make(n=1, **kw):
        new = [sbus.client.connect(bus.address, **kw) for _ in range(n)]
        made.extend(new)
        return new[0] if n == 1 else new

    yield make
    for c in made:
        c.close()


def own_whoami() -> bytes:
    return b"!/cred/%d/%d/%d" % (os.getgid(), os.getuid(), os.getpid())


def readline(proc: subprocess.Popen, timeout: float = TIMEOUT) -> bytes:
    """One line of a child's stdout, waiting for it without sleeping."""
    fd = proc.stdout.fileno()
    line = b""
    deadline = time.monotonic() + timeout
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"no line from the child within {timeout}s (so far {line!r})")
        chunk = os.read(fd, 1)
        if not chunk:
            raise AssertionError(f"child ended its output: {line!r}, stderr: {proc.stderr.read()!r}")
        line += chunk
    return line[:-1]


# --- addresses (no server needed) --------------------------------------------------


def test_parse_forms():
    assert address.parse("/run/sbus.socket") == ("path", "/run/sbus.socket", "/run/sbus.socket")
    kind, value, _ = address.parse("/dev/fd/7")
    assert (kind, value) == ("fd", 7)
    kind, value, _ = address.parse("/dev/unix/abstract/00616263")
    assert kind == "abstract" and value == b"\0abc".ljust(108, b"\0")
    full = "00" + "ab" * 107
    assert address.parse("/dev/unix/abstract/" + full).value == bytes.fromhex(full)
    # not hex: an ordinary path, as with the server
    assert address.parse("/dev/unix/abstract/xyz").kind == "path"
    with pytest.raises(address.AddressError):
        address.parse("/dev/unix/abstract/61")  # would be a relative path to the kernel
    with pytest.raises(address.AddressError):
        address.parse("x" * 200)


def test_default_address_order(monkeypatch):
    monkeypatch.setenv("SBUS_SOCKET", "/from/env")
    assert address.resolve("/given").text == "/given"
    assert address.resolve(None).text == "/from/env"
    monkeypatch.delenv("SBUS_SOCKET")
    assert address.resolve(None).text == "/run/sbus.socket"  # where sbusd listens by default


# --- connecting ----------------------------------------------------------------


def test_connect_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        sbus.client.connect(str(tmp_path / "missing.socket"))
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(str(tmp_path / "dead.socket"))
    dead.close()  # the file stays, nobody listens
    with pytest.raises(ConnectionRefusedError):
        sbus.client.connect(str(tmp_path / "dead.socket"))


def test_connect_default_from_env_never_from_cwd(start_bus, tmp_path, monkeypatch):
    bus = start_bus(address=str(tmp_path / "sbus.socket"))
    monkeypatch.setenv("SBUS_SOCKET", bus.address)
    with sbus.client.connect() as c:
        assert c.whoami(TIMEOUT) == own_whoami()
    monkeypatch.delenv("SBUS_SOCKET")
    monkeypatch.chdir(tmp_path)  # a socket file in the working directory is not looked at
    assert address.resolve(None).text == "/run/sbus.socket"


def test_connect_abstract(start_bus):
    bus = start_bus(address="/dev/unix/abstract")
    printed = bus.printed.decode().strip()
    assert printed.startswith("/dev/unix/abstract/00")
    with sbus.client.connect(printed) as c:
        assert c.whoami(TIMEOUT) == own_whoami()


def test_connect_dev_fd(bus):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(bus.address)
    fd = s.detach()
    with sbus.client.connect(f"/dev/fd/{fd}") as c:
        assert c.fileno() == fd
        assert c.whoami(TIMEOUT) == own_whoami()
    with pytest.raises(OSError):
        os.fstat(fd)  # the client took the descriptor over and closed it


def test_dev_fd_in_a_child(bus):
    """The real use: a parent hands a connected socket down."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(bus.address)
    code = "import sys, sbus.client; print(sbus.client.connect(sys.argv[1]).whoami(10).decode())"
    out = subprocess.run([sys.executable, "-c", code, f"/dev/fd/{s.fileno()}"], pass_fds=[s.fileno()],
                         capture_output=True, timeout=TIMEOUT, check=True).stdout
    s.close()
    # the credentials are the connecting process's: ours
    assert out.strip() == own_whoami()


# --- messaging -----------------------------------------------------------------


def test_publish_subscribe(clients):
    sub, pub = clients(2)
    sub.subscribe("sensors/")
    sub.subscribe(b"other")
    sub.sync(TIMEOUT)
    pub.publish("sensors/a", "21.5")
    pub.publish(b"nope/a", b"x")
    pub.publish(b"sensors/b/c", b"\0binary\xff")
    pub.publish("other", b"")
    assert sub.receive(timeout=TIMEOUT) == Message(b"sensors/a", b"21.5")
    assert sub.receive(timeout=TIMEOUT) == Message(b"sensors/b/c", b"\0binary\xff")
    assert sub.receive(timeout=TIMEOUT) == Message(b"other", b"")
    sub.unsubscribe("sensors/")
    sub.sync(TIMEOUT)
    pub.publish("sensors/a", "gone")
    pub.publish("other", "still")
    assert sub.receive(timeout=TIMEOUT) == Message(b"other", b"still")


def test_whoami_keeps_messages_in_order(clients):
    c = clients()
    assert c.whoami(TIMEOUT) == own_whoami()
    c.subscribe("me/")
    for i in range(5):
        c.publish("me/x", b"%d" % i)
    assert c.whoami(TIMEOUT) == own_whoami()
    assert c.pending() == 5
    assert [c.receive(timeout=TIMEOUT).payload for _ in range(5)] == [b"0", b"1", b"2", b"3", b"4"]


def test_control_and_stats(clients):
    c = clients()
    c.send_control("unknown/key", b"ignored")  # unknown CMSGs are ignored
    stats = c.stats(TIMEOUT)
    for key in ("clients", "subscriptions", "packets_in", "packets_out", "drops", "disconnects", "queues"):
        assert key in stats
    assert stats["clients"] >= 1
    c.send_control(b"!/cred/whoami")
    got = c.receive(timeout=TIMEOUT)
    assert got == Control(b"!/cred/whoami", own_whoami())


def test_iteration_and_context_manager(clients):
    c = clients()
    c.subscribe("it/")
    with sbus.client.connect(c.socket.getpeername()) as p:
        for i in range(3):
            p.publish("it/x", b"%d" % i)
        p.sync(TIMEOUT)
    assert p.closed
    got = []
    for m in c:
        got.append(m.payload)
        if len(got) == 3:
            break
    assert got == [b"0", b"1", b"2"]


def test_largest_packet_and_over_the_limit(clients):
    sub, pub = clients(2)
    sub.subscribe("big")
    sub.sync(TIMEOUT)
    payload = os.urandom(MAX_PACKET - len(b"MSG big\0"))
    assert pub.publish("big", payload) == MAX_PACKET
    assert sub.receive(timeout=TIMEOUT) == Message(b"big", payload)
    with pytest.raises(ProtocolError, match="exceeds"):
        pub.publish("big", payload + b"!")
    assert pub.whoami(TIMEOUT) == own_whoami()  # nothing was sent, still connected


def test_never_sends_an_empty_packet(clients):
    c = clients()
    with pytest.raises(ProtocolError):
        c.send_packet(b"")


def test_server_disconnect_raises_connection_closed(clients):
    c = clients()
    c.subscribe(b"!/cred/1/2/3/not-mine")  # another pid's secret space: disconnected
    with pytest.raises(ConnectionClosed):
        c.whoami(TIMEOUT)
    with pytest.raises(ConnectionClosed):
        c.receive(timeout=TIMEOUT)
    assert list(c) == []  # iteration just ends


def test_echo_off(clients):
    me, other = clients(2)
    me.subscribe("chat/")
    me.echo(False)
    me.publish("chat/me", "mine")
    me.sync(TIMEOUT)
    other.publish("chat/other", "theirs")
    assert me.receive(timeout=TIMEOUT) == Message(b"chat/other", b"theirs")
    me.echo(True)
    me.publish("chat/me", "again")
    assert me.receive(timeout=TIMEOUT) == Message(b"chat/me", b"again")


CHILD = textwrap.dedent(r"""
    import sys
    import sbus.client
    address, peer = sys.argv[1], sys.argv[2].encode()
    with sbus.client.connect(address) as bus:
        bus.subscribe("!/cred////inbox/")   # empty fields: the server fills in our own ids
        print(bus.whoami(10).decode(), flush=True)
        secret = bus.receive(timeout=10)
        bus.publish(peer + b"/reply", secret.payload[::-1])
        bus.sync(10)
""")


def test_secret_key_between_processes(bus, clients):
    me, spy = clients(2)
    mine = me.whoami(TIMEOUT)
    me.subscribe(mine + b"/reply")
    me.sync(TIMEOUT)
    for pattern in ("", "*/", "!/", "*/*/*/*/*/inbox/"):
        spy.subscribe(pattern)
    spy.sync(TIMEOUT)
    child = subprocess.Popen([sys.executable, "-c", CHILD, bus.address, mine.decode()],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        theirs = readline(child)
        assert theirs.startswith(b"!/cred/") and theirs != mine
        assert theirs.rsplit(b"/", 1)[1] == str(child.pid).encode()
        me.publish(theirs + b"/inbox/x", b"secret")
        assert me.receive(timeout=TIMEOUT) == Message(mine + b"/reply", b"terces")
        assert child.wait(TIMEOUT) == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()
    # The spy saw everything up to this marker in order; the child's secret was not among it.
    me.publish("marker", "end")
    seen = []
    while True:
        m = spy.receive(timeout=TIMEOUT)
        if m.key == b"marker":
            break
        seen.append(m.key)
    assert not [k for k in seen if k.startswith(theirs)]


def test_flood_soft_discard(clients):
    reader, writer = clients(2)
    reader.subscribe("flood/")
    reader.flood(soft="discard")
    reader.sync(TIMEOUT)
    chunk = b"x" * 100_000
    for _ in range(100):  # 10 MB at a reader that does not read
        writer.publish("flood/x", chunk)
    stats = writer.stats(TIMEOUT)
    assert sum(stats["drops"].values()) > 0
    assert writer.whoami(TIMEOUT) == own_whoami()  # the writer was never blocked or hurt
    # the reader is still connected and gets what was not dropped
    assert reader.receive(timeout=TIMEOUT) == Message(b"flood/x", chunk)


def test_flood_modes_are_validated(clients):
    c = clients()
    c.flood(soft="queue", hard="discard", order="queue")
    c.flood(soft=b"block", hard=b"block", order=b"random")
    with pytest.raises(ValueError):
        c.flood(soft="sometimes")
    with pytest.raises(ValueError):
        c.flood(hard="queue")
    assert c.whoami(TIMEOUT)


# --- the socket itself ------------------------------------------------------------


def test_socket_buffers_fit_the_largest_packet(clients):
    c = clients()
    assert c.socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > MAX_PACKET
    assert c.socket.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) > MAX_PACKET
    assert c.socket.type == socket.SOCK_SEQPACKET


def test_epoll(clients):
    sub, pub = clients(2)
    sub.subscribe("ep/")
    sub.sync(TIMEOUT)
    ep = select.epoll()
    try:
        ep.register(sub.fileno(), select.EPOLLIN)
        assert ep.poll(0) == []
        pub.publish("ep/1", "a")
        assert ep.poll(TIMEOUT) == [(sub.fileno(), select.EPOLLIN)]
        assert sub.receive(socket.MSG_DONTWAIT) == Message(b"ep/1", b"a")
        assert ep.poll(0) == []
    finally:
        ep.close()


def test_dontwait_and_peek(clients):
    sub, pub = clients(2)
    sub.subscribe("pk/")
    sub.sync(TIMEOUT)
    with pytest.raises(BlockingIOError):
        sub.receive(socket.MSG_DONTWAIT)
    pub.publish("pk/1", "first")
    pub.publish("pk/2", "second")
    assert select.select([sub], [], [], TIMEOUT)[0] == [sub]
    assert sub.receive(socket.MSG_PEEK) == Message(b"pk/1", b"first")
    assert sub.receive(socket.MSG_PEEK | socket.MSG_DONTWAIT) == Message(b"pk/1", b"first")
    assert sub.receive(socket.MSG_DONTWAIT) == Message(b"pk/1", b"first")
    assert sub.receive(timeout=TIMEOUT) == Message(b"pk/2", b"second")
    with pytest.raises(BlockingIOError):
        sub.receive(socket.MSG_DONTWAIT)


def test_nonblocking_with_fcntl_and_timeout(clients):
    c = clients()
    flags = fcntl.fcntl(c.socket, fcntl.F_GETFL)
    fcntl.fcntl(c.socket, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    with pytest.raises(BlockingIOError):
        c.receive()
    # whoami waits for its reply even on a nonblocking socket
    assert c.whoami(TIMEOUT) == own_whoami()
    with pytest.raises(TimeoutError):
        c.receive(timeout=0.05)


# --- batches: publish_many / receive_many (sendmmsg/recvmmsg, or one call per packet) ------


from sbus.client import PacketTooLarge  # noqa: E402
import importlib.util  # noqa: E402

# The clients use the extension unless SBUS_PURE_PYTHON=1 (sbus.client.blocking.BATCH_IO).
BATCH_IO = (importlib.util.find_spec("sbus._speedups") is not None
            and os.environ.get("SBUS_PURE_PYTHON", "") in ("", "0"))
IO_PATHS = [pytest.param(True, id="batch_io", marks=pytest.mark.skipif(not BATCH_IO, reason="sbus._speedups not built")),
            pytest.param(False, id="pure")]


def numbered(n: int, size: int = 16, key=b"many/x") -> list[tuple[bytes, bytes]]:
    return [(key, b"%08d" % i + b"." * (size - 8)) for i in range(n)]


def take(c, n: int, max_count: int = 1000) -> list:
    """Exactly n packets through receive_many; checks each batch's bound."""
    got: list = []
    while len(got) < n:
        batch = c.receive_many(max_count, timeout=TIMEOUT)
        assert 1 <= len(batch) <= max_count
        got.extend(batch)
    assert len(got) == n, f"{len(got) - n} packets more than expected"
    return got


@pytest.mark.parametrize("batch_io", IO_PATHS)
def test_publish_many_delivers_every_message_in_order(clients, batch_io):
    sub = clients(batch_io=batch_io)
    pub = clients(batch_io=batch_io)
    assert pub.batch_io is batch_io
    sub.flood(hard="block")
    sub.subscribe("many/")
    sub.sync(TIMEOUT)
    sent = numbered(3000)
    # a generator of str and bytes keys, str and bytes payloads, beyond one sendmmsg (1024)
    assert pub.publish_many((k, p) for k, p in sent) == 3000
    assert pub.publish_many([("many/s", "text"), (b"many/e", b"")]) == 2
    assert pub.publish_many([]) == 0
    got = take(sub, 3002, max_count=7)
    assert got[:3000] == [Message(k, p) for k, p in sent]
    assert got[3000:] == [Message(b"many/s", b"text"), Message(b"many/e", b"")]


@pytest.mark.parametrize("batch_io", IO_PATHS)
def test_publish_many_on_a_full_socket_loses_nothing(clients, batch_io):
    """The reader does not read (soft/block: the server stops reading the publisher), so the
    publisher's socket fills: MSG_DONTWAIT stops there and says how far it got; a blocking
    publish_many in another thread waits and sends the rest; the reader gets all, in order."""
    import threading

    sub = clients(batch_io=batch_io)
    pub = clients(batch_io=batch_io)
    sub.flood(soft="block", hard="block")
    sub.subscribe("many/")
    sub.sync(TIMEOUT)
    sent = numbered(5000, size=4000)  # 20 MB: far more than the sockets and the server hold
    first = pub.publish_many(sent, socket.MSG_DONTWAIT)
    assert 0 < first < len(sent), "the publisher's socket never filled"
    done: list = []
    t = threading.Thread(target=lambda: done.append(pub.publish_many(sent[first:])), daemon=True)
    t.start()
    got = take(sub, len(sent), max_count=100)
    t.join(TIMEOUT)
    assert done == [len(sent) - first]
    assert [m.payload for m in got] == [p for _, p in sent]


@pytest.mark.parametrize("batch_io", IO_PATHS)
def test_publish_many_refuses_bad_input_before_sending_anything(clients, batch_io):
    sub = clients()
    pub = clients(batch_io=batch_io)
    sub.subscribe("many/")
    sub.sync(TIMEOUT)
    with pytest.raises(ProtocolError, match="NUL"):
        pub.publish_many([("many/a", b"1"), ("many/\0b", b"2")])
    with pytest.raises(ProtocolError, match="exceeds"):
        pub.publish_many([("many/a", b"1"), ("many/a", b"x" * MAX_PACKET)])
    with pytest.raises(ProtocolError, match="empty packet"):
        pub.send_packets([b"MSG many/a\0ok", b""])
    with pytest.raises(TypeError, match="message 1 is not a .key, payload. pair"):
        pub.publish_many([("many/a", b"1"), ("many/a",)])
    with pytest.raises(TypeError, match="message 0 is not"):
        pub.publish_many([b"MSG many/a\0raw"])
    with pytest.raises(ValueError, match="max_count"):
        sub.receive_many(0)
    pub.publish("many/end", b"")
    assert sub.receive_many(timeout=TIMEOUT) == [Message(b"many/end", b"")]  # nothing before it


@pytest.mark.parametrize("batch_io", IO_PATHS)
def test_publish_many_to_a_closed_connection_says_why(clients, batch_io):
    c = clients(batch_io=batch_io)
    c.subscribe(b"!/cred/1/2/3/not-mine")  # another pid's secret space: disconnected
    with pytest.raises(ConnectionClosed) as info:
        c.whoami(TIMEOUT)
    with pytest.raises(ConnectionClosed, match="forbidden_subscription") as info:
        c.publish_many(numbered(10))
    assert info.value.notice.reason == "forbidden_subscription"
    with pytest.raises(ConnectionClosed, match="forbidden_subscription"):
        c.publish("many/a", b"")  # once the server said it closes, every send says so


@pytest.mark.parametrize("batch_io", IO_PATHS)
def test_receive_many_keeps_order_with_set_aside_packets_and_errors(clients, batch_io):
    """Packets whoami() set aside come first; a too-large packet in a batch is raised in its
    place, a disconnect after the packets before it; nothing is lost on the way."""
    c = clients(batch_io=batch_io, max_packet=1000)
    pub = clients()
    c.subscribe("many/")
    c.sync(TIMEOUT)
    pub.publish_many(numbered(5))
    pub.sync(TIMEOUT)
    c.whoami(TIMEOUT)  # the five are set aside now
    pub.publish_many([("many/a", b"before"), ("many/big", b"x" * 2000), ("many/b", b"after")])
    pub.sync(TIMEOUT)
    assert [m.payload for m in take(c, 5)] == [p for _, p in numbered(5)]
    assert c.receive_many(timeout=TIMEOUT) == [Message(b"many/a", b"before")]
    with pytest.raises(PacketTooLarge):
        c.receive_many(timeout=TIMEOUT)
    assert c.receive_many(timeout=TIMEOUT) == [Message(b"many/b", b"after")]
    with pytest.raises(BlockingIOError):
        c.receive_many(flags=socket.MSG_DONTWAIT)
    with pytest.raises(TimeoutError):
        c.receive_many(timeout=0.01)
    # three messages in the socket (sent when the server finished pub's batch, before pub's
    # reply), then a forbidden pattern: the server's last words follow them, then the end
    pub.publish_many(numbered(3))
    pub.sync(TIMEOUT)
    c.subscribe(b"!/cred/1/2/3/not-mine")
    got = []
    with pytest.raises(ConnectionClosed, match="forbidden_subscription"):
        while True:
            got.extend(c.receive_many(timeout=TIMEOUT))
    assert [m.payload for m in got] == [p for _, p in numbered(3)]
    with pytest.raises(ConnectionClosed):
        c.receive_many(timeout=TIMEOUT)


def test_batch_io_true_without_the_extension_is_one_clear_error(bus):
    code = ("import sbus.client, sys\n"
            "try:\n    sbus.client.connect(sys.argv[1], batch_io=True)\n"
            "except ValueError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code, bus.address], capture_output=True, text=True,
                         env=dict(os.environ, SBUS_PURE_PYTHON="1"), timeout=TIMEOUT)
    assert "batch_io=True needs the sbus._speedups extension" in out.stdout, out.stderr[-300:]


@pytest.mark.parametrize("batch_io", IO_PATHS)
def test_receive_many_when_the_server_dies(start_bus, batch_io):
    """kill -9 of the server: what was in the socket comes out, then ConnectionClosed (never
    an empty batch)."""
    import signal

    srv = start_bus()
    c = sbus.client.connect(srv.address, batch_io=batch_io)
    pub = sbus.client.connect(srv.address)
    try:
        c.subscribe("many/")
        c.sync(TIMEOUT)
        pub.publish_many(numbered(3))
        pub.sync(TIMEOUT)  # the three are in c's socket
        srv.stop(signal.SIGKILL)
        got = []
        with pytest.raises(ConnectionClosed):
            while True:
                batch = c.receive_many(timeout=TIMEOUT)
                assert batch, "an empty batch"
                got.extend(batch)
        assert [m.payload for m in got] == [p for _, p in numbered(3)]
        with pytest.raises(ConnectionClosed):
            c.publish_many(numbered(1))
    finally:
        c.close()
        pub.close()
