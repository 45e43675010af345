"""``twistd sbus-relay``: a slave bus server below a master (docs/relay-link.md).

    twistd -n sbus-relay --upstream /run/sbus.socket --socket /run/user/1000/sbus.socket

It serves its own clients exactly like ``twistd sbus`` (same options) and is
itself one client of the master:

* **Prefix first.** The credential prefix is the relay's own whoami on the
  master followed by ``/``. The relay connects to the master *before* it
  opens its socket: until the master has answered, the socket does not exist
  (clients get ``ENOENT``/``ECONNREFUSED``, never a wrong whoami). Every
  failed attempt is logged (``waiting for the master ...``) and retried with
  back-off. ``--cred-prefix`` is refused: the master decides.
* **Subscriptions.** One upward ``SUB`` per distinct pattern held by local
  clients (the broker tells us when a pattern gets its first holder and
  loses its last: `IUpstream.patternHeld` / `patternReleased`); on every
  (re)connection the relay subscribes to the router's held set as it is at
  that moment, so nothing is missed or left over.
* **Echo off upward**, so what the relay publishes never comes back to it.
* **Publishes.** Every local publish is routed locally by the broker and then
  written upward once; what the master sends down is delivered to local
  subscribers once (each client gets each message on one path only: locally
  if it is on the publisher's bus, from above otherwise). A key in the
  relay's own secret space (``<prefix>!/cred/...``) is not sent upward: only
  local clients can own it.
* **Master away.** The relay keeps serving locally; local publishes are not
  sent upward (counted as ``drops.master_down`` in statistics); it
  reconnects with exponential back-off (``--initial-delay`` to
  ``--max-delay``) and re-subscribes everything held.
* **Prefix changes.** If the whoami on the master changes after a reconnect
  (the master is itself a relay that was restarted), local clients keep the
  prefix they were given: the relay translates secret patterns upward and
  secret keys downward between the two, and logs it once. Peers elsewhere
  that learned the old identities must ask again.
* **Flow control.** Downward: a local subscriber in ``block`` mode that fills
  up pauses reading from the master (then the master's flood settings for
  the relay apply). Upward: when more than ``--queue-bytes`` wait to go to
  the master, the local publishers feeding it are paused until it drains.

Statistics: ``CMSG server/stats`` on the relay shows an ``"upstream"``
object (see `Relay.stats`).
"""

from __future__ import annotations

import os
from collections import Counter

from twisted.application import service
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python import usage
from zope.interface import implementer

from sbus.client import address as client_address
from sbus.client.twisted import ReconnectingClient, SbusProtocol, parse_whoami
from sbus.core.credentials import SECRET_ROOT, secret_prefix, whoami
from sbus.core.pausing import Holds, Pauses
from sbus.core.topology import CHANGE_KEY
from sbus.interfaces import IUpstream
from sbus.options import MISSING_BUS_HELP
from sbus.server import tap
from sbus.server.address import parse_address
from sbus.server.config import ServerConfig

log = Logger(namespace="sbus.relay")


def _cost(pattern: bytes) -> int:
    """What the master charges for a pattern (as `BrokerProtocol.subscribe` computes it)."""
    from sbus.server.config import SEGMENT_COST
    return len(pattern) + SEGMENT_COST * (pattern.count(b"/") + pattern.count(b"*") + 1)

_ECHO_OFF = b"CMSG echo/off"
#: Sent by a relay to each local client whose name changed (its own name on the master changed).
RELAY_WHOAMI = b"relay/whoami"
_WHOAMI_NOTICE = b"CMSG " + RELAY_WHOAMI + b"\0"
#: Lossless: when the relay stops reading the master (a local `block` subscriber is full), the
#: master holds the publishers instead of discarding what waits for the relay.
_HARD_BLOCK = b"CMSG blocking/hard/block"


def _show(b: bytes) -> str:
    return b.decode("utf-8", "replace")


