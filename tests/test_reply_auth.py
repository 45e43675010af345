"""Replies a requester can trust (issue 33, item 5; docs/request-reply.md "Security").

A forger of another uid (uid 65534 in a forked child) taps the requests on a bus every user
may use (``sbusd -o``) and answers each one first, every way it can: plain bodies on the reply
key and its variants, verified-looking replies that claim the real responder's prefix (with a
guessed token and with none), root's pid 1, its own prefix, and a challenge of its own sent to
the responder for the requester's reply key. The real responder answers only after the forger
has (its handler waits for the forger's signal), so a forgery always arrives first. `sbus
request` and the blocking, asyncio and Twisted clients must print the real answer; the forger
must never see a key in root's secret space (where the token travels). With the code from
before, `sbus request` printed the forger's body.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import subprocess
import sys
import threading

import pytest
import pytest_twisted

from helpers import REPO, run_as
from sbus.client import Client, ConnectionClosed, Message
from sbus.core import codec
from sbus.core.reqrep import (ANY, CHALLENGE, Requester, Responder, encode_request, parse_request,
                              request_digest)

FORGED = b"FORGED"


# ---------------------------------------------------------------- the core


Q = b"!/cred/1/1000/30"      # the requester, uid 1000
R = b"!/cred/1/1000/40"      # a responder of the same uid
OTHER = b"!/cred/9/2000/50"  # a responder of uid 2000


def exchange(req, resp, key=b"svc/a", body=b"q", **kw):
    """One request from `req` answered by `resp` through the whole handshake: (result, packets)."""
    rid, packet = req.request(key, body, "w", **kw)
    m = codec.parse(packet)
    out = resp.handle(m.payload, lambda k, b: b"ans " + b, m.key)
    sent = 0
    while out is not None:
        sent += 1
        reply = codec.parse(out)
        got = req.receive(reply.key, reply.payload)
        if got is not None:
            return got, sent
        out = None
        for challenge in req.take_outgoing():
            c = codec.parse(challenge)
            assert c.key == resp.challenge_key
            ask = resp.challenge(c.payload)
            out = resp.run(ask, lambda k, b: b"ans " + b) if ask.__class__.__name__ == "Ask" else ask
    return None, sent


def test_a_responder_of_the_uid_asked_for_proves_it_once_then_answers_at_once():
    req, resp = Requester(Q), Responder(whoami=R)
    assert exchange(req, resp) == (("w", b"ans q"), 2)  # offer, then the answer with the token
    assert exchange(req, resp, body=b"q2") == (("w", b"ans q2"), 1)  # the token is known
    assert req.challenges == 1 and req.unverified == 0
    # another uid's responder is refused by default, accepted when named
    assert exchange(req, Responder(whoami=OTHER)) == (None, 1) and req.unverified == 1
    assert exchange(req, Responder(whoami=OTHER), responder_uid=2000) == (("w", b"ans q"), 2)
    # behind a relay: every hop must be root, the uid asked for, or our own
    assert exchange(Requester(Q), Responder(whoami=b"!/cred/0/0/7/!/cred/1/1000/8"))[0] == ("w", b"ans q")
    assert exchange(Requester(Q), Responder(whoami=b"!/cred/5/65534/7/!/cred/1/1000/8"))[0] is None


def test_a_responder_from_before_is_refused_unless_any_is_asked_for():
    req, old = Requester(Q), Responder()  # no whoami: answers as before the extension
    rid, packet = req.request(b"svc/a", b"q", "w")
    m = codec.parse(packet)
    reply = codec.parse(old.handle(m.payload, lambda k, b: b"old", m.key))
    assert req.receive(reply.key, reply.payload) is None
    assert str(req.timeout_error(rid, b"svc/a", 1)).endswith(
        "(1 unverified reply refused: not from a responder of the uid asked for, or from one too old to prove it)")
    rid, packet = req.request(b"svc/a", b"q", "w", responder_uid=ANY)
    m = codec.parse(packet)
    assert parse_request(m.payload)[0].endswith(b"/r")  # the request of before, unchanged
    reply = codec.parse(old.handle(m.payload, lambda k, b: b"old", m.key))
    assert req.receive(reply.key, reply.payload) == ("w", b"old")
    with pytest.raises(ValueError):
        req.request(b"svc/a", b"", "w", responder_uid="root")


def test_a_reply_to_another_request_on_the_same_reply_key_is_refused():
    """The forger re-sends the requester's reply key with a question of its own to the real
    responder: its answer is genuine but not to what was asked (the digest differs)."""
    req, resp = Requester(Q), Responder(whoami=R)
    exchange(req, resp)  # the responder knows our token: it answers at once from now on
    rid, packet = req.request(b"svc/a", b"what I asked", "w")
    reply_key = parse_request(codec.parse(packet).payload)[0]
    theirs = codec.parse(resp.handle(encode_request(reply_key, b"what the forger asked"),
                                     lambda k, b: b"ans " + b, b"svc/a"))
    assert req.receive(theirs.key, theirs.payload) is None and req.unverified == 1


def test_a_token_planted_by_a_forger_costs_one_round_trip_not_the_reply():
    req, resp = Requester(Q), Responder(whoami=R)
    exchange(req, resp)
    rid, packet = req.request(b"svc/a", b"q", "w")
    m = codec.parse(packet)
    reply_key = parse_request(m.payload)[0]
    # the forger sends the responder a token of its own for our reply key
    resp.handle(m.payload, lambda k, b: b"ans " + b, m.key)
    assert resp.challenge(b"\0".join((reply_key, request_digest(b"svc/a", b"q"), b"f" * 32))) is not None
    rid2, packet = req.request(b"svc/a", b"q2", "w2")
    m = codec.parse(packet)
    out = codec.parse(resp.handle(m.payload, lambda k, b: b"ans " + b, m.key))  # with the forger's token
    assert req.receive(out.key, out.payload) is None
    (challenge,) = req.take_outgoing()
    again = codec.parse(resp.challenge(codec.parse(challenge).payload))  # the kept reply, our token
    assert req.receive(again.key, again.payload) == ("w2", b"ans q2")


# ---------------------------------------------------------------- real processes


def forger(address, responder_whoami, signal_w):
    """Uid 65534's part: answer every request first, every way; return the keys its tap on ''
    saw. Ends when the bus stops."""
    tap = Client(address)
    tap.subscribe(b"")
    c = Client(address)
    c.subscribe(b"svc/")
    me = c.whoami(10)
    tap.sync(10)
    os.write(signal_w, b"r")
    while True:
        try:
            m = c.receive(timeout=120)
        except (ConnectionClosed, TimeoutError):
            break
        parsed = parse_request(m.payload) if type(m) is Message else None
        if parsed is None:
            continue
        reply_key, body = parsed
        digest = request_digest(m.key, body)
        base = reply_key.rsplit(b"/", 1)[0]
        for k in (reply_key, base, base + b"/r", base + b"/e", base + b"/x"):
            c.publish(k, FORGED)
        for claim, token in ((responder_whoami, b"0" * 32), (responder_whoami, b""), (b"!/cred/0/0/1", b""),
                             (me, b"")):
            c.publish(reply_key, b"\0".join((claim, token, digest, FORGED)))
        c.publish(responder_whoami + CHALLENGE, b"\0".join((reply_key, digest, b"f" * 32)))
        c.sync(10)
        os.write(signal_w, b"f")
    keys = []
    while True:
        try:
            keys.append(tap.receive(flags=socket.MSG_DONTWAIT).key.decode("utf-8", "replace"))
        except (BlockingIOError, ConnectionClosed, AttributeError):
            return repr(keys)


class Attack:
    """A shared bus, a real responder (of `responder_uid`) whose handler answers only after the
    forger (of `forger_uid`) has answered the same request, and the forger."""

    def __init__(self, start_bus, shared_dir, responder_uid=0, forger_uid=65534):
        self.bus = start_bus("-o", address=os.path.join(shared_dir, "bus.socket"))
        self.signal_r, self.signal_w = os.pipe()
        self.who_r, self.who_w = os.pipe()
        self.out = {}
        address = self.bus.address

        def handler(key, body):
            if select.select([self.signal_r], [], [], 30)[0]:
                os.read(self.signal_r, 1)  # the forger has answered this request
            return b"real " + body

        def serve():
            with Client(address) as srv:
                try:
                    srv.serve(b"svc/", handler, ready=lambda: os.write(self.who_w, srv.whoami(10) + b"\n"))
                except ConnectionClosed:
                    pass  # the bus stopped as it answered the forger's challenge to a request already answered
            return "served"

        def responder():
            self.out["responder"] = serve() if responder_uid == 0 else run_as(responder_uid, responder_uid, serve)

        self.threads = [threading.Thread(target=responder, daemon=True)]
        self.threads[0].start()
        self.responder = os.read(self.who_r, 200).strip()
        t = threading.Thread(target=lambda: self.out.setdefault(
            "forger", run_as(forger_uid, forger_uid, lambda: forger(address, self.responder, self.signal_w))),
            daemon=True)
        t.start()
        self.threads.append(t)
        assert os.read(self.signal_r, 1) == b"r"

    def cli(self, *args, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sbus.cli", "request", *args], capture_output=True, timeout=60,
                              cwd=REPO, env=dict(os.environ, SBUS_SOCKET=self.bus.address), **kw)

    def end(self) -> str:
        """Stop the bus; the forger's tap report (the keys it saw)."""
        self.bus.stop()
        for t in self.threads:
            t.join(30)
        for fd in (self.signal_r, self.signal_w, self.who_r, self.who_w):
            os.close(fd)
        assert self.out.get("responder") == "served", self.out.get("responder")  # it ended, without an error
        keys = self.out.get("forger", "")
        assert keys.startswith("["), keys
        assert "svc/" in keys and "!/cred/0/" not in keys, keys  # it saw the requests, never a token
        return keys


