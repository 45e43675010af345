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

The directory must be readable at the same path by the driver and every executor (local
mode; a shared mount on a cluster); executors import this module, so the ``sbus`` package
must be installed on them or shipped with ``--py-files`` (docs/pipeline.md).
"""

from __future__ import annotations

import os

from .schema import GAP, JOURNAL_SUFFIX, PREFIX, TMP_DIR, published_files

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


def register(spark) -> None:
    """Make ``format("sbus")`` known to `spark` (once per session; again is harmless)."""
    spark.dataSource.register(SbusDataSource)


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
        n = e.name
        if n.startswith(PREFIX) and n.endswith(JOURNAL_SUFFIX):
            try:
                out.append((int(n[len(PREFIX):-len(JOURNAL_SUFFIX)]), e.path))
            except ValueError:
                continue
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


def read_range(directory: str, start: int, end: int, *, lenient: bool = False):
    """The rows with ``start < seq <= end``, as Arrow tables in seq order (with ``kind``).

    Published files and journals are taken in the order of their first seq (a file before a
    journal of the same rows); each gives the rows past those taken. Raises `DataLoss` when
    seqs in the range are in neither (deleted by retention), unless `lenient`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for attempt in range(5):
        layout = Layout(directory)
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
            else:
                try:
                    t = pq.read_table(path, filters=[("seq", ">", covered), ("seq", "<=", end)])
                except FileNotFoundError:
                    again = True  # retention between the listing and the read
                    break
            if t.num_rows:
                out.append(_with_kind(t))
            covered = max(covered, min(last, end))
        if again or (covered < end and not lenient) or (hole and not lenient):
            if attempt < 4:
                continue
            raise DataLoss(f"{directory}: seqs after {covered} up to {end} are no longer in the recording "
                           f"(deleted by retention?); failOnDataLoss=false skips them")
        return out
    return out


# -- Spark's side (pyspark imported here only: the module is importable without it)

try:
    from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - without pyspark only the helpers above are usable
    DataSource = DataSourceReader = DataSourceStreamReader = object
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


def _split(start: int, end: int, step: int) -> list:
    out = []
    s = start
    while s < end:
        out.append(SeqRange(s, min(end, s + step)))
        s += step
    return out


def _read(directory: str, part: SeqRange, lenient: bool):
    import pyarrow as pa

    if part.end > part.start:
        for t in read_range(directory, part.start, part.end, lenient=lenient):
            yield from t.to_batches()
    if part.close_us is not None:
        row = {"recv_time": pa.array([part.close_us], pa.timestamp("us", tz="UTC")),
               "key": pa.array([b""], pa.binary()), "payload": pa.array([b""], pa.binary()),
               "size": pa.array([0], pa.int32()), "seq": pa.array([CLOSE_SEQ], pa.int64()),
               "dropped": pa.array([0], pa.int64()), "kind": pa.array(["close"], pa.string())}
        yield pa.RecordBatch.from_pydict(row)


class SbusBatchReader(DataSourceReader):
    """Everything the recording holds now, published files and journals."""

    def __init__(self, directory: str, opts: dict):
        self.directory = directory
        self.step = _int_option(opts, "seqsPerPartition", DEFAULT_SEQS_PER_PARTITION)
        self.lenient = not _true(opts, "failOnDataLoss", True)

    def partitions(self):
        layout = Layout(self.directory)
        first = layout.first_seq()
        if first is None:
            return [SeqRange(0, 0)]
        return _split(first - 1, JournalTail().last_seq(layout), self.step) or [SeqRange(0, 0)]

    def read(self, partition):
        return _read(self.directory, partition, self.lenient)


class SbusStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"seq": S}`` (every row up to S read; ``"closed": true`` once the closing row
    of ``closeAtEnd`` was read)."""

    def __init__(self, directory: str, opts: dict):
        self.directory = directory
        self.opts = opts
        self.max_rows = _int_option(opts, "maxRecordsPerTrigger", None)
        self.step = _int_option(opts, "seqsPerPartition", DEFAULT_SEQS_PER_PARTITION)
        self.lenient = not _true(opts, "failOnDataLoss", True)
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
        return _read(self.directory, partition, self.lenient)

    def commit(self, end: dict) -> None:
        """Nothing to release: the recording belongs to the recorder (its retention deletes)."""
