"""Shared fixtures: real server processes on real sockets.

`bus` starts `sbusd -f` (our drop-in command) on a fresh socket path and
waits for its readiness signal (standard output closed) instead of sleeping.
`start_bus(*args)` starts one with extra options; `start_twistd_bus(*options)`
runs `twistd sbus` with options. Each has `.address`, `.connect()`, `.log()`,
`.wait_log(needle)` and `.stop()` (see `helpers.LoggedProcess`).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid

import pytest
from hypothesis import HealthCheck, settings

from helpers import SbusdProcess, TwistdBus

# Property tests check what is computed, not how fast: on a loaded CI machine one example took
# 1.5 s where hypothesis's default deadline is 200 ms, and failed the run as "flaky". Speed is
# measured under bench/.
settings.register_profile("sbus", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("sbus")

# A suite started in the background of a non-interactive shell (`make test &`, nohup, a CI
# script's `&`) inherits SIGINT ignored, and so would every server and command it starts: the
# tests that stop them with SIGINT (as Ctrl-C does) would wait in vain. A handled signal is
# reset to the default in a child at exec, an ignored one is not: handle it here.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

#: The modules that take longest, seconds of test time on a quiet 2-core machine (`make test
#: PYTEST_ARGS=--durations=0`, summed by module). pytest-xdist hands out whole modules in the
#: order collected (Makefile: --no-loadscope-reorder); these go first, so none of them starts
#: near the end and holds the run open while the other workers idle (longest first). Every other
#: module follows, the ones with more tests first (xdist's own order).
LONG_MODULES = {"test_link_failover.py": 278, "test_pipeline.py": 221, "test_failover.py": 206,
                "test_nats_restart.py": 160, "test_pipeline_source.py": 118, "test_fuzz_server.py": 60,
                "test_record.py": 43, "test_relay_restart.py": 33, "test_topology_services.py": 29,
                "test_attack_trust.py": 28}


def pytest_collection_modifyitems(config, items):
    tests = {}
    for item in items:
        tests[item.path.name] = tests.get(item.path.name, 0) + 1
    # a stable sort: each module's tests stay together and in their order
    items.sort(key=lambda item: (-LONG_MODULES.get(item.path.name, 0), -tests[item.path.name]))


@pytest.fixture
def start_bus(tmp_path):
    """Factory: start_bus(*extra_args) -> SbusdProcess listening on a fresh path."""
    procs = []

    def start(*extra, address=None, env=None):
        address = address or str(tmp_path / f"bus-{uuid.uuid4().hex[:8]}.socket")
        log_path = tmp_path / f"sbusd-{len(procs)}.log"
        popen = {} if env is None else {"env": env}
        p = SbusdProcess(["-f", "-a", address, *extra], log_path, address=address, **popen)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


@pytest.fixture
def start_twistd_bus(tmp_path):
    """Factory: start_twistd_bus(*options) -> TwistdBus running `twistd sbus` with those options."""
    procs = []

    def start(*options):
        address = str(tmp_path / f"bus-{uuid.uuid4().hex[:8]}.socket")
        p = TwistdBus(address, tmp_path / f"twistd-{len(procs)}.log", options)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


@pytest.fixture
def bus(start_bus):
    """One running server process; `.address` is its socket path."""
    return start_bus()


@pytest.fixture(params=["pure"] if os.environ.get("SBUS_PURE_PYTHON") == "1" else ["batch", "pure"])
def both_paths(request, start_bus, start_twistd_bus, monkeypatch):
    """start(*twistd_options) -> a server on the batch transport (the accelerator, when built)
    or on the pure-Python one: a test that takes this runs on both I/O paths (on the pure one
    only in a run where SBUS_PURE_PYTHON=1, .ci/run's second pass: the first ran both)."""
    monkeypatch.setenv("SBUS_PURE_PYTHON", "1" if request.param == "pure" else "")

    def start(*options):
        return start_twistd_bus(*options) if options else start_bus()
    return start


@pytest.fixture
def shared_dir():
    """A fresh directory under /tmp that uid 65534 may traverse (tmp_path's parents are 0700),
    for a bus another uid uses (``start_bus("-o", address=...)``)."""
    d = tempfile.mkdtemp(prefix="sbus-shared-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)
