"""``twistd sbus-msgbus``: the msgbus line protocol, joined to an sbus bus.

    twistd -n sbus-msgbus --bus /run/sbus.socket [--port tcp:11111]

Serves the protocol of msgbus (the line protocol of the original msgbus server; its
README's rules are restated below, and docs/deploy.md "Where msgbus's README is silent"
lists what the original does beyond them) on a Twisted stream endpoint and joins it to an
sbus bus (docs/deploy.md "The msgbus gateway").

The protocol, as served
-----------------------

Commands are lines ending with ``\\n`` (a ``\\r`` before it is ignored);
words are separated by runs of spaces or tabs.

====================================  ==========================================
client sends                          server answers
====================================  ==========================================
``sub CH1 CH2 ...``                   ``ack sub``
``unsub CH1 CH2 ...``                 ``ack unsub`` (channels not held: ignored)
``listen``                            ``ack listen``
``unlisten``                          ``ack unlisten``
``ping``                              ``pong``
``send X CH1 CH2 ...``                ``ack send``, then the client sends X bytes
the X bytes                           ``ack send`` once delivered (see delivery)
``error TEXT``                        nothing (logged), as the original does
anything else                         ``error <reason>``, the connection stays
====================================  ==========================================

Delivery: a message sent to channel ``s`` reaches every *listening* client
registered on a channel ``c`` that starts with ``s`` (``s`` equal to ``c``
included; the README's "substrings" are prefixes), as ``recv X\\n`` followed by
the X bytes; once per client however many of its channels match, however
many channels the send names, and never to the sender itself. Registering
on a channel twice is the same as once.

Malformed lines (unknown command, ``sub``/``unsub``/``send`` without channels,
a bad length, arguments to ``ping``/``listen``/``unlisten``, an empty line, a
NUL in a channel) get ``error ...`` and the connection stays usable. Two
errors close the connection, after the error line: a command line longer
than ``--max-line`` (64 KiB) and a ``send`` whose declared length is over the
limit (below). A client that disconnects mid-message sends nothing.

Joined to the bus
-----------------

* Every gateway ``send`` is also published on the bus as ``msgbus/<channel>``,
  once per distinct channel named in it.
* The gateway subscribes to ``msgbus/`` on the bus, with echo off (so its own
  publishes do not come back); a bus message on ``msgbus/<name>`` is delivered
  to the gateway's clients as if it had been sent to ``<name>``.
* Several gateways may share a bus: each republishes only what its own
  clients sent, so nothing loops.

Size limit: a message must fit in one sbus packet with its key
(``MSG msgbus/<channel>\\0``). By default (``--max-message`` not given) a
``send`` is refused, and the connection closed, when X plus that overhead for
its longest channel exceeds the bus's packet limit (``--max-packet``,
409600). With ``--max-message N`` the limit is N; a message that is then too
big for a packet is still delivered to the gateway's clients but not
published on the bus (counted as a drop).

Channels whose name would make an invalid sbus key (a ``!`` segment, as in
``a/!/b``) are served to the gateway's clients but not published (a drop).

Who is served: only peers the bus would admit itself (`sbus.services.admission`,
the rule every service shares: its socket's mode and owner, the peer's own groups, and
its ``-u`` list asked of the bus), judged per connection from ``SO_PEERCRED`` on a
``unix:`` port (a path, ``unix:/dev/unix/abstract/HEX``, ``unix:/dev/fd/N``, or
``systemd:domain=UNIX:index=0``), or from the owner of the connecting socket (an exact
``sock_diag`` lookup, else ``/proc/net/tcp``) for a TCP peer on this host. Anyone else
gets one line, ``error uid N ... may not ...``, and is closed, before a command is read.
A TCP peer on another host has no uid to check: refused unless ``--allow-remote``. A
``unix:`` port on a path is created with the bus socket's mode (a second fence).

A ``send`` that is refused never has its bytes read as commands: with a
valid length X (a missing or invalid channel, a channel too long) the X
bytes are read and dropped after the ``error`` line; with no valid length
(``send x ...``) where the message ends is unknown, so the connection is
closed after the ``error`` line. A client that half-closes (``printf 'ping\\n'
| nc -N``) gets the replies to everything it sent, then the gateway closes.

Bounds per connection: a command line (``--max-line``, 64 KiB), a message
(one bus packet), channel names (``--max-channel``, 4,096 bytes), channels
held (``--max-channels``, 1,024) and their total bytes
(``--max-channel-bytes``, 256 KiB), the output queue (``--queue-bytes``); and
``--max-clients`` (4,096) connections; and per uid (other than the gateway's own)
everything its connections hold together (``--max-uid-bytes``, 64 MiB: unfinished
lines and messages, queued output, channel names; the connection that grows it
over is closed with an ``error`` line, a message that would is dropped for that
client). The listen backlog is ``--backlog``
(1,024). A port that cannot be bound (taken by someone else) is a logged,
fatal error: the gateway exits non-zero instead of running without a
listener.

Slow clients: each connection registers itself as a streaming producer on its
transport; while the transport's buffer is full, messages for it wait in a
per-client queue, and beyond ``--queue-bytes`` (4 MiB) they are dropped and
counted.

Data structure and cost
-----------------------

Channels live in a radix trie (`ChannelTrie`, edges labelled with byte
strings): a node per registered channel and per branching point, each node
holding the clients registered on exactly that channel. A ``sub``/``unsub``
of a channel of length L costs O(L). Delivering to ``s`` walks down at most
len(s) bytes, then visits the subtree below: O(L + n), where n is the number
of nodes under ``s``, collecting recipients into a set so each gets one
copy. Memory is O(distinct channels + their bytes) (a node per byte cost
~300 bytes per channel byte: fifty 60 KB channels grew the gateway to 1.6 GB).

Statistics: a stats line every ``--stats-interval`` seconds (if changed) and
at stop: clients, messages received from clients and from the bus,
deliveries, publishes to the bus, drops, bus reconnects.
"""

