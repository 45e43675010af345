"""The server's settings, one object shared by `twistd sbus` and `sbusd`; the
default limits (one definition each: `sbus.core.limits` for those the client
side shares) and the allowed-uid set (`allowed_uid_set`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable

from sbus.core.flood import DEFAULT_CONTROL_BYTES
from sbus.core.sessions import DEFAULT_MAX_LINGER
from sbus.core.limits import DEFAULT_DRAIN_CAP, DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_PACKETS, MAX_PACKET


def allowed_uid_set(users: Iterable[int] | None) -> frozenset[int] | None:
    """Who may connect: None (no -u/--user given) lets anyone in; otherwise the users
    named plus the server's own uid (as the reference server does)."""
    if users is None:
        return None
    return frozenset(users) | {os.getuid()}

#: Queued bytes all clients of one uid may pin together, and all clients of the server: past either,
#: a client's hard flood mode applies as if its own queue were full (fits a small machine).
DEFAULT_MAX_UID_QUEUE_BYTES = 64 << 20
DEFAULT_MAX_QUEUE_BYTES = 256 << 20
#: The hold budget of the `block` modes: how much longer a client may hold publishers paused than it
#: lets them run before it is disconnected (`stalled`).
DEFAULT_STALL_TIMEOUT = 30.0
#: Busy polling (`sbus.pollloop`, applied by `sbus.reactor`): after a wait that ended within this
#: many seconds, the server polls this long before it sleeps (a round trip's next request is met
#: awake); 0 turns it off.
DEFAULT_BUSY_POLL = 50e-6
#: So that one client or one user cannot take the whole bus's memory or descriptors.
DEFAULT_MAX_SUBSCRIPTIONS = 100_000
DEFAULT_MAX_UID_SUBSCRIPTIONS = 1_000_000
DEFAULT_MAX_UID_CONNECTIONS = 4096
#: What stored patterns may cost, estimated as their bytes plus SEGMENT_COST per '/'-segment
#: and per '*' (each can be a trie node of its own), per client and per uid.
DEFAULT_MAX_SUBSCRIPTION_BYTES = 32 << 20
DEFAULT_MAX_UID_SUBSCRIPTION_BYTES = 128 << 20
DEFAULT_MAX_PATTERN_SEGMENTS = 256
SEGMENT_COST = 128


def busy_poll_us(text: str) -> float:
    """`--busy-poll USEC` (microseconds, as Linux's SO_BUSY_POLL) -> seconds; ValueError naming it."""
    try:
        usec = int(text)
    except ValueError:
        usec = -1
    if not 0 <= usec <= 1_000_000:
        raise ValueError(f"--busy-poll: not a number of microseconds from 0 to 1000000: {text!r}")
    return usec / 1e6


def pattern_cost(pattern: bytes) -> int:
    """What one stored pattern is estimated to pin: its bytes, and SEGMENT_COST per trie node."""
    return len(pattern) + SEGMENT_COST * (pattern.count(b"/") + pattern.count(b"*") + 1)


@dataclass
class ServerConfig:
    max_packet: int = MAX_PACKET
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    queue_packets: int = DEFAULT_QUEUE_PACKETS
    #: Credential prefix: b"" for a top-level server, "<whoami on master>/" for a slave.
    cred_prefix: bytes = b""
    #: uids allowed to connect (the server's own is added: `allowed_uid_set`); None lets anyone in.
    allowed_uids: frozenset[int] | None = None
    #: The bus owner's grant (``--service-uid``): uids of services that carry other uids'
    #: traffic (sbus-nats, a relay), which see every uid's `server/interest` as root does.
    service_uids: frozenset[int] = frozenset()
    #: Replies and notices one client may have queued before it is not read until they drain.
    queue_control_bytes: int = DEFAULT_CONTROL_BYTES
    #: Packets read from one client per wakeup before others get a turn.
    drain_cap: int = DEFAULT_DRAIN_CAP
    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    #: Queued bytes per uid (all its clients) and for the whole server.
    max_uid_queue_bytes: int = DEFAULT_MAX_UID_QUEUE_BYTES
    max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES
    #: Subscriptions one client may hold (duplicates count).
    max_subscriptions: int = DEFAULT_MAX_SUBSCRIPTIONS
    #: Subscriptions and connections all clients of one uid may hold together.
    max_uid_subscriptions: int = DEFAULT_MAX_UID_SUBSCRIPTIONS
    max_uid_connections: int = DEFAULT_MAX_UID_CONNECTIONS
    max_subscription_bytes: int = DEFAULT_MAX_SUBSCRIPTION_BYTES
    max_uid_subscription_bytes: int = DEFAULT_MAX_UID_SUBSCRIPTION_BYTES
    max_pattern_segments: int = DEFAULT_MAX_PATTERN_SEGMENTS
    #: How long a closed connection's named session may keep its patterns (`server/session`).
    max_session_linger: float = DEFAULT_MAX_LINGER
    #: Seconds the reactor polls before it sleeps, right after a wait this short (`sbus.pollloop`,
    #: applied by `sbus.reactor`).
    busy_poll: float = DEFAULT_BUSY_POLL
    #: A log line per connect and ordinary disconnect (``--log-connections``); otherwise one
    #: summary line per `connection_log_interval` seconds (`sbus.core.churn`).
    log_connections: bool = False
    connection_log_interval: float = 60.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.allowed_uids = allowed_uid_set(self.allowed_uids)
        self.service_uids = frozenset(self.service_uids)
