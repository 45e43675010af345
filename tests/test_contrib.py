"""contrib/: the systemd units and the example bridge configuration.

* every unit passes `systemd-analyze verify` (when available), with the
  install path of twistd (/usr/local/bin) pointed at this interpreter's;
* every ExecStart's options are accepted (run with `--help` appended);
* the socket-activated units really work: `systemd-socket-activate
  --seqpacket` plays systemd, with the socket path moved into a temporary
  directory, and a client gets a whoami answer (a chained one through the
  relay unit);
* the bridge unit runs with a configuration in the format of
  contrib/bridge-example.conf.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import WHOAMI, WHOAMI_REPLY, connect, msg, recv, send, sub, sync
from helpers import REPO, child_env
from test_bridge import TIMEOUT, TwistdProcess

CONTRIB = Path(REPO) / "contrib"
UNITS = sorted((CONTRIB / "systemd").glob("*/*.s*"))
BIN = os.path.dirname(sys.executable)
INSTALLED_BIN = "/usr/local/bin/"


def read_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values]}} (comments, continuations handled)."""
    sections: dict = {}
    current = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not key=value: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def localise(text: str, tmp_path: Path, instance: str = "test") -> str:
    """Unit text for this checkout: our twistd, %t in tmp_path."""
    return text.replace(INSTALLED_BIN, BIN + "/").replace("%t", str(tmp_path)).replace("%i", instance)


def exec_argv(unit: Path, tmp_path: Path, **replace) -> list[str]:
    (cmd,) = read_unit(unit)["Service"]["ExecStart"]
    cmd = localise(cmd, tmp_path)
    for old, new in replace.items():
        cmd = cmd.replace(old, new)
    # $VARS come from an EnvironmentFile= at run time (sbus-link@): none here
    return [w for w in shlex.split(cmd) if not w.startswith("$")]


def test_units_exist():
    names = {f"{p.parent.name}/{p.name}" for p in UNITS}
    assert {"system/sbus.socket", "system/sbus.service", "system/sbus-bridge@.service",
            "system/sbus-msgbus.service", "system/sbus-record.service", "system/sbus-link@.service",
            "user/sbus.socket", "user/sbus.service", "user/sbus-relay.socket",
            "user/sbus-relay.service"} <= names, names


@pytest.mark.parametrize("scope", ["system", "user"])
def test_systemd_analyze_verify(scope, tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    d = tmp_path / scope
    d.mkdir()
    names = []
    for unit in UNITS:
        if unit.parent.name != scope:
            continue
        name = unit.name.replace("@.", "@test.")  # verify an instance of a template
        (d / name).write_text(unit.read_text().replace(INSTALLED_BIN, BIN + "/"))
        names.append(name)
    env = dict(os.environ)
    args = [tool]
    if scope == "user":
        runtime = tmp_path / "xdg"
        runtime.mkdir(mode=0o700)
        env["XDG_RUNTIME_DIR"] = str(runtime)
        args.append("--user")
    res = subprocess.run([*args, "verify", *names], cwd=d, capture_output=True, timeout=60, env=env)
    out = (res.stdout + res.stderr).decode()
    assert res.returncode == 0, out
    assert out.strip() == "", out  # warnings (unknown keys, ...) are failures too


#: systemd-analyze security's bands (analyze-security.c): exposure under 1.0 SAFE, under 5.0 OK,
#: under 7.5 MEDIUM, under 9.0 EXPOSED, then UNSAFE. We require OK or better.
GOOD_ENOUGH = ("PERFECT", "SAFE", "OK")


@pytest.mark.parametrize("unit", [u for u in UNITS if u.suffix == ".service"],
                         ids=lambda u: f"{u.parent.name}/{u.name}")
def test_systemd_analyze_security_rates_every_unit_ok(unit, tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    name = unit.name.replace("@.", "@test.")
    (tmp_path / name).write_text(unit.read_text().replace(INSTALLED_BIN, BIN + "/"))
    env = dict(os.environ)
    args = [tool, "security", "--offline=yes"]
    if unit.parent.name == "user":
        runtime = tmp_path / "xdg"
        runtime.mkdir(mode=0o700)
        env["XDG_RUNTIME_DIR"] = str(runtime)
        args.insert(1, "--user")
    res = subprocess.run([*args, f"./{name}"], cwd=tmp_path, capture_output=True, timeout=60, env=env)
    out = (res.stdout + res.stderr).decode()
    if "--offline" in out and "unrecognized" in out:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d) (\w+)", out)
    assert m, out
    score, band = float(m.group(1)), m.group(2)
    assert band in GOOD_ENOUGH and score < 5.0, f"{unit.name}: {score} {band}\n{out}"


@pytest.mark.parametrize("unit", [u for u in UNITS if u.suffix == ".service"],
                         ids=lambda u: f"{u.parent.name}/{u.name}")
def test_exec_start_options_are_accepted(unit, tmp_path):
    argv = exec_argv(unit, tmp_path)
    assert argv[0] == os.path.join(BIN, "twistd"), argv
    assert "--nodaemon" in argv and "--pidfile=" in argv
    res = subprocess.run([*argv, "--help"], capture_output=True, timeout=TIMEOUT, cwd=tmp_path,
                         env=child_env())
    assert res.returncode == 0, res.stderr.decode() + res.stdout.decode()
    assert b"Usage: twistd [options] sbus" in res.stdout


def test_socket_units_pair_with_their_services():
    for unit in UNITS:
        if unit.suffix != ".socket":
            continue
        conf = read_unit(unit)
        (listen,) = conf["Socket"]["ListenSequentialPacket"]
        assert listen in ("/run/sbus.socket", "%t/sbus.socket"), listen
        service = unit.with_suffix(".service")
        assert service.exists(), service
        svc = read_unit(service)
        assert svc["Unit"]["Requires"] == [unit.name]
        assert "--socket systemd" in svc["Service"]["ExecStart"][0]


def socket_activate(unit: Path, tmp_path: Path, **replace) -> tuple[TwistdProcess, str]:
    """Run the service of a .socket unit the way systemd would; return (process, socket path)."""
    tool = shutil.which("systemd-socket-activate")
    if tool is None:
        pytest.skip("systemd-socket-activate is not installed")
    (listen,) = read_unit(unit)["Socket"]["ListenSequentialPacket"]
    path = localise(listen, tmp_path).replace("/run/", str(tmp_path) + "/run-")
    argv = exec_argv(unit.with_suffix(".service"), tmp_path, **replace)
    proc = TwistdProcess([unit.stem], tmp_path, argv=[tool, "--seqpacket", "-E", f"PYTHONPATH={child_env()['PYTHONPATH']}",
                                                      "-l", path, *argv])
    return proc, path


def whoami_when_served(path: str, proc: TwistdProcess) -> bytes:
    """Connect (systemd-socket-activate listens at once) and ask whoami, with a timeout."""
    import time

    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            s = connect(path, timeout=TIMEOUT)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            assert proc.proc.poll() is None, proc.log()
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.01)
    with s:
        send(s, WHOAMI)
        reply = recv(s, TIMEOUT)
    assert reply.startswith(WHOAMI_REPLY), (reply, proc.log())
    return reply[len(WHOAMI_REPLY):]


