"""The Twisted shell around `sbus.core.topology`, shared by the bridge and the link.

A service makes one `Tree` with its two ports, tells it when a port's
connection comes and goes (with its whoami on that bus), when it pauses
reading a port (back-pressure), and hands it every ``sbus/topology/...``
message and every message on its own ``<whoami>/sbus-topology/...`` keys; it
forwards traffic only while `Tree.forwarding` is true. The tree sends through
the ``send(port, key, payload)`` callable it was given, logs each change of
state in one line, and counts in `stats()`.

**Whom a bus port believes** (docs/security.md, "Whom each service trusts").
Anyone on a bus may publish anything, so a hello on a public key proves
nothing (a forged one made a bridge stand by). On a bus port:

* ``MSG sbus/topology/hello`` is only an *announcement*: ``{"v":2,"who":W}``,
  W being the sender's whoami on that bus; sent when the port comes up and
  every `ANNOUNCE_EVERY` hello intervals, never the tree's state.
* On hearing W, a node whose trusted uids include every uid of W's
  credential chain (default: its own uids on that bus, the service's uid and
  root; ``--trust-uid`` adds more) proves W with the challenge the link's
  whoami uses: a nonce sent to W's secret key, which only W can read. The
  three messages (``<W>/sbus-topology/auth``: ``{"from", "n"}``, then
  ``{"from", "n", "echo"}``, then ``{"from", "echo"}``) give both ends a
  session key, SHA-256 of the two nonces, that nobody else has read.
* Hellos then go to each proven peer's secret key (``<W>/sbus-topology/hello``,
  ``MAC NUL SESSION NUL SENDER NUL HELLO``, HMAC-SHA256 over sender, receiver
  and hello): a catch-all subscriber of another uid never receives them
  (issue 22), and one without the session key cannot forge them.
* Floods cost little: announcements of untrusted uids are dropped after one
  parse, challenges started and answered are rate-limited per port (and
  pending ones capped), a forged hello costs one HMAC; none reaches the tree.

A link's peer port (``CMSG link/stp`` over the authenticated connection) is
believed as it is: the connection's TLS, key or uid check proved the peer.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from sbus.core import topology
from sbus.core.credentials import owner_of
from sbus.core.topology import CHANGE_KEY, HELLO_KEY, RESERVED, Hello, Node

__all__ = ["Tree", "RESERVED", "HELLO_KEY", "CHANGE_KEY", "PRIVATE", "PRIVATE_PATTERN", "change_packet",
           "send_urgent", "chain_uids"]

#: Our own secret keys of the tree: ``<whoami>/sbus-topology/auth`` and ``.../hello``.
PRIVATE = b"sbus-topology/"
AUTH = PRIVATE + b"auth"
PRIVATE_HELLO = PRIVATE + b"hello"
#: What a bus port subscribes to for them (the server fills in our ids).
PRIVATE_PATTERN = b"!/cred////" + PRIVATE
#: Public announcements every this many hello intervals (and when a port comes up).
ANNOUNCE_EVERY = 10
_LABEL = b"sbus-topology-hello-v2"
_MAX_WHO = 512
_MAX_PENDING = 64


def chain_uids(who: bytes) -> list[int] | None:
    """The uids of every ``!/cred/G/U/P`` link of a whoami, outermost first; None if it is not
    a canonical whoami (each link as the server writes it)."""
    if len(who) > _MAX_WHO:
        return None
    uids = []
    rest = who + b"/"
    while rest:
        owner = owner_of(rest)
        if owner is None:
            return None
        uids.append(owner.uid)
        rest = rest[len(b"!/cred/%d/%d/%d/" % (owner.gid, owner.uid, owner.pid)):]
    return uids


class _Bucket:
    """A token bucket: `take(now)` is true at most `rate` times a second (bursts of `burst`)."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst, self.tokens, self.t = rate, burst, burst, None

    def take(self, now: float) -> bool:
        if self.t is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
        self.t = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class _BusPort:
    """What a bus port knows of its proven peers."""

    def __init__(self):
        self.who: bytes | None = None
        #: peer whoami -> [(session id, key, last valid hello time)], newest first (at most 2)
        self.sessions: dict[bytes, list] = {}
        #: our nonce -> (peer whoami, time): challenges we sent
        self.asked: dict[str, tuple[bytes, float]] = {}
        #: our nonce -> (peer whoami, key, time): challenges we answered, waiting for the echo
        self.answered: dict[str, tuple[bytes, bytes, float]] = {}
        self.next_announce = 0.0
        self.ask_bucket = _Bucket(8, 16)
        self.answer_bucket = _Bucket(8, 16)


def change_packet(why: str) -> bytes:
    return b"MSG " + CHANGE_KEY + b"\0" + why.encode("utf-8", "replace")[:1000]


