"""The recording format: one schema shared by the recorder, replay and the Spark jobs.

A recording is a flat directory of Parquet files written by
``twistd sbus-record``::

    DIR/rec-0000000000000001-0000000000051234.parquet   published (complete, closed, fsynced)
    DIR/rec-0000000000051235-0000000000102400.parquet
    DIR/_tmp/...                                        being written; never read
                                                        (a crash's leftovers are recovered at start)

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
``seq``        int64                  per recorder directory, 1, 2, 3, ... across files and
                                      restarts (every row takes one)
``dropped``    int64                  0 for a recorded message; N > 0 marks a *drop row*:
                                      N messages meant for the recorder were lost here
                                      (dropped by the bus or by the recorder's own queue).
                                      Its ``key``/``payload`` are the first/last lost keys
                                      (empty when unknown), ``size`` is 0.
                                      -1 (`GAP`) marks a *gap row*: an unknown number lost
                                      (the recorder stopped without publishing: a crash);
                                      ``key`` is empty, ``payload`` a JSON description.

Recordings made before ``dropped`` existed have no such column; readers
treat it as 0 (Spark reads it as NULL with `SPARK_DDL`).

This module imports no pyarrow (the command lines' ``--help`` and their
errors work without it); `arrow_schema()` builds the Arrow schema on demand.
"""

from __future__ import annotations

import os
import re

#: What to install when pyarrow/pyspark/matplotlib are missing (one line, in every error).
EXTRA = "pip install 'sbus[pipeline]'"

#: Bytes charged per row on top of key and payload (timestamps, seq, list slots).
ROW_OVERHEAD = 64
DEFAULT_ROLL_BYTES = 128 << 20
DEFAULT_ROLL_AGE = 60.0
DEFAULT_ROW_GROUP_BYTES = 32 << 20

#: ``dropped`` of a *gap row*: an unknown number of messages was lost here (the recorder
#: stopped without publishing: a crash, ``kill -9``); its ``payload`` describes the gap (JSON).
GAP = -1

#: Keys under this prefix are the pipeline's own output (``sbus-pipeline stream
#: --publish-to NAME`` publishes under ``_pipeline/NAME/``); the recorder skips them
#: by default so that the analytics never count themselves.
PIPELINE_PREFIX = b"_pipeline/"

#: Columns, in order.
COLUMNS = ("recv_time", "key", "payload", "size", "seq", "dropped")

#: The same schema for Spark (a DDL string keeps pyspark out of this module).
SPARK_DDL = "recv_time TIMESTAMP, key BINARY, payload BINARY, size INT, seq BIGINT, dropped BIGINT"

_arrow_schema = None


class MissingExtra(ImportError):
    """pyarrow/pyspark/matplotlib is not installed; ``str()`` is the one line to show."""


def require(module: str):
    """Import `module` or raise `MissingExtra` naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise MissingExtra(f"{top} is not installed ({_first(e)}): {EXTRA}") from None


def _first(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def arrow_schema():
    """The recording's Arrow schema (imports pyarrow)."""
    global _arrow_schema
    if _arrow_schema is None:
        pa = require("pyarrow")
        _arrow_schema = pa.schema(
            [
                pa.field("recv_time", pa.timestamp("us", tz="UTC"), nullable=False),
                pa.field("key", pa.binary(), nullable=False),
                pa.field("payload", pa.binary(), nullable=False),
                pa.field("size", pa.int32(), nullable=False),
                pa.field("seq", pa.int64(), nullable=False),
                pa.field("dropped", pa.int64(), nullable=False),
            ],
            metadata={b"sbus.recording": b"2"},
        )
    return _arrow_schema


def __getattr__(name):  # ARROW_SCHEMA, built on first use
    if name == "ARROW_SCHEMA":
        return arrow_schema()
    raise AttributeError(name)

TMP_DIR = "_tmp"
#: ``_tmp/rec-<first seq>.arrows``: the journal of the file being written (see the writer).
JOURNAL_SUFFIX = ".arrows"
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


def named_seq(name: str, suffix: str) -> int | None:
    """The seq in a ``rec-<seq><suffix>`` name (a journal's, a part's), None for any other name."""
    if not (name.startswith(PREFIX) and name.endswith(suffix)):
        return None
    digits = name[len(PREFIX):len(name) - len(suffix)]
    return int(digits) if digits.isdigit() else None


def published_files(directory: str) -> list[tuple[int, int, str]]:
    """[(first_seq, last_seq, path)] of the published files, in recording order."""
    out = []
    for entry in os.scandir(directory):
        if not entry.name.startswith(PREFIX):
            continue
        seqs = parse_name(entry.name)
        if seqs is not None and entry.is_file():
            out.append((seqs[0], seqs[1], entry.path))
    out.sort()
    return out


def check_recording(directory: str, allow_empty: bool = False) -> list[tuple[int, int, str]]:
    """The published files of `directory`, or `RecordingError` (missing, not a directory, empty
    unless `allow_empty`: a live stream may start before the recorder published a file)."""
    if not os.path.exists(directory):
        raise RecordingError(f"{directory}: no such directory")
    if not os.path.isdir(directory):
        raise RecordingError(f"{directory}: not a directory")
    try:
        files = published_files(directory)
    except OSError as e:
        raise RecordingError(f"{directory}: {e.strerror}") from None
    if not files and not allow_empty:
        raise RecordingError(f"{directory}: no recorded files (rec-*.parquet) in it")
    return files
