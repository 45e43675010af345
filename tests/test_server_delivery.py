"""Delivery through a real server (docs/protocol.md "Delivery"): exact bytes, one copy, duplicates,
echo, per-publisher order, CMSG never forwarded, whoami."""

from __future__ import annotations

import os

from helpers import (  # noqa: F401
    MAX_PACKET, Agent, cmsg, connect, mbus, msg, recv, send, sub, sync, unique, unsub, whoami,
)


def _pair(bus, big=False):
    return connect(bus.address, big=big), connect(bus.address, big=big)


def test_packet_delivered_byte_for_byte(mbus):
    key = unique("bytes/").encode() + b"/\xff\x01 \xc3(*"
    s, p = _pair(mbus)
    send(s, sub(key))
    sync(s)
    packets = [
        msg(key, b""),                                   # empty payload
        msg(key, b"\0"),                                 # payload is one NUL
        msg(key, b"a\0b\0\0c\0"),                        # NULs inside the payload
        msg(key, bytes(range(256)) * 4),                 # every byte value
        msg(key, b"\0SUB x\0MSG y\0z\0CMSG !/cred/whoami"),  # looks like other packets
        msg(key, b"\n\r\t trailing spaces  "),
    ]
    send(p, *packets)
    assert [recv(s) for _ in packets] == packets
    assert sync(s) == []
    s.close()
    p.close()


def test_largest_packet_delivered_intact(mbus):
    key = unique("big/").encode()
    s, p = _pair(mbus, big=True)
    send(s, sub(key))
    sync(s)
    head = msg(key)
    body = bytes((i * 7 + 3) % 256 for i in range(MAX_PACKET - len(head)))
    big = head + body
    assert len(big) == MAX_PACKET
    send(p, big, msg(key, b"after"))
    got = recv(s)
    assert len(got) == MAX_PACKET
    assert got == big
    assert recv(s) == msg(key, b"after")
    # the publisher was not disconnected for it
    assert sync(p) == []
    s.close()
    p.close()


def test_one_copy_per_client_however_many_patterns_match(mbus):
    base = unique("one/").encode()
    key = base + b"/b/c"
    s, other, p = connect(mbus.address), connect(mbus.address), connect(mbus.address)
    patterns = [b"", base + b"/", base + b"/*/c", key, key, b"*/", base + b"/b/"]
    send(s, *[sub(x) for x in patterns])
    send(other, sub(key))
    sync(s)
    sync(other)
    send(p, msg(key, b"1"), msg(key, b"2"))
    assert recv(s) == msg(key, b"1")
    assert recv(s) == msg(key, b"2")
    assert recv(other) == msg(key, b"1")
    assert recv(other) == msg(key, b"2")
    # nothing more for either once the publisher's packets are all routed
    sync(p)
    assert sync(s) == []
    assert sync(other) == []
    for x in (s, other, p):
        x.close()


def test_duplicate_subscriptions_are_stored(mbus):
    key = unique("dup/").encode()
    marker = key + b"-marker"
    s, p = _pair(mbus)
    send(s, sub(key), sub(key), sub(marker))
    sync(s)
    send(p, msg(key, b"both"))
    assert recv(s) == msg(key, b"both")

    send(s, unsub(key))  # one instance left
    sync(s)
    send(p, msg(key, b"one left"), msg(marker))
    assert recv(s) == msg(key, b"one left")
    assert recv(s) == msg(marker)

    send(s, unsub(key))  # none left
    sync(s)
    send(p, msg(key, b"none left"), msg(marker))
    assert recv(s) == msg(marker)
    assert sync(s) == []

    send(s, sub(key))  # and it can come back
    sync(s)
    send(p, msg(key, b"back"))
    assert recv(s) == msg(key, b"back")
    s.close()
    p.close()


def test_echo_on_by_default(mbus):
    key = unique("echo/").encode()
    s = connect(mbus.address)
    send(s, sub(key), msg(key, b"to myself"))
    assert sync(s) == [msg(key, b"to myself")]
    # not to a sender that does not match
    send(s, msg(key + b"x", b"not mine"))
    assert sync(s) == []
    s.close()


