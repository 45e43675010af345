"""The Spark side shared by both jobs: the session, and the one transform they share."""

from __future__ import annotations

import os
import sys



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
    b = b.config("spark.ui.showConsoleProgress", "true" if progress else "false")
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
    ])


def is_remote(path: str) -> bool:
    """A URL Spark understands but we cannot check locally (hdfs://, s3a://, ...)."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    return path[len("file://"):] if path.startswith("file://") else path


def with_prefix(df, depth: int):
    """Add ``prefix``: the first `depth` '/'-separated parts of the key (as a string)."""
    from pyspark.sql import functions as F

    key = F.col("key").cast("string")
    return df.withColumn("prefix", F.substring_index(key, "/", depth) if depth > 0 else F.lit(""))


def window_aggregates(df, window: str, depth: int):
    """Per (window, prefix): messages and payload bytes. The transform both jobs share."""
    from pyspark.sql import functions as F

    return (
        with_prefix(df, depth)
        .groupBy(F.window("recv_time", window).alias("w"), "prefix")
        .agg(F.count(F.lit(1)).alias("messages"), F.sum("size").alias("bytes"))
        .select(
            F.col("w.start").alias("window_start"),
            F.col("w.end").alias("window_end"),
            "prefix",
            "messages",
            "bytes",
        )
    )
