"""Named sessions that linger after their connection dies (sans-I/O).

A service that is killed and restarted cannot know what was published for it while it was
dead; the server can. A connection that names its session (``CMSG server/session\\0NAME\\0LINGER``,
docs/protocol.md "Sessions") leaves, when it closes, a `Lingering` stand-in that keeps its patterns
for LINGER seconds and counts every message that matches them. Its successor (same uid, same name)
claims it and is told how many it missed and how long the gap was, so a loss nobody alive could
see is still counted, by the successor (as an MQTT persistent session would, without queueing).

The table only keeps names and counts; the server's shell moves patterns, charges the uid and
runs the expiry timers.
"""

from __future__ import annotations

import math

from sbus.core.codec import CONFIRM_FLAG
from sbus.core.codec import MAX_SESSION_NAME as MAX_NAME
from sbus.core.codec import check_session_name
from sbus.core.codec import session_reply as reply

__all__ = ["SessionTable", "Lingering", "SessionRefused", "parse_request", "parse_ack", "reply",
           "NEW", "RESUMED", "BUSY", "REFUSED", "MAX_NAME", "DEFAULT_MAX_LINGER"]

NEW = b"new"
RESUMED = b"resumed"
BUSY = b"busy"
REFUSED = b"refused"
DEFAULT_MAX_LINGER = 60.0


class SessionRefused(ValueError):
    """A request the server cannot take: the text says why (one log line)."""


