"""SOCK_SEQPACKET for Twisted: a listening port and a connected transport.

Twisted has no SEQPACKET support and its stream transports join writes, so
this is a small transport of our own on the public reactor API
(`addReader`/`addWriter`). Each `write` is one packet and one `send`
(SEQPACKET sends are all or nothing); each wakeup reads several packets,
up to a cap, so one busy client cannot starve the others; oversized packets
are detected with MSG_TRUNC, never silently cut.

Shared by the server (`sbus.server`), the Twisted client and the services;
it imports nothing from `sbus.server`.

Closing peers: Linux reports ``ECONNRESET`` on the next ``recv`` when the
peer closed with packets of ours still unread, *before* the packets it sent
us; so a read error is not the end: packets are read until ``recv`` returns
end of file. Likewise a failed ``send`` (the peer is gone) stops output but
not input: what the peer sent before it went is read and delivered first.

The per-packet work is in two places a batch accelerator may replace:
`SeqPacketTransport.doRead` (one wakeup's reads) and `doWrite` (draining
the queue); single sends go through `trySend`.
"""

from __future__ import annotations

import errno
import os
import select
import socket
from itertools import islice

from twisted.internet import error, interfaces, main
from twisted.logger import Logger
from twisted.python import failure
from zope.interface import implementer

from sbus.address import peer_credentials, size_buffers
from sbus.core.credentials import Credentials
from sbus.core.flood import FIFO, QUEUED_BLOCK, Outbox
from sbus.core.limits import DEFAULT_DRAIN_CAP, DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_PACKETS, MAX_PACKET
from sbus.interfaces import IPacketTransport

log = Logger()

_MSG_TRUNC = socket.MSG_TRUNC
#: Never SIGPIPE, whatever the embedding program did with the signal: a gone peer is EPIPE.
_NOSIGNAL = socket.MSG_NOSIGNAL
#: A send error that concerns the packet, not the connection: drop that packet, keep the peer.
_PACKET_ERRORS = (errno.EMSGSIZE,)
#: After a failed send, at most this many packets still waiting from the peer are read.
_DRAIN_AFTER_SEND_FAILURE = 1 << 16
_ACCEPT_CAP = 64
_ACCEPT_ERRORS_BACKOFF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

_buffers: dict[int, memoryview] = {}

#: Linux 6.5+: a pidfd for the process that connected (not in Python 3.11's socket module).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


def receive_buffer(size: int) -> memoryview:
    """One buffer per size for the whole process: the reactor reads one socket at a time."""
    buf = _buffers.get(size)
    if buf is None:
        buf = _buffers[size] = memoryview(bytearray(size))
    return buf


@implementer(interfaces.IAddress)
class SeqPacketAddress:
    """The peer of a connection: its socket name and its credentials."""

    __slots__ = ("name", "cred")

    def __init__(self, name, cred: Credentials | None = None):
        self.name = name
        self.cred = cred

    def __repr__(self):
        if self.cred:
            return f"<SeqPacketAddress pid={self.cred.pid} uid={self.cred.uid} gid={self.cred.gid}>"
        return f"<SeqPacketAddress {self.name!r}>"


