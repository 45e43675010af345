"""Lossless by default, end to end: a burst to a `block` subscriber arrives complete across a
bridge, across two relay levels and across a link (issue 11 item 2).

The subscriber asks for ``blocking/hard/block`` and does not read until the publisher is
stuck (or done): every queue on the way fills. Each service stops reading its near side
when its far side is slow, and asks its own servers for ``hard/block``, so the publisher
is held at the source instead of anything being discarded. The default run sends 20 MB
(2,000 packets of 10 KB); the slow run sends the issue's 200,000 messages of 100 bytes.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest

from helpers import SERVICE_TIMEOUT, connect, msg, send, sub, sync
from test_topology_services import relay, services  # noqa: F401  (fixture)

HARD_BLOCK = b"CMSG blocking/hard/block"


class Publisher(threading.Thread):
    def __init__(self, address, key_prefix: bytes, n: int, size: int):
        super().__init__(daemon=True)
        self.sock = connect(address)
        self.sock.settimeout(120)
        self.prefix, self.n, self.size = key_prefix, n, size
        self.sent = 0
        self.error = None

    def run(self):
        pad = b"x" * max(0, self.size - 8)
        try:
            for i in range(self.n):
                self.sock.send(msg(self.prefix + b"%d" % i, b"%08d" % i + pad))
                self.sent += 1
        except Exception as e:  # noqa: BLE001
            self.error = e


def routed(pub_address, s, key, timeout=SERVICE_TIMEOUT):
    """Until a probe published on `pub_address` reaches `s`. A relay passes a subscription
    upward asynchronously, and what is published before it arrives has no subscriber there
    (under load, the first 68 to 138 messages of a burst did not match on the master)."""
    probe = b"MSG " + key + b"probe"
    p = connect(pub_address)
    s.settimeout(0.2)
    deadline = time.monotonic() + timeout
    try:
        while True:
            send(p, msg(key + b"probe"))
            try:
                while not s.recv(1 << 20).startswith(probe):
                    pass
                return
            except socket.timeout:
                assert time.monotonic() < deadline, "the subscription never reached the publisher's bus"
    finally:
        p.close()
        s.settimeout(None)


def burst(pub_address, sub_address, n, size, timeout=120.0):
    key = f"burst/{uuid.uuid4().hex[:6]}/".encode()
    s = connect(sub_address)
    send(s, HARD_BLOCK, sub(key))
    sync(s)
    routed(pub_address, s, key)
    p = Publisher(pub_address, key, n, size)
    p.start()
    # Read nothing until the publisher is held (no progress for a while) or done: every queue
    # on the way is full by then.
    last, still = -1, time.monotonic()
    while p.is_alive() and time.monotonic() - still < 1.0:
        if p.sent != last:
            last, still = p.sent, time.monotonic()
        time.sleep(0.05)
    held = p.is_alive()
    s.settimeout(timeout)
    got = 0
    seen = set()
    deadline = time.monotonic() + timeout
    while got < n and time.monotonic() < deadline:
        packet = s.recv(1 << 20)
        assert packet, "the subscriber was disconnected"
        if packet.startswith(b"MSG " + key) and not packet.startswith(b"MSG " + key + b"probe"):
            i = int(packet[4 + len(key):packet.index(b"\0")])
            assert i not in seen, f"duplicate {i}"
            seen.add(i)
            got += 1
    p.join(timeout)
    assert p.error is None, p.error
    s.close()
    missing = n - got
    assert missing == 0, f"{missing} of {n} messages lost (publisher held: {held})"


def stats_drops(bus) -> dict:
    from helpers import stats
    with connect(bus.address) as c:
        return stats(c)["drops"]


def bridge_between(services, a, b):  # noqa: F811
    br = services("sbus-bridge", "--bus-a", a, "--bus-b", b, "--rule", "burst/ a>b", "--max-delay", "0.5")
    deadline = time.monotonic() + SERVICE_TIMEOUT
    while "forwarding between a and b" not in br.log():
        br.alive_or_raise()
        assert time.monotonic() < deadline, br.log()
        time.sleep(0.05)
    return br


def link_between(services, tmp_path, a, b):  # noqa: F811
    path = str(tmp_path / f"l-{uuid.uuid4().hex[:6]}")
    la = services("sbus-link", "--bus", a, "--listen", "unix:" + path,
                  "--initial-delay", "0.05", "--max-delay", "0.5", "--stats-interval", "0")
    deadline = time.monotonic() + SERVICE_TIMEOUT
    while "sbus-link: listening on" not in la.log():
        la.alive_or_raise()
        assert time.monotonic() < deadline, la.log()
        time.sleep(0.05)
    lb = services("sbus-link", "--bus", b, "--connect", "unix:" + path,
                  "--initial-delay", "0.05", "--max-delay", "0.5", "--stats-interval", "0")
    for proc in (la, lb):
        while "forwarding between bus and peer" not in proc.log():
            proc.alive_or_raise()
            assert time.monotonic() < deadline, proc.log()
            time.sleep(0.05)
    return la, lb


SIZES = [pytest.param(2000, 10_000, id="2k-x-10KB"),
         pytest.param(200_000, 100, id="200k-x-100B", marks=pytest.mark.slow)]


@pytest.mark.parametrize("n,size", SIZES)
def test_burst_across_a_bridge(start_bus, services, n, size):  # noqa: F811
    a, b = start_bus(), start_bus()
    br = bridge_between(services, a.address, b.address)
    burst(a.address, b.address, n, size)
    assert stats_drops(a) == {} and stats_drops(b) == {}
    br.stop()
    assert "drops a>b=0" in br.log()


@pytest.mark.parametrize("n,size", SIZES)
def test_burst_across_two_relay_levels(start_bus, services, tmp_path, n, size):  # noqa: F811
    master = start_bus()
    r1 = relay(services, tmp_path, master.address)
    r2 = relay(services, tmp_path, r1.address)
    burst(master.address, r2.address, n, size)
    assert stats_drops(master) == {}


@pytest.mark.parametrize("n,size", SIZES)
def test_burst_across_a_link(start_bus, services, tmp_path, n, size):  # noqa: F811
    a, b = start_bus(), start_bus()
    link_between(services, tmp_path, a.address, b.address)
    burst(a.address, b.address, n, size)
    assert stats_drops(a) == {} and stats_drops(b) == {}
