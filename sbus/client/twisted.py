"""The Twisted client: a packet protocol with per-pattern callbacks.

Twisted has no SOCK_SEQPACKET transport; this reuses the server's
(`sbus.seqpacket.SeqPacketTransport`: one `write` is one packet and
one `send`, several packets are read per wakeup, oversize is detected).

    from twisted.internet import task
    from sbus.client.twisted import connect

    async def main(reactor):
        bus = await connect(reactor, "/run/sbus.socket")
        bus.subscribe("sensors/", lambda key, payload: print(key, payload))
        await bus.sync()                      # the subscription is in place
        bus.publish("sensors/a", b"21.5")
        print(await bus.whoami())

`ReconnectingClient` keeps a connection up with back-off and re-applies
subscriptions, echo and flood settings after every reconnect.

Services subclass `SbusProtocol` and override `messageReceived(key, payload,
raw_packet)` (the raw packet is what to forward byte for byte) and perhaps
`controlReceived`.
"""

from __future__ import annotations

import errno
import json
import os
import random
import time
from collections import deque

from twisted.internet import defer
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from sbus.core import codec
from sbus.core.codec import MAX_PACKET, Control, Message, ProtocolError
from sbus.core.credentials import CredentialError, Credentials, SECRET_ROOT, check_pattern
from sbus.core.patterns import reaches
from sbus.core.reqrep import ANY, Ask, NoResponders, RemoteError, Requester, Responder, error_text
from sbus.core.workqueue import (SUBMIT_ROOT, Delivery, Membership, NoService, WorkerBase, check_group, encode_jobs,
                                 submit_result)
from sbus.interfaces import IPacketProtocol
from sbus.seqpacket import SeqPacketTransport
from zope.interface import implementer

from .address import AddressError, open_socket, resolve
from .socketwatch import WAKE_INTERVAL, WAKE_WINDOW, SocketWatch
from .blocking import ConnectionClosed, echo_packet, flood_packets

log = Logger()

__all__ = ["SbusProtocol", "ReconnectingClient", "TwistedWorker", "connect", "connect_socket", "ConnectionClosed",
           "parse_whoami"]


def parse_whoami(whoami: bytes) -> tuple[bytes, Credentials] | None:
    """Split a whoami answer into (credential prefix, own Credentials); None if malformed."""
    i = whoami.rfind(SECRET_ROOT)
    if i < 0:
        return None
    parts = whoami[i + len(SECRET_ROOT):].split(b"/")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    gid, uid, pid = (int(p) for p in parts)
    return whoami[:i], Credentials(pid, uid, gid)


class _Subscription:
    __slots__ = ("pattern", "match", "callback")

    def __init__(self, pattern: bytes, match: bytes, callback):
        self.pattern = pattern
        self.match = match
        self.callback = callback