@implementer(
    interfaces.IReadWriteDescriptor,
    interfaces.ITransport,
    interfaces.IPushProducer,
    interfaces.IConsumer,
    IPacketTransport,
)
class SeqPacketTransport:
    """A connected SOCK_SEQPACKET socket driving one protocol."""

    __slots__ = (
        "socket", "protocol", "reactor", "peer", "outbox", "max_packet", "drain_cap",
        "connected", "disconnecting", "_fd", "_reading", "_writing", "_send", "_recv_into",
        "_buf", "_packetReceived", "_producer", "_producerPaused", "_streaming", "_host", "packets_out",
        "bytes_out", "packets_unsendable", "_hungUp", "_watch", "_aborted", "_closing", "__weakref__",
    )

    def __init__(self, sock, protocol, reactor, *, max_packet, drain_cap=DEFAULT_DRAIN_CAP,
                 queue_bytes=DEFAULT_QUEUE_BYTES, queue_packets=DEFAULT_QUEUE_PACKETS, peer=None):
        sock.setblocking(False)
        size_buffers(sock, max_packet)
        self.socket = sock
        self._fd = sock.fileno()
        self.protocol = protocol
        self.reactor = reactor
        self.peer = peer
        self.outbox = Outbox(queue_bytes, queue_packets)
        self.max_packet = max_packet
        self.drain_cap = drain_cap
        self.connected = True
        self.disconnecting = False
        self._reading = self._writing = False
        self._send = sock.send
        self._recv_into = sock.recv_into
        # MSG_TRUNC makes recv_into report a bigger packet's real size, so one spare byte is not needed.
        self._buf = receive_buffer(max_packet)
        self._packetReceived = protocol.packetReceived
        self._producer = None
        self._producerPaused = False
        self._streaming = True
        self._host = None
        self.packets_out = 0
        self.bytes_out = 0
        #: Packets dropped because the kernel refused them (EMSGSIZE), not because the peer left.
        self.packets_unsendable = 0
        #: The peer hung up while we were not reading: read what it sent, pause or no pause.
        self._hungUp = False
        #: The reactor's HangupWatch once we used it (released when the connection ends).
        self._watch = None
        self._aborted = False
        #: The delayed call that will finish the connection (abort, failed send), if any.
        self._closing = None

    # -- startup / descriptors

    def startReading(self):
        if not self._reading and self.connected:
            self._reading = True
            self.reactor.addReader(self)

    def stopReading(self):
        if self._reading:
            self._reading = False
            self.reactor.removeReader(self)

    def startWriting(self):
        if not self._writing and self.connected:
            self._writing = True
            self.reactor.addWriter(self)

    def stopWriting(self):
        if self._writing:
            self._writing = False
            self.reactor.removeWriter(self)

    def fileno(self):
        return self._fd

    def logPrefix(self):
        return self.protocol.__class__.__name__

    # -- reading

    def doRead(self):
        """Read up to `drain_cap` packets (one wakeup's worth); None, or why the connection ended."""
        recv_into = self._recv_into
        buf = self._buf
        limit = self.max_packet
        deliver = self._packetReceived
        for _ in range(self.drain_cap):
            try:
                n = recv_into(buf, limit, _MSG_TRUNC)
            except BlockingIOError:
                return None
            except InterruptedError:
                continue
            except ConnectionResetError:
                # The peer closed with our packets unread: Linux says so before handing us the
                # packets it sent. The error is reported once; read on until end of file.
                continue
            except OSError:
                return main.CONNECTION_LOST
            if n == 0:
                # A zero-length packet reads exactly like end of file: treat it as the peer closing.
                return main.CONNECTION_DONE
            if n > limit:
                self.protocol.packetTooLarge(n)
            else:
                deliver(buf[:n].tobytes())
            if not self._reading:
                return None
        return None

    # -- writing

    def trySend(self, packet: bytes) -> bool:
        """Send `packet` now if nothing is queued before it. True: done with it (sent, or
        there is no one to send it to); False: it would block, queue it."""
        if self.outbox.nbytes:  # something queued (no packet is empty); not __bool__: ~70 ns less
            return False
        if self.disconnecting:
            return True
        try:
            self._send(packet, _NOSIGNAL)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno in _PACKET_ERRORS:
                self._unsendable(packet, e)
            else:
                self._sendFailed(e)
            return True
        self.packets_out += 1
        self.bytes_out += len(packet)
        return True

    def offer(self, packet: bytes) -> int:
        """Queue `packet` under the client's flood policy; return what `Outbox.offer` decided."""
        action = self.outbox.offer(packet)
        if action <= QUEUED_BLOCK:
            self.startWriting()
        return action

    def sendLast(self, packet: bytes) -> None:
        """Send now, ahead of anything queued, if the socket takes it (the connection is closing)."""
        if self.connected:
            try:
                self._send(packet, _NOSIGNAL)
            except OSError:
                return
            self.packets_out += 1
            self.bytes_out += len(packet)

    def notifyWritable(self) -> None:
        """Call the protocol's `outboxDrained` once the socket is writable and nothing is queued."""
        self.startWriting()

    def queued(self) -> int:
        return len(self.outbox)

    def queuedBytes(self) -> int:
        return self.outbox.nbytes

    def hasRoom(self) -> bool:
        """Is the queue under its limits (and its uid's and the server's)?"""
        return not self.outbox.full()

    def queueState(self):
        return self.outbox.state()

    def setFlood(self, soft=None, hard=None, order=None) -> None:
        outbox = self.outbox
        if soft is not None:
            outbox.set_soft(soft)
        if hard is not None:
            outbox.set_hard(hard)
        if order is not None:
            outbox.set_order(order)

    def setBudget(self, budget) -> None:
        self.outbox.set_budget(budget)

    def peerPidfd(self) -> int:
        """A new pidfd (the caller closes it) of the process that connected: SO_PEERPIDFD, Linux
        6.5+, always that process whenever asked. Raises OSError (ENOPROTOOPT: older kernels)."""
        return self.socket.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)

    def enqueue(self, packet: bytes) -> None:
        self.outbox.push(packet)
        self.startWriting()
        producer = self._producer
        if producer is not None and not self._producerPaused and self.outbox.nbytes > self.outbox.max_bytes:
            self._producerPaused = True
            producer.pauseProducing()

    def write(self, packet: bytes) -> None:
        """ITransport.write: one packet; queued, never dropped, if it cannot go now."""
        if not packet:
            raise ValueError("an empty SEQPACKET packet reads as end of file; refusing to send one")
        if not self.connected or self.disconnecting:
            return
        if not self.trySend(packet):
            self.enqueue(packet)
        elif self._producer is not None and not self._streaming:
            self.startWriting()  # a pull producer is asked for more from doWrite

    def writeSequence(self, seq):
        """The items of `seq` form ONE packet (SEQPACKET has no streams to join them into)."""
        self.write(b"".join(seq))

    def doWrite(self):
        """Send queued packets until the kernel says EAGAIN or the queue is empty."""
        outbox = self.outbox
        send = self._send
        while outbox:
            packet = outbox.peek()
            try:
                send(packet, _NOSIGNAL)
            except BlockingIOError:
                return None
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno not in _PACKET_ERRORS:
                    self._sendFailed(e)
                    return None
                outbox.pop()
                self._unsendable(packet, e)
                continue
            outbox.pop()
            self.packets_out += 1
            self.bytes_out += len(packet)
        self.stopWriting()
        if self.disconnecting:
            return main.CONNECTION_DONE if self.connected else None
        producer = self._producer
        if producer is not None and (self._producerPaused or not self._streaming):
            self._producerPaused = False
            producer.resumeProducing()
            if not self.connected:
                return None
        drained = getattr(self.protocol, "outboxDrained", None)
        if drained is not None:
            drained()
        return None

    def _unsendable(self, packet: bytes, exc: OSError) -> None:
        """The kernel refused this packet (EMSGSIZE: bigger than our SO_SNDBUF allows). It is the
        packet's fault, not the peer's: drop it, keep the connection, say so once."""
        self.packets_unsendable += 1
        hook = getattr(self.protocol, "packetUnsendable", None)
        if hook is not None:
            hook(packet, exc)
        elif self.packets_unsendable == 1:
            log.warn("{who}: dropped a {n}-byte packet the kernel refuses to send ({err}); "
                     "the socket buffer is too small for the packet size limit",
                     who=self.logPrefix(), n=len(packet), err=exc.strerror)

    def _sendFailed(self, exc):
        """The peer is gone (EPIPE, ECONNRESET, ...): stop sending, but first read and deliver
        what it sent before it went (it is in our receive queue already), then finish the
        connection, from the reactor rather than from inside a routing loop."""
        if self.connected and not self.disconnecting:
            self.disconnecting = True
            self.outbox.clear()
            self.stopWriting()
            self._closing = self.reactor.callLater(
                0, self._drainThenLose, failure.Failure(error.ConnectionLost(str(exc))))

    def _drainThenLose(self, reason):
        self._closing = None
        if not self.connected:
            return
        recv_into = self._recv_into
        buf = self._buf
        limit = self.max_packet
        # Bounded: a gone peer's queue is finite; one that only shut its reading side is cut off.
        for _ in range(_DRAIN_AFTER_SEND_FAILURE):
            if self._aborted or not self.connected:
                break
            try:
                n = recv_into(buf, limit, _MSG_TRUNC)
            except (InterruptedError, ConnectionResetError):
                continue
            except OSError:  # BlockingIOError included: all it sent is read
                break
            if n == 0:
                break
            if n > limit:
                self.protocol.packetTooLarge(n)
            else:
                self._packetReceived(buf[:n].tobytes())
        self.stopReading()
        self._lose(reason)

    # -- closing

    def loseConnection(self, _reason=None):
        """Close after everything queued has been sent."""
        if not self.connected or self.disconnecting:
            return
        self.disconnecting = True
        self.stopReading()
        self.startWriting()

    def abortConnection(self):
        """Close now, throwing away anything queued."""
        if not self.connected or self._aborted:
            return
        self._aborted = True
        self.disconnecting = True
        self.outbox.clear()
        self.stopReading()
        self.stopWriting()
        closing = self._closing
        if closing is not None and closing.active():
            closing.cancel()
        self._closing = self.reactor.callLater(0, self._lose, failure.Failure(error.ConnectionAborted()))

    def _lose(self, reason):
        self._closing = None
        if self.connected:
            self.connectionLost(reason)

    def readConnectionLost(self, reason):
        self.connectionLost(reason)

    def connectionLost(self, reason):
        if not self.connected:
            return
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.unwatch(self)
            _release_watch(watch)
        closing, self._closing = self._closing, None
        if closing is not None and closing.active():
            closing.cancel()
        self.stopReading()
        self.stopWriting()
        self.connected = False
        self.outbox.clear()
        try:
            self.socket.close()
        except OSError:
            pass
        self._fd = -1
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.stopProducing()
        protocol = self.protocol
        self._packetReceived = None
        protocol.connectionLost(reason)

    # -- ITransport odds and ends

    def getPeer(self):
        return SeqPacketAddress(self._peerName(), self.peer)

    def getHost(self):
        if self._host is None:
            self._host = SeqPacketAddress(self.socket.getsockname())
        return self._host

    def _peerName(self):
        try:
            return self.socket.getpeername()
        except OSError:
            return None

    # -- IPushProducer: pausing stops reading, which back-pressures the peer

    def pauseProducing(self):
        if self._hungUp or not self.connected:
            return
        self.stopReading()
        watch = self._watch
        if watch is None:
            watch = self._watch = _acquire_watch(self.reactor)
        if watch is not None:
            watch.watch(self)

    def resumeProducing(self):
        watch = self._watch
        if watch is not None:
            watch.unwatch(self)
        if self.connected and not self.disconnecting:
            self.startReading()

    def peerHungUp(self):
        """While paused, the peer closed: what it sent before is all it will send, so read it
        (it lands in subscribers' queues), then its end of file, and let the connection go."""
        self._hungUp = True
        if self.connected and not self.disconnecting:
            self.startReading()

    def stopProducing(self):
        self.loseConnection()

    # -- IConsumer

    def registerProducer(self, producer, streaming):
        if self._producer is not None:
            raise RuntimeError(f"cannot register producer {producer!r}: {self._producer!r} is registered")
        if not self.connected:
            producer.stopProducing()
            return
        self._producer = producer
        self._producerPaused = False
        self._streaming = bool(streaming)
        if not streaming:
            # A pull producer writes once per resumeProducing: doWrite asks again each time
            # the queue is empty, as long as it stays registered.
            self.startWriting()

    def unregisterProducer(self):
        self._producer = None
        self._streaming = True


