"""What one user (uid) holds and spends on a bus, in one object (no Twisted here).

dbus-broker charges every peer's bytes, fds and objects to its user (`UserCharge`) and
releases them when the peer goes; sbus does the same. A `UserCharge` carries, for one uid:
its connections, its stored patterns and what they cost, the bytes its clients' queues
hold (`queue`, a `sbus.core.flood.Budget` under the server's), and the reactor time its
clients' routing work takes (`work`). The broker charges here when a client connects,
subscribes or makes the router work, and releases here when it unsubscribes or leaves, so
no uid can take the memory or the time of everyone.
"""

from __future__ import annotations

from sbus.core.flood import Budget

__all__ = ["UserCharge", "WorkBudget", "WORK_SHARE", "WORK_BURST", "WORK_SLICE"]

#: The share of the reactor's time one uid's routing work (cache misses, SUB/UNSUB) may take
#: while other uids are connected: whatever it sends, another uid keeps well over half its rate.
WORK_SHARE = 0.3
#: Seconds of such work a uid may spend at once before its share applies.
WORK_BURST = 0.2
#: Seconds of such work one connection may do in one read batch before the reactor turns once
#: (accepts, reads the others) and comes back to it: a batch of 64 costly packets must not hold
#: everyone for 64 of them, even while its uid is alone (issue 33 item 6: a uid alone, reading
#: 64 misses of 100-160 ms at once, held root's connect for 12.9 s).
WORK_SLICE = 0.01
#: A debt smaller than this is none: waiting out a rounding error (a wait of 1e-17 s, which a
#: timer cannot tell from now) would put the uid back in the same state at once, again and again.
WORK_EPSILON = 1e-6


class WorkBudget:
    """Seconds of reactor time a uid may spend: `share` earned per second, up to `burst`."""

    __slots__ = ("share", "burst", "credit", "since")

    def __init__(self, now: float, share: float = WORK_SHARE, burst: float = WORK_BURST):
        self.share = share
        self.burst = burst
        self.credit = burst
        self.since = now

    def whole(self, now: float) -> bool:
        """Earned back to its burst: forgetting it now would give the uid nothing."""
        return self.credit + (now - self.since) * self.share >= self.burst

    def owed(self, now: float) -> float:
        """How long the uid must still wait to be out of debt (0: it is not in debt)."""
        credit = min(self.burst, self.credit + (now - self.since) * self.share)
        return 0.0 if credit >= -WORK_EPSILON else -credit / self.share

    def spend(self, seconds: float, now: float, alone: bool = False) -> float:
        """Charge `seconds` of work; return how long the uid must now wait (0: not at all).
        `alone` (no other uid connected, nobody to wait for): the debt is kept to one burst, so
        a uid that connects finds it owing a fraction of a second, not all it ever spent."""
        credit = min(self.burst, self.credit + (now - self.since) * self.share) - seconds
        if alone and credit < -self.burst:
            credit = -self.burst
        self.credit = credit
        self.since = now
        return 0.0 if credit >= -WORK_EPSILON else -credit / self.share


