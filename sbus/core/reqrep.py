"""Request/reply over the bus, sans I/O: one core for the blocking, Twisted and asyncio clients.

The wire convention (docs/request-reply.md):

* a **request** is an ordinary ``MSG KEY\\0REPLY_KEY\\0BODY``: the payload starts with the key
  to reply on, then a NUL, then the request's body (keys never hold a NUL, so the split is
  unambiguous);
* REPLY_KEY is under the requester's own secret prefix (its whoami answer + ``/``), so only
  the requester's connection can receive the reply: ``<whoami>/sbus/reply/<NONCE>/<ID>``;
  NONCE is random per `Requester` (two in one process never meet), ID counts requests;
* a **reply** is ``MSG REPLY_KEY\\0BODY``; a responder replies only to a valid secret key
  (`parse_request`), so nobody can make a responder publish on a key of their choosing;
* **error replies**, an extension a requester asks for: its REPLY_KEY ends in ``/r``
  (``.../<NONCE>/<ID>/r``); a responder whose handler raised then publishes the error's text
  on the same key with ``/e`` instead of ``/r``, and the requester raises `RemoteError`. A
  reply key without ``/r`` (a requester from before) gets no error reply: its reply body could
  not say "error" in a way it can tell apart from an answer.
* **verified replies**, the extension a requester asks for by ``/a`` (issue 33.5): a reply
  is ``MSG <inbox><ID>/a`` (``/x`` for an error) with payload ``PREFIX\0TOKEN\0DIGEST\0BODY``:
  PREFIX the responder's whoami, DIGEST a hash of the request's key and body (a reply to
  another request, even a copy with this reply key, does not match). The requester accepts
  it only when PREFIX's uid is the one it trusts and TOKEN is the secret it sent privately to
  ``PREFIX/sbus/challenge`` (a key only that process can subscribe to). A responder that does
  not know the requester's token yet answers without it; the requester then sends its token
  there (``REPLY_KEY\0DIGEST\0TOKEN``) and the responder answers again with it, and with it
  at once on later requests. The token only ever travels on secret keys: another uid never
  reads it, whatever it subscribes to.

`Requester` makes request packets and matches replies: the first reply to a request wins,
later ones are counted in `late` and dropped. `Interest` follows the server's
``server/interest`` notices so that a request nobody is subscribed to fails at once
(`NoResponders`) instead of after the timeout. The clients only add their way of waiting.
"""

from __future__ import annotations

import hashlib
import secrets

from sbus.core import codec
from sbus.core.codec import MAX_PACKET
from sbus.core.credentials import SECRET_ROOT, CredentialError, check_key
from sbus.core.patterns import matches

#: Under the requester's secret prefix: where its replies arrive.
REPLY_SEGMENT = b"sbus/reply/"
#: A reply key longer than this is refused by responders (it would only cost them).
MAX_REPLY_KEY = 1024
#: The last segment of a reply key whose requester understands error replies, and of the error reply.
ASKS_ERRORS = b"/r"
ERROR_SUFFIX = b"/e"
#: An error reply's text is cut to this many bytes.
MAX_ERROR_TEXT = 2000
#: The last segment of a reply key whose requester verifies who answers, and of the error reply.
ASKS_VERIFIED = b"/a"
VERIFIED_ERROR = b"/x"
#: Under a responder's secret prefix: where requesters send it their token.
CHALLENGE = b"/sbus/challenge"
#: `responder_uid` that accepts a reply from anyone (the protocol from before verification).
ANY = "any"
#: A requester sends at most this many challenges per request (one per responder claimed).
MAX_CHALLENGES = 16
#: What a responder remembers: the tokens of this many requesters, replies up to these bounds.
MAX_SESSIONS = 4096
MAX_KEPT_REPLIES = 4096
MAX_KEPT_BYTES = 16 << 20


class RequestError(Exception):
    """Base class of request/reply failures."""


