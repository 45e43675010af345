"""`twistd sbus-msgbus`: a real bus, a real gateway process, msgbus clients over TCP.

The gateway listens on an ephemeral loopback port (`tcp:0`) and logs it; the
tests wait for that line and for its bus connection (polled, with a
timeout). Absence of a delivery is proven by a marker sent afterwards on the
same path: the gateway handles one client's commands in order and writes to
each client in order.
"""

from __future__ import annotations

import os
import re
import socket

import pytest

from helpers import connect, msg, recv, send, sub, sync
from test_bridge import TIMEOUT, TwistdProcess


class MsgbusClient:
    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def line(self) -> bytes:
        while b"\n" not in self.buf:
            assert self._fill(), f"closed; buffer {self.buf!r}"
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            assert self._fill(), f"closed; buffer {self.buf!r}"
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def command(self, line: bytes) -> bytes:
        self.send(line + b"\n")
        return self.line()

    def send_message(self, data: bytes) -> None:
        """`send X CH...\n` + X bytes; both of the gateway's `ack send` lines come back."""
        head, _, body = data.partition(b"\n")
        self.send(head + b"\n")
        assert self.line() == b"ack send", head
        self.send(body)
        assert self.line() == b"ack send", head

    def message(self) -> bytes:
        """The next `recv X` + X bytes."""
        head = self.line()
        m = re.fullmatch(rb"recv (\d+)", head)
        assert m, head
        return self.read(int(m.group(1)))

    def closed(self) -> bytes:
        """Read to EOF; return what came first."""
        while self._fill():
            pass
        return self.buf

    def close(self):
        self.sock.close()


@pytest.fixture
def gateway(tmp_path, bus):
    procs = []

    def start(*extra):
        p = TwistdProcess(["sbus-msgbus", "--bus", bus.address,
                           "--port", "tcp:0:interface=127.0.0.1", *extra], tmp_path)
        procs.append(p)
        text = p.wait_log(r"msgbus gateway listening on 127\.0\.0\.1:\d+")
        p.wait_log(r"connected to the bus .*subscribed to msgbus/")
        p.port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", text).group(1))
        return p

    yield start
    for p in procs:
        p.stop()


def test_trie():
    from sbus.services.msgbus import ChannelTrie

    t = ChannelTrie()
    assert t.add(b"fooquux", "L") and t.add(b"foo", "M") and t.add(b"bar", "L")
    assert not t.add(b"foo", "M")
    assert t.collect(b"foo", set()) == {"L", "M"}
    assert t.collect(b"fooq", set()) == {"L"}
    assert t.collect(b"", set()) == {"L", "M"}
    assert t.collect(b"fooquuxx", set()) == set()
    assert t.remove(b"fooquux", "L") and not t.remove(b"fooquux", "L")
    assert t.collect(b"foo", set()) == {"M"}
    t.remove(b"foo", "M")
    t.remove(b"bar", "L")
    assert not t and t.channels == 0


def test_radix_trie_against_a_model():
    """Random adds and removes of aliasing channels: collect() matches a plain set, and
    removing everything leaves only the root (no node is kept for nothing)."""
    import random

    from sbus.services.msgbus import ChannelTrie

    for seed in range(200):
        r = random.Random(seed)
        t, model = ChannelTrie(), set()
        for _ in range(150):
            ch = bytes(r.choice(b"ab") for _ in range(r.randint(0, 5)))
            m = r.randint(0, 3)
            if r.random() < 0.6:
                assert t.add(ch, m) == ((ch, m) not in model)
                model.add((ch, m))
            else:
                assert t.remove(ch, m) == ((ch, m) in model)
                model.discard((ch, m))
            p = bytes(r.choice(b"ab") for _ in range(r.randint(0, 4)))
            assert t.collect(p, set()) == {mm for c, mm in model if c.startswith(p)}, seed
            assert t.channels == len(model)
        for c, m in list(model):
            t.remove(c, m)
        assert not t and t.nodes() == 1, seed
    t = ChannelTrie()
    t.add(b"x" * 60_000, "L")
    assert t.nodes() == 2                     # one node per channel, not per byte


