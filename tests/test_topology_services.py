"""Loop-safe topologies with real processes: buses (sbusd), relays and bridges (twistd).

Each topology below has a cycle; every subscriber must still get each
message exactly once, and when the active path dies a standby path must carry
traffic again within 5 s. "Exactly once" is checked by collecting until every
message arrived, then reading on for a grace period in which any duplicate
from a longer path (or a loop storm) would show up.
"""

from __future__ import annotations

import re
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers import SERVICE_TIMEOUT, LoggedProcess, child_env, connect, msg, send, sub, sync
from helpers import recv as _recv

TWISTD = [sys.executable, "-m", "twisted", "--log-format", "text"]
TAKEOVER = 5.0
GRACE = 0.6
STATE = re.compile(r"spanning tree: .*?: (forwarding between|standing by)")


class Service(LoggedProcess):
    stop_signal = signal.SIGTERM

    def __init__(self, tmp_path, plugin, *args, name=None):
        name = name or f"{plugin}-{uuid.uuid4().hex[:6]}"
        super().__init__([*TWISTD, plugin, *args], Path(tmp_path) / f"{name}.log", cwd=tmp_path)

    def state(self) -> str | None:
        found = STATE.findall(self.log())
        if not found:
            return None
        return "forwarding" if found[-1] == "forwarding between" else "standby"


