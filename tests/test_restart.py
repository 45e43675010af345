"""Restarts without a human: each command, killed with `kill -9`, starts again as it was typed.

A process killed with SIGKILL cleans nothing up: its socket file stays, nobody answering on it,
and twistd's pid file stays. The same command must start again, removing a socket file nobody
answers on with one log line (as the bus server does), and a service whose bus is missing
names its full path once and retries quietly (docs/deploy.md "Restart after a crash").
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SERVICE_TIMEOUT, LoggedProcess, SbusdProcess, answers_whoami, child_env, wait_until

#: twistd as typed (its default pid file, twistd.pid in the working directory, included)
TWISTD = [sys.executable, "-c", "import sys; from twisted.scripts.twistd import run; sys.argv[0] = 'twistd'; run()",
          "-n"]
STALE = "removed the stale socket (nobody listening) at"


def _accepts_stream(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
        return True
    except OSError:
        return False


def _start(argv, cwd: Path, n: int, ready) -> LoggedProcess:
    p = LoggedProcess(argv, cwd / f"run-{n}.log", cwd=cwd)
    try:
        wait_until(lambda: p.alive_or_raise() and ready(cwd, p), f"{argv[4:6]} ready", SERVICE_TIMEOUT * 2)
    except AssertionError:
        p.stop(signal.SIGKILL)
        raise
    return p


#: name -> (arguments after twistd -n, readiness check (cwd, process) -> bool)
SERVICES = {
    "sbus": (["sbus", "--socket", "bus2.socket"], lambda d, p: answers_whoami(str(d / "bus2.socket"))),
    "sbus-relay": (["sbus-relay", "--bus", "{bus}", "--socket", "relay.socket"],
                   lambda d, p: answers_whoami(str(d / "relay.socket"))),
    "sbus-msgbus": (["sbus-msgbus", "--bus", "{bus}", "--port", "unix:gw.socket"],
                    lambda d, p: "connected to the bus" in p.log() and _accepts_stream(str(d / "gw.socket"))),
    "sbus-msgbus lockfile=0": (["sbus-msgbus", "--bus", "{bus}", "--port", "unix:gw.socket:lockfile=0"],
                               lambda d, p: "connected to the bus" in p.log()
                               and _accepts_stream(str(d / "gw.socket"))),
    "sbus-link": (["sbus-link", "--bus", "{bus}", "--listen", "unix:link.socket"],
                  lambda d, p: _accepts_stream(str(d / "link.socket"))),
    "sbus-bridge": (["sbus-bridge", "--bus-a", "{bus}", "--bus-b", "{bus_b}", "--rule", "x/ a>b"],
                    lambda d, p: p.log().count("ready") >= 2),
    "sbus-record": (["sbus-record", "--bus", "{bus}", "--out", "rec"],
                    lambda d, p: "subscribed" in p.log()),
}
BINDS = {"sbus", "sbus-relay", "sbus-msgbus", "sbus-msgbus lockfile=0", "sbus-link"}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_the_same_command_starts_again_after_kill_9(name, tmp_path, start_bus):
    bus, bus_b = start_bus(), start_bus()
    args, ready = SERVICES[name]
    argv = TWISTD + [a.format(bus=bus.address, bus_b=bus_b.address) for a in args]
    first = _start(argv, tmp_path, 1, ready)
    first.stop(signal.SIGKILL)
    second = _start(argv, tmp_path, 2, ready)
    try:
        log = second.log()
        if name in BINDS:
            assert log.count(STALE) == 1, log[-2000:]
    finally:
        assert second.stop(signal.SIGTERM) == 0, second.log()[-2000:]


def test_sbusd_starts_again_after_kill_9(tmp_path):
    path = str(tmp_path / "bus.socket")
    first = SbusdProcess(["-f", "-a", path], tmp_path / "sbusd-1.log", address=path)
    first.stop(signal.SIGKILL)
    assert os.path.exists(path)  # left behind, nobody answering
    second = SbusdProcess(["-f", "-a", path], tmp_path / "sbusd-2.log", address=path)
    try:
        assert answers_whoami(path)
        assert second.log().count(STALE) == 1, second.log()
    finally:
        assert second.stop() == 0


def test_a_live_service_socket_is_not_taken_over(tmp_path, start_bus):
    """The other side of the rule: a socket someone answers on stays theirs, one line, exit 1."""
    bus = start_bus()
    argv = TWISTD + ["--pidfile=", "sbus-msgbus", "--bus", bus.address, "--port", "unix:gw.socket"]
    first = _start(argv, tmp_path, 1, SERVICES["sbus-msgbus"][1])
    try:
        r = subprocess.run(argv, cwd=tmp_path, env=child_env(), capture_output=True, timeout=SERVICE_TIMEOUT * 3,
                           stdin=subprocess.DEVNULL)
        assert r.returncode != 0
        assert "another server is listening on gw.socket" in r.stdout.decode() + r.stderr.decode()
        assert _accepts_stream(str(tmp_path / "gw.socket"))  # still the first one's
    finally:
        first.stop()


# ---------------------------------------------------------------- a bus that is not there


#: name -> (arguments, what the log says once the bus has answered)
MISSING = {
    "sbus-relay": (["sbus-relay", "--bus", "{missing}", "--socket", "relay.socket"], "connected to the master"),
    "sbus-msgbus": (["sbus-msgbus", "--bus", "{missing}", "--port", "tcp:0:interface=127.0.0.1"],
                    "connected to the bus"),
    "sbus-link": (["sbus-link", "--bus", "{missing}", "--listen", "unix:link.socket"], "listening on"),
    "sbus-bridge": (["sbus-bridge", "--bus-a", "{missing}", "--bus-b", "{missing}b", "--rule", "x/ a>b"], "ready"),
    "sbus-record": (["sbus-record", "--bus", "{missing}", "--out", "rec"], "subscribed"),
    # no NATS server on port 1: the bus side is what is looked at
    "sbus-nats": (["--reactor=asyncio", "sbus-nats", "--bus", "{missing}", "--server", "nats://127.0.0.1:1",
                   "--allow-unauthenticated", "--export", "x/"],
                  "bus: connected to"),
}


@pytest.mark.parametrize("name", sorted(MISSING))
def test_a_missing_bus_is_named_once_with_its_full_path(name, tmp_path, start_bus):
    """Named once (full path, why), retried quietly, served once it is there. sbus-link opens
    no port before it has a bus."""
    missing = str(tmp_path / "nonexist" / "a.socket")
    args, connected = MISSING[name]
    argv = TWISTD + ["--pidfile=", *[a.format(missing=missing) for a in args]]
    p = LoggedProcess(argv, tmp_path / "svc.log", cwd=tmp_path)
    sides = 2 if name == "sbus-bridge" else 1
    try:
        line = re.compile(rf"cannot connect to .*{re.escape(missing)}b?: No such file or directory; "
                          ".*retrying quietly with back-off")
        p.wait_log(line, count=sides)
        assert not (tmp_path / "link.socket").exists()  # sbus-link: no port without a bus
        os.mkdir(tmp_path / "nonexist")
        start_bus(address=missing)
        if name == "sbus-bridge":
            start_bus(address=missing + "b")
        p.wait_log(connected, count=sides)
    finally:
        p.stop()
    log = p.log()
    assert len(line.findall(log)) == sides, log[-2000:]
    assert not [line for line in log.splitlines() if "Errno" in line and "NATS:" not in line], log[-2000:]


@pytest.mark.parametrize("name", sorted(MISSING))
def test_help_says_what_a_missing_bus_does(name):
    r = subprocess.run(TWISTD[:-1] + [name, "--help"], env=child_env(), capture_output=True,
                       timeout=SERVICE_TIMEOUT * 3)
    text = " ".join(r.stdout.decode().split())
    assert r.returncode == 0 and "named once in the log, with its full path" in text, text[-600:]


def test_sbus_link_port_taken_is_fatal_once_the_bus_answers(tmp_path, start_bus):
    """The --listen port opens only with a bus; if someone else holds it then: one line, exit 1
    (a link running without its port would look served)."""
    bus = start_bus()
    key = tmp_path / "k"
    key.write_text(os.urandom(16).hex())
    key.chmod(0o600)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        r = subprocess.run(TWISTD + ["--pidfile=", "sbus-link", "--bus", bus.address, "--listen",
                                     f"tcp:{port}:interface=127.0.0.1", "--key-file", str(key)],
                           cwd=tmp_path, env=child_env(), capture_output=True, timeout=SERVICE_TIMEOUT * 3,
                           stdin=subprocess.DEVNULL)
    out = r.stdout.decode() + r.stderr.decode()
    assert r.returncode == 1, out[-2000:]
    assert out.index("connected to bus") < out.index(f"cannot listen on tcp:{port}"), out[-2000:]
    assert out.count("cannot listen on") == 1 and "Traceback" not in out, out[-2000:]


def test_a_planted_symlink_at_a_service_socket_path_is_left_alone(tmp_path, start_bus):
    """Only a socket nobody answers on is removed: a symlink (to a file, or to a dead socket) at
    the --port path is an error, and neither it nor its target is touched."""
    bus = start_bus()
    target = tmp_path / "precious"
    target.write_text("data")
    dead = tmp_path / "dead.socket"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(dead))
    s.close()
    for victim in (target, dead):
        link = tmp_path / "gw.socket"
        link.symlink_to(victim)
        r = subprocess.run(TWISTD + ["--pidfile=", "sbus-msgbus", "--bus", bus.address, "--port", "unix:gw.socket"],
                           cwd=tmp_path, env=child_env(), capture_output=True, timeout=SERVICE_TIMEOUT * 3,
                           stdin=subprocess.DEVNULL)
        out = r.stdout.decode() + r.stderr.decode()
        assert r.returncode != 0 and "cannot listen on unix:gw.socket" in out, out[-1500:]
        assert link.is_symlink() and victim.exists() and STALE not in out
        link.unlink()
    assert target.read_text() == "data"
