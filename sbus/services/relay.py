"""``twistd sbus-relay``: a slave bus server below a master (docs/relay-link.md).

    twistd -n sbus-relay --bus /run/sbus.socket --socket /run/user/1000/sbus.socket

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
* **Who is served.** A local client is admitted only if the master would admit its uid
  itself (`sbus.services.admission`, the rule every service shares: the master socket's
  mode, owner and group against the client's own groups, and the master's ``-u`` list,
  asked of it in ``server/stats``; until the master has told it, only root and the relay's
  own uid), per connection from ``SO_PEERCRED``, whatever the relay's socket is (a path,
  abstract, ``/dev/fd/N``, systemd's). A refused client gets one log line and is closed.
  ``--mode`` is a second fence: one wider than the master is refused at start.
* **Echo off upward**, so what the relay publishes never comes back to it.
* **Publishes.** Every local publish is routed locally by the broker and then
  written upward once; what the master sends down is delivered to local
  subscribers once (each client gets each message on one path only: locally
  if it is on the publisher's bus, from above otherwise). A key in the
  relay's own secret space (``<prefix>!/cred/...``) is not sent upward: only
  local clients can own it.
* **Master away.** The relay keeps serving locally; local publishes are not
  sent upward: counted as ``drops.master_down`` (published while there was
  no master connection, or after the relay found it gone) and
  ``drops.in_flight`` (written to the connection but still queued in the
  relay when it ended) in statistics, in ``sbus stats --services`` asked on
  the relay's bus, and in the stop line. What the master had taken from the
  socket but not delivered when it died, the relay cannot know. It
  reconnects with exponential back-off (``--initial-delay`` to
  ``--max-delay``) and re-subscribes everything held.
* **Master back: at once.** Where the master is a socket file (Linux), the
  relay watches the file's directory with inotify (`sbus.client.socketwatch`, as every
  service's `ReconnectingClient` with ``watch=True``): when
  a socket appears at the master's path (created, moved there, or its mode
  changed) while the relay waits, it tries at once instead of after the
  back-off. The file exists from ``bind()``, before the new master calls
  ``listen()``: a refused attempt is retried every ``WAKE_INTERVAL`` for
  ``WAKE_WINDOW`` seconds, then the back-off resumes, doubling from
  ``WAKE_INTERVAL``. A relay of a relay is woken the same way when the relay
  above restarts (its socket reappears once it serves again). Without
  inotify (another OS, an abstract or ``/dev/fd/N`` master, a watch that
  cannot be set) the back-off alone applies; the relay says so in its log.
* **No planted symlinks.** The master's socket file is opened without
  following a final symlink (``O_PATH | O_NOFOLLOW``) and connected through
  that descriptor (``/proc/self/fd/N``): a symlink at the master's path is
  followed only if it belongs to the relay's own uid or to root; one of
  another uid is refused (``ELOOP``, in the log) and never wakes the relay.
* **Prefix changes.** If the whoami on the master changes after a reconnect
  (the master is itself a relay that was restarted), local clients keep the
  prefix they were given: the relay translates secret patterns upward and
  secret keys downward between the two, and logs it once. Peers elsewhere
  that learned the old identities must ask again.
* **Flow control.** Downward: a local subscriber in ``block`` mode that fills
  up pauses reading from the master (then the master's flood settings for
  the relay apply). Upward: when more than ``--queue-bytes`` wait to go to
  the master, the local publishers feeding it are paused until it drains.
  Little stays in the relay's memory, where a kill -9 loses it uncounted:
  past a few read batches queued for a local client in a ``block`` mode, the
  relay stops reading the master until that queue is sent (`Backlog`).

* **Restarted: the gap counted.** The relay holds a ``server/session`` on its master named
  after the socket it serves. When it dies, its clients' patterns linger on the master and
  count what the master had for them; the restarted relay claims the session
  `SESSION_SETTLE` seconds after it first serves (its clients have subscribed again) and
  counts what it missed, less what reached it or it published up meanwhile
  (`sbus.services.session.SessionClaim`), as ``lost.restart`` with one log line giving the
  gap; after a reconnection the claim is at once and a loss is ``lost.reconnect``.

Statistics: ``CMSG server/stats`` on the relay shows an ``"upstream"``
object (see `Relay.stats`); the relay also answers ``sbus/services/stats``
requests published on its own bus (`sbus.services.svcstats`) with it, and
logs it in one line when it stops.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections import Counter

from twisted.application import service
from twisted.internet import defer
from twisted.logger import Logger
from twisted.python import usage
from zope.interface import implementer

from sbus.client import address as client_address
from sbus.client.socketwatch import link_refusal, symlink_refusal
from sbus.client.twisted import ReconnectingClient, SbusProtocol, connect_socket, parse_whoami
from sbus.core.credentials import SECRET_ROOT, secret_prefix, whoami
from sbus.core.flood import BLOCK, Outbox
from sbus.core.pausing import Holds, Pauses
from sbus.core.topology import CHANGE_KEY
from sbus.interfaces import IUpstream
from sbus.options import MISSING_BUS_HELP, RespelledOptions
from sbus.server import tap
from sbus.server.address import parse_address
from sbus.server.config import ServerConfig
from sbus.server.config import pattern_cost as _cost  # what the master charges for a pattern
from sbus.services.admission import Admission, AdmittingFactory
from sbus.services.session import DEFAULT_LINGER, SessionClaim, carried_note, session_name
from sbus.services.svcstats import STATS_REQUEST, StatsResponder, lost, unknown_gaps

log = Logger(namespace="sbus.relay")


_ECHO_OFF = b"CMSG echo/off"
#: Sent by a relay to each local client whose name changed (its own name on the master changed).
RELAY_WHOAMI = b"relay/whoami"
_WHOAMI_NOTICE = b"CMSG " + RELAY_WHOAMI + b"\0"
#: Lossless: when the relay stops reading the master (a local `block` subscriber is full), the
#: master holds the publishers instead of discarding what waits for the relay.
_HARD_BLOCK = b"CMSG blocking/hard/block"


def _show(b: bytes) -> str:
    return b.decode("utf-8", "replace")


class Options(RespelledOptions, tap.BusOptions):
    synopsis = "--bus ADDRESS [--socket PATH] [twistd sbus options]"
    command = "twistd sbus-relay"
    renamed = {"--upstream": "--bus"}
    longdesc = (
        "Run an sbus slave server (relay): it serves local clients like `twistd sbus` and is a "
        "client of the master at --bus, from which it takes its credential prefix. "
        "The socket is opened once the master has answered whoami."
    )
    optParameters = [
        ["bus", "b", None, "The master bus: PATH, /dev/unix/abstract/HEX or /dev/fd/N (required). "
                                 + MISSING_BUS_HELP],
        ["initial-delay", None, "0.1", "First reconnection delay to the master, seconds."],
        ["max-delay", None, "10", "Longest reconnection delay to the master, seconds."],
        ["session-linger", None, f"{DEFAULT_LINGER:g}", "Seconds the master keeps counting what our "
                                                        "subscriptions match after we die, for our "
                                                        "restarted successor (server/session; 0: none)."],
    ]

    def postOptions(self) -> None:
        super().postOptions()
        if not self["bus"]:
            raise usage.UsageError("--bus: the master's address is required")
        try:
            client_address.parse(self["bus"])
        except client_address.AddressError as e:
            raise usage.UsageError(f"--bus: {e}") from None
        try:
            linger = float(self["session-linger"])
        except ValueError:
            raise usage.UsageError(f"--session-linger: not a number: {self['session-linger']!r}") from None
        if not 0 <= linger < float("inf"):
            raise usage.UsageError("--session-linger: must be 0 or more seconds")
        self["session-linger"] = linger
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


class _UpOutbox(Outbox):
    """The queue of the connection to the master. What it holds when the connection ends is
    lost: `clear` tells the relay how many messages that was (`Relay.lostQueued`)."""

    __slots__ = ("on_lost",)

    def __init__(self, max_bytes: int, max_packets: int, on_lost=None):
        super().__init__(max_bytes, max_packets)
        self.on_lost = on_lost

    def clear(self) -> int:
        n = lost = 0
        while self.nbytes:
            n += 1
            if self.pop()[:4] == b"MSG ":
                lost += 1
        n += super().clear()
        if lost and self.on_lost is not None:
            self.on_lost(lost)
        return n


class UpstreamProtocol(SbusProtocol):
    """The relay's connection to its master."""

    relay: "Relay | None" = None
    #: Our claim of the relay's session on the master (`sbus.services.session`).
    claim: SessionClaim | None = None
    #: Who holds this connection's reading paused (the broker's feeder protocol).
    pauses: Pauses | None = None

    def connectionMade(self):
        self.pauses = Pauses(self.transport)
        old = getattr(self.transport, "outbox", None)
        if old is not None and not old.nbytes and hasattr(self.transport, "useQueue"):
            self.transport.useQueue(_UpOutbox(old.max_bytes, old.max_packets, self.relay.lostQueued))
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
        """What the master sent in one wakeup is queued for local clients: send it, stop
        reading the master while too much of it stays queued here (`Backlog`), and tell the
        master it is handed on (`server/session-ack`)."""
        relay = self.relay
        factory = relay.factory
        if factory is not None:
            queued = factory.dirty[:]  # (the local clients this batch queued for)
            factory.flushDirty(self)
            if queued and self is relay.up:
                relay.backlog.check(queued, self.pauses)
        if self.claim is not None:
            # routed here: a kill from now on loses it in our memory (`Backlog` keeps that
            # small), not uncounted in the master's kernel buffer toward us
            self.claim.acknowledge()

    def unsolicitedControl(self, key: bytes, payload: bytes | None) -> None:
        if key == RELAY_WHOAMI and payload:
            self.relay.whoamiChanged(self, payload)
        elif key == b"server/disconnect" and payload:
            self.relay.disconnect_reason = payload.replace(b"\0", b": ", 1).decode("utf-8", "replace")[:300]


