"""Log and pid files take the bus's mode, whichever service writes them (issue 16 item 10).

Every twistd plugin's log names its peers (a server's: every client's pid and uid): on a
0700 bus it is 0600, created so (sbus/logfiles.py). Real processes, under umask 022."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile

import pytest
from helpers import LoggedProcess, SbusdProcess, child_env, run_as, wait_until

TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile="]
TWIST = [sys.executable, "-m", "twisted"]


@pytest.fixture(scope="module")
def buses(tmp_path_factory):
    """Two private (0700) buses, shared: the services only need their sockets' mode."""
    d = tmp_path_factory.mktemp("logmodes")
    procs = []
    for name in ("bus", "other"):
        address = str(d / f"{name}.socket")
        procs.append(SbusdProcess(["-f", "-a", address], d / f"{name}.log", address=address))
        assert stat.S_IMODE(os.stat(address).st_mode) == 0o700
    yield [p.address for p in procs]
    for p in procs:
        p.stop()


@pytest.fixture
def bus(buses):
    return buses[0]


def plugin_args(name: str, address: str, tmp_path) -> list[str]:
    if name == "sbus-record":
        return ["sbus-record", "--bus", address, "--out", str(tmp_path / "rec")]
    if name == "sbus-link":
        return ["sbus-link", "--bus", address, "--listen", f"unix:{tmp_path / 'link.socket'}",
                "--stats-interval", "0"]
    if name == "sbus-msgbus":
        return ["sbus-msgbus", "--bus", address, "--port", "tcp:0:interface=127.0.0.1"]
    if name == "sbus-bridge":
        other = address.replace("bus.socket", "other.socket")
        return ["sbus-bridge", "--bus-a", address, "--bus-b", other, "--rule", "x/ a>b"]
    if name == "sbus-nats":
        pytest.importorskip("nats")
        return ["sbus-nats", "--bus", address, "--server", "nats://127.0.0.1:1", "--allow-unauthenticated",
                "--initial-delay", "5", "--export", "x/*"]
    raise AssertionError(name)


PLUGINS = ["sbus-record", "sbus-link", "sbus-msgbus", "sbus-bridge", "sbus-nats"]


def start(argv, tmp_path, umask=0o022) -> LoggedProcess:
    """Stopped by SIGTERM: these tests stop a service as soon as its log file is written, which
    twistd does before the reactor runs and installs its SIGINT handler; a SIGINT then raised
    KeyboardInterrupt where a Deferred caught it, and the service ran on until killed (30 s)."""
    proc = LoggedProcess(argv, tmp_path / "out.log", env=child_env(), cwd=str(tmp_path), umask=umask)
    proc.stop_signal = signal.SIGTERM
    return proc


def wait_log(proc, log) -> None:
    wait_until(lambda: proc.alive_or_raise() and log.exists() and log.stat().st_size > 0, f"{log}")


def assert_private(path) -> None:
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
    assert stat.S_IMODE(st.st_mode) == 0o600, f"{path}: {stat.S_IMODE(st.st_mode):04o}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("runner", ["twistd", "twist"])
@pytest.mark.parametrize("plugin", PLUGINS)
def test_plugin_log_file_takes_the_bus_mode(bus, tmp_path, plugin, runner):
    """It was 0644 (the umask) for all but sbus and sbus-relay."""
    log = tmp_path / "service.log"
    args = plugin_args(plugin, bus, tmp_path)
    argv = [*TWISTD, "--logfile", str(log), *args] if runner == "twistd" else [*TWIST, "--log-file", str(log), *args]
    proc = start(argv, tmp_path)
    try:
        wait_log(proc, log)
        assert_private(log)
    finally:
        proc.stop()


@pytest.mark.timeout(60)
def test_rotated_log_files_keep_the_mode(bus, tmp_path):
    """twistd rotates on SIGUSR1 (and at 1 MB): the new file is 0600 too, not the umask's 0644."""
    log = tmp_path / "rec.log"
    proc = start([*TWISTD, "--logfile", str(log), *plugin_args("sbus-record", bus, tmp_path)], tmp_path)
    try:
        wait_log(proc, log)
        proc.proc.send_signal(signal.SIGUSR1)
        # twistd's LogFile creates the new file under umask 0777 (mode 0000), then chmods it to
        # the old file's mode: the rotation is done once that chmod is (a check in between failed)
        wait_until(lambda: (tmp_path / "rec.log.1").exists() and log.exists() and stat.S_IMODE(log.stat().st_mode),
                   "the rotation")
        assert_private(log)
        assert_private(tmp_path / "rec.log.1")
    finally:
        proc.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("runner", ["twistd", "twist"])
def test_a_readable_log_file_is_replaced_by_a_private_one(bus, tmp_path, runner):
    """A 0644 log from an earlier run (or the one `twist` creates under the umask before any
    plugin code runs): whoever opened it keeps what it had, not what comes next."""
    log = tmp_path / "old.log"
    log.write_bytes(b"earlier run\n")
    os.chmod(log, 0o644)
    held = open(log, "rb")  # the other reader, who opened it while it was readable
    try:
        args = plugin_args("sbus-msgbus", bus, tmp_path)
        argv = [*TWISTD, "--logfile", str(log), *args] if runner == "twistd" else [*TWIST, "--log-file", str(log), *args]
        proc = start(argv, tmp_path)
        try:
            wait_until(lambda: proc.alive_or_raise() and log.stat().st_size > len(b"earlier run\n"), "new lines")
            assert_private(log)
            assert log.read_bytes().startswith(b"earlier run\n")
            assert os.stat(log).st_ino != os.fstat(held.fileno()).st_ino
            assert held.read() == b"earlier run\n"
        finally:
            proc.stop()
    finally:
        held.close()


