"""``spark.readStream.format("sbus")``: a Spark data source over a recording, live journal included.

    from sbus.pipeline.source import register
    register(spark)
    df = spark.readStream.format("sbus").option("maxRecordsPerTrigger", 100000).load(DIR)
    df = spark.read.format("sbus").load(DIR)          # batch, the same schema

The offset is the recorder's ``seq`` (``{"seq": S}``: every row up to S has been read),
the way Kafka's source uses a partition's offset: a query's checkpoint holds the last
offset of each micro-batch, so a restarted query reads from exactly there, and every
row comes once. Rows come from the published files (``rec-FIRST-LAST.parquet``) and,
for the newest ones, from the journals in ``_tmp/`` (``rec-FIRST.arrows``: Arrow IPC
streams the recorder flushes with every batch it takes), so a message is readable as
soon as the recorder's writer thread has taken it, not when its file is published
(``--roll-age``). A journal holds exactly the rows its published file will hold, with
the same seqs, so it does not matter which of the two a row is read from; a journal
that is published (renamed and deleted) while it is read is read again from its file.

Drop rows and gap rows come in seq order like any row; ``kind`` says which a row is
(``message``, ``drop``, ``gap``; and ``close`` for the closing row of ``closeAtEnd``).

Options (Kafka's names where there is one):

``startingOffsets``       ``earliest`` (default), ``latest``, or a seq: the first row read
                          (a new query only; a restarted one resumes from its checkpoint)
``maxRecordsPerTrigger``  at most this many seqs per micro-batch (default: all available)
``seqsPerPartition``      a Spark task per this many seqs (default 262144)
``failOnDataLoss``        ``true`` (default): rows the query has not read yet that are no
                          longer there (deleted by ``--retain-*``) fail the query; ``false``
                          skips them
``closeAtEnd``            seconds, with ``Trigger.AvailableNow``: after the last row
                          available at the start, one *closing row* (``kind`` ``close``,
                          ``seq`` -1) whose ``recv_time`` is the newest row's plus this,
                          to move an event-time watermark past the recording's last windows
                          (``sbus-pipeline stream --close-at-end``)
``keys``                  only the messages with one of these keys (comma-separated, or a
                          JSON list of strings when a key holds a comma), and every drop
                          and gap row (Kafka's ``subscribe``)
``keyPrefix``             only the messages whose key starts with this, and every drop and
                          gap row (Kafka's ``subscribePattern``; one of the two)

Key filters: the two options above filter in the reader, stream and batch alike (skipped
Parquet row groups, journal rows left out before they reach Spark). A batch read also takes
``key = X``, ``key IN (...)`` (and ``StringStartsWith`` on key) from the query itself
(`SbusBatchReader.pushFilters`; SQL's meaning: only the rows with such a key, losses
included only if their key matches); Spark pushes filters into Python sources for batch
reads only, and only with ``spark.sql.python.filterPushdown.enabled``, which `register` sets.

The directory must be readable at the same path by the driver and every executor (local
mode; a shared mount on a cluster); executors import this module, so the ``sbus`` package
must be installed on them or shipped with ``--py-files`` (docs/pipeline.md).
"""

from __future__ import annotations

import os

from .schema import GAP, JOURNAL_SUFFIX, TMP_DIR, named_seq, published_files

NAME = "sbus"
#: The source's schema: the recording's columns and ``kind``.
DDL = ("recv_time TIMESTAMP, key BINARY, payload BINARY, size INT, seq BIGINT, dropped BIGINT, "
       "kind STRING")
DEFAULT_SEQS_PER_PARTITION = 1 << 18
#: ``seq`` of the closing row (`closeAtEnd`); no recorded row has it.
CLOSE_SEQ = -1
KINDS = {0: "message", GAP: "gap"}


class DataLoss(RuntimeError):
    """Rows the query has still to read are gone (retention deleted their file)."""


#: Spark's switch for filter pushdown into Python sources (off by default; with it off, a
#: reader that takes filters fails every batch read).
PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"


