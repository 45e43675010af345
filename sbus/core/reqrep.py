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

`Requester` makes request packets and matches replies: the first reply to a request wins,
later ones are counted in `late` and dropped. `Interest` follows the server's
``server/interest`` notices so that a request nobody is subscribed to fails at once
(`NoResponders`) instead of after the timeout. The clients only add their way of waiting.
"""

from __future__ import annotations

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
    """No reply within the timeout."""

    def __init__(self, key: bytes, timeout: float | None):
        super().__init__(f"no reply to {key.decode('utf-8', 'replace')} within {timeout:g} s")
        self.key = key


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
    be sent once before the first request (the reply pattern). `request(key, body, waiter)`
    returns (request id, packet to send) and remembers `waiter` (whatever the client waits
    with: a list, a Deferred, a Future). `receive(key, payload)` returns (waiter, body) for
    the first reply to a pending request, or None (not a reply to us; or a late or duplicate
    reply, counted in `late`). `forget(rid)` drops a request (its timeout expired)."""

    def __init__(self, whoami: bytes, max_packet: int = MAX_PACKET):
        if not whoami.startswith(SECRET_ROOT):
            raise ValueError(f"not a whoami answer: {whoami[:80]!r}")
        self.max_packet = max_packet
        self.inbox = whoami + b"/" + REPLY_SEGMENT + secrets.token_hex(8).encode() + b"/"
        self.interest = Interest()
        self._next = 0
        self._pending: dict[bytes, object] = {}
        #: Replies that came after their request was answered or given up (dropped).
        self.late = 0
        self.sent = 0
        self.answered = 0
        #: Error replies received (`RemoteError`s).
        self.errors = 0

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

    def request(self, key, body=b"", waiter=None) -> tuple[bytes, bytes]:
        key = key.encode() if isinstance(key, str) else bytes(key)
        body = body.encode() if isinstance(body, str) else bytes(body)
        self._next += 1
        rid = b"%x" % self._next
        packet = codec.encode_msg(key, encode_request(self.inbox + rid + ASKS_ERRORS, body), self.max_packet)
        self._pending[rid] = waiter
        self.sent += 1
        return rid, packet

    def is_reply(self, key: bytes) -> bool:
        return key.startswith(self.inbox)

    def receive(self, key: bytes, payload: bytes):
        """(waiter, body) for the first reply to a pending request, (waiter, `RemoteError`) for
        an error reply; None for anything else."""
        if not key.startswith(self.inbox):
            return None
        rid, _, kind = key[len(self.inbox):].partition(b"/")
        if rid not in self._pending or kind not in (b"r", b"e"):
            self.late += 1
            return None
        self.answered += 1
        waiter = self._pending.pop(rid)
        if kind == b"e":
            self.errors += 1
            return waiter, RemoteError(key, payload.decode("utf-8", "replace"))
        return waiter, payload

    def forget(self, rid: bytes) -> None:
        self._pending.pop(rid, None)

    def pending(self) -> int:
        return len(self._pending)

    def abandon(self) -> list:
        """Forget every pending request (the connection ended); returns their waiters."""
        waiters = [w for w in self._pending.values() if w is not None]
        self._pending.clear()
        return waiters


class Responder:
    """The responder side: which requests to answer, and the reply packets (sans I/O)."""

    def __init__(self, max_packet: int = MAX_PACKET):
        self.max_packet = max_packet
        self.answered = 0
        self.refused = 0
        #: Requests whose handler raised (each answered with an error reply when the requester
        #: asked for them, and logged once by the client).
        self.failed = 0

    def handle(self, payload: bytes, handler, key: bytes = b"", log=None):
        """Run ``handler(key, body)`` for a request; the reply packet to send, or None.

        A payload without a valid secret reply key is refused (counted), the handler not run;
        a handler that returns None sends no reply; one that raises is answered with an error
        reply (`error`), after ``log(key, exc)`` if given."""
        parsed = parse_request(payload)
        if parsed is None:
            self.refused += 1
            return None
        reply_key, body = parsed
        try:
            out = handler(key, body)
        except Exception as e:
            if log is not None:
                log(key, e)
            return self.error(reply_key, e)
        if out is None:
            return None
        return self.reply(reply_key, out)

    def reply(self, reply_key: bytes, out) -> bytes:
        out = out.encode() if isinstance(out, str) else bytes(out)
        self.answered += 1
        return reply_packet(reply_key, out, self.max_packet)

    def error(self, reply_key: bytes, exc: BaseException) -> bytes | None:
        """The error reply for a handler that raised `exc` (counted in `failed`), or None when
        the requester did not ask for error replies (its key lacks the ``/r`` ending)."""
        self.failed += 1
        if not reply_key.endswith(ASKS_ERRORS):
            return None
        text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:MAX_ERROR_TEXT]
        return reply_packet(reply_key[:-len(ASKS_ERRORS)] + ERROR_SUFFIX, text, self.max_packet)


def error_text(key: bytes, exc: BaseException) -> str:
    """The one log line for a handler that raised."""
    return f"request handler failed on {key.decode('utf-8', 'replace')}: {type(exc).__name__}: {exc}"
