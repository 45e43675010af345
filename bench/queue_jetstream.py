#!/usr/bin/env python3
"""Confirmed job submission: sbus-queue `submit` against NATS JetStream, same machine, same jobs.

    .venv/bin/python bench/queue_jetstream.py [--jobs N] [--batch B] [--size BYTES] [--rounds R]

Per round, alternating: (a) `bench/queue_submit.py`'s workload against `twistd sbus-queue
--store` (one blocking producer, `Client.submit` of batches of B, each confirmed once the batch
is journalled and fsynced); (b) nats-server -js with a file-storage stream on jobs.> and one
nats-py producer publishing with `js.publish` B at a time concurrently (asyncio.gather), each
confirmed by its PubAck. Then the latency of one job at a time, confirmed, on each (200 jobs).
Prints jobs/s and single-job confirmation latency (median), medians over the rounds.

Note: JetStream acknowledges a publish once written to its file, and fsyncs on its
sync_interval (2 minutes by default), not per message; sbus-queue fsyncs before each
confirmation. Needs nats-py and nats-server (the test extras install both).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sbus.client import Client  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_log(path, needle, proc, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:4]} exited {proc.returncode}")
        with open(path, "rb") as f:
            if needle in f.read():
                return
        time.sleep(0.05)
    raise SystemExit(f"not ready: {needle!r} not in {path}")


def sbus_round(d, jobs, batch, size):
    address = os.path.join(d, "bus.socket")
    server = subprocess.Popen([sys.executable, "-m", "sbus.server.sbusd", "-f", "-a", address],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    server.stdout.read()
    log = os.path.join(d, "queue.log")
    with open(log, "wb") as logf:
        queue = subprocess.Popen([sys.executable, "-m", "twisted", "--log-format", "text", "sbus-queue", "--bus",
                                  address, "--group", "jobs=jobs/", "--limit", str(jobs + 1000), "--store",
                                  os.path.join(d, "store")], cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT)
    try:
        wait_log(log, b"control: following the members", queue)
        payload = b"x" * size
        with Client(address) as c:
            c.submit("jobs", [(b"jobs/warm", payload)])
            start = time.perf_counter()
            for i in range(0, jobs, batch):
                c.submit("jobs", [(b"jobs/%d" % j, payload) for j in range(i, min(jobs, i + batch))], timeout=30)
            rate = jobs / (time.perf_counter() - start)
            lat = []
            for i in range(200):
                t = time.perf_counter()
                c.submit("jobs", [(b"jobs/one%d" % i, payload)])
                lat.append(time.perf_counter() - t)
        return rate, statistics.median(lat)
    finally:
        queue.terminate()
        queue.wait()
        server.terminate()
        server.wait()


def jetstream_round(d, jobs, batch, size):
    import nats

    exe = shutil.which("nats-server") or os.path.join(os.path.dirname(sys.executable), "nats-server")
    port = free_port()
    log = os.path.join(d, "nats.log")
    with open(log, "wb") as logf:
        srv = subprocess.Popen([exe, "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", os.path.join(d, "js")],
                               stdout=logf, stderr=subprocess.STDOUT)
    try:
        wait_log(log, b"Server is ready", srv)

        async def run():
            nc = await nats.connect(f"nats://127.0.0.1:{port}")
            js = nc.jetstream()
            await js.add_stream(name="JOBS", subjects=["jobs.>"], storage="file")
            payload = b"x" * size
            await js.publish("jobs.warm", payload)
            start = time.perf_counter()
            for i in range(0, jobs, batch):
                await asyncio.gather(*(js.publish(f"jobs.{j}", payload) for j in range(i, min(jobs, i + batch))))
            rate = jobs / (time.perf_counter() - start)
            lat = []
            for i in range(200):
                t = time.perf_counter()
                await js.publish(f"jobs.one{i}", payload)
                lat.append(time.perf_counter() - t)
            await nc.close()
            return rate, statistics.median(lat)

        return asyncio.run(run())
    finally:
        srv.terminate()
        srv.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    results = {"sbus-queue --store": [], "JetStream (file)": []}
    for _ in range(args.rounds):
        for name, fn in (("sbus-queue --store", sbus_round), ("JetStream (file)", jetstream_round)):
            with tempfile.TemporaryDirectory() as d:
                results[name].append(fn(d, args.jobs, args.batch, args.size))
    print(f"{args.jobs} jobs of {args.size} B, confirmed in batches of {args.batch}; medians of {args.rounds} rounds")
    print("| system | jobs/s, batched confirmations | one job confirmed, median |")
    print("|---|---|---|")
    for name, rs in results.items():
        rate = statistics.median(r for r, _ in rs)
        lat = statistics.median(l for _, l in rs)
        print(f"| {name} | {rate:,.0f} | {lat * 1000:.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