#: What may wait in the relay's own memory for one local connection in a `block` mode before the
#: relay stops reading its master (four read batches of 64): the rest waits on the master, where
#: a kill -9 of the relay is counted by its session (`Backlog`).
BACKLOG_BYTES = 64 << 10
BACKLOG_PACKETS = 256


class _DrainWatch:
    """A pull producer on a local client's transport: the transport asks it for more
    (`resumeProducing`) when it has sent everything queued, and stops it when it closes."""

    __slots__ = ("backlog", "client")

    def __init__(self, backlog: "Backlog", client):
        self.backlog = backlog
        self.client = client

    def resumeProducing(self) -> None:
        self.backlog.drained(self.client)

    def stopProducing(self) -> None:
        self.backlog.drained(self.client)

    def pauseProducing(self) -> None:
        pass


class Backlog:
    """Keeps what the master sends out of the relay's memory: a local connection in a `block`
    mode (a relay below, a lossless subscriber) would otherwise hold the master's feed only when
    its queue here is full (16,384 packets), and all of that dies with the relay uncounted. Past
    `BACKLOG_BYTES` or `BACKLOG_PACKETS` queued for one, the relay stops reading the master until
    that queue has been sent; the master keeps the rest (hard/block) and its session counts it at
    a kill (what its kernel buffered for us, unread, it cannot). Connections in a drop mode never
    hold it. One that keeps it held `patience` seconds (half the stall timeout) is let be until
    its queue is small again: the bus's own cap and stall budget then apply to it, as to any
    client, so a stuck reader stops the relay at most `patience` longer than before, and is
    still disconnected as ``stalled``. Only connections of the relay's own uid or root (a relay
    below, a service of ours) may hold it: the bus's hold budget does not see this hold, and a
    client of another uid could otherwise stall everyone's feed again and again by reading a
    little between holds; theirs waits here up to the bus's cap, as before."""

    def __init__(self, reactor, patience: float, trusted_uids=(0, os.getuid())):
        self.reactor = reactor
        self.patience = patience
        self.trusted_uids = frozenset(trusted_uids)
        #: Local clients whose queue the relay waits to see sent, each with its watch.
        self.waiting: dict = {}
        #: Clients that held the relay past `patience`, let be until their queue is small.
        self.exempt: set = set()
        #: The master connection's `Pauses` while held, and the call that ends our patience.
        self.pauses = None
        self.timer = None
        #: Times the relay stopped reading its master for a backlog; clients let be for holding too long.
        self.holds = 0
        self.let_be = 0

    def check(self, clients, pauses) -> None:
        """After a read batch from the master: hold it if one of `clients` has too much queued."""
        if self.exempt:
            self.exempt = {c for c in self.exempt if c.connected}
        for client in clients:
            out = client.outbox
            if (out.hard != BLOCK and out.soft != BLOCK) or client in self.waiting \
                    or client.cred.uid not in self.trusted_uids:
                continue
            if out.nbytes <= BACKLOG_BYTES and len(out) <= BACKLOG_PACKETS:
                self.exempt.discard(client)
                continue
            transport = client.transport
            if client in self.exempt or not client.connected or transport.disconnecting:
                continue
            watch = self.waiting[client] = _DrainWatch(self, client)
            transport.registerProducer(watch, False)  # (closed: stopProducing at once)
        if self.waiting and self.pauses is None and pauses is not None:
            self.pauses = pauses
            pauses.hold()
            self.holds += 1
            self.timer = self.reactor.callLater(self.patience, self._impatient)

    def drained(self, client) -> None:
        """`client`'s queue was sent (or it closed): read the master again if nobody else waits."""
        if self.waiting.pop(client, None) is None:
            return
        client.transport.unregisterProducer()
        if not self.waiting:
            self._release()

    def _impatient(self) -> None:
        self.timer = None
        self.let_be += len(self.waiting)
        self.exempt.update(self.waiting)
        self.reset()

    def reset(self) -> None:
        """Stop waiting for anyone (the master connection ended, or patience ran out)."""
        waiting, self.waiting = self.waiting, {}
        for client in waiting:
            client.transport.unregisterProducer()
        self._release()

    def _release(self) -> None:
        timer, self.timer = self.timer, None
        if timer is not None and timer.active():
            timer.cancel()
        pauses, self.pauses = self.pauses, None
        if pauses is not None:
            pauses.release()

    def stats(self) -> dict:
        """Whether the relay is not reading its master now for a backlog, how often it stopped,
        and how many clients it let be for holding it too long."""
        return {"intake_paused": self.pauses is not None, "intake_pauses": self.holds,
                "intake_let_be": self.let_be}