@implementer(interfaces.IReadDescriptor)
class HangupWatch:
    """Paused transports are out of the reactor, so nothing would notice their peer
    leaving; one epoll set per reactor watches them for EPOLLRDHUP/EPOLLHUP instead.

    Shared by the ports and transports of one reactor (see `_acquire_watch`); the
    epoll descriptor is closed when the last of them lets go.
    """

    def __init__(self, reactor):
        self.reactor = reactor
        self.epoll = select.epoll()
        self.transports: dict[int, SeqPacketTransport] = {}
        self.reading = False
        #: Ports listening and transports that paused, on this reactor.
        self.users = 0

    def watch(self, transport: SeqPacketTransport):
        fd = transport.fileno()
        if fd < 0 or fd in self.transports:
            return
        self.epoll.register(fd, select.EPOLLRDHUP)
        self.transports[fd] = transport
        if not self.reading:
            self.reading = True
            self.reactor.addReader(self)

    def unwatch(self, transport: SeqPacketTransport):
        fd = transport.fileno()
        if self.transports.get(fd) is transport:
            del self.transports[fd]
            self.epoll.unregister(fd)
            self._idle()

    def _idle(self):
        # Out of the reactor when there is nothing to watch: no stray reader left behind.
        if not self.transports and self.reading:
            self.reading = False
            self.reactor.removeReader(self)

    def close(self):
        self.transports.clear()
        self._idle()
        self.epoll.close()

    def fileno(self):
        return self.epoll.fileno()

    def logPrefix(self):
        return "HangupWatch"

    def doRead(self):
        for fd, _events in self.epoll.poll(0):
            transport = self.transports.pop(fd, None)
            if transport is not None:
                self.epoll.unregister(fd)
                transport.peerHungUp()
        self._idle()

    def connectionLost(self, reason):
        self.reading = False


