"""`sbus.core.flood.Outbox` against a plain model, and the cost of switching order (issue 10 item 9)."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from sbus.core import flood
from sbus.core.flood import Outbox

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(1, 6)),
        st.tuples(st.just("pop"), st.just(0)),
        st.tuples(st.just("order"), st.sampled_from(sorted(flood.ORDERS))),
    ),
    max_size=200,
)


def _model_next(model, order):
    if order == flood.FIFO:
        return min(model)
    if order == flood.STACK:
        return max(model)
    return min(model, key=lambda e: (-len(e[1]), e[0]))


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_outbox_drains_in_the_chosen_order_across_switches(ops):
    box = Outbox(1 << 30, 1 << 30)
    model = []  # (seq, packet)
    seq = 0
    for op, arg in ops:
        if op == "push":
            seq += 1
            packet = b"%d:" % seq + b"x" * arg
            box.push(packet)
            model.append((seq, packet))
        elif op == "order":
            box.set_order(arg)
        elif model:
            if not box.blocked:
                box.refused()  # the packets wait for a full socket: the order applies to them
            want = _model_next(model, box.order)
            assert box.peek() == want[1]
            assert box.pop() == want[1]
            model.remove(want)
        assert len(box) == len(model)
        assert box.nbytes == sum(len(p) for _, p in model)
        assert bool(box) == bool(model)


def test_switching_order_does_not_touch_the_queue():
    """16k packets queued, 4,000 switches between random and queue: the old code re-sorted the
    whole queue on each (about 3 ms each, 12 s); now each switch is O(1)."""
    box = Outbox(1 << 30, 1 << 30)
    for i in range(16384):
        box.push(b"p" * (1 + i % 97))
    box.set_order(flood.LARGEST)  # the one-time conversion, outside the timed part
    t0 = time.perf_counter()
    for _ in range(2000):
        box.set_order(flood.FIFO)
        box.set_order(flood.LARGEST)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"4,000 order switches took {elapsed:.2f} s"
    assert len(box) == 16384
    box.refused()  # they wait for a full socket: the order applies
    sizes = [len(box.pop()) for _ in range(100)]
    assert sizes == sorted(sizes, reverse=True)


def test_dead_entries_do_not_pile_up():
    box = Outbox(1 << 30, 1 << 30)
    box.set_order(flood.LARGEST)
    box.set_order(flood.FIFO)
    for i in range(10000):
        box.push(b"x" * (1 + i % 7))
        box.pop()
    assert len(box._heap) < 200 and len(box._items) < 200


_queue_ops = st.lists(st.one_of(
    st.tuples(st.just("offer"), st.integers(1, 40)),
    st.tuples(st.just("control"), st.integers(1, 40)),
    st.tuples(st.just("send"), st.integers(1, 5)),
    st.tuples(st.just("refuse"), st.just(0)),
    st.tuples(st.just("writable"), st.just(0)),
    st.tuples(st.just("order"), st.sampled_from(sorted(flood.ORDERS))),
), max_size=30)


def _drive(box: Outbox, ops) -> None:
    seq = 0
    for op, arg in ops:
        seq += 1
        if op == "offer":
            if box.offer(b"%d:" % seq + b"m" * arg) == flood.FLUSH:
                box.decide(b"%d:" % seq + b"m" * arg)
        elif op == "control":
            box.push_control(b"%d:" % seq + b"c" * arg)
        elif op == "send" and box.nbytes:
            batch = box.head(arg)
            if batch:
                box.sent(len(batch))
        elif op == "refuse" and box.nbytes:
            box.refused()
        elif op == "writable":
            box.writable()
        elif op == "order":
            box.set_order(arg)


@settings(max_examples=400, deadline=None)
@given(_queue_ops, st.lists(st.integers(1, 60), min_size=1, max_size=20), st.integers(64, 600),
       st.integers(2, 24))
def test_a_run_queued_at_once_is_what_offer_would_queue_message_by_message(ops, sizes, max_bytes, max_packets):
    """The broker queues a publisher's run of messages for the same recipients at once
    (`Outbox.room`, `take`): wherever `room` says the run fits, `offer` would have queued every
    one of them (QUEUED, never FLUSH or a decision), and both leave the same queue."""
    one, two = Outbox(max_bytes, max_packets), Outbox(max_bytes, max_packets)
    _drive(one, ops)
    _drive(two, ops)
    room = one.room()
    run = [b"r%d:" % i + b"x" * n for i, n in enumerate(sizes)]
    nbytes = sum(map(len, run))
    if room is None or nbytes > room[0] or len(run) > room[1]:
        return
    one.take(run, nbytes)
    for packet in run:
        assert two.offer(packet) == flood.QUEUED, "room said it fits, offer would not simply queue it"
    assert (len(one), one.nbytes, one.state()) == (len(two), two.nbytes, two.state())
    drained = [[], []]
    for box, out in zip((one, two), drained):
        while box.nbytes:
            out.append(box.peek())
            box.pop()
    assert drained[0] == drained[1]
