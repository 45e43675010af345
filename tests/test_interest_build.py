"""The interest table is built in slices (issue 32 fault 8): the first `server/interest` of any
uid over many held patterns does not stop the bus for the build. The broker runs on the
simulator's fake kernel (sbus.simulator), so each reactor turn is one step we take."""

from __future__ import annotations

from sbus.simulator import Proc, Simulation


def _roomy(seed: int, path: str) -> Simulation:
    """A simulated bus whose limits are the defaults' size, not the simulator's small ones."""
    sim = Simulation(seed, path, 0)
    cfg = sim.config
    cfg.max_subscriptions = cfg.max_uid_subscriptions = 1 << 20
    cfg.max_subscription_bytes = cfg.max_uid_subscription_bytes = 1 << 30
    cfg.queue_bytes = cfg.max_uid_queue_bytes = cfg.max_queue_bytes = cfg.queue_control_bytes = 1 << 26
    cfg.queue_packets = 1 << 16
    cfg.max_uid_connections = 100
    cfg.drain_cap = 64
    sim.work.tick = 1e-6  # a request costs next to nothing: no uid waits for its share here
    return sim


def _turn(sim) -> None:
    """One reactor turn: every ready descriptor once, then the timers that are due."""
    for sel, ev in sim.reactor.ready():
        sim.reactor.serve(sel, ev)
    sim.reactor.advance(0)


def test_a_first_watcher_over_many_patterns_does_not_stop_the_bus():
    sim = _roomy(1, "pure")
    holder = sim.connect(Proc(11, 0, 0), 1 << 26)
    root = sim.connect(Proc(12, 0, 0), 1 << 26)
    watcher = sim.connect(Proc(13, 65534, 65534), 1 << 26)
    n = 25_000
    for i in range(n):
        holder.sock.send(b"SUB p/%d" % i)
        if i % 500 == 499:
            for _ in range(20):
                _turn(sim)
    while holder.proto.subscriptions < n:
        _turn(sim)
    sim.factory.interest_slice = 1000
    watcher.sock.send(b"CMSG server/interest")
    watcher.sock.send(b"CMSG !/cred/whoami")
    _turn(sim)  # the request is read: one slice of the build, not all of it
    assert not sim.factory.interest_ready
    root.sock.send(b"CMSG !/cred/whoami")
    _turn(sim)
    assert root.sock.recv().startswith(b"CMSG !/cred/whoami\0")  # answered during the build
    assert not sim.factory.interest_ready
    turns = 0
    while not sim.factory.interest_ready:
        _turn(sim)
        turns += 1
    assert turns >= n // 1000 - 2
    # The watcher (another uid) sees only its own uid's patterns: an empty listing, then its reply.
    got = []
    for _ in range(200):
        _turn(sim)
        try:
            got.append(watcher.sock.recv())
        except BlockingIOError:
            if got and got[-1].startswith(b"CMSG !/cred/whoami"):
                break
    assert got[0] == b"CMSG server/interest\0=" and got[-1].startswith(b"CMSG !/cred/whoami\0"), got[:3]


def test_a_root_watcher_gets_every_pattern_once_the_build_is_done():
    sim = _roomy(2, "batch")
    holder = sim.connect(Proc(21, 1000, 1000), 1 << 26)
    watcher = sim.connect(Proc(22, 0, 0), 1 << 26)
    for i in range(40):
        holder.sock.send(b"SUB q/%d" % i)
    for _ in range(50):
        _turn(sim)
    sim.factory.interest_slice = 7
    watcher.sock.send(b"CMSG server/interest")
    holder.sock.send(b"UNSUB q/0")  # changes during the build are kept
    holder.sock.send(b"SUB r/new")
    seen = set()
    for _ in range(200):
        _turn(sim)
        while True:
            try:
                packet = watcher.sock.recv()
            except BlockingIOError:
                break
            seen.add(packet)
    listed = {p[len(b"CMSG server/interest\0"):] for p in seen}
    assert b"=" in listed
    assert {b"+\0q/%d" % i for i in range(1, 40)} <= listed and b"+\0r/new" in listed, sorted(listed)[:5]
    assert b"+\0q/0" not in listed or b"-\0q/0" in listed
