"""The broker: per-client protocol and the factory that holds the bus together.

A thin Twisted shell around the sans-I/O core: packets come in from a
`SeqPacketTransport`, are classified and routed by `sbus.core`, and go out
through each subscriber's transport under its flood-control settings.
Nothing here logs per packet or creates a Deferred per packet.
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import time
from collections import Counter

from twisted.internet import interfaces, protocol
from twisted.logger import Logger
from zope.interface import implementer

from sbus.core import codec, flood
from sbus.core.credentials import SECRET_ROOT, CredentialError, check_key, check_pattern, secret_prefix, whoami
from sbus.core.router import Router
from sbus.server.config import allowed_uid_set, SEGMENT_COST, ServerConfig

log = Logger()

#: Linux 6.5+: a pidfd for the process that connected (not in Python 3.11's socket module).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)

_WHOAMI_REPLY = b"CMSG " + codec.WHOAMI + b"\0"
_STATS_REPLY = b"CMSG " + codec.STATS + b"\0"

# Disconnect reasons, as they appear in statistics.
PROTOCOL_ERROR = "protocol_error"
OVERSIZE = "oversize"
FORBIDDEN = "forbidden_subscription"
INVALID_BANG = "invalid_bang"
OWNER_GONE = "owner_exited"
TOO_MANY_SUBSCRIPTIONS = "too_many_subscriptions"
STALLED = "stalled"
CLOSED = "closed"


class BrokerProtocol(protocol.Protocol):
    """One connected client: its credentials, subscriptions, echo and flood settings."""

    __slots__ = (
        "factory", "cred", "label", "echo", "packets_in", "bytes_in", "drops",
        "blocked_feeders", "block_count", "whoami_reply", "reason", "subscriptions", "subscription_bytes",
        "_stall",
        "_owner", "_match", "_prefix",
    )

    def __init__(self, factory: "BrokerFactory", cred):
        self.factory = factory
        self.cred = cred
        self.label = f"pid={cred.pid} uid={cred.uid} gid={cred.gid}"
        self.echo = True
        self.packets_in = 0
        self.bytes_in = 0
        self.drops: Counter | None = None
        #: Publishers this client's full queue has paused (soft/hard `block`).
        self.blocked_feeders: set | None = None
        #: How many subscribers are holding this client's reading paused.
        self.block_count = 0
        self.whoami_reply = _WHOAMI_REPLY + whoami(factory.config.cred_prefix, cred)
        self.reason = CLOSED
        self.subscriptions = 0
        #: Estimated memory its patterns pin (see `pattern_cost`).
        self.subscription_bytes = 0
        #: Fires when this client has held publishers paused for too long.
        self._stall = None
        #: Watches the process that connected once the client holds secret patterns.
        self._owner = None
        self._match = factory.router.match
        self._prefix = factory.config.cred_prefix

    def __repr__(self):
        return f"<client {self.label}>"

    # -- connection life

    def connectionMade(self):
        self.factory.clientConnected(self)

    def connectionLost(self, reason=None):
        self._releaseFeeders()
        if self._owner is not None:
            self._owner.close()
        self.factory.clientGone(self)

    # -- incoming packets: the hot path

    def packetReceived(self, packet: bytes):
        self.packets_in += 1
        self.bytes_in += len(packet)
        if packet[:4] == b"MSG ":
            end = packet.find(b"\0", 4)
            if end < 0:
                return self.misbehaved(PROTOCOL_ERROR, "MSG without a NUL between key and payload")
            key = packet[4:end]
            # 33 is "!": an int membership test is one memchr; `b"!" in key` first tries the
            # operand as an int and raises and clears a TypeError (CPython 3.11: ~10x slower).
            if 33 in key:
                try:
                    check_key(key)
                except CredentialError as e:
                    return self.misbehaved(INVALID_BANG, str(e))
            for client in self._match(key):
                if client is self and not self.echo:
                    continue
                client.deliver(packet, self)
            upstream = self.factory.upstream
            if upstream is not None:
                upstream.localPublish(packet, key, self)
            return None
        try:
            kind, key = codec.classify(packet, self.factory.config.max_packet)
        except codec.ProtocolError as e:
            return self.misbehaved(PROTOCOL_ERROR, str(e))
        if kind == codec.CMSG:
            handler = _CONTROL.get(key)
            if handler is not None:
                handler(self)
        elif kind == codec.SUB:
            self.subscribe(key)
        else:
            self.unsubscribe(key)
        return None

    def packetTooLarge(self, size: int):
        self.misbehaved(OVERSIZE, f"packet of {size} bytes exceeds the {self.factory.config.max_packet}-byte limit")

    # -- outgoing

    def deliver(self, packet: bytes, feeder: "BrokerProtocol | None") -> None:
        """Hand a routed packet to this client under its flood-control settings."""
        transport = self.transport
        if transport.trySend(packet) or transport.disconnecting:
            return
        outbox = transport.outbox
        action = outbox.offer(packet)
        if action == flood.QUEUED:
            transport.startWriting()
        elif action == flood.QUEUED_BLOCK:
            transport.startWriting()
            if feeder is not None:
                self._block(feeder)
        elif action == flood.DROPPED:
            drops = self.drops
            if drops is None:
                drops = self.drops = Counter()
            drops[outbox.reason] += 1
        else:
            self.misbehaved(outbox.reason, f"cannot keep up ({outbox.reason.replace('_', '/')} mode, "
                                           f"{len(outbox)} packets / {outbox.nbytes} bytes queued)")

    def reply(self, packet: bytes) -> None:
        """Server replies are queued, never dropped, whatever the flood mode."""
        self.transport.write(packet)

    def outboxDrained(self):
        self._releaseFeeders()

    def _block(self, feeder: "BrokerProtocol"):
        feeders = self.blocked_feeders
        if feeders is None:
            feeders = self.blocked_feeders = set()
            if self._stall is None:
                self._stall = self.factory.reactor.callLater(self.factory.config.stall_timeout, self._stalled)
        if feeder not in feeders:
            feeders.add(feeder)
            feeder.block_count += 1
            if feeder.block_count == 1:
                feeder.transport.pauseProducing()

    def _stalled(self):
        self._stall = None
        self.misbehaved(STALLED, f"held publishers paused for over {self.factory.config.stall_timeout:g} s "
                                 f"({len(self.transport.outbox)} packets queued)")

    def _releaseFeeders(self):
        stall = self._stall
        if stall is not None:
            self._stall = None
            if stall.active():
                stall.cancel()
        feeders = self.blocked_feeders
        if not feeders:
            return
        self.blocked_feeders = None
        for feeder in feeders:
            feeder.block_count -= 1
            if feeder.block_count == 0:
                feeder.transport.resumeProducing()

    # -- requests

    def subscribe(self, pattern: bytes):
        try:
            pattern = check_pattern(pattern, self.cred, self._prefix)
        except CredentialError as e:
            reason = FORBIDDEN if pattern.startswith(SECRET_ROOT) else INVALID_BANG
            return self.misbehaved(reason, str(e))
        if pattern.startswith(SECRET_ROOT) and not self._ownerAlive():
            return self.misbehaved(OWNER_GONE, f"secret pattern refused: the process that connected "
                                               f"(pid {self.cred.pid}) has exited, its pid is not this "
                                               f"connection's any more")
        factory = self.factory
        config = factory.config
        segments = pattern.count(b"/") + pattern.count(b"*") + 1  # each is a trie node: '*'s count too
        if segments > config.max_pattern_segments:
            return self.misbehaved(TOO_MANY_SUBSCRIPTIONS, f"pattern of {segments} segments (each '*' counts as "
                                                           f"one), over the limit of {config.max_pattern_segments}")
        cost = len(pattern) + SEGMENT_COST * segments
        uid = self.cred.uid
        for have, limit, what in (
            (self.subscriptions + 1, config.max_subscriptions, "subscriptions per client"),
            (self.subscription_bytes + cost, config.max_subscription_bytes, "subscription bytes per client"),
            (factory.uid_subscriptions[uid] + 1, config.max_uid_subscriptions, f"subscriptions for uid {uid}"),
            (factory.uid_subscription_bytes[uid] + cost, config.max_uid_subscription_bytes,
             f"subscription bytes for uid {uid}"),
        ):
            if have > limit:
                return self.misbehaved(TOO_MANY_SUBSCRIPTIONS, f"over the limit of {limit} {what}")
        self.subscriptions += 1
        self.subscription_bytes += cost
        factory.uid_subscriptions[uid] += 1
        factory.uid_subscription_bytes[uid] += cost
        if self.factory.router.subscribe(self, pattern):
            upstream = self.factory.upstream
            if upstream is not None:
                upstream.patternHeld(pattern)
        return None

    def unsubscribe(self, pattern: bytes):
        # Unsubscribing what one does not hold is ignored (NOTES §2 leaves it to us; ignoring is kinder).
        try:
            pattern = check_pattern(pattern, self.cred, self._prefix)
        except CredentialError:
            return
        held = self.factory.router.unsubscribe(self, pattern)
        if held is None:
            return
        cost = len(pattern) + SEGMENT_COST * (pattern.count(b"/") + pattern.count(b"*") + 1)  # as in subscribe
        self.subscriptions -= 1
        self.subscription_bytes -= cost
        self.factory.uid_subscriptions[self.cred.uid] -= 1
        self.factory.uid_subscription_bytes[self.cred.uid] -= cost
        if held:
            upstream = self.factory.upstream
            if upstream is not None:
                upstream.patternReleased(pattern)

    def _ownerAlive(self) -> bool:
        """Is the process that connected still alive? (pids get reused: its secrets are not inherited)"""
        owner = self._owner
        if owner is None:
            try:
                fd = self.transport.socket.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
            except OSError as e:
                # ESRCH: already gone. Kernels before 6.5 have no pidfds: credentials alone, as in C.
                return e.errno != errno.ESRCH
            owner = self._owner = OwnerWatch(fd, self)
            if not owner.alive():
                return False
            self.factory.reactor.addReader(owner)
        return not owner.exited

    def ownerExited(self):
        """The process that connected is gone; whoever holds the socket now is someone else."""
        log.info("client {client}: the process that connected has exited; "
                 "no secret key is delivered to this connection any more", client=self.label)
        self.factory.router.add_client(self, None)

    def misbehaved(self, reason: str, detail: str):
        """Disconnect this client, with one log line naming it and why."""
        if self.transport.disconnecting:
            return
        self.reason = reason
        log.warn("disconnecting client {client}: {detail}", client=self.label, detail=detail)
        self.transport.abortConnection()

    # -- control messages

    def _whoami(self):
        self.reply(self.whoami_reply)

    def _stats(self):
        self.reply(_STATS_REPLY + self.factory.statsJSON(viewer_uid=self.cred.uid))

    def _echo_on(self):
        self.echo = True

    def _echo_off(self):
        self.echo = False


@implementer(interfaces.IReadDescriptor)
class OwnerWatch:
    """A pidfd of a client's connecting process: readable once that process exits."""

    __slots__ = ("fd", "client", "exited", "__weakref__")

    def __init__(self, fd: int, client: BrokerProtocol):
        self.fd = fd
        self.client = client
        self.exited = False

    def alive(self) -> bool:
        if not self.exited and select.select([self.fd], [], [], 0)[0]:
            self.exited = True
        return not self.exited

    def fileno(self):
        return self.fd

    def logPrefix(self):
        return "OwnerWatch"

    def doRead(self):
        if not self.exited:
            self.exited = True
            self.client.factory.reactor.removeReader(self)
            self.client.ownerExited()

    def connectionLost(self, reason):
        self.close()

    def close(self):
        if self.fd >= 0:
            self.client.factory.reactor.removeReader(self)
            os.close(self.fd)
            self.fd = -1


