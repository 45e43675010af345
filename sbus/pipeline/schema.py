"""The recording format: one schema shared by the recorder, replay and the Spark jobs.

A recording is a flat directory of Parquet files written by
``twistd sbus-record``::

    DIR/rec-0000000000000001-0000000000051234.parquet   published (complete, closed, fsynced)
    DIR/rec-0000000000051235-0000000000102400.parquet
    DIR/_tmp/...                                        being written; never read

The two numbers in a name are the first and last ``seq`` in the file, so
names sort in recording order and the recorder finds where to continue
without opening a file. Spark's file listing skips names starting with
``_`` or ``.``, so ``_tmp/`` is invisible to ``spark.read.parquet(DIR)``;
replay lists only ``rec-*.parquet``.

Columns (see docs/pipeline.md):

``recv_time``  timestamp[us, tz=UTC]  when the recorder read the message
``key``        binary                 the routing key
``payload``    binary                 the message payload
``size``       int32                  ``len(payload)``
``seq``        int64                  per recorder directory, increasing across files and
                                      restarts; a gap = messages received but dropped
"""

from __future__ import annotations

import os
import re

import pyarrow as pa

ARROW_SCHEMA = pa.schema(
    [
        pa.field("recv_time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("key", pa.binary(), nullable=False),
        pa.field("payload", pa.binary(), nullable=False),
        pa.field("size", pa.int32(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
    ],
    metadata={b"sbus.recording": b"1"},
)

#: The same schema for Spark (a DDL string keeps pyspark out of this module).
SPARK_DDL = "recv_time TIMESTAMP, key BINARY, payload BINARY, size INT, seq BIGINT"

TMP_DIR = "_tmp"
PREFIX = "rec-"
SUFFIX = ".parquet"
_NAME = re.compile(r"^rec-(\d{16,})-(\d{16,})\.parquet$")


class RecordingError(Exception):
    """A recording directory that cannot be used; ``str()`` is one line."""


def file_name(first_seq: int, last_seq: int) -> str:
    return f"{PREFIX}{first_seq:016d}-{last_seq:016d}{SUFFIX}"


def parse_name(name: str) -> tuple[int, int] | None:
    """(first_seq, last_seq) of a published file name, or None for anything else."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def published_files(directory: str) -> list[tuple[int, int, str]]:
    """[(first_seq, last_seq, path)] of the published files, in recording order."""
    out = []
    for entry in os.scandir(directory):
        seqs = parse_name(entry.name)
        if seqs is not None and entry.is_file():
            out.append((seqs[0], seqs[1], entry.path))
    out.sort()
    return out


def check_recording(directory: str) -> list[tuple[int, int, str]]:
    """The published files of `directory`, or `RecordingError` (missing, not a directory, empty)."""
    if not os.path.exists(directory):
        raise RecordingError(f"{directory}: no such directory")
    if not os.path.isdir(directory):
        raise RecordingError(f"{directory}: not a directory")
    try:
        files = published_files(directory)
    except OSError as e:
        raise RecordingError(f"{directory}: {e.strerror}") from None
    if not files:
        raise RecordingError(f"{directory}: no recorded files (rec-*.parquet) in it")
    return files
