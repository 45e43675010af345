"""The reference server's own test program (maandree/sbus `make check`, which runs
`./test`, which runs `./sbusd`) against OUR sbusd.

Runs only when a built reference tree is named by SBUS_REFERENCE_DIR (a clone
where `make` has built `test`); it is copied to a temporary directory, its
`sbusd` replaced by a wrapper that execs this tree's `python -m sbus.server.sbusd`.
Nothing of the reference is copied into this project. See docs/reliability.md
for the command by hand.

The reference test gives each server one second (alarm(1), inherited across
exec): on a loaded machine a Python server can miss that, so a failure here is
retried a few times before it counts.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest

from helpers import REPO

REFERENCE = os.environ.get("SBUS_REFERENCE_DIR")

WRAPPER = """#!/bin/sh
PYTHONPATH={repo}${{PYTHONPATH:+:$PYTHONPATH}} exec {python} -m sbus.server.sbusd "$@"
"""


@pytest.mark.skipif(not REFERENCE or not os.access(os.path.join(REFERENCE, "test"), os.X_OK),
                    reason="no built reference: set SBUS_REFERENCE_DIR to a maandree/sbus clone after `make`")
def test_reference_test_program_passes_with_our_sbusd(tmp_path):
    work = tmp_path / "ref"
    shutil.copytree(REFERENCE, work, symlinks=True)
    sbusd = work / "sbusd"
    sbusd.unlink(missing_ok=True)
    sbusd.write_text(WRAPPER.format(repo=REPO, python=sys.executable))
    sbusd.chmod(sbusd.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    outcomes = []
    for _ in range(3):
        (work / ".test.sock").unlink(missing_ok=True)
        res = subprocess.run(["./test"], cwd=work, capture_output=True, timeout=120)
        if res.returncode == 0:
            return
        lines = res.stderr.decode(errors="replace").splitlines()
        outcomes.append(next((line for line in lines if line.startswith("FAILURE")), f"status {res.returncode}"))
    pytest.fail("the reference's ./test failed 3 times: " + " | ".join(outcomes))
