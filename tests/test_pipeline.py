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

from pipeline_conftest import (  # noqa: F401
    ROOT, read_recording, spark, start_recorder, wait_rows, write_truncated,
)
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

    stream.run(spark, str(rec), str(out), str(cp), **kw)
    after1 = output()
    # windows that ended by the watermark (35 s) are out; [30, 40) waits for later data
    assert after1 == windows_of(first, closed_before=30)

    # restart with the same checkpoint; new files, then one far later message that closes the rest
    second = write_phase(rec, range(40, 66, 5), first[-1][1] + 1)
    late = write_phase(rec, [1000], second[-1][1] + 1, per_second=1)
    listener = connect(bus.address)
    listener.subscribe(b"stats/")
    listener.sync(timeout=5)
    stream.run(spark, str(rec), str(out), str(cp), publish_to="stats", bus=bus.address, **kw)
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
        assert m.key == f"stats/{d['prefix']}".encode()
        assert k not in seen
        seen[k] = [d["messages"], d["bytes"]]
    assert seen == expected

    # a third run with nothing new: nothing is counted or published twice
    stream.run(spark, str(rec), str(out), str(cp), publish_to="stats", bus=bus.address, **kw)
    assert output() == expected
    with pytest.raises(TimeoutError):
        listener.receive(timeout=0.5)
    listener.close()


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "sbus.pipeline", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_cli_errors_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "_tmp").mkdir()
    for args, text in (
        (["report", str(tmp_path / "missing"), "--out", str(tmp_path / "r")], "no such directory"),
        (["report", str(tmp_path / "empty"), "--out", str(tmp_path / "r")], "no recorded files"),
        (["stream", str(tmp_path / "missing"), "--out", "o", "--checkpoint", "c"], "no such directory"),
        (["report", str(tmp_path / "empty"), "--out", "r", "--window", "0s"], "--window must be positive"),
    ):
        p = run_cli(*args)
        assert p.returncode == 2, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sbus-pipeline: ") and text in lines[0], p.stderr
