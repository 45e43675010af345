"""Shared work queues, sans I/O: the member's side (`Membership`) and the service's (`QueueCore`).

The wire protocol (docs/queues.md), all ordinary sbus traffic:

* **join**: a member subscribes to ``<whoami>/sbus/services/queue/GROUP/MEMBER/`` (its own
  secret space; MEMBER is random per join). The service, watching ``server/interest``, sees
  that pattern appear: the server filled in and checked the credentials, so the member's
  identity (uid, pid, relay chain) is the pattern's, never something a payload claims.
  Leaving is dropping the pattern (UNSUB, or the connection ending: ``kill -9`` included).
* **hello** / **refused**: the service that serves GROUP answers on the member's key:
  ``MSG <member>hello\\0JSON`` (group, pattern, window, and ``service``: its id) or
  ``MSG <member>refused\\0REASON`` (uid not allowed). A service that does not serve GROUP
  says nothing: several services share a bus, each with its own groups; a member hears
  from none only when no service serves its group.
* **serves**: each service holds ``sbus/services/queue/serves/GROUP/ID`` for each of its
  groups (ID: its start time and a random part), so a second service for a group sees the
  first in the interest feed and gives the group up (the earlier ID keeps it).
* **delivery**: ``MSG <member>m\\0TOKEN N\\0KEY\\0PAYLOAD``: TOKEN is random per delivery (only
  the member can read it), N the delivery count (1 first, 2+ redelivered), KEY and PAYLOAD
  the original message.
* **ack**: ``MSG sbus/services/queue/ack\\0TOKEN[ TOKEN...]``. Knowing a token proves the
  delivery reached you: nobody else could read it. A token is good once; an unknown one is
  counted and ignored.
* **nack**: ``MSG sbus/services/queue/nack\\0TOKEN DELAY\\0ERROR``: redeliver (after DELAY
  seconds, 0: now); **reject**: ``MSG sbus/services/queue/reject\\0TOKEN\\0ERROR``: straight to
  the dead letters; **progress**: ``MSG sbus/services/queue/progress\\0TOKEN[ TOKEN...]``: the
  member is still at it, its ack deadline starts again (the token stays good).
* **dead letter**: a job nacked, expired or left behind `max_deliveries` times, or rejected,
  is published as ``MSG DEAD_LETTER_KEY\\0JSON\\0PAYLOAD`` (JSON: group, key, attempts,
  error), or dropped and counted when the group has no dead-letter key.

`QueueCore` takes the events (intake messages, interest notices, acks) and returns the
packets to publish; the Twisted service (`sbus.services.queue`) only moves packets.
"""

from __future__ import annotations

import json
import os
import re
import heapq
import secrets
import struct
import time
from collections import deque
from typing import NamedTuple

from sbus.core import codec
from sbus.core.codec import MAX_PACKET
from sbus.core.patterns import matches

QUEUE_ROOT = b"sbus/services/queue/"
ACK_KEY = b"sbus/services/queue/ack"
NACK_KEY = b"sbus/services/queue/nack"
REJECT_KEY = b"sbus/services/queue/reject"
PROGRESS_KEY = b"sbus/services/queue/progress"
#: Keys the service's control connection receives from members, besides `ACK_KEY`.
MEMBER_KEYS = (NACK_KEY, REJECT_KEY, PROGRESS_KEY)
#: A member's error text is cut to this many bytes.
MAX_ERROR = 1000
FULL_ROOT = b"sbus/services/queue/full/"
SERVES_ROOT = b"sbus/services/queue/serves/"
#: A confirmed submission is a request (sbus.core.reqrep) on SUBMIT_ROOT + GROUP.
SUBMIT_ROOT = b"sbus/services/queue/submit/"
_JOB = struct.Struct(">HI")
MODES = ("block", "discard", "error")
#: What a group at its `max_jobs`/`max_bytes` does with one more job: refuse it (a submission is
#: told "full", a publish handled by the group's `full` mode) or drop the oldest waiting job.
OVERFLOWS = ("reject-publish", "drop-oldest")
_NAME = re.compile(rb"[A-Za-z0-9_.-]{1,64}\Z")
_MEMBER_PATTERN = re.compile(rb"((?:!/cred/\d+/\d+/\d+/)+)sbus/services/queue/([^/*]+)/([^/*]+)/\Z")
_CRED = re.compile(rb"!/cred/(\d+)/(\d+)/(\d+)/")