@pytest.mark.parametrize("scope", ["system", "user"])
def test_bus_socket_activation(scope, tmp_path):
    proc, path = socket_activate(CONTRIB / "systemd" / scope / "sbus.socket", tmp_path)
    try:
        who = whoami_when_served(path, proc)
        assert who == b"!/cred/%d/%d/%d" % (os.getgid(), os.getuid(), os.getpid())
        assert "sbus listening on systemd fd 3" in proc.log()
    finally:
        proc.stop()


def test_relay_socket_activation(bus, tmp_path):
    proc, path = socket_activate(CONTRIB / "systemd" / "user" / "sbus-relay.socket", tmp_path,
                                 **{"/run/sbus.socket": bus.address})
    try:
        who = whoami_when_served(path, proc)
        # chained: the relay's credentials on the master, then ours on the relay
        assert who.startswith(b"!/cred/%d/%d/%d/!/cred/" % (os.getgid(), os.getuid(), proc.pid)), who
        assert who.endswith(b"!/cred/%d/%d/%d" % (os.getgid(), os.getuid(), os.getpid())), who
    finally:
        proc.stop()


def test_bridge_unit_with_example_config(start_bus, tmp_path):
    bus_a, bus_b = start_bus(), start_bus()
    example = (CONTRIB / "bridge-example.conf").read_text()
    assert "\na /run/user/1000/sbus.socket\n" in example and "\nb /run/user/1001/sbus.socket\n" in example
    conf = tmp_path / "bridge-test.conf"
    conf.write_text(example.replace("/run/user/1000/sbus.socket", bus_a.address)
                    .replace("/run/user/1001/sbus.socket", bus_b.address))
    argv = exec_argv(CONTRIB / "systemd" / "system" / "sbus-bridge@.service", tmp_path,
                     **{"/etc/sbus/bridge-test.conf": str(conf)})
    bridge = TwistdProcess(["sbus-bridge"], tmp_path, argv=argv)
    try:
        bridge.wait_log(r"side a: connected .*; ready")
        bridge.wait_log(r"side b: connected .*; ready")
        bridge.wait_log(r"spanning tree: .*: forwarding between a and b")
        sb, pa = connect(bus_b.address), connect(bus_a.address)
        send(sb, sub(b""))
        sync(sb)
        send(pa, msg(b"share/photos/1", b"jpeg"))       # rule '' both share/ alice/
        got = recv(sb)
        while got.startswith(b"MSG sbus/topology/"):    # the bridge's spanning-tree hellos
            got = recv(sb)
        assert got == msg(b"alice/photos/1", b"jpeg")
        sb.close()
        pa.close()
    finally:
        bridge.stop()


