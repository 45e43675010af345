"""What a newcomer meets first: one default bus for server and clients, errors that say what
was wrong, hints where another system's habit fails silently, `make run` and `make test`.

Each case runs the commands as a user types them (real processes, their exit status and their
standard error).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, LoggedProcess, SbusdProcess, answers_whoami, child_env, wait_until

SBUS = [sys.executable, "-m", "sbus.cli"]
SBUSD = [sys.executable, "-m", "sbus.server.sbusd"]
TIMEOUT = 60
LIMIT = 409600 - len(b"MSG \0") - len(b"k")  # the largest payload on key 'k'


def env(**extra) -> dict:
    e = {k: v for k, v in child_env().items() if k != "SBUS_SOCKET"}
    e.update(extra)
    return e


def run(argv, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("env", env())
    kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run(argv, capture_output=True, timeout=TIMEOUT, **kw)


# ---------------------------------------------------------------- one default bus


def test_server_and_clients_share_one_default(tmp_path):
    """`sbusd -f` then `sbus pub`, with nothing but $SBUS_SOCKET (or nothing at all) saying where:
    they meet. Without it both sides mean /run/sbus.socket."""
    path = str(tmp_path / "bus.socket")
    bus = SbusdProcess(["-f"], tmp_path / "sbusd.log", address=path, env=env(SBUS_SOCKET=path))
    try:
        assert os.path.exists(path)  # sbusd listens where $SBUS_SOCKET says
        r = run([*SBUS, "whoami"], env=env(SBUS_SOCKET=path), cwd="/")
        assert r.returncode == 0 and r.stdout.startswith(b"!/cred/"), r.stderr
    finally:
        bus.stop()
    h = run([*SBUSD, "-h"]).stdout.decode()
    assert re.search(r"-a ADDRESS +where to listen \(default \$SBUS_SOCKET, else /run/sbus\.socket", h), h
    if not os.path.exists("/run/sbus.socket"):  # (a system bus on this machine would answer)
        (tmp_path / "sbus.socket").touch()      # never looked at: not the working directory's
        r = run([*SBUS, "whoami"], cwd=tmp_path)
        assert r.returncode == 1 and r.stderr.startswith(b"sbus: /run/sbus.socket: no such socket"), r.stderr


# ---------------------------------------------------------------- sbus sub: another system's wildcard


@pytest.mark.parametrize("pattern", ["#", ">", "sensors/#", "sensors.>"])
def test_sub_hints_that_a_foreign_wildcard_is_a_literal_key(pattern, bus):
    r = run([*SBUS, "sub", "--bus", bus.address, "-n", "1", "-t", "0.1", pattern])
    assert r.returncode == 124, r.stderr  # nothing came: a literal key nobody publishes
    line = r.stderr.decode().splitlines()[0]
    assert line.startswith(f"sbus: hint: {pattern!r} is a literal key") and "'' matches every key" in line, line


def test_sub_gives_no_hint_for_sbus_patterns(bus):
    r = run([*SBUS, "sub", "--bus", bus.address, "-n", "1", "-t", "0.1", "", "a/", "a/*/c", "a#b"])
    assert r.returncode == 124 and b"hint" not in r.stderr, r.stderr  # 124: nothing came


def test_sub_help_says_what_matches_everything():
    text = " ".join(run([*SBUS, "sub", "--help"]).stdout.decode().split())
    assert "'' matches every key" in text and "'#' and '>' are literal keys" in text, text


# ---------------------------------------------------------------- sbus pub: bounded reads


def test_pub_whole_reads_no_more_than_one_message_can_carry(bus):
    """`yes | sbus pub k --whole` grew to GBs before failing. Now: the limit plus one byte, then
    one error line. The writer below counts what the command took before it let go."""
    p = subprocess.Popen([*SBUS, "pub", "--bus", bus.address, "k", "--whole"], stdin=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env())
    chunk, written = b"y\n" * 32768, 0
    try:
        while written < 64 * LIMIT:
            p.stdin.write(chunk)
            p.stdin.flush()
            written += len(chunk)
    except BrokenPipeError:
        pass
    finally:
        try:
            p.stdin.close()
        except BrokenPipeError:
            pass
        err = p.stderr.read().decode()
        p.wait(TIMEOUT)
    assert p.returncode == 1 and err.count("\n") == 1, err
    assert err.startswith(f"sbus: message too large: standard input holds more than {LIMIT} bytes"), err
    assert written < 4 * LIMIT, written  # what it read, plus what the pipe held


def test_pub_file_reads_no_more_than_one_message_can_carry(bus):
    r = run([*SBUS, "pub", "--bus", bus.address, "k", "--file", "/dev/zero"])  # endless
    assert r.returncode == 1 and r.stderr.count(b"\n") == 1, r.stderr
    assert r.stderr.startswith(b"sbus: message too large: /dev/zero holds more than %d bytes" % LIMIT)


def test_pub_largest_message_still_goes(bus, tmp_path):
    f = tmp_path / "big"
    f.write_bytes(b"x" * LIMIT)
    assert run([*SBUS, "pub", "--bus", bus.address, "k", "--file", str(f)]).returncode == 0
    r = run([*SBUS, "pub", "--bus", bus.address, "k", "--whole"], stdin=open(f, "rb"))
    assert r.returncode == 0, r.stderr
    f.write_bytes(b"x" * (LIMIT + 1))
    r = run([*SBUS, "pub", "--bus", bus.address, "k", "--file", str(f)])
    assert r.returncode == 1 and b"message too large" in r.stderr


def test_pub_lines_are_bounded_too(bus):
    r = run([*SBUS, "pub", "--bus", bus.address, "k", "-"], stdin=open("/dev/zero", "rb"))  # one endless line
    assert r.returncode == 1 and r.stderr.startswith(b"sbus: message too large: a line of standard input"), \
        r.stderr


# ---------------------------------------------------------------- other commands' errors


def test_stats_services_with_none_says_so(bus):
    r = run([*SBUS, "stats", "--services", "--wait", "0.2", "--bus", bus.address])
    assert r.returncode == 1 and r.stdout == b"[]\n"
    assert r.stderr.startswith(b"sbus: no service answered within 0.2 s") and r.stderr.count(b"\n") == 1, r.stderr


def test_ready_file_in_a_directory_that_takes_no_file(bus):
    r = run([*SBUS, "sub", "--bus", bus.address, "--ready-file", "/proc/version", "x"])
    assert r.returncode == 1 and r.stderr.count(b"\n") == 1, r.stderr
    assert r.stderr.startswith(b"sbus: --ready-file /proc/version: cannot create a file in /proc"), r.stderr
    assert b"directory you can write to" in r.stderr


def test_asyncio_timeout_says_what_did_not_come(bus):
    code = ("import asyncio, sys, sbus.client.asyncio as a\n"
            "async def main():\n"
            "    bus = await a.connect(sys.argv[1])\n"
            "    for call in (bus.receive(timeout=0.05), ):\n"
            "        try:\n"
            "            await call\n"
            "        except TimeoutError as e:\n"
            "            print(repr(str(e)))\n"
            "asyncio.run(main())")
    r = run([sys.executable, "-c", code, bus.address])
    assert r.returncode == 0 and r.stdout.decode().strip() == "'no packet within 0.05 s'", r


# ---------------------------------------------------------------- make run, make test


def _make_plan(target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    r = run(["make", "-n", "-f", os.path.join(REPO, "Makefile"), target, "VENV=/nonexistent/venv"], cwd=REPO)
    assert r.returncode == 0, r.stderr
    return r.stdout.decode()


def test_first_make_test_shows_progress():
    """A first `make test` installs about 900 MB: it says so, and pip lists what it fetches."""
    plan = _make_plan("test")
    assert "installing sbus and the test dependencies" in plan
    (pip,) = [line for line in plan.splitlines() if "pip install" in line and "[test]" in line]
    assert " -q" not in pip, pip


def test_make_run_leaves_no_pid_file_and_starts_again(tmp_path):
    """The command `make run` runs, in a clone: nothing untracked appears (twistd.pid was), and
    after a crash the same command starts again."""
    (twistd_line,) = [line for line in _make_plan("run").splitlines() if "twistd" in line]
    argv = twistd_line.split()
    assert argv[0].endswith("/twistd") and "sbus" in argv
    argv = [sys.executable, "-c", "import sys; from twisted.scripts.twistd import run; run()", *argv[1:]]
    clone = tmp_path / "clone"
    clone.mkdir()
    for attempt in (1, 2):
        p = LoggedProcess(argv, tmp_path / f"run-{attempt}.log", cwd=clone)
        try:
            wait_until(lambda: p.alive_or_raise() and answers_whoami(str(clone / "sbus.socket")),
                       "make run serving")
            assert sorted(os.listdir(clone)) == ["sbus.socket"], os.listdir(clone)
        finally:
            p.stop(signal.SIGKILL if attempt == 1 else signal.SIGTERM)
    assert os.listdir(clone) == []  # the socket file removed at the clean stop


def test_make_run_says_where_clients_find_the_bus():
    plan = _make_plan("run")
    assert "export SBUS_SOCKET=" + os.path.join(REPO, "sbus.socket") in plan, plan


def test_sources_cite_nothing_outside_the_repository():
    """A module's text points at docs/ (shipped with it), never at files only the authors have."""
    bad = []
    for path in sorted(Path(REPO, "sbus").rglob("*.py")):
        text = path.read_text()
        if re.search(r"shared/(seeds|spec|tools)|\.\./shared|NOTES\.md|DESIGN\.md|STYLE\.md", text):
            bad.append(str(path.relative_to(REPO)))
    assert not bad, bad
