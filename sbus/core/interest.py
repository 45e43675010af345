"""Which patterns a bus's clients hold, as a watcher may see them (sans-I/O).

A service that brings messages onto a bus from elsewhere (``twistd sbus-nats``)
should ask its source only for what local clients want, as a relay subscribes
upward only to what its own clients hold. A client cannot see other clients'
subscriptions, so the server tells a watcher (``CMSG server/interest``,
docs/protocol.md "Server notices"): ``+\\0PATTERN`` when a pattern becomes held,
``-\\0PATTERN`` when the last holder lets go, ``=`` once the first listing is
complete.

Scope: a watcher sees the patterns of every client if it is privileged (root
or the server's own user, as for ``server/stats``), else those of clients of
its own uid. Its own subscriptions never count, so a service that also
exports does not ask for what it subscribes to itself.

Changes are coalesced per watcher: the table marks patterns dirty and the
shell sends the differences when the watcher's socket has room. A watcher
that does not read pins at most one pending entry per distinct pattern, never
a queue that grows with the number of SUB/UNSUB another client sends.
"""

from __future__ import annotations

__all__ = ["InterestTable", "HELD", "RELEASED", "LISTED"]

HELD = b"+\0"
RELEASED = b"-\0"
#: The first listing is complete (sent once, after the snapshot).
LISTED = b"="


class _Watcher:
    __slots__ = ("client", "uid", "everything", "told", "dirty", "listed")

    def __init__(self, client, uid: int, everything: bool):
        self.client = client
        self.uid = uid
        self.everything = everything
        #: the patterns it has been told are held
        self.told: set[bytes] = set()
        #: patterns whose state may differ from what it was told (a dict: ordered, no duplicates)
        self.dirty: dict[bytes, None] = {}
        self.listed = False


class InterestTable:
    """Holds per pattern and uid, each client's holds, and what each watcher has been told.

    `held` and `released` are called once per client and pattern (when the client's first
    instance of the pattern comes, and when its last goes), `forget` when a client leaves; each
    returns the watchers whose view may have changed, for the shell to bring up to date with
    `changes`. Build the table before the first `watch` by calling `held` for every hold.
    """

    def __init__(self):
        self._holds: dict[bytes, dict[int, int]] = {}  # pattern -> uid -> clients holding it
        self._total: dict[bytes, int] = {}  # pattern -> clients holding it
        self._by_client: dict[object, tuple[int, set[bytes]]] = {}  # client -> (uid, patterns)
        self._watchers: dict[object, _Watcher] = {}

    def __len__(self) -> int:
        """How many watchers."""
        return len(self._watchers)

    def holds(self) -> int:
        """How many (holder, pattern) holds it has (the simulator bounds what one turn adds)."""
        return sum(len(mine) for _, mine in self._by_client.values())

    def watching(self, client) -> bool:
        return client in self._watchers

    def watch(self, client, uid: int, everything: bool) -> None:
        """Start telling `client`: everything it may see now is listed first, then `LISTED`."""
        w = self._watchers[client] = _Watcher(client, uid, everything)
        if everything:
            w.dirty = dict.fromkeys(self._total)
        else:
            w.dirty = {p: None for p, by_uid in self._holds.items() if uid in by_uid}

    def unwatch(self, client) -> None:
        self._watchers.pop(client, None)

    def held(self, client, uid: int, pattern: bytes) -> list:
        entry = self._by_client.get(client)
        if entry is None:
            entry = self._by_client[client] = (uid, set())
        if pattern in entry[1]:
            return []
        entry[1].add(pattern)
        by_uid = self._holds.get(pattern)
        if by_uid is None:
            by_uid = self._holds[pattern] = {}
        by_uid[uid] = by_uid.get(uid, 0) + 1
        self._total[pattern] = self._total.get(pattern, 0) + 1
        return self._touch(uid, pattern)

    def released(self, client, pattern: bytes) -> list:
        entry = self._by_client.get(client)
        if entry is None or pattern not in entry[1]:
            return []
        uid, mine = entry
        mine.discard(pattern)
        if not mine:
            del self._by_client[client]
        self._drop(uid, pattern)
        return self._touch(uid, pattern)

    def forget(self, client) -> list:
        """`client` is gone: release everything it held and stop telling it."""
        self._watchers.pop(client, None)
        entry = self._by_client.pop(client, None)
        if entry is None:
            return []
        uid, mine = entry
        touched = {}
        for pattern in mine:
            self._drop(uid, pattern)
            touched.update(dict.fromkeys(self._touch(uid, pattern)))
        return list(touched)

    def changes(self, client):
        """Yield the payloads that bring `client` up to date, one at a time. Each is taken as
        told when yielded: the shell may stop when the socket is full and ask again later."""
        w = self._watchers.get(client)
        if w is None:
            return
        dirty, told = w.dirty, w.told
        while dirty:
            # popitem: O(1). Taking from the front (next(iter(dirty))) scans the slots of every
            # key deleted before, which a dict keeps: quadratic over a listing, and O(patterns
            # ever listed) for each later change (issue 20, faults 4 and 8).
            pattern = dirty.popitem()[0]
            if not dirty:
                dirty = w.dirty = {}  # let the emptied table's slots go
            now = self._visible(w, pattern)
            if now == (pattern in told):
                continue
            if now:
                told.add(pattern)
                yield HELD + pattern
            else:
                told.discard(pattern)
                yield RELEASED + pattern
        if not w.listed:
            w.listed = True
            yield LISTED

    def pending(self, client) -> bool:
        """Whether `client` has changes not yet taken by `changes`."""
        w = self._watchers.get(client)
        return w is not None and (bool(w.dirty) or not w.listed)

    # -- inside

    def _drop(self, uid: int, pattern: bytes) -> None:
        by_uid = self._holds[pattern]
        n = by_uid[uid] - 1
        if n:
            by_uid[uid] = n
        else:
            del by_uid[uid]
        total = self._total[pattern] - 1
        if total:
            self._total[pattern] = total
        else:
            del self._total[pattern]
            del self._holds[pattern]

    def _visible(self, w: _Watcher, pattern: bytes) -> bool:
        if w.everything:
            n = self._total.get(pattern, 0)
        else:
            by_uid = self._holds.get(pattern)
            n = by_uid.get(w.uid, 0) if by_uid else 0
        entry = self._by_client.get(w.client)
        if entry is not None and pattern in entry[1]:
            n -= 1  # its own hold never counts for it
        return n > 0

    def _touch(self, uid: int, pattern: bytes) -> list:
        touched = []
        for c, w in self._watchers.items():
            if w.everything or w.uid == uid:
                w.dirty[pattern] = None
                touched.append(c)
        return touched
