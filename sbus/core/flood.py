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

This queue is the one place that decides what a client gets (docs/protocol.md "Flood
control"). Everything the server sends a client goes through it: messages by `offer`
(the flood policy decides), replies and notices by `push_control` (never dropped,
bounded by their own small budget). The transport only moves bytes: it takes packets
from the front (`peek`/`pop`, or `head` and `sent` for a sendmmsg batch) and, when the
socket refuses with packets left, calls `refused`, which applies the soft mode to the
messages the socket did not take. "Cannot be delivered without blocking" is `blocked`:
the socket refused a send and the queue has not emptied since. While it is not blocked,
the queue holds only what was offered since the transport last emptied it (the current
batch), all of which the socket may still take.
"""

from __future__ import annotations

import heapq
from collections import deque
from functools import lru_cache
from itertools import islice
from typing import NamedTuple

from sbus.core.reasons import Disconnect, Drop

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
#: Not decided yet: the queue holds half its limits of packets the socket may still take; send
#: them first (the transport's `flush`), then ask again with `decide` (never FLUSH).
FLUSH = -1
#: The queue is closed (`clear`): the packet goes nowhere, and nothing is counted.
CLOSED = -2
#: `hard/block`, over a limit: not queued (the caps hold exactly); the caller holds it back,
#: beside the queue, with its publisher paused, until the queue has room (`sbus.server.broker`).
HELD_BACK = 6
DROPPED = DROPPED_SOFT  # any value <= DROPPED_HARD and >= DROPPED is a drop
DISCONNECT = DISCONNECT_SOFT  # any value >= DISCONNECT is a disconnection

# Reasons, as they appear in statistics (`sbus.core.reasons`).
SOFT_DISCARD = Drop.SOFT_DISCARD
HARD_DISCARD = Drop.HARD_DISCARD
SOFT_ERROR = Disconnect.SOFT_ERROR
HARD_ERROR = Disconnect.HARD_ERROR

_COMPACT_SLACK = 64

#: What an `Outbox` holds instead of a deque while it is empty: nothing to append to, so the
#: first packet makes the deque and the last one sent lets it go (a deque with its block is
#: about 1.3 KB, more than everything else an idle connection pins).
_NO_ITEMS = ()


@lru_cache(maxsize=64)
def _half(limit: int) -> int:
    """Half a limit, at least 1; cached so that every outbox with the same limits shares one
    int object (one of its own would cost every idle connection 32 bytes)."""
    return max(1, limit // 2)


#: Replies and notices one client may have queued beyond its message limits before the server
#: stops reading that client until they drain (a client that asks without reading).
DEFAULT_CONTROL_BYTES = 1 << 20


def _heap_size(packet: bytes) -> int:
    """A packet's key in the largest-first heap: a message by its size (the largest first); a
    control packet after every message, in the order queued (seq breaks the tie)."""
    return 0 if packet.__class__ is Control else -len(packet)


class Control(bytes):
    """A server reply or notice in a client's queue: flood control never drops it."""

    __slots__ = ()


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
    """Everything waiting for one client, with that client's flood settings.

    This class serves `queue` and `stack` from one deque of packets; the first switch to
    `random` turns the instance into a `_DualOutbox` (same slots) for the rest of its life.
    Control packets (`Control`) share the deque in `queue` order, keeping their place; in
    `random` order they are in the heap after every message, in the order they came; in
    `stack` order they wait in `_ctl` (in the order they came) and go out before any message
    (the newest first is the client's choice)."""

    __slots__ = ("soft", "hard", "order", "max_bytes", "max_packets", "nbytes", "_items", "_heap",
                 "_seq", "_n", "_dead_items", "_dead_heap", "reason", "budget", "_server", "_charged",
                 "blocked", "_ctl", "ctl_bytes", "ctl_limit", "_batch_bytes", "_batch_packets", "closed", "lost",
                 "waiting")

    def __init__(self, max_bytes: int, max_packets: int, ctl_limit: int = DEFAULT_CONTROL_BYTES):
        self.soft = QUEUE
        self.hard = DISCARD
        self.order = FIFO
        self.max_bytes = max_bytes
        self.max_packets = max_packets
        #: Bytes queued, messages and control packets.
        self.nbytes = 0
        #: Packets in arrival order (dual mode: entries ``[packet]``, ``[None]`` once sent); while
        #: the queue is empty (outside dual mode), `_NO_ITEMS`.
        self._items: deque | tuple = _NO_ITEMS
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
        #: The socket refused a send and the queue has not emptied since (or the queue is closed).
        self.blocked = False
        #: `clear`ed: the connection is going; what is offered from now on goes nowhere (CLOSED).
        self.closed = False
        #: Messages `clear` threw away (a session's stand-in counts them as missed).
        self.lost = 0
        #: `hard/block`: messages over a limit that wait beside the queue for room, each
        #: ``(packet, holder, budget)`` (`hold_back`); None while there are none.
        self.waiting: deque | None = None
        #: Control packets waiting ahead of every message (orders other than `queue`).
        self._ctl: deque | None = None
        #: Bytes of control packets queued, and how many may be before the client is not read.
        self.ctl_bytes = 0
        self.ctl_limit = ctl_limit
        #: While not blocked: past half the limits, send what is queued before deciding more.
        self._batch_bytes = _half(max_bytes)
        self._batch_packets = _half(max_packets)

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
        return len(self._items) + (len(self._ctl) if self._ctl else 0)

    def __bool__(self) -> bool:
        return self.nbytes != 0  # no packet is empty

    def full(self) -> bool:
        """Are the messages at or over one of the limits (their own, the uid's, the server's)?"""
        return (self.nbytes - self.ctl_bytes >= self.max_bytes or len(self) >= self.max_packets
                or self.budget.used >= self.budget.limit or self._server.used >= self._server.limit)

    def controls(self) -> tuple[int, int]:
        """How many of the queued packets are replies and notices, and their bytes, counted
        afresh (O(n): for checks and closing, not the hot path)."""
        items = [p for p in self._live_items() + list(self._ctl or ()) if p.__class__ is Control]
        return len(items), sum(map(len, items))

    def state(self) -> QueueState:
        return QueueState(len(self), self.nbytes, self.soft, self.hard, self.order)

    def offer(self, packet: bytes) -> int:
        """Decide the fate of a message for this client (and queue it if kept).

        While the socket is not known to be full (`blocked` is False) a message is queued for
        the transport's next send, within the client's own limits; once it is, the soft mode
        decides, and the uid's and the server's budgets count too. (What waits for the next
        send of a socket that took everything so far, at most one read batch, is charged to
        those budgets only if the socket refuses it: `refused`.)"""
        if self.blocked:  # (a dual outbox's `offer` is `decide`)
            return self.decide(packet)
        nbytes = self.nbytes + len(packet)
        items = self._items
        if nbytes - self.ctl_bytes > self._batch_bytes or len(items) >= self._batch_packets:
            return FLUSH  # much is waiting to be sent: find out whether the socket takes it
        self.nbytes = nbytes
        if items is _NO_ITEMS:
            items = self._items = deque()
        items.append(packet)
        return QUEUED

    def room(self) -> tuple[int, int] | None:
        """How many bytes and packets may be queued now, all at once, where `offer` would simply
        queue each of them (the same test, for a run of messages): None if `offer` would not (the
        socket is full, the queue is closed, or it is in `random` order)."""
        if self.blocked:
            return None
        return self._batch_bytes - (self.nbytes - self.ctl_bytes), self._batch_packets - len(self._items)

    def take(self, packets: list, nbytes: int) -> None:
        """Queue a run of messages of `nbytes` bytes that `room` said fits: what `offer` would
        have done with each (QUEUED), at once."""
        self.nbytes += nbytes
        items = self._items
        if items is _NO_ITEMS:
            self._items = deque(packets)
        else:
            items.extend(packets)

    def decide(self, packet: bytes) -> int:
        """`offer` without FLUSH: what the limits and the soft mode say now."""
        if self.closed:
            return CLOSED
        blocked = self.blocked
        if blocked:
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
        extra = self.nbytes - self._charged + n  # what pushing it would add to the budgets
        if (self.nbytes - self.ctl_bytes + n > self.max_bytes or len(self._items) - self._dead_items >= self.max_packets
                or (blocked and (budget.used + extra > budget.limit or server.used + extra > server.limit))):
            hard = self.hard
            if hard is DISCARD:
                self.reason = HARD_DISCARD
                return DROPPED_HARD
            if hard is ERROR:
                self.reason = HARD_ERROR
                return DISCONNECT_HARD
            if self.nbytes != self.ctl_bytes:
                return HELD_BACK  # it goes in when what is queued has gone
            # No message queued: nothing would drain to make room, so it goes in alone (one
            # message larger than the limit, or the uid's or server's caps taken by others).
            self.push(packet)
            return QUEUED_BLOCK
        if blocked:
            self.push(packet)
            return QUEUED_BLOCK if self.soft is BLOCK else QUEUED
        self._push_uncharged(packet)
        return QUEUED

    def _push_uncharged(self, packet: bytes) -> None:
        self.nbytes += len(packet)
        if self._items is _NO_ITEMS:
            self._items = deque()
        self._items.append(packet)

    def _charge(self) -> None:
        """Charge the budgets with everything queued (the socket refused it)."""
        charge = self.nbytes - self._charged
        self._charged = self.nbytes
        self.budget.used += charge
        self._server.used += charge

    def push(self, packet: bytes) -> None:
        """Queue unconditionally."""
        nbytes = self.nbytes + len(packet)
        self.nbytes = nbytes
        charge = nbytes - self._charged
        self._charged = nbytes
        self.budget.used += charge
        self._server.used += charge
        if self._items is _NO_ITEMS:
            self._items = deque()
        self._items.append(packet)

    def push_control(self, packet: bytes) -> bool:
        """Queue a reply or notice, whatever the flood mode and the message limits; False if
        control packets are now over their own budget (then stop reading the client until
        its queue drains)."""
        if packet.__class__ is not Control:
            packet = Control(packet)
        n = len(packet)
        if not self._ctl and (self.order is FIFO or (self.order is LARGEST and self._heap is not None)):
            # In `queue` order it keeps its place among the messages; in `random` it goes after
            # every message queued (a sync is a barrier), in the order of the requests.
            self.push(packet)
        else:
            nbytes = self.nbytes + n
            self.nbytes = nbytes
            charge = nbytes - self._charged
            self._charged = nbytes
            self.budget.used += charge
            self._server.used += charge
            if self._ctl is None:
                self._ctl = deque()
            self._ctl.append(packet)
        self.ctl_bytes += n
        return self.ctl_bytes <= self.ctl_limit

    def _settle(self) -> None:
        """The queue is empty: nothing is charged any more, the socket took the last packet.
        Its deques go (the dual views stay): an idle client pins none."""
        if self._heap is None:
            self._items = _NO_ITEMS
        self._ctl = None
        charged = self._charged
        if charged:
            self._charged = 0
            self.budget.used -= charged
            self._server.used -= charged
        self.blocked = self.closed

    def writable(self) -> None:
        """The socket took everything queued (it was writable): it is not full any more."""
        if not self.nbytes:
            self.blocked = self.closed

    def peek(self) -> bytes:
        """The packet to send next."""
        if self._ctl:
            return self._ctl[0]
        # The order applies to what waits for a full socket; a batch the socket may take goes in order.
        return self._items[-1] if self.order is STACK and self.blocked else self._items[0]

    def pop(self) -> bytes:
        """Remove the packet `peek` returns (it has been sent)."""
        ctl = self._ctl
        if ctl:
            packet = ctl.popleft()
        else:
            items = self._items
            packet = items.pop() if self.order is STACK and self.blocked else items.popleft()
        n = len(packet)
        self.nbytes -= n
        if packet.__class__ is Control:
            self.ctl_bytes -= n
        if not self.nbytes:
            self._settle()
        return packet

    def head(self, cap: int) -> list | None:
        """Up to `cap` packets from the front, in sending order, for one sendmmsg; None when the
        queue does not drain front to back as one deque (another order, control packets apart)."""
        if (self.order is not FIFO and self.blocked) or self._ctl or self._heap is not None:
            return None
        items = self._items
        return list(items) if len(items) <= cap else list(islice(items, cap))

    def sent(self, n: int) -> int:
        """The first `n` packets of `head` were sent: remove them; return their bytes."""
        items = self._items
        if n == len(items):
            nbytes = self.nbytes
            self.nbytes = self.ctl_bytes = 0
            self._settle()  # lets the deque go (`clear` would keep a spare block in it)
            return nbytes
        total = ctl = 0
        popleft = items.popleft
        for _ in range(n):
            packet = popleft()
            total += len(packet)
            if packet.__class__ is Control:
                ctl += len(packet)
        self.nbytes -= total
        self.ctl_bytes -= ctl
        if not self.nbytes:
            self._settle()
        return total

    def refused(self) -> tuple[int, list | None]:
        """The socket refused a send with packets left: from now on the queue is `blocked`.
        If it was not before, the messages left are ones the socket could not take now, and
        the soft mode decides for them, then the uid's and the server's budgets (the hard mode
        for what is over them): (QUEUED, None) keep them; (QUEUED_BLOCK, None) keep them and
        hold whoever fed them; (DISCONNECT_SOFT or _HARD, None); (DROPPED_SOFT or _HARD,
        dropped): those are thrown away (control packets stay), in the order they came."""
        if self.blocked:
            return QUEUED, None
        self.blocked = True
        soft = self.soft
        if not self._has_messages():
            self._charge()
            return QUEUED, None
        if soft is DISCARD:
            self.reason = SOFT_DISCARD
            dropped = self._drop_messages(1 << 62)
            self._charge()
            return DROPPED_SOFT, dropped
        if soft is ERROR:
            self.reason = SOFT_ERROR
            self._charge()
            return DISCONNECT_SOFT, None
        extra = self.nbytes - self._charged
        over = max(self.budget.used + extra - self.budget.limit, self._server.used + extra - self._server.limit)
        if over > 0 and self.hard is not BLOCK:
            if self.hard is ERROR:
                self.reason = HARD_ERROR
                self._charge()
                return DISCONNECT_HARD, None
            self.reason = HARD_DISCARD
            dropped = self._drop_messages(over)
            self._charge()
            return DROPPED_HARD, dropped
        self._charge()
        return (QUEUED_BLOCK, None) if soft is BLOCK or over > 0 else (QUEUED, None)

    def _has_messages(self) -> bool:
        return self.nbytes != self.ctl_bytes

    def _drop_messages(self, nbytes: int) -> list:
        """Remove the newest messages, at least `nbytes` of them or all (control packets
        stay); return them in arrival order."""
        live = self._live_items()
        dropped = []
        freed = 0
        for i in range(len(live) - 1, -1, -1):
            if freed >= nbytes:
                break
            p = live[i]
            if p.__class__ is not Control:
                dropped.append(p)
                freed += len(p)
                live[i] = None
        dropped.reverse()
        ctl = self._ctl
        self._ctl = None
        self._items = deque()
        self._reset_views()
        self.nbytes = self.ctl_bytes = 0
        charged, self._charged = self._charged, 0
        self.budget.used -= charged
        self._server.used -= charged
        for p in live:
            if p is not None:
                if p.__class__ is Control:
                    self.ctl_bytes += len(p)
                self._push_uncharged(p)
        if ctl:
            self._ctl = ctl
            self.nbytes += sum(map(len, ctl))
            self.ctl_bytes += sum(map(len, ctl))
        return dropped

    def _live_items(self) -> list:
        return list(self._items)

    def _reset_views(self) -> None:
        pass

    def set_order(self, order: str) -> None:
        """Switch draining order, keeping what is queued: O(1) (amortised, see the module's text)."""
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}")
        order = ORDERS_BY_NAME[order]
        if order is STACK:
            self._controls_ahead()
        if order is LARGEST and self._heap is None:
            # Once per outbox: from now on it keeps both views.
            entries = deque([p] for p in self._items)
            heap = [(_heap_size(entry[0]), seq, entry) for seq, entry in enumerate(entries, 1)]
            heapq.heapify(heap)
            self._items, self._heap, self._seq, self._n = entries, heap, len(entries), len(entries)
            self.__class__ = _DualOutbox
        self.order = order

    def _controls_ahead(self) -> None:
        """Into `stack` order: control packets leave the messages' deque for `_ctl`, in the
        order they came and ahead of those already there (there they go before every message,
        and in the order of the requests: a reply is never sorted like a message)."""
        if self.ctl_bytes and self._items:
            ctl = deque(p for p in self._items if p.__class__ is Control)
            if ctl:
                self._items = deque(p for p in self._items if p.__class__ is not Control)
                if self._ctl:
                    ctl.extend(self._ctl)
                self._ctl = ctl

    def set_soft(self, mode: str) -> None:
        if mode not in SOFT_MODES:
            raise ValueError(f"unknown soft mode {mode!r}")
        self.soft = {QUEUE: QUEUE, DISCARD: DISCARD, BLOCK: BLOCK, ERROR: ERROR}[mode]

    def set_hard(self, mode: str) -> None:
        if mode not in HARD_MODES:
            raise ValueError(f"unknown hard mode {mode!r}")
        self.hard = {DISCARD: DISCARD, BLOCK: BLOCK, ERROR: ERROR}[mode]

    # -- `hard/block`: messages that wait beside the queue, charged like it

    def hold_back(self, packet: bytes, holder, budget: Budget) -> None:
        """`hard/block`, and `packet` is over a limit: it waits beside the queue until the queue
        has room for it, charged to `budget` (its publisher's uid: the one that sends into a full
        queue pays, and the caps still hold). `holder` stays held while it waits (`holders`)."""
        n = len(packet)
        budget.used += n
        budget.parent.used += n
        waiting = self.waiting
        if waiting is None:
            waiting = self.waiting = deque()
        waiting.append((packet, holder, budget))

    def next_waiting(self) -> bytes | None:
        """The message that has waited longest beside the queue (to `decide` again), or None."""
        waiting = self.waiting
        return waiting[0][0] if waiting else None

    def unwait(self) -> None:
        """The message `next_waiting` gave was decided: it leaves the side, and its charge."""
        packet, _, budget = self.waiting.popleft()
        budget.used -= len(packet)
        budget.parent.used -= len(packet)

    def holders(self) -> set:
        """Whose messages still wait: they stay held."""
        return {holder for _, holder, _ in self.waiting or ()}

    def drop_waiting(self) -> int:
        """The connection is going: what waits is let go, uncharged and counted as `lost`."""
        waiting, self.waiting = self.waiting, None
        if not waiting:
            return 0
        for packet, _, budget in waiting:
            budget.used -= len(packet)
            budget.parent.used -= len(packet)
        self.lost += len(waiting)
        return len(waiting)

    def clear(self) -> int:
        """Forget everything queued or waiting beside the queue, and whatever is offered later
        (the connection is going); return how many packets were queued."""
        self.drop_waiting()
        n = len(self)
        if n:
            self.lost += n - self.controls()[0]
        self._items = deque()
        self._ctl = None
        if self._heap is not None:
            self._heap = []
        self._settle()
        self._n = self.nbytes = self._dead_items = self._dead_heap = self.ctl_bytes = 0
        self.closed = self.blocked = True
        return n


