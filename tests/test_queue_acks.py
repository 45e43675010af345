"""Ack deadlines, progress, nack, reject and dead letters (docs/queues.md "Acks, deadlines and
dead letters"): the core's rules with a clock of the test's, then the real service.
"""

from __future__ import annotations

import os

import asyncio
import json

from helpers import REPO, wait_until
from sbus.client import Client
from sbus.core import codec
from sbus.core.workqueue import Membership
from test_queue import _deliveries, _join, group_stats, online, publish, start_queue  # noqa: F401


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_core_ack_wait_progress_nack_delay_and_reject():
    clock = Clock()
    core = online([(b"jobs", b"jobs/")], ack_wait=5, max_deliveries=3, dead_letter=b"dead/jobs", clock=clock)
    a, _ = _join(core, member=b"a")
    [(to, key, token, n)] = _deliveries(core.message(b"jobs/1", b"x"))
    assert (to, n) == (a, 1)
    b, _ = _join(core, member=b"b")
    clock.now += 3
    assert core.progress(token) == []    # a is still at it: its deadline starts again
    clock.now += 3
    assert core.tick() == []
    clock.now += 2.5                     # 5.5 s after the progress: gone to b
    [(to, _, token2, n)] = _deliveries(core.tick())
    assert (to, n) == (b, 2) and core.groups[b"jobs"].expired == 1
    assert core.ack(token) == [] and core.acks_unknown == 1  # a's late ack is worth nothing
    assert core.nack(token2 + b" 2\0disk full") == []        # redeliver in 2 s, not now
    clock.now += 1
    assert core.tick() == []
    clock.now += 1.5
    [(to, _, token3, n)] = _deliveries(core.tick())
    assert n == 3
    # the third delivery nacked: max_deliveries reached, a dead letter with its headers
    [dead] = core.nack(token3 + b" 0\0still full")
    m = codec.parse(dead)
    head, _, payload = m.payload.partition(b"\0")
    assert (m.key, payload) == (b"dead/jobs", b"x")
    assert json.loads(head) == {"group": "jobs", "key": "jobs/1", "attempts": 3, "error": "still full"}
    # reject: straight to the dead letters, whatever the count
    [(_, _, token4, n)] = _deliveries(core.message(b"jobs/2", b"y"))
    [dead] = core.reject(token4 + b"\0bad input")
    assert json.loads(codec.parse(dead).payload.partition(b"\0")[0])["attempts"] == 1
    st = core.groups[b"jobs"].stats()
    assert (st["nacked"], st["rejected"], st["dead_lettered"], st["in_flight"], st["backlog"]) == (2, 1, 2, 0, 0)


def test_core_without_a_dead_letter_key_the_loss_is_counted():
    core = online([(b"jobs", b"jobs/")], max_deliveries=1)
    _join(core)
    [(_, _, token, _)] = _deliveries(core.message(b"jobs/1", b"x"))
    assert core.nack(token + b" 0\0e") == []
    assert core.groups[b"jobs"].lost["max_deliveries"] == 1


def test_membership_packets():
    m = Membership(b"!/cred/1/2/3", "jobs")
    assert codec.parse(m.nack_packet(b"tok", 1.5, "why")).payload == b"tok 1.5\0why"
    assert codec.parse(m.reject_packet(b"tok", b"no")).payload == b"tok\0no"
    assert codec.parse(m.progress_packet(b"t1", b"t2")).payload == b"t1 t2"