def register(spark, push_filters: bool = True) -> None:
    """Make ``format("sbus")`` known to `spark` (once per session; again is harmless).

    `push_filters`: batch reads take key filters from the query (`SbusBatchReader.pushFilters`);
    this turns on `PUSHDOWN_CONF` for the session, which Spark requires for that. False
    registers a reader without them (for a session that must keep the switch off)."""
    if push_filters:
        spark.conf.set(PUSHDOWN_CONF, "true")
        spark.dataSource.register(SbusDataSource)
    else:
        spark.dataSource.register(SbusPlainDataSource)


# -- what a recording holds (driver and executors alike)

def journals(directory: str) -> list[tuple[int, str]]:
    """[(first seq, path)] of the journals in ``_tmp/`` (the file being written, and an old one
    a restarted recorder is still recovering), in seq order."""
    tmp = os.path.join(directory, TMP_DIR)
    out = []
    try:
        entries = list(os.scandir(tmp))
    except FileNotFoundError:
        return []
    for e in entries:
        seq = named_seq(e.name, JOURNAL_SUFFIX)
        if seq is not None:
            out.append((seq, e.path))
    out.sort()
    return out


def journal_batches(path: str):
    """The whole record batches of a journal, read as they are now (a batch being written is
    left for the next look); nothing if it is gone or has no whole batch yet."""
    import pyarrow as pa

    try:
        source = pa.memory_map(path)
    except (FileNotFoundError, OSError):
        return
    try:
        reader = pa.ipc.open_stream(source)
    except (pa.ArrowInvalid, OSError, EOFError):
        return
    while True:
        try:
            yield reader.read_next_batch()
        except StopIteration:
            return
        except (pa.ArrowInvalid, OSError, EOFError):
            return  # cut short: the recorder is writing it


class Layout:
    """One look at a recording: its published files and journals, and what seqs they hold."""

    def __init__(self, directory: str):
        # journals first: one published between the two looks is then in both (never in neither)
        self.journals = journals(directory)
        self.files = published_files(directory)
        self.directory = directory

    def first_seq(self) -> int | None:
        firsts = [f[0] for f in self.files] + [j[0] for j in self.journals]
        return min(firsts) if firsts else None

    def published_last(self) -> int:
        return self.files[-1][1] if self.files else 0


class JournalTail:
    """The newest seq in the journals, scanning only what was appended since the last look
    (the driver asks each trigger; a journal is read once however often it is asked)."""

    def __init__(self):
        self._seen: dict[str, tuple[int, int]] = {}  # path -> (bytes scanned, last seq)

    def last_seq(self, layout: Layout) -> int:
        best = layout.published_last()
        keep = {}
        for first, path in layout.journals:
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                continue
            old = self._seen.get(path)
            if old is not None and old[0] == size:
                last = old[1]
            else:
                last = None
                for b in journal_batches(path):
                    if b.num_rows:
                        last = b.column(b.schema.get_field_index("seq"))[-1].as_py()
                if last is None:
                    continue
            keep[path] = (size, last)
            best = max(best, last)
        self._seen = keep
        return best