from __future__ import annotations

import os
from collections import deque

from twisted.internet import endpoints, protocol
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure
from zope.interface import implementer

from sbus.options import METRICS_OPTION, MISSING_BUS_HELP, positive_int
from sbus.services.access import endpoint_kind, peer_credentials, server_endpoint
from sbus.services.admission import Admission
from sbus.services.chassis import Chassis

from sbus.core.codec import MAX_PACKET
from sbus.core.credentials import CredentialError, check_key

log = Logger(namespace="sbus.msgbus")

KEY_PREFIX = b"msgbus/"
#: ``MSG msgbus/`` + the NUL: the bytes of an sbus packet besides channel and payload.
PACKET_OVERHEAD = len(b"MSG ") + len(KEY_PREFIX) + 1
DEFAULT_PORT = "tcp:11111:interface=127.0.0.1"
DEFAULT_MAX_LINE = 64 * 1024
DEFAULT_QUEUE_BYTES = 4 << 20
DEFAULT_BACKLOG = 1024
DEFAULT_MAX_CLIENTS = 4096
#: What all connections of one uid (other than the gateway's own) may hold together: unfinished
#: lines and messages, queued output, channel names.
DEFAULT_MAX_UID_BYTES = 64 << 20
DEFAULT_MAX_CHANNEL = 4096          # bytes in one channel name
DEFAULT_MAX_CHANNELS = 1024         # channels one client may hold
DEFAULT_MAX_CHANNEL_BYTES = 256 << 10  # their total bytes


