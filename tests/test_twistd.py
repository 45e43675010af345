"""The `sbus` twistd plugin (sbus.server.tap), through real processes.

Two runners: `python -m twisted sbus ...` (the `twist` runner: always in the
foreground) and `twistd -n sbus ...` (run as `python -c` so it uses this
interpreter).
Plugins are found on sys.path entries holding `twisted/plugins/`, so the
processes run with the repository root on PYTHONPATH (an editable install
alone does not expose it outside the repository directory).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parent.parent)
TIMEOUT = 10.0
WHOAMI = b"CMSG !/cred/whoami"
TWIST = [sys.executable, "-m", "twisted", "--log-format", "text"]
TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile="]
OPTIONS = ["--socket", "--mode", "--user", "--cred-prefix", "--max-packet",
           "--queue-bytes", "--queue-packets", "--reuse"]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO + os.pathsep + e.get("PYTHONPATH", "") if e.get("PYTHONPATH") else REPO
    return e


def run(argv, tmp_path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
                          cwd=tmp_path, env=env(), **kw)


def connect(addr) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(TIMEOUT)
    s.connect(addr)
    return s


class Server:
    def __init__(self, argv, tmp_path, **kw):
        self.log_path = tmp_path / f"twistd-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "wb")
        kw.setdefault("env", env())
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=tmp_path, **kw)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def whoami(self, addr) -> bytes:
        """Wait (with a timeout) until the server answers on `addr`; return the reply."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}: {self.log()}"
            try:
                with connect(addr) as s:
                    s.send(WHOAMI)
                    return s.recv(4096)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise AssertionError(f"not serving on {addr} within {TIMEOUT}s: {self.log()}")
                time.sleep(0.01)

    def stop(self, sig=signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()


@pytest.fixture
def server(tmp_path):
    servers = []

    def start(argv, **kw):
        s = Server(argv, tmp_path, **kw)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


# ------------------------------------------------------------------ help and errors


def test_plugin_is_listed(tmp_path):
    res = run([sys.executable, "-m", "twisted", "--help"], tmp_path)
    assert res.returncode == 0
    assert any(line.split()[:1] == ["sbus"] for line in res.stdout.decode().splitlines())


@pytest.mark.parametrize("runner", [TWIST, TWISTD], ids=["twist", "twistd"])
def test_help_lists_options(tmp_path, runner):
    res = run([*runner, "sbus", "--help"], tmp_path)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.decode().split())  # help text wraps wherever the columns fall
    for opt in OPTIONS:
        assert opt in text
    assert "(default: $SBUS_SOCKET, else /run/sbus.socket" in text and "[default: 409600]" in text


@pytest.mark.parametrize("args,needle", [
    (["--max-packet", "16"], "--max-packet: must be > 16"),
    (["--max-packet", str(16 * 1024 * 1024 + 1)], "--max-packet: must be > 16"),
    (["--max-packet", "big"], "--max-packet: not an integer"),
    (["--queue-bytes", "0"], "--queue-bytes: must be positive"),
    (["--queue-packets", "-3"], "--queue-packets: must be positive"),
    (["--mode", "0800"], "--mode: not an octal number"),
    (["--mode", "1777"], "--mode: must be between"),
    (["--cred-prefix", "!/cred/1/2/3"], "--cred-prefix: bad credential prefix"),
    (["--cred-prefix", "x/"], "--cred-prefix: bad credential prefix"),
    (["--cred-prefix", "!/cred/a/2/3/"], "--cred-prefix: bad credential prefix"),
    (["--user", "no-such-user-xyzzy"], "--user: getpwnam no-such-user-xyzzy"),
    (["--socket", "/dev/unix/abstract/41"], "--socket: bad unix socket address"),
    (["--bogus"], "option --bogus not recognized"),
])
def test_bad_options(tmp_path, args, needle):
    res = run([*TWIST, "sbus", *args], tmp_path)
    assert res.returncode != 0
    out = (res.stdout + res.stderr).decode()
    lines = [line for line in out.splitlines() if needle in line]
    assert len(lines) == 1, out
    assert not list(tmp_path.glob("*.socket"))


def test_bad_option_twistd(tmp_path):
    res = run([*TWISTD, "sbus", "--max-packet", "5"], tmp_path)
    assert res.returncode != 0
    out = (res.stdout + res.stderr).decode()
    assert sum("--max-packet: must be > 16" in line for line in out.splitlines()) == 1


