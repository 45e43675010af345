"""The asyncio client against a real server process (no pytest-asyncio: asyncio.run per test)."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap

import pytest

import sbus.client.asyncio as aio
from sbus.client import ConnectionClosed, Control, Message, ProtocolError
from sbus.core.codec import MAX_PACKET

TIMEOUT = 10.0


def run(coro, timeout=30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def own_whoami() -> bytes:
    return b"!/cred/%d/%d/%d" % (os.getgid(), os.getuid(), os.getpid())


def test_publish_subscribe_and_async_for(bus):
    async def main():
        async with await aio.connect(bus.address) as sub, await aio.connect(bus.address) as pub:
            await sub.subscribe("sensors/")
            await sub.sync(TIMEOUT)
            for i in range(3):
                await pub.publish("sensors/a", b"%d" % i)
            await pub.publish("elsewhere", b"no")
            await pub.publish(b"sensors/end", b"")
            got = []
            async for m in sub:
                got.append(m)
                if m.key == b"sensors/end":
                    break
            assert got == [Message(b"sensors/a", b"0"), Message(b"sensors/a", b"1"),
                           Message(b"sensors/a", b"2"), Message(b"sensors/end", b"")]
            await sub.unsubscribe("sensors/")
            await sub.subscribe("x")
            await sub.sync(TIMEOUT)
            await pub.publish("sensors/a", b"gone")
            await pub.publish("x", b"here")
            assert await sub.receive(TIMEOUT) == Message(b"x", b"here")
        assert sub.closed and pub.closed

    run(main())


def test_whoami_stats_and_control(bus):
    async def main():
        async with await aio.connect(bus.address) as c:
            await c.subscribe("me")
            await c.publish("me", b"before")
            assert await c.whoami(TIMEOUT) == own_whoami()
            assert await c.receive(TIMEOUT) == Message(b"me", b"before")  # kept in order
            stats = await c.stats(TIMEOUT)
            assert stats["clients"] >= 1 and "drops" in stats
            await c.send_control("unknown/key")  # ignored by the server
            # concurrent requests get their own replies
            a, b = await asyncio.gather(c.whoami(TIMEOUT), c.whoami(TIMEOUT))
            assert a == b == own_whoami()
            with pytest.raises(TimeoutError):
                await c.receive(0.05)

    run(main())


def test_largest_packet_and_limits(bus):
    async def main():
        async with await aio.connect(bus.address) as c:
            await c.subscribe("big")
            payload = os.urandom(MAX_PACKET - len(b"MSG big\0"))
            await c.publish("big", payload)
            assert await c.receive(TIMEOUT) == Message(b"big", payload)
            with pytest.raises(ProtocolError):
                await c.publish("big", payload + b"!")
            with pytest.raises(ProtocolError):
                await c.send_packet(b"")

    run(main())


def test_server_disconnect(bus):
    async def main():
        c = await aio.connect(bus.address)
        await c.subscribe(b"!/cred/1/2/3/not-mine")
        with pytest.raises(ConnectionClosed) as info:
            await c.whoami(TIMEOUT)
        assert "forbidden_subscription" in str(info.value)  # the server's server/disconnect
        assert c.disconnect_reason.reason == "forbidden_subscription"
        assert [m async for m in c] == []
        with pytest.raises(ConnectionClosed):
            await c.publish("a", b"")
        c.close()

    run(main())


def test_connect_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        run(aio.connect(str(tmp_path / "missing.socket")))


def test_echo_off(bus):
    async def main():
        async with await aio.connect(bus.address) as me, await aio.connect(bus.address) as other:
            await me.subscribe("chat/")
            await me.echo(False)
            await me.publish("chat/me", b"mine")
            await me.sync(TIMEOUT)
            await other.publish("chat/other", b"theirs")
            assert await me.receive(TIMEOUT) == Message(b"chat/other", b"theirs")

    run(main())


CHILD = textwrap.dedent(r"""
    import asyncio, sys
    import sbus.client.asyncio as aio

    async def main(address, peer):
        async with await aio.connect(address) as bus:
            await bus.subscribe("!/cred////inbox/")
            print((await bus.whoami(10)).decode(), flush=True)
            secret = await bus.receive(10)
            await bus.publish(peer + b"/reply", secret.payload[::-1])
            await bus.sync(10)

    asyncio.run(main(sys.argv[1], sys.argv[2].encode()))
