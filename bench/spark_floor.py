"""The floor for the report's time: a Spark job that starts, reads a recording and counts it.

    .venv/bin/python bench/spark_floor.py DIR [--master URL] [--scan]

Starts Spark the way ``sbus-pipeline`` does (`sbus.pipeline.spark.session`, same
master default), reads ``DIR`` with the recording's schema, counts the rows,
stops. ``--scan``: a bare scan instead of the count (which reads only the Parquet
footers): every value of the columns the report reads (`sbus.pipeline.report.read`:
``recv_time``, ``key``, ``size``, ``dropped``) is decoded, into Spark's ``noop`` sink. Prints one JSON line: rows, and the seconds for starting the session,
the count, and the whole (from process start, as the report is timed from
the outside). `bench/pipeline_report.py` runs it after the report, in the same
run, and gives the report's time as a multiple of this one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_PROCESS = time.monotonic()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/ holds a profile.py: run as a script, it would shadow the standard library's (pyspark imports it)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, ROOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--master", default=None)
    ap.add_argument("--scan", action="store_true", help="decode the report's columns instead of counting rows")
    args = ap.parse_args()
    from sbus.pipeline.spark import read_schema, session

    t = time.monotonic()
    spark = session(args.master, app_name="sbus floor", progress=False)
    spark.sparkContext.setLogLevel("WARN")
    started = time.monotonic() - t
    t = time.monotonic()
    df = spark.read.schema(read_schema()).parquet(args.directory)
    if args.scan:
        from sbus.pipeline.report import read

        read(spark, args.directory).write.format("noop").mode("overwrite").save()
        rows = None  # the noop sink counts nothing back
    else:
        rows = df.count()
    counted = time.monotonic() - t
    spark.stop()
    print(json.dumps({"kind": "scan" if args.scan else "count", "rows": rows, "session_seconds": round(started, 2), "count_seconds": round(counted, 2),
                      "process_seconds": round(time.monotonic() - T_PROCESS, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
