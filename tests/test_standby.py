"""The standby's window (sbus.core.standby), sans-I/O: what a standby bridge forwards when it
takes over is exactly what the active path did not deliver, in order, nothing twice."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbus.core.standby import OVERHEAD, Window, parse_size


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def seen(w, side, key, payload=b"", targets=None):
    """A message on `side` that a '' both bridge forwards unchanged (or to `targets`)."""
    w.seen_on(side, key, payload, [key] if targets is None else targets)


def test_what_the_active_path_delivered_is_not_replayed():
    w = Window()
    for i in range(5):
        seen(w, "a", b"k%d" % i)
    for i in range(3):
        seen(w, "b", b"k%d" % i)      # the active path's copies on b
    assert w.drain() == [("a", b"k3", b""), ("a", b"k4", b"")]
    assert w.delivered == {"a": 3, "b": 0} and w.replayed == {"a": 2, "b": 0}
    assert w.gap == {"a": 0, "b": 0} and len(w) == 0


def test_a_copy_read_before_its_original_settles_both():
    w = Window()
    seen(w, "b", b"k0")               # the copy, read first (a burst queued on a)
    seen(w, "a", b"k0")               # then the original
    seen(w, "a", b"k1")
    assert w.drain() == [("a", b"k1", b"")]
    assert sum(w.delivered.values()) == 1


def test_a_copy_read_early_without_a_rule_back_is_still_paired():
    w = Window()
    w.seen_on("b", b"s/k", b"p", [])               # no b>a rule: nothing to forward back
    w.seen_on("a", b"k", b"p", [b"s/k"])           # a>b with prefix s/
    w.seen_on("a", b"k2", b"p", [b"s/k2"])
    assert w.drain() == [("a", b"s/k2", b"p")]


def test_messages_from_both_sides_in_one_window():
    w = Window()
    seen(w, "a", b"x")
    seen(w, "b", b"y")
    seen(w, "a", b"y")                # the copy of b's y
    seen(w, "b", b"z")
    assert w.drain() == [("a", b"x", b""), ("b", b"z", b"")]


def test_identical_consecutive_messages_are_counted():
    w = Window()
    for _ in range(3):
        seen(w, "a", b"k", b"same")
    seen(w, "b", b"k", b"same")
    seen(w, "b", b"k", b"same")
    assert w.drain() == [("a", b"k", b"same")]


def test_the_payload_is_part_of_the_match():
    w = Window()
    seen(w, "a", b"k", b"1")
    seen(w, "a", b"k", b"2")
    seen(w, "b", b"k", b"2")          # not a copy of the first: a copy of the second... out of order
    assert w.drain() == [("a", b"k", b"1")]


def test_rewritten_keys_are_matched_as_they_appear_on_the_other_side():
    w = Window()
    w.seen_on("a", b"sensors/t", b"1", [b"site1/sensors/t"])
    w.seen_on("b", b"sensors/t", b"1", [])         # not the copy: it is under site1/
    w.seen_on("b", b"site1/sensors/t", b"1", [])
    w.seen_on("a", b"sensors/t", b"2", [b"site1/sensors/t", b"all/sensors/t"])
    w.seen_on("b", b"all/sensors/t", b"2", [])
    assert w.drain() == [("a", b"site1/sensors/t", b"2")]


def test_past_the_bound_the_oldest_unpaired_are_counted_as_the_gap():
    w = Window(max_messages=10)
    for i in range(15):
        seen(w, "a", b"k%d" % i)
    out = w.drain()
    assert [k for _, k, _ in out] == [b"k%d" % i for i in range(5, 15)]
    assert w.gap == {"a": 5, "b": 0} and w.replayed["a"] == 10


def test_the_byte_bound():
    w = Window(max_bytes=10 * (100 + 2 + OVERHEAD))
    for i in range(20):
        seen(w, "a", b"k%d" % (i % 10), b"x" * 100)
    assert len(w) == 10
    w.drain()
    assert w.gap["a"] == 10


def test_what_the_active_path_skipped_is_not_a_gap():
    w = Window(max_messages=4)
    seen(w, "a", b"skipped")          # the active path does not carry it (other rules)
    for i in range(4):
        seen(w, "a", b"k%d" % i)      # the fifth record pushes "skipped" out
    for i in range(3):
        seen(w, "b", b"k%d" % i)      # the active path went on past it
    assert w.drain() == [("a", b"k3", b"")]
    assert w.gap == {"a": 0, "b": 0} and w.skipped == {"a": 1, "b": 0}


def test_skipped_messages_age_out():
    clock = Clock()
    w = Window(skip_age=10.0, clock=clock)
    seen(w, "a", b"skipped")
    seen(w, "a", b"k")
    seen(w, "b", b"k")                # the active path went past it
    clock.now = 11.0
    seen(w, "a", b"later")
    assert w.skipped["a"] == 1
    assert w.drain() == [("a", b"later", b"")]


def test_unpaired_messages_never_delivered_past_do_not_age_out():
    """The active path died: what it did not deliver stays, however long the takeover takes."""
    clock = Clock()
    w = Window(skip_age=1.0, clock=clock)
    seen(w, "a", b"k0")
    seen(w, "b", b"k0")
    seen(w, "a", b"k1")
    clock.now = 100.0
    seen(w, "a", b"k2")
    assert w.drain() == [("a", b"k1", b""), ("a", b"k2", b"")]


def test_reset_forgets():
    w = Window()
    seen(w, "a", b"k")
    w.reset()
    seen(w, "b", b"k")                # now taken for a message published on b
    assert w.drain() == [("b", b"k", b"")]


def test_bad_arguments():
    with pytest.raises(ValueError):
        Window(("a", "a"))
    with pytest.raises(ValueError):
        Window(max_messages=0)


# ---------------------------------------------------------------- property


@st.composite
def flows(draw):
    """Messages published on a and b (contents repeat within a side), the active path dying
    after delivering a prefix of each side's messages, and the order the standby reads its two
    connections in."""
    n = draw(st.integers(0, 40))
    msgs = [(draw(st.sampled_from("ab")), draw(st.sampled_from([b"x", b"y"])), draw(st.sampled_from([b"1", b"2"])))
            for _ in range(n)]
    dies = draw(st.integers(0, n))
    # bus streams in time order: an original at publication, its copy (if delivered) a little later
    delays = [draw(st.integers(0, 5)) for _ in range(n)]
    events = []
    last_copy = {"a": -1, "b": -1}    # the active path forwards in order: copies keep it
    for i, (side, key, payload) in enumerate(msgs):
        k = side.encode() + b"/" + key    # contents never repeat across sides (an assumption)
        events.append((2 * i, side, k, payload))
        if i < dies:
            other = "b" if side == "a" else "a"
            t = max(2 * i + 1 + 2 * delays[i], last_copy[side] + 2)
            last_copy[side] = t
            events.append((t, other, k, payload))
    copies = sorted((e for e in events if e[0] % 2), key=lambda e: e[0])
    ordered = []
    for side in "ab":
        origs = [e for e in events if e[0] % 2 == 0 and e[1] == side]
        cps = [e for e in copies if e[1] == side]
        ordered.append(sorted(origs + cps, key=lambda e: e[0]))
    reads = draw(st.lists(st.booleans(), min_size=len(ordered[0]) + len(ordered[1]),
                          max_size=len(ordered[0]) + len(ordered[1])))
    return msgs, dies, ordered, reads


@settings(max_examples=300, deadline=None)
@given(flows())
def test_takeover_forwards_exactly_what_was_not_delivered(flow):
    msgs, dies, (on_a, on_b), reads = flow
    w = Window()
    streams = {"a": list(on_a), "b": list(on_b)}
    for pick_a in reads:
        side = "a" if (pick_a and streams["a"]) or not streams["b"] else "b"
        _, s, key, payload = streams[side].pop(0)
        w.seen_on(s, key, payload, [key])
    out = w.drain()
    lost = [(side, side.encode() + b"/" + key, payload) for side, key, payload in msgs[dies:]]
    for side in "ab":
        assert [o for o in out if o[0] == side] == [x for x in lost if x[0] == side]
    assert w.gap == {"a": 0, "b": 0}


def test_a_late_copy_of_a_message_pushed_out_is_not_forwarded_back():
    """More in flight on the active path than the window holds: the copies that come after
    their originals were pushed out are the active path's, not messages published there."""
    w = Window(max_messages=3)
    for i in range(6):
        seen(w, "a", b"k%d" % i)
    for i in range(6):
        seen(w, "b", b"k%d" % i)
    assert w.drain() == []
    assert w.gap == {"a": 0, "b": 0} and w.delivered == {"a": 6, "b": 0}