""")


def test_secret_key_between_processes(bus):
    async def main():
        async with await aio.connect(bus.address) as me, await aio.connect(bus.address) as spy:
            mine = await me.whoami(TIMEOUT)
            await me.subscribe(mine + b"/reply")
            await spy.subscribe("")
            await spy.subscribe("!/")
            await spy.sync(TIMEOUT)
            await me.sync(TIMEOUT)
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CHILD, bus.address, mine.decode(),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            try:
                theirs = (await asyncio.wait_for(child.stdout.readline(), TIMEOUT)).strip()
                assert theirs.startswith(b"!/cred/") and theirs != mine, await child.stderr.read()
                await me.publish(theirs + b"/inbox/x", b"secret")
                assert await me.receive(TIMEOUT) == Message(mine + b"/reply", b"terces")
                assert await asyncio.wait_for(child.wait(), TIMEOUT) == 0
            finally:
                if child.returncode is None:
                    child.kill()
                    await child.wait()
            await me.publish("marker", b"")
            seen = []
            while True:
                m = await spy.receive(TIMEOUT)
                if m.key == b"marker":
                    break
                seen.append(m.key)
            assert not [k for k in seen if k.startswith(theirs)]

    run(main())


def test_flood_soft_discard_with_a_slow_reader(bus):
    async def main():
        # inbox_limit=1: the client stops reading after one packet, like a consumer that fell behind
        async with await aio.connect(bus.address, inbox_limit=1) as reader, \
                await aio.connect(bus.address) as writer:
            await reader.subscribe("flood/")
            await reader.flood(soft="discard")
            await reader.sync(TIMEOUT)
            chunk = b"x" * 100_000
            for _ in range(100):
                await writer.publish("flood/x", chunk)
            stats = await writer.stats(TIMEOUT)
            assert sum(stats["drops"].values()) > 0
            assert await reader.receive(TIMEOUT) == Message(b"flood/x", chunk)

    run(main())


def test_backpressure_queue_mode_loses_nothing(bus):
    """Default flood mode (queue): a slow asyncio reader gets everything, in order."""

    async def main():
        async with await aio.connect(bus.address, inbox_limit=8) as reader, \
                await aio.connect(bus.address) as writer:
            await reader.subscribe("q/")
            await reader.sync(TIMEOUT)
            n = 300
            for i in range(n):
                await writer.publish("q/x", b"%d" % i + b"." * 10_000)
            for i in range(n):
                m = await reader.receive(TIMEOUT)
                assert m.payload.startswith(b"%d." % i)

    run(main())


def test_control_messages_reach_receive(bus):
    async def main():
        async with await aio.connect(bus.address) as c:
            await c.send_control(b"!/cred/whoami")  # not through request(): lands in the inbox
            assert await c.receive(TIMEOUT) == Control(b"!/cred/whoami", own_whoami())

    run(main())


def test_drop_notices(bus):
    """soft/discard and a reader that reads late: the server's drop notices come out of
    receive() as DropNotice and `dropped` sums them to the server's own count."""
    import socket as _socket

    from sbus.core.codec import DropNotice

    async def main():
        c = await aio.connect(bus.address)
        c._stop_reading()  # a reader that does not read for now
        c.socket.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVBUF, 8192)
        await c.flood(soft="discard")
        await c.subscribe("adrop/")
        pub = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
        pub.connect(bus.address)
        for i in range(500):
            pub.send(b"MSG adrop/x\0" + b"." * 2000)
        pub.send(b"CMSG !/cred/whoami")
        pub.recv(4096)
        c._start_reading()
        notices = []
        while True:
            try:
                m = await c.receive(timeout=1.0)
            except TimeoutError:
                break
            if isinstance(m, DropNotice):
                notices.append(m)
        st = await c.stats(TIMEOUT)
        while c.pending():  # a notice still pending went out just before the reply
            m = await c.receive()
            if isinstance(m, DropNotice):
                notices.append(m)
        mine = [q for q in st["queues"] if q["pid"] == os.getpid() and q["drops"]]
        assert notices and c.dropped == sum(n.count for n in notices) == sum(mine[0]["drops"].values())
        pub.close()
        c.close()

    run(main())


