"""`twistd sbus-msgbus`: a real bus, a real gateway process, msgbus clients over TCP.

The gateway listens on an ephemeral loopback port (`tcp:0`) and logs it; the
tests wait for that line and for its bus connection (polled, with a
timeout). Absence of a delivery is proven by a marker sent afterwards on the
same path: the gateway handles one client's commands in order and writes to
each client in order.
"""

from __future__ import annotations

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
                     (b"send x foo", b"bad length"), (b"send 3", b"channel"),
                     (b"ping now", b"no arguments")):
        reply = sender.command(bad)
        assert reply.startswith(b"error ") and why in reply, (bad, reply)
        assert b"\n" not in reply
    assert sender.command(b"ping") == b"pong"

    # several channels, prefix delivery, once per client
    sender.send(b"send 5 foo fooq bar\nhello")
    assert listener.message() == b"hello"
    sender.send(b"send 4 fooz\nnope")                  # not a prefix of fooquux nor bar
    sender.send(b"send 3 fooquux\nend")                # the marker: equal channel
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
    sender.send(b"send 1 bar\nx")
    assert sender.command(b"ping") == b"pong"            # the gateway has handled the send
    assert listener.command(b"listen") == b"ack listen"   # an 'x' would have come before this
    assert listener.command(b"unsub bar") == b"ack unsub"
    sender.send(b"send 1 bar\ny")
    sender.send(b"send 1 fooquux\nz")
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
    c.send(b"send 100 a\n" + b"x" * 100)
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
    other.send(b"send 4 q\nnext")
    assert listener.message() == b"next"