def test_readme_session_with_sbus_both_ways(bus, gateway):
    gw = gateway()
    listener, sender = MsgbusClient(gw.port), MsgbusClient(gw.port)
    observer = connect(bus.address)                    # an sbus client watching msgbus/
    send(observer, sub(b"msgbus/"))
    sync(observer)

    assert listener.command(b"sub fooquux bar") == b"ack sub"
    assert listener.command(b"listen") == b"ack listen"
    assert listener.command(b"ping") == b"pong"
    # the sender also listens on foo: it must never get its own message
    assert sender.command(b"sub foo") == b"ack sub"
    assert sender.command(b"listen") == b"ack listen"

    # errors: the connection stays usable
    for bad, why in ((b"bogus", b"unknown command"), (b"", b"empty"), (b"sub", b"channel"),
                     (b"send 3\nab", b"channel"), (b"ping now", b"no arguments")):
        reply = sender.command(bad)
        assert reply.startswith(b"error ") and why in reply, (bad, reply)
        assert b"\n" not in reply
    assert sender.command(b"ping") == b"pong"

    # several channels, prefix delivery, once per client
    sender.send_message(b"send 5 foo fooq bar\nhello")
    assert listener.message() == b"hello"
    sender.send_message(b"send 4 fooz\nnope")                  # not a prefix of fooquux nor bar
    sender.send_message(b"send 3 fooquux\nend")                # the marker: equal channel
    assert listener.message() == b"end"
    assert sender.command(b"ping") == b"pong"          # nothing of its own came back

    # sbus saw one publish per channel named
    got = [recv(observer) for _ in range(5)]
    assert got == [msg(b"msgbus/foo", b"hello"), msg(b"msgbus/fooq", b"hello"),
                   msg(b"msgbus/bar", b"hello"), msg(b"msgbus/fooz", b"nope"),
                   msg(b"msgbus/fooquux", b"end")]

    # sbus -> gateway: msgbus/<name> as if sent to <name>, with prefix semantics
    pub = connect(bus.address)
    send(pub, msg(b"msgbus/fooqu", b"from sbus"))
    send(pub, msg(b"msgbus/fooquuxx", b"too long"))    # not a prefix of fooquux
    send(pub, msg(b"other/key", b"not msgbus"))
    send(pub, msg(b"msgbus/ba", b"marker"))
    assert listener.message() == b"from sbus"
    assert listener.message() == b"marker"
    # the sender (on foo) got none of these ('fooqu' is no prefix of 'foo'): its first is this
    send(pub, msg(b"msgbus/f", b"for both"))
    assert sender.message() == b"for both"
    assert listener.message() == b"for both"

    # unlisten / unsub
    assert listener.command(b"unlisten") == b"ack unlisten"
    sender.send_message(b"send 1 bar\nx")
    assert sender.command(b"ping") == b"pong"            # the gateway has handled the send
    assert listener.command(b"listen") == b"ack listen"   # an 'x' would have come before this
    assert listener.command(b"unsub bar") == b"ack unsub"
    sender.send_message(b"send 1 bar\ny")
    sender.send_message(b"send 1 fooquux\nz")
    assert listener.message() == b"z"

    gw.stop()
    assert re.search(r"stopped: clients=\d+; messages from clients=6 from bus=4; ", gw.log()), gw.log()
    for c in (listener, sender):
        c.close()
    observer.close()
    pub.close()


def test_oversize_send_closes(gateway):
    gw = gateway("--max-message", "100")
    c, other = MsgbusClient(gw.port), MsgbusClient(gw.port)
    c.send_message(b"send 100 a\n" + b"x" * 100)
    assert c.command(b"ping") == b"pong"              # 100 is allowed
    c.send(b"send 101 a\n")
    rest = c.closed()
    assert rest.startswith(b"error ") and b"101" in rest and rest.endswith(b"\n"), rest
    assert other.command(b"ping") == b"pong"          # nobody else noticed


def test_default_limit_is_one_bus_packet(gateway):
    gw = gateway()
    c = MsgbusClient(gw.port)
    limit = 409600 - len(b"MSG msgbus/\0") - len(b"chan")
    assert c.command(b"sub chan") == b"ack sub"
    c.send(b"send %d chan\n" % (limit + 1))
    assert b"over the limit of %d bytes" % limit in c.closed()


