"""The Twisted shell around `sbus.core.topology`, shared by the bridge and the link.

A service makes one `Tree` with its two ports, tells it when a port's
connection comes and goes, when it pauses reading a port (back-pressure),
and hands it every ``sbus/topology/...`` message it receives; it forwards
traffic only while `Tree.forwarding` is true. The tree sends its hellos
through the ``send(port, packet)`` callable it was given, logs each change
of state in one line, and counts in `stats()`.
"""

from __future__ import annotations

import os

from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from sbus.core import topology
from sbus.core.topology import CHANGE_KEY, HELLO_KEY, RESERVED, Hello, Node

__all__ = ["Tree", "RESERVED", "HELLO_KEY", "CHANGE_KEY", "hello_packet", "change_packet", "send_urgent"]

_HELLO_MSG = b"MSG " + HELLO_KEY + b"\0"


def hello_packet(hello: Hello) -> bytes:
    return _HELLO_MSG + hello.encode()


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
                 forward_delay: float = topology.FORWARD_DELAY):
        self.reactor = reactor
        self.enabled = enabled
        self.send = send
        self.log = log
        self.on_change = on_change
        self.node = Node(node_id or topology.new_id(), ports, name, hello_interval=hello_interval,
                         max_age=max_age, forward_delay=forward_delay)
        self._loop = LoopingCall(self._tick)
        self._loop.clock = reactor
        self.bad_hellos = 0
        self.hellos_in = 0
        self.hellos_out = 0
        self.changes = 0
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

    def port_up(self, port: int) -> None:
        if self.enabled:
            self.node.port_up(port, self.reactor.seconds())
            self._flush()

    def port_down(self, port: int) -> None:
        if self.enabled:
            self.node.port_down(port, self.reactor.seconds())
            self._flush()

    def paused(self, port: int, paused: bool) -> None:
        if self.enabled:
            self.node.port_paused(port, paused, self.reactor.seconds())

    def received(self, port: int, key: bytes, payload: bytes) -> None:
        """A message under ``sbus/topology/`` arrived on `port`."""
        if not self.enabled:
            return
        now = self.reactor.seconds()
        if key == HELLO_KEY:
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
        elif key == CHANGE_KEY:
            self.changes += 1
            self.node.topology_changed(port, now)
        self._flush()

    # -- inside

    def _tick(self) -> None:
        self.node.tick(self.reactor.seconds())
        self._flush()

    def _emit(self, out) -> None:
        for port, hello in out:
            try:
                self.send(port, hello)
            except Exception as e:  # a connection that just went away
                self.log.debug("spanning tree: hello not sent on {port}: {err}", port=port, err=e)
            else:
                self.hellos_out += 1

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
                  bad_hellos=self.bad_hellos, change_notices=self.changes)
        return st


def default_name(kind: str, detail: str) -> str:
    return f"{kind} pid {os.getpid()} ({detail})"