class NoResponders(RequestError):
    """Nobody holds a pattern that matches the request's key (as `server/interest` tells)."""

    def __init__(self, key: bytes):
        super().__init__(f"no responders: nobody is subscribed to {key.decode('utf-8', 'replace')}")
        self.key = key


class RemoteError(RequestError):
    """The responder's handler failed: the text is its error (type and message)."""

    def __init__(self, key: bytes, text: str):
        super().__init__(text)
        self.key = key
        self.text = text


class RequestTimeout(RequestError, TimeoutError):
    """No reply within the timeout (`unverified`: replies refused as not from a trusted responder)."""

    def __init__(self, key: bytes, timeout: float | None, unverified: int = 0):
        text = f"no reply to {key.decode('utf-8', 'replace')} within {timeout:g} s"
        if unverified:
            text += (f" ({unverified} unverified repl{'y' if unverified == 1 else 'ies'} refused: "
                     "not from a responder of the uid asked for, or from one too old to prove it)")
        super().__init__(text)
        self.key = key
        self.unverified = unverified


def parse_prefix(prefix: bytes) -> list[tuple[int, int, int]] | None:
    """The (gid, uid, pid) of each hop of a whoami answer (``!/cred/G/U/P``, behind relays
    ``!/cred/G/U/P/!/cred/G/U/P``), or None when it is not exactly one."""
    hops = []
    for part in prefix.split(b"/" + SECRET_ROOT) if prefix.startswith(SECRET_ROOT) else ():
        fields = part[len(SECRET_ROOT):].split(b"/") if not hops else part.split(b"/")
        if len(fields) != 3 or not all(f.isdigit() and len(f) <= 10 for f in fields):
            return None
        hops.append(tuple(int(f) for f in fields))
    return hops or None


def uid_of(whoami: bytes) -> int:
    """The uid of the process behind a whoami answer (its last hop)."""
    hops = parse_prefix(whoami)
    if hops is None:
        raise ValueError(f"not a whoami answer: {whoami[:80]!r}")
    return hops[-1][1]


def request_digest(key: bytes, body: bytes) -> bytes:
    """What ties a verified reply to its request: a hash of the request's key and body."""
    return hashlib.blake2b(key + b"\0" + body, digest_size=16).hexdigest().encode()


def encode_request(reply_key: bytes, body: bytes) -> bytes:
    """The payload of a request: REPLY_KEY NUL BODY."""
    return reply_key + b"\0" + body


def parse_request(payload: bytes) -> tuple[bytes, bytes] | None:
    """(reply key, body) of a request payload, or None if it carries no valid secret reply key.

    A reply key must be a well-formed `!/cred/` key (a responder must never be made to publish
    anywhere else): starting with ``!/cred/G/U/P/`` (digits), no invalid '!', at most
    `MAX_REPLY_KEY` bytes."""
    i = payload.find(b"\0")
    if i < 0:
        return None
    key = payload[:i]
    if not key.startswith(SECRET_ROOT) or len(key) > MAX_REPLY_KEY:
        return None
    parts = key[len(SECRET_ROOT):].split(b"/", 3)
    if len(parts) < 4 or not all(p.isdigit() for p in parts[:3]):
        return None
    try:
        check_key(key)
    except CredentialError:
        return None
    return key, payload[i + 1:]


def reply_packet(reply_key: bytes, body: bytes, max_packet: int = MAX_PACKET) -> bytes:
    """The packet that answers a request."""
    return codec.encode_msg(reply_key, body, max_packet)


