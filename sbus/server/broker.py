"""The broker: per-client protocol and the factory that holds the bus together.

A thin Twisted shell around the sans-I/O core: packets come in from a
packet transport (`sbus.interfaces.IPacketTransport`), are classified and
routed by `sbus.core`, and go out through each subscriber's transport under
its flood-control settings. The broker uses only that interface: send now,
queue under the flood policy, queue regardless (replies), pause and resume;
the transport calls `outboxDrained` when its queue has emptied.
Nothing here logs per packet or creates a Deferred per packet.
"""

from __future__ import annotations

import errno
import json
import os
import select
import time
from collections import Counter, deque
from functools import lru_cache

from twisted.internet import protocol
from twisted.logger import Logger
from zope.interface import implementer

from sbus.core import codec, flood
from sbus.core.accounting import WORK_SLICE, UserCharge
from sbus.seqpacket import SERVER_SNDBUF_LEAST, kernel_send_floor
from sbus.core.churn import ConnectionChurn
from sbus.core.credentials import SECRET_ROOT, CredentialError, check_key, check_pattern, secret_prefix, whoami
from sbus.core.interest import InterestTable
from sbus.core.pausing import HoldBudget, Holds, Pauses
from sbus.core.reasons import Disconnect, Drop, Refusal
from sbus.core.router import Router
from sbus.core.runs import extent as run_extent
from sbus.core.sessions import REFUSED, Lingering, SessionRefused, SessionTable, parse_ack, parse_request
from sbus.core.sessions import reply as session_reply
from sbus.interfaces import IQueueingProtocol
from sbus.server.config import ServerConfig, allowed_uid_set, pattern_cost

log = Logger()

#: Seconds after which a uid's connections waiting for room to send a big packet look again,
#: if the packet of its that pins the room stays unread (issue 33.7): its queues may drain.
GROW_RETRY = 0.5
_WHOAMI_REPLY = b"CMSG " + codec.WHOAMI + b"\0"
_STATS_REPLY = b"CMSG " + codec.STATS + b"\0"
_ID_REPLY = b"CMSG " + codec.SERVER_ID + b"\0"
_DROPPED = b"CMSG " + codec.DROPPED + b"\0"
_DISCONNECT = b"CMSG " + codec.DISCONNECT + b"\0"
_INTEREST = b"CMSG " + codec.INTEREST + b"\0"
_SESSION = b"CMSG " + codec.SESSION
_SESSION_CONFIRM = b"CMSG " + codec.SESSION_CONFIRM
_SESSION_ACK = b"CMSG " + codec.SESSION_ACK

# Disconnect reasons, as they appear in statistics (`sbus.core.reasons`, the one vocabulary).
PROTOCOL_ERROR = Disconnect.PROTOCOL_ERROR
OVERSIZE = Disconnect.OVERSIZE
FORBIDDEN = Disconnect.FORBIDDEN
INVALID_BANG = Disconnect.INVALID_BANG
OWNER_GONE = Disconnect.OWNER_GONE
TOO_MANY_SUBSCRIPTIONS = Disconnect.TOO_MANY_SUBSCRIPTIONS
STALLED = Disconnect.STALLED
SHUTDOWN = Disconnect.SHUTDOWN
CLOSED = Disconnect.CLOSED
INTERNAL_ERROR = Disconnect.INTERNAL_ERROR

#: What a drop or a disconnect decided by `Outbox.offer` is counted as.
_OFFER_REASON = {
    flood.DROPPED_SOFT: Drop.SOFT_DISCARD, flood.DROPPED_HARD: Drop.HARD_DISCARD,
    flood.DISCONNECT_SOFT: Disconnect.SOFT_ERROR, flood.DISCONNECT_HARD: Disconnect.HARD_ERROR,
}

#: Rendering statistics may take at most this share of the reactor's time (see `BrokerFactory._statsFor`).
STATS_SHARE = 0.1


def _overflow_ids() -> tuple[int, int] | None:
    """The kernel's overflow uid/gid if this server runs in a user namespace that does not map
    every id (then a peer whose ids are not mapped shows as them); None in the initial one."""
    try:
        with open("/proc/self/uid_map") as f:
            maps = f.read().split()
        if maps == ["0", "0", "4294967295"]:
            return None
        with open("/proc/sys/kernel/overflowuid") as f:
            uid = int(f.read())
        with open("/proc/sys/kernel/overflowgid") as f:
            gid = int(f.read())
        return uid, gid
    except (OSError, ValueError):
        return 65534, 65534


@lru_cache(maxsize=16)
def secret_root_of(prefix: bytes) -> bytes:
    """``prefix + SECRET_ROOT``: one object for every client under `prefix`, not 50 B each."""
    return prefix + SECRET_ROOT


