"""Adversarial suite (issue 7): every way we know to read a secret without the
credentials, who may connect, and resource exhaustion — each against a real
server process. docs/security.md lists each attack with the test here (or in
tests/test_server_*.py) that shows it fails.

Conventions: no sleeps as synchronisation (a whoami round trip, the server's
statistics or its log, each with a deadline); every assertion is one a broken
server would get wrong.
"""

from __future__ import annotations

import os
import resource
import shutil
import stat
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from helpers import (  # noqa: F401
    MAX_PACKET, Agent, Disconnected, LoggedProcess, SbusdProcess, TwistdBus, connect, mbus, msg, recv,
    run_as, send, served, stats, sub, sync, try_whoami, unique, wait_closed, wait_offender_logged, wait_stats,
    wait_until,
)

NOBODY = 65534
TIMEOUT = 10.0
WHOAMI = b"CMSG !/cred/whoami"
WHOAMI_REPLY = WHOAMI + b"\0"
CRED_WORDS = ("cred", "!", "secret", "forbid", "permi", "allow", "refus", "reject", "invalid", "truncat")

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another uid")


# ---------------------------------------------------------------- shared helpers (test_faults imports them)


def proc_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat (a counter, not a timing)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_fd_soft_limit(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no 'Max open files' line")


def sbusd(tmp_path, *args, address=None, preexec_fn=None) -> SbusdProcess:
    address = address or str(Path(tmp_path) / f"bus-{uuid.uuid4().hex[:8]}.sock")
    return SbusdProcess(["-f", "-a", address, *args], Path(tmp_path) / f"sbusd-{uuid.uuid4().hex[:6]}.log",
                        address=address, preexec_fn=preexec_fn)


def _answers_whoami(address) -> bytes | None:
    try:
        with connect(address, timeout=2) as s:
            send(s, WHOAMI)
            reply = recv(s, 2)
            return reply[len(WHOAMI_REPLY):] if reply.startswith(WHOAMI_REPLY) else None
    except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
        return None


def relay(tmp_path, upstream: str, address: str, *args) -> LoggedProcess:
    """`twistd sbus-relay` below `upstream`, ready once it answers whoami on `address`."""
    p = LoggedProcess([sys.executable, "-m", "twisted", "--log-format", "text", "sbus-relay", "--bus", upstream,
                       "--socket", address, *args], Path(tmp_path) / f"relay-{uuid.uuid4().hex[:6]}.log")
    p.address = address
    wait_until(lambda: p.alive_or_raise() and _answers_whoami(address), f"relay serving on {address}")
    return p


@pytest.fixture
def world_dir():
    """A directory every uid may enter (pytest's tmp dirs are 0700)."""
    d = tempfile.mkdtemp(prefix="sbus-adv-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def servers():
    started = []
    yield started
    for s in reversed(started):
        s.stop()


def drain_until(sock, marker: bytes, timeout: float = TIMEOUT) -> list[bytes]:
    got = []
    deadline = time.monotonic() + timeout
    while True:
        p = recv(sock, max(0.05, deadline - time.monotonic()))
        if not p:
            raise Disconnected(f"closed before {marker!r}; got {got[:5]!r}")
        if p == marker:
            return got
        got.append(p)


# ================================================================ secrets: SUB tricks


def _fill(template: str, g: int, u: int, p: int) -> bytes:
    arabic = "".join(chr(0x660 + int(d)) for d in str(p))  # int() accepts these; the server must not
    return template.format(
        G=g, U=u, P=p, P32=p + 2**32, P64=p + 2**64, U32=u + 2**32, G32=g + 2**32, PNEG=p - 2**32,
        PARABIC=arabic, PFULL="".join(chr(0xFF10 + int(d)) for d in str(p)),
    ).encode()


# Each template, filled with the subscriber's own gid/uid/pid, is NOT acceptable: the client is
# disconnected and logged. (Wildcards, other ids, padding `007`/`+7`/` 7`, truncation: see
# tests/test_server_secrets.py FORBIDDEN/PADDED; these are the ones it does not have.)
SUB_TRICKS = [
    ("pid+2^32", "!/cred/{G}/{U}/{P32}/"),
    ("pid+2^64", "!/cred/{G}/{U}/{P64}/"),
    ("uid+2^32", "!/cred/{G}/{U32}/{P}/"),
    ("gid+2^32", "!/cred/{G32}/{U}/{P}/"),
    ("pid-2^32", "!/cred/{G}/{U}/{PNEG}/"),
    ("trailing-space", "!/cred/{G}/{U}/{P} /"),
    ("trailing-tab", "!/cred/{G}/{U}/{P}\t/"),
    ("arabic-digits", "!/cred/{G}/{U}/{PARABIC}/"),
    ("fullwidth-digits", "!/cred/{G}/{U}/{PFULL}/"),
    ("underscore", "!/cred/{G}/{U}/{P}_/"),
    ("exponent", "!/cred/{G}/{U}/{P}e0/"),
    ("nul-truncated", "!/cred/{G}/{U}/{P}\0/x"),  # the pattern ends at the NUL: truncated
    ("star-pid", "!/cred/{G}/{U}/*/"),
    ("slash-in-field", "!/cred/{G}//{U}/{P}/"),
]


@pytest.mark.parametrize("template", [t for _, t in SUB_TRICKS], ids=[n for n, _ in SUB_TRICKS])
def test_secret_subscription_tricks_are_refused(mbus, template):
    with Agent(mbus.address) as a:
        g, u, p = a.whoami()
        pattern = _fill(template, g, u, p)
        a.send(sub(pattern))
        assert a.wait_closed(), f"{pattern!r} was accepted"
        wait_offender_logged(mbus, p, u, CRED_WORDS)
    served(mbus.address)


# ================================================================ secrets: keys that look like someone's


def test_non_canonical_secret_keys_reach_nobody(mbus):
    """Keys that a lax parser would read as the owner's (ids beyond 32 bits, padded, signed,
    Unicode digits, no trailing '/') and a forged whoami reply reach nobody: not the owner,
    not a catch-all spy. The canonical key is the positive control."""
    with Agent(mbus.address) as owner:
        g, u, p = owner.whoami()
        marker = unique("marker/").encode()
        owner.send(sub(b""), sub(b"!/cred/%d/%d/%d/" % (g, u, p)))
        assert owner.sync() == []
        spies = []
        for pattern in (b"", b"*", b"*/", b"!/", b"!/cred/%d/%d//" % (g, u)):
            s = connect(mbus.address)
            send(s, sub(pattern), sub(marker))
            assert sync(s) == []
            spies.append(s)
        bogus = [_fill(t, g, u, p) for t in (
            "!/cred/{G}/{U}/{P32}/x", "!/cred/{G}/{U}/{P64}/x", "!/cred/{G}/{U32}/{P}/x", "!/cred/{G32}/{U}/{P}/x",
            "!/cred/{G}/{U}/0{P}/x", "!/cred/{G}/{U}/+{P}/x", "!/cred/{G}/{U}/ {P}/x", "!/cred/0{G}/{U}/{P}/x",
            "!/cred/{G}/{U}/{PARABIC}/x", "!/cred/{G}/{U}/{P}", "!/cred/{G}/{U}", "!/cred/", "!/cred//{U}/{P}/x",
            "!/cred/whoami",
        )]
        pub = connect(mbus.address)
        good = msg(b"!/cred/%d/%d/%d/x" % (g, u, p), b"for the owner")
        send(pub, *[msg(k, b"!/cred/0/0/1") for k in bogus], good, msg(marker, b"m"))
        # the owner holds "" and its space: it gets the canonical key and nothing else secret-looking
        got = []
        while (pkt := owner.recv()) != msg(marker, b"m"):
            assert pkt, "owner disconnected"
            got.append(pkt)
        assert got == [good], got
        for s in spies:
            assert drain_until(s, msg(marker, b"m")) == []
            s.close()
        assert sync(pub) == []  # publishing to any of them is legal
        pub.close()


# ================================================================ secrets: through a relay


@pytest.mark.timeout(60)
def test_prefix_spoofed_through_a_relay(tmp_path, servers):
    """A slave's clients live in `<relay's whoami on the master>/!/cred/...`. Nobody can claim
    the relay's own master space, another local pid's space (with or without the prefix)
    or (from the master) a relay client's space; keys for any of them reach only their owner."""
    master = sbusd(tmp_path)
    servers.append(master)
    r = relay(tmp_path, master.address, str(tmp_path / "relay.sock"))
    servers.append(r)
    rg, ru, rp = os.getgid(), os.getuid(), r.pid
    relay_space = b"!/cred/%d/%d/%d/" % (rg, ru, rp)  # the relay's own secret space on the master

    with Agent(r.address) as owner:
        w = owner.call("whoami")[1]
        og, ou, op = os.getgid(), os.getuid(), owner.pid
        assert w == relay_space + b"!/cred/%d/%d/%d" % (og, ou, op)
        owner_space = w + b"/"
        marker = unique("marker/").encode()
        owner.send(sub(owner_space), sub(marker))
        assert owner.sync() == []

        # -- claims that must be refused, on the relay and on the master
        claims = [
            (r.address, relay_space),                                    # the relay's master space
            (r.address, relay_space + b"x"),
            (r.address, relay_space + b"!/cred/"),                       # truncated below the prefix
            (r.address, relay_space + b"!/cred/%d/%d/%d/" % (og, ou, op)),  # another local pid
            (r.address, relay_space + b"!/cred/*/*/*/"),
            # (own ids with the prefix left out, `!/cred/g/u/p/` and `!/cred////`, are the local
            # form of one's own space since issue 11: test_relay_cred.py)
            (master.address, relay_space + b"!/cred/%d/%d/%d/" % (og, ou, op)),  # from above
            (master.address, relay_space),
        ]
        for address, pattern in claims:
            with Agent(address) as spy:
                pattern = pattern.replace(b"%d", b"%d" % spy.pid)
                spy.send(sub(pattern))
                assert spy.wait_closed(), f"{pattern!r} accepted on {address}"
        # the relay never passed a refused claim upward: its upward subscriptions are the owner's two
        with connect(master.address) as m:
            up = [q for q in stats(m)["queues"] if q["pid"] == rp]
        assert up and up[0]["subscriptions"] == 2, up

        # -- catch-all spies on both buses
        spies = []
        for address in (r.address, master.address):
            for pattern in (b"", b"*/", b"!/", b"!/cred/"[:-1]):
                s = connect(address)
                send(s, sub(pattern), sub(marker))
                sync(s)
                spies.append(s)
        # the spies' marker subscriptions must have reached the master before the markers are sent
        wait_until(lambda: next(q["subscriptions"] for q in stats(connect(master.address))["queues"]
                                if q["pid"] == rp) == 6, "the relay subscribed upward")
        from_master, from_relay = connect(master.address), connect(r.address)
        secrets_for_owner = [msg(owner_space + b"a", b"from above"), msg(owner_space + b"b", b"from beside")]
        send(from_master, msg(relay_space + b"mine", b"the relay's own"), secrets_for_owner[0],
             msg(relay_space + b"!/cred/%d/%d/%d/x" % (og, ou, op + 1), b"a neighbour's"))
        sync(from_master)
        send(from_relay, secrets_for_owner[1], msg(relay_space + b"mine", b"the relay's own, from below"))
        sync(from_relay)
        send(from_master, msg(marker, b"m1"))
        send(from_relay, msg(marker, b"m2"))
        markers = {msg(marker, b"m1"), msg(marker, b"m2")}
        got = []
        while markers:
            pkt = owner.recv(TIMEOUT)
            assert pkt, "owner lost"
            if pkt in markers:
                markers.discard(pkt)
            else:
                got.append(pkt)
        assert sorted(got) == sorted(secrets_for_owner)
        for s in spies:
            left = {msg(marker, b"m1"), msg(marker, b"m2")}
            while left:
                pkt = recv(s, TIMEOUT)
                assert pkt in left, f"spy got {pkt[:80]!r}"
                left.discard(pkt)
            s.close()
    assert r.proc.poll() is None and master.proc.poll() is None


# ================================================================ who may connect


@needs_root
@pytest.mark.parametrize("flags,expect", [
    ([], {"other": "EACCES", "group": "EACCES", "mode": 0o700}),
    (["-g"], {"other": "EACCES", "group": "served", "mode": 0o770}),
    (["-g", "-o"], {"other": "served", "group": "served", "mode": 0o777}),
    (["-o"], {"other": "served", "group": "EACCES", "mode": 0o707}),
], ids=["default", "-g", "-g-o", "-o"])
def test_socket_file_mode_decides_who_reaches_the_bus(world_dir, servers, flags, expect):
    bus = sbusd(world_dir, *flags)
    servers.append(bus)
    assert stat.S_IMODE(os.stat(bus.address).st_mode) == expect["mode"]
    assert os.stat(bus.address).st_uid == os.getuid()
    # uid nobody in no group of ours, and uid nobody whose group is the socket's group (0)
    assert run_as(NOBODY, NOBODY, lambda: try_whoami(bus.address)) == expect["other"]
    assert run_as(NOBODY, 0, lambda: try_whoami(bus.address)) == expect["group"]
    assert try_whoami(bus.address) == "served"


@needs_root
def test_user_allow_list_refuses_other_uids_at_accept(world_dir, servers):
    """-u on a world-writable socket: the file mode lets everyone reach it, the server
    refuses everyone but the listed users and itself, counts and logs each refusal, and a
    refused connection holds nothing."""
    bus = sbusd(world_dir, "-g", "-o", "-u", "65533")
    servers.append(bus)
    watcher = connect(bus.address)
    wait_stats(watcher, lambda s: s["clients"] == 1)
    for _ in range(3):
        assert run_as(NOBODY, NOBODY, lambda: try_whoami(bus.address)) == "refused"
    assert run_as(65533, 65533, lambda: try_whoami(bus.address)) == "served"
    assert run_as(0, 0, lambda: try_whoami(bus.address)) == "served"
    st = wait_stats(watcher, lambda s: s["clients"] == 1 and s["disconnects"].get("closed") == 2)
    assert st["refused"] == {"user_not_allowed": 3}
    assert all(q["uid"] == 0 for q in st["queues"])
    log = bus.wait_log("uid=65534", count=3)
    assert log.count("user not allowed") == 3
    # a refused uid cannot get in by publishing/subscribing before the refusal either
    def sneaky():
        s = connect(bus.address, timeout=3)
        try:
            s.send(sub(b""))
            s.send(msg(b"sneak", b"x"))
        except OSError:
            pass
        return try_whoami(bus.address)
    spy = connect(bus.address)
    send(spy, sub(b"sneak"))
    sync(spy)
    assert run_as(NOBODY, NOBODY, sneaky) == "refused"
    assert sync(spy) == []


# ================================================================ resource exhaustion


def test_one_client_cannot_hold_millions_of_patterns(tmp_path, servers):
    """Default limits: the client asking for its 100,001st pattern is disconnected (counted,
    logged), everything it held is released, and the bus serves everyone meanwhile."""
    bus = sbusd(tmp_path)
    servers.append(bus)
    watcher = connect(bus.address)
    send(watcher, sub(b"watch"))
    base = stats(watcher)
    limit = base["limits"]["max_subscriptions"]
    assert limit == 100_000
    greedy = connect(bus.address, big=True)
    sent = 0
    try:
        for i in range(1_000_000):
            greedy.send(b"SUB p/%d" % i)
            sent += 1
    except (BrokenPipeError, ConnectionResetError):
        pass
    wait_closed(greedy)
    assert limit < sent < 1_000_000
    st = wait_stats(watcher, lambda s: s["clients"] == 1)
    assert st["disconnects"].get("too_many_subscriptions") == 1
    assert st["subscriptions"] == base["subscriptions"]
    bus.wait_log(f"over the limit of {limit} subscriptions per client")
    served(bus.address)


def test_patterns_and_keys_at_the_packet_limit(mbus):
    """The longest pattern and the longest key the packet limit allows are stored and routed."""
    p = connect(mbus.address, big=True)
    s = connect(mbus.address, big=True)
    base = unique("long/").encode()
    longest = base + b"/" + b"y" * (MAX_PACKET - len(b"SUB ") - len(base) - 1)
    assert len(sub(longest)) == MAX_PACKET  # the longest pattern there is: stored
    long_pattern = base + b"/" + b"x" * (MAX_PACKET - len(b"MSG \0") - len(base) - 1)
    send(s, sub(longest), sub(long_pattern), sub(base + b"/*"))
    assert sync(s) == []
    key = long_pattern  # a MSG with that key and an empty payload is exactly at the limit
    assert len(msg(key, b"")) == MAX_PACKET
    send(p, msg(key, b""))
    assert recv(s) == msg(key, b"")  # one copy, byte for byte, however many patterns match
    send(s, b"UNSUB " + base + b"/*")  # (an UNSUB of the longest would itself be over the limit)
    sync(s)
    send(s, sub(base + b"-marker"))
    sync(s)
    send(p, msg(key, b""), msg(base + b"/m", b"not any more"), msg(base + b"-marker", b"m"))
    assert recv(s) == msg(key, b"")  # the long exact pattern alone still matches
    assert recv(s) == msg(base + b"-marker", b"m")
    assert sync(s) == []


def test_long_patterns_cannot_pin_unbounded_memory(tmp_path, servers):
    """64 MiB of patterns (160 distinct 400 KB patterns) from one client: the server must stop it
    (disconnect, counted) instead of holding them all."""
    bus = sbusd(tmp_path)
    servers.append(bus)
    greedy = connect(bus.address, big=True)
    filler = b"x" * (MAX_PACKET - 24)
    try:
        for i in range(160):
            greedy.send(b"SUB %06d/" % i + filler)
        sync(greedy)
    except (Disconnected, BrokenPipeError, ConnectionResetError):
        pass
    wait_closed(greedy)
    assert stats(connect(bus.address))["disconnects"].get("too_many_subscriptions") == 1


def test_many_segment_patterns_do_not_amplify_memory(tmp_path, servers):
    bus = sbusd(tmp_path)
    servers.append(bus)
    c = connect(bus.address, big=True)
    sync(c)
    before = proc_rss_kib(bus.pid)
    try:
        for i in range(2):
            send(c, b"SUB %d/" % i + b"a/" * ((MAX_PACKET - 16) // 2))
        sync(c, timeout=30)
    except (Disconnected, BrokenPipeError, ConnectionResetError):
        return  # refused (the server may close before the second pattern is sent): fine
    grown_mib = (proc_rss_kib(bus.pid) - before) / 1024
    assert grown_mib < 16, f"two 400 KB patterns grew the server by {grown_mib:.0f} MiB"


def test_distinct_long_keys_do_not_pin_memory(tmp_path, servers):
    """A publisher (no subscription needed) sending distinct keys near the packet limit."""
    bus = sbusd(tmp_path)
    servers.append(bus)
    s = connect(bus.address)
    send(s, sub(b"somebody/listens"))
    pub = connect(bus.address, big=True)
    sync(pub)
    before = proc_rss_kib(bus.pid)
    filler = b"k" * (MAX_PACKET - 32)
    for i in range(300):
        send(pub, b"MSG %06d/" % i + filler + b"\0")
    sync(pub, timeout=30)
    grown_mib = (proc_rss_kib(bus.pid) - before) / 1024
    assert grown_mib < 48, f"300 distinct long keys pinned {grown_mib:.0f} MiB in the server"


def _raise_nofile(n: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(n, hard), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= n


@pytest.mark.timeout(90)
def test_thousands_of_connections(tmp_path, servers):
    """4,096 connections of one uid (the default per-uid limit) are served; the next one is
    refused at accept (counted); one leaving lets one more in; all leaving frees everything."""
    if not _raise_nofile(4096 + 200):
        pytest.skip("cannot raise RLIMIT_NOFILE in the test process")
    bus = sbusd(tmp_path)
    servers.append(bus)
    if proc_fd_soft_limit(bus.pid) < 4096 + 64:
        pytest.skip("the server's own descriptor limit is below the per-uid connection limit")
    conns = [connect(bus.address) for _ in range(4096)]
    st = wait_stats(conns[0], lambda s: s["clients"] == 4096, timeout=30)
    assert st["limits"]["max_uid_connections"] == 4096
    # each is a full client: a whoami on a sample of them (first, last, some in between)
    for c in conns[::512] + conns[-1:]:
        assert sync(c) == []
    extra = connect(bus.address)
    wait_closed(extra)
    assert stats(conns[0])["refused"] == {"too_many_connections": 1}
    conns.pop().close()
    wait_stats(conns[0], lambda s: s["clients"] == 4095)
    again = connect(bus.address)
    assert sync(again) == []
    conns.append(again)
    last = conns.pop(0)
    for c in conns:
        c.close()
    wait_stats(last, lambda s: s["clients"] == 1 and s["subscriptions"] == 0, timeout=30)
    served(bus.address)
    assert bus.proc.poll() is None


def _starved_bus(tmp_path, servers):
    """A server limited to 64 descriptors, a subscriber/publisher pair on it, and 64 more
    connections: more than it can hold, the rest wait in its listen backlog."""
    bus = sbusd(tmp_path, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)))
    servers.append(bus)
    s, p = connect(bus.address), connect(bus.address)
    key = unique("alive/").encode()
    send(s, sub(key))
    assert sync(s) == []
    held = [connect(bus.address) for _ in range(64)]
    bus.wait_log("not accepting for 0.5 s")
    accepted = stats(s)["clients"]  # stable now: no descriptor is left for another
    assert 10 <= accepted < 2 + len(held)
    return bus, s, p, key, held, accepted


@pytest.mark.timeout(60)
def test_fd_limit_makes_accept_back_off_not_spin(tmp_path, servers):
    """The server runs out of descriptors: it keeps serving its clients and pauses accepting
    (logged) instead of spinning: its CPU time over several back-off periods stays low."""
    bus, s, p, key, held, accepted = _starved_bus(tmp_path, servers)
    cpu0, t0 = proc_cpu_seconds(bus.pid), time.monotonic()
    n0 = bus.log().count("not accepting for 0.5 s")
    bus.wait_log("not accepting for 0.5 s", count=n0 + 4)
    for i in range(50):  # still serving its clients during the back-off
        send(p, msg(key, b"%d" % i))
    assert [recv(s) for _ in range(50)] == [msg(key, b"%d" % i) for i in range(50)]
    cpu = proc_cpu_seconds(bus.pid) - cpu0
    wall = time.monotonic() - t0
    assert cpu < 0.3 * wall, f"server used {cpu:.2f} s of CPU in {wall:.2f} s while out of descriptors"
    for c in held[: accepted - 2]:  # those that got in are full clients
        assert sync(c) == []
    assert bus.proc.poll() is None


@pytest.mark.timeout(60)
def test_fd_limit_waiting_clients_get_in_once_others_leave(tmp_path, servers):
    bus, s, p, key, held, accepted = _starved_bus(tmp_path, servers)
    for c in held[: accepted - 2]:
        c.close()
    for c in held[accepted - 2:]:
        assert sync(c, timeout=TIMEOUT) == []
    assert "Traceback" not in bus.log()
    served(bus.address)


def test_sbusd_raises_its_soft_descriptor_limit(tmp_path, servers):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 8192:
        pytest.skip("hard limit too low to tell")
    bus = sbusd(tmp_path, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    servers.append(bus)
    assert proc_fd_soft_limit(bus.pid) >= min(hard, 4096 + 64)


# -------------------------------------------------------------- a client that never reads, in every mode

MODES = {
    # name: (control messages, what happens to the non-reader, does the flooding publisher get held)
    "queue+discard": ([b"blocking/soft/queue", b"blocking/hard/discard"], "hard_discard", False),
    "soft-discard": ([b"blocking/soft/discard"], "soft_discard", False),
    "soft-error": ([b"blocking/soft/error"], "soft_error", False),
    "queue+error": ([b"blocking/soft/queue", b"blocking/hard/error"], "hard_error", False),
    "soft-block": ([b"blocking/soft/block"], "stalled", True),
    "queue+hard-block": ([b"blocking/soft/queue", b"blocking/hard/block"], "stalled", True),
    "stack+discard": ([b"order/stack", b"blocking/hard/discard"], "hard_discard", False),
    "random+discard": ([b"order/random", b"blocking/hard/discard"], "hard_discard", False),
}
QUEUE_BYTES = 256 * 1024


@pytest.fixture(scope="module")
def small_bus(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    address = str(d / "bus.sock")
    srv = TwistdBus(address, d / "twistd.log", ["--queue-bytes", str(QUEUE_BYTES), "--queue-packets", "1000",
                                               "--stall-timeout", "3"])
    yield srv
    srv.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_client_that_never_reads(small_bus, mode):
    """One subscriber never reads, in each flood-control mode, while a publisher floods its key:
    its queue stays within the limit, a well-behaved subscriber of the same key gets every packet
    in order, unrelated traffic flows meanwhile, and the mode's outcome happens and is counted."""
    controls, outcome, holds = MODES[mode]
    bus = small_bus
    key = unique("flood/").encode()
    other = unique("other/").encode()
    lazy = connect(bus.address)
    send(lazy, *[b"CMSG " + c for c in controls], sub(key))
    assert sync(lazy) == []
    reader = connect(bus.address, big=True)  # a well-behaved subscriber of the same key, reading all along
    send(reader, b"CMSG blocking/hard/block", sub(key))  # lossless even when this thread lags
    sync(reader)
    got: list[bytes] = []
    end = msg(key, b"end")

    def read_all():
        while True:
            pkt = recv(reader, 30)
            if not pkt or pkt == end:
                got.append(pkt)
                return
            got.append(pkt)

    import threading
    t = threading.Thread(target=read_all, daemon=True)
    t.start()
    u_sub, u_pub = connect(bus.address), connect(bus.address)
    send(u_sub, sub(other))
    sync(u_sub)
    watcher = connect(bus.address)
    base = stats(watcher)

    pub = connect(bus.address)
    pub.settimeout(0.5)
    sent = 0
    payload = b"f" * 1000
    held = False
    while sent < 3000:
        try:
            pub.send(msg(key, b"%d:" % sent + payload))
        except TimeoutError:
            held = True
            break
        sent += 1
    assert held == holds, f"publisher held: {held}, expected {holds} (sent {sent})"
    # The non-reader's queue never exceeds its limit (plus the packet that crossed it).
    queues = [q for q in stats(watcher)["queues"] if q["queued_bytes"] > 0]
    assert all(q["queued_bytes"] <= QUEUE_BYTES + 1100 for q in queues), queues
    # Unrelated traffic is not held up, whatever the non-reader does.
    for i in range(200):
        send(u_pub, msg(other, b"%d" % i))
    assert [recv(u_sub) for _ in range(200)] == [msg(other, b"%d" % i) for i in range(200)]
    # The outcome is the mode's and it is counted (block modes: at the stall deadline).
    if outcome in ("soft_error", "hard_error", "stalled"):
        # (without reading `lazy`: reading would drain its queue and release the publisher)
        wait_stats(watcher, lambda s: s["disconnects"].get(outcome, 0) > base["disconnects"].get(outcome, 0),
                   timeout=15)
        wait_closed(lazy, timeout=15)
    else:
        wait_stats(watcher, lambda s: s["drops"].get(outcome, 0) > base["drops"].get(outcome, 0))
        assert sync(lazy, timeout=10) is not None  # still connected
    # A held publisher is read again; the well-behaved subscriber got every packet, in order.
    pub.settimeout(15)
    send(pub, end)
    t.join(30)
    assert got and got[-1] == end, got[-1:]
    assert got[:-1] == [msg(key, b"%d:" % i + payload) for i in range(sent)]
    assert bus.proc.poll() is None
    for c in (lazy, reader, u_sub, u_pub, watcher, pub):
        c.close()
