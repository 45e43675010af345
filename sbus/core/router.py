"""Subscription trie and match cache: who gets a message with a given key.

The trie makes the cost of a match depend on the patterns that can match,
not on how many subscriptions exist; the cache makes repeated keys (the
common case on a bus) one dict lookup. Its answers are defined by the
reference matcher `patterns.matches`, plus the secrecy rule of NOTES §4,
which the router enforces itself so no pattern can leak a secret key.

How a pattern maps onto the trie (derived from the reference matcher, for
keys without '*'; such keys are split on '/' into segments):

* the empty pattern matches every key (a separate match-all table);
* a trailing '/' makes the end node a "tail": it matches keys with at least
  one more segment; otherwise the key must have exactly as many segments;
* a segment without '*' must equal the key's segment;
* a segment ``P*`` matches a key segment that starts with P, and is longer
  than P if it is the key's last segment (a '*' never matches an empty end);
  ``P**...`` is the same but can never match the key's last segment;
* a segment ``P*R`` where R has a byte other than '*' never matches a key
  without '*': such patterns are stored only in the bookkeeping ("dead").

Keys containing '*' are rare and compare bytes with pattern bytes, so they
take a slow path through `patterns.matches` over all distinct patterns.
"""

from __future__ import annotations

from .patterns import matches

SECRET_ROOT = b"!/cred/"

#: Longer keys are matched every time, not cached: the cache holds at most
#: cache_size * this many bytes of keys, whatever publishers send.
_CACHED_KEY_MAX = 512

#: Above this many cached keys a change clears the whole cache instead of
#: testing every cached key against the changed pattern.
_SELECTIVE_INVALIDATION = 512


class _Node:
    """One trie node. Tables are created on first use and holders are
    tuples: most nodes of a large subscription set are leaves with one
    holder, and this keeps a stored pattern to a few hundred bytes."""

    __slots__ = ("literal", "star", "end", "tail")

    def __init__(self):
        self.literal: dict[bytes, _Node] | None = None  # exact segment -> child
        self.star: dict[bytes, _Node] | None = None  # prefix before '*' -> child
        self.end: tuple = ()  # clients with a pattern ending exactly here
        self.tail: tuple = ()  # clients with a pattern ending here with '/'

    def empty(self) -> bool:
        return not (self.literal or self.star or self.end or self.tail)


def _compile(pattern: bytes):
    """Return (steps, tail) for the trie, or None for a pattern that can
    never match a key without '*'. Steps are (is_star, bytes)."""
    segs = pattern.split(b"/")
    tail = False
    if len(segs) > 1 and not segs[-1]:
        tail = True
        segs.pop()
    last = len(segs) - 1
    steps = []
    for i, seg in enumerate(segs):
        at = seg.find(b"*")
        if at < 0:
            steps.append((False, seg))
            continue
        rest = seg[at + 1:]
        if rest.strip(b"*"):
            return None
        if rest and i == last and not tail:
            # 'P**' needs the key to go on after the first star's stop
            return None
        steps.append((True, seg[:at]))
    return steps, tail


