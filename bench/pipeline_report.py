"""The 1,000,000-message report: record real bus traffic, then time `sbus-pipeline report`.

    .venv/bin/python bench/pipeline_report.py [--messages 1000000] [--work bench/out/pipeline]
                                              [--synthetic] [--docs docs/pipeline]

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
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
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
        for k in ks:
            size = min(int(rng.lognormvariate(4.6, 1.2)), 65_536)
            yield k, rng.randbytes(size)


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


def record_via_bus(n, work):
    rec = os.path.join(work, "rec")
    address = os.path.join(work, "bus.socket")
    bus_log = open(os.path.join(work, "sbusd.log"), "wb")
    bus = subprocess.Popen([sys.executable, "-m", "sbus.server.sbusd", "-f", "-r", "-a", address],
                           stdout=subprocess.PIPE, stderr=bus_log, cwd=ROOT)
    bus.stdout.read()  # sbusd -f closes stdout when it listens
    rec_log_path = os.path.join(work, "record.log")
    rec_log = open(rec_log_path, "wb")
    recorder = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "twistd"), "-n", "--pidfile=", "sbus-record",
         "--bus", address, "--out", rec, "--roll-age", "10s", "--queue-bytes", "256M"],  # lossless: the default
        stdout=rec_log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_ready(recorder, b"subscribed", rec_log_path)
        t = time.monotonic()
        out = subprocess.run([sys.executable, __file__, "--publish", address, "--messages", str(n)],
                             capture_output=True, text=True, cwd=ROOT, check=True)
        publish_s = time.monotonic() - t
        recorder.send_signal(signal.SIGTERM)
        recorder.wait(120)
        got = count_rows(rec)
        log = open(rec_log_path).read()
        dropped = [ln for ln in log.splitlines() if "cannot keep up" in ln or "the bus dropped" in ln]
        print(f"published {json.loads(out.stdout)['sent']} in {publish_s:.1f}s "
              f"({n / publish_s:,.0f} msg/s); recorded {got}; drop warnings: {len(dropped)}")
        return {"method": "bus", "publish_seconds": round(publish_s, 1), "recorded": got,
                "drop_warnings": len(dropped)}
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "pipeline"))
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs", "pipeline"))
    ap.add_argument("--window", default="2s")
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--publish", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.publish:
        return publisher(args.publish, args.messages)

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    info = record_synthetic(args.messages, args.work) if args.synthetic else record_via_bus(args.messages, args.work)
    rec = os.path.join(args.work, "rec")
    size = sum(os.path.getsize(os.path.join(rec, f)) for f in os.listdir(rec) if f.endswith(".parquet"))
    report_dir = os.path.join(args.work, "report")
    cmd = [sys.executable, "-m", "sbus.pipeline", "report", rec, "--out", report_dir, "--window", args.window]
    print("$", " ".join(cmd), flush=True)
    t = time.monotonic()
    subprocess.run(cmd, check=True, cwd=ROOT)
    took = time.monotonic() - t
    info.update(report_seconds=round(took, 1), recording_bytes=size,
                files=len([f for f in os.listdir(rec) if f.endswith(".parquet")]))
    os.makedirs(args.docs, exist_ok=True)
    for name in ("rate.png", "top_keys.png", "sizes.png", "summary.txt"):
        shutil.copy(os.path.join(report_dir, name), os.path.join(args.docs, name))
    with open(os.path.join(args.docs, "run.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