def test_a_member_that_does_not_ack_in_time_loses_the_job_to_another(bus, start_queue):
    """--ack-wait 1: a member that holds a job (stopped, stuck) without acking: the job goes to
    another member, marked redelivered; progress keeps it; asyncio nack and reject work."""
    import sbus.client.asyncio as aio

    start_queue(bus, "--group", "jobs=jobs/", "--ack-wait", "1", "--dead-letter", "dead/jobs")
    with Client(bus.address) as slow_conn, Client(bus.address) as dead:
        dead.subscribe(b"dead/")
        dead.sync(5)
        slow = slow_conn.join("jobs", timeout=20)
        publish(bus.address, [b"jobs/1"])
        d = slow.next(timeout=20)

        async def other():
            c = await aio.connect(bus.address)
            w = await c.join("jobs", timeout=20)
            got = await w.next(timeout=30)        # after slow's deadline
            await w.reject(got, "cannot")
            await c.sync()
            c.close()
            return got

        got = asyncio.run(other())
        assert (got.key, got.deliveries, got.redelivered) == (b"jobs/1", 2, True)
        m = dead.receive(timeout=30)
        assert json.loads(m.payload.partition(b"\0")[0]) == {"group": "jobs", "key": "jobs/1", "attempts": 2,
                                                             "error": "cannot"}
        slow.ack(d)  # too late: its token died at the deadline
        slow_conn.sync(5)
    st = group_stats(bus.address)
    assert (st["expired"], st["rejected"], st["dead_lettered"], st["acked"]) == (1, 1, 1, 0)


def test_a_durable_queue_survives_kill9_of_the_service(bus, tmp_path):
    """--store DIR: jobs the service took, and one delivered but not acked, survive a kill -9 of
    sbus-queue; the same command started again delivers them (replayed), acked ones not."""
    import signal

    from test_queue import QueueProcess

    store = tmp_path / "store"
    argv = ["--group", "jobs=jobs/", "--store", str(store)]
    first = QueueProcess(bus.address, tmp_path / "q1.log", argv)
    try:
        with Client(bus.address) as c:
            w = c.join("jobs", timeout=20)
            publish(bus.address, [b"jobs/%d" % i for i in range(200)])
            done = [w.next(timeout=20) for _ in range(3)]
            w.ack(*done[:2])  # jobs/0 and jobs/1 done, jobs/2 taken and not acked
            c.sync(5)
            wait_until(lambda: (lambda st: st["acked"] == 2 and st["received"] == 200)(group_stats(bus.address)),
                       "the service took all 200 and saw 2 acks")
        first.stop(signal.SIGKILL)
    finally:
        first.stop()
    second = QueueProcess(bus.address, tmp_path / "q2.log", argv)
    try:
        with Client(bus.address) as c:
            w = c.join("jobs", timeout=20)
            got = []
            while len(got) < 198:
                d = w.next(timeout=20)
                got.append(d.key)
                w.ack(d)
            want = {b"jobs/%d" % i for i in range(2, 200)}
            assert set(got) == want and len(got) == 198, \
                ("again", sorted(set(got) - want)[:5], "missing", sorted(want - set(got))[:5])
            c.sync(5)
        st = group_stats(bus.address)
        assert st["replayed"] == 198 and st["backlog"] == 0, st
    finally:
        second.stop()


def test_a_journal_replays_what_is_not_done_and_cuts_a_torn_record(tmp_path):
    from sbus.core.queuestore import QueueStore

    store = QueueStore(str(tmp_path))
    j, jobs = store.open(b"jobs")
    assert jobs == []
    ids = [store.add(b"jobs", b"k%d" % i, b"p%d" % i) for i in range(3)]
    store.done(b"jobs", ids[1])
    store.flush(sync=True)
    with open(j.path, "ab") as f:
        f.write(b"\0\0\0\x40E")  # the start of a record the process died writing
    j.close()
    again = QueueStore(str(tmp_path))
    _, jobs = again.open(b"jobs")
    assert jobs == [(ids[0], b"k0", b"p0"), (ids[2], b"k2", b"p2")]
    assert again.add(b"jobs", b"k3", b"") == ids[2] + 1  # ids are never reused
    again.close()


