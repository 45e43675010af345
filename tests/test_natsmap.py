"""sbus.core.natsmap: keys <-> NATS subjects, exact both ways; patterns map to subscriptions
that select the same keys as the reference matcher (or a superset, flagged not exact)."""

import re

import pytest
from hypothesis import given, settings, strategies as st

from sbus.core.natsmap import (MappingError, check_prefix, key_to_subject, pattern_to_subject,
                               subject_covers, subject_matches, subject_meet, subject_to_key,
                               subjects_overlap)
from sbus.core.patterns import matches

keys = st.binary(max_size=60).map(lambda b: b.replace(b"\0", b""))
# small alphabets make the interesting collisions (empty segments, '*', '/') likely
small = st.lists(st.sampled_from([b"a", b"b", b"/", b"*", b".", b" ", b">", b"_", b"\xff"]),
                 max_size=8).map(b"".join)
prefixes = st.sampled_from(["sbus", "", "site1.sbus", "x-y"])

TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


@given(keys, prefixes)
@settings(max_examples=500)
def test_every_key_round_trips_through_valid_tokens(key, prefix):
    subject = key_to_subject(key, prefix)
    assert subject_to_key(subject, prefix) == key
    body = subject[len(prefix) + 1:] if prefix else subject
    assert all(TOKEN.match(t) for t in body.split("."))


@given(small, small, prefixes)
@settings(max_examples=400)
def test_patterns_select_what_the_reference_matcher_selects(pattern, key, prefix):
    subject, exact = pattern_to_subject(pattern, prefix)
    got = subject_matches(subject, key_to_subject(key, prefix))
    if exact:
        assert got == matches(pattern, key)
    elif matches(pattern, key):
        assert got  # broader: never narrower


@given(small, small, small)
@settings(max_examples=200)
def test_overlap_is_true_when_a_subject_matches_both(p1, p2, key):
    s1, _ = pattern_to_subject(p1)
    s2, _ = pattern_to_subject(p2)
    subject = key_to_subject(key)
    if subject_matches(s1, subject) and subject_matches(s2, subject):
        assert subjects_overlap(s1, s2) and subjects_overlap(s2, s1)


@given(small, small, small)
@settings(max_examples=400)
def test_the_meet_matches_exactly_what_both_match(p1, p2, key):
    """sbus-nats subscribes to the meet of a held pattern and an import: never narrower than
    what both select (nothing wanted is missed), never broader (nothing unwanted is asked for)."""
    s1, _ = pattern_to_subject(p1)
    s2, _ = pattern_to_subject(p2)
    subject = key_to_subject(key)
    meet = subject_meet(s1, s2)
    both = subject_matches(s1, subject) and subject_matches(s2, subject)
    assert (meet is not None and subject_matches(meet, subject)) == both
    assert subject_meet(s2, s1) == meet
    if meet is None:
        assert not subjects_overlap(s1, s2)


@given(small, small, small)
@settings(max_examples=400)
def test_cover_means_every_subject_of_the_one_matches_the_other(p1, p2, key):
    s1, _ = pattern_to_subject(p1)
    s2, _ = pattern_to_subject(p2)
    subject = key_to_subject(key)
    if subject_covers(s1, s2) and subject_matches(s2, subject):
        assert subject_matches(s1, subject)
    assert subject_covers(s1, s1)
    if subject_covers(s1, s2) and subject_covers(s2, s1):
        assert s1 == s2


@pytest.mark.parametrize("a, b, covers", [
    ("s.>", "s.x", True), ("s.>", "s.*.>", True), ("s.*.>", "s.>", False), ("s.*", "s.x", True),
    ("s.x", "s.*", False), ("s.*", "s.>", False), ("s.a.>", "s.a", False), ("s.a", "s.a", True),
])
def test_cover_examples(a, b, covers):
    assert subject_covers(a, b) is covers


@pytest.mark.parametrize("key, subject", [
    (b"sensors/t", "sbus.sensors.t"),
    (b"a/", "sbus.a._"),
    (b"", "sbus._"),
    (b"a//b", "sbus.a._.b"),
    (b"a.b c", "sbus.a_2Eb_20c"),
    (b"cpu_load", "sbus.cpu_5Fload"),
    (b"*/>", "sbus._2A._3E"),
    (b"caf\xc3\xa9", "sbus.caf_C3_A9"),
    (b"!/cred/1/2/3/x", "sbus._21.cred.1.2.3.x"),
])
def test_documented_examples(key, subject):
    assert key_to_subject(key) == subject
    assert subject_to_key(subject) == key


@pytest.mark.parametrize("pattern, subject, exact", [
    (b"", "sbus.>", True),
    (b"a/", "sbus.a.>", True),
    (b"/", "sbus._.>", True),
    (b"a/*", "sbus.a.*", False),   # the reference '*' never matches an empty last segment
    (b"a/*/", "sbus.a.*.>", True),
    (b"a/*/b", "sbus.a.*.b", True),
    (b"a//", "sbus.a._.>", True),
    (b"a/b*", "sbus.a.*", False),
    (b"x*/", "sbus.*.>", False),
])
def test_pattern_examples(pattern, subject, exact):
    assert pattern_to_subject(pattern) == (subject, exact)


def test_the_trailing_slash_edge():
    # sbus 'a/' matches the key 'a/' itself; its subject has the extra empty token
    assert matches(b"a/", b"a/")
    assert subject_matches(pattern_to_subject(b"a/")[0], key_to_subject(b"a/"))
    assert not subject_matches(pattern_to_subject(b"a/")[0], key_to_subject(b"a"))
    # sbus '*' matches an empty segment between two '/'; the empty token '_' is a token
    # for NATS's '*'
    assert matches(b"a/*/b", b"a//b")
    assert subject_matches(pattern_to_subject(b"a/*/b")[0], key_to_subject(b"a//b"))
    # ... but not an empty last segment: flagged, so the bridge filters
    assert not matches(b"a/*", b"a/")
    assert pattern_to_subject(b"a/*")[1] is False


@pytest.mark.parametrize("subject", [
    "sbus.a..b", "sbus.a_2e", "sbus.a_41", "sbus.a_00", "sbus.a_4", "sbus.a_ZZ", "sbus.a b",
    "sbus.a.*", "sbus.caf\u00e9", "other.a", "sbus", "sbusx.a", "sbus.",
])
def test_foreign_subjects_are_refused(subject):
    with pytest.raises(MappingError):
        subject_to_key(subject)


@pytest.mark.parametrize("prefix", ["a..b", "a.*", ">", "a b", "$SYS", ".a", "a."])
def test_bad_prefixes(prefix):
    with pytest.raises(MappingError):
        check_prefix(prefix)


def test_good_prefixes():
    assert check_prefix("site1.sbus") == "site1.sbus"
    assert check_prefix("") == ""
