"""Who holds a connection's reading paused, counted once (no Twisted here).

A publisher may be held by several parties at once: every subscriber in a
`block` mode whose queue it filled, a relay whose upward queue it filled,
the server while its own replies to it wait. `Pauses` counts them for one
producer: the first hold pauses it, the last release resumes it. `Holds`
is one party's set of producers it holds (each at most once), released all
together when that party's queue drains or it goes away. `HoldBudget` bounds
how long holding may last.
"""

from __future__ import annotations


class Pauses:
    """How many holds keep one producer (anything with pauseProducing/resumeProducing) paused."""

    __slots__ = ("producer", "count")

    def __init__(self, producer):
        self.producer = producer
        self.count = 0

    def hold(self) -> None:
        self.count += 1
        if self.count == 1:
            self.producer.pauseProducing()

    def release(self) -> None:
        if self.count <= 0:
            raise RuntimeError("released a producer that nobody holds")
        self.count -= 1
        if self.count == 0:
            self.producer.resumeProducing()

    def __bool__(self) -> bool:
        return self.count > 0

    def __repr__(self):
        return f"<Pauses {self.count} of {self.producer!r}>"


class Holds:
    """The `Pauses` one party holds, each at most once."""

    __slots__ = ("_held",)

    def __init__(self):
        #: A dict as an ordered set: released in the order held (the same run twice is the same
        #: run: the simulator replays a seed exactly).
        self._held: dict[Pauses, None] | None = None

    def add(self, pauses: Pauses) -> bool:
        """Hold `pauses` (no-op if already held); True if this is a new hold."""
        held = self._held
        if held is None:
            held = self._held = {}
        elif pauses in held:
            return False
        held[pauses] = None
        pauses.hold()
        return True

    def discard(self, pauses: Pauses) -> None:
        """Let one go (it went away, or needs releasing early)."""
        if self._held and pauses in self._held:
            del self._held[pauses]
            pauses.release()

    def release(self, keep=()) -> int:
        """Let every held producer go but those in `keep`; return how many went."""
        held = self._held
        if not held:
            return 0
        if keep:
            gone = [p for p in held if p not in keep]
            for pauses in gone:
                del held[pauses]
                pauses.release()
            return len(gone)
        self._held = None
        for pauses in held:
            pauses.release()
        return len(held)

    def __len__(self) -> int:
        return len(self._held) if self._held else 0

    def __bool__(self) -> bool:
        return bool(self._held)

    def __contains__(self, pauses) -> bool:
        return bool(self._held) and pauses in self._held


class HoldBudget:
    """Seconds its holders may keep publishers paused beyond the time they let them run.

    While any holder holds, the budget is spent at one second per second; while none does, it
    is earned back, up to `limit`. One budget may be shared (all connections of a uid, kept after
    they close), so that holding from several connections, or reconnecting, earns nothing."""

    __slots__ = ("limit", "credit", "since", "holders", "shared")

    def __init__(self, limit: float, now: float, shared: bool = False):
        self.limit = limit
        self.shared = shared
        self.credit = limit
        self.since = now
        self.holders: set = set()

    def start(self, holder, now: float) -> float:
        """`holder` starts holding: the seconds left before the budget is spent."""
        if not self.holders:
            self.credit = min(self.limit, self.credit + (now - self.since))
            self.since = now
        self.holders.add(holder)
        return self.credit - (now - self.since)

    def stop(self, holder, now: float) -> None:
        if holder in self.holders:
            self.holders.discard(holder)
            if not self.holders:
                self.credit -= now - self.since
                self.since = now

    def idle(self, now: float) -> bool:
        """Nobody holds and the whole budget is earned back: nothing to remember."""
        return not self.holders and self.credit + (now - self.since) >= self.limit