class Interest:
    """The patterns other clients hold, from ``CMSG server/interest`` notices.

    `ready` once the first listing has ended (``=``); `wanted(key)` is then whether any
    held pattern matches `key` (cached per key until the next change). The scope is the
    server's: root and the bus owner see every client's patterns, other uids only their own
    uid's (docs/protocol.md "Server notices")."""

    def __init__(self):
        self.ready = False
        self.held: set[bytes] = set()
        self._listing: set[bytes] | None = set()
        self._cache: dict[bytes, bool] = {}

    def feed(self, payload: bytes | None) -> None:
        payload = payload or b""
        if payload == b"=":
            if self._listing is not None:
                self.held, self._listing = self._listing, None
                self.ready = True
                self._cache.clear()
            return
        sign, _, pattern = payload.partition(b"\0")
        target = self.held if self._listing is None else self._listing
        if sign == b"+":
            target.add(pattern)
        elif sign == b"-":
            target.discard(pattern)
        else:
            return
        self._cache.clear()

    def wanted(self, key: bytes) -> bool | None:
        """True/False once ready (does any held pattern match `key`?), None before."""
        if not self.ready:
            return None
        hit = self._cache.get(key)
        if hit is None:
            hit = any(matches(p, key) for p in self.held)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = hit
        return hit


