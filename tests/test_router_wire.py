"""Router faults seen on the wire (issue 10, items 1 and 6), against real server processes.

* Aliasing patterns (`x*/` and `x**/`, `*/` and `**/`, `a*/b` and `a**/b`)
  used to share one trie holder: the first removal took both, the second
  raised inside the server's client-gone handler, and the client stayed in
  the client table forever (stats counted it, its uid's connection count
  never fell, `-c` never exited), and after `UNSUB x**/` the still-held
  `x*/` stopped delivering.
* A key containing `*` used to take a slow path over every subscription; now
  it goes through the trie, and must give the reference matcher's answers.
"""

from __future__ import annotations

import subprocess

from helpers import (
    SERVICE_TIMEOUT,
    connect,
    msg,
    recv,
    send,
    stats,
    sub,
    sync,
    unique,
    unsub,
    wait_closed,
    wait_stats,
    wait_until,
)
from test_relay import Relay, procs, queue_of  # noqa: F401  (procs: fixture)

from sbus.core.patterns import matches

ALIASES = [(b"x*/", b"x**/"), (b"*/", b"**/"), (b"a*/b", b"a**/b")]


def test_aliasing_clients_leave_cleanly(start_bus):
    """Three clients hold aliasing patterns and go away: the server forgets all of them,
    and with `-c` it exits once they have gone."""
    bus = start_bus("-c")
    watcher = connect(bus.address)
    clients = []
    for first, second in ALIASES:
        s = connect(bus.address)
        send(s, sub(first), sub(second), sub(first))
        sync(s)
        clients.append(s)
    st = stats(watcher)
    assert st["clients"] == 4 and st["subscriptions"] == 9, st
    for s in clients:
        s.close()
    st = wait_stats(watcher, lambda st: st["clients"] == 1, timeout=SERVICE_TIMEOUT)
    assert st["subscriptions"] == 0 and st["disconnects"] == {"closed": 3}, st
    # the router still works for everyone else
    send(watcher, sub(b"x*/"), msg(b"xa/b", b"hi"))
    assert sync(watcher) == [msg(b"xa/b", b"hi")]
    watcher.close()
    try:
        assert bus.proc.wait(SERVICE_TIMEOUT) == 0, bus.log()
    except subprocess.TimeoutExpired:
        raise AssertionError(f"sbusd -c did not exit after its last client left: {bus.log()}") from None


def test_aliasing_clients_release_their_uid_slot(start_twistd_bus):
    """A uid's connection count falls again when aliasing clients leave (it used to stick:
    after max-uid-connections such clients the uid was locked out)."""
    bus = start_twistd_bus("--max-uid-connections", "3")
    watcher = connect(bus.address)
    wait_stats(watcher, lambda st: st["clients"] == 1, timeout=SERVICE_TIMEOUT)  # the start-up probe has gone
    for round_ in range(3):
        pair = [connect(bus.address) for _ in range(2)]
        for s, (first, second) in zip(pair, ALIASES[round_:] + ALIASES[:round_]):
            send(s, sub(first), sub(second))
            sync(s)
        for s in pair:
            s.close()
        wait_stats(watcher, lambda st: st["clients"] == 1, timeout=SERVICE_TIMEOUT)
    # two more connections of this uid are still accepted
    late = [connect(bus.address) for _ in range(2)]
    for s in late:
        sync(s)
    assert stats(watcher)["clients"] == 3


def test_unsub_of_an_alias_keeps_the_other(bus):
    """After `UNSUB x**/` the still-held `x*/` delivers; after `UNSUB x*/` nothing does."""
    publisher = connect(bus.address)
    for first, second, key in [(b"x*/", b"x**/", b"xa/b"), (b"*/", b"**/", b"q/r"), (b"a*/b", b"a**/b", b"ab/b")]:
        s = connect(bus.address)
        send(s, sub(first), sub(second), unsub(second))
        sync(s)
        send(publisher, msg(key, b"1"))
        sync(publisher)
        assert sync(s) == [msg(key, b"1")], (first, second)
        send(s, unsub(first), sub(second), unsub(second))
        sync(s)
        send(publisher, msg(key, b"2"))
        sync(publisher)
        assert sync(s) == [], (first, second)
        assert stats(s)["subscriptions"] == 0
        s.close()


