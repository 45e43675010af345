"""Per-client outgoing queue and the flood-control policies of NOTES §5.

Plain Python: the server asks `Outbox.offer` what to do with a packet that
cannot go straight to the client's socket (it would block, or older packets
are still waiting), and acts on the answer. The queue drains in the order
the client chose: oldest first (`order/queue`), newest first
(`order/stack`), or largest first (`order/random`: whatever frees the most
memory with the next send).
"""

from __future__ import annotations

import heapq
from collections import deque
from itertools import count

# Modes, as named by the protocol's control keys.
QUEUE, DISCARD, BLOCK, ERROR = "queue", "discard", "block", "error"
FIFO, STACK, LARGEST = "queue", "stack", "random"

SOFT_MODES = frozenset((QUEUE, DISCARD, BLOCK, ERROR))
HARD_MODES = frozenset((DISCARD, BLOCK, ERROR))
ORDERS = frozenset((FIFO, STACK, LARGEST))

# What `offer` decided.
QUEUED = 0  # kept; will be sent when the socket is writable
QUEUED_BLOCK = 1  # kept; stop reading from whoever fed it until the queue drains
DROPPED = 2  # discarded (counted under `reason`)
DISCONNECT = 3  # the client misbehaves: disconnect it (counted under `reason`)

# Reasons, as they appear in statistics.
SOFT_DISCARD = "soft_discard"
HARD_DISCARD = "hard_discard"
SOFT_ERROR = "soft_error"
HARD_ERROR = "hard_error"


class Outbox:
    """Packets waiting for one client, with that client's flood settings."""

    __slots__ = ("soft", "hard", "order", "max_bytes", "max_packets", "nbytes", "_items", "_seq", "reason")

    def __init__(self, max_bytes: int, max_packets: int):
        self.soft = QUEUE
        self.hard = DISCARD
        self.order = FIFO
        self.max_bytes = max_bytes
        self.max_packets = max_packets
        self.nbytes = 0
        self._items: deque | list = deque()
        self._seq = None
        #: Why the last DROPPED/DISCONNECT happened.
        self.reason = ""

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def offer(self, packet: bytes) -> int:
        """Decide the fate of a packet that cannot be sent right now."""
        soft = self.soft
        if soft is DISCARD:
            self.reason = SOFT_DISCARD
            return DROPPED
        if soft is ERROR:
            self.reason = SOFT_ERROR
            return DISCONNECT
        if self.nbytes + len(packet) > self.max_bytes or len(self._items) >= self.max_packets:
            hard = self.hard
            if hard is DISCARD:
                self.reason = HARD_DISCARD
                return DROPPED
            if hard is ERROR:
                self.reason = HARD_ERROR
                return DISCONNECT
            self.push(packet)
            return QUEUED_BLOCK
        self.push(packet)
        return QUEUED_BLOCK if soft is BLOCK else QUEUED

    def push(self, packet: bytes) -> None:
        """Queue unconditionally (server replies are never dropped)."""
        self.nbytes += len(packet)
        if self._seq is None:
            self._items.append(packet)
        else:
            heapq.heappush(self._items, (-len(packet), next(self._seq), packet))

    def peek(self) -> bytes:
        """The packet to send next."""
        items = self._items
        if self._seq is not None:
            return items[0][2]
        return items[-1] if self.order is STACK else items[0]

    def pop(self) -> bytes:
        """Remove the packet `peek` returned (it has been sent)."""
        items = self._items
        if self._seq is not None:
            packet = heapq.heappop(items)[2]
        elif self.order is STACK:
            packet = items.pop()
        else:
            packet = items.popleft()
        self.nbytes -= len(packet)
        return packet

    def set_order(self, order: str) -> None:
        """Switch draining order, keeping what is queued."""
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}")
        if order == self.order:
            return
        if self._seq is not None:
            packets = [p for _, _, p in sorted(self._items, key=lambda e: e[1])]
        else:
            packets = list(self._items)
        self.order = ORDERS_BY_NAME[order]
        if self.order is LARGEST:
            self._seq = count()
            self._items = [(-len(p), next(self._seq), p) for p in packets]
            heapq.heapify(self._items)
        else:
            self._seq = None
            self._items = deque(packets)

    def set_soft(self, mode: str) -> None:
        if mode not in SOFT_MODES:
            raise ValueError(f"unknown soft mode {mode!r}")
        self.soft = {QUEUE: QUEUE, DISCARD: DISCARD, BLOCK: BLOCK, ERROR: ERROR}[mode]

    def set_hard(self, mode: str) -> None:
        if mode not in HARD_MODES:
            raise ValueError(f"unknown hard mode {mode!r}")
        self.hard = {DISCARD: DISCARD, BLOCK: BLOCK, ERROR: ERROR}[mode]

    def clear(self) -> int:
        """Forget everything queued; return how many packets that was."""
        n = len(self._items)
        self._items = [] if self._seq is not None else deque()
        self.nbytes = 0
        return n


# Interned names so `is` comparisons above hold for values parsed off the wire.
ORDERS_BY_NAME = {FIFO: FIFO, STACK: STACK, LARGEST: LARGEST}
