"""One spelling per idea across every command (issue 34, sbus.respell): read from each
command's own ``--help``, and the old spellings still parse, with one warning line."""

import re
import subprocess
import sys

import pytest

from tests.helpers import REPO, child_env

TWISTD = [sys.executable, "-m", "twisted"]
#: command -> argv of its --help
COMMANDS = {
    "twistd sbus": [*TWISTD, "sbus", "--help"],
    **{f"twistd {name}": [*TWISTD, name, "--help"]
       for name in ("sbus-relay", "sbus-bridge", "sbus-link", "sbus-nats", "sbus-msgbus", "sbus-record",
                    "sbus-queue")},
    "sbus": [sys.executable, "-m", "sbus.cli", "--help"],
    "sbus pub": [sys.executable, "-m", "sbus.cli", "pub", "--help"],
    "sbus-replay": [sys.executable, "-m", "sbus.pipeline.replay", "--help"],
}
#: Servers listen on --socket; everything else connects to --bus.
SERVERS = {"twistd sbus", "twistd sbus-relay"}
#: old spellings that no --help may show (the idea's one spelling is beside each)
OLD = {"--upstream": "--bus", "--a": "--bus-a", "--b": "--bus-b", "--allow-plain-tcp": "--allow-plain",
       "--report-interval": "--stats-interval", "--reconnect-wait": "--initial-delay"}


@pytest.fixture(scope="module")
def helps():
    procs = {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                                    env=child_env()) for name, argv in COMMANDS.items()}
    out = {}
    for name, p in procs.items():
        text = p.communicate(timeout=120)[0].decode()
        assert p.returncode == 0, f"{name} --help: {text[-300:]}"
        out[name] = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", text))
    return out


def test_no_help_shows_an_old_spelling(helps):
    for name, options in helps.items():
        assert not options & set(OLD), f"{name}: {sorted(options & set(OLD))}"


def test_every_client_names_its_bus_bus_and_only_servers_listen_on_socket(helps):
    for name, options in helps.items():
        if name in SERVERS:
            assert "--socket" in options, name
        else:
            assert "--socket" not in options, name
        if name != "twistd sbus":
            assert {"--bus"} <= options or {"--bus-a", "--bus-b"} <= options, name


@pytest.mark.parametrize("argv, new", [
    (["sbus-relay", "--upstream", "/nonexistent/m.socket", "--socket", "/nonexistent/r.socket"], "--bus"),
    (["sbus-bridge", "--a", "/nonexistent/a", "--b", "/nonexistent/a", "--rule", "'' both"], "--bus-a"),
    (["sbus-record", "--out", "/nonexistent/d", "--report-interval", "-1"], "--stats-interval"),
    (["sbus-nats", "--reconnect-wait", "-1", "--server", "nats://127.0.0.1:1"], "--initial-delay"),
    (["sbus-link", "--allow-plain-tcp", "--bus", "/nonexistent/x", "--listen", "tcp:host=192.0.2.1:port=1:x"],
     "--allow-plain"),
])
def test_an_old_spelling_still_parses_with_one_warning_line(argv, new):
    """Each is then refused for its value, in the new spelling's name: proof it was parsed as it."""
    res = subprocess.run([*TWISTD, *argv], capture_output=True, cwd=REPO, env=child_env(), timeout=120)
    err = res.stderr.decode() + res.stdout.decode()
    old = next(a for a in argv if a in OLD)
    assert res.returncode != 0 and "Traceback" not in err, err[-500:]
    assert err.count(f"{old} is an old spelling, deprecated: use {new}") == 1, err[-500:]


def test_the_sbus_command_takes_its_old_socket_option_with_a_warning(tmp_path):
    missing = str(tmp_path / "none.socket")
    for argv in (["-s", missing, "whoami"], ["whoami", "--socket", missing], ["whoami", f"-s{missing}"]):
        res = subprocess.run([sys.executable, "-m", "sbus.cli", *argv], capture_output=True, cwd=REPO,
                             env=child_env(), timeout=60)
        err = res.stderr.decode().splitlines()
        assert res.returncode == 1 and len(err) == 2, err
        assert "is an old spelling, deprecated: use" in err[0] and f"{missing}: no such socket" in err[1], err
