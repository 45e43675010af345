"""Subscription trie and match cache: who gets a message with a given key.

The trie makes the cost of a match depend on the patterns that can match,
not on how many subscriptions exist; the cache makes repeated keys (the
common case on a bus) one dict lookup. Its answers are exactly those of the
reference matcher `patterns.matches`, for every key (a '*' in a key is an
ordinary byte), with the reserved keys' rule of `patterns.reaches` (a key
under ``sbus/topology/`` only reaches patterns that start with ``sbus/``), plus the secrecy rule of docs/protocol.md "Credentials and secret keys", which the router enforces
itself so no pattern can leak a secret key.

How the reference matcher decomposes (see `patterns.matches`): a '*' never
crosses a '/', so pattern segment i is always compared with key segment i.
Within a segment, equal bytes advance both sides first (so a pattern '*'
facing a key '*' is consumed as an equal byte); a pattern '*' facing any
other byte eats the rest of the key segment. Hence for a pattern segment
``P*R`` (P without '*') and a key segment S:

* S starts with P followed by '*': continue with R against the rest of S
  after that '*' (the two stars were equal bytes);
* S starts with P followed by another byte, or S is P and is not the key's
  last segment: the star eats the rest of S, and R must be empty or, if S is
  not the key's last segment, only stars (they eat nothing before '/');
* otherwise no match. A segment without '*' must equal S.

A trailing '/' on a pattern matches at least one more key segment, whatever
it holds (a "tail"); the empty pattern matches every key (the match-all
table).

So the trie has one step per piece of a pattern: a segment ``A*B*C`` is the
steps star A, star B, literal C, and then the next segment starts. A node
holds `literal` (remainder of a segment without '*' -> the node after that
segment), `star` (piece before a '*' -> the node just after that '*') and,
at segment boundaries, the clients whose pattern ends there (`end`) or ends
there with a '/' (`tail`). Compilation is injective: two distinct pattern
strings never share a holder entry (``x*/`` and ``x**/`` are different
paths), so removing one never touches another. Holders are dicts: adding and
removing one is O(1).

The cache is bounded by an estimate of its memory, not by a count of keys;
result tuples of any length worth sharing are shared between keys; a change
of pattern drops only the cached keys it can affect (found through an index
of cached keys by their first segment), never the whole cache unless the
pattern can match every key.
"""

from __future__ import annotations

from zope.interface import implementer

from sbus.interfaces import IRouter

from .credentials import SECRET_ROOT
from .patterns import SYSTEM, matches

#: Default memory bound of the match cache (estimated bytes).
DEFAULT_CACHE_BYTES = 16 << 20
#: Keys longer than this are routed every time, not cached: one such key
#: would take the room of hundreds of ordinary ones, and a walk of the trie
#: is linear in the key's length anyway.
CACHED_KEY_MAX = 4096
#: Estimated cost of one cache entry besides its key's bytes: the dict slot,
#: the key object's header, its slot in the first-segment index.
_ENTRY_COST = 160
#: Result tuples at least this long are shared between cache entries.
_SHARE_MIN = 3
#: On one change, test at most this many cached keys with the reference
#: matcher; larger affected groups are dropped without testing.
_TEST_MAX = 256
#: ... and at most this many bytes of them: the reference matcher is a
#: Python loop over the key's bytes, so 256 keys near `CACHED_KEY_MAX` that
#: share a long prefix with the pattern cost ~150 ms per SUB or UNSUB (a
#: one-client stall of the reactor). Keys past the budget are dropped untested.
_TEST_BYTES = 16 << 10
#: A change whose pattern starts with ``P*`` scans the index's groups for
#: those starting with P; with more groups than this it empties the cache.
_SCAN_GROUPS = 1024
#: Star tables larger than this are searched by piece length, not scanned.
_SCAN_MAX = 4


def _tuple_cost(n: int) -> int:
    return 56 + 8 * n