@implementer(IPacketProtocol)
class SbusProtocol(Protocol):
    """One connection to an sbus server (a packet protocol, see `IPacketProtocol`).

    Server notices: `dropNotice(count, first, last)` is called for each `server/dropped`
    (`dropped` counts them all); a `server/disconnect` is kept as `disconnectReason` (a
    `codec.DisconnectNotice`) and becomes the `ConnectionClosed` the connection is lost with.

    Callbacks given to `subscribe` are called as ``callback(key, payload)``
    (bytes, bytes) for each message whose key their pattern matches; a
    callback registered under several matching patterns is called once per
    message. Exceptions in callbacks are logged and do not hurt the
    connection.
    """

    max_packet = MAX_PACKET

    def __init__(self):
        self._subs: list[_Subscription] = []
        self._requests: dict[bytes, deque] = {}
        self._lost: list[defer.Deferred] = []
        self.connected = False
        self.lostReason: Failure | None = None
        #: The whoami answer, once known (`connect` asks for it).
        self.credentials: bytes | None = None
        self._cred: tuple[bytes, Credentials] | None = None
        #: Last settings sent, for `ReconnectingClient` and inspection.
        self.echoOn: bool | None = None
        self.floodModes: dict[str, str] = {}
        #: Messages the server dropped for us, summed from its `server/dropped` notices.
        self.dropped = 0
        #: The server's `server/disconnect` notice, if it sent one before closing.
        self.disconnectReason: codec.DisconnectNotice | None = None
        self._reqrep: Requester | None = None  # request/reply state, made at the first request()
        self._acknowledged = 0  # the last count `acknowledgeSession` sent

    # -- connection

    def connectionMade(self):
        # Ask for the server's notices (docs/protocol.md "Extensions"); others ignore the key.
        self.transport.write(b"CMSG " + codec.EXTENSIONS)

    def connectionLost(self, reason=None):
        self.connected = False
        if self.disconnectReason is not None:
            reason = Failure(ConnectionClosed(str(self.disconnectReason)))
        self.lostReason = reason
        requests, self._requests = self._requests, {}
        for queue in requests.values():
            for d in queue:
                d.errback(ConnectionClosed(str(self.disconnectReason)) if self.disconnectReason
                          else ConnectionClosed())
        if self._reqrep is not None:
            for d in self._reqrep.abandon():
                if not d.called:
                    d.errback(ConnectionClosed(str(self.disconnectReason)) if self.disconnectReason
                              else ConnectionClosed())
        why = reason.value if isinstance(reason, Failure) else reason
        waiters, self._lost = self._lost, []
        for d in waiters:
            d.callback(why)

    def whenLost(self) -> defer.Deferred:
        """A Deferred that fires with the reason (an exception) when the connection is gone."""
        if not self.connected and self.lostReason is not None:
            reason = self.lostReason
            return defer.succeed(reason.value if isinstance(reason, Failure) else reason)
        d = defer.Deferred()
        self._lost.append(d)
        return d

    def close(self) -> defer.Deferred:
        """Close after what is queued has been sent; fires when the connection is gone."""
        d = self.whenLost()
        if self.transport is not None and self.connected:
            self.transport.loseConnection()
        return d

    # -- sending

    def sendPacket(self, packet: bytes) -> None:
        """Send one encoded packet (queued, never dropped, if the socket is full)."""
        if not self.connected:
            raise ConnectionClosed("not connected")
        if not packet:
            raise ProtocolError("refusing to send an empty packet (it reads as end of file)")
        self.transport.write(packet)

    def subscribe(self, pattern, callback=None) -> None:
        """Send `SUB pattern`; `callback(key, payload)` gets the messages it matches."""
        packet = codec.encode_sub(pattern, self.max_packet)
        pattern = packet[4:]
        self.sendPacket(packet)
        self._subs.append(_Subscription(pattern, self.stored_pattern(pattern), callback))

    def unsubscribe(self, pattern, callback=None) -> None:
        """Send `UNSUB pattern` and forget one (pattern, callback) registration."""
        packet = codec.encode_unsub(pattern, self.max_packet)
        pattern = packet[6:]
        self.sendPacket(packet)
        for i in range(len(self._subs) - 1, -1, -1):
            sub = self._subs[i]
            if sub.pattern == pattern and (callback is None or sub.callback == callback):
                del self._subs[i]
                break

    @property
    def subscriptions(self) -> list[tuple[bytes, object]]:
        """(pattern, callback) for each subscription held, in order."""
        return [(s.pattern, s.callback) for s in self._subs]

    def publish(self, key, payload=b"") -> None:
        self.sendPacket(codec.encode_msg(key, payload, self.max_packet))

    def sendControl(self, key, payload=None) -> None:
        self.sendPacket(codec.encode_cmsg(key, payload, self.max_packet))

    def server_request(self, key, payload=None) -> defer.Deferred:
        """Send `CMSG key`; the Deferred fires with the payload of the server's `CMSG key` reply."""
        packet = codec.encode_cmsg(key, payload, self.max_packet)
        key = codec.classify(packet, self.max_packet)[1]
        self.sendPacket(packet)
        d = defer.Deferred()
        self._requests.setdefault(key, deque()).append(d)
        return d

    def forgetRequest(self, key: bytes, d: defer.Deferred) -> None:
        """Stop waiting for the answer to `server_request(key)` that gave `d`: the server does
        not know the request (a reference server routes it as a message), which shows when a
        later request's answer comes first, since a server answers in order. `d` never fires."""
        queue = self._requests.get(key)
        if queue is not None and d in queue:
            queue.remove(d)
            if not queue:
                del self._requests[key]

    def whoami(self) -> defer.Deferred:
        """Deferred[bytes]: the credentials the server sees, e.g. ``b"!/cred/100/1000/1111"``."""

        def got(payload):
            payload = payload or b""
            self._setCredentials(payload)
            return payload

        return self.server_request(codec.WHOAMI).addCallback(got)

    def sync(self) -> defer.Deferred:
        """Fires once the server has processed everything sent before (a whoami round trip)."""
        return self.whoami().addCallback(lambda _: None)

    def stats(self) -> defer.Deferred:
        """Deferred[dict]: the server's statistics."""
        return self.server_request(codec.STATS).addCallback(lambda p: json.loads(p or b"{}"))

    def session(self, name: bytes, linger: float, confirm: bool = False) -> defer.Deferred:
        """Deferred[`codec.SessionReply`]: hold the named session (docs/protocol.md "Sessions"),
        or claim the one a dead predecessor left and learn what it missed. Subscribe first.
        `confirm`: the server keeps the count until `confirmSession` (call it once recorded); a
        server older than that refuses the flag, and is asked again in the old form."""
        codec.check_session_name(name)
        d = self._sessionRequest(name, linger, confirm)
        if confirm:
            def older(reply: codec.SessionReply):
                # a server from before the confirmation refuses the flag: claim in the old form
                if reply.state == "refused" and self.connected:
                    return self._sessionRequest(name, linger, False)
                return reply
            d.addCallback(older)
        return d

    def _sessionRequest(self, name: bytes, linger: float, confirm: bool) -> defer.Deferred:
        self.sendPacket(codec.session_request(name, linger, confirm))
        d = defer.Deferred()
        self._requests.setdefault(codec.SESSION, deque()).append(d)
        return d.addCallback(codec.parse_session_reply)

    def confirmSession(self, name: bytes) -> None:
        """The count the claim of session `name` was told is recorded: the server may forget it."""
        self.sendPacket(codec.session_confirm(name))

    def acknowledgeSession(self, name: bytes, count: int | None = None) -> None:
        """Tell the server the first `count` packets this connection read (default: all so far)
        are handed on: if it closes holding session `name`, what was sent past them (unread in
        the kernel, or held here) is counted as missed too (docs/protocol.md "Acknowledging
        what was read"). Sent only when it says more than the last one, and not while packets
        wait in our queue to the server (it would not be read sooner than a later one, and a
        server that holds us would see our queue fill with them)."""
        n = self.transport.packets_in if count is None else count
        if n > self._acknowledged and self.connected and not self.transport.queued():
            self._acknowledged = n
            self.sendPacket(codec.session_ack(name, n))

    def echo(self, on: bool = True) -> None:
        self.sendPacket(echo_packet(on))
        self.echoOn = bool(on)

    def flood(self, soft=None, hard=None, order=None) -> None:
        """Select flood-control modes (see `sbus.client.Client.flood`)."""
        for packet in flood_packets(soft, hard, order):
            self.sendPacket(packet)
        for name, mode in (("soft", soft), ("hard", hard), ("order", order)):
            if mode is not None:
                self.floodModes[name] = mode.decode() if isinstance(mode, bytes) else mode

    # -- receiving

    def packetReceived(self, packet: bytes) -> None:
        try:
            parsed = codec.parse(packet, self.max_packet)
        except ProtocolError as e:
            log.warn("ignoring a malformed packet from the server: {err}", err=e)
            return
        if type(parsed) is Message:
            self.messageReceived(parsed.key, parsed.payload, packet)
        elif type(parsed) is Control:
            self.controlReceived(parsed.key, parsed.payload, packet)

    def packetTooLarge(self, size: int) -> None:
        log.warn("discarded a packet of {size} bytes from the server (limit {limit})",
                 size=size, limit=self.max_packet)

    def outboxDrained(self) -> None:
        pass

    def messageReceived(self, key: bytes, payload: bytes, packet: bytes) -> None:
        """A message arrived; the default calls the callbacks of the matching patterns."""
        called = None
        for sub in self._subs:
            cb = sub.callback
            if cb is None or not reaches(sub.match, key):
                continue
            if called is None:
                called = [cb]
            elif cb in called:
                continue
            else:
                called.append(cb)
            try:
                cb(key, payload)
            except Exception:
                log.failure("subscription callback {cb!r} failed on {key!r}", cb=cb, key=key)
        if called is None:
            self.unhandledMessage(key, payload, packet)

    def unhandledMessage(self, key: bytes, payload: bytes, packet: bytes) -> None:
        """A message no callback took (for example a subscription without one)."""

    def controlReceived(self, key: bytes, payload: bytes | None, packet: bytes) -> None:
        """A control message arrived: replies fire `request` Deferreds, in order."""
        if key == codec.DROPPED:
            try:
                notice = codec.parse_drop_notice(payload)
            except ProtocolError as e:
                log.warn("ignoring a malformed drop notice: {err}", err=e)
                return
            self.dropped += notice.count
            self.dropNotice(notice.count, notice.first, notice.last)
            return
        if key == codec.DISCONNECT:
            self.disconnectReason = codec.parse_disconnect(payload)
            return
        if key == codec.INTEREST and self._reqrep is not None:
            self._reqrep.interest.feed(payload)  # and on to unsolicitedControl: others may follow it too
        queue = self._requests.get(key)
        if queue:
            d = queue.popleft()
            if not queue:
                del self._requests[key]
            d.callback(payload)
        else:
            self.unsolicitedControl(key, payload)

    def unsolicitedControl(self, key: bytes, payload: bytes | None) -> None:
        """A control message nobody asked for."""

    def dropNotice(self, count: int, first: bytes, last: bytes) -> None:
        """The server dropped `count` messages meant for us (keys `first` .. `last`); `dropped`
        already counts them. Override to react (log, mark a gap); the default does nothing more,
        so that a lossy subscriber does not log once per notice."""

    # -- request/reply with other clients (docs/request-reply.md; the core: sbus.core.reqrep)

    def _reactor(self):
        reactor = getattr(self.transport, "reactor", None)
        if reactor is None:
            from twisted.internet import reactor
        return reactor

    def request(self, key, payload=b"", timeout: float = 5.0, check: bool = True,
                responder_uid=None) -> defer.Deferred:
        """Deferred[bytes]: publish a request on `key`; fires with the first verified reply's
        payload (from a responder of `responder_uid`: see the blocking client's `request`).

        Fails with `NoResponders` at once when nobody holds a matching pattern (as the server's
        interest feed shows: `check=False` skips this, e.g. for a responder of another uid),
        `RequestTimeout` after `timeout` seconds, `ConnectionClosed` if the connection ends."""
        return defer.ensureDeferred(self._request(key, payload, timeout, check, responder_uid))

    async def _request(self, key, payload, timeout, check, responder_uid):
        if self._reqrep is None:
            if self.credentials is None:
                await self.whoami()
            if self._reqrep is None:
                requester = Requester(self.credentials, self.max_packet)
                self.subscribe(requester.inbox, self._replyReceived)
                self.sendControl(codec.INTEREST)
                self._reqrep = requester
        requester = self._reqrep
        key = codec.encode_msg(key, b"", self.max_packet)[4:-1]
        if check and (not requester.interest.ready or requester.doubtful(key)):
            await self.sync()  # the listing, and every change before now, has arrived
            requester.check(key)
        d = defer.Deferred()
        rid, packet = requester.request(key, payload, d, responder_uid)
        self.sendPacket(packet)
        call = self._reactor().callLater(timeout, self._requestExpired, rid, d, key, timeout)
        try:
            return await d
        finally:
            if call.active():
                call.cancel()
            requester.forget(rid)

    def _requestExpired(self, rid, d, key, timeout):
        error = self._reqrep.timeout_error(rid, key, timeout)
        if not d.called:
            d.errback(error)

    def _replyReceived(self, key, payload):
        got = self._reqrep.receive(key, payload) if self._reqrep is not None else None
        if got is None and self._reqrep is not None and self._reqrep.outgoing:
            for challenge in self._reqrep.take_outgoing():
                self.sendPacket(challenge)
        if got is not None and not got[0].called:
            if type(got[1]) is RemoteError:
                got[0].errback(got[1])
            else:
                got[0].callback(got[1])

    def serve(self, pattern, handler) -> Responder:
        """Answer requests on `pattern`: ``handler(key, body)`` returns the reply (bytes, str,
        a Deferred or a coroutine of one; None: no reply). A handler that fails is logged once
        and answered with an error reply (the caller gets `RemoteError`). Returns the
        `Responder` (counts: `answered`, `refused`, `failed`). Verified requests are answered
        once the whoami answer is known (asked first here when `credentials` is not: it comes
        before any request on the new subscription)."""
        responder = Responder(self.max_packet)

        def received(key, payload):
            ask = responder.accept(payload, key)
            if ask is None:
                return
            offer = responder.offer(ask)
            if offer is not None:
                self.sendPacket(offer)  # the handler runs when the requester's token comes
            else:
                run(ask)

        def run(ask):
            key = ask.key

            def send(out):
                if out is not None and self.connected:
                    self.sendPacket(responder.reply(ask, out))

            def failed(f):
                log.error("{text}", text=error_text(key, f.value))
                out = responder.error(ask, f.value)
                if out is not None and self.connected:
                    self.sendPacket(out)

            d = defer.maybeDeferred(handler, key, ask.body)
            d.addCallback(lambda r: defer.ensureDeferred(r) if hasattr(r, "__await__") else r)
            d.addCallbacks(send, failed)

        def challenged(key, payload):
            out = responder.challenge(payload)
            if type(out) is Ask:
                run(out)
            elif out is not None and self.connected:
                self.sendPacket(out)

        def identified(whoami):
            responder.identify(whoami)
            self.subscribe(responder.challenge_key, challenged)
            return whoami

        if self.credentials is not None:
            identified(self.credentials)
        else:
            self.whoami().addCallback(identified).addErrback(lambda f: None)
        self.subscribe(pattern, received)
        return responder

    # -- shared work queues (docs/queues.md; the core: sbus.core.workqueue)

    def submit(self, group, jobs, timeout: float = 5.0, responder_uid=ANY) -> defer.Deferred:
        """Deferred[int]: confirmed submission (see the blocking client's `submit`)."""
        group = check_group(group)

        def failed(f):
            if f.check(NoResponders):
                raise NoService(f"no sbus-queue service serves group {group.decode()}")
            return f
        d = self.request(SUBMIT_ROOT + group, encode_jobs(jobs), timeout=timeout, responder_uid=responder_uid)
        return d.addCallbacks(lambda answer: submit_result(group, answer), failed)

    def join(self, group, callback, timeout: float = 5.0) -> defer.Deferred:
        """Deferred[TwistedWorker]: join a work-queue group of `twistd sbus-queue`.
        ``callback(delivery)`` gets each `Delivery`; acknowledge with ``worker.ack(delivery)``.
        Fails with `Refused` or `TimeoutError` (no service answered)."""
        return defer.ensureDeferred(self._join(group, callback, timeout))

    async def _join(self, group, callback, timeout):
        if self.credentials is None:
            await self.whoami()
        membership = Membership(self.credentials, group, self.max_packet)
        ready = defer.Deferred()
        worker = TwistedWorker(self, membership)

        def received(key, payload):
            what = membership.receive(key, payload)
            if type(what) is Delivery:
                callback(what)
            elif what == "hello" and not ready.called:
                ready.callback(worker)
            elif what == "refused" and not ready.called:
                err = membership.refusal()
                if err is not None:
                    ready.errback(err)

        self.subscribe(membership.prefix, received)
        call = self._reactor().callLater(
            timeout, lambda: ready.called or ready.errback(membership.timeout_error(timeout)))
        try:
            return await ready
        except BaseException:
            if self.connected:
                self.unsubscribe(membership.prefix, received)
            raise
        finally:
            if call.active():
                call.cancel()

    # -- secret patterns

    def _setCredentials(self, whoami: bytes) -> None:
        self.credentials = whoami
        cred = parse_whoami(whoami)
        if cred != self._cred:
            self._cred = cred
            for sub in self._subs:
                sub.match = self.stored_pattern(sub.pattern)

    def stored_pattern(self, pattern: bytes) -> bytes:
        """The pattern the server stores: empty fields of a secret pattern filled in."""
        if self._cred is None or SECRET_ROOT not in pattern:
            return pattern
        prefix, cred = self._cred
        try:
            return check_pattern(pattern, cred, prefix)
        except CredentialError:
            return pattern