def check_group(name) -> bytes:
    """A group name as bytes; ValueError unless 1-64 of [A-Za-z0-9_.-]."""
    if isinstance(name, str):
        name = name.encode()
    if not _NAME.match(name):
        raise ValueError(f"bad group name {name[:80]!r}: 1-64 characters of A-Z a-z 0-9 _ . -")
    return name


# -- the member's side ---------------------------------------------------------------------


class Delivery(NamedTuple):
    """One message handed to this member: `deliveries` is 1 the first time, more when redelivered."""

    key: bytes
    payload: bytes
    token: bytes
    deliveries: int

    @property
    def redelivered(self) -> bool:
        return self.deliveries > 1


class Refused(Exception):
    """The queue service refused the join (uid not allowed)."""


class NoService(TimeoutError):
    """No sbus-queue service answered for the group: none serves it on this bus."""


class QueueFull(Exception):
    """A confirmed submission was refused: the group holds its `--limit` of jobs."""


def encode_jobs(jobs) -> bytes:
    """The body of a submission: per job KEYLEN(2) PAYLOADLEN(4) KEY PAYLOAD."""
    parts = []
    for key, payload in jobs:
        key = key.encode() if isinstance(key, str) else bytes(key)
        payload = payload.encode() if isinstance(payload, str) else bytes(payload)
        parts.append(_JOB.pack(len(key), len(payload)) + key + payload)
    return b"".join(parts)


def decode_jobs(body: bytes) -> list | None:
    jobs, i, n = [], 0, len(body)
    while i < n:
        if i + 6 > n:
            return None
        klen, plen = _JOB.unpack_from(body, i)
        i += 6
        if i + klen + plen > n or klen == 0:
            return None
        jobs.append((body[i:i + klen], body[i + klen:i + klen + plen]))
        i += klen + plen
    return jobs


def submit_result(group: bytes, answer: bytes) -> int:
    """The service's answer to a submission: the count held, or `QueueFull`/`ValueError`."""
    word, _, rest = answer.partition(b" ")
    if word == b"ok" and rest.isdigit():
        return int(rest)
    text = answer.decode("utf-8", "replace")[:300]
    if word == b"full:":
        raise QueueFull(f"group {group.decode()}: {text}")
    raise ValueError(f"group {group.decode()}: {text}")


class WorkerBase:
    """What the clients' workers share: the connection, its `Membership`, the hello's `info`."""

    def __init__(self, client, membership: "Membership"):
        self.client = client
        self.membership = membership
        #: Packets on the connection that were not deliveries (skipped).
        self.skipped = 0

    @property
    def info(self) -> dict:
        return self.membership.info or {}