def _control_table():
    table = {
        codec.WHOAMI: BrokerProtocol._whoami,
        codec.STATS: BrokerProtocol._stats,
        codec.ECHO_ON: BrokerProtocol._echo_on,
        codec.ECHO_OFF: BrokerProtocol._echo_off,
    }
    for mode in flood.SOFT_MODES:
        table[b"blocking/soft/" + mode.encode()] = lambda self, m=mode: self.transport.outbox.set_soft(m)
    for mode in flood.HARD_MODES:
        table[b"blocking/hard/" + mode.encode()] = lambda self, m=mode: self.transport.outbox.set_hard(m)
    for order in flood.ORDERS:
        table[b"order/" + order.encode()] = lambda self, o=order: self.transport.outbox.set_order(o)
    return table


_CONTROL = _control_table()


class BrokerFactory(protocol.Factory):
    """The bus: its router, its clients and its counters."""

    protocol = BrokerProtocol
    noisy = False
    #: An `IUpstream` (a relay's link to its master), told about local traffic it must carry.
    upstream = None

    def __init__(self, config: ServerConfig | None = None, on_empty=None, router=None, reactor=None):
        if reactor is None:
            from twisted.internet import reactor
        self.reactor = reactor
        self.config = config or ServerConfig()
        self.router = router if router is not None else Router()
        self.clients: set[BrokerProtocol] = set()
        self.on_empty = on_empty
        self.had_client = False
        self.started = time.time()
        allowed = self.config.allowed_uids
        self.allowed_uids = None if allowed is None else allowed_uid_set(allowed)
        # Totals of clients that have gone; live clients are summed at stats time.
        self.gone = Counter()
        self.drops = Counter()
        self.disconnects = Counter()
        self.refused = Counter()
        self.uid_connections = Counter()
        self.uid_subscriptions = Counter()
        self.uid_subscription_bytes = Counter()

    def buildProtocol(self, addr):
        cred = addr.cred
        if self.allowed_uids is not None and cred.uid not in self.allowed_uids:
            self.refused["user_not_allowed"] += 1
            log.warn("refused connection from pid={pid} uid={uid}: user not allowed", pid=cred.pid, uid=cred.uid)
            return None
        limit = self.config.max_uid_connections
        if self.uid_connections[cred.uid] >= limit:
            self.refused["too_many_connections"] += 1
            log.warn("refused connection from pid={pid} uid={uid}: uid has {n} connections, the limit",
                     pid=cred.pid, uid=cred.uid, n=limit)
            return None
        return self.protocol(self, cred)

    def clientConnected(self, client: BrokerProtocol):
        self.clients.add(client)
        self.uid_connections[client.cred.uid] += 1
        self.had_client = True
        self.router.add_client(client, secret_prefix(self.config.cred_prefix, client.cred))
        log.info("client connected: {client}", client=client.label)

    def clientGone(self, client: BrokerProtocol):
        released = self.router.remove_client(client)
        if released and self.upstream is not None:
            for pattern in released:
                self.upstream.patternReleased(pattern)
        self.clients.discard(client)
        uid = client.cred.uid
        for counts, n in ((self.uid_connections, 1), (self.uid_subscriptions, client.subscriptions),
                          (self.uid_subscription_bytes, client.subscription_bytes)):
            counts[uid] -= n
            if counts[uid] <= 0:
                del counts[uid]
        t = client.transport
        self.gone["packets_in"] += client.packets_in
        self.gone["bytes_in"] += client.bytes_in
        self.gone["packets_out"] += t.packets_out
        self.gone["bytes_out"] += t.bytes_out
        if client.drops:
            self.drops.update(client.drops)
        self.disconnects[client.reason] += 1
        log.info("client disconnected: {client} ({reason})", client=client.label, reason=client.reason)
        if not self.clients and self.on_empty is not None:
            self.on_empty()

    def deliverLocally(self, packet: bytes, key: bytes, feeder=None) -> None:
        """Deliver a MSG packet that came from outside this bus (a relay's master).

        `feeder`, if given, is paused like a local publisher when a subscriber in
        `block` mode fills up: it needs `block_count` and a `transport`."""
        for client in self.router.match(key):
            client.deliver(packet, feeder)

    def stats(self, viewer_uid: int | None = None) -> dict:
        """Totals for the whole bus; per-client rows only for the viewer's own uid, unless the
        viewer is root or the server's own user (other users' pids and traffic are theirs)."""
        clients = list(self.clients)
        private = viewer_uid is not None and viewer_uid not in (0, os.getuid())
        drops = Counter(self.drops)
        queues = []
        totals = Counter(self.gone)
        for c in clients:
            t = c.transport
            totals["packets_in"] += c.packets_in
            totals["bytes_in"] += c.bytes_in
            totals["packets_out"] += t.packets_out
            totals["bytes_out"] += t.bytes_out
            if c.drops:
                drops.update(c.drops)
            if private and c.cred.uid != viewer_uid:
                continue
            ob = t.outbox
            queues.append({
                "pid": c.cred.pid, "uid": c.cred.uid, "gid": c.cred.gid,
                "subscriptions": c.subscriptions,
                "queued_packets": len(ob), "queued_bytes": ob.nbytes,
                "soft": ob.soft, "hard": ob.hard, "order": ob.order, "echo": c.echo,
                "packets_in": c.packets_in, "packets_out": t.packets_out,
                "drops": dict(c.drops or {}),
            })
        result = {
            "clients": len(clients),
            "subscriptions": self.router.subscription_count,
            "packets_in": totals["packets_in"],
            "packets_out": totals["packets_out"],
            "bytes_in": totals["bytes_in"],
            "bytes_out": totals["bytes_out"],
            "drops": dict(drops),
            "disconnects": dict(self.disconnects),
            "refused": dict(self.refused),
            "queues": queues,
            "uptime_s": round(time.time() - self.started, 3),
            "limits": {name: getattr(self.config, name) for name in (
                "max_packet", "queue_bytes", "queue_packets", "stall_timeout", "max_subscriptions",
                "max_uid_subscriptions", "max_uid_connections", "max_subscription_bytes",
                "max_uid_subscription_bytes", "max_pattern_segments")},
        }
        upstream_stats = getattr(self.upstream, "stats", None)
        if upstream_stats is not None:
            result["upstream"] = upstream_stats()
        return result

    def statsJSON(self, viewer_uid: int | None = None) -> bytes:
        """The statistics as JSON that fits in one packet (busiest queues first if it must be cut)."""
        stats = self.stats(viewer_uid)
        room = self.config.max_packet - len(_STATS_REPLY)
        data = json.dumps(stats, separators=(",", ":")).encode()
        if len(data) > room:
            stats["queues"].sort(key=lambda q: q["queued_bytes"], reverse=True)
            while len(data) > room and stats["queues"]:
                del stats["queues"][len(stats["queues"]) // 2:]
                stats["queues_truncated"] = True
                data = json.dumps(stats, separators=(",", ":")).encode()
        return data
