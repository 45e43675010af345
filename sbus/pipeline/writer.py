"""The recorder's file writer: rows in, atomically published Parquet files out.

Plain Python and pyarrow, no Twisted: `sbus.services.record` runs it on a
worker thread, and the benchmark uses it directly to make large synthetic
recordings through the same code path.

Life of a file:

1. the first row opens ``DIR/_tmp/<name>.parquet.part`` (a `pq.ParquetWriter`);
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
"""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .schema import ARROW_SCHEMA, TMP_DIR, file_name, published_files

#: Bytes charged per row on top of key and payload (timestamps, seq, list slots).
ROW_OVERHEAD = 64

DEFAULT_ROLL_BYTES = 128 << 20
DEFAULT_ROLL_AGE = 60.0
DEFAULT_ROW_GROUP_BYTES = 32 << 20


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self.roll_bytes = roll_bytes
        self.roll_age = roll_age
        self.row_group_bytes = min(row_group_bytes, roll_bytes)
        self.retain_age = retain_age or None
        self.retain_bytes = retain_bytes or None
        self.compression = compression
        self.fsync = fsync
        self.clock = clock
        self.log = log or (lambda text: None)
        os.makedirs(self.tmp, exist_ok=True)
        #: Leftovers removed from _tmp/ (names).
        self.cleaned = self._clean_tmp()
        files = published_files(directory)
        #: The seq the next recorded message gets (continues the directory's numbering).
        self.next_seq = files[-1][1] + 1 if files else 1
        self.files_published = 0
        self.rows_published = 0
        self._reset_buffer()
        self._writer: pq.ParquetWriter | None = None
        self._tmp_path = None
        self._first_seq = self._last_seq = None
        self._opened_at = 0.0
        self._file_rows = 0
        self._file_size = 0

    # -- buffer

    def _reset_buffer(self):
        self._times: list[int] = []
        self._seqs: list[int] = []
        self._keys: list[bytes] = []
        self._payloads: list[bytes] = []
        self._buf_bytes = 0

    def _clean_tmp(self) -> list[str]:
        removed = []
        for entry in os.scandir(self.tmp):
            if entry.is_file() or entry.is_symlink():
                os.unlink(entry.path)
                removed.append(entry.name)
        return removed

    @property
    def pending_rows(self) -> int:
        """Rows accepted but not yet in a published file (lost if we crash now)."""
        return self._file_rows + len(self._seqs)

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
        payloads = pa.array(self._payloads, type=pa.binary())
        table = pa.Table.from_arrays(
            [
                pa.array(self._times, type=pa.timestamp("us", tz="UTC")),
                pa.array(self._keys, type=pa.binary()),
                payloads,
                pc.binary_length(payloads).cast(pa.int32()),
                pa.array(self._seqs, type=pa.int64()),
            ],
            schema=ARROW_SCHEMA,
        )
        if self._writer is None:
            self._tmp_path = os.path.join(self.tmp, f"rec-{self._first_seq:016d}.parquet.part")
            self._writer = pq.ParquetWriter(self._tmp_path, ARROW_SCHEMA, compression=self.compression)
        self._last_seq = self._seqs[-1]
        self._file_rows += len(self._seqs)
        self._writer.write_table(table, row_group_size=len(self._seqs))
        self._reset_buffer()
        self._file_size = os.path.getsize(self._tmp_path)

    def publish(self) -> str | None:
        """Write what is buffered, close, fsync and rename the current file; its path."""
        if self._first_seq is None:
            return None
        self._write_row_group()
        self._writer.close()
        if self.fsync:
            fd = os.open(self._tmp_path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        final = os.path.join(self.directory, file_name(self._first_seq, self._last_seq))
        os.rename(self._tmp_path, final)
        if self.fsync:
            fsync_dir(self.directory)
        size = os.path.getsize(final)
        rows = self._file_rows
        self.files_published += 1
        self.rows_published += rows
        self._writer = None
        self._tmp_path = None
        self._first_seq = self._last_seq = None
        self._file_rows = 0
        self._file_size = 0
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

    def abandon(self) -> None:
        """Drop the current file (after a write error): close and delete it."""
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:
                pass
        if self._tmp_path is not None:
            try:
                os.unlink(self._tmp_path)
            except OSError:
                pass
        self._writer = None
        self._tmp_path = None
        self._first_seq = self._last_seq = None
        self._file_rows = 0
        self._file_size = 0
        self._reset_buffer()
