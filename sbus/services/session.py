"""A service's claim of a lingering ``server/session`` (issue 23): what a dead predecessor missed.

The server keeps a closed connection's patterns for a while as a named session and counts
what matched them (``CMSG server/session\\0NAME\\0LINGER``, docs/protocol.md). A service that
claims the same NAME after a restart is told that count (MISSED) and how long the gap
lasted (GAP). `SessionClaim` is one connection's claim, shared by the bridge and the relay:

* `saw()` is called for each message the connection received and passed on (or counted
  elsewhere) before the claim was answered, and `sent()` for each the service published
  there itself, before the claim was sent, that its own patterns match (echo is off: it never sees those, but the lingering session,
  another connection, counts them). Those matched the lingering session's patterns too (when
  the patterns are the same: the same role), so they are in MISSED as well: the loss is
  ``MISSED - seen``, never below 0. A connection that was subscribed before the
  predecessor's connection closed has seen everything MISSED counts, so its loss is 0: a
  sibling taking over a role it watched counts nothing. This also makes the moment of the
  claim free: a late claim over-counts nothing.
* `claim()` sends the request and fires with the parsed reply; `lost` is set then.

Secret keys (``!/cred/``) are never counted by the server, so `saw()` ignores them.
"""

from __future__ import annotations

from typing import NamedTuple

from twisted.internet import defer

from sbus.client.twisted import parse_whoami
from sbus.core.credentials import SECRET_ROOT

SESSION = b"server/session"
#: Seconds a service asks its session to linger after its connection closes (the server clamps
#: it to its ``--max-session-linger``, 60 s by default).
DEFAULT_LINGER = 60.0
MAX_NAME = 200
STATES = ("new", "resumed", "busy", "refused")


class SessionReply(NamedTuple):
    name: bytes
    state: str
    missed: int
    gap: float
    linger: float


def parse_reply(payload: bytes | None) -> SessionReply | None:
    """The server's ``server/session`` reply, or None if it is not one."""
    parts = (payload or b"").split(b"\0")
    if len(parts) != 5:
        return None
    name, state, missed, gap, linger = parts
    try:
        state = state.decode("ascii")
        reply = SessionReply(name, state, int(missed), float(gap), float(linger))
    except (UnicodeDecodeError, ValueError):
        return None
    if state not in STATES or reply.missed < 0 or not reply.gap >= 0 or not reply.linger >= 0:
        return None
    return reply


def session_name(text: str) -> bytes:
    """A session name from `text`: UTF-8, no NUL, at most `MAX_NAME` bytes (cut, the caller puts
    what makes it unique first)."""
    return text.replace("\0", "?").encode("utf-8", "surrogateescape")[:MAX_NAME]


class SessionClaim:
    """One connection's claim of session `name`: counts what it saw before the answer."""

    def __init__(self, proto, name: bytes, linger: float = DEFAULT_LINGER):
        self.proto = proto
        self.name = name
        self.linger = linger
        parsed = parse_whoami(proto.credentials or b"")
        self._secret = (parsed[0] if parsed is not None else b"") + SECRET_ROOT
        #: Messages received and passed on (or counted elsewhere) until the claim was answered.
        self.seen = 0
        self.pending = False
        self.reply: SessionReply | None = None
        #: What the predecessor's gap lost: MISSED less what this connection saw (0 if not resumed).
        self.lost = 0
        self.attempts = 0

    @property
    def holds(self) -> bool:
        return self.reply is not None and self.reply.state in ("new", "resumed")

    @property
    def counting(self) -> bool:
        return not self.holds

    def saw(self, key: bytes) -> None:
        """A message received (delivered before the claim's answer: the session counted it)."""
        if not self.holds and not key.startswith(self._secret) and not key.startswith(SECRET_ROOT):
            self.seen += 1

    def sent(self, key: bytes) -> None:
        """A message we published that our patterns match: the session counted it if the server
        read it before the claim, which it does only if we sent it before the claim."""
        if not self.pending:
            self.saw(key)

    def claim(self) -> defer.Deferred:
        """Send the claim (unless one is under way or held); fires with the `SessionReply`,
        or None (no answer we understand). Errors (the connection went away) are swallowed."""
        if self.pending or self.holds or not self.proto.connected:
            return defer.succeed(None)
        self.pending = True
        self.attempts += 1
        try:
            d = self.proto.server_request(SESSION, self.name + b"\0" + b"%.3f" % self.linger)
        except Exception:
            self.pending = False
            return defer.succeed(None)

        def answered(payload):
            self.pending = False
            reply = parse_reply(payload)
            if reply is None:
                return None
            self.reply = reply
            if reply.state == "resumed":
                self.lost = max(0, reply.missed - self.seen)
            return reply

        def failed(_):
            self.pending = False
            return None

        return d.addCallbacks(answered, failed)