def test_keys_with_a_star_routed_by_the_trie(bus):
    """Among 50,000 subscriptions, keys containing '*' reach exactly the clients the
    reference matcher names (a '*' in a key is an ordinary byte)."""
    root = unique("star").encode()
    many = connect(bus.address, big=True)
    for base in range(0, 50_000, 5000):
        send(many, *[sub(b"%s/%d/*" % (root, i)) for i in range(base, base + 5000)])
        sync(many, timeout=SERVICE_TIMEOUT)
    patterns = [b"%s/7/x*" % root, b"%s/7/x**" % root, b"%s/*/x*/" % root, b"%s/7/*x" % root,
                b"%s/7*/x" % root, b"%s/**/x*y" % root, b"%s/7/x*y" % root]
    few = []
    for p in patterns:
        s = connect(bus.address)
        send(s, sub(p))
        sync(s)
        few.append(s)
    assert stats(many)["subscriptions"] == 50_000 + len(patterns)
    keys = [b"%s/7/x*" % root, b"%s/7/x*y" % root, b"%s/7/x**" % root, b"%s/7/*x" % root, b"%s/7*/x" % root,
            b"%s/7/x*/z" % root, b"%s/*/x*y" % root, b"%s/**/x*y" % root, b"%s/7*/x*/" % root, b"%s/*" % root,
            b"%s/49999/*" % root, b"%s/7/**" % root]
    publisher = connect(bus.address)
    send(publisher, *[msg(k, b"%d" % n) for n, k in enumerate(keys)])
    sync(publisher)
    expect_many = [msg(k, b"%d" % n) for n, k in enumerate(keys) if any(
        matches(b"%s/%d/*" % (root, i), k) for i in (7, 49999))]
    assert expect_many, "the test needs keys the 50,000 match"
    got = []
    while len(got) < len(expect_many):
        got.append(recv(many, SERVICE_TIMEOUT))
    assert got == expect_many
    assert sync(many) == []
    for p, s in zip(patterns, few):
        expected = [msg(k, b"%d" % n) for n, k in enumerate(keys) if matches(p, k)]
        assert sync(s) == expected, p


def test_many_star_patterns_are_limited(bus):
    """Each '*' of a pattern is a trie node now (keys with '*' route through the trie), so it
    counts like a '/'-segment: a 400 KB pattern of stars is refused, one of 255 is fine."""
    fine = connect(bus.address)
    send(fine, sub(b"*" * 255), sub(b"a*" * 127 + b"/"))
    assert sync(fine) == []
    greedy = connect(bus.address, big=True)
    send(greedy, sub(b"*" * 400_000))
    wait_closed(greedy, SERVICE_TIMEOUT)
    st = stats(fine)
    assert st["disconnects"].get("too_many_subscriptions") == 1 and st["subscriptions"] == 2, st


def test_relay_withdraws_aliasing_patterns_upward(start_bus, tmp_path, procs):  # noqa: F811
    """A relay subscribes upward once per distinct pattern and withdraws it when its last
    local holder goes: with aliasing patterns the withdrawal used to be lost."""
    master = start_bus()
    relay = Relay(master.address, str(tmp_path / "relay.sock"), tmp_path)
    procs.append(relay)
    held = lambda: (queue_of(master.address, relay.proc.pid) or {}).get("subscriptions")  # noqa: E731
    local = connect(relay.address)
    send(local, sub(b"x*/"), sub(b"x**/"), sub(b"*/"), sub(b"**/"))
    sync(local)
    wait_until(lambda: held() == 4, "the relay subscribed upward")
    send(local, unsub(b"x**/"))
    sync(local)
    wait_until(lambda: held() == 3, "the relay withdrew x**/ upward")
    local.close()
    wait_until(lambda: held() == 0, "the relay withdrew everything upward")
    assert held() == 0


def test_sub_unsub_loop_against_long_cached_keys_does_not_stall_the_server(bus):
    """One client caches 250 keys of 4 KB that share a long prefix with a
    pattern, then SUBs and UNSUBs that pattern: each change tested every
    cached key of the group with the reference matcher (a Python loop over
    bytes), ~150 ms per SUB or UNSUB with the reactor blocked: 40 of them took
    18.8 s through sbusd (0.3 s now, the test budget is capped in bytes)."""
    import time

    s = connect(bus.address, big=True)
    body = b"b" * 4000
    keys = [b"A/" + body + b"x%d" % i for i in range(250)]
    pattern = b"A/" + body + b"y"
    start = time.monotonic()
    for _ in range(20):
        send(s, *[msg(k) for k in keys])  # refill the cache each round
        send(s, sub(pattern), unsub(pattern))
    sync(s, timeout=60)
    took = time.monotonic() - start
    assert took < 6.0, f"40 SUB/UNSUB took {took:.1f} s"
    s.close()