def parse_request(payload: bytes, max_linger: float) -> tuple[bytes, float, bool]:
    """``NAME\\0LINGER[\\0confirm]`` -> (name, linger clamped to `max_linger`, whether the count
    is kept until confirmed); raises `SessionRefused`."""
    name, sep, text = payload.partition(b"\0")
    text, flagged, flag = text.partition(b"\0")
    if flagged and flag != CONFIRM_FLAG:
        raise SessionRefused(f"unknown flag {flag[:20]!r} after the linger (only {CONFIRM_FLAG.decode()})")
    try:
        check_session_name(name)
    except ValueError as e:
        raise SessionRefused(str(e)) from None
    if not sep:
        raise SessionRefused("no linger after the session name (NAME\\0SECONDS)")
    try:
        linger = float(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise SessionRefused(f"linger {text[:20]!r} is not a number of seconds") from None
    if not math.isfinite(linger) or linger < 0:
        raise SessionRefused(f"linger {text[:20]!r} is not a number of seconds >= 0")
    return name, min(linger, max_linger), bool(flagged)


def parse_ack(payload: bytes) -> tuple[bytes, int]:
    """``NAME\0COUNT`` (``server/session-ack``) -> (name, packets read); raises `SessionRefused`."""
    name, sep, text = payload.partition(b"\0")
    try:
        check_session_name(name)
    except ValueError as e:
        raise SessionRefused(str(e)) from None
    if not sep or not text.isdigit() or len(text) > 20:
        raise SessionRefused(f"count {text[:24]!r} after the session name is not a number of packets")
    return name, int(text)


class Lingering:
    """A closed connection's stand-in in the router: it holds the patterns and counts what they
    match. It has what the delivery loop asks of a recipient (`deliver`, `echo`, `ownerAlive`),
    so routing treats it like any client and needs no test of its own on the hot path."""

    __slots__ = ("uid", "name", "missed", "carried", "left", "linger", "subscriptions", "subscription_bytes",
                 "timer")
    echo = True

    def __init__(self, uid: int, name: bytes, left: float, linger: float, missed: int = 0, carried: int = 0):
        self.uid = uid
        self.name = name
        #: Messages that matched while nobody held the session (what was still queued, unsent,
        #: for the connection when it closed included), plus `carried`.
        self.missed = missed + carried
        #: Of `missed`: the count the closed holder was told at its claim and never confirmed.
        self.carried = carried
        self.left = left
        self.linger = linger
        #: What its patterns cost, still charged to the uid until it ends.
        self.subscriptions = 0
        self.subscription_bytes = 0
        #: The shell's expiry call.
        self.timer = None

    def __hash__(self):
        # By what it is, not where it lives in memory: sets of recipients iterate in the same
        # order in every run (the simulator replays a seed exactly). Equality stays identity.
        return hash((self.uid, self.name))

    def deliver(self, packet: bytes, feeder=None, key: bytes = b"") -> None:
        self.missed += 1

    def runRoom(self) -> tuple[int, int]:
        return 1 << 62, 1 << 62  # it only counts

    def deliverRun(self, packets: list, nbytes: int) -> None:
        self.missed += len(packets)

    def ownerAlive(self) -> bool:
        """No secret key reaches a stand-in: secrets belong to a live process."""
        return False

    def __repr__(self):
        return f"<session {self.name!r} of uid {self.uid}, lingering>"


class SessionTable:
    """Per uid and name: the live connection holding it, or its `Lingering` stand-in."""

    def __init__(self):
        self._held: dict[tuple[int, bytes], object] = {}  # (uid, name) -> client
        self._names: dict[object, tuple[bytes, float]] = {}  # client -> (name, linger)
        self._unconfirmed: dict[object, int] = {}  # client -> the count it was told, until it confirms
        self._acked: dict[object, int] = {}  # client -> packets it says it read and handed on
        self._lingering: dict[tuple[int, bytes], Lingering] = {}
        #: Totals for `server/stats`.
        self.resumed = 0
        self.expired = 0
        self.missed_expired = 0

    def name_of(self, client) -> tuple[bytes, float] | None:
        return self._names.get(client)

    def claim(self, client, uid: int, name: bytes, linger: float,
              confirm: bool = False) -> tuple[bytes, Lingering | None]:
        """`client` asks to hold `name`: (NEW or RESUMED, the stand-in it takes over, which the
        shell ends), or (BUSY, None) if another live connection holds it. Raises `SessionRefused`
        if `client` holds another name. `confirm`: the count the stand-in had stays with the
        session until `confirm(client)`; a close before that hands it to the next stand-in."""
        mine = self._names.get(client)
        if mine is not None and mine[0] != name:
            raise SessionRefused(f"this connection holds session {mine[0][:40]!r} already")
        holder = self._held.get((uid, name))
        if holder is not None and holder is not client:
            return BUSY, None
        self._held[(uid, name)] = client
        self._names[client] = (name, linger)
        ghost = self._lingering.pop((uid, name), None)
        if ghost is None:
            return NEW, None
        self.resumed += 1
        if confirm and ghost.missed:
            self._unconfirmed[client] = self._unconfirmed.get(client, 0) + ghost.missed
        return RESUMED, ghost

    def holder(self, uid: int, name: bytes):
        """The live connection holding `uid`'s session `name`, or None (lingering or unknown):
        asked without claiming (``server/session-held``)."""
        return self._held.get((uid, name))

    def confirm(self, client, name: bytes) -> int | None:
        """`client` recorded the count of its claim of `name`: the count it drops (0 if none was
        unconfirmed), or None if `client` does not hold `name`."""
        entry = self._names.get(client)
        if entry is None or entry[0] != name:
            return None
        return self._unconfirmed.pop(client, 0)

    def ack(self, client, name: bytes, count: int) -> bool:
        """`client` read and handed on `count` packets of its connection (its latest word
        counts); False if it does not hold `name`."""
        entry = self._names.get(client)
        if entry is None or entry[0] != name:
            return False
        self._acked[client] = count
        return True

    def leave(self, client, uid: int) -> tuple[bytes, float, int, int | None] | None:
        """`client` closed: (its name, its linger, the count it was told and never confirmed,
        the packets it last said it read or None) if it held one; the name is free again."""
        entry = self._names.pop(client, None)
        carried = self._unconfirmed.pop(client, 0)
        acked = self._acked.pop(client, None)
        if entry is None:
            return None
        del self._held[(uid, entry[0])]
        return entry[0], entry[1], carried, acked

    def linger(self, ghost: Lingering) -> None:
        """Keep `ghost` until it is claimed or `expire`d (a name has at most one)."""
        self._lingering[(ghost.uid, ghost.name)] = ghost

    def expire(self, ghost: Lingering) -> bool:
        """Its time is up; False if it was claimed meanwhile."""
        if self._lingering.get((ghost.uid, ghost.name)) is not ghost:
            return False
        del self._lingering[(ghost.uid, ghost.name)]
        self.expired += 1
        self.missed_expired += ghost.missed
        return True

    def lingering(self) -> list[Lingering]:
        return list(self._lingering.values())

    def stats(self, uid: int | None = None) -> dict:
        """Counts for `server/stats`: every uid's, or (`uid`) one uid's live and lingering ones."""
        if uid is None:
            held, lingering = len(self._held), len(self._lingering)
        else:
            held = sum(1 for u, _ in self._held if u == uid)
            lingering = sum(1 for u, _ in self._lingering if u == uid)
        result = {"held": held, "lingering": lingering}
        if uid is None:
            result.update(resumed=self.resumed, expired=self.expired, missed=self.missed_expired)
        return result
