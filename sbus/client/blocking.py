"""The blocking client: a SEQPACKET socket plus the codec, and nothing hidden.

A client keeps no protocol state (the server does), so this class is a thin
wrapper: every method is one `send` or one `recv_into`, the `flags` are
passed through to the system call, and `socket` is the real socket for
setsockopt/getsockopt/fcntl/ioctl, select/poll/epoll.

`publish_many()` and `receive_many()` hand over many messages per system call
(sendmmsg/recvmmsg, through the optional C extension `sbus._speedups` that the
server's transport uses; without it, or with SBUS_PURE_PYTHON=1, one `send` or
`recv` per packet, with the same results).

The one convenience with state: `whoami()` (and `request()`, `stats()`)
wait for the server's answer, and keep whatever else arrives meanwhile, in
order, for the next `receive()` calls. While such packets are pending, the
socket itself may not be readable although `receive()` has something: check
`pending()` before you block in select/epoll on `fileno()`.

    with sbus.client.connect("/run/sbus.socket") as bus:
        bus.subscribe("sensors/")
        bus.publish("sensors/a", b"21.5")
        for message in bus:
            print(message.key, message.payload)
"""

from __future__ import annotations

import errno
import json
import logging
import select
import socket
import time
from collections import deque

from sbus.core import codec
from sbus.core.codec import MAX_PACKET, Control, DisconnectNotice, DropNotice, Message, ProtocolError
from sbus.core.patterns import reaches
from sbus.core.reqrep import ANY, Ask, NoResponders, RemoteError, Requester, Responder, error_text
from sbus.core.workqueue import (SUBMIT_ROOT, Delivery, Membership, NoService, WorkerBase, check_group, encode_jobs,
                                 submit_result)
from sbus import speedups

from .address import open_socket, size_buffers

_MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_MSG_TRUNC = socket.MSG_TRUNC
_MSG_PEEK = socket.MSG_PEEK
_MSG_DONTWAIT = socket.MSG_DONTWAIT
#: The default (and, with the extension, the largest useful) number of packets per batch call.
DEFAULT_BATCH = 256


_BATCH = speedups.load()  # recvmmsg/sendmmsg, as the server's transport uses them
#: True when `publish_many`/`receive_many` use sendmmsg/recvmmsg by default.
BATCH_IO = _BATCH is not None


class SbusError(Exception):
    """Base class of the client's own errors."""


class ConnectionClosed(SbusError, ConnectionError):
    """The server closed the connection (or the peer is gone); `notice` is the server's
    `server/disconnect` (a `DisconnectNotice`: reason, text) when it said why."""

    def __init__(self, message: str = "the server closed the connection", notice: DisconnectNotice | None = None):
        super().__init__(message)
        self.notice = notice


