"""The work-queue service's durable store (``twistd sbus-queue --store DIR``): one append-only
journal per group, ``DIR/GROUP.journal``.

**Format: a plain length-prefixed log**, not Arrow IPC as the recorder's journal: a record is
``LEN(4, big-endian) TYPE(1) ID(8)`` and, for an enqueue, ``KEYLEN(2) KEY PAYLOAD``. The
queue's records are tiny and of two shapes (a job in, a job done); they are read back only
at start, in order, and a torn last record (the process killed in the middle of a write) is
recognised by its length and cut off. Arrow would add a dependency and a schema for no
reader that needs columns.

* ``E`` (enqueue): a job the service took; ``D`` (done): acked, dead-lettered or dropped.
* Writes go to the kernel at once (`os.write` per batch of the reactor's turn, no user-space
  buffer), so a ``kill -9`` of the service loses nothing that was written; `sync` fsyncs
  (the service calls it before it confirms a job to a producer, and on a timer), as the
  recorder does for its files: after a power cut, what was not fsynced may be lost.
* At start, `load` replays each journal: the jobs with no ``D`` come back in their order,
  and the journal is rewritten with only those (to a temporary file, fsynced, renamed, the
  directory fsynced), so it does not grow across restarts. While running, a journal whose
  jobs are all done is truncated once it passes `COMPACT_BYTES`.
"""

from __future__ import annotations

import os
import struct

from sbus.pipeline.writer import DIR_MODE, FILE_MODE, fsync_dir

_HEAD = struct.Struct(">IcQ")   # length of what follows the 4 bytes, type, id
_KEYLEN = struct.Struct(">H")
#: A journal whose jobs are all done is emptied once it is larger than this.
COMPACT_BYTES = 64 << 20


class JournalError(Exception):
    """The store directory cannot be used (one line for the operator)."""


class GroupJournal:
    def __init__(self, path: str):
        self.path = path
        self.fd = -1
        self.size = 0
        self.live = 0
        self.next_id = 1
        self._pending: list[bytes] = []

    def load(self) -> list[tuple[int, bytes, bytes]]:
        """The jobs not done, in order; rewrites the journal with only them."""
        jobs: dict[int, tuple[bytes, bytes]] = {}
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            data = b""
        i, n = 0, len(data)
        while i + 4 <= n:
            (length,) = struct.unpack_from(">I", data, i)
            if length < 9 or i + 4 + length > n:
                break  # a torn last record: the process died while writing it
            _, kind, jid = _HEAD.unpack_from(data, i)
            if kind == b"E":
                (klen,) = _KEYLEN.unpack_from(data, i + 13)
                key = data[i + 15:i + 15 + klen]
                jobs[jid] = (key, data[i + 15 + klen:i + 4 + length])
            elif kind == b"D":
                jobs.pop(jid, None)
            self.next_id = max(self.next_id, jid + 1)
            i += 4 + length
        out = [(jid, k, p) for jid, (k, p) in jobs.items()]
        tmp = self.path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            body = b"".join(_enqueue(jid, k, p) for jid, k, p in out)
            _write_all(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        fsync_dir(os.path.dirname(self.path))
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self.size = len(body)
        self.live = len(out)
        return out

    def add(self, key: bytes, payload: bytes) -> int:
        jid = self.next_id
        self.next_id += 1
        self._pending.append(_enqueue(jid, key, payload))
        self.live += 1
        return jid

    def done(self, jid: int) -> None:
        self._pending.append(_HEAD.pack(9, b"D", jid))
        self.live -= 1

    def flush(self) -> None:
        if self._pending:
            body = b"".join(self._pending)
            self._pending.clear()
            _write_all(self.fd, body)
            self.size += len(body)
        if self.live == 0 and self.size > COMPACT_BYTES:
            os.ftruncate(self.fd, 0)
            self.size = 0

    def sync(self) -> None:
        self.flush()
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            self.flush()
            os.close(self.fd)
            self.fd = -1


class QueueStore:
    """The journals of a service's groups under one directory."""

    def __init__(self, directory: str):
        self.directory = directory
        try:
            os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
            probe = os.path.join(directory, ".probe")
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE))
            os.unlink(probe)
        except OSError as e:
            raise JournalError(f"--store {directory}: {e.strerror}") from None
        self.journals: dict[bytes, GroupJournal] = {}
        self.dirty: set[GroupJournal] = set()
        self.unsynced: set[GroupJournal] = set()

    def open(self, group: bytes) -> tuple[GroupJournal, list]:
        j = self.journals[group] = GroupJournal(os.path.join(self.directory, group.decode() + ".journal"))
        return j, j.load()

    def add(self, group: bytes, key: bytes, payload: bytes) -> int:
        j = self.journals[group]
        self.dirty.add(j)
        return j.add(key, payload)

    def done(self, group: bytes, jid: int) -> None:
        j = self.journals[group]
        self.dirty.add(j)
        j.done(jid)

    def flush(self, sync: bool = False) -> None:
        """Write what this turn added (to the kernel); `sync`: and fsync it."""
        dirty, self.dirty = self.dirty, set()
        for j in dirty:
            j.flush()
        self.unsynced |= dirty
        if sync:
            unsynced, self.unsynced = self.unsynced, set()
            for j in unsynced:
                os.fsync(j.fd)

    def close(self) -> None:
        for j in self.journals.values():
            j.close()


def _enqueue(jid: int, key: bytes, payload: bytes) -> bytes:
    return _HEAD.pack(9 + 2 + len(key) + len(payload), b"E", jid) + _KEYLEN.pack(len(key)) + key + payload


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