def newest_time_us(directory: str, upto: int) -> int | None:
    """The newest ``recv_time`` (µs) among the rows with seq <= `upto`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    best = None
    for t in read_range(directory, max(0, upto - (1 << 16)), upto, lenient=True):
        if t.num_rows:
            v = pc.max(t.column("recv_time").cast(pa.int64())).as_py()
            best = v if best is None else max(best, v)
    if best is None:  # the last 65,536 seqs hold no row: look at everything
        for t in read_range(directory, 0, upto, lenient=True):
            if t.num_rows:
                v = pc.max(t.column("recv_time").cast(pa.int64())).as_py()
                best = v if best is None else max(best, v)
    return best


# -- key filters

def _successor(prefix: bytes) -> bytes | None:
    """The least byte string greater than every string starting with `prefix` (None: none is)."""
    p = prefix.rstrip(b"\xff")
    return p[:-1] + bytes([p[-1] + 1]) if p else None


class KeyMatch:
    """Rows whose ``key`` is one of `keys`, or starts with `prefix` (one of the two); with
    `losses`, every drop and gap row too (the ``keys``/``keyPrefix`` options: a filtered
    stream still sees each loss). Picklable: it travels to the executors with the reader."""

    def __init__(self, keys=None, prefix: bytes | None = None, losses: bool = False):
        self.keys = None if keys is None else frozenset(keys)
        self.prefix, self.losses = prefix, losses

    def __repr__(self):
        what = f"keys={sorted(self.keys)!r}" if self.keys is not None else f"prefix={self.prefix!r}"
        return f"KeyMatch({what}, losses={self.losses})"

    def expression(self):
        """The row condition, as a pyarrow expression (on a table with ``dropped`` filled in)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        key = pc.field("key")
        if self.keys is not None:
            e = key.isin(pa.array(sorted(self.keys), pa.binary()))
        else:
            e = pc.starts_with(key, pattern=self.prefix)
        return e | (pc.field("dropped") != 0) if self.losses else e

    def may_hold(self, low: bytes | None, high: bytes | None, losses: bool) -> bool:
        """Whether a row group whose keys lie in [`low`, `high`] (None: unknown) may hold a
        matching row; `losses`: it may hold drop or gap rows."""
        if (self.losses and losses) or low is None or high is None:
            return True
        if self.keys is not None:
            return any(low <= k <= high for k in self.keys)
        end = _successor(self.prefix)
        return high >= self.prefix and (end is None or low < end)


class ReadCount:
    """What reads took from the recording: rows decoded (row groups read, journal rows in the
    range), row groups skipped on their statistics, and rows given to Spark."""

    def __init__(self):
        self.rows_read = self.row_groups_skipped = self.rows_out = 0

    def add(self, other: "ReadCount", rows_out: int = 0) -> None:
        self.rows_read += other.rows_read
        self.row_groups_skipped += other.row_groups_skipped
        self.rows_out += other.rows_out + rows_out


def _stats(rg, column: int):
    """(min, max) of a column in a row group, or None when the file has no statistics."""
    st = rg.column(column).statistics if column >= 0 else None
    return (st.min, st.max) if st is not None and st.has_min_max else None


def _read_file(path: str, after: int, end: int, match, count: ReadCount):
    """The rows of a published file with ``after < seq <= end`` that every `match` holds for,
    reading only the row groups whose statistics allow such rows."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    md = pf.metadata
    names = list(md.schema.names)
    col = {n: (names.index(n) if n in names else -1) for n in ("seq", "key", "dropped")}
    keep = []
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        seq = _stats(rg, col["seq"])
        if seq is not None and (seq[1] <= after or seq[0] > end):
            continue
        if match:
            keys = _stats(rg, col["key"]) or (None, None)
            dropped = _stats(rg, col["dropped"])
            losses = dropped is None or dropped != (0, 0)
            if not all(m.may_hold(keys[0], keys[1], losses) for m in match):
                count.row_groups_skipped += 1
                continue
        keep.append(i)
    if not keep:
        return None
    t = pf.read_row_groups(keep)
    count.rows_read += t.num_rows
    return _between(t, after, end)


def _matching(table, match):
    """`table` (with ``kind``) cut to the rows every `match` holds for."""
    for m in match:
        table = table.filter(m.expression())
    return table


# -- reading a range of seqs

def _with_kind(table):
    """The recording's columns in order (``dropped`` 0 when an old recording lacks it) and ``kind``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = table.num_rows
    if "dropped" not in table.column_names:
        table = table.append_column("dropped", pa.array([0] * n, type=pa.int64()))
    d = table.column("dropped")
    kind = pc.if_else(pc.equal(d, 0), "message", pc.if_else(pc.equal(d, GAP), "gap", "drop"))
    cols = [table.column(c) for c in ("recv_time", "key", "payload", "size", "seq", "dropped")]
    return pa.table(cols + [kind.cast(pa.string())],
                    names=["recv_time", "key", "payload", "size", "seq", "dropped", "kind"])