class Options(tap.BusOptions):
    synopsis = "--upstream ADDRESS [--socket PATH] [twistd sbus options]"
    longdesc = (
        "Run an sbus slave server (relay): it serves local clients like `twistd sbus` and is a "
        "client of the master at --upstream, from which it takes its credential prefix. "
        "The socket is opened once the master has answered whoami."
    )
    optParameters = [
        ["upstream", None, None, "The master bus: PATH, /dev/unix/abstract/HEX or /dev/fd/N (required). "
                                 + MISSING_BUS_HELP],
        ["initial-delay", None, "0.1", "First reconnection delay to the master, seconds."],
        ["max-delay", None, "10", "Longest reconnection delay to the master, seconds."],
    ]

    def postOptions(self) -> None:
        super().postOptions()
        if not self["upstream"]:
            raise usage.UsageError("--upstream: the master's address is required")
        try:
            client_address.parse(self["upstream"])
        except client_address.AddressError as e:
            raise usage.UsageError(f"--upstream: {e}") from None
        for name in ("initial-delay", "max-delay"):
            try:
                value = float(self[name])
            except ValueError:
                raise usage.UsageError(f"--{name}: not a number: {self[name]!r}") from None
            if value <= 0:
                raise usage.UsageError(f"--{name}: must be positive, got {value}")
            self[name] = value
        if self["max-delay"] < self["initial-delay"]:
            raise usage.UsageError("--max-delay: must not be below --initial-delay")


class UpstreamProtocol(SbusProtocol):
    """The relay's connection to its master."""

    relay: "Relay | None" = None
    #: Who holds this connection's reading paused (the broker's feeder protocol).
    pauses: Pauses | None = None

    def connectionMade(self):
        self.pauses = Pauses(self.transport)
        SbusProtocol.connectionMade(self)

    def packetReceived(self, packet: bytes) -> None:
        if packet[:4] == b"MSG ":
            end = packet.find(b"\0", 4)
            if end >= 0:
                self.relay.fromMaster(self, packet[4:end], packet)
                return
        SbusProtocol.packetReceived(self, packet)

    def outboxDrained(self) -> None:
        self.relay.upstreamDrained(self)

    def readBatchDone(self) -> None:
        """What the master sent in one wakeup is queued for local clients: send it."""
        factory = self.relay.factory
        if factory is not None:
            factory.flushDirty(self)

    def unsolicitedControl(self, key: bytes, payload: bytes | None) -> None:
        if key == RELAY_WHOAMI and payload:
            self.relay.whoamiChanged(self, payload)
        elif key == b"server/disconnect" and payload:
            self.relay.disconnect_reason = payload.replace(b"\0", b": ", 1).decode("utf-8", "replace")[:300]


class _MasterClient(ReconnectingClient):
    def __init__(self, relay: "Relay", *args, **kw):
        super().__init__(*args, **kw)
        self.relay = relay

    def connectionMade(self, protocol):
        self.relay.masterUp(protocol)

    def connectionLost(self, reason):
        self.relay.masterDown(reason)

    def connectionFailed(self, reason):
        self.relay.masterUnreachable(reason, self.lastFailure if self.failureIsNews else None)


