"""``sbus-pipeline stream DIR --out OUT --checkpoint CP``: window aggregates, continuously.

Structured Streaming over the recording through the sbus source (`sbus.pipeline.source`:
published files and the live journal, the recorder's ``seq`` as the offset, so a message
counts about as soon as the recorder has it, not when its file is published), the same
per-(window, prefix) aggregation as the report, with a watermark on ``recv_time``,
written in append mode to a Parquet file sink at OUT. ``source="files"`` (``--source
files``) reads the published files with Spark's file source instead: for a recording
shipped to a store the sbus source cannot list (``hdfs://``, ``s3a://``).

Exactly once: the source's offsets, the aggregation state and the
sink's commit log (``OUT/_spark_metadata``) all live under the checkpoint;
after a crash or a stop, a restart with the same ``--checkpoint`` resumes
from the last committed batch. Read OUT with ``spark.read.parquet(OUT)``
(it honours ``_spark_metadata``), not by listing files.

A window is emitted once the watermark (latest ``recv_time`` seen minus
``--watermark``) passes its end, i.e. after traffic newer than that has
been recorded. Rows later than the watermark are dropped by Spark: `run`
counts them (every batch's ``numRowsDroppedByWatermark``), says so, and fails
(`LateRows`) unless ``drop_late`` (``--drop-late``).

``--available-now`` stops when the rows present are processed; the
windows the watermark has not passed are held back (their state is in the
checkpoint) and `run` names them with their message counts. With
``close_at_end`` (``--close-at-end``) the source adds a *closing row* after the last
row of the run (its ``closeAtEnd`` option): it moves the watermark past every window,
so the run writes them too, and is filtered out after the watermark: it counts nowhere.
(It used to come from a second file source, read in the first micro-batch: the
watermark jumped to the recording's end and every later batch's rows were dropped,
in silence: issue 35.)

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
from .source import CLOSE_SEQ
from .spark import local_path, read_schema, window_aggregates
from .units import spark_interval


def publish_root(name: str) -> str:
    """``_pipeline/NAME``: where ``--publish-to NAME`` publishes (the recorder skips it)."""
    root = PIPELINE_PREFIX.decode()
    name = name.strip("/")
    return name if name.startswith(root) or name + "/" == root else root + name


#: Where the stream reads: the sbus source (published files and the live journal, seq offsets),
#: or Spark's file source (published files only; for a recording on hdfs://, s3a://, ...).
SOURCES = ("sbus", "files")


def key_filter(reader, keys=None, key_prefix: str | None = None):
    """`reader` with the sbus source's ``keys`` (a JSON list: a key may hold a comma) or
    ``keyPrefix`` option, if given (drop and gap rows still come)."""
    import json

    if keys is not None:
        reader = reader.option("keys", json.dumps(list(keys)))
    if key_prefix is not None:
        reader = reader.option("keyPrefix", key_prefix)
    return reader


def source_stream(spark, directory: str, *, source: str = "sbus", max_records_per_trigger: int | None = None,
                  max_files_per_trigger: int | None = None, close_after: float | None = None,
                  keys=None, key_prefix: str | None = None):
    """The recording as a stream: rows ``recv_time, key, size, seq, dropped``; with the sbus
    source and `close_after`, a closing row (seq `CLOSE_SEQ`) after the last row available at
    the start of an ``availableNow`` run, `close_after` seconds after the newest one; `keys` or
    `key_prefix`: only those messages (sbus source)."""
    cols = ("recv_time", "key", "size", "seq", "dropped")
    if source != "sbus" and (keys is not None or key_prefix is not None):
        raise ValueError("key filters need the sbus source")
    if source == "files":
        reader = spark.readStream.schema(read_schema())
        if max_files_per_trigger:
            reader = reader.option("maxFilesPerTrigger", int(max_files_per_trigger))
        return reader.parquet(directory).select(*cols)
    from .source import register

    register(spark)
    reader = key_filter(spark.readStream.format("sbus"), keys, key_prefix)
    if max_records_per_trigger:
        reader = reader.option("maxRecordsPerTrigger", int(max_records_per_trigger))
    if close_after is not None:
        reader = reader.option("closeAtEnd", repr(float(close_after)))
    return reader.load(os.path.abspath(local_path(directory))).select(*cols)


def aggregated_stream(spark, directory: str, *, window_seconds: float, depth: int,
                      watermark_seconds: float, source: str = "sbus", max_records_per_trigger: int | None = None,
                      max_files_per_trigger: int | None = None, close_at_end: bool = False,
                      keys=None, key_prefix: str | None = None):
    """The per-(window, prefix) aggregation of the recording as it comes. `close_at_end`
    (sbus source, availableNow): the closing row moves the watermark past every window
    and counts nowhere."""
    from pyspark.sql import functions as F

    close_after = window_seconds + watermark_seconds if close_at_end else None
    src = source_stream(spark, directory, source=source, max_records_per_trigger=max_records_per_trigger,
                        max_files_per_trigger=max_files_per_trigger, close_after=close_after,
                        keys=keys, key_prefix=key_prefix)
    src = src.withWatermark("recv_time", spark_interval(watermark_seconds) if watermark_seconds > 0 else "0 seconds")
    # a closing row moves the watermark (above) and is then left out: it counts nowhere. (The
    # condition names recv_time so that Spark does not push it below the watermark, which it
    # does with filters that leave the event time alone.)
    src = src.where((F.col("seq") != F.lit(CLOSE_SEQ)) | F.col("recv_time").isNull()).drop("seq")
    out = window_aggregates(src, spark_interval(window_seconds), depth)
    return out.withColumn("window_seconds", F.lit(float(window_seconds)))


def batch_read(spark, directory: str, source: str = "sbus", keys=None, key_prefix: str | None = None):
    """The whole recording now, read the way the stream reads it."""
    if source == "files":
        return spark.read.schema(read_schema()).parquet(directory)
    from .source import register

    register(spark)
    return key_filter(spark.read.format("sbus"), keys, key_prefix).load(os.path.abspath(local_path(directory)))


def held_back(spark, directory: str, watermark, window_seconds: float, source: str = "sbus",
              keys=None, key_prefix: str | None = None) -> list[tuple]:
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
    df = batch_read(spark, directory, source, keys, key_prefix).where(F.col("recv_time") >= F.lit(cutoff))
    rows = (df.groupBy(F.window("recv_time", spark_interval(window_seconds)).alias("w"))
            .agg(F.count(F.when(dropped_col() == 0, F.lit(1))).alias("messages"), F.sum(lost_col()).alias("lost"))
            .orderBy("w.start").collect())
    utc = dt.timezone.utc
    return [(r["w"]["start"].astimezone(utc), r["w"]["end"].astimezone(utc), r["messages"], r["lost"] or 0)
            for r in rows]


class LateRows(RuntimeError):
    """Spark dropped rows as later than the watermark: they are in no window (``str()``: one line).

    Spark counts them after the partial aggregation (``numRowsDroppedByWatermark``): one
    dropped row is one (window, prefix) count of one micro-batch's task, not one message."""

    def __init__(self, dropped: int):
        self.dropped = dropped
        super().__init__(f"Spark dropped {dropped:,} late row(s) (numRowsDroppedByWatermark: each a partial "
                         f"count of one window and prefix, one or more messages) as later than the "
                         f"watermark: they are counted in no window (give --watermark more room, or "
                         f"--drop-late to accept this)")