class UserCharge:
    """One uid's connections, patterns, queued bytes and routing work."""

    __slots__ = ("uid", "connections", "subscriptions", "subscription_bytes", "queue", "work", "watchers",
                 "kernel", "grown", "growing")

    def __init__(self, uid: int, queue_limit: int, server_queue: Budget, now: float):
        self.uid = uid
        self.connections = 0
        self.subscriptions = 0
        self.subscription_bytes = 0
        #: Bytes queued for this uid's clients, under the server's budget.
        self.queue = Budget(queue_limit, server_queue)
        self.work = WorkBudget(now)
        #: Its connections watching `server/interest`: each keeps a view of the uid's patterns,
        #: charged like them (`pattern_refusal`, `watch_refusal`) unless the uid sees everything.
        self.watchers = 0
        #: Of `queue`'s bytes, those reserved for its connections' kernel send buffers (not queued).
        self.kernel = 0
        #: Of `kernel`, what big packets sent whole through a small buffer hold until read (`grow`).
        self.grown = 0
        #: Its connections waiting for room to send a big packet (`may_grow`), in the order they
        #: asked (a dict: replayed alike in the simulator); None while there are none.
        self.growing = None

    def pattern_refusal(self, cost: int, max_subscriptions: int, max_bytes: int, views: bool = True) -> str | None:
        """Why one more pattern of `cost` would be over this uid's limits, or None. With
        `views` (a uid whose interest watchers see only its own patterns), each of its
        watchers keeps a copy of every pattern it holds: they count too."""
        if self.subscriptions + 1 > max_subscriptions:
            return f"over the limit of {max_subscriptions} subscriptions for uid {self.uid}"
        copies = 1 + self.watchers if views else 1
        if (self.subscription_bytes + cost) * copies > max_bytes:
            held = f" (its patterns and {copies - 1} interest watchers' views of them)" if copies > 1 else ""
            return f"over the limit of {max_bytes} subscription bytes for uid {self.uid}{held}"
        return None

    def watch_refusal(self, max_bytes: int) -> str | None:
        """Why one more interest watcher of this uid (which sees only its own uid's patterns and
        keeps a view of them, `sbus.core.interest`) would be over its subscription bytes, or None:
        its patterns and every view of them are charged alike."""
        copies = 2 + self.watchers
        if self.subscription_bytes * copies > max_bytes:
            return (f"over the limit of {max_bytes} subscription bytes for uid {self.uid}: one more interest "
                    f"watcher's view of its {self.subscription_bytes} bytes of patterns would make {copies} copies")
        return None

    def charge_pattern(self, cost: int) -> None:
        self.subscriptions += 1
        self.subscription_bytes += cost

    def release_patterns(self, n: int, cost: int) -> None:
        self.subscriptions -= n
        self.subscription_bytes -= cost

    def kernel_fits(self, n: int) -> bool:
        """Whether this uid's queue budget and the server's have room to reserve `n` more bytes
        of a connection's kernel send buffer (`reserve_kernel`)."""
        queue, server = self.queue, self.queue.parent
        return queue.used + n <= queue.limit and (server is None or server.used + n <= server.limit)

    def reserve_kernel(self, n: int) -> None:
        """Reserve `n` bytes of a connection's kernel send buffer (as the kernel counts it) from
        this uid's queue budget and the server's, as its queues are (issue 33.7): its connections
        that never read exhaust the budget their queues use. Given back by `release_kernel`."""
        self.kernel += n
        self.queue.used += n
        if self.queue.parent is not None:
            self.queue.parent.used += n

    def release_kernel(self, n: int) -> None:
        """Give back what `reserve_kernel` reserved (the connection's socket is closed)."""
        self.kernel -= n
        self.queue.used -= n
        if self.queue.parent is not None:
            self.queue.parent.used -= n

    def may_grow(self, n: int, who) -> bool:
        """Whether a connection `who` of this uid may send a packet the kernel counts as about
        `n` bytes through a send buffer raised for it (`grow`): if the budgets have room, or if
        no other big packet of the uid waits unread (so one always can: a uid's queues over its
        cap cannot stall its own readers for ever). If not, `who` waits for the next `shrink`.
        So a uid's connections that never read pin its cap and one big packet, not one each."""
        if not self.grown or self.kernel_fits(n):
            return True
        if self.growing is None:
            self.growing = {}
        self.growing[who] = None
        return False

    def grow(self, n: int) -> None:
        """A big packet the kernel counts as `n` bytes was sent through a raised send buffer:
        charged like the buffers until its peer has read it (`shrink`)."""
        self.reserve_kernel(n)
        self.grown += n

    def shrink(self, n: int) -> None:
        """The peer has read (or closed with) a big packet charged by `grow`: give it back (the
        connections waiting for room then try again: `take_waiting`)."""
        self.release_kernel(n)
        self.grown -= n

    def take_waiting(self) -> list:
        """The connections waiting for room (`may_grow`), in the order they asked, to try again
        (the uid's budget may have room now: its queues drain too)."""
        waiting, self.growing = self.growing, None
        return list(waiting) if waiting else []

    def forget(self, who) -> None:
        """`who` went: it waits for nothing any more (`may_grow`)."""
        if self.growing is not None:
            self.growing.pop(who, None)

    def idle(self, now: float) -> bool:
        """Nothing charged and nothing owed: no connection, nothing queued, its routing work
        earned back (the object may go; kept while in debt, a uid that closes its last
        connection and connects again would start afresh)."""
        return self.connections <= 0 and self.queue.used <= 0 and self.work.whole(now)

    def __repr__(self):
        return (f"<UserCharge uid={self.uid} conns={self.connections} subs={self.subscriptions} "
                f"queued={self.queue.used}>")