@implementer(IUpstream)
class Relay(service.Service):
    """A bus (`BusService`) opened once the master has given us our prefix, plus the link to the master."""

    def __init__(self, upstream: str, address: str, config: ServerConfig, mode: int = 0o700,
                 reuse: bool = False, initialDelay: float = 0.1, maxDelay: float = 10.0, reactor=None):
        self.upstream = upstream
        self.address = address
        self.config = config
        self.mode = mode
        self.reuse = reuse
        self.initialDelay = initialDelay
        self.maxDelay = maxDelay
        self.reactor = reactor
        self.bus = None
        self.factory = None
        self.client: _MasterClient | None = None
        self.up: UpstreamProtocol | None = None
        #: Prefix given to local clients (fixed once serving) and our current one on the master.
        self.local_prefix: bytes | None = None
        self.up_prefix: bytes | None = None
        self._local_secret = None
        self.rekeys = 0
        #: The master's limits for one client (from its server/stats), and what we hold upward.
        self.master_limits: dict | None = None
        self.held_up = 0
        self.held_up_bytes = 0
        self.quota_refusals = 0
        self.disconnect_reason: str | None = None
        self._last_reason_logged: str | None = None
        self._up_since = 0.0
        self.up_limit = config.queue_bytes
        #: Local publishers paused while too much waits to go up to the master.
        self.blocked = Holds()
        # counters
        self.forwarded_up = 0
        self.forwarded_down = 0
        self.connects = 0
        self.disconnects = 0
        self.failed_attempts = 0
        self.drops = Counter()
        self.subscribed_up = 0

    # -- service life

    def startService(self):
        service.Service.startService(self)
        if self.reactor is None:
            from twisted.internet import reactor
            self.reactor = reactor
        from sbus.services.shutdown import exit_zero_on_sigterm
        exit_zero_on_sigterm(self.reactor)
        log.info("sbus-relay: connecting to the master at {up}; {where} opens once it has answered "
                 "whoami (the credential prefix comes from the master)", up=self.upstream, where=self.address)

        def protocolFactory():
            p = UpstreamProtocol()
            p.relay = self
            return p

        self.client = _MasterClient(self, self.reactor, self.upstream, protocolFactory,
                                    initialDelay=self.initialDelay, maxDelay=self.maxDelay,
                                    max_packet=self.config.max_packet)
        self.client.start()

    def stopService(self):
        service.Service.stopService(self)
        ds = []
        if self.client is not None:
            ds.append(self.client.stop())
        if self.bus is not None and self.bus.running:
            ds.append(defer.maybeDeferred(self.bus.stopService))
        return defer.DeferredList(ds)

    def _serve(self, prefix: bytes) -> bool:
        self.config.cred_prefix = prefix
        self.local_prefix = prefix
        self._local_secret = prefix + SECRET_ROOT
        from sbus.server.service import BusService

        wider = parse_address(self.address).kind == "path" and _wider_than_master(self.mode, self.upstream)
        if wider:  # the master's socket did not exist at start-up: judged now that it answered
            log.critical("sbus-relay: --mode: {why}; stopping", why=wider)
            self.reactor.callLater(0, self.reactor.stop)
            return False
        bus = BusService(self.address, self.config, mode=self.mode, reuse=self.reuse, reactor=self.reactor)
        try:
            bus.startService()
        except Exception as e:
            log.critical("sbus-relay: cannot serve on {where}: {err}; stopping", where=self.address, err=e)
            self.reactor.callLater(0, self.reactor.stop)
            return False
        self.bus = bus
        self.factory = bus.factory
        self.factory.upstream = self
        log.info("sbus-relay: serving on {where} with credential prefix {prefix}",
                 where=bus.printed_address or self.address, prefix=_show(prefix))
        return True

    # -- the master connection

    def masterUnreachable(self, reason, news: str | None = None):
        """`news`: the failure in one line when it is worth logging (the first, or a new error)."""
        self.failed_attempts += 1
        if news is not None:
            log.warn("sbus-relay: cannot connect to the master at {news}; {what}retrying quietly with "
                     "back-off", news=news, what="not serving yet, " if self.factory is None else "")

    def masterUp(self, proto: UpstreamProtocol):
        parsed = parse_whoami(proto.credentials or b"")
        if parsed is None:
            log.error("sbus-relay: the master answered whoami with {w!r}; disconnecting", w=proto.credentials)
            proto.transport.abortConnection()
            return
        prefix = proto.credentials + b"/"
        if self.factory is None and not self._serve(prefix):
            proto.transport.abortConnection()
            return
        self.connects += 1
        self.up_prefix = prefix
        if prefix != self.local_prefix:
            self._rekey(prefix)
        proto.sendPacket(_ECHO_OFF)
        proto.sendPacket(_HARD_BLOCK)
        held = self.factory.router.held_patterns()
        for pattern in held:
            proto.sendPacket(b"SUB " + self._upPattern(pattern))
        self.subscribed_up = len(held)
        self.held_up = len(held)
        self.held_up_bytes = sum(_cost(p) for p in held)
        self.up = proto
        self._up_since = self.reactor.seconds()
        self.disconnect_reason = None
        proto.stats().addCallbacks(self._masterStats, lambda f: None)
        if self.connects > 1:
            # Our bus and the master's are one segment again: the spanning tree re-checks both sides.
            self._topologyChange(f"relay pid {os.getpid()} rejoined its master")
        if self.connects > 1:
            log.info("sbus-relay: reconnected to the master at {up}; re-subscribed {n} patterns",
                     up=self.upstream, n=len(held))
        else:
            log.info("sbus-relay: connected to the master at {up} as {who}", up=self.upstream,
                     who=_show(proto.credentials))

    def masterDown(self, reason):
        self.up = None
        self.subscribed_up = 0
        if self.factory is not None and self.client is not None and self.running:
            lived = self.reactor.seconds() - self._up_since
            if lived < 5.0:
                # Cut off right after connecting: do not hot-loop; back off as if it had failed.
                self._backoff = min(max(2 * getattr(self, "_backoff", 0.0), 1.0), self.maxDelay)
                self.client._delay = max(getattr(self.client, "_delay", 0.0), self._backoff)
            else:
                self._backoff = 0.0
            why = self.disconnect_reason
            if why and why != self._last_reason_logged:
                self._last_reason_logged = why
                log.error("sbus-relay: the master closed our connection: {why}", why=why)
        self._releasePublishers()
        if self.factory is None:
            return
        self.disconnects += 1
        # Our bus is a segment of its own now: a standby bridge or link may have to take over.
        self._topologyChange(f"relay pid {os.getpid()} lost its master")
        if self.running:
            log.warn("sbus-relay: lost the master at {up} ({why}); serving locally (publishes are not "
                     "sent upward meanwhile), reconnecting with back-off", up=self.upstream, why=reason)

    def _masterStats(self, stats: dict) -> None:
        limits = stats.get("limits") if isinstance(stats, dict) else None
        if isinstance(limits, dict):
            self.master_limits = limits

    def admitPattern(self, client, pattern: bytes, cost: int, segments: int) -> str | None:
        """Issue 16 item 8: the master allows this relay (one client there) so many patterns; each
        local uid gets a share, and the total never goes over, so no local user can get the relay
        cut off. None: admitted; else the reason the local client is disconnected."""
        limits = self.master_limits
        if not limits:
            return None
        try:
            n_limit = min(int(limits["max_subscriptions"]), int(limits["max_uid_subscriptions"]))
            b_limit = min(int(limits["max_subscription_bytes"]), int(limits["max_uid_subscription_bytes"]))
            seg_limit = int(limits.get("max_pattern_segments", segments))
        except (KeyError, TypeError, ValueError):
            return None
        n_budget, b_budget = max(1, n_limit - 16), max(1, b_limit - 16 * 256)
        if segments > seg_limit:
            return f"pattern of {segments} segments: the master takes at most {seg_limit}"
        factory = self.factory
        uid = client.cred.uid
        holding = {u for u, charge in factory.users.items() if charge.subscriptions}
        users = len(holding | {uid})
        share_n, share_b = n_budget // max(2, users), b_budget // max(2, users)
        charge = factory.users.get(uid)
        have_n, have_b = (charge.subscriptions, charge.subscription_bytes) if charge is not None else (0, 0)
        why = None
        if self.held_up + 1 > n_budget or self.held_up_bytes + cost > b_budget:
            why = (f"the relay holds {self.held_up} of the {n_budget} patterns its master allows it "
                   f"({self.held_up_bytes} of {b_budget} bytes)")
        elif have_n + 1 > share_n or have_b + cost > share_b:
            why = (f"uid {uid} holds {have_n} patterns ({have_b} bytes) here, its share of the "
                   f"{n_budget} patterns ({b_budget} bytes) the master allows this relay is "
                   f"{share_n} ({share_b} bytes) among {max(2, users)} users")
        if why is None:
            return None
        self.quota_refusals += 1
        return f"over this relay's quota on its master: {why}"

    def _topologyChange(self, why: str) -> None:
        packet = b"MSG " + CHANGE_KEY + b"\0" + why.encode()
        self.factory.deliverLocally(packet, CHANGE_KEY)
        self.factory.flushDirty()
        if self.up is not None:
            self.up.sendPacket(packet)

    def _upPattern(self, pattern: bytes) -> bytes:
        return pattern

    def _rekey(self, prefix: bytes) -> None:
        """Our name on the master changed (it is a relay that restarted): every local client's
        identity is ``<our name>/!/cred/G/U/P``, so it changes with it. Move each client's
        secret space and secret patterns to the new prefix, answer whoami with the new name,
        and tell each client (``CMSG relay/whoami\0<new whoami>``; a relay below us does the
        same for its own clients). Names learned before are dead anyway: nothing above routes
        the old prefix any more."""
        old = self.local_prefix
        factory = self.factory
        router = factory.router
        self.config.cred_prefix = prefix
        self.local_prefix = prefix
        self._local_secret = prefix + SECRET_ROOT
        self.rekeys += 1
        moved = 0
        delta = len(prefix) - len(old)
        for client in list(factory.clients):
            cred = client.cred
            name = whoami(prefix, cred)
            if router.secret_prefix_of(client) is not None:  # None: its owner exited, no secret key
                router.add_client(client, secret_prefix(prefix, cred))
            for pattern, n in list(router.patterns_of(client).items()):
                if not pattern.startswith(old + SECRET_ROOT):
                    continue
                new = prefix + pattern[len(old):]
                for _ in range(n):
                    if router.unsubscribe(client, pattern) is None:
                        break
                    router.subscribe(client, new)
                    moved += 1
                    client.repricePattern(delta)
                interest = factory.interest
                if interest is not None:  # watchers of server/interest see the move
                    factory.tellInterest(interest.released(client, factory.interestForm(pattern)))
                    factory.tellInterest(interest.held(client, cred.uid, factory.interestForm(new)))
            client.setCredPrefix(prefix)
            client.notify(_WHOAMI_NOTICE + name)
        factory.flushDirty()
        log.warn("sbus-relay: our name on the master is now {new} (was {old}); {n} local clients have "
                 "new names under it ({m} secret subscriptions moved) and were told (CMSG relay/whoami)",
                 new=_show(prefix[:-1]), old=_show(old[:-1]), n=len(factory.clients), m=moved)

    def whoamiChanged(self, proto, whoami_: bytes) -> None:
        """The master (a relay) says our name on it changed without a reconnection."""
        if proto is not self.up or parse_whoami(whoami_) is None:
            return
        prefix = whoami_ + b"/"
        proto.credentials = whoami_
        self.up_prefix = prefix
        if prefix != self.local_prefix:
            self._rekey(prefix)  # the master moved our upward subscriptions already

    # -- IUpstream: what the local bus tells us

    def localPublish(self, packet: bytes, key: bytes, client) -> None:
        if key.startswith(self._local_secret):
            return  # only local clients can own it: never useful upward
        up = self.up
        if up is None:
            self.drops["master_down"] += 1
            return
        transport = up.transport
        transport.write(packet)
        self.forwarded_up += 1
        if transport.queuedBytes() > self.up_limit and client.pauses is not None:
            self.blocked.add(client.pauses)

    def patternHeld(self, pattern: bytes) -> None:
        self.held_up += 1
        self.held_up_bytes += _cost(pattern)
        up = self.up
        if up is not None:
            up.sendPacket(b"SUB " + self._upPattern(pattern))
            self.subscribed_up += 1

    def patternReleased(self, pattern: bytes) -> None:
        self.held_up -= 1
        self.held_up_bytes -= _cost(pattern)
        up = self.up
        if up is not None:
            up.sendPacket(b"UNSUB " + self._upPattern(pattern))
            self.subscribed_up -= 1

    def stats(self) -> dict:
        up = self.up
        return {
            "master": self.upstream,
            "connected": up is not None,
            "whoami": _show(self.up_prefix[:-1]) if self.up_prefix else None,
            "prefix": _show(self.local_prefix or b""),
            "renamed": self.rekeys,
            "held_up_patterns": self.held_up,
            "quota_refusals": self.quota_refusals,
            "master_limits": self.master_limits,
            "forwarded_up": self.forwarded_up,
            "forwarded_down": self.forwarded_down,
            "subscriptions_up": self.subscribed_up,
            "connects": self.connects,
            "reconnects": max(0, self.connects - 1),
            "disconnects": self.disconnects,
            "failed_attempts": self.failed_attempts,
            "drops": dict(self.drops),
            "queued_up_bytes": up.transport.queuedBytes() if up is not None else 0,
            "blocked_publishers": len(self.blocked),
        }

    # -- from the master

    def fromMaster(self, proto: UpstreamProtocol, key: bytes, packet: bytes) -> None:
        self.forwarded_down += 1
        self.factory.deliverLocally(packet, key, proto)

    def upstreamDrained(self, proto) -> None:
        if proto is self.up:
            self._releasePublishers()

    def _releasePublishers(self):
        self.blocked.release()


def _wider_than_master(mode: int, upstream: str) -> str | None:
    """Why a socket of `mode` would let in someone who could not open the master (no service
    serves a socket wider than the bus it stands on: `BusAccess.wider`), or None."""
    from sbus.services.access import BusAccess

    return BusAccess(upstream).wider(mode)[1]


def makeService(options: Options) -> Relay:
    from sbus.options import StartupError
    from sbus.server.address import AddressError, check_bindable

    try:  # the relay binds once its master answers: fail now for what is already known
        check_bindable(options["socket"], bool(options["reuse"]))
    except AddressError as e:
        raise StartupError(str(e)) from None
    if parse_address(options["socket"]).kind == "path" and os.path.exists(options["upstream"]):
        wider = _wider_than_master(options["mode"], options["upstream"])
        if wider:
            raise StartupError(f"--mode: {wider}")
    return Relay(
        options["upstream"],
        options["socket"],
        tap.config_from_options(options),
        mode=options["mode"],
        reuse=bool(options["reuse"]),
        initialDelay=options["initial-delay"],
        maxDelay=options["max-delay"],
    )
