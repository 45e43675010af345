"""Bad input through a real server (docs/protocol.md "Packets"): the offender is disconnected with
one log line naming its pid and uid and the reason; everyone else is served."""

from __future__ import annotations

import os
import re

import pytest

from helpers import (  # noqa: F401
    MAX_PACKET, Agent, cmsg, connect, mbus, msg, recv, send, served, set_big_buffers, stats, sub,
    sync, unique, unsub, wait_closed, wait_offender_logged, wait_stats,
)

BAD = [
    # (id, packet, words one of which the log line must contain)
    ("unknown-type", b"HELLO world", ("unknown", "type", "malformed", "invalid")),
    ("lowercase-sub", b"sub x", ("unknown", "type", "malformed", "invalid")),
    ("sub-without-space", b"SUBx", ("unknown", "type", "malformed", "invalid")),
    ("msg-without-space", b"MSG", ("unknown", "type", "malformed", "invalid", "nul")),
    ("binary", b"\0\xff\x00MSG a\0b", ("unknown", "type", "malformed", "invalid")),
    ("bare-sub", b"SUB", ("unknown", "type", "malformed", "invalid")),
    ("bare-unsub", b"UNSUB", ("unknown", "type", "malformed", "invalid")),
    ("bare-cmsg", b"CMSG", ("unknown", "type", "malformed", "invalid")),
    ("cmsg-nul-no-space", b"CMSG\0x", ("unknown", "type", "malformed", "invalid")),
    ("msg-without-nul", b"MSG key-but-no-nul", ("nul", "malformed", "invalid")),
    ("msg-empty-without-nul", b"MSG ", ("nul", "malformed", "invalid")),
    ("bang-in-key", b"MSG a/!/b\0x", ("!",)),
    ("bang-leading", b"MSG !/x\0x", ("!",)),
    ("bang-trailing", b"MSG a/!/\0x", ("!",)),
    ("cred-star", b"SUB !/cred/*/*/*/", ("cred", "!", "secret")),
    ("cred-truncated", b"SUB !/cred/", ("cred", "!", "secret")),
]


class Watch:
    """An unrelated subscriber/publisher pair that must keep being served."""

    def __init__(self, bus):
        self.key = unique("watch/").encode()
        self.sub, self.pub = connect(bus.address), connect(bus.address)
        send(self.sub, sub(self.key))
        sync(self.sub)
        self.n = 0

    def check(self):
        self.n += 1
        send(self.pub, msg(self.key, b"%d" % self.n))
        assert recv(self.sub) == msg(self.key, b"%d" % self.n)

    def close(self):
        self.sub.close()
        self.pub.close()