class Membership:
    """A member's protocol state: its key, and what the packets addressed to it mean."""

    def __init__(self, whoami: bytes, group, max_packet: int = MAX_PACKET):
        self.group = check_group(group)
        self.member = secrets.token_hex(8).encode()
        self.prefix = whoami + b"/" + QUEUE_ROOT + self.group + b"/" + self.member + b"/"
        self.max_packet = max_packet
        self.info: dict | None = None
        self.refused: str | None = None
        #: "unknown group" refusals from services of before several services per bus (ignored:
        #: another service may serve the group).
        self.unknown = 0

    @property
    def subscribe_packet(self) -> bytes:
        return codec.encode_sub(self.prefix, self.max_packet)

    @property
    def unsubscribe_packet(self) -> bytes:
        return codec.encode_unsub(self.prefix, self.max_packet)

    def mine(self, key: bytes) -> bool:
        return key.startswith(self.prefix)

    def receive(self, key: bytes, payload: bytes):
        """A `Delivery`, "hello", "refused" (then `info` / `refused` are set), or None."""
        if not key.startswith(self.prefix):
            return None
        what = key[len(self.prefix):]
        if what == b"m":
            head, sep, rest = payload.partition(b"\0")
            okey, sep2, body = rest.partition(b"\0")
            token, _, count = head.partition(b" ")
            if not sep or not sep2 or not count.isdigit():
                return None
            return Delivery(okey, body, token, int(count))
        if what == b"hello":
            try:
                self.info = json.loads(payload)
            except ValueError:
                self.info = {}
            return "hello"
        if what == b"refused":
            self.refused = payload.decode("utf-8", "replace")[:200]
            return "refused"
        return None

    def joined(self, packet) -> bool:
        """While joining: True for the service's hello; raises `Refused` for its refusal;
        False for anything else (to be kept for the application)."""
        what = self.receive(packet.key, packet.payload) if type(packet) is codec.Message else None
        if what == "refused" and (err := self.refusal()) is not None:
            raise err
        return what == "hello"

    def refusal(self) -> Refused | None:
        """The `Refused` for the refusal just received; None for an "unknown group" from a
        service of before several services per bus (counted in `unknown`: another may serve it)."""
        if self.refused.startswith("unknown group"):
            self.unknown += 1
            return None
        return Refused(f"group {self.group.decode()}: {self.refused}")

    def held(self, packet) -> bool:
        """While joining: True for a packet of the join protocol that the application must not see."""
        return type(packet) is codec.Message and packet.key.startswith(self.prefix)

    def delivery(self, packet) -> Delivery | None:
        """The `Delivery` a received packet is, or None."""
        if type(packet) is not codec.Message:
            return None
        d = self.receive(packet.key, packet.payload)
        return d if type(d) is Delivery else None

    def timeout_error(self, timeout: float) -> NoService:
        return NoService(f"no sbus-queue service answered for group {self.group.decode()} within {timeout:g} s")

    def ack_packet(self, *deliveries) -> bytes:
        return codec.encode_msg(ACK_KEY, _tokens(deliveries), self.max_packet)

    def progress_packet(self, *deliveries) -> bytes:
        """Still working on these: their ack deadlines start again."""
        return codec.encode_msg(PROGRESS_KEY, _tokens(deliveries), self.max_packet)

    def nack_packet(self, delivery, delay: float = 0.0, error="") -> bytes:
        """Not done: redeliver after `delay` seconds (to any member); `error` is kept as the
        job's last error (in its dead letter, if it comes to that)."""
        if not delay >= 0:
            raise ValueError(f"delay must be >= 0, not {delay!r}")
        return codec.encode_msg(NACK_KEY, _tokens((delivery,)) + b" %g\0" % delay + _error(error), self.max_packet)

    def reject_packet(self, delivery, error="") -> bytes:
        """Never to be done: straight to the dead letters."""
        return codec.encode_msg(REJECT_KEY, _tokens((delivery,)) + b"\0" + _error(error), self.max_packet)


def _tokens(deliveries) -> bytes:
    return b" ".join(d.token if isinstance(d, Delivery) else bytes(d) for d in deliveries)


def _error(error) -> bytes:
    return (error.encode("utf-8", "replace") if isinstance(error, str) else bytes(error))[:MAX_ERROR]


# -- the service's side --------------------------------------------------------------------


class _Entry:
    __slots__ = ("key", "payload", "deliveries", "size", "deadline", "error", "avoid", "jid")

    def __init__(self, key: bytes, payload: bytes):
        self.key = key
        self.payload = payload
        self.deliveries = 0
        self.deadline = None  # while delivered, with an ack deadline: when it expires
        self.error = b""      # the last error a member gave (nack, reject), or why it came back
        self.avoid = None     # the member that let its ack wait expire: another, if one has room
        self.jid = 0          # its id in the group's journal (with a store)