# ---------------------------------------------------------------- docs/deploy.md


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deploy_doc_commands_work_when_pasted(tmp_path):
    """The ```sh blocks of docs/deploy.md, in order, in one non-interactive bash."""
    import re

    doc = (Path(REPO) / "docs" / "deploy.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", doc, re.S)
    assert len(blocks) >= 6
    assert "mktemp -d" in blocks[0] and "/tmp/" not in doc.split("## The bridge")[0]
    script = "set -e\n" + "".join(blocks)
    script = script.replace("11111", str(free_port())).replace("7010", str(free_port()))
    env = child_env()
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env["TMPDIR"] = str(tmp_path)                    # where the recipe's mktemp -d makes its directory
    proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, 15)                  # whatever a failed run left behind
        except ProcessLookupError:
            pass
    out, err = stdout.decode(), stderr.decode()
    assert proc.returncode == 0, out + err
    (demo,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("tmp")]
    assert demo.stat().st_mode & 0o777 == 0o700
    lines = out.splitlines()
    assert re.fullmatch(r"(!/cred/\d+/\d+/\d+/){2}!/cred/\d+/\d+/\d+", lines[0]), out
    for expected in ("demo/hello from level 3", "alice/photo hello bob", "share/reply hello alice",
                     "b'ack sub\\n' b'ack listen\\n'", "b'recv 5\\n' b'hello'", "msgbus/foo hello",
                     "linked/x over the link",
                     "removed the stale socket (nobody listening) at session.socket"):
        assert expected in lines, (expected, out, err)
    bridge_log = (demo / "bridge.log").read_text()
    assert "stopped: forwarded a>b=1 b>a=1; reconnects a=0 b=0; drops a>b=0 b>a=0" in bridge_log
    for log in ("system.log", "alice.log", "session.log", "bob.log", "bridge.log", "msgbus.log",
                "carol.log", "link-a.log", "link-c.log"):
        assert "Server Shut Down" in (demo / log).read_text(), log


# ---------------------------------------------------------------- clean shutdown (issue 11 item 7)


@pytest.mark.parametrize("service,twice", [(s, False) for s in ("sbus", "sbus-relay", "sbus-record",
                                                                 "sbus-bridge", "sbus-link", "sbus-msgbus")]
                         + [("sbus-link", True)])
def test_sigterm_stops_every_service_cleanly(service, twice, start_bus, tmp_path):
    """SIGTERM: exit status 0, the final counters, no traceback (a second one while stopping too)."""
    import signal

    bus_a, bus_b = start_bus(), start_bus()
    if service == "sbus-bridge":
        args = ["--bus-a", bus_a.address, "--bus-b", bus_b.address, "--rule", "'' both"]
        ready = r"side b: connected .*; ready"
    elif service == "sbus-link":
        key = tmp_path / "k"
        key.write_text(os.urandom(16).hex())
        key.chmod(0o600)
        listener = TwistdProcess(["sbus-link", "--bus", bus_b.address, "--listen", "tcp:0:interface=127.0.0.1",
                                  "--key-file", str(key)], tmp_path)
        port = re.search(r"port=(\d+)", listener.wait_log(r"listening on .*port=\d+")).group(1)
        args = ["--bus", bus_a.address, "--connect", f"tcp:host=127.0.0.1:port={port}", "--key-file", str(key)]
        ready = "link up"
    elif service == "sbus-msgbus":
        args = ["--bus", bus_a.address, "--port", "tcp:0:interface=127.0.0.1"]
        ready = "subscribed to msgbus/"
    elif service == "sbus":
        args = ["--socket", str(tmp_path / "own.socket")]
        ready = "sbus listening on"
    elif service == "sbus-relay":
        args = ["--bus", bus_a.address, "--socket", str(tmp_path / "relay.socket")]
        ready = "listening"
    else:
        args = ["--bus", bus_a.address, "--out", str(tmp_path / "rec")]
        ready = "subscribed"
    proc = TwistdProcess([service, *args], tmp_path)
    try:
        proc.wait_log(ready)
        if service == "sbus":  # its line comes before the reactor runs: wait for an answer
            from helpers import try_whoami, wait_until
            wait_until(lambda: try_whoami(args[1]) == "served", "a served whoami")
        proc.proc.send_signal(signal.SIGTERM)
        if twice:
            # a second SIGTERM while stopping: no ReactorNotRunning traceback. (Once the
            # reactor has stopped, Twisted restores the default action, so a late one may
            # still end the process by the signal.)
            try:
                proc.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        code = proc.proc.wait(TIMEOUT)
    finally:
        proc.stop()
        if service == "sbus-link":
            assert listener.stop() in (0, None)
    log = proc.log()
    assert code == 0 or (twice and code == -signal.SIGTERM), (code, log)
    assert "Traceback" not in log and "ReactorNotRunning" not in log and "#critical]" not in log, log
    assert "Server Shut Down." in log, log
    if service in ("sbus-bridge", "sbus-link", "sbus-msgbus"):
        assert "stats" in log or "stopped:" in log, log      # the final counters