def send_urgent(transport, packet: bytes) -> None:
    """Write a packet ahead of what is already queued on a SEQPACKET transport (hellos must not
    wait behind megabytes of data: a late hello makes a standby path take over)."""
    outbox = getattr(transport, "outbox", None)
    items = getattr(outbox, "_items", None)
    if outbox and getattr(outbox, "order", None) == "queue" and hasattr(items, "appendleft"):
        items.appendleft(packet)
        outbox.nbytes += len(packet)
        transport.startWriting()
    else:
        transport.write(packet)


class Tree:
    def __init__(self, reactor, name: str, ports: dict[int, str], send, log: Logger, *,
                 enabled: bool = True, on_change=None, node_id: str | None = None,
                 hello_interval: float = topology.HELLO_INTERVAL, max_age: float = topology.MAX_AGE,
                 forward_delay: float = topology.FORWARD_DELAY, trusted_uids=(),
                 transport_ports=()):
        self.reactor = reactor
        self.enabled = enabled
        self.send = send
        self.log = log
        self.on_change = on_change
        self.node = Node(node_id or topology.new_id(), ports, name, hello_interval=hello_interval,
                         max_age=max_age, forward_delay=forward_delay)
        #: uids whose services we believe, besides our own on each bus (and the service's, root)
        self.trusted = {0, os.getuid(), *trusted_uids}
        #: ports whose connection authenticates the peer (a link's): hellos are believed as they come
        self.bus_ports = {n: _BusPort() for n in ports if n not in transport_ports}
        self._loop = LoopingCall(self._tick)
        self._loop.clock = reactor
        self.bad_hellos = 0
        self.hellos_in = 0
        self.hellos_out = 0
        self.changes = 0
        self.changes_ignored = 0
        self._last_change: dict[int, float] = {}
        #: what we refused, by reason (untrusted, forged, throttled, malformed, unknown_session)
        self.refused: dict[str, int] = {}
        self.sessions_made = 0
        self._was = False

    @property
    def forwarding(self) -> bool:
        return not self.enabled or self.node.forwarding

    def start(self) -> None:
        if self.enabled and not self._loop.running:
            self._loop.start(self.node.hello_interval / 4, now=False)

    def stop(self) -> None:
        """Say goodbye on every port that is up (so standbys need not wait for a timeout)."""
        if self._loop.running:
            self._loop.stop()
        if self.enabled:
            self._emit(self.node.goodbye())

    # -- events from the service

    def port_up(self, port: int, who: bytes | None = None) -> None:
        """The port's connection is up; `who` is our whoami on it (a bus port)."""
        if not self.enabled:
            return
        bp = self.bus_ports.get(port)
        if bp is not None:
            self._reset(bp)
            bp.who = who
        self.node.port_up(port, self.reactor.seconds())
        if bp is not None:
            self._announce(port, bp, self.reactor.seconds())
        self._flush()

    def port_down(self, port: int) -> None:
        if self.enabled:
            self.node.port_down(port, self.reactor.seconds())
            self._flush()
            bp = self.bus_ports.get(port)
            if bp is not None:
                self._reset(bp)

    def paused(self, port: int, paused: bool) -> None:
        if self.enabled:
            self.node.port_paused(port, paused, self.reactor.seconds())

    def owns(self, port: int, key: bytes) -> bool:
        """Is `key` one of our own tree keys on `port` (``<our whoami>/sbus-topology/...``)?"""
        bp = self.bus_ports.get(port)
        return (bp is not None and bp.who is not None and key.startswith(bp.who)
                and key[len(bp.who):len(bp.who) + 1 + len(PRIVATE)] == b"/" + PRIVATE)

    def received(self, port: int, key: bytes, payload: bytes) -> None:
        """A message under ``sbus/topology/`` (or, see `owns`, our own tree keys) arrived on `port`."""
        if not self.enabled:
            return
        now = self.reactor.seconds()
        bp = self.bus_ports.get(port)
        if key == HELLO_KEY:
            if bp is None:
                self._believe(port, payload, now)
            else:
                self._heard_announcement(port, bp, payload, now)
        elif key == CHANGE_KEY:
            # Anyone may publish it: at most one per hello interval and port is acted on, and it
            # only makes what we heard there expire soon (unless heard again), never forgets it.
            if now - self._last_change.get(port, -1e9) < self.node.hello_interval:
                self.changes_ignored += 1
                return
            self._last_change[port] = now
            self.changes += 1
            self.node.topology_changed(port, now)
        elif bp is not None and bp.who is not None:
            rest = key[len(bp.who) + 1:]
            if rest == PRIVATE_HELLO:
                self._private_hello(port, bp, payload, now)
            elif rest == AUTH:
                self._auth(port, bp, payload, now)
        self._flush()

    # -- proving who announces (bus ports)

    def _refuse(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1

    def _trusts(self, bp: _BusPort, who) -> bool:
        if not isinstance(who, str):
            return False
        who = who.encode()
        if who == bp.who:
            return False
        uids = chain_uids(who)
        if not uids:
            return False
        ours = set(chain_uids(bp.who) or ()) if bp.who else set()
        return all(u in self.trusted or u in ours for u in uids)

    def _json(self, payload: bytes):
        if len(payload) > 2048:
            return None
        try:
            body = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            return None
        return body if isinstance(body, dict) else None

    def _heard_announcement(self, port: int, bp: _BusPort, payload: bytes, now: float) -> None:
        if bp.who is None:
            return  # the port is not up: we would not know whom to say we are
        body = self._json(payload)
        if body is None or body.get("v") != 2:
            self._refuse("malformed")
            return
        who = body.get("who")
        if isinstance(who, str) and who.encode() == bp.who:
            return  # our own (an echo)
        if not self._trusts(bp, who):
            self._refuse("untrusted")
            return
        who = who.encode()
        if not bp.sessions.get(who):
            self._ask(port, bp, who, now)

    def _ask(self, port: int, bp: _BusPort, who: bytes, now: float) -> None:
        """Challenge `who` (a trusted whoami): a nonce to its secret key (rate-limited)."""
        if any(w == who and now - t < self.node.max_age for w, t in bp.asked.values()):
            return
        if not bp.ask_bucket.take(now):
            self._refuse("throttled")
            return
        nonce = os.urandom(16).hex()
        self._remember(bp.asked, nonce, (who, now))
        self._send(port, who + b"/" + AUTH, {"from": bp.who.decode(), "n": nonce})

    def _auth(self, port: int, bp: _BusPort, payload: bytes, now: float) -> None:
        body = self._json(payload)
        if body is None or not self._trusts(bp, body.get("from")):
            self._refuse("untrusted" if body is not None else "malformed")
            return
        peer = body["from"].encode()
        n, echo = body.get("n"), body.get("echo")
        if not all(x is None or (isinstance(x, str) and 16 <= len(x) <= 64) for x in (n, echo)):
            self._refuse("malformed")
            return
        if n is not None and echo is None:          # 1: they ask us
            if not bp.answer_bucket.take(now):
                self._refuse("throttled")
                return
            ours = os.urandom(16).hex()
            key = hashlib.sha256(n.encode() + b"\0" + ours.encode()).digest()
            self._remember(bp.answered, ours, (peer, key, now))
            self._send(port, peer + b"/" + AUTH, {"from": bp.who.decode(), "n": ours, "echo": n})
        elif n is not None:                          # 2: they answer our question
            asked = bp.asked.pop(echo, None)
            if asked is None or asked[0] != peer:
                self._refuse("forged")
                return
            key = hashlib.sha256(echo.encode() + b"\0" + n.encode()).digest()
            self._send(port, peer + b"/" + AUTH, {"from": bp.who.decode(), "echo": n})
            self._proven(port, bp, peer, key, now)
        elif echo is not None:                       # 3: they read our answer
            answered = bp.answered.pop(echo, None)
            if answered is None or answered[0] != peer:
                self._refuse("forged")
                return
            self._proven(port, bp, peer, answered[1], now)
        else:
            self._refuse("malformed")

    @staticmethod
    def _remember(table: dict, nonce: str, value) -> None:
        if len(table) >= _MAX_PENDING:
            del table[next(iter(table))]           # the oldest
        table[nonce] = value

    def _proven(self, port: int, bp: _BusPort, peer: bytes, key: bytes, now: float) -> None:
        sid = hashlib.sha256(b"sid\0" + key).hexdigest()[:16].encode()
        bp.sessions[peer] = [(sid, key, now), *bp.sessions.get(peer, ())][:2]
        self.sessions_made += 1
        hello = self.node.hello_for(port)
        if hello is not None:   # tell the new peer where we stand at once
            self._send_hello(port, bp, peer, hello)

    def _private_hello(self, port: int, bp: _BusPort, payload: bytes, now: float) -> None:
        parts = payload.split(b"\0", 3)
        if len(parts) != 4:
            self._refuse("malformed")
            return
        mac, sid, peer, body = parts
        for i, (s, key, _) in enumerate(bp.sessions.get(peer, ())):
            if s == sid:
                break
        else:
            self._refuse("unknown_session")
            if self._trusts(bp, peer.decode("utf-8", "replace")):
                self._ask(port, bp, peer, now)   # it knows us, we lost it (idle while it paused?)
            return
        want = hmac.new(key, b"\0".join((_LABEL, peer, bp.who, body)), hashlib.sha256).hexdigest().encode()
        if not hmac.compare_digest(mac, want):
            self._refuse("forged")
            return
        bp.sessions[peer][i] = (sid, key, now)
        self._believe(port, body, now)

    def _believe(self, port: int, payload: bytes, now: float) -> None:
        try:
            hello = Hello.decode(payload)
        except ValueError as e:
            self.bad_hellos += 1
            if self.bad_hellos == 1:
                self.log.warn("spanning tree: ignoring a malformed hello on {port}: {err}",
                              port=self.node.ports[port].label, err=e)
            return
        self.hellos_in += 1
        self.node.received(port, hello, now)

    # -- inside

    def _send(self, port: int, key: bytes, body: dict) -> None:
        try:
            self.send(port, key, json.dumps(body, separators=(",", ":")).encode())
        except Exception as e:  # a connection that just went away
            self.log.debug("spanning tree: not sent on {port}: {err}", port=port, err=e)

    def _send_hello(self, port: int, bp: _BusPort, peer: bytes, hello: Hello) -> None:
        sid, key, _ = bp.sessions[peer][0]
        body = hello.encode()
        mac = hmac.new(key, b"\0".join((_LABEL, bp.who, peer, body)), hashlib.sha256).hexdigest().encode()
        try:
            self.send(port, peer + b"/" + PRIVATE_HELLO, b"\0".join((mac, sid, bp.who, body)))
        except Exception as e:
            self.log.debug("spanning tree: hello not sent on {port}: {err}", port=port, err=e)
        else:
            self.hellos_out += 1

    def _announce(self, port: int, bp: _BusPort, now: float) -> None:
        bp.next_announce = now + ANNOUNCE_EVERY * self.node.hello_interval
        if bp.who is not None:
            self._send(port, HELLO_KEY, {"v": 2, "who": bp.who.decode()})

    def _reset(self, bp: _BusPort) -> None:
        bp.who = None
        bp.sessions.clear()
        bp.asked.clear()
        bp.answered.clear()

    def _expire(self, bp: _BusPort, now: float) -> None:
        idle = 4 * self.node.max_age
        for peer in [p for p, ss in bp.sessions.items() if now - max(x[2] for x in ss) > idle]:
            del bp.sessions[peer]
        for table in (bp.asked, bp.answered):
            for nonce in [n for n, v in table.items() if now - v[-1] > self.node.max_age]:
                del table[nonce]

    def _tick(self) -> None:
        now = self.reactor.seconds()
        self.node.tick(now)
        for port, bp in self.bus_ports.items():
            if not self.node.ports[port].paused:   # not reading: the silence is ours
                self._expire(bp, now)
            if bp.who is not None and now >= bp.next_announce:
                self._announce(port, bp, now)
        self._flush()

    def _emit(self, out) -> None:
        for port, hello in out:
            bp = self.bus_ports.get(port)
            if bp is None:
                try:
                    self.send(port, HELLO_KEY, hello.encode())
                except Exception as e:  # a connection that just went away
                    self.log.debug("spanning tree: hello not sent on {port}: {err}", port=port, err=e)
                else:
                    self.hellos_out += 1
            elif bp.who is not None:
                for peer in list(bp.sessions):
                    self._send_hello(port, bp, peer, hello)

    def _flush(self) -> None:
        self._emit(self.node.outgoing())
        for event in self.node.events():
            if event.kind == "blocked" and event.text.startswith("standing by: loop"):
                self.log.warn("spanning tree: {name}: {text}", name=self.node.name, text=event.text)
            else:
                self.log.info("spanning tree: {name}: {text}", name=self.node.name, text=event.text)
        now = self.node.forwarding
        if now != self._was:
            self._was = now
            if self.on_change is not None:
                self.on_change(now)

    def stats(self) -> dict:
        if not self.enabled:
            return {"enabled": False}
        st = self.node.state()
        st.update(enabled=True, hellos_in=self.hellos_in, hellos_out=self.hellos_out,
                  bad_hellos=self.bad_hellos, change_notices=self.changes,
                  change_notices_ignored=self.changes_ignored, refused=dict(self.refused),
                  sessions_made=self.sessions_made,
                  peers={self.node.ports[n].label: len(bp.sessions) for n, bp in self.bus_ports.items()},
                  trusted_uids=sorted(self.trusted))
        return st


def opt_trust_uid(options, value: str) -> None:
    """Also believe spanning-tree hellos of this user's services (name or uid; repeatable); by default only our own uids and root's."""  # noqa: E501
    from twisted.python import usage

    from sbus.server.sbusd import resolve_user

    try:
        options.setdefault("trust-uids", []).append(resolve_user(value))
    except ValueError as e:
        raise usage.UsageError(f"--trust-uid: {e}") from None


def default_name(kind: str, detail: str) -> str:
    return f"{kind} pid {os.getpid()} ({detail})"
