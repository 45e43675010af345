"""`twistd sbus-bridge`: real buses (`sbusd -f`), a real bridge process, raw clients.

Synchronisation never sleeps: the bridge is ready once it logged both sides
ready (polled with a timeout); messages are awaited with receive timeouts;
markers sent through the bridge after the traffic prove, by the bridge's
per-connection ordering, that no looped copy is still on its way.

`TwistdProcess` is shared with the other service tests (test_msgbus,
test_contrib).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import LoggedProcess, child_env, connect, msg, recv, send, sub, sync

TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile="]
TIMEOUT = 10.0


class TwistdProcess(LoggedProcess):
    """`twistd -n PLUGIN ARGS...` in the background, its output in a log file."""

    stop_signal = signal.SIGTERM

    def __init__(self, args, tmp_path, argv=None):
        log = Path(tmp_path) / f"{args[0] if args else 'svc'}-{time.monotonic_ns()}.log"
        super().__init__(argv or [*TWISTD, *args], log, cwd=tmp_path)

    def wait_log(self, pattern: str, count: int = 1, timeout: float = TIMEOUT) -> str:
        """Wait until regex `pattern` matched `count` times in the log; return the log."""
        return super().wait_log(re.compile(pattern), timeout, count)


@pytest.fixture
def twistd(tmp_path):
    procs = []

    def start(*args):
        p = TwistdProcess(list(args), tmp_path)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def start_bridge(twistd, a, b, *rules, extra=()):
    args = ["sbus-bridge", "--bus-a", a, "--bus-b", b, "--max-delay", "0.5", *extra]
    for r in rules:
        args += ["--rule", r]
    bridge = twistd(*args)
    bridge.wait_log(r"side a: connected .*; ready")
    bridge.wait_log(r"side b: connected .*; ready")
    if "--no-spanning-tree" not in extra:
        bridge.wait_log(r"spanning tree: .*: forwarding between a and b")
    return bridge


def recv_until(sock, last: bytes, timeout: float = 5.0) -> list[bytes]:
    """Packets until (and including) `last`; then everything already queued (a sync)."""
    got = []
    deadline = time.monotonic() + timeout
    while True:
        p = recv(sock, max(0.01, deadline - time.monotonic()))
        assert p, f"disconnected; had {got!r}"
        if p.startswith(b"MSG sbus/topology/"):
            continue  # the bridges' spanning-tree hellos
        got.append(p)
        if p == last:
            break
    return got + [p for p in sync(sock) if not p.startswith(b"MSG sbus/topology/")]


def stats_line(bridge) -> str:
    text = bridge.log()
    lines = [l for l in text.splitlines() if "] stopped: forwarded" in l]
    assert lines, text
    return lines[-1]


# ---------------------------------------------------------------- rules


def test_rule_syntax():
    from sbus.services.bridge import Rule, RuleError, parse_rule

    assert parse_rule("sensors/ a>b") == Rule(b"sensors/", "a>b")
    assert parse_rule("'' both alice/ bob/") == Rule(b"", "both", b"alice/", b"bob/")
    r = parse_rule('sensors/ both "" site1/')
    assert list(r.routes()) == [("a", b"sensors/", b"", b"site1/"),
                                ("b", b"site1/sensors/", b"site1/", b"")]
    assert list(parse_rule("x/ b>a p/ q/").routes()) == [("b", b"q/x/", b"q/", b"p/")]
    for bad in ("x/", "x/ sideways", "x/ a>b onlyone", "x/ a>b a* b/", "'x a>b"):
        with pytest.raises(RuleError):
            parse_rule(bad)


def test_usage_errors_are_one_line(tmp_path):
    cfg = tmp_path / "bridge.conf"
    cfg.write_text("a A.socket\nb B.socket\nrule x/ diagonal\n")
    for args, needle in ((["--bus-a", "x", "--rule", "p a>b"], "--bus-b ADDRESS is required"),
                         (["--bus-a", "x", "--bus-b", "y"], "at least one --rule"),
                         (["--bus-a", "x", "--bus-b", "y", "--rule", "p up"], "direction must be"),
                         (["--config", str(cfg)], "bridge.conf:3")):
        res = subprocess.run([*TWISTD, "sbus-bridge", *args], capture_output=True, timeout=TIMEOUT,
                             cwd=tmp_path, env=child_env())
        assert res.returncode != 0
        assert needle in res.stderr.decode() + res.stdout.decode(), (args, res)


# ---------------------------------------------------------------- real processes


def test_both_directions_with_rewrite_and_no_loop(start_bus, twistd):
    bus_a, bus_b = start_bus(), start_bus()
    # A's sensors/... is B's site1/sensors/...: what the bridge publishes on B
    # matches its own B-side subscription, and back: a loop if echo were on.
    bridge = start_bridge(twistd, bus_a.address, bus_b.address, "sensors/ both '' site1/")
    sa, sb = connect(bus_a.address), connect(bus_b.address)
    pa, pb = connect(bus_a.address), connect(bus_b.address)
    send(sa, sub(b""))
    send(sb, sub(b""))
    sync(sa)
    sync(sb)

    send(pa, msg(b"sensors/t", b"1"))                         # A -> B, rewritten
    assert recv_until(sb, msg(b"site1/sensors/t", b"1")) == [msg(b"site1/sensors/t", b"1")]
    send(pb, msg(b"site1/sensors/u", b"2"))                   # B -> A, rewritten back
    send(pb, msg(b"elsewhere/v", b"3"))                       # not bridged
    got_a = recv_until(sa, msg(b"sensors/u", b"2"))
    # markers through the bridge, each way: a looped copy would come before them
    send(pa, msg(b"sensors/zmarker"))
    send(pb, msg(b"site1/sensors/ymarker"))
    got_a += recv_until(sa, msg(b"sensors/ymarker"))
    got_b = recv_until(sb, msg(b"site1/sensors/zmarker"))

    assert got_a.count(msg(b"sensors/t", b"1")) == 1          # pa's own, never looped back
    assert got_a.count(msg(b"sensors/u", b"2")) == 1
    assert not any(p.startswith(b"MSG elsewhere/") or p.startswith(b"MSG site1/") for p in got_a)
    assert got_b.count(msg(b"site1/sensors/u", b"2")) == 1    # pb's own, never looped back
    assert got_b.count(msg(b"site1/sensors/t", b"1")) == 0    # seen once, before
    assert got_b.count(msg(b"elsewhere/v", b"3")) == 1
    assert not any(p.startswith(b"MSG sensors/") for p in got_b)

    assert bridge.stop() in (0, -signal.SIGTERM)
    line = stats_line(bridge)
    assert "forwarded a>b=2 b>a=2" in line, line
    assert "echoes suppressed=0" in line and "drops a>b=0 b>a=0" in line, line
    for s in (sa, sb, pa, pb):
        s.close()


def test_secret_keys_cross_only_when_named(start_bus, twistd):
    bus_a, bus_b = start_bus(), start_bus()
    bridge = start_bridge(twistd, bus_a.address, bus_b.address,
                          "'' a>b", "'' a>b !/cred//// to-bridge/")
    # the bridge's own secret key on A: its whoami there (as root, that of the helper process
    # that connected as the side's user, see sbus/services/safeconnect.py)
    who = re.search(r"side a: connected to .* as (!/cred/\d+/\d+/\d+); ", bridge.log()).group(1)
    secret = who.encode() + b"/hello"
    sb, pa = connect(bus_b.address), connect(bus_a.address)
    send(sb, sub(b""))
    sync(sb)
    send(pa, msg(secret, b"private"))
    send(pa, msg(b"plain/marker"))
    got = recv_until(sb, msg(b"plain/marker"))
    # the '' rule does not carry it; the rule naming !/cred/ does, rewritten
    assert got == [msg(b"to-bridge/hello", b"private"), msg(b"plain/marker")], got
    bridge.stop()
    assert "forwarded a>b=2" in stats_line(bridge)
    assert "secret filtered=0" in stats_line(bridge)  # one rule took it


def test_side_restart_and_traffic_resumes(start_bus, twistd):
    bus_a, bus_b = start_bus(), start_bus()
    bridge = start_bridge(twistd, bus_a.address, bus_b.address, "jobs/ a>b", "done/ b>a")
    pa = connect(bus_a.address)

    def round_trip(tag: bytes):
        sb = connect(bus_b.address)
        send(sb, sub(b"jobs/"))
        sync(sb)
        send(pa, msg(b"jobs/" + tag, tag))
        assert recv_until(sb, msg(b"jobs/" + tag, tag)) == [msg(b"jobs/" + tag, tag)]
        sa = connect(bus_a.address)
        send(sa, sub(b"done/"))
        sync(sa)
        send(sb, msg(b"done/" + tag, tag))
        assert recv_until(sa, msg(b"done/" + tag, tag)) == [msg(b"done/" + tag, tag)]
        sa.close()
        sb.close()

    round_trip(b"1")
    address = bus_b.address
    bus_b.stop()
    bridge.wait_log(r"side b: lost the connection")
    send(pa, msg(b"jobs/lost", b"x"))  # B is down: dropped and counted
    bus_b = start_bus(address=address)
    bridge.wait_log(r"side b: reconnected \(reconnect 1\) .*; ready")
    bridge.wait_log(r"spanning tree: .*: forwarding between a and b", count=2)
    round_trip(b"2")  # subscriptions were re-made on the new B, both ways
    bridge.stop()
    line = stats_line(bridge)
    assert "forwarded a>b=2 b>a=2" in line, line
    assert "reconnects a=0 b=1" in line, line
    assert "drops a>b=1 b>a=0" in line, line
    pa.close()


def test_config_file(start_bus, twistd, tmp_path):
    bus_a, bus_b = start_bus(), start_bus()
    cfg = tmp_path / "bridge.conf"
    cfg.write_text(f"# example\na {bus_a.address}\nb {bus_b.address}\n\nrule '' both left/ right/\n")
    bridge = twistd("sbus-bridge", "--config", str(cfg))
    bridge.wait_log(r"side a: connected .*; ready")
    bridge.wait_log(r"side b: connected .*; ready")
    bridge.wait_log(r"spanning tree: .*: forwarding between a and b")
    sb, pa = connect(bus_b.address), connect(bus_a.address)
    send(sb, sub(b"right/"))
    sync(sb)
    send(pa, msg(b"left/x/y", b"z"))
    assert recv_until(sb, msg(b"right/x/y", b"z")) == [msg(b"right/x/y", b"z")]


# ---------------------------------------------------------------- attacks (issue 16 item 2)

NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="the bridge's privilege drop needs root")
def test_root_bridge_never_follows_a_users_symlink_into_another_bus(start_bus, twistd):
    import shutil
    import tempfile

    from helpers import run_as, stats

    victim = start_bus()                    # a private bus (0700, in a directory only root reaches)
    side_a = start_bus()
    d = tempfile.mkdtemp(prefix="sbus-user-")
    try:
        os.chown(d, NOBODY, NOBODY)
        os.chmod(d, 0o755)
        planted = os.path.join(d, "sbus.socket")
        # the user of that directory points their socket path at the victim's bus
        assert run_as(NOBODY, NOBODY, lambda: os.symlink(victim.address, planted) or "ok") == "ok"
        bridge = twistd("sbus-bridge", "--bus-a", side_a.address, "--bus-b", planted, "--max-delay", "0.2",
                        "--rule", "'' both")
        bridge.wait_log(r"side a: connected .*; ready")
        bridge.wait_log(r"side b: cannot connect to .*(Permission denied|symlink).*connecting as uid 65534")
        with victim.connect() as v:
            assert stats(v)["clients"] == 1, stats(v)      # only this one: the bridge never got in
        assert "side b: connected" not in bridge.log()

        # a bus the directory's user may open: the bridge is there as that user, not as root
        os.unlink(planted) if os.path.lexists(planted) else None
        shared = start_bus("-g", "-o", address=planted)
        bridge.wait_log(r"side b: connected as uid 65534 \(owner of " + re.escape(d) + r"\)")
        text = bridge.wait_log(r"side b: (re)?connected .* as !/cred/\d+/65534/\d+; .*ready")
        assert re.search(r"side a: connected .* as !/cred/0/0/\d+;", text)   # A is root's own
        bridge.wait_log(r"spanning tree: .*: forwarding between a and b")
        with connect(shared.address) as sb, connect(side_a.address) as pa:
            send(sb, sub(b""))
            sync(sb)
            send(pa, msg(b"x/1", b"across"))
            assert recv_until(sb, msg(b"x/1", b"across")) == [msg(b"x/1", b"across")]
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_recent_packets_forget_what_is_older_than_max_age():
    """A bridge's filter of late copies after a takeover (`held_copies`) must end: a copy that
    never came would otherwise take an identical message a client publishes much later."""
    from sbus.services.bridge import RecentPackets

    now = [0.0]
    recent = RecentPackets(max_items=10, max_age=30.0, clock=lambda: now[0])
    recent.add(b"MSG status\0ok")
    recent.add(b"MSG status\0ok")
    assert recent.take(b"MSG status\0ok")
    now[0] = 31.0
    assert not recent.take(b"MSG status\0ok")
    assert not recent


def test_recent_packets_a_copy_taken_does_not_shorten_a_newer_identical_copys_life():
    """A copy taken is gone: when its time runs out later, a newer identical copy (added after
    the take) keeps its own full `max_age`, and the oldest entry to fall out at `max_items`
    likewise costs no live copy. (The filter forgot the newer copy early: its echo then crossed
    back as a new message.)"""
    from sbus.services.bridge import RecentPackets

    now = [0.0]
    p = b"MSG status\0ok"
    recent = RecentPackets(max_items=10, max_age=30.0, clock=lambda: now[0])
    recent.add(p)
    now[0] = 1.0
    assert recent.take(p)           # the copy of t=0 came back
    now[0] = 2.0
    recent.add(p)                   # a new identical copy at t=2, live until t=32
    now[0] = 31.0                   # the t=0 entry's age runs out
    assert recent.take(p)           # the t=2 copy is still known
    assert not recent.take(p)

    recent = RecentPackets(max_items=2, max_age=30.0, clock=lambda: now[0])
    recent.add(p)
    assert recent.take(p)
    recent.add(p)
    recent.add(b"MSG other\0x")    # at max_items: the taken entry falls out, not the live copy
    assert recent.take(p)
    assert not recent.take(p)
