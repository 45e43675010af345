"""The asyncio client (standard library only).

    import asyncio
    import sbus.client.asyncio

    async def main():
        async with await sbus.client.asyncio.connect("/run/sbus.socket") as bus:
            await bus.subscribe("sensors/")
            await bus.publish("sensors/a", b"21.5")
            print(await bus.whoami())
            async for message in bus:
                print(message.key, message.payload)

    asyncio.run(main())

The socket is nonblocking and watched with `loop.add_reader`; each wakeup
reads up to 256 packets (one recvmmsg through the optional C extension
`sbus._speedups`, else `recv_into` one by one; MSG_TRUNC either way, so an
oversized packet is detected). Received packets wait in an inbox; when it
holds `inbox_limit` packets the client stops reading, so a slow consumer
pushes back on the server (whose flood control then applies) instead of
growing memory without bound. `publish_many` sends many packets with
sendmmsg; `receive_many` takes all that has arrived in one await.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import deque

from sbus.core import codec
from sbus.core.codec import MAX_PACKET, Control, Message, ProtocolError
from sbus.core.patterns import reaches
from sbus.core.reqrep import ANY, Ask, NoResponders, RemoteError, Requester, Responder
from sbus.core.workqueue import (SUBMIT_ROOT, Delivery, Membership, NoService, WorkerBase, check_group, encode_jobs,
                                 submit_result)

from .address import open_socket
from .blocking import (DEFAULT_BATCH, ConnectionClosed, PacketTooLarge, batch_io_calls, check_count, echo_packet,
                       encode_many, flood_packets, log_handler_error)

__all__ = ["Client", "AsyncWorker", "connect", "ConnectionClosed", "Message", "Control"]

_MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_MSG_TRUNC = socket.MSG_TRUNC
#: Packets read per wakeup (at most; fewer when the inbox is nearly full).
_DRAIN_CAP = DEFAULT_BATCH


class Client:
    """A connection to an sbus server for asyncio; make one with `connect`."""

    def __init__(self, sock: socket.socket, *, max_packet: int = MAX_PACKET, inbox_limit: int = 4096,
                 loop: asyncio.AbstractEventLoop | None = None, batch_io: bool | None = None):
        batch = batch_io_calls(batch_io)
        #: Whether reading and publish_many use recvmmsg/sendmmsg.
        self.batch_io = batch is not None
        self._send_batch = batch.send_batch if batch is not None else None
        self._recv_batch = batch.recv_batch if batch is not None else None
        sock.setblocking(False)
        self.socket = sock
        self.max_packet = max_packet
        self.inbox_limit = inbox_limit
        self._loop = loop or asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._view = memoryview(bytearray(max_packet))
        self._inbox: deque = deque()
        self._inbox_errors = 0  # exceptions waiting in the inbox, in their place
        self._waiter: asyncio.Future | None = None
        self._requests: dict[bytes, deque] = {}
        self._send_lock = asyncio.Lock()
        self._closed: BaseException | None = None
        self._reading = False
        self._write_waiter: asyncio.Future | None = None
        #: Messages the server dropped for us (sum of its `server/dropped` notices, which
        #: `receive()` returns as `DropNotice`s), and its `server/disconnect` notice if any.
        self.dropped = 0
        self.disconnect_reason: codec.DisconnectNotice | None = None
        self._reqrep: Requester | None = None  # request/reply state, made at the first request()
        self._tasks: set = set()  # sends started by the reader (challenges), kept until done
        #: The counts of the last `serve()` (answered, refused).
        self.responder: Responder | None = None
        # Ask for the server's notices (docs/protocol.md "Extensions"): a new socket's buffer has room.
        sock.send(b"CMSG " + codec.EXTENSIONS)
        self._start_reading()

    # -- plumbing

    def fileno(self) -> int:
        return self._fd

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def _start_reading(self):
        if not self._reading and self._closed is None:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)

    def _stop_reading(self):
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def _wake(self):
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _lost(self, exc: BaseException):
        if self._closed is not None:
            return
        self._closed = exc
        self._stop_reading()
        requests, self._requests = self._requests, {}
        waiters = [fut for queue in requests.values() for fut in queue]
        if self._reqrep is not None:
            waiters += self._reqrep.abandon()
        for fut in waiters:
            if not fut.done():
                fut.set_exception(ConnectionClosed(str(exc)) if not isinstance(exc, ConnectionClosed) else exc)
        self._wake()
        w = self._write_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def close(self) -> None:
        """Close the connection (anything not yet received is lost)."""
        self._lost(ConnectionClosed("connection closed by the client"))
        if self.socket.fileno() >= 0:
            self.socket.close()

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()

    # -- reading

    def _on_readable(self):
        inbox = self._inbox
        cap = min(_DRAIN_CAP, max(1, self.inbox_limit - len(inbox)))
        recv_batch = self._recv_batch
        if recv_batch is not None:
            packets = None
            for _ in range(2):
                try:
                    packets = recv_batch(self._fd, cap, self.max_packet)
                    break
                except InterruptedError:
                    return
                except ConnectionResetError:
                    continue  # reported once, ahead of packets still queued for us (the server's last words)
                except OSError as e:
                    self._lost(ConnectionClosed(f"the connection failed: {e.strerror or e}"))
                    return
            if packets is None:
                return
        else:
            packets = self._read_some(cap)
            if packets is None:
                return
        if packets:
            self._take(packets)
        if len(inbox) >= self.inbox_limit:
            self._stop_reading()

    def _read_some(self, cap: int) -> list | None:
        """Without the extension: up to `cap` packets, one recv_into each (None: lost)."""
        sock, view, limit = self.socket, self._view, self.max_packet
        packets = []
        for _ in range(cap):
            try:
                n = sock.recv_into(view, limit, _MSG_TRUNC)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionResetError:
                continue  # reported once, ahead of packets still queued for us
            except OSError as e:
                self._lost(ConnectionClosed(f"the connection failed: {e.strerror or e}"))
                return None
            if n == 0:
                packets.append(b"")
                break
            packets.append(n if n > limit else view[:n].tobytes())
        return packets

    def _take(self, packets: list) -> None:
        """Sort what one wakeup read: messages to the inbox, replies to their waiters."""
        inbox = self._inbox
        append = inbox.append
        new_tuple = tuple.__new__  # Message(key, payload) without its Python-level __new__
        limit = self.max_packet
        plain = self._reqrep is None  # else a message may be a reply to a request()
        got = False
        for p in packets:
            if p.__class__ is int:
                append(PacketTooLarge(p, limit))
                self._inbox_errors += 1
                got = True
                continue
            if not p:
                notice = self.disconnect_reason
                if got:
                    self._wake()
                self._lost(ConnectionClosed(str(notice), notice) if notice else ConnectionClosed())
                return
            if plain and p[:4] == b"MSG ":
                end = p.find(b"\0", 4)
                if end >= 0:
                    append(new_tuple(Message, (p[4:end], p[end + 1:])))
                    got = True
                    continue
            try:
                packet = codec.parse(p, limit)
            except ProtocolError as e:
                append(e)
                self._inbox_errors += 1
                got = True
                continue
            if self._sort(packet):
                got = True
        if got:
            self._wake()

    def _sort(self, packet) -> bool:
        """One parsed packet: True when it went to the inbox."""
        inbox = self._inbox
        if type(packet) is Control and packet.key == codec.DROPPED:
            try:
                packet = codec.parse_drop_notice(packet.payload)
            except ProtocolError as e:
                inbox.append(e)
                self._inbox_errors += 1
                return True
            self.dropped += packet.count
            inbox.append(packet)
            return True
        if type(packet) is Control and packet.key == codec.DISCONNECT:
            self.disconnect_reason = codec.parse_disconnect(packet.payload)
            return False
        if self._reqrep is not None:
            if type(packet) is Control and packet.key == codec.INTEREST:
                self._reqrep.interest.feed(packet.payload)
                return False
            if type(packet) is Message and self._reqrep.is_reply(packet.key):
                got = self._reqrep.receive(packet.key, packet.payload)
                if got is None and self._reqrep.outgoing:
                    self._send_later(self._reqrep.take_outgoing())
                if got is not None and not got[0].done():
                    if type(got[1]) is RemoteError:
                        got[0].set_exception(got[1])
                    else:
                        got[0].set_result(got[1])
                return False
        if type(packet) is Control:
            queue = self._requests.get(packet.key)
            if queue:
                fut = queue.popleft()
                if not queue:
                    del self._requests[packet.key]
                if not fut.done():
                    fut.set_result(packet.payload)
                return False
        if type(packet) in (Message, Control):
            inbox.append(packet)
            return True
        return False

    def pending(self) -> int:
        """Packets received and not yet taken by `receive()`."""
        return len(self._inbox)

    async def receive(self, timeout: float | None = None):
        """The next `Message` or `Control`; raises `ConnectionClosed` at end, `TimeoutError`."""
        while not self._inbox:
            if self._closed is not None:
                raise self._closed
            self._waiter = self._loop.create_future()
            try:
                if timeout is None:
                    await self._waiter
                else:
                    try:
                        await asyncio.wait_for(self._waiter, timeout)
                    except TimeoutError:  # asyncio's has no message; say what did not come
                        raise TimeoutError(f"no packet within {timeout} s") from None
            finally:
                self._waiter = None
        item = self._inbox.popleft()
        if not self._reading and len(self._inbox) < self.inbox_limit // 2:
            self._start_reading()
        if isinstance(item, BaseException):
            self._inbox_errors -= 1
            raise item
        return item

    async def receive_many(self, max_count: int = DEFAULT_BATCH, timeout: float | None = None) -> list:
        """Wait for the next packet as `receive()` does, and return it together with every
        packet already received, up to `max_count`, in order (never empty). An error that
        comes after other packets is raised by the next call, so nothing before it is lost."""
        check_count(max_count)
        inbox = self._inbox
        if not inbox:
            first = await self.receive(timeout)  # waits; raises what it meets first
            out = [first]
        else:
            out = []
        popleft = inbox.popleft
        if not self._inbox_errors:
            if len(inbox) <= max_count - len(out):
                out.extend(inbox)
                inbox.clear()
            else:
                out.extend([popleft() for _ in range(max_count - len(out))])
        else:
            while inbox and len(out) < max_count:
                if isinstance(inbox[0], BaseException):
                    if out:
                        break
                    self._inbox_errors -= 1
                    raise popleft()
                out.append(popleft())
        if not self._reading and len(inbox) < self.inbox_limit // 2:
            self._start_reading()
        return out

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.receive()
        except ConnectionClosed:
            raise StopAsyncIteration from None

    # -- sending

    async def _writable(self):
        fut = self._write_waiter = self._loop.create_future()

        def ready():
            if not fut.done():
                fut.set_result(None)

        self._loop.add_writer(self._fd, ready)
        try:
            await fut
        finally:
            self._write_waiter = None
            self._loop.remove_writer(self._fd)

    def _try_send(self, packet: bytes) -> bool:
        try:
            self.socket.send(packet, _MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return False
        except (BrokenPipeError, ConnectionResetError):
            raise self._peer_closed() from None
        return True

    def _try_send_many(self, packets: list, start: int) -> int:
        """Send from packets[start] on until the socket is full; the index reached."""
        send_batch = self._send_batch
        if send_batch is None:
            while start < len(packets) and self._try_send(packets[start]):
                start += 1
            return start
        try:
            return start + send_batch(self._fd, packets, start)
        except InterruptedError:
            return start
        except (BrokenPipeError, ConnectionResetError):
            raise self._peer_closed() from None

    def _peer_closed(self) -> ConnectionClosed:
        """A send found the connection closed; what the server sent first (its
        server/disconnect notice: why) is still queued for us. Read it now, so the error says
        why (the blocking client does the same): under load the send failed before the reader
        had run."""
        for _ in range(64):
            if self._closed is not None:
                break
            self._on_readable()
        notice = self.disconnect_reason
        self._lost(ConnectionClosed(str(notice), notice) if notice else ConnectionClosed())
        return ConnectionClosed(str(notice), notice) if notice else ConnectionClosed()

    async def send_packet(self, packet: bytes) -> None:
        """Send one encoded packet; waits (in order) while the socket is full."""
        if not packet:
            raise ProtocolError("refusing to send an empty packet (it reads as end of file)")
        if self._closed is not None:
            raise ConnectionClosed(str(self._closed))
        if not self._send_lock.locked() and self._try_send(packet):
            return
        async with self._send_lock:
            while not self._try_send(packet):
                await self._writable()
                if self._closed is not None:
                    raise ConnectionClosed(str(self._closed))

    async def send_packets(self, packets) -> None:
        """Send encoded packets in order, one packet each, with as few system calls as the
        socket allows (sendmmsg when `batch_io`); waits (in order with other sends) while the
        socket is full. An empty packet is refused before anything is sent."""
        if packets.__class__ is not list:
            packets = list(packets)
        if not all(packets):
            raise ProtocolError("refusing to send an empty packet (it reads as end of file)")
        if self._closed is not None:
            raise ConnectionClosed(str(self._closed))
        sent = 0
        if not self._send_lock.locked():
            sent = self._try_send_many(packets, 0)
            if sent == len(packets):
                return
        async with self._send_lock:
            while True:
                sent = self._try_send_many(packets, sent)
                if sent == len(packets):
                    return
                await self._writable()
                if self._closed is not None:
                    raise ConnectionClosed(str(self._closed))

    async def publish_many(self, messages) -> None:
        """Publish every ``(key, payload)`` pair of `messages`, in order (see `send_packets`).
        Every message is encoded and checked before any is sent: a bad one raises
        `ProtocolError` and nothing is sent."""
        await self.send_packets(encode_many(messages, self.max_packet))

    async def subscribe(self, pattern) -> None:
        await self.send_packet(codec.encode_sub(pattern, self.max_packet))

    async def unsubscribe(self, pattern) -> None:
        await self.send_packet(codec.encode_unsub(pattern, self.max_packet))

    async def publish(self, key, payload=b"") -> None:
        await self.send_packet(codec.encode_msg(key, payload, self.max_packet))

    async def send_control(self, key, payload=None) -> None:
        await self.send_packet(codec.encode_cmsg(key, payload, self.max_packet))

    async def server_request(self, key, payload=None, timeout: float | None = None) -> bytes | None:
        """Send `CMSG key` and return the payload of the server's `CMSG key` reply."""
        packet = codec.encode_cmsg(key, payload, self.max_packet)
        key = codec.classify(packet, self.max_packet)[1]
        fut = self._loop.create_future()
        self._requests.setdefault(key, deque()).append(fut)
        try:
            await self.send_packet(packet)
        except BaseException:
            queue = self._requests.get(key)
            if queue and fut in queue:
                queue.remove(fut)
            if fut.done() and not fut.cancelled():
                fut.exception()  # failed with the connection: the caller gets the send's error
            raise
        if timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise TimeoutError(f"no reply to {key.decode('utf-8', 'replace')} within {timeout} s") from None

    async def whoami(self, timeout: float | None = None) -> bytes:
        return (await self.server_request(codec.WHOAMI, timeout=timeout)) or b""

    async def sync(self, timeout: float | None = None) -> None:
        """Return once the server has processed everything sent before."""
        await self.whoami(timeout)

    async def stats(self, timeout: float | None = None) -> dict:
        return json.loads((await self.server_request(codec.STATS, timeout=timeout)) or b"{}")

    async def echo(self, on: bool = True) -> None:
        await self.send_packet(echo_packet(on))

    async def flood(self, soft=None, hard=None, order=None) -> None:
        for packet in flood_packets(soft, hard, order):
            await self.send_packet(packet)


    # -- request/reply with other clients (docs/request-reply.md; the core: sbus.core.reqrep)

    def _send_later(self, packets: list) -> None:
        """Send packets from a task (the reader cannot wait): challenges to responders."""
        task = self._loop.create_task(self.send_packets(packets))
        self._tasks.add(task)
        task.add_done_callback(self._sent_later)

    def _sent_later(self, task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # a closed connection: the request's waiter learns it

    async def request(self, key, payload=b"", timeout: float = 5.0, check: bool = True,
                      responder_uid=None) -> bytes:
        """Publish a request on `key` and return the first verified reply's payload (see the
        blocking client's `request`, and its `responder_uid`): `NoResponders` at once,
        `RequestTimeout` after `timeout`."""
        if self._reqrep is None:
            whoami = await self.whoami(timeout)
            if self._reqrep is None:
                requester = Requester(whoami, self.max_packet)
                self._reqrep = requester
                await self.send_packet(requester.subscribe_packet)
                await self.send_control(codec.INTEREST)
        requester = self._reqrep
        key = codec.encode_msg(key, b"", self.max_packet)[4:-1]
        if check and (not requester.interest.ready or requester.doubtful(key)):
            await self.sync(timeout)  # the listing, and every change before now, has arrived
            requester.check(key)
        fut = self._loop.create_future()
        rid, packet = requester.request(key, payload, fut, responder_uid)
        try:
            await self.send_packet(packet)
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise requester.timeout_error(rid, key, timeout) from None
        finally:
            requester.forget(rid)

    async def serve(self, pattern, handler, count: int | None = None) -> int:
        """Answer requests on `pattern` with ``handler(key, body)`` (a function or a coroutine
        function; its result is the reply, None for none) until `count` requests or the end of
        the connection. A handler that raises is logged, answered with an error reply (the
        caller gets `RemoteError`), counted in `responder.failed`; serving goes on. Returns
        the requests handled."""
        pattern = codec.encode_sub(pattern, self.max_packet)[4:]
        await self.subscribe(pattern)  # first: a sync() right after serve() starts covers it
        responder = self.responder = Responder(self.max_packet, await self.whoami())
        # In place before any offer of ours goes out (the whoami answer comes before requests).
        await self.subscribe(responder.challenge_key)
        handled = 0
        while count is None or handled < count:
            try:
                m = await self.receive()
            except ConnectionClosed:
                break
            if type(m) is not Message:
                continue
            if m.key == responder.challenge_key:
                ask = responder.challenge(m.payload)
                if type(ask) is not Ask:
                    if ask is not None:
                        await self.send_packet(ask)  # a reply sent before, with a new token
                    continue
            elif reaches(pattern, m.key):
                ask = responder.accept(m.payload, m.key)
                offer = None if ask is None else responder.offer(ask)
                if offer is not None:
                    await self.send_packet(offer)  # the handler runs when the requester's token comes
                    continue
            else:
                continue
            handled += 1
            if ask is None:
                continue
            try:
                out = handler(m.key, ask.body)
                if asyncio.iscoroutine(out) or isinstance(out, asyncio.Future):
                    out = await out
            except Exception as e:
                log_handler_error(m.key, e)
                out = responder.error(ask, e)
                if out is not None:
                    await self.send_packet(out)
                continue
            if out is not None:
                await self.send_packet(responder.reply(ask, out))
        return handled

    # -- shared work queues (docs/queues.md; the core: sbus.core.workqueue)

    async def submit(self, group, jobs, timeout: float = 5.0, responder_uid=ANY) -> int:
        """Confirmed submission (see the blocking client's `submit`)."""
        group = check_group(group)
        try:
            answer = await self.request(SUBMIT_ROOT + group, encode_jobs(jobs), timeout=timeout,
                                        responder_uid=responder_uid)
        except NoResponders:
            raise NoService(f"no sbus-queue service serves group {group.decode()}") from None
        return submit_result(group, answer)

    async def join(self, group, timeout: float = 5.0) -> "AsyncWorker":
        """Join a work-queue group of `twistd sbus-queue`; an `AsyncWorker` once the service said
        hello. Raises `Refused` or `TimeoutError`. Use a connection of its own for a worker."""
        membership = Membership(await self.whoami(timeout), group, self.max_packet)
        await self.send_packet(membership.subscribe_packet)
        deadline = self._loop.time() + timeout
        held = []
        try:
            while True:
                left = deadline - self._loop.time()
                try:
                    if left <= 0:
                        raise TimeoutError
                    m = await self.receive(timeout=left)
                except (TimeoutError, asyncio.TimeoutError):
                    raise membership.timeout_error(timeout) from None
                if membership.joined(m):
                    break
                if not membership.held(m):
                    held.append(m)
        except BaseException:
            if not self.closed:
                await self.send_packet(membership.unsubscribe_packet)
            raise
        finally:
            self._inbox.extendleft(reversed(held))
        return AsyncWorker(self, membership)


class AsyncWorker(WorkerBase):
    """A member of a work-queue group (`Client.join`): ``async for delivery in worker``."""

    async def next(self, timeout: float | None = None) -> Delivery:
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
            d = self.membership.delivery(await self.client.receive(timeout=left))
            if d is not None:
                return d
            self.skipped += 1

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delivery:
        try:
            return await self.next()
        except ConnectionClosed:
            raise StopAsyncIteration from None

    async def ack(self, *deliveries) -> None:
        if deliveries:
            await self.client.send_packet(self.membership.ack_packet(*deliveries))

    async def nack(self, delivery, delay: float = 0.0, error="") -> None:
        """Redeliver after `delay` seconds (see the blocking `Worker.nack`)."""
        await self.client.send_packet(self.membership.nack_packet(delivery, delay, error))

    async def reject(self, delivery, error="") -> None:
        """Straight to the dead letters."""
        await self.client.send_packet(self.membership.reject_packet(delivery, error))

    async def progress(self, *deliveries) -> None:
        """Still working on these: their ack deadlines start again."""
        if deliveries:
            await self.client.send_packet(self.membership.progress_packet(*deliveries))

    async def leave(self) -> None:
        await self.client.send_packet(self.membership.unsubscribe_packet)


async def connect(address=None, *, max_packet: int = MAX_PACKET, inbox_limit: int = 4096,
                  timeout: float = 10.0, batch_io: bool | None = None) -> Client:
    """Connect to the bus at `address` (default: $SBUS_SOCKET, else /run/sbus.socket)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            sock = open_socket(address, max_packet=max_packet, blocking=False)
            break
        except BlockingIOError:  # the server's listen backlog is full
            if loop.time() >= deadline:
                raise TimeoutError(f"connecting to {address}: the server does not accept") from None
            await asyncio.sleep(0.01)
    return Client(sock, max_packet=max_packet, inbox_limit=inbox_limit, loop=loop, batch_io=batch_io)
