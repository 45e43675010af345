"""One uid cannot spend the reactor of everyone (issue 20 fault 9, issue 21 item 6).

uid 65534 holds 40,000 patterns whose star pieces all match one family of keys and publishes
a distinct key each time: every message is a cache miss that walks all 40,000 patterns
(~100 ms each here). The server charges that routing time to the publisher's uid
(`sbus.core.accounting`): another uid's publish rate stays above half its rate alone. Before,
it fell to about nothing (0 msg/s for 7 s).

The rates are compared within one run (alone, attacked, alone again), as a ratio.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time

import pytest

from helpers import connect, msg, run_as, send, sub, sync, unique

ATTACKER = 65534


def _rate(address: str, seconds: float = 2.0) -> float:
    """Messages per second one root publisher gets through to its own subscriber."""
    key = unique("fair/").encode()
    s = connect(address, big=True)
    send(s, sub(key))
    assert sync(s, timeout=30) == []
    p = connect(address, big=True)
    s.settimeout(30)
    n = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for _ in range(20):
            p.send(msg(key, b"x" * 64))
        for _ in range(20):
            s.recv(1 << 16)
        n += 20
    elapsed = time.monotonic() - t0
    s.close()
    p.close()
    return n / elapsed


def _attack(address: str, ready_w: int, stop_r: int) -> str:
    """As uid 65534: hold 40,000 expensive patterns on two connections, then publish distinct
    keys that match them until told to stop."""
    conns = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    for c in conns:
        c.connect(address)
        c.settimeout(120)
    n = 0
    for i in range(1, 201):
        for j in range(1, 201):
            conns[n % 2].send(b"SUB " + b"a" * i + b"*/" + b"a" * j + b"*/")
            n += 1
    for c in conns:
        c.send(b"CMSG !/cred/whoami")
        while not c.recv(1 << 16).startswith(b"CMSG !/cred/whoami"):
            pass
        c.setblocking(False)
    os.write(ready_w, b"r")
    k = 0
    while True:  # publish whenever a socket takes more (no spinning: the server paces us)
        readable, writable, _ = select.select([stop_r], conns, [], 0.5)
        if readable:
            break
        for c in writable:
            try:
                c.send(b"MSG " + b"a" * 300 + b"/" + b"a" * 300 + b"/%d\0" % k)
                k += 1
            except BlockingIOError:
                pass
    return f"sent {k}"


@pytest.mark.timeout(240)
def test_a_uid_whose_publishes_miss_the_cache_cannot_halve_another_uids_rate(start_bus, shared_dir):
    address = os.path.join(shared_dir, "bus.socket")
    bus = start_bus("-o", address=address)
    alone = _rate(bus.address)
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    result = []
    t = threading.Thread(target=lambda: result.append(
        run_as(ATTACKER, ATTACKER, lambda: _attack(address, ready_w, stop_r))), daemon=True)
    t.start()
    try:
        assert select.select([ready_r], [], [], 120)[0], "the attacker never got its patterns in"
        attacked = _rate(bus.address, seconds=4.0)
    finally:
        os.write(stop_w, b"s")
        t.join(60)
    again = _rate(bus.address)
    assert result and result[0].startswith("sent "), result
    baseline = min(alone, again)
    assert attacked >= 0.5 * baseline, (
        f"another uid's rate fell to {attacked:.0f} msg/s from {baseline:.0f} alone ({result[0]})")
    assert int(result[0].split()[1]) > 0  # and the attacker was served, at its share
