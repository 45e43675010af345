"""Per-client outgoing queue and the flood-control policies of docs/protocol.md "Flood control".

Plain Python: the server asks `Outbox.offer` what to do with a packet that
cannot go straight to the client's socket (it would block, or older packets
are still waiting), and acts on the answer. The queue drains in the order
the client chose: oldest first (`order/queue`), newest first
(`order/stack`), or largest first (`order/random`: whatever frees the most
memory with the next send).

Switching the order is O(1) (a client may toggle it in every packet it
sends). While an outbox has only ever used `queue` and `stack` it is a
plain deque of packets, both ends of which serve those two orders. The
first switch to `random` turns it, for the rest of its life, into a deque
of entries in arrival order plus a heap of the same entries by size; a
packet sent through one of them is marked dead and skipped (and let go) by
the other, and each is compacted when its dead entries outnumber the live
ones, so every packet costs O(log n) amortised whatever the toggling.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import NamedTuple

# Modes, as named by the protocol's control keys.
QUEUE, DISCARD, BLOCK, ERROR = "queue", "discard", "block", "error"
FIFO, STACK, LARGEST = "queue", "stack", "random"

SOFT_MODES = frozenset((QUEUE, DISCARD, BLOCK, ERROR))
HARD_MODES = frozenset((DISCARD, BLOCK, ERROR))
ORDERS = frozenset((FIFO, STACK, LARGEST))

# What `offer` decided (`reason` says it in words for the last two kinds).
QUEUED = 0  # kept; will be sent when the socket is writable
QUEUED_BLOCK = 1  # kept; stop reading from whoever fed it until the queue drains
DROPPED_SOFT = 2  # discarded by the soft mode (`soft_discard`)
DROPPED_HARD = 3  # discarded by the hard mode (`hard_discard`)
DISCONNECT_SOFT = 4  # the client misbehaves: disconnect it (`soft_error`)
DISCONNECT_HARD = 5  # (`hard_error`)
DROPPED = DROPPED_SOFT  # any value <= DROPPED_HARD and >= DROPPED is a drop
DISCONNECT = DISCONNECT_SOFT  # any value >= DISCONNECT is a disconnection

# Reasons, as they appear in statistics.
SOFT_DISCARD = "soft_discard"
HARD_DISCARD = "hard_discard"
SOFT_ERROR = "soft_error"
HARD_ERROR = "hard_error"

_COMPACT_SLACK = 64


class Budget:
    """Bytes queued by a group of outboxes (one uid's; the whole server's) against a limit.

    An outbox charges what it queues to its budget and to that budget's parent; a packet
    that would take either over its limit is over the limit, like one over the outbox's own
    (the client's hard mode applies)."""

    __slots__ = ("used", "limit", "parent")

    def __init__(self, limit: int, parent: "Budget | None" = None):
        self.used = 0
        self.limit = limit
        self.parent = parent

    def __repr__(self):
        return f"<Budget {self.used}/{self.limit}>"


class QueueState(NamedTuple):
    """An outbox as statistics show it."""

    packets: int
    bytes: int
    soft: str
    hard: str
    order: str


#: Charged when an outbox has no budget of its own: no limit, nobody reads it.
_UNLIMITED = Budget(1 << 62, Budget(1 << 62))


class Outbox:
    """Packets waiting for one client, with that client's flood settings.

    This class serves `queue` and `stack` from one deque of packets; the first switch to
    `random` turns the instance into a `_DualOutbox` (same slots) for the rest of its life."""

    __slots__ = ("soft", "hard", "order", "max_bytes", "max_packets", "nbytes", "_items", "_heap",
                 "_seq", "_n", "_dead_items", "_dead_heap", "reason", "budget", "_server", "_charged")

    def __init__(self, max_bytes: int, max_packets: int):
        self.soft = QUEUE
        self.hard = DISCARD
        self.order = FIFO
        self.max_bytes = max_bytes
        self.max_packets = max_packets
        self.nbytes = 0
        #: Packets in arrival order (dual mode: entries ``[packet]``, ``[None]`` once sent).
        self._items: deque = deque()
        #: Dual mode only: ``(-size, seq, entry)`` for every entry.
        self._heap: list | None = None
        self._seq = 0
        #: Dual mode only: live packets (dead entries stay in the deque and the heap).
        self._n = 0
        self._dead_items = 0
        self._dead_heap = 0
        #: Why the last DROPPED/DISCONNECT happened.
        self.reason = ""
        #: What this outbox charges its bytes to (its uid's budget, whose parent is the server's).
        self.budget = _UNLIMITED
        self._server = _UNLIMITED.parent
        #: What is charged to the budgets: `nbytes` as of the last push (sends are settled at the
        #: next push or when the queue empties, so the budgets never count less than is queued).
        self._charged = 0

    def set_budget(self, budget: Budget) -> None:
        """Charge to `budget` (and its parent) from now on, moving what is queued there."""
        self.budget.used -= self._charged
        self._server.used -= self._charged
        self.budget = budget
        self._server = budget.parent if budget.parent is not None else _UNLIMITED.parent
        self._charged = self.nbytes
        budget.used += self.nbytes
        self._server.used += self.nbytes

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def full(self) -> bool:
        """Is the queue at or over one of its limits (its own, its uid's, the server's)?"""
        return (self.nbytes >= self.max_bytes or len(self) >= self.max_packets
                or self.budget.used >= self.budget.limit or self._server.used >= self._server.limit)

    def state(self) -> QueueState:
        return QueueState(len(self), self.nbytes, self.soft, self.hard, self.order)

    def offer(self, packet: bytes) -> int:
        """Decide the fate of a packet that cannot be sent right now (and queue it if kept)."""
        soft = self.soft
        if soft is DISCARD:
            self.reason = SOFT_DISCARD
            return DROPPED_SOFT
        if soft is ERROR:
            self.reason = SOFT_ERROR
            return DISCONNECT_SOFT
        n = len(packet)
        budget = self.budget
        server = self._server
        if (self.nbytes + n > self.max_bytes or len(self._items) - self._dead_items >= self.max_packets
                or budget.used + n > budget.limit or server.used + n > server.limit):
            hard = self.hard
            if hard is DISCARD:
                self.reason = HARD_DISCARD
                return DROPPED_HARD
            if hard is ERROR:
                self.reason = HARD_ERROR
                return DISCONNECT_HARD
            self.push(packet)
            return QUEUED_BLOCK
        self.push(packet)
        return QUEUED_BLOCK if soft is BLOCK else QUEUED

    def push(self, packet: bytes) -> None:
        """Queue unconditionally."""
        nbytes = self.nbytes + len(packet)
        self.nbytes = nbytes
        charge = nbytes - self._charged
        self._charged = nbytes
        self.budget.used += charge
        self._server.used += charge
        self._items.append(packet)

    def _settle(self) -> None:
        """The queue is empty: nothing is charged any more."""
        charged, self._charged = self._charged, 0
        self.budget.used -= charged
        self._server.used -= charged

    def peek(self) -> bytes:
        """The packet to send next."""
        return self._items[-1] if self.order is STACK else self._items[0]

    def pop(self) -> bytes:
        """Remove the packet `peek` returns (it has been sent)."""
        items = self._items
        packet = items.pop() if self.order is STACK else items.popleft()
        self.nbytes -= len(packet)
        if not items:
            self._settle()
        return packet

    def set_order(self, order: str) -> None:
        """Switch draining order, keeping what is queued: O(1) (amortised, see the module's text)."""
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}")
        order = ORDERS_BY_NAME[order]
        if order is LARGEST and self._heap is None:
            # Once per outbox: from now on it keeps both views.
            entries = deque([p] for p in self._items)
            heap = [(-len(entry[0]), seq, entry) for seq, entry in enumerate(entries, 1)]
            heapq.heapify(heap)
            self._items, self._heap, self._seq, self._n = entries, heap, len(entries), len(entries)
            self.__class__ = _DualOutbox
        self.order = order

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
        n = len(self)
        self._items = deque()
        if self._heap is not None:
            self._heap = []
        self._settle()
        self._n = self.nbytes = self._dead_items = self._dead_heap = 0
        return n