class ChannelTrie:
    """Clients by channel, in a radix (path-compressed) byte trie.

    `collect(s)` finds the clients on channels starting with s. A node is
    ``[edges, members]``; ``edges`` maps the first byte of an edge label to
    ``[label, child]``. Every node but the root holds members or has at least
    two edges (chains of one-child nodes are merged), so memory is
    O(distinct channels + their bytes), not one node per byte.
    """

    __slots__ = ("root", "channels")

    def __init__(self):
        self.root = [{}, set()]
        self.channels = 0  # (client, channel) registrations

    def add(self, channel: bytes, member) -> bool:
        node = self.root
        rest = channel
        while rest:
            edge = node[0].get(rest[0])
            if edge is None:
                child = [{}, set()]
                node[0][rest[0]] = [bytes(rest), child]
                node = child
                break
            label = edge[0]
            k = len(_common_prefix(label, rest))
            if k < len(label):  # split the edge at k
                mid = [{label[k]: [label[k:], edge[1]]}, set()]
                edge[0] = label[:k]
                edge[1] = mid
            node = edge[1]
            rest = rest[k:]
        if member in node[1]:
            return False
        node[1].add(member)
        self.channels += 1
        return True

    def remove(self, channel: bytes, member) -> bool:
        path = []  # (parent node, first byte of the edge taken)
        node = self.root
        rest = channel
        while rest:
            edge = node[0].get(rest[0])
            if edge is None or not rest.startswith(edge[0]):
                return False
            path.append((node, rest[0]))
            rest = rest[len(edge[0]):]
            node = edge[1]
        if member not in node[1]:
            return False
        node[1].discard(member)
        self.channels -= 1
        # prune: drop empty leaves, merge member-less nodes left with one edge
        while path:
            parent, byte = path.pop()
            edge = parent[0][byte]
            if node[1]:
                break
            if not node[0]:
                del parent[0][byte]
                node = parent
                continue
            if len(node[0]) == 1:
                (label, child), = node[0].values()
                edge[0] = edge[0] + label
                edge[1] = child
            break
        return True

    def collect(self, prefix: bytes, into: set) -> set:
        """Add to `into` every member registered on a channel starting with `prefix`."""
        node = self.root
        rest = prefix
        while rest:
            edge = node[0].get(rest[0])
            if edge is None:
                return into
            label = edge[0]
            if len(rest) <= len(label):
                if not label.startswith(rest):
                    return into
                node = edge[1]
                break
            if not rest.startswith(label):
                return into
            rest = rest[len(label):]
            node = edge[1]
        stack = [node]
        while stack:
            node = stack.pop()
            if node[1]:
                into.update(node[1])
            stack.extend(e[1] for e in node[0].values())
        return into

    def nodes(self) -> int:
        """Nodes in the trie, root included (for tests of its memory bound)."""
        n, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            n += 1
            stack.extend(e[1] for e in node[0].values())
        return n

    def __bool__(self):
        return bool(self.root[0] or self.root[1])


def _common_prefix(a: bytes, b: bytes) -> bytes:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return a[:i]


#: Seconds a client told an error and closed on may take to close its side (see `close`).
LINGER = 10.0


