"""`CMSG server/stats` through a real server: the reply's shape and that its
counters move exactly as the traffic says."""

from __future__ import annotations

import json
import os

from helpers import (
    STATS, STATS_REPLY, Agent, cmsg, connect, msg, recv, send, stats, sub, sync, total, unique,
    unsub, wait_stats,
)

WHOAMI_LEN = len(b"CMSG !/cred/whoami")


def test_reply_shape_and_only_to_the_asker(bus):
    watcher = connect(bus.address)
    send(watcher, sub(b""))
    sync(watcher)
    q = connect(bus.address)
    send(q, STATS)
    reply = recv(q)
    assert reply.startswith(STATS_REPLY)
    st = json.loads(reply[len(STATS_REPLY):])
    for field in ("clients", "subscriptions", "packets_in", "packets_out", "bytes_in", "bytes_out"):
        assert isinstance(st[field], int) and st[field] >= 0, field
    for field in ("drops", "disconnects"):
        assert isinstance(st[field], dict), field
        assert all(isinstance(k, str) and isinstance(v, int) for k, v in st[field].items())
    assert st["clients"] == 2
    assert st["subscriptions"] == 1
    assert isinstance(st["queues"], list) and len(st["queues"]) == 2
    for entry in st["queues"]:
        assert entry["pid"] == os.getpid() and entry["uid"] == os.getuid()
        assert entry["queued_packets"] == 0 and entry["queued_bytes"] == 0
    # with a payload part too
    send(q, cmsg(b"server/stats", b""))
    assert recv(q).startswith(STATS_REPLY)
    # the reply went to q only: the catch-all subscriber saw nothing
    assert sync(watcher) == []


def test_counters_follow_the_traffic(bus):
    q = connect(bus.address)
    a, b = connect(bus.address, extensions=False), connect(bus.address, extensions=False)
    key = unique("k/").encode()
    st0 = stats(q)
    st1 = stats(q)  # baseline: what one stats request itself adds
    d_in = st1["packets_in"] - st0["packets_in"]
    d_bin = st1["bytes_in"] - st0["bytes_in"]
    d_out = st1["packets_out"] - st0["packets_out"]
    assert (d_in, d_bin) == (1, len(STATS))

    sent = [sub(key), sub(key), sub(key + b"/x")]          # a: 3 SUBs (one duplicate)
    send(a, *sent)
    sync(a)                                                 # + whoami in, reply out
    payload_msgs = [msg(key, b"hello"), msg(key, b"\0" * 100)]
    send(b, *payload_msgs)                                  # b: 2 MSGs, each to a once
    sync(b)                                                 # + whoami in, reply out
    got = [recv(a) for _ in payload_msgs]
    assert got == payload_msgs
    st2 = stats(q)

    assert st2["subscriptions"] - st1["subscriptions"] == 3  # duplicates are stored
    assert st2["packets_in"] - st1["packets_in"] == len(sent) + len(payload_msgs) + 2 + d_in
    assert st2["bytes_in"] - st1["bytes_in"] == (
        sum(map(len, sent)) + sum(map(len, payload_msgs)) + 2 * WHOAMI_LEN + d_bin
    )
    # out: the 2 deliveries to a, the 2 whoami replies, plus what a stats reply adds
    assert st2["packets_out"] - st1["packets_out"] == 2 + 2 + d_out
    assert st2["bytes_out"] - st1["bytes_out"] >= sum(map(len, payload_msgs)) + 2 * (WHOAMI_LEN + 1)
    assert st2["clients"] == 3

    # UNSUB removes one instance
    send(a, unsub(key))
    sync(a)
    assert stats(q)["subscriptions"] - st1["subscriptions"] == 2

    # a second subscriber doubles the deliveries of one publish
    c = connect(bus.address)
    send(c, sub(key))
    sync(c)
    st3 = stats(q)
    send(b, msg(key, b"x"))
    assert recv(a) == msg(key, b"x") and recv(c) == msg(key, b"x")
    st4 = stats(q)
    assert st4["packets_out"] - st3["packets_out"] == 2 + d_out
    assert st4["packets_in"] - st3["packets_in"] == 1 + d_in

    # a client leaving takes its subscriptions with it
    a.close()
    st5 = wait_stats(q, lambda st: st["clients"] == 3)
    assert st5["subscriptions"] == st4["subscriptions"] - 2
    for x in (b, c, q):
        x.close()


def test_queues_list_every_client_with_its_own_pid(bus):
    q = connect(bus.address)
    with Agent(bus.address) as a, Agent(bus.address) as b:
        st = stats(q)
        pids = sorted(e["pid"] for e in st["queues"])
        assert pids == sorted([os.getpid(), a.pid, b.pid])
        assert all(e["uid"] == os.getuid() for e in st["queues"])
        assert st["clients"] == 3
    st = wait_stats(q, lambda st: st["clients"] == 1)
    assert [e["pid"] for e in st["queues"]] == [os.getpid()]


def test_queue_depth_is_reported(bus):
    key = unique("q/").encode()
    with Agent(bus.address) as slow:
        slow.send(sub(key))
        slow.sync()
        p = connect(bus.address, big=True)
        size = 64 * 1024
        for i in range(40):  # ~2.6 MB at a client that does not read
            send(p, msg(key, b"%d" % i + b"." * (size - 20)))
        sync(p)
        st = stats(p)
        mine = [e for e in st["queues"] if e["pid"] == slow.pid]
        assert len(mine) == 1
        depth = mine[0]
        assert 0 < depth["queued_packets"] < 40
        # every queued packet is one of ours, of known size
        assert depth["queued_bytes"] == sum(
            len(msg(key, b"%d" % i + b"." * (size - 20))) for i in range(40 - depth["queued_packets"], 40)
        )
        others = [e for e in st["queues"] if e["pid"] != slow.pid]
        assert all(e["queued_packets"] == 0 for e in others)
        # once it reads, the queue empties
        for _ in range(40):
            assert slow.recv()
        st = wait_stats(p, lambda st: all(e["queued_packets"] == 0 for e in st["queues"]))
        assert all(e["queued_bytes"] == 0 for e in st["queues"])


def test_disconnects_are_counted_by_reason(bus):
    q = connect(bus.address)
    offences = [b"BOGUS", b"MSG no nul", b"MSG a/!/b\0", b"SUB !/cred/*/*/*/", b"HELLO"]
    base = stats(q)["disconnects"]
    for packet in offences:
        with Agent(bus.address) as a:
            a.sync()
            a.send(packet)
            assert a.wait_closed()
    st = wait_stats(q, lambda st: total(st["disconnects"]) - total(base) >= len(offences))
    assert total(st["disconnects"]) - total(base) == len(offences)
    # several reasons, not one bucket for everything: cred refusals are not protocol errors
    assert len([k for k, v in st["disconnects"].items() if v > base.get(k, 0)]) >= 2
    assert st["clients"] == 1


def test_stats_request_is_not_a_subscription_or_publish(bus):
    """Asking for stats changes nothing but the counters."""
    q = connect(bus.address)
    send(q, sub(b""))
    sync(q)
    st1 = stats(q)
    st2 = stats(q)
    assert st2["subscriptions"] == st1["subscriptions"] == 1
    assert st2["clients"] == 1
    assert sync(q) == []  # nothing was published to the catch-all subscriber