class Router:
    """Clients (opaque hashables) and their patterns; `match` finds recipients."""

    def __init__(self, cache_size: int = 8192):
        self.cache_size = cache_size
        self._root = _Node()
        self._all: dict[object, int] = {}  # client -> instances of the empty pattern
        self._prefix: dict[object, bytes | None] = {}  # client -> secret prefix
        self._client_patterns: dict[object, dict[bytes, int]] = {}  # client -> pattern -> instances
        self._holders: dict[bytes, int] = {}  # pattern -> how many clients hold it
        self._count = 0
        self._cache: dict[bytes, tuple] = {}
        #: trie nodes touched by cache misses; lets tests check that
        #: non-matching subscriptions are not visited (not a timing test).
        self.visited = 0

    # -- clients -----------------------------------------------------------

    def add_client(self, client, secret_prefix: bytes | None) -> None:
        """Register a client. `secret_prefix` is what a secret key must start
        with to reach it (None: no secret key ever). Re-adding an existing
        client replaces its prefix and keeps its patterns."""
        if client in self._prefix:
            self._prefix[client] = secret_prefix
            self._cache.clear()
            return
        self._prefix[client] = secret_prefix
        self._client_patterns[client] = {}

    def remove_client(self, client) -> list[bytes]:
        """Forget a client; return the patterns nobody holds any more."""
        if client not in self._prefix:
            return []
        del self._prefix[client]
        held = self._client_patterns.pop(client)
        gone = []
        holders = self._holders
        for pattern, n in held.items():
            self._count -= n
            left = holders[pattern] - 1
            if left:
                holders[pattern] = left
            else:
                del holders[pattern]
                gone.append(pattern)
            self._trie_remove(client, pattern)
        if held:
            self._cache.clear()
        return gone

    # -- subscriptions -----------------------------------------------------

    def subscribe(self, client, pattern: bytes) -> bool:
        """Store one more instance; True if no client held `pattern` before.
        Raises KeyError for a client that was not added."""
        mine = self._client_patterns[client]
        n = mine.get(pattern, 0)
        mine[pattern] = n + 1
        self._count += 1
        if n:
            return False
        holders = self._holders.get(pattern, 0)
        self._holders[pattern] = holders + 1
        self._trie_add(client, pattern)
        self._invalidate(pattern)
        return not holders

    def unsubscribe(self, client, pattern: bytes) -> bool | None:
        """Remove one instance. None if the client did not hold it; else
        True if now no client holds `pattern`, False otherwise."""
        mine = self._client_patterns.get(client)
        if not mine:
            return None
        n = mine.get(pattern)
        if n is None:
            return None
        self._count -= 1
        if n > 1:
            mine[pattern] = n - 1
            return False
        del mine[pattern]
        self._trie_remove(client, pattern)
        self._invalidate(pattern)
        left = self._holders[pattern] - 1
        if left:
            self._holders[pattern] = left
            return False
        del self._holders[pattern]
        return True

    def patterns_of(self, client) -> dict[bytes, int]:
        return dict(self._client_patterns.get(client, {}))

    def held_patterns(self) -> list[bytes]:
        return list(self._holders)

    @property
    def subscription_count(self) -> int:
        return self._count

    @property
    def client_count(self) -> int:
        return len(self._prefix)

    # -- matching ----------------------------------------------------------

    def match(self, key: bytes) -> tuple:
        """Every client with a matching pattern, once each, secrecy applied."""
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        found = self._slow(key) if b"*" in key else self._walk(key)
        if found and key.startswith(SECRET_ROOT):
            prefix = self._prefix
            found = [c for c in found if prefix[c] is not None and key.startswith(prefix[c])]
        result = tuple(found)
        if len(key) <= _CACHED_KEY_MAX:
            cache = self._cache
            if len(cache) >= self.cache_size:
                cache.clear()
            cache[key] = result
        return result

    def _walk(self, key: bytes) -> set:
        found = set(self._all)
        segs = key.split(b"/")
        last = len(segs) - 1
        live = [self._root]
        visited = 0
        for i, s in enumerate(segs):
            visited += len(live)
            nxt = []
            final = i == last
            n = len(s)
            for node in live:
                if node.tail:
                    found.update(node.tail)
                literal = node.literal
                if literal:
                    child = literal.get(s)
                    if child is not None:
                        nxt.append(child)
                star = node.star
                if star:
                    if len(star) > n + 1:
                        # many prefixes: look up each prefix of s instead
                        visited += n + 1
                        for j in range(n if final else n + 1):
                            child = star.get(s[:j])
                            if child is not None:
                                nxt.append(child)
                    else:
                        visited += len(star)
                        for p, child in star.items():
                            if s.startswith(p) and (len(p) < n or not final):
                                nxt.append(child)
            if not nxt:
                self.visited += visited
                return found
            live = nxt
        visited += len(live)
        self.visited += visited
        for node in live:
            if node.end:
                found.update(node.end)
        return found

    def _slow(self, key: bytes) -> set:
        return {
            client
            for client, held in self._client_patterns.items()
            if any(matches(pattern, key) for pattern in held)
        }

    # -- internals ---------------------------------------------------------

    def _invalidate(self, pattern: bytes) -> None:
        cache = self._cache
        if not cache:
            return
        if not pattern or len(cache) > _SELECTIVE_INVALIDATION:
            cache.clear()
            return
        for key in [k for k in cache if matches(pattern, k)]:
            del cache[key]

    def _trie_add(self, client, pattern: bytes) -> None:
        """Called for a client's first instance of `pattern`."""
        if not pattern:
            self._all[client] = 1
            return
        compiled = _compile(pattern)
        if compiled is None:
            return
        steps, tail = compiled
        node = self._root
        for is_star, seg in steps:
            if is_star:
                table = node.star
                if table is None:
                    table = node.star = {}
            else:
                table = node.literal
                if table is None:
                    table = node.literal = {}
            child = table.get(seg)
            if child is None:
                child = table[seg] = _Node()
            node = child
        if tail:
            node.tail += (client,)
        else:
            node.end += (client,)

    def _trie_remove(self, client, pattern: bytes) -> None:
        """Called when a client's last instance of `pattern` goes."""
        if not pattern:
            del self._all[client]
            return
        compiled = _compile(pattern)
        if compiled is None:
            return
        steps, tail = compiled
        node = self._root
        path = []
        for is_star, seg in steps:
            table = node.star if is_star else node.literal
            path.append((table, seg))
            node = table[seg]
        if tail:
            node.tail = tuple(c for c in node.tail if c is not client)
        else:
            node.end = tuple(c for c in node.end if c is not client)
        for table, seg in reversed(path):
            if not table[seg].empty():
                break
            del table[seg]