class PacketTooLarge(SbusError, ProtocolError):
    """A received packet was bigger than the client's buffer (it was discarded)."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"received a packet of {size} bytes, over the {limit}-byte limit (discarded)")
        self.size = size
        self.limit = limit


def _check_mode(what: str, mode, allowed) -> bytes:
    if isinstance(mode, str):
        mode = mode.encode()
    if mode not in allowed:
        raise ValueError(f"unknown {what} mode {mode!r}; one of {', '.join(m.decode() for m in allowed)}")
    return mode


def flood_packets(soft=None, hard=None, order=None) -> list[bytes]:
    """The control packets that select these flood-control modes (None: leave as is)."""
    packets = []
    if soft is not None:
        packets.append(codec.encode_cmsg(b"blocking/soft/" + _check_mode("soft", soft, codec.SOFT_MODES)))
    if hard is not None:
        packets.append(codec.encode_cmsg(b"blocking/hard/" + _check_mode("hard", hard, codec.HARD_MODES)))
    if order is not None:
        packets.append(codec.encode_cmsg(b"order/" + _check_mode("order", order, codec.ORDERS)))
    return packets


def echo_packet(on: bool) -> bytes:
    return codec.encode_cmsg(codec.ECHO_ON if on else codec.ECHO_OFF)


def encode_many(messages, max_packet: int = MAX_PACKET) -> list[bytes]:
    """Encode an iterable of ``(key, payload)`` pairs as MSG packets, every one checked as
    `codec.encode_msg` checks it (the first bad one raises its `ProtocolError`; an item that
    is not a pair raises `TypeError`). Each distinct key is checked once per call."""
    heads: dict = {}
    out: list[bytes] = []
    append = out.append
    encode = codec.encode_msg
    for item in messages:
        try:
            key, payload = item
        except (TypeError, ValueError):
            raise TypeError(f"message {len(out)} is not a (key, payload) pair: {type(item).__name__}") from None
        kc = key.__class__
        if (kc is bytes or kc is str) and payload.__class__ is bytes:
            head = heads.get(key)
            if head is None:
                head = heads[key] = encode(key, b"", max_packet)
            packet = head + payload
            if len(packet) > max_packet:
                encode(key, payload, max_packet)  # raises the codec's own error
        else:
            packet = encode(key, payload, max_packet)
        append(packet)
    return out


def batch_io_calls(batch_io: bool | None):
    """The extension module a client uses for batch calls: `batch_io` None means whatever is
    there (BATCH_IO), False none, True the extension or `ValueError`."""
    if batch_io is None:
        return _BATCH
    if batch_io and _BATCH is None:
        raise ValueError("batch_io=True needs the sbus._speedups extension (not built, or SBUS_PURE_PYTHON=1)")
    return _BATCH if batch_io else None


def check_count(max_count: int) -> int:
    if max_count.__class__ is not int or max_count < 1:
        raise ValueError(f"max_count must be a positive int, not {max_count!r}")
    return max_count


class Client:
    """A connection to an sbus server.

    `Client(address)` connects (see `sbus.client.address` for the forms and
    the default); `Client(sock=s)` wraps an already connected socket.
    `batch_io` (None: when the extension is there) chooses sendmmsg/recvmmsg for
    `publish_many`/`receive_many`; False keeps one system call per packet.
    """

    def __init__(self, address=None, *, sock: socket.socket | None = None, max_packet: int = MAX_PACKET,
                 batch_io: bool | None = None):
        self.max_packet = max_packet
        batch = batch_io_calls(batch_io)
        #: Whether publish_many/receive_many use sendmmsg/recvmmsg.
        self.batch_io = batch is not None
        self._send_batch = batch.send_batch if batch is not None else None
        self._recv_batch = batch.recv_batch if batch is not None else None
        self._batch_cap = batch.MAX_BATCH if batch is not None else 0
        if sock is None:
            sock = open_socket(address, max_packet=max_packet)
        else:
            size_buffers(sock, max_packet)
        self.socket: socket.socket = sock
        self._buf = bytearray(max_packet)
        self._view = memoryview(self._buf)
        self._pending: deque = deque()
        #: Messages the server dropped for this client, summed from its `server/dropped` notices.
        self.dropped = 0
        #: The server's `server/disconnect` notice, once it has sent one.
        self.disconnect_reason: DisconnectNotice | None = None
        self._reqrep: Requester | None = None  # request/reply state, made at the first request()
        #: The counts of the last `serve()` (answered, refused).
        self.responder: Responder | None = None
        # Ask for the server's notices (`server/dropped`, `server/disconnect`): a server that does not
        # know the key ignores it (docs/protocol.md "Extensions").
        sock.send(b"CMSG " + codec.EXTENSIONS)

    # -- plumbing

    def fileno(self) -> int:
        return self.socket.fileno()

    def close(self) -> None:
        self.socket.close()

    @property
    def closed(self) -> bool:
        return self.socket.fileno() < 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<sbus Client fd={self.socket.fileno()}>"

    def send_packet(self, packet: bytes, flags: int = 0) -> int:
        """Send one encoded packet (one `send`); return its size."""
        if not packet:
            raise ProtocolError("refusing to send an empty packet (it reads as end of file)")
        if self.disconnect_reason is not None:  # the server said it closes: say why, at once
            raise self._closed()
        try:
            return self.socket.send(packet, flags | _MSG_NOSIGNAL)
        except (BrokenPipeError, ConnectionResetError):
            raise self._last_words() from None

    def send_packets(self, packets, flags: int = 0) -> int:
        """Send encoded packets in order, one packet each, with as few system calls as the
        socket allows (sendmmsg, up to 1024 a call, when `batch_io`); blocks while the socket
        is full. With ``MSG_DONTWAIT`` in `flags` it stops at the first packet the socket does
        not take. Returns how many were sent (all of them, without MSG_DONTWAIT).

        An empty packet is refused (`ProtocolError`) before anything is sent. A closed
        connection raises `ConnectionClosed` (with the server's reason when it gave one),
        another failure of the socket its `OSError`; packets sent before the failure are gone.
        """
        if packets.__class__ is not list:
            packets = list(packets)
        if not all(packets):
            raise ProtocolError("refusing to send an empty packet (it reads as end of file)")
        if self.disconnect_reason is not None:
            raise self._closed()
        total = len(packets)
        send_batch = self._send_batch
        dontwait = flags & _MSG_DONTWAIT
        sent = 0
        if send_batch is not None and not flags & ~_MSG_DONTWAIT:
            while sent < total:
                try:
                    sent += send_batch(self.socket.fileno(), packets, sent)
                except InterruptedError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    raise self._last_words() from None
                if sent < total:
                    if dontwait:
                        break
                    self._wait_writable()
            return sent
        send = self.socket.send
        flags |= _MSG_NOSIGNAL
        while sent < total:
            try:
                send(packets[sent], flags)
            except (BlockingIOError, InterruptedError) as e:
                if dontwait and isinstance(e, BlockingIOError):
                    break
                self._wait_writable()
                continue
            except (BrokenPipeError, ConnectionResetError):
                raise self._last_words() from None
            sent += 1
        return sent

    def _wait_writable(self) -> None:
        p = select.poll()
        p.register(self.socket.fileno(), select.POLLOUT)
        p.poll()

    # -- the four packet types

    def subscribe(self, pattern, flags: int = 0) -> None:
        self.send_packet(codec.encode_sub(pattern, self.max_packet), flags)

    def unsubscribe(self, pattern, flags: int = 0) -> None:
        self.send_packet(codec.encode_unsub(pattern, self.max_packet), flags)

    def publish(self, key, payload=b"", flags: int = 0) -> int:
        return self.send_packet(codec.encode_msg(key, payload, self.max_packet), flags)

    def publish_many(self, messages, flags: int = 0) -> int:
        """Publish every ``(key, payload)`` pair of `messages`, in order, with as few system
        calls as the socket allows (see `send_packets`). Every message is encoded and checked
        before any is sent: a bad key or an oversized message raises `ProtocolError` and
        nothing is sent. Returns how many were sent."""
        return self.send_packets(encode_many(messages, self.max_packet), flags)

    def send_control(self, key, payload=None, flags: int = 0) -> int:
        return self.send_packet(codec.encode_cmsg(key, payload, self.max_packet), flags)

    # -- receiving

    def pending(self) -> int:
        """How many packets `whoami()`/`request()` set aside for `receive()`."""
        return len(self._pending)

    def _wait_readable(self, timeout: float | None) -> bool:
        p = select.poll()
        p.register(self.socket.fileno(), select.POLLIN)
        ms = -1 if timeout is None else max(0, int(timeout * 1000 + 0.999))
        return bool(p.poll(ms))

    def _closed(self) -> ConnectionClosed:
        notice = self.disconnect_reason
        return ConnectionClosed(str(notice), notice) if notice is not None else ConnectionClosed()

    def _last_words(self) -> ConnectionClosed:
        """A send found the connection closed: what the server sent before closing is still
        queued for us, its `server/disconnect` notice among it. Read it without waiting
        (other packets are kept for `receive()`), so the error says why."""
        resets = 0
        while self.disconnect_reason is None:
            try:
                n = self.socket.recv_into(self._view, self.max_packet, _MSG_TRUNC | _MSG_DONTWAIT)
            except ConnectionResetError:
                resets += 1  # reported once, ahead of what is still queued
                if resets > 1:
                    break
                continue
            except OSError:
                break
            if n == 0 or n > self.max_packet:
                break
            try:
                packet = codec.parse(self._view[:n].tobytes(), self.max_packet)
            except ProtocolError:
                break
            if type(packet) is Control and packet.key == codec.DISCONNECT:
                self.disconnect_reason = codec.parse_disconnect(packet.payload)
            else:
                self._pending.append(packet)
        return self._closed()

    def _recv(self, flags: int = 0):
        if self.disconnect_reason is not None:
            raise self._closed()
        try:
            n = self.socket.recv_into(self._view, self.max_packet, flags | _MSG_TRUNC)
        except ConnectionResetError:
            # Linux reports a reset once, ahead of packets still queued for us (the server's
            # last words among them): read on until end of file.
            try:
                n = self.socket.recv_into(self._view, self.max_packet, (flags | _MSG_TRUNC | _MSG_DONTWAIT))
            except (ConnectionResetError, BlockingIOError):
                raise self._closed() from None
        if n == 0:
            raise self._closed()
        if n > self.max_packet:
            raise PacketTooLarge(n, self.max_packet)
        p = self._view[:n].tobytes()
        if p[:4] == b"MSG ":  # the common case, without codec.parse's calls
            end = p.find(b"\0", 4)
            if end >= 0:
                m = tuple.__new__(Message, (p[4:end], p[end + 1:]))
                return m if self._reqrep is None or flags & _MSG_PEEK else self._reqrep_packet(m)
        return self._handle(codec.parse(p, self.max_packet), flags & _MSG_PEEK)

    def _handle(self, packet, peek: int = 0):
        """What a parsed packet from the server is for `receive()`: a notice, or None when
        request() took it; a `server/disconnect` raises ConnectionClosed."""
        if type(packet) is Control:
            if packet.key == codec.DROPPED:
                notice = codec.parse_drop_notice(packet.payload)
                if not peek:
                    self.dropped += notice.count
                return notice
            if packet.key == codec.DISCONNECT:
                self.disconnect_reason = codec.parse_disconnect(packet.payload)
                raise self._closed()
        if self._reqrep is not None and not peek:
            return self._reqrep_packet(packet)
        return packet

    def _reqrep_packet(self, packet):
        """Interest notices and replies are request()'s: taken here (None), never handed out."""
        if type(packet) is Control and packet.key == codec.INTEREST:
            self._reqrep.interest.feed(packet.payload)
            return None
        if type(packet) is Message and self._reqrep.is_reply(packet.key):
            got = self._reqrep.receive(packet.key, packet.payload)
            if got is not None:
                got[0].append(got[1])
            elif self._reqrep.outgoing:
                for challenge in self._reqrep.take_outgoing():
                    self.send_packet(challenge)
            return None
        return packet

    def receive(self, flags: int = 0, timeout: float | None = None):
        """Return the next `Message`, `Control` or `DropNotice` (the server dropped `count`
        messages meant for us; `dropped` sums them).

        A `server/disconnect` from the server raises `ConnectionClosed` with its text.

        `flags` go to `recv` (``MSG_DONTWAIT`` raises `BlockingIOError` when
        nothing is there, ``MSG_PEEK`` leaves the packet queued). `timeout`
        (seconds) raises `TimeoutError`. Raises `ConnectionClosed` at end of
        connection, `PacketTooLarge` for a packet over the limit (which is
        consumed: the next receive gets the next packet).
        """
        if self._pending:
            item = self._pending[0] if flags & _MSG_PEEK else self._pending.popleft()
            if isinstance(item, BaseException):  # set aside by receive_many, in its place
                raise item
            return item
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is None:
                packet = self._recv(flags)
            else:
                # What is already there needs no poll: try first, wait only when nothing is.
                try:
                    packet = self._recv(flags | _MSG_DONTWAIT)
                except BlockingIOError:
                    if not self._wait_readable(deadline - time.monotonic()):
                        raise TimeoutError(f"no packet within {timeout} s") from None
                    continue
            if isinstance(packet, (Message, Control, DropNotice)):
                return packet
            if packet is None:  # taken by request(): wait for the next one, within the timeout
                continue
            # The server never sends SUB/UNSUB; skip anything else defensively.
            if flags & _MSG_PEEK:
                self._recv(flags & ~_MSG_PEEK)

    def receive_many(self, max_count: int = DEFAULT_BATCH, timeout: float | None = None, flags: int = 0) -> list:
        """Wait for the next packet as `receive()` does, and return it together with every
        packet already waiting, up to `max_count`, in order: a list of `Message`, `Control`
        and `DropNotice` (never empty). With `batch_io`, one recvmmsg takes them all.

        `flags` may be ``MSG_DONTWAIT`` (`BlockingIOError` when nothing is there). The errors
        are `receive()`'s; one that comes after other packets of the batch is raised by the
        next call, so nothing received before it is lost.
        """
        check_count(max_count)
        if flags & ~_MSG_DONTWAIT:
            raise ValueError("receive_many takes no flags but MSG_DONTWAIT")
        pending = self._pending
        if pending:
            out = []
            while pending and len(out) < max_count:
                if isinstance(pending[0], BaseException):
                    if out:
                        break
                    raise pending.popleft()
                out.append(pending.popleft())
            return out
        recv_batch = self._recv_batch
        if recv_batch is None:
            out = [self.receive(flags, timeout)]
            while len(out) < max_count:
                try:
                    out.append(self.receive(_MSG_DONTWAIT))
                except (BlockingIOError, ConnectionClosed):
                    break  # the next call says it again
                except (PacketTooLarge, ProtocolError) as e:  # consumed: raised in its turn
                    pending.append(e)
                    break
            return out
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.socket.fileno()
        count = min(max_count, self._batch_cap)
        resets = 0
        while True:
            if self.disconnect_reason is not None:
                raise self._closed()
            try:
                packets = recv_batch(fd, count, self.max_packet)
            except InterruptedError:
                continue
            except ConnectionResetError:
                # Linux reports a reset once, ahead of packets still queued for us.
                resets += 1
                if resets > 1:
                    raise self._closed() from None
                continue
            if packets:
                break
            if flags & _MSG_DONTWAIT:
                raise BlockingIOError(errno.EAGAIN, "no packet waiting")
            left = None if deadline is None else deadline - time.monotonic()
            if not self._wait_readable(left):
                raise TimeoutError(f"no packet within {timeout} s")
        return self._batch(packets)

    def _batch(self, packets: list) -> list:
        """The packets of one recvmmsg as receive() would hand them out, one by one. An error
        (a packet too large or malformed: consumed) is raised in its place: now if it is the
        first, else by a later call, with what came after it set aside behind it."""
        out: list = []
        append = out.append
        new_tuple = tuple.__new__  # Message(key, payload) without its Python-level __new__
        limit = self.max_packet
        plain = self._reqrep is None
        failed = False
        for p in packets:
            if p.__class__ is int:
                append(PacketTooLarge(p, limit))
                failed = True
                continue
            if not p:  # end of file: said now if nothing came before it, else by the next call
                if not out:
                    raise self._closed()
                break
            if p[:4] == b"MSG ":
                end = p.find(b"\0", 4)
                if end >= 0:
                    m = new_tuple(Message, (p[4:end], p[end + 1:]))
                    if plain:
                        append(m)
                    else:
                        m = self._reqrep_packet(m)
                        if m is not None:
                            append(m)
                    continue
            try:
                item = self._handle(codec.parse(p, limit))
            except ConnectionClosed:
                if not out:
                    raise
                break  # the next call raises it (disconnect_reason is set)
            except ProtocolError as e:
                append(e)
                failed = True
                continue
            if isinstance(item, (Message, Control, DropNotice)):
                append(item)
        if failed:
            for k, item in enumerate(out):
                if isinstance(item, BaseException):
                    self._pending.extend(out[k + 1:] if k == 0 else out[k:])
                    if k == 0:
                        raise item
                    return out[:k]
        return out

    def __iter__(self):
        """Yield received packets until the server closes the connection."""
        while True:
            try:
                yield self.receive()
            except ConnectionClosed:
                return

    def messages(self, timeout: float | None = None):
        """Yield only `Message`s (control messages are skipped); `timeout` per message."""
        while True:
            m = self.receive(timeout=timeout)
            if isinstance(m, Message):
                yield m

    # -- request/reply with the server

    def server_request(self, key, payload=None, timeout: float | None = None) -> bytes | None:
        """Send `CMSG key` and return the payload of the server's `CMSG key` reply.

        Anything else that arrives first is kept, in order, for `receive()`.
        """
        key = codec.encode_cmsg(key)[5:]  # validated bytes
        self.send_control(key, payload)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no reply to {key.decode('utf-8', 'replace')} within {timeout} s")
            if not self._wait_readable(left):
                continue
            try:
                packet = self._recv(_MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if isinstance(packet, Control) and packet.key == key:
                return packet.payload
            if isinstance(packet, (Message, Control, DropNotice)):
                self._pending.append(packet)

    def whoami(self, timeout: float | None = None) -> bytes:
        """The client's credentials as the server sees them, e.g. ``b"!/cred/100/1000/1111"``."""
        return self.server_request(codec.WHOAMI, timeout=timeout) or b""

    def sync(self, timeout: float | None = None) -> None:
        """Return once the server has processed everything sent before (a whoami round trip)."""
        self.whoami(timeout)

    def stats(self, timeout: float | None = None) -> dict:
        """The server's statistics (``CMSG server/stats``) as a dict."""
        return json.loads(self.server_request(codec.STATS, timeout=timeout) or b"{}")

    # -- settings

    def echo(self, on: bool = True) -> None:
        """Receive (on, the default) or not (off) your own messages."""
        self.send_packet(echo_packet(on))

    def flood(self, soft=None, hard=None, order=None) -> None:
        """Choose flood control: soft in queue/discard/block/error, hard in
        discard/block/error, order in queue/stack/random (None: unchanged)."""
        for packet in flood_packets(soft, hard, order):
            self.send_packet(packet)


    # -- request/reply with other clients (docs/request-reply.md; the core: sbus.core.reqrep)

    @property
    def requester(self) -> Requester | None:
        """The request/reply state once `request()` was used: its counts (`sent`, `answered`,
        `late`: replies after the first, dropped) and `inbox`, the reply key prefix."""
        return self._reqrep

    def _requester(self, timeout: float | None) -> Requester:
        if self._reqrep is None:
            requester = Requester(self.whoami(timeout), self.max_packet)
            self.send_packet(requester.subscribe_packet)
            self.send_control(codec.INTEREST)
            self._reqrep = requester
            # The interest listing and its end come before the answer to a later request.
            self.sync(timeout)
        return self._reqrep

    def request(self, key, payload=b"", timeout: float = 5.0, check: bool = True,
                responder_uid=None) -> bytes:
        """Publish a request on `key` and return the first verified reply's payload.

        The reply comes on a key under this client's own secret prefix (only it can read
        it), and is accepted only from a responder that proves (through its own secret key)
        that it runs as `responder_uid`: by default this process's uid; a uid; or ``"any"``
        for any reply (the unverified protocol of before, which older responders speak).
        Raises `NoResponders` at once if nobody holds a pattern matching `key` (as the
        server's interest feed shows it: a responder of another uid is visible only to root
        and the bus owner; `check=False` skips this), `RequestTimeout` (a `TimeoutError`)
        after `timeout` seconds. Other packets that arrive meanwhile are kept for `receive()`.
        """
        deadline = time.monotonic() + timeout
        requester = self._requester(timeout)
        key = codec.encode_msg(key)[4:-1]  # validated bytes
        if check and requester.doubtful(key):
            self.sync(timeout)
            requester.check(key)
        waiter: list = []
        rid, packet = requester.request(key, payload, waiter, responder_uid)
        self.send_packet(packet)
        while not waiter:
            left = deadline - time.monotonic()
            if left <= 0 or not self._wait_readable(left):
                if waiter:
                    break
                raise requester.timeout_error(rid, key, timeout)
            try:
                packet = self._recv(_MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if isinstance(packet, (Message, Control, DropNotice)):
                self._pending.append(packet)
        if type(waiter[0]) is RemoteError:
            raise waiter[0]
        return waiter[0]

    def serve(self, pattern, handler, count: int | None = None, timeout: float | None = None,
              ready=None) -> int:
        """Answer requests on `pattern`: ``handler(key, body)`` returns the reply (bytes or str;
        None: no reply). Returns after `count` requests (default: until the connection ends,
        or `timeout` seconds without one: `TimeoutError`). Messages without a valid secret
        reply key are ignored (counted in `responder.refused`). A handler that raises is
        logged (logger ``sbus.client``), answered with an error reply (the caller gets
        `RemoteError`), counted in `responder.failed`, and serving goes on. `ready()` is called once the
        subscription is in place. Returns the requests handled. Verified requests are answered
        as docs/request-reply.md says (a challenge on this connection's secret key)."""
        pattern = codec.encode_sub(pattern, self.max_packet)[4:]
        responder = self.responder = Responder(self.max_packet, self.whoami(timeout))
        self.subscribe(responder.challenge_key)
        self.subscribe(pattern)
        self.sync(timeout)
        if ready is not None:
            ready()
        handled = 0
        while count is None or handled < count:
            try:
                m = self.receive(timeout=timeout)
            except ConnectionClosed:
                break
            if type(m) is not Message:
                continue
            if m.key == responder.challenge_key:
                reply = responder.challenge(m.payload)
                if type(reply) is Ask:  # the requester's token: now run the handler
                    handled += 1
                    reply = responder.run(reply, handler, log_handler_error)
            elif reaches(pattern, m.key):
                ask = responder.accept(m.payload, m.key)
                reply = None if ask is None else responder.offer(ask)
                if reply is None:
                    handled += 1
                    reply = None if ask is None else responder.run(ask, handler, log_handler_error)
            else:
                continue
            if reply is not None:
                try:
                    self.send_packet(reply)
                except ConnectionClosed:
                    break   # the connection ended as we answered: as a read would have said
        return handled

    # -- shared work queues (docs/queues.md; the core: sbus.core.workqueue)

    def submit(self, group, jobs, timeout: float = 5.0, responder_uid=ANY) -> int:
        """Hand `jobs` ((key, payload) pairs; keys matching the group's pattern) to the queue
        service of `group`, confirmed: returns once it holds them all (in its journal, fsynced,
        with ``--store``): the count. All or none: `QueueFull` when they would pass the group's
        limit, `NoService` when no service serves the group, `RequestTimeout` after `timeout`.
        `responder_uid`: the uid the service runs as, to take its confirmation only from a
        process of that uid (a verified reply, as `request`); by default any answer counts."""
        group = check_group(group)
        try:
            answer = self.request(SUBMIT_ROOT + group, encode_jobs(jobs), timeout=timeout,
                                  responder_uid=responder_uid)
        except NoResponders:
            raise NoService(f"no sbus-queue service serves group {group.decode()}") from None
        return submit_result(group, answer)

    def join(self, group, timeout: float = 5.0) -> "Worker":
        """Join a work-queue group of `twistd sbus-queue`; returns a `Worker` once the service
        said hello. Raises `Refused` (uid not allowed) or `NoService`, a `TimeoutError` (no
        service answered). Use a connection of its own for a worker."""
        membership = Membership(self.whoami(timeout), group, self.max_packet)
        self.send_packet(membership.subscribe_packet)
        deadline = time.monotonic() + timeout
        held: list = []
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise TimeoutError
                    m = self.receive(timeout=left)
                except TimeoutError:
                    raise membership.timeout_error(timeout) from None
                if membership.joined(m):
                    break
                if not membership.held(m):
                    held.append(m)
        except BaseException:
            if not self.closed:
                try:
                    self.send_packet(membership.unsubscribe_packet)
                except ConnectionClosed:
                    pass
            raise
        finally:
            self._pending.extendleft(reversed(held))
        return Worker(self, membership)


class Worker(WorkerBase):
    """A member of a work-queue group (`Client.join`): iterate for `Delivery`s, `ack` each."""

    def next(self, timeout: float | None = None) -> Delivery:
        """The next delivery (`TimeoutError` after `timeout`, `ConnectionClosed` at the end)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            d = self.membership.delivery(self.client.receive(timeout=left))
            if d is not None:
                return d
            self.skipped += 1

    def __iter__(self):
        while True:
            try:
                yield self.next()
            except ConnectionClosed:
                return

    def ack(self, *deliveries) -> None:
        """Acknowledge deliveries (handled: the service forgets them)."""
        if deliveries:
            self.client.send_packet(self.membership.ack_packet(*deliveries))

    def nack(self, delivery, delay: float = 0.0, error="") -> None:
        """Not done: the service redelivers it (to any member) after `delay` seconds; `error`
        is kept as its last error (in its dead letter after `--max-deliveries`)."""
        self.client.send_packet(self.membership.nack_packet(delivery, delay, error))

    def reject(self, delivery, error="") -> None:
        """Never to be done: straight to the group's dead letters."""
        self.client.send_packet(self.membership.reject_packet(delivery, error))

    def progress(self, *deliveries) -> None:
        """Still working on these: their `--ack-wait` deadlines start again."""
        if deliveries:
            self.client.send_packet(self.membership.progress_packet(*deliveries))

    def leave(self) -> None:
        """Leave the group: what is not acknowledged goes to another member, redelivered."""
        self.client.send_packet(self.membership.unsubscribe_packet)


def log_handler_error(key: bytes, exc: BaseException) -> None:
    logging.getLogger("sbus.client").error("%s", error_text(key, exc))


def connect(address=None, **kwargs) -> Client:
    """Connect to the bus at `address` (default: $SBUS_SOCKET, else /run/sbus.socket)."""
    return Client(address, **kwargs)
