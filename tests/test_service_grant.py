"""Issue 33 items 4 and 8, through real processes: sbus-nats takes no secret from its command
line (``--token-file``, ``--password-file``), and a service of another uid than the bus's
sees every uid's ``server/interest`` only by the bus owner's grant (``--service-uid``).

The split of uids the shipped systemd units had (two DynamicUser= units: the bus and
sbus-nats as two uids) is emulated with real processes dropped to uids of their own (as
tests/run_as_user.py does): the bus as uid 61001 (socket 0777), a subscriber of the test's
own uid (root), and three sbus-nats against a real nats-server that wants a token:

* uid 61001, the bus's own (what the units do now: one ``User=`` for both): follows interest;
* uid 61002, granted by the bus (``--service-uid 61002``): follows interest;
* uid 61003, not granted: sees only its own patterns, says so in one line, subscribes to
  nothing on NATS (what the shipped units did silently).
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from helpers import LoggedProcess, connect, recv, send, sub, sync, wait_until

nats = pytest.importorskip("nats", reason="needs nats-py: pip install 'sbus[nats]'")

from test_nats import NATS_SERVER, TWISTD, free_ports  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUS_UID, GRANTED, UNGRANTED = 61001, 61002, 61003
TIMEOUT = 30.0
#: run_as_user.py, with what sbus-nats imports lazily imported while still root (the
#: interpreter's standard library may be unreadable to the uid it drops to).
AS_USER = [sys.executable, "-c",
           "import runpy, sys, nats, nats.aio.client, nats.js, asyncio, ssl, json, "
           "resource, twisted.internet.asyncioreactor, sbus.services.nats, sbus.services.svcstats, "
           "sbus.server.service, sbus.server.broker, sbus.reactor, sbus.server.tap, sbus.server.address\n"
           f"runpy.run_path({os.path.join(REPO, 'tests', 'run_as_user.py')!r}, run_name='__main__')"]


def run_nats_cli(*args, timeout=60):
    return subprocess.run([*TWISTD, "sbus-nats", *args], capture_output=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=REPO)


# ---------------------------------------------------------------- item 4: no secret on a command line


@pytest.mark.parametrize("args, needle", [
    (["--token", "s3cret"], "--token-file"),
    (["--user", "u", "--password", "s3cret"], "--password-file"),
    (["--server", "nats://s3cret@127.0.0.1:4222"], "--token-file"),
    (["--server", "nats://u:s3cret@127.0.0.1:4222"], "--password-file"),
])
def test_an_inline_secret_is_refused_naming_the_file_option(args, needle):
    server = [] if any(a.startswith("nats://") for a in args) else ["--server", "nats://127.0.0.1:4222"]
    r = run_nats_cli(*server, *args, "--export", "a/")
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1, err
    assert needle in err and "/proc/PID/cmdline" in err and "s3cret" not in err, err


def test_a_secret_file_others_may_read_or_that_is_missing_is_one_line(tmp_path):
    f = tmp_path / "token"
    f.write_text("s3cret\n")
    f.chmod(0o644)
    for args, needle in ((["--token-file", str(f)], "mode 0644"),
                         (["--token-file", str(tmp_path / "none")], "No such file"),
                         (["--user", "u", "--password-file", str(f)], "--password-file")):
        r = run_nats_cli("--server", "nats://127.0.0.1:4222", *args, "--export", "a/")
        err = r.stderr.decode().strip()
        assert r.returncode == 2 and len(err.splitlines()) == 1 and needle in err, err
        assert "s3cret" not in err and "Traceback" not in err, err


def test_the_shipped_units_run_the_bus_and_sbus_nats_as_one_user():
    """The units: DynamicUser= alone gave the two services two uids; a shared User= (or the
    bus unit granting the service's uid) is what lets sbus-nats follow every uid's interest.
    Their secrets come as systemd credentials, never on the command line."""
    units = {}
    for name in ("sbus.service", "sbus-nats@.service"):
        p = configparser.ConfigParser(strict=False, interpolation=None)
        p.read(os.path.join(REPO, "contrib", "systemd", "system", name))
        units[name] = p["Service"]
    bus, svc = units["sbus.service"], units["sbus-nats@.service"]
    grant = re.search(r"--service-uid[ =](\S+)", bus.get("ExecStart", ""))
    assert (bus.get("User") and bus.get("User") == svc.get("User")) or \
        (grant and grant.group(1) == svc.get("User")), (dict(bus), dict(svc))
    text = open(os.path.join(REPO, "contrib", "systemd", "system", "sbus-nats@.service")).read()
    assert not re.search(r"--(token|password)[ =]", text), "a secret on the command line"


# ---------------------------------------------------------------- item 8: the grant, split uids


@pytest.fixture(scope="module")
def split():
    d = tempfile.mkdtemp(prefix="sbus-grant-")
    os.chmod(d, 0o755)
    procs = []
    try:
        port, mport = free_ports(2)
        token = os.urandom(12).hex()
        node = LoggedProcess([NATS_SERVER, "-a", "127.0.0.1", "-p", str(port), "-m", str(mport),
                              "--auth", token], os.path.join(d, "nats.log"))
        procs.append(node)
        own = os.path.join(d, "bus")       # the bus's directory, its uid's
        os.mkdir(own, 0o755)
        os.chown(own, BUS_UID, BUS_UID)
        address = os.path.join(own, "bus.socket")
        bus = LoggedProcess([*AS_USER, str(BUS_UID), "-n", "--pidfile=", "sbus", "--socket", address,
                             "--mode", "0777", "--service-uid", str(GRANTED)],
                            os.path.join(d, "bus.log"), cwd=d)
        procs.append(bus)
        node.wait_log("Server is ready")
        wait_until(lambda: bus.alive_or_raise() and os.path.exists(address), "the bus of uid 61001")
        services = {}
        for uid, pattern in ((BUS_UID, "own/"), (GRANTED, "granted/"), (UNGRANTED, "ungranted/")):
            tok = os.path.join(d, f"token-{uid}")
            with open(tok, "w") as f:
                f.write(token + "\n")
            os.chown(tok, uid, uid)
            os.chmod(tok, 0o600)
            p = LoggedProcess([*AS_USER, str(uid), "-n", "--pidfile=", "sbus-nats", "--bus", address,
                               "--server", f"nats://127.0.0.1:{port}", "--token-file", tok,
                               "--import", pattern, "--stats-interval", "1", "--name", f"grant-{uid}"],
                              os.path.join(d, f"nats-{uid}.log"), cwd=d)
            procs.append(p)
            services[uid] = p
        for p in services.values():
            p.wait_log(re.compile(r"NATS: connected to .*; ready"), TIMEOUT)
            p.wait_log(re.compile(r"bus: connected to "), TIMEOUT)
        yield {"address": address, "url": f"nats://127.0.0.1:{port}", "token": token,
               "monitor": f"http://127.0.0.1:{mport}", "services": services}
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(d, ignore_errors=True)


def _nats_subjects(monitor: str, pid: int) -> set:
    import json
    import urllib.request
    with urllib.request.urlopen(monitor + "/connz?subs=1", timeout=5) as r:
        conns = json.load(r).get("connections") or []
    return {s for c in conns if f" pid={pid} " in (c.get("name") or "")
            for s in (c.get("subscriptions_list") or ())}


def _publish_until_received(split, subject: str, sock: socket.socket, key: bytes) -> None:
    """Publish on NATS until the bus subscriber has the message (interest spreads to NATS
    asynchronously: an event waited for, not a sleep)."""
    import asyncio

    async def main():
        nc = await nats.connect(split["url"], token=split["token"])
        try:
            deadline = asyncio.get_running_loop().time() + TIMEOUT
            while True:
                await nc.publish(subject, b"payroll")
                await nc.flush()
                try:
                    p = recv(sock, 0.2)
                except (TimeoutError, socket.timeout):
                    p = b""
                if p.startswith(b"MSG " + key + b"\0"):
                    return
                if asyncio.get_running_loop().time() > deadline:
                    raise AssertionError(f"{key!r} never reached the bus subscriber")
        finally:
            await nc.close()

    asyncio.run(main())


@pytest.mark.parametrize("uid, pattern", [(BUS_UID, "own"), (GRANTED, "granted")])
def test_a_service_of_the_bus_uid_or_granted_imports_for_another_uid(split, uid, pattern):
    s = connect(split["address"])
    try:
        send(s, sub(f"{pattern}/".encode()))
        sync(s)
        _publish_until_received(split, f"sbus.{pattern}.x", s, f"{pattern}/x".encode())
    finally:
        s.close()
    # the granted service sees every uid's interest: no line says it sees only its own
    assert "neither root nor the bus's own uid" not in split["services"][uid].log()


def test_a_service_not_granted_says_so_and_follows_nothing_of_others(split):
    svc = split["services"][UNGRANTED]
    text = svc.wait_log(f"uid {UNGRANTED} is neither root nor the bus's own uid")
    assert text.count("is neither root nor the bus's own uid") == 1
    s = connect(split["address"])
    try:
        send(s, sub(b"ungranted/"))
        sync(s)
        # the granted one's import arrives: the feed has told every watcher that can see it ...
        send(s, sub(b"granted/"))
        sync(s)
        _publish_until_received(split, "sbus.granted.y", s, b"granted/y")
        # ... and the ungranted service holds nothing on NATS for our pattern
        subjects = _nats_subjects(split["monitor"], svc.pid)
        assert not any("ungranted" in x for x in subjects), subjects
    finally:
        s.close()
