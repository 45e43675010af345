"""An importer acknowledges only what has left it for its bus, and still acknowledges when its
bus queue never empties (CI, loaded: a queue that was never empty at an ack tick starved the
acks, and the importer's next restart went uncounted by its exporter)."""

from __future__ import annotations

from sbus.services.nats import AckGate


class Edge:
    """The kernel's edge of a transport: packets queued in the process and written so far."""

    def __init__(self):
        self.queue = 0
        self.packets_out = 0

    def queuedBytes(self):
        return self.queue * 100

    def queued(self):
        return self.queue

    def arrive(self, n=1):
        self.queue += n

    def write(self, n=1):
        n = min(n, self.queue)
        self.queue -= n
        self.packets_out += n


def test_an_empty_queue_lets_everything_seen_be_acknowledged():
    gate, t = AckGate(), Edge()
    assert gate.upto({"i": ["1", "5", None, 0.0]}, t) is None


def test_a_queue_that_never_empties_still_lets_acks_through_one_mark_behind():
    gate, t = AckGate(), Edge()
    seen = {"i": ["1", "1", None, 0.0]}
    acked = []
    for n in range(2, 200):
        t.arrive(3)                # more arrives each tick than is written: never empty
        seen["i"][1] = str(n)
        t.write(2)
        upto = gate.upto(seen, t)
        assert upto is not None, "the queue is never empty"
        if upto:
            acked.append(int(upto["i"]))
    assert t.queue > 0
    assert len(acked) > 5, "acks starved while the queue never emptied"
    assert acked == sorted(acked)


def test_nothing_is_acknowledged_before_it_has_left():
    gate, t = AckGate(), Edge()
    seen = {"i": ["1", "10", None, 0.0]}
    t.arrive(10)
    assert gate.upto(seen, t) == {}           # the mark is set: 10 packets to go
    seen["i"][1] = "15"
    t.arrive(5)
    t.write(9)
    assert gate.upto(seen, t) == {}           # one of the first ten is still here
    t.write(1)
    assert gate.upto(seen, t) == {"i": "10"}  # the first ten left; 11..15 have not


def test_a_new_connection_starts_a_new_mark():
    gate, old, new = AckGate(), Edge(), Edge()
    seen = {"i": ["1", "4", None, 0.0]}
    old.arrive(4)
    assert gate.upto(seen, old) == {}
    old.write(4)
    new.arrive(1)
    assert gate.upto(seen, new) == {}, "the old connection's count says nothing of the new one"
