"""One takeover machine for a hot standby (sans-I/O; for ``sbus-bridge`` and ``sbus-link``, which
still keep takeovers of their own: issue 34).

A service that may carry a flow (a bridge's two directions, a link half's receiving one) while
another path may carry it too decides here *when* it carries. The spanning tree says whose the
flow is (`peer_gone`: the other path was declared dead or stood down; `peer_alive`: another path
carries it); the service's window (`sbus.core.standby.Window`) says *what* the other path left
undelivered. This machine orders the two, the way h11's ``_state.py`` orders HTTP: named states,
an explicit table of ``(state, event) -> (new state, actions)``, and an error naming both for
anything else (`TakeoverError`: a bug in the caller, never the peer's doing).

States:

* ``STOPPED``: nothing watched (a side is down, or has not answered a round trip since it
  connected). Nothing carried.
* ``STANDBY``: both sides watched, another path carries: the window fills.
* ``CATCHING_UP``: the flow is ours; round trips through both servers are under way (`SYNC`),
  so that every copy the old path made meets its original before we forward the rest. A round
  trip alone comes back before a server has read what a dead path wrote while flood control
  held its connection paused: where the old path held the role's session on a server, `SYNC`
  first waits (bounded) until that server no longer says it is ``closing``
  (``server/session-held``; the bridge does so at each takeover).
* ``DELIVERING``: carrying; what the window held is written (`REPLAY`), and a round trip after
  it (`FLUSH`) is under way. Only when it is back has the window reached the servers: then, and
  not before, we claim the role's session (`CLAIM`), so that a kill before that leaves the old
  holder's session counting (the gap is counted, not lost unseen).
* ``CARRYING``: forwarding as messages come.
* ``HANDING_OVER``: the tree gave the flow to another path while we carried: we forward nothing
  new, watch with a fresh window (`RESET`), and wait for what we wrote to reach the servers
  (`FLUSH`); then ``STANDBY``. Until then we still count as carrying.

Events (`Takeover.handle`): ``watching``, ``peer_alive``, ``peer_gone``, ``caught_up``,
``delivered``, ``session_claimed``, ``session_lost``, ``restart``, and ``timeout`` (made by
`Takeover.tick` when a catch-up outlives `CATCH_UP_TIMEOUT` on the given clock). ``caught_up``
and ``delivered`` answer a round trip and carry the token the `SYNC` or `FLUSH` action gave:
an answer to a round trip of an earlier state (the flow was taken from us meanwhile, a side
reconnected) is stale and ignored, so a late answer never makes a service carry.

Invariants (tests/test_takeover_machine.py):

* a service carries (`carrying`) only after ``peer_gone``, i.e. when the tree has declared the
  other path dead or the other path stood down (the tree blocks at once and unblocks only after
  its forward delay); a restarted service starts ``STOPPED`` and cannot carry before that. Node
  ids begin with the start time (`sbus.core.topology.new_id`): a restarted service never
  outranks the live one it replaced, so the tree gives it the flow only once that one is dead;
* every message of a takeover window is carried once (`REPLAY`) or counted lost (`COUNT_LOST`:
  the catch-up failed, a side went away during it): leaving ``CATCHING_UP`` otherwise keeps the
  window (back to ``STANDBY``: the window goes on pairing), and `RESET` only forgets what another
  path carries.
"""

from __future__ import annotations

import time

STOPPED = "stopped"
STANDBY = "standby"
CATCHING_UP = "catching up"
DELIVERING = "delivering"
CARRYING = "carrying"
HANDING_OVER = "handing over"
STATES = (STOPPED, STANDBY, CATCHING_UP, DELIVERING, CARRYING, HANDING_OVER)
#: States in which this service's output may still reach a bus (at most one side of a flow).
CARRYING_STATES = frozenset({DELIVERING, CARRYING, HANDING_OVER})