#: One watch per reactor in use, by id (an entry holds its reactor, so the id is not reused).
_watches: dict[int, HangupWatch] = {}


def _acquire_watch(reactor) -> HangupWatch | None:
    """The reactor's watch, created on first use (ports take it when they start listening,
    before descriptors can run out); None if it cannot be created (out of descriptors).
    Each successful call is paired with one `_release_watch`."""
    watch = _watches.get(id(reactor))
    if watch is None:
        try:
            watch = _watches[id(reactor)] = HangupWatch(reactor)
        except OSError as e:
            log.warn("cannot watch paused connections for hang-ups: {err}", err=e.strerror)
            return None
    watch.users += 1
    return watch


def _release_watch(watch: HangupWatch) -> None:
    watch.users -= 1
    if watch.users <= 0 and _watches.get(id(watch.reactor)) is watch:
        del _watches[id(watch.reactor)]
        watch.close()


@implementer(interfaces.IListeningPort, interfaces.IReadDescriptor)
class SeqPacketPort:
    """Accepts SEQPACKET connections on a bound socket and hands them to a factory.

    The factory's `buildProtocol(addr)` sees the peer's credentials as
    `addr.cred`; returning None refuses the connection. Closing the port never
    unlinks a socket file: whoever bound the path owns it.
    """

    def __init__(self, sock: socket.socket, factory, reactor=None, *, max_packet: int | None = None,
                 drain_cap: int | None = None, queue_bytes: int | None = None, queue_packets: int | None = None):
        if reactor is None:
            from twisted.internet import reactor
        self.socket = sock
        self.factory = factory
        self.reactor = reactor
        self.connected = False
        self._backoff = None
        self._watch = None
        self._fd = sock.fileno()
        # Per-connection settings: explicit ones win, else the factory's ServerConfig, else defaults.
        cfg = getattr(factory, "config", None)
        self._settings = {
            name: value if value is not None else getattr(cfg, name, default)
            for name, value, default in (
                ("max_packet", max_packet, MAX_PACKET), ("drain_cap", drain_cap, DEFAULT_DRAIN_CAP),
                ("queue_bytes", queue_bytes, DEFAULT_QUEUE_BYTES),
                ("queue_packets", queue_packets, DEFAULT_QUEUE_PACKETS),
            )
        }

    def startListening(self):
        sock = self.socket
        sock.setblocking(False)
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.listen(socket.SOMAXCONN)
        if self._watch is None:
            self._watch = _acquire_watch(self.reactor)
        self.factory.doStart()
        self.connected = True
        self.reactor.addReader(self)

    def stopListening(self):
        from twisted.internet import defer

        if self.connected:
            self.connected = False
            self.reactor.removeReader(self)
            if self._backoff is not None and self._backoff.active():
                self._backoff.cancel()
            self.socket.close()
            self._fd = -1
            watch, self._watch = self._watch, None
            if watch is not None:
                _release_watch(watch)
            self.factory.doStop()
        return defer.succeed(None)

    loseConnection = stopListening

    def connectionLost(self, reason):
        self.stopListening()

    def fileno(self):
        return self._fd

    def logPrefix(self):
        return "SeqPacketPort"

    def getHost(self):
        return SeqPacketAddress(self.socket.getsockname())

    def doRead(self):
        for _ in range(_ACCEPT_CAP):
            try:
                conn, name = self.socket.accept()
            except BlockingIOError:
                return None
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in _ACCEPT_ERRORS_BACKOFF:
                    self._pauseAccepting(e)
                    return None
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                log.error("accept failed: {err}", err=e)
                return None
            try:
                cred = peer_credentials(conn)
            except OSError as e:
                log.warn("refused a connection: cannot read its credentials ({err})", err=e)
                conn.close()
                continue
            self._connect(conn, name, cred)
        return None

    def _connect(self, conn, name, cred) -> None:
        """Give one accepted socket its protocol and transport. An exception here costs that
        one connection (logged, closed), never the listener (as twisted's tcp.Port does)."""
        transport = None
        try:
            protocol = self.factory.buildProtocol(SeqPacketAddress(name, cred))
            if protocol is None:
                conn.close()
                return
            transport = ServerTransport(conn, protocol, self.reactor, peer=cred, **self._settings)
            protocol.makeConnection(transport)
            transport.startReading()
        except Exception:
            log.failure("could not set up the connection of pid {pid} uid {uid}; closed it, still listening",
                        pid=cred.pid, uid=cred.uid)
            if transport is not None and transport.connected:
                try:  # let the protocol forget what it set up; it failed once, stay quiet
                    transport.connectionLost(failure.Failure(error.ConnectionAborted()))
                except Exception:
                    transport.stopReading()
                    transport.stopWriting()
            conn.close()

    def _pauseAccepting(self, exc):
        """Out of descriptors or memory: stop accepting for a moment instead of spinning."""
        self.reactor.removeReader(self)
        log.warn("accept failed ({err}); not accepting for 0.5 s", err=exc.strerror)

        def resume():
            self._backoff = None
            if self.connected:
                self.reactor.addReader(self)

        self._backoff = self.reactor.callLater(0.5, resume)


