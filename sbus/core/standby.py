"""A standby's window: what it saw on one side that the active path has not yet delivered on
the other (sans-I/O, plain Python; used by ``twistd sbus-bridge``).

A standby bridge subscribes on both its buses like the active one, so it sees each message
twice: where it was published, and where the active path delivered it. Messages are not
numbered on a bus, so the window pairs the two sightings by **content and order**: a message
seen on side X with key ``k`` and payload ``p``, which this bridge would forward to side Y as
``t`` (its rules, prefix rewriting included), waits in the window until ``(t, p)`` is seen on
Y; the oldest waiting copy is taken first. When the standby takes over it forwards what still
waits, in the order it was seen, and nothing twice: `Window.drain`.

Which sighting comes first is not fixed. The standby reads its two connections in turns, so
the active path's copy on Y may be read before the original on X (a burst queued on X). A
message seen on X that pairs with nothing is therefore kept both ways: as a message to forward
X -> Y, and as a possible early copy of something still unread on Y. Whichever pairing comes
first settles it. Before draining, the caller must have read everything its two servers
delivered up to one moment after the active path stopped (a whoami round trip on each side):
then every copy the active path made has met its original, and what waits is exactly what it
did not deliver.

Assumptions (docs/deploy.md, "Failover without loss"):

* **Identical messages.** Copies with the same key and payload are interchangeable: consecutive
  identical messages are counted, not told apart, which is exact. A message published on Y
  identical to one published on X within the window (same resulting key and payload) may be
  taken for the active path's copy of it; the standby would then not forward it at takeover.
* **The active path forwards what this bridge would**, in order (same rules, same buses). What
  it does not carry, while it visibly delivers later messages of the same side, is dropped after
  `SKIP_AGE` seconds and counted as ``skipped``, not as a loss.
* **The window is bounded**: at most `MAX_MESSAGES` messages and `MAX_BYTES` bytes (keys,
  payloads and `OVERHEAD` per message): at 5,000 msg/s, 20 s of traffic, and a takeover after
  ``kill -9`` takes about 3 s. What falls out of it unpaired, newer than the last message the
  active path was seen delivering, is counted as ``gap`` at the next takeover: those messages
  may be lost.
* **What the dead active wrote is routed before the drain.** A server held paused by flood
  control (a hard/block subscriber with a full queue) may not have read it when the round trip
  comes back, seconds after the death or not; drained then, it would arrive twice. The bridge
  therefore drains only once no server says the active's session is ``closing``
  (``server/session-held``: its peer is gone, its packets not all read; the bridge asks it at each takeover),
  bounded by `sbus.services.bridge.RELEASE_WAIT` with a warning past it. An active path that
  held no session there (died before claiming it, ``--session-linger 0``) is not waited for.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

MAX_MESSAGES = 100_000
MAX_BYTES = 64 * 1024 * 1024
SKIP_AGE = 10.0
#: What each message costs besides its key and payload (measured: about 600 bytes of records
#: and indexes for a small message), charged against `max_bytes`.
OVERHEAD = 512


def parse_size(value) -> int:
    """A ``--standby-window`` value (a whole number, at least 1); ValueError naming what is
    wrong, in one line, for the caller to report as a usage error."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--standby-window: not a whole number: {value!r}") from None
    if n < 1:
        raise ValueError("--standby-window: must be at least 1")
    return n


class _Record:
    __slots__ = ("rid", "side", "key", "payload", "units", "twin", "t", "size", "replay")

    def __init__(self, rid, side, key, payload, units, twin, t, replay=True):
        self.rid, self.side, self.key, self.payload = rid, side, key, payload
        self.replay = replay    # False: seen before watching began; only paired, never forwarded
        self.units = units      # target keys on the other side still awaiting the active's copy
        self.twin = twin        # may still be an early copy of a message unread on the other side
        self.t = t
        self.size = len(key) + len(payload) + OVERHEAD