_PROC_FD = "/proc/self/fd"
#: A restarted relay claims its session this long after it first serves: its clients (relays
#: below woken by inotify, clients backing off from 0.1 s) have subscribed again by then, and
#: what the master sent them meanwhile is subtracted from what the session counted.
SESSION_SETTLE = 2.0


def master_file_refusal(path: str) -> str | None:
    """Why the relay must not connect through what is at `path` (`link_refusal`)."""
    return link_refusal(path)


def _open_master_file(path: str) -> int:
    """An ``O_PATH`` descriptor of the master's socket file at `path`: the file itself, or what a
    symlink of ours or root's names. A symlink of another uid raises `OSError` (``ELOOP``)."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISLNK(st.st_mode):
        return fd
    os.close(fd)
    refusal = symlink_refusal(st)
    if refusal is not None:
        raise OSError(errno.ELOOP, refusal, path)
    return os.open(path, os.O_PATH | os.O_CLOEXEC)  # ours or root's: followed


def connect_master(reactor, address, max_packet, timeout):
    """The relay's connector (`ReconnectingClient`): a path is opened first (`_open_master_file`)
    and connected through that descriptor, so what is connected is the file that was judged,
    whatever replaces the name meanwhile. Without ``/proc`` the same rule is applied to the name
    just before a plain connect (a replacement in between is not seen). Other addresses: a
    plain connect."""
    addr = client_address.resolve(address)
    if addr.kind != "path":
        return connect_socket(reactor, address, max_packet, timeout)
    if not os.path.isdir(_PROC_FD):  # no /proc: judged by name, then connected by name
        refusal = master_file_refusal(addr.value)
        if refusal is not None:
            return defer.fail(OSError(errno.ELOOP, refusal, addr.text))
        return connect_socket(reactor, address, max_packet, timeout)
    try:
        fd = _open_master_file(addr.value)
    except OSError as e:
        return defer.fail(type(e)(e.errno, e.strerror or os.strerror(e.errno), addr.text))

    def close(result):
        os.close(fd)
        return result

    return connect_socket(reactor, f"{_PROC_FD}/{fd}", max_packet, timeout).addBoth(close)


class _MasterClient(ReconnectingClient):
    """The link to the master; its socket's return wakes it (`ReconnectingClient.wake`)."""

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
                 reuse: bool = False, initialDelay: float = 0.1, maxDelay: float = 10.0, reactor=None,
                 session_linger: float = DEFAULT_LINGER, listener=None):
        self.upstream = upstream
        #: A systemd-activated socket, taken at start (`makeService`): served once the master answers.
        self.listener = listener
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
        #: Reading the master paused while too much of it waits here for a local client.
        self.backlog = Backlog(reactor, config.stall_timeout / 2)
        # counters
        self.forwarded_up = 0
        self.forwarded_down = 0
        self.connects = 0
        self.disconnects = 0
        self.failed_attempts = 0
        self.drops = Counter()
        self.subscribed_up = 0
        #: Times without the master (after having had it): how many, the last and all, seconds.
        self.gaps = 0
        self.last_gap = 0.0
        self.gap_seconds = 0.0
        self._down_since = 0.0
        #: `_notUp()` when last connected: what did not go up since is this gap's.
        self._not_up_mark = 0
        self.responder = StatsResponder("sbus-relay", self._name, self.stats)
        #: Who may use our bus: whom the master would admit itself (`sbus.services.admission`).
        self.admission = Admission(upstream, "sbus-relay")
        #: ``server/session`` on the master: seconds it lingers (0: none), what gaps lost and why
        #: (``restart``: our predecessor's; ``reconnect``: our own connection's), the last gap.
        self.session_linger = session_linger
        self.session_name = session_name(f"sbus-relay {hashlib.sha256(os.fsencode(self._role())).hexdigest()[:20]} "
                                         f"serving {address}")
        self.gap_lost = Counter()
        self.last_session_gap: float | None = None
        self._held_before = False
        self._session_state: str | None = None
        #: The back-off after being cut off right after connecting (`masterDown`), seconds.
        self._backoff = 0.0

    # -- service life

    def startService(self):
        service.Service.startService(self)
        if self.reactor is None:
            from twisted.internet import reactor
            self.reactor = reactor
        self.backlog.reactor = self.reactor
        from sbus.services.shutdown import exit_zero_on_sigterm
        exit_zero_on_sigterm(self.reactor)
        log.info("sbus-relay: connecting to the master at {up}; {where} opens once it has answered "
                 "whoami (the credential prefix comes from the master)", up=self.upstream, where=self.address)

        def protocolFactory():
            p = UpstreamProtocol()
            p.relay = self
            return p

        # watch=True: while away, the master's socket file reappearing wakes it at once
        # (`sbus.client.socketwatch`; a relay of a relay: when the one above serves again)
        self.client = _MasterClient(self, self.reactor, self.upstream, protocolFactory,
                                    initialDelay=self.initialDelay, maxDelay=self.maxDelay,
                                    max_packet=self.config.max_packet, connector=connect_master, watch=True)
        # our own session claim says whether a gap was counted (`_claimed`); without one, none is
        self.client.missesUncounted = self.session_linger <= 0
        self.client.start()

    def _role(self) -> str:
        """What identifies this relay to its master across restarts: the socket it serves."""
        try:
            addr = client_address.resolve(self.address)
        except client_address.AddressError:
            return str(self.address)
        value = os.path.abspath(addr.value) if addr.kind == "path" else addr.value
        return f"{addr.kind}:{os.fsdecode(value) if isinstance(value, bytes) else value}"

    def _name(self) -> str:
        return self.bus.printed_address if self.bus is not None and self.bus.printed_address else self.address

    def stopService(self):
        service.Service.stopService(self)
        st = self.stats()
        log.info("sbus-relay stopped: forwarded up={up} down={down}; connects={c} reconnects={r} "
                 "(at once on the master's socket appearing: {w}); not sent upward: master_down={md} "
                 "in_flight={inf}; not received from the master during a gap: restart={rs} reconnect={rc} "
                 "(last gap {gap} s); drop reasons {why}",
                 up=st["forwarded_up"], down=st["forwarded_down"], c=st["connects"], r=st["reconnects"],
                 rs=self.gap_lost["restart"], rc=self.gap_lost["reconnect"],
                 gap="-" if self.last_session_gap is None else f"{self.last_session_gap:.3f}",
                 w=st["wakeups"], md=self.drops["master_down"], inf=self.drops["in_flight"],
                 why=json.dumps(st["drops"], separators=(",", ":")))
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
        bus = BusService(self.address, self.config, mode=self.mode, reuse=self.reuse, reactor=self.reactor,
                         listener=self.listener)
        try:
            bus.startService()
        except Exception as e:
            log.critical("sbus-relay: cannot serve on {where}: {err}; stopping", where=self.address, err=e)
            self.reactor.callLater(0, self.reactor.stop)
            return False
        self.bus = bus
        self.factory = bus.factory
        self.factory.upstream = self
        bus.port.factory = AdmittingFactory(bus.factory, self.admission)  # before any accept
        if not self.admission.settled:
            # Peers of another uid would be refused until the master has said whom it admits:
            # they wait in the backlog for its answer instead (a round trip, masterUp).
            bus.port.pauseProducing()
            self.admission.whenSettled(bus.port.resumeProducing)
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
        proto.stats().addCallbacks(self._masterStats, lambda f: None)   # its limits too: not `ask`
        self.admission.settleAfter(proto)
        if self.session_linger > 0:
            proto.claim = SessionClaim(proto, self.session_name, self.session_linger)
            if self.connects == 1:  # our first: let our clients subscribe again first
                self.reactor.callLater(SESSION_SETTLE, self._claim, proto)
            else:
                self._claim(proto)
        if self.connects > 1:
            # Our bus and the master's are one segment again: the spanning tree re-checks both sides.
            self._topologyChange(f"relay pid {os.getpid()} rejoined its master")
        if self.connects > 1:
            gap = self.reactor.seconds() - self._down_since
            self.gaps += 1
            self.gap_seconds += gap
            self.last_gap = gap
            lost = self._notUp() - self._not_up_mark
            log.info("sbus-relay: reconnected to the master at {up} after {gap:.3f}s without it; "
                     "re-subscribed {n} patterns; {lost} local publishes did not go up meanwhile "
                     "(drops.master_down, drops.in_flight)", up=self.upstream, n=len(held), gap=gap, lost=lost)
        else:
            log.info("sbus-relay: connected to the master at {up} as {who}", up=self.upstream,
                     who=_show(proto.credentials))
        self._not_up_mark = self._notUp()

    def masterDown(self, reason):
        self.up = None
        self.subscribed_up = 0
        self.backlog.reset()
        if self.factory is not None and self.client is not None and self.running:
            lived = self.reactor.seconds() - self._up_since
            if lived < 5.0:
                # Cut off right after connecting: do not hot-loop; back off as if it had failed.
                self._backoff = min(max(2 * self._backoff, 1.0), self.maxDelay)
                self.client.backOffAtLeast(self._backoff)
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
        self._down_since = self.reactor.seconds()
        # Our bus is a segment of its own now: a standby bridge or link may have to take over.
        self._topologyChange(f"relay pid {os.getpid()} lost its master")
        if self.running:
            log.warn("sbus-relay: lost the master at {up} ({why}); serving locally (publishes are not "
                     "sent upward meanwhile), reconnecting with back-off", up=self.upstream, why=reason)

    def _masterStats(self, stats: dict) -> None:
        self.admission.learn(stats)
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
            self._sentUp(self.up, CHANGE_KEY)

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
        if key == STATS_REQUEST:
            self.reactor.callLater(0, self._answerStats, packet[len(b"MSG ") + len(key) + 1:])
        up = self.up
        transport = up.transport if up is not None else None
        if transport is None or not transport.connected or transport.disconnecting:
            self.drops["master_down"] += 1  # no master, or it is gone and we are finding out
            return
        transport.write(packet)
        if transport.disconnecting:  # this very send found the master gone
            self.drops["in_flight"] += 1
            return
        self.forwarded_up += 1
        self._sentUp(up, key)
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
            "admission_refused": self.admission.refused,
            "master_limits": self.master_limits,
            "forwarded_up": self.forwarded_up,
            "forwarded_down": self.forwarded_down,
            "subscriptions_up": self.subscribed_up,
            "connects": self.connects,
            "reconnects": max(0, self.connects - 1),
            "disconnects": self.disconnects,
            "failed_attempts": self.failed_attempts,
            "wakeups": self.client.wakeups if self.client is not None else 0,
            "master_gaps": {"count": self.gaps, "last_seconds": round(self.last_gap, 3),
                            "total_seconds": round(self.gap_seconds, 3),
                            "now_seconds": round(self.reactor.seconds() - self._down_since, 3)
                            if up is None and self.disconnects else 0.0},
            "watching": self.client is not None and self.client.watchMissing is None,
            "drops": dict(self.drops),
            "session": self._sessionStats(),
            "restart": self.gap_lost["restart"],
            "lost": lost(self.drops, self.gap_lost),
            "unknown_gaps": unknown_gaps(self.client) if self.client is not None else unknown_gaps(),
            "stats_requests": {"answered": self.responder.answered, "refused": self.responder.refused},
            "queued_up_bytes": up.transport.queuedBytes() if up is not None else 0,
            "blocked_publishers": len(self.blocked),
            **self.backlog.stats(),
        }

    def _notUp(self) -> int:
        return self.drops["master_down"] + self.drops["in_flight"]

    def lostQueued(self, n: int) -> None:
        """`n` messages were queued for the master when the connection to it ended."""
        self.drops["in_flight"] += n

    def _answerStats(self, payload: bytes) -> None:
        """``sbus/services/stats`` published on our bus: answer its asker (a local client)."""
        factory = self.factory
        if factory is None or self.local_prefix is None:
            return
        me = self.local_prefix + SECRET_ROOT + b"%d/%d/%d" % (os.getgid(), os.getuid(), os.getpid())
        reply = self.responder.answer(payload, me)
        if reply is None:
            return
        key = reply[4:reply.index(b"\0")]
        if not key.startswith(self._local_secret):
            return  # an asker above us: the services up there answer it
        factory.deliverLocally(reply, key)
        factory.flushDirty()

    # -- from the master

    def fromMaster(self, proto: UpstreamProtocol, key: bytes, packet: bytes) -> None:
        self.forwarded_down += 1
        session = proto.claim
        if session is not None and session.counting:
            session.saw(key)
        self.factory.deliverLocally(packet, key, proto)

    # -- the session on the master: what a predecessor's gap lost

    def _claim(self, proto: UpstreamProtocol) -> None:
        if proto is not self.up or proto.claim is None or not proto.connected:
            return
        proto.claim.claim().addCallback(self._claimed, proto)

    def _sentUp(self, proto: UpstreamProtocol, key: bytes) -> None:
        """We published `key` on the master: our predecessor's lingering session counts it if its
        patterns (those our clients hold again) match it, and it never comes back to us (echo
        off): not a loss either."""
        session = proto.claim
        if session is not None and session.counting and self.factory.router.match(key):
            session.sent(key)

    def _claimed(self, reply, proto: UpstreamProtocol) -> None:
        if reply is None:
            return  # gone, or a master that does not know server/session (it never answers)
        name = reply.name.decode("utf-8", "replace")
        if reply.state in ("busy", "refused"):
            # busy: another live connection of our uid holds our name (a second relay of this
            # socket cannot serve; a stale copy of us being closed): not retried, said once.
            if self._session_state != reply.state:
                log.warn("sbus-relay: the master answered {state} to our session {name!r}: a gap of ours "
                         "is not counted there", state=reply.state, name=name)
            self._session_state = reply.state
            return
        self._session_state = reply.state
        self.client.gapEnded(reply.state != "new", reply.name)
        reason = "reconnect" if self._held_before else "restart"
        self._held_before = True
        if reply.state == "new":
            log.info("sbus-relay: holding session {name!r} on the master (lingers {linger:.3f} s after "
                     "we go)", name=name, linger=reply.linger)
            return
        lost_now = proto.claim.lost
        self.gap_lost[reason] += lost_now
        self.last_session_gap = proto.claim.uncovered
        log.info("sbus-relay: resumed session {name!r} on the master after a gap of {gap:.3f} s "
                 "({away:.3f} s of it before we were connected): {missed} message(s) for our "
                 "subscriptions meanwhile, {seen} of them reached us, {lost} lost ({reason}){carried}",
                 away=proto.claim.uncovered, name=name, gap=reply.gap, missed=reply.missed,
                 seen=proto.claim.seen, lost=lost_now, reason=reason, carried=carried_note(reply))
        proto.claim.confirm()

    def _sessionStats(self) -> dict | None:
        if self.session_linger <= 0:
            return None
        up = self.up
        session = up.claim if up is not None else None
        reply = session.reply if session is not None else None
        return {"name": self.session_name.decode("utf-8", "replace"),
                "state": reply.state if reply is not None else None,
                "missed": reply.missed if reply is not None else 0,
                "seen": session.seen if session is not None else 0,
                "last_gap_seconds": self.last_session_gap}

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
    listener = None
    if parse_address(options["socket"]).kind == "systemd":
        # taken now: systemd's variables say it is ours only while nothing else has read them
        from sbus.server.address import open_listener
        try:
            listener = open_listener(options["socket"], options["mode"], bool(options["reuse"]))
        except AddressError as e:
            raise StartupError(str(e)) from None
    if parse_address(options["socket"]).kind == "path" and os.path.exists(options["bus"]):
        wider = _wider_than_master(options["mode"], options["bus"])
        if wider:
            raise StartupError(f"--mode: {wider}")
    return Relay(
        options["bus"],
        options["socket"],
        tap.config_from_options(options),
        mode=options["mode"],
        reuse=bool(options["reuse"]),
        initialDelay=options["initial-delay"],
        maxDelay=options["max-delay"],
        session_linger=options["session-linger"],
        listener=listener,
    )
