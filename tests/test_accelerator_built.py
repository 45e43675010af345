"""CI runs the suite twice, with the batch I/O accelerator and without (SBUS_PURE_PYTHON=1).
If the extension silently failed to build, both runs would be pure: with
SBUS_REQUIRE_SPEEDUPS=1 (set by .ci/run for the first run) its absence is a failure."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import child_env


@pytest.mark.skipif(not os.environ.get("SBUS_REQUIRE_SPEEDUPS"), reason="SBUS_REQUIRE_SPEEDUPS not set")
def test_the_server_uses_batch_io_when_required():
    env = child_env()
    env.pop("SBUS_PURE_PYTHON", None)
    out = subprocess.run([sys.executable, "-c", "import sbus.seqpacket as s; print(s.BATCH_IO)"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
