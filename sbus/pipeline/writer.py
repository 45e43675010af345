"""The recorder's file writer: rows in, atomically published Parquet files out.

Plain Python and pyarrow, no Twisted: `sbus.services.record` runs it on a
worker thread, and the benchmark uses it directly to make large synthetic
recordings through the same code path.

Life of a file:

1. the first row opens the file's **journal**, ``DIR/_tmp/rec-<first seq>.arrows``
   (an Arrow IPC stream), and ``DIR/_tmp/rec-<first seq>.parquet.part`` (a
   `pq.ParquetWriter`), both created with ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode
   0600, relative to a descriptor of ``_tmp/`` itself opened with
   ``O_NOFOLLOW``: a symlink planted in ``DIR`` or ``_tmp/`` is never
   followed, nothing existing is overwritten;
2. every batch of rows the writer takes (`extend`) goes to the journal at
   once, as one IPC record batch flushed to the kernel before `extend`
   returns, and is kept in memory until ``row_group_bytes`` are buffered,
   which become one Parquet row group;
3. when the file reaches ``roll_bytes`` on disk (plus what is buffered) or
   ``roll_age`` seconds after its first row, the rest is written, the
   Parquet file is closed, fsynced, renamed to ``DIR/rec-FIRST-LAST.parquet``,
   the directory is fsynced, and the journal is deleted. Only then does
   anything read it.

**Why a journal.** A Parquet file is unreadable until it is closed: its
index (the footer, with every row group's offsets) is written last, so the
``.part`` file a crash leaves behind cannot be read. An Arrow IPC stream
is readable up to its last whole record batch. So a writer that starts
after a crash (``kill -9``, OOM, power cut: the kernel had the journal's
writes) **recovers** the whole batches of each leftover journal as a
published file, and says so (`Recovery`); what it cannot recover is what
was still queued for the writer in the dead process (and, after a power
cut, what the kernel had not yet put on disk: the journal is not fsynced
per batch). A file marker ``_tmp/running`` (the writer's pid) exists while
a writer runs; finding it (or a leftover) at start means the last run did
not stop cleanly: `Recovery.unclean`, and the recorder marks that hole
with a *gap row* (below). ``_tmp/`` is emptied when a writer starts.

Directories the writer creates are 0700, files 0600 (whatever the umask):
a recording can hold anything the bus carried, secret keys included.

**Why buffered files.** pyarrow writes to a Python file object and ignores
the count its ``write`` returns. A raw (unbuffered) file on a disk that is
filling takes part of a write and returns the part taken; pyarrow would go
on as if all of it were written, and publish a file with a hole in its
footer. A `io.BufferedWriter` writes the rest or raises, so a full disk is
always an error the recorder sees (and counts), never a broken file.

Rows are ``(recv_time_us, seq, key, payload)`` for messages (`extend`), and
*drop rows* (`add_drop`) that mark where messages were lost: column
``dropped`` = how many, ``key``/``payload`` = first/last lost key; a *gap
row* (``dropped`` = `GAP`, -1) marks an unknown number lost (a crash), its
``payload`` a JSON description (see `gap_payload`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .schema import (  # noqa: F401  (constants re-exported)
    DEFAULT_ROLL_AGE,
    DEFAULT_ROLL_BYTES,
    DEFAULT_ROW_GROUP_BYTES,
    GAP,
    JOURNAL_SUFFIX,
    ROW_OVERHEAD,
    TMP_DIR,
    arrow_schema,
    file_name,
    named_seq,
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


#: While a writer runs, ``_tmp/`` holds this marker (its pid); a clean close removes it.
MARKER = "running"
PART_SUFFIX = ".parquet.part"
RECOVERING_SUFFIX = ".parquet.recovering"


@dataclass
class Recovery:
    """What a writer found in ``_tmp/`` when it started."""

    #: The last writer did not stop cleanly (its marker or unpublished files were left).
    unclean: bool = False
    #: (leftover name, rows recovered, published file name)
    recovered: list = field(default_factory=list)
    #: (leftover name, why it was removed)
    removed: list = field(default_factory=list)


def gap_payload(after_seq: int, after_us: int | None, restart_us: int, recovered: int) -> bytes:
    """The JSON description a gap row carries (its ``payload``)."""
    def iso(us):
        if us is None:
            return None
        import datetime as dt
        return dt.datetime.fromtimestamp(us / 1e6, dt.timezone.utc).isoformat(timespec="microseconds")

    return json.dumps({"gap": "the recorder stopped without publishing (crash or kill -9)",
                       "after_seq": after_seq, "from": iso(after_us), "to": iso(restart_us),
                       "lost": None, "recovered": recovered}).encode()


def parse_gap(payload: bytes) -> dict:
    """A gap row's description (`gap_payload`), or {} when it is not one."""
    try:
        d = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return {}
    return d if isinstance(d, dict) else {}


