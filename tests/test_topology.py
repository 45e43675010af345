"""The spanning-tree core (`sbus.core.topology`) over simulated segments, no I/O.

A segment delivers what a node sends on it to every other port on it (a
node's own port does not hear itself: services are echo-off), after a small
delay. Hypothesis draws random multigraphs (self-loops and parallel edges
included), and the properties are the ones the services rely on: the
forwarding nodes never form a cycle, at any moment, and after convergence
they connect every connected component; after a node dies, a standby takes
over within the promised time.
"""

from __future__ import annotations

import heapq
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from sbus.core import topology
from sbus.core.topology import FORWARD_DELAY, HELLO_INTERVAL, MAX_AGE, Hello, Node

STEP = 0.05


class Sim:
    def __init__(self, edges, delay=0.01, seed=0):
        self.edges = list(edges)          # node index -> (segment of port 1, segment of port 2)
        self.delay = delay
        self.now = 0.0
        self.queue = []
        self.seq = itertools.count()
        self.alive = [True] * len(edges)
        self.cut: set[tuple[int, int]] = set()   # (node, port) whose connection is down
        self.nodes = []
        for i, _ in enumerate(edges):
            # ids in a fixed order per seed, so failures replay
            nid = f"8000{(seed * 1000 + i) * 7919 % 10**12:032x}"
            self.nodes.append(Node(nid, {1: "a", 2: "b"}, name=f"n{i}"))
        self.logs = []
        for i, n in enumerate(self.nodes):
            n.port_up(1, 0.0)
            n.port_up(2, 0.0)
            self._flush(i)

    def segment(self, i, port):
        return self.edges[i][port - 1]

    def _flush(self, i):
        node = self.nodes[i]
        for port, hello in node.outgoing():
            seg = self.segment(i, port)
            for j, (sa, sb) in enumerate(self.edges):
                if not self.alive[j]:
                    continue
                for q, s in ((1, sa), (2, sb)):
                    if s == seg and (j, q) != (i, port) and (j, q) not in self.cut:
                        heapq.heappush(self.queue, (self.now + self.delay, next(self.seq), j, q, hello))
        self.logs.extend((self.now, i, e) for e in node.events())

    def run(self, seconds, check=None):
        end = self.now + seconds
        while self.now < end - 1e-9:
            step_end = self.now + STEP
            while self.queue and self.queue[0][0] <= step_end:
                t, _, j, q, hello = heapq.heappop(self.queue)
                self.now = max(self.now, t)
                if self.alive[j] and (j, q) not in self.cut:
                    self.nodes[j].received(q, hello, self.now)
                    self._flush(j)
                if check:
                    check(self)
            self.now = step_end
            for i, n in enumerate(self.nodes):
                if self.alive[i]:
                    n.tick(self.now)
                    self._flush(i)
            if check:
                check(self)

    def kill(self, i):
        self.alive[i] = False

    def disconnect(self, i, port):
        self.cut.add((i, port))
        self.nodes[i].port_down(port, self.now)
        self._flush(i)

    def forwarding(self):
        return [i for i, n in enumerate(self.nodes) if self.alive[i] and n.forwarding]

    def usable(self):
        return [i for i in range(len(self.edges))
                if self.alive[i] and (i, 1) not in self.cut and (i, 2) not in self.cut]


def find(parent, x):
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def components(n_segments, edges):
    parent = list(range(n_segments))
    for a, b in edges:
        parent[find(parent, a)] = find(parent, b)
    return [find(parent, x) for x in range(n_segments)]


def acyclic(n_segments, edges) -> bool:
    parent = list(range(n_segments))
    for a, b in edges:
        ra, rb = find(parent, a), find(parent, b)
        if ra == rb:
            return False
        parent[ra] = rb
    return True


def assert_no_cycle(sim, n_segments):
    edges = [sim.edges[i] for i in sim.forwarding()]
    assert acyclic(n_segments, edges), f"cycle among forwarding nodes at t={sim.now:.2f}: {edges}"


def assert_spanning(sim, n_segments):
    fwd = [sim.edges[i] for i in sim.forwarding()]
    assert acyclic(n_segments, fwd), f"cycle: {fwd}"
    want = components(n_segments, [sim.edges[i] for i in sim.usable()])
    got = components(n_segments, fwd)
    # same partition of segments
    assert len(set(zip(want, got))) == len(set(want)) == len(set(got)), (
        f"forwarding {fwd} does not span the graph {[sim.edges[i] for i in sim.usable()]}")


SETTLE = FORWARD_DELAY + MAX_AGE + 4 * HELLO_INTERVAL


graphs = st.integers(min_value=1, max_value=6).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)),
                                             min_size=1, max_size=9)))


@settings(max_examples=60, deadline=None)
@given(graphs, st.integers(0, 10**6), st.sampled_from([0.001, 0.01, 0.04]))
def test_converges_to_a_spanning_tree_and_never_loops(graph, seed, delay):
    n_segments, edges = graph
    sim = Sim(edges, delay=delay, seed=seed)
    sim.run(SETTLE, check=lambda s: assert_no_cycle(s, n_segments))
    assert_spanning(sim, n_segments)