class Requester:
    """Make request packets and match their replies (sans I/O).

    ``Requester(whoami)``: `whoami` is the connection's whoami answer. `subscribe_packet` must
    be sent once before the first request (the reply pattern). `request(key, body, waiter,
    responder_uid)` returns (request id, packet to send) and remembers `waiter` (whatever the
    client waits with: a list, a Deferred, a Future). `receive(key, payload)` returns (waiter,
    body) for the first acceptable reply to a pending request, or None (not a reply to us; a
    late or duplicate reply, counted in `late`; an unverified one, counted in `unverified`).
    Packets `receive` wants sent (challenges to a responder's secret key) wait in `outgoing`
    (`take_outgoing`). `forget(rid)` drops a request (its timeout expired)."""

    def __init__(self, whoami: bytes, max_packet: int = MAX_PACKET):
        if not whoami.startswith(SECRET_ROOT):
            raise ValueError(f"not a whoami answer: {whoami[:80]!r}")
        self.max_packet = max_packet
        self.uid = uid_of(whoami)
        self.inbox = whoami + b"/" + REPLY_SEGMENT + secrets.token_hex(8).encode() + b"/"
        self.interest = Interest()
        self._next = 0
        # rid -> [waiter, trusted uid (None: any), request digest, responders challenged]
        self._pending: dict[bytes, list] = {}
        # responder prefix -> the token sent to it (only to its secret key)
        self._tokens: dict[bytes, bytes] = {}
        self.outgoing: list[bytes] = []
        #: Replies that came after their request was answered or given up (dropped).
        self.late = 0
        self.sent = 0
        self.answered = 0
        #: Error replies received (`RemoteError`s).
        self.errors = 0
        #: Replies refused: not from a responder of the trusted uid, or not to this request.
        self.unverified = 0
        #: Tokens sent to responders' secret keys.
        self.challenges = 0

    @property
    def subscribe_packet(self) -> bytes:
        return codec.encode_sub(self.inbox, self.max_packet)

    def doubtful(self, key: bytes) -> bool:
        """True when the interest we know of says nobody would hear `key`. Notices may still be
        on their way: the client then syncs with the server (a round trip: every change made
        before it has then arrived) and calls `check`. A positive answer costs nothing."""
        return self.interest.wanted(key) is False

    def check(self, key: bytes) -> None:
        """Raise `NoResponders` if the interest listing says nobody holds a matching pattern."""
        if self.interest.wanted(key) is False:
            raise NoResponders(key)

    def trusted_uid(self, responder_uid) -> int | None:
        """The uid a request trusts: this process's own by default (None), a named one, or
        None for `ANY`. Raises ValueError for anything else."""
        if responder_uid is None:
            return self.uid
        if responder_uid == ANY:
            return None
        if isinstance(responder_uid, str) and responder_uid.isdigit():
            responder_uid = int(responder_uid)
        if type(responder_uid) is not int or not 0 <= responder_uid < 2 ** 32:
            raise ValueError(f"responder_uid must be a uid or {ANY!r}, not {responder_uid!r}")
        return responder_uid

    def request(self, key, body=b"", waiter=None, responder_uid=None) -> tuple[bytes, bytes]:
        """(rid, packet). `responder_uid`: whose replies are accepted (`trusted_uid`); with
        `ANY` the request is the unverified one of before (``/r``), which every responder answers."""
        key = key.encode() if isinstance(key, str) else bytes(key)
        body = body.encode() if isinstance(body, str) else bytes(body)
        uid = self.trusted_uid(responder_uid)
        self._next += 1
        rid = b"%x" % self._next
        ending = ASKS_ERRORS if uid is None else ASKS_VERIFIED
        packet = codec.encode_msg(key, encode_request(self.inbox + rid + ending, body), self.max_packet)
        self._pending[rid] = [waiter, uid, None if uid is None else request_digest(key, body), set(), 0]
        self.sent += 1
        return rid, packet

    def is_reply(self, key: bytes) -> bool:
        return key.startswith(self.inbox)

    def receive(self, key: bytes, payload: bytes):
        """(waiter, body) for the first acceptable reply to a pending request, (waiter,
        `RemoteError`) for an error reply; None for anything else."""
        if not key.startswith(self.inbox):
            return None
        rid, _, kind = key[len(self.inbox):].partition(b"/")
        entry = self._pending.get(rid)
        if entry is None or kind not in (b"r", b"e", b"a", b"x"):
            self.late += 1
            return None
        if (entry[1] is None) != (kind in (b"r", b"e")):
            self.unverified += 1  # an unverified reply to a verified request, or the reverse
            entry[4] += 1
            return None
        if entry[1] is not None:
            payload = self._verified(rid, entry, payload)
            if payload is None:
                return None
        self.answered += 1
        del self._pending[rid]
        if kind in (b"e", b"x"):
            self.errors += 1
            return entry[0], RemoteError(key, payload.decode("utf-8", "replace"))
        return entry[0], payload

    def _verified(self, rid: bytes, entry: list, payload: bytes) -> bytes | None:
        """The body of a verified reply, or None: refused, or a challenge queued in `outgoing`."""
        parts = payload.split(b"\0", 3)
        if len(parts) != 4 or parts[2] != entry[2] or not self._trusts(parts[0], entry[1]):
            self.unverified += 1
            entry[4] += 1
            return None
        prefix, token, _, body = parts
        known = self._tokens.get(prefix)
        if known is not None and token == known:
            return body
        if prefix not in entry[3] and len(entry[3]) < MAX_CHALLENGES:
            entry[3].add(prefix)
            if known is None:
                if len(self._tokens) >= MAX_SESSIONS:
                    del self._tokens[next(iter(self._tokens))]
                known = self._tokens[prefix] = secrets.token_hex(16).encode()
            self.challenges += 1
            self.outgoing.append(codec.encode_msg(
                prefix + CHALLENGE, self.inbox + rid + ASKS_VERIFIED + b"\0" + entry[2] + b"\0" + known,
                self.max_packet))
        elif token:
            self.unverified += 1
            entry[4] += 1
        return None

    def _trusts(self, prefix: bytes, uid: int) -> bool:
        """A responder's prefix is trusted when its process has `uid` and every relay it is
        behind runs as root, as that uid, or as our own (each hop holds the next one's keys)."""
        hops = parse_prefix(prefix)
        return hops is not None and hops[-1][1] == uid and all(h[1] in (0, uid, self.uid) for h in hops)

    def take_outgoing(self) -> list[bytes]:
        """The packets to send now (challenges), handed over once."""
        out, self.outgoing = self.outgoing, []
        return out

    def refused(self, rid: bytes) -> int:
        """How many replies to `rid` were refused or claimed it without proving it (for a
        timeout's text)."""
        entry = self._pending.get(rid)
        return 0 if entry is None else entry[4] + len(entry[3])

    def timeout_error(self, rid: bytes, key: bytes, timeout: float) -> RequestTimeout:
        """The error for `rid` timing out (it says how many replies were refused); forgets it."""
        error = RequestTimeout(key, timeout, self.refused(rid))
        self.forget(rid)
        return error

    def forget(self, rid: bytes) -> None:
        self._pending.pop(rid, None)

    def pending(self) -> int:
        return len(self._pending)

    def abandon(self) -> list:
        """Forget every pending request (the connection ended); returns their waiters."""
        waiters = [e[0] for e in self._pending.values() if e[0] is not None]
        self._pending.clear()
        return waiters