def test_long_line_closes(gateway):
    gw = gateway("--max-line", "1024")
    c = MsgbusClient(gw.port)
    c.send(b"sub " + b"c" * 2000)                      # no newline yet: already too long
    rest = c.closed()
    assert rest.startswith(b"error line too long"), rest
    c2 = MsgbusClient(gw.port)
    assert c2.command(b"sub " + b"c" * 1000) == b"ack sub"


def test_sender_vanishing_mid_message_sends_nothing(bus, gateway):
    gw = gateway()
    listener, sender = MsgbusClient(gw.port), MsgbusClient(gw.port)
    assert listener.command(b"sub q") == b"ack sub"
    assert listener.command(b"listen") == b"ack listen"
    sender.send(b"send 10 q\nhalf")
    sender.close()
    other = MsgbusClient(gw.port)
    other.send_message(b"send 4 q\nnext")
    assert listener.message() == b"next"


# ---------------------------------------------------------------- attacks (issue 11 item 6, issue 16 item 3)


def test_a_refused_send_never_runs_its_payload(gateway):
    gw = gateway()
    c = MsgbusClient(gw.port)
    # 'send 10' names no channel: refused, but its 10 bytes are a message, not commands
    c.send(b"send 10\nping\nping\nping\n")
    assert c.line().startswith(b"error send needs")
    assert c.line() == b"pong"                  # the third ping only: after the 10 bytes
    assert c.command(b"listen") == b"ack listen"  # no second pong came before this
    # a channel over the length limit: refused the same way
    c.send(b"send 5 " + b"c" * 5000 + b"\nping\nping\n")
    assert b"over the limit" in c.line()
    assert c.line() == b"pong"
    # a length that is no number: where the message ends is unknown, so the connection closes
    c.send(b"send 1O chan\nping\n")
    rest = c.closed()
    assert rest.startswith(b"error send: bad length") and b"pong" not in rest, rest


def test_a_half_closed_client_gets_its_replies(gateway):
    gw = gateway()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=TIMEOUT) as s:
        s.sendall(b"ping\nsub a\nping\n")          # what `printf ... | nc -N` does
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    assert got == b"pong\nack sub\npong\n"


def test_backlog_default_and_option(gateway):
    import shutil
    import subprocess

    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed")

    def backlog(port):
        out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
        return int(out.split()[2])  # State Recv-Q Send-Q: Send-Q is the backlog of a listener

    assert backlog(gateway().port) >= 1024
    assert backlog(gateway("--backlog", "2000").port) == 2000


def test_thousand_simultaneous_connects_are_served(gateway):
    import selectors
    import time

    gw = gateway()
    t0 = time.monotonic()
    socks = []
    try:
        for _ in range(1000):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", gw.port))
            socks.append(s)
        sel = selectors.DefaultSelector()
        for s in socks:
            s.send  # noqa: B018
            sel.register(s, selectors.EVENT_WRITE)
        pending = set(socks)
        while pending:
            events = sel.select(TIMEOUT)
            assert events, f"{len(pending)} of 1000 connects still pending after {TIMEOUT}s"
            for key, _ in events:
                sel.unregister(key.fileobj)
                pending.discard(key.fileobj)
                key.fileobj.setblocking(True)
                key.fileobj.settimeout(TIMEOUT)
                key.fileobj.sendall(b"ping\n")
        for s in socks:
            assert s.recv(16) == b"pong\n"
        elapsed = time.monotonic() - t0
    finally:
        for s in socks:
            s.close()
    assert elapsed < 8, elapsed  # was 11 s with a backlog of 50 (SYN retries); ~1 s here


def test_another_uid_is_refused_on_loopback(bus, gateway):
    from helpers import run_as

    gw = gateway()
    owner = MsgbusClient(gw.port)
    assert owner.command(b"sub payroll") == b"ack sub"
    assert owner.command(b"listen") == b"ack listen"
    observer = connect(bus.address)
    send(observer, sub(b"msgbus/"))
    sync(observer)
    pub = connect(bus.address)

    def attacker():
        s = socket.create_connection(("127.0.0.1", gw.port), timeout=TIMEOUT)
        s.sendall(b"sub payroll\nlisten\nsend 8 cmd/shutdown\nshutdown")
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except OSError as e:
            got += f" ({e})".encode()
        return repr(got)

    got = run_as(65534, 65534, attacker)
    assert got.startswith("b'error uid 65534") and "may not open the bus" in got, got
    assert "pong" not in got and "ack" not in got and "recv" not in got, got
    # nothing was published, and the owner is still served (a marker proves the order)
    send(pub, msg(b"msgbus/payroll", b"salary"))
    assert owner.message() == b"salary"
    assert recv(observer) == msg(b"msgbus/payroll", b"salary")
    gw.wait_log(r"refused msgbus client 127\.0\.0\.1:\d+: uid 65534 \(sock_diag\) may not open")
    observer.close()
    pub.close()


