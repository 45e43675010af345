"""``sbus-pipeline stream DIR --out OUT --checkpoint CP``: window aggregates, continuously.

Structured Streaming over the recording directory (the file source picks up
each file the recorder publishes; ``_tmp/`` is never listed), the same
per-(window, prefix) aggregation as the report, with a watermark on
``recv_time``, written in append mode to a Parquet file sink at OUT.

Exactly once: the file source's offsets, the aggregation state and the
sink's commit log (``OUT/_spark_metadata``) all live under the checkpoint;
after a crash or a stop, a restart with the same ``--checkpoint`` resumes
from the last committed batch. Read OUT with ``spark.read.parquet(OUT)``
(it honours ``_spark_metadata``), not by listing files.

A window is emitted once the watermark (latest ``recv_time`` seen minus
``--watermark``) passes its end, i.e. after traffic newer than that has
been recorded; files arriving later than the watermark are dropped by Spark.

``--available-now`` stops when the files present are processed; the
windows the watermark has not passed are held back (their state is in the
checkpoint) and `run` names them with their message counts. With
``close_at_end`` (``--close-at-end``) a *closing row* in ``CP/close/`` (the
query's second file source) moves the watermark past them, so the run
writes them too; it is filtered out after the watermark and counts nowhere.

Drop rows in the recording (messages the bus or the recorder lost) are
counted in the ``dropped`` column of a row whose ``prefix`` is NULL, never
as messages.

``--publish-to NAME --bus ADDRESS`` also publishes each finished window on
the bus from a second query (``foreachBatch``, its own checkpoint under
``CP/publish``): key ``_pipeline/NAME/<prefix>`` (``_pipeline/NAME`` for the
lost count of a window), payload JSON ``{"window_start", "window_end",
"prefix", "messages", "bytes", "dropped", "batch"}``. ``_pipeline/`` is the
pipeline's reserved prefix, which the recorder does not record by default:
the stream never counts its own output.
Idempotent by batch id: the last published batch id is kept in
``CP/publish/sbus-published`` and a re-run batch at or below it is skipped.
(A crash between publishing and noting the id can repeat that one batch;
the ``batch`` field lets consumers discard the duplicate.)
"""

from __future__ import annotations

import json
import os
from datetime import timezone

from .schema import PIPELINE_PREFIX
from .spark import is_remote, local_path, read_schema, window_aggregates
from .units import spark_interval


def publish_root(name: str) -> str:
    """``_pipeline/NAME``: where ``--publish-to NAME`` publishes (the recorder skips it)."""
    root = PIPELINE_PREFIX.decode()
    name = name.strip("/")
    return name if name.startswith(root) or name + "/" == root else root + name


#: The seq of a closing row (`close_windows`): no recorded row has it; it only moves the watermark.
CLOSE_SEQ = -1


def close_dir(checkpoint: str) -> str:
    """``CP/close``: the second file source of the stream, where `close_windows` puts its row."""
    return checkpoint.rstrip("/") + "/close"


def aggregated_stream(spark, directory: str, *, window_seconds: float, depth: int,
                      watermark_seconds: float, max_files_per_trigger: int | None,
                      closer: str | None = None):
    """The per-(window, prefix) aggregation of the recording's files as they come; `closer`
    (`close_dir`) is a second source whose rows only advance the watermark."""
    from pyspark.sql import functions as F

    reader = spark.readStream.schema(read_schema())
    if max_files_per_trigger:
        reader = reader.option("maxFilesPerTrigger", int(max_files_per_trigger))
    src = reader.parquet(directory).select("recv_time", "key", "size", "seq", "dropped")
    if closer is not None:
        src = src.unionByName(spark.readStream.schema(read_schema()).parquet(closer)
                              .select("recv_time", "key", "size", "seq", "dropped"))
    src = src.withWatermark("recv_time", spark_interval(watermark_seconds) if watermark_seconds > 0 else "0 seconds")
    # a closing row moves the watermark (above) and is then left out: it counts nowhere. (The
    # condition names recv_time so that Spark does not push it below the watermark, which it
    # does with filters that leave the event time alone.)
    src = src.where((F.col("seq") != F.lit(CLOSE_SEQ)) | F.col("recv_time").isNull()).drop("seq")
    out = window_aggregates(src, spark_interval(window_seconds), depth)
    return out.withColumn("window_seconds", F.lit(float(window_seconds)))


