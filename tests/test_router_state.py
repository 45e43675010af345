"""The router as a state machine: SUB, UNSUB and dropped clients against a model.

Hypothesis drives random sequences of `add_client`, `subscribe`,
`unsubscribe` and `remove_client` on a `Router` and, after every step,
checks `match()` against the reference matcher (`patterns.matches`) plus the
secrecy rule, and the bookkeeping the broker relies on: subscription and
client counts, the held-pattern set, each client's patterns, the values
subscribe/unsubscribe/remove_client return, and that a dropped client is
never returned again. The alphabet is chosen so that aliasing patterns
(`x*/` and `x**/`, `*/` and `**/`, `a*/b` and `a**/b`) and keys containing
`*` come up often: pattern aliasing (issue 10, item 1) is found in well
under a second on the old router.

`test_router_state_long` is the same machine with many more examples, behind
the `slow` marker (`pytest -m slow tests/test_router_state.py`).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from sbus.core.credentials import SECRET_ROOT
from sbus.core.patterns import reaches
from sbus.core.router import Router

CLIENTS = ["c0", "c1", "c2", "c3"]
SECRET_PREFIXES = {
    "c0": b"!/cred/1/2/3/",
    "c1": b"!/cred/1/2/3/",  # same space as c0
    "c2": b"!/cred/1/2/3/!/cred/7/8/9/",  # below a relay
    "c3": None,  # never gets a secret key
}

# Segments that make aliases and '*'-keys likely.
PATTERN_SEGMENTS = [b"", b"*", b"**", b"x*", b"x**", b"*x", b"x", b"a*b", b"a**b", b"!"]
KEY_SEGMENTS = [b"", b"x", b"xa", b"a", b"ab", b"a*b", b"*", b"**", b"x*", b"*x", b"!", b"cred", b"1", b"2", b"3"]


def _joined(segments, max_size):
    return st.lists(st.sampled_from(segments), min_size=1, max_size=max_size).map(b"/".join)


PATTERNS = st.one_of(
    _joined(PATTERN_SEGMENTS, 3),
    _joined(PATTERN_SEGMENTS, 2).map(lambda p: p + b"/"),  # tails
    _joined(PATTERN_SEGMENTS, 2).map(lambda p: b"/" + p),
    st.sampled_from([b"", b"*/", b"**/", b"x*/", b"x**/", b"a*/b", b"a**/b", b"!/", b"!/cred/1/2/3/",
                     b"!/cred/1/2/3/x*", b"!/cred/1/2/3/!/cred/7/8/9/"]),
    st.sampled_from([b"sbus/", b"sbus/topology/", b"sbus/*/", b"*/topology/", b"sbus*/"]),
)
KEYS = st.one_of(
    _joined(KEY_SEGMENTS, 5),
    _joined(KEY_SEGMENTS, 3).map(lambda k: k + b"/"),
    _joined(KEY_SEGMENTS, 3).map(lambda k: b"/" + k),
    _joined(KEY_SEGMENTS, 3).map(lambda k: b"!/cred/1/2/3/" + k),
    _joined(KEY_SEGMENTS, 2).map(lambda k: b"!/cred/1/2/3/!/cred/7/8/9/" + k),
    _joined(KEY_SEGMENTS, 2).map(lambda k: b"!/cred/4/5/6/" + k),
    _joined(KEY_SEGMENTS, 2).map(lambda k: b"sbus/topology/" + k),
)


class RouterMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.router = Router()
        self.held: dict[str, dict[bytes, int]] = {}  # the model: client -> pattern -> instances
        self.dropped: set[str] = set()
        self.keys: list[bytes] = [b"xa/b", b"x/b", b"/", b"a/b", b"x*/b"]

    # -- the model

    def expected(self, key: bytes) -> set:
        out = set()
        for c, pats in self.held.items():
            if any(reaches(p, key) for p in pats):
                if key.startswith(SECRET_ROOT):
                    prefix = SECRET_PREFIXES[c]
                    if prefix is None or not key.startswith(prefix):
                        continue
                out.add(c)
        return out

    def holds(self, pattern: bytes) -> bool:
        return any(pattern in pats for pats in self.held.values())

    # -- rules

    @rule(c=st.sampled_from(CLIENTS))
    def add(self, c):
        self.router.add_client(c, SECRET_PREFIXES[c])
        self.held.setdefault(c, {})
        self.dropped.discard(c)

    @rule(c=st.sampled_from(CLIENTS), pattern=PATTERNS)
    def subscribe(self, c, pattern):
        if c not in self.held:
            self.add(c)
        before = self.holds(pattern)
        assert self.router.subscribe(c, pattern) is (not before)
        self.held[c][pattern] = self.held[c].get(pattern, 0) + 1

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), c=st.sampled_from(CLIENTS))
    def subscribe_near(self, data, c):
        """A pattern one edit away from one already held: near-aliases are where a trie goes wrong."""
        pattern = data.draw(st.sampled_from(sorted({p for pats in self.held.values() for p in pats})))
        edits = [pattern + b"/", b"/" + pattern, pattern + b"*", pattern.replace(b"*", b"**", 1),
                 pattern.replace(b"**", b"*", 1), pattern.rstrip(b"/"), pattern.replace(b"*", b"", 1)]
        self.subscribe(c, data.draw(st.sampled_from(edits)))

    @rule(c=st.sampled_from(CLIENTS), pattern=PATTERNS)
    def unsubscribe(self, c, pattern):
        self._unsubscribe(c, pattern)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def unsubscribe_held(self, data):
        c = data.draw(st.sampled_from(sorted(c for c, p in self.held.items() if p)))
        pattern = data.draw(st.sampled_from(sorted(self.held[c])))
        self._unsubscribe(c, pattern)

    def _unsubscribe(self, c, pattern):
        result = self.router.unsubscribe(c, pattern)
        pats = self.held.get(c, {})
        if pattern not in pats:
            assert result is None
            return
        pats[pattern] -= 1
        if not pats[pattern]:
            del pats[pattern]
        assert result is (not self.holds(pattern))

    @rule(c=st.sampled_from(CLIENTS))
    def drop(self, c):
        gone = self.router.remove_client(c)
        mine = self.held.pop(c, {})
        assert sorted(gone) == sorted(p for p in mine if not self.holds(p))
        if mine or c in SECRET_PREFIXES:
            self.dropped.add(c)

    @rule(key=KEYS)
    def match(self, key):
        self.keys.append(key)
        self._check(key)
        self._check(key)  # again: from the cache

    def _check(self, key):
        got = self.router.match(key)
        assert len(got) == len(set(got)), (key, got)
        assert set(got) == self.expected(key), (key, got, self.held)
        assert not (set(got) & (self.dropped - set(self.held))), (key, got, "stale client")

    # -- invariants

    @invariant()
    def bookkeeping(self):
        r = self.router
        assert r.client_count == len(self.held)
        assert r.subscription_count == sum(n for pats in self.held.values() for n in pats.values())
        assert sorted(r.held_patterns()) == sorted({p for pats in self.held.values() for p in pats})
        for c, pats in self.held.items():
            assert r.patterns_of(c) == pats

    @invariant()
    def matches_model(self):
        for key in self.keys[-6:]:
            self._check(key)

    def teardown(self):
        for c in list(self.held):
            self.router.remove_client(c)
        assert self.router.subscription_count == 0 and self.router.held_patterns() == []
        assert self.router._root.empty() and not self.router._all


TestRouterState = RouterMachine.TestCase
TestRouterState.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_router_state_long():
    """The same machine, long (about 2 minutes): run with `-m slow`."""
    run_state_machine_as_test(RouterMachine, settings=settings(
        max_examples=2000, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