def test_sbus_request_and_the_blocking_and_asyncio_clients_refuse_forged_replies(start_bus, shared_dir):
    import sbus.client.asyncio as aio

    attack = Attack(start_bus, shared_dir)
    try:
        for i in range(2):
            r = attack.cli("svc/x", f"cli{i}", "-t", "30")
            assert (r.returncode, r.stdout) == (0, b"real cli%d\n" % i), r
        with Client(attack.bus.address) as c:
            for i in range(2):  # the first proves the responder, the second is answered at once
                assert c.request("svc/x", b"blocking%d" % i, timeout=30) == b"real blocking%d" % i
            # per request at least: 4 plain bodies (/a /r /e /x) and the claim of its own prefix
            assert c.requester.unverified >= 2 * 5 and c.requester.challenges >= 1

        async def main():
            c = await aio.connect(attack.bus.address)
            try:
                return [await c.request("svc/x", b"asyncio%d" % i, timeout=30) for i in range(2)]
            finally:
                c.close()
        assert asyncio.run(main()) == [b"real asyncio0", b"real asyncio1"]
    finally:
        attack.end()


@pytest_twisted.ensureDeferred
async def test_the_twisted_client_refuses_forged_replies(start_bus, shared_dir):
    from twisted.internet import reactor
    from sbus.client.twisted import connect

    attack = Attack(start_bus, shared_dir)
    try:
        p = await connect(reactor, attack.bus.address)
        try:
            for i in range(2):
                assert await p.request("svc/x", b"twisted%d" % i, timeout=30) == b"real twisted%d" % i
        finally:
            await p.close()
    finally:
        attack.end()


def test_from_uid_names_another_users_responder(start_bus, shared_dir):
    """Root asks uid 65534's responder while uid 65533 forges: by default (root's own uid) the
    real reply is refused too, and the timeout says so; ``--from-uid 65534`` gets it."""
    attack = Attack(start_bus, shared_dir, responder_uid=65534, forger_uid=65533)
    try:
        r = attack.cli("--from-uid", "65534", "svc/x", "hi", "-t", "30")
        assert (r.returncode, r.stdout) == (0, b"real hi\n"), r
        r = attack.cli("svc/x", "hi", "-t", "3")
        assert r.returncode == 124 and b"unverified" in r.stderr and FORGED not in r.stdout, r
        r = attack.cli("--from-uid", "nosuchuser", "svc/x")
        assert r.returncode == 2 and b"not a uid, a user name or 'any'" in r.stderr
    finally:
        attack.end()