class _DualOutbox(Outbox):
    """An `Outbox` that has used `random`: a deque of entries in arrival order plus a heap of
    the same entries by size; what one of them sends is dead in the other. Control packets
    are entries like messages, in the heap after every message (`_heap_size`); in `stack`
    order they wait in `_ctl`."""

    __slots__ = ()

    def offer(self, packet: bytes) -> int:
        return self.decide(packet)

    def room(self) -> None:
        return None  # every message is decided on its own here (`decide`)

    def __len__(self) -> int:
        return self._n + (len(self._ctl) if self._ctl else 0)

    def push(self, packet: bytes) -> None:
        self._push_uncharged(packet)
        self._charge()

    def _push_uncharged(self, packet: bytes) -> None:
        n = len(packet)
        self.nbytes += n
        self._n += 1
        entry = [packet]
        self._items.append(entry)
        self._seq += 1
        heapq.heappush(self._heap, (_heap_size(packet), self._seq, entry))

    def peek(self) -> bytes:
        if self._ctl:
            return self._ctl[0]
        order = self.order if self.blocked else FIFO
        if order is LARGEST:
            heap = self._heap
            while heap[0][2][0] is None:
                heapq.heappop(heap)
                self._dead_heap -= 1
            return heap[0][2][0]
        items = self._items
        if order is STACK:
            while items[-1][0] is None:
                items.pop()
                self._dead_items -= 1
            return items[-1][0]
        while items[0][0] is None:
            items.popleft()
            self._dead_items -= 1
        return items[0][0]

    def pop(self) -> bytes:
        if self._ctl:
            return Outbox.pop(self)
        self.peek()  # skips dead entries at the end we take from
        order = self.order if self.blocked else FIFO
        if order is LARGEST:
            entry = heapq.heappop(self._heap)[2]
            self._dead_items += 1
        else:
            entry = self._items.pop() if order is STACK else self._items.popleft()
            self._dead_heap += 1
        packet = entry[0]
        entry[0] = None
        self.nbytes -= len(packet)
        if packet.__class__ is Control:
            self.ctl_bytes -= len(packet)
        self._n -= 1
        if not self.nbytes:
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

    def _live_items(self) -> list:
        return [e[0] for e in self._items if e[0] is not None]

    def _reset_views(self) -> None:
        self._heap = []
        self._n = self._dead_items = self._dead_heap = 0

    def set_order(self, order: str) -> None:
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}")
        self.order = ORDERS_BY_NAME[order]
        if self.order is STACK:
            self._controls_ahead()

    def _controls_ahead(self) -> None:
        if not self.ctl_bytes:
            return
        moved = deque()
        for entry in self._items:
            packet = entry[0]
            if packet is not None and packet.__class__ is Control:
                entry[0] = None  # dead in both views
                self._dead_items += 1
                self._dead_heap += 1
                self._n -= 1
                moved.append(packet)
        if moved:
            if self._ctl:
                moved.extend(self._ctl)
            self._ctl = moved


# Interned names so `is` comparisons above hold for values parsed off the wire.
ORDERS_BY_NAME = {FIFO: FIFO, STACK: STACK, LARGEST: LARGEST}
