"""The reference matcher gives exactly the docs/protocol.md "Routing keys and patterns" answers."""

import pytest

from sbus.core.patterns import matches

# docs/protocol.md "Routing keys and patterns" table, row for row.
TABLE = [
    (b"", b"", True),
    (b"", b"anything", True),
    (b"", b"a/b/c/", True),
    (b"", b"!/cred/1/2/3/x", True),  # the matcher itself knows nothing of secrecy
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
]

# Consequences of the exact algorithm order that must be preserved.
EDGES = [
    # '*' cannot match an empty remainder at the very end of the key
    (b"a/*", b"a/", False),
    (b"a*", b"a", False),
    (b"*", b"", False),
    (b"*", b"a", True),
    # ... but can match empty before a '/'
    (b"a/*/c", b"a//c", True),
    (b"*/", b"/x", True),
    (b"*/", b"/", True),
    # a literal '*' in a key is first matched as an equal byte
    (b"a*", b"a*b", False),
    (b"a*", b"a*", True),
    (b"a*", b"ab", True),
    (b"a*b", b"a*b", True),
    (b"a*b", b"axb", False),
    # a star stops at '/'
    (b"*", b"a/b", False),
    (b"*/b", b"a/b", True),
    (b"a*/b", b"a/b", True),
    (b"a*/b", b"b/b", False),
    # several stars in one segment
    (b"a**", b"ab", False),
    (b"a**/b", b"ax/b", True),
    (b"a**/b", b"a/b", True),
    # trailing '/' semantics
    (b"/", b"/", True),
    (b"/", b"/x/y", True),
    (b"/", b"x/", False),
    (b"a/", b"a/b/c", True),
    (b"a/", b"ab/", False),
    (b"a//", b"a//", True),
    (b"a//", b"a/b/", False),
    # exact lengths
    (b"a", b"a", True),
    (b"a", b"ab", False),
    (b"ab", b"a", False),
    (b"a", b"a/b", False),
    (b"a/b", b"a", False),
    (b"a/b", b"a/b", True),
    (b"", b"", True),
    (b"x", b"", False),
]


@pytest.mark.parametrize("pattern,key,expected", TABLE)
def test_notes_table(pattern, key, expected):
    assert matches(pattern, key) is expected


@pytest.mark.parametrize("pattern,key,expected", EDGES)
def test_algorithm_edges(pattern, key, expected):
    assert matches(pattern, key) is expected


def test_pattern_equal_to_key_without_star_matches():
    for key in (b"a", b"a/b", b"a/b/", b"!/cred/1/2/3/x", b"/", b"//"):
        assert matches(key, key)