def _between(table, start: int, end: int):
    import pyarrow.compute as pc

    s = table.column("seq")
    return table.filter(pc.and_(pc.greater(s, start), pc.less_equal(s, end)))


def read_range(directory: str, start: int, end: int, *, lenient: bool = False, match=(),
               count: ReadCount | None = None):
    """The rows with ``start < seq <= end``, as Arrow tables in seq order (with ``kind``).

    Published files and journals are taken in the order of their first seq (a file before a
    journal of the same rows); each gives the rows past those taken. Raises `DataLoss` when
    seqs in the range are in neither (deleted by retention), unless `lenient`. `match`: only
    the rows every `KeyMatch` in it holds for (row groups that cannot hold one are not read);
    `count`: a `ReadCount` to add to."""
    import pyarrow as pa

    for attempt in range(5):
        layout = Layout(directory)
        tally = ReadCount()
        sources = sorted([(f, 0, last, path) for f, last, path in layout.files]
                         + [(f, 1, None, path) for f, path in layout.journals])
        out = []
        covered = start  # every seq up to here is accounted for
        hole = again = False
        for first, is_journal, last, path in sources:
            if covered >= end or first > end:
                break
            if last is not None and last <= covered:
                continue
            if first > covered + 1:
                hole = True
                if not lenient:
                    break
            if is_journal:
                batches = list(journal_batches(path))
                if not batches:
                    if not os.path.exists(path):
                        again = True  # published since the listing: look again
                        break
                    continue
                whole = pa.Table.from_batches(batches)
                t = _between(whole, covered, end)
                last = whole.column("seq")[-1].as_py()
                tally.rows_read += t.num_rows
            else:
                try:
                    t = _read_file(path, covered, end, match, tally)
                except FileNotFoundError:
                    again = True  # retention between the listing and the read
                    break
            if t is not None and t.num_rows:
                t = _matching(_with_kind(t), match)
                if t.num_rows:
                    out.append(t)
            covered = max(covered, min(last, end))
        if again or (covered < end and not lenient) or (hole and not lenient):
            if attempt < 4:
                continue
            raise DataLoss(f"{directory}: seqs after {covered} up to {end} are no longer in the recording "
                           f"(deleted by retention?); failOnDataLoss=false skips them")
        break
    if count is not None:  # the attempt that gave `out`
        count.add(tally, sum(t.num_rows for t in out))
    return out


# -- Spark's side (pyspark imported here only: the module is importable without it)

try:
    from pyspark.sql.datasource import (DataSource, DataSourceReader, DataSourceStreamReader, EqualTo, In,
                                        InputPartition, IsNotNull, StringStartsWith)
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - without pyspark only the helpers above are usable
    DataSource = DataSourceReader = DataSourceStreamReader = object
    EqualTo = In = IsNotNull = StringStartsWith = None
    InputPartition = SupportsTriggerAvailableNow = object
    ReadAllAvailable = ReadMaxRows = None


class SeqRange(InputPartition):
    """One Spark task: the rows with ``start < seq <= end`` (and the closing row, if `close_us`)."""

    def __init__(self, start: int, end: int, close_us: int | None = None):
        self.start, self.end, self.close_us = start, end, close_us


def _options(options) -> dict:
    """The options as given (Spark lower-cases their names)."""
    return {str(k).lower(): v for k, v in dict(options).items()}


def _int_option(opts: dict, name: str, default):
    v = opts.get(name.lower())
    if v is None:
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"sbus source: {name} must be a whole number, not {v!r}") from None
    if n <= 0:
        raise ValueError(f"sbus source: {name} must be positive")
    return n


def _true(opts: dict, name: str, default: bool) -> bool:
    v = opts.get(name.lower())
    return default if v is None else str(v).strip().lower() in ("true", "1", "yes")