class _Node:
    """One trie node: a point in a pattern at the start of a segment or just after a '*'.

    Tables are created on first use: most nodes of a large subscription set
    are leaves with one holder."""

    __slots__ = ("literal", "star", "lens", "end", "tail")

    def __init__(self):
        self.literal: dict[bytes, _Node] | None = None  # rest of a segment, no '*' -> next segment
        self.star: dict[bytes, _Node] | None = None  # piece before a '*' -> after that '*'
        self.lens: dict[int, int] | None = None  # big star tables: piece length -> how many pieces
        self.end: tuple | dict | None = None  # clients whose pattern ends exactly here
        self.tail: tuple | dict | None = None  # clients whose pattern ends here with '/'

    def empty(self) -> bool:
        return not (self.literal or self.star or self.end or self.tail)


#: Holders of one pattern are a tuple while they are this few, then a dict: most patterns of a
#: large subscription set have one holder, and a 1-tuple is 48 bytes where a dict is 184 or more.
_FEW = 8


def _hold(holders, client):
    """`holders` (None, a tuple or a dict) with `client` added; the client is not in it yet."""
    if holders is None:
        return (client,)
    if type(holders) is tuple:
        if len(holders) < _FEW:
            return holders + (client,)
        holders = dict.fromkeys(holders)
    holders[client] = None
    return holders


def _unhold(holders, client):
    """`holders` without `client` (which is in it); None once nobody is left."""
    if type(holders) is tuple:
        return tuple([c for c in holders if c != client]) or None
    del holders[client]
    return holders or None


def _compile(pattern: bytes) -> tuple[list[tuple[bool, bytes]], bool]:
    """(steps, tail) for a non-empty pattern. Steps are (is_star, piece); the
    mapping is injective, so distinct patterns end at distinct holders."""
    segs = pattern.split(b"/")
    tail = len(segs) > 1 and not segs[-1]
    if tail:
        segs.pop()
    steps = []
    for seg in segs:
        pieces = seg.split(b"*")
        for piece in pieces[:-1]:
            steps.append((True, piece))
        steps.append((False, pieces[-1]))
    return steps, tail


def _close(mid: _Node, final: bool, out: list) -> None:
    """A star just ate the rest of a key segment: the pattern segment may end
    here, or (not at the key's end) after more stars that eat nothing."""
    while True:
        lit = mid.literal
        if lit:
            node = lit.get(b"")
            if node is not None:
                out.append(node)
        if final:
            return
        star = mid.star
        if not star:
            return
        mid = star.get(b"")
        if mid is None:
            return


def _stars_before(node: _Node, s: bytes, final: bool, out: list) -> int:
    """The pieces before a '*' at `node` that key segment `s` (no '*' in it) continues: a piece
    that is a proper prefix of `s`, or all of it where the key goes on (a star also eats the empty
    rest of a segment, but not at the very end of the key). Returns lookups done."""
    star = node.star
    n = len(s)
    if len(star) <= _SCAN_MAX:
        for p, mid in star.items():
            if s.startswith(p) and (len(p) < n or not final):
                _close(mid, final, out)
        return len(star)
    lens = node.lens
    for m in lens:
        if m < n:
            mid = star.get(s[:m])
        elif m == n and not final:
            mid = star.get(s)
        else:
            continue
        if mid is not None:
            _close(mid, final, out)
    return len(lens)