class Ask:
    """One request a responder answers: where to reply, what was asked, and for a verified
    request the requester's token (b"" while unknown) and the request's digest."""

    __slots__ = ("reply_key", "key", "body", "token", "digest")

    def __init__(self, reply_key: bytes, key: bytes, body: bytes, token=None, digest=None):
        self.reply_key, self.key, self.body, self.token, self.digest = reply_key, key, body, token, digest


class Responder:
    """The responder side: which requests to answer, and the reply packets (sans I/O).

    ``Responder(max_packet, whoami)``: with `whoami` (the connection's whoami answer) it
    answers verified requests (``/a``) as the extension says, and the client must subscribe
    to `challenge_key` and hand what arrives there to `challenge`; without, it answers them
    as a responder from before the extension would (unverified: the requester refuses them).

    The client's loop: ``ask = accept(payload, key)``; ``offer(ask)`` is a packet to send
    instead of running the handler (the requester must first send its token), else run the
    handler and send ``reply(ask, out)`` or ``error(ask, exc)``. ``challenge(payload)`` is a
    packet to send, an `Ask` to run now, or None."""

    def __init__(self, max_packet: int = MAX_PACKET, whoami: bytes | None = None):
        self.max_packet = max_packet
        self.whoami = None
        self.challenge_key = None
        self.answered = 0
        self.refused = 0
        #: Requests whose handler raised (each answered with an error reply when the requester
        #: asked for them, and logged once by the client).
        self.failed = 0
        #: Verified requests answered with an offer first (the requester's token unknown yet).
        self.offered = 0
        # requester inbox -> its token; (reply key, digest) -> an Ask waiting for its token, or
        # the (reply key, body) already sent, to send again with a new token
        self._sessions: dict[bytes, bytes] = {}
        self._kept: dict[tuple[bytes, bytes], object] = {}
        self._kept_bytes = 0
        if whoami is not None:
            self.identify(whoami)

    def identify(self, whoami: bytes) -> None:
        """Learn this connection's whoami: verified requests are answered from now on."""
        if parse_prefix(whoami) is None:
            raise ValueError(f"not a whoami answer: {whoami[:80]!r}")
        self.whoami = whoami
        self.challenge_key = whoami + CHALLENGE

    def accept(self, payload: bytes, key: bytes = b"") -> Ask | None:
        """The request in a message's payload, or None (refused, counted): no valid reply key."""
        parsed = parse_request(payload)
        if parsed is None:
            self.refused += 1
            return None
        ask = Ask(parsed[0], key, parsed[1])
        if self.whoami is not None and ask.reply_key.endswith(ASKS_VERIFIED):
            ask.digest = request_digest(key, ask.body)
            ask.token = self._sessions.get(inbox_of(ask.reply_key), b"")
        return ask

    def offer(self, ask: Ask) -> bytes | None:
        """The offer to send for a verified request whose requester's token we do not know
        (the handler runs when the token comes, `challenge`); None: run the handler now."""
        if ask.token != b"":
            return None
        self.offered += 1
        self._keep((ask.reply_key, ask.digest), ask, len(ask.body))
        return self._verified_packet(ask.reply_key, b"", ask.digest, b"")

    def handle(self, payload: bytes, handler, key: bytes = b"", log=None):
        """For a request: its offer, or run ``handler(key, body)`` and return the reply packet
        to send, or None.

        A payload without a valid secret reply key is refused (counted), the handler not run;
        a handler that returns None sends no reply; one that raises is answered with an error
        reply (`error`), after ``log(key, exc)`` if given."""
        ask = self.accept(payload, key)
        if ask is None:
            return None
        return self.offer(ask) or self.run(ask, handler, log)

    def run(self, ask: Ask, handler, log=None) -> bytes | None:
        """Run a (plain) ``handler(key, body)`` for `ask`: the reply packet, or None."""
        try:
            out = handler(ask.key, ask.body)
        except Exception as e:
            if log is not None:
                log(ask.key, e)
            return self.error(ask, e)
        if out is None:
            return None
        return self.reply(ask, out)

    def reply(self, ask: Ask, out) -> bytes:
        out = out.encode() if isinstance(out, str) else bytes(out)
        self.answered += 1
        return self._answer(ask, ask.reply_key, out)

    def error(self, ask: Ask, exc: BaseException) -> bytes | None:
        """The error reply for a handler that raised `exc` (counted in `failed`), or None when
        the requester did not ask for error replies (its key lacks the ``/r`` or ``/a`` ending)."""
        self.failed += 1
        text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:MAX_ERROR_TEXT]
        if ask.token is not None:
            return self._answer(ask, ask.reply_key[:-len(ASKS_VERIFIED)] + VERIFIED_ERROR, text)
        if not ask.reply_key.endswith(ASKS_ERRORS):
            return None
        return reply_packet(ask.reply_key[:-len(ASKS_ERRORS)] + ERROR_SUFFIX, text, self.max_packet)

    def _answer(self, ask: Ask, key: bytes, body: bytes) -> bytes:
        """The reply packet; a verified one carries our whoami and the requester's token, and is
        kept (bounded) to send again should the requester send another token."""
        if ask.token is None:
            return reply_packet(key, body, self.max_packet)
        self._keep((ask.reply_key, ask.digest), (key, body), len(body))
        return self._verified_packet(key, ask.token, ask.digest, body)

    def _verified_packet(self, key: bytes, token: bytes, digest: bytes, body: bytes) -> bytes:
        return codec.encode_msg(key, b"\0".join((self.whoami, token, digest, body)), self.max_packet)

    def _keep(self, ref: tuple[bytes, bytes], item, size: int) -> None:
        self._forget(ref)
        self._kept[ref] = (item, size)
        self._kept_bytes += size
        while len(self._kept) > MAX_KEPT_REPLIES or self._kept_bytes > MAX_KEPT_BYTES:
            self._forget(next(iter(self._kept)))

    def _forget(self, ref) -> None:
        old = self._kept.pop(ref, None)
        if old is not None:
            self._kept_bytes -= old[1]

    def challenge(self, payload: bytes):
        """A requester's token arrived on `challenge_key` (only we can read it): remember it for
        that requester; the `Ask` it waited for (run it now, its reply carries the token), or
        the reply already sent, again with this token (bytes); None when neither is kept
        (counted in `refused`)."""
        parts = payload.split(b"\0")
        if len(parts) != 3 or self.whoami is None:
            self.refused += 1
            return None
        reply_key, digest, token = parts
        kept = self._kept.get((reply_key, digest))
        if kept is None or not (0 < len(token) <= 64 and token.isalnum()):
            self.refused += 1
            return None
        inbox = inbox_of(reply_key)
        self._sessions.pop(inbox, None)
        if len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]
        self._sessions[inbox] = token
        item = kept[0]
        if type(item) is Ask:
            self._forget((reply_key, digest))
            item.token = token
            return item
        return self._verified_packet(item[0], token, digest, item[1])


def inbox_of(reply_key: bytes) -> bytes:
    """The requester's part of a reply key: all but ``<ID>/<ending>``."""
    return reply_key[:reply_key.rfind(b"/", 0, reply_key.rfind(b"/")) + 1]


def error_text(key: bytes, exc: BaseException) -> str:
    """The one log line for a handler that raised."""
    return f"request handler failed on {key.decode('utf-8', 'replace')}: {type(exc).__name__}: {exc}"