def connectSeqPacket(reactor, address, protocol, *, max_packet: int = MAX_PACKET,
                     drain_cap: int = DEFAULT_DRAIN_CAP, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                     queue_packets: int = DEFAULT_QUEUE_PACKETS) -> SeqPacketTransport:
    """Connect `protocol` to the SEQPACKET socket at `address` (a path, or bytes
    starting with NUL for an abstract name); the client side of the same transport.

    Unix-domain connects finish at once or fail at once (a full backlog gives
    EAGAIN, reported like a refusal), so this is synchronous and raises OSError.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        size_buffers(sock, max_packet)
        sock.setblocking(False)
        sock.connect(address)
        peer = peer_credentials(sock)
    except BaseException:
        sock.close()
        raise
    transport = SeqPacketTransport(
        sock, protocol, reactor, max_packet=max_packet, drain_cap=drain_cap,
        queue_bytes=queue_bytes, queue_packets=queue_packets, peer=peer,
    )
    protocol.makeConnection(transport)
    transport.startReading()
    return transport


# -- batch I/O (the accelerator): recvmmsg/sendmmsg through sbus._speedups ----------------------
#
# The server side reads a publisher's waiting packets with one recvmmsg, routes them all, and
# sends each recipient its share with one sendmmsg when the batch is done (docs/performance.md).
# Clients see no difference: per publisher, packets reach each subscriber in the order sent;
# what a subscriber's socket does not take goes through the broker's flood control exactly as a
# refused send does on the pure path. SBUS_PURE_PYTHON=1 (or no compiler at install) keeps the
# pure-Python transport above.


def _load_speedups():
    if os.environ.get("SBUS_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from sbus import _speedups
    except ImportError:
        return None
    return _speedups


_speedups = _load_speedups()
#: True when the server's connections use batch I/O (the C extension is there and not disabled).
BATCH_IO = _speedups is not None
if BATCH_IO:
    _recv_batch = _speedups.recv_batch
    _send_batch = _speedups.send_batch

#: Set while a batch is being routed: `BatchSeqPacketTransport.trySend` then collects.
_collecting = False
#: The protocol whose packets are being routed (the feeder flood control may pause).
_feeder = None
#: Transports holding collected packets, flushed when the batch is routed.
_dirty: list = []


def _key_of(packet: bytes) -> bytes:
    """The routing key of a delivered (MSG) packet, for flood control's drop notices."""
    end = packet.find(b"\0", 4)
    return packet[4:end] if end >= 0 else packet[4:]