class DropCounter:
    """Sums each query's ``numRowsDroppedByWatermark`` over all its micro-batches (a listener:
    ``recentProgress`` keeps only the last 100), and says at once when a batch drops rows."""

    def __init__(self, spark, log=None):
        from pyspark.sql.streaming import StreamingQueryListener

        counter = self
        self.dropped: dict[str, int] = {}
        self.batches: dict[str, int] = {}
        self.ended: set[str] = set()
        self.log = log
        import threading

        self._cond = threading.Condition()

        class Listener(StreamingQueryListener):
            def onQueryStarted(self, event):
                pass

            def onQueryProgress(self, event):
                counter.progress(event.progress)

            def onQueryIdle(self, event):
                pass

            def onQueryTerminated(self, event):
                counter.terminated(str(event.id))

        self.listener = Listener()
        self.spark = spark
        spark.streams.addListener(self.listener)

    def terminated(self, qid: str) -> None:
        with self._cond:
            self.ended.add(qid)
            self._cond.notify_all()

    def progress(self, p) -> None:
        n = sum(int(getattr(op, "numRowsDroppedByWatermark", 0) or 0) for op in (p.stateOperators or []))
        qid = str(p.id)
        with self._cond:
            self.dropped[qid] = self.dropped.get(qid, 0) + n
            self.batches[qid] = self.batches.get(qid, 0) + 1
        if n and self.log is not None:
            self.log(f"batch {p.batchId} of {p.name or qid}: Spark dropped {n:,} late row(s) (partial counts) "
                     f"as later than the watermark")

    def wait_ended(self, queries, timeout: float = 30.0) -> None:
        """Wait until the listener has heard every query end (its last progress comes before)."""
        import time

        ids = {str(q.id) for q in queries}
        deadline = time.monotonic() + timeout
        with self._cond:
            while not ids <= self.ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)

    def total(self, query) -> int:
        with self._cond:
            return self.dropped.get(str(query.id), 0)

    def close(self) -> None:
        try:
            self.spark.streams.removeListener(self.listener)
        except Exception:
            pass


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
          depth: int = 1, watermark_seconds: float = 0.0, source: str = "sbus",
          max_records_per_trigger: int | None = None, max_files_per_trigger: int | None = 10,
          trigger: str | None = None, available_now: bool = False, publish_to: str | None = None,
          bus: str | None = None, query_name: str = "sbus-windows", shuffle_partitions: int | None = None,
          close_at_end: bool = False, keys=None, key_prefix: str | None = None):
    """Start the query (and the publisher, if asked); return the started StreamingQuery objects.

    `shuffle_partitions` applies to a new checkpoint only: Spark keeps the number a
    stateful query started with in its checkpoint and reuses it on every restart."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r} (one of {', '.join(SOURCES)})")
    if close_at_end and (source != "sbus" or not available_now):
        raise ValueError("--close-at-end needs --available-now and the sbus source")
    if shuffle_partitions:
        spark.conf.set("spark.sql.shuffle.partitions", str(int(shuffle_partitions)))

    def build():
        return aggregated_stream(spark, directory, window_seconds=window_seconds, depth=depth,
                                 watermark_seconds=watermark_seconds, source=source,
                                 max_records_per_trigger=max_records_per_trigger,
                                 max_files_per_trigger=max_files_per_trigger, close_at_end=close_at_end,
                                 keys=keys, key_prefix=key_prefix)

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
        drop_late: bool = False, **kw) -> list[tuple]:
    """Start and wait: until done (``available_now``), `timeout` seconds, or Ctrl-C.

    Rows Spark drops as later than the watermark are counted (every micro-batch's
    ``numRowsDroppedByWatermark``) and raise `LateRows` at the end unless `drop_late`
    (then `log` is told the count). After an ``available_now`` run: the windows still held
    back (see `held_back`), each also told to `log` (one line)."""
    counter = DropCounter(spark, log)
    try:
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
        counter.wait_ended(queries)
        late = counter.total(queries[0])
    finally:
        counter.close()
    if late:
        if not drop_late:
            raise LateRows(late)
        if log is not None:
            log(f"Spark dropped {late:,} late row(s) (partial counts of a window and prefix) as later than "
                f"the watermark (--drop-late): they are counted in no window")
    if not kw.get("available_now"):
        return []
    held = held_back(spark, directory, watermark_of(queries[0]), kw.get("window_seconds", 60.0),
                     kw.get("source", "sbus"), kw.get("keys"), kw.get("key_prefix"))
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