def test_server_disconnect_is_said_when_a_send_finds_it_first(bus):
    """The server has said why and closed before the event loop ran our reader: the next send
    fails (EPIPE) first. The error still carries the server's reason (it is queued for us)."""
    import select

    async def main():
        c = await aio.connect(bus.address)
        await c.subscribe(b"!/cred/1/2/3/not-mine")
        poller = select.poll()  # block the loop (no reader runs) until the server has closed
        poller.register(c.socket, select.POLLRDHUP)
        assert poller.poll(TIMEOUT * 1000), "the server did not close the connection"
        with pytest.raises(ConnectionClosed) as info:
            await c.whoami(TIMEOUT)
        assert "forbidden_subscription" in str(info.value)
        c.close()

    run(main())


# --- batches: publish_many / receive_many (sendmmsg/recvmmsg, or one call per packet) ------


from sbus.client import PacketTooLarge  # noqa: E402
from test_client_blocking import IO_PATHS, numbered  # noqa: E402  (both paths, numbered messages)


async def take(c, n: int, max_count: int = 1000) -> list:
    got: list = []
    while len(got) < n:
        batch = await c.receive_many(max_count, timeout=TIMEOUT)
        assert 1 <= len(batch) <= max_count
        got.extend(batch)
    assert len(got) == n, f"{len(got) - n} packets more than expected"
    return got


@pytest.mark.parametrize("batch_io", IO_PATHS)
def test_publish_many_delivers_every_message_in_order(bus, batch_io):
    async def main():
        async with await aio.connect(bus.address, batch_io=batch_io) as sub, \
                await aio.connect(bus.address, batch_io=batch_io) as pub:
            assert pub.batch_io is batch_io
            await sub.flood(hard="block")
            await sub.subscribe("many/")
            await sub.sync(TIMEOUT)
            sent = numbered(3000)
            await pub.publish_many((k, p) for k, p in sent)
            await pub.publish_many([("many/s", "text"), (b"many/e", b"")])
            await pub.publish_many([])
            got = await take(sub, 3002, max_count=7)
            assert got[:3000] == [Message(k, p) for k, p in sent]
            assert got[3000:] == [Message(b"many/s", b"text"), Message(b"many/e", b"")]

    run(main())


@pytest.mark.parametrize("batch_io", IO_PATHS)
def test_publish_many_on_a_full_socket_loses_nothing(bus, batch_io):
    """20 MB to a reader that does not read yet (soft/block): publish_many cannot finish, and
    waits; a publish() meanwhile goes after all of it; once the reader reads, all arrive in order."""
    import sbus.client

    reader = sbus.client.connect(bus.address)
    reader.flood(soft="block", hard="block")
    reader.subscribe("many/")
    reader.sync(TIMEOUT)
    sent = numbered(5000, size=4000)

    def read_all():
        got = []
        while len(got) < len(sent) + 1:
            got.extend(reader.receive_many(100, timeout=TIMEOUT))
        return got

    async def main():
        async with await aio.connect(bus.address, batch_io=batch_io) as pub:
            bulk = asyncio.ensure_future(pub.publish_many(sent))
            await asyncio.sleep(0)  # let it run up to its first full socket
            assert not bulk.done(), "20 MB went into the sockets at once?"
            after = asyncio.ensure_future(pub.publish("many/after", b"last"))
            got = await asyncio.to_thread(read_all)
            await bulk
            await after
        return got

    try:
        got = run(main())
    finally:
        reader.close()
    assert [m.payload for m in got[:-1]] == [p for _, p in sent]
    assert got[-1] == Message(b"many/after", b"last")


