"""The 1,000,000-message report: record real bus traffic, then time `sbus-pipeline report`.

    .venv/bin/python bench/pipeline_report.py [--messages 1000000] [--work bench/out/pipeline]
                                              [--synthetic] [--docs docs/pipeline]
                                              [--crash-at 0.5 [--downtime 2]] [--no-floor | --floor count]
                                              [--recording DIR] [--pairs N]

1. starts ``sbusd`` and ``twistd -n sbus-record`` (real processes, real sockets);
2. one publisher process sends ``--messages`` messages through the bus in
   phases of different rates (keys from a skewed distribution over 5
   prefixes, log-normal payload sizes), so the charts have something to show;
3. waits until the recorder has published every message, stops it;
4. runs ``python -m sbus.pipeline report DIR --out REPORT --window 2s`` and times it;
5. copies the PNGs and summary into ``--docs`` and prints the figures.

``--synthetic`` skips the bus and writes the same traffic with the
recorder's own writer (`RecordingWriter`), with receive times spread over
ten minutes (for when the bus is too slow on a machine).

``--crash-at F`` kills the recorder with SIGKILL once about F of the
messages are in its files (journal included), waits ``--downtime`` seconds
and starts it again while the publisher goes on; afterwards it checks that
every message sent is recorded or lost at the gap row the restart wrote
(each payload starts with its number), and that the report's first line
names the gap.

Before the report (unless ``--no-floor``) it times the *floor*,
``bench/spark_floor.py --scan``: a Spark job that starts and scans the same files
(the report's columns, every value decoded; ``--floor count``: only counts them, from
the footers), in the same run; the report's time is given as a multiple of
it, with the report's own breakdown (``timings.json``). ``--pairs N`` times N
such pairs, floor then report, one after the other (on a shared machine only
a pair's own ratio means much), and gives each pair's ratio and their median.
``--recording DIR`` times an existing recording instead of making one (its
``run.json`` then goes to ``--work``, the docs' charts are left alone).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PREFIXES = [("sensors", 40), ("app", 25), ("metrics", 18), ("log", 12), ("ctl", 5)]
# target msg/s per phase and its share of the messages; 0 = as fast as possible
PHASES = [(8000, 0.10), (20000, 0.20), (0, 0.35), (4000, 0.05), (15000, 0.30)]


def make_keys(rng):
    keys = []
    for prefix, weight in PREFIXES:
        n = weight * 4
        for i in range(n):
            keys.append((f"{prefix}/{['a', 'b', 'c', 'd'][i % 4]}/{i}".encode(), weight / (i + 1)))
    return [k for k, _ in keys], [w for _, w in keys]


def traffic(n, seed=6):
    """Yield (key, payload) deterministically."""
    rng = random.Random(seed)
    keys, weights = make_keys(rng)
    batch = 10_000
    for start in range(0, n, batch):
        ks = rng.choices(keys, weights, k=min(batch, n - start))
        for j, k in enumerate(ks):
            size = min(int(rng.lognormvariate(4.6, 1.2)), 65_536)
            yield k, b"%08d" % (start + j) + rng.randbytes(max(size - 8, 0))  # its number first


def publisher(address, n):
    import sbus.client

    gen = traffic(n)
    sent = 0
    with sbus.client.connect(address) as c:
        for rate, share in PHASES:
            count = round(n * share) if (rate, share) != PHASES[-1] else n - sent
            t0 = time.monotonic()
            for i in range(count):
                k, p = next(gen)
                c.publish(k, p)
                if rate and not i % 200:
                    ahead = t0 + i / rate - time.monotonic()
                    if ahead > 0:
                        time.sleep(ahead)
            sent += count
        c.sync(timeout=60)
    print(json.dumps({"sent": sent}))


def wait_ready(proc, needle, log_path, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log_path, "rb") as f:
            if needle in f.read():
                return
        if proc.poll() is not None:
            raise SystemExit(f"process exited: {open(log_path).read()}")
        time.sleep(0.05)
    raise SystemExit(f"{needle!r} not seen in {log_path}")


def count_rows(directory):
    import pyarrow.parquet as pq

    from sbus.pipeline.schema import published_files

    return sum(pq.ParquetFile(p).metadata.num_rows for *_, p in published_files(directory))


def journal_rows(directory):
    """Rows in the recorder's files so far: published, and the journal of the one being written."""
    from sbus.pipeline.writer import JOURNAL_SUFFIX, read_journal

    n = count_rows(directory)
    tmp = os.path.join(directory, "_tmp")
    for name in os.listdir(tmp) if os.path.isdir(tmp) else ():
        if name.endswith(JOURNAL_SUFFIX):
            try:
                table, _ = read_journal(os.open(os.path.join(tmp, name), os.O_RDONLY), name)
            except OSError:
                continue
            n += table.num_rows if table is not None else 0
    return n


