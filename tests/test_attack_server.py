"""Attacks on a live server that held (issue 10/16 review, "attacksrv"): kept as regression tests.

The faults this review found have their tests beside the code they fixed
(test_router.py, test_router_wire.py, test_sbusd.py); see docs/security.md.
"""

from __future__ import annotations

import os
import socket

import pytest

from helpers import WHOAMI_REPLY, cmsg, connect, msg, send, stats, sub, sync, unique, wait_stats

MODES = {
    "queue-hard-discard": [],
    "stack-hard-discard": [b"order/stack"],
    "random-hard-discard": [b"order/random"],
    "soft-discard": [b"blocking/soft/discard"],
    "stack-soft-discard": [b"blocking/soft/discard", b"order/stack"],
    "random-soft-discard": [b"blocking/soft/discard", b"order/random"],
}


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_burst_into_a_slow_reader_every_drop_is_told_and_counted(bus, mode):
    """A subscriber with a small receive buffer reads nothing during a burst
    bigger than its queue, then reads: messages received plus the counts of
    its `server/dropped` notices equal what was published, exactly, and
    equal the server's drop counter, in every discarding mode and order."""
    key = unique("burst/").encode()
    s = connect(bus.address)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    send(s, *[cmsg(c) for c in MODES[mode]], sub(key))
    sync(s)
    pub = connect(bus.address, big=True)
    n = 20000
    payload = b"x" * 700  # 14 MB: past the 4 MiB queue cap and every socket buffer
    for i in range(n):
        pub.send(msg(key, b"%d." % i + payload))
    sync(pub, timeout=30)
    s.send(b"CMSG !/cred/whoami")
    got = noted = 0
    at_reply = None
    s.settimeout(30)
    while at_reply is None or got + noted < n:
        pk = s.recv(1 << 20)
        if pk.startswith(WHOAMI_REPLY):
            at_reply = got + noted
        elif pk.startswith(b"MSG "):
            got += 1
        elif pk.startswith(b"CMSG server/dropped\0"):
            count, first, last = pk.split(b"\0")[1:]
            assert first.startswith(key) and last.startswith(key)
            noted += int(count)
        else:
            raise AssertionError(f"unexpected packet {pk[:60]!r}")
    assert noted > 0 and got + noted == n
    if b"order/stack" not in MODES[mode]:  # a stack sends the reply before what was queued
        # every drop before the request is told before its reply (hard discard: the notice
        # waited for room and went after the reply, so a client's sync missed it)
        assert at_reply == n
    reason = "soft_discard" if "soft" in mode else "hard_discard"
    st = stats(pub)
    mine = [c for c in st["clients_list"] if c["pid"] == os.getpid()] if "clients_list" in st else None
    assert st["drops"].get(reason, 0) >= noted
    assert mine is None or sum(c["drops"].get(reason, 0) for c in mine) == noted
    s.close()
    pub.close()


@pytest.mark.parametrize("how", [socket.SHUT_RD, socket.SHUT_WR], ids=["shut-rd", "shut-wr"])
def test_a_half_closed_subscriber_is_let_go_and_holds_nothing(bus, how):
    """A `SUB ""` subscriber in `blocking/soft/block` that shuts down one
    direction of its socket and then sits there: the server ends it
    (`closed`), the publisher is not held, no queue is left behind."""
    s = connect(bus.address)
    send(s, cmsg(b"blocking/soft/block"), sub(b""))
    sync(s)
    s.shutdown(how)
    pub = connect(bus.address, big=True)
    for i in range(5000):
        pub.send(msg(b"k/x", b"x" * 2000))  # 10 MB: far past a held subscriber's queue
    sync(pub, timeout=30)
    st = wait_stats(pub, lambda st: st["clients"] == 1)
    assert st["queued_bytes"] == 0 if "queued_bytes" in st else True
    s.close()
    pub.close()