def _key_options(opts: dict) -> tuple:
    """The ``keys``/``keyPrefix`` options as `KeyMatch`es (losses always kept): () if neither."""
    import json

    keys, prefix = opts.get("keys"), opts.get("keyprefix")
    if keys is not None and prefix is not None:
        raise ValueError("sbus source: give keys or keyPrefix, not both")
    if prefix is not None:
        if not str(prefix):
            raise ValueError("sbus source: keyPrefix is empty (leave it out to read every key)")
        return (KeyMatch(prefix=str(prefix).encode(), losses=True),)
    if keys is None:
        return ()
    text = str(keys).strip()
    if text.startswith("["):
        try:
            names = json.loads(text)
        except ValueError:
            names = None
        if not isinstance(names, list) or not all(isinstance(k, str) for k in names):
            raise ValueError(f"sbus source: keys: a JSON list of strings, or keys separated by commas, "
                             f"not {text!r}")
    else:
        names = text.split(",")
    if not names or "" in names:
        raise ValueError(f"sbus source: keys: an empty key in {text!r}")
    return (KeyMatch(keys=[k.encode() for k in names], losses=True),)


class SbusDataSource(DataSource):
    """``format("sbus")``: `SbusStreamReader` for ``readStream``, `SbusBatchReader` for ``read``."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def __init__(self, options):
        super().__init__(options)
        opts = _options(options)
        path = opts.get("path")
        if not path:
            raise ValueError("sbus source: give the recording directory: .load(DIR)")
        if path.startswith("file://"):
            path = path[len("file://"):]
        if "://" in path:
            raise ValueError(f"sbus source: {path}: a local path (or a mount every executor shares), "
                             f"not a URL")
        if not os.path.isabs(path):  # the Python workers that read it run in another directory
            raise ValueError(f"sbus source: {path}: give an absolute path (os.path.abspath)")
        self.directory = path
        self.opts = opts

    def schema(self):
        return DDL

    def reader(self, schema):
        return SbusBatchReader(self.directory, self.opts)

    def streamReader(self, schema):
        return SbusStreamReader(self.directory, self.opts)


class SbusPlainDataSource(SbusDataSource):
    """``format("sbus")`` whose batch reader takes no filters from the query (`register` with
    ``push_filters=False``: Spark fails a read whose reader takes filters when its pushdown
    switch is off)."""

    def reader(self, schema):
        return SbusPlainBatchReader(self.directory, self.opts)


def _split(start: int, end: int, step: int) -> list:
    out = []
    s = start
    while s < end:
        out.append(SeqRange(s, min(end, s + step)))
        s += step
    return out


def _read(directory: str, part: SeqRange, lenient: bool, match=()):
    import pyarrow as pa

    if part.end > part.start:
        for t in read_range(directory, part.start, part.end, lenient=lenient, match=match):
            yield from t.to_batches()
    if part.close_us is not None:
        row = {"recv_time": pa.array([part.close_us], pa.timestamp("us", tz="UTC")),
               "key": pa.array([b""], pa.binary()), "payload": pa.array([b""], pa.binary()),
               "size": pa.array([0], pa.int32()), "seq": pa.array([CLOSE_SEQ], pa.int64()),
               "dropped": pa.array([0], pa.int64()), "kind": pa.array(["close"], pa.string())}
        yield pa.RecordBatch.from_pydict(row)


class SbusPlainBatchReader(DataSourceReader):
    """Everything the recording holds now, published files and journals (with the key options,
    only the rows they keep)."""

    def __init__(self, directory: str, opts: dict):
        self.directory = directory
        self.step = _int_option(opts, "seqsPerPartition", DEFAULT_SEQS_PER_PARTITION)
        self.lenient = not _true(opts, "failOnDataLoss", True)
        self.match = _key_options(opts)

    def partitions(self):
        layout = Layout(self.directory)
        first = layout.first_seq()
        if first is None:
            return [SeqRange(0, 0)]
        return _split(first - 1, JournalTail().last_seq(layout), self.step) or [SeqRange(0, 0)]

    def read(self, partition):
        return _read(self.directory, partition, self.lenient, self.match)


def _pushed_match(f):
    """The `KeyMatch` a filter Spark pushes is (SQL's meaning: losses only if their key
    matches), True for ``key IS NOT NULL`` (every row has a key), None if not one on ``key``.
    (``key`` is binary: Spark pushes ``key = X`` and ``key IN (...)``; a LIKE or startswith
    on it needs a cast, which Spark does not push, but a StringStartsWith is taken as given.)"""
    if getattr(f, "attribute", None) != ("key",):
        return None
    if isinstance(f, IsNotNull):
        return True
    if isinstance(f, EqualTo) and isinstance(f.value, (bytes, str)):
        return KeyMatch(keys=[_bytes(f.value)])
    if isinstance(f, In) and all(isinstance(v, (bytes, str)) for v in f.value):
        return KeyMatch(keys=[_bytes(v) for v in f.value])
    if isinstance(f, StringStartsWith) and f.value:
        return KeyMatch(prefix=_bytes(f.value))
    return None


def _bytes(v) -> bytes:
    return v.encode() if isinstance(v, str) else v


class SbusBatchReader(SbusPlainBatchReader):
    """`SbusPlainBatchReader` that also takes the query's filters on ``key``."""

    def pushFilters(self, filters):
        """Take ``key = X``, ``key IN (...)``, ``key`` starts with, ``key IS NOT NULL`` (the
        reader applies them exactly; Spark does not again); give back every other filter."""
        left, taken = [], []
        for f in filters:
            m = _pushed_match(f)
            if m is None:
                left.append(f)
            elif m is not True:
                taken.append(m)
        self.match = tuple(self.match) + tuple(taken)
        return left


class SbusStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"seq": S}`` (every row up to S read; ``"closed": true`` once the closing row
    of ``closeAtEnd`` was read)."""

    def __init__(self, directory: str, opts: dict):
        self.directory = directory
        self.opts = opts
        self.max_rows = _int_option(opts, "maxRecordsPerTrigger", None)
        self.step = _int_option(opts, "seqsPerPartition", DEFAULT_SEQS_PER_PARTITION)
        self.lenient = not _true(opts, "failOnDataLoss", True)
        self.match = _key_options(opts)
        close = opts.get("closeatend")
        self.close_after = float(close) if close not in (None, "") else None
        self.tail = JournalTail()
        self.target = None  # Trigger.AvailableNow: the newest seq when it began

    def _latest(self) -> int:
        return self.tail.last_seq(Layout(self.directory))

    def initialOffset(self) -> dict:
        where = str(self.opts.get("startingoffsets", "earliest")).strip().lower()
        if where == "earliest":
            first = Layout(self.directory).first_seq()
            return {"seq": (first - 1) if first is not None else 0}
        if where == "latest":
            return {"seq": self._latest()}
        try:
            seq = int(where)
        except ValueError:
            raise ValueError(f"sbus source: startingOffsets is earliest, latest or a seq, not {where!r}") from None
        if seq < 1:
            raise ValueError("sbus source: a startingOffsets seq is 1 or more")
        return {"seq": seq - 1}

    def getDefaultReadLimit(self):
        return ReadMaxRows(self.max_rows) if self.max_rows else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self._latest()

    def latestOffset(self, start: dict, limit) -> dict:
        begin = int(start["seq"])
        newest = self.target if self.target is not None else self._latest()
        end = newest
        if isinstance(limit, ReadMaxRows):
            end = min(newest, begin + int(limit.max_rows))
        end = max(end, begin)
        out = {"seq": end}
        if self.target is not None and self.close_after is not None and end >= self.target:
            out["closed"] = True  # this batch also carries the closing row
        return out

    def reportLatestOffset(self):
        return {"seq": self._latest()}

    def partitions(self, start: dict, end: dict):
        s, e = int(start["seq"]), int(end["seq"])
        parts = _split(s, e, self.step)
        if end.get("closed") and end != start:  # a closed query that read more closes again
            newest = newest_time_us(self.directory, e)
            if newest is not None:
                close = SeqRange(e, e, newest + int(self.close_after * 1e6))
                parts.append(close)
        return parts

    def read(self, partition):
        return _read(self.directory, partition, self.lenient, self.match)

    def commit(self, end: dict) -> None:
        """Nothing to release: the recording belongs to the recorder (its retention deletes)."""
