"""The per-uid accounting object (`sbus.core.accounting`), sans I/O: what a uid may spend of
the reactor (`WorkBudget`) and what it may pin in patterns and in its interest watchers'
views of them (`UserCharge`). The server's use of them is tested through the real socket in
test_fairness.py and test_interest.py."""

from __future__ import annotations

import pytest

from sbus.core.accounting import WORK_BURST, WORK_SHARE, UserCharge, WorkBudget
from sbus.core.flood import Budget

MIB = 1 << 20


def test_work_within_the_burst_costs_no_wait_and_debt_is_earned_back_at_the_share():
    b = WorkBudget(now=100.0)
    assert b.spend(WORK_BURST / 2, now=100.0) == 0.0
    assert b.owed(100.0) == 0.0
    wait = b.spend(WORK_BURST, now=100.0)  # half a burst over
    assert wait == pytest.approx(WORK_BURST / 2 / WORK_SHARE)
    assert b.owed(100.0) == pytest.approx(wait)
    assert b.owed(100.0 + wait / 2) == pytest.approx(wait / 2)  # earned back as time passes
    assert b.owed(100.0 + wait + 1e-9) == 0.0


def test_credit_never_grows_past_the_burst():
    b = WorkBudget(now=0.0)
    # an hour idle earns no more than one burst: spending two bursts at once is still a debt
    assert b.spend(2 * WORK_BURST, now=3600.0) == pytest.approx(WORK_BURST / WORK_SHARE)


def _user(subscription_bytes: int = 0, watchers: int = 0) -> UserCharge:
    u = UserCharge(65534, 1 << 20, Budget(1 << 30), now=0.0)
    if subscription_bytes:
        u.charge_pattern(subscription_bytes)
    u.watchers = watchers
    return u


def test_pattern_limits_count_patterns_and_bytes():
    u = _user()
    assert u.pattern_refusal(100, max_subscriptions=1, max_bytes=MIB) is None
    u.charge_pattern(100)
    assert "1 subscriptions for uid 65534" in u.pattern_refusal(100, max_subscriptions=1, max_bytes=MIB)
    assert "subscription bytes for uid 65534" in u.pattern_refusal(MIB, max_subscriptions=10, max_bytes=MIB)
    u.release_patterns(1, 100)
    assert (u.subscriptions, u.subscription_bytes) == (0, 0)


def test_each_watchers_view_counts_like_the_patterns_it_copies():
    # 40 MiB of patterns and two watchers: three copies of 40 MiB, under 128 MiB
    u = _user(40 * MIB, watchers=2)
    assert u.pattern_refusal(MIB, 10**6, 128 * MIB) is None  # 3 x 41 MiB = 123 MiB
    refusal = u.pattern_refusal(3 * MIB, 10**6, 128 * MIB)  # 3 x 43 MiB = 129 MiB
    assert refusal is not None and "2 interest watchers' views" in refusal
    # a uid that sees everything (root, the bus's owner) keeps no view of its own patterns
    assert u.pattern_refusal(3 * MIB, 10**6, 128 * MIB, views=False) is None


def test_one_more_watcher_is_refused_when_its_view_would_go_over():
    u = _user(40 * MIB, watchers=2)
    refusal = u.watch_refusal(128 * MIB)  # a fourth copy: 160 MiB
    assert refusal is not None and "would make 4 copies" in refusal
    u.watchers = 1
    assert u.watch_refusal(128 * MIB) is None  # a third copy: 120 MiB
    # a uid holding a few patterns watches on many connections (every request/reply client does)
    few = _user(2_000, watchers=1000)
    assert few.watch_refusal(128 * MIB) is None


def test_kernel_send_buffers_are_reserved_from_the_uids_queue_budget_and_the_servers():
    server = Budget(10 * MIB)
    user = UserCharge(1000, MIB, server, now=0.0)
    want = 128 << 10
    reserved = 0
    while user.kernel_fits(want):
        user.reserve_kernel(want)
        reserved += want
    assert reserved == MIB  # eight sockets' buffers fill a 1 MiB uid budget
    assert user.queue.used == server.used == MIB  # the same budget its queues use
    assert not user.kernel_fits(1)
    assert not user.idle(0.0)
    for _ in range(8):
        user.release_kernel(want)
    assert user.queue.used == server.used == 0
    assert user.idle(0.0)


def test_the_servers_budget_bounds_kernel_buffers_too():
    server = Budget(256 << 10)
    a = UserCharge(1, MIB, server, now=0.0)
    b = UserCharge(2, MIB, server, now=0.0)
    a.reserve_kernel(128 << 10)
    b.reserve_kernel(128 << 10)
    assert not a.kernel_fits(1) and not b.kernel_fits(1)  # each uid has room, the server does not


def test_big_packets_pin_a_uids_cap_and_one_more_and_the_waiters_are_woken_in_order():
    """Issue 33.7: a big packet sent through a raised buffer is charged until read; a connection
    without room waits and is woken when it is given back; one pinned packet per uid always goes
    (a uid over its cap still reaches its readers, one at a time)."""
    server = Budget(10 * MIB)
    user = UserCharge(1000, MIB, server, now=0.0)
    user.reserve_kernel(MIB)  # the cap full of buffers and queues
    assert user.may_grow(600 << 10, "a")  # nothing pinned: it goes, past the cap
    user.grow(600 << 10)
    assert user.queue.used == server.used == MIB + (600 << 10) and user.grown == 600 << 10
    assert not user.may_grow(1, "b") and not user.may_grow(1, "c") and not user.may_grow(1, "b")
    user.shrink(600 << 10)
    assert user.take_waiting() == ["b", "c"]  # once each, in the order they asked
    assert user.grown == 0 and user.queue.used == MIB and user.growing is None
    user.grow(10)
    assert not user.may_grow(1, "d")
    user.forget("d")  # it went
    user.shrink(10)
    assert user.take_waiting() == []