def ensure_close_dir(spark, checkpoint: str) -> str:
    """Create ``CP/close`` (empty) where Spark writes, so the stream's second source exists."""
    path = close_dir(checkpoint)
    if is_remote(path):
        spark.createDataFrame([], read_schema()).write.mode("append").parquet(path)
    else:
        from .writer import makedirs_private

        makedirs_private(local_path(path))
    return path


def close_windows(spark, directory: str, checkpoint: str, window_seconds: float, watermark_seconds: float):
    """Put one closing row into ``CP/close``: its time (the end of the window holding the
    recording's newest row, plus the watermark delay) moves the watermark past every window
    the recording has, so the next run emits them all. Returns that window's end (UTC), or None
    for an empty recording. Rows recorded later for the closed windows come too late: Spark
    drops them."""
    import datetime as dt

    if is_remote(directory):
        raise ValueError(f"--close-at-end reads the newest time from the files: {directory} is not local")
    newest = newest_time(directory)
    if newest is None:
        return None
    end_us = (newest // int(window_seconds * 1e6) + 1) * int(window_seconds * 1e6)
    at = dt.datetime.fromtimestamp((end_us + int(watermark_seconds * 1e6)) / 1e6, dt.timezone.utc)
    row = [(at, b"", b"", 0, CLOSE_SEQ, 0)]
    spark.createDataFrame(row, read_schema()).coalesce(1).write.mode("append").parquet(close_dir(checkpoint))
    return dt.datetime.fromtimestamp(end_us / 1e6, dt.timezone.utc)


def newest_time(directory: str) -> int | None:
    """The newest ``recv_time`` (µs) of a local recording, from its newest file's statistics."""
    import pyarrow.parquet as pq

    from .schema import published_files

    files = published_files(local_path(directory))
    best = None
    for _, _, path in files[-3:]:  # recv_time rises with seq; a few files spare a clock step back
        md = pq.ParquetFile(path).metadata
        col = md.schema.to_arrow_schema().get_field_index("recv_time")
        for i in range(md.num_row_groups):
            st = md.row_group(i).column(col).statistics
            if st is not None and st.has_min_max:
                v = st.max
                us = int(v.timestamp() * 1e6) if hasattr(v, "timestamp") else int(v)
                best = us if best is None else max(best, us)
    return best


def held_back(spark, directory: str, watermark, window_seconds: float) -> list[tuple]:
    """The windows the watermark has not passed (append mode holds them until newer data
    arrives): [(window_start, window_end, messages, lost)] from the recording."""
    import datetime as dt

    from pyspark.sql import functions as F

    from .spark import dropped_col, lost_col

    if watermark is None:
        return []
    w_us = int(window_seconds * 1e6)
    wm_us = int(watermark.timestamp() * 1e6)
    cutoff = dt.datetime.fromtimestamp((wm_us // w_us) * w_us / 1e6, dt.timezone.utc)
    df = spark.read.schema(read_schema()).parquet(directory).where(F.col("recv_time") >= F.lit(cutoff))
    rows = (df.groupBy(F.window("recv_time", spark_interval(window_seconds)).alias("w"))
            .agg(F.count(F.when(dropped_col() == 0, F.lit(1))).alias("messages"), F.sum(lost_col()).alias("lost"))
            .orderBy("w.start").collect())
    utc = dt.timezone.utc
    return [(r["w"]["start"].astimezone(utc), r["w"]["end"].astimezone(utc), r["messages"], r["lost"] or 0)
            for r in rows]


class Publisher:
    """foreachBatch function: publish each row of a batch once, keyed by batch id."""

    def __init__(self, bus: str | None, key_prefix: str, state_file: str):
        self.bus = bus
        self.key_prefix = publish_root(key_prefix)
        self.state_file = state_file

    def last_batch(self) -> int:
        try:
            with open(self.state_file) as f:
                return int(f.read().strip() or -1)
        except FileNotFoundError:
            return -1

    def _note(self, batch_id: int) -> None:
        from .report import private_file

        tmp = self.state_file + ".tmp"
        with private_file(tmp, "w") as f:
            f.write(f"{batch_id}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.state_file)

    def __call__(self, df, batch_id: int) -> None:
        if batch_id <= self.last_batch():
            return  # already published (a re-run after a restart)
        rows = df.orderBy("window_start", "prefix").collect()  # NULL (losses) first
        if rows:
            import sbus.client

            with sbus.client.connect(self.bus) as bus:
                for r in rows:
                    payload = {  # PySpark gives naive local times: send aware UTC ones
                        "window_start": r["window_start"].astimezone(timezone.utc).isoformat(),
                        "window_end": r["window_end"].astimezone(timezone.utc).isoformat(),
                        "prefix": r["prefix"],
                        "messages": r["messages"],
                        "bytes": r["bytes"],
                        "dropped": r["dropped"],
                        "batch": batch_id,
                    }
                    key = self.key_prefix if r["prefix"] is None else f"{self.key_prefix}/{r['prefix']}"
                    bus.publish(key.encode("utf-8", "surrogateescape"), json.dumps(payload).encode())
                bus.sync(timeout=30)
        self._note(batch_id)


def start(spark, directory: str, out: str, checkpoint: str, *, window_seconds: float = 60.0,
          depth: int = 1, watermark_seconds: float = 0.0, max_files_per_trigger: int | None = 10,
          trigger: str | None = None, available_now: bool = False, publish_to: str | None = None,
          bus: str | None = None, query_name: str = "sbus-windows", shuffle_partitions: int | None = None,
          close_at_end: bool = False):
    """Start the query (and the publisher, if asked); return the started StreamingQuery objects.

    `shuffle_partitions` applies to a new checkpoint only: Spark keeps the number a
    stateful query started with in its checkpoint and reuses it on every restart."""
    if shuffle_partitions:
        spark.conf.set("spark.sql.shuffle.partitions", str(int(shuffle_partitions)))
    closer = ensure_close_dir(spark, checkpoint)
    if close_at_end:
        close_windows(spark, directory, checkpoint, window_seconds, watermark_seconds)

    def build():
        return aggregated_stream(spark, directory, window_seconds=window_seconds, depth=depth,
                                 watermark_seconds=watermark_seconds,
                                 max_files_per_trigger=max_files_per_trigger, closer=closer)

    def triggered(writer):
        if available_now:
            return writer.trigger(availableNow=True)
        if trigger:
            return writer.trigger(processingTime=trigger)
        return writer

    cp = checkpoint.rstrip("/")
    queries = []
    w = (build().writeStream.format("parquet").outputMode("append")
         .option("checkpointLocation", f"{cp}/sink").option("path", out)
         .queryName(query_name))
    queries.append(triggered(w).start())
    if publish_to:
        from .writer import makedirs_private

        state_dir = local_path(f"{cp}/publish")
        makedirs_private(state_dir)
        pub = Publisher(bus, publish_to, os.path.join(state_dir, "sbus-published"))
        w = (build().writeStream.outputMode("append").foreachBatch(pub)
             .option("checkpointLocation", f"{cp}/publish/query").queryName(query_name + "-publish"))
        queries.append(triggered(w).start())
    return queries


def run(spark, directory: str, out: str, checkpoint: str, *, timeout: float | None = None, log=None,
        **kw) -> list[tuple]:
    """Start and wait: until done (``available_now``), `timeout` seconds, or Ctrl-C.

    After an ``available_now`` run: the windows still held back (see `held_back`), each also
    told to `log` (one line)."""
    queries = start(spark, directory, out, checkpoint, **kw)
    try:
        if kw.get("available_now"):
            for q in queries:
                q.awaitTermination()
        elif timeout is not None:
            queries[0].awaitTermination(timeout)
        else:
            spark.streams.awaitAnyTermination()
    finally:
        for q in queries:
            if q.isActive:
                q.stop()
        for q in queries:
            if q.exception() is not None:
                raise q.exception()
    if not kw.get("available_now"):
        return []
    held = held_back(spark, directory, watermark_of(queries[0]), kw.get("window_seconds", 60.0))
    if log is not None:
        for start_t, end_t, n, lost in held:
            log(f"held back until newer data arrives: the window {start_t.isoformat()} .. {end_t.isoformat()} "
                f"({n:,} messages{f', {lost:,} known lost' if lost else ''}) is not past the watermark; "
                f"--close-at-end closes it at the end of a run")
    return held


def watermark_of(query):
    """The query's event-time watermark after its last batch (aware UTC), None before any data."""
    import datetime as dt

    progress = query.lastProgress or {}
    text = (progress.get("eventTime") or {}).get("watermark")
    if not text:
        return None
    t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return t if t.timestamp() > 0 else None