@implementer(IRouter)
class Router:
    """Clients (opaque hashables) and their patterns; `match` finds recipients."""

    def __init__(self, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.cache_bytes = cache_bytes
        self._root = _Node()
        self._all: dict[object, None] = {}  # clients holding the empty pattern
        self._prefix: dict[object, bytes | None] = {}  # client -> secret prefix
        self._client_patterns: dict[object, dict[bytes, int]] = {}  # client -> pattern -> instances
        self._holders: dict[bytes, int] = {}  # pattern -> how many clients hold it
        self._count = 0
        self._cache: dict[bytes, tuple] = {}
        #: `cached(key)`: the cached answer for `key`, or None (the cache dict is never replaced).
        self.cached = self._cache.get
        self._groups: dict[bytes, set] = {}  # first segment of a cached key -> cached keys
        self._shared: dict[tuple, list] = {}  # result -> [the shared tuple, entries using it]
        self._cached = 0  # estimated bytes held by the cache
        #: trie nodes and table lookups of cache misses; lets tests check
        #: that non-matching subscriptions are not visited (not a timing test).
        self.visited = 0
        #: `match`'s cache hits, and every miss (`match`'s and `miss`'s): plain integers, an
        #: increment each, for `cache_stats` (the broker's own `cached` lookups it counts itself).
        self.hits = 0
        self.misses = 0
        self._own_misses = 0  # the misses of keys a caller looked up in `cached` itself (`miss`)

    # -- clients -----------------------------------------------------------

    def add_client(self, client, secret_prefix: bytes | None) -> None:
        """Register a client. `secret_prefix` is what a secret key must start
        with to reach it (None: no secret key ever). Re-adding an existing
        client replaces its prefix and keeps its patterns."""
        if client in self._prefix:
            if self._prefix[client] != secret_prefix:
                self._prefix[client] = secret_prefix
                self._invalidate(SECRET_ROOT)
            return
        self._prefix[client] = secret_prefix  # (its patterns' dict comes with its first SUB)

    def secret_prefix_of(self, client) -> bytes | None:
        """What a secret key must start with to reach `client` (None: none ever, or unknown)."""
        return self._prefix.get(client)

    def remove_client(self, client) -> list[bytes]:
        """Forget a client and every instance of every pattern it held;
        return the patterns nobody holds any more."""
        if client not in self._prefix:
            return []
        del self._prefix[client]
        held = self._client_patterns.pop(client, None) or {}
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
            self._invalidate(pattern)
        return gone

    # -- subscriptions -----------------------------------------------------

    def subscribe(self, client, pattern: bytes) -> bool:
        """Store one more instance; True if no client held `pattern` before.
        Raises KeyError for a client that was not added."""
        mine = self._client_patterns.get(client)
        if mine is None:
            if client not in self._prefix:
                raise KeyError(client)
            mine = self._client_patterns[client] = {}
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
        """Remove one instance of exactly `pattern`. None if the client did
        not hold it; else True if now no client holds `pattern`."""
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

    def holds(self, client, pattern: bytes) -> bool:
        """Whether `client` holds at least one instance of exactly `pattern`."""
        mine = self._client_patterns.get(client)
        return bool(mine) and pattern in mine

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

    @property
    def cache_used(self) -> int:
        """Estimated bytes the match cache holds (at most `cache_bytes`)."""
        return self._cached

    # -- matching ----------------------------------------------------------

    def match(self, key: bytes) -> tuple:
        """Every client with a matching pattern, once each, secrecy applied."""
        hit = self._cache.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        return self._miss(key)

    def miss(self, key: bytes) -> tuple:
        """`match` for a key `cached` did not know: the walk of the trie (the costly part, which
        the broker times and charges to the publisher's uid)."""
        self._own_misses += 1
        return self._miss(key)

    def cache_stats(self, looked_up: int) -> dict:
        """The match cache's hits and misses, for ``server/stats``. `looked_up`: the keys callers
        looked up in `cached` themselves (the broker's hot path, which cannot afford a call
        per message); those `miss` did not see were hits."""
        return {"hits": self.hits + looked_up - self._own_misses, "misses": self.misses,
                "bytes": self._cached, "limit_bytes": self.cache_bytes}

    def _miss(self, key: bytes) -> tuple:
        self.misses += 1
        found = self._walk(key)
        if found and key.startswith(SECRET_ROOT):
            prefix = self._prefix
            found = [c for c in found if prefix[c] is not None and key.startswith(prefix[c])]
        result = tuple(found)
        if len(key) <= CACHED_KEY_MAX:
            result = self._store(key, result)
        return result

    def _walk(self, key: bytes) -> set:
        segs = key.split(b"/")
        last = len(segs) - 1
        visited = 0
        starred = b"*" in key
        if key.startswith(SYSTEM):
            # Reserved: only patterns whose first segment is literally `sbus` (`patterns.reaches`).
            first = self._root.literal.get(segs[0]) if self._root.literal else None
            if first is None:
                return set()
            found = set()
            live = [first]
            start = 1
        else:
            found = set(self._all)
            live = [self._root]
            start = 0
        for i in range(start, last + 1):
            s = segs[i]
            visited += len(live)
            nxt: list[_Node] = []
            final = i == last
            if starred and b"*" in s:
                for node in live:
                    if node.tail:
                        found.update(node.tail)
                    visited += self._starred(node, s, final, nxt)
            else:
                for node in live:
                    if node.tail:
                        found.update(node.tail)
                    literal = node.literal
                    if literal:
                        child = literal.get(s)
                        if child is not None:
                            nxt.append(child)
                    if node.star:
                        visited += _stars_before(node, s, final, nxt)
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

    @staticmethod
    def _starred(node: _Node, s: bytes, final: bool, out: list) -> int:
        """Key segment `s` contains '*': the general case of the rules in the
        module docstring, one key '*' at a time. Returns lookups done."""
        visited = 0
        frontier = [node]
        while True:
            q = s.find(b"*")
            if q < 0:
                break
            head = s[:q]
            nxt = []
            for nd in frontier:
                star = nd.star
                if not star:
                    continue
                # pieces shorter than `head`: the star eats all of s; the
                # piece equal to `head`: the two stars are equal bytes
                lens = nd.lens if len(star) > _SCAN_MAX else {len(p): 1 for p in star}
                visited += len(lens)
                for m in lens:
                    if m < q:
                        mid = star.get(head[:m])
                        if mid is not None:
                            _close(mid, final, out)
                    elif m == q:
                        mid = star.get(head)
                        if mid is not None:
                            nxt.append(mid)
            if not nxt:
                return visited
            frontier = nxt
            s = s[q + 1:]
        # the rest of the segment has no '*': as in the walk
        for nd in frontier:
            visited += 1
            literal = nd.literal
            if literal:
                child = literal.get(s)
                if child is not None:
                    out.append(child)
            if nd.star:
                visited += _stars_before(nd, s, final, out)
        return visited

    # -- the cache ---------------------------------------------------------

    def _store(self, key: bytes, result: tuple) -> tuple:
        cost = _ENTRY_COST + len(key)
        if len(result) >= _SHARE_MIN:
            entry = self._shared.get(result)
            if entry is None:
                self._shared[result] = [result, 1]
                cost += _tuple_cost(len(result))
            else:
                result = entry[0]
                entry[1] += 1
        else:
            cost += _tuple_cost(len(result))
        if cost > self.cache_bytes:
            self._deref(result)
            return result
        self._cache[key] = result
        first = key.partition(b"/")[0]
        group = self._groups.get(first)
        if group is None:
            self._groups[first] = {key}
        else:
            group.add(key)
        self._cached += cost
        if self._cached > self.cache_bytes:
            self._evict()
        return result

    def _deref(self, result: tuple) -> int:
        """Release one use of `result`; return the bytes that frees."""
        n = len(result)
        if n < _SHARE_MIN:
            return _tuple_cost(n)
        entry = self._shared[result]
        entry[1] -= 1
        if entry[1]:
            return 0
        del self._shared[result]
        return _tuple_cost(n)

    def _drop(self, key: bytes) -> None:
        result = self._cache.pop(key)
        self._cached -= _ENTRY_COST + len(key) + self._deref(result)

    def _evict(self) -> None:
        """Over budget: drop the oldest entries until a quarter of the budget is free."""
        target = self.cache_bytes * 3 // 4
        excess = self._cached - target
        victims = []
        for key, result in self._cache.items():
            if excess <= 0:
                break
            victims.append(key)
            excess -= _ENTRY_COST + len(key) + (_tuple_cost(len(result)) if len(result) < _SHARE_MIN else 0)
        groups = self._groups
        for key in victims:
            self._drop(key)
            first = key.partition(b"/")[0]
            group = groups[first]
            group.discard(key)
            if not group:
                del groups[first]

    def clear_cache(self) -> None:
        self._cache.clear()
        self._groups.clear()
        self._shared.clear()
        self._cached = 0

    def _invalidate(self, pattern: bytes) -> None:
        """Drop the cached keys whose answer a change of `pattern` can alter."""
        if not self._cache:
            return
        first = pattern.split(b"/", 1)[0]
        star = first.find(b"*")
        groups = self._groups
        if star < 0:
            if not pattern:
                self.clear_cache()
                return
            # a segment without '*' matches only an equal key segment
            group = groups.get(first)
            affected = [first] if group else []
        else:
            head = first[:star]
            if not head:
                if len(self._cache) > _TEST_MAX:
                    self.clear_cache()
                    return
                affected = list(groups)
            elif len(groups) > _SCAN_GROUPS:
                self.clear_cache()
                return
            else:
                affected = [g for g in groups if g.startswith(head)]
        budget = _TEST_MAX
        room = _TEST_BYTES
        for name in affected:
            group = groups[name]
            if len(group) <= budget:
                budget -= len(group)
                doomed = []
                for k in group:
                    n = len(k)
                    if n <= room:
                        room -= n
                        if not matches(pattern, k):
                            continue
                    doomed.append(k)  # matches, or no room left to test it
            else:
                doomed = list(group)
            for key in doomed:
                self._drop(key)
                group.discard(key)
            if not group:
                del groups[name]

    # -- the trie ----------------------------------------------------------

    def _trie_add(self, client, pattern: bytes) -> None:
        """Called for a client's first instance of `pattern`."""
        if not pattern:
            self._all[client] = None
            return
        steps, tail = _compile(pattern)
        node = self._root
        for is_star, piece in steps:
            if is_star:
                table = node.star
                if table is None:
                    table = node.star = {}
                child = table.get(piece)
                if child is None:
                    child = table[piece] = _Node()
                    lens = node.lens
                    if lens is not None:
                        lens[len(piece)] = lens.get(len(piece), 0) + 1
                    elif len(table) > _SCAN_MAX:
                        lens = node.lens = {}
                        for p in table:
                            lens[len(p)] = lens.get(len(p), 0) + 1
            else:
                table = node.literal
                if table is None:
                    table = node.literal = {}
                child = table.get(piece)
                if child is None:
                    child = table[piece] = _Node()
            node = child
        if tail:
            node.tail = _hold(node.tail, client)
        else:
            node.end = _hold(node.end, client)

    def _trie_remove(self, client, pattern: bytes) -> None:
        """Called when a client's last instance of `pattern` goes."""
        if not pattern:
            del self._all[client]
            return
        steps, tail = _compile(pattern)
        node = self._root
        path = []
        for is_star, piece in steps:
            path.append((node, is_star, piece))
            node = (node.star if is_star else node.literal)[piece]
        if tail:
            node.tail = _unhold(node.tail, client)
        else:
            node.end = _unhold(node.end, client)
        for parent, is_star, piece in reversed(path):
            table = parent.star if is_star else parent.literal
            if not table[piece].empty():
                break
            del table[piece]
            if is_star:
                lens = parent.lens
                if lens is not None:
                    n = lens[len(piece)] - 1
                    if n:
                        lens[len(piece)] = n
                    else:
                        del lens[len(piece)]
                if not table:
                    parent.star = parent.lens = None
            elif not table:
                parent.literal = None
