"""The takeover machine (sbus.core.takeover), sans-I/O with a fake clock: every row of its table,
illegal and stale events, takeovers in a row, a restart while catching up, and a stateful
property: of two services the tree hands one flow, at most one carries at any moment, and what
a takeover window held is carried or counted, never forgotten."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sbus.core import takeover as t
from sbus.core.takeover import Takeover, TakeoverError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


#: The shortest way from a fresh machine to each state (events, answered with their tokens).
PATHS = {
    t.STOPPED: [],
    t.STANDBY: [t.WATCHING],
    t.CATCHING_UP: [t.WATCHING, t.PEER_GONE],
    t.DELIVERING: [t.WATCHING, t.PEER_GONE, t.CAUGHT_UP],
    t.CARRYING: [t.WATCHING, t.PEER_GONE, t.CAUGHT_UP, t.DELIVERED],
    t.HANDING_OVER: [t.WATCHING, t.PEER_GONE, t.CAUGHT_UP, t.DELIVERED, t.PEER_ALIVE],
}


def send(m: Takeover, event: str):
    """Handle `event`, answering a round trip with its current token."""
    token = {t.CAUGHT_UP: m.sync_token, t.DELIVERED: m.flush_token}.get(event)
    return m.handle(event, token)


def machine_in(state: str, clock=None) -> Takeover:
    m = Takeover(clock=clock or Clock())
    for event in PATHS[state]:
        send(m, event)
    assert m.state == state
    return m


@pytest.mark.parametrize("state, event", sorted(t.TRANSITIONS))
def test_every_row_of_the_table(state, event):
    clock = Clock()
    m = machine_in(state, clock)
    if event == t.TIMEOUT:
        clock.now += t.CATCH_UP_TIMEOUT
        actions = m.tick()
    else:
        actions = send(m, event)
    new, expected = t.TRANSITIONS[(state, event)]
    assert (m.state, actions) == (new, expected)
    # a round trip is under way exactly where its answer is awaited
    assert (m.sync_token is not None) == (m.state == t.CATCHING_UP)
    assert (m.flush_token is not None) == (m.state in (t.DELIVERING, t.HANDING_OVER))


ILLEGAL = [(s, e) for s in t.STATES for e in t.EVENTS
           if (s, e) not in t.TRANSITIONS and e not in (t.CAUGHT_UP, t.DELIVERED)]


@pytest.mark.parametrize("state, event", ILLEGAL)
def test_an_illegal_event_names_state_and_event(state, event):
    m = machine_in(state)
    with pytest.raises(TakeoverError, match=f"cannot handle event '{event}' in state '{state}'") as e:
        m.handle(event)
    assert (e.value.state, e.value.event) == (state, event)
    assert m.state == state        # nothing changed


def test_an_unknown_event_is_an_error():
    with pytest.raises(TakeoverError, match="'carry now'"):
        Takeover().handle("carry now")


def test_a_stale_answer_is_ignored_and_never_makes_a_service_carry():
    m = machine_in(t.CATCHING_UP)
    old = m.sync_token
    assert m.handle(t.PEER_ALIVE) == ()          # the flow was taken back: standing by
    assert m.handle(t.CAUGHT_UP, old) == () and m.state == t.STANDBY
    m.handle(t.PEER_GONE)                        # ours again: a new round trip
    assert m.sync_token != old
    assert m.handle(t.CAUGHT_UP, old) == () and m.state == t.CATCHING_UP
    assert m.handle(t.CAUGHT_UP, None) == () and m.state == t.CATCHING_UP
    assert send(m, t.CAUGHT_UP) == (t.REPLAY, t.FLUSH) and m.carrying


def test_a_flush_answer_from_before_a_handover_does_not_end_the_next_one():
    m = machine_in(t.DELIVERING)
    first = m.flush_token
    assert m.handle(t.PEER_ALIVE) == (t.RESET, t.FLUSH)
    assert m.handle(t.DELIVERED, first) == () and m.state == t.HANDING_OVER and m.holds_output
    assert send(m, t.DELIVERED) == () and m.state == t.STANDBY and not m.holds_output


def test_restart_while_catching_up_counts_the_window_and_waits_for_the_tree_again():
    m = machine_in(t.CATCHING_UP)
    token = m.sync_token
    assert m.handle(t.RESTART) == (t.COUNT_LOST,)
    assert m.state == t.STOPPED and not m.carrying
    assert m.handle(t.CAUGHT_UP, token) == ()    # the old connection's round trip
    assert send(m, t.WATCHING) == (t.RESET,) and m.state == t.STANDBY
    assert not m.carrying                        # only the tree gives the flow back


def test_a_catch_up_that_takes_too_long_is_counted_and_tried_again():
    clock = Clock()
    m = machine_in(t.CATCHING_UP, clock)
    first = m.sync_token
    clock.now += t.CATCH_UP_TIMEOUT - 0.001
    assert m.tick() == ()
    clock.now += 0.001
    assert m.tick() == (t.COUNT_LOST, t.SYNC)
    assert m.state == t.CATCHING_UP and m.sync_token not in (None, first)
    assert m.handle(t.CAUGHT_UP, first) == ()
    assert m.tick() == ()                        # the new catch-up has its own time
    assert send(m, t.CAUGHT_UP) == (t.REPLAY, t.FLUSH)


def test_takeover_time_is_measured_from_the_flow_to_the_replay():
    clock = Clock()
    m = machine_in(t.STANDBY, clock)
    clock.now = 10.0
    send(m, t.PEER_GONE)
    clock.now = 10.75
    send(m, t.CAUGHT_UP)
    assert m.last_takeover == pytest.approx(0.75) and m.takeovers == 1
    assert m.stats() == {"state": t.DELIVERING, "takeovers": 1, "last_takeover_seconds": 0.75}


def test_the_claim_comes_only_once_the_replay_reached_the_servers():
    m = machine_in(t.CATCHING_UP)
    assert t.CLAIM not in send(m, t.CAUGHT_UP)   # written, not yet read by the servers
    assert send(m, t.DELIVERED) == (t.CLAIM,)
    m.handle(t.SESSION_CLAIMED)
    assert m.claimed
    m.handle(t.SESSION_LOST)
    assert not m.claimed and m.carrying           # drops are counted; the tree decides


class Pair:
    """Two services of one flow and the tree between them: the tree hands the flow to at most
    one, blocks at once, and gives it to the other only once the first holds no output (it
    handed over) or is dead. Each takeover's window is a number of messages."""

    def __init__(self, clock):
        self.clock = clock
        self.m = [Takeover(clock=clock), Takeover(clock=clock)]
        self.owner: int | None = None
        self.window = [0, 0]
        self.carried = 0
        self.lost = 0
        self.forgotten_while_ours = 0

    def do(self, i: int, event: str, token=None, *, stale=False) -> None:
        m = self.m[i]
        before = m.state
        if event in (t.CAUGHT_UP, t.DELIVERED) and not stale:
            token = m.sync_token if event == t.CAUGHT_UP else m.flush_token
        for action in m.handle(event, token):
            if action == t.REPLAY:
                self.carried += self.window[i]
                self.window[i] = 0
            elif action == t.COUNT_LOST:
                self.lost += self.window[i]
                self.window[i] = 0
            elif action == t.RESET:
                if before == t.CATCHING_UP:
                    self.forgotten_while_ours += self.window[i]
                self.window[i] = 0

    def give(self, i: int) -> bool:
        other = self.m[1 - i]
        if self.owner is not None or other.holds_output:
            return False
        self.owner = i
        self.do(i, t.PEER_GONE)
        return True

    def block(self, i: int) -> None:
        if self.owner == i:
            self.owner = None
        self.do(i, t.PEER_ALIVE)

    def kill(self, i: int) -> None:
        """kill -9 and start again: a fresh machine; the tree declares the dead one gone."""
        if self.owner == i:
            self.owner = None
        self.lost += self.window[i] if self.m[i].state == t.CATCHING_UP else 0
        self.window[i] = 0
        self.m[i] = Takeover(clock=self.clock)

    def flow(self, n: int = 100) -> None:
        """Messages published: a standby's window holds those the carrier has not delivered."""
        for i, m in enumerate(self.m):
            if m.state in (t.STANDBY, t.CATCHING_UP, t.HANDING_OVER):
                self.window[i] += n

    def check(self) -> None:
        assert sum(m.holds_output for m in self.m) <= 1, [m.history[-4:] for m in self.m]
        assert self.forgotten_while_ours == 0