@pytest.mark.parametrize("batch_io", IO_PATHS)
def test_publish_many_refuses_bad_input_before_sending_anything(bus, batch_io):
    async def main():
        async with await aio.connect(bus.address) as sub, \
                await aio.connect(bus.address, batch_io=batch_io) as pub:
            await sub.subscribe("many/")
            await sub.sync(TIMEOUT)
            with pytest.raises(ProtocolError, match="NUL"):
                await pub.publish_many([("many/a", b"1"), ("many/\0b", b"2")])
            with pytest.raises(ProtocolError, match="exceeds"):
                await pub.publish_many([("many/a", b"1"), ("many/a", b"x" * MAX_PACKET)])
            with pytest.raises(ProtocolError, match="empty packet"):
                await pub.send_packets([b"MSG many/a\0ok", b""])
            with pytest.raises(ValueError, match="max_count"):
                await sub.receive_many(0)
            await pub.publish("many/end", b"")
            assert await sub.receive_many(timeout=TIMEOUT) == [Message(b"many/end", b"")]
            # the server closes on a forbidden pattern: the next publish_many says why
            await pub.subscribe(b"!/cred/1/2/3/not-mine")
            with pytest.raises(ConnectionClosed):
                await pub.whoami(TIMEOUT)
            with pytest.raises(ConnectionClosed, match="forbidden_subscription"):
                await pub.publish_many(numbered(10))

    run(main())


@pytest.mark.parametrize("batch_io", IO_PATHS)
def test_receive_many_keeps_order_with_errors_in_place(bus, batch_io):
    async def main():
        async with await aio.connect(bus.address, batch_io=batch_io, max_packet=1000) as c, \
                await aio.connect(bus.address) as pub:
            await c.subscribe("many/")
            await c.sync(TIMEOUT)
            await pub.publish_many([("many/a", b"before"), ("many/big", b"x" * 2000), ("many/b", b"after")])
            await pub.sync(TIMEOUT)
            assert await c.receive_many(timeout=TIMEOUT) == [Message(b"many/a", b"before")]
            with pytest.raises(PacketTooLarge):
                await c.receive_many(timeout=TIMEOUT)
            assert await c.receive_many(timeout=TIMEOUT) == [Message(b"many/b", b"after")]
            with pytest.raises(TimeoutError):
                await c.receive_many(timeout=0.01)
            await pub.publish_many(numbered(3))
            await pub.sync(TIMEOUT)  # the three are in c's socket now, then its last words
            await c.subscribe(b"!/cred/1/2/3/not-mine")
            got = []
            with pytest.raises(ConnectionClosed):
                while True:
                    got.extend(await c.receive_many(timeout=TIMEOUT))
            assert [m.payload for m in got] == [p for _, p in numbered(3)]
            assert c.disconnect_reason.reason == "forbidden_subscription"

    run(main())


@pytest.mark.parametrize("batch_io", IO_PATHS)
def test_receive_many_when_the_server_dies(start_bus, batch_io):
    """kill -9 of the server: what was in the socket comes out, then ConnectionClosed."""
    import signal

    srv = start_bus()

    async def main():
        async with await aio.connect(srv.address, batch_io=batch_io) as c, \
                await aio.connect(srv.address) as pub:
            await c.subscribe("many/")
            await c.sync(TIMEOUT)
            await pub.publish_many(numbered(3))
            await pub.sync(TIMEOUT)
            srv.stop(signal.SIGKILL)
            got = []
            with pytest.raises(ConnectionClosed):
                while True:
                    batch = await c.receive_many(timeout=TIMEOUT)
                    assert batch, "an empty batch"
                    got.extend(batch)
            assert [m.payload for m in got] == [p for _, p in numbered(3)]
            with pytest.raises(ConnectionClosed):
                await c.publish_many(numbered(1))

    run(main())
