"""``twistd sbus-relay`` with real processes: a master (sbusd), relays below it, raw clients.

Synchronisation never sleeps: readiness is a whoami answered on the relay's
socket (polled with a timeout); "the subscription has reached the master" is
the master's own statistics showing the relay's connection holding it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers import (  # noqa: F401  (child_env, wait_until: test_link takes them from here)
    SERVICE_TIMEOUT, Agent, LoggedProcess, child_env, connect, msg, recv, send, stats, sub, sync, unsub,
    wait_until, whoami,
)

TIMEOUT = SERVICE_TIMEOUT
WHOAMI = b"CMSG !/cred/whoami"
WHOAMI_REPLY = b"CMSG !/cred/whoami\0"


class Twistd(LoggedProcess):
    """A `python -m twisted PLUGIN ...` process, its output in a log file."""

    def __init__(self, plugin: str, args, tmp_path, name: str | None = None):
        name = name or f"{plugin}-{uuid.uuid4().hex[:6]}"
        super().__init__([sys.executable, "-m", "twisted", "--log-format", "text", plugin, *args],
                         Path(tmp_path) / f"{name}.log", cwd=tmp_path)


class Relay(Twistd):
    def __init__(self, upstream: str, address: str, tmp_path, *extra, wait: bool = True):
        self.address = address
        self.upstream = upstream
        super().__init__("sbus-relay", ["--bus", upstream, "--socket", address, *extra], tmp_path,
                         name=f"relay-{Path(address).stem}")
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = TIMEOUT) -> bytes:
        def answered():
            if self.proc.poll() is not None:
                raise AssertionError(f"relay exited {self.proc.returncode}:\n{self.log()}")
            try:
                with connect(self.address, timeout=2) as s:
                    send(s, WHOAMI)
                    reply = recv(s, 2)
                    return reply[len(WHOAMI_REPLY):] if reply.startswith(WHOAMI_REPLY) else None
            except (FileNotFoundError, ConnectionRefusedError):
                return None

        return wait_until(answered, f"relay serving on {self.address}", timeout)

    def connect(self) -> socket.socket:
        return connect(self.address)


@pytest.fixture
def procs():
    started = []
    yield started
    for p in reversed(started):
        p.stop()


@pytest.fixture
def hierarchy(start_bus, tmp_path, procs):
    """master (sbusd) <- relay1 <- relay2; returns (master, relay1, relay2)."""
    master = start_bus()
    r1 = Relay(master.address, str(tmp_path / "r1.sock"), tmp_path)
    procs.append(r1)
    r2 = Relay(r1.address, str(tmp_path / "r2.sock"), tmp_path)
    procs.append(r2)
    return master, r1, r2


def queue_of(address: str, pid: int) -> dict | None:
    with connect(address) as s:
        st = stats(s)
    for q in st["queues"]:
        if q["pid"] == pid:
            return q
    return None


def wait_subs(address: str, pid: int, n: int):
    """Wait until the bus at `address` shows client `pid` (a relay) holding `n` subscriptions."""
    def ok():
        q = queue_of(address, pid)
        return q is not None and q["subscriptions"] == n
    wait_until(ok, f"client {pid} holding {n} subscriptions on {address}: {queue_of(address, pid)}")


def relay_stats(relay: Relay) -> dict:
    with relay.connect() as s:
        return stats(s)["upstream"]


def drain_until(sock, marker: bytes, timeout: float = TIMEOUT) -> list[bytes]:
    """Receive until a packet equal to `marker`; return what came before it."""
    got = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"marker {marker!r} never came; got {got[:10]!r}")
        try:
            p = recv(sock, left)
        except TimeoutError:
            continue
        assert p, "disconnected"
        if p == marker:
            return got
        got.append(p)


def drain_until_all(sock, markers, timeout: float = TIMEOUT) -> list[bytes]:
    """Receive until every packet of `markers` has come (in any order); return all that came."""
    want = set(markers)
    got = []
    deadline = time.monotonic() + timeout
    while want:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"markers {want!r} never came; got {len(got)}: {got[-5:]!r}")
        try:
            p = recv(sock, left)
        except TimeoutError:
            continue
        assert p, "disconnected"
        want.discard(p)
        got.append(p)
    return got


# ---------------------------------------------------------------- tests


def test_whoami_chain(hierarchy):
    master, r1, r2 = hierarchy
    gid, uid, me = os.getgid(), os.getuid(), os.getpid()
    with connect(master.address) as m, r1.connect() as s1, r2.connect() as s2:
        assert whoami(m) == (gid, uid, me)
        send(s1, WHOAMI)
        assert recv(s1) == WHOAMI_REPLY + b"!/cred/%d/%d/%d/!/cred/%d/%d/%d" % (gid, uid, r1.pid, gid, uid, me)
        send(s2, WHOAMI)
        assert recv(s2) == WHOAMI_REPLY + (b"!/cred/%d/%d/%d/!/cred/%d/%d/%d/!/cred/%d/%d/%d"
                                           % (gid, uid, r1.pid, gid, uid, r2.pid, gid, uid, me))
    up = relay_stats(r2)
    assert up["connected"] and up["whoami"] == "!/cred/%d/%d/%d/!/cred/%d/%d/%d" % (gid, uid, r1.pid, gid, uid, r2.pid)
    assert up["prefix"] == up["whoami"] + "/"


def test_three_levels_exactly_once(hierarchy):
    master, r1, r2 = hierarchy
    buses = [master.address, r1.address, r2.address]
    N = 40
    # At every level: a subscriber to data/, one to everything, two holding the same pattern twice,
    # one to a key nobody publishes; plus a publisher that subscribes to nothing.
    subs_data = [connect(a) for a in buses]
    subs_all = [connect(a) for a in buses]
    subs_twice = [connect(a) for a in buses]
    subs_other = [connect(a) for a in buses]
    pubs = [connect(a) for a in buses]
    try:
        for level in range(3):
            send(subs_data[level], sub("data/"))
            send(subs_all[level], sub(""))
            send(subs_twice[level], sub("data/*/x"), sub("data/"), sub("data/"))
            send(subs_other[level], sub("other/"))
            for s in (subs_data[level], subs_all[level], subs_twice[level], subs_other[level]):
                sync(s)
        # Distinct patterns: data/, "", data/*/x, other/  -> one upward SUB each.
        wait_subs(r1.address, r2.pid, 4)
        wait_subs(master.address, r1.pid, 4)
        assert relay_stats(r2)["subscriptions_up"] == 4

        sent = []
        for i in range(N):
            for level in range(3):
                key = f"data/{level}/x"
                payload = f"{level}:{i}".encode()
                send(pubs[level], msg(key, payload))
                sent.append(msg(key, payload))
        markers = [msg(f"data/marker/{level}", b"end") for level in range(3)]
        for level in range(3):
            send(pubs[level], markers[level])

        for group in (subs_data, subs_all, subs_twice):
            for level, s in enumerate(group):
                # every publisher's marker arrives after its own messages
                got = drain_until_all(s, markers)
                got.extend(sync(s))  # anything else already queued
                data = [p for p in got if p not in markers]
                assert sorted(data) == sorted(sent), (level, len(data), len(sent))
                assert len(set(data)) == len(data), "duplicates"
                for pl in range(3):  # per-publisher order
                    mine = [p for p in data if p.startswith(b"MSG data/%d/" % pl)]
                    assert mine == [p for p in sent if p.startswith(b"MSG data/%d/" % pl)]
        for s in subs_other:
            assert sync(s) == []

        # A final round shows nothing was still in flight (no late duplicate from a loop).
        final = msg("data/final", b"!")
        send(pubs[0], final)
        for group in (subs_data, subs_all, subs_twice):
            for s in group:
                assert drain_until(s, final) == []
        for p in pubs:
            assert sync(p) == []
        st1, st2 = relay_stats(r1), relay_stats(r2)
        assert st2["forwarded_up"] == N + 1 and st1["forwarded_up"] == 2 * (N + 1)
        assert st1["drops"] == {} and st2["drops"] == {}
    finally:
        for s in subs_data + subs_all + subs_twice + subs_other + pubs:
            s.close()


def test_upward_subscription_follows_last_holder(hierarchy):
    master, r1, r2 = hierarchy
    a, b = r2.connect(), r2.connect()
    try:
        send(a, sub("w/"))
        send(b, sub("w/"), sub("w/"))
        sync(a), sync(b)
        wait_subs(r1.address, r2.pid, 1)
        wait_subs(master.address, r1.pid, 1)
        send(b, unsub("w/"), unsub("w/"))
        sync(b)
        assert queue_of(r1.address, r2.pid)["subscriptions"] == 1  # a still holds it
        a.close()
        wait_subs(r1.address, r2.pid, 0)
        wait_subs(master.address, r1.pid, 0)
        with connect(master.address) as m:  # nothing comes down to b any more
            send(m, msg("w/1", b"x"))
        send(b, sub("marker/"))
        wait_subs(master.address, r1.pid, 1)
        with connect(master.address) as m:
            send(m, msg("marker/1", b"m"))
        assert drain_until(b, msg("marker/1", b"m")) == []
    finally:
        a.close()
        b.close()


def test_secret_key_reaches_only_its_owner_anywhere(hierarchy):
    master, r1, r2 = hierarchy
    buses = [master.address, r1.address, r2.address]
    spies = [connect(a) for a in buses]
    pubs = [connect(a) for a in buses]
    owner_low = Agent(r2.address)   # a client at the bottom
    owner_top = Agent(master.address)
    try:
        for s in spies:
            send(s, sub(""))
            sync(s)
        w_low = owner_low.call("whoami")[1]
        w_top = owner_top.call("whoami")[1]
        assert w_low.count(b"!/cred/") == 3
        owner_low.send(sub(w_low + b"/secret/"))
        owner_low.send(sub(b""))  # the owner gets its own secret keys through "" too, once
        owner_top.send(sub(w_top + b"/secret/"))
        assert owner_low.sync() == [] and owner_top.sync() == []
        wait_subs(r1.address, r2.pid, 2)
        wait_subs(master.address, r1.pid, 2)

        expect_low, expect_top = [], []
        for level, p in enumerate(pubs):
            send(p, msg(w_low + b"/secret/%d" % level, b"to low"))
            expect_low.append(msg(w_low + b"/secret/%d" % level, b"to low"))
            send(p, msg(w_top + b"/secret/%d" % level, b"to top"))
            expect_top.append(msg(w_top + b"/secret/%d" % level, b"to top"))
        markers = [msg(f"pub/marker/{level}") for level in range(3)]
        for level, p in enumerate(pubs):
            send(p, markers[level])
        for s in spies:
            got = drain_until_all(s, markers)
            assert [p for p in got if b"!/cred/" in p] == [], got
        got_low = []
        while len([p for p in got_low if b"/secret/" in p]) < 3:
            p = owner_low.recv(TIMEOUT)
            assert p, "owner got nothing"
            got_low.append(p)
        got_top = [owner_top.recv(TIMEOUT) for _ in range(3)]
        assert sorted(p for p in got_low if b"/secret/" in p) == sorted(expect_low)
        assert sorted(got_top) == sorted(expect_top)
        # Exactly once: nothing else secret pending for either owner.
        assert [p for p in owner_low.sync() if b"/secret/" in p] == []
        assert owner_top.sync() == []
        # Nobody was disconnected for the upward secret subscriptions.
        assert relay_stats(r2)["connected"] and relay_stats(r1)["connected"]
    finally:
        owner_low.kill()
        owner_top.kill()
        for s in spies + pubs:
            s.close()


def test_master_restart_during_traffic(start_bus, tmp_path, procs):
    master = start_bus()
    path = master.address
    relay = Relay(path, str(tmp_path / "r.sock"), tmp_path, "--initial-delay", "0.05", "--max-delay", "0.5")
    procs.append(relay)
    s = relay.connect()
    local_pub = relay.connect()
    try:
        send(s, sub("t/"))
        sync(s)
        wait_subs(path, relay.pid, 1)
        with connect(path) as m:
            for i in range(20):
                send(m, msg("t/before", b"%d" % i))
            send(m, msg("t/marker", b"1"))
        assert len(drain_until(s, msg("t/marker", b"1"))) == 20

        master.stop()  # SIGINT: the socket file goes away
        relay.wait_log("lost the master")
        # Still serving locally; local publishes while the master is away are counted as drops upward.
        for i in range(5):
            send(local_pub, msg("t/local", b"%d" % i))
        assert [recv(s) for _ in range(5)] == [msg("t/local", b"%d" % i) for i in range(5)]
        wait_until(lambda: relay_stats(relay)["drops"].get("master_down") == 5, "5 drops counted")
        assert relay_stats(relay)["connected"] is False

        master2 = start_bus(address=path)
        wait_until(lambda: relay_stats(relay)["reconnects"] == 1, "reconnection")
        wait_subs(path, relay.pid, 1)  # re-subscribed, nobody on the relay did anything
        with connect(path) as m:
            send(m, msg("t/after", b"again"))
            send(m, msg("t/marker", b"2"))
            # and upward still works after the reconnection
            send(m, sub("t/"))
            sync(m)
            wait_subs(path, relay.pid, 1)
            send(local_pub, msg("t/up", b"from below"))
            assert recv(m) == msg("t/up", b"from below")
        # From two publishers (the master, a local client): no order between them, each once.
        got = sorted(recv(s) for _ in range(3))
        assert got == sorted([msg("t/after", b"again"), msg("t/marker", b"2"), msg("t/up", b"from below")])
        assert sync(s) == []
        st = relay_stats(relay)
        assert st["connected"] and st["reconnects"] == 1 and st["disconnects"] == 1
        assert "reconnected to the master" in relay.log()
        master2.stop()
    finally:
        s.close()
        local_pub.close()


def test_relay_waits_for_master_before_serving(start_bus, tmp_path, procs):
    path = str(tmp_path / "late-master.sock")
    relay = Relay(path, str(tmp_path / "r.sock"), tmp_path, "--initial-delay", "0.05", "--max-delay", "0.2",
                  wait=False)
    procs.append(relay)
    relay.wait_log("cannot connect to the master")
    assert not os.path.exists(relay.address)  # nothing served without a prefix
    master = start_bus(address=path)
    w = relay.wait_ready()
    assert w == b"!/cred/%d/%d/%d/!/cred/%d/%d/%d" % (os.getgid(), os.getuid(), relay.pid,
                                                        os.getgid(), os.getuid(), os.getpid())
    master.stop()


def test_relay_options(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "twisted", "sbus-relay", *args], capture_output=True,
                              timeout=TIMEOUT, cwd=tmp_path, env=child_env(), stdin=subprocess.DEVNULL)

    r = run("--socket", "x.sock")
    assert r.returncode != 0 and b"--bus" in r.stderr + r.stdout
    r = run("--bus", "m.sock", "--cred-prefix", "!/cred/1/2/3/")
    assert r.returncode == 2 and b"cred-prefix" in r.stderr, r.stderr  # a relay has no such option
    (tmp_path / "exists.sock").write_text("")
    r = run("--bus", "m.sock", "--socket", "exists.sock")
    assert r.returncode != 0 and b"exists" in r.stderr + r.stdout
    r = run("--help")
    out = r.stdout.decode()
    for opt in ("--bus", "--socket", "--mode", "--user", "--max-packet", "--queue-bytes",
                "--queue-packets", "--reuse", "--initial-delay", "--max-delay"):
        assert opt in out, opt
    assert "--cred-prefix" not in out  # it takes its prefix from its whoami on the master


def test_middle_relay_restart_renames_clients_below(hierarchy, tmp_path, procs):
    """Issue 11 item 3: the middle relay restarts with a new pid, so every name below it changes.

    Old clients of the relays below are told their new name (``CMSG relay/whoami``) and
    answered it by whoami; their secret subscriptions move with it; new clients get the new
    name; secret messages sent from the master to the new names arrive, two levels down too."""
    master, r1, r2 = hierarchy
    r3 = Relay(r2.address, str(tmp_path / "r3.sock"), tmp_path)
    procs.append(r3)
    old2, old3 = Agent(r2.address), Agent(r3.address)
    try:
        w2_old, w3_old = old2.call("whoami")[1], old3.call("whoami")[1]
        old2.send(sub(w2_old + b"/s/"))
        old3.send(sub(w3_old + b"/s/"))
        old2.sync()
        old3.sync()
        wait_subs(master.address, r1.pid, 2)
        r1.stop()
        r2.wait_log("lost the master")
        r1b = Relay(master.address, r1.address, tmp_path)
        procs.append(r1b)
        wait_until(lambda: relay_stats(r2)["reconnects"] == 1, "the bottom relay reconnected")
        wait_until(lambda: relay_stats(r3)["renamed"] == 1, "the lowest relay renamed")
        wait_subs(master.address, r1b.pid, 2)
        st2, st3 = relay_stats(r2), relay_stats(r3)
        assert st2["prefix"] == st2["whoami"] + "/" and st3["prefix"] == st3["whoami"] + "/"
        assert st3["whoami"].startswith(st2["prefix"])
        w2_new = st2["prefix"].encode() + w2_old[w2_old.rindex(b"!/cred/"):]   # own link, new chain
        w3_new = st3["prefix"].encode() + w3_old[w3_old.rindex(b"!/cred/"):]
        assert w2_new != w2_old and w3_new != w3_old
        # told, and whoami says so
        assert old2.recv(TIMEOUT) == b"CMSG relay/whoami\0" + w2_new
        assert old3.recv(TIMEOUT) == b"CMSG relay/whoami\0" + w3_new
        assert old2.call("whoami")[1] == w2_new and old3.call("whoami")[1] == w3_new
        # new clients get the new chain
        new2, new3 = Agent(r2.address), Agent(r3.address)
        try:
            n2, n3 = new2.call("whoami")[1], new3.call("whoami")[1]
            assert n2.startswith(st2["prefix"].encode()) and n3.startswith(st3["prefix"].encode())
            new2.send(sub(n2 + b"/s/"))
            new3.send(sub(n3 + b"/s/"))
            new2.sync()
            new3.sync()
            wait_subs(master.address, r1b.pid, 4)
            with connect(master.address) as m:
                for w in (w2_new, w3_new, n2, n3):
                    send(m, msg(w + b"/s/1", b"to " + w))
            assert old2.recv(TIMEOUT) == msg(w2_new + b"/s/1", b"to " + w2_new)
            assert old3.recv(TIMEOUT) == msg(w3_new + b"/s/1", b"to " + w3_new)
            assert new2.recv(TIMEOUT) == msg(n2 + b"/s/1", b"to " + n2)
            assert new3.recv(TIMEOUT) == msg(n3 + b"/s/1", b"to " + n3)
        finally:
            new2.kill()
            new3.kill()
    finally:
        old2.kill()
        old3.kill()


def test_local_clients_cannot_get_the_relay_cut_off_from_its_master(start_twistd_bus, tmp_path, procs):
    """Issue 16 item 8: the master allows the relay (one client there) 200 patterns. A local
    client that asks for more than its uid's share is refused with a reason; the relay stays
    connected, and its other clients keep getting messages from the master."""
    master = start_twistd_bus("--max-subscriptions", "200")
    r = Relay(master.address, str(tmp_path / "q.sock"), tmp_path)
    procs.append(r)
    wait_until(lambda: relay_stats(r)["master_limits"], "the relay learned the master's limits")
    quiet = connect(r.address)
    send(quiet, sub(b"keep/"))
    sync(quiet)
    greedy = connect(r.address)
    try:
        for i in range(250):
            send(greedy, sub(b"greedy/%d/" % i))
    except (BrokenPipeError, ConnectionResetError):
        pass
    from helpers import wait_closed
    wait_closed(greedy)
    assert "over this relay's quota on its master" in r.wait_log("over this relay's quota")
    st = relay_stats(r)
    assert st["connected"] and st["disconnects"] == 0 and st["reconnects"] == 0, st
    assert st["quota_refusals"] == 1 and st["held_up_patterns"] == 1, st   # keep/ only
    with connect(master.address) as m:
        send(m, msg(b"keep/1", b"still here"))
    assert recv(quiet, TIMEOUT) == msg(b"keep/1", b"still here")
    quiet.close()
    greedy.close()
