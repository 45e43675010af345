"""Spanning tree over buses and services: which bridge or link carries traffic (sans-I/O).

Operators may join buses with bridges and links in any shape, cycles and
redundant paths included. Each service runs one `Node` of this protocol and
forwards only while the node says so; the forwarding services always form a
spanning tree of the buses they connect, so every subscriber gets each
message once.

The model is Ethernet's spanning tree (802.1D) with two-port bridges:

* A **segment** is what one `MSG` reaches: one bus, or a whole hierarchy of
  relays (a relay carries every message between its bus and its master, and
  a relay tree cannot loop: each relay has one master). A link's TCP
  connection is a segment too, shared by the link's two processes.
* A **node** is a service with two **ports**: a bridge's sides ``a`` and
  ``b``; a link process's bus and its peer connection. Relays do not take
  part: they are inside segments.
* Nodes send `Hello` messages (on a bus to each proven peer's secret key,
  ``<whoami>/sbus-topology/hello``, see `sbus.services.spanning`; ``CMSG
  link/stp`` on a link connection) on each port, every
  `HELLO_INTERVAL` and whenever their view changes, saying which role the
  port has; only a designated port's hello offers a path to the root.
  The node with the lowest id is the **root**; every other node's **root
  port** is the port with the best path to the root; on each segment the
  node offering the best path (lowest root id, cost, node id, port number)
  is **designated**. A node forwards only if each of its ports is its root
  port or designated. On each segment but the root's one node is designated,
  and it links the segment one hop closer to the root: a tree.
* A node whose two ports are on the same segment (a bridge from a bus to
  itself, or between two relays of one master) hears its own hello come
  back and never forwards.
* What a node heard expires after `MAX_AGE` unless heard again (the sender
  died or its path broke), except on a port the node itself stopped reading
  (back-pressure: the silence is ours). A port that is down empties; a
  node with a port down sends ``bye`` and takes no part until it is up.
  ``sbus/topology/change`` (sent by a relay that lost or regained its master)
  makes what was heard on that port expire within two hello intervals unless
  heard again, and everyone re-announces at once.
* **Block at once, unblock late.** A node stops forwarding the moment it
  should; it starts only after it should have forwarded for `FORWARD_DELAY`
  without a break, longer than the time the old path needs to hear the news
  and stop. During a change messages may be lost, not duplicated.

Costs count hops; a path over `MAX_COST` is unreachable (stale information
circulating after a root died counts up to it and disappears).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

#: Reserved keys (never forwarded by a bridge or link; relays carry them like any key).
RESERVED = b"sbus/topology/"
HELLO_KEY = RESERVED + b"hello"
CHANGE_KEY = RESERVED + b"change"

HELLO_INTERVAL = 0.5
MAX_AGE = 2.0
FORWARD_DELAY = 1.0
MAX_COST = 32

VERSION = 1


def new_id(priority: int = 0x8000, clock=time.time) -> str:
    """A node id: 4 hex digits of priority (lower wins the root), 12 of the start time in
    milliseconds, then 20 random ones. Among nodes of one priority the one started first has
    the lowest id, so it stays root or designated: a service restarted while the one that
    replaced it carries never outranks it, and stands by until that one is declared dead
    instead of preempting it while it still delivers its takeover backlog (issue 34)."""
    if not 0 <= priority <= 0xFFFF:
        raise ValueError("priority must fit in 16 bits")
    started = int(clock() * 1000) & (1 << 48) - 1
    return f"{priority:04x}{started:012x}{os.urandom(10).hex()}"


_ROLES = {r: r for r in ("designated", "root", "alternate")}


def _valid_id(value) -> bool:
    return isinstance(value, str) and len(value) == 36 and all(c in "0123456789abcdef" for c in value)


@dataclass(frozen=True)
class Hello:
    """One announcement: "on this segment I offer a path to `root` of `cost` hops"."""

    root: str
    cost: int
    node: str
    port: int
    name: str = ""
    root_name: str = ""
    bye: bool = False
    #: The sender's role on this segment: "designated", "root" or "alternate". Only a designated
    #: sender's offer is a path to the root; every hello replaces what its sender said before.
    role: str = "designated"
    #: The root's sequence number: the root counts up every hello interval and every node passes
    #: on the newest it has. A root whose number stops rising is dead (max age).
    seq: int = 0

    @property
    def vector(self) -> tuple:
        return (self.root, self.cost, self.node, self.port)

    def encode(self) -> bytes:
        body = {"v": VERSION, "root": self.root, "cost": self.cost, "node": self.node,
                "port": self.port, "name": self.name, "root_name": self.root_name, "role": self.role,
                "seq": self.seq}
        if self.bye:
            body["bye"] = True
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Hello":
        """Parse what `encode` made; `ValueError` (one line) for anything else."""
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"hello is not JSON: {e}") from None
        if not isinstance(body, dict) or body.get("v") != VERSION:
            raise ValueError("hello of an unknown version")
        root, node, cost, port = body.get("root"), body.get("node"), body.get("cost"), body.get("port")
        if not (_valid_id(root) and _valid_id(node)):
            raise ValueError("hello with a malformed node id")
        if type(cost) is not int or not 0 <= cost <= MAX_COST or type(port) is not int or not 0 <= port < 1 << 16:
            raise ValueError("hello with a malformed cost or port")
        name, root_name = body.get("name", ""), body.get("root_name", "")
        if not isinstance(name, str) or not isinstance(root_name, str):
            raise ValueError("hello with a malformed name")
        role = body.get("role", "designated")
        if role not in _ROLES:
            raise ValueError("hello with an unknown role")
        seq = body.get("seq", 0)
        if type(seq) is not int or not 0 <= seq < 1 << 53:
            raise ValueError("hello with a malformed sequence number")
        return cls(root, cost, node, port, name[:200], root_name[:200], body.get("bye") is True,
                   _ROLES[role], seq)


@dataclass(frozen=True)
class Event:
    """Something the service should log once: `kind` is "forwarding" or "blocked"."""

    kind: str
    text: str


class _Port:
    __slots__ = ("number", "label", "up", "paused", "heard", "role")

    def __init__(self, number: int, label: str):
        self.number = number
        self.label = label
        self.up = False
        self.paused = False
        #: (sender node, sender port) -> [Hello, expiry time]
        self.heard: dict[tuple[str, int], list] = {}
        self.role = "disabled"  # root, designated, alternate, disabled


class Node:
    """One service's view of the spanning tree. Feed it events, then read `outgoing()`,
    `events()` and `forwarding`; call `tick(now)` at least every `HELLO_INTERVAL / 2`."""

    def __init__(self, node_id: str, ports: dict[int, str], name: str = "", *,
                 hello_interval: float = HELLO_INTERVAL, max_age: float = MAX_AGE,
                 forward_delay: float = FORWARD_DELAY):
        if not _valid_id(node_id):
            raise ValueError("node id must be 36 lowercase hex digits (see new_id)")
        self.id = node_id
        self.name = name
        self.ports = {n: _Port(n, label) for n, label in ports.items()}
        self.hello_interval = hello_interval
        self.max_age = max_age
        self.forward_delay = forward_delay
        self.root = node_id
        self.root_name = name
        self.cost = 0
        self.root_port: int | None = None
        self.forwarding = False
        self._wanted_since: float | None = None
        self._next_hello = 0.0
        self._out: list[tuple[int, Hello]] = []
        self._events: list[Event] = []
        self._block_reason = ""
        #: Our sequence number as root; the root's newest known otherwise.
        self.seq = 0
        self._own_seq = 0
        #: root -> [newest seq seen, when first seen]: a root whose seq stalls for max age is dead.
        self._roots: dict[str, list] = {}
        #: root -> (seq, cost): the best path to it we have used (feasibility, as in Babel: a path
        #: is taken only if its seq is newer, or as new and no longer; no counting to infinity).
        self._fd: dict[str, tuple[int, int]] = {}
        self._now = 0.0

    # -- inputs

    def port_up(self, port: int, now: float) -> None:
        p = self.ports[port]
        p.up = True
        p.heard.clear()
        self._update(now, announce=True)

    def port_down(self, port: int, now: float) -> None:
        p = self.ports[port]
        if not p.up:
            return
        p.up = False
        p.paused = False
        p.heard.clear()
        # Tell the segments still reachable that we are gone.
        for other in self.ports.values():
            if other.up:
                self._out.append((other.number, self._hello(other.number, bye=True)))
        self._update(now, announce=False)

    def port_paused(self, port: int, paused: bool, now: float) -> None:
        """We stopped (or resumed) reading this port: what we heard there must not expire meanwhile."""
        p = self.ports[port]
        if p.paused and not paused:
            for entry in p.heard.values():
                entry[1] = max(entry[1], now + self.max_age)
            if port == self.root_port and self.root in self._roots:
                self._roots[self.root][1] = max(self._roots[self.root][1], now)
        p.paused = paused

    def received(self, port: int, hello: Hello, now: float) -> None:
        p = self.ports[port]
        if not p.up:
            return
        seen = self._roots.get(hello.root)
        if seen is None:
            if len(self._roots) >= 4096:
                self._prune(now, force=True)
            self._roots[hello.root] = [hello.seq, now]
        elif hello.seq > seen[0]:
            seen[0], seen[1] = hello.seq, now
        key = (hello.node, hello.port)
        if hello.bye:
            if p.heard.pop(key, None) is None:
                return
        else:
            entry = p.heard.get(key)
            if entry is not None and entry[0] == hello:
                entry[1] = now + self.max_age
                return
            p.heard[key] = [hello, now + self.max_age]
        self._update(now, announce=False)

    def topology_changed(self, port: int, now: float) -> None:
        """A relay on this port's segment lost or regained its master: what was heard there
        expires within two hello intervals unless heard again (everyone re-announces at once,
        so what is still reachable is); re-announce. Anyone may publish the notice, so it never
        empties the port at once (that made a node designated there: a forged notice, a loop)."""
        p = self.ports[port]
        if not p.up:
            return
        soon = now + 2 * self.hello_interval
        for entry in p.heard.values():
            entry[1] = min(entry[1], soon)
        self._update(now, announce=True)

    def tick(self, now: float) -> None:
        changed = self._root_died(now)
        self._prune(now)
        for p in self.ports.values():
            if p.paused or not p.heard:
                continue
            old = [k for k, (_, expiry) in p.heard.items() if expiry <= now]
            for k in old:
                del p.heard[k]
                changed = True
        if changed:
            self._update(now, announce=False)
        else:
            self._timers(now)
        if now >= self._next_hello:
            self._announce(now)

    def hello_for(self, port: int) -> Hello | None:
        """What we would announce on `port` now (for a peer just met); None while inactive."""
        return self._hello(port) if self.active else None

    def goodbye(self) -> list[tuple[int, Hello]]:
        """Hellos saying we leave, for each port we are designated on (send them before closing)."""
        out = [(p.number, self._hello(p.number, bye=True)) for p in self.ports.values() if p.up]
        self.forwarding = False
        return out

    # -- outputs

    def outgoing(self) -> list[tuple[int, Hello]]:
        out, self._out = self._out, []
        return out

    def events(self) -> list[Event]:
        ev, self._events = self._events, []
        return ev

    @property
    def active(self) -> bool:
        """Every port up (a node with a port down takes no part)."""
        return all(p.up for p in self.ports.values())

    def state(self) -> dict:
        """For statistics."""
        return {
            "node": self.id, "forwarding": self.forwarding, "root": self.root, "root_name": self.root_name,
            "cost": self.cost,
            "ports": {p.label: p.role for p in self.ports.values()},
            "heard": {p.label: sorted({h.name or h.node for h, _ in p.heard.values()}) for p in self.ports.values()},
            "blocked_because": "" if self.forwarding else self._block_reason,
        }

    # -- the computation

    def _hello(self, port: int, bye: bool = False) -> Hello:
        role = self.ports[port].role
        return Hello(self.root, self.cost, self.id, port, self.name, self.root_name, bye,
                     role if role != "disabled" else "alternate", self.seq)

    def _alive(self, root: str) -> bool:
        if root == self.id:
            return True
        if root == self.root and self.root_port is not None and self.ports[self.root_port].paused:
            return True  # we are not reading: the silence is ours
        seen = self._roots.get(root)
        return seen is not None and self._now - seen[1] <= self.max_age

    def _root_died(self, now: float) -> bool:
        """Our root's sequence number stalled for max age: recompute without it."""
        self._now = now
        return self.root != self.id and not self._alive(self.root)

    def _prune(self, now: float, force: bool = False) -> None:
        if not force and len(self._roots) < 64:
            return
        for root in [r for r, (_, t) in self._roots.items() if now - t > 4 * self.max_age or force]:
            if root != self.root:
                del self._roots[root]
                self._fd.pop(root, None)

    def _update(self, now: float, announce: bool) -> None:
        self._now = now
        before = (self.root, self.cost, self.root_port, tuple(p.role for p in self.ports.values()), self.seq)
        self._compute()
        after = (self.root, self.cost, self.root_port, tuple(p.role for p in self.ports.values()), self.seq)
        if announce or after != before:
            self._announce(now)
        self._timers(now)

    def _compute(self) -> None:
        ports = self.ports.values()
        if not all(p.up for p in ports):
            for p in ports:
                p.role = "disabled"
            self.root, self.root_name, self.cost, self.root_port = self.id, self.name, 0, None
            self._block_reason = "a side is down"
            return
        best = None
        best_hello = None
        fd = self._fd
        for p in ports:
            for hello, _ in p.heard.values():
                if (hello.node == self.id or hello.role != "designated" or hello.cost + 1 > MAX_COST
                        or hello.root >= self.id or not self._alive(hello.root)):
                    continue
                have = fd.get(hello.root)
                if have is not None and (hello.seq < have[0] or (hello.seq == have[0] and hello.cost + 1 > have[1])):
                    continue  # not feasible: might lead back through us
                vector = (hello.root, hello.cost + 1, hello.node, hello.port, p.number)
                if best is None or vector < best:
                    best, best_hello = vector, hello
        if best is not None:
            self.root, self.cost, self.root_port = best[0], best[1], best[4]
            self.root_name = best_hello.root_name
            self.seq = best_hello.seq
            have = fd.get(self.root)
            if have is None or self.seq > have[0] or self.cost < have[1]:
                fd[self.root] = (self.seq, self.cost)
        else:
            self.root, self.root_name, self.cost, self.root_port = self.id, self.name, 0, None
            self.seq = self._own_seq
        reason = ""
        for p in ports:
            if p.number == self.root_port:
                p.role = "root"
                continue
            offer = (self.root, self.cost, self.id, p.number)
            better = None
            for hello, _ in p.heard.values():
                if (hello.vector < offer and (better is None or hello.vector < better.vector)
                        and self._alive(hello.root)):
                    better = hello
            if better is None:
                p.role = "designated"
            else:
                p.role = "alternate"
                if not reason:
                    if better.node == self.id:
                        reason = (f"loop: both sides are on one segment (our own hello from side "
                                  f"{self.ports[better.port].label} came back on side {p.label})")
                    else:
                        reason = (f"loop: side {p.label} is already reached through "
                                  f"{better.name or better.node}")
        self._block_reason = reason

    def _wanted(self) -> bool:
        return all(p.role in ("root", "designated") for p in self.ports.values())

    def _timers(self, now: float) -> None:
        if self._wanted():
            if self.forwarding:
                return
            if self._wanted_since is None:
                self._wanted_since = now
            if now - self._wanted_since >= self.forward_delay:
                self.forwarding = True
                self._logged = ""
                sides = " and ".join(p.label for p in self.ports.values())
                self._events.append(Event("forwarding", f"forwarding between {sides} (root "
                                                        f"{self.root_name or self.root}, {self.cost} hops)"))
            return
        self._wanted_since = None
        reason = self._block_reason or "topology change"
        if self.forwarding:
            self.forwarding = False
            self._logged = reason
            self._events.append(Event("blocked", f"standing by: {reason}"))
        elif reason.startswith("loop") and reason != self._logged:
            # Never silent: a loop found before we ever forwarded is logged too (once per cause).
            self._logged = reason
            self._events.append(Event("blocked", f"standing by: {reason}"))

    _logged = ""

    def _announce(self, now: float) -> None:
        self._next_hello = now + self.hello_interval
        if not self.active:
            return
        if self.root == self.id:
            self._own_seq += 1
            self.seq = self._own_seq
        for p in self.ports.values():
            self._out.append((p.number, self._hello(p.number)))