def take_over(pair: Pair, i: int) -> None:
    """Give the flow to `i` and answer its round trips."""
    assert pair.give(i)
    pair.do(i, t.CAUGHT_UP)
    pair.do(i, t.DELIVERED)
    assert pair.m[i].state == t.CARRYING


@pytest.mark.parametrize("times", [2, 3])
def test_takeovers_in_a_row(times):
    """kill the carrier, restart it, kill the new carrier...: each takeover carries the whole
    window, and the restarted one never carries while the other does."""
    clock = Clock()
    pair = Pair(clock)
    for i in (0, 1):
        pair.do(i, t.WATCHING)
    take_over(pair, 0)
    carrier = 0
    for n in range(times):
        standby = 1 - carrier
        pair.flow(500)                              # what the standby saw go by
        pair.kill(carrier)                          # dies with messages undelivered
        pair.flow(300)                              # published while nobody carries
        clock.now += 3.0
        pair.give(standby)
        pair.do(carrier, t.WATCHING)                # restarted: it watches, does not carry
        assert not pair.m[carrier].carrying and pair.m[standby].state == t.CATCHING_UP
        pair.check()
        clock.now += 0.5
        pair.do(standby, t.CAUGHT_UP)
        assert pair.carried == 800 * (n + 1) and pair.lost == 0
        assert pair.m[standby].last_takeover == pytest.approx(0.5)
        pair.do(standby, t.DELIVERED)
        assert not pair.give(carrier)               # taken: the restarted one waits
        pair.check()
        carrier = standby
    assert pair.m[carrier].takeovers == 1


