"""Helpers and fixtures for the recorder, replay and Spark tests (imported by those modules).

* `start_recorder(bus_address, out, *args)`: a real ``twistd -n sbus-record`` process,
  ready once it logged that its subscriptions are in place;
* `spark`: ONE local SparkSession for the whole test run (session scope;
  ``local[2]``, 2 shuffle partitions, no UI, driver on 127.0.0.1, workers on
  this interpreter). Only tests/test_pipeline.py uses it; to share it with
  other modules, list this module in the root conftest's ``pytest_plugins``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from helpers import LoggedProcess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class RecorderProcess(LoggedProcess):
    """`twistd -n sbus-record --bus ADDRESS --out DIR ARGS...`, its output in a log file."""

    stop_signal = signal.SIGTERM
    stop_timeout = 20.0  # it closes, fsyncs and publishes its open file

    def __init__(self, bus_address, out, args=(), log_path=None):
        self.out = str(out)
        log_path = log_path or os.path.join(os.path.dirname(self.out), f"record-{time.monotonic_ns()}.log")
        super().__init__([os.path.join(os.path.dirname(sys.executable), "twistd"), "-n", "--pidfile=",
                          "sbus-record", "--bus", bus_address, "--out", self.out, *args], log_path, cwd=ROOT)

    def wait_log(self, needle: str, timeout: float = 20.0, count: int = 1) -> str:
        return super().wait_log(needle, timeout, count)

    def wait_ready(self, count: int = 1) -> None:
        self.wait_log("subscribed", count=count)


@pytest.fixture
def start_recorder(tmp_path):
    procs = []

    def start(bus_address, out=None, *args, ready=True):
        out = out or tmp_path / "rec"
        p = RecorderProcess(bus_address, out, args, log_path=str(tmp_path / f"record-{len(procs)}.log"))
        procs.append(p)
        if ready:
            p.wait_ready()
        return p

    yield start
    for p in procs:
        p.stop()


def read_recording(directory):
    """All rows of a recording as a list of dicts, in file-name order (pyarrow only)."""
    import pyarrow.parquet as pq

    from sbus.pipeline.schema import published_files

    rows = []
    for _, _, path in published_files(str(directory)):
        rows.extend(pq.read_table(path).to_pylist())
    return rows


def wait_rows(directory, n, timeout=20.0):
    """Wait until the published files of `directory` hold at least `n` rows."""
    import pyarrow.parquet as pq

    from sbus.pipeline.schema import published_files

    deadline = time.monotonic() + timeout
    got = 0
    while time.monotonic() < deadline:
        got = sum(pq.ParquetFile(p).metadata.num_rows for _, _, p in published_files(str(directory)))
        if got >= n:
            return got
        time.sleep(0.05)
    raise AssertionError(f"only {got} of {n} rows published within {timeout}s")


def write_truncated(path):
    """A Parquet file cut in half, as a crash mid-write leaves it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pa.table({"x": list(range(1000))})
    pq.write_table(t, str(path))
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


@pytest.fixture(scope="session")
def spark():
    import pyspark  # noqa: F401
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from sbus.pipeline.spark import session

    s = session(
        "local[2]",
        app_name="sbus-tests",
        progress=False,
        conf={
            "spark.sql.shuffle.partitions": "2",
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.sql.streaming.forceDeleteTempCheckpointLocation": "true",
        },
    )
    s.sparkContext.setLogLevel("ERROR")
    yield s
    s.stop()
