"""``twistd sbus-bridge``: join two buses, forwarding what the rules select.

    twistd -n sbus-bridge --bus-a /run/user/1000/sbus.socket --bus-b /run/user/1001/sbus.socket \\
        --rule 'share/ both' \\
        --rule 'sensors/ a>b "" alice/' \\
        --rule 'cmd/ b>a alice/ bob/'

The bridge is an ordinary client of each bus (side ``a`` and side ``b``).
Run as root, it connects to each side *as that side's user* (the owner of
the socket's directory, or ``--a-user``/``--b-user``), through a helper
process that drops to that user first and never follows a symlink it does
not own (`sbus.services.safeconnect`): a user who points their socket path
at someone else's bus gets ``Permission denied``, not the other bus.

Rules
-----

A rule is ``PATTERN DIRECTION [A_PREFIX B_PREFIX]`` (split like a shell line,
so ``''`` or ``""`` is an empty prefix):

* ``DIRECTION`` is ``a>b``, ``b>a`` or ``both``;
* the prefixes work like the local/remote prefixes of Mosquitto's bridge
  ``topic`` lines, and are always written **A side first, B side second**,
  whatever the direction. The bridge subscribes to ``A_PREFIX + PATTERN`` on
  bus A (for ``a>b``/``both``) and to ``B_PREFIX + PATTERN`` on bus B (for
  ``b>a``/``both``); a key ``A_PREFIX + rest`` taken from A is published on B
  as ``B_PREFIX + rest``, and a key ``B_PREFIX + rest`` taken from B is
  published on A as ``A_PREFIX + rest``. Without prefixes keys cross
  unchanged (and the packet is forwarded byte for byte).

Examples: ``sensors/ a>b '' site1/`` sends A's ``sensors/t`` to B as
``site1/sensors/t``; ``'' both alice/ bob/`` maps all of A's ``alice/...`` to
B's ``bob/...`` and back.

A message matched by several rules of the same direction is forwarded once
per distinct resulting key (so two overlapping rules without rewrite forward
it once). A prefix may not contain ``*`` (it is cut off literally).

Secret keys
-----------

Keys starting with ``!/cred/`` are never forwarded unless the rule's source
pattern (prefix + pattern) itself starts with ``!/cred/``. The bridge can only
ever receive its own secret keys anyway (the server enforces that), so such a
rule means "what is sent privately to the bridge on A goes to ... on B".
Empty credential fields in a source prefix are filled in with the bridge's own
ids, as the server does for patterns (``!/cred////inbox/``).

Why nothing loops
-----------------

By construction: the bridge has exactly one connection per bus and switches
echo off on both (``CMSG echo/off`` is sent, in order, before anything is
published on that connection). A message it publishes on bus B is therefore
never delivered back to its own B connection, whatever rules and rewrites
match there: only messages published by *other* clients of a bus enter the
bridge. So a ``both`` rule, or an ``a>b`` rule whose rewritten keys match a
``b>a`` rule, cannot bounce a message back and forth, and every message
crosses at most once.

Because a server may ignore ``echo/off`` (the protocol allows it), each
new connection checks it: the bridge subscribes to a private (secret) key
of its own, publishes on it and round-trips a whoami. If the probe came back,
echo off is not honoured, and the bridge falls back to remembering the
packets it published on that connection (a bounded multiset, a few seconds)
and dropping them when the server echoes them back. Until the probe answers,
that memory is on, so there is no window either.

What this does not prevent is a loop through *several* bridges (A-B, B-C,
C-A with overlapping rules): each bridge only knows its own two buses. Do
not build cycles, or give each hop a disjoint key prefix.

Standing by, taking over
------------------------

While the spanning tree keeps this bridge standing by (another path joins
its buses), it forwards nothing but watches: `sbus.core.standby.Window`
pairs what it sees on one side with the active path's copy arriving on the
other. When the tree makes it forward, it waits until no server says the
role's session is ``closing`` (``server/session-held``: the dead active's
writes still unread there, held by flood control), reads both servers up to a
whoami round trip, forwards what the old path had not delivered, in order,
and then everything new. The assumptions (identical messages, the window's bounds,
100,000 messages and 64 MiB) and their counters (``failover_gap``,
``skipped_by_active``) are in docs/deploy.md, "Failover without loss".

Restarted: the gap counted
--------------------------

On each side the bridge holds a ``server/session`` named after its role (the side, both
addresses, the rules: `BridgeService.roleName`), so the same command started again claims the
same one. When it dies its patterns linger on each bus, counting what they match. A bridge
claims only once it forwards and the other side's server has read its window (a round trip
behind it: the claim's answer ends the count, so nothing it counts as passed on may still wait
in the bridge, where a kill would lose it uncounted); the gap's loss is what the session
counted less what this connection received, or published there itself, before the claim
(`sbus.services.session.SessionClaim`): exact whenever the claim comes, and 0 for a standby
that watched the whole gap. It goes to ``lost.restart`` (``reconnect``: our own connection
broke and came back) with one log line giving the gap. A second live bridge of the role gets
``busy`` and asks again every `SESSION_RETRY` seconds while it forwards; a standby holds no
session, since the active path loses nothing when it dies.

Reconnection, back-pressure, statistics
---------------------------------------

Each side is a `ReconnectingClient`: it reconnects independently with
back-off and re-subscribes; while one side is down, messages for it are
dropped and counted (a bus keeps nothing for absent clients). When the
connection to one side has more than `MAX_UNSENT` messages waiting (its socket
is full), the bridge stops reading from the other side until it drains; the
other server then applies its own flood control to the bridge. What waits
there is counted by our session if we are killed; what waits in the bridge
would be lost with nobody counting it, so the bridge holds little.

A stats line is logged every ``--stats-interval`` seconds (if anything
changed) and at stop: messages forwarded each way, reconnects per side,
drops (other side down, rewritten key invalid or too long for a packet),
secret keys filtered, what the active path delivered while we stood by,
what we forwarded from the window at takeover, the failover gap, and what a restart's gap
lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from collections import Counter, deque
from dataclasses import dataclass

from twisted.application import service
from twisted.internet import defer
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python import usage

from sbus.core import codec
from sbus.core.codec import MAX_PACKET, ProtocolError
from sbus.core.credentials import SECRET_ROOT, CredentialError, check_key
from sbus.core.patterns import matches
from sbus.core.standby import MAX_MESSAGES, Window, parse_size
from sbus.core.topology import RESERVED as TOPOLOGY
from sbus.options import METRICS_OPTION, MISSING_BUS_HELP, RespelledOptions
from sbus.services.safeconnect import OwnerConnector, parse_user
from sbus.services.session import DEFAULT_LINGER, SessionClaim, carried_note, session_name, held_states
from sbus.services.shutdown import exit_zero_on_sigterm, stop_with_status
from sbus.services.spanning import PRIVATE_PATTERN, Tree, default_name, opt_trust_uid, send_urgent
from sbus.services.svcstats import STATS_REQUEST, StatsResponder, lost, unknown_gaps

SERVER_ID = b"server/id"

log = Logger(namespace="sbus.bridge")

DIRECTIONS = ("a>b", "b>a", "both")
SIDES = ("a", "b")
OTHER = {"a": "b", "b": "a"}
PORT = {"a": 1, "b": 2}
SIDE_OF_PORT = {1: "a", 2: "b"}
PROBE_SEGMENT = b"/sbus-bridge/echo-probe/"
#: While we forward and another live bridge of our role holds the session, ask again this often.
SESSION_RETRY = 0.5
#: Messages we hold unsent for one side (its socket is full) before we stop reading the other:
#: a kill -9 loses what a bridge holds, counted by nobody (a lingering session counts only what
#: the server still had), so we hold little; the kernel's socket buffer keeps the flow going.
MAX_UNSENT = 64
#: Taking over while a server has not yet read what the old active path wrote to it (its
#: connection closed, its session ``closing``: flood control holds it paused): ask again this
#: often, and go on after at most `RELEASE_WAIT` seconds (``--takeover-wait``; the servers'
#: default ``--stall-timeout``, after which whoever holds it is disconnected, and a little more),
#: saying duplicates may come.
RELEASE_POLL = 0.1
RELEASE_WAIT = 35.0
#: Seconds at least that a bridge knows the late copies of a takeover window it forwarded into a
#: side still holding the old path's writes (`_replay`): the server's default stall timeout.
HELD_COPIES_AGE = 30.0
#: Why a session's gap was lost: this process's first connection to a side (a restart), or a
#: later one (our connection to that side broke while its server stayed up).
GAP_REASONS = ("restart", "reconnect")


class RuleError(ValueError):
    """A rule that cannot be parsed; `str()` is one line."""


def _b(text) -> bytes:
    return os.fsencode(text) if isinstance(text, str) else bytes(text)


@dataclass(frozen=True)
class Rule:
    pattern: bytes
    direction: str
    a_prefix: bytes = b""
    b_prefix: bytes = b""

    def routes(self):
        """(source side, subscription pattern, source prefix, destination prefix) per direction."""
        prefix = {"a": self.a_prefix, "b": self.b_prefix}
        for src in SIDES:
            if self.direction in (f"{src}>{OTHER[src]}", "both"):
                yield src, prefix[src] + self.pattern, prefix[src], prefix[OTHER[src]]

    def __str__(self):
        parts = [self.pattern, self.direction.encode()]
        if self.a_prefix or self.b_prefix:
            parts += [self.a_prefix, self.b_prefix]
        return " ".join(shlex.quote(os.fsdecode(p)) for p in parts)


def parse_rule(text: str) -> Rule:
    """Parse ``PATTERN DIRECTION [A_PREFIX B_PREFIX]``; raise `RuleError`."""
    try:
        words = shlex.split(text, comments=False, posix=True)
    except ValueError as e:
        raise RuleError(f"rule {text!r}: {e}") from None
    if len(words) not in (2, 4):
        raise RuleError(f"rule {text!r}: expected 'PATTERN DIRECTION [A_PREFIX B_PREFIX]'")
    pattern, direction = _b(words[0]), words[1].lower()
    if direction not in DIRECTIONS:
        raise RuleError(f"rule {text!r}: direction must be one of a>b, b>a, both, not {words[1]!r}")
    a_prefix, b_prefix = (_b(w) for w in words[2:]) if len(words) == 4 else (b"", b"")
    for what, value in (("pattern", pattern), ("A prefix", a_prefix), ("B prefix", b_prefix)):
        if b"\0" in value:
            raise RuleError(f"rule {text!r}: {what} contains a NUL")
    for what, value in (("A prefix", a_prefix), ("B prefix", b_prefix)):
        if b"*" in value:
            raise RuleError(f"rule {text!r}: {what} may not contain '*'")
    return Rule(pattern, direction, a_prefix, b_prefix)


@dataclass
class Route:
    """One direction of one rule, as seen from its source side."""

    pattern: bytes       # subscribed on the source bus
    src_prefix: bytes
    dst_prefix: bytes
    secret: bool         # the rule names !/cred/ explicitly

    @property
    def rewrites(self) -> bool:
        return self.src_prefix != self.dst_prefix


class RecentPackets:
    """A bounded multiset of packets published lately (only for servers that ignore echo/off).

    `take` consumes a packet's oldest copy, which stays in the age order until its time runs
    out: `_taken` counts, per packet, such consumed entries at the front of its copies, so that
    their expiry (or eviction at `max_items`) costs no newer identical copy its place."""

    def __init__(self, max_items: int = 8192, max_age: float = 10.0, clock=time.monotonic):
        self.max_items = max_items
        self.max_age = max_age
        self.clock = clock
        self._counts: dict[bytes, int] = {}
        self._taken: dict[bytes, int] = {}
        self._order: deque = deque()

    def __len__(self):
        return len(self._order)

    def add(self, packet: bytes) -> None:
        now = self.clock()
        self._expire(now)
        if len(self._order) >= self.max_items:
            self._drop(self._order.popleft()[1])
        self._order.append((now, packet))
        self._counts[packet] = self._counts.get(packet, 0) + 1

    def take(self, packet: bytes) -> bool:
        """True (and forget one copy, the oldest) if `packet` was published lately (within
        `max_age`)."""
        self._expire(self.clock())
        n = self._counts.get(packet)
        if not n:
            return False
        _decrement(self._counts, packet)
        self._taken[packet] = self._taken.get(packet, 0) + 1
        return True

    def _drop(self, packet: bytes) -> None:
        """The oldest entry of `packet` leaves the age order: a copy taken already, or a live one."""
        _decrement(self._taken if self._taken.get(packet) else self._counts, packet)

    def _expire(self, now: float) -> None:
        order = self._order
        while order and now - order[0][0] > self.max_age:
            self._drop(order.popleft()[1])


def _decrement(counts: dict, key) -> None:
    n = counts.get(key, 0)
    if n <= 1:
        counts.pop(key, None)
    else:
        counts[key] = n - 1


class _Pauser:
    """IPushProducer registered on one side's transport, pausing reads from the other side.

    `stopProducing` (the destination connection went away) only resumes the
    source: losing one side must never close the other.
    """

    def __init__(self, bridge: "BridgeService", source: str):
        self.bridge = bridge
        self.source = source

    def pauseProducing(self):
        self.bridge._paused[self.source] = True
        self.bridge._pausedCount[self.source] += 1
        if self.bridge.tree is not None:
            self.bridge.tree.paused(PORT[self.source], True)
        proto = self.bridge.clients[self.source].protocol
        if proto is not None and proto.transport is not None:
            proto.transport.pauseProducing()

    def resumeProducing(self):
        self.bridge._paused[self.source] = False
        if self.bridge.tree is not None:
            self.bridge.tree.paused(PORT[self.source], False)
        proto = self.bridge.clients[self.source].protocol
        if proto is not None and proto.transport is not None:
            proto.transport.resumeProducing()

    def stopProducing(self):
        self.resumeProducing()


class BridgeService(service.Service):
    name = "sbus-bridge"

    def __init__(self, a, b, rules: list[Rule], *, stats_interval: float = 60.0,
                 initial_delay: float = 0.1, max_delay: float = 10.0,
                 max_packet: int = MAX_PACKET, reactor=None, users: dict | None = None,
                 spanning_tree: bool = True, trusted_uids=(), standby_window: int = MAX_MESSAGES,
                 session_linger: float = DEFAULT_LINGER, takeover_wait: float = RELEASE_WAIT):
        if not rules:
            raise ValueError("a bridge needs at least one rule")
        self.address = {"a": a, "b": b}
        #: uids whose bridges and links we believe on the buses (besides ours and root)
        self.trusted_uids = tuple(trusted_uids)
        #: Run as root, each side is connected as its user (sbus.services.safeconnect).
        self.connectors = {side: OwnerConnector((users or {}).get(side)) for side in SIDES}
        self.rules = list(rules)
        self.stats_interval = stats_interval
        self.initial_delay = initial_delay
        self.max_delay = max_delay
        self.max_packet = max_packet
        self._reactor = reactor
        self.routes: dict[str, list[Route]] = {"a": [], "b": []}
        for rule in self.rules:
            for src, pattern, src_prefix, dst_prefix in rule.routes():
                self.routes[src].append(Route(pattern, src_prefix, dst_prefix,
                                              pattern.startswith(SECRET_ROOT)))
        self.clients: dict = {}
        self.forwarded = {"a": 0, "b": 0}        # by source side: a -> b, b -> a
        self.dropped = {"a": 0, "b": 0}          # by source side
        self.secret_filtered = 0
        self.echoes_suppressed = 0
        self.old_path_copies = {side: 0 for side in SIDES}
        self.connects = {"a": 0, "b": 0}
        self._paused = {"a": False, "b": False}
        self._pausedCount = {"a": 0, "b": 0}
        #: Why messages were not forwarded, by source side: side_down (the other side is not
        #: connected), bad_key (the rewritten key is invalid or too long).
        self.drop_reasons = {"a": Counter(), "b": Counter()}
        #: Standing by: what we saw on one side that the active path has not yet delivered on the
        #: other (sbus.core.standby); forwarded when we take over. Armed once both sides are
        #: connected and have answered a round trip.
        self.window = Window(SIDES, max_messages=standby_window)
        self._ready = {"a": False, "b": False}
        #: Messages seen while standing by before the window was armed (a side just connected).
        self.unwatched = {"a": 0, "b": 0}
        #: Taking over: the round trips on both sides are under way (nothing forwarded yet).
        self._catching_up = False
        self._takeovers = 0
        self.spanning_tree = spanning_tree
        #: ``server/session`` (docs/deploy.md, "Restarted: its gap counted"): seconds it lingers
        #: (0: none); per side, its name, whether this process held it before, what the gaps lost.
        self.session_linger = session_linger
        #: Seconds a takeover waits for a server to read the dead active's writes (`_catchUp`).
        self.takeover_wait = takeover_wait
        self.session_names = {side: self.roleName(side) for side in SIDES}
        self._held_before = {"a": False, "b": False}
        self.gap_lost = {reason: {"a": 0, "b": 0} for reason in GAP_REASONS}
        self.last_gap: dict[str, float | None] = {"a": None, "b": None}
        self._session_logged: dict[str, str | None] = {"a": None, "b": None}
        self._retry = None
        #: The next `_catchUp` round while a server still reads the old active's writes.
        self._release = None
        self._public_patterns: dict[str, list[bytes]] = {"a": [], "b": []}
        self.tree = None
        self.server_ids: dict[str, bytes] = {}
        self._loop = None
        self._last_stats = None

    @property
    def reactor(self):
        if self._reactor is None:
            from twisted.internet import reactor
            self._reactor = reactor
        return self._reactor

    @property
    def reconnects(self) -> dict[str, int]:
        return {s: max(0, n - 1) for s, n in self.connects.items()}

    # -- life cycle

    def startService(self):
        from sbus.client.twisted import ReconnectingClient, SbusProtocol

        super().startService()
        bridge = self

        def protocol_factory(side):
            class BridgeProtocol(SbusProtocol):
                echo_filter: RecentPackets | None = None
                held_copies: RecentPackets | None = None
                claim: SessionClaim | None = None
                probe_key: bytes | None = None
                probe_seen = False
                pauser: "_Pauser | None" = None

                def messageReceived(self, key, payload, packet):
                    bridge._received(side, self, key, payload, packet)

                def outboxDrained(self):
                    bridge.outboxDrained(self)

                def readBatchDone(self):
                    bridge.handedOn(side)

            return BridgeProtocol

        class Client(ReconnectingClient):
            def __init__(self, side, *args, **kw):
                super().__init__(*args, **kw)
                self.side = side

            def connectionMade(self, protocol):
                bridge._connected(self.side, protocol)

            def connectionLost(self, reason):
                bridge._lost(self.side, reason)

            def connectionFailed(self, reason):
                if self.failureIsNews:
                    bridge.sideFailed(self.side, self.lastFailure)

        for side in SIDES:
            client = Client(side, self.reactor, self.address[side], protocol_factory(side),
                            initialDelay=self.initial_delay, maxDelay=self.max_delay,
                            max_packet=self.max_packet, connector=self.connectors[side], watch=True)
            # Lossless: when we stop reading this side (the other is slow), its server holds the
            # publishers instead of discarding what waits for us.
            client.flood(hard="block")
            client.subscribe(TOPOLOGY)
            if self.spanning_tree:
                client.subscribe(PRIVATE_PATTERN)  # <our whoami>/sbus-topology/...: proven peers
            client.subscribe(STATS_REQUEST)
            seen = set()
            for route in self.routes[side]:
                if route.pattern not in seen:  # one SUB per distinct pattern
                    seen.add(route.pattern)
                    client.subscribe(route.pattern)
            #: The public patterns we hold on this side (what our session counts there).
            self._public_patterns[side] = [TOPOLOGY, STATS_REQUEST, *seen]
            client.echo(False)
            client.missesUncounted = self.session_linger <= 0   # no session: every reconnect a gap
            self.clients[side] = client
        self.tree = Tree(self.reactor, default_name("sbus-bridge", f"a={self.address['a']} b={self.address['b']}"),
                         {1: "a", 2: "b"}, self._sendTree, log, enabled=self.spanning_tree,
                         trusted_uids=self.trusted_uids, on_change=self._forwardingChanged)
        self.tree.start()
        self.responder = StatsResponder("sbus-bridge", self.tree.node.name, self.stats, self._publicStats)
        for rule in self.rules:
            log.info("rule: {rule}", rule=str(rule))
        for side in SIDES:
            log.info("side {side}: {addr}, subscribing {n} pattern(s)", side=side,
                     addr=self.address[side] or "(default address)",
                     n=len({r.pattern for r in self.routes[side]}))
            self.clients[side].start()
        self._loop = LoopingCall(self._report, False)
        self._loop.clock = self.reactor
        self._loop.start(self.stats_interval, now=False)
        if self.session_linger > 0:
            self._retry = LoopingCall(self._retryClaims)
            self._retry.clock = self.reactor
            self._retry.start(SESSION_RETRY, now=False)
        exit_zero_on_sigterm(self.reactor)

    def stopService(self):
        super().stopService()
        for loop in (self._loop, self._retry):
            if loop is not None and loop.running:
                loop.stop()
        if self._release is not None and self._release.active():
            self._release.cancel()
        if self.tree is not None:
            self.tree.stop()
        ds = [c.stop() for c in self.clients.values()]

        def stopped(_):
            for connector in self.connectors.values():
                connector.release()
            self._report(True)

        return defer.DeferredList(ds, consumeErrors=True).addCallback(stopped)

    # -- connections

    def _sendTree(self, port: int, key: bytes, payload: bytes) -> None:
        proto = self.clients[SIDE_OF_PORT[port]].protocol
        if proto is not None and proto.connected:
            send_urgent(proto.transport, b"MSG " + key + b"\0" + payload)
            self._published(proto, SIDE_OF_PORT[port], key)

    def _serverId(self, side: str, proto, payload) -> None:
        if not payload or proto is not self.clients[side].protocol:
            return
        self.server_ids[side] = payload
        other = self.server_ids.get(OTHER[side])
        if other == payload and self.clients[OTHER[side]].connected:
            log.critical("refusing to bridge a bus to itself: side a ({a}) and side b ({b}) are the same "
                         "bus (server/id {id}); stopping", a=self.address["a"], b=self.address["b"],
                         id=payload.decode("ascii", "replace"))
            self.refused = True
            stop_with_status(self.reactor, 1)

    refused = False

    def _connected(self, side: str, proto) -> None:
        self.connects[side] += 1
        other = OTHER[side]
        self.server_ids.pop(side, None)
        try:
            proto.server_request(SERVER_ID).addCallbacks(lambda p: self._serverId(side, proto, p), lambda f: None)
        except Exception:
            pass
        proto.echo_filter = RecentPackets()  # until the probe shows echo/off is honoured
        # back-pressure: when this side's queue is full, stop reading the other side
        proto.pauser = _Pauser(self, other)
        proto.transport.registerProducer(proto.pauser, True)
        if self._paused[side]:
            proto.transport.pauseProducing()
        who = proto.credentials or b""
        if self.session_linger > 0:
            proto.claim = SessionClaim(proto, self.session_names[side], self.session_linger)
        what = "connected" if self.connects[side] == 1 else f"reconnected (reconnect {self.connects[side] - 1})"
        if self.connectors[side].last_why:
            log.info("side {side}: connected {how}", side=side, how=self.connectors[side].last_why)
        if SECRET_ROOT not in who:
            log.warn("side {side}: {what} to {addr}; no usable whoami, cannot check echo/off",
                     side=side, what=what, addr=self.address[side])
            self.tree.port_up(PORT[side], proto.credentials)   # no round trip: no window either
            self._claim(side)
            return
        def bridge_ready():
            if proto is self.clients[side].protocol and proto.connected:
                self._sideReady(side)

        proto.probe_key = who + PROBE_SEGMENT + os.urandom(6).hex().encode()
        try:
            proto.subscribe(proto.probe_key)
            proto.publish(proto.probe_key, b"")
        except Exception:
            return   # the connection is going away: _lost follows

        def probed(_):
            try:
                proto.unsubscribe(proto.probe_key)
            except Exception:
                pass
            bridge_ready()
            if proto.probe_seen:
                log.warn("side {side}: the server ignores echo/off; suppressing echoes of our own "
                         "publishes by memory", side=side)
            else:
                proto.echo_filter = None
            log.info("side {side}: {what} to {addr} as {who}; subscribed, echo off; ready",
                     side=side, what=what, addr=self.address[side],
                     who=who.decode("utf-8", "replace"))

        proto.sync().addCallbacks(probed, lambda f: None)

    def sideFailed(self, side: str, what: str) -> None:
        """A connect attempt failed, with another error than the one before (`what`: the full
        address and why): said once, the retries are quiet."""
        log.warn("side {side}: cannot connect to {what}; retrying quietly with back-off",
                 side=side, what=what)

    def _lost(self, side: str, reason) -> None:
        self.connectors[side].release()
        self._ready[side] = False
        self.window.reset()
        self.server_ids.pop(side, None)
        if self.tree is not None:
            self.tree.port_down(PORT[side])
        if self.running:
            log.warn("side {side}: lost the connection to {addr} ({why}); reconnecting",
                     side=side, addr=self.address[side], why=reason)

    # -- forwarding

    def _received(self, side: str, proto, key: bytes, payload: bytes, packet: bytes) -> None:
        session = proto.claim
        if session is not None and session.counting and not self._unwatched(side):
            session.saw(key)   # passed on, or counted here: not lost to a predecessor's gap
        if key.startswith(TOPOLOGY) or self.tree.owns(PORT[side], key):
            self.tree.received(PORT[side], key, payload)
            return  # never forwarded: each segment's hellos are its own
        if key == STATS_REQUEST:
            answer = self.responder.answer(payload, proto.credentials)
            if answer is not None and proto.connected:
                proto.sendPacket(answer)
            return
        if proto.probe_key is not None and key == proto.probe_key:
            proto.probe_seen = True
            return
        if not self.tree.forwarding or self._catching_up:
            if not self.clients[OTHER[side]].connected:
                self.dropped[side] += 1
                self.drop_reasons[side]["side_down"] += 1
            else:
                # Until both sides answered a round trip we may miss one sighting of what arrives:
                # it is only paired, never forwarded (sbus.core.standby).
                watched = self._ready[side] and self._ready[OTHER[side]]
                if not watched:
                    self.unwatched[side] += 1
                self.window.seen_on(side, key, payload, self._targets(side, proto, key)[0], watched)
            return
        if proto.echo_filter is not None and proto.echo_filter.take(packet):
            self.echoes_suppressed += 1
            return
        held = proto.held_copies
        if held is not None:
            if held.take(packet):
                self.old_path_copies[OTHER[side]] += 1   # its original came from there: never back
                return
            if not held:
                proto.held_copies = None   # expired: a packet like one of them is its own again
        targets, filtered = self._targets(side, proto, key)
        if not targets:
            if filtered:
                self.secret_filtered += 1
            return
        for target in targets:
            self._forward(side, key, target, payload, packet)

    def _unwatched(self, side: str) -> bool:
        """A message from `side` now would be neither forwarded nor watched nor counted as
        dropped: standing by (or catching up) before both sides answered their round trip."""
        return ((not self.tree.forwarding or self._catching_up) and self.clients[OTHER[side]].connected
                and not (self._ready[side] and self._ready[OTHER[side]]))

    def _targets(self, side: str, proto, key: bytes) -> tuple[list[bytes], bool]:
        """The keys a message `key` from `side` is published as on the other side, and whether a
        rule matched that a secret key may not cross."""
        secret = key.startswith(SECRET_ROOT)
        targets: list[bytes] = []
        filtered = False
        match = proto.stored_pattern
        for route in self.routes[side]:
            if not matches(match(route.pattern), key):
                continue
            if secret and not route.secret:
                filtered = True
                continue
            src = match(route.src_prefix) if route.secret else route.src_prefix
            if not key.startswith(src):
                continue
            target = route.dst_prefix + key[len(src):]
            if target not in targets:
                targets.append(target)
        return targets, filtered

    def _forward(self, side: str, key: bytes, target: bytes, payload: bytes, packet: bytes | None) -> bool:
        """Publish one message from `side` as `target` on the other side (`packet`: the original
        packet, reused when the key is unchanged)."""
        if target == key and packet is not None:
            out = packet
        else:
            try:
                check_key(target)
                out = codec.encode_msg(target, payload, self.max_packet)
            except (CredentialError, ProtocolError) as e:
                self.dropped[side] += 1
                self.drop_reasons[side]["bad_key"] += 1
                log.warn("side {side}: not forwarding {key!r} as {target!r}: {err}",
                         side=side, key=key, target=target, err=e)
                return False
        dest = self.clients[OTHER[side]].protocol
        if dest is None or not dest.connected:
            self.dropped[side] += 1
            self.drop_reasons[side]["side_down"] += 1
            return False
        if dest.echo_filter is not None:
            dest.echo_filter.add(out)
        dest.sendPacket(out)
        self.forwarded[side] += 1
        self._published(dest, OTHER[side], target)
        if dest.transport.queued() > MAX_UNSENT and not self._paused[side]:
            dest.pauser.pauseProducing()   # the rest waits in `side`'s server, which counts it
        return True

    def outboxDrained(self, dest) -> None:
        """`dest` sent all it held: read again from the side we stopped for it (`_forward`)."""
        if dest.pauser is not None:
            if self._paused[dest.pauser.source]:
                dest.pauser.resumeProducing()
            self.handedOn(dest.pauser.source)

    def handedOn(self, side: str) -> None:
        """Tell `side`'s server that all we read from it has left this process (forwarded into
        the other server's socket, or dropped and counted here), so a kill -9 from now on is
        counted by its session, our kernel buffer's share too (`server/session-ack`). While
        some waits in our queue toward the other side, we tell it when that queue drains."""
        proto = self.clients[side].protocol
        if proto is None or proto.claim is None:
            return
        dest = self.clients[OTHER[side]].protocol
        if dest is not None and dest.connected and dest.transport.queued():
            return
        proto.claim.acknowledge()

    # -- standing by and taking over

    def _sideReady(self, side: str) -> None:
        """`side` is connected, subscribed and answered a round trip: the window may watch it, and
        only now does the tree hear of the port (so we never forward, nor make another bridge
        stand by, before the window watches both sides)."""
        self._ready[side] = True
        proto = self.clients[side].protocol
        self.tree.port_up(PORT[side], proto.credentials)
        self._claim(side)

    def _forwardingChanged(self, forwarding: bool) -> None:
        if not forwarding:
            if self._catching_up:
                self._catching_up = False   # back to standing by: the window stays as it is
            else:
                self.window.reset()         # a fresh window from the moment we stand by
            return
        if not (self._ready["a"] and self._ready["b"]):
            for side in SIDES:    # nothing watched (the window is empty): forward from now on
                self._claim(side)
            return
        # Read everything both servers delivered up to one moment after the old path stopped
        # before forwarding the window: then every copy it made has met its original
        # (sbus.core.standby).
        self._catching_up = True
        self._takeovers += 1
        self._catchUp(self._takeovers, self.reactor.seconds() + self.takeover_wait, set())

    def _catchUp(self, generation: int, deadline: float, waited: set) -> None:
        """One round of the catch-up: on each side, is our role's session still ``closing``
        (`codec.SESSION_HELD`: the old active's connection is gone but the server has not read
        all it wrote, e.g. held paused by a hard/block subscriber), then a round trip. Replay
        once no side is closing (its writes are routed, its copies have met their originals),
        or past `deadline`; else ask again in `RELEASE_POLL` s. `waited`: the sides said so."""
        self._release = None
        if generation != self._takeovers or not self._catching_up:
            return
        protos = {side: self.clients[side].protocol for side in SIDES}
        try:
            d = held_states({side: (proto, self.session_names[side]) for side, proto in protos.items()})
        except Exception:
            d = defer.fail(ConnectionError("a side went away"))

        def answered(states):
            if generation != self._takeovers or not self._catching_up:
                return
            live = sorted(side for side, state in states.items() if state == codec.HELD_LIVE
                          and not (protos[side].claim is not None and protos[side].claim.holds))
            if live and self.spanning_tree:
                # Another live bridge of our role carries the flow (it claimed the session after
                # its own takeover); its hellos have not reached us yet, e.g. queued behind its
                # takeover's backlog. Forwarding now would deliver everything twice: we wait
                # until it lets go (killed: closing, then free) or the tree makes us stand by.
                if "live" not in waited:
                    waited.add("live")
                    log.warn("taking over: another live bridge of this role holds the session of side(s) "
                             "{sides} (it carries the flow; its hellos have not reached us yet): not "
                             "forwarding until it lets go", sides=",".join(live))
                self._release = self.reactor.callLater(RELEASE_POLL, self._catchUp, generation, deadline, waited)
                return
            closing = sorted(side for side, state in states.items() if state == codec.HELD_CLOSING)
            if closing and self.reactor.seconds() < deadline:
                for side in set(closing) - waited:
                    waited.add(side)
                    log.info("taking over: side {side}'s server has not yet read what the old active "
                             "path wrote to it (its session is closing); waiting up to {s:g} s for it",
                             side=side, s=self.takeover_wait)
                self._release = self.reactor.callLater(RELEASE_POLL, self._catchUp, generation, deadline, waited)
                return
            if closing:
                log.warn("taking over: side(s) {sides} still hold the old active path's writes unread "
                         "after {s:g} s; forwarding the window now: messages it wrote there may arrive "
                         "twice", sides=",".join(closing), s=self.takeover_wait)
            self._catching_up = False
            if not self.tree.forwarding:
                return
            self._replay(closing)

        def failed(f):
            if generation == self._takeovers:
                self._catching_up = False
                self.window.reset()   # a side went away: _lost counted what it could

        d.addCallbacks(answered, failed)

    def _replay(self, closing=()) -> None:
        """Forward the window. Into a `closing` side (its server still holds the dead active's
        writes unread: `--takeover-wait` ran out) copies of what we forward may come later, routed
        to us too: those we recognise (`held_copies`, `HELD_COPIES_AGE` or `--takeover-wait`) and
        never send back to the side they came from; its subscribers may get them twice, as the
        warning says."""
        out = self.window.drain()
        copies = {}
        for side in closing:
            proto = self.clients[side].protocol
            if proto is not None and proto.connected:
                # for as long as a server may still hold them: its stall timeout (30 s by default,
                # which --takeover-wait's default exceeds); a packet like one of them that a
                # client of that side publishes meanwhile would be taken for a copy
                copies[OTHER[side]] = proto.held_copies = RecentPackets(
                    max_items=max(1, len(out)), max_age=max(self.takeover_wait, HELD_COPIES_AGE))
        for src, target, payload in out:
            if self._forward(src, target, target, payload, None) and src in copies:
                copies[src].add(codec.encode_msg(target, payload, self.max_packet))
        gap = self.window.last_gap
        log.info("taking over: forwarded {n} message(s) the old path had not delivered "
                 "(a>b={ab} b>a={ba}); failover gap a>b={gab} b>a={gba}",
                 n=len(out), ab=sum(1 for s, _, _ in out if s == "a"), ba=sum(1 for s, _, _ in out if s == "b"),
                 gab=gap["a"], gba=gap["b"])
        for side in SIDES:    # what we saw is forwarded now: the gap before us is ours to count
            self._claimWhenDelivered(side)

    def _claimWhenDelivered(self, side: str) -> None:
        """Claim `side`'s session once the other side's server has read what we forwarded there at
        takeover (a round trip behind it). The claim's answer ends the count of the gap before
        us, less what we saw: killed while the window still waited in our queue, those would be
        lost with nobody counting them (a second kill right after a takeover). Killed before the
        claim, the predecessor's session goes on counting, over-counting at worst."""
        dest = self.clients[OTHER[side]].protocol
        if dest is None or not dest.connected:
            self._claim(side)
            return
        dest.sync().addBoth(lambda _: self._claim(side))

    # -- the session: what a predecessor's gap lost

    def roleName(self, side: str) -> bytes:
        """The ``server/session`` name of our connection to `side`: the same for every bridge
        started with the same buses and rules (our restarted successor), different for any
        other role. Sessions are per uid, so two users' bridges never meet."""
        from sbus.client.address import AddressError, resolve

        def canonical(address) -> str:
            try:
                r = resolve(address)
            except AddressError:
                return str(address)
            value = os.path.abspath(r.value) if r.kind == "path" else r.value
            return f"{r.kind}:{os.fsdecode(value) if isinstance(value, bytes) else value}"

        role = "\0".join([side, canonical(self.address["a"]), canonical(self.address["b"]),
                           *sorted(str(rule) for rule in self.rules)])
        digest = hashlib.sha256(role.encode("utf-8", "surrogateescape")).hexdigest()[:20]
        return session_name(f"sbus-bridge {side} {digest} a={self.address['a']} b={self.address['b']}")

    def _claim(self, side: str) -> None:
        """Claim our role's session on `side` once we forward and have forwarded what our window
        held: whoever carries the role after a gap judges what the gap lost (`SessionClaim`;
        claimed earlier, a kill before the window is out would lose it uncounted). A standby
        claims nothing: if it dies, the active path lost nothing."""
        proto = self.clients[side].protocol if side in self.clients else None
        if proto is None or proto.claim is None or not proto.connected or not self.tree.forwarding \
                or self._catching_up:
            return
        session = proto.claim
        if session.holds or session.pending:
            return
        session.claim().addCallback(self._claimed, side, proto)

    def _published(self, proto, side: str, key: bytes) -> None:
        """We published `key` on `side`: a predecessor's lingering session there counts it if
        its patterns (ours) match it, and we do not see it (echo off): not a loss either."""
        session = proto.claim
        if session is None or not session.counting:
            return
        match = proto.stored_pattern
        if any(matches(match(p), key) for p in self._public_patterns[side]):
            session.sent(key)

    def _retryClaims(self) -> None:
        for side in SIDES:
            proto = self.clients[side].protocol
            if proto is not None and proto.claim is not None and proto.claim.reply is not None \
                    and proto.claim.reply.state == "busy":
                self._claim(side)

    def _sessionLog(self, side: str, what: str, text: str, **kw) -> None:
        """Log a session's state once per state and side (a busy retry says it once)."""
        if self._session_logged[side] == what:
            return
        self._session_logged[side] = what
        (log.warn if what == "refused" else log.info)(text, side=side, **kw)

    def _claimed(self, reply, side: str, proto) -> None:
        if reply is None:
            if proto.connected:
                self._sessionLog(side, "unanswered", "side {side}: the server's answer to server/session "
                                 "is not one we understand: a gap of ours is not counted there")
            return
        name = reply.name.decode("utf-8", "replace")
        if reply.state == "busy":
            self._sessionLog(side, "busy", "side {side}: session {name!r} is held by another live bridge "
                             "of this role (same uid, buses and rules): it carries the count; asking "
                             "again every {s} s while we forward", name=name, s=SESSION_RETRY)
            return
        if reply.state == "refused":
            self._sessionLog(side, "refused", "side {side}: the server refused session {name!r} (see its "
                             "log): a gap of ours is not counted there", name=name)
            return
        if proto is self.clients[side].protocol:   # a restarted bus counted nothing for us: said, counted
            self.clients[side].gapEnded(reply.state != "new", reply.name)
        reason = "reconnect" if self._held_before[side] else "restart"
        self._held_before[side] = True
        self._session_logged[side] = reply.state
        if reply.state == "new":
            log.info("side {side}: holding session {name!r} (lingers {linger:.3f} s after we go)",
                     side=side, name=name, linger=reply.linger)
            return
        lost_now = proto.claim.lost
        self.gap_lost[reason][side] += lost_now
        self.last_gap[side] = proto.claim.uncovered
        log.info("side {side}: resumed session {name!r} after a gap of {gap:.3f} s ({away:.3f} s of it "
                 "before we subscribed): {missed} message(s) for it meanwhile, {seen} of them reached "
                 "us, {lost} lost ({reason}, {dir}){carried}", away=proto.claim.uncovered,
                 side=side, name=name, gap=reply.gap, missed=reply.missed, seen=proto.claim.seen,
                 lost=lost_now, reason=reason, dir=f"{side}>{OTHER[side]}", carried=carried_note(reply))
        proto.claim.confirm()

    def _sessionStats(self) -> dict:
        out = {}
        for side in SIDES:
            proto = self.clients[side].protocol if side in self.clients else None
            session = proto.claim if proto is not None else None
            reply = session.reply if session is not None else None
            out[side] = {"name": self.session_names[side].decode("utf-8", "replace"),
                         "state": reply.state if reply is not None else None,
                         "missed": reply.missed if reply is not None else 0,
                         "seen": session.seen if session is not None else 0,
                         "last_gap_seconds": self.last_gap[side]}
        return out

    # -- statistics

    def stats(self) -> dict:
        return {
            "forwarded": {"a>b": self.forwarded["a"], "b>a": self.forwarded["b"]},
            "reconnects": self.reconnects,
            "drops": {"a>b": self.dropped["a"], "b>a": self.dropped["b"]},
            "secret_filtered": self.secret_filtered,
            "echoes_suppressed": self.echoes_suppressed,
            "connected": {s: bool(c.connected) for s, c in self.clients.items()},
            "drop_reasons": {"a>b": dict(self.drop_reasons["a"]), "b>a": dict(self.drop_reasons["b"])},
            "standby_not_forwarded": self._byDirection(self.window.delivered),
            "standby": {
                "delivered_by_active": self._byDirection(self.window.delivered),
                "replayed_at_takeover": self._byDirection(self.window.replayed),
                "skipped_by_active": self._byDirection(self.window.skipped),
                "unwatched": self._byDirection(self.unwatched),
                "old_path_copies": self._byDirection(self.old_path_copies),
                "window": self.window.stats(),
            },
            "failover_gap": self._byDirection(self.window.gap),
            "restart": self._byDirection(self.gap_lost["restart"]),
            "reconnect": self._byDirection(self.gap_lost["reconnect"]),
            "session": self._sessionStats() if self.session_linger > 0 else None,
            "lost": lost(*self.drop_reasons.values(), {"failover_gap": self.window.gap}, self.gap_lost),
            "unknown_gaps": unknown_gaps(*self.clients.values()),
            "paused_reading": {s: self._pausedCount[s] for s in SIDES},
            "server_id": {s: v.decode("ascii", "replace") for s, v in self.server_ids.items()},
            "spanning_tree": self.tree.stats() if self.tree is not None else None,
        }

    @staticmethod
    def _byDirection(counts: dict) -> dict:
        return {"a>b": counts["a"], "b>a": counts["b"]}

    def _publicStats(self) -> dict:
        tree = self.tree.stats() if self.tree is not None else {}
        return {"connected": {s: bool(c.connected) for s, c in self.clients.items()},
                "forwarding": self.tree.forwarding if self.tree is not None else None,
                "spanning_tree_enabled": tree.get("enabled")}

    def _report(self, final: bool) -> None:
        st = self.stats()
        seen = {k: st[k] for k in ("forwarded", "reconnects", "drops", "secret_filtered", "echoes_suppressed",
                                    "connected", "standby_not_forwarded", "standby", "failover_gap",
                                    "restart", "reconnect")}
        seen["forwarding"] = self.tree is None or self.tree.forwarding
        if not final and seen == self._last_stats:
            return
        self._last_stats = seen
        log.info("{what}: forwarded a>b={ab} b>a={ba}; reconnects a={ra} b={rb}; drops a>b={dab} "
                 "b>a={dba}; secret filtered={sf}; echoes suppressed={es}; connected a={ca} b={cb}; "
                 "standing by, delivered by the active path a>b={sab} b>a={sba}; "
                 "replayed at takeover a>b={rab} b>a={rba}; "
                 "failover gap a>b={gab} b>a={gba}; "
                 "lost to a restart's gap a>b={lab} b>a={lba} (last gap a={pa} b={pb} s); "
                 "drop reasons {why}",
                 lab=st["restart"]["a>b"] + st["reconnect"]["a>b"], lba=st["restart"]["b>a"] + st["reconnect"]["b>a"],
                 pa=_seconds(self.last_gap["a"]), pb=_seconds(self.last_gap["b"]),
                 rab=st["standby"]["replayed_at_takeover"]["a>b"], rba=st["standby"]["replayed_at_takeover"]["b>a"],
                 gab=st["failover_gap"]["a>b"], gba=st["failover_gap"]["b>a"],
                 sab=st["standby_not_forwarded"]["a>b"], sba=st["standby_not_forwarded"]["b>a"],
                 why=json.dumps(st["drop_reasons"], separators=(",", ":")),
                 what="stopped" if final else "stats",
                 ab=st["forwarded"]["a>b"], ba=st["forwarded"]["b>a"],
                 ra=st["reconnects"]["a"], rb=st["reconnects"]["b"],
                 dab=st["drops"]["a>b"], dba=st["drops"]["b>a"], sf=st["secret_filtered"],
                 es=st["echoes_suppressed"],
                 ca="yes" if st["connected"]["a"] else "no", cb="yes" if st["connected"]["b"] else "no")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


