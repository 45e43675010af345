"""Issue 23, "relays reconnect fast": a relay whose master's socket reappears tries at once.

Real processes throughout: sbusd masters, ``twistd sbus-relay`` relays, raw
clients. Each relay here has ``--initial-delay 300 --max-delay 600``: once
it has failed a try, its next one by back-off is at least 270 s away (10 %
jitter), while every wait below gives up after 60 s. A relay that only
backs off (the code before) fails each test; one woken by its master's
socket file appearing (inotify on its directory) passes. Nothing sleeps:
each step waits for a log line, a statistic or a delivery, with a timeout.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (uid 65534 cannot import it from the venv after the fork)
import os
import signal
import socket
import sys

import pytest

from helpers import SbusdProcess, connect, msg, recv, run_as, send, sub, sync, wait_until
from test_relay import Relay, procs, queue_of, relay_stats, wait_subs  # noqa: F401  (procs: fixture)

#: The relay's back-off in these tests: the next try after a failure is >= 270 s away.
LONG = ("--initial-delay", "300", "--max-delay", "600")
#: How long a test waits for what a woken relay does at once: far below LONG.
FAST = 60.0


def both_ways(master_address: str, relay: Relay, tag: bytes, via: int | None = None) -> None:
    """A message published on the relay reaches a subscriber on the master, and one published
    on the master reaches a subscriber on the relay (the relay re-subscribed upward). `via`:
    the pid of the master's client the relay is below (the relay itself by default)."""
    key = b"t/" + tag
    with connect(master_address) as up, relay.connect() as low_sub, relay.connect() as low_pub:
        send(up, sub(key))
        sync(up)
        send(low_sub, sub(key))
        sync(low_sub)
        wait_subs(master_address, via or relay.pid, 1)
        send(low_pub, msg(key, b"up " + tag))
        assert recv(up, FAST) == msg(key, b"up " + tag)
        send(up, msg(key, b"down " + tag))
        assert recv(low_sub, FAST) == msg(key, b"up " + tag)   # its own bus's publish, locally
        assert recv(low_sub, FAST) == msg(key, b"down " + tag)


def test_relay_connects_at_once_when_its_master_appears_and_after_each_restart(start_bus, tmp_path, procs):
    path = str(tmp_path / "master.sock")
    relay = Relay(path, str(tmp_path / "r.sock"), tmp_path, *LONG, wait=False)
    procs.append(relay)
    relay.wait_log("cannot connect to the master")  # first try failed: the next is >= 270 s away
    master = start_bus(address=path)
    relay.wait_ready(FAST)
    assert "(inotify)" in relay.log() and "connecting now" in relay.log()
    both_ways(path, relay, b"0")
    # Restarted many times quickly, the hard way: the dead master's socket file stays; each new
    # master moves it aside and binds a new one (the relay must not take the old file for it).
    for n in range(1, 6):
        master.stop(signal.SIGKILL)
        relay.wait_log("lost the master", count=n)
        master = start_bus(address=path)
        wait_until(lambda: relay_stats(relay)["reconnects"] == n, f"reconnection {n}", FAST)
    both_ways(path, relay, b"5")
    st = relay_stats(relay)
    assert st["connected"] and st["watching"] and st["wakeups"] >= 6, st


def test_relay_below_a_restarted_relay_reconnects_at_once(start_bus, tmp_path, procs):
    """A relay of a relay: the middle one is killed and started again with the same command;
    its socket reappears once it serves, which wakes the relay below it."""
    master = start_bus()
    middle_address = str(tmp_path / "middle.sock")
    middle = Relay(master.address, middle_address, tmp_path)
    procs.append(middle)
    low = Relay(middle_address, str(tmp_path / "low.sock"), tmp_path, *LONG)
    procs.append(low)
    both_ways(master.address, low, b"before", via=middle.pid)
    middle.stop(signal.SIGKILL)
    low.wait_log("lost the master")
    middle = Relay(master.address, middle_address, tmp_path)
    procs.append(middle)
    wait_until(lambda: relay_stats(low)["reconnects"] == 1, "the low relay reconnected", FAST)
    both_ways(master.address, low, b"after", via=middle.pid)
    assert relay_stats(low)["wakeups"] >= 1


