"""Shared fixtures: real server processes on real sockets.

`bus` starts `sbusd -f` (our drop-in command) on a fresh socket path and
waits for its readiness signal (standard output closed) instead of sleeping.
`start_bus(*args)` starts one with extra options; `bus_proc.log()` returns
what it wrote to stderr so far.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

READY_TIMEOUT = 10.0


class BusProcess:
    def __init__(self, args, address, log_path, env=None, command=None):
        self.address = address
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            command or [sys.executable, "-m", "sbus.server.sbusd", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if command is None else self._log,
            stderr=self._log,
            env=env,
        )
        if command is None:
            self.printed = self._wait_ready()
        else:
            self._wait_connectable()

    def _wait_connectable(self):
        """For servers without sbusd's readiness signal: wait until the socket accepts."""
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()}")
            try:
                self.connect().close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"server not connectable in {READY_TIMEOUT}s: {self.log()}")
                time.sleep(0.02)

    def _wait_ready(self) -> bytes:
        """Read stdout until EOF: sbusd -f closes it once the socket listens."""
        out = b""
        deadline = time.monotonic() + READY_TIMEOUT
        fd = self.proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise RuntimeError(f"sbusd not ready in {READY_TIMEOUT}s: {self.log()}")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                out += chunk
        if self.proc.poll() is not None:
            raise RuntimeError(f"sbusd exited with {self.proc.returncode}: {self.log()}")
        return out

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def wait_log(self, needle: str, timeout: float = 5.0) -> str:
        """Wait until `needle` appears in the server's log; return the log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            if needle in text:
                return text
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} not logged within {timeout}s; log:\n{self.log()}")

    def connect(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(5)
        s.connect(self.address)
        return s

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()


@pytest.fixture
def start_bus(tmp_path):
    """Factory: start_bus(*extra_args) -> BusProcess listening on a fresh path."""
    procs = []

    def start(*extra, address=None, env=None):
        address = address or str(tmp_path / f"bus-{uuid.uuid4().hex[:8]}.socket")
        log_path = str(tmp_path / f"sbusd-{len(procs)}.log")
        p = BusProcess(["-f", "-a", address, *extra], address, log_path, env=env)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


@pytest.fixture
def start_twistd_bus(tmp_path):
    """Factory: start_twistd_bus(*options) -> BusProcess running `twistd -n sbus` with those options."""
    procs = []

    def start(*options):
        address = str(tmp_path / f"bus-{uuid.uuid4().hex[:8]}.socket")
        log_path = str(tmp_path / f"twistd-{len(procs)}.log")
        command = [sys.executable, "-m", "twisted", "--log-format", "text", "sbus", "--socket", address, *options]
        p = BusProcess([], address, log_path, command=command)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


@pytest.fixture
def bus(start_bus):
    """One running server process; `.address` is its socket path."""
    return start_bus()