class TwistedWorker(WorkerBase):
    """A member of a work-queue group (`SbusProtocol.join`); `client` is the protocol."""

    def ack(self, *deliveries) -> None:
        """Acknowledge deliveries (handled: the service forgets them)."""
        if deliveries:
            self.client.sendPacket(self.membership.ack_packet(*deliveries))

    def nack(self, delivery, delay: float = 0.0, error="") -> None:
        """Redeliver after `delay` seconds (see the blocking `Worker.nack`)."""
        self.client.sendPacket(self.membership.nack_packet(delivery, delay, error))

    def reject(self, delivery, error="") -> None:
        """Straight to the dead letters."""
        self.client.sendPacket(self.membership.reject_packet(delivery, error))

    def progress(self, *deliveries) -> None:
        """Still working on these: their ack deadlines start again."""
        if deliveries:
            self.client.sendPacket(self.membership.progress_packet(*deliveries))

    def leave(self) -> None:
        """Leave the group: what is not acknowledged goes to another member, redelivered."""
        self.client.unsubscribe(self.membership.prefix)


def connect_socket(reactor, address, max_packet: int = MAX_PACKET, timeout: float = 10.0):
    """Deferred[socket]: a nonblocking connect, retried while the server's backlog is full (for
    `ReconnectingClient(connector=...)`, which may open the socket its own way and then call this)."""
    d = defer.Deferred()
    deadline = reactor.seconds() + timeout

    def attempt():
        try:
            sock = open_socket(address, max_packet=max_packet, blocking=False)
        except BlockingIOError as e:
            if reactor.seconds() < deadline:
                reactor.callLater(0.01, attempt)
            else:
                d.errback(TimeoutError(errno.ETIMEDOUT, f"connect timed out ({e.strerror})", e.filename))
            return
        except Exception:
            d.errback()
            return
        d.callback(sock)

    attempt()
    return d


