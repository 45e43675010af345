#!/usr/bin/env python3
"""Confirmed submissions to a work queue from one Python producer (docs/queues.md).

    .venv/bin/python bench/queue_submit.py [--jobs N] [--batch B] [--size BYTES] [--no-store]

Starts a bus (``sbusd -f``) and ``twistd sbus-queue --group bench=bench/ --limit N`` (with
``--store`` in a temporary directory unless --no-store), then one blocking client submits N
jobs of BYTES bytes in batches of B with `Client.submit` (each batch confirmed: held, and
fsynced in the journal with a store, before the next is sent). Prints jobs/s and the median
and 90th percentile of a batch's confirmation latency. Nobody consumes: the jobs stay queued.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sbus.client import Client  # noqa: E402


def wait_for(path, needle, proc, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"sbus-queue exited {proc.returncode}")
        try:
            with open(path) as f:
                if needle in f.read():
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"sbus-queue not ready: {needle!r} not in {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--no-store", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        address = os.path.join(d, "bus.socket")
        server = subprocess.Popen([sys.executable, "-m", "sbus.server.sbusd", "-f", "-a", address],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        server.stdout.read()
        log = os.path.join(d, "queue.log")
        argv = [sys.executable, "-m", "twisted", "--log-format", "text", "sbus-queue",
                "--bus", address, "--group", "bench=bench/", "--limit", str(args.jobs + 1)]
        if not args.no_store:
            argv += ["--store", os.path.join(d, "store")]
        logf = open(log, "wb")
        queue = subprocess.Popen(argv, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT)
        try:
            wait_for(log, "control: following the members", queue)
            payload = b"x" * args.size
            batches = [[(b"bench/%d" % (i + j), payload) for j in range(min(args.batch, args.jobs - i))]
                       for i in range(0, args.jobs, args.batch)]
            lat = []
            with Client(address) as c:
                c.submit("bench", batches[0][:1])  # the first request sets up the reply key
                start = time.perf_counter()
                for b in batches:
                    t = time.perf_counter()
                    c.submit("bench", b, timeout=30)
                    lat.append(time.perf_counter() - t)
                took = time.perf_counter() - start
            lat.sort()
            print(f"{args.jobs} jobs of {args.size} B in batches of {args.batch}, "
                  f"{'in memory' if args.no_store else 'journalled and fsynced (--store)'}: "
                  f"{args.jobs / took:,.0f} jobs/s; batch confirmation median "
                  f"{statistics.median(lat) * 1000:.2f} ms, p90 {lat[int(len(lat) * 0.9)] * 1000:.2f} ms")
        finally:
            queue.terminate()
            queue.wait()
            logf.close()
            server.terminate()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
