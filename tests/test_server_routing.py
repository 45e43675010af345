"""Routing through a real server (docs/protocol.md "Routing keys and patterns"): which subscribers get a published key.

Every check goes over the wire: a subscriber sends `SUB pattern`, a publisher
sends `MSG key\\0payload` then a marker on a key the subscriber holds exactly;
per-publisher order means the subscriber sees the message before the marker
if and only if its pattern matched.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import connect, mbus, msg, recv, send, sub, sync, unique, unsub  # noqa: F401


def ref_match(pattern: bytes, key: bytes) -> bool:
    """docs/protocol.md "Routing keys and patterns", literally."""
    i = j = 0
    while True:
        while i < len(pattern) and j < len(key) and pattern[i] == key[j]:
            i += 1
            j += 1
        if j == len(key):
            return i == len(pattern)
        if i == len(pattern):
            return len(pattern) == 0 or pattern[-1:] == b"/"
        if pattern[i:i + 1] == b"*":
            i += 1
            while j < len(key) and key[j:j + 1] != b"/":
                j += 1
            continue
        return False


TABLE = [
    # docs/protocol.md "Routing keys and patterns" table
    (b"", b"a/b/c", True),
    (b"", b"x", True),
    (b"a/*/c/", b"a/b/c/", True),
    (b"a/*/c/", b"a/b/c/d/e", True),
    (b"a/*/c/", b"a/b/c", False),
    (b"a/*/c/", b"a/c/d", False),
    (b"a/*", b"a/b", True),
    (b"a/*", b"a/b/c", False),
    (b"a*/b", b"axy/b", True),
    (b"*x", b"abx", False),
    (b"a/", b"a/", True),
    (b"a/", b"a", False),
    # more of the same rules
    (b"a/*/c", b"a//c", True),        # '*' may consume nothing
    (b"a/*/c", b"a/bb/c", True),
    (b"a/*/c", b"a/b/c/", False),     # pattern used up, last byte not '/'
    (b"a/*/c", b"a/b/x/c", False),    # '*' stops at the next '/'
    (b"a/b", b"a/b", True),
    (b"a/b", b"a/bc", False),
    (b"a/b", b"a/", False),           # key used up first
    (b"a/", b"a/b/c/d", True),        # trailing '/' matches everything after
    (b"a/", b"ab", False),
    (b"*", b"anything", True),
    (b"*", b"a/b", False),
    (b"*/", b"a/b/c", True),
    (b"*/", b"abc", False),
    (b"*/*", b"a/b", True),
    (b"*/*", b"a/b/c", False),
    (b"a/*/", b"a/b", False),
    (b"/", b"/x", True),
    (b"x/", b"x/", True),
]


def test_reference_matcher_agrees_with_the_table():
    for pattern, key, expected in TABLE:
        assert ref_match(pattern, key) is expected, (pattern, key)


def _delivered(sub_sock, pub_sock, pattern: bytes, key: bytes, marker: bytes) -> bool:
    """Publish `key` then `marker`; True iff `sub_sock` got `key` before the marker."""
    payload = b"p-" + key
    send(pub_sock, msg(key, payload), msg(marker, b"marker"))
    first = recv(sub_sock)
    if first == msg(marker, b"marker"):
        return False
    assert first == msg(key, payload), (pattern, key, first)
    assert recv(sub_sock) == msg(marker, b"marker")
    return True


@pytest.mark.parametrize("pattern,key,expected", TABLE, ids=[f"{p!r}~{k!r}" for p, k, _ in TABLE])
def test_table_row(mbus, pattern, key, expected):
    marker = unique("marker-").encode()
    s, p = connect(mbus.address), connect(mbus.address)
    try:
        send(s, sub(pattern), sub(marker))
        assert sync(s) == []
        assert _delivered(s, p, pattern, key, marker) is expected
        # and the subscriber got nothing else
        assert sync(s) == []
    finally:
        s.close()
        p.close()


def test_empty_pattern_matches_keys_of_every_shape(mbus):
    marker = unique("marker-").encode()
    s, p = connect(mbus.address), connect(mbus.address)
    keys = [b"", b"/", b"//", b"a", b"a/b/c/", b"\xff\xfe/\x01", b"*", b"a b c"]
    send(s, sub(b""))
    sync(s)
    send(p, *[msg(k, b"%d" % i) for i, k in enumerate(keys)], msg(marker))
    got = [recv(s) for _ in range(len(keys) + 1)]
    assert got == [msg(k, b"%d" % i) for i, k in enumerate(keys)] + [msg(marker)]
    s.close()
    p.close()


def test_sub_pattern_stops_at_nul(mbus):
    """`SUB pattern\\0junk`: the pattern is up to the NUL, the rest is ignored."""
    base = unique("nul/").encode()
    s, p = connect(mbus.address), connect(mbus.address)
    send(s, sub(base + b"/x\0/ignored/junk"))
    sync(s)
    send(p, msg(base + b"/x/ignored/junk", b"no"), msg(base + b"/x", b"yes"))
    assert recv(s) == msg(base + b"/x", b"yes")
    assert sync(s) == []
    # UNSUB with trailing junk removes the same pattern
    send(s, unsub(base + b"/x\0other junk"))
    sync(s)
    send(s, sub(base + b"/m"))
    sync(s)
    send(p, msg(base + b"/x", b"gone"), msg(base + b"/m", b"marker"))
    assert recv(s) == msg(base + b"/m", b"marker")
    s.close()
    p.close()


def test_many_subscribers_each_get_what_matches(mbus):
    """One publish, several subscribers with different patterns, in one go."""
    base = unique("multi").encode()
    cases = [
        (b"", True), (base + b"/", True), (base + b"/*/c", True), (base + b"/b/c", True),
        (base + b"/*", False), (base + b"/b/c/", False), (base + b"/x/c", False), (b"*/", True),
        (b"*", False), (base + b"/b/c/d", False),
    ]
    marker = base + b"/marker"
    socks = []
    p = connect(mbus.address)
    for pattern, _ in cases:
        s = connect(mbus.address)
        send(s, sub(pattern), sub(marker))
        sync(s)
        socks.append(s)
    send(p, msg(base + b"/b/c", b"hello"), msg(marker, b"m"))
    for s, (pattern, expected) in zip(socks, cases):
        first = recv(s)
        if expected:
            assert first == msg(base + b"/b/c", b"hello"), pattern
            first = recv(s)
        assert first == msg(marker, b"m"), pattern
        s.close()
    p.close()


# ---------------------------------------------------------------- property test

segment = st.text(alphabet="ab", max_size=2)
pattern_st = st.lists(st.one_of(segment, st.just("*"), st.sampled_from(["a*", "*b", "**"])), max_size=4).map(
    lambda parts: "/".join(parts)
) | st.text(alphabet="ab/*", max_size=6)
key_st = st.lists(segment, max_size=4).map(lambda parts: "/".join(parts)) | st.text(alphabet="ab/", max_size=6) \
    | st.text(alphabet="ab/*", max_size=5)


@pytest.fixture(scope="module")
def prop_pair(mbus):
    s, p = connect(mbus.address), connect(mbus.address)
    marker = unique("prop-marker-").encode()
    send(s, sub(marker))
    sync(s)
    yield s, p, marker
    s.close()
    p.close()


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=pattern_st, key=key_st)
def test_server_routes_like_the_reference_matcher(prop_pair, pattern, key):
    s, p, marker = prop_pair
    pattern, key = pattern.encode(), key.encode()
    send(s, sub(pattern))
    sync(s)
    try:
        assert _delivered(s, p, pattern, key, marker) is ref_match(pattern, key), (pattern, key)
    finally:
        send(s, unsub(pattern))
        sync(s)  # drain (don't mask the real failure)
    assert sync(s) == []


# ------------------------------------------- several clients, changing subscriptions

N_CLIENTS = 3
op_st = st.one_of(
    st.tuples(st.just("sub"), st.integers(0, N_CLIENTS - 1), pattern_st),
    st.tuples(st.just("unsub"), st.integers(0, N_CLIENTS - 1), pattern_st),
    st.tuples(st.just("pub"), st.just(0), key_st),
)


@pytest.fixture(scope="module")
def prop_clients(mbus):
    clients = [connect(mbus.address) for _ in range(N_CLIENTS)]
    pub = connect(mbus.address)
    marker = unique("multi-marker-").encode()
    for c in clients:
        send(c, sub(marker))
        sync(c)
    yield clients, pub, marker
    for c in clients + [pub]:
        c.close()


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op_st, min_size=1, max_size=12))
def test_changing_subscriptions_of_several_clients(prop_clients, ops):
    """Subscriptions added and removed between publishes (the router's cache must follow)."""
    clients, pub, marker = prop_clients
    held = [[] for _ in clients]  # the model: a multiset of patterns per client
    try:
        for op, who, arg in ops:
            arg = arg.encode()
            if op == "sub":
                send(clients[who], sub(arg))
                sync(clients[who])
                held[who].append(arg)
            elif op == "unsub":
                send(clients[who], unsub(arg))
                sync(clients[who])
                if arg in held[who]:
                    held[who].remove(arg)
            else:
                send(pub, msg(arg, b"v"), msg(marker))
                for c, pats in zip(clients, held):
                    first = recv(c)
                    if any(ref_match(x, arg) for x in pats):
                        assert first == msg(arg, b"v"), (arg, pats)
                        first = recv(c)
                    assert first == msg(marker), (arg, pats, first)
    finally:
        for c, pats in zip(clients, held):
            for x in pats:
                send(c, unsub(x))
            sync(c)  # drain (don't mask the real failure)