# -- twistd options


def parse_config(path: str) -> tuple[dict, list[Rule]]:
    """Read a config file: lines ``a ADDRESS``, ``b ADDRESS``, ``rule PATTERN DIRECTION [A_PREFIX B_PREFIX]``.

    Blank lines and lines starting with ``#`` are ignored. Returns
    ({"a": ..., "b": ...}, rules); raises `RuleError` naming the line.
    """
    addresses: dict = {}
    rules = []
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for n, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            word, _, rest = text.partition(" ")
            rest = rest.strip()
            try:
                if word in ("a", "b"):
                    if not rest:
                        raise RuleError(f"'{word}' needs an address")
                    addresses[word] = rest
                elif word == "rule":
                    rules.append(parse_rule(rest))
                else:
                    raise RuleError(f"unknown keyword {word!r} (a, b or rule)")
            except RuleError as e:
                raise RuleError(f"{path}:{n}: {e}") from None
    return addresses, rules


class Options(RespelledOptions):
    synopsis = "--bus-a ADDRESS --bus-b ADDRESS --rule 'PATTERN DIRECTION [A_PREFIX B_PREFIX]' ... | --config FILE"
    command = "twistd sbus-bridge"
    renamed = {"--a": "--bus-a", "--b": "--bus-b"}
    longdesc = (
        "Join two sbus buses as a client of each. A rule is PATTERN DIRECTION [A_PREFIX B_PREFIX]: "
        "DIRECTION is a>b, b>a or both; the prefixes (A side first, always) rewrite keys going "
        "across: A_PREFIX+rest on A is B_PREFIX+rest on B and back. Secret (!/cred/) keys cross "
        "only for rules whose pattern names them. Config file lines: 'a ADDRESS', 'b ADDRESS', "
        "'rule ...', '#' comments; options given on the command line win. " + MISSING_BUS_HELP
    )
    optParameters = [
        METRICS_OPTION,
        ["bus-a", None, None, "Address of bus A (path, /dev/unix/abstract/HEX)."],
        ["bus-b", None, None, "Address of bus B."],
        ["config", "c", None, "Read addresses and rules from this file."],
        ["stats-interval", None, "60", "Seconds between stats lines in the log (only if changed)."],
        ["max-delay", None, "10", "Longest reconnect back-off, seconds."],
        ["a-user", None, None, "When run as root: connect to bus A as this user (name or uid); "
                               "default: the owner of the socket's directory."],
        ["b-user", None, None, "The same for bus B."],
        ["session-linger", None, f"{DEFAULT_LINGER:g}", "Seconds the servers keep counting what our "
                                                        "patterns match after we die, for our restarted "
                                                        "successor (server/session; 0: no session)."],
        ["standby-window", None, str(MAX_MESSAGES), "Standing by, remember at most this many messages "
                                                    "the active path has not yet delivered (forwarded "
                                                    "if we take over; see docs/deploy.md)."],
        ["takeover-wait", None, f"{RELEASE_WAIT:g}", "Taking over, wait at most this many seconds for a "
                                                     "server to read what the dead active bridge wrote "
                                                     "to it (0: never wait; see docs/deploy.md)."],
    ]
    optFlags = [
        ["no-spanning-tree", None, "Forward always, taking no part in the spanning tree (only for a "
                                   "bridge whose keys no other path carries; see docs/deploy.md)."],
    ]

    def __init__(self):
        super().__init__()
        self["rules"] = []
        self["trust-uids"] = []

    opt_trust_uid = opt_trust_uid

    def opt_rule(self, value: str) -> None:
        """A forwarding rule 'PATTERN DIRECTION [A_PREFIX B_PREFIX]' (repeatable)."""
        try:
            self["rules"].append(parse_rule(value))
        except RuleError as e:
            raise usage.UsageError(f"--rule: {e}") from None

    opt_r = opt_rule

    def postOptions(self):
        if self["config"]:
            try:
                addresses, rules = parse_config(self["config"])
            except OSError as e:
                raise usage.UsageError(f"--config: {e.filename}: {e.strerror}") from None
            except RuleError as e:
                raise usage.UsageError(f"--config: {e}") from None
            for side in SIDES:
                if not self[f"bus-{side}"] and side in addresses:
                    self[f"bus-{side}"] = addresses[side]
            self["rules"] = rules + self["rules"]
        for side in SIDES:
            if not self[f"bus-{side}"]:
                raise usage.UsageError(f"--bus-{side} ADDRESS is required (or '{side} ADDRESS' in --config)")
            from sbus.client.address import AddressError, parse
            try:
                parse(self[f"bus-{side}"])
            except AddressError as e:
                raise usage.UsageError(f"--bus-{side}: {e}") from None
        if not self["rules"]:
            raise usage.UsageError("at least one --rule is required")
        for side in SIDES:
            if self[f"{side}-user"]:
                try:
                    parse_user(self[f"{side}-user"])
                except ValueError as e:
                    raise usage.UsageError(f"--{side}-user: {e}") from None
        same = same_socket(self["bus-a"], self["bus-b"])
        if same:
            raise usage.UsageError(f"refusing to bridge a bus to itself: --bus-a and --bus-b {same}")
        try:
            self["standby-window"] = parse_size(self["standby-window"])
        except ValueError as e:
            raise usage.UsageError(str(e)) from None
        for name in ("stats-interval", "max-delay", "session-linger", "takeover-wait"):
            try:
                value = float(self[name])
            except ValueError:
                raise usage.UsageError(f"--{name}: not a number: {self[name]!r}") from None
            if name in ("session-linger", "takeover-wait"):
                if not 0 <= value < float("inf"):
                    raise usage.UsageError(f"--{name}: must be 0 or more seconds")
            elif not value > 0:
                raise usage.UsageError(f"--{name}: must be positive")
            self[name] = value


def same_socket(a: str, b: str) -> str | None:
    """Why addresses `a` and `b` name the same socket (same file, same abstract name), or None."""
    from sbus.client.address import AddressError, resolve

    try:
        ra, rb = resolve(a), resolve(b)
    except AddressError:
        return None
    if (ra.kind, ra.value) == (rb.kind, rb.value):
        return f"are the same address ({ra})"
    try:
        if ra.kind == rb.kind == "path" and os.path.samefile(ra.value, rb.value):
            return f"name the same socket file ({ra} and {rb})"
    except OSError:
        pass
    return None


def makeService(options) -> BridgeService:
    return BridgeService(options["bus-a"], options["bus-b"], options["rules"],
                         stats_interval=options["stats-interval"], max_delay=options["max-delay"],
                         users={"a": options["a-user"], "b": options["b-user"]},
                         spanning_tree=not options["no-spanning-tree"],
                         trusted_uids=options["trust-uids"], standby_window=options["standby-window"],
                         session_linger=options["session-linger"],
                         takeover_wait=options["takeover-wait"])