@implementer(IHalfCloseableProtocol)
class MsgbusProtocol(protocol.Protocol):
    """One msgbus client connection (also a streaming producer for its own transport)."""

    def __init__(self, gateway: "MsgbusGateway"):
        self.gateway = gateway
        self.channels: set[bytes] = set()
        self.listening = False
        self._buf = bytearray()
        self._need: int | None = None       # body bytes still expected after 'send'
        self._send_channels: list[bytes] = []
        self._skip = 0                      # body bytes of a refused 'send' still to discard
        self.channel_bytes = 0
        self.uid: int | None = None
        self._closing = False
        self._congested = False
        self._pending: deque = deque()
        self._pending_bytes = 0
        self.peer = "?"
        self.charged = 0                    # bytes counted against our uid (`MsgbusGateway.charge`)
        self._linger = None                 # after an error line: the call that ends the wait

    # -- connection

    def connectionMade(self):
        peer = self.transport.getPeer()
        self.peer = f"{getattr(peer, 'host', peer)}:{getattr(peer, 'port', '')}"
        refusal = self.gateway.admit(self)
        if refusal:
            self.gateway.refused += 1
            log.warn("refused msgbus client {peer}: {why}", peer=self.peer, why=refusal)
            self._closing = True
            self.transport.write(b"error " + refusal.encode("utf-8", "replace") + b"\n")
            self.transport.loseConnection()
            return
        self.transport.registerProducer(self, True)
        self.gateway.clientConnected(self)

    # IHalfCloseableProtocol: the client sent everything (printf ... | nc -N)
    def readConnectionLost(self):
        """Answer what was sent (already done, in order), then close once it is written."""
        if not self._closing:
            self.close()
        elif self._linger is not None:
            self.transport.loseConnection()  # the client closed after our error line: done

    def writeConnectionLost(self):
        if not self._closing:
            self.close()

    def connectionLost(self, reason=None):
        linger, self._linger = self._linger, None
        if linger is not None and linger.active():
            linger.cancel()
        self._closing = True
        self._pending.clear()
        self._pending_bytes = 0
        self._buf.clear()
        self.gateway.clientLost(self)

    def held(self) -> int:
        """Bytes this connection holds in the gateway: unfinished input, queued output, channels."""
        return len(self._buf) + self._pending_bytes + self.channel_bytes

    # -- output

    def sendLine(self, line: bytes) -> None:
        if not self._closing:
            self.transport.write(line + b"\n")

    def error(self, reason: str, close: bool = False) -> None:
        self.gateway.errors += 1
        self.sendLine(b"error " + reason.replace("\n", " ").encode("utf-8", "replace"))
        if close:
            log.info("closing msgbus client {peer}: {reason}", peer=self.peer, reason=reason)
            self.close(linger=True)

    def close(self, linger: bool = False) -> None:
        """Close after what is written; pending messages are dropped. `linger` (after an error
        line): close our side only and read, discarding, until the client closes (at most
        `LINGER` s). Closing a TCP socket with the client's data unread resets it, and the reset
        can take the error line with it before the client reads it (or fail the client's send)."""
        self._closing = True
        self._pending.clear()
        self._pending_bytes = 0
        # a registered (paused) producer would keep a disconnecting TCP transport open
        self.transport.unregisterProducer()
        half_close = getattr(self.transport, "loseWriteConnection", None)
        if linger and half_close is not None and self._linger is None:
            from twisted.internet import reactor
            self.transport.resumeProducing()  # reading may have been paused: read to discard
            half_close()
            self._linger = reactor.callLater(LINGER, self.transport.abortConnection)
        else:
            self.transport.loseConnection()

    def deliver(self, data: bytes) -> bool:
        """Queue one ``recv X\\n`` + bytes for this client; False if dropped."""
        if self._closing:
            return False
        if not self._congested:
            self.transport.write(data)
            return True
        if self._pending_bytes + len(data) > self.gateway.queue_bytes:
            return False
        self._pending.append(data)
        self._pending_bytes += len(data)
        if not self.gateway.charge(self):
            self._pending.pop()
            self._pending_bytes -= len(data)
            self.gateway.charge(self)
            return False
        return True

    # IPushProducer, driven by our own transport's write buffer
    def pauseProducing(self):
        self._congested = True

    def resumeProducing(self):
        self._congested = False
        pending = self._pending
        while pending and not self._congested and not self._closing:
            data = pending.popleft()
            self._pending_bytes -= len(data)
            self.transport.write(data)
        self.gateway.charge(self)

    def stopProducing(self):
        self._pending.clear()
        self._pending_bytes = 0

    # -- input

    def dataReceived(self, data: bytes):
        if self._closing:
            return
        buf = self._buf
        buf += data
        pos = 0
        max_line = self.gateway.max_line
        while not self._closing:
            if self._skip:
                n = min(self._skip, len(buf) - pos)
                pos += n
                self._skip -= n
                if self._skip:
                    break
                continue
            if self._need is not None:
                if len(buf) - pos < self._need:
                    break
                body = bytes(buf[pos:pos + self._need])
                pos += self._need
                self._need = None
                channels, self._send_channels = self._send_channels, []
                self.gateway.clientSent(self, channels, body)
                self.sendLine(b"ack send")  # the second: the message went out
                continue
            end = buf.find(b"\n", pos)
            if end < 0:
                if len(buf) - pos > max_line:
                    self.error(f"line too long (over {max_line} bytes)", close=True)
                break
            if end - pos > max_line:
                self.error(f"line too long (over {max_line} bytes)", close=True)
                break
            line = bytes(buf[pos:end])
            pos = end + 1
            self.lineReceived(line[:-1] if line.endswith(b"\r") else line)
        if self._closing:
            buf.clear()
        elif pos:
            del buf[:pos]
        if not self._closing and not self.gateway.charge(self):
            self.error(f"uid {self.uid}: its connections hold over {self.gateway.max_uid_bytes} bytes "
                       f"in the gateway together (--max-uid-bytes); closing", close=True)
            buf.clear()                         # released now, not when the close completes
            self.gateway.charge(self)

    def lineReceived(self, line: bytes) -> None:
        words = line.split()
        if not words:
            return self.error("empty command")
        cmd, args = words[0], words[1:]
        handler = _COMMANDS.get(cmd)
        if handler is None:
            return self.error(f"unknown command {cmd.decode('utf-8', 'replace')!r}")
        handler(self, args)

    def _no_args(self, name: str, args) -> bool:
        if args:
            self.error(f"{name} takes no arguments")
            return False
        return True

    def _channels(self, name: str, args, quiet: bool = False) -> list[bytes] | None:
        """The channels of a command, or None after an error line (`quiet`: the caller says it)."""
        why = None
        if not args:
            why = f"{name} needs at least one channel"
        elif any(b"\0" in a for a in args):
            why = f"{name}: a channel may not contain a NUL byte"
        else:
            longest = max(len(a) for a in args)
            if longest > self.gateway.max_channel:
                why = f"{name}: a channel of {longest} bytes is over the limit of {self.gateway.max_channel}"
        if why is not None:
            if quiet:
                self._why = why
            else:
                self.error(why)
            return None
        return args

    def do_sub(self, args):
        channels = self._channels("sub", args)
        if channels is not None:
            new = set(channels) - self.channels
            g = self.gateway
            if len(self.channels) + len(new) > g.max_channels:
                return self.error(f"sub: over the limit of {g.max_channels} channels per client")
            added = sum(len(c) for c in new)
            if self.channel_bytes + added > g.max_channel_bytes:
                return self.error(f"sub: over the limit of {g.max_channel_bytes} channel bytes per client")
            self.channel_bytes += added
            for c in channels:
                if c not in self.channels:
                    self.channels.add(c)
                    self.gateway.trie.add(c, self)
            self.sendLine(b"ack sub")

    def do_unsub(self, args):
        channels = self._channels("unsub", args)
        if channels is not None:
            for c in channels:
                if c in self.channels:
                    self.channels.discard(c)
                    self.channel_bytes -= len(c)
                    self.gateway.trie.remove(c, self)
            self.sendLine(b"ack unsub")

    def do_listen(self, args):
        if self._no_args("listen", args):
            self.listening = True
            self.sendLine(b"ack listen")

    def do_unlisten(self, args):
        if self._no_args("unlisten", args):
            self.listening = False
            self.sendLine(b"ack unlisten")

    def do_ping(self, args):
        if self._no_args("ping", args):
            self.sendLine(b"pong")

    def do_send(self, args):
        if not args:
            return self.error("send needs a length and at least one channel")
        size = args[0]
        if not (size.isdigit() and size.isascii()):
            # where the message ends is unknown: its bytes must never be read as commands
            return self.error(f"send: bad length {size.decode('utf-8', 'replace')!r}; closing",
                              close=True)
        digits = size.lstrip(b"0")
        # int() refuses over 4,300 digits (ValueError: a traceback); no limit has 19
        n = int(digits) if 0 < len(digits) <= 18 else (0 if not digits else None)
        channels = self._channels("send", args[1:], quiet=True)
        limit = self.gateway.limit_for(channels or [b""])
        if n is None or n > limit:
            shown = n if n is not None else f"{len(digits)} digits of"
            return self.error(f"send: message of {shown} bytes is over the limit of {limit} bytes", close=True)
        if channels is None:
            # refused, but its X bytes are announced: discard them, never run them as commands
            self._skip = n
            return self.error(self._why)
        self._need = n
        self._send_channels = channels
        self.sendLine(b"ack send")  # the first: the command is accepted, send the bytes

    def do_error(self, args):
        """A client reporting an error: logged, not answered (as the original does)."""
        log.info("msgbus client {peer} reports: {what}", peer=self.peer,
                 what=b" ".join(args).decode("utf-8", "replace")[:200])


