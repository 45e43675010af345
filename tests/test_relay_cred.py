"""Secret patterns in the local form on a relay (issue 11, item 4), with real processes.

A relay's clients live in `<relay's whoami on the master>/!/cred/G/U/P/...`.
The empty-field form `!/cred////...` that the protocol allows (and the local
form `!/cred/G/U/P/...` with one's own ids) used to be refused on a relay,
disconnecting the client, while a master accepted it; so a bridge rule
`'' a>b !/cred//// to-bob/` reconnected forever when side A was a relay. Both
forms now name the client's own space there too, and are stored (and sent
upward) with the prefix.
"""

from __future__ import annotations

import os
import re

from helpers import SERVICE_TIMEOUT, connect, msg, recv, send, stats, sub, sync, unsub, wait_until
from test_bridge import recv_until, start_bridge, twistd  # noqa: F401  (fixture)
from test_relay import WHOAMI, WHOAMI_REPLY, Relay, procs, queue_of  # noqa: F401  (fixture)


def _whoami(sock) -> bytes:
    send(sock, WHOAMI)
    while True:
        p = recv(sock, SERVICE_TIMEOUT)
        assert p, "disconnected"
        if p.startswith(WHOAMI_REPLY):
            return p[len(WHOAMI_REPLY):]


def test_local_secret_forms_on_a_relay(start_bus, tmp_path, procs):
    master = start_bus()
    relay = Relay(master.address, str(tmp_path / "relay.sock"), tmp_path)
    procs.append(relay)
    me = connect(relay.address)
    w = _whoami(me)
    g, u, p = os.getgid(), os.getuid(), os.getpid()
    assert w.endswith(b"!/cred/%d/%d/%d" % (g, u, p)) and w.count(b"!/cred/") == 2, w
    send(me, sub(b"!/cred////inbox/"), sub(b"!/cred/%d/%d/%d/local/" % (g, u, p)), sub(b"!/cred/%d///both" % g),
         sub(b"marker"))
    assert sync(me) == []  # still connected, nothing refused
    # the relay holds them with the prefix, and subscribed upward to exactly that
    assert stats(me)["subscriptions"] == 4
    wait_until(lambda: (queue_of(master.address, relay.proc.pid) or {}).get("subscriptions") == 4,
               "the relay subscribed upward")
    above, beside = connect(master.address), connect(relay.address)
    send(above, msg(w + b"/inbox/1", b"from above"), msg(w + b"/both", b"both"))
    sync(above)
    send(beside, msg(w + b"/inbox/2", b"from beside"), msg(w + b"/local/3", b"local"),
         msg(w + b"/elsewhere", b"not subscribed"), msg(b"marker"))
    expected = [msg(w + b"/inbox/1", b"from above"), msg(w + b"/both", b"both"),
                msg(w + b"/inbox/2", b"from beside"), msg(w + b"/local/3", b"local"), msg(b"marker")]
    got = []
    while not set(expected) <= set(got):  # two paths (above, beside): no order between them
        pkt = recv(me, SERVICE_TIMEOUT)
        assert pkt, f"disconnected after {got!r}"
        got.append(pkt)
    got += sync(me)
    assert sorted(got) == sorted(expected), got
    # UNSUB in the local form removes what SUB in the local form stored
    send(me, unsub(b"!/cred////inbox/"), unsub(b"!/cred/%d/%d/%d/local/" % (g, u, p)))
    sync(me)
    assert stats(me)["subscriptions"] == 2  # 'both' and 'marker'
    wait_until(lambda: (queue_of(master.address, relay.proc.pid) or {}).get("subscriptions") == 2,
               "the relay withdrew upward")


def test_bridge_empty_field_rule_from_a_relay(start_bus, tmp_path, procs, twistd):  # noqa: F811
    """docs/deploy.md's rule `'' a>b !/cred//// to-bob/` with side A a relay: what is sent
    privately to the bridge on A arrives on B as to-bob/..., and the bridge stays connected."""
    master, bus_b = start_bus(), start_bus()
    relay = Relay(master.address, str(tmp_path / "relay.sock"), tmp_path)
    procs.append(relay)
    bridge = start_bridge(twistd, relay.address, bus_b.address, "'' a>b !/cred//// to-bob/")
    b_side = connect(bus_b.address)
    send(b_side, sub(b"to-bob/"))
    sync(b_side)
    # the bridge's secret key on A: its whoami there, the relay's prefix included (as root, that
    # of the helper process that connected as the side's user, see sbus/services/safeconnect.py)
    who = re.search(r"side a: connected to .* as ((?:!/cred/\d+/\d+/\d+/)+!/cred/\d+/\d+/\d+); ",
                    bridge.log()).group(1)
    probe = connect(relay.address)
    send(probe, msg(who.encode() + b"/hello", b"private"))
    got = recv_until(b_side, msg(b"to-bob/hello", b"private"), timeout=SERVICE_TIMEOUT)
    assert got == [msg(b"to-bob/hello", b"private")]
    assert "lost the connection" not in bridge.log() and "reconnect" not in bridge.log(), bridge.log()