def test_options_build_the_config():
    from sbus.server.tap import Options, config_from_options

    o = Options()
    o.parseOptions(["--max-packet", "1000", "--queue-bytes", "5000", "--queue-packets", "7",
                    "--cred-prefix", "!/cred/1/2/3/!/cred/4/5/6/", "-u", "65534", "--user", "0",
                    "--mode", "0770", "-r", "--socket", "/dev/unix/abstract"])
    c = config_from_options(o)
    assert (c.max_packet, c.queue_bytes, c.queue_packets) == (1000, 5000, 7)
    assert c.cred_prefix == b"!/cred/1/2/3/!/cred/4/5/6/"
    assert c.allowed_uids == frozenset({65534, 0, os.getuid()})
    assert o["mode"] == 0o770 and o["reuse"] and o["socket"] == "/dev/unix/abstract"
    d = config_from_options(_parsed([]))
    assert d.allowed_uids is None and d.cred_prefix == b"" and d.max_packet == 409600


def _parsed(argv):
    from sbus.server.tap import Options

    o = Options()
    o.parseOptions(argv)
    return o


# ------------------------------------------------------------------ serving


@pytest.mark.parametrize("runner", [TWIST, TWISTD], ids=["twist", "twistd"])
def test_serves_and_exits_on_sigint(server, tmp_path, runner):
    path = str(tmp_path / "tw.sock")
    s = server([*runner, "sbus", "--socket", path, "--mode", "0750"])
    reply = s.whoami(path)
    assert reply.startswith(WHOAMI + b"\0!/cred/")
    assert os.stat(path).st_mode & 0o777 == 0o750
    # twistd re-raises the signal that stopped it after a clean shutdown
    # (app._exitWithSignal), so the status is "killed by SIGINT", not 0.
    assert s.stop() in (0, -signal.SIGINT), s.log()
    assert not os.path.exists(path)
    assert "Traceback" not in s.log()


@pytest.mark.parametrize("runner, chosen", [(TWISTD, None), (TWISTD, "sbus"), (TWISTD, "epoll"),
                                            (TWIST, None), (TWIST, "epoll")],
                         ids=["twistd", "twistd-sbus", "twistd-epoll", "twist", "twist-epoll"])
def test_the_bus_runs_on_its_own_reactor_unless_another_is_chosen(server, tmp_path, runner, chosen):
    path = str(tmp_path / "r.sock")
    s = server([*runner, *(["--reactor", chosen] if chosen else []), "sbus", "--socket", path])
    assert s.whoami(path).startswith(WHOAMI + b"\0!/cred/")
    if runner is TWISTD:  # only twistd names the reactor; both say when polling is off
        want = ("twisted.internet.epollreactor.EPollReactor" if chosen == "epoll"
                else "sbus.reactor.SbusReactor")
        assert f"reactor class: {want}." in s.log(), s.log()
    assert ("busy polling is off" in s.log()) == (chosen == "epoll"), s.log()


def test_default_socket_is_where_clients_look(server, tmp_path):
    """No --socket: $SBUS_SOCKET, as for the clients (else /run/sbus.socket, as for them)."""
    path = tmp_path / "from-env.socket"
    s = server([*TWIST, "sbus"], env=dict(env(), SBUS_SOCKET=str(path)))
    s.whoami(str(path))
    assert s.stop() in (0, -signal.SIGINT)
    assert not path.exists()


def test_cred_prefix_reaches_whoami(server, tmp_path):
    path = str(tmp_path / "prefix.sock")
    s = server([*TWIST, "sbus", "--socket", path, "--cred-prefix", "!/cred/1/2/3/"])
    reply = s.whoami(path)
    assert reply.startswith(WHOAMI + b"\0!/cred/1/2/3/!/cred/"), reply


def _stale_socket(path: str) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(path)
    stale.close()


def _one_error_line(res) -> str:
    """A start-up failure: one line on standard error, nothing like a traceback anywhere."""
    err = res.stderr.decode()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err + res.stdout.decode()
    return err.strip()


@pytest.mark.parametrize("runner", [TWIST, TWISTD], ids=["twist", "twistd"])
def test_stale_socket_recovers_itself(server, tmp_path, runner):
    path = str(tmp_path / "stale.sock")
    _stale_socket(path)
    s = server([*runner, "sbus", "--socket", path])
    s.whoami(path)
    assert f"removed the stale socket (nobody listening) at {path}" in s.log()


def test_kill_9_then_start_again_serves(server, tmp_path):
    """What `make run` does after a crash: the same command, no flag."""
    path = str(tmp_path / "crashed.sock")
    first = server([*TWISTD, "sbus", "--socket", path])
    first.whoami(path)
    first.proc.kill()
    first.proc.wait(TIMEOUT)
    assert os.path.exists(path)
    second = server([*TWISTD, "sbus", "--socket", path])
    second.whoami(path)


