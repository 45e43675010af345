"""The sbus Spark source (``format("sbus")``) and the stream that reads through it (issue 35)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
from collections import defaultdict

import pytest

from pipeline_conftest import ROOT, read_recording, spark, start_recorder, wait_rows  # noqa: F401
from helpers import child_env, wait_until
from sbus.client import connect
from sbus.pipeline.source import journal_batches, journals
from sbus.pipeline.writer import RecordingWriter, gap_payload

import pyspark  # noqa: F401  (the test extra installs it: a missing install fails, never skips)

T0 = 1_700_000_000_000_000  # a multiple of 10 s


def utc_us(t) -> int:
    if t.tzinfo is None:
        t = t.astimezone()  # collect() gives naive local times
    return round(t.timestamp() * 1_000_000)


def message_rows(first_seq, n, t_us, step_us=1000, tag=b"a"):
    return [(t_us + i * step_us, first_seq + i, b"%s/%d" % (tag, i % 3), b"x" * (i % 17)) for i in range(n)]


def test_batch_and_stream_read_files_and_the_live_journal(spark, tmp_path):
    """Published files, then rows only in the journal (a drop row and a gap row among them):
    ``read`` sees them all, in seq order, each kind as itself; ``readStream`` reads them in
    micro-batches of at most ``maxRecordsPerTrigger`` seqs and, restarted on its checkpoint,
    reads only what came since: every row once."""
    from sbus.pipeline.source import register

    register(spark)
    rec, out, cp = tmp_path / "rec", tmp_path / "out", tmp_path / "cp"
    w = RecordingWriter(str(rec), fsync=False)
    rows = []
    for f in range(3):
        rows += message_rows(len(rows) + 1, 10, T0 + f * 1_000_000)
        w.extend(rows[-10:])
        w.publish()
    rows += message_rows(len(rows) + 1, 6, T0 + 4_000_000, tag=b"b")
    w.extend(rows[-6:])  # in the journal only: not published
    w.add_drop(T0 + 4_500_000, 37, 5, b"b/0", b"b/2")
    w.add_drop(T0 + 4_600_000, 38, -1, b"", gap_payload(37, T0 + 4_500_000, T0 + 4_600_000, 0))
    assert len(os.listdir(rec)) == 4  # three files and _tmp

    got = spark.read.format("sbus").load(str(rec)).orderBy("seq").collect()
    assert [r["seq"] for r in got] == list(range(1, 39))
    assert [r["kind"] for r in got][-3:] == ["message", "drop", "gap"]
    assert got[-2]["dropped"] == 5 and got[-1]["dropped"] == -1
    assert [(utc_us(r["recv_time"]), r["key"], r["payload"]) for r in got[:36]] == \
        [(t, k, p) for t, _, k, p in rows]

    def stream_once(**opts):
        reader = spark.readStream.format("sbus")
        for k, v in opts.items():
            reader = reader.option(k, v)
        q = (reader.load(str(rec)).writeStream.format("parquet").option("path", str(out))
             .option("checkpointLocation", str(cp)).trigger(availableNow=True).start())
        q.awaitTermination()
        return [json.loads(p["sources"][0]["endOffset"])["seq"] for p in q.recentProgress if p["numInputRows"]]

    ends = stream_once(maxRecordsPerTrigger=15)
    assert ends == [15, 30, 38]
    more = message_rows(39, 20, T0 + 5_000_000, tag=b"c")
    w.extend(more[:12])
    w.publish()  # the journal read before is now a published file (the same seqs)
    w.extend(more[12:])
    assert stream_once(maxRecordsPerTrigger=15) == [53, 58]  # resumes after 38
    seqs = [r["seq"] for r in spark.read.parquet(str(out)).collect()]
    assert sorted(seqs) == list(range(1, 59))  # every row exactly once

    # startingOffsets: a seq (the first read) and latest
    start = spark.readStream.format("sbus").option("startingOffsets", "50").load(str(rec))
    q = start.writeStream.format("memory").queryName("from50").trigger(availableNow=True).start()
    q.awaitTermination()
    assert sorted(r["seq"] for r in spark.sql("select seq from from50").collect()) == list(range(50, 59))
    q = (spark.readStream.format("sbus").option("startingOffsets", "latest").load(str(rec))
         .writeStream.format("memory").queryName("latest").trigger(availableNow=True).start())
    q.awaitTermination()
    assert spark.sql("select * from latest").count() == 0
    w.close()


def write_files(directory, n_files, per_file=50, first_second=0):
    """`n_files` published files of `per_file` rows, one file per second (three prefixes)."""
    w = RecordingWriter(str(directory), fsync=False)
    rows = []
    for f in range(n_files):
        rows += message_rows(w.next_seq + len(rows), per_file, T0 + (first_second + f) * 1_000_000 + 1000,
                             step_us=10_000)
        w.extend(rows[-per_file:])
        w.publish()
    w.close()
    return rows


def counted(spark, out):
    got = defaultdict(int)
    for r in spark.read.parquet(str(out)).collect():
        got[((utc_us(r["window_start"]) - T0) // 1_000_000, r["prefix"])] += r["messages"]
    return dict(got)


def expected(rows, window_s=10):
    exp = defaultdict(int)
    for t, _, k, _ in rows:
        exp[((t - T0) // 1_000_000 // window_s * window_s, k.split(b"/")[0].decode())] += 1
    return dict(exp)


def test_close_at_end_counts_every_row_of_a_long_recording(spark, tmp_path):
    """Issue 35 fault 1: 25 files read 50 rows per micro-batch (5 batches) with
    --close-at-end: every window, every row (the closing row used to be read in the first
    batch, and every later batch's rows were dropped as late, in silence: 20 files of 35)."""
    from sbus.pipeline import stream

    rec, out, cp = tmp_path / "rec", tmp_path / "out", tmp_path / "cp"
    rows = write_files(rec, 25, per_file=10)
    held = stream.run(spark, str(rec), str(out), str(cp), window_seconds=10, depth=1, watermark_seconds=0,
                      max_records_per_trigger=50, available_now=True, close_at_end=True)
    assert held == []
    assert len([n for n in os.listdir(cp / "sink" / "offsets") if n.isdigit()]) >= 5
    assert counted(spark, out) == expected(rows)
    assert sum(counted(spark, out).values()) == 25 * 10


def test_rows_dropped_as_late_are_counted_and_fail_the_run(spark, tmp_path):
    """A closed stream that then reads rows for windows already closed: Spark drops them;
    the run says how many and fails, unless asked to drop late rows."""
    from sbus.pipeline import stream

    rec, out, cp = tmp_path / "rec", tmp_path / "out", tmp_path / "cp"
    write_files(rec, 3, per_file=10)
    kw = dict(window_seconds=10, depth=1, watermark_seconds=0, available_now=True, close_at_end=True)
    stream.run(spark, str(rec), str(out), str(cp), **kw)
    before = counted(spark, out)
    w = RecordingWriter(str(rec), fsync=False)  # rows stamped in the first window, recorded later
    w.extend(message_rows(w.next_seq, 40, T0 + 2_000_000))
    w.close()
    with pytest.raises(stream.LateRows) as e:
        stream.run(spark, str(rec), str(out), str(cp), **kw)
    assert e.value.dropped >= 1 and f"dropped {e.value.dropped} late row(s)" in str(e.value)
    assert counted(spark, out) == before
    w = RecordingWriter(str(rec), fsync=False)
    w.extend(message_rows(w.next_seq, 7, T0 + 5_000_000))
    w.close()
    said = []
    stream.run(spark, str(rec), str(out), str(cp), log=said.append, drop_late=True, **kw)
    assert any("late row(s)" in line and "--drop-late" in line for line in said), said
    assert counted(spark, out) == before


def run_stream_cli(log_path, *args):
    """``sbus-pipeline stream ARGS`` in its own process, its output in `log_path`."""
    env = child_env()
    env["SBUS_SHUFFLE_PARTITIONS"] = "2"
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "sbus.pipeline", "--master", "local[2]", "-q", "stream",
                                 *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.slow
# two Spark processes one after the other, beside the other slow tests: under load (a loaded CI
# run) the second alone took 90 s, its JVM's start 60 s of it, and the test passed pytest.ini's 180 s
@pytest.mark.timeout(480)
def test_stream_exactly_once_across_kill_9_of_the_query(bus, start_recorder, spark, tmp_path):
    """Real processes: a recorder on a bus, ``sbus-pipeline stream --trigger`` reading it live;
    the query is killed with SIGKILL after some committed batches, traffic goes on, and a
    restart on the same checkpoint (``--available-now --close-at-end``) counts every message
    once."""
    rec_dir, out, cp = tmp_path / "rec", tmp_path / "out", tmp_path / "cp"
    start_recorder(bus.address, rec_dir, "--roll-age", "2s")
    sent = defaultdict(int)

    def publish(n, tag):
        with connect(bus.address) as c:
            for i in range(n):
                c.publish(b"%s/%d" % (tag, i % 4), b"p" * (i % 50))
                sent[tag.decode()] += 1
            c.sync(timeout=30)

    publish(3000, b"a")
    args = [str(rec_dir), "--out", str(out), "--checkpoint", str(cp), "--window", "1s",
            "--max-records-per-trigger", "500", "--trigger", "200 milliseconds"]
    p = run_stream_cli(tmp_path / "stream-1.log", *args)
    commits = cp / "sink" / "commits"
    try:
        wait_until(lambda: (p.poll() is None or pytest.fail((tmp_path / "stream-1.log").read_text()[-3000:]))
                   and commits.is_dir()
                   and len([n for n in os.listdir(commits) if n.isdigit()]) >= 3,
                   "three committed micro-batches", timeout=120)
        publish(2000, b"b")
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
    publish(1000, b"c")
    wait_rows(rec_dir, 6000)  # 6,000 published rows (the journal may hold them before)
    p = run_stream_cli(tmp_path / "stream-2.log", *args[:-4], "--available-now", "--close-at-end")
    try:
        assert p.wait(timeout=300) == 0, (tmp_path / "stream-2.log").read_text()[-3000:]
    finally:
        p.kill()    # not left running if the wait ran out
        p.wait()
    got = defaultdict(int)
    for r in spark.read.parquet(str(out)).collect():
        if r["prefix"] is not None:
            got[r["prefix"]] += r["messages"]
    assert dict(got) == dict(sent)  # every message once: none lost, none twice


def test_the_docs_example_runs_as_written(spark, tmp_path, monkeypatch, capsys):
    """docs/pipeline.md's ``format("sbus")`` examples (the second, key filters, goes on from
    the first), on a recording with a published file, rows only in the live journal and a
    drop row."""
    import re

    text = open(os.path.join(ROOT, "docs", "pipeline.md")).read()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if 'format("sbus")' in b]
    assert len(blocks) == 2
    code = "\n".join(blocks)
    monkeypatch.chdir(tmp_path)
    w = RecordingWriter("rec", fsync=False)
    w.extend(message_rows(1, 9, T0))
    w.publish()
    w.extend(message_rows(10, 6, T0 + 1_000_000, tag=b"b"))
    w.add_drop(T0 + 2_000_000, 16, 4)
    exec(compile(code, "docs/pipeline.md", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r"\|\s*drop\|\s*1\|", out) and re.search(r"\|\s*message\|\s*15\|", out), out
    for key, n in ((b"a/0", 3), (b"b/0", 2), (b"b/2", 2)):
        assert re.search(rf"\|\s*{key.decode()}\|\s*{n}\|", out), out
    assert re.search(r"\|\s*message\|\s*6\|", out), out  # keyPrefix b/: its six, and the drop row
    assert "a/0 or b/2: 5" in out, out
    w.close()


def test_rate_chart_after_a_loss(spark, tmp_path):
    """Issue 35 fault 3: after a crash, the loss the restart learnt of (a drop row of 60,000)
    was drawn as one 30,000 msg/s point that set the y-axis, the lines ran across the gap, and
    the headline's average (gaps counted as silence) disagreed with window_stats'. Now: the
    loss is a count per window on its own axis, no point inside the gap, the rate axis fits the
    rates, and the headline's average is window_stats' basis (the time recorded)."""
    from sbus.pipeline import report

    rec = tmp_path / "rec"
    w = RecordingWriter(str(rec), fsync=False)
    t0 = T0 + 300_000
    before = [(t0 + i * 1000, i + 1, b"a/x" if i % 2 else b"b/y", b"p" * 20) for i in range(10_000)]  # 10 s
    w.extend(before)
    restart = before[-1][0] + 12_000_000  # 12 s down
    w.add_drop(restart, 10_001, -1, b"", gap_payload(10_000, before[-1][0], restart, 0))
    w.add_drop(restart + 1000, 10_002, 60_000)  # what the bus counted while no recorder ran
    after = [(restart + 2000 + i * 1000, 10_003 + i, b"a/x" if i % 2 else b"b/y", b"p" * 20) for i in range(8000)]
    w.extend(after)
    w.close()
    out = tmp_path / "report"
    summary = report.run(spark, str(rec), str(out), window_seconds=2, log=lambda text: None)
    assert summary["lost"] == 60_000
    chart = json.loads((out / "rate.json").read_text())
    cw = chart["window_seconds"]  # the chart's own window (enough points for the span)
    assert "(lost)" not in chart["series"]
    assert [n for _, n in chart["lost_per_window"]] == [60_000]
    g_from, g_to = (dt.datetime.fromisoformat(x) for x in chart["gaps"][0])
    for name in ("a", "b"):
        points = chart["series"][name]
        inside = [v for x, v in points
                  if g_from <= dt.datetime.fromisoformat(x) and dt.datetime.fromisoformat(x) + dt.timedelta(seconds=cw) <= g_to]
        assert len(inside) >= 4 and all(v is None for v in inside), points  # no line through the gap
        rates = [v for _, v in points if v is not None]
        assert max(rates) < 600 and min(rates) > 400, rates  # 500 msg/s each, partial windows too
    assert chart["y_axis"][1] < 1000  # the rates fill the axis
    stats = [r for r in pq_rows(out / "tables" / "window_stats") if r["messages"]]
    basis = sum(r["messages"] for r in stats) / sum(r["covered_seconds"] for r in stats)
    text = (out / "summary.txt").read_text()
    avg = float(text.split("average rate")[1].split("msg/s")[0].replace(",", ""))
    assert abs(avg - basis) <= 0.5 and abs(avg - 1000) < 5, (avg, basis)
    assert "gaps left out" in text


def pq_rows(path):
    import pyarrow.parquet as pq

    return pq.read_table(str(path)).to_pylist()


@pytest.mark.slow
def test_source_exactly_once_across_kill_9_of_the_recorder(bus, start_recorder, spark, tmp_path):
    """Real recorder processes: the stream reads rows from the live journal, the recorder is
    killed with SIGKILL, a new one recovers that journal (the same rows under the same seqs)
    and records on; the restarted query reads every recorded row once, the gap row in its
    place, and nothing the recorder did not keep."""
    from sbus.pipeline.source import register

    register(spark)
    rec_dir, out, cp = tmp_path / "rec", tmp_path / "out", tmp_path / "cp"
    rec = start_recorder(bus.address, rec_dir)  # default --roll-age 60s: all in the journal

    def publish(first, n):
        with connect(bus.address) as c:
            for i in range(first, first + n):
                c.publish(b"k/%d" % (i % 5), b"%d" % i)
            c.sync(timeout=30)

    def stream_once():
        q = (spark.readStream.format("sbus").load(str(rec_dir)).select("seq", "kind", "payload")
             .writeStream.format("parquet").option("path", str(out)).option("checkpointLocation", str(cp))
             .trigger(availableNow=True).start())
        q.awaitTermination()

    publish(0, 3000)
    wait_until(lambda: sum(b.num_rows for _, p in journals(str(rec_dir)) for b in journal_batches(p)) >= 3000,
               "3,000 rows in the journal")
    stream_once()
    assert spark.read.parquet(str(out)).count() == 3000  # read from the journal: nothing published yet
    os.kill(rec.pid, signal.SIGKILL)
    rec.proc.wait(10)
    rec2 = start_recorder(bus.address, rec_dir, "--roll-age", "1s")
    rec2.wait_log("from the unpublished leftover")
    publish(3000, 2000)
    stream_once()
    assert rec2.stop() in (0, -15)
    stream_once()
    got = spark.read.parquet(str(out)).collect()
    recorded = read_recording(rec_dir)
    assert sorted(r["seq"] for r in got) == [r["seq"] for r in recorded]  # each row once
    assert [r["kind"] for r in sorted(got, key=lambda r: r["seq"]) if r["kind"] != "message"][0] == "gap"
    numbers = [int(r["payload"]) for r in got if r["kind"] == "message"]
    assert len(numbers) == len(set(numbers)) and set(range(3000)) <= set(numbers)
    assert set(numbers) == {int(r["payload"]) for r in recorded if r["dropped"] == 0}


def clustered_recording(directory):
    """Two published files of ``a/*`` keys, one of ``b/*``, then in the journal ``c/*`` rows, a
    drop row (key ``a/0``) and a gap row (key empty): 38 rows; the files' row groups hold one
    prefix each, so their key statistics tell a reader which it may skip."""
    w = RecordingWriter(str(directory), fsync=False)
    seq = 1
    for f, tag in enumerate((b"a", b"a", b"b")):
        w.extend(message_rows(seq, 10, T0 + f * 1_000_000, tag=tag))
        w.publish()
        seq += 10
    w.extend(message_rows(seq, 6, T0 + 4_000_000, tag=b"c"))
    w.add_drop(T0 + 4_500_000, 37, 5, b"a/0", b"a/2")
    w.add_drop(T0 + 4_600_000, 38, -1, b"", gap_payload(37, T0 + 4_500_000, T0 + 4_600_000, 0))
    return w


def test_key_filters_are_applied_in_the_reader(spark, tmp_path, capsys):
    """Key filters skip rows in the reader: ``keyPrefix``/``keys`` (stream and batch) give the
    matching messages and every drop and gap row, from fewer rows read (row groups skipped on
    their key statistics, the journal's rows left out), and the stream hands Spark only those
    (its numInputRows); a batch query's ``key = X`` / ``key IN (...)`` are pushed into the
    reader (Spark does not filter them again) and give exactly the rows with those keys."""
    from pyspark.sql import functions as F

    from sbus.pipeline.source import KeyMatch, ReadCount, read_range, register

    register(spark)
    rec = tmp_path / "rec"
    w = clustered_recording(rec)
    everything = [(r["seq"], r["key"]) for r in spark.read.format("sbus").load(str(rec)).collect()]
    assert len(everything) == 38
    losses = [37, 38]

    def seqs(df):
        return sorted(r["seq"] for r in df.collect())

    # the reader itself: fewer rows read than the range holds
    count = ReadCount()
    got = read_range(str(rec), 0, 38, match=(KeyMatch(prefix=b"b/", losses=True),), count=count)
    assert sorted(s for t in got for s in t.column("seq").to_pylist()) == list(range(21, 31)) + losses
    assert count.row_groups_skipped == 2 and count.rows_read == 10 + 8 and count.rows_out == 12

    # options, batch and stream: the matching messages, and every loss
    want_b = [s for s, k in everything if k.startswith(b"b/")] + losses
    assert seqs(spark.read.format("sbus").option("keyPrefix", "b/").load(str(rec))) == want_b
    want_keys = [s for s, k in everything if k in (b"a/1", b"c/0")] + losses
    q = (spark.readStream.format("sbus").option("keys", "a/1,c/0").option("maxRecordsPerTrigger", 15)
         .load(str(rec)).writeStream.format("memory").queryName("keyed").trigger(availableNow=True).start())
    q.awaitTermination()
    assert sorted(r["seq"] for r in spark.sql("select seq from keyed").collect()) == want_keys
    assert sum(p["numInputRows"] for p in q.recentProgress) == len(want_keys) < 38  # all Spark was given
    assert seqs(spark.read.format("sbus").option("keys", '["a/1", "c/0"]').load(str(rec))) == want_keys

    # pushed down from the query: SQL's meaning (the drop row is there as its key is a/0)
    df = spark.read.format("sbus").load(str(rec))
    assert seqs(df.where(F.col("key").isin(b"c/1", b"a/0"))) == \
        [s for s, k in everything if k in (b"c/1", b"a/0")]
    q = df.where((F.col("key") == b"a/1") & (F.col("size") > 2))
    q.explain(mode="formatted")
    plan = capsys.readouterr().out
    assert "PushedFilters: [IsNotNull(key), EqualTo(key" in plan, plan
    (condition,) = [line for line in plan.splitlines() if line.startswith("Condition :")]
    assert "size" in condition and "key" not in condition, plan  # Spark filters only on size
    assert [(r["key"], r["size"] > 2) for r in q.collect()] == [(b"a/1", True)] * 4
    w.close()


def test_key_options_bad_input(spark, tmp_path):
    """Both options at once, or a key list that is no list: one clear error."""
    from sbus.pipeline.source import register

    register(spark)
    rec = tmp_path / "rec"
    clustered_recording(rec).close()
    for opts, words in (({"keys": "a/1", "keyPrefix": "a/"}, "keys or keyPrefix, not both"),
                        ({"keys": "a/1,,a/2"}, "an empty key"),
                        ({"keys": '["a/1", 2]'}, "a JSON list of strings")):
        reader = spark.read.format("sbus")
        for k, v in opts.items():
            reader = reader.option(k, v)
        with pytest.raises(Exception, match=words):
            reader.load(str(rec)).collect()



def test_a_session_with_pushdown_off_still_reads(spark, tmp_path):
    """``register(spark, push_filters=False)``: a reader that takes no filters from the query,
    so a session that keeps Spark's switch off reads (Spark filters on key itself)."""
    from sbus.pipeline.source import PUSHDOWN_CONF, register

    rec = tmp_path / "rec"
    clustered_recording(rec).close()
    register(spark, push_filters=False)
    spark.conf.set(PUSHDOWN_CONF, "false")
    try:
        df = spark.read.format("sbus").load(str(rec)).where("key = X'612F31'")  # a/1
        assert sorted(r["seq"] for r in df.collect()) == [2, 5, 8, 12, 15, 18]
    finally:
        register(spark)
    assert spark.conf.get(PUSHDOWN_CONF) == "true"
