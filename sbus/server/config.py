"""The server's settings, one object shared by `twistd sbus` and `sbusd`."""

from __future__ import annotations

from dataclasses import dataclass, field

from sbus.core.codec import MAX_PACKET

#: What one client that never reads may pin in the server (NOTES §5).
DEFAULT_QUEUE_BYTES = 4 * 1024 * 1024
DEFAULT_QUEUE_PACKETS = 16384
#: How long a client in a `block` mode may hold publishers paused before it is disconnected.
DEFAULT_STALL_TIMEOUT = 30.0
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


@dataclass
class ServerConfig:
    max_packet: int = MAX_PACKET
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    queue_packets: int = DEFAULT_QUEUE_PACKETS
    #: Credential prefix: b"" for a top-level server, "<whoami on master>/" for a slave.
    cred_prefix: bytes = b""
    #: uids allowed to connect besides the server's own; None lets anyone in.
    allowed_uids: frozenset[int] | None = None
    #: Packets read from one client per wakeup before others get a turn.
    drain_cap: int = 64
    stall_timeout: float = DEFAULT_STALL_TIMEOUT
    #: Subscriptions one client may hold (duplicates count).
    max_subscriptions: int = DEFAULT_MAX_SUBSCRIPTIONS
    #: Subscriptions and connections all clients of one uid may hold together.
    max_uid_subscriptions: int = DEFAULT_MAX_UID_SUBSCRIPTIONS
    max_uid_connections: int = DEFAULT_MAX_UID_CONNECTIONS
    max_subscription_bytes: int = DEFAULT_MAX_SUBSCRIPTION_BYTES
    max_uid_subscription_bytes: int = DEFAULT_MAX_UID_SUBSCRIPTION_BYTES
    max_pattern_segments: int = DEFAULT_MAX_PATTERN_SEGMENTS
    extra: dict = field(default_factory=dict)
