"""sbus-replay: a recording made by the real recorder, replayed onto a fresh bus."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from pipeline_conftest import ROOT, read_recording, start_recorder, wait_rows  # noqa: F401
from sbus.client import connect
from sbus.pipeline import replay as replay_mod
from sbus.pipeline.writer import RecordingWriter


class Listener:
    """Subscribes to everything on a bus and collects (key, payload) in a thread."""

    def __init__(self, address, expect):
        self.client = connect(address)
        self.client.subscribe(b"")
        self.client.sync(timeout=5)
        self.expect = expect
        self.got = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for m in self.client.messages(timeout=10):
                self.got.append((m.key, m.payload))
                if len(self.got) >= self.expect:
                    return
        except TimeoutError:
            return

    def wait(self):
        self.thread.join(20)
        self.client.close()
        return self.got


def run_replay(*args):
    return subprocess.run([sys.executable, "-m", "sbus.pipeline.replay", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_replay_reproduces_the_recorded_sequence(start_bus, start_recorder, tmp_path):
    bus = start_bus()
    out = tmp_path / "rec"
    rec = start_recorder(bus.address, out, "--roll-bytes", "16K", "--roll-age", "300ms")
    msgs = [(b"r/%d/%d" % (i % 5, i % 3), b"%d" % i + b"z" * (i % 300)) for i in range(2000)]
    with connect(bus.address) as c:
        for k, p in msgs:
            c.publish(k, p)
        c.sync(timeout=10)
    wait_rows(out, len(msgs))
    rec.stop()
    recorded = [(r["key"], r["payload"]) for r in read_recording(out)]
    assert recorded == msgs

    fresh = start_bus()
    listener = Listener(fresh.address, len(msgs))
    p = run_replay(str(out), "--bus", fresh.address, "--progress", "never")
    assert p.returncode == 0, p.stderr
    assert f"replayed {len(msgs)} messages" in p.stderr
    assert listener.wait() == recorded


def synthetic(directory, n=300, step_us=10_000, t0=1_700_000_000_000_000):
    w = RecordingWriter(str(directory), roll_bytes=4000, row_group_bytes=2000, fsync=False)
    rows = [(t0 + i * step_us, i + 1, b"k/%d" % (i % 3), b"%d" % i) for i in range(n)]
    w.extend(rows)
    w.close()
    return rows, t0


def test_key_filter_and_time_range(bus, tmp_path):
    rows, t0 = synthetic(tmp_path / "rec")
    # from t0+1s (row 100) to t0+2s (row 200, excluded), keys k/1 only
    want = [(k, p) for t, s, k, p in rows if t0 + 1_000_000 <= t < t0 + 2_000_000 and k == b"k/1"]
    listener = Listener(bus.address, len(want))
    p = run_replay(str(tmp_path / "rec"), "--bus", bus.address, "--key", "k/1",
                   "--from", str((t0 + 1_000_000) / 1e6), "--to", "2023-11-14T22:13:22Z")
    assert p.returncode == 0, p.stderr
    assert listener.wait() == want and len(want) == 34


def test_recorded_speed(bus, tmp_path):
    rows, t0 = synthetic(tmp_path / "rec", n=101, step_us=10_000)  # spans exactly 1.0 s
    slept = []
    now = [0.0]

    def sleep(s):
        slept.append(s)
        now[0] += s

    listener = Listener(bus.address, len(rows))
    sent, _ = replay_mod.replay(str(tmp_path / "rec"), bus.address, speed=2.0, sleep=sleep,
                                clock=lambda: now[0])
    assert sent == 101
    assert sum(slept) == pytest.approx(0.5)  # recorded spacing / 2
    assert len(listener.wait()) == 101


def test_real_time_pacing(bus, tmp_path):
    import time

    synthetic(tmp_path / "rec", n=31, step_us=10_000)  # 0.3 s
    t = time.monotonic()
    p = run_replay(str(tmp_path / "rec"), "--bus", bus.address, "--speed", "1")
    assert p.returncode == 0, p.stderr
    # process start + 0.3 s of recorded pace
    assert time.monotonic() - t >= 0.3


def test_errors_are_one_line(bus, tmp_path):
    (tmp_path / "empty").mkdir()
    synthetic(tmp_path / "rec", n=5)
    cases = [
        ([str(tmp_path / "missing"), "--bus", bus.address], 2, "no such directory"),
        ([str(tmp_path / "empty"), "--bus", bus.address], 2, "no recorded files"),
        ([str(tmp_path / "rec"), "--bus", str(tmp_path / "nobus.socket")], 1, "No such file"),
        ([str(tmp_path / "rec"), "--bus", bus.address, "--from", "yesterday"], 2, "not a time"),
    ]
    for args, code, text in cases:
        p = run_replay(*args)
        assert p.returncode == code, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sbus-replay: ") and text in lines[0], p.stderr