class _Backlog(deque):
    """A group's waiting jobs, with the bytes of their keys and payloads (for ``max_bytes``)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def append(self, entry: _Entry) -> None:
        super().append(entry)
        self.bytes += len(entry.key) + len(entry.payload)

    def appendleft(self, entry: _Entry) -> None:
        super().appendleft(entry)
        self.bytes += len(entry.key) + len(entry.payload)

    def popleft(self) -> _Entry:
        entry = super().popleft()
        self.bytes -= len(entry.key) + len(entry.payload)
        return entry

    def clear(self) -> None:
        super().clear()
        self.bytes = 0


class _Member:
    __slots__ = ("key", "group", "uids", "pid", "inflight", "inflight_bytes")

    def __init__(self, key: bytes, group: "_Group", uids: tuple, pid: int):
        self.key = key
        self.group = group
        self.uids = uids
        self.pid = pid
        self.inflight: dict[bytes, _Entry] = {}
        self.inflight_bytes = 0  # of the delivery packets in `inflight`


class _Group:
    def __init__(self, name: bytes, pattern: bytes, limit: int, full: str, window: int, window_bytes: int,
                 ack_wait: float | None = None, max_deliveries: int | None = None,
                 dead_letter: bytes | None = None, max_bytes: int | None = None,
                 overflow: str = "reject-publish"):
        self.max_bytes = max_bytes
        self.overflow = overflow
        self.ack_wait = ack_wait
        self.max_deliveries = max_deliveries
        self.dead_letter = dead_letter
        self.expired = self.nacked = self.rejected = self.dead_lettered = 0
        self.replayed = 0
        self.submitted = self.submit_refused = 0
        self.name = name
        self.pattern = pattern
        self.limit = limit
        self.full = full
        self.window = window
        self.window_bytes = window_bytes
        self.backlog = _Backlog()
        self.ring: list[_Member] = []
        self.rr = 0
        self.full_episode = False
        self.received = self.delivered = self.acked = self.redelivered = 0
        self.joined = self.left = self.refused = 0
        self.lost = {"full": 0, "too_big": 0, "max_deliveries": 0, "dropped": 0}

    def over(self, jobs: int, size: int) -> bool:
        """Would `jobs` more waiting jobs of `size` bytes pass `limit` (max jobs) or `max_bytes`?"""
        return (len(self.backlog) + jobs > self.limit
                or (self.max_bytes is not None and self.backlog.bytes + size > self.max_bytes))

    def at_cap(self) -> bool:
        return self.over(1, 1)

    def below_half(self) -> bool:
        """Far enough under the caps to read the intake again (half of each)."""
        return (len(self.backlog) < max(1, self.limit // 2)
                and (self.max_bytes is None or self.backlog.bytes < max(1, self.max_bytes // 2)))

    def holds_publishers(self) -> bool:
        """Over its caps, this group holds the publishers (the intake paused) rather than
        dropping or refusing."""
        return self.full == "block" and self.overflow == "reject-publish"

    def next_member(self) -> _Member | None:
        """Round robin over the members whose window has room: fewer than `window` deliveries
        and `window_bytes` bytes unacknowledged (one delivery of any size when it has none)."""
        ring, n, window, window_bytes = self.ring, len(self.ring), self.window, self.window_bytes
        for i in range(n):
            j = (self.rr + i) % n
            m = ring[j]
            if len(m.inflight) < window and (m.inflight_bytes < window_bytes or not m.inflight):
                self.rr = (j + 1) % n
                return m
        return None

    def stats(self) -> dict:
        return {"pattern": self.pattern.decode("utf-8", "replace"), "mode": self.full,
                "limit": self.limit, "max_bytes": self.max_bytes, "overflow": self.overflow,
                "backlog_bytes": self.backlog.bytes, "window": self.window, "window_bytes": self.window_bytes,
                "members": len(self.ring),
                "backlog": len(self.backlog), "in_flight": sum(len(m.inflight) for m in self.ring),
                "received": self.received, "delivered": self.delivered, "acked": self.acked,
                "redelivered": self.redelivered, "lost": dict(self.lost),
                "ack_wait": self.ack_wait, "max_deliveries": self.max_deliveries,
                "dead_letter": self.dead_letter.decode("utf-8", "replace") if self.dead_letter else None,
                "expired": self.expired, "nacked": self.nacked, "rejected": self.rejected,
                "dead_lettered": self.dead_lettered, "replayed": self.replayed,
                "submitted": self.submitted, "submit_refused": self.submit_refused,
                "joined": self.joined, "left": self.left, "refused": self.refused}


class QueueCore:
    """The groups, their members and their work; every method returns packets to publish.

    ``groups``: (name, pattern) pairs. ``limit``: messages waiting per group (not counting
    those delivered and not yet acknowledged, at most ``window`` deliveries and about
    ``window_bytes`` bytes per member). ``full``: what
    happens to a message over the limit (block: accepted, and `should_pause` tells the
    service to stop reading its intake; discard: dropped and counted; error: dropped,
    counted, and ``MSG sbus/services/queue/full/GROUP\\0COUNT`` published once per episode).
    ``allowed_uids``: uids that may join (every uid of a member's credential chain must be
    one). ``ack_wait``: seconds a member has to ack (or send progress) before the job goes to
    another; ``max_deliveries``: after that many, a job that comes back goes to
    ``dead_letter`` (a key; None: dropped, counted ``lost.max_deliveries``). ``clock``: seconds,
    for the deadlines (`tick` is called with nothing, at least every `tick_interval`)."""

    def __init__(self, groups, *, limit: int = 10000, full: str = "block", window: int = 64,
                 window_bytes: int = 1 << 20, allowed_uids=(), max_packet: int = MAX_PACKET,
                 ack_wait: float | None = None, max_deliveries: int | None = None,
                 dead_letter: bytes | None = None, clock=time.monotonic, store=None,
                 max_bytes: int | None = None, overflow: str = "reject-publish", caps=None):
        if full not in MODES:
            raise ValueError(f"unknown mode {full!r}; one of {', '.join(MODES)}")
        caps = {check_group(n): dict(c) for n, c in (caps or {}).items()}
        self.groups: dict[bytes, _Group] = {}
        for name, pattern in groups:
            name = check_group(name)
            pattern = pattern.encode() if isinstance(pattern, str) else bytes(pattern)
            if name in self.groups:
                raise ValueError(f"group {name.decode()} given twice")
            mine = {"limit": limit, "max_bytes": max_bytes, "overflow": overflow, "ack_wait": ack_wait,
                    "max_deliveries": max_deliveries, "dead_letter": dead_letter, **caps.pop(name, {})}
            if mine["overflow"] not in OVERFLOWS:
                raise ValueError(f"unknown overflow policy {mine['overflow']!r}; one of {', '.join(OVERFLOWS)}")
            self.groups[name] = _Group(name, pattern, mine["limit"], full, window, window_bytes, mine["ack_wait"],
                                       mine["max_deliveries"], mine["dead_letter"], mine["max_bytes"],
                                       mine["overflow"])
        if caps:
            raise ValueError(f"no group named {next(iter(caps)).decode()}")
        self.clock = clock
        #: A `sbus.core.queuestore.QueueStore`, or None (in memory only).
        self.store = store
        if store is not None:
            for g in self.groups.values():
                _, jobs = store.open(g.name)
                for jid, key, payload in jobs:  # replayed: may have been delivered before
                    entry = _Entry(key, payload)
                    entry.jid, entry.deliveries = jid, 1
                    g.backlog.append(entry)
                g.replayed = len(jobs)
        #: (due, seq, group, entry): nacked with a delay, or delivered with an ack deadline
        #: (stale ones are skipped: an entry's `deadline` says whether it is still due).
        self._timers: list = []
        self._seq = 0
        self.allowed = set(allowed_uids) | {os.getuid(), 0}
        self.max_packet = max_packet
        self.members: dict[bytes, _Member] = {}
        self.tokens: dict[bytes, _Member] = {}
        self._dead: list = []  # (group, entry) to dead-letter at the next packet-returning call
        self._listing: set[bytes] | None = None
        #: Deliveries go out only while the control connection is up and its first interest
        #: listing is complete (until then work waits in the backlogs).
        self.online = False
        self.acks_unknown = 0
        self.ignored_keys = 0
        self.lost_intake = 0
        #: This service's id (start time, random part: the earlier one keeps a contested group).
        self.service_id = b"%020d-%s" % (time.time_ns(), secrets.token_hex(4).encode())
        #: Joins for groups this service does not serve (another service's, or none's): unanswered.
        self.joins_elsewhere = 0
        #: Groups given up to an earlier service that serves them too: name -> (its id, pattern).
        self.conflicts: dict[bytes, tuple[bytes, bytes]] = {}

    def caps_text(self) -> str:
        """Each group's caps and overflow policy, for the service's start-up line."""
        return "; ".join(f"{g.name.decode()} {g.limit} jobs" + (f", {g.max_bytes} bytes" if g.max_bytes else "")
                         + f" ({g.overflow})" for g in self.groups.values())

    def serves_patterns(self) -> list[bytes]:
        """The keys that tell other services which groups this one serves."""
        return [SERVES_ROOT + name + b"/" + self.service_id for name in self.groups]

    def _serves(self, pattern: bytes) -> None:
        """Another service's `serves` key: if it serves one of our groups and started first, give
        the group up. Its members (subscribed once, seen by both services) and its work (both
        intakes received it) stay with the other service: nothing of it is lost here."""
        name, _, other = pattern[len(SERVES_ROOT):].partition(b"/")
        g = self.groups.get(name)
        if g is None or not other or other >= self.service_id:
            return
        self.conflicts[name] = (other, g.pattern)
        del self.groups[name]
        for member in g.ring:
            self.members.pop(member.key, None)
            for token in member.inflight:
                self.tokens.pop(token, None)
        g.ring.clear()
        g.backlog.clear()

    # -- intake

    def message(self, key: bytes, payload: bytes) -> list[bytes]:
        """A message from the intake connection: to each group whose pattern matches."""
        if key.startswith(b"sbus/services/") or key.startswith(b"!/cred/"):
            self.ignored_keys += 1
            return []
        out: list[bytes] = []
        for g in self.groups.values():
            if not matches(g.pattern, key):
                continue
            g.received += 1
            if not (g.holds_publishers() or self._room(g, 1, len(key) + len(payload))):
                g.lost["full"] += 1
                if g.full == "error" and not g.full_episode:
                    g.full_episode = True
                    out.append(codec.encode_msg(FULL_ROOT + g.name, b"%d" % g.limit, self.max_packet))
                continue
            entry = _Entry(key, payload)
            if self.store is not None:
                entry.jid = self.store.add(g.name, key, payload)
            g.backlog.append(entry)
            self._pump(g, out)
        return out

    def _room(self, g: _Group, jobs: int, size: int) -> bool:
        """May `jobs` more jobs of `size` bytes wait in `g`? Under ``drop-oldest`` the oldest
        waiting jobs (never those in flight) are dropped for them (counted ``lost.dropped``,
        and journaled as done, so a restart does not bring them back); only a batch bigger
        than the caps themselves has no room. Under ``reject-publish``: while under the caps,
        or always for a publish to a group that holds its publishers instead (``block``)."""
        if g.overflow == "drop-oldest":
            if jobs > g.limit or (g.max_bytes is not None and size > g.max_bytes):
                return False
            while g.over(jobs, size):
                self._finish(g, g.backlog.popleft())
                g.lost["dropped"] += 1
            return True
        return not g.over(jobs, size)

    def should_pause(self) -> bool:
        return any(g.holds_publishers() and g.at_cap() for g in self.groups.values())

    def may_resume(self) -> bool:
        return all(not g.holds_publishers() or g.below_half() for g in self.groups.values())

    def intake_dropped(self, count: int) -> None:
        """The server dropped `count` messages for the intake connection (`server/dropped`)."""
        self.lost_intake += count

    # -- members, from server/interest

    def interest(self, payload: bytes | None) -> list[bytes]:
        payload = payload or b""
        out: list[bytes] = []
        if payload == b"=":
            listing, self._listing = self._listing, None
            if listing is not None:
                for key in [k for k in self.members if k not in listing]:
                    self._leave(key, out)
            if not self.online:
                self.online = True
                for g in self.groups.values():
                    self._pump(g, out)
            return out
        sign, _, pattern = payload.partition(b"\0")
        if sign == b"+" and pattern.startswith(SERVES_ROOT):
            self._serves(pattern)
        elif sign == b"+":
            if self._listing is not None:
                self._listing.add(pattern)
            if pattern not in self.members:
                self._join(pattern, out)
        elif sign == b"-":
            if pattern in self.members:
                self._leave(pattern, out)
        return out

    def relisting(self) -> None:
        """A new interest listing is starting (the control connection was made again)."""
        self._listing = set()

    def control_lost(self) -> None:
        """The connection that publishes deliveries is gone: what it sent may not have reached
        the members, so every unacknowledged delivery goes back to the front of its group's
        backlog (redelivered to whoever is there once the listing is complete)."""
        self.online = False
        for g in self.groups.values():
            for member in g.ring:
                self._requeue(member)

    def _join(self, pattern: bytes, out: list) -> None:
        m = _MEMBER_PATTERN.match(pattern)
        if m is None:
            return  # not a member key: somebody else's subscription
        chain, group, _ = m.groups()
        creds = _CRED.findall(chain)
        uids = tuple(int(u) for _, u, _ in creds)
        pid = int(creds[-1][2])
        g = self.groups.get(group)
        if g is None:
            self.joins_elsewhere += 1  # another service's group (or nobody's: the member times out)
            return
        bad = [u for u in uids if u not in self.allowed]
        if bad:
            g.refused += 1
            out.append(codec.encode_msg(pattern + b"refused", b"uid %d may not join group %s" % (bad[0], group),
                                        self.max_packet))
            return
        member = _Member(pattern, g, uids, pid)
        self.members[pattern] = member
        g.ring.append(member)
        g.joined += 1
        hello = json.dumps({"group": group.decode(), "pattern": g.pattern.decode("utf-8", "replace"),
                            "window": g.window, "window_bytes": g.window_bytes,
                            "service": self.service_id.decode()}).encode()
        out.append(codec.encode_msg(pattern + b"hello", hello, self.max_packet))
        self._pump(g, out)

    def _leave(self, key: bytes, out: list) -> None:
        member = self.members.pop(key)
        g = member.group
        i = g.ring.index(member)
        del g.ring[i]
        if i < g.rr:
            g.rr -= 1
        if g.ring:
            g.rr %= len(g.ring)
        else:
            g.rr = 0
        g.left += 1
        self._requeue(member)
        self._pump(g, out)

    def _requeue(self, member: _Member) -> None:
        """A member's unacknowledged work goes first, in the order it was delivered; its tokens die."""
        g = member.group
        back = list(member.inflight.items())
        member.inflight.clear()
        member.inflight_bytes = 0
        for token, _ in back:
            self.tokens.pop(token, None)
        dead = []
        for _, entry in reversed(back):
            entry.deadline = None
            if g.max_deliveries is not None and entry.deliveries >= g.max_deliveries:
                dead.append(entry)
                continue
            g.backlog.appendleft(entry)
        g.redelivered += len(back) - len(dead)
        self._dead.extend((g, e) for e in reversed(dead))

    # -- acknowledgements

    def ack(self, payload: bytes) -> list[bytes]:
        out: list[bytes] = []
        touched = []
        for token in payload.split(b" "):
            got = self._take(token)
            if got is None:
                continue
            g = got[0].group
            self._finish(g, got[1])
            g.acked += 1
            if not touched or touched[-1] is not g:
                touched.append(g)
        for g in touched:
            self._pump(g, out)
        return out

    def _take(self, token: bytes):
        """(member, entry) of a delivery still out, its token now dead; None if unknown."""
        member = self.tokens.pop(token, None)
        if member is None:
            if token:
                self.acks_unknown += 1
            return None
        entry = member.inflight.pop(token)
        member.inflight_bytes -= entry.size
        entry.deadline = None
        return member, entry

    def progress(self, payload: bytes) -> list[bytes]:
        """Members still at work on these deliveries: their ack deadlines start again."""
        now = self.clock()
        for token in payload.split(b" "):
            member = self.tokens.get(token)
            if member is None:
                continue
            entry = member.inflight[token]
            if member.group.ack_wait is not None:
                self._arm(member.group, entry, token, now + member.group.ack_wait)
        return []

    def nack(self, payload: bytes) -> list[bytes]:
        """``TOKEN DELAY\\0ERROR``: redeliver after DELAY seconds (the front of the queue at once
        with 0), unless it has had `max_deliveries`."""
        head, _, error = payload.partition(b"\0")
        token, _, delay = head.partition(b" ")
        try:
            delay = max(0.0, float(delay or b"0"))
        except ValueError:
            delay = 0.0
        return self._settle(token, error, lambda g, entry, out: self._again(g, entry, out, delay), "nacked")

    def reject(self, payload: bytes) -> list[bytes]:
        """``TOKEN\\0ERROR``: straight to the dead letters."""
        token, _, error = payload.partition(b"\0")
        return self._settle(token, error, self._dead_letter, "rejected")

    def _settle(self, token: bytes, error: bytes, then, counter: str) -> list[bytes]:
        """A member gives a delivery back (nack, reject): count it, keep its error, `then` decides
        where the job goes, and the group is pumped."""
        got = self._take(token)
        out: list[bytes] = []
        if got is None:
            return out
        member, entry = got
        g = member.group
        setattr(g, counter, getattr(g, counter) + 1)
        entry.error = error[:MAX_ERROR]
        then(g, entry, out)
        self._pump(g, out)
        return out
        return out

    def _again(self, g: _Group, entry: _Entry, out: list, delay: float = 0.0) -> None:
        """A job that came back: to the dead letters after `max_deliveries`, else to the front
        of the queue (now, or when `delay` has passed)."""
        if g.max_deliveries is not None and entry.deliveries >= g.max_deliveries:
            self._dead_letter(g, entry, out)
            return
        g.redelivered += 1
        if delay > 0:
            self._arm(g, entry, None, self.clock() + delay)
        else:
            g.backlog.appendleft(entry)

    def _arm(self, g: _Group, entry: _Entry, token, due: float) -> None:
        entry.deadline = due
        self._seq += 1
        heapq.heappush(self._timers, (due, self._seq, g, entry, token))

    def _finish(self, g: _Group, entry: _Entry) -> None:
        """The job is done with (acked, dead-lettered, dropped): out of the journal."""
        if self.store is not None and entry.jid:
            self.store.done(g.name, entry.jid)

    def _dead_letter(self, g: _Group, entry: _Entry, out: list) -> None:
        self._finish(g, entry)
        if g.dead_letter is None:
            g.lost["max_deliveries"] += 1
            return
        head = json.dumps({"group": g.name.decode(), "key": entry.key.decode("utf-8", "replace"),
                           "attempts": entry.deliveries,
                           "error": entry.error.decode("utf-8", "replace")}).encode()
        try:
            out.append(codec.encode_msg(g.dead_letter, head + b"\0" + entry.payload, self.max_packet))
        except codec.ProtocolError:
            g.lost["too_big"] += 1
            return
        g.dead_lettered += 1

    def tick(self) -> list[bytes]:
        """Deadlines that passed: deliveries not acked in `ack_wait` go back (to another member,
        or the dead letters), nacked jobs whose delay is over go to the front of the queue."""
        out: list[bytes] = []
        now = self.clock()
        timers = self._timers
        touched = set()
        while timers and timers[0][0] <= now:
            due, _, g, entry, token = heapq.heappop(timers)
            if entry.deadline != due:
                continue  # acked, extended or already back
            entry.deadline = None
            if token is None:  # a nack's delay is over
                g.backlog.appendleft(entry)
            else:
                member = self.tokens.pop(token, None)
                if member is None:
                    continue
                member.inflight.pop(token, None)
                member.inflight_bytes -= entry.size
                entry.avoid = member
                g.expired += 1
                entry.error = b"ack wait of %g s expired" % g.ack_wait
                self._again(g, entry, out)
            touched.add(g)
        for g in touched:
            if g.name in self.groups:
                self._pump(g, out)
        return out

    def next_deadline(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    # -- confirmed submissions

    def submit(self, name: bytes, body: bytes) -> tuple[bytes, list[bytes]]:
        """A batch of jobs a producer wants confirmed: all held (the answer ``ok N``; with a
        store, written to the journal, which the service fsyncs before answering) or none
        (``full: ...`` when they would pass the group's limit, counted ``submit_refused``)."""
        g = self.groups.get(name)
        if g is None:
            return b"error: this service does not serve group " + name[:64], []
        jobs = decode_jobs(body)
        if jobs is None:
            return b"error: malformed batch", []
        for key, _ in jobs:
            if key.startswith(b"sbus/services/") or key.startswith(b"!") or not matches(g.pattern, key):
                return b"error: key %s does not match the group's pattern" % key[:200], []
        if not self._room(g, len(jobs), sum(len(k) + len(p) for k, p in jobs)):
            g.submit_refused += len(jobs)
            caps = b"max %d jobs" % g.limit + (b", %d bytes" % g.max_bytes if g.max_bytes is not None else b"")
            return b"full: queue full (%d jobs, %d bytes waiting; %s)" % (len(g.backlog), g.backlog.bytes, caps), []
        out: list[bytes] = []
        store = self.store
        for key, payload in jobs:
            entry = _Entry(key, payload)
            if store is not None:
                entry.jid = store.add(g.name, key, payload)
            g.backlog.append(entry)
        g.received += len(jobs)
        g.submitted += len(jobs)
        self._pump(g, out)
        return b"ok %d" % len(jobs), out

    # -- delivery

    def _pump(self, g: _Group, out: list) -> None:
        if self._dead:
            dead, self._dead = self._dead, []
            for dg, entry in dead:
                self._dead_letter(dg, entry, out)
        backlog = g.backlog
        while backlog and self.online:
            member = g.next_member()
            if member is None:
                break
            entry = backlog[0]
            if entry.avoid is not None:
                if entry.avoid is member:
                    member = g.next_member() or member
                entry.avoid = None
            backlog.popleft()
            entry.deliveries += 1
            token = secrets.token_hex(8).encode()
            payload = b"%s %d\0%s\0%s" % (token, entry.deliveries, entry.key, entry.payload)
            key = member.key + b"m"
            if len(key) + len(payload) + 5 > self.max_packet:
                g.lost["too_big"] += 1
                self._finish(g, entry)
                continue
            entry.size = len(key) + len(payload) + 5
            if g.ack_wait is not None:
                self._arm(g, entry, token, self.clock() + g.ack_wait)
            member.inflight[token] = entry
            member.inflight_bytes += entry.size
            self.tokens[token] = member
            g.delivered += 1
            out.append(b"MSG " + key + b"\0" + payload)
        if g.full_episode and not g.at_cap():
            g.full_episode = False

    # -- statistics

    def stats(self) -> dict:
        return {"groups": {g.name.decode(): g.stats() for g in self.groups.values()},
                "acks_unknown": self.acks_unknown, "lost_intake": self.lost_intake,
                "ignored_keys": self.ignored_keys, "joins_elsewhere": self.joins_elsewhere,
                "service": self.service_id.decode(),
                "given_up": {n.decode(): o.decode() for n, (o, _) in self.conflicts.items()}}