class _DualOutbox(Outbox):
    """An `Outbox` that has used `random`: a deque of entries in arrival order plus a heap of
    the same entries by size; what one of them sends is dead in the other."""

    __slots__ = ()

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n != 0

    def push(self, packet: bytes) -> None:
        n = len(packet)
        nbytes = self.nbytes + n
        self.nbytes = nbytes
        charge = nbytes - self._charged
        self._charged = nbytes
        self.budget.used += charge
        self._server.used += charge
        self._n += 1
        entry = [packet]
        self._items.append(entry)
        self._seq += 1
        heapq.heappush(self._heap, (-n, self._seq, entry))

    def peek(self) -> bytes:
        if self.order is LARGEST:
            heap = self._heap
            while heap[0][2][0] is None:
                heapq.heappop(heap)
                self._dead_heap -= 1
            return heap[0][2][0]
        items = self._items
        if self.order is STACK:
            while items[-1][0] is None:
                items.pop()
                self._dead_items -= 1
            return items[-1][0]
        while items[0][0] is None:
            items.popleft()
            self._dead_items -= 1
        return items[0][0]

    def pop(self) -> bytes:
        self.peek()  # skips dead entries at the end we take from
        if self.order is LARGEST:
            entry = heapq.heappop(self._heap)[2]
            self._dead_items += 1
        else:
            entry = self._items.pop() if self.order is STACK else self._items.popleft()
            self._dead_heap += 1
        packet = entry[0]
        entry[0] = None
        self.nbytes -= len(packet)
        self._n -= 1
        if not self._n:
            self._settle()
        live = self._n + _COMPACT_SLACK
        if self._dead_items > live:
            self._items = deque(e for e in self._items if e[0] is not None)
            self._dead_items = 0
        if self._dead_heap > live:
            heap = self._heap = [t for t in self._heap if t[2][0] is not None]
            heapq.heapify(heap)
            self._dead_heap = 0
        return packet

    def set_order(self, order: str) -> None:
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}")
        self.order = ORDERS_BY_NAME[order]


# Interned names so `is` comparisons above hold for values parsed off the wire.
ORDERS_BY_NAME = {FIFO: FIFO, STACK: STACK, LARGEST: LARGEST}