@implementer(IQueueingProtocol)
class BrokerProtocol(protocol.Protocol):
    """One connected client: its credentials, subscriptions, echo and flood settings."""

    # `transport` and `connected` (set by `makeConnection`) are slots too: otherwise the first of
    # them would give every connection an instance dict (Twisted's protocols have no slots).
    __slots__ = (
        "factory", "transport", "connected", "cred", "echo", "packets_in", "bytes_in", "drops",
        "_pauses", "holds", "reason", "subscriptions", "subscription_bytes",
        "_stall", "_budget",
        "owner", "_cached", "_prefix", "_secret_root", "charge", "_workWait", "_sliceWork",
        "dropped", "_dropFirst", "_dropLast", "_queuedSinceNotice",
        "_replyHeld", "statsWanted", "_watching", "outbox", "dirty", "extensions", "_waitingReplies",
        "_run", "_lastClients",
    )

    def __init__(self, factory: "BrokerFactory", cred):
        self.factory = factory
        self.transport = None
        self.connected = 0
        self.cred = cred
        self.echo = True
        self.packets_in = 0
        self.bytes_in = 0
        self.drops: Counter | None = None
        #: `pauses`, once asked for.
        self._pauses: Pauses | None = None
        #: Publishers this client's full queue holds paused (soft/hard `block`); made at the first.
        self.holds: Holds | None = None
        self.reason = CLOSED
        self.subscriptions = 0
        #: Estimated memory its patterns pin (see `pattern_cost`).
        self.subscription_bytes = 0
        #: The hold budget (see `_block`), and while this client holds publishers, the call that
        #: ends it.
        self._stall = None
        self._budget: HoldBudget | None = None  # made at the first hold: idle clients pin none
        #: The process that connected; None if it could not be proven alive at connect.
        self.owner: Owner | None = None
        self._cached = factory.router.cached  # one dict's `get`, shared: it costs a connection nothing
        #: Its uid's `UserCharge` (set when it connects), and while it waits for its uid's
        #: routing work to be earned back, the call that ends the wait.
        self.charge: UserCharge | None = None
        self._workWait = None
        #: Routing work done for it in this read batch (`spent`: past `WORK_SLICE`, it yields).
        self._sliceWork = 0.0
        self._prefix = factory.config.cred_prefix
        self._secret_root = secret_root_of(self._prefix)
        #: Drops not yet told to the client (`server/dropped`, only to a client that asked for
        #: extensions), and the keys that began and ended them.
        self.dropped = 0
        self._dropFirst = self._dropLast = b""
        self._queuedSinceNotice = True
        #: Whether this client's reading is paused until its replies drain.
        self._replyHeld = False
        #: `server/stats` requests waiting for the next rendering (see `BrokerFactory.statsRequested`).
        self.statsWanted = 0
        #: Whether it asked for `server/interest` (see `_interest`).
        self._watching = False
        #: Everything the server will send this client, in one queue (`sbus.core.flood.Outbox`).
        config = factory.config
        self.outbox = flood.Outbox(config.queue_bytes, config.queue_packets, config.queue_control_bytes)
        #: Whether it is in the factory's list of queues to send from at the end of the batch.
        self.dirty = False
        #: Whether it asked for the server's notices (`CMSG server/extensions`).
        self.extensions = False
        #: Replies that wait for its interest listing to be queued (see `reply`).
        self._waitingReplies: list | None = None
        #: Its messages of this read batch that go to the same recipients, queued a run at a time
        #: (`_startRun`, `flushRun`); and the recipients of its last message in this batch.
        self._run: _Run | None = None
        self._lastClients = None

    def __repr__(self):
        return f"<client {self.label}>"

    # Made when asked, not kept: a string each would cost every idle connection about 70 bytes.
    @property
    def label(self) -> str:
        cred = self.cred
        return f"pid={cred.pid} uid={cred.uid} gid={cred.gid}"

    @property
    def whoami_reply(self) -> bytes:
        return _WHOAMI_REPLY + whoami(self._prefix, self.cred)

    @property
    def pauses(self) -> Pauses | None:
        """Who holds this client's reading paused (subscribers it filled, the relay, its own
        replies); None until it is connected. Made at the first hold (48 bytes an idle client
        does not need)."""
        pauses = self._pauses
        if pauses is None and self.transport is not None:
            pauses = self._pauses = Pauses(self.transport)
        return pauses

    def repricePattern(self, delta: int) -> None:
        """One stored pattern's cost changed by `delta` bytes (a relay moved it to a new prefix)."""
        self.subscription_bytes += delta
        if self.charge is not None:
            self.charge.subscription_bytes += delta

    def setCredPrefix(self, prefix: bytes) -> None:
        """This bus's credential prefix changed (a relay renamed on its master): whoami answers
        and secret keys follow it."""
        self._prefix = prefix
        self._secret_root = secret_root_of(prefix)

    # -- connection life

    def connectionMade(self):
        self.transport.useQueue(self.outbox)
        self.factory.clientConnected(self)

    def connectionLost(self, reason=None):
        if self._run is not None and self._run.packets:
            self.flushRun()  # (they were read before the end: delivered as they would have been)
        self._lastClients = None
        wait, self._workWait = self._workWait, None
        if wait is not None and wait.active():
            wait.cancel()
        self._releaseFeeders()
        if self.owner is not None:
            self.owner.close()
        self.factory.clientGone(self)

    # -- incoming packets: the hot path

    def packetReceived(self, packet: bytes):
        self.packets_in += 1
        n = len(packet)
        self.bytes_in += n
        run = self._run
        if packet[:4] == b"MSG ":
            end = packet.find(b"\0", 4)
            key = packet[4:end]
            # 33 is "!": an int membership test is one memchr; `b"!" in key` first tries the
            # operand as an int and raises and clears a TypeError (CPython 3.11: ~10x slower).
            if end < 0 or 33 in key:
                if run is not None and run.packets:
                    self.flushRun()
                if end < 0:
                    return self.misbehaved(PROTOCOL_ERROR, "MSG without a NUL between key and payload")
                try:
                    check_key(key)
                except CredentialError as e:
                    return self.misbehaved(INVALID_BANG, str(e))
                if key.startswith(self._secret_root):
                    self.factory.deliverSecret(packet, key, self)
                    return None
                clients = self._cached(key)
                self.factory.looked_up += 1
            else:
                clients = self._cached(key)
                self.factory.looked_up += 1
                if run is not None and run.packets:
                    if clients is run.clients and run.nbytes + n <= run.room_bytes \
                            and len(run.packets) < run.room_packets:
                        run.packets.append(packet)  # the hot path of 1 -> N: one append
                        run.nbytes += n
                        upstream = self.factory.upstream
                        if upstream is not None:
                            upstream.localPublish(packet, key, self)
                            return None
                        return True  # a run is open: the rest of the batch may be taken at once
                    self.flushRun()
                if clients is not None and clients is self._lastClients and self._startRun(clients, packet):
                    upstream = self.factory.upstream
                    if upstream is not None:
                        upstream.localPublish(packet, key, self)
                        return None
                    return True
            if clients is None:
                clock = self.factory.work_clock
                t0 = clock()
                clients = self.factory.router.miss(key)
                self.spent(clock() - t0)
            self._lastClients = clients
            for client in clients:
                if client is self and not self.echo:
                    continue
                client.deliver(packet, self, key)
            upstream = self.factory.upstream
            if upstream is not None:
                upstream.localPublish(packet, key, self)
            return None
        if run is not None and run.packets:
            self.flushRun()
        try:
            kind, key = codec.classify(packet, self.factory.config.max_packet)
        except codec.ProtocolError as e:
            return self.misbehaved(PROTOCOL_ERROR, str(e))
        if kind == codec.CMSG:
            handler = _CONTROL.get(key)
            if handler is not None:
                handler(self)
            elif key == codec.SESSION:
                self.factory.sessionRequested(self, packet[len(_SESSION) + 1:])
            elif key == codec.SESSION_CONFIRM:
                self.factory.sessionConfirmed(self, packet[len(_SESSION_CONFIRM) + 1:])
            elif key == codec.SESSION_HELD:
                self.factory.sessionHeldAsked(self, packet.partition(b"\0")[2])
            elif key == codec.SESSION_ACK:
                self.factory.sessionAcked(self, packet[len(_SESSION_ACK) + 1:])
        else:
            clock = self.factory.work_clock
            t0 = clock()
            if kind == codec.SUB:
                self.subscribe(key)
            else:
                self.unsubscribe(key)
            self.spent(clock() - t0)
        return None

    def packetsReceived(self, packets: list, start: int) -> int:
        """Take, at once, as many of `packets[start:]` as continue this batch's open run (see
        `sbus.core.runs`): what `packetReceived` would do with each, one message appended to
        the run; return the index of the first one not taken (`start`: none). Offered only
        after `packetReceived` returned True (a run is open, and no upstream wants each one)."""
        run = self._run
        if run is None or not run.packets:
            return start
        end, nbytes = run_extent(packets, start, self._cached, run.clients,
                                 run.room_bytes - run.nbytes, run.room_packets - len(run.packets))
        if end > start:
            run.packets += packets[start:end]
            run.nbytes += nbytes
            self.packets_in += end - start
            self.bytes_in += nbytes
            self.factory.looked_up += end - start
        return end

    def spent(self, seconds: float) -> None:
        """Charge reactor time this client's request took (routing a key the cache did not know,
        a SUB or UNSUB, an interest listing) to its uid, checked after each packet, not once a
        batch. While other uids are connected, a uid past its share
        (`sbus.core.accounting.WORK_SHARE`) is not read until it has earned the time back; alone,
        it is charged too (its debt kept to one burst), so a uid that connects finds it paused
        after its next costly packet. Either way, past `WORK_SLICE` of work in one batch it
        yields: the rest of the batch waits (in the kernel, or the transport's stash) until the
        reactor has turned once and accepted and read the others."""
        factory = self.factory
        charge = self.charge
        if charge is None:
            return
        alone = len(factory.uid_connected) < 2
        wait = charge.work.spend(seconds, factory.reactor.seconds(), alone)
        self._sliceWork += seconds
        if self._workWait is not None or self.transport.disconnecting:
            return
        if wait <= 0 or alone:
            if self._sliceWork < WORK_SLICE:
                return
            wait = 0.0  # read again once the reactor has turned, after the others
        self.pauses.hold()
        self._workWait = factory.reactor.callLater(wait, self._workEarned)

    def _waitForWork(self) -> bool:
        """Before costly work for this client: if its uid is in debt (other uids connected),
        do not read it until the uid has earned the time back; True if it must wait. (A uid
        whose every connection spends once and is paused would otherwise spend with new
        connections: connect, ask for a 100,000-line listing, close, again.)"""
        factory = self.factory
        if self._workWait is not None:
            return True
        if len(factory.uid_connected) < 2 or self.charge is None or self.transport.disconnecting:
            return False
        wait = self.charge.work.owed(factory.reactor.seconds())
        if wait <= 0:
            return False
        self.pauses.hold()
        self._workWait = factory.reactor.callLater(wait, self._workEarned)
        return True

    def _workEarned(self) -> None:
        self._workWait = None
        self.pauses.release()
        if self._watching and not self.transport.disconnecting:
            interest = self.factory.interest
            if interest is None or not interest.watching(self):
                # Asked while its uid was in debt; its other connections may have spent since.
                if not self._waitForWork():
                    self._startListing()
            else:
                self.tellInterest()  # the rest of a listing that waited for the time
            self.factory.flushDirty()

    def packetTooLarge(self, size: int):
        if self._run is not None and self._run.packets:
            self.flushRun()
        self.misbehaved(OVERSIZE, f"packet of {size} bytes exceeds the {self.factory.config.max_packet}-byte limit")

    def readBatchDone(self):
        """The transport has handed over one wakeup's packets: send what they routed."""
        self._sliceWork = 0.0
        if self._run is not None and self._run.packets:
            self.flushRun()
        self._lastClients = None
        self.factory.flushDirty(self)

    # -- runs: a publisher's messages to the same recipients, queued together

    def _startRun(self, clients: tuple, packet: bytes) -> bool:
        """Its second message in a row for the same recipients: queue them a run at a time from
        now on (`flushRun`), while every recipient's queue has room for all of the run where
        `Outbox.offer` would simply queue each message (`Outbox.room`). The run is queued before
        anything else happens for these clients, so they see what per-message delivery would
        have given them, in the same order; False: deliver this one on its own."""
        echo = self.echo
        room_bytes = room_packets = 1 << 62
        targets = []
        for client in clients:
            if client is self and not echo:
                continue
            room = client.runRoom()
            if room is None:
                return False
            if room[0] < room_bytes:
                room_bytes = room[0]
            if room[1] < room_packets:
                room_packets = room[1]
            targets.append(client)
        n = len(packet)
        if n > room_bytes or room_packets < 1:
            return False
        run = self._run
        if run is None:
            run = self._run = _Run()
        run.clients = clients
        run.targets = targets
        run.room_bytes = room_bytes
        run.room_packets = room_packets
        run.packets.append(packet)
        run.nbytes = n
        return True

    def flushRun(self) -> None:
        """Queue the run for each of its recipients."""
        run = self._run
        packets, nbytes = run.packets, run.nbytes
        for client in run.targets:
            client.deliverRun(packets, nbytes)
        packets.clear()
        run.nbytes = 0
        run.targets = ()
        run.clients = None

    def runRoom(self) -> tuple[int, int] | None:
        """What a run for this client may hold (`Outbox.room`); None while a drop notice waits
        (it goes before the next message: `deliver`)."""
        return None if self.dropped else self.outbox.room()

    def deliverRun(self, packets: list, nbytes: int) -> None:
        """Queue a run `runRoom` said fits: `deliver` of each, at once."""
        self.outbox.take(packets, nbytes)
        self._queuedSinceNotice = True
        if not self.dirty:
            self.dirty = True
            self.factory.dirty.append(self)

    # -- outgoing: everything goes through `self.outbox`, where flood control decides

    def deliver(self, packet: bytes, feeder: "BrokerProtocol | None", key: bytes = b"") -> None:
        """Offer a routed message to this client's queue; it is sent when the batch is done."""
        if self.dropped:
            self._tellDrops()
        out = self.outbox
        action = out.offer(packet)  # a closing client's queue is closed: CLOSED, nothing sent
        if action == flood.QUEUED:
            self._queuedSinceNotice = True
            if not self.dirty:
                self.dirty = True
                self.factory.dirty.append(self)
            return
        if action == flood.FLUSH:  # half its limits wait to be sent: does the socket take them?
            self.flush(feeder)
            action = out.decide(packet)
            if action == flood.QUEUED:
                self._queuedSinceNotice = True
                self._markDirty()
                return
        if action != flood.CLOSED:
            self._decided(action, feeder, (packet,))
        else:
            # Its connection is going (a failed send, a drain held): nobody receives it, and a
            # session it holds counts it as missed when the stand-in takes over.
            out.lost += 1

    def _decided(self, action: int, feeder, packets) -> None:
        """Act on what the queue decided for `packets` (not plainly queued)."""
        if action == flood.HELD_BACK:
            self._holdBack(packets[0], feeder)
        elif action == flood.QUEUED_BLOCK:
            self._queuedSinceNotice = True
            self._markDirty()
            if feeder is not None:
                self._block(feeder)
        elif action <= flood.DROPPED_HARD:
            drops = self.drops
            if drops is None:
                drops = self.drops = Counter()
            drops[_OFFER_REASON[action]] += len(packets)
            if self.extensions:
                if not self.dropped:
                    self._dropFirst = codec.msg_key(packets[0])
                self._dropLast = codec.msg_key(packets[-1])
                self.dropped += len(packets)
                if not self.outbox:
                    self._tellDrops()  # nothing queued: the notice is next
        else:
            reason = _OFFER_REASON[action]
            out = self.outbox
            if packets:  # the message that decided it went nowhere: lost with what is queued
                out.lost += len(packets)
            self.misbehaved(reason, f"cannot keep up ({reason.replace('_', '/')} mode, "
                                    f"{len(out)} packets / {out.nbytes} bytes queued)")

    def _markDirty(self) -> None:
        if not self.dirty and not self.outbox.blocked:
            self.dirty = True
            self.factory.dirty.append(self)

    def flush(self, feeder=None) -> None:
        """Send from the queue now (the end of a batch); if the socket is full, flood control
        decides about the messages it did not take, and `feeder` is who fed them."""
        self.dirty = False
        out = self.outbox
        if out.blocked:
            return  # the transport writes when the socket is writable, and says when it drained
        if self.transport.flush():
            if self._replyHeld or self.dropped or self._watching or self._stall is not None:
                self._drained()  # emptied here, not by the writer: what waits for that goes on
        elif not out.blocked:
            self.refused(feeder)

    def sendRefused(self) -> None:
        """The transport's socket refused packets nobody judged yet (see `flush`)."""
        self.refused(None)

    def mayGrowSendBuffer(self, n: int) -> bool:
        """May the transport send a packet of `n` bytes through its small send buffer, raised
        for it (issue 33.7)? Only if the uid has room for what the kernel will count (up to
        half again a big packet's length: its head is a power-of-two allocation), or pins no
        other big packet; else the transport waits, woken when that packet is given back
        (`sendBufferCharged`), or to look again after a while (`BrokerFactory.growLater`: the
        uid's queues may drain while that packet stays unread)."""
        user = self.charge
        if user is None or user.may_grow(n + (n >> 1), self):
            return True
        self.factory.growLater(user)
        return False

    def sendBufferCharged(self, n: int) -> None:
        """The transport's kernel holds `n` more bytes (a big packet sent whole, charged to the
        uid), or `-n` fewer (read, or closed with): given back, and the uid's connections that
        waited for room try again."""
        user = self.charge
        if user is None:
            return
        if n > 0:
            user.grow(n)
            return
        user.shrink(-n)
        self.factory.growNow(user)

    def refused(self, feeder) -> None:
        action, dropped = self.outbox.refused()
        if action != flood.QUEUED:
            self._decided(action, feeder, dropped)

    def _queueControl(self, packet: bytes) -> None:
        """Queue a reply or notice: never dropped; past the control budget this client is not
        read until its queue drains (a client that asks without reading pins one queue)."""
        if not self.outbox.push_control(packet) and not self._replyHeld:
            self._replyHeld = True
            self.pauses.hold()
        self._markDirty()

    def _tellDrops(self) -> None:
        """Queue the pending `server/dropped` notice if the client has room for it: an empty
        queue, or a queue under its limits into which a message went since the last notice (so a
        client whose every message is dropped gets one notice per drained queue, not one per
        message). Only a client that asked for extensions counts `dropped`."""
        if self.transport.disconnecting:
            return
        out = self.outbox
        if out.blocked and not out:
            return  # the socket is full: the notice goes when it drains (`outboxDrained`)
        if not out or (self._queuedSinceNotice and not out.full()):
            self._queueControl(self._dropNotice())
            self._queuedSinceNotice = False
            self._dropsTold()

    def _dropNotice(self) -> bytes:
        count = b"%d" % self.dropped
        first, last = self._dropFirst, self._dropLast
        room = self.factory.config.max_packet - len(_DROPPED) - len(count) - 2
        if len(first) + len(last) > room:
            # Both keys do not fit in one packet: each keeps its beginning.
            first, last = first[:room // 2], last[:room - room // 2]
        return b"%s%s\0%s\0%s" % (_DROPPED, count, first, last)

    def _dropsTold(self):
        self.dropped = 0
        self._dropFirst = self._dropLast = b""

    def reply(self, packet: bytes) -> None:
        """Answer a request: after everything routed to this client before it, never dropped
        (docs/protocol.md "Replies and notices"). A watcher's interest changes come first; if
        they do not all fit its control budget, the reply waits with them, and the client is
        not read meanwhile."""
        if self.transport.disconnecting:
            return
        if self._watching and (self._waitingReplies is not None or not self.tellInterest()):
            if self._waitingReplies is None:
                self._waitingReplies = []
                self.pauses.hold()
            self._waitingReplies.append(packet)
            return
        if self.dropped:
            # The notice goes before the reply, whatever the room: a client that syncs must hear
            # of every drop that happened before its request.
            self._queueControl(self._dropNotice())
            self._queuedSinceNotice = False
            self._dropsTold()
        self._queueControl(packet)

    def notify(self, packet: bytes) -> None:
        """A notice the server sends of its own accord: only to a client that asked for them."""
        if self.extensions and not self.transport.disconnecting:
            self._queueControl(packet)

    def outboxDrained(self):
        """The transport's writer emptied the queue."""
        self._drained()
        self.factory.flushDirty()

    def _drained(self) -> None:
        """The queue is empty: release what waited for that, and queue what the room allows."""
        if self.outbox.waiting:
            self._placeWaiting()
        self._releaseFeeders()
        if self._replyHeld:
            self._replyHeld = False
            self.pauses.release()
        self._queuedSinceNotice = True
        if self.dropped:
            self._tellDrops()
        if self._watching:
            self.tellInterest()

    # -- block modes and their hold budget

    def _block(self, feeder: "BrokerProtocol"):
        """Hold `feeder` paused until our queue drains.

        The hold budget: a client may hold publishers `stall_timeout` seconds more than it lets
        them run. Holding spends the budget, not holding earns it back (up to `stall_timeout`); when
        it is spent the client is disconnected as `stalled`. A client that drains now and then but
        keeps publishers held most of the time cannot hold them indefinitely. For a uid other than
        root and the server's own, the budget is the uid's, shared by its connections and kept
        after they close: several connections, or reconnecting, earn nothing. The server's user and
        root keep one per connection (on a private bus every client, the owner's recorder,
        bridges and relays included, is the owner's)."""
        pauses = feeder.pauses
        if pauses is None:
            return
        if not self.holds and self._stall is None:
            reactor = self.factory.reactor
            budget = self._budget
            if budget is None:
                budget = self._budget = self.factory.holdBudget(self.cred.uid)
            left = budget.start(self, reactor.seconds())
            self._stall = reactor.callLater(max(left, 0.0), self._stalled)
        holds = self.holds
        if holds is None:
            holds = self.holds = Holds()
        holds.add(pauses)

    def _stalled(self):
        self._stall = None
        self._budget.stop(self, self.factory.reactor.seconds())
        timeout = self.factory.config.stall_timeout
        self.misbehaved(STALLED, f"held publishers paused for {timeout:g} s more than "
                                 f"{'its uid' if self._budget.shared else 'it'} let them run "
                                 f"({len(self.outbox)} packets queued)")

    def _holdBack(self, packet: bytes, feeder) -> None:
        """`hard/block`, and `packet` is over a limit: it waits beside the queue, charged to its
        publisher's uid (the one that sends into a full queue pays), and the publisher is held
        until the queue has room for it. A publisher is held after its first such packet, so at
        most one waits per publisher. With nobody to hold (`feeder` None) it is queued."""
        pauses = getattr(feeder, "pauses", None)
        if pauses is None:
            self.outbox.push(packet)
            self._queuedSinceNotice = True
            self._markDirty()
            return
        self.outbox.hold_back(packet, pauses, _budgetOf(feeder, self.outbox))
        self._block(feeder)

    def _placeWaiting(self) -> None:
        """The queue drained: what waits beside it goes in, in the order it came, as far as the
        limits let it; the publishers of what still waits stay held (`_releaseFeeders`)."""
        out = self.outbox
        while (packet := out.next_waiting()) is not None:
            # As `deliver`: into a socket not known to be full goes one read batch uncharged; the
            # rest waits for it to be sent (else a drain could queue the whole limit, uncharged,
            # past the uid's cap: simulator seed 602717800530).
            action = out.offer(packet)
            if action == flood.FLUSH:
                if out.nbytes != out.ctl_bytes:
                    break
                action = out.decide(packet)
            if action == flood.HELD_BACK:
                break
            out.unwait()
            if action == flood.QUEUED:
                self._queuedSinceNotice = True
                self._markDirty()
            elif action != flood.CLOSED:
                self._decided(action, None, (packet,))
                if out.closed:
                    break

    def _releaseFeeders(self):
        if self.outbox.waiting:
            transport = self.transport
            if transport.connected and not transport.disconnecting:
                # Publishers whose message still waits stay held: let the others go.
                self.holds.release(self.outbox.holders())
                return
            self.outbox.drop_waiting()
        stall = self._stall
        if stall is not None:
            self._stall = None
            if stall.active():
                stall.cancel()
            self._budget.stop(self, self.factory.reactor.seconds())
        if self.holds is not None:
            self.holds.release()

    # -- requests

    def subscribe(self, pattern: bytes):
        try:
            pattern = check_pattern(pattern, self.cred, self._prefix)
        except CredentialError as e:
            reason = FORBIDDEN if pattern.startswith(SECRET_ROOT) else INVALID_BANG
            return self.misbehaved(reason, str(e))
        if pattern.startswith(self._secret_root):
            refusal = self._secretRefusal()
            if refusal is not None:
                return self.misbehaved(*refusal)
        factory = self.factory
        config = factory.config
        segments = pattern.count(b"/") + pattern.count(b"*") + 1  # each is a trie node: '*'s count too
        if segments > config.max_pattern_segments:
            return self.misbehaved(TOO_MANY_SUBSCRIPTIONS, f"pattern of {segments} segments (each '*' counts as "
                                                           f"one), over the limit of {config.max_pattern_segments}")
        cost = pattern_cost(pattern)
        uid = self.cred.uid
        for have, limit, what in (
            (self.subscriptions + 1, config.max_subscriptions, "subscriptions per client"),
            (self.subscription_bytes + cost, config.max_subscription_bytes, "subscription bytes per client"),
        ):
            if have > limit:
                return self.misbehaved(TOO_MANY_SUBSCRIPTIONS, f"over the limit of {limit} {what}")
        refusal = self.charge.pattern_refusal(cost, config.max_uid_subscriptions, config.max_uid_subscription_bytes,
                                              not factory.privileged(uid))
        if refusal is not None:
            return self.misbehaved(TOO_MANY_SUBSCRIPTIONS, refusal)
        admit = getattr(factory.upstream, "admitPattern", None)  # a relay: its quota on the master
        if admit is not None:
            refusal = admit(self, pattern, cost, segments)
            if refusal is not None:
                return self.misbehaved(TOO_MANY_SUBSCRIPTIONS, refusal)
        self.subscriptions += 1
        self.subscription_bytes += cost
        self.charge.charge_pattern(cost)
        if factory.router.subscribe(self, pattern):
            upstream = factory.upstream
            if upstream is not None:
                upstream.patternHeld(pattern)
        if factory.interest is not None:
            factory.tellInterest(factory.interest.held(self, uid, factory.interestForm(pattern)))
        return None

    def unsubscribe(self, pattern: bytes):
        # Unsubscribing what one does not hold is ignored: the protocol leaves it open, ignoring is
        # kinder (docs/protocol.md "Packets").
        try:
            pattern = check_pattern(pattern, self.cred, self._prefix)
        except CredentialError:
            return
        held = self.factory.router.unsubscribe(self, pattern)
        if held is None:
            return
        cost = pattern_cost(pattern)
        self.subscriptions -= 1
        self.subscription_bytes -= cost
        self.charge.release_patterns(1, cost)
        if held:
            upstream = self.factory.upstream
            if upstream is not None:
                upstream.patternReleased(pattern)
        factory = self.factory
        if factory.interest is not None and not factory.router.holds(self, pattern):
            form = factory.interestForm(pattern)
            if form or not any(not factory.interestForm(p) for p in factory.router.patterns_of(self)):
                factory.tellInterest(factory.interest.released(self, form))

    # -- the process that connected (secrets are not inherited)

    def watchOwner(self) -> bool:
        """Prove the process that connected alive, right at accept: True if it is.

        Fails closed: whatever stops us proving it (an exited or reaped peer: ESRCH, or EINVAL on
        kernels 6.5 to about 6.15; out of descriptors; a peer in another pid or user namespace)
        means no secret key for this connection, with one log line saying why."""
        cred = self.cred
        overflow = self.factory.overflow_ids
        why = None
        if cred.pid == 0:
            why = "its process is in another pid namespace (pid 0): it has no secret space here"
        elif overflow is not None and (cred.uid == overflow[0] or cred.gid == overflow[1]):
            why = (f"its uid/gid {cred.uid}/{cred.gid} is this user namespace's overflow id (a user of "
                   f"another namespace): it has no secret space here")
        else:
            owner = self.factory.owners.take(self.transport, cred.pid)
            if isinstance(owner, str):
                why = owner
            elif not owner.alive():
                owner.close()
                why = f"the process that connected (pid {cred.pid}) has already exited"
            else:
                self.owner = owner
                self.factory.noSecrets.pop(self, None)
                return True
        self.factory.noSecrets[self] = why
        log.info("client {client}: no secret keys for this connection: {why}", client=self.label, why=why)
        return False

    def _secretRefusal(self) -> tuple[str, str] | None:
        """None if this connection may hold secret patterns; else (reason, text) to disconnect it."""
        if self.owner is None:
            why = self.factory.noSecrets.get(self, "")
            if why.startswith("cannot prove") and self.watchOwner():
                # It could not be proven alive at connect (out of descriptors): it can now.
                self.factory.router.add_client(self, secret_prefix(self._prefix, self.cred))
                return None
            why = self.factory.noSecrets.get(self, "")
            if "exited" not in why:
                return FORBIDDEN if "cannot prove" not in why else OWNER_GONE, f"secret pattern refused: {why}"
        elif self.ownerAlive():
            return None
        return OWNER_GONE, (f"secret pattern refused: the process that connected (pid {self.cred.pid}) "
                            f"has exited, its pid is not this connection's any more")

    def ownerAlive(self) -> bool:
        """Is the process that connected alive now? (asked of the kernel, not remembered)"""
        owner = self.owner
        if owner is None:
            return False
        if owner.alive():
            return True
        if not owner.told:
            owner.told = True
            self.ownerExited()
        return False

    def ownerExited(self):
        """The process that connected is gone; whoever holds the socket now is someone else."""
        log.info("client {client}: the process that connected has exited; "
                 "no secret key is delivered to this connection any more", client=self.label)
        self.factory.router.add_client(self, None)

    # -- leaving

    def misbehaved(self, reason: str, detail: str):
        """Disconnect this client, with one log line naming it and why, and tell it why
        (`server/disconnect`, sent ahead of anything queued, which is thrown away)."""
        transport = self.transport
        if transport.disconnecting:
            return
        self.reason = reason
        log.warn("disconnecting client {client}: {detail}", client=self.label, detail=detail)
        if self.extensions:
            text = detail.encode("utf-8", "replace").replace(b"\0", b" ").replace(b"\n", b" ")
            notice = _DISCONNECT + reason.encode() + b"\0" + text
            transport.sendLast(notice[:self.factory.config.max_packet])
        self.outbox.clear()
        transport.abortConnection()

    @property
    def watching(self) -> bool:
        """Whether it asked for `server/interest` (charged to its uid's `watchers`)."""
        return self._watching

    # -- control messages

    def _whoami(self):
        self.reply(self.whoami_reply)

    def _stats(self):
        self.factory.statsRequested(self)

    def _id(self):
        self.reply(_ID_REPLY + self.factory.bus_id)

    def _interest(self):
        """Start telling this client which patterns are held (`sbus.core.interest`); asking again
        changes nothing. The first listing ends with `=`, which comes before any later reply.
        Each watcher keeps a view of what it may see: for a uid other than root and the server's
        own, that uid's own patterns, so the view is charged to the uid's subscription bytes like
        the patterns themselves (without it, 400 connections of one uid holding 100,000 patterns
        pinned 2 GB)."""
        if not self._watching:
            factory = self.factory
            user = self.charge
            if not factory.seesAllInterest(self.cred.uid):
                refusal = user.watch_refusal(factory.config.max_uid_subscription_bytes)
                if refusal is not None:
                    return self.misbehaved(TOO_MANY_SUBSCRIPTIONS, refusal)
            user.watchers += 1
            self._watching = True
            if not self._waitForWork():  # else `_workEarned` starts it
                self._startListing()

    def _startListing(self) -> None:
        clock = self.factory.work_clock
        t0 = clock()
        ready = self.factory.watchInterest(self)  # its first slice is charged like routing work
        self.spent(clock() - t0)
        if ready:
            self.tellInterest()

    def _extensions(self):
        """`CMSG server/extensions`: from now on send this client the server's notices
        (`server/dropped`, `server/disconnect`, `relay/whoami`); no reply (docs/protocol.md)."""
        self.extensions = True

    def tellInterest(self) -> bool:
        """Queue the interest changes this client has not been told, as control packets, while
        its socket may take them (the queue is not blocked) and its control budget has room;
        the rest wait, coalesced in the table, until its queue drains (`outboxDrained`): a
        watcher that does not read is told the outcome, not every change. True when it has
        been told everything; then the replies that waited for that are queued."""
        table = self.factory.interest
        if self.transport.disconnecting:
            if self._waitingReplies is not None:  # nobody to answer: what held its reading goes
                self._waitingReplies = None
                self.pauses.release()
            return True
        if table is None or not table.watching(self):
            return not self._watching  # asked while its uid was in debt: the listing waits
        out = self.outbox
        if not out.blocked and out.ctl_bytes < out.ctl_limit and self._workWait is None:
            # (A uid past its share of the reactor gets the rest when it has earned the time.)
            clock = self.factory.work_clock
            t0 = clock()
            told = False
            for payload in table.changes(self):
                self._queueControl(_INTEREST + payload)
                told = True
                if out.blocked or out.ctl_bytes >= out.ctl_limit:
                    break
            if told:  # (charging an empty look would hold it again at once, and again: a timer loop)
                self.spent(clock() - t0)
        if table.pending(self):
            return False
        waiting = self._waitingReplies
        if waiting is not None:
            self._waitingReplies = None
            for packet in waiting:
                self._queueControl(packet)
            self.pauses.release()
        return True

    def _echo_on(self):
        self.echo = True

    def _echo_off(self):
        self.echo = False


class _Run:
    """A publisher's messages of one read batch for the same recipients (`_startRun`)."""

    __slots__ = ("packets", "nbytes", "clients", "targets", "room_bytes", "room_packets")

    def __init__(self):
        self.packets: list[bytes] = []
        self.nbytes = 0
        self.clients = None
        self.targets = ()
        self.room_bytes = self.room_packets = 0


class Owner:
    """The process that connected, for secret keys: is it still alive?

    With SO_PEERPIDFD (Linux 6.5+) each question takes a fresh pidfd from the socket (always
    that process, even when its pid has been reused), polls it and closes it: no descriptor is
    held per client. Without it, `pidfd_open` of the SO_PEERCRED pid right at accept, kept only
    if that process started no later than the accept (not a newer one that got the pid), and
    held for the life of the connection. Any error means "not proven alive" (fail closed)."""

    __slots__ = ("transport", "fd", "exited", "told")

    def __init__(self, transport, fd: int = -1):
        self.transport = transport
        self.fd = fd
        self.exited = False
        self.told = False

    @classmethod
    def take(cls, transport, pid: int) -> "Owner | str":
        """An `Owner`, or the reason why the process cannot be watched."""
        try:
            os.close(transport.peerPidfd())
            return cls(transport)
        except OSError as e:
            if e.errno in (errno.ESRCH, errno.EINVAL):
                return f"the process that connected (pid {pid}) has already exited"
            if e.errno != errno.ENOPROTOOPT or not hasattr(os, "pidfd_open"):
                return f"cannot prove the process that connected alive ({e.strerror or e})"
        try:
            return cls(transport, _pidfd_of_old_process(pid, time.clock_gettime(time.CLOCK_BOOTTIME)))
        except OSError as e:
            if e.errno == errno.ESRCH:
                return f"the process that connected (pid {pid}) has already exited"
            return f"cannot prove the process that connected alive ({e.strerror or e})"

    def alive(self) -> bool:
        if self.exited:
            return False
        fd = self.fd
        if fd >= 0:
            return self._poll(fd)
        try:
            fd = self.transport.peerPidfd()
        except OSError as e:
            if e.errno in (errno.ESRCH, errno.EINVAL):
                self.exited = True
            return False
        try:
            return self._poll(fd)
        finally:
            os.close(fd)

    def _poll(self, fd: int) -> bool:
        p = select.poll()
        p.register(fd, select.POLLIN)
        try:
            if p.poll(0):
                self.exited = True  # a pidfd is readable once its process has exited
        except OSError:
            return False
        return not self.exited

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _pidfd_of_old_process(pid: int, accepted: float) -> int:
    """pidfd_open(pid), kept only if that process started no later than `accepted` (CLOCK_BOOTTIME)."""
    fd = os.pidfd_open(pid)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / _CLOCK_TICKS  # starttime, field 22 of proc(5)
        if started > accepted + 1 / _CLOCK_TICKS:
            raise OSError(errno.ESRCH, "the pid belongs to a process newer than the connection")
    except (OSError, ValueError, IndexError):
        os.close(fd)
        raise
    return fd


def _budgetOf(feeder, outbox) -> "flood.Budget":
    """The budget a held-back message is charged to: its publisher's uid's (else the
    subscriber's, for a feeder that is no client, such as a relay's master)."""
    charge = getattr(feeder, "charge", None)
    return charge.queue if charge is not None else outbox.budget


def _show(name: bytes) -> str:
    """A session name for a log line: printable, and short."""
    return repr(name[:60])[1:]


def _control_table():
    table = {
        codec.EXTENSIONS: BrokerProtocol._extensions,
        codec.WHOAMI: BrokerProtocol._whoami,
        codec.STATS: BrokerProtocol._stats,
        codec.SERVER_ID: BrokerProtocol._id,
        codec.INTEREST: BrokerProtocol._interest,
        codec.ECHO_ON: BrokerProtocol._echo_on,
        codec.ECHO_OFF: BrokerProtocol._echo_off,
    }
    for mode in flood.SOFT_MODES:
        table[b"blocking/soft/" + mode.encode()] = lambda self, m=mode: self.outbox.set_soft(m)
    for mode in flood.HARD_MODES:
        table[b"blocking/hard/" + mode.encode()] = lambda self, m=mode: self.outbox.set_hard(m)
    for order in flood.ORDERS:
        table[b"order/" + order.encode()] = lambda self, o=order: self.outbox.set_order(o)
    return table


_CONTROL = _control_table()


def _kernel_charge(transport) -> int:
    """What a transport's kernel send buffer is charged (`SeqPacketTransport.sendBufferCharge`;
    0 for a transport that keeps no small buffer)."""
    charge = getattr(transport, "sendBufferCharge", None)
    return charge() if charge is not None else 0


class BrokerFactory(protocol.Factory):
    """The bus: its router, its clients and its counters."""

    protocol = BrokerProtocol
    noisy = False
    #: Patterns listed per reactor turn while the interest table is first built.
    interest_slice = 10_000
    #: An `IUpstream` (a relay's link to its master), told about local traffic it must carry.
    upstream = None

    def __init__(self, config: ServerConfig | None = None, on_empty=None, router=None, reactor=None,
                 owners=None, work_clock=None, kernel_floor=None):
        if reactor is None:
            from twisted.internet import reactor
        self.reactor = reactor
        #: The OS's edges, behind one call each (the simulator gives its own): who proves a
        #: connecting process alive (`take(transport, pid)` -> an `Owner` or why not), and the
        #: clock that measures the reactor time a request costs its uid.
        self.owners = owners if owners is not None else Owner
        self.work_clock = work_clock if work_clock is not None else time.perf_counter
        #: And the smallest send buffer the kernel gives a socket, as it counts it: a connection
        #: of a uid is charged twice that at least (`reserveSendBuffer`, `sendBufferCharge`).
        self.least_charge = 2 * (kernel_floor if kernel_floor is not None else kernel_send_floor())
        #: Per uid with connections waiting for room to send a big packet: the call that lets
        #: them try again (`growLater`).
        self.growRetry: dict[UserCharge, object] = {}
        self.config = config or ServerConfig()
        self.router = router if router is not None else Router()
        self.clients: set[BrokerProtocol] = set()
        self.on_empty = on_empty
        self.had_client = False
        #: The reactor's clock, not time.time: the simulator's fake clock makes `uptime_s`, and so
        #: the stats reply's size, the same in every run of a seed.
        self.started = reactor.seconds()
        #: `server/id`: random at start, stable for the life of this process.
        self.bus_id = os.urandom(16).hex().encode()
        allowed = self.config.allowed_uids
        self.allowed_uids = None if allowed is None else allowed_uid_set(allowed)
        self.overflow_ids = _overflow_ids()
        #: Connections that get no secret key, and why (their owner could not be proven alive).
        self.noSecrets: dict[BrokerProtocol, str] = {}
        # Per uid: how many clients are connected (not a set of them: 33 B per connection), and the
        # totals of its clients that have gone.
        self.uid_connected: Counter[int] = Counter()
        self.uid_gone: dict[int, Counter] = {}
        self.uid_drops: dict[int, Counter] = {}
        self.uid_disconnects: dict[int, Counter] = {}
        self.refused = Counter()
        #: Keys the clients' hot path looked up in the router's cache itself (`Router.cache_stats`).
        self.looked_up = 0
        # Memory bound on queued bytes for the whole server; each uid's `UserCharge` holds its own
        # budget under it, and its connections, patterns and routing work.
        self.queue_budget = flood.Budget(self.config.max_queue_bytes)
        self.users: dict[int, UserCharge] = {}
        # Per uid other than root and ours: how long its clients may still hold publishers.
        self.uid_hold_budgets: dict[int, HoldBudget] = {}
        # `server/stats`: when the next rendering may start, and who waits for it.
        self._stats_next = 0.0
        self._stats_waiting: list[BrokerProtocol] = []
        self._stats_call = None
        #: `server/interest`: who holds which pattern; built when the first watcher asks, then kept
        #: up to date for the life of the server (building it is O(patterns held): once, not per
        #: watcher that comes and goes).
        self.interest: InterestTable | None = None
        #: While it is being built: the holders and patterns not listed yet, who waits for it,
        #: who pays, and the next slice's call (`_buildInterest`).
        self._unlisted: deque | None = None
        self._unlistedPatterns = None
        self._listWaiters: list | None = None
        self._listBuilder = None
        self._listCall = None
        #: Clients whose queues got packets since they were last sent from (`flushDirty`).
        self.dirty: list[BrokerProtocol] = []
        self._interest_room = self.config.max_packet - len(_INTEREST) - 2
        #: `server/session`: named sessions, and the stand-ins of closed ones (`sbus.core.sessions`).
        self.sessions = SessionTable()
        #: Connections that came and went since the last summary line (`logChurn`).
        self.churn = ConnectionChurn()
        self._churnCall = None
        self._churnSince = self.reactor.seconds()
        self.stopping = False

    def stopFactory(self):
        """The server is stopping: tell every client why before the process closes them."""
        for ghost in self.sessions.lingering():  # nothing lingers past the server
            if ghost.timer is not None and ghost.timer.active():
                ghost.timer.cancel()
        if self._listCall is not None and self._listCall.active():
            self._listCall.cancel()
        for call in self.growRetry.values():
            if call.active():
                call.cancel()
        self.growRetry.clear()
        self.stopping = True
        if not self.clients:
            self.logChurn()
        notice = _DISCONNECT + SHUTDOWN.encode() + b"\0the server is shutting down"
        for client in list(self.clients):
            transport = client.transport
            if transport is not None and transport.connected and not transport.disconnecting:
                client.reason = SHUTDOWN
                if client.extensions:
                    transport.sendLast(notice)

    def buildProtocol(self, addr):
        cred = addr.cred
        if self.allowed_uids is not None and cred.uid not in self.allowed_uids:
            self.refused[Refusal.USER_NOT_ALLOWED] += 1
            log.warn("refused connection from pid={pid} uid={uid}: user not allowed", pid=cred.pid, uid=cred.uid)
            return None
        limit = self.config.max_uid_connections
        user = self.users.get(cred.uid)
        if user is not None and user.connections >= limit:
            self.refused[Refusal.TOO_MANY_CONNECTIONS] += 1
            log.warn("refused connection from pid={pid} uid={uid}: uid has {n} connections, the limit",
                     pid=cred.pid, uid=cred.uid, n=limit)
            return None
        if user is not None and self.smallSendBuffer(cred.uid) and not user.kernel_fits(self.least_charge):
            self.refused[Refusal.OVER_UID_QUEUE_CAP] += 1
            log.warn("refused connection from pid={pid} uid={uid}: its queues and kernel buffers fill its "
                     "{cap}-byte cap (its clients do not read); not even the kernel's smallest send buffer fits",
                     pid=cred.pid, uid=cred.uid, cap=user.queue.limit)
            return None
        return self.protocol(self, cred)

    def holdBudget(self, uid: int) -> HoldBudget:
        """A fresh budget per connection for root and the server's own user; the uid's shared one
        (kept while it is being spent or earned back) for anyone else."""
        now = self.reactor.seconds()
        limit = self.config.stall_timeout
        if self.privileged(uid):
            return HoldBudget(limit, now)
        budget = self.uid_hold_budgets.get(uid)
        if budget is None:
            if len(self.uid_hold_budgets) >= 4096:  # forget the budgets there is nothing to remember of
                for u, b in list(self.uid_hold_budgets.items()):
                    if b.idle(now):
                        del self.uid_hold_budgets[u]
            budget = self.uid_hold_budgets[uid] = HoldBudget(limit, now, shared=True)
        return budget

    def clientConnected(self, client: BrokerProtocol):
        uid = client.cred.uid
        self.clients.add(client)
        self.uid_connected[uid] += 1
        self.had_client = True
        user = self.users.get(uid)
        if user is None:
            if len(self.users) >= 4096:  # forget the charges there is nothing to remember of
                now = self.reactor.seconds()
                for u, charge in list(self.users.items()):
                    if charge.idle(now):
                        del self.users[u]
            user = self.users[uid] = UserCharge(uid, self.config.max_uid_queue_bytes, self.queue_budget,
                                                self.reactor.seconds())
        user.connections += 1
        client.charge = user
        client.outbox.set_budget(user.queue)
        self.reserveSendBuffer(client, user)
        alive = client.watchOwner()
        self.router.add_client(client, secret_prefix(self.config.cred_prefix, client.cred) if alive else None)
        if self.config.log_connections:
            log.info("client connected: {client}", client=client.label)
        else:
            self.churn.arrived()
            self._churnLater()

    def _churnLater(self) -> None:
        """The summary of connections that came and went goes out one interval after the first."""
        if self._churnCall is None:
            self._churnCall = self.reactor.callLater(self.config.connection_log_interval, self.logChurn)

    def logChurn(self) -> None:
        """One line: how many clients connected and left (by reason) since the last such line."""
        if self._churnCall is not None and self._churnCall.active():
            self._churnCall.cancel()
        self._churnCall = None
        now = self.reactor.seconds()
        line = self.churn.summary(len(self.clients), now - self._churnSince)
        self._churnSince = now
        if line is not None:
            log.info("{line}", line=line)

    def flushDirty(self, feeder=None) -> None:
        """Send from every queue that got packets since it was last sent from: the end of a
        read batch (`feeder` is the publisher whose batch it was), or of anything else that
        queued packets outside one (timers, a client leaving)."""
        while self.dirty:  # a queue emptied here may queue more (notices, interest): again
            dirty, self.dirty = self.dirty, []
            for client in dirty:
                try:
                    client.flush(feeder)
                except Exception:
                    # One client's fault costs that client, never the others later in the list
                    # (as Twisted's reactor disconnects the one selectable that raised).
                    self.clientFailed(client)

    def clientFailed(self, client: BrokerProtocol) -> None:
        """Handling `client` raised: one log line with the traceback, and it is let go."""
        log.failure("internal error while serving client {client}; disconnecting it", client=client.label)
        client.dirty = False
        client.reason = INTERNAL_ERROR
        try:
            client.outbox.clear()
            client.transport.abortConnection()
        except Exception:
            log.failure("could not disconnect client {client}", client=client.label)

    def reserveSendBuffer(self, client: BrokerProtocol, user: UserCharge) -> None:
        """Charge the kernel send buffer of a client's socket to its uid, as its queue is (issue
        33.7): a uid with room reserves the small buffer, room kept for the kernel's minimum of
        every connection it may still open; one without is set to the kernel's minimum and
        reserves that (`buildProtocol` refuses a connection for which even that does not fit).
        So its connections that never read, however many, exhaust the budget their queues use
        and no more. Given back in `clientGone`."""
        transport = client.transport
        want = _kernel_charge(transport)
        if not want:
            return
        spare = max(0, self.config.max_uid_connections - user.connections)
        if not user.kernel_fits(want + spare * self.least_charge):
            transport.keepSendBufferSmall(SERVER_SNDBUF_LEAST)
            want = transport.sendBufferCharge()
        user.reserve_kernel(want)

    def growLater(self, user: UserCharge) -> None:
        """A connection of `user` waits for room to send a big packet (`mayGrowSendBuffer`):
        let its waiting connections try again in GROW_RETRY seconds, if nothing wakes them
        before (one timer per uid, whatever the number waiting)."""
        if user not in self.growRetry:
            self.growRetry[user] = self.reactor.callLater(GROW_RETRY, self.growNow, user)

    def growNow(self, user: UserCharge) -> None:
        """Let the connections of `user` waiting for room to send a big packet try again."""
        call = self.growRetry.pop(user, None)
        if call is not None and call.active():
            call.cancel()
        for client in user.take_waiting():
            transport = client.transport
            if transport is not None and transport.connected:
                transport.startWriting()

    def clientGone(self, client: BrokerProtocol):
        uid = client.cred.uid
        session = self.sessions.leave(client, uid)
        ghost = None
        if session is not None and session[1] > 0:
            ghost = self._linger(client, *session)  # before its patterns go: the stand-in holds them
        if self.interest is not None:
            self.tellInterest(self.interest.forget(client))
        released = self.router.remove_client(client)
        if released and self.upstream is not None:
            for pattern in released:
                self.upstream.patternReleased(pattern)
        if client in self.clients:
            self.clients.remove(client)
            left = self.uid_connected[uid] - 1
            if left > 0:
                self.uid_connected[uid] = left
            else:
                del self.uid_connected[uid]
        self.noSecrets.pop(client, None)
        user = client.charge
        if user is not None:
            # what `reserveSendBuffer` reserved (the socket is closed, whatever stands in; no slot
            # of its own: an idle connection's memory is at its goal, docs/performance.md)
            user.release_kernel(_kernel_charge(client.transport))
            user.forget(client)
            if ghost is None:
                user.connections -= 1  # (a stand-in counts as one of its uid's connections)
            user.release_patterns(client.subscriptions - (ghost.subscriptions if ghost else 0),
                                  client.subscription_bytes - (ghost.subscription_bytes if ghost else 0))
            if client.watching:
                user.watchers -= 1
            if user.idle(self.reactor.seconds()) and self.users.get(uid) is user:
                del self.users[uid]
        t = client.transport
        gone = self.uid_gone.setdefault(uid, Counter())
        gone["packets_in"] += client.packets_in
        gone["bytes_in"] += client.bytes_in
        gone["packets_out"] += t.packets_out
        gone["bytes_out"] += t.bytes_out
        if client.drops:
            self.uid_drops.setdefault(uid, Counter()).update(client.drops)
        self.uid_disconnects.setdefault(uid, Counter())[client.reason] += 1
        if self.config.log_connections or not self.churn.ordinary(client.reason):
            log.info("client disconnected: {client} ({reason})", client=client.label, reason=client.reason)
        else:
            self.churn.left(client.reason)
            self._churnLater()
        self.flushDirty()
        if not self.clients and self.stopping:
            self.logChurn()  # the last summary: who came and went up to the end
        if not self.clients and self.on_empty is not None:
            self.on_empty()

    # -- server/session (sbus.core.sessions)

    def sessionRequested(self, client: BrokerProtocol, payload: bytes) -> None:
        """Hold a named session for `client`, or hand it the one a predecessor left: it is told
        how many messages matched while nobody held it, and how long that was."""
        uid = client.cred.uid
        try:
            name, linger, confirm = parse_request(payload, self.config.max_session_linger)
            state, ghost = self.sessions.claim(client, uid, name, linger, confirm)
        except SessionRefused as e:
            log.warn("server/session refused for {client}: {why}", client=client.label, why=str(e))
            client.reply(session_reply(payload.partition(b"\0")[0][:200], REFUSED))
            return
        missed = gap = carried = 0
        if ghost is not None:
            missed, gap, carried = ghost.missed, max(0.0, self.reactor.seconds() - ghost.left), ghost.carried
            self._endLingering(ghost)
            log.info("session {name} of uid {uid} resumed by {client} after {gap:.3f} s: {n} messages missed"
                     "{also}", name=_show(name), uid=uid, client=client.label, gap=gap, n=missed,
                     also=f" ({carried} of them told before to a holder that did not confirm)" if carried else "")
        client.reply(session_reply(name, state, missed, gap, linger, carried if confirm else None))

    def sessionConfirmed(self, client: BrokerProtocol, name: bytes) -> None:
        """`client` recorded the count its claim of `name` was told: the server forgets it (until
        then a close hands it on to the next stand-in). No answer."""
        if self.sessions.confirm(client, name) is None:
            log.warn("server/session-confirm from {client}: it holds no session {name}",
                     client=client.label, name=_show(name[:200]))

    def sessionAcked(self, client: BrokerProtocol, payload: bytes) -> None:
        """`server/session-ack`: `client` has read and handed on this many packets. What the
        server sent past that when it closes (unread in the kernel, or held by the dead process)
        is counted as missed with the rest. No answer."""
        try:
            name, count = parse_ack(payload)
            if not self.sessions.ack(client, name, count):
                raise SessionRefused(f"it holds no session {_show(name[:200])}")
        except SessionRefused as e:
            log.warn("server/session-ack from {client} ignored: {why}", client=client.label, why=str(e))

    def sessionHeldAsked(self, client: BrokerProtocol, name: bytes) -> None:
        """`server/session-held`: is `client`'s uid's session `name` held, and is its holder's peer
        still there? ``closing``: the peer has closed and what it sent is not all read yet (read
        and routed before its end of file frees the name). Claims nothing."""
        try:
            codec.check_session_name(name)
        except ValueError as e:
            log.warn("server/session-held refused for {client}: {why}", client=client.label, why=str(e))
            client.reply(codec.session_held_reply(name[:200], codec.HELD_REFUSED))
            return
        holder = self.sessions.holder(client.cred.uid, name)
        state = codec.HELD_FREE
        if holder is not None:
            state = codec.HELD_CLOSING if holder.transport.peerClosed() else codec.HELD_LIVE
        client.reply(codec.session_held_reply(name, state))

    def _linger(self, client: BrokerProtocol, name: bytes, linger: float, carried: int,
                acked: int | None) -> Lingering:
        """`client` closed holding session `name`: a stand-in takes over its patterns (not its
        secret ones: a secret reaches only a live process) and counts what they match, charged to
        the uid as the patterns were, until it is claimed or `linger` seconds are up. It starts
        with what was queued, unsent, what was sent past the packets `client` last acknowledged
        (if it ever did), and the count `client` was told and never confirmed."""
        uid = client.cred.uid
        missed = client.outbox.lost + len(client.outbox)
        if acked is not None:
            missed += max(0, client.transport.packets_out - acked)
        ghost = Lingering(uid, name, self.reactor.seconds(), linger, missed=missed, carried=carried)
        router = self.router
        router.add_client(ghost, None)
        secret = (SECRET_ROOT, self.config.cred_prefix + SECRET_ROOT)
        interest = self.interest
        touched = []
        for pattern, n in router.patterns_of(client).items():
            if pattern.startswith(secret):
                continue
            for _ in range(n):
                router.subscribe(ghost, pattern)
            ghost.subscriptions += n
            ghost.subscription_bytes += n * pattern_cost(pattern)
            if interest is not None:
                touched += interest.held(ghost, uid, self.interestForm(pattern))
        self.tellInterest(touched)
        self.sessions.linger(ghost)
        ghost.timer = self.reactor.callLater(linger, self._expire, ghost)
        return ghost

    def _expire(self, ghost: Lingering) -> None:
        ghost.timer = None
        if self.sessions.expire(ghost):
            log.warn("session {name} of uid {uid} expired after {linger:.3f} s: {n} messages missed",
                     name=_show(ghost.name), uid=ghost.uid, linger=ghost.linger, n=ghost.missed)
            self._endLingering(ghost)
            self.flushDirty()

    def _endLingering(self, ghost: Lingering) -> None:
        """The stand-in's patterns go (claimed or expired), and what it cost its uid."""
        timer, ghost.timer = ghost.timer, None
        if timer is not None and timer.active():
            timer.cancel()
        if self.interest is not None:
            self.tellInterest(self.interest.forget(ghost))
        released = self.router.remove_client(ghost)
        if released and self.upstream is not None:
            for pattern in released:
                self.upstream.patternReleased(pattern)
        user = self.users.get(ghost.uid)
        if user is not None:
            user.connections -= 1
            user.release_patterns(ghost.subscriptions, ghost.subscription_bytes)
            if user.idle(self.reactor.seconds()):
                del self.users[ghost.uid]

    # -- server/interest

    def interestForm(self, pattern: bytes) -> bytes:
        """The pattern as a notice carries it: a pattern too long for one notice packet is told as
        the empty pattern, which matches every key (more interest, never less)."""
        return pattern if len(pattern) <= self._interest_room else b""

    def watchInterest(self, client: BrokerProtocol) -> bool:
        """Start telling `client` the interest; False while the table is still being built (it
        is then told when the build is done, `_buildInterest`)."""
        table = self.interest
        if table is None:
            # Built once, in slices of `interest_slice` patterns, one slice per reactor turn: a
            # first watcher (of any uid) over 300,000 patterns must not stop the bus for the
            # build (issue 32 fault 8). Changes meanwhile go into the table as they happen.
            table = self.interest = InterestTable()
            self._unlisted = deque(list(self.clients) + list(self.sessions.lingering()))
            self._unlistedPatterns = None
            self._listWaiters = [client]
            self._listBuilder = client
            self._buildInterest()
            return self.interest_ready
        if not self.interest_ready:
            if client not in self._listWaiters:
                self._listWaiters.append(client)
            return False
        uid = client.cred.uid
        table.watch(client, uid, self.seesAllInterest(uid))
        return True

    @property
    def interest_ready(self) -> bool:
        return self.interest is not None and self._listWaiters is None

    def _buildInterest(self) -> None:
        """One slice of the interest table's build; the next in the next reactor turn."""
        self._listCall = None
        table = self.interest
        router = self.router
        form = self.interestForm
        clock = self.work_clock
        t0 = clock()
        left = self.interest_slice
        while left > 0:
            patterns = self._unlistedPatterns
            if not patterns:
                if not self._unlisted:
                    break
                holder = self._unlisted.popleft()
                if isinstance(holder, BrokerProtocol):
                    if holder not in self.clients:
                        continue  # gone meanwhile
                    uid = holder.cred.uid
                elif holder.timer is None:
                    continue  # a stand-in that ended meanwhile
                else:
                    uid = holder.uid
                patterns = self._unlistedPatterns = (holder, uid, list(router.patterns_of(holder)))
            holder, uid, pending = patterns
            while pending and left > 0:
                pattern = pending.pop()
                left -= 1
                if router.holds(holder, pattern):  # (not released since the build began)
                    table.held(holder, uid, form(pattern))
            if not pending:
                self._unlistedPatterns = None
        builder = self._listBuilder
        if builder is not None and builder.transport is not None and builder.transport.connected:
            builder.spent(clock() - t0)  # the first watcher's uid pays for the build
        if self._unlisted or self._unlistedPatterns:
            self._listCall = self.reactor.callLater(0, self._buildInterest)
            return
        waiters, self._listWaiters = self._listWaiters, None
        self._listBuilder = self._unlisted = None
        for client in waiters:
            transport = client.transport
            if transport is not None and transport.connected and not transport.disconnecting:
                uid = client.cred.uid
                table.watch(client, uid, self.seesAllInterest(uid))
                client.tellInterest()
        self.flushDirty()

    def tellInterest(self, watchers) -> None:
        for client in watchers:
            client.tellInterest()

    def deliverLocally(self, packet: bytes, key: bytes, feeder=None) -> None:
        """Deliver a MSG packet that came from outside this bus (a relay's master).

        `feeder`, if given, is paused like a local publisher when a subscriber in
        `block` mode fills up: it needs a `pauses` (`sbus.core.pausing.Pauses`)."""
        if key.startswith(self.config.cred_prefix + SECRET_ROOT):
            return self.deliverSecret(packet, key, feeder, local=False)
        for client in self.router.match(key):
            client.deliver(packet, feeder, key)

    def deliverSecret(self, packet: bytes, key: bytes, publisher, local: bool = True) -> None:
        """A secret key: its owner gets it only while the process that connected is alive, asked
        now, not when the reactor gets round to the pidfd's exit event."""
        for client in self.router.match(key):
            if client is publisher and not client.echo:
                continue
            if client.ownerAlive():
                client.deliver(packet, publisher, key)
        if local and self.upstream is not None:
            self.upstream.localPublish(packet, key, publisher)

    # -- statistics

    def statsRequested(self, client: BrokerProtocol) -> None:
        """Answer now if rendering is allowed now; else hold the asker (not reading it keeps its
        later packets after the answer) until the next rendering, which answers everyone waiting."""
        if client.statsWanted == 0 and not self._stats_waiting and self.reactor.seconds() >= self._stats_next:
            client.reply(_STATS_REPLY + self._statsFor({}, client.cred.uid))
            return
        client.statsWanted += 1
        if client.statsWanted == 1:
            self._stats_waiting.append(client)
            client.pauses.hold()
        if self._stats_call is None:
            self._stats_call = self.reactor.callLater(max(0.0, self._stats_next - self.reactor.seconds()),
                                                      self._answerStats)

    def _answerStats(self) -> None:
        self._stats_call = None
        waiting, self._stats_waiting = self._stats_waiting, []
        rendered: dict = {}
        for client in waiting:
            n, client.statsWanted = client.statsWanted, 0
            if client.transport.connected and not client.transport.disconnecting:
                reply = _STATS_REPLY + self._statsFor(rendered, client.cred.uid)
                for _ in range(n):
                    client.reply(reply)
            client.pauses.release()
        self.flushDirty()

    def _statsFor(self, rendered: dict, viewer_uid: int) -> bytes:
        """The JSON for this viewer; one rendering per scope per batch. Rendering may take at most
        STATS_SHARE of the reactor's time: the next one may start only after 1/STATS_SHARE - 1
        times the last one's duration has passed."""
        scope = None if self.privileged(viewer_uid) else viewer_uid
        data = rendered.get(scope)
        if data is None:
            start = self.work_clock()
            data = rendered[scope] = self.statsJSON(viewer_uid)
            spent = self.work_clock() - start
            self._stats_next = self.reactor.seconds() + spent * (1 / STATS_SHARE - 1)
        return data

    @staticmethod
    def privileged(uid: int | None) -> bool:
        return uid is None or uid in (0, os.getuid())

    def smallSendBuffer(self, uid: int) -> bool:
        """Whose connection gets a small kernel send buffer (`SeqPacketPort`, issue 33.7): any
        uid but root and the server's own. Those two are trusted with the machine already, and
        their relays and bridges carry the bus's bulk: at 64 KiB a relay's rate fell by a fifth
        (docs/performance.md "Kernel send buffers")."""
        return not self.privileged(uid)

    def seesAllInterest(self, uid: int | None) -> bool:
        """Who sees every uid's `server/interest`: root, the server's own uid, and the uids the
        bus owner grants it to (``--service-uid``: services that carry other uids' traffic)."""
        return self.privileged(uid) or uid in self.config.service_uids

    def stats(self, viewer_uid: int | None = None) -> dict:
        """The bus as `viewer_uid` may see it: root and the server's own user see every client and
        the whole bus's totals; any other uid sees only its own clients, in rows and in totals (the
        bus's totals would tell it who subscribes to what, by diffing them around a publish)."""
        private = not self.privileged(viewer_uid)
        if private:
            uids = [viewer_uid]
            clients = [c for c in self.clients if c.cred.uid == viewer_uid]
        else:
            uids = set(self.uid_gone) | set(self.uid_connected) | set(self.uid_drops) | set(self.uid_disconnects)
            clients = list(self.clients)
        totals = Counter()
        drops = Counter()
        disconnects = Counter()
        for uid in uids:
            totals.update(self.uid_gone.get(uid, ()))
            drops.update(self.uid_drops.get(uid, ()))
            disconnects.update(self.uid_disconnects.get(uid, ()))
        queues = []
        subscriptions = 0
        for c in clients:
            t = c.transport
            totals["packets_in"] += c.packets_in
            totals["bytes_in"] += c.bytes_in
            totals["packets_out"] += t.packets_out
            totals["bytes_out"] += t.bytes_out
            subscriptions += c.subscriptions
            if c.drops:
                drops.update(c.drops)
            q = c.outbox.state()
            queues.append({
                "pid": c.cred.pid, "uid": c.cred.uid, "gid": c.cred.gid,
                "subscriptions": c.subscriptions,
                "queued_packets": q.packets, "queued_bytes": q.bytes,
                "soft": q.soft, "hard": q.hard, "order": q.order, "echo": c.echo,
                "packets_in": c.packets_in, "packets_out": t.packets_out,
                "drops": dict(c.drops or {}),
            })
        # (the budgets also hold the kernel send buffers reserved for connections: not queued)
        if private:
            user = self.users.get(viewer_uid)
            kernel = user.kernel if user is not None else 0
            queued = user.queue.used - kernel if user is not None else 0
        else:
            kernel = sum(u.kernel for u in self.users.values())
            queued = self.queue_budget.used - kernel
        result = {
            "clients": len(clients),
            "subscriptions": subscriptions if private else self.router.subscription_count,
            "packets_in": totals["packets_in"],
            "packets_out": totals["packets_out"],
            "bytes_in": totals["bytes_in"],
            "bytes_out": totals["bytes_out"],
            "queued_bytes": queued,
            "kernel_reserved_bytes": kernel,
            "drops": dict(drops),
            "disconnects": dict(disconnects),
            "refused": {} if private else dict(self.refused),
            "queues": queues,
            "uptime_s": round(self.reactor.seconds() - self.started, 3),
            "limits": {name: getattr(self.config, name) for name in (
                "max_packet", "queue_bytes", "queue_packets", "max_uid_queue_bytes", "max_queue_bytes",
                "stall_timeout", "max_subscriptions", "max_uid_subscriptions", "max_uid_connections",
                "max_subscription_bytes", "max_uid_subscription_bytes", "max_pattern_segments")},
        }
        if private:
            result["scope"] = "uid"
            if self.seesAllInterest(viewer_uid):  # the owner's grant: server/interest lists every uid's
                result["interest_scope"] = "all"
        else:  # who may connect (the -u list; None: anyone the socket's mode lets in), for services
            result["allowed_uids"] = sorted(self.allowed_uids) if self.allowed_uids is not None else None
        result["sessions"] = self.sessions.stats(viewer_uid if private else None)
        if not private:
            result["router_cache"] = self.router.cache_stats(self.looked_up)
        upstream_stats = getattr(self.upstream, "stats", None)
        if upstream_stats is not None and not private:
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
