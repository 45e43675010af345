"""The spanning tree's proof of who announces (sbus.services.spanning, issue 21 #5), on a
simulated bus with a fake clock: who is challenged, what a catch-all subscriber sees, what a
forger gets. The real-process attacks are in test_attack_trust.py."""

from __future__ import annotations

import json
from collections import deque

from twisted.internet.task import Clock
from twisted.logger import Logger

from sbus.services.spanning import Tree, chain_uids


class Bus:
    """One segment: public keys reach every other connection (echo off), a secret key only the
    connection whose whoami starts it, as the server delivers."""

    def __init__(self):
        self.conns = []          # (tree or None, port, who)
        self.queue = deque()
        self.seen_by_catch_all = []

    def attach(self, tree, port, who: bytes):
        self.conns.append((tree, port, who))

    def publish(self, who: bytes, key: bytes, payload: bytes):
        self.queue.append((who, key, payload))

    def pump(self):
        while self.queue:
            sender, key, payload = self.queue.popleft()
            if not key.startswith(b"!/cred/"):
                self.seen_by_catch_all.append((key, payload))
            for tree, port, who in self.conns:
                if tree is None or who == sender:
                    continue
                if key.startswith(b"!/cred/") and not key.startswith(who + b"/"):
                    continue
                if key.startswith(b"sbus/topology/") or tree.owns(port, key):
                    tree.received(port, key, payload)


def bridge(clock, name, buses, whos, **kw):
    """A two-port node; port n is on buses[n-1] as whos[n-1]."""
    def send(port, key, payload):
        buses[port - 1].publish(whos[port - 1], key, payload)

    tree = Tree(clock, name, {1: "a", 2: "b"}, send, Logger(), **kw)
    for n, (bus, who) in enumerate(zip(buses, whos), 1):
        bus.attach(tree, n, who)
    return tree


def run(clock, buses, seconds):
    for _ in range(int(seconds / 0.05)):
        clock.advance(0.05)
        for b in buses:
            b.pump()


def start(clock, buses, trees, whos):
    for tree, w in zip(trees, whos):
        tree.start()
        for n in (1, 2):
            tree.port_up(n, w[n - 1])
        for b in buses:
            b.pump()


def test_parallel_nodes_prove_each_other_and_only_announcements_are_public():
    clock = Clock()
    b1, b2 = Bus(), Bus()
    whos = [(b"!/cred/0/0/11", b"!/cred/0/0/12"), (b"!/cred/0/0/21", b"!/cred/0/0/22")]
    x = bridge(clock, "x", [b1, b2], whos[0])
    y = bridge(clock, "y", [b1, b2], whos[1])
    start(clock, [b1, b2], [x, y], whos)
    run(clock, [b1, b2], 5)
    assert [x.forwarding, y.forwarding].count(True) == 1
    assert x.sessions_made and y.sessions_made and not x.refused and not y.refused
    # what a catch-all subscriber (of any uid) gets: announcements only, a few, no tree state
    public = [json.loads(p) for k, p in b1.seen_by_catch_all if k == b"sbus/topology/hello"]
    assert public and all(set(p) == {"v", "who"} for p in public)
    assert len(public) <= 2 * (2 + 5 / (10 * 0.5)), len(public)     # at start, then every 5 s


def test_untrusted_announcer_is_not_challenged_and_forgeries_change_nothing():
    clock = Clock()
    b1, b2 = Bus(), Bus()
    whos = (b"!/cred/0/0/11", b"!/cred/0/0/12")
    x = bridge(clock, "x", [b1, b2], whos)
    start(clock, [b1, b2], [x], [whos])
    run(clock, [b1, b2], 3)
    assert x.forwarding
    evil = b"!/cred/1003/1003/77"
    b1.attach(None, 0, evil)
    hello = {"v": 1, "root": "0" * 36, "node": "0" * 36, "cost": 0, "port": 1, "role": "designated",
             "seq": 1 << 40}
    for i in range(1000):
        b1.publish(evil, b"sbus/topology/hello", json.dumps({"v": 2, "who": evil.decode()}).encode())
        b1.publish(evil, b"sbus/topology/hello", json.dumps(hello).encode())
        b1.publish(evil, whos[0] + b"/sbus-topology/hello",
                   b"\0".join((b"0" * 64, b"0" * 16, b"!/cred/0/0/1", json.dumps(hello).encode())))
        b1.publish(evil, b"sbus/topology/hello", json.dumps({"v": 2, "who": f"!/cred/0/0/{9000 + i}"}).encode())
    challenged = [k for _, k, _ in b1.queue if k.startswith(evil)]
    b1.pump()
    run(clock, [b1, b2], 3)
    assert x.forwarding and not challenged
    assert x.refused["untrusted"] == 1000 and x.refused["malformed"] == 1000
    assert x.refused["unknown_session"] == 1000 and x.refused["throttled"] > 900
    assert x.stats()["hellos_in"] == 0


def test_trust_uid_lets_another_users_node_in():
    clock = Clock()
    b1, b2 = Bus(), Bus()
    whos = [(b"!/cred/0/0/11", b"!/cred/0/0/12"), (b"!/cred/5/1003/21", b"!/cred/5/1003/22")]
    x = bridge(clock, "x", [b1, b2], whos[0], trusted_uids=(1003,))
    y = bridge(clock, "y", [b1, b2], whos[1], trusted_uids=(0,))
    start(clock, [b1, b2], [x, y], whos)
    run(clock, [b1, b2], 5)
    assert [x.forwarding, y.forwarding].count(True) == 1 and x.sessions_made and y.sessions_made


def test_without_trust_another_users_node_is_not_part_of_the_tree():
    """The same two nodes, neither told to trust the other's uid: no session, each on its own
    (both forward: why deploy.md says to give --trust-uid when users' services share buses)."""
    clock = Clock()
    b1, b2 = Bus(), Bus()
    whos = [(b"!/cred/0/0/11", b"!/cred/0/0/12"), (b"!/cred/5/1003/21", b"!/cred/5/1003/22")]
    x = bridge(clock, "x", [b1, b2], whos[0])
    y = bridge(clock, "y", [b1, b2], whos[1])
    y.trusted.discard(0)          # as if y ran as uid 1003 (our test runs as root)
    start(clock, [b1, b2], [x, y], whos)
    run(clock, [b1, b2], 6)       # x's first announcement came before y's ports were up
    assert x.sessions_made == y.sessions_made == 0
    assert x.refused["untrusted"] and y.refused["untrusted"]


def test_chain_uids():
    assert chain_uids(b"!/cred/1/2/3") == [2]
    assert chain_uids(b"!/cred/1/2/3/!/cred/4/5/6") == [2, 5]
    for bad in (b"!/cred/1/2", b"!/cred/01/2/3", b"!/cred/1/2/3/x", b"x!/cred/1/2/3", b"", b"!/cred/1/2/3/"):
        assert chain_uids(bad) is None, bad