_COMMANDS = {
    b"sub": MsgbusProtocol.do_sub,
    b"unsub": MsgbusProtocol.do_unsub,
    b"listen": MsgbusProtocol.do_listen,
    b"unlisten": MsgbusProtocol.do_unlisten,
    b"ping": MsgbusProtocol.do_ping,
    b"send": MsgbusProtocol.do_send,
    b"error": MsgbusProtocol.do_error,
}


class MsgbusGateway(protocol.Factory):
    """The msgbus side: clients, the channel trie, delivery; `bus` publishes to sbus."""

    noisy = False

    def __init__(self, *, max_packet: int = MAX_PACKET, max_message: int | None = None,
                 max_line: int = DEFAULT_MAX_LINE, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 max_clients: int = DEFAULT_MAX_CLIENTS, max_channel: int = DEFAULT_MAX_CHANNEL,
                 max_channels: int = DEFAULT_MAX_CHANNELS,
                 max_channel_bytes: int = DEFAULT_MAX_CHANNEL_BYTES,
                 admission: Admission | None = None, allow_remote: bool = False,
                 max_uid_bytes: int = DEFAULT_MAX_UID_BYTES):
        self.max_clients = max_clients
        self.max_uid_bytes = max_uid_bytes
        #: uid -> bytes its connections hold together (`charge`); the gateway's own uid is not held
        self.uid_bytes: dict = {}
        self.own_uid = os.getuid()
        self.max_channel = max_channel
        self.max_channels = max_channels
        self.max_channel_bytes = max_channel_bytes
        self.admission = admission if admission is not None else Admission(None, "sbus-msgbus")
        self.allow_remote = allow_remote
        self.refused = 0
        self.max_packet = max_packet
        self.max_message = max_message
        self.max_line = max_line
        self.queue_bytes = queue_bytes
        self.trie = ChannelTrie()
        self.clients: set[MsgbusProtocol] = set()
        self.bus = None  # a ReconnectingClient (publish returns False while down)
        self.received_clients = 0
        self.received_bus = 0
        self.delivered = 0
        self.published = 0
        self.dropped_clients = 0   # slow gateway clients
        self.dropped_bus = 0       # not published: bus down, key invalid or too long
        self.errors = 0

    def buildProtocol(self, addr):
        return MsgbusProtocol(self)

    def admit(self, client: MsgbusProtocol) -> str | None:
        """None if the client may use the bus; else why not (one line)."""
        if len(self.clients) >= self.max_clients:
            return f"too many clients (limit {self.max_clients})"
        pid, uid, gid, how = peer_credentials(client.transport)
        client.uid = uid
        if uid is None:
            if self.allow_remote:
                return None
            return (f"uid unknown ({how}: not a local peer); remote clients need --allow-remote")
        return self.admission.refusal(uid, pid, gid, how)

    def limit_for(self, channels: list[bytes]) -> int:
        if self.max_message is not None:
            return self.max_message
        return self.max_packet - PACKET_OVERHEAD - max(len(c) for c in channels)

    def clientConnected(self, client: MsgbusProtocol) -> None:
        self.clients.add(client)

    def clientLost(self, client: MsgbusProtocol) -> None:
        self.clients.discard(client)
        for c in client.channels:
            self.trie.remove(c, client)
        client.channels.clear()
        client.channel_bytes = 0
        self.charge(client)

    def charge(self, client: MsgbusProtocol) -> bool:
        """Count what `client` holds now (unfinished input, queued output, channel names) against
        its uid; False if its uid's connections together hold more than `max_uid_bytes`."""
        now = client.held()
        delta, client.charged = now - client.charged, now
        uid = client.uid
        total = self.uid_bytes.get(uid, 0) + delta
        if total:
            self.uid_bytes[uid] = total
        else:
            self.uid_bytes.pop(uid, None)
        return uid == self.own_uid or total <= self.max_uid_bytes

    def deliver(self, channels, body: bytes, sender=None) -> int:
        recipients: set = set()
        for c in channels:
            self.trie.collect(c, recipients)
        recipients.discard(sender)
        data = b"recv %d\n" % len(body) + body
        n = 0
        for client in recipients:
            if client.listening:
                if client.deliver(data):
                    n += 1
                else:
                    self.dropped_clients += 1
        self.delivered += n
        return n

    def clientSent(self, sender: MsgbusProtocol, channels: list[bytes], body: bytes) -> None:
        self.received_clients += 1
        self.deliver(channels, body, sender)
        seen = set()
        for c in channels:
            if c in seen:
                continue
            seen.add(c)
            key = KEY_PREFIX + c
            try:
                check_key(key)
                packet_ok = len(key) + len(body) + 5 <= self.max_packet
            except CredentialError:
                packet_ok = False
            if not packet_ok:
                self.dropped_bus += 1
                log.warn("not publishing a message on {key!r} to the bus: invalid key or too big "
                         "for a packet", key=key)
                continue
            if self.bus is not None and self.bus.publish(key, body):
                self.published += 1
            else:
                self.dropped_bus += 1

    def busMessage(self, key: bytes, payload: bytes) -> None:
        if not key.startswith(KEY_PREFIX):
            return
        self.received_bus += 1
        self.deliver((key[len(KEY_PREFIX):],), payload)


