"""The Spark side shared by both jobs: the session, and the one transform they share."""

from __future__ import annotations

import math
import os
import sys

#: Hadoop's umask for what Spark writes (tables, stream output, checkpoints): 0700 dirs, 0600 files.
HADOOP_UMASK = "077"
#: A shuffle partition per this much recorded data, beyond one per core.
BYTES_PER_PARTITION = 256 << 20
MAX_AUTO_PARTITIONS = 200


def shuffle_partitions(cores: int, data_bytes: int | None = None) -> int:
    """The default number of shuffle partitions: one per core the job has, more only
    when the recording is big (one per `BYTES_PER_PARTITION`), at most 200 (Spark's own
    default, meant for big clusters). Both jobs shuffle only partial aggregates (a few rows per
    window and prefix), so more partitions than cores only add tasks; the stream pays
    for each partition in every micro-batch (one state store per partition), and the
    number is fixed in its checkpoint at the first start."""
    n = max(1, int(cores or 1))
    if data_bytes:
        n = max(n, math.ceil(data_bytes / BYTES_PER_PARTITION))
    return min(n, MAX_AUTO_PARTITIONS)


#: JVM options for a driver we start in local mode (see `session`).
LOCAL_JVM_OPTIONS = "-XX:TieredStopAtLevel=1"


def local_jvm(master: str | None) -> bool:
    """True when `session` starts the JVM itself and it runs the job: a ``local`` master,
    not under ``spark-submit`` (which has started the JVM already)."""
    return master is not None and master.startswith("local") and not under_spark_submit()


def under_spark_submit() -> bool:
    """True when started by ``spark-submit`` (it hands us a running JVM gateway)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def session(master: str | None = None, app_name: str = "sbus-pipeline", conf: dict | None = None,
            progress: bool = True):
    """Get (or create) the SparkSession.

    ``master`` None means: whatever ``spark-submit`` chose, else ``local[*]``.
    Workers run this interpreter (so pyarrow is there) unless
    ``PYSPARK_PYTHON`` says otherwise.
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    b = SparkSession.builder.appName(app_name)
    if master is None and not under_spark_submit():
        master = "local[*]"
    if master is not None:
        b = b.master(master)
    b = b.config("spark.sql.session.timeZone", "UTC")
    # outputs and checkpoints private whatever the process umask (Hadoop applies its own)
    b = b.config("spark.hadoop.fs.permissions.umask-mode", HADOOP_UMASK)
    b = b.config("spark.ui.showConsoleProgress", "true" if progress else "false")
    if local_jvm(master):
        # a local job's JVM lives seconds: the C1 compiler alone makes its code fast sooner (C2's
        # slower compiling never pays back in a short run; the report's pass took 40 % less).
        # As a default option, so spark.driver.extraJavaOptions (appended after it) can undo it.
        b = b.config("spark.driver.defaultJavaOptions", LOCAL_JVM_OPTIONS)
    for k, v in (conf or {}).items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    return spark


def read_schema():
    """The recording's schema as a Spark StructType (streaming sources need one)."""
    from pyspark.sql.types import BinaryType, IntegerType, LongType, StructField, StructType, TimestampType

    return StructType([
        StructField("recv_time", TimestampType(), False),
        StructField("key", BinaryType(), False),
        StructField("payload", BinaryType(), False),
        StructField("size", IntegerType(), False),
        StructField("seq", LongType(), False),
        StructField("dropped", LongType(), True),  # NULL in recordings made before drop rows
    ])


def is_remote(path: str) -> bool:
    """A URL Spark understands but we cannot check locally (hdfs://, s3a://, ...)."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def dropped_col():
    """The row's ``dropped``: 0 for a message, N > 0 for a drop row, -1 for a gap row."""
    from pyspark.sql import functions as F

    return F.coalesce(F.col("dropped"), F.lit(0))


def lost_col():
    """How many messages a row stands for as known lost: N for a drop row, else 0 (a gap
    row's count is unknown: it is counted as a gap, never as messages)."""
    from pyspark.sql import functions as F

    d = dropped_col()
    return F.when(d > 0, d).otherwise(F.lit(0))


def with_prefix(df, depth: int):
    """Add ``prefix``: the first `depth` '/'-separated parts of the key (as a string);
    NULL for a drop row (its losses belong to no prefix)."""
    from pyspark.sql import functions as F

    key = F.col("key").cast("string")
    prefix = F.substring_index(key, "/", depth) if depth > 0 else F.lit("")
    return df.withColumn("prefix", F.when(dropped_col() == 0, prefix))


def window_aggregates(df, window: str, depth: int):
    """Per (window, prefix): messages, payload bytes and known lost messages (on the
    rows whose prefix is NULL; a gap row adds nothing to them). The transform both jobs share."""
    from pyspark.sql import functions as F

    d = dropped_col()
    return (
        with_prefix(df, depth)
        .groupBy(F.window("recv_time", window).alias("w"), "prefix")
        .agg(F.count(F.when(d == 0, F.lit(1))).alias("messages"), F.sum("size").alias("bytes"),
             F.sum(lost_col()).alias("dropped"))
        .select(
            F.col("w.start").alias("window_start"),
            F.col("w.end").alias("window_end"),
            "prefix",
            "messages",
            "bytes",
            "dropped",
        )
    )