class Window:
    """See the module docstring. `sides` are the two side names (``("a", "b")``)."""

    def __init__(self, sides=("a", "b"), *, max_messages: int = MAX_MESSAGES, max_bytes: int = MAX_BYTES,
                 skip_age: float = SKIP_AGE, clock=time.monotonic):
        if len(sides) != 2 or sides[0] == sides[1]:
            raise ValueError("a window has two distinct sides")
        if max_messages < 1 or max_bytes < 1:
            raise ValueError("window bounds must be positive")
        self.sides = tuple(sides)
        self.other = {sides[0]: sides[1], sides[1]: sides[0]}
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.skip_age = skip_age
        self.clock = clock
        self._records: OrderedDict[int, _Record] = OrderedDict()
        #: (side it would appear on, key, payload) -> record ids awaiting that copy (oldest first)
        self._wanted: dict[tuple, deque] = {}
        #: (side seen on, key, payload) -> record ids that may be early copies (oldest first)
        self._early: dict[tuple, deque] = {}
        self._next = 0
        self._bytes = 0
        #: per source side: the newest record id whose copy the active path delivered
        self._last_delivered = dict.fromkeys(sides, -1)
        #: per source side: ids of unpaired records pushed out by the bounds, newer than that
        self._overflow = {s: deque() for s in sides}
        #: per source side: more of them than `max_messages` (ids no longer kept)
        self._overflow_more = dict.fromkeys(sides, 0)
        #: the gap of the last `drain`, per source side
        self.last_gap = dict.fromkeys(sides, 0)
        #: hash((side, key, payload)) of copies still expected for records pushed out by the
        #: bounds -> their ids, and the order they were pushed out in (at most `max_messages`):
        #: a late copy of one is the active path's, not a message to forward back
        self._evicted: dict[int, object] = {}
        self._evicted_order: deque = deque()
        # counters, per source side (the direction source -> other)
        self.seen = dict.fromkeys(sides, 0)
        self.delivered = dict.fromkeys(sides, 0)
        self.skipped = dict.fromkeys(sides, 0)
        self.replayed = dict.fromkeys(sides, 0)
        self.gap = dict.fromkeys(sides, 0)

    def __len__(self):
        return len(self._records)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def pending(self) -> int:
        """Messages (target copies) that would be forwarded if the standby took over now."""
        return sum(len(r.units) for r in self._records.values() if r.replay)

    # -- input

    def seen_on(self, side, key: bytes, payload: bytes, targets=(), replay: bool = True) -> None:
        """A message arrived on `side`; `targets`: the keys this bridge would publish it as on the
        other side (empty if no rule forwards it that way). ``replay=False``: we are not yet sure
        to see both sightings of what arrives now (just subscribed): it only pairs with its
        other sighting, and is never forwarded nor counted as lost."""
        other = self.other[side]
        copy = (side, key, payload)
        rec = self._take(self._wanted, copy, lambda r: key in r.units)
        if rec is not None:                 # the active path's copy of a message seen on `other`
            rec.units.remove(key)
            rec.twin = False                # it was an original after all
            self._unindex(self._early, (rec.side, rec.key, rec.payload), rec.rid)
            self._delivered(rec)
            if not rec.units:
                self._drop(rec)
            return
        if self._evicted and self._late_copy(side, hash(copy)):
            return
        remaining = []
        early = False
        for target in targets:
            twin = self._take(self._early, (other, target, payload), lambda r: r.twin)
            if twin is None:
                remaining.append(target)
                continue
            # `twin` was our copy, read on `other` before we read this original: settled.
            early = True
            if twin.replay:
                self.seen[other] -= 1       # it was a copy, not a message published there
            self._drop(twin)
        if replay:
            self.seen[side] += 1
        if early:
            self.delivered[side] += 1
            self._last_delivered[side] = self._next
        if not remaining and early:
            self._next += 1
            return
        rec = _Record(self._next, side, key, payload, remaining, not early, self.clock(), replay)
        self._next += 1
        self._records[rec.rid] = rec
        self._bytes += rec.size
        for target in remaining:
            self._index(self._wanted, (other, target, payload), rec.rid)
        if rec.twin:
            self._index(self._early, copy, rec.rid)
        self._bound()

    # -- takeover

    def drain(self) -> list[tuple]:
        """What to forward now, in order: ``(source side, target key, payload)`` per copy. Counts
        the replayed copies and the gap, and empties the window."""
        out = []
        for rec in self._records.values():
            if not rec.replay:
                continue
            for target in rec.units:
                out.append((rec.side, target, rec.payload))
                self.replayed[rec.side] += 1
        for side, ids in self._overflow.items():
            self.last_gap[side] = len(ids) + self._overflow_more[side]
            self.gap[side] += self.last_gap[side]
        self.reset()
        return out

    def reset(self) -> None:
        """Forget everything (a side reconnected, or this bridge stopped forwarding)."""
        self._records.clear()
        self._wanted.clear()
        self._early.clear()
        self._evicted.clear()
        self._evicted_order.clear()
        self._bytes = 0
        for side in self.sides:
            self._overflow[side].clear()
            self._overflow_more[side] = 0
            self._last_delivered[side] = self._next - 1

    def stats(self) -> dict:
        return {"messages": len(self._records), "bytes": self._bytes, "pending": self.pending(),
                "max_messages": self.max_messages, "max_bytes": self.max_bytes}

    # -- inside

    # An index maps a content to one record id (an int: most contents are seen once) or to a
    # deque of them, oldest first (identical messages): a deque per record cost 600 bytes.

    def _take(self, index: dict, what: tuple, ok):
        while True:
            ids = index.get(what)
            if ids is None:
                return None
            rid = ids if type(ids) is int else ids[0]
            rec = self._records.get(rid)
            self._unindex(index, what, rid)
            if rec is not None and ok(rec):
                return rec

    @staticmethod
    def _index(index: dict, what: tuple, rid: int) -> None:
        ids = index.get(what)
        if ids is None:
            index[what] = rid
        elif type(ids) is int:
            index[what] = deque((ids, rid))
        else:
            ids.append(rid)

    @staticmethod
    def _unindex(index: dict, what: tuple, rid: int) -> None:
        ids = index.get(what)
        if ids is None:
            return
        if type(ids) is int:
            if ids == rid:
                del index[what]
            return
        if ids[0] == rid:
            ids.popleft()
        else:
            try:
                ids.remove(rid)
            except ValueError:
                return
        if len(ids) == 1:
            index[what] = ids[0]
        elif not ids:
            del index[what]

    def _delivered(self, rec: _Record) -> None:
        self._went_past(rec.side, rec.rid)

    def _went_past(self, side, rid: int) -> None:
        """The active path delivered record `rid` of `side`."""
        self.delivered[side] += 1
        if rid > self._last_delivered[side]:
            self._last_delivered[side] = rid
            overflow = self._overflow[side]
            while overflow and overflow[0] < rid:   # the active path went on past them
                overflow.popleft()
                self.skipped[side] += 1

    def _late_copy(self, side, h: int) -> bool:
        """Is a message on `side` (content hash `h`) the active path's copy of a record the bounds
        pushed out? Then that record was not lost after all."""
        ids = self._evicted.get(h)
        if ids is None:
            return False
        rid = ids if type(ids) is int else ids[0]
        self._unindex(self._evicted, h, rid)
        source = self.other[side]
        overflow = self._overflow[source]
        try:
            overflow.remove(rid)
        except ValueError:
            pass
        self._went_past(source, rid)
        return True

    def _drop(self, rec: _Record) -> None:
        del self._records[rec.rid]
        self._bytes -= rec.size
        other = self.other[rec.side]
        for target in rec.units:
            self._unindex(self._wanted, (other, target, rec.payload), rec.rid)
        if rec.twin:
            self._unindex(self._early, (rec.side, rec.key, rec.payload), rec.rid)

    def _bound(self) -> None:
        records = self._records
        while len(records) > self.max_messages or self._bytes > self.max_bytes:
            rec = next(iter(records.values()))
            self._drop(rec)
            if not rec.replay:
                continue
            other = self.other[rec.side]
            for target in rec.units:
                h = hash((other, target, rec.payload))
                self._index(self._evicted, h, rec.rid)
                self._evicted_order.append((h, rec.rid))
                if len(self._evicted_order) > self.max_messages:
                    self._unindex(self._evicted, *self._evicted_order.popleft())
            if rec.units:
                if rec.rid < self._last_delivered[rec.side]:
                    self.skipped[rec.side] += 1
                else:
                    overflow = self._overflow[rec.side]
                    overflow.append(rec.rid)
                    if len(overflow) > self.max_messages:
                        overflow.popleft()
                        self._overflow_more[rec.side] += 1   # too many to keep: a gap whatever comes
        # Old records the active path went past (it delivered later ones of that side): it does
        # not carry them. Old records without anything to forward: never paired, not a loss.
        now = self.clock()
        while records:
            rec = next(iter(records.values()))
            if now - rec.t < self.skip_age:
                break
            if rec.replay and rec.units and rec.rid > self._last_delivered[rec.side]:
                break                       # may still be the active path's loss: keep it
            self._drop(rec)
            if rec.replay and rec.units:
                self.skipped[rec.side] += 1
