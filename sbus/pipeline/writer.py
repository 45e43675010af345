"""The recorder's file writer: rows in, atomically published Parquet files out.

Plain Python and pyarrow, no Twisted: `sbus.services.record` runs it on a
worker thread, and the benchmark uses it directly to make large synthetic
recordings through the same code path.

Life of a file:

1. the first row opens ``DIR/_tmp/<name>.parquet.part`` (a `pq.ParquetWriter`),
   created with ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600, relative to a
   descriptor of ``_tmp/`` itself opened with ``O_NOFOLLOW``: a symlink
   planted in ``DIR`` or ``_tmp/`` is never followed, nothing existing is
   overwritten;
2. rows are buffered in memory and written as one row group whenever the
   buffer reaches ``row_group_bytes`` (one ``write_table`` = one row group);
3. when the file reaches ``roll_bytes`` on disk (plus what is buffered) or
   ``roll_age`` seconds after its first row, the rest is written, the file is
   closed, fsynced, renamed to ``DIR/rec-FIRST-LAST.parquet`` and the
   directory is fsynced. Only then does anything read it.

A crash loses the rows of the file being written (at most ``roll_age``
seconds or ``roll_bytes`` of traffic) plus what is still queued for the
writer; published files are complete. ``_tmp/`` is emptied when a writer
starts, so a truncated file left there by a crash is never read.

Directories the writer creates are 0700, files 0600 (whatever the umask):
a recording can hold anything the bus carried, secret keys included.

Rows are ``(recv_time_us, seq, key, payload)`` for messages (`extend`), and
*drop rows* (`add_drop`) that mark where messages were lost: column
``dropped`` = how many, ``key``/``payload`` = first/last lost key.
"""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .schema import (  # noqa: F401  (constants re-exported)
    DEFAULT_ROLL_AGE,
    DEFAULT_ROLL_BYTES,
    DEFAULT_ROW_GROUP_BYTES,
    ROW_OVERHEAD,
    TMP_DIR,
    arrow_schema,
    file_name,
    published_files,
)

