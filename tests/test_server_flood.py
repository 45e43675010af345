"""Flood control through a real server (docs/protocol.md "Flood control").

Each test gets a fresh server (`bus`), so the global counters in
`CMSG server/stats` belong to the test. A subscriber that "never reads" is
simply a socket we don't read from until the test says so; the server's send
to it blocks once the kernel buffers are full (~1 MB here), after which the
flood-control modes decide.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time

import pytest

from helpers import (
    cmsg, connect, msg, recv, send, served, stats, sub, sync, total, unique, wait_closed,
    wait_offender_logged, wait_stats,
)

DEFAULT_QUEUE_BYTES = 4 * 1024 * 1024
DEFAULT_QUEUE_PACKETS = 16384
BIG = 64 * 1024


def numbered(key: bytes, i: int, size: int) -> bytes:
    head = msg(key, b"%d:" % i)
    return head + b"." * max(0, size - len(head))


def seq_of(key: bytes, packet: bytes) -> int:
    prefix = msg(key)
    assert packet.startswith(prefix), packet[:60]
    return int(packet[len(prefix):].split(b":", 1)[0])


def dropped(count: int, first: bytes, last: bytes) -> bytes:
    return b"CMSG server/dropped\0%d\0%s\0%s" % (count, first, last)


def read_n(sock, key, n):
    return [seq_of(key, recv(sock)) for _ in range(n)]


def subscriber(bus, key, *controls, big=False):
    s = connect(bus.address, big=big)
    send(s, *[cmsg(c) for c in controls], sub(key))
    assert sync(s) == []
    return s


def entry_of_victim(st):
    """The per-client stats entry of the flooded subscriber (the one with drops or a queue)."""
    return max(st["queues"], key=lambda q: (total(q.get("drops", {})), q["queued_bytes"], q["queued_packets"]))


@pytest.mark.parametrize("control", [b"blocking/soft/discard", b"blocking/soft/discard\0payload is ignored"])
def test_soft_discard_drops_without_blocking_the_publisher(bus, control):
    key = unique("d/").encode()
    s = subscriber(bus, key, control)
    p = connect(bus.address, big=True)
    n = 100
    for i in range(n):  # ~6.5 MB at a subscriber that does not read: must not block p
        send(p, numbered(key, i, BIG))
    sync(p)
    st = stats(connect(bus.address))
    drops = total(st["drops"])
    assert 0 < drops < n
    victim = entry_of_victim(st)
    assert victim["queued_packets"] == 0 and victim["queued_bytes"] == 0  # discarded, not queued
    assert total(victim["drops"]) == drops                                  # counted for that client
    assert st["disconnects"] == {} or total(st["disconnects"]) == 0
    # what was not dropped arrives, in order, and nothing else
    got = read_n(s, key, n - drops)
    assert got == list(range(n - drops))
    # then one drop notice tells it how many it missed (issue 15)
    assert sync(s) == [dropped(drops, key, key)]


def test_latest_control_message_wins(bus):
    key = unique("w/").encode()
    s = subscriber(bus, key, b"blocking/soft/discard", b"blocking/soft/queue")
    p = connect(bus.address, big=True)
    n = 40  # ~2.6 MB: beyond the kernel buffers, within the 4 MiB queue
    for i in range(n):
        send(p, numbered(key, i, BIG))
    sync(p)
    st = stats(connect(bus.address))
    assert total(st["drops"]) == 0
    assert entry_of_victim(st)["queued_packets"] > 0
    assert read_n(s, key, n) == list(range(n))
    assert sync(s) == []


def test_soft_error_disconnects_the_blocking_subscriber(bus):
    key = unique("e/").encode()
    s = subscriber(bus, key, b"blocking/soft/error")
    p = connect(bus.address, big=True)
    for i in range(60):
        send(p, numbered(key, i, BIG))
    sync(p)
    got = [seq_of(key, x) for x in wait_closed(s)]
    assert got == list(range(len(got)))  # what it got before, in order
    q = connect(bus.address)
    st = stats(q)
    assert total(st["disconnects"]) == 1
    assert st["clients"] == 2  # p and q
    wait_offender_logged(bus, os.getpid(), os.getuid(), ("error", "keep up", "block"))
    served(bus.address)
    assert sync(p) == []


def test_default_queue_is_capped_in_bytes(bus):
    key = unique("cap/").encode()
    s = subscriber(bus, key)  # defaults: soft queue, hard discard, order queue
    p = connect(bus.address, big=True)
    n = 400  # 25 MiB of 64 KiB packets
    for i in range(n):
        send(p, numbered(key, i, BIG))
    sync(p)
    st = stats(connect(bus.address))
    victim = entry_of_victim(st)
    assert 0 < victim["queued_bytes"] <= DEFAULT_QUEUE_BYTES
    assert victim["queued_bytes"] > DEFAULT_QUEUE_BYTES - 2 * BIG  # it did fill up to the limit
    drops = total(st["drops"])
    assert drops == total(victim["drops"]) > 0
    assert total(st["disconnects"]) == 0
    # the kept ones are the oldest (hard discard drops new packets), in order
    assert read_n(s, key, n - drops) == list(range(n - drops))
    assert sync(s) == [dropped(drops, key, key)]
    # and nothing is logged per packet
    assert len(bus.log().splitlines()) < 30


def test_default_queue_is_capped_in_packets(bus):
    key = unique("capn/").encode()
    s = subscriber(bus, key)
    p = connect(bus.address, big=True)
    n = 22000  # small packets: the 16384-packet limit binds before the byte limit
    for i in range(n):
        send(p, numbered(key, i, 60))
    sync(p)
    st = stats(connect(bus.address))
    victim = entry_of_victim(st)
    assert victim["queued_packets"] == DEFAULT_QUEUE_PACKETS
    drops = total(st["drops"])
    assert drops == total(victim["drops"]) > 0
    assert read_n(s, key, n - drops) == list(range(n - drops))
    assert sync(s) == [dropped(drops, key, key)]


def test_hard_error_disconnects_once_over_the_limit(bus):
    key = unique("he/").encode()
    s = subscriber(bus, key, b"blocking/hard/error")
    p = connect(bus.address, big=True)
    q = connect(bus.address)
    # within the queue limit: soft mode is still "queue", nothing happens
    for i in range(30):
        send(p, numbered(key, i, BIG))
    sync(p)
    st = stats(q)
    assert total(st["disconnects"]) == 0 and st["clients"] == 3
    assert entry_of_victim(st)["queued_packets"] > 0
    # over it: disconnected
    for i in range(30, 200):
        send(p, numbered(key, i, BIG))
    sync(p)
    got = [seq_of(key, x) for x in wait_closed(s)]
    assert got == list(range(len(got)))
    st = stats(q)
    assert total(st["disconnects"]) == 1 and st["clients"] == 2
    wait_offender_logged(bus, os.getpid(), os.getuid(), ("error", "limit", "keep up", "queue"))
    served(bus.address)


def _send_until_stalled(p, q, key, n, size):
    """Send non-blocking until the server stops reading `p`; return how many were sent.

    "Stopped" = `p`'s socket buffer is full and, twice in a row, the server's
    packets_in grew by exactly the one stats request `q` made in between.
    """
    p.setblocking(False)
    i = 0
    try:
        while i < n:
            try:
                p.send(numbered(key, i, size))
                i += 1
                continue
            except BlockingIOError:
                pass
            quiet = 0
            while quiet < 2:
                before = stats(q)["packets_in"]
                _, w, _ = select.select([], [p], [], 0.1)
                if w:
                    break  # the server read more of p: keep sending
                quiet = quiet + 1 if stats(q)["packets_in"] - before == 1 else 0
            else:
                return i
        return i
    finally:
        p.settimeout(5)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", [b"blocking/soft/block", b"blocking/hard/block"])
def test_block_holds_the_publisher_and_loses_nothing(bus, mode):
    key = unique("b/").encode()
    s = subscriber(bus, key, mode, big=True)
    p = connect(bus.address, sndbuf=65536)
    q = connect(bus.address)
    n, size = 2000, 8192  # 16 MB: far more than kernel buffers + the 4 MiB queue
    sent = _send_until_stalled(p, q, key, n, size)
    assert sent < n, "the publisher was never held back"

    # the bus is not stalled: an unrelated pair keeps talking, and reading stats works
    st1 = stats(q)
    u1, u2 = connect(bus.address, extensions=False), connect(bus.address, extensions=False)
    ukey = unique("u/").encode()
    send(u1, sub(ukey))
    sync(u1)
    for i in range(20):
        send(u2, msg(ukey, b"%d" % i))
        assert recv(u1) == msg(ukey, b"%d" % i)
    st2 = stats(q)
    # ... while nothing more was read from the held publisher: exactly u1's SUB and
    # whoami, u2's 20 MSGs and q's stats request came in
    assert st2["packets_in"] - st1["packets_in"] == 2 + 20 + 1
    assert total(st2["drops"]) == 0 and total(st2["disconnects"]) == 0

    # the subscriber starts reading: it gets every message, in order
    def rest():
        p.settimeout(20)
        for i in range(sent, n):
            send(p, numbered(key, i, size))

    t = threading.Thread(target=rest, daemon=True)
    t.start()
    got = read_n(s, key, n)
    t.join(20)
    assert got == list(range(n))
    assert sync(s) == []
    st = stats(q)
    assert total(st["drops"]) == 0 and total(st["disconnects"]) == 0


def _fill_queue(bus, key, controls, n=40):
    s = subscriber(bus, key, *controls)
    p = connect(bus.address, big=True)
    for i in range(n):  # ~2.6 MB: beyond the kernel buffers, within the queue limit
        send(p, numbered(key, i, BIG))
    sync(p)
    st = stats(connect(bus.address))
    assert total(st["drops"]) == 0
    queued = entry_of_victim(st)["queued_packets"]
    assert 2 <= queued < n
    return s, queued


def test_order_stack_drains_newest_first(bus):
    key = unique("o/").encode()
    n = 40
    s, queued = _fill_queue(bus, key, [b"order/stack"], n)
    got = read_n(s, key, n)
    in_socket = n - queued
    # first what was already in the socket buffer, oldest first; then the queue, newest first
    assert got == list(range(in_socket)) + list(range(n - 1, in_socket - 1, -1))
    assert sync(s) == []


def test_order_queue_is_the_default_and_drains_oldest_first(bus):
    key = unique("oq/").encode()
    n = 40
    s, queued = _fill_queue(bus, key, [], n)
    assert read_n(s, key, n) == list(range(n))


def test_order_random_loses_nothing(bus):
    key = unique("or/").encode()
    n = 40
    s, queued = _fill_queue(bus, key, [b"order/random"], n)
    got = read_n(s, key, n)
    assert sorted(got) == list(range(n))
    assert got[: n - queued] == list(range(n - queued))
    assert sync(s) == []


def test_back_to_order_queue(bus):
    key = unique("ob/").encode()
    n = 40
    s, queued = _fill_queue(bus, key, [b"order/stack", b"order/queue"], n)
    assert read_n(s, key, n) == list(range(n))


@pytest.mark.timeout(30)
def test_held_publisher_resumes_when_the_blocking_subscriber_leaves(bus):
    key = unique("bl/").encode()
    s = subscriber(bus, key, b"blocking/soft/block")
    # a second subscriber of the same key, also in block mode so that it loses nothing
    # when it reads slower than the resumed publisher writes
    other = subscriber(bus, key, b"blocking/soft/block")
    p = connect(bus.address, sndbuf=65536)
    n, size = 2000, 8192
    sent = _send_until_stalled(p, connect(bus.address), key, n, size)
    assert sent < n
    s.close()  # the blocking subscriber goes away: the publisher must be read again

    def rest():
        p.settimeout(20)
        for i in range(sent, n):
            send(p, numbered(key, i, size))

    t = threading.Thread(target=rest, daemon=True)
    t.start()
    got = read_n(other, key, n)
    t.join(20)
    assert got == list(range(n))
    assert sync(p) == []
    assert total(stats(p)["drops"]) == 0


@pytest.mark.timeout(30)
def test_queue_mode_keeps_order_while_the_reader_catches_up(bus):
    """New packets must not overtake queued ones when the socket frees up."""
    key = unique("cq/").encode()
    s = subscriber(bus, key, big=True)
    p = connect(bus.address, big=True)
    n, size = 3000, 8192
    # first build up a queue, then publish the rest while s reads
    for i in range(300):
        send(p, numbered(key, i, size))
    sync(p)
    assert entry_of_victim(stats(connect(bus.address)))["queued_packets"] > 0

    def rest():
        p.settimeout(20)
        for i in range(300, n):
            send(p, numbered(key, i, size))

    t = threading.Thread(target=rest, daemon=True)
    t.start()
    got = []
    notices = 0
    expected = None  # known once p is done: n minus what the server dropped (hard discard)
    while expected is None or len(got) < expected:
        if expected is None and not t.is_alive():
            sync(p)
            expected = n - total(stats(p)["drops"])
            continue
        try:
            pkt = recv(s, 0.1)
        except TimeoutError:
            continue
        if pkt.startswith(b"CMSG server/dropped\0"):
            notices += int(pkt.split(b"\0")[1])
            continue
        got.append(seq_of(key, pkt))
    notices += sum(int(p.split(b"\0")[1]) for p in sync(s))
    assert notices == n - len(got)  # every drop was told
    assert got == sorted(set(got)), "out of order or duplicated"
    assert got[:300] == list(range(300))


@pytest.mark.timeout(30)
def test_held_publisher_that_leaves_does_not_hurt_the_subscriber(bus):
    """The publisher held for a blocking subscriber goes away; the subscriber then
    drains: it gets every message the publisher sent, in order, stays connected,
    and the server logs no error."""
    key = unique("hl/").encode()
    s = subscriber(bus, key, b"blocking/soft/block", big=True)
    p = connect(bus.address, sndbuf=65536)
    q = connect(bus.address)
    n, size = 2000, 8192
    sent = _send_until_stalled(p, q, key, n, size)
    assert sent < n
    p.close()  # what it sent is still in its socket: the server must deliver all of it
    got = read_n(s, key, sent)
    assert got == list(range(sent))
    wait_stats(q, lambda st: st["clients"] == 2)  # p is gone now at the latest
    send(q, msg(key, b"end:"))
    assert recv(s) == msg(key, b"end:")
    assert sync(s) == []
    log = bus.log()
    assert "Traceback" not in log and "Unhandled" not in log, log


@pytest.mark.timeout(60)
def test_held_publishers_that_leave_wait_in_the_kernel_not_in_the_queue(bus):
    """Held (paused) publishers that close stay held: what they sent waits unread in their
    sockets, not in the queue of the subscriber that holds them, which keeps to its limit
    however many of them leave (issue 20, fault 6). When the subscriber reads, all of it
    arrives, in order, and the publishers' connections are released."""
    key = unique("hr/").encode()
    s = subscriber(bus, key, b"blocking/hard/block", big=True)  # does not read, for now
    q = connect(bus.address)
    limit = stats(q)["limits"]["queue_bytes"]
    total_sent = 0
    for round_ in range(3):
        p = connect(bus.address, sndbuf=65536)
        sent = _send_until_stalled(p, q, key, 2000, 8192)
        assert sent < 2000
        total_sent += sent
        p.close()
    queued = entry_of_victim(stats(q))["queued_bytes"]
    assert queued <= limit + 64 * 8192, f"{queued} bytes queued, limit {limit}"
    got = 0
    deadline = time.monotonic() + 30
    while True:  # read until the departed publishers are drained and gone
        try:
            assert recv(s, 0.5).startswith(b"MSG ")
            got += 1
            continue
        except TimeoutError:
            pass
        if stats(q)["clients"] == 2:
            break
        assert time.monotonic() < deadline, f"publishers not released ({got} of {total_sent} read)"
    send(q, msg(key, b"end"))
    while recv(s, 10) != msg(key, b"end"):
        got += 1
    assert got == total_sent
    s.close()