def test_confirmed_submissions(bus, tmp_path):
    """submit(): returns once the service holds the jobs (journalled, with --store); all or
    none: QueueFull over --limit; NoService for a group no service serves; survives kill -9."""
    import signal

    import pytest

    from sbus.client import NoService, QueueFull, RequestTimeout
    from test_queue import QueueProcess

    argv = ["--group", "jobs=jobs/", "--limit", "100", "--store", str(tmp_path / "store")]
    first = QueueProcess(bus.address, tmp_path / "q1.log", argv)
    try:
        with Client(bus.address) as c:
            assert c.submit("jobs", [(b"jobs/%d" % i, b"p") for i in range(50)]) == 50
            with pytest.raises(QueueFull, match=r"group jobs: full: queue full \(50 jobs, \d+ bytes waiting; max 100 jobs\)"):
                c.submit("jobs", [(b"jobs/x%d" % i, b"p") for i in range(51)])
            with pytest.raises(ValueError, match="does not match"):
                c.submit("jobs", [(b"other/1", b"")])
            with pytest.raises(NoService, match="no sbus-queue service serves group nothere"):
                c.submit("nothere", [(b"a", b"")])
            # Verified (issue 33.5): taken only from a service that proves its uid. A service that
            # is not of the uid named is refused; this submitter never sent it its token, so the
            # service only offered, and holds nothing.
            with pytest.raises(RequestTimeout, match="1 unverified reply refused"):
                c.submit("jobs", [(b"jobs/other", b"p")], timeout=2, responder_uid=os.getuid() + 1)
            assert c.submit("jobs", [(b"jobs/v", b"p")], responder_uid=os.getuid()) == 1
        r = sbus_cli(bus.address, "submit", "--from-uid", str(os.getuid()), "jobs", "jobs/cli", "x")
        assert (r.returncode, r.stderr) == (0, b""), r
        r = sbus_cli(bus.address, "submit", "nothere", "a/1")
        assert (r.returncode, r.stderr) == (1, b"sbus: not held: no sbus-queue service serves group nothere\n"), r
        first.stop(signal.SIGKILL)  # at once after the confirmation: nothing confirmed is lost
    finally:
        first.stop()
    st = None
    second = QueueProcess(bus.address, tmp_path / "q2.log", argv)
    try:
        st = group_stats(bus.address)
        assert (st["replayed"], st["backlog"]) == (52, 52), st
    finally:
        second.stop()


def sbus_cli(address, *args):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "sbus.cli", "-b", address, *args], capture_output=True,
                          timeout=60, cwd=REPO)


def test_ack_wait_max_deliveries_and_dead_letter_per_group(bus, start_queue):
    """[GROUP=]VALUE, as --max-jobs: group fast has a 1 s deadline and no delivery limit; group
    once has no deadline, one delivery at most and its own dead-letter key; a plain value is every
    group's default."""
    start_queue(bus, "--group", "fast=fast/", "--group", "once=once/", "--ack-wait", "fast=1",
                "--max-deliveries", "once=1", "--dead-letter", "dead/all", "--dead-letter", "once=dead/once")
    fast, once = group_stats(bus.address, "fast"), group_stats(bus.address, "once")
    assert (fast["ack_wait"], fast["max_deliveries"], fast["dead_letter"]) == (1.0, None, "dead/all")
    assert (once["ack_wait"], once["max_deliveries"], once["dead_letter"]) == (None, 1, "dead/once")
    with Client(bus.address) as a, Client(bus.address) as b, Client(bus.address) as dead:
        dead.subscribe(b"dead/")
        dead.sync(5)
        fa, oa = a.join("fast", timeout=20), a.join("once", timeout=20)
        publish(bus.address, [b"fast/1", b"once/1"])
        first = {fa.next(timeout=20).key, oa.next(timeout=20).key}
        assert first == {b"fast/1", b"once/1"}
        fb = b.join("fast", timeout=20)
        again = fb.next(timeout=30)            # a held it past fast's deadline
        assert (again.key, again.deliveries, again.redelivered) == (b"fast/1", 2, True)
        fb.ack(again)
        a.close()                              # once/1 comes back after its one delivery: dead letter
        m = dead.receive(timeout=30)
        assert m.key == b"dead/once" and json.loads(m.payload.partition(b"\0")[0])["key"] == "once/1"
        b.sync(5)
    fast, once = group_stats(bus.address, "fast"), group_stats(bus.address, "once")
    assert (fast["expired"], fast["acked"], once["dead_lettered"], once["expired"]) == (1, 1, 1, 0)
