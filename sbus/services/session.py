"""A service's claim of a lingering ``server/session`` (issue 23): what a dead predecessor missed.

The server keeps a closed connection's patterns for a while as a named session and counts
what matched them (``CMSG server/session\\0NAME\\0LINGER``, docs/protocol.md). A service that
claims the same NAME after a restart is told that count (MISSED) and how long the gap
lasted (GAP). `SessionClaim` is one connection's claim, shared by the bridge and the relay:

* `saw()` is called for each message the connection received and passed on (or counted
  elsewhere) before the claim was answered, and `sent()` for each the service published
  there itself, before the claim was sent, that its own patterns match (echo is off: it
  never sees those, but the lingering session, another connection, counts them). Those matched the lingering session's patterns too (when
  the patterns are the same: the same role), so they are in MISSED as well: the loss is
  ``MISSED - seen``, never below 0. A connection that was subscribed before the
  predecessor's connection closed has seen everything MISSED counts, so its loss is 0: a
  sibling taking over a role it watched counts nothing. This also makes the moment of the
  claim free: a late claim over-counts nothing.
* `claim()` sends the request and fires with the parsed reply; `lost` is set then. The claim
  asks the server to keep the count until it is confirmed: once the service has logged and
  counted it, it calls `confirm()`. A service killed between the answer and its log line
  leaves the count with the session, and its successor is told it again (``carried``); one
  killed after its log line and before the confirmation reached the server leaves it too,
  so the count may be in two log lines (the second says it is carried), never in none.

Secret keys (``!/cred/``) are never counted by the server, so `saw()` ignores them.
"""

from __future__ import annotations

import time

from twisted.internet import defer

from sbus.client.twisted import parse_whoami
from sbus.core.codec import SessionReply, session_name  # noqa: F401  (the services' one import)
from sbus.core.credentials import SECRET_ROOT

#: Seconds a service asks its session to linger after its connection closes (the server clamps
#: it to its ``--max-session-linger``, 60 s by default).
DEFAULT_LINGER = 60.0


def carried_note(reply: SessionReply) -> str:
    """The end of a service's "resumed" log line: how much of the count an earlier instance was
    told and killed before confirming (its own log line, if it wrote one, has them too)."""
    if reply.carried <= 0:
        return ""
    return (f"; {reply.carried} of them were told to a predecessor that was killed before confirming "
            "(its log may count them too)")


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
        #: Of the gap, the seconds before this connection was made (subscribed): nobody's.
        self.uncovered = 0.0
        self._made = time.monotonic()
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
        or None (the connection went away, or an answer we do not understand)."""
        if self.pending or self.holds or not self.proto.connected:
            return defer.succeed(None)
        self.pending = True
        self.attempts += 1
        try:
            d = self.proto.session(self.name, self.linger, confirm=True)
        except Exception:
            self.pending = False
            return defer.succeed(None)

        def answered(reply: SessionReply):
            self.pending = False
            self.reply = reply
            if reply.state == "resumed":
                # what this connection saw matched the stand-in: in its own count, not the carried one
                carried = min(max(0, reply.carried), reply.missed)
                self.lost = carried + max(0, reply.missed - carried - self.seen)
                self.uncovered = max(0.0, reply.gap - (time.monotonic() - self._made))
            return reply

        def failed(_):
            self.pending = False
            return None

        return d.addCallbacks(answered, failed)

    def acknowledge(self, count: int | None = None) -> None:
        """The connection's first `count` packets read (default: all) are handed on
        (`SbusProtocol.acknowledgeSession`): a kill counts what the server sent past them."""
        if self.holds and self.proto.connected:
            self.proto.acknowledgeSession(self.name, count)

    def confirm(self) -> None:
        """The count is logged and counted: the server may forget it."""
        if self.reply is not None and self.reply.state == "resumed" and self.proto.connected:
            self.proto.confirmSession(self.name)


def held_states(asks: dict):
    """Ask servers whether sessions are free, live or closing (``server/session-held``), each
    connection's requests followed by a round trip; the one query of a takeover (bridge, link).

    `asks`: {key: (protocol, session name)}. Returns a Deferred of {key: state} for the requests
    answered (a server that does not know the request answers only the round trip: that request
    is forgotten). Raises at once if a connection cannot send; the Deferred fails with the first
    round trip that fails."""
    from twisted.internet import defer

    from sbus.core import codec

    states: dict = {}
    sent = []
    for key, (proto, name) in asks.items():
        ask = proto.server_request(codec.SESSION_HELD, name)
        sent.append((proto, ask))
        ask.addCallback(lambda payload, key=key: states.__setitem__(key, codec.parse_session_held(payload)[1]))
        ask.addErrback(lambda f: None)   # malformed, or the connection went: not closing
    syncs = {id(proto): proto.sync() for proto, _ in sent}

    def answered(_):
        for proto, ask in sent:   # the round trip came back first: that server never answers
            if not ask.called:
                proto.forgetRequest(codec.SESSION_HELD, ask)
        return states

    def first(f):
        f.trap(defer.FirstError)
        return f.value.subFailure

    return defer.gatherResults(list(syncs.values()), consumeErrors=True).addCallbacks(answered, first)