@pytest.mark.parametrize("packet,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_packet_disconnects_offender_only(mbus, packet, words):
    watch = Watch(mbus)
    with Agent(mbus.address) as bad:
        g, u, p = bad.whoami()
        bad.send(sub(b""))
        bad.sync()
        watch.check()
        bad.send(packet)
        assert bad.wait_closed(), f"{packet!r} did not get its sender disconnected"
        lines = wait_offender_logged(mbus, p, u, words)
        # "one log line": the offence is not logged over and over
        assert len(lines) <= 2, lines
    watch.check()
    served(mbus.address)
    assert mbus.proc.poll() is None
    watch.close()


def test_oversize_packet_disconnects_offender_only(mbus):
    watch = Watch(mbus)
    with Agent(mbus.address, big=True) as bad:
        g, u, p = bad.whoami()
        key = unique("big/").encode()
        watch_big = connect(mbus.address, big=True)
        send(watch_big, sub(key))
        sync(watch_big)
        ok = msg(key, b"x" * (MAX_PACKET - len(msg(key))))
        bad.send(ok)  # exactly the maximum is fine ...
        assert recv(watch_big) == ok
        assert bad.sync() == []
        too_big = msg(key, b"y" * (MAX_PACKET + 1 - len(msg(key))))
        assert len(too_big) == MAX_PACKET + 1
        bad.send(too_big)  # ... one byte more is not
        assert bad.wait_closed()
        wait_offender_logged(mbus, p, u, ("409601", "409600", "size", "large", "long", "limit", "trunc", "max"))
        # nobody got a truncated copy
        send(watch.pub, msg(key, b"after"))
        assert recv(watch_big) == msg(key, b"after")
        watch_big.close()
    watch.check()
    watch.close()


def test_much_larger_packet_is_detected_too(mbus):
    key = unique("huge/").encode()
    w = connect(mbus.address, big=True)
    send(w, sub(key))
    sync(w)
    with Agent(mbus.address, big=True) as bad:
        g, u, p = bad.whoami()
        bad.send(msg(key, b"z" * (MAX_PACKET * 2)))
        assert bad.wait_closed()
        wait_offender_logged(mbus, p, u)
    s = connect(mbus.address)
    send(s, msg(key, b"after"))
    assert recv(w) == msg(key, b"after")  # no (truncated) copy of the huge one before it
    w.close()
    s.close()


def test_bang_inside_a_word_is_fine(mbus):
    """`!` is only reserved next to a `/`: `a/b!c` is an ordinary key."""
    base = unique("bang/").encode()
    s, p = connect(mbus.address), connect(mbus.address)
    send(s, sub(base + b"/"))
    sync(s)
    send(p, msg(base + b"/b!c", b"1"), msg(base + b"/x!!y/z", b"2"))
    assert recv(s) == msg(base + b"/b!c", b"1")
    assert recv(s) == msg(base + b"/x!!y/z", b"2")
    assert sync(p) == []
    s.close()
    p.close()


def test_unsub_of_pattern_not_held_is_ignored(mbus):
    key = unique("unsub/").encode()
    s, p = connect(mbus.address), connect(mbus.address)
    send(s, unsub(key), unsub(b""), unsub(b"never/held/*"), sub(key))
    assert sync(s) == []  # still connected
    send(p, msg(key, b"still served"))
    assert recv(s) == msg(key, b"still served")
    # and an UNSUB of something else leaves what is held alone
    send(s, unsub(key + b"/other"))
    sync(s)
    send(p, msg(key, b"again"))
    assert recv(s) == msg(key, b"again")
    s.close()
    p.close()


def test_unknown_cmsg_is_ignored(mbus):
    key = unique("cmsg/").encode()
    s, p = connect(mbus.address), connect(mbus.address)
    send(s, sub(key))
    sync(s)
    send(s, cmsg(b"no/such/control"), cmsg(b"blocking/soft/nonsense", b"x"), cmsg(b"echo/maybe"),
         cmsg(b"", b""), cmsg(b"order/"), cmsg(b"!/cred/whoamI"))
    assert sync(s) == []  # still connected, no reply to any of them
    send(p, msg(key, b"still served"))
    assert recv(s) == msg(key, b"still served")
    s.close()
    p.close()


def test_client_killed_mid_stream_leaves_others_served(mbus):
    watch = Watch(mbus)
    key = unique("flood/").encode()
    listener = connect(mbus.address, big=True)
    send(listener, sub(key))
    sync(listener)
    before = stats(listener)["clients"]
    victim = Agent(mbus.address)
    try:
        victim.flood(key, 2000)  # subscribed to everything, publishing without reading
        # it really was streaming: the listener gets its messages
        first = recv(listener)
        assert first.startswith(msg(key, b"0:"))
    finally:
        victim.kill()
    watch.check()
    served(mbus.address)
    # its connection and its subscriptions went away
    wait_stats(listener, lambda st: st["clients"] == before and all(q["pid"] != victim.pid for q in st["queues"]))
    # the listener still gets new traffic (after whatever of the victim's was in flight)
    send(watch.pub, msg(key, b"end"))
    while True:
        pkt = recv(listener)
        assert pkt, "listener disconnected"
        if pkt == msg(key, b"end"):
            break
        assert re.match(rb"MSG " + re.escape(key) + rb"\0\d+:x+$", pkt)
    watch.check()
    assert mbus.proc.poll() is None
    listener.close()
    watch.close()


def test_client_closing_with_unread_queue_leaves_others_served(mbus):
    """A subscriber with a full queue that just closes: its queue is freed, nobody notices."""
    watch = Watch(mbus)
    key = unique("gone/").encode()
    s = connect(mbus.address)
    send(s, sub(key))
    sync(s)
    p = connect(mbus.address, big=True)
    for i in range(200):
        send(p, msg(key, b"%d" % i + b"q" * 8000))
    sync(p)
    s.close()
    q = connect(mbus.address)
    wait_stats(q, lambda st: all(x["queued_bytes"] == 0 for x in st["queues"]))
    watch.check()
    q.close()
    p.close()
    watch.close()


@pytest.mark.parametrize("bad", [b"BOGUS", b"MSG no-nul", b"MSG a/!/b\0x", b"SUB !/cred/*/*/*/", "oversize"])
def test_nothing_after_the_bad_packet_is_processed(mbus, bad):
    """Packets queued behind the offending one (same read batch) must not be acted on."""
    key = unique("after/").encode()
    w = connect(mbus.address)
    send(w, sub(key))
    sync(w)
    c = connect(mbus.address, big=True)
    if bad == "oversize":
        bad = msg(key, b"o" * MAX_PACKET)
    # back to back: all in the server's receive queue at once
    burst = [msg(key, b"before"), bad, msg(key, b"after-1"), sub(b""), msg(key, b"after-2"),
             *[msg(key, b"after-%d" % i) for i in range(3, 50)]]
    try:
        for pkt in burst:
            c.send(pkt)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server already dropped us: fine, as long as it acted on nothing after `bad`
    assert recv(w) == msg(key, b"before")
    try:
        wait_closed(c)
    except ConnectionResetError:
        pass
    # routing is synchronous: anything the offender's later packets caused is already written
    assert sync(w) == []
    w.close()
