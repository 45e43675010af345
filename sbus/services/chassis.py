"""The service chassis (docs/deploy.md "Service chassis"): the machinery of a service on the
bus, written once, in the manner of Twisted's ``ClientService`` with a back-off retry policy.

A service subclasses `Chassis` and supplies hooks only: ``kind``, ``log``, ``statsName()``,
``stats()``, ``publicStats`` (what other uids see, if anything); ``setUp()``, which makes its
bus connections with `connect` and says there what it does with a message, a drop notice, the
bus's disconnect notice or another control message, and when the connection comes (``made``,
``ready``) or goes (``lost``), a read batch is done (``batch``) or its session claim is answered
(``claimed``); ``reportLine`` (or ``report``; ``reportedStats`` for what it compares);
``lostLine``/``failedLine`` for its own connection lines; ``beforeStop()`` (still connected)
and ``afterStop()``.

The chassis owns one `ReconnectingClient` per connection (back-off, the socket watch, echo
off, the session claim or the count of uncounted gaps, paused reading kept across
reconnections, the lost-connection line), the stats answers (`svcstats`), the report every
``stats_interval`` (when changed), periodic calls (`every`), SIGTERM as a clean stop with
status 0 (`shutdown`), and the order of a stop: periodic calls, ``beforeStop()``, the
connections, ``afterStop()``, the final report.
"""

from __future__ import annotations

import json

from twisted.application import service
from twisted.internet import defer
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python import usage

from sbus.client.twisted import ReconnectingClient, SbusProtocol
from sbus.services.shutdown import exit_zero_on_sigterm
from sbus.services.svcstats import STATS_REQUEST, StatsResponder, unknown_gaps