@pytest.fixture
def services(tmp_path):
    procs = []

    def start(plugin, *args, **kw):
        p = Service(tmp_path, plugin, *args, **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


def bridge(services, a, b, rule="'' both"):
    return services("sbus-bridge", "--bus-a", a, "--bus-b", b, "--rule", rule, "--max-delay", "0.5",
                    "--stats-interval", "1")


def relay(services, tmp_path, upstream):
    address = str(Path(tmp_path) / f"relay-{uuid.uuid4().hex[:6]}.socket")
    r = services("sbus-relay", "--bus", upstream, "--socket", address, "--max-delay", "0.5")
    r.address = address

    def served():
        r.alive_or_raise()
        try:
            connect(address, timeout=1).close()
            return True
        except OSError:
            return False

    wait(served, "relay serving")
    return r


def recv(sock, timeout):
    """One packet, or None if nothing came within `timeout`."""
    try:
        return _recv(sock, timeout)
    except TimeoutError:
        return None


def wait(predicate, what, timeout=SERVICE_TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def settled(bridges, forwarding: int, timeout=SERVICE_TIMEOUT):
    """Every bridge has decided, and `forwarding` of them carry traffic."""
    def done():
        for b in bridges:
            b.alive_or_raise()
        states = [b.state() for b in bridges]
        return None not in states and states.count("forwarding") == forwarding and states
    return wait(done, f"{forwarding} of {len(bridges)} bridges forwarding", timeout)


def subscriber(address, pattern=b"t/"):
    s = connect(address)
    send(s, sub(pattern))
    sync(s)
    return s


def collect(sock, expected: set[bytes], timeout=SERVICE_TIMEOUT) -> list[bytes]:
    """Messages until every expected key arrived (then `linger` reads what comes after)."""
    got = []
    deadline = time.monotonic() + timeout
    missing = set(expected)
    while missing:
        p = recv(sock, max(0.01, deadline - time.monotonic()))
        assert p is not None and time.monotonic() < deadline, f"missing {sorted(missing)[:5]}..., got {len(got)}"
        if p.startswith(b"MSG "):
            key = p[4:p.index(b"\0")]
            got.append(key)
            missing.discard(key)
    return got


def linger(socks: dict, got: dict) -> None:
    """Whatever comes within GRACE on any of `socks` (name -> socket), added to `got[name]`: one
    window for them all, so each is read on for GRACE after the last of its expected keys."""
    names = {s.fileno(): name for name, s in socks.items()}
    end = time.monotonic() + GRACE
    while (left := end - time.monotonic()) > 0:
        for fd in select.select(list(names), [], [], left)[0]:
            p = recv(socks[names[fd]], 0.01)
            if p and p.startswith(b"MSG "):
                got[names[fd]].append(p[4:p.index(b"\0")])


def exactly_once(publisher_address, subscribers, tag: str, n=50):
    pub = connect(publisher_address)
    keys = {f"t/{tag}/{i}".encode() for i in range(n)}
    for k in sorted(keys):
        send(pub, msg(k, b"x"))
    received = {name: collect(s, keys) for name, s in subscribers.items()}
    linger(subscribers, received)
    for name, got in received.items():
        got = [k for k in got if k.startswith(f"t/{tag}/".encode())]
        dups = {k: got.count(k) for k in set(got) if got.count(k) != 1}
        assert not dups and len(got) == n, f"{name}: {len(got)} deliveries for {n} messages, dups {dups}"
    pub.close()


def takeover_time(publisher_address, sock, tag: str) -> float:
    """Publish a probe every 0.1 s until one arrives on `sock`; seconds taken."""
    pub = connect(publisher_address)
    start = time.monotonic()
    i = 0
    while time.monotonic() - start < 3 * TAKEOVER:
        send(pub, msg(f"t/{tag}/probe{i}".encode()))
        i += 1
        p = recv(sock, 0.1)
        if p and p.startswith(f"MSG t/{tag}/probe".encode()):
            pub.close()
            return time.monotonic() - start
    raise AssertionError("no standby took over")


# ---------------------------------------------------------------- refusals


def test_bridge_from_a_bus_to_itself_is_refused_with_one_line(start_bus, tmp_path):
    bus = start_bus()
    other_spelling = str(Path(bus.address).parent / "." / Path(bus.address).name)
    for a, b in ((bus.address, bus.address), (bus.address, other_spelling)):
        res = subprocess.run([*TWISTD, "sbus-bridge", "--bus-a", a, "--bus-b", b, "--rule", "'' both"],
                             capture_output=True, timeout=SERVICE_TIMEOUT, cwd=tmp_path, env=child_env())
        out = (res.stderr + res.stdout).decode()
        assert res.returncode != 0, out
        lines = [l for l in out.splitlines() if "refusing to bridge a bus to itself" in l]
        assert len(lines) == 1 and "Traceback" not in out, out


# ---------------------------------------------------------------- cycles


def test_two_parallel_bridges_deliver_once_and_fail_over(start_bus, services):
    a, b = start_bus(), start_bus()
    b1, b2 = bridge(services, a.address, b.address), bridge(services, a.address, b.address)
    settled([b1, b2], forwarding=1)
    standby = b1 if b1.state() == "standby" else b2
    active = b2 if standby is b1 else b1
    assert re.search(r"standing by: loop: side [ab] is already reached through sbus-bridge pid \d+",
                     standby.log()), standby.log()
    sa, sb = subscriber(a.address), subscriber(b.address)
    exactly_once(a.address, {"b": sb, "a": sa}, "ab")
    exactly_once(b.address, {"a": sa, "b": sb}, "ba")

    active.proc.kill()  # kill -9: no goodbye, the standby must time it out
    took = takeover_time(a.address, sb, "kill")
    print(f"takeover after kill -9 of the active bridge: {took:.2f} s")
    assert took < TAKEOVER, took
    settled([standby], forwarding=1)
    sync(sb)
    exactly_once(a.address, {"b": sb, "a": sa}, "after")


def test_ring_of_three_bridges_delivers_once(start_bus, services):
    buses = [start_bus() for _ in range(3)]
    bridges = [bridge(services, buses[i].address, buses[(i + 1) % 3].address) for i in range(3)]
    settled(bridges, forwarding=2)
    assert [b.state() for b in bridges].count("standby") == 1  # one edge of the ring stands by
    subs = {f"bus{i}": subscriber(bus.address) for i, bus in enumerate(buses)}
    for i, bus in enumerate(buses):
        exactly_once(bus.address, subs, f"from{i}")
    # the active bridge next to the standby's... any active one: the ring heals through the standby
    victim = next(b for b in bridges if b.state() == "forwarding")
    victim.stop()  # SIGTERM: it says goodbye, the standby need not wait for a timeout
    settled([b for b in bridges if b is not victim], forwarding=2)
    for s in subs.values():
        sync(s)
    for i, bus in enumerate(buses):
        exactly_once(bus.address, subs, f"healed{i}")


def test_bridge_between_two_relays_of_one_master(start_bus, services, tmp_path):
    master = start_bus()
    r1, r2 = relay(services, tmp_path, master.address), relay(services, tmp_path, master.address)
    br = bridge(services, r1.address, r2.address)
    # its own hello, sent on one relay, comes back through the master on the other
    wait(lambda: "standing by: loop: both sides are on one segment" in br.log(), "the loop logged")
    assert br.state() == "standby"
    s1, s2, sm = subscriber(r1.address), subscriber(r2.address), subscriber(master.address)
    exactly_once(r1.address, {"r1": s1, "r2": s2, "master": sm}, "r1")
    exactly_once(r2.address, {"r1": s1, "r2": s2, "master": sm}, "r2")
    exactly_once(master.address, {"r1": s1, "r2": s2, "master": sm}, "m")

    master.proc.kill()  # the relays keep serving; the bridge is now the only path
    took = takeover_time(r1.address, s2, "nomaster")
    print(f"takeover after kill -9 of the master: {took:.2f} s")
    assert took < TAKEOVER, took
    exactly_once(r1.address, {"r1": s1, "r2": s2}, "bridged")


def test_sbus_stats_services_asks_the_bridges(start_bus, services):
    import json as _json
    a, b = start_bus(), start_bus()
    br = bridge(services, a.address, b.address)
    settled([br], forwarding=1)
    res = subprocess.run([sys.executable, "-c", "import sys; from sbus.cli import main; sys.exit(main())",
                          "-b", a.address, "stats", "--services"],
                         capture_output=True, timeout=SERVICE_TIMEOUT, env=child_env())
    assert res.returncode == 0, res
    (answer,) = _json.loads(res.stdout)
    assert answer["service"] == "sbus-bridge" and answer["pid"] == br.pid
    st = answer["stats"]
    assert st["spanning_tree"]["forwarding"] and st["connected"] == {"a": True, "b": True}
    assert "drop_reasons" in st and "standby_not_forwarded" in st