def _flush_dirty():
    global _dirty
    dirty = _dirty
    _dirty = []
    feeder = _feeder
    for transport in dirty:
        pending = transport._pending
        if pending is not None:
            transport._pending = None
            transport._sendPending(pending, feeder)


def _lean_dispatch(reactor) -> None:
    """Let the epoll reactor hand events of batch transports straight to its `_doReadOrWrite`.

    Twisted wraps every event in `log.callWithLogger` (a `logPrefix` call, two dict copies and a
    context push and pop), which profiles as the largest Python cost of a wakeup that reads one
    packet (a round trip). Our transports log through `twisted.logger` (namespaces, not the
    legacy context), and `_doReadOrWrite` itself catches and logs whatever `doRead`/`doWrite`
    raise, so for them the wrapper adds nothing. Other descriptors keep it. Only Twisted's own
    EPollReactor, unmodified, is touched, once.
    """
    try:
        from twisted.internet.epollreactor import EPollReactor
    except ImportError:  # pragma: no cover - not Linux
        return
    if type(reactor) is not EPollReactor or "doIteration" in vars(reactor):
        return
    from twisted.python import log as legacy_log

    poller = reactor._poller
    selectables = reactor._selectables
    drdw = reactor._doReadOrWrite
    with_logger = legacy_log.callWithLogger
    fast = BatchSeqPacketTransport

    def doPoll(timeout):
        if timeout is None:
            timeout = -1
        try:
            events = poller.poll(timeout, len(selectables))
        except InterruptedError:
            return
        for fd, event in events:
            selectable = selectables.get(fd)
            if selectable is None:
                continue
            if selectable.__class__ is fast:
                drdw(selectable, fd, event)
            else:
                with_logger(selectable, drdw, selectable, fd, event)

    reactor.doPoll = reactor.doIteration = doPoll