@pytest.mark.timeout(60)
def test_other_uid_cannot_read_the_log(bus):
    """In a directory everyone may enter: uid 65534 cannot open the sbus-link log."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as uid 65534")
    d = tempfile.mkdtemp(prefix="sbus-logmodes-")
    os.chmod(d, 0o755)
    from pathlib import Path

    tmp = Path(d)
    log = tmp / "link.log"
    proc = start([*TWISTD, "--logfile", str(log), *plugin_args("sbus-link", bus, tmp)], tmp)
    try:
        wait_log(proc, log)

        def attempt():
            try:
                open(log, "rb").close()
                return "read"
            except PermissionError:
                return "denied"

        assert run_as(65534, 65534, attempt) == "denied"
    finally:
        proc.stop()
        subprocess.run(["rm", "-rf", d])


@pytest.mark.timeout(60)
def test_planted_symlink_or_foreign_file_is_refused(bus, tmp_path):
    """A log name in a shared directory: another uid's symlink is not followed, another
    uid's file not written into. One line, exit 1, the target untouched."""
    if os.geteuid() != 0:
        pytest.skip("needs root to plant files of uid 65534")
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine\n")
    link = tmp_path / "link.log"
    os.symlink(victim, link)
    os.lchown(link, 65534, 65534)
    foreign = tmp_path / "foreign.log"
    foreign.write_bytes(b"")
    os.chmod(foreign, 0o666)
    os.chown(foreign, 65534, 65534)
    for path, says in ((link, "is a symlink owned by uid 65534"), (foreign, "belongs to uid 65534")):
        res = subprocess.run([*TWISTD, "--logfile", str(path), *plugin_args("sbus-msgbus", bus, tmp_path)],
                             capture_output=True, text=True, env=child_env(), timeout=30)
        assert res.returncode == 1, res
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], res.stderr
    assert victim.read_bytes() == b"mine\n" and foreign.read_bytes() == b""


@pytest.mark.timeout(60)
def test_twistd_pid_file_is_not_world_writable_nor_followed(bus, tmp_path):
    """twistd wrote its pid file with open(..., 'wb'): under umask 0 it was 0666, and a
    dangling symlink at its name created the file it points to."""
    pidfile = tmp_path / "s.pid"
    log = tmp_path / "s.log"
    argv = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n",
            "--pidfile", str(pidfile), "--logfile", str(log), *plugin_args("sbus-msgbus", bus, tmp_path)]
    proc = start(argv, tmp_path, umask=0)
    try:
        wait_log(proc, log)
        wait_until(lambda: pidfile.exists() and pidfile.read_text().strip() == str(proc.pid), "the pid file")
        assert stat.S_IMODE(os.stat(pidfile).st_mode) == 0o644
        assert_private(log)  # umask 0 or not
    finally:
        proc.stop()
    target = tmp_path / "elsewhere"
    pidfile = tmp_path / "planted.pid"
    os.symlink(target, pidfile)
    argv[argv.index("--pidfile") + 1] = str(pidfile)
    argv[argv.index("--logfile") + 1] = str(tmp_path / "s2.log")
    res = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=30)
    assert res.returncode == 1 and "pid file" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res
    assert not target.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flags,mode", [((), 0o600), (("-g",), 0o640)])
def test_sbusd_log_file_takes_the_bus_mode(tmp_path, flags, mode):
    """sbusd -l created its log 0640 (group-readable on a 0700 bus)."""
    log = tmp_path / "sbusd.log"
    address = str(tmp_path / "b.socket")
    p = SbusdProcess(["-f", "-a", address, "-l", str(log), *flags], tmp_path / "out.log",
                     address=address, umask=0o022)
    try:
        wait_until(lambda: log.exists() and log.stat().st_size > 0, "the log line")
        assert stat.S_IMODE(os.stat(log).st_mode) == mode
    finally:
        p.stop()


def test_a_log_file_that_cannot_be_copied_whole_keeps_its_bytes(tmp_path):
    """A readable log file is replaced by a private copy; a disk that fills mid-copy (here: a
    file size limit, which also takes part of a write before it fails) must not leave a copy cut
    short in its place: the old file stays whole and is narrowed in place instead."""
    log = tmp_path / "bus.log"
    log.write_bytes(b"an old line\n" * 10_000)  # 120 KB
    log.chmod(0o644)
    script = (
        "import resource, signal, sys\n"
        "from sbus.logfiles import prepare\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, resource.RLIM_INFINITY))\n"
        "print(prepare(sys.argv[1], 0o600)[1] is None)\n")
    r = subprocess.run([sys.executable, "-c", script, str(log)], capture_output=True, text=True, timeout=60,
                       env=child_env())
    assert r.returncode == 0, r.stderr[-1000:]
    assert log.read_bytes() == b"an old line\n" * 10_000
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and r.stdout.strip() == "True"
    assert os.listdir(tmp_path) == ["bus.log"]  # no copy left behind