@pytest.mark.parametrize("runner", [TWIST, TWISTD, TWISTD[:-2]], ids=["twist", "twistd", "twistd-daemon"])
@pytest.mark.parametrize("flags", [[], ["--reuse"]], ids=["plain", "reuse"])
def test_live_server_socket_is_never_taken(server, tmp_path, runner, flags):
    path = str(tmp_path / "live.sock")
    first = server([*TWIST, "sbus", "--socket", path])
    first.whoami(path)
    pidfile = ["--pidfile", str(tmp_path / "d.pid")] if runner is not TWIST and "-n" not in runner else []
    argv = [*runner[:3], *pidfile, *runner[3:]] if pidfile else runner
    res = run([*argv, "sbus", "--socket", path, *flags], tmp_path)
    assert res.returncode == 1
    assert _one_error_line(res) == f"twistd sbus: another server is listening on {path}"
    first.whoami(path)  # still the first one's


def test_empty_file_needs_reuse(server, tmp_path):
    path = tmp_path / "touched.sock"
    path.touch()
    res = run([*TWIST, "sbus", "--socket", str(path)], tmp_path)
    assert res.returncode == 1
    assert _one_error_line(res).startswith(f"twistd sbus: bind {path}: Address already in use")
    s = server([*TWIST, "sbus", "--socket", str(path), "--reuse"])
    s.whoami(str(path))


@pytest.mark.parametrize("runner", [TWIST, TWISTD], ids=["twist", "twistd"])
def test_usage_error_is_one_line_with_status_2(tmp_path, runner):
    res = run([*runner, "sbus", "--queue-bytes", "0"], tmp_path)
    assert res.returncode == 2
    assert _one_error_line(res) == "twistd sbus: --queue-bytes: must be positive, got 0 (see --help)"
    assert res.stdout == b""


def test_max_packet_beyond_what_the_kernel_sends_is_refused(tmp_path):
    """--max-packet accepts up to 16 MiB, but SO_SNDBUF (net.core.wmem_max) and the kernel's
    allocation limit are usually lower: refuse at start, rather than fail forwarding."""
    from sbus.address import packet_limit_problem

    if packet_limit_problem(16 << 20) is None:
        pytest.skip("this kernel sends 16 MiB SEQPACKET packets")
    res = run([*TWIST, "sbus", "--max-packet", str(16 << 20)], tmp_path)
    assert res.returncode == 2
    line = _one_error_line(res)
    assert line.startswith("twistd sbus: --max-packet: packet size limit 16777216 is more than this kernel sends")
    assert "the largest that works here is" in line


@pytest.mark.parametrize("runner", [TWIST, TWISTD], ids=["twist", "twistd"])
def test_relay_start_failures_are_one_line(server, tmp_path, runner):
    """sbus-relay binds once its master answers; what is wrong already is said at start."""
    missing = tmp_path / "missing" / "r.sock"
    res = run([*runner, "sbus-relay", "--socket", str(missing), "--bus", str(tmp_path / "m.sock")], tmp_path)
    assert res.returncode == 1
    assert _one_error_line(res) == f"twistd sbus-relay: bind {missing}: No such file or directory"
    live = str(tmp_path / "live.sock")
    first = server([*TWIST, "sbus", "--socket", live])
    first.whoami(live)
    res = run([*runner, "sbus-relay", "--socket", live, "--reuse", "--bus", live], tmp_path)
    assert res.returncode == 1
    assert _one_error_line(res) == f"twistd sbus-relay: another server is listening on {live}"


def test_systemd_inherited_socket(server, tmp_path):
    from test_address import SYSTEMD_SHIM

    path = str(tmp_path / "activated.sock")
    outer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    outer.bind(path)
    fd = outer.fileno()  # bound, not listening: the server calls listen()
    s = server([sys.executable, "-c", SYSTEMD_SHIM, str(fd), *TWIST, "sbus", "--socket", "systemd"],
               pass_fds=[fd])
    outer.close()
    assert s.whoami(path).startswith(WHOAMI + b"\0")
    assert "systemd fd 3" in s.log()
    assert s.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    assert os.path.exists(path), "the plugin unlinked an inherited socket's path"


def test_failure_inside_start_service_is_one_line(tmp_path):
    """A plugin whose service fails while starting (sbus-msgbus on a taken port): one line
    naming the plugin once, status 1, no traceback."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        res = run([*TWISTD, "sbus-msgbus", "--port", f"tcp:{port}:interface=127.0.0.1",
                   "--bus", str(tmp_path / "nobus.sock")], tmp_path)
    finally:
        taken.close()
    assert res.returncode == 1
    line = _one_error_line(res)
    assert line.startswith(f"twistd sbus-msgbus: cannot listen on tcp:{port}") and line.count("sbus-msgbus") == 1, line
