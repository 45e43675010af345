"""Publish -> row in the sink: how far behind the bus a Spark stream over the sbus source runs.

    .venv/bin/python bench/stream_latency.py [--rate 10000] [--seconds 30] [--warmup 10]
                                             [--trigger 0] [--work DIR]

Real processes and real Spark (local mode): ``sbusd``, ``twistd -n sbus-record`` with its
defaults (a file is published 60 s after its first row: the stream reads the live journal),
a publisher process sending ``--rate`` messages per second for ``--warmup`` + ``--seconds``
seconds, each payload starting with its publish time (``time.time_ns()``), and in this process
``spark.readStream.format("sbus")`` into a ``foreachBatch`` sink. The sink takes each batch's
publish times (Arrow) and, once it has the whole batch, stamps it: latency = that stamp minus
the publish time, for every message. Messages published in the warm-up (the JVM's first
batches) are left out. Prints one JSON line: median, p90, p99, max (seconds), how many
messages, batches, and that every message came exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# not bench/ first on the path: its profile.py would shadow the standard one pyspark imports
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, ROOT)
sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # after the standard library

from pipeline_report import wait_ready  # noqa: E402


def publish(address: str, rate: float, seconds: float) -> None:
    """The publisher process: `rate` msg/s, paced per 100 messages; payload ``<ns>:<n>:`` + pad."""
    import sbus.client

    n = int(rate * seconds)
    pad = b"x" * 80
    with sbus.client.connect(address) as c:
        t0 = time.monotonic()
        for i in range(n):
            if not i % 100:
                ahead = t0 + i / rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            c.publish(b"lat/%d" % (i % 8), b"%d:%d:" % (time.time_ns(), i) + pad)
        c.sync(timeout=60)
    print(json.dumps({"sent": n, "seconds": time.monotonic() - t0}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=10_000)
    ap.add_argument("--seconds", type=float, default=30.0, help="measured seconds of traffic")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of traffic left out first")
    ap.add_argument("--trigger", default="0 seconds", help="processingTime trigger (default: back to back)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--publish", nargs=3, metavar=("ADDRESS", "RATE", "SECONDS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.publish:
        publish(a.publish[0], float(a.publish[1]), float(a.publish[2]))
        return 0

    import numpy as np

    from sbus.pipeline.source import register
    from sbus.pipeline.spark import session

    work = a.work or tempfile.mkdtemp(prefix="sbus-latency-")
    os.makedirs(work, exist_ok=True)
    rec = os.path.join(work, "rec")
    shutil.rmtree(rec, ignore_errors=True)
    shutil.rmtree(os.path.join(work, "cp"), ignore_errors=True)
    address = os.path.join(work, "bus.socket")
    procs = []
    bus = subprocess.Popen([sys.executable, "-m", "sbus.server.sbusd", "-f", "-r", "-a", address],
                           stdout=subprocess.PIPE, stderr=open(os.path.join(work, "sbusd.log"), "wb"), cwd=ROOT)
    procs.append(bus)
    bus.stdout.read()  # sbusd -f closes stdout once it listens
    rec_log = os.path.join(work, "record.log")
    recorder = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "twistd"), "-n", "--pidfile=",
                                 "sbus-record", "--bus", address, "--out", rec],
                                stdout=open(rec_log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    procs.append(recorder)
    try:
        wait_ready(recorder, b"subscribed", rec_log)
        spark = session("local[2]", app_name="sbus-latency", progress=False,
                        conf={"spark.sql.shuffle.partitions": "2", "spark.ui.enabled": "false"})
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        lat_parts, seen, batches = [], [], []

        def sink(df, batch_id):
            t = df.selectExpr("cast(split(cast(payload as string), ':')[0] as bigint) as pub",
                              "cast(split(cast(payload as string), ':')[1] as bigint) as n").toArrow()
            now = time.time_ns()
            if t.num_rows:
                pub = t.column("pub").to_numpy()
                lat_parts.append((pub, (now - pub) / 1e9))
                seen.append(t.column("n").to_numpy())
                batches.append((batch_id, t.num_rows, now))

        q = (spark.readStream.format("sbus").load(os.path.abspath(rec)).where("kind = 'message'")
             .writeStream.foreachBatch(sink).option("checkpointLocation", os.path.join(work, "cp"))
             .trigger(processingTime=a.trigger).start())
        total = a.warmup + a.seconds
        t_start = time.time_ns()
        pub = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--publish", address, str(a.rate),
                                str(total)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        sent = json.loads(pub.communicate(timeout=total * 3 + 60)[0])
        deadline = time.monotonic() + 120
        while sum(len(s) for s in seen) < sent["sent"] and time.monotonic() < deadline:
            time.sleep(0.1)
        q.stop()
        ns = np.concatenate(seen) if seen else np.array([], dtype=np.int64)
        pubs = np.concatenate([p for p, _ in lat_parts])
        lats = np.concatenate([x for _, x in lat_parts])
        keep = pubs >= t_start + int(a.warmup * 1e9)
        lat = lats[keep]
        out = {
            "rate": a.rate, "sent": sent["sent"], "publish_seconds": round(sent["seconds"], 2),
            "received": int(len(ns)), "exactly_once": bool(len(ns) == sent["sent"]
                                                           and len(np.unique(ns)) == sent["sent"]),
            "measured": int(len(lat)), "batches": len(batches),
            "median_s": round(float(np.median(lat)), 3), "p90_s": round(float(np.percentile(lat, 90)), 3),
            "p99_s": round(float(np.percentile(lat, 99)), 3), "max_s": round(float(lat.max()), 3),
            "trigger": a.trigger, "loadavg": [round(x, 2) for x in os.getloadavg()],
        }
        print(json.dumps(out))
        spark.stop()
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
