"""Request/reply (docs/request-reply.md): one sans-I/O core, three clients, the CLI.

The core (`sbus.core.reqrep`) is tested directly; the clients against a real bus: a reply
comes back on the requester's own secret key, nobody subscribed fails at once, a timeout,
several responders (the first reply wins, the others are counted late), a responder of
another uid, and a tap of another uid on '' that sees the request but never the reply.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading

import pytest
import pytest_twisted

from helpers import REPO, run_as, wait_until
from sbus.client import Client, NoResponders, RemoteError, RequestTimeout
from sbus.core import codec
from sbus.core.reqrep import Interest, Requester, Responder, encode_request, parse_request

ME = b"!/cred/1/2/3"


# ---------------------------------------------------------------- the core


@pytest.mark.parametrize("reply_key", [
    b"public/key",            # a responder must never publish on a key of the requester's choosing
    b"!/cred/x/2/3/r",        # malformed credentials
    b"!/cred/1/2/3",          # truncated: no fourth '/'
    b"!/cred/1/2/3/a/!/b",    # invalid '!'
    b"!/cred/1/2/3/" + b"a" * 1100,
])
def test_a_request_without_a_valid_secret_reply_key_is_refused(reply_key):
    assert parse_request(encode_request(reply_key, b"body")) is None
    r = Responder()
    assert r.handle(encode_request(reply_key, b"body"), lambda k, b: b"x") is None and r.refused == 1
    assert parse_request(b"no nul at all") is None


def test_requester_first_reply_wins_and_later_ones_are_counted():
    req = Requester(ME)
    assert req.inbox.startswith(ME + b"/sbus/reply/")
    rid, packet = req.request(b"svc/a", b"q", waiter="w", responder_uid="any")  # unverified: as before
    m = codec.parse(packet)
    reply_key, body = parse_request(m.payload)
    assert (m.key, body) == (b"svc/a", b"q") and reply_key.startswith(req.inbox)
    reply = codec.parse(Responder().handle(m.payload, lambda k, b: b"r:" + b, m.key))
    assert req.receive(reply.key, reply.payload) == ("w", b"r:q")
    assert req.receive(reply.key, reply.payload) is None and req.late == 1
    assert req.receive(b"other/key", b"") is None
    assert Requester(ME).inbox != req.inbox  # two in one process never meet


def boom(key, body):
    if body == b"bad":
        raise ValueError("no such item: " + body.decode())
    return b"ok " + body


def test_a_handler_that_raises_is_an_error_reply_only_for_requesters_that_ask():
    req = Requester(ME)
    r = Responder()
    logged = []
    rid, packet = req.request(b"svc/a", b"bad", waiter="w", responder_uid="any")
    m = codec.parse(packet)
    reply = codec.parse(r.handle(m.payload, boom, m.key, lambda k, e: logged.append((k, str(e)))))
    waiter, err = req.receive(reply.key, reply.payload)
    assert waiter == "w" and isinstance(err, RemoteError) and err.text == "ValueError: no such item: bad"
    assert logged == [(b"svc/a", "no such item: bad")] and r.failed == 1 and req.errors == 1
    # a requester from before the extension (reply key without /r): no reply, it could not tell
    assert r.handle(encode_request(ME + b"/sbus/reply/abc/1", b"bad"), boom) is None and r.failed == 2
    # an error reply cannot be made to look like an answer, nor an answer like an error
    rid, packet = req.request(b"svc/a", b"good", waiter="w2", responder_uid="any")
    reply = codec.parse(r.handle(codec.parse(packet).payload, boom))
    assert req.receive(reply.key, reply.payload) == ("w2", b"ok good")


def test_interest_says_nothing_until_the_listing_is_complete():
    i = Interest()
    i.feed(b"+\0svc/")
    assert i.wanted(b"svc/a") is None
    i.feed(b"=")
    assert i.wanted(b"svc/a") is True and i.wanted(b"other") is False
    i.feed(b"-\0svc/")
    assert i.wanted(b"svc/a") is False


# ---------------------------------------------------------------- the blocking client


def serve_in_thread(address, pattern, handler, count):
    """A responder on its own connection; returns (thread, ready event)."""
    ready = threading.Event()
    conn = Client(address)
    t = threading.Thread(target=conn.serve, args=(pattern, handler), kwargs={"count": count, "ready": ready.set},
                         daemon=True)
    t.start()
    assert ready.wait(10)
    return t, conn


def test_blocking_request_reply_no_responders_and_timeout(bus):
    with Client(bus.address) as c:
        with pytest.raises(NoResponders):
            c.request("svc/echo", b"x", timeout=30)  # at once: nobody holds svc/
        t, s = serve_in_thread(bus.address, b"svc/", lambda k, b: k + b" " + b, 2)
        assert c.request("svc/echo", b"1") == b"svc/echo 1"
        assert c.request(b"svc/echo", "2") == b"svc/echo 2"
        t.join(10)
        s.close()
        # subscribed but silent: check=False, and the timeout
        with Client(bus.address) as silent:
            silent.subscribe(b"mute/")
            silent.sync(5)
            with pytest.raises(RequestTimeout):
                c.request("mute/x", b"", timeout=0.2)
        # messages that are not replies are kept for receive()
        c.subscribe(b"note")
        c.publish(b"note", b"kept")
        with pytest.raises(NoResponders):
            c.request("svc/echo", b"3")
        assert c.receive(timeout=5) == codec.Message(b"note", b"kept")


def test_a_blocking_responder_survives_its_handler(bus, caplog):
    """A handler that raises: the caller gets RemoteError (not a timeout), the error is logged
    once, and the responder goes on serving the next request."""
    t, s = serve_in_thread(bus.address, b"svc/", boom, 3)
    with Client(bus.address) as c:
        with pytest.raises(RemoteError, match="ValueError: no such item: bad"):
            c.request("svc/x", b"bad", timeout=30)
        assert c.request("svc/x", b"1", timeout=30) == b"ok 1"
        with pytest.raises(RemoteError):
            c.request("svc/x", b"bad", timeout=30)
    t.join(10)
    assert not t.is_alive() and s.responder.failed == 2 and s.responder.answered == 1
    assert [r.getMessage() for r in caplog.records if r.name == "sbus.client"] == [
        "request handler failed on svc/x: ValueError: no such item: bad"] * 2
    s.close()


def test_a_blocking_responder_whose_bus_goes_as_it_answers_returns(bus):
    """`serve` returns when the connection ends, also when that is found sending a reply (it
    raised `ConnectionClosed` then, killing a serving thread: a warning at test_reply_auth's
    teardown). The handler here kills the bus and waits until its socket is gone."""
    import signal

    result = {}

    def handler(key, body):
        bus.stop(signal.SIGKILL)
        wait_until(lambda: conn_closed(), "the bus gone")
        return b"late"

    conn = Client(bus.address)

    def conn_closed():
        try:
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).connect(bus.address)
        except OSError:
            return True
        return False

    ready = threading.Event()
    t = threading.Thread(target=lambda: result.update(n=conn.serve(b"svc/", handler, ready=ready.set)),
                         daemon=True)
    t.start()
    assert ready.wait(10)
    with Client(bus.address) as c:
        with pytest.raises(Exception):
            c.request("svc/x", b"1", timeout=30, responder_uid="any")
    t.join(30)
    assert not t.is_alive() and result == {"n": 1}, result
    conn.close()


def test_several_responders_first_reply_wins(bus):
    # Both serve in this process: they share its secret prefix, so the requester's one token
    # reaches both, and each runs each of the two requests (count=2).
    threads = [serve_in_thread(bus.address, b"svc/", lambda k, b, i=i: b"r%d" % i, 2) for i in range(2)]
    with Client(bus.address) as c:
        assert c.request("svc/x", b"") in (b"r0", b"r1")

        def second_is_late():
            # The other responder's offer or reply comes after the first reply: late (its offer
            # and its reply may both be: 1 or 2).
            c.sync(5)
            return c.requester.late >= 1
        wait_until(second_is_late, "the second responder's answer, counted late")
        assert c.requester.answered == 1 and c.pending() == 0
        # once both know this requester's token, both answer at once; still the first wins
        assert c.request("svc/x", b"") in (b"r0", b"r1")
        for t, _ in threads:
            t.join(30)
            assert not t.is_alive()
    for _, conn in threads:
        conn.close()


# ---------------------------------------------------------------- Twisted and asyncio


def test_asyncio_request_reply(bus):
    import sbus.client.asyncio as aio

    async def main():
        c = await aio.connect(bus.address)
        s = await aio.connect(bus.address)
        with pytest.raises(NoResponders):
            await c.request("svc/a", b"x")

        async def handler(key, body):
            return b"async " + body

        async def failing(key, body):
            raise KeyError(body.decode())

        task = asyncio.ensure_future(s.serve("svc/", handler, count=1))
        await s.sync()
        assert await c.request("svc/a", b"x") == b"async x"
        await task
        task = asyncio.ensure_future(s.serve("svc/", failing, count=2))
        await s.sync()
        for _ in range(2):  # the responder survives its handler
            with pytest.raises(RemoteError, match="KeyError: 'y'"):
                await c.request("svc/a", b"y", timeout=30)
        assert await task == 2 and s.responder.failed == 2
        with pytest.raises(RequestTimeout):
            await c.request("nobody/a", b"x", timeout=0.2, check=False)
        c.close()
        s.close()

    asyncio.run(main())


@pytest_twisted.ensureDeferred
async def test_twisted_request_reply(bus):
    from twisted.internet import defer, reactor
    from sbus.client.twisted import connect

    c = await connect(reactor, bus.address)
    s = await connect(reactor, bus.address)
    try:
        with pytest.raises(NoResponders):
            await c.request("svc/a", b"x")
        s.serve("svc/", lambda k, b: defer.succeed(b"twisted " + b))
        await s.sync()
        assert await c.request("svc/a", b"x") == b"twisted x"

        async def failing(key, body):
            raise RuntimeError("broken " + body.decode())

        responder = s.serve("bad/", failing)
        await s.sync()
        for _ in range(2):
            with pytest.raises(RemoteError, match="RuntimeError: broken z"):
                await c.request("bad/a", b"z", timeout=30)
        assert responder.failed == 2
        with pytest.raises(RequestTimeout):
            await c.request("nobody/a", b"x", timeout=0.2, check=False)
    finally:
        await c.close()
        await s.close()


# ---------------------------------------------------------------- another uid


def test_a_responder_of_another_uid_answers_and_a_tap_on_everything_sees_no_reply(start_bus, shared_dir):
    """On a bus every user may use (-o): uid 65534 serves, root asks (root sees every uid's
    interest, so the check finds the responder). A second uid-65534 connection subscribed to
    '' sees the request (an ordinary message) but not the reply (the requester's secret key).
    Then uid 65534 asks root's responder: by default it is told "no responders" (interest is
    scoped to its own uid), with check=False it gets the reply."""
    bus = start_bus("-o", address=os.path.join(shared_dir, "bus.socket"))
    ready_r, ready_w = os.pipe()
    got_r, got_w = os.pipe()

    def responder():
        tap = Client(bus.address)
        tap.subscribe(b"")
        tap.sync(5)
        srv = Client(bus.address)
        srv.serve(b"svc/", lambda k, b: b"from nobody: " + b, count=1, ready=lambda: os.write(ready_w, b"r"))
        os.read(got_r, 1)  # the requester has its reply: the server routed it before
        tap.sync(5)
        keys = []
        while True:
            try:
                m = tap.receive(flags=socket.MSG_DONTWAIT)
            except BlockingIOError:
                return repr(keys)
            keys.append(getattr(m, "key", b"?"))

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("tap", run_as(65534, 65534, responder)))
    t.start()
    assert os.read(ready_r, 1) == b"r"
    with Client(bus.address) as c:
        assert c.request("svc/q", b"hi", timeout=10, responder_uid=65534) == b"from nobody: hi"
        inbox = c.requester.inbox
        os.write(got_w, b"g")
    t.join(30)
    keys = out["tap"]
    # (the tap shares the responder's process, so the token sent to its challenge key is its own)
    assert "svc/q" in keys and "!/cred/0/" not in keys and inbox.decode() not in keys, keys

    ready2_r, ready2_w = os.pipe()
    with Client(bus.address) as root_srv:
        def asker():
            c = Client(bus.address)
            try:
                c.request("root/q", b"x", timeout=10, responder_uid=0)
                first = "answered"
            except NoResponders:
                first = "no responders"
            return first + " / " + c.request("root/q", b"x", timeout=10, check=False, responder_uid=0).decode()

        t2 = threading.Thread(target=lambda: out.setdefault("asker", run_as(65534, 65534, asker)))
        root_srv.subscribe(b"root/")
        root_srv.sync(5)
        t2.start()
        root_srv.serve(b"root/", lambda k, b: b"from root", count=1, timeout=20)
        t2.join(30)
    assert out["asker"] == "no responders / from root", out["asker"]
    for fd in (ready_r, ready_w, got_r, got_w, ready2_r, ready2_w):
        os.close(fd)


# ---------------------------------------------------------------- the command line


def sbus_cli(address, *args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sbus.cli", "-b", address, *args], capture_output=True,
                          timeout=60, cwd=REPO, **kw)


def test_cli_request_timeout_bad_use_and_a_failing_serve_command(bus, tmp_path):
    r = sbus_cli(bus.address, "request", "--no-check", "-t", "0.2", "nobody/x")
    assert (r.returncode, r.stderr) == (124, b"sbus: no reply to nobody/x within 0.2 s\n"), r
    r = sbus_cli(bus.address, "serve", "svc/")
    assert r.returncode == 2 and r.stderr == b"sbus: give the command to run after --\n", r
    r = sbus_cli(bus.address, "serve", "svc/", "-n", "1", "cat")  # (before a '--' they may go anywhere)
    assert r.returncode == 2 and b"options go before the pattern" in r.stderr and r.stderr.count(b"\n") == 1
    # a command that fails sends no reply (the asker times out) and says so; one that works answers,
    # with the body from the asker's stdin
    ready = tmp_path / "ready"
    serve = subprocess.Popen([sys.executable, "-m", "sbus.cli", "-b", bus.address, "serve", "-n", "2",
                              "--ready-file", str(ready), "svc/", "--", "sh", "-c",
                              'body=$(cat); [ "$body" = fail ] && exit 3; printf "%s!" "$body"'],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    try:
        wait_until(lambda: ready.exists() or serve.poll() is not None, "sbus serve ready")
        r = sbus_cli(bus.address, "request", "-t", "1", "svc/a", "fail")
        assert r.returncode == 124, r
        r = sbus_cli(bus.address, "request", "svc/a", "-", input=b"from stdin")
        assert (r.returncode, r.stdout) == (0, b"from stdin!\n"), r
        assert serve.wait(30) == 0
        assert serve.stderr.read() == b"sbus: sh exited 3 on svc/a: no reply\n"
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