@settings(max_examples=40, deadline=None)
@given(graphs, st.integers(0, 10**6), st.data())
def test_a_standby_takes_over_when_a_forwarding_node_dies(graph, seed, data):
    n_segments, edges = graph
    sim = Sim(edges, seed=seed)
    sim.run(SETTLE)
    fwd = sim.forwarding()
    if not fwd:
        return
    victim = data.draw(st.sampled_from(fwd))
    how = data.draw(st.sampled_from(["kill", "cut"]))
    if how == "kill":
        sim.kill(victim)      # silent: its hellos stop, the others time it out
    else:
        sim.disconnect(victim, data.draw(st.sampled_from([1, 2])))  # says bye on the other side
    sim.run(MAX_AGE + FORWARD_DELAY + 2 * HELLO_INTERVAL + 0.2, check=lambda s: assert_no_cycle(s, n_segments))
    assert_spanning(sim, n_segments)


def test_parallel_pair_one_forwards():
    sim = Sim([(0, 1), (0, 1)])
    sim.run(SETTLE)
    assert len(sim.forwarding()) == 1
    blocked = [e for _, _, e in sim.logs if e.kind == "blocked"]
    assert len(blocked) == 1 and "loop: side" in blocked[0].text and "already reached through n" in blocked[0].text


def test_self_loop_never_forwards_and_says_why():
    sim = Sim([(0, 0)])
    sim.run(SETTLE)
    assert sim.forwarding() == []
    (event,) = [e for _, _, e in sim.logs]
    assert event.kind == "blocked" and "both sides are on one segment" in event.text


def test_ring_of_three_blocks_one():
    sim = Sim([(0, 1), (1, 2), (2, 0)])
    sim.run(SETTLE)
    assert len(sim.forwarding()) == 2


def test_takeover_time_after_silent_death():
    sim = Sim([(0, 1), (0, 1)])
    sim.run(SETTLE)
    (active,) = sim.forwarding()
    sim.kill(active)
    start = sim.now
    while not sim.forwarding():
        sim.run(STEP)
        assert sim.now - start < MAX_AGE + FORWARD_DELAY + 2 * HELLO_INTERVAL
    assert sim.now - start >= FORWARD_DELAY


def test_paused_port_does_not_expire():
    node = Node(topology.new_id(), {1: "a", 2: "b"})
    node.port_up(1, 0)
    node.port_up(2, 0)
    better = Hello("0000" + "0" * 32, 1, "0001" + "0" * 32, 1, "other")
    node.received(2, better, 0.0)
    node.port_paused(2, True, 0.1)
    node.tick(10 * MAX_AGE)
    assert node.root == better.root
    node.port_paused(2, False, 10 * MAX_AGE)
    node.tick(10 * MAX_AGE + MAX_AGE / 2)
    assert node.root == better.root
    node.tick(12 * MAX_AGE)
    assert node.root == node.id


def test_hello_round_trip_and_hostile_input():
    h = Hello(topology.new_id(), 3, topology.new_id(), 2, "bridge x", "root y", bye=True)
    assert Hello.decode(h.encode()) == h
    for bad in [b"", b"nope", b"[]", b'{"v":2}', b'{"v":1,"root":"x","node":"y","cost":1,"port":1}',
                Hello(h.root, 3, h.node, 2).encode().replace(b'"cost":3', b'"cost":-1'),
                Hello(h.root, 3, h.node, 2).encode().replace(b'"cost":3', b'"cost":true'),
                b"\xff\xfe"]:
        with pytest.raises(ValueError):
            Hello.decode(bad)


def test_change_notice_re_announces():
    sim = Sim([(0, 1), (0, 1)])
    sim.run(SETTLE)
    before = sim.forwarding()
    for i, n in enumerate(sim.nodes):
        n.topology_changed(1, sim.now)
        sim._flush(i)
    sim.run(SETTLE, check=lambda s: assert_no_cycle(s, 2))
    assert sim.forwarding() == before


def test_node_ids_order_by_start_time_and_keep_the_priority():
    """A service restarted while the one that replaced it carries never outranks it (issue 34:
    a restarted bridge preempted the live one while it still delivered its takeover backlog)."""
    now = [1_700_000_000.0]
    first = topology.new_id(clock=lambda: now[0])
    now[0] += 0.002
    later = topology.new_id(clock=lambda: now[0])
    assert len(first) == len(later) == 36 and first[:4] == "8000"
    assert first < later                                           # the one started first wins
    assert topology.new_id(0x1000, clock=lambda: now[0]) < first   # a better priority still wins
    assert topology.new_id(clock=lambda: now[0]) != later          # the rest is random
    Hello(first, 0, later, 1, "a", "b")                             # a valid id on the wire