def test_echo_off_and_on(mbus):
    key = unique("echo/").encode()
    s, other = _pair(mbus)
    send(s, sub(key))
    send(other, sub(key))
    sync(other)
    send(s, cmsg(b"echo/off"), msg(key, b"1"))
    assert sync(s) == []                      # no echo ...
    assert recv(other) == msg(key, b"1")      # ... but it was published
    # others' messages still arrive while echo is off
    send(other, msg(key, b"from other"))
    assert recv(s) == msg(key, b"from other")
    assert recv(other) == msg(key, b"from other")  # other's echo is still on
    send(s, cmsg(b"echo/on"), msg(key, b"2"))
    assert sync(s) == [msg(key, b"2")]
    assert recv(other) == msg(key, b"2")
    # near misses are unknown controls, ignored: echo stays on
    send(s, cmsg(b"echo/offx"), cmsg(b"echo/of"), cmsg(b"echo/off/"), cmsg(b"echo"), msg(key, b"2b"))
    assert sync(s) == [msg(key, b"2b")]
    assert recv(other) == msg(key, b"2b")
    # payload after the control key is ignored
    send(s, cmsg(b"echo/off", b"whatever"), msg(key, b"3"))
    assert sync(s) == []
    assert recv(other) == msg(key, b"3")
    s.close()
    other.close()


def test_per_publisher_order_with_many_messages(mbus):
    base = unique("order/").encode()
    subs = [connect(mbus.address, big=True) for _ in range(2)]
    pubs = [connect(mbus.address) for _ in range(3)]
    for s in subs:
        send(s, sub(base + b"/"))
        sync(s)
    n = 1500
    for i in range(n):  # interleave three publishers
        for j, p in enumerate(pubs):
            send(p, msg(b"%s/%d" % (base, j), b"%d" % i))
    for p in pubs:
        sync(p)
    for s in subs:
        seen = {0: [], 1: [], 2: []}
        for _ in range(3 * n):
            pkt = recv(s)
            head, payload = pkt.split(b"\0", 1)
            seen[int(head.rsplit(b"/", 1)[1])].append(int(payload))
        assert all(v == list(range(n)) for v in seen.values())
        assert sync(s) == []
    for x in subs + pubs:
        x.close()


def test_cmsg_is_never_forwarded(mbus):
    base = unique("cm/").encode()
    s, p = _pair(mbus)
    send(s, sub(b""), sub(base + b"/"))
    sync(s)
    send(p,
         cmsg(base + b"/x", b"payload"),
         cmsg(base + b"/x"),
         cmsg(b"", b"empty key"),
         cmsg(b"echo/off"),
         cmsg(b"server/nonsense", b"x"),
         msg(base + b"/marker", b"m"))
    assert recv(s) == msg(base + b"/marker", b"m")
    assert sync(s) == []
    # not even back to its sender, who subscribes to everything too
    send(p, sub(b""))
    send(p, cmsg(base + b"/y", b"z"))
    assert sync(p) == []
    s.close()
    p.close()


def test_whoami(mbus):
    s = connect(mbus.address)
    expected = b"CMSG !/cred/whoami\0!/cred/%d/%d/%d" % (os.getgid(), os.getuid(), os.getpid())
    send(s, cmsg(b"!/cred/whoami"))
    assert recv(s) == expected
    # with an (empty) payload part too, and without any subscription
    send(s, cmsg(b"!/cred/whoami", b""))
    assert recv(s) == expected
    send(s, cmsg(b"!/cred/whoami", b"ignored"))
    assert recv(s) == expected
    # near misses get no reply
    send(s, cmsg(b"!/cred/whoamix"), cmsg(b"!/cred/whoam"), cmsg(b"!/cred/whoami/"), cmsg(b"!/cred/whoami"))
    assert recv(s) == expected
    assert sync(s) == []
    s.close()


def test_whoami_names_the_connecting_process(mbus):
    with Agent(mbus.address) as a:
        assert a.pid != os.getpid()
        assert a.whoami() == (os.getgid(), os.getuid(), a.pid)