WATCHING = "watching"            # both sides connected and answered a round trip
PEER_ALIVE = "peer_alive"        # the tree: another path carries the flow
PEER_GONE = "peer_gone"          # the tree: the flow is ours (the other path is dead or stood down)
CAUGHT_UP = "caught_up"          # the SYNC round trips are back (token)
DELIVERED = "delivered"          # the FLUSH round trips are back (token)
SESSION_CLAIMED = "session_claimed"  # the role's session is ours (new or resumed)
SESSION_LOST = "session_lost"    # a side's connection went away (and our session there with it)
RESTART = "restart"              # start over: the service's connections were made anew
TIMEOUT = "timeout"              # the catch-up took longer than CATCH_UP_TIMEOUT
EVENTS = (WATCHING, PEER_ALIVE, PEER_GONE, CAUGHT_UP, DELIVERED, SESSION_CLAIMED, SESSION_LOST,
          RESTART, TIMEOUT)

# Actions, for the service to perform in order.
RESET = "reset"            # forget the window's content (another path carries it), watch afresh
SYNC = "sync"              # a round trip through each server; answer with caught_up(token)
REPLAY = "replay"          # forward what the window holds, in order (carried once)
FLUSH = "flush"            # a round trip after what we wrote; answer with delivered(token)
CLAIM = "claim"            # claim the role's session wherever it is not held
COUNT_LOST = "count_lost"  # count what the window holds as lost (failover_gap) and forget it

#: Seconds a catch-up may take before its window is counted lost and it starts again.
CATCH_UP_TIMEOUT = 10.0

_ = ()
#: (state, event) -> (new state, actions). Anything not here is a `TakeoverError`.
TRANSITIONS: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    (STOPPED, WATCHING): (STANDBY, (RESET,)),
    (STOPPED, PEER_ALIVE): (STOPPED, _),
    (STOPPED, PEER_GONE): (CARRYING, (CLAIM,)),        # nothing watched: carry from now on
    (STOPPED, SESSION_LOST): (STOPPED, _),
    (STOPPED, RESTART): (STOPPED, _),

    (STANDBY, WATCHING): (STANDBY, _),
    (STANDBY, PEER_ALIVE): (STANDBY, _),
    (STANDBY, PEER_GONE): (CATCHING_UP, (SYNC,)),
    (STANDBY, SESSION_LOST): (STOPPED, (RESET,)),      # the active path carries: nothing of ours lost
    (STANDBY, RESTART): (STOPPED, (RESET,)),

    (CATCHING_UP, WATCHING): (CATCHING_UP, _),
    (CATCHING_UP, PEER_ALIVE): (STANDBY, _),           # the window stays: it goes on pairing
    (CATCHING_UP, PEER_GONE): (CATCHING_UP, _),
    (CATCHING_UP, CAUGHT_UP): (DELIVERING, (REPLAY, FLUSH)),
    (CATCHING_UP, SESSION_LOST): (STOPPED, (COUNT_LOST,)),
    (CATCHING_UP, RESTART): (STOPPED, (COUNT_LOST,)),
    (CATCHING_UP, TIMEOUT): (CATCHING_UP, (COUNT_LOST, SYNC)),

    (DELIVERING, WATCHING): (DELIVERING, _),
    (DELIVERING, PEER_GONE): (DELIVERING, _),
    (DELIVERING, PEER_ALIVE): (HANDING_OVER, (RESET, FLUSH)),
    (DELIVERING, DELIVERED): (CARRYING, (CLAIM,)),
    (DELIVERING, SESSION_LOST): (DELIVERING, _),       # the FLUSH answers (or fails) all the same
    (DELIVERING, RESTART): (STOPPED, (RESET,)),

    (CARRYING, WATCHING): (CARRYING, _),
    (CARRYING, PEER_GONE): (CARRYING, _),
    (CARRYING, PEER_ALIVE): (HANDING_OVER, (RESET, FLUSH)),
    (CARRYING, SESSION_LOST): (CARRYING, _),           # drops are counted; the tree decides
    (CARRYING, RESTART): (STOPPED, (RESET,)),

    (HANDING_OVER, WATCHING): (HANDING_OVER, _),
    (HANDING_OVER, PEER_ALIVE): (HANDING_OVER, _),
    (HANDING_OVER, PEER_GONE): (CATCHING_UP, (SYNC,)),  # ours again: what we did not forward waits
    (HANDING_OVER, DELIVERED): (STANDBY, _),
    (HANDING_OVER, SESSION_LOST): (STOPPED, (RESET,)),
    (HANDING_OVER, RESTART): (STOPPED, (RESET,)),
}
# A claim's answer may come in any state (it was sent while carrying): it changes no state.
for _state in STATES:
    TRANSITIONS[(_state, SESSION_CLAIMED)] = (_state, _)
