"""Per-client and per-uid limits, and the stall deadline of the block modes,
through a real `twistd sbus` process started with small limits."""

from __future__ import annotations

import socket

import pytest

from helpers import connect, msg, recv, send, served, stats, sub, sync, unique, wait_closed, wait_stats


def test_a_client_over_its_subscription_limit_is_disconnected(start_twistd_bus):
    bus = start_twistd_bus("--max-subscriptions", "10")
    greedy = connect(bus.address)
    for i in range(10):
        send(greedy, sub(f"g/{i}"))
    assert sync(greedy) == []  # ten are fine
    send(greedy, sub("g/10"))
    wait_closed(greedy)
    bus.wait_log("over the limit of 10 subscriptions per client")
    s = stats(connect(bus.address))
    assert s["disconnects"].get("too_many_subscriptions") == 1
    served(bus.address)


def test_duplicates_count_towards_the_limit_and_unsub_frees_room(start_twistd_bus):
    bus = start_twistd_bus("--max-subscriptions", "3")
    c = connect(bus.address)
    send(c, sub("d"), sub("d"), sub("d"), b"UNSUB d", sub("e"))
    assert sync(c) == []
    send(c, sub("f"))
    wait_closed(c)


def test_one_uid_cannot_hold_more_than_its_subscriptions(start_twistd_bus):
    bus = start_twistd_bus("--max-uid-subscriptions", "5")
    a, b = connect(bus.address), connect(bus.address)
    send(a, *(sub(f"a/{i}") for i in range(3)))
    send(b, *(sub(f"b/{i}") for i in range(2)))
    assert sync(a) == [] and sync(b) == []
    send(b, sub("b/over"))
    wait_closed(b)
    bus.wait_log("over the limit of 5 subscriptions for uid")
    # b's subscriptions were given back: a may take them
    send(a, sub("a/3"), sub("a/4"))
    assert sync(a) == []


def test_one_uid_cannot_hold_more_than_its_connections(start_twistd_bus):
    bus = start_twistd_bus("--max-uid-connections", "3")
    first = connect(bus.address)
    wait_stats(first, lambda s: s["clients"] == 1)  # the fixture's readiness probe has gone
    held = [first, connect(bus.address), connect(bus.address)]
    for c in held:
        sync(c)
    extra = connect(bus.address)  # the kernel accepts; the server closes it at once
    wait_closed(extra)
    bus.wait_log("uid has 3 connections, the limit")
    held.pop().close()
    assert wait_stats(held[0], lambda s: s["clients"] == 2)["refused"] == {"too_many_connections": 1}
    again = connect(bus.address)
    assert sync(again) == []


@pytest.mark.timeout(30)
def test_a_blocking_subscriber_that_stalls_is_disconnected_and_publishers_resume(start_twistd_bus):
    """soft/block holds the publisher; past the deadline the stalled subscriber is
    dropped (counted) and the publisher's traffic flows to everyone else again."""
    bus = start_twistd_bus("--stall-timeout", "2")
    key = unique("stall/")
    stalled = connect(bus.address)
    send(stalled, b"CMSG blocking/soft/block", sub(key))
    sync(stalled)
    reader = connect(bus.address, big=True)
    send(reader, sub(key))
    sync(reader)
    pub = connect(bus.address)
    payload = b"x" * 16384
    sent = 0
    # The server stops reading the publisher once `stalled` is full: our send buffer fills and a
    # send stays blocked (while the server reads us, a full buffer empties in microseconds).
    pub.settimeout(0.5)
    while sent < 400:
        try:
            pub.send(msg(key, payload))
        except TimeoutError:
            break
        sent += 1
    assert sent < 400, "the publisher was never held back"
    bus.wait_log("held publishers paused for 2 s", timeout=10)
    wait_closed(stalled)
    # The publisher is read again: everything it sent reaches the other subscriber.
    pub.setblocking(True)
    send(pub, msg(key, b"end"))
    got = 0
    while recv(reader, timeout=10) != msg(key, b"end"):
        got += 1
    assert got == sent  # a SEQPACKET send that would block sends nothing
    assert stats(reader)["disconnects"].get("stalled") == 1
