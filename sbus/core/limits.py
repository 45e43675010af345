"""Default limits, one definition each, for the server's settings
(`sbus.server.config`), the transport (`sbus.seqpacket`) and the clients.

Plain Python (no Twisted): the client side imports these too.
"""

from sbus.core.codec import MAX_PACKET

__all__ = ["MAX_PACKET", "DEFAULT_QUEUE_BYTES", "DEFAULT_QUEUE_PACKETS", "DEFAULT_DRAIN_CAP"]

#: What one connection that never reads may pin in its peer's output queue (docs/protocol.md "Flood control").
DEFAULT_QUEUE_BYTES = 4 << 20
DEFAULT_QUEUE_PACKETS = 16384
#: Packets read from one connection per wakeup before the others get a turn.
DEFAULT_DRAIN_CAP = 64
