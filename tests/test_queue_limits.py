"""A group's caps, `--max-jobs` and `--max-bytes`, and what one more job does at them,
`--overflow reject-publish|drop-oldest` (docs/queues.md "Caps and overflow"): the core's rules,
then a real `sbus-queue --store` with a real member, submitter and `sbus submit`, killed -9 and
started again.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from helpers import REPO, wait_until
from sbus.client import Client, QueueFull
from sbus.core.queuestore import QueueStore
from test_queue import MEMBER, QueueProcess, _deliveries, _join, lines, online, service_stats  # noqa: F401
from test_queue_acks import sbus_cli


def _submit(core, group, jobs):
    from sbus.core.workqueue import encode_jobs

    return core.submit(group, encode_jobs(jobs))[0]


def test_core_drop_oldest_drops_the_oldest_waiting_never_in_flight(tmp_path):
    store = QueueStore(str(tmp_path))
    core = online([(b"jobs", b"j/")], window=1, store=store,
                  caps={b"jobs": {"limit": 100, "max_bytes": 30, "overflow": "drop-oldest"}})
    _join(core)
    assert len(_deliveries(core.message(b"j/0", b"x" * 7))) == 1   # in flight: never dropped
    for i in range(1, 6):                                           # 10 bytes each: 3 may wait
        core.message(b"j/%d" % i, b"x" * 7)
    g = core.groups[b"jobs"]
    assert [e.key for e in g.backlog] == [b"j/3", b"j/4", b"j/5"] and g.backlog.bytes == 30
    assert g.lost["dropped"] == 2 and g.stats()["in_flight"] == 1
    assert _submit(core, b"jobs", [(b"j/6", b"x" * 7), (b"j/7", b"x" * 7)]) == b"ok 2"
    assert [e.key for e in g.backlog] == [b"j/5", b"j/6", b"j/7"] and g.lost["dropped"] == 4
    # a batch bigger than the caps themselves is refused whole; a publish that big is counted full
    assert _submit(core, b"jobs", [(b"j/big", b"x" * 40)]).startswith(b"full: queue full")
    core.message(b"j/big", b"x" * 40)
    assert g.lost["full"] == 1 and g.submit_refused == 1 and len(g.backlog) == 3
    # the drops are journaled as done: the store replays the in-flight job and the 3 waiting
    store.flush(sync=True)
    store.close()
    assert [k for _, k, _ in QueueStore(str(tmp_path)).open(b"jobs")[1]] == [b"j/0", b"j/5", b"j/6", b"j/7"]


def test_core_reject_publish_refuses_submissions_and_counts_publishes_by_bytes():
    core = online([(b"held", b"h/"), (b"jobs", b"j/")], full="discard", max_bytes=25)
    g = core.groups[b"jobs"]
    assert _submit(core, b"jobs", [(b"j/1", b"x" * 7), (b"j/2", b"x" * 7)]) == b"ok 2"   # 20 bytes
    assert _submit(core, b"jobs", [(b"j/3", b"x" * 7)]) == (
        b"full: queue full (2 jobs, 20 bytes waiting; max 10000 jobs, 25 bytes)")
    core.message(b"j/4", b"x" * 7)
    core.message(b"j/5", b"x")                                                           # 4 bytes fit
    assert (g.lost["full"], g.submit_refused, len(g.backlog), g.lost["dropped"]) == (1, 1, 3, 0)
    # block (the default mode) holds the publishers by bytes too: pause at the cap, resume under half
    core = online([(b"jobs", b"j/")], max_bytes=100)
    for i in range(10):
        core.message(b"j/%d" % i, b"x" * 7)
    assert core.should_pause() and not core.may_resume()
    _join(core)  # a member takes its window of 64: all of it
    assert core.may_resume() and not core.should_pause()


def test_caps_per_group_options_are_checked():
    bad = [(["--max-jobs", "nosuch=5"], "no --group named nosuch"),
           (["--overflow", "drop-newest"], "--overflow: one of reject-publish, drop-oldest"),
           (["--max-bytes", "jobs=0"], "max-bytes")]
    for argv, needle in bad:
        p = subprocess.run([sys.executable, "-m", "twisted", "sbus-queue", "--group", "jobs=j/", *argv],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
        assert p.returncode != 0 and needle in p.stderr and "Traceback" not in p.stderr, (argv, p.stderr)




def test_caps_through_the_service_survive_kill9(bus, tmp_path):
    """One service, two groups: `keep` (--max-jobs 5, reject-publish, --full discard) tells a
    submitter "queue full" and counts the publishes it refused; `fresh` (--max-bytes 1000,
    drop-oldest) keeps the newest jobs and its member's in-flight ones, drops the oldest
    waiting ones, counted, and after a kill -9 of the service the same command started again
    brings back exactly the jobs that were not dropped."""
    store = tmp_path / "store"
    argv = ["--group", "keep=keep/", "--group", "fresh=fresh/", "--max-jobs", "keep=5", "--full", "discard",
            "--max-bytes", "fresh=1000", "--overflow", "fresh=drop-oldest", "--window", "2", "--store", str(store)]
    first = QueueProcess(bus.address, tmp_path / "q1.log", argv)
    held = tmp_path / "held"
    member = subprocess.Popen([sys.executable, MEMBER, bus.address, "fresh", str(held), "--never-ack"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    try:
        assert member.stdout.readline() == b"joined\n"
        with Client(bus.address) as c:
            assert c.submit("keep", [(b"keep/%d" % i, b"p") for i in range(5)]) == 5
            with pytest.raises(QueueFull, match="queue full"):
                c.submit("keep", [(b"keep/x", b"p")])
            for i in range(10):
                c.publish(b"keep/pub%d" % i, b"p")
            for i in range(20):   # 108 bytes each: 9 may wait beside the member's 2 in flight
                assert c.submit("fresh", [(b"fresh/%02d" % i, b"x" * 100)]) == 1
            c.sync(30)
        p = sbus_cli(bus.address, "submit", "keep", "keep/cli", "p")
        assert p.returncode == 1 and b"queue full" in p.stderr and b"Traceback" not in p.stderr, p.stderr
        p = sbus_cli(bus.address, "stats", "--services")
        [st] = [a["stats"] for a in json.loads(p.stdout) if a["service"] == "sbus-queue"]
        keep, fresh = st["groups"]["keep"], st["groups"]["fresh"]
        assert (keep["submit_refused"], keep["lost"]["full"], keep["backlog"]) == (2, 10, 5), keep
        assert (fresh["lost"]["dropped"], fresh["backlog"], fresh["backlog_bytes"], fresh["in_flight"]) == (
            9, 9, 972, 2), fresh
        assert st["lost"]["dropped"] == 9 and fresh["overflow"] == "drop-oldest" and keep["max_bytes"] is None
        assert sorted(k for k, _ in lines(held)) == [b"fresh/00", b"fresh/01"]
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
        member.kill()
        member.wait(30)
        second = QueueProcess(bus.address, tmp_path / "q2.log", argv)
        try:
            st = service_stats(bus.address)["groups"]
            assert (st["fresh"]["replayed"], st["keep"]["replayed"]) == (11, 5), st
            got = tmp_path / "got"
            worker = subprocess.Popen([sys.executable, MEMBER, bus.address, "fresh", str(got)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
            try:
                assert worker.stdout.readline() == b"joined\n"
                want = [b"fresh/%02d" % i for i in (0, 1, *range(11, 20))]
                wait_until(lambda: len(lines(got)) >= len(want), "the jobs not dropped, again", 60)
                assert sorted(k for k, _ in lines(got)) == want
            finally:
                worker.kill()
                worker.wait(30)
        finally:
            second.stop()
    finally:
        if member.poll() is None:
            member.kill()
            member.wait(30)
        if first.proc.poll() is None:
            first.stop()


def test_the_metrics_collector_counts_drops_and_shows_the_byte_cap_as_a_level():
    from sbus.metrics import Families, service_metrics
    from sbus.services.queue import QueueService

    svc = QueueService(None, [(b"r", b"r/")], caps={b"r": {"max_bytes": 10, "overflow": "drop-oldest"}})
    for i in range(3):
        svc.core.message(b"r/%d" % i, b"x" * 7)
    out = Families()
    service_metrics("queue", svc.stats(), out)
    got = {(s.name, tuple(sorted(s.labels.items()))): (s.value, f.type) for f in out for s in f.samples}
    assert got[("sbus_service_lost_messages_total", (("reason", "dropped"), ("service", "queue")))] == (2, "counter")
    assert got[("sbus_queue_group_lost_total", (("group", "r"), ("reason", "dropped")))] == (2, "counter")
    assert got[("sbus_queue_group_max_bytes", (("group", "r"),))] == (10, "gauge")
    assert got[("sbus_queue_group_backlog_bytes", (("group", "r"),))] == (10, "gauge")


def test_a_stats_answer_never_counts_what_the_journal_has_not_written(tmp_path):
    """CI found it: an ack and a stats request in one turn, and the answer (acked: 2) went out
    before the turn's journal write, so a kill -9 just after brought acked jobs back. Whatever a
    stats answer counts is in the kernel (written, not yet fsynced) when it leaves."""
    from twisted.internet.task import Clock

    from sbus.services.queue import QueueService

    store = QueueStore(str(tmp_path))
    svc = QueueService(None, [(b"r", b"r/")], store=store, reactor=Clock())
    for i in range(3):
        svc.core.message(b"r/%d" % i, b"job")
    assert store.dirty, "the jobs' records wait for the end of the turn"
    seen = []

    class Control:
        credentials, max_packet = None, 1 << 20

        def sendPacket(self, packet):
            seen.append((json.loads(packet.split(b"\0", 1)[1])["stats"]["groups"]["r"]["received"],
                         sum(1 for _ in store.dirty), (tmp_path / "r.journal").stat().st_size))

    svc.answerStats(Control(), b"!/cred/0/0/0/stats")
    received, dirty, size = seen[0]
    assert (received, dirty) == (3, 0) and size > 0, seen
    store.close()