del _, _state

#: Events that answer a round trip: they carry its token, and a stale one is ignored.
_ANSWERS = {CAUGHT_UP: SYNC, DELIVERED: FLUSH}


class TakeoverError(RuntimeError):
    """An event the machine does not take in its state (h11's LocalProtocolError): the caller's
    bug, named with both."""

    def __init__(self, state: str, event: str):
        super().__init__(f"takeover: cannot handle event {event!r} in state {state!r}")
        self.state = state
        self.event = event


class Takeover:
    """One flow's takeover state (see the module docstring). `handle` an event, perform the
    actions it returns, in order; `token` an answer to a SYNC or FLUSH with `sync_token` or
    `flush_token` as they were when the action was returned."""

    def __init__(self, clock=time.monotonic, catch_up_timeout: float = CATCH_UP_TIMEOUT):
        self.clock = clock
        self.catch_up_timeout = catch_up_timeout
        self.state = STOPPED
        #: The current round trip's token per kind (SYNC, FLUSH); None: none under way.
        self._tokens: dict[str, int | None] = {SYNC: None, FLUSH: None}
        self._next_token = 0
        #: When the flow became ours (peer_gone from STANDBY), and how long the last takeover took
        #: from there to carrying (seconds, on `clock`).
        self._given_at: float | None = None
        self._catching_since = 0.0
        self.last_takeover: float | None = None
        self.takeovers = 0
        self.claimed = False
        self.history: list[tuple[str, str, str]] = []

    @property
    def carrying(self) -> bool:
        """Does this service forward new messages now?"""
        return self.state in (DELIVERING, CARRYING)

    @property
    def holds_output(self) -> bool:
        """May what this service wrote still reach a bus (carrying, or handing over)?"""
        return self.state in CARRYING_STATES

    @property
    def sync_token(self) -> int | None:
        return self._tokens[SYNC]

    @property
    def flush_token(self) -> int | None:
        return self._tokens[FLUSH]

    def handle(self, event: str, token: int | None = None) -> tuple[str, ...]:
        """Take `event`; returns the actions to perform, in order. An answer (``caught_up``,
        ``delivered``) with a stale `token` returns no action and changes nothing."""
        kind = _ANSWERS.get(event)
        if kind is not None and (token is None or token != self._tokens[kind]):
            return ()
        try:
            new, actions = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise TakeoverError(self.state, event) from None
        old = self.state
        self.state = new
        if kind is not None:
            self._tokens[kind] = None
        if new != CATCHING_UP:
            self._tokens[SYNC] = None
        if new not in (DELIVERING, HANDING_OVER):
            self._tokens[FLUSH] = None
        for action in actions:
            if action in (SYNC, FLUSH):
                self._tokens[action] = self._next_token
                self._next_token += 1
        if event == SESSION_CLAIMED:
            self.claimed = True
        elif event in (SESSION_LOST, RESTART):
            self.claimed = False
        now = self.clock()
        if new == CATCHING_UP and old != CATCHING_UP:
            self._given_at = now
            self._catching_since = now
        elif event == TIMEOUT:
            self._catching_since = now
        if new == DELIVERING and old == CATCHING_UP:
            self.takeovers += 1
            self.last_takeover = now - self._given_at if self._given_at is not None else None
        self.history.append((old, event, new))
        del self.history[:-32]
        return actions

    def tick(self) -> tuple[str, ...]:
        """Call now and then: a catch-up older than `catch_up_timeout` becomes a ``timeout``."""
        if self.state == CATCHING_UP and self.clock() - self._catching_since >= self.catch_up_timeout:
            return self.handle(TIMEOUT)
        return ()

    def stats(self) -> dict:
        return {"state": self.state, "takeovers": self.takeovers,
                "last_takeover_seconds": None if self.last_takeover is None else round(self.last_takeover, 3)}
