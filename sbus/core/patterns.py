"""The reference routing-key matcher (docs/protocol.md "Routing keys and patterns"), byte for byte.

This is deliberately the plain algorithm of the reference C server and
nothing more: it is the definition the fast `Router` is tested against (for
every key, including keys that contain '*', which the router routes through
its trie), and what the router uses to test cached keys when a pattern
changes.
"""

from __future__ import annotations

_SLASH = ord("/")
_STAR = ord("*")

#: The services' own chatter (spanning-tree announcements and changes, `sbus.core.topology`).
#: A key under it reaches only patterns whose first segment is literally ``sbus``: never the
#: catch-all ``""`` nor a pattern that starts with a star, so a client that did not ask for it
#: never sees it (MQTT's rule for ``$SYS/`` topics and ``#``; docs/protocol.md "Reserved keys").
SYSTEM = b"sbus/topology/"
_SYSTEM_PATTERN = b"sbus/"


def reaches(pattern: bytes, key: bytes) -> bool:
    """Does a message with `key` reach a subscriber of `pattern`? `matches`, except for keys
    under `SYSTEM`. (Secret keys have their own rule besides: docs/protocol.md.)"""
    if key.startswith(SYSTEM) and not pattern.startswith(_SYSTEM_PATTERN):
        return False
    return matches(pattern, key)


def matches(pattern: bytes, key: bytes) -> bool:
    """True if routing-key `pattern` matches routing `key`."""
    np, nk = len(pattern), len(key)
    p = k = 0
    while True:
        while p < np and k < nk and pattern[p] == key[k]:
            p += 1
            k += 1
        if k == nk:
            return p == np
        if p == np:
            # a trailing '/' matches '/' and anything after it
            return np == 0 or pattern[p - 1] == _SLASH
        if pattern[p] == _STAR:
            # greedy up to the next '/', no backtracking
            p += 1
            while k < nk and key[k] != _SLASH:
                k += 1
            continue
        return False