def test_socket_bound_before_listen_is_retried_at_short_intervals(start_bus, tmp_path, procs):
    """The socket file exists from the new master's bind(), before its listen(): the relay is
    woken, refused, and keeps trying at short intervals, not after its long back-off."""
    master = start_bus()
    path = master.address
    relay = Relay(path, str(tmp_path / "r.sock"), tmp_path, *LONG)
    procs.append(relay)
    master.stop()  # SIGINT: the socket file goes away
    relay.wait_log("lost the master")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        listener.bind(path)  # the file appears; nobody listens yet
        before = relay_stats(relay)["failed_attempts"]
        wait_until(lambda: relay_stats(relay)["failed_attempts"] >= before + 3,
                   "three refused tries after the socket appeared", FAST)
        # sbusd takes the bound socket over (/dev/fd/N) and listens on it.
        fd = listener.fileno()
        new = SbusdProcess(["-f", "-a", f"/dev/fd/{fd}"], tmp_path / "sbusd-fd.log", address=path,
                           pass_fds=(fd,))
        procs.append(new)
    finally:
        listener.close()
    wait_until(lambda: relay_stats(relay)["connected"], "the relay connected to the listening master", FAST)
    both_ways(path, relay, b"late-listen")


def test_master_directory_made_late_and_made_again_is_watched(start_bus, tmp_path, procs):
    """The master's directory does not exist when the relay starts (``/run/sbus/`` made by the
    master's service manager), then is removed and made again: each time the relay watches
    the parent for it, then it, and connects as soon as the master serves there."""
    import shutil

    directory = tmp_path / "run-sbus"
    path = str(directory / "master.sock")
    relay = Relay(path, str(tmp_path / "r.sock"), tmp_path, *LONG, wait=False)
    procs.append(relay)
    relay.wait_log("cannot connect to the master")
    directory.mkdir()
    master = start_bus(address=path)
    relay.wait_ready(FAST)
    both_ways(path, relay, b"first")
    master.stop()
    relay.wait_log("lost the master")
    shutil.rmtree(directory)
    relay.wait_log(f"watching {tmp_path} (inotify) for it", count=2)
    directory.mkdir()
    master = start_bus(address=path)
    wait_until(lambda: relay_stats(relay)["reconnects"] == 1, "reconnection", FAST)
    both_ways(path, relay, b"again")


@pytest.fixture
def attacker_dir():
    """A directory of uid 65534 (which may create and replace names in it), under a fresh
    directory everyone may traverse (tmp_path's parents are 0700)."""
    import shutil
    import tempfile

    top = tempfile.mkdtemp(prefix="sbus-relay-attack-")
    os.chmod(top, 0o755)
    d = os.path.join(top, "user")
    os.mkdir(d, 0o755)
    os.chown(d, 65534, 65534)
    yield d
    shutil.rmtree(top, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as uid 65534")
def test_relay_never_connects_through_a_symlink_another_uid_planted(start_bus, tmp_path, procs, attacker_dir):
    """The master's socket lives in a directory uid 65534 may write (``/run/user/65534``). While
    the master is down, 65534 puts a symlink at its path to a private bus of root's it cannot
    open itself: a root relay that followed it would join that bus and carry its traffic to
    and from the relay's clients. The relay refuses it (and a planted plain file), and connects
    again once a real master serves at the path."""
    private = start_bus(address=str(tmp_path / "private.sock"))  # 0700 in a 0700 directory: root's
    path = os.path.join(attacker_dir, "master.sock")
    master = start_bus(address=path)
    relay = Relay(path, str(tmp_path / "r.sock"), tmp_path, "--initial-delay", "0.05", "--max-delay", "0.2")
    procs.append(relay)
    master.stop()
    relay.wait_log("lost the master")

    def plant(what: str) -> str:
        def act():
            if os.path.lexists(path):
                os.unlink(path)
            if what == "symlink":
                os.symlink(private.address, path)
            elif what == "file":
                with open(path, "w") as f:
                    f.write("not a socket\n")
            return "done"
        return run_as(65534, 65534, act)

    assert plant("symlink") == "done"
    relay.wait_log("a symlink of uid 65534 (neither ours nor root's): refusing to connect through it")
    assert plant("file") == "done"
    relay.wait_log(f"{path}: Connection refused")
    assert plant("symlink") == "done"
    relay.wait_log("refusing to connect through it", count=2)
    assert queue_of(private.address, relay.pid) is None, "the relay joined the private bus"
    assert relay_stats(relay)["connected"] is False
    assert plant("nothing") == "done"
    master = start_bus(address=path)
    wait_until(lambda: relay_stats(relay)["connected"], "the relay connected to the real master", FAST)
    assert queue_of(path, relay.pid) is not None
    assert queue_of(private.address, relay.pid) is None


def test_a_symlink_of_our_own_uid_is_followed(start_bus, tmp_path, procs):
    """A master reached through a symlink of the relay's own uid (or root's) is connected as before."""
    master = start_bus()
    link = str(tmp_path / "master-link.sock")
    os.symlink(master.address, link)
    assert os.lstat(link).st_uid == os.geteuid()
    relay = Relay(link, str(tmp_path / "r.sock"), tmp_path)
    procs.append(relay)
    both_ways(master.address, relay, b"via-link")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
