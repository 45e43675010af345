"""The Spark jobs, on real PySpark in local mode (one session for the run: `spark`)."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import subprocess
import sys
import time
from collections import defaultdict

import pyarrow.parquet as pq
import pytest
import signal
import stat

from pipeline_conftest import (  # noqa: F401
    ROOT, read_recording, spark, start_recorder, wait_rows, write_truncated,
)
from helpers import wait_until
from sbus.client import connect
from sbus.pipeline.writer import RecordingWriter

import pyspark  # noqa: E402,F401  (the test extra installs it: a missing install fails, never skips)


def percentile(sorted_values, p):
    """Linear interpolation between closest ranks (numpy's default), written out."""
    pos = p * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def epoch_us(t) -> int:
    if isinstance(t, dt.datetime):
        if t.tzinfo is None:
            t = t.replace(tzinfo=dt.timezone.utc)
        return round(t.timestamp() * 1_000_000)
    return int(t)


def prefix(key: bytes, depth: int) -> str:
    return b"/".join(key.split(b"/")[:depth]).decode()


def table(path):
    return pq.read_table(str(path)).to_pylist()


def test_report_counts_bytes_percentiles_per_window(bus, start_recorder, spark, tmp_path):
    from sbus.pipeline import report

    out = tmp_path / "rec"
    rec = start_recorder(bus.address, out, "--roll-bytes", "32K", "--roll-age", "300ms")
    published = []
    with connect(bus.address) as c:
        for burst in range(3):  # three bursts, a second apart: several 1 s windows
            for i in range(600 * (burst + 1)):
                key = [b"app/web/req", b"app/db/q", b"sys/cpu", b"sys/mem/free", b"solo"][(i * (burst + 2)) % 5]
                payload = os.urandom((i * 37 + burst * 11) % 900)
                c.publish(key, payload)
                published.append((key, payload))
            c.sync(timeout=10)
            time.sleep(1.05)
    wait_rows(out, len(published))
    rec.stop()
    # a crash leftover appearing later must not be read either
    write_truncated(out / "_tmp" / "rec-0000000000999999.parquet.part")

    rows = read_recording(out)
    assert sorted((r["key"], r["payload"]) for r in rows) == sorted(published)

    # expected, computed here without Spark
    win = defaultdict(lambda: [0, 0])
    sizes = defaultdict(list)
    for r in rows:
        w = epoch_us(r["recv_time"]) // 1_000_000 * 1_000_000
        cell = win[(w, prefix(r["key"], 2))]
        cell[0] += 1
        cell[1] += r["size"]
        sizes[w].append(r["size"])
    assert len(sizes) >= 3

    summary = report.run(spark, str(out), str(tmp_path / "report"), window_seconds=1.0, depth=2,
                         top=3, log=lambda text: None)
    tables = tmp_path / "report" / "tables"

    got = {(epoch_us(r["window_start"]), r["prefix"]): [r["messages"], r["bytes"]]
           for r in table(tables / "windows")}
    assert got == dict(win)
    # per prefix totals straight from what was published (no clock involved)
    per_prefix = defaultdict(lambda: [0, 0])
    for k, p in published:
        per_prefix[prefix(k, 2)][0] += 1
        per_prefix[prefix(k, 2)][1] += len(p)
    totals = defaultdict(lambda: [0, 0])
    for (w, pre), (m, b) in got.items():
        totals[pre][0] += m
        totals[pre][1] += b
    assert dict(totals) == dict(per_prefix)

    stats = {epoch_us(r["window_start"]): r for r in table(tables / "window_stats")}
    assert set(stats) == set(sizes)
    for w, vals in sizes.items():
        vals.sort()
        s = stats[w]
        assert (s["messages"], s["bytes"], s["size_min"], s["size_max"]) == (len(vals), sum(vals), vals[0], vals[-1])
        for p, col in ((0.5, "size_p50"), (0.9, "size_p90"), (0.99, "size_p99")):
            assert s[col] == pytest.approx(percentile(vals, p), abs=1e-9), (w, col)

    all_sizes = sorted(len(p) for _, p in published)
    assert summary["messages"] == len(published)
    assert summary["bytes"] == sum(all_sizes)
    assert summary["distinct_keys"] == 5 and summary["distinct_prefixes"] == 5
    for p, col in ((0.5, "size_p50"), (0.99, "size_p99"), (0.999, "size_p999")):
        assert summary[col] == pytest.approx(percentile(all_sizes, p))
    per_second = defaultdict(int)
    for r in rows:
        per_second[epoch_us(r["recv_time"]) // 1_000_000] += 1
    assert summary["peak_msgs_per_s"] == max(per_second.values())

    top = table(tables / "top_keys")
    counts = defaultdict(lambda: [0, 0])
    for k, p in published:
        counts[k.decode()][0] += 1
        counts[k.decode()][1] += len(p)
    want = sorted(counts.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))[:3]
    assert [(r["key"], [r["messages"], r["bytes"]]) for r in top] == want

    hist = table(tables / "size_hist")
    assert sum(r["messages"] for r in hist) == len(published)
    for r in hist:
        assert r["messages"] == sum(1 for s in all_sizes if r["size_from"] <= s <= r["size_to"])

    page = (tmp_path / "report" / "index.html").read_text()
    for png in ("rate.png", "top_keys.png", "sizes.png"):
        assert f'src="{png}"' in page
        assert (tmp_path / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"messages        {len(published):,}" in (tmp_path / "report" / "summary.txt").read_text()


T0 = 1_700_000_000_000_000  # a multiple of 10 s


def write_phase(directory, seconds, start_seq, per_second=7):
    """Rows at known times: `per_second` messages in each listed second; one file per second."""
    w = RecordingWriter(str(directory), fsync=False)
    assert w.next_seq == start_seq
    rows = []
    seq = start_seq
    for s in seconds:
        for i in range(per_second):
            rows.append((T0 + s * 1_000_000 + i * 1000, seq, b"p%d/k%d" % (seq % 3, i), b"x" * (seq % 50)))
            seq += 1
        w.extend(rows[-per_second:])
        w.publish()
    return rows


def windows_of(rows, window_s=10, closed_before=None):
    exp = defaultdict(lambda: [0, 0])
    for t, seq, k, p in rows:
        w = (t - T0) // 1_000_000 // window_s * window_s
        if closed_before is None or w + window_s <= closed_before:
            exp[(w, prefix(k, 1))][0] += 1
            exp[(w, prefix(k, 1))][1] += len(p)
    return dict(exp)


def test_stream_counts_exactly_once_across_restart(bus, spark, tmp_path):
    from sbus.pipeline import stream

    rec, out, cp = tmp_path / "rec", tmp_path / "out", tmp_path / "cp"
    rec.mkdir()
    first = write_phase(rec, range(0, 36, 5), 1)  # t = 0 .. 35 s
    write_truncated(rec / "_tmp" / "rec-0000000000000999.parquet.part")
    kw = dict(window_seconds=10, depth=1, watermark_seconds=0, max_files_per_trigger=2, available_now=True)

    def output():
        df = spark.read.parquet(str(out))  # honours the sink's _spark_metadata
        got = {}
        for r in df.collect():
            start = r["window_start"].astimezone(dt.timezone.utc)  # collect(): naive local time
            k = ((epoch_us(start) - T0) // 1_000_000, r["prefix"])
            assert k not in got, f"window {k} written twice"
            got[k] = [r["messages"], r["bytes"]]
        return got

    stream.run(spark, str(rec), str(out), str(cp), shuffle_partitions=3, **kw)
    after1 = output()
    # the number of shuffle partitions is chosen at the first start and kept in the checkpoint
    assert '"spark.sql.shuffle.partitions":"3"' in (cp / "sink" / "offsets" / "0").read_text()
    # windows that ended by the watermark (35 s) are out; [30, 40) waits for later data
    assert after1 == windows_of(first, closed_before=30)

    # restart with the same checkpoint; new files, then one far later message that closes the rest
    second = write_phase(rec, range(40, 66, 5), first[-1][1] + 1)
    late = write_phase(rec, [1000], second[-1][1] + 1, per_second=1)
    listener = connect(bus.address)
    listener.subscribe(b"_pipeline/stats/")
    listener.sync(timeout=5)
    stream.run(spark, str(rec), str(out), str(cp), publish_to="stats", bus=bus.address, shuffle_partitions=5, **kw)
    assert sorted(n for n in os.listdir(cp / "sink" / "state" / "0") if n.isdigit()) == ["0", "1", "2"]  # 3, not 5
    expected = windows_of(first + second + late, closed_before=1000)
    assert output() == expected
    assert sum(m for m, _ in output().values()) == len(first) + len(second)

    # every finished window went out on the bus once, with its figures
    seen = {}
    while True:
        try:
            m = listener.receive(timeout=1)
        except TimeoutError:
            break
        d = json.loads(m.payload)
        k = ((epoch_us(dt.datetime.fromisoformat(d["window_start"])) - T0) // 1_000_000, d["prefix"])
        assert m.key == f"_pipeline/stats/{d['prefix']}".encode()
        assert k not in seen
        seen[k] = [d["messages"], d["bytes"]]
    assert seen == expected

    # a third run with nothing new: nothing is counted or published twice
    stream.run(spark, str(rec), str(out), str(cp), publish_to="stats", bus=bus.address, **kw)
    assert output() == expected
    with pytest.raises(TimeoutError):
        listener.receive(timeout=0.5)
    listener.close()
    spark.conf.set("spark.sql.shuffle.partitions", "2")  # the shared session's setting


def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "sbus.pipeline", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_errors_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_tmp").mkdir()
    for args, text in (
        (["report", str(tmp_path / "missing"), "--out", str(tmp_path / "r")], "no such directory"),
        (["report", str(tmp_path / "empty"), "--out", str(tmp_path / "r")], "no recorded files"),
        (["stream", str(tmp_path / "missing"), "--out", "o", "--checkpoint", "c"], "no such directory"),
        (["report", str(tmp_path / "empty"), "--out", "r", "--window", "0s"], "--window must be positive"),
        (["stream", str(tmp_path / "empty"), "--out", "o", "--checkpoint", "c", "--keys", "a,,b"], "an empty key"),
        (["stream", str(tmp_path / "empty"), "--out", "o", "--checkpoint", "c", "--key-prefix", ""],
         "--key-prefix is empty"),
        (["stream", str(tmp_path / "empty"), "--out", "o", "--checkpoint", "c", "--key", "a", "--key-prefix", "b"],
         "not both"),
        (["stream", str(tmp_path / "empty"), "--out", "o", "--checkpoint", "c", "--source", "files",
          "--keys", "a"], "need the sbus source"),
    ):
        p = run_cli(*args)
        assert p.returncode == 2, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sbus-pipeline: ") and text in lines[0], p.stderr


def private_tree(root):
    """Every directory under `root` 0700 and every file 0600 (issue 16 item 14)."""
    for d, dirs, files in os.walk(root):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d
        for f in files:
            assert stat.S_IMODE(os.lstat(os.path.join(d, f)).st_mode) == 0o600, os.path.join(d, f)


def test_report_of_a_short_recording(spark, tmp_path):
    """A 4-second recording and the default 60 s window: the rate chart still shows several
    points over an axis that spans the data, the headline says the recording is shorter than
    a window, and its average rate is never above its peak (one basis: 1-second windows)."""
    from sbus.pipeline import report

    rec = tmp_path / "rec"
    w = RecordingWriter(str(rec), fsync=False)
    t0 = T0 + 200_000  # 0.2 s into a second
    rows = [(t0 + int(4_000_000 * (i / 4000) ** 2), i + 1, b"a/%d" % (i % 3) if i % 4 else b"b/x", b"y" * (i % 40))
            for i in range(4000)]  # 4 s, ever faster
    w.extend(rows)
    w.close()
    old = os.umask(0)
    try:
        summary = report.run(spark, str(rec), str(tmp_path / "report"), log=lambda text: None)
    finally:
        os.umask(old)
    assert summary["messages"] == 4000 and summary["lost"] == 0
    chart = json.loads((tmp_path / "report" / "rate.json").read_text())
    assert chart["window_seconds"] < 60 and chart["points"] >= 10
    for name in ("a", "b"):
        assert len(chart["series"][name]) == chart["points"]
    lo, hi = (dt.datetime.fromisoformat(x).timestamp() for x in chart["x_axis"])
    first, last = t0 / 1e6, rows[-1][0] / 1e6
    assert lo <= first and hi >= last  # the axis covers the data ...
    assert hi - lo <= (last - first) + 2 * chart["window_seconds"]  # ... and not four years of nothing
    text = (tmp_path / "report" / "summary.txt").read_text()
    assert "messages        4,000 recorded, none known lost" in text
    assert "shorter than one 60 s window" in text
    avg = float(text.split("average rate")[1].split("msg/s")[0].replace(",", ""))
    peak = float(text.split("peak rate")[1].split("msg/s")[0].replace(",", ""))
    assert 0 < avg <= peak
    private_tree(tmp_path / "report")


def test_lossy_recorder_report_counts_what_the_bus_dropped(start_bus, start_recorder, spark, tmp_path):
    """--lossy and a recorder that cannot keep up (stopped): the bus drops for it, tells it,
    and the report's headline counts exactly the server's own drop counter."""
    from sbus.pipeline import report

    bus = start_bus()
    out = tmp_path / "rec"
    rec = start_recorder(bus.address, out, "--lossy", "--roll-age", "300ms")
    n = 30_000
    os.kill(rec.pid, signal.SIGSTOP)
    try:
        with connect(bus.address) as c:
            for i in range(n):
                c.publish(b"burst/%d" % (i % 5), b"%06d" % i)
            c.sync(timeout=30)
            # (the recorder's connections: its recording one and the one that answers stats)
            rows = [q for q in c.stats(timeout=5)["queues"] if q["pid"] == rec.pid]
    finally:
        os.kill(rec.pid, signal.SIGCONT)
    lost = sum(sum(q["drops"].values()) for q in rows)
    assert lost > 0  # the old default lost these silently
    rec.wait_log(f"{lost} dropped by the bus since start")
    assert rec.stop() in (0, -15)
    assert f"{lost} dropped by the bus" in rec.log()
    rows = read_recording(out)
    messages = [r for r in rows if not r["dropped"]]
    assert sum(r["dropped"] for r in rows) == lost and len(messages) + lost == n
    assert [r["seq"] for r in rows] == list(range(1, len(rows) + 1))

    summary = report.run(spark, str(out), str(tmp_path / "report"), window_seconds=1, log=lambda t: None)
    assert (summary["messages"], summary["lost"]) == (n - lost, lost)
    text = (tmp_path / "report" / "summary.txt").read_text()
    assert f"messages        {n - lost:,} recorded, {lost:,} known lost" in text
    windows = table(tmp_path / "report" / "tables" / "windows")
    assert sum(r["dropped"] for r in windows) == lost
    assert sum(r["messages"] for r in windows) == n - lost
    assert all(r["prefix"] is None for r in windows if r["dropped"])


def test_stream_does_not_count_its_own_output(bus, start_recorder, spark, tmp_path):
    """The stream publishes its windows back onto the bus the recorder records: they are
    not recorded, so they are never counted (issue 15: a whole `agg` prefix appeared)."""
    from sbus.pipeline import stream

    rec_dir, out, cp = tmp_path / "rec", tmp_path / "out", tmp_path / "cp"
    rec = start_recorder(bus.address, rec_dir, "--roll-age", "200ms")
    sent = 0

    def burst(tag):
        nonlocal sent
        with connect(bus.address) as c:
            for i in range(50):
                c.publish(b"%s/%d" % (tag, i % 3), b"x")
            c.sync(timeout=10)
        sent += 50
        wait_rows(rec_dir, sent)

    kw = dict(window_seconds=1, depth=1, watermark_seconds=0, max_files_per_trigger=None, available_now=True,
              publish_to="agg", bus=bus.address)
    burst(b"a")
    t = time.monotonic()
    wait_until(lambda: time.monotonic() - t > 1.1, "the next 1 s window")  # traffic a window later
    burst(b"b")
    stream.run(spark, str(rec_dir), str(out), str(cp), **kw)  # publishes a's window on the bus
    for tag in (b"c", b"d"):  # later traffic closes the windows the published aggregates fell in
        t = time.monotonic()
        wait_until(lambda: time.monotonic() - t > 1.1, "the next 1 s window")
        burst(tag)
    stream.run(spark, str(rec_dir), str(out), str(cp), **kw)
    rec.stop()
    assert not any(r["key"].startswith(b"_pipeline/") for r in read_recording(rec_dir))
    prefixes = {r["prefix"] for r in spark.read.parquet(str(out)).collect()}
    # d's window closes only if later rows come: under load its own 50 messages can straddle a
    # window boundary. What matters: no prefix of the stream's own output.
    assert {"a", "b", "c"} <= prefixes <= {"a", "b", "c", "d"}, prefixes
    private_tree(cp)
    private_tree(out)


def test_headline_rates_share_one_basis():
    """Issue 12 item 7: 500 messages in 0.145 s read "average 3,441 msg/s" beside "peak 250"."""
    from sbus.pipeline.report import headline_text

    first = dt.datetime(2026, 11, 22, 10, 0, 0, 930_000, tzinfo=dt.timezone.utc)
    s = {"messages": 500, "bytes": 500, "first": first, "last": first + dt.timedelta(seconds=0.145),
         "distinct_keys": 1, "distinct_prefixes": 1, "prefix_depth": 1, "lost": 0,
         "peak_msgs_per_s": 250, "peak_second": first, "peak_bytes_per_s": 250,
         "peak_window_messages": 500, "peak_window_start": first, "window_seconds": 60.0,
         "size_min": 1, "size_max": 1, "size_p50": 1, "size_p90": 1, "size_p99": 1, "size_p999": 1}
    text = headline_text(s)
    avg = float(text.split("average rate")[1].split("msg/s")[0].replace(",", ""))
    assert avg <= 250
    assert "shorter than one 60 s window" in text


def test_shuffle_partitions_default():
    from sbus.pipeline.spark import shuffle_partitions

    assert shuffle_partitions(2) == 2
    assert shuffle_partitions(8, 100 << 20) == 8  # small data: one per core
    assert shuffle_partitions(2, 10 << 30) == 40  # 10 GiB: one per 256 MiB
    assert shuffle_partitions(2, 1 << 50) == 200


def test_first_start_is_announced(tmp_path, monkeypatch):
    from sbus.pipeline import cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert "first start on this machine" in cli._starting_line(None)
    cli._note_started()
    assert "first start" not in cli._starting_line(None)
    assert stat.S_IMODE(os.stat(tmp_path / "sbus").st_mode) == 0o700


def test_report_marks_gaps_partial_windows_and_draws_honest_charts(spark, tmp_path):
    """Issue 24 items 1, 4, 5, 6: a recording with a crash gap, starting and ending mid-window.
    The headline's first line names the gap; partial windows (the first, the last, and those the
    gap cuts) are rated over the time the recording covers (the old report showed ~575 and
    ~75 msg/s for a steady 1,000 msg/s); sizes.json: counts that differ by under 1 % on a linear
    axis from zero (it was log, cut near the smallest); "(other)" is drawn under the prefixes."""
    from sbus.pipeline import report
    from sbus.pipeline.writer import gap_payload

    rec = tmp_path / "rec"
    w = RecordingWriter(str(rec), fsync=False)
    t0 = T0 + 850_000  # 0.85 s into a 2 s window
    # 1,000 msg/s, every 1 ms: "dev" a third, 40 small prefixes the rest; sizes 100 or 200 bytes
    def msg(i):
        key = b"dev/x" if i % 3 == 0 else b"o%d/y" % (i % 40)
        return key, b"s" * (100 if i % 2 else 200)

    rows = [(t0 + i * 1000, i + 1, *msg(i)) for i in range(6000)]  # until t0 + 6 s
    w.extend(rows)
    last_before = rows[-1][0]
    restart = last_before + 2_600_000  # the recorder was down 2.6 s
    w.add_drop(restart, 6001, -1, b"", gap_payload(6000, last_before, restart, 6000))
    after = [(restart + i * 1000, 6002 + i, *msg(i)) for i in range(2750)]  # ends 0.15 s into a window
    w.extend(after)
    w.close()
    summary = report.run(spark, str(rec), str(tmp_path / "report"), window_seconds=2, log=lambda text: None)
    out = tmp_path / "report"
    first_line = (out / "summary.txt").read_text().splitlines()[0]
    assert "8,750 recorded" in first_line and "1 gap of unknown size" in first_line, first_line
    assert "after seq 6000" in first_line
    assert summary["gaps"] == 1 and summary["lost"] == 0

    stats = [r for r in pq.read_table(str(out / "tables" / "window_stats")).to_pylist() if r["messages"]]
    for r in stats:
        assert 950 <= r["msgs_per_s"] <= 1050, r  # steady 1,000 msg/s, partial windows included
    assert stats[0]["partial"] and stats[-1]["partial"] and not stats[1]["partial"]
    assert abs(stats[0]["covered_seconds"] - 1.15) < 0.01
    assert sum(r["partial"] for r in stats) >= 3  # first, last, and the gap's

    chart = json.loads((out / "rate.json").read_text())
    dev = [v for _, v in chart["series"]["dev"] if v is not None]
    assert min(dev) > 0.8 * 1000 / 3 and max(dev) < 1.2 * 1000 / 3, dev  # no collapse at the ends
    assert len(chart["partial"]) >= 3 and len(chart["gaps"]) == 1
    style = chart["style"]
    assert all(style["(other)"]["zorder"] < st["zorder"] for name, st in style.items() if name != "(other)")
    assert style["(other)"]["alpha"] < 1

    sizes = json.loads((out / "sizes.json").read_text())
    assert [b["messages"] for b in sizes["buckets"]] == [4375, 4375]
    assert sizes["scale"] == "linear" and sizes["y_axis"][0] == 0


def test_size_chart_goes_log_only_when_it_must():
    from sbus.pipeline.report import size_scale

    assert size_scale([110_500, 110_000, 111_000]) == "linear"
    assert size_scale([5, 1_000_000]) == "log"
    assert size_scale([0, 3, 250]) == "linear"


def test_available_now_says_what_it_holds_back_and_can_close_it(spark, tmp_path):
    """Issue 24 item 3: --available-now wrote 6 of 7 windows and said nothing about the last
    (119,849 messages). Now a run names the held-back window and its count; --close-at-end
    closes it (a closing row moves the watermark and counts nowhere)."""
    from sbus.pipeline import stream

    rec, out, cp = tmp_path / "rec", tmp_path / "out", tmp_path / "cp"
    rec.mkdir()
    rows = write_phase(rec, range(0, 36, 5), 1)  # t = 0 .. 35 s; windows of 10 s
    kw = dict(window_seconds=10, depth=1, watermark_seconds=0, max_files_per_trigger=3, available_now=True)
    said = []
    held = stream.run(spark, str(rec), str(out), str(cp), log=said.append, **kw)
    start = dt.datetime.fromtimestamp((T0 + 30_000_000) / 1e6, dt.timezone.utc)
    assert [(h[0], h[2]) for h in held] == [(start, 14)]  # seconds 30 and 35, 7 each
    assert len(said) == 1 and start.isoformat() in said[0] and "(14 messages)" in said[0], said

    def output():
        got = defaultdict(lambda: [0, 0])
        for r in spark.read.parquet(str(out)).collect():
            k = ((epoch_us(r["window_start"].astimezone(dt.timezone.utc)) - T0) // 1_000_000, r["prefix"])
            got[k][0] += r["messages"]
            got[k][1] += r["bytes"]
        return dict(got)

    assert output() == windows_of(rows, closed_before=30)
    said.clear()
    held = stream.run(spark, str(rec), str(out), str(cp), log=said.append, close_at_end=True, **kw)
    assert held == [] and said == []
    assert output() == windows_of(rows)  # every window, once; the closing row counted nowhere


def test_stream_command_key_filters(spark, tmp_path):
    """``sbus-pipeline stream --key-prefix P`` (and ``--keys``/``--key``) pass the source's key
    filter: only those messages are counted, and drop rows still arrive (their losses counted)."""
    rec, out = tmp_path / "rec", tmp_path / "out"
    rec.mkdir()
    rows = write_phase(rec, range(0, 16, 5), 1)  # keys p0/.., p1/.., p2/..; windows of 10 s
    w = RecordingWriter(str(rec), fsync=False)
    w.add_drop(T0 + 16_000_000, len(rows) + 1, 9, b"p0/k0", b"p2/k1")
    w.publish()
    p = run_cli("stream", str(rec), "--out", str(out), "--checkpoint", str(tmp_path / "cp"), "--window", "10s",
                "--available-now", "--close-at-end", "--key-prefix", "p1", "-q", "--master", "local[1]", timeout=240)
    assert p.returncode == 0, p.stderr
    got = defaultdict(lambda: [0, 0, 0])
    for r in spark.read.parquet(str(out)).collect():
        k = ((epoch_us(r["window_start"].astimezone(dt.timezone.utc)) - T0) // 1_000_000, r["prefix"])
        got[k][0] += r["messages"]
        got[k][1] += r["bytes"]
        got[k][2] += r["dropped"]
    want = {k: v + [0] for k, v in windows_of([r for r in rows if r[2].startswith(b"p1")]).items()}
    want[(10, None)] = [0, 0, 9]  # the drop row: no prefix, its 9 lost messages
    assert dict(got) == want
