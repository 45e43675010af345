"""The router against the reference matcher, plus secrecy and bookkeeping."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from sbus.core.patterns import matches, reaches
from sbus.core.router import Router

ALPHABET = [b"a", b"b", b"/", b"*", b"!"]
#: Tokens: '*', '**', 'x*', '*x', empty segments ('//'), '/' at both ends, '!'.
TOKENS = [b"a", b"x", b"/", b"*", b"**", b"x*", b"*x", b"//", b"!", b"!/cred/"]
CLIENTS = ["c0", "c1", "c2", "c3"]


def _bytes(max_size):
    return st.lists(st.sampled_from(ALPHABET), max_size=max_size).map(b"".join)


def _tokens(max_size):
    return st.lists(st.sampled_from(TOKENS), max_size=max_size).map(b"".join)


PATTERNS = st.one_of(
    _bytes(6),
    _bytes(5).map(lambda p: p + b"/"),
    _tokens(5),
    _tokens(4).map(lambda p: b"/" + p + b"/"),
    st.sampled_from([b"", b"*/", b"**/", b"!/", b"*", b"*/*", b"!/cred/", b"a/*/b/", b"x*/", b"x**/", b"a*/b",
                     b"a**/b"]),
    # the reserved keys' rule: only patterns starting with `sbus/` reach `sbus/topology/...`
    st.sampled_from([b"sbus/", b"sbus/topology/", b"sbus/*/hello", b"*/topology/", b"sbus/topology/hello", b"sbus*/"]),
)
KEYS = st.one_of(
    _bytes(7),
    _tokens(6),
    _tokens(4).map(lambda k: b"/" + k + b"/"),
    st.sampled_from([b"", b"/", b"a/", b"a//b", b"!/cred/1/2/3/a", b"!/cred/4/5/6/a/b", b"!/cred/1/2/3/*"]),
    st.sampled_from([b"sbus/topology/hello", b"sbus/topology/", b"sbus/topology/x/y", b"sbus/other"]),
)
SECRET_PREFIXES = {"c0": b"!/cred/1/2/3/", "c1": b"!/cred/4/5/6/", "c2": b"!/cred/1/2/3/", "c3": None}


class Model:
    """What the router must answer, from the reference matcher alone."""

    def __init__(self):
        self.held: dict[str, dict[bytes, int]] = {}

    def expected(self, key: bytes) -> set:
        out = set()
        for c, pats in self.held.items():
            if any(reaches(p, key) for p in pats):
                if key.startswith(b"!/cred/"):
                    prefix = SECRET_PREFIXES[c]
                    if prefix is None or not key.startswith(prefix):
                        continue
                out.add(c)
        return out


def _check(router: Router, model: Model, keys):
    for key in keys:
        got = router.match(key)
        assert len(got) == len(set(got)), (key, got)
        assert set(got) == model.expected(key), (key, got, model.held)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("sub"), st.sampled_from(CLIENTS), PATTERNS),
        st.tuples(st.just("unsub"), st.sampled_from(CLIENTS), PATTERNS),
        st.tuples(st.just("remove"), st.sampled_from(CLIENTS), st.just(b"")),
        st.tuples(st.just("match"), st.just(None), KEYS),
    ),
    max_size=40,
)


@settings(max_examples=400, deadline=None)
@given(subs=st.lists(st.tuples(st.sampled_from(CLIENTS), PATTERNS), max_size=12), keys=st.lists(KEYS, max_size=12))
def test_equivalent_to_reference_static(subs, keys):
    router, model = Router(), Model()
    for c in CLIENTS:
        router.add_client(c, SECRET_PREFIXES[c])
        model.held[c] = {}
    for c, p in subs:
        router.subscribe(c, p)
        model.held[c][p] = model.held[c].get(p, 0) + 1
    _check(router, model, keys)
    _check(router, model, keys)  # again, from the cache


@settings(max_examples=400, deadline=None)
@given(ops=OPS, keys=st.lists(KEYS, min_size=1, max_size=8), cache_bytes=st.sampled_from([0, 700, 2000, 1 << 20]))
def test_equivalent_to_reference_dynamic(ops, keys, cache_bytes):
    """Random sub/unsub/remove sequences, with the cache warm between changes."""
    router, model = Router(cache_bytes=cache_bytes), Model()
    for c in CLIENTS:
        router.add_client(c, SECRET_PREFIXES[c])
        model.held[c] = {}
    for op, c, arg in ops:
        if op == "match":
            _check(router, model, [arg])
            continue
        _check(router, model, keys)
        if op == "sub":
            if c not in model.held:
                router.add_client(c, SECRET_PREFIXES[c])
                model.held[c] = {}
            before = any(arg in pats for pats in model.held.values())
            assert router.subscribe(c, arg) is (not before)
            model.held[c][arg] = model.held[c].get(arg, 0) + 1
        elif op == "unsub":
            pats = model.held.get(c, {})
            res = router.unsubscribe(c, arg)
            if arg not in pats:
                assert res is None
            else:
                pats[arg] -= 1
                if not pats[arg]:
                    del pats[arg]
                assert res is (not any(arg in p for p in model.held.values()))
        else:
            gone = router.remove_client(c)
            mine = model.held.pop(c, {})
            assert sorted(gone) == sorted(p for p in mine if not any(p in q for q in model.held.values()))
        _check(router, model, keys)
        assert router.subscription_count == sum(n for pats in model.held.values() for n in pats.values())
        assert router.client_count == len(model.held)
        assert sorted(router.held_patterns()) == sorted({p for pats in model.held.values() for p in pats})
        assert router.cache_used <= cache_bytes
        for cl, pats in model.held.items():
            assert router.patterns_of(cl) == pats
    # everything withdrawn leaves an empty trie behind
    for c in list(model.held):
        router.remove_client(c)
    assert router._root.empty() and not router._all
    assert router.subscription_count == 0 and router.held_patterns() == []


def test_duplicates_counted_one_copy_per_client():
    r = Router()
    r.add_client("x", None)
    assert r.subscribe("x", b"a/*") is True
    assert r.subscribe("x", b"a/*") is False
    assert r.subscribe("x", b"a/b") is True
    assert r.subscribe("x", b"") is True
    assert r.match(b"a/b") == ("x",)
    assert r.patterns_of("x") == {b"a/*": 2, b"a/b": 1, b"": 1}
    assert r.subscription_count == 4
    assert r.unsubscribe("x", b"a/*") is False
    assert r.unsubscribe("x", b"a/*") is True
    assert r.unsubscribe("x", b"a/*") is None
    assert r.unsubscribe("nobody", b"a/*") is None
    assert r.match(b"a/b") == ("x",)
    assert r.unsubscribe("x", b"") is True
    assert r.unsubscribe("x", b"a/b") is True
    assert r.match(b"a/b") == ()


def test_subscribe_return_values_across_clients():
    r = Router()
    r.add_client(1, None)
    r.add_client(2, None)
    assert r.subscribe(1, b"k") is True
    assert r.subscribe(2, b"k") is False
    assert r.unsubscribe(1, b"k") is False
    assert r.unsubscribe(2, b"k") is True
    r.subscribe(1, b"k")
    r.subscribe(2, b"k")
    r.subscribe(2, b"only2")
    assert sorted(r.remove_client(2)) == [b"only2"]
    assert r.remove_client(2) == []
    assert r.match(b"k") == (1,)
    assert r.client_count == 1


def test_secrecy_never_leaks():
    r = Router()
    r.add_client("me", b"!/cred/100/1000/1234/")
    r.add_client("other", b"!/cred/100/1000/999/")
    r.add_client("anon", None)
    for c in ("other", "anon"):
        for p in (b"", b"*/", b"!/", b"*/cred/*/", b"!/cred/100/1000/1234/", b"!/cred/100/1000/1234/x"):
            r.subscribe(c, p)
    r.subscribe("me", b"!/cred/100/1000/1234/x")
    assert r.match(b"!/cred/100/1000/1234/x") == ("me",)
    assert r.match(b"!/cred/100/1000/1234/y") == ()
    # malformed secret keys reach nobody
    for key in (b"!/cred/1/2", b"!/cred/x/y/z/k", b"!/cred/", b"!/cred/100/1000/1234"):
        assert r.match(key) == ()
    # with a '*' in the key (slow path) too
    assert r.match(b"!/cred/100/1000/1234/*") == ()
    r.subscribe("me", b"")
    assert r.match(b"!/cred/100/1000/1234/*") == ("me",)
    # not secret: ordinary delivery
    assert set(r.match(b"!/cre")) == {"me", "other", "anon"}


def test_slave_prefix_chain():
    r = Router()
    r.add_client("local", b"!/cred/100/1000/1111/!/cred/5/6/7/")
    r.add_client("slave-self", b"!/cred/100/1000/1111/")
    r.subscribe("local", b"!/cred/100/1000/1111/!/cred/5/6/7/")
    r.subscribe("slave-self", b"")
    key = b"!/cred/100/1000/1111/!/cred/5/6/7/hello"
    assert set(r.match(key)) == {"local", "slave-self"}
    assert r.match(b"!/cred/100/1000/1111/!/cred/5/6/8/hello") == ("slave-self",)


def test_readd_replaces_secret_prefix():
    r = Router()
    r.add_client("c", b"!/cred/1/1/1/")
    r.subscribe("c", b"")
    assert r.match(b"!/cred/1/1/1/x") == ("c",)
    r.add_client("c", b"!/cred/2/2/2/")
    assert r.match(b"!/cred/1/1/1/x") == ()
    assert r.patterns_of("c") == {b"": 1}


def test_cache_hit_and_invalidation():
    r = Router()
    r.add_client("a", None)
    r.add_client("b", None)
    r.subscribe("a", b"x/*")
    first = r.match(b"x/y")
    assert r.match(b"x/y") is first  # served from the cache
    r.match(b"z")
    r.subscribe("b", b"x/y")
    assert set(r.match(b"x/y")) == {"a", "b"}
    r.unsubscribe("a", b"x/*")
    assert r.match(b"x/y") == ("b",)
    r.remove_client("b")
    assert r.match(b"x/y") == ()


def test_cache_bounded_by_bytes():
    """Memory, not entries: 8,191 keys x 2,000 match-all clients fit in a few MiB (one shared tuple)."""
    r = Router(cache_bytes=4 << 20)
    for i in range(2000):
        r.add_client(i, None)
        r.subscribe(i, b"")
    for i in range(8191):
        r.match(b"k%d" % i)
    assert len(r._cache) == 8191 and len(r._shared) == 1
    assert r.cache_used < 2 << 20, r.cache_used
    # results that differ per key are not shared, and the bound holds
    r = Router(cache_bytes=64 << 10)
    for i in range(100):
        r.add_client(i, None)
        r.subscribe(i, b"k%d" % i)
    for n in range(20):
        for i in range(100):
            assert r.match(b"k%d" % i) == (i,)
            assert r.cache_used <= 64 << 10
    big = b"x" * 5000
    r.subscribe(0, b"")
    assert r.match(big) == (0,) and big not in r._cache  # too long to cache: routed each time


def test_invalidation_is_selective():
    r = Router()
    r.add_client("a", None)
    r.subscribe("a", b"k/*")
    r.subscribe("a", b"j/*")
    for i in range(600):
        r.match(b"k/%d" % i)
        r.match(b"j/%d" % i)
    r.subscribe("a", b"zzz")  # cannot change any cached answer: nothing dropped
    assert len(r._cache) == 1200
    r.add_client("b", None)
    r.subscribe("b", b"k/5")  # drops the 'k' group (too big to test key by key), only that group
    assert all(b"j/%d" % i in r._cache for i in range(600))
    assert set(r.match(b"k/5")) == {"a", "b"} and r.match(b"k/6") == ("a",)
    for i in range(100):
        r.match(b"k/%d" % i)
    r.subscribe("b", b"k/6")  # a small group: its keys are tested, only k/6 goes
    assert len(r._cache) == 699 and b"k/6" not in r._cache
    r.subscribe("b", b"j*/1")  # a first segment with '*': groups starting with 'j'
    assert set(r.match(b"j/1")) == {"a", "b"}
    assert all(b"k/%d" % i in r._cache for i in range(7, 100))
    assert r.match(b"zzz") == ("a",)
    r.remove_client("b")
    assert r.match(b"k/5") == ("a",) and r.match(b"j/1") == ("a",)


def test_dead_patterns_are_stored():
    r = Router()
    r.add_client("a", None)
    assert r.subscribe("a", b"a*b") is True
    assert r.subscribe("a", b"a**") is True
    assert r.match(b"axb") == ()
    assert r.match(b"ab") == ()
    assert r.match(b"a*b") == ("a",)  # a '*' in the key compares as a byte
    assert r.patterns_of("a") == {b"a*b": 1, b"a**": 1}
    assert r.unsubscribe("a", b"a*b") is True
    assert r.unsubscribe("a", b"a**") is True
    assert r.subscription_count == 0


def test_subscribe_unknown_client_raises():
    r = Router()
    try:
        r.subscribe("ghost", b"a")
    except KeyError:
        pass
    else:
        raise AssertionError("expected KeyError")


def _visits(r: Router, key: bytes) -> int:
    r._cache.clear()
    before = r.visited
    r.match(key)
    return r.visited - before


def test_non_matching_subscriptions_not_visited():
    """Node visits, not time: the walk touches only what can match."""
    r = Router()
    r.add_client("hit", None)
    r.add_client("miss", None)
    r.subscribe("hit", b"app/*/temp")
    r.subscribe("hit", b"ap*/x/")
    small = _visits(r, b"app/x/temp")
    for i in range(5000):
        r.subscribe("miss", b"other%d/x/temp" % i)  # literal siblings
        r.subscribe("miss", b"app/y%d/temp" % i)  # literal children under app
        r.subscribe("miss", b"p%d*/x" % i)  # many star prefixes at the root
    assert r.match(b"app/x/temp") == ("hit",)
    large = _visits(r, b"app/x/temp")
    assert large <= small + 8, (small, large)


@settings(max_examples=200, deadline=None)
@given(
    prefixes=st.lists(_bytes(3).filter(lambda p: b"/" not in p and b"*" not in p), min_size=1, max_size=25),
    suffix=st.sampled_from([b"*", b"*/", b"**/", b"*/a", b"*/*"]),
    keys=st.lists(KEYS, max_size=10),
)
def test_many_star_prefixes_lookup_branch(prefixes, suffix, keys):
    """A node with more star children than len(segment)+1 looks prefixes up."""
    r, model = Router(), Model()
    r.add_client("c3", None)
    model.held["c3"] = {}
    for i, p in enumerate(prefixes):
        c = CLIENTS[i % 3]
        if c not in model.held:
            r.add_client(c, SECRET_PREFIXES[c])
            model.held[c] = {}
        r.subscribe(c, p + suffix)
        model.held[c][p + suffix] = model.held[c].get(p + suffix, 0) + 1
    _check(r, model, keys + [p for p in prefixes] + [p + b"a" for p in prefixes] + [p + b"/a" for p in prefixes])


def test_star_prefix_lookup_last_segment():
    r = Router()
    for p in (b"", b"a", b"ab", b"abc", b"x", b"y", b"z"):
        r.add_client(p, None)
        r.subscribe(p, p + b"*")
    # 'ab' is the key's last segment: 'ab*' needs at least one more byte
    assert set(r.match(b"ab")) == {b"", b"a"}
    assert set(r.match(b"abc")) == {b"", b"a", b"ab"}
    assert r.match(b"") == ()


def test_router_provides_irouter():
    from zope.interface.verify import verifyObject

    from sbus.interfaces import IRouter

    assert verifyObject(IRouter, Router())


def test_many_holders_of_one_pattern_add_and_remove_in_linear_time():
    """Issue 10 item 7: holders were tuples, so 50,000 holders of one pattern took 48 s to
    remove (quadratic). Now each add and remove is O(1): well under a second; the bound
    below leaves a wide margin for a loaded machine."""
    import time

    r = Router()
    n = 50_000
    start = time.process_time()
    for i in range(n):
        r.add_client(i, None)
        r.subscribe(i, b"p/*")
        r.subscribe(i, b"p/x")
    assert len(r.match(b"p/q")) == n
    for i in range(0, n, 2):
        r.unsubscribe(i, b"p/*")
        r.remove_client(i)
    for i in range(1, n, 2):
        r.remove_client(i)
    took = time.process_time() - start
    assert r._root.empty() and r.subscription_count == 0 and r.match(b"p/q") == ()
    assert took < 8, f"{took:.1f}s of CPU for {n} holders"


def test_invalidation_tests_a_bounded_number_of_key_bytes(monkeypatch):
    """One SUB or UNSUB tests at most `_TEST_BYTES` of cached keys with the
    reference matcher (a Python loop over bytes), whatever the cache holds:
    250 cached 4 KB keys sharing a long prefix with the pattern cost 150 ms
    per SUB (and as much per UNSUB) before the bound, so one client's
    SUB/UNSUB loop stalled the reactor. Keys past the bound are dropped, so
    answers stay exact."""
    import sbus.core.router as router_mod

    tested = []

    def counting(pattern, key):
        tested.append(len(key))
        return matches(pattern, key)

    monkeypatch.setattr(router_mod, "matches", counting)
    r = Router()
    r.add_client("a", None)
    body = b"b" * 4000
    keys = [b"A/" + body + b"x%d" % i for i in range(250)]
    pattern = b"A/" + body + b"y"  # no cached key matches it: none is dropped for matching
    for k in keys:
        r.match(k)
    for _ in range(5):
        tested.clear()
        r.subscribe("a", pattern)
        assert sum(tested) <= router_mod._TEST_BYTES
        tested.clear()
        r.unsubscribe("a", pattern)
        assert sum(tested) <= router_mod._TEST_BYTES
        for k in keys:
            r.match(k)  # the attacker refills the cache
    r.subscribe("a", b"A/" + body + b"x7")
    assert r.match(b"A/" + body + b"x7") == ("a",)
    assert all(r.match(k) == () for k in keys if not k.endswith(b"x7"))


import pytest  # noqa: E402


@pytest.mark.xfail(strict=True, reason=(
    "open (attacksrv): a miss visits every pattern matching a prefix of the key; 40,000 patterns of one "
    "client (a{i}*/a{j}*/) cost 80,000 visits, ~120 ms, per distinct key (as many with a{i}*/a{j}*/z, "
    "which match nothing); the broker must charge misses to the publisher (docs/security.md, Open)"))
def test_one_clients_many_matching_star_patterns_do_not_make_each_miss_expensive():
    """A client subscribes 40,000 distinct patterns that all match one family
    of keys (star pieces of 200 lengths in two segments), then publishes a
    distinct key each time, so every message is a cache miss. The walk visits
    every one of them (the answer is one client): ~120 ms of the reactor per
    message on this machine, 10x the 13 ms of issue 10 #6. Counted in trie
    visits, not time."""
    r = Router()
    r.add_client("a", None)
    for i in range(1, 201):
        for j in range(1, 201):
            r.subscribe("a", b"a" * i + b"*/" + b"a" * j + b"*/")
    r.visited = 0
    assert r.match(b"a" * 300 + b"/" + b"a" * 300 + b"/x") == ("a",)
    assert r.visited < 5000, r.visited


def test_holders_of_one_pattern_past_the_small_tuple_and_back():
    """A pattern's holders are a tuple while few, then a dict: every step of growing past the
    switch and shrinking back gives exactly the holders left, for both pattern endings."""
    import random

    r = Router()
    clients = [f"c{i}" for i in range(20)]
    for c in clients:
        r.add_client(c, None)
    for pattern, key in ((b"h/", b"h/x"), (b"h/x", b"h/x")):
        held = []
        for c in clients:
            r.subscribe(c, pattern)
            held.append(c)
            r.clear_cache()
            assert sorted(r.match(key)) == sorted(held)
        order = clients[:]
        random.Random(7).shuffle(order)
        for c in order:
            r.unsubscribe(c, pattern)
            held.remove(c)
            r.clear_cache()
            assert sorted(r.match(key)) == sorted(held)
