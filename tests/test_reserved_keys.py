"""Keys under `sbus/topology/` (the services' spanning-tree chatter) reach only patterns that
start with `sbus/` (issue 22): not the catch-all `""`, not a pattern starting with a star, the way
MQTT keeps `$SYS/` topics from `#` subscribers. docs/protocol.md "Reserved keys"."""

from __future__ import annotations

import sys
import time
import uuid

import pytest

from helpers import SERVICE_TIMEOUT, LoggedProcess, connect, msg, recv, send, sub, sync
from sbus.core.patterns import reaches

HELLO = b"sbus/topology/hello"


@pytest.mark.parametrize("pattern, key, expected", [
    (b"", HELLO, False),
    (b"*/", HELLO, False),
    (b"*/topology/", HELLO, False),
    (b"sb*/", HELLO, False),
    (b"sbus/", HELLO, True),
    (b"sbus/topology/", HELLO, True),
    (b"sbus/*/hello", HELLO, True),
    (b"sbus/topology/hello", HELLO, True),
    (b"", b"sbus/other", True),          # only `sbus/topology/` is reserved
    (b"", b"sbus/topologyx", True),
    (b"*/", b"a/sbus/topology/hello", True),
])
def test_the_reserved_keys_rule(pattern, key, expected):
    assert reaches(pattern, key) is expected


def test_a_reserved_key_reaches_only_patterns_that_start_with_sbus(both_paths):
    bus = both_paths()
    patterns = [b"", b"*/", b"*/topology/", b"sbus/", b"sbus/*/hello", b"sbus/topology/"]
    subs = {}
    for p in patterns:
        s = connect(bus.address, extensions=p != b"")  # the catch-all: a reference client
        send(s, sub(p))
        sync(s)
        subs[p] = s
    pub = connect(bus.address)
    send(pub, msg(HELLO, b"{}"), msg(b"sbus/other", b"1"))
    sync(pub)
    for p, s in subs.items():
        got = [x.split(b"\0")[0] for x in sync(s)]
        want = [b"MSG " + HELLO] if p.startswith(b"sbus/") else []
        if not p.startswith(b"*/topology/") and p != b"sbus/*/hello" and p != b"sbus/topology/":
            want.append(b"MSG sbus/other")
        assert got == want, f"pattern {p!r}: got {got}"
        s.close()
    pub.close()


def test_a_catch_all_reference_client_hears_no_bridge_chatter(start_bus, tmp_path):
    """Two parallel bridges (hellos, announcements, challenges on both buses): a reference
    client subscribed to everything gets the test's message and nothing from the bridges,
    while a subscriber of `sbus/topology/` hears their announcements."""
    a, b = start_bus(), start_bus()
    watcher = connect(a.address)
    send(watcher, sub(b"sbus/topology/"))
    sync(watcher)
    everything = connect(a.address, extensions=False)
    send(everything, sub(b""))
    sync(everything)
    bridges = [LoggedProcess([sys.executable, "-m", "twisted", "--log-format", "text", "sbus-bridge",
                              "--bus-a", a.address, "--bus-b", b.address, "--rule", "'' both", "--max-delay", "0.5"],
                             tmp_path / f"bridge-{uuid.uuid4().hex[:6]}.log", cwd=tmp_path) for _ in range(2)]
    try:
        heard = set()
        deadline = time.monotonic() + SERVICE_TIMEOUT
        while len(heard) < 2:  # an announcement from each bridge
            assert time.monotonic() < deadline, f"heard {len(heard)} of 2 bridges announce"
            for p in bridges:
                p.alive_or_raise()
            try:
                p = recv(watcher, 1.0)
            except TimeoutError:
                continue
            if p.startswith(b"MSG " + HELLO + b"\0"):
                heard.add(p.split(b"\0", 1)[1])
        pub = connect(a.address)
        send(pub, msg(b"app/x", b"1"))
        sync(pub)
        got = sync(everything)
        assert [x.split(b"\0")[0] for x in got] == [b"MSG app/x"], [x[:40] for x in got]
        pub.close()
    finally:
        for p in bridges:
            p.stop()
        watcher.close()
        everything.close()