def start_recorder(address, rec, log_path):
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "twistd"), "-n", "--pidfile=", "sbus-record",
         "--bus", address, "--out", rec, "--roll-age", "10s", "--queue-bytes", "256M"],  # lossless: the default
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return proc


def check_crash(rec, sent):
    """Every message sent is recorded or lost at a gap: {recorded, lost_at_gaps, gaps}."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from sbus.pipeline.schema import published_files

    numbers, gaps = [], []
    for *_, path in published_files(rec):
        t = pq.read_table(path, columns=["seq", "payload", "dropped"])
        d = t.column("dropped").to_pylist()
        heads = pc.binary_slice(t.column("payload"), 0, 8).to_pylist() if hasattr(pc, "binary_slice") \
            else [p[:8] for p in t.column("payload").to_pylist()]
        for drop, head in zip(d, heads):
            if drop == 0:
                numbers.append(int(head))
            elif drop < 0:
                gaps.append(len(numbers))  # the gap falls before this many recorded messages
            else:
                raise SystemExit(f"unexpected drop row ({drop} lost) in a lossless recording")
    # between gaps the numbers run on by one; across a gap they jump: that jump is what it lost
    lost = 0
    bounds = [0, *gaps, len(numbers)]
    for a, b in zip(bounds, bounds[1:]):
        part = numbers[a:b]
        if part != list(range(part[0], part[0] + len(part))) if part else False:
            raise SystemExit(f"messages missing or out of order between gaps (rows {a}..{b})")
    for g in gaps:
        before = numbers[g - 1] if g > 0 else -1
        after = numbers[g] if g < len(numbers) else sent
        lost += after - before - 1
    if numbers and numbers[0] != 0 and (not gaps or gaps[0] != 0):
        raise SystemExit(f"the first {numbers[0]} messages are missing with no gap row")
    if numbers and numbers[-1] != sent - 1 and (not gaps or gaps[-1] != len(numbers)):
        raise SystemExit("the last messages are missing with no gap row")
    if len(numbers) + lost != sent:
        raise SystemExit(f"sent {sent} != recorded {len(numbers)} + lost at gaps {lost}")
    return {"recorded": len(numbers), "lost_at_gaps": lost, "gaps": len(gaps)}


def record_via_bus(n, work, crash_at=None, downtime=2.0):
    rec = os.path.join(work, "rec")
    address = os.path.join(work, "bus.socket")
    bus_log = open(os.path.join(work, "sbusd.log"), "wb")
    bus = subprocess.Popen([sys.executable, "-m", "sbus.server.sbusd", "-f", "-r", "-a", address],
                           stdout=subprocess.PIPE, stderr=bus_log, cwd=ROOT)
    bus.stdout.read()  # sbusd -f closes stdout when it listens
    rec_log_path = os.path.join(work, "record.log")
    open(rec_log_path, "wb").close()
    recorder = start_recorder(address, rec, rec_log_path)
    info = {"method": "bus"}
    try:
        wait_ready(recorder, b"subscribed", rec_log_path)
        t = time.monotonic()
        pub = subprocess.Popen([sys.executable, __file__, "--publish", address, "--messages", str(n)],
                               stdout=subprocess.PIPE, text=True, cwd=ROOT)
        if crash_at is not None:
            while journal_rows(rec) < crash_at * n:
                if pub.poll() is not None:
                    raise SystemExit("the publisher ended before the crash point")
                time.sleep(0.2)
            recorder.kill()  # SIGKILL: no clean stop
            recorder.wait()
            killed = time.monotonic() - t
            time.sleep(downtime)  # the recorder is down: what is published now is lost
            recorder = start_recorder(address, rec, rec_log_path)
            wait_ready(recorder, b"gap row at seq", rec_log_path)
            info.update(killed_after_seconds=round(killed, 1), downtime_seconds=downtime)
            print(f"killed the recorder (SIGKILL) {killed:.1f}s into the publish; restarted {downtime:g}s later")
        out, _ = pub.communicate()
        if pub.returncode:
            raise SystemExit("the publisher failed")
        publish_s = time.monotonic() - t
        recorder.send_signal(signal.SIGTERM)
        recorder.wait(300)
        got = count_rows(rec)
        log = open(rec_log_path).read()
        dropped = [ln for ln in log.splitlines() if "cannot keep up" in ln or "the bus dropped" in ln]
        print(f"published {json.loads(out)['sent']} in {publish_s:.1f}s "
              f"({n / publish_s:,.0f} msg/s); {got} rows recorded; drop warnings: {len(dropped)}")
        info.update(publish_seconds=round(publish_s, 1), rows=got, drop_warnings=len(dropped))
        if crash_at is not None:
            info["recovered_line"] = next((ln.split("] ", 1)[-1] for ln in log.splitlines()
                                           if "recovered" in ln and "leftover" in ln), None)
            info["stop_line"] = [ln.split("] ", 1)[-1] for ln in log.splitlines() if "stopped:" in ln][-1]
        check = check_crash(rec, n)
        info.update(check)
        print(f"sent {n:,} = recorded {check['recorded']:,} + lost at {check['gaps']} gap(s) "
              f"{check['lost_at_gaps']:,}")
        return info
    finally:
        if recorder.poll() is None:
            recorder.kill()
        bus.send_signal(signal.SIGINT)
        bus.wait(10)


def record_synthetic(n, work):
    from sbus.pipeline.writer import RecordingWriter

    rec = os.path.join(work, "rec")
    w = RecordingWriter(rec, roll_bytes=64 << 20)
    t0 = int(time.time() * 1e6)
    span_us = 600 * 1_000_000
    rows = []
    t = time.monotonic()
    for i, (k, p) in enumerate(traffic(n)):
        rows.append((t0 + i * span_us // n, w.next_seq + i, k, p))
        if len(rows) == 50_000:
            w.extend(rows)
            rows = []
    w.extend(rows)
    w.close()
    return {"method": "synthetic (RecordingWriter)", "write_seconds": round(time.monotonic() - t, 1),
            "recorded": count_rows(rec)}


def run_report(rec, report_dir, window):
    """Run ``sbus-pipeline report`` on `rec`; its wall time in seconds."""
    cmd = [sys.executable, "-m", "sbus.pipeline", "report", rec, "--out", report_dir, "--window", window]
    print("$", " ".join(cmd), flush=True)
    t = time.monotonic()
    subprocess.run(cmd, check=True, cwd=ROOT)
    return time.monotonic() - t


def run_floor(rec, kind="scan"):
    """Time the floor (`bench/spark_floor.py`, a bare scan or a count) on `rec`: its JSON line
    plus ``wall_seconds``."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "spark_floor.py"), rec] + (["--scan"] if kind == "scan" else [])
    print("$", " ".join(cmd), flush=True)
    t = time.monotonic()
    floor = json.loads(subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True).stdout)
    floor["wall_seconds"] = round(time.monotonic() - t, 1)
    return floor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "pipeline"))
    ap.add_argument("--docs", default=None,
                    help="where the charts, summary.txt and run.json go (default docs/pipeline; "
                         "with --recording: --work)")
    ap.add_argument("--window", default="2s")
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--crash-at", type=float, default=None, metavar="F",
                    help="kill -9 the recorder when about F of the messages are recorded, then restart it")
    ap.add_argument("--downtime", type=float, default=2.0, help="seconds the recorder stays down")
    ap.add_argument("--no-floor", action="store_true", help="do not time the floor (bench/spark_floor.py)")
    ap.add_argument("--floor", choices=("scan", "count"), default="scan",
                    help="the floor: a bare scan of the report's columns (default), or a count (footers only)")
    ap.add_argument("--recording", metavar="DIR", help="time this existing recording (records nothing)")
    ap.add_argument("--pairs", type=int, default=1, metavar="N",
                    help="time N pairs of floor then report (their ratios and the median go in run.json)")
    ap.add_argument("--publish", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.publish:
        return publisher(args.publish, args.messages)

    if args.recording:  # time an existing recording: no bus, no writing
        rec = args.recording
        os.makedirs(args.work, exist_ok=True)
        info = {"method": f"existing recording {rec}", "rows": count_rows(rec)}
    else:
        shutil.rmtree(args.work, ignore_errors=True)
        os.makedirs(args.work)
        info = record_synthetic(args.messages, args.work) if args.synthetic else \
            record_via_bus(args.messages, args.work, args.crash_at, args.downtime)
        rec = os.path.join(args.work, "rec")
    size = sum(os.path.getsize(os.path.join(rec, f)) for f in os.listdir(rec) if f.endswith(".parquet"))
    report_dir = os.path.join(args.work, "report")
    info.update(recording_bytes=size, files=len([f for f in os.listdir(rec) if f.endswith(".parquet")]))
    pairs = []
    for i in range(args.pairs):
        # floor and report alternate, so each pair ran under the same load (the machine may be shared)
        floor = None if args.no_floor else run_floor(rec, args.floor)
        took = run_report(rec, report_dir, args.window)
        with open(os.path.join(report_dir, "timings.json")) as f:
            pair = {"report_seconds": round(took, 1), "report_breakdown": json.load(f)}
        if floor:
            pair.update(floor=floor, report_over_floor=round(took / floor["wall_seconds"], 2))
        print(json.dumps(pair), flush=True)
        pairs.append(pair)
    info.update(pairs[-1])
    if len(pairs) > 1:
        info["pairs"] = pairs
        if not args.no_floor:
            info["median_report_over_floor"] = statistics.median(p["report_over_floor"] for p in pairs)
            floor_s = statistics.median(p["floor"]["wall_seconds"] for p in pairs)
            report_s = statistics.median(p["report_seconds"] for p in pairs)
            info.update(median_floor_seconds=floor_s, median_report_seconds=report_s,
                        report_over_floor_of_medians=round(report_s / floor_s, 2))
    first_line = open(os.path.join(report_dir, "summary.txt")).readline().rstrip("\n")
    info["headline"] = first_line
    if info.get("gaps") and "gap" not in first_line:
        raise SystemExit(f"the report's first line does not name the gap: {first_line}")
    docs = args.docs or (args.work if args.recording else os.path.join(ROOT, "docs", "pipeline"))
    os.makedirs(docs, exist_ok=True)
    for name in ("rate.png", "top_keys.png", "sizes.png", "summary.txt"):
        if os.path.realpath(docs) != os.path.realpath(report_dir):
            shutil.copy(os.path.join(report_dir, name), os.path.join(docs, name))
    with open(os.path.join(docs, "run.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