def read_journal(fd: int, name: str) -> tuple[object | None, str]:
    """The whole record batches of a journal as a table (None if none), and what ended it."""
    f = open(fd, "rb", closefd=True)
    batches = []
    why = "complete"
    try:
        reader = pa.ipc.open_stream(f)
        if not reader.schema.equals(arrow_schema(), check_metadata=False):
            return None, "not a journal of this recorder (another schema)"
        while True:
            try:
                batches.append(reader.read_next_batch())
            except StopIteration:
                break
            except (pa.ArrowInvalid, OSError, EOFError) as e:
                why = f"cut short ({str(e).splitlines()[0][:100]}): the rest was being written"
                break
    except (pa.ArrowInvalid, OSError, EOFError) as e:
        return None, f"unreadable ({str(e).splitlines()[0][:100]})"
    finally:
        f.close()
    if not batches:
        return None, "no whole batch in it"
    return pa.Table.from_batches(batches, schema=arrow_schema()), why


class RecordingWriter:
    """Writes rows ``(recv_time_us, seq, key, payload)`` to a recording directory.

    Not thread-safe: one thread owns it. `log(text)` receives one line per
    published or deleted file. `recovery` says what the start found in ``_tmp/``.
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
        recover_later: bool = False,
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
        self._clear_file()
        self._reset_buffer()
        self.files_published = 0
        self.rows_published = 0
        #: What was found in _tmp/: recovered leftovers, removed ones, whether the last run crashed
        #: (`unclean` at once; the rest once `recover` has run).
        self.recovery = Recovery()
        files = published_files(directory)
        self._published_at_start = [(first, last) for first, last, _ in files]
        self._leftovers = self._scan_tmp()
        self.cleaned = [name for name, _ in self.recovery.removed]
        #: The seq the next recorded message gets (continues the directory's numbering, after the
        #: whole batches of the journals a crash left, recovered or not yet).
        self.next_seq = max(files[-1][1] if files else 0, self._journal_tail[0]) + 1
        fd = create_private(MARKER, self._tmp_fd)
        with open(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        if not recover_later:
            self.recover()

    def recover(self) -> Recovery:
        """Publish the whole batches of each leftover journal found at start, remove the other
        leftovers; `recovery` says what was done. Safe on another thread while this writer
        records (it touches only the leftovers, and new files have higher seqs)."""
        self._recover_tmp(self._leftovers)
        #: Names of the leftovers removed from _tmp/ (kept for callers of the old interface).
        self.cleaned = [name for name, _ in self.recovery.removed]
        return self.recovery

    def _scan_tmp(self) -> list[str]:
        """The leftovers in ``_tmp/`` (the marker aside), whether the last run stopped uncleanly,
        and from the journals' whole batches (memory-mapped: their headers only are parsed, so
        it is quick whatever their size): the newest (seq, recv_time) and how many rows they
        hold that no published file holds."""
        names = sorted(e.name for e in os.scandir(self._tmp_fd)
                       if e.is_file(follow_symlinks=False) or e.is_symlink())
        self.recovery.unclean = any(n == MARKER or n.endswith((JOURNAL_SUFFIX, PART_SUFFIX)) for n in names)
        self._journal_tail = (0, None)
        self._journal_rows = 0
        for name in names:
            if not name.endswith(JOURNAL_SUFFIX) or os.path.islink(os.path.join(self.tmp, name)):
                continue
            try:
                source = pa.memory_map(os.path.join(self.tmp, name))
                reader = pa.ipc.open_stream(source)
                if not reader.schema.equals(arrow_schema(), check_metadata=False):
                    continue
            except (pa.ArrowInvalid, OSError, EOFError):
                continue
            while True:
                try:
                    b = reader.read_next_batch()
                except (StopIteration, pa.ArrowInvalid, OSError, EOFError):
                    break
                if not b.num_rows:
                    continue
                seq = b.column(4)
                self._journal_rows += len(seq) - int(pc.sum(self._published_mask(seq)).as_py() or 0)
                last = seq[-1].as_py()
                if last > self._journal_tail[0]:
                    self._journal_tail = (last, b.column(0).cast(pa.int64())[-1].as_py())
        names = [n for n in names if n != MARKER]
        # The seq this writer starts from: a journal named at or past it holds no whole batch
        # (its seqs would be below), and this writer's first files may take its name, which the
        # recovery beside it must then not read as a leftover (it published and removed the new
        # run's first rows: seq 3001 twice, CI). It goes now, with its .part.
        start = max([hi for _, hi in self._published_at_start] + [self._journal_tail[0]]) + 1
        # (a journal of another name counts as below: no clash with ours)
        stems = {n[:-len(JOURNAL_SUFFIX)] for n in names
                 if n.endswith(JOURNAL_SUFFIX) and (named_seq(n, JOURNAL_SUFFIX) is None
                                                    or named_seq(n, JOURNAL_SUFFIX) < start)}
        later = [n for n in names if (n.endswith(JOURNAL_SUFFIX) and n[:-len(JOURNAL_SUFFIX)] in stems)
                 or (n.endswith(PART_SUFFIX) and n[:-len(PART_SUFFIX)] in stems)]
        # the rest goes now (a quick unlink each): a leftover .part without its journal may bear
        # the name this writer's first file takes; a later journal's seqs are all below ours
        self._recover_tmp([n for n in names if n not in later])
        return later

    def _published_mask(self, seqs):
        """True where a seq is in a file that was published when this writer started."""
        mask = pc.less(seqs, 0)
        lo, hi = pc.min(seqs).as_py(), pc.max(seqs).as_py()
        for first, last in self._published_at_start:
            if last >= lo and first <= hi:
                mask = pc.or_(mask, pc.and_(pc.greater_equal(seqs, first), pc.less_equal(seqs, last)))
        return mask

    # -- buffer

    def _reset_buffer(self):
        self._batches: list = []
        self._buf_rows = 0
        self._buf_drop_rows = self._buf_dropped = 0
        self._buf_bytes = 0

    def _recover_tmp(self, names: list[str]) -> Recovery:
        """Publish the whole batches of each leftover journal; remove everything else."""
        rec = self.recovery
        journals = {n[:-len(JOURNAL_SUFFIX)] for n in names if n.endswith(JOURNAL_SUFFIX)}
        for name in names:
            if os.path.islink(os.path.join(self.tmp, name)):
                why = "a symlink (removed the link, not its target)"
            elif name.endswith(JOURNAL_SUFFIX):
                rec.unclean = True
                why = self._recover_journal(name, rec)
            elif name.endswith(PART_SUFFIX):
                rec.unclean = True
                if name[:-len(PART_SUFFIX)] in journals:
                    why = None  # its journal holds the same rows
                else:
                    why = ("unreadable: a Parquet file's index (footer) is written only when it is closed, "
                           "so the rows of one cut short cannot be read")
            elif name.endswith(RECOVERING_SUFFIX):
                why = None  # a recovery cut short: its journal is recovered again
            else:
                why = "not the recorder's"
            try:
                os.unlink(name, dir_fd=self._tmp_fd)
            except FileNotFoundError:
                pass
            if why is not None:
                rec.removed.append((name, why))
        if rec.recovered or rec.removed:
            os.fsync(self._tmp_fd) if self.fsync else None
        return rec

    def _recover_journal(self, name: str, rec: Recovery) -> str | None:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._tmp_fd)
        except OSError as e:
            return f"cannot open: {e.strerror}"
        table, why = read_journal(fd, name)
        if table is None:
            return why
        # rows a published file already holds are not published twice
        table = table.filter(pc.invert(self._published_mask(table.column("seq"))))
        if table.num_rows == 0:
            return "its rows were all published already"
        seq = table.column("seq").to_numpy()
        if len(seq) > 1 and not (seq[1:] > seq[:-1]).all():
            return "its seqs are not increasing: not a journal of this recorder"
        try:
            published = self._publish_table(table, self._journal_first(name, table))
        except OSError as e:  # a full disk must not keep the recorder from starting: the gap covers them
            try:
                os.unlink(f"rec-{table.column('seq')[0].as_py():016d}{RECOVERING_SUFFIX}", dir_fd=self._tmp_fd)
            except OSError:
                pass
            return f"could not publish its {table.num_rows} whole rows ({e.strerror}): lost, inside the gap"
        rec.recovered.append((name, table.num_rows, published))  # the recorder logs it
        return None

    def _journal_first(self, name: str, table) -> int:
        """The first seq a recovered journal's file is named from: the journal's own (a file that
        began with a write error's drop row covers the seqs before that row), unless a published
        file holds some of those."""
        first = table.column("seq")[0].as_py()
        named = named_seq(name, JOURNAL_SUFFIX)
        if named is None:
            return first
        if named < first and not any(lo < first and hi >= named for lo, hi in self._published_at_start):
            return named
        return first

    def _publish_table(self, table, first: int | None = None) -> str:
        """Write `table` as a published file at once (recovery), named from `first` (default:
        its first row's seq); its name."""
        last = table.column("seq")[-1].as_py()
        first = table.column("seq")[0].as_py() if first is None else first
        part = f"rec-{first:016d}{RECOVERING_SUFFIX}"
        fd = create_private(part, self._tmp_fd)
        with open(fd, "wb", closefd=True) as f:  # buffered: see "Why buffered files"
            nbytes = table.nbytes
            rows = max(1, int(table.num_rows * self.row_group_bytes / max(nbytes, 1)))
            pq.write_table(table, f, row_group_size=rows, compression=self.compression)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        name = file_name(first, last)
        os.rename(part, name, src_dir_fd=self._tmp_fd, dst_dir_fd=self._dir_fd)
        if self.fsync:
            os.fsync(self._dir_fd)
        return name

    def last_row(self) -> tuple[int, int] | None:
        """(seq, recv_time in µs) of the recording's last published row, None if it is empty."""
        files = published_files(self.directory)
        if not files:
            return None
        pf = pq.ParquetFile(files[-1][2])
        if pf.num_row_groups == 0:
            return None
        t = pf.read_row_group(pf.num_row_groups - 1, columns=["recv_time", "seq"])
        return t.column("seq")[-1].as_py(), t.column("recv_time").cast(pa.int64())[-1].as_py()

    def gap_row(self, restart_us: int) -> tuple[int, int, bytes, bytes]:
        """A drop row for an unclean start: (recv_us, GAP, b"", description) minus the seq."""
        last = self.last_row()
        if last is None or self._journal_tail[0] > last[0]:  # a journal not yet recovered holds the last
            last = self._journal_tail if self._journal_tail[0] else last
        recovered = self._journal_rows  # what recovery publishes (or has published)
        after_seq, after_us = (last if last is not None else (0, None))
        return restart_us, GAP, b"", gap_payload(after_seq, after_us, restart_us, recovered)

    def __del__(self):
        for fd in (getattr(self, "_tmp_fd", None), getattr(self, "_dir_fd", None)):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    @property
    def pending_rows(self) -> int:
        """Rows accepted but not yet in a published file (recovered from the journal after a crash)."""
        return self._file_rows + self._buf_rows

    def last_taken_seq(self) -> int | None:
        """The seq of the last row `extend` took (journaled), None if none."""
        return self._last_seq

    def add_drop(self, recv_us: int, seq: int, count: int, first: bytes = b"", last: bytes = b"") -> None:
        """A drop row: `count` messages were lost at this point (first and last key if known);
        `count` GAP: an unknown number (`payload` = `last` describes the gap)."""
        self.extend(((recv_us, seq, first, last),), dropped=count)

    def add_loss(self, recv_us: int, first_seq: int, last_seq: int, count: int) -> None:
        """The drop row for the seqs `first_seq`..`last_seq` a write error discarded (`count`
        messages): at seq `last_seq`, after every seq a reader may already have read from the
        discarded file's journal (so offsets only grow and the row is never skipped), in a file
        named from `first_seq` (so the names still cover every seq: a missing seq always means
        retention deleted it)."""
        if self._first_seq is None:
            self._first_seq, self._opened_at = first_seq, self.clock()
        self.add_drop(recv_us, last_seq, count)

    def append(self, recv_us: int, seq: int, key: bytes, payload: bytes) -> None:
        self.extend(((recv_us, seq, key, payload),))

    def extend(self, rows, dropped: int = 0) -> None:
        """Add rows (iterable of ``(recv_time_us, seq, key, payload)``), in seq order.

        Each call's rows reach the journal before it returns (in batches cut at row-group
        boundaries). `dropped` (add_drop): every row of the call is a drop row of that count."""
        times, seqs, keys, payloads = [], [], [], []
        nbytes = self._buf_bytes
        limit = self.row_group_bytes
        for t, s, k, p in rows:
            if self._first_seq is None and not seqs:
                self._first_seq = s
                self._opened_at = self.clock()
            times.append(t)
            seqs.append(s)
            keys.append(k)
            payloads.append(p)
            nbytes += len(k) + len(p) + ROW_OVERHEAD
            if nbytes >= limit:
                self._add_batch(times, seqs, keys, payloads, dropped)
                times, seqs, keys, payloads = [], [], [], []
                self._write_row_group()
                nbytes = 0
                if self._file_size >= self.roll_bytes:
                    self.publish()
        if seqs:
            self._add_batch(times, seqs, keys, payloads, dropped)
        self._buf_bytes = nbytes
        if self._batches and self._file_size + nbytes >= self.roll_bytes:
            self.publish()

    def _add_batch(self, times, seqs, keys, payloads, dropped: int) -> None:
        n = len(seqs)
        pl = pa.array(payloads, type=pa.binary())
        sizes = pa.array([0] * n, type=pa.int32()) if dropped else pc.binary_length(pl).cast(pa.int32())
        batch = pa.RecordBatch.from_arrays(
            [pa.array(times, type=pa.timestamp("us", tz="UTC")), pa.array(keys, type=pa.binary()), pl, sizes,
             pa.array(seqs, type=pa.int64()), pa.array([dropped] * n, type=pa.int64())],
            schema=arrow_schema())
        if self._journal is None:
            self._open_files()
        self._journal.write_batch(batch)
        self._journal_file.flush()  # in the kernel: survives kill -9
        self._batches.append(batch)
        self._last_seq = seqs[-1]
        self._buf_rows += n
        if dropped:
            self._buf_drop_rows += n
            self._buf_dropped += n * max(dropped, 0)

    def tick(self) -> None:
        """Publish the current file if it is older than ``roll_age``; call often."""
        if self._first_seq is not None and self.clock() - self._opened_at >= self.roll_age:
            self.publish()

    def seconds_to_roll(self) -> float | None:
        if self._first_seq is None:
            return None
        return max(0.0, self.roll_age - (self.clock() - self._opened_at))

    # -- files

    def _open_files(self) -> None:
        base = f"rec-{self._first_seq:016d}"
        self._journal_name = base + JOURNAL_SUFFIX
        # buffered, flushed per batch: see "Why buffered files"
        self._journal_file = open(create_private(self._journal_name, self._tmp_fd), "wb", closefd=True)
        self._journal = pa.ipc.new_stream(self._journal_file, arrow_schema())
        self._tmp_path = os.path.join(self.tmp, base + PART_SUFFIX)
        self._file = open(create_private(base + PART_SUFFIX, self._tmp_fd), "wb", closefd=True)
        self._writer = pq.ParquetWriter(self._file, arrow_schema(), compression=self.compression)

    def _write_row_group(self) -> None:
        if not self._batches:
            return
        table = pa.Table.from_batches(self._batches, schema=arrow_schema())
        n = table.num_rows
        self._writer.write_table(table, row_group_size=n)
        # after the write: if it fails, abandon() counts these rows once (buffered)
        self._file_rows += n
        self._file_drop_rows += self._buf_drop_rows
        self._file_dropped += self._buf_dropped
        self._reset_buffer()
        self._file_size = self._file.tell()  # what is written, in the kernel or still buffered

    def publish(self) -> str | None:
        """Write what is buffered, close, fsync and rename the current file; its path."""
        if self._first_seq is None:
            return None
        if self._writer is None:  # a row was seen but its batch never reached the journal
            self._clear_file()
            return None
        self._write_row_group()
        self._writer.close()
        f = self._file
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
        f.close()
        name = file_name(self._first_seq, self._last_seq)
        final = os.path.join(self.directory, name)
        os.rename(os.path.basename(self._tmp_path), name, src_dir_fd=self._tmp_fd, dst_dir_fd=self._dir_fd)
        if self.fsync:
            os.fsync(self._dir_fd)
        self._close_journal(unlink=True)  # after the rename: a crash in between leaves both (recovery skips it)
        rows = self._file_rows
        self.files_published += 1
        self.rows_published += rows
        self._clear_file()
        self.log(f"published {os.path.basename(final)}: {rows} messages, {size} bytes")
        self.apply_retention()
        return final

    def _close_journal(self, unlink: bool) -> None:
        self._discard(self._journal, self._journal_file, self._journal_name if unlink else None)

    def _discard(self, *closers_then_name) -> None:
        """Close what is not None (ignoring errors), then unlink the name in _tmp/ (if given)."""
        *closers, name = closers_then_name
        for closer in closers:
            if closer is not None:
                try:
                    closer.close()
                except Exception:
                    pass
        if name is not None:
            try:
                os.unlink(name, dir_fd=self._tmp_fd)
            except OSError:
                pass

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
        """Publish the current file (if any); the writer stopped cleanly (its marker goes)."""
        path = self.publish()
        try:
            os.unlink(MARKER, dir_fd=self._tmp_fd)
        except FileNotFoundError:
            pass
        return path

    def _clear_file(self) -> None:
        self._writer = None
        self._file = None
        self._tmp_path = None
        self._journal = self._journal_file = self._journal_name = None
        self._first_seq = self._last_seq = None
        self._opened_at = 0.0
        self._file_rows = 0
        self._file_size = 0
        self._file_drop_rows = self._file_dropped = 0

    def abandon(self) -> tuple[int | None, int]:
        """Drop the current file (after a write error): close and delete it and its journal.

        Returns (first seq, messages lost): the rows of the file and the
        buffer, plus what the drop rows among them counted."""
        first = self._first_seq
        messages = self._file_rows - self._file_drop_rows + self._buf_rows - self._buf_drop_rows
        lost = messages + self._file_dropped + self._buf_dropped
        #: Of `lost`, the messages themselves (the rest was counted by the drop rows discarded with them).
        self.abandoned_messages = messages
        self._discard(self._writer, self._file,
                      os.path.basename(self._tmp_path) if self._tmp_path is not None else None)
        self._close_journal(unlink=True)
        self._clear_file()
        self._reset_buffer()
        return first, lost