def test_a_gap_longer_than_the_window_is_counted_whole():
    w = Window(max_messages=3)
    for i in range(20):
        seen(w, "a", b"k%d" % i)
    assert len(w.drain()) == 3
    assert w.gap == {"a": 17, "b": 0} and w.last_gap == {"a": 17, "b": 0}


def test_what_was_seen_before_watching_only_pairs():
    """Just subscribed: a sighting whose other half came before we subscribed must not be
    forwarded at takeover, but what pairs with it later is settled."""
    w = Window()
    w.seen_on("b", b"copy-of-old", b"", [b"copy-of-old"], replay=False)  # its original came before
    w.seen_on("a", b"orig", b"", [b"orig"], replay=False)
    seen(w, "b", b"orig")                           # watching now: the copy of "orig"
    seen(w, "a", b"new")
    w.seen_on("b", b"old", b"", [b"old"], replay=False)   # never paired: not forwarded, not lost
    assert w.drain() == [("a", b"new", b"")]
    assert w.gap == {"a": 0, "b": 0}


def test_one_direction_as_a_link_half_keeps_it():
    """sbus-link: a half watches only the direction it publishes (peer -> bus). Its own bus's
    sightings carry no targets: they pair with the peer's messages (a copy read before or after
    its original) and are never forwarded themselves."""
    w = Window(("peer", "bus"))
    w.seen_on("bus", b"k1", b"1", ())           # another path's copy, read before the original
    w.seen_on("bus", b"local", b"x", ())        # a message published on our own bus
    w.seen_on("peer", b"k1", b"1", (b"k1",))    # the original: settled by the early copy
    w.seen_on("peer", b"k2", b"2", (b"k2",))
    w.seen_on("bus", b"k2", b"2", ())           # its copy, after it: settled
    w.seen_on("peer", b"k3", b"3", (b"k3",))    # never delivered by the active path
    assert w.drain() == [("peer", b"k3", b"3")]
    assert w.delivered == {"peer": 2, "bus": 0} and w.replayed == {"peer": 1, "bus": 0}


def test_parse_size_says_what_is_wrong_in_one_line():
    assert parse_size("300") == 300
    for value, needle in (("0", "must be at least 1"), ("many", "not a whole number"), ("-3", "at least 1")):
        with pytest.raises(ValueError, match=needle):
            parse_size(value)