DIR_MODE, FILE_MODE = 0o700, 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_private(path: str) -> None:
    """`os.makedirs` where every directory created (parents too) is 0700."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(os.path.abspath(path))
    if parent != path:
        makedirs_private(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):
            raise


def private_dir(path: str) -> int:
    """Create `path` (and parents) 0700 if missing; open it without following a final
    symlink. A ``_tmp`` that is a symlink or not ours is refused (OSError)."""
    if not os.path.islink(path):
        makedirs_private(path)
    fd = os.open(path, _DIR_FLAGS | os.O_NOFOLLOW)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(1, f"{path} belongs to uid {st.st_uid}, not to us: refusing to write in it", path)
    return fd


def create_private(name: str, dir_fd: int) -> int:
    """Open a new file `name` in `dir_fd`, 0600, never following or reusing what is there.

    A leftover of that name (a crash, or a planted symlink) is unlinked (the link
    itself, never its target) and the creation retried once."""
    try:
        return os.open(name, _CREATE_FLAGS, FILE_MODE, dir_fd=dir_fd)
    except FileExistsError:
        os.unlink(name, dir_fd=dir_fd)
        return os.open(name, _CREATE_FLAGS, FILE_MODE, dir_fd=dir_fd)


class RecordingWriter:
    """Writes rows ``(recv_time_us, seq, key, payload)`` to a recording directory.

    Not thread-safe: one thread owns it. `log(text)` receives one line per
    published or deleted file.
    """

    def __init__(
        self,
        directory: str,
        *,
        roll_bytes: int = DEFAULT_ROLL_BYTES,
        roll_age: float = DEFAULT_ROLL_AGE,
        row_group_bytes: int = DEFAULT_ROW_GROUP_BYTES,
        retain_age: float | None = None,
        retain_bytes: int | None = None,
        compression: str = "snappy",
        fsync: bool = True,
        clock=time.monotonic,
        log=None,
    ):
        self.directory = directory
        self.tmp = os.path.join(directory, TMP_DIR)
        makedirs_private(directory)
        self._dir_fd = os.open(directory, _DIR_FLAGS)
        self._tmp_fd = private_dir(self.tmp)
        self.roll_bytes = roll_bytes
        self.roll_age = roll_age
        self.row_group_bytes = min(row_group_bytes, roll_bytes)
        self.retain_age = retain_age or None
        self.retain_bytes = retain_bytes or None
        self.compression = compression
        self.fsync = fsync
        self.clock = clock
        self.log = log or (lambda text: None)
        #: Leftovers removed from _tmp/ (names).
        self.cleaned = self._clean_tmp()
        files = published_files(directory)
        #: The seq the next recorded message gets (continues the directory's numbering).
        self.next_seq = files[-1][1] + 1 if files else 1
        self.files_published = 0
        self.rows_published = 0
        self._reset_buffer()
        self._writer: pq.ParquetWriter | None = None
        self._file = None
        self._tmp_path = None
        self._first_seq = self._last_seq = None
        self._opened_at = 0.0
        self._file_rows = 0
        self._file_size = 0
        self._file_drop_rows = self._file_dropped = 0

    # -- buffer

    def _reset_buffer(self):
        self._times: list[int] = []
        self._seqs: list[int] = []
        self._keys: list[bytes] = []
        self._payloads: list[bytes] = []
        self._drops: list[tuple[int, int]] = []  # (index in the buffer, count)
        self._buf_bytes = 0

    def _clean_tmp(self) -> list[str]:
        removed = []
        for entry in os.scandir(self._tmp_fd):
            if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                os.unlink(entry.name, dir_fd=self._tmp_fd)  # a symlink: the link, not its target
                removed.append(entry.name)
        return removed

    def __del__(self):
        for fd in (getattr(self, "_tmp_fd", None), getattr(self, "_dir_fd", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    @property
    def pending_rows(self) -> int:
        """Rows accepted but not yet in a published file (lost if we crash now)."""
        return self._file_rows + len(self._seqs)

    def last_taken_seq(self) -> int | None:
        """The seq of the last row `extend` took (buffered or in the file), None if none."""
        return self._seqs[-1] if self._seqs else self._last_seq

    def add_drop(self, recv_us: int, seq: int, count: int, first: bytes = b"", last: bytes = b"") -> None:
        """A drop row: `count` messages were lost at this point (first and last key if known)."""
        self._drops.append((len(self._seqs), count))
        self.extend(((recv_us, seq, first, last),))

    def append(self, recv_us: int, seq: int, key: bytes, payload: bytes) -> None:
        self.extend(((recv_us, seq, key, payload),))

    def extend(self, rows) -> None:
        """Add rows (iterable of ``(recv_time_us, seq, key, payload)``), in seq order."""
        times, seqs, keys, payloads = self._times, self._seqs, self._keys, self._payloads
        nbytes = self._buf_bytes
        for t, s, k, p in rows:
            if self._first_seq is None:
                self._first_seq = s
                self._opened_at = self.clock()
            times.append(t)
            seqs.append(s)
            keys.append(k)
            payloads.append(p)
            nbytes += len(k) + len(p) + ROW_OVERHEAD
            if nbytes >= self.row_group_bytes:
                self._buf_bytes = nbytes
                self._write_row_group()
                times, seqs, keys, payloads = self._times, self._seqs, self._keys, self._payloads
                nbytes = 0
                if self._file_size >= self.roll_bytes:
                    self.publish()
        self._buf_bytes = nbytes
        if self._seqs and self._file_size + nbytes >= self.roll_bytes:
            self.publish()

    def tick(self) -> None:
        """Publish the current file if it is older than ``roll_age``; call often."""
        if self._first_seq is not None and self.clock() - self._opened_at >= self.roll_age:
            self.publish()

    def seconds_to_roll(self) -> float | None:
        if self._first_seq is None:
            return None
        return max(0.0, self.roll_age - (self.clock() - self._opened_at))

    # -- files

    def _write_row_group(self) -> None:
        if not self._seqs:
            return
        n = len(self._seqs)
        payloads = pa.array(self._payloads, type=pa.binary())
        sizes = pc.binary_length(payloads).cast(pa.int32())
        dropped = [0] * n
        if self._drops:
            for i, count in self._drops:
                dropped[i] = count
            sizes = pa.array([0 if d else s for s, d in zip(sizes.to_pylist(), dropped)], type=pa.int32())
        schema = arrow_schema()
        table = pa.Table.from_arrays(
            [
                pa.array(self._times, type=pa.timestamp("us", tz="UTC")),
                pa.array(self._keys, type=pa.binary()),
                payloads,
                sizes,
                pa.array(self._seqs, type=pa.int64()),
                pa.array(dropped, type=pa.int64()),
            ],
            schema=schema,
        )
        if self._writer is None:
            name = f"rec-{self._first_seq:016d}.parquet.part"
            self._tmp_path = os.path.join(self.tmp, name)
            fd = create_private(name, self._tmp_fd)
            self._file = open(fd, "wb", buffering=0, closefd=True)
            self._writer = pq.ParquetWriter(self._file, schema, compression=self.compression)
        self._last_seq = self._seqs[-1]
        self._writer.write_table(table, row_group_size=n)
        self._file_rows += n  # after the write: if it fails, abandon() counts these rows once (buffered)
        self._file_drop_rows += len(self._drops)
        self._file_dropped += sum(c for _, c in self._drops)
        self._reset_buffer()
        self._file_size = os.fstat(self._file.fileno()).st_size

    def publish(self) -> str | None:
        """Write what is buffered, close, fsync and rename the current file; its path."""
        if self._first_seq is None:
            return None
        self._write_row_group()
        self._writer.close()
        f = self._file
        if self.fsync:
            os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
        f.close()
        name = file_name(self._first_seq, self._last_seq)
        final = os.path.join(self.directory, name)
        os.rename(os.path.basename(self._tmp_path), name, src_dir_fd=self._tmp_fd, dst_dir_fd=self._dir_fd)
        if self.fsync:
            os.fsync(self._dir_fd)
        rows = self._file_rows
        self.files_published += 1
        self.rows_published += rows
        self._clear_file()
        self.log(f"published {os.path.basename(final)}: {rows} messages, {size} bytes")
        self.apply_retention()
        return final

    def apply_retention(self, now: float | None = None) -> list[str]:
        """Delete the oldest published files beyond ``retain_age`` / ``retain_bytes``.

        The newest file is always kept: it carries the numbering forward.
        """
        if self.retain_age is None and self.retain_bytes is None:
            return []
        now = time.time() if now is None else now
        files = []
        for first, last, path in published_files(self.directory):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            files.append((path, st.st_size, st.st_mtime))
        total = sum(f[1] for f in files)
        deleted = []
        for path, size, mtime in files[:-1]:
            too_big = self.retain_bytes is not None and total > self.retain_bytes
            too_old = self.retain_age is not None and mtime < now - self.retain_age
            if not (too_big or too_old):
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            total -= size
            deleted.append(path)
        if deleted:
            if self.fsync:
                fsync_dir(self.directory)
            self.log(f"retention: deleted {len(deleted)} file(s), {total} bytes kept")
        return deleted

    def close(self) -> str | None:
        """Publish the current file (if any)."""
        return self.publish()

    def _clear_file(self) -> None:
        self._writer = None
        self._file = None
        self._tmp_path = None
        self._first_seq = self._last_seq = None
        self._file_rows = 0
        self._file_size = 0
        self._file_drop_rows = self._file_dropped = 0

    def abandon(self) -> tuple[int | None, int]:
        """Drop the current file (after a write error): close and delete it.

        Returns (first seq, messages lost): the rows of the file and the
        buffer, plus what the drop rows among them counted."""
        first = self._first_seq
        messages = self._file_rows - self._file_drop_rows + len(self._seqs) - len(self._drops)
        lost = messages + self._file_dropped + sum(c for _, c in self._drops)
        #: Of `lost`, the messages themselves (the rest was counted by the drop rows discarded with them).
        self.abandoned_messages = messages
        for closer in (self._writer, self._file):
            if closer is not None:
                try:
                    closer.close()
                except Exception:
                    pass
        if self._tmp_path is not None:
            try:
                os.unlink(os.path.basename(self._tmp_path), dir_fd=self._tmp_fd)
            except OSError:
                pass
        self._clear_file()
        self._reset_buffer()
        return first, lost