async def _connect(reactor, address, protocolFactory, max_packet, timeout, connector=None):
    sock = await (connector or connect_socket)(reactor, address, max_packet, timeout)
    proto = protocolFactory()
    proto.max_packet = max_packet
    transport = SeqPacketTransport(sock, proto, reactor, max_packet=max_packet)
    proto.connected = True
    proto.makeConnection(transport)
    transport.startReading()
    await proto.whoami()
    return proto


def connect(reactor, address=None, protocolFactory=SbusProtocol, *, max_packet: int = MAX_PACKET,
            timeout: float = 10.0, connector=None) -> defer.Deferred:
    """Connect to the bus at `address`; Deferred[protocol], fired after a whoami round trip.

    `protocolFactory` is called with no arguments (a `SbusProtocol` subclass
    or any callable returning one). Errors: the `OSError` of the connect
    (`FileNotFoundError`, `ConnectionRefusedError`, `PermissionError`, ...)
    or `ConnectionClosed`.
    """
    return defer.ensureDeferred(_connect(reactor, address, protocolFactory, max_packet, timeout,
                                         connector))


class ReconnectingClient:
    """Keep a connection to a bus up, and its subscriptions and settings with it.

    Everything given to `subscribe`, `echo` and `flood` is remembered and
    sent again on every new connection. While disconnected, `publish`
    drops the message and returns False (a bus keeps no messages for
    absent clients either). Override `connectionMade(protocol)` /
    `connectionLost(reason)`, or pass `protocolFactory`, to build on it.
    """

    #: True for a client holding no session whose misses matter (a service): every reconnection
    #: is a gap nobody counted, logged and counted (`gapEnded`). A client that claims a session
    #: of its own (the relay's `SessionClaim`) leaves it False and calls `gapEnded` itself.
    missesUncounted = False

    def __init__(self, reactor, address=None, protocolFactory=SbusProtocol, *,
                 initialDelay: float = 0.1, maxDelay: float = 10.0, factor: float = 2.0,
                 jitter: float = 0.1, max_packet: int = MAX_PACKET, connector=None, watch: bool = False):
        self.reactor = reactor
        self.address = address
        #: While away from a bus at a socket path, watch for its socket file to reappear and
        #: connect at once (`sbus.client.socketwatch`; services pass True). Off by default: an
        #: inotify instance per client (the kernel allows 128 per user by default) while away.
        self.watch = watch
        self._watch = None
        #: Failed attempts are retried after WAKE_INTERVAL until then (the socket reappeared).
        self.fast_until = 0.0
        #: When the last connection was lost (reactor seconds, wall clock), until the next one
        #: has learnt what it missed (`_answered`); gaps nobody counted, and their seconds.
        self._lostAt: tuple[float, float] | None = None
        self.unknownGaps = 0
        self.unknownGapSeconds = 0.0
        #: Attempts started at once because the socket reappeared (`wake` by the watch).
        self.wakeups = 0
        #: Why a lost bus is not watched for, as last found (None: it is, or will be tried).
        self.watchMissing: str | None = None if watch else "not asked to watch"
        self._watchLogged: str | None = None
        #: ``connector(reactor, address, max_packet, timeout) -> Deferred[socket]`` opens the
        #: socket (default: a plain connect); the bridge passes one that connects as a side's owner.
        self.connector = connector
        self.protocolFactory = protocolFactory
        self.initialDelay = initialDelay
        self.maxDelay = maxDelay
        self.factor = factor
        self.jitter = jitter
        self.max_packet = max_packet
        self.protocol: SbusProtocol | None = None
        self.attempts = 0
        self.lastError: Failure | None = None
        self._subs: list[tuple[bytes, object]] = []
        self._echo: bool | None = None
        self._flood: dict[str, object] = {}
        #: `holdSession`: (name, linger, confirm), claimed again on every connection.
        self._session: tuple[bytes, float, bool] | None = None
        self._holding: SbusProtocol | None = None  # the connection the server said holds it
        self._delay = initialDelay
        self._call = None
        self._connecting = False
        self._inflight = None
        self._running = False
        self._waiters: list[defer.Deferred] = []
        #: The last failed attempt in one line (`describeFailure`), None once connected.
        self.lastFailure: str | None = None
        self.failureIsNews = False

    # -- life cycle

    def holdSession(self, name: bytes, linger: float, confirm: bool = False) -> None:
        """Hold the named session on every connection (docs/protocol.md "Sessions"): while this
        client is away (reconnecting, or dead and restarted) the bus counts what its patterns
        match for `linger` seconds, and the next connection is told (`sessionClaimed`).
        `confirm`: the bus keeps that count until `confirmSession` (once it is recorded)."""
        codec.check_session_name(name)
        self._session = (name, float(linger), bool(confirm))

    def confirmSession(self) -> None:
        """The count `sessionClaimed` was told is recorded: the bus may forget it."""
        proto = self.protocol
        if self._session is not None and proto is not None and proto.connected:
            proto.confirmSession(self._session[0])

    def acknowledgeSession(self, count: int | None = None) -> None:
        """The current connection's first `count` packets read (default: all) are handed on
        (`SbusProtocol.acknowledgeSession`); nothing before the session is claimed."""
        proto = self.protocol
        if self._session is not None and proto is not None and proto is self._holding:
            proto.acknowledgeSession(self._session[0], count)

    def start(self) -> "ReconnectingClient":
        if not self._running:
            self._running = True
            self._attempt()
        return self

    def stop(self) -> defer.Deferred:
        """Stop reconnecting and close; fires when the connection (if any) is gone."""
        self._running = False
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
        self._disarm()
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            d.errback(ConnectionClosed("client stopped"))
        if self._inflight is not None:
            done = defer.Deferred()
            self._inflight.addBoth(lambda _: done.callback(None))
            return done
        if self.protocol is not None:
            return self.protocol.close().addCallback(lambda _: None)
        return defer.succeed(None)

    @property
    def connected(self) -> bool:
        return self.protocol is not None and self.protocol.connected

    def whenConnected(self) -> defer.Deferred:
        """Deferred[SbusProtocol]: the current connection, or the next one."""
        if self.connected:
            return defer.succeed(self.protocol)
        d = defer.Deferred()
        self._waiters.append(d)
        return d

    def backOffAtLeast(self, delay: float) -> None:
        """Wait at least `delay` seconds before the next attempt after a failure (the back-off
        then grows from there); `connectionFailed` may also lower it with `retryFailuresAfter`."""
        self._delay = max(self._delay, delay)

    def retryFailuresAfter(self, delay: float) -> None:
        """The next failed attempt is retried after `delay` seconds (called from
        `connectionFailed`: a server known to be coming back is tried at short intervals)."""
        self._delay = delay

    def retryNow(self, soon: float = 0.0, before=None) -> bool:
        """The address is worth trying at once (its socket reappeared): start an attempt now,
        unless connected, one is under way, or the next is due within `soon` seconds anyway
        (so that a storm of such news makes no storm of connects). `before()` is called just
        before the attempt (whose failure may be reported before this returns). True if one
        was started."""
        if not self._running or self.connected or self._connecting:
            return False
        call = self._call
        if call is not None and call.active():
            if call.getTime() - self.reactor.seconds() <= soon:
                return False
            call.cancel()
        self._call = None
        if before is not None:
            before()
        self._attempt()
        return True

    @property
    def connecting(self) -> bool:
        """An attempt to connect is under way."""
        return self._connecting

    @property
    def running(self) -> bool:
        """Started and not stopped."""
        return self._running

    def _attempt(self):
        self._call = None
        if not self._running or self._connecting:
            return
        self._connecting = True
        self.attempts += 1
        d = self._inflight = connect(self.reactor, self.address, self.protocolFactory,
                                     max_packet=self.max_packet, connector=self.connector)
        d.addCallbacks(self._connected, self._failed)

    def _connected(self, proto: SbusProtocol):
        self._connecting = False
        self._inflight = None
        if not self._running:
            return proto.close().addCallback(lambda _: None)
        self.protocol = proto
        self._delay = self.initialDelay
        self.lastFailure = None
        self.fast_until = 0.0
        self._disarm()
        try:
            for pattern, callback in self._subs:
                proto.subscribe(pattern, callback)
            if self._echo is not None:
                proto.echo(self._echo)
            if self._flood:
                proto.flood(**self._flood)
            if self._session is not None:  # after the subscriptions, as the server asks
                proto.session(*self._session).addCallbacks(self._answered, lambda _: None)
            elif self.missesUncounted:
                self.gapEnded(False)
        except ConnectionClosed:
            pass
        proto.whenLost().addCallback(self._lost, proto)
        self.connectionMade(proto)
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            d.callback(proto)

    def _failed(self, reason: Failure):
        self._connecting = False
        self._inflight = None
        self.lastError = reason
        text = self.describeFailure(reason)
        #: True when this failure is worth a log line: the first since the last connection, or
        #: another error than the previous attempt's. The same error again: retry quietly.
        self.failureIsNews = text != self.lastFailure
        self.lastFailure = text
        if self.reactor.seconds() < self.fast_until:
            self.retryFailuresAfter(WAKE_INTERVAL)  # the socket is back: its listen() is near
        self.connectionFailed(reason)
        self._schedule()
        self._arm()

    def describeFailure(self, reason: Failure) -> str:
        """One line: the bus's full address and what went wrong, e.g.
        ``/run/missing/sbus.socket: No such file or directory`` (an `OSError`'s own file name
        may be a part of the path only, or relative)."""
        exc = reason.value if isinstance(reason, Failure) else reason
        try:
            addr = resolve(self.address)
            names = {addr.text}
            where = os.path.abspath(addr.value) if addr.kind == "path" else addr.text
        except (AddressError, TypeError):
            names, where = set(), str(self.address)
        if isinstance(exc, OSError) and exc.errno:
            why = exc.strerror or os.strerror(exc.errno)
        else:
            why = reason.getErrorMessage() if isinstance(reason, Failure) else str(exc)
        for name in names | {where}:  # a message that names the address already
            if why.startswith(name + ": "):
                why = why[len(name) + 2:]
        return f"{where}: {why}"

    def connectionFailed(self, reason: Failure):
        """Hook: an attempt to connect failed (another follows after the back-off).
        `lastFailure` says it in one line (`describeFailure`); `failureIsNews` is False when
        the attempt before failed the same way: log only news, so that a missing bus is
        named once and then retried quietly. By default: that one warning."""
        if self.failureIsNews:
            log.warn("cannot connect to the bus at {what}; retrying quietly with back-off (at most "
                     "{delay:g}s apart)", what=self.lastFailure, delay=self.maxDelay)

    def _lost(self, reason, proto):
        if self.protocol is proto:
            self.protocol = None
        if self._running and self._lostAt is None:
            self._lostAt = (self.reactor.seconds(), time.time())
        self.connectionLost(reason)
        self._schedule()
        self._arm()

    # -- the socket's return (sbus.client.socketwatch), and what was missed meanwhile

    def wake(self, before=None) -> bool:
        """The bus's socket reappeared: try at once (no attempt storm: at most one per
        WAKE_INTERVAL), and retry a refusal after WAKE_INTERVAL for WAKE_WINDOW seconds.
        True if an attempt was started; `before()` is called just before it."""
        if not self._running or self.connected:
            return False
        self.fast_until = self.reactor.seconds() + WAKE_WINDOW
        if self._connecting:
            return False  # under way: a refusal is retried soon (`_failed`)
        return self.retryNow(soon=2 * WAKE_INTERVAL, before=before)

    def _arm(self) -> None:
        """Away from a bus at a socket path: watch for the socket file (`watch`)."""
        if not self.watch or not self._running or self.connected:
            return
        if self._watch is None:
            try:
                addr = resolve(self.address)
            except (AddressError, TypeError):
                return
            if addr.kind != "path":
                if self.watchMissing is None:
                    self.watchMissing = f"{addr.text} is not a socket file"
                    log.info("not watching for the bus to come back: {why}; a restarted bus is found by "
                             "the back-off alone (at most {d:g}s apart)", why=self.watchMissing, d=self.maxDelay)
                return
            self._watch = SocketWatch(self.reactor, addr.value, self._appeared, self._arm)
        watch = self._watch
        before = watch.notifier
        self.watchMissing = watch.arm()
        if watch.level == "directory" and watch.notifier is not before:
            watch.check()  # a new watch: the socket may have come back before it was set
        if watch.state != self._watchLogged:  # one line per change of what is watched
            self._watchLogged = watch.state
            if watch.level is None:
                log.warn("not watching the bus's socket file: {why}; a restarted bus is found by the "
                         "back-off alone (at most {d:g}s apart)", why=watch.state, d=self.maxDelay)
            else:
                log.info("{state}: a bus restarted at {where} is connected at once, not after the "
                         "back-off", state=watch.state, where=watch.path)

    def _disarm(self) -> None:
        if self._watch is not None:
            self._watch.disarm()

    def _appeared(self) -> None:
        if self.wake():
            self.wakeups += 1
            log.info("a socket appeared at {where}: connecting now, not after the back-off",
                     where=self._watch.path if self._watch is not None else self.address)

    def _answered(self, reply: "codec.SessionReply") -> None:
        """The claim's answer after a reconnection: a bus that did not know our session (a new
        server, or one whose linger ran out) counted nothing for us while we were away, so
        what was published meanwhile is missed in a number nobody knows: one line naming the
        interval, and counted (`unknownGaps`); then `sessionClaimed`."""
        self.gapEnded(reply.state != "new", reply.name)
        self._holding = self.protocol if reply.state in ("new", "resumed") else None
        self.sessionClaimed(reply)

    def gapEnded(self, counted: bool, session: bytes | None = None) -> None:
        """Back on the bus after losing it: did anything count what was published for us
        meanwhile (`counted`: a session claim's answer)? If not, one line naming the interval
        and it is counted (`unknownGaps`, `unknownGapSeconds`: `svcstats.unknown_gaps`)."""
        lost, self._lostAt = self._lostAt, None
        if lost is None or counted:
            return
        gap = max(0.0, self.reactor.seconds() - lost[0])
        self.unknownGaps += 1
        self.unknownGapSeconds += gap
        why = (f"back on the bus at {self.address}, holding no session there" if session is None else
               f"session {session.decode('utf-8', 'replace')}: the bus did not know it (restarted, or "
               "it lingered out)")
        log.warn("{why}: what was published for us between {t1} and {t2} ({gap:.3f} s) is missed, in a "
                 "number nobody counted", why=why, t1=_clock(lost[1]), t2=_clock(time.time()), gap=gap)

    def _schedule(self):
        if not self._running or self._call is not None:
            return
        delay = self._delay * random.uniform(1 - self.jitter, 1 + self.jitter)
        self._delay = min(self._delay * self.factor, self.maxDelay)
        self._call = self.reactor.callLater(delay, self._attempt)

    # -- hooks

    def sessionClaimed(self, reply: "codec.SessionReply") -> None:
        """Hook: the bus answered `holdSession`'s claim. By default one log line when the session
        was resumed (what was missed while away) or is held by another live process."""
        name = reply.name.decode("utf-8", "replace")
        if reply.state == "resumed":
            log.warn("session {name}: away {gap:.3f} s, the bus counted {n} messages published for "
                     "us meanwhile (lost){carried}", name=name, gap=reply.gap, n=reply.missed,
                     carried=f"; {reply.carried} of them were told before to a connection that closed "
                     "before confirming" if reply.carried else "")
        elif reply.state in ("busy", "refused"):
            log.warn("session {name}: {state} (another live connection of this user holds it, or "
                     "the bus refused the name); nothing is counted for us while away",
                     name=name, state=reply.state)

    def connectionMade(self, protocol: SbusProtocol) -> None:
        """Called after each (re)connection, once subscriptions and settings are re-sent."""

    def connectionLost(self, reason) -> None:
        """Called when a connection ends (a reconnect is scheduled unless stopped)."""

    # -- the protocol's API, remembered across reconnects

    def subscribe(self, pattern, callback=None) -> None:
        pattern = codec.encode_sub(pattern)[4:]
        self._subs.append((pattern, callback))
        if self.connected:
            self.protocol.subscribe(pattern, callback)

    def unsubscribe(self, pattern, callback=None) -> None:
        pattern = codec.encode_unsub(pattern)[6:]
        for i in range(len(self._subs) - 1, -1, -1):
            p, cb = self._subs[i]
            if p == pattern and (callback is None or cb == callback):
                del self._subs[i]
                break
        else:
            return
        if self.connected:
            self.protocol.unsubscribe(pattern, callback)

    def echo(self, on: bool = True) -> None:
        self._echo = bool(on)
        if self.connected:
            self.protocol.echo(on)

    def flood(self, soft=None, hard=None, order=None) -> None:
        flood_packets(soft, hard, order)  # validate now
        for name, mode in (("soft", soft), ("hard", hard), ("order", order)):
            if mode is not None:
                self._flood[name] = mode
        if self.connected:
            self.protocol.flood(soft, hard, order)

    def publish(self, key, payload=b"") -> bool:
        """Publish if connected (True); drop and return False otherwise."""
        if not self.connected:
            codec.encode_msg(key, payload, self.max_packet)  # still report bad input
            return False
        self.protocol.publish(key, payload)
        return True

    def sendControl(self, key, payload=None) -> bool:
        if not self.connected:
            return False
        self.protocol.sendControl(key, payload)
        return True

    def whoami(self) -> defer.Deferred:
        """Deferred[bytes], on the current connection or the next one."""
        return self.whenConnected().addCallback(lambda p: p.whoami())

    def sync(self) -> defer.Deferred:
        return self.whenConnected().addCallback(lambda p: p.sync())

    def stats(self) -> defer.Deferred:
        return self.whenConnected().addCallback(lambda p: p.stats())

    def request(self, key, payload=b"", timeout: float = 5.0, check: bool = True,
                responder_uid=None) -> defer.Deferred:
        """`SbusProtocol.request` on the current connection or the next one."""
        return self.whenConnected().addCallback(lambda p: p.request(key, payload, timeout, check, responder_uid))


def _clock(t: float) -> str:
    """A wall-clock time for a log line: UTC, to the millisecond."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