class Chassis(service.Service):
    """Base of a service on the bus: see the module docstring for what a subclass supplies."""

    kind = "sbus-service"
    log = Logger(namespace="sbus.chassis")

    def __init__(self, bus, *, stats_interval: float = 60.0, reactor=None):
        self.bus = bus
        self.stats_interval = stats_interval
        self._reactor = reactor
        self.responder = StatsResponder(self.kind, self.statsName, self.stats, self.publicStats)
        self.buses: list[ReconnectingClient] = []
        self._loops: list[LoopingCall] = []
        self._lastStats = None

    @property
    def reactor(self):
        if self._reactor is None:
            from twisted.internet import reactor
            self._reactor = reactor
        return self._reactor

    # -- hooks

    def statsName(self) -> str:
        return self.kind

    def stats(self) -> dict:
        return {}

    #: A method: what uids other than ours and root's see besides kind and name (default: nothing).
    publicStats = None

    def setUp(self) -> None:
        """Make the connections (`connect`) and start what the service runs."""

    def beforeStop(self):
        """First step of a stop, connections still up (may return a Deferred)."""

    def afterStop(self):
        """Once every connection is closed, before the final report (may return a Deferred)."""

    def lostLine(self, client, prefix: str, reason) -> None:
        """A connection (not `quiet`) was lost while running; it reconnects."""
        self.log.warn("{prefix}lost the bus connection ({why}); reconnecting", prefix=prefix, why=reason)

    def failedLine(self, client, prefix: str, reason) -> None:
        """An attempt to connect (not `quiet`) failed: by default `ReconnectingClient`'s line,
        once per distinct failure (``client.failureIsNews``)."""
        ReconnectingClient.connectionFailed(client, reason)

    def reportedStats(self) -> dict:
        """What the report compares with the last one and logs (default: `stats()`)."""
        return self.stats()

    def reportLine(self, stats: dict, final: bool) -> None:
        self.log.info("{kind} {what}: {stats}", kind=self.kind, what="stopped" if final else "stats",
                      stats=json.dumps(stats, separators=(",", ":")))

    def report(self, final: bool = False) -> None:
        """Every `stats_interval` (if the stats changed) and once at the end of a stop."""
        st = self.reportedStats()
        if not final and st == self._lastStats:
            return
        self._lastStats = st
        self.reportLine(st, final)

    def answerStats(self, proto, payload: bytes) -> None:
        """A ``sbus/services/stats`` request on a connection made with ``stats=True``."""
        self.responder.reply(proto, payload)

    # -- machinery

    def connect(self, label: str = "", *, subscribe=(), echo: bool = False, flood=None, session=None,
                misses: bool = False, stats: bool = False, quiet: bool = False, start: bool = True,
                message=None, dropped=None, notice=None, control=None, made=None, ready=None,
                lost=None, claimed=None, batch=None, **retry) -> ReconnectingClient:
        """A connection to the bus, kept up with back-off (`retry`: `ReconnectingClient`'s
        initialDelay, maxDelay, factor, jitter, max_packet). `session`: (name, linger, confirm)
        claimed on every connection (with confirm, a resumed claim is confirmed once `claimed`
        has counted it); else `misses`: what is missed while away matters (each reconnection's
        gap is logged and counted). `stats`: answer stats requests here. `quiet`: no failure
        and no lost lines (another connection says them). `label` prefixes its log lines.
        `batch(proto)`: after each batch of packets read (what was read is handed on)."""
        svc, prefix = self, f"{label}: " if label else ""

        class Protocol(SbusProtocol):
            def messageReceived(self, key, payload, packet):
                if key == STATS_REQUEST and stats:
                    svc.answerStats(self, payload)
                elif message is not None:
                    message(key, payload, self)
                else:
                    SbusProtocol.messageReceived(self, key, payload, packet)

            def dropNotice(self, count, first, last):
                if dropped is not None:
                    dropped(count, first, last)

            def unsolicitedControl(self, key, payload):
                if control is not None:
                    control(key, payload)

            def connectionLost(self, reason=None):
                if notice is not None and self.disconnectReason is not None:
                    notice(self.disconnectReason)
                SbusProtocol.connectionLost(self, reason)

            if batch is not None:  # the transport calls it only if it is there
                def readBatchDone(self):
                    batch(self)

        class Client(ReconnectingClient):
            connects = 0
            paused = False
            counted = bool(session or misses)  # its gaps are the service's `unknown_gaps`

            def pauseReading(self, paused: bool = True) -> None:
                """Stop (False: resume) reading the bus, on this connection and the next ones."""
                self.paused = paused
                if self.connected and paused:
                    self.protocol.transport.pauseProducing()
                elif self.connected:
                    self.protocol.transport.resumeProducing()

            def connectionMade(self, proto):
                self.connects += 1
                if self.paused:
                    proto.transport.pauseProducing()
                if made is not None:
                    made(proto)
                if ready is not None:  # after the round trip the bus has our settings in place
                    proto.sync().addCallbacks(lambda _: ready(proto), lambda f: None)

            def connectionFailed(self, reason):
                if not quiet:
                    svc.failedLine(self, prefix, reason)

            def connectionLost(self, reason):
                if svc.running and not quiet:
                    svc.lostLine(self, prefix, reason)
                if lost is not None:
                    lost(reason)

            def sessionClaimed(self, reply):
                ReconnectingClient.sessionClaimed(self, reply)
                if claimed is not None:
                    claimed(reply)
                if session[2] and reply.state == "resumed":
                    self.confirmSession()  # counted: the bus may forget it

        client = Client(self.reactor, self.bus, Protocol, watch=True, **retry)
        for pattern in subscribe:
            client.subscribe(pattern)
        if stats:
            client.subscribe(STATS_REQUEST)
        client.echo(echo)
        if flood:
            client.flood(**flood)
        if session:
            client.holdSession(*session)
        client.missesUncounted = misses and not session
        self.buses.append(client)
        if start:
            client.start()
        return client

    def every(self, interval: float, f, *args, start: bool = True) -> LoopingCall:
        """Call `f(*args)` every `interval` seconds (first after one interval) until the stop."""
        loop = LoopingCall(f, *args)
        loop.clock = self.reactor
        self._loops.append(loop)
        if start:
            loop.start(interval, now=False)
        return loop

    def unknownGaps(self) -> dict:
        """``unknown_gaps`` of the connections whose misses matter (`svcstats.unknown_gaps`)."""
        return unknown_gaps(*(c for c in self.buses if c.counted))

    def reconnects(self) -> int:
        return sum(max(0, c.connects - 1) for c in self.buses)

    @staticmethod
    def checkBus(address) -> None:
        """The ``--bus`` option: a bad address is a usage error now (one line), not a log line later."""
        from sbus.client.address import AddressError, parse
        try:
            if address:
                parse(address)
        except AddressError as e:
            raise usage.UsageError(f"--bus: {e}") from None

    @staticmethod
    def who(proto) -> str:
        """A connection's credentials for a log line."""
        return (proto.credentials or b"?").decode("utf-8", "replace")

    def startService(self):
        super().startService()
        exit_zero_on_sigterm(self.reactor)
        self.setUp()
        self.every(self.stats_interval, self.report)

    def stopService(self):
        super().stopService()
        for loop in self._loops:
            if loop.running:
                loop.stop()
        d = defer.succeed(None)
        for step in (self.beforeStop,
                     lambda: defer.DeferredList([c.stop() for c in self.buses], consumeErrors=True),
                     self.afterStop, lambda: self.report(final=True)):
            d.addCallback(lambda _, step=step: step())
            d.addErrback(lambda f: self.log.failure("{kind}: a step of the stop failed", f, kind=self.kind))
        return d