class BatchSeqPacketTransport(SeqPacketTransport):
    """The server's transport with batch receive and batch send.

    `doRead` takes up to `drain_cap` packets with one recvmmsg and routes them with deliveries
    collected: while it runs, `trySend` (the broker's delivery path) appends to the recipient's
    pending list instead of sending. When the batch is routed, every recipient's list goes out
    with one sendmmsg. Replies (`write`) are never collected: they first flush what is pending
    for that client, so order holds.

    What a recipient's socket refuses goes through its protocol's `deliver` (flood control:
    queue, drop, block, disconnect) in order, exactly as a refused send does on the pure path,
    until flood control pauses the publisher. From then on, the pure path would not have read
    the publisher's later packets at all; here they are read already, so the publisher's
    transport holds them (`_held`: recipient and packet), off every queue and limit, and hands
    them over first when it resumes. Likewise, if the publisher is paused in the middle of a
    batch, the rest of the batch waits on its transport (`_stash`), unrouted, as unread packets
    wait in the kernel. So queues, limits, drops and pauses are what the pure path gives.
    """

    __slots__ = ("_pending", "_stash", "_held")

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._pending = None
        self._stash = None
        self._held = None
        if "doIteration" not in vars(self.reactor):
            _lean_dispatch(self.reactor)

    def _paused(self) -> bool:
        """Held back by flood control (not reading, yet neither closing nor hung up)."""
        return not self._reading and self.connected and not self.disconnecting

    # -- reading

    def doRead(self):
        if self._held is not None or self._stash is not None:
            why = self._catchUp()
            if why is not None or not self._reading:
                return why
        for _ in range(2):
            try:
                packets = _recv_batch(self._fd, self.drain_cap, self.max_packet)
            except (InterruptedError, ConnectionResetError):
                # ECONNRESET comes once, before the packets a closing peer sent: read on (as doRead).
                continue
            except OSError:
                return main.CONNECTION_LOST
            if not packets:
                return None
            if len(packets) == 1 and packets[0].__class__ is bytes and packets[0]:
                # One packet (a round trip, a quiet bus): nothing to batch, send as it routes.
                self._packetReceived(packets[0])
                return None
            return self._route(packets)
        return None

    def _catchUp(self):
        """Hand over what waited while this publisher was paused: held deliveries, then the
        unrouted rest of its last batch. None, or why the connection ended."""
        held = self._held
        if held is not None:
            self._held = None
            protocol = self.protocol
            for k, (client, packet) in enumerate(held):
                t = client.transport
                if t.connected and not t.disconnecting:
                    client.deliver(packet, protocol, _key_of(packet))
                if self._paused():
                    rest = held[k + 1:]
                    if rest:
                        self._held = rest + (self._held or [])
                    return None
        stash = self._stash
        if stash is not None and self._reading:
            self._stash = None
            return self._route(stash)
        return None

    def _hold(self, client, packets: list) -> None:
        held = self._held
        if held is None:
            held = self._held = []
        held.extend([(client, p) for p in packets])

    def _route(self, packets: list):
        global _collecting, _feeder
        deliver = self._packetReceived
        protocol = self.protocol
        _collecting = True
        _feeder = protocol
        i = 0
        try:
            for packet in packets:
                i += 1
                if packet.__class__ is int:
                    protocol.packetTooLarge(packet)
                elif not packet:
                    # A zero-length packet reads exactly like end of file: the peer closed.
                    return main.CONNECTION_DONE
                else:
                    if packet[0] != 77 and _dirty:
                        # Not a MSG ("M"): a request, maybe for stats or whoami, whose answer must
                        # see every delivery routed before it as done (sent, queued or dropped).
                        _flush_dirty()
                    deliver(packet)
                if not self._reading:
                    if self._paused() and i < len(packets):
                        self._stash = packets[i:]  # paused: the rest waits, as unread packets do
                    return None
            return None
        finally:
            _collecting = False
            if _dirty:
                _flush_dirty()
            _feeder = None

    def resumeProducing(self):
        SeqPacketTransport.resumeProducing(self)
        if (self._held is not None or self._stash is not None) and self._reading:
            # The socket may have nothing more to read, so the reactor would not call doRead.
            self.reactor.callLater(0, self._resumed)

    def _resumed(self):
        if self._reading and self.connected:
            why = self._catchUp()
            if why is not None:
                self.connectionLost(failure.Failure(why))

    # -- writing

    def trySend(self, packet: bytes) -> bool:
        # outbox.nbytes == 0 is "nothing queued" (no packet is empty) without a Python __bool__ call.
        if _collecting and not self.outbox.nbytes and not self.disconnecting:
            pending = self._pending
            if pending is None:
                self._pending = [packet]
                _dirty.append(self)
            else:
                pending.append(packet)
            return True
        return SeqPacketTransport.trySend(self, packet)

    def _sendPending(self, pending: list, feeder) -> None:
        if not self.connected or self.disconnecting:
            return
        total = len(pending)
        fd = self._fd
        i = 0
        while i < total:
            try:
                n = _send_batch(fd, pending, i)
            except OSError as e:
                if e.errno in _PACKET_ERRORS:  # this packet's fault (EMSGSIZE): drop it, go on
                    self._unsendable(pending[i], e)
                    i += 1
                    continue
                self._sendFailed(e)
                return
            if n == 0:
                break  # EAGAIN: the socket is full
            self.packets_out += n
            self.bytes_out += sum(map(len, pending[i:i + n])) if i or n < total else sum(map(len, pending))
            i += n
        if i == total:
            return
        # The socket is full: the rest goes through flood control, in order, as refused sends
        # do; once that pauses the publisher, the rest waits with it (see the class doc).
        global _collecting
        saved, _collecting = _collecting, False
        try:
            client = self.protocol
            deliver = client.deliver
            source = getattr(feeder, "transport", None)
            paused = getattr(source, "_paused", None)
            for j in range(i, total):
                if self.disconnecting:
                    break
                if paused is not None and paused():
                    source._hold(client, pending[j:])
                    break
                deliver(pending[j], feeder, _key_of(pending[j]))
        finally:
            _collecting = saved

    def doWrite(self):
        """Drain the queue with sendmmsg, up to `drain_cap` packets a call, when it drains
        oldest first (order/queue); other orders, and the end of the drain (producers,
        `outboxDrained`), are the pure transport's."""
        outbox = self.outbox
        if outbox.__class__ is not Outbox or outbox.order is not FIFO:  # (random: a dual outbox)
            return SeqPacketTransport.doWrite(self)
        items = outbox._items
        fd = self._fd
        cap = self.drain_cap
        while items:
            batch = list(islice(items, cap))
            try:
                n = _send_batch(fd, batch)
            except OSError as e:
                if e.errno in _PACKET_ERRORS:
                    outbox.pop()
                    self._unsendable(batch[0], e)
                    continue
                self._sendFailed(e)
                return None
            pop = outbox.pop
            for _ in range(n):
                pop()
            self.packets_out += n
            self.bytes_out += sum(map(len, batch if n == len(batch) else batch[:n]))
            if n < len(batch):
                return None  # the socket is full (an error, if any, comes with the next call)
        return SeqPacketTransport.doWrite(self)  # empty: stop writing, resume producers, ...

    def _flushPending(self):
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._sendPending(pending, _feeder)

    def write(self, packet: bytes) -> None:
        """A reply (never collected). Everything routed before it goes out first, to every
        client: a reply is a barrier (a client's whoami after its MSG means: routed)."""
        global _collecting
        if _dirty:
            _flush_dirty()
        saved, _collecting = _collecting, False
        try:
            SeqPacketTransport.write(self, packet)
        finally:
            _collecting = saved

    # -- closing: what was routed before is sent first, as on the pure path

    def loseConnection(self, _reason=None):
        self._flushPending()
        SeqPacketTransport.loseConnection(self, _reason)

    def sendLast(self, packet: bytes) -> None:
        self._flushPending()  # the last word comes after what was routed to this client before
        SeqPacketTransport.sendLast(self, packet)

    def abortConnection(self):
        self._flushPending()
        self._stash = self._held = None
        SeqPacketTransport.abortConnection(self)

    def connectionLost(self, reason):
        self._pending = self._stash = self._held = None
        SeqPacketTransport.connectionLost(self, reason)


#: The class the server's port uses for the connections it accepts.
ServerTransport = BatchSeqPacketTransport if BATCH_IO else SeqPacketTransport