class MsgbusService(Chassis):
    name = kind = "sbus-msgbus"
    log = log

    def __init__(self, bus, port: str = DEFAULT_PORT, *, stats_interval: float = 60.0,
                 max_delay: float = 10.0, reactor=None, backlog: int = DEFAULT_BACKLOG,
                 **gateway_options):
        super().__init__(bus, stats_interval=stats_interval, reactor=reactor)
        self.backlog = backlog
        gateway_options.setdefault("admission", Admission(bus, "sbus-msgbus"))
        self.port = port
        self.max_delay = max_delay
        self.gateway = MsgbusGateway(**gateway_options)
        self.client = None
        self._listening = None

    def statsName(self) -> str:
        return self.port

    def setUp(self):
        gateway = self.gateway
        gateway.bus = self.client = self.connect(
            subscribe=[KEY_PREFIX], misses=True, stats=True, maxDelay=self.max_delay,
            max_packet=gateway.max_packet, message=lambda key, payload, proto: gateway.busMessage(key, payload),
            # the bus's -u list (admission): until it is known, only root and our uid are served
            made=gateway.admission.ask,
            ready=lambda proto: log.info(
                "connected to the bus {bus} as {who}; subscribed to msgbus/, echo off{again}",
                bus=self.bus or "(default address)", who=self.who(proto),
                again=f" (reconnect {self.client.connects - 1})" if self.client.connects > 1 else ""))
        endpoint = server_endpoint(self.reactor, self.port, gateway.admission.access, self.backlog)
        result = []
        endpoint.listen(gateway).addBoth(result.append)
        if not result or isinstance(result[0], Failure):
            # A port someone else holds would leave clients talking to the squatter: fatal.
            why = result[0].getErrorMessage() if result else "listening did not complete"
            log.critical("msgbus gateway: cannot listen on {port}: {why}; exiting", port=self.port, why=why)
            self.client.stop()
            raise SystemExit(f"sbus-msgbus: cannot listen on {self.port}: {why}")
        port = self._listening = result[0]
        host = port.getHost()
        log.info("msgbus gateway listening on {host}:{port} (admits {who}{remote})",
                 host=getattr(host, "host", getattr(host, "name", host)), port=getattr(host, "port", ""),
                 who=gateway.admission.describe(),
                 remote="; remote peers too (--allow-remote)" if gateway.allow_remote else "")

    def beforeStop(self):
        for c in list(self.gateway.clients):
            c.close()
        if self._listening is not None:
            return self._listening.stopListening()

    def stats(self) -> dict:
        g = self.gateway
        return {
            "clients": len(g.clients), "from_clients": g.received_clients, "from_bus": g.received_bus,
            "delivered": g.delivered, "published": g.published,
            "drops": {"slow_client": g.dropped_clients, "not_published": g.dropped_bus},
            "errors": g.errors, "refused": g.refused, "reconnects": self.reconnects(),
            "unknown_gaps": self.unknownGaps(),
            "stats_requests": {"answered": self.responder.answered, "refused": self.responder.refused},
        }

    def reportLine(self, st: dict, final: bool) -> None:
        log.info("{what}: clients={clients}; messages from clients={fc} from bus={fb}; delivered={d}; "
                 "published to bus={p}; drops slow client={ds} not published={dn}; errors={e}; "
                 "refused={rf}; reconnects={r}", rf=st["refused"], what="stopped" if final else "stats", clients=st["clients"],
                 fc=st["from_clients"], fb=st["from_bus"], d=st["delivered"], p=st["published"],
                 ds=st["drops"]["slow_client"], dn=st["drops"]["not_published"], e=st["errors"],
                 r=st["reconnects"])