def test_a_preempted_carrier_hands_over_before_the_other_carries():
    """The tree moves the flow while the carrier still delivers its backlog: the other is given
    the flow only once the first one's output reached the servers."""
    pair = Pair(Clock())
    for i in (0, 1):
        pair.do(i, t.WATCHING)
    pair.give(0)
    pair.do(0, t.CAUGHT_UP)                         # delivering the replay
    pair.block(0)
    assert pair.m[0].state == t.HANDING_OVER and pair.m[0].holds_output
    assert not pair.give(1)
    pair.do(0, t.DELIVERED)
    assert pair.give(1)
    pair.check()


class TwoServices(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.pair = Pair(self.clock)

    who = st.integers(0, 1)

    @rule(i=who)
    def watching(self, i):
        self.pair.do(i, t.WATCHING)

    @rule(i=who)
    def move_the_flow(self, i):
        """The tree gives the flow to `i`: blocks whoever has it first (it may still hold
        output: then `i` gets it later, when asked again)."""
        owner = self.pair.owner
        if owner is not None and owner != i:
            self.pair.block(owner)
        self.pair.give(i)

    @rule(i=who)
    def block(self, i):
        self.pair.block(i)

    @rule(i=who)
    def answer(self, i):
        m = self.pair.m[i]
        if m.sync_token is not None:
            self.pair.do(i, t.CAUGHT_UP)
        elif m.flush_token is not None:
            self.pair.do(i, t.DELIVERED)

    @rule(i=who, event=st.sampled_from([t.CAUGHT_UP, t.DELIVERED]), token=st.integers(0, 40))
    def late_answer(self, i, event, token):
        m = self.pair.m[i]
        if token not in (m.sync_token, m.flush_token):
            self.pair.do(i, event, token, stale=True)

    @rule(i=who, event=st.sampled_from([t.SESSION_LOST, t.RESTART, t.SESSION_CLAIMED]))
    def connection(self, i, event):
        self.pair.do(i, event)

    @rule(i=who)
    def kill(self, i):
        self.pair.kill(i)

    @rule(n=st.integers(1, 50))
    def flow(self, n):
        self.pair.flow(n)

    @rule(dt=st.floats(0, 12))
    def time_passes(self, dt):
        self.clock.now += dt
        for i in (0, 1):
            before = self.pair.m[i].state
            actions = self.pair.m[i].tick()
            if actions:
                assert before == t.CATCHING_UP and actions == (t.COUNT_LOST, t.SYNC)
                self.pair.lost += self.pair.window[i]
                self.pair.window[i] = 0

    @invariant()
    def at_most_one_carries(self):
        self.pair.check()


TestTwoServices = TwoServices.TestCase
TestTwoServices.settings = settings(max_examples=600, stateful_step_count=25, deadline=None, database=None)