def test_unix_port_takes_the_bus_mode(bus, gateway, tmp_path):
    import stat as stat_mod

    from helpers import run_as

    path = tmp_path / "msgbus.sock"
    p = TwistdProcess(["sbus-msgbus", "--bus", bus.address, "--port", f"unix:{path}"], tmp_path)
    try:
        p.wait_log(r"msgbus gateway listening on")
        assert stat_mod.S_IMODE(os.stat(bus.address).st_mode) == 0o700
        assert stat_mod.S_IMODE(os.stat(path).st_mode) == 0o700    # Twisted's default was 0666
        os.chmod(tmp_path, 0o755)

        def attacker():
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(str(path))
            except PermissionError:
                return "EACCES"
            s.sendall(b"ping\n")
            return repr(s.recv(100))

        assert run_as(65534, 65534, attacker) == "EACCES"
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(path))
            s.sendall(b"ping\n")
            assert s.recv(100) == b"pong\n"
    finally:
        p.stop()


def test_a_taken_port_is_fatal_and_logged(bus, tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        p = TwistdProcess(["sbus-msgbus", "--bus", bus.address, "--port",
                           f"tcp:{port}:interface=127.0.0.1"], tmp_path)
        try:
            code = p.proc.wait(TIMEOUT)
        finally:
            p.stop()
    assert code != 0
    log = p.log()
    assert re.search(rf"cannot listen on tcp:{port}:interface=127.0.0.1: .*[Aa]ddress already in use", log), log
    assert "Traceback" not in log, log


def test_channel_memory_is_bounded(gateway):
    def rss(pid):
        with open(f"/proc/{pid}/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) * 1024

    gw = gateway()
    c = MsgbusClient(gw.port)
    assert c.command(b"ping") == b"pong"
    before = rss(gw.proc.pid)
    for i in range(5):                              # 60 KB channels: one trie node per byte before
        assert b"over the limit" in c.command(b"sub " + bytes([65 + i]) * 60_000)
    assert b"over the limit of 1024 channels" in c.command(b"sub " + b" ".join(b"%d" % i for i in range(2000)))
    # within the limits: 1,024 channels of 256 bytes (the per-client byte budget)
    for i in range(16):
        line = b"sub " + b" ".join(b"%03d%03d" % (i, j) + b"x" * 250 for j in range(64))
        assert c.command(line) == b"ack sub"
    assert b"over the limit" in c.command(b"sub one-more-channel")
    grown = rss(gw.proc.pid) - before
    assert grown < 30 << 20, f"gateway grew by {grown >> 20} MiB"


def test_a_client_of_the_original_server_gets_both_ack_send_lines(bus, gateway):
    """The original msgbus server answers `ack send` after the `send` line and again after the
    payload; a client that waits for them (before sending the bytes, before its next
    command) hung on the gateway. Also as the original: `error TEXT` from a client is not
    answered, `send 0` is an empty message."""
    gw = gateway()
    listener, sender = MsgbusClient(gw.port), MsgbusClient(gw.port)
    assert listener.command(b"sub chan") == b"ack sub"
    assert listener.command(b"listen") == b"ack listen"
    assert sender.command(b"send 5 chan") == b"ack send"   # the original's go-ahead
    sender.send(b"hello")
    assert sender.line() == b"ack send"                      # delivered
    assert listener.message() == b"hello"
    assert sender.command(b"send 0 chan") == b"ack send"
    assert sender.line() == b"ack send"
    assert listener.message() == b""
    sender.send(b"error something went wrong on my side\n")  # reported, not answered
    assert sender.command(b"ping") == b"pong"
    assert "something went wrong on my side" in gw.log()