class Options(usage.Options):
    synopsis = "--bus ADDRESS [--port ENDPOINT] [options]"
    longdesc = (
        "Serve the msgbus line protocol (sub, unsub, listen, unlisten, ping, send) on a Twisted "
        "server endpoint and join it to an sbus bus: sends are also published as msgbus/<channel>, "
        "and bus messages on msgbus/<name> reach clients as if sent to <name>. The default port "
        "listens on loopback only; 'tcp:11111' listens on every interface."
    )
    optParameters = [
        METRICS_OPTION,
        ["bus", "b", None, "Bus address (path, /dev/unix/abstract/HEX, /dev/fd/N); "
                           "default $SBUS_SOCKET, else /run/sbus.socket. " + MISSING_BUS_HELP],
        ["port", "p", DEFAULT_PORT, "Twisted server endpoint string for msgbus clients."],
        ["max-packet", None, str(MAX_PACKET), "The bus's packet limit, bytes."],
        ["max-message", None, None, "Largest message a client may send, bytes (default: what "
                                    "fits in one bus packet with its key)."],
        ["max-line", None, str(DEFAULT_MAX_LINE), "Longest command line, bytes."],
        ["queue-bytes", None, str(DEFAULT_QUEUE_BYTES), "Per-client output queue beyond the "
                                                        "socket buffer; more is dropped."],
        ["stats-interval", None, "60", "Seconds between stats lines in the log (only if changed)."],
        ["max-delay", None, "10", "Longest bus reconnect back-off, seconds."],
        ["backlog", None, str(DEFAULT_BACKLOG), "Listen backlog (connections waiting for accept)."],
        ["max-clients", None, str(DEFAULT_MAX_CLIENTS), "Clients served at once; more are refused."],
        ["max-uid-bytes", None, str(DEFAULT_MAX_UID_BYTES),
         "Bytes all connections of one uid (not the gateway's own) may hold together: unfinished "
         "commands and messages, queued output, channel names. Over it: the connection that "
         "grows it is closed, a message for it dropped."],
        ["max-channel", None, str(DEFAULT_MAX_CHANNEL), "Longest channel name, bytes."],
        ["max-channels", None, str(DEFAULT_MAX_CHANNELS), "Channels one client may hold."],
        ["max-channel-bytes", None, str(DEFAULT_MAX_CHANNEL_BYTES),
         "Total bytes of the channels one client may hold."],
    ]
    optFlags = [
        ["allow-remote", None, "Admit TCP peers on other hosts (their uid cannot be checked). "
                               "Local peers are always checked: only uids that could open the bus "
                               "socket are served."],
    ]

    def postOptions(self):
        Chassis.checkBus(self["bus"])
        for name in ("max-packet", "max-line", "queue-bytes", "backlog", "max-clients", "max-channel",
                     "max-channels", "max-channel-bytes", "max-uid-bytes"):
            self[name] = positive_int(name, self[name])
        if self["max-packet"] <= PACKET_OVERHEAD + 1:
            raise usage.UsageError(f"--max-packet: must be over {PACKET_OVERHEAD + 1}")
        if self["max-message"] is not None:
            self["max-message"] = positive_int("max-message", self["max-message"])
        for name in ("stats-interval", "max-delay"):
            try:
                self[name] = float(self[name])
            except ValueError:
                raise usage.UsageError(f"--{name}: not a number: {self[name]!r}") from None
            if not self[name] > 0:
                raise usage.UsageError(f"--{name}: must be positive")
        try:
            # parse only (no reactor is touched before twistd chooses one)
            endpoint_kind(self["port"])
            endpoints.serverFromString(object(), self["port"])
        except IndexError:
            raise usage.UsageError(f"--port {self['port']!r}: systemd passed no such socket (LISTEN_FDS, "
                                   "LISTEN_FDNAMES)") from None
        except (ValueError, KeyError, TypeError) as e:
            raise usage.UsageError(f"--port: bad endpoint {self['port']!r}: {e}") from None


def makeService(options) -> MsgbusService:
    return MsgbusService(
        options["bus"], options["port"], stats_interval=options["stats-interval"],
        max_delay=options["max-delay"], max_packet=options["max-packet"],
        max_message=options["max-message"], max_line=options["max-line"],
        queue_bytes=options["queue-bytes"], backlog=options["backlog"],
        max_clients=options["max-clients"], max_channel=options["max-channel"],
        max_channels=options["max-channels"], max_channel_bytes=options["max-channel-bytes"],
        allow_remote=bool(options["allow-remote"]), max_uid_bytes=options["max-uid-bytes"],
    )
