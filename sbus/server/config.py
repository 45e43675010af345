"""The server's settings, one object shared by `twistd sbus` and `sbusd`."""

from __future__ import annotations

from dataclasses import dataclass, field

from sbus.core.codec import MAX_PACKET

#: What one client that never reads may pin in the server (NOTES §5).
DEFAULT_QUEUE_BYTES = 4 * 1024 * 1024
DEFAULT_QUEUE_PACKETS = 16384


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
    extra: dict = field(default_factory=dict)
