"""``sbus-pipeline report DIR --out REPORT_DIR``: batch analytics over a recording.

Computes (one Spark pass over the recording, `compute`, then the tables from
its counts in Python, `derive`):

``windows``       per window and key prefix: messages, payload bytes
``window_stats``  per window: messages, bytes, msg/s, bytes/s, payload size min/p50/p90/p99/max
``top_keys``      the busiest keys: messages, bytes
``size_hist``     payload sizes in power-of-two buckets
``summary``       one row: totals, time span, overall percentiles, peak rates

and writes them as Parquet tables under ``REPORT_DIR/tables/<name>/``, plus
a page for people: ``REPORT_DIR/index.html`` with PNG charts and the
headline figures, also in ``REPORT_DIR/summary.txt``.

Drop rows (``dropped`` > 0: messages the bus or the recorder lost) count as
known lost messages, never as messages. Average rates (the headline's and
``window_stats``' msg/s) share one basis: the time recorded (first to last
message, gaps left out, `recorded_seconds`); the peak is the busiest
1-second window. The rate
chart picks its own window for enough points over the recording's span
(`chart_window`) and writes its data to ``rate.json``. Everything written is
private (0700/0600).

Gap rows (``dropped`` -1: the recorder crashed, an unknown number lost)
are counted as ``gaps`` and named in the headline's first line. Windows
the recording covers only in part (its first and last, and those a gap
cuts) are rated over the time it covers (``covered_seconds``, ``partial``),
and drawn with open markers. The size chart counts from zero unless the
spread needs a log axis, which its title then says (``sizes.json``).

Percentiles are exact (linear interpolation between closest ranks, as
Spark's ``percentile`` and ``numpy.percentile``'s default; per window with
Spark's formula, `group_percentiles`, to the last bit). Windows are tumbling,
aligned to the epoch, in UTC. A key's prefix is its first ``--depth``
``/``-separated parts.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import math
import os
import threading
import time

from .spark import is_remote, local_path, window_aggregates, with_prefix

PERCENTILES = (0.5, 0.9, 0.99)
SUMMARY_PERCENTILES = (0.5, 0.9, 0.99, 0.999)
TABLES = ("windows", "window_stats", "top_keys", "size_hist", "summary")


#: The one Spark pass (`compute`) groups every row three ways at once (Spark's grouping sets);
#: each output row belongs to one set, told by its ``gid`` (Spark's ``grouping_id()``). Every
#: column of a row's kind is a grouping column and the only aggregates are a count, a sum and a
#: min and max, so Spark's aggregation does little per row (issue 35: the report's pass was over
#: twice a bare scan's time with three sets of nine aggregates); `derive` sums the rest. The
#: per-key figures are grouped by prefix in Spark, not brought to the driver per (second, key):
#: half the rows to fetch (issue 35: ~400,000 for 1,000,000 messages, then ~210,000).
GROUP_COLS = ("w_us", "size", "dropped", "sec_us", "prefix", "key")
SETS = {"sizes": ("w_us", "size", "dropped"),  # per window, payload size and kind: window_stats,
        # size_hist, the summary; and the windows table's row of the drop and gap rows
        "prefixes": ("w_us", "sec_us", "prefix"),  # per window, second and key prefix of the
        # messages: the windows table, the busiest second
        "keys": ("key",)}  # per key of the messages: top_keys, the distinct keys


def _gid(name: str) -> int:
    """``grouping_id()`` of the set `name`: a bit per grouping column left out (first = highest)."""
    n = len(GROUP_COLS)
    return sum(1 << (n - 1 - i) for i, c in enumerate(GROUP_COLS) if c not in SETS[name])


def read(spark, directory: str):
    """The recording's columns the report needs (``dropped``: 0 for a message, see `dropped_col`)."""
    from .spark import dropped_col, read_schema

    return (spark.read.schema(read_schema()).parquet(directory)
            .select("recv_time", "key", "size", dropped_col().alias("dropped")))


def compute(spark, directory: str, window_seconds: float, depth: int = 1):
    """The report's one pass over the recording: a DataFrame of counts (`derive` builds the
    tables from it, in Python), and the recording's DataFrame (for a chart in other windows).

    Every row is counted in three groupings (`SETS`) in one aggregation: per (window, payload
    size, ``dropped``), so per-window and overall exact percentiles, the histogram, the totals
    and the known losses follow from counts (``dropped``: 0 a message, N > 0 a drop row, -1 a
    gap row); per (window, second, key prefix) of the messages (`with_prefix`), so the windows
    table and the per-second rates; per key of the messages, so the busiest keys. The driver
    gets a row per group: with many distinct keys or sizes per window that grows, never beyond
    three times the recording's rows. ``first``/``last`` (µs) are the group's earliest and
    latest times."""
    from pyspark.sql import functions as F

    from .units import spark_interval

    df = read(spark, directory)
    # the window in µs as F.window takes it (`spark_interval`: whole milliseconds), its start
    # computed as F.window does; grouping on numbers, not F.window's struct, is cheaper
    spark_interval(window_seconds)  # (refuses a window of 0)
    width = round(window_seconds * 1000) * 1000
    us = F.unix_micros("recv_time")
    rows = with_prefix(df, depth).select(
        (us - F.pmod(us, F.lit(width))).alias("w_us"), "size", "dropped",  # (F.window's start, as a number)
        (us - F.pmod(us, F.lit(1_000_000))).alias("sec_us"), "prefix",
        F.when(F.col("dropped") == 0, F.col("key").cast("string")).alias("key"), us.alias("us"))
    parts = rows.groupingSets([list(s) for s in SETS.values()], *GROUP_COLS).agg(
        F.grouping_id().alias("gid"), F.count(F.lit(1)).alias("rows"), F.sum("size").alias("bytes"),
        F.min("us").alias("first"), F.max("us").alias("last"))
    return parts, df


def _ts_type():
    import pyarrow as pa

    return pa.timestamp("us", tz="UTC")


def _schema(fields):
    """A pyarrow schema from (name, type, nullable): the tables' types as Spark wrote them."""
    import pyarrow as pa

    return pa.schema([pa.field(n, t, nullable=nb) for n, t, nb in fields])


def _table_schemas():
    import pyarrow as pa

    ts, i64, f64 = _ts_type(), pa.int64(), pa.float64()
    return {
        "windows": _schema([("window_start", ts, True), ("window_end", ts, True), ("prefix", pa.string(), True),
                            ("messages", i64, False), ("bytes", i64, True), ("dropped", i64, True)]),
        "window_stats": _schema([
            ("window_start", ts, True), ("window_end", ts, True), ("messages", i64, False), ("bytes", i64, True),
            ("dropped", i64, True), ("gaps", i64, False), ("covered_seconds", f64, False),
            ("partial", pa.bool_(), False), ("msgs_per_s", f64, True), ("bytes_per_s", f64, True),
            ("size_min", pa.int32(), True), ("size_p50", f64, True), ("size_p90", f64, True),
            ("size_p99", f64, True), ("size_max", pa.int32(), True)]),
        "top_keys": _schema([("key", pa.string(), True), ("messages", i64, False), ("bytes", i64, True)]),
        "size_hist": _schema([("bucket", pa.int32(), True), ("size_from", i64, True), ("size_to", i64, True),
                              ("messages", i64, True)]),
    }


def group_percentiles(values, counts, starts, ps):
    """Exact percentiles per group, as Spark's ``percentile`` computes them (linear
    interpolation between closest ranks: ``a + (h - lo) * (b - a)``, h = (n - 1) p).
    `values`/`counts` (numpy) are sorted by group then value; group g's rows are
    ``starts[g]:starts[g + 1]``. Returns an array (groups × len(ps)) of float64."""
    import numpy as np

    cum = np.cumsum(counts, dtype=np.int64)
    base = np.concatenate(([0], cum))[starts[:-1]]  # rows before each group
    n = cum[starts[1:] - 1] - base
    out = np.empty((len(n), len(ps)), dtype=np.float64)
    for j, p in enumerate(ps):
        pos = (n - 1).astype(np.float64) * p
        lower, higher = np.floor(pos).astype(np.int64), np.ceil(pos).astype(np.int64)
        a = values[np.searchsorted(cum, base + lower + 1)].astype(np.float64)
        b = values[np.searchsorted(cum, base + higher + 1)].astype(np.float64)
        out[:, j] = np.where(a == b, a, a + (pos - lower) * (b - a))
    return out


def derive(parts, window_seconds: float, depth: int, top: int, gaps=()) -> tuple:
    """The report's tables from `compute`'s counts (a pyarrow Table): {name: pyarrow Table},
    ``size_counts`` [(size, messages)] and the summary's row (a dict). Exactly what Spark's
    aggregates over every row gave before: same columns, types, NULLs and percentiles."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    schemas = _table_schemas()
    gid = parts.column("gid")
    width = round(window_seconds * 1000) * 1000
    ts = _ts_type()

    def part(name):
        return parts.filter(pc.equal(gid, _gid(name)))

    def ints(t, col):
        return t.column(col).cast(pa.int64()).to_numpy(zero_copy_only=False)

    # per (window, size, dropped): the messages' sizes (dropped 0), drop rows (> 0), gap rows (-1)
    s = part("sizes")
    w_all, kind, size, n = ints(s, "w_us"), ints(s, "dropped"), ints(s, "size"), ints(s, "rows")
    wins, inv = np.unique(w_all, return_inverse=True)
    nw = len(wins)

    def per_window(mask, values):
        out = np.zeros(nw, np.int64)
        np.add.at(out, inv[mask], values[mask])
        return out

    msg, drop, gap = kind == 0, kind > 0, kind < 0
    messages = per_window(msg, n)
    wbytes = per_window(msg, size * n)
    dropped = per_window(drop, kind * n)
    gap_rows = per_window(gap, n)
    other = ~msg
    other_bytes = per_window(other, size * n)  # the windows table's row of the drop and gap rows
    has_other = per_window(other, n) > 0

    # windows: per (window, prefix) of the messages, and a row (prefix NULL) of a window's drop and gap rows
    k = part("prefixes").filter(pc.is_valid(part("prefixes").column("prefix")))
    kw = k.group_by(["w_us", "prefix"], use_threads=False).aggregate([("rows", "sum"), ("bytes", "sum")])
    ow = wins[has_other]
    w_us = np.concatenate((kw.column("w_us").to_numpy(zero_copy_only=False).astype(np.int64), ow))
    windows = pa.table({
        "window_start": pa.array(w_us, pa.int64()).cast(ts), "window_end": pa.array(w_us + width, pa.int64()).cast(ts),
        "prefix": pa.concat_arrays([kw.column("prefix").combine_chunks().cast(pa.string()),
                                    pa.nulls(len(ow), pa.string())]),
        "messages": pa.array(np.concatenate((ints(kw, "rows_sum"), np.zeros(len(ow), np.int64))), pa.int64()),
        "bytes": pa.array(np.concatenate((ints(kw, "bytes_sum"), other_bytes[has_other])), pa.int64()),
        "dropped": pa.array(np.concatenate((np.zeros(len(kw), np.int64), dropped[has_other])), pa.int64())})
    windows = windows.sort_by([(c, "ascending", "at_end") for c in ORDER["windows"]]).cast(schemas["windows"])

    # window_stats: per window, from its per-size counts
    sz, g_of, cnt = size[msg], inv[msg], n[msg]
    order = np.lexsort((sz, g_of))
    sz, g_of, cnt = sz[order], g_of[order], cnt[order]
    with_msgs = np.unique(g_of)  # windows with messages (the others: NULL sizes)
    starts = np.searchsorted(g_of, np.concatenate((with_msgs, [nw])))
    pct = group_percentiles(sz, cnt, starts, PERCENTILES)
    size_min = np.full(nw, -1, np.int64)
    size_max = np.full(nw, -1, np.int64)
    pcts = np.full((nw, len(PERCENTILES)), np.nan)
    if len(with_msgs):
        size_min[with_msgs] = sz[starts[:-1]]
        size_max[with_msgs] = sz[starts[1:] - 1]
        pcts[with_msgs] = pct
    has = messages > 0

    first_us = int(ints(s, "first")[msg].min()) if msg.any() else None
    last_us = int(ints(s, "last")[msg].max()) if msg.any() else None
    end_of = wins + width
    gap_us = [(_us(f), _us(t)) for f, t in gaps if f is not None]
    covered = [_covered_us(int(a), int(b), first_us, last_us, gap_us, window_seconds) for a, b in zip(wins, end_of)]
    rows = []
    for i in range(nw):
        cov = covered[i]
        m = int(messages[i])
        b = int(wbytes[i]) if has[i] else None
        rows.append({
            "window_start": int(wins[i]), "window_end": int(end_of[i]), "messages": m, "bytes": b,
            "dropped": int(dropped[i]), "gaps": int(gap_rows[i]), "covered_seconds": cov,
            "partial": cov < float(window_seconds),
            "msgs_per_s": m / cov if cov > 0 else None, "bytes_per_s": (b or 0) / cov if cov > 0 else None,
            "size_min": int(size_min[i]) if has[i] else None,
            **{f"size_p{_pname(p)}": float(pcts[i, j]) if has[i] else None for j, p in enumerate(PERCENTILES)},
            "size_max": int(size_max[i]) if has[i] else None})
    window_stats = _with_timestamps(rows, schemas["window_stats"], ("window_start", "window_end"))

    # per payload size over the whole recording
    sizes = np.unique(sz)
    per_size = np.zeros(len(sizes), np.int64)
    np.add.at(per_size, np.searchsorted(sizes, sz), cnt)
    counts = [(int(a), int(c)) for a, c in zip(sizes, per_size)]

    # the busiest second (the earliest of ties) and the busiest keys
    sec = k.group_by("sec_us", use_threads=False).aggregate([("rows", "sum"), ("bytes", "sum")])
    peak_second, peak_n, peak_b = None, 0, None
    if sec.num_rows:
        n_s, us_s = ints(sec, "rows_sum"), ints(sec, "sec_us")
        best = np.lexsort((us_s, -n_s))[0]
        peak_second, peak_n = _from_us(int(us_s[best])), int(n_s[best])
        peak_b = int(pc.max(sec.column("bytes_sum")).as_py())
    keys = part("keys").filter(pc.is_valid(part("keys").column("key"))).rename_columns(
        {"rows": "rows_sum", "bytes": "bytes_sum"})
    order = pc.sort_indices(keys, sort_keys=[("rows_sum", "descending"), ("bytes_sum", "descending"),
                                             ("key", "ascending")])  # (strings: by their bytes, as Spark)
    best = keys.take(order[:top])
    top_keys = pa.table({"key": best["key"], "messages": best["rows_sum"],
                         "bytes": best["bytes_sum"]}).cast(schemas["top_keys"])

    total = int(messages.sum())
    summary = {
        "messages": total, "bytes": int(wbytes.sum()) if total else None,
        "distinct_keys": keys.num_rows,
        "first": _from_us(first_us), "last": _from_us(last_us),
        "lost": int(dropped.sum()) if nw else None, "drop_rows": int(n[drop].sum()),
        "gaps": int(gap_rows.sum()), "peak_second": peak_second, "peak_msgs_per_s": peak_n,
        "peak_bytes_per_s": peak_b, "window_seconds": float(window_seconds), "prefix_depth": depth,
    }
    return {"windows": windows, "window_stats": window_stats, "top_keys": top_keys}, counts, summary


def _covered_us(start: int, end: int, first, last, gaps, window_seconds: float) -> float:
    """`covered_seconds` of the window [start, end) (µs), as the Spark expression computed it:
    from the first message to the last (NULLs ignored, as ``greatest``/``least`` do), less
    the gaps, in whole µs; at most the window."""
    lo = start if first is None else max(start, first)
    hi = end if last is None else min(end, last)
    cov = max(hi - lo, 0)
    for g_from, g_to in gaps:
        cov = cov - max(min(hi, g_to) - max(lo, g_from), 0)
    return min(max(cov, 0) / 1e6, float(window_seconds))


def _from_us(us):
    return None if us is None else dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(microseconds=us)


def _with_timestamps(rows, schema, ts_cols):
    """A pyarrow Table of `schema` from dict rows whose `ts_cols` are µs since the epoch."""
    import pyarrow as pa

    cols = {}
    for f in schema:
        vals = [r[f.name] for r in rows]
        if f.name in ts_cols:
            cols[f.name] = pa.array(vals, pa.int64()).cast(f.type)
        else:
            cols[f.name] = pa.array(vals, f.type)
    return pa.table(cols).cast(schema)


def summary_table(row: dict):
    """The summary's one-row table, typed and NULL-able as Spark made it (the extras, added
    as literals, are NOT NULL unless NULL)."""
    import pyarrow as pa

    ts = _ts_type()
    types = [("messages", pa.int64(), False), ("bytes", pa.int64(), True), ("distinct_keys", pa.int64(), False),
             ("first", ts, True), ("last", ts, True), ("lost", pa.int64(), True),
             ("drop_rows", pa.int64(), False), ("gaps", pa.int64(), False), ("peak_second", ts, True),
             ("peak_msgs_per_s", pa.int64(), False), ("peak_bytes_per_s", pa.int64(), True),
             ("window_seconds", pa.float64(), False), ("prefix_depth", pa.int32(), False),
             ("distinct_prefixes", pa.int64(), None), ("size_min", pa.int32(), None),
             ("size_max", pa.int32(), None),
             *[(f"size_p{_pname(p)}", pa.float64(), None) for p in SUMMARY_PERCENTILES],
             ("peak_window_start", ts, None), ("peak_window_messages", pa.int64(), None)]
    schema = _schema([(n, t, (row[n] is None) if nb is None else nb) for n, t, nb in types])
    return pa.Table.from_pylist([{n: row[n] for n, _, _ in types}], schema=schema)


def size_histogram(counts) -> list[dict]:
    """Power-of-two buckets (0, 1, 2-3, 4-7, ...) from [(size, messages)]."""
    buckets: dict[int, int] = {}
    for size, n in counts:
        b = 0 if size == 0 else size.bit_length()
        buckets[b] = buckets.get(b, 0) + n
    return [{"bucket": b, "size_from": 0 if b == 0 else 1 << (b - 1), "size_to": 0 if b == 0 else (1 << b) - 1,
             "messages": buckets[b]} for b in sorted(buckets)]


def percentiles_from_counts(counts, ps) -> list:
    """Exact percentiles of the values [(value, count)] (sorted by value): linear interpolation
    between closest ranks, as Spark's ``percentile`` and numpy's default; None when empty."""
    import numpy as np

    if not sum(n for _, n in counts):
        return [None] * len(ps)
    values = np.array([v for v, _ in counts], dtype=np.int64)
    return [float(v) for v in group_percentiles(values, np.array([n for _, n in counts], dtype=np.int64),
                                                np.array([0, len(counts)]), ps)[0]]


def busiest_window(window_stats) -> tuple:
    """(start, messages) of the window with most messages (the earliest of ties); (None, 0)."""
    best = None
    for r in window_stats:
        if r["messages"] and (best is None or r["messages"] > best["messages"]):
            best = r
    return (best["window_start"], best["messages"]) if best else (None, 0)


#: How the small tables are sorted (nulls last), after they are fetched.
ORDER = {"windows": ("window_start", "prefix"), "window_stats": ("window_start",)}


def _save(spark, table, tables: str, name: str, local: bool) -> None:
    """Write the small result `table` (pyarrow) as the table `tables`/`name`: locally a private
    Parquet file written by pyarrow, elsewhere by Spark (one file)."""
    if local:
        _write_local(table, tables, name)
    else:
        spark.createDataFrame(table).coalesce(1).write.mode("overwrite").parquet(f"{tables}/{name}")


def pa_table(rows: list[dict], schema):
    import pyarrow as pa

    return pa.Table.from_pylist(rows, schema=schema)


def _write_local(table, tables: str, name: str) -> None:
    """`table` as ``tables/name/part-00000.parquet`` (private), replacing what was there."""
    import shutil

    import pyarrow.parquet as pq

    path = os.path.join(local_path(tables), name)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)  # overwrite, as Spark's mode("overwrite")
    elif os.path.lexists(path):
        os.unlink(path)
    makedirs_private(path)
    with private_file(os.path.join(path, "part-00000.parquet"), "wb") as f:
        pq.write_table(table, f)


def _us(t: dt.datetime) -> int:
    return round(t.timestamp() * 1_000_000)


def read_gaps(spark, directory: str) -> list[dict]:
    """The recording's gap rows (an unknown number lost: the recorder stopped without
    publishing), in seq order: {seq, from, to, after_seq, recovered}. Read apart from the rest:
    ``payload`` only for them (Parquet statistics skip row groups without one)."""
    from .spark import is_remote
    from .writer import parse_gap

    if is_remote(directory):
        from pyspark.sql import functions as F

        from .spark import read_schema

        rows = [(r["seq"], _utc({"t": r["recv_time"]})["t"], bytes(r["payload"])) for r in
                spark.read.schema(read_schema()).parquet(directory).where(F.col("dropped") < 0)
                .select("seq", "recv_time", "payload").orderBy("seq").collect()]
    else:  # a local recording: pyarrow reads only the row groups whose statistics say they hold one
        rows = local_gap_rows(local_path(directory))
    out = []
    for seq, to, payload in rows:
        d = parse_gap(payload)
        try:
            frm = dt.datetime.fromisoformat(d["from"]) if d.get("from") else None
        except (TypeError, ValueError):
            frm = None
        out.append({"seq": seq, "from": frm, "to": to, "after_seq": d.get("after_seq"),
                    "recovered": d.get("recovered")})
    return out


def local_gap_rows(directory: str) -> list[tuple]:
    """[(seq, recv_time (aware UTC), payload)] of the gap rows of a local recording."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from .schema import published_files

    rows = []
    for _, _, path in published_files(directory):
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if "dropped" not in names:
            continue
        col = names.index("dropped")
        for i in range(pf.num_row_groups):
            st = pf.metadata.row_group(i).column(col).statistics
            if st is not None and st.has_min_max and st.min >= 0:
                continue
            t = pf.read_row_group(i, columns=["seq", "recv_time", "payload", "dropped"])
            t = t.filter(pc.less(t.column("dropped"), 0))
            for r in t.to_pylist():
                rows.append((r["seq"], r["recv_time"].astimezone(dt.timezone.utc), r["payload"]))
    return sorted(rows)


def covered_seconds(start: dt.datetime, end: dt.datetime, first, last, gaps=()) -> float:
    """How much of the window [start, end) the recording covers: from its first message to its
    last, less the gaps (from, to) when the recorder was down. (`compute` does the same in Spark
    for window_stats.)"""
    if first is None or last is None:
        return 0.0
    lo, hi = max(start, first), min(end, last)
    cov = max((hi - lo).total_seconds(), 0.0)
    for g_from, g_to in gaps:
        if g_from is not None:
            cov -= max((min(hi, g_to) - max(lo, g_from)).total_seconds(), 0.0)
    return min(max(cov, 0.0), (end - start).total_seconds())


def _pname(p: float) -> str:
    s = f"{p * 100:g}"
    return s.replace(".", "")  # 50, 90, 99, 999


def run(spark, directory: str, out: str, *, window_seconds: float = 60.0, depth: int = 1,
        top: int = 20, top_prefixes: int = 6, html_dir: str | None = None, log=print,
        shuffle_partitions: int | None = None, timings: dict | None = None) -> dict:
    """Compute, write the tables and the HTML report; return the summary as a dict.

    `timings` (seconds per stage) is completed and written to ``timings.json`` beside the page."""
    t0 = time.monotonic()
    timings = dict(timings or {})
    lap = [t0]

    def took(stage):
        now = time.monotonic()
        timings[stage] = round(timings.get(stage, 0) + now - lap[0], 2)
        lap[0] = now

    if shuffle_partitions:
        spark.conf.set("spark.sql.shuffle.partitions", str(int(shuffle_partitions)))
    charting = threading.Thread(target=_import_charting, name="sbus-report-matplotlib", daemon=True)
    charting.start()  # while this thread waits for Spark (issue 35: the import took 1-1.5 s after it)
    gaps = read_gaps(spark, directory)
    took("gaps")
    intervals = [(g["from"], g["to"]) for g in gaps]
    parts, df = compute(spark, directory, window_seconds, depth)
    fetched = parts.toArrow()  # the one Spark job (and its shuffle): everything else is derived here
    took("aggregate")
    tables = out.rstrip("/") + "/tables"
    local = not is_remote(tables)
    t, counts, summary = derive(fetched, window_seconds, depth, top, intervals)
    hist = size_histogram(counts)
    t["size_hist"] = pa_table(hist, _table_schemas()["size_hist"])
    collected = {name: [_utc(r) for r in table.to_pylist()] for name, table in t.items()}
    peak_start, peak_n = busiest_window(collected["window_stats"])
    pcts = percentiles_from_counts(counts, SUMMARY_PERCENTILES)
    prefixes = {r["prefix"] for r in collected["windows"] if r["prefix"] is not None}
    summary.update(distinct_prefixes=len(prefixes), size_min=counts[0][0] if counts else None,
                   size_max=counts[-1][0] if counts else None,
                   **{f"size_p{_pname(p)}": v for v, p in zip(pcts, SUMMARY_PERCENTILES)},
                   peak_window_start=peak_start, peak_window_messages=peak_n)
    t["summary"] = summary_table(summary)
    collected["summary"] = [_utc(r) for r in t["summary"].to_pylist()]
    summary = collected["summary"][0]
    took("derive")
    for name in TABLES:
        _save(spark, t[name], tables, name, local)
    took("write_tables")
    summary["gap_list"] = gaps
    span = _span(summary)
    chart_w = chart_window(span, window_seconds)
    if chart_w == window_seconds:
        collected["chart"] = collected["windows"]
    else:
        from .units import spark_interval

        collected["chart"] = [_utc(r) for r in
                              window_aggregates(df, spark_interval(chart_w), depth).toArrow().to_pylist()]
        took("chart_windows")
    html_dir = html_dir or local_path(out)
    makedirs_private(html_dir)
    charting.join()
    summary["compute_seconds"] = round(time.monotonic() - t0, 2)
    write_html(html_dir, directory, collected, window_seconds, depth, top_prefixes, chart_w)
    text = headline_text(summary)
    with private_file(os.path.join(html_dir, "summary.txt"), "w") as f:
        f.write(text + "\n")
    took("charts_and_page")
    with private_file(os.path.join(html_dir, "timings.json"), "w") as f:
        json.dump(timings, f, indent=1)
    log(text)
    return summary


def _import_charting() -> None:
    """Import what `write_html` draws with (matplotlib, its Agg backend): started beside the Spark
    job, whose wait leaves this process idle. A failure is left for `write_html` to raise."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.dates  # noqa: F401
        import matplotlib.pyplot  # noqa: F401
    except Exception:
        pass


#: Window lengths the rate chart may use (seconds).
NICE_WINDOWS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400,
                21600, 43200, 86400, 7 * 86400)
MIN_POINTS, MAX_POINTS = 20, 2000


def chart_window(span: float, window: float) -> float:
    """The rate chart's window: the report's, unless that gives fewer than `MIN_POINTS`
    points over `span` seconds (then the longest nice window that gives enough, down to
    0.1 s) or more than `MAX_POINTS` (then the shortest nice one that gives few enough)."""
    if span <= 0:
        return window
    if span / window < MIN_POINTS:
        shorter = [w for w in NICE_WINDOWS if w < window and span / w >= MIN_POINTS]
        return max(shorter) if shorter else min(window, NICE_WINDOWS[0])
    if span / window > MAX_POINTS:
        longer = [w for w in NICE_WINDOWS if w > window and span / w <= MAX_POINTS]
        return min(longer) if longer else window
    return window


def makedirs_private(path: str) -> None:
    from .writer import makedirs_private as make

    make(path)


def private_file(path: str, mode: str = "w"):
    """Open `path` for writing as a 0600 file (replacing a file or symlink of that name, never
    writing through it), whatever the umask."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return open(fd, mode)


def _utc(row: dict) -> dict:
    """PySpark hands timestamps over as naive local time; make them aware, in UTC."""
    for k, v in row.items():
        if isinstance(v, dt.datetime) and v.tzinfo is None:
            row[k] = v.astimezone(dt.timezone.utc)
    return row


# -- the human part


def _ts(t) -> str:
    if t is None:
        return "-"
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _span(s: dict) -> float:
    return (s["last"] - s["first"]).total_seconds() if s.get("first") and s.get("last") else 0.0


def _seconds_spanned(s: dict) -> int:
    """How many 1-second windows (epoch-aligned) hold the recording: the rates' basis."""
    if not s.get("first") or not s.get("last"):
        return 0
    return int(s["last"].timestamp() // 1) - int(s["first"].timestamp() // 1) + 1


def headline_text(s: dict) -> str:
    from .units import human_bytes

    span = _span(s)
    n = s["messages"]
    lost = s.get("lost") or 0
    if lost:
        share = 100.0 * lost / (n + lost)
        losses = (f"{lost:,} known lost ({share:.2g}%: dropped by the bus or the recorder, "
                  f"marked by {s.get('drop_rows') or 0:,} drop rows)")
    else:
        losses = "none known lost"
    gaps = s.get("gap_list") or []
    ngaps = s.get("gaps") or len(gaps)
    if ngaps:
        if not lost:
            losses = "none counted lost by drop rows"
        g = gaps[0] if gaps else {}
        where = (f"nothing recorded from {_ts(g.get('from')) if g.get('from') else 'the start'} to "
                 f"{_ts(g.get('to'))}, after seq {g.get('after_seq')}") if g else "see the gap rows"
        more = f"; {ngaps - 1} more below" if ngaps > 1 else ""
        losses += (f"; {ngaps} gap{'s' if ngaps > 1 else ''} of unknown size (the recorder stopped "
                   f"without publishing: {where}{more})")
    seconds = _seconds_spanned(s)
    recorded = recorded_seconds(s)
    if seconds <= 1:
        avg = (f"{n:,} msg/s (the whole recording is within one 1-second window: "
               f"{n:,} messages in {span:.3f} s)")
    elif recorded < 2.0:  # too short for a rate over its time: it could read above the peak (issue 12)
        avg = (f"{n / seconds:,.0f} msg/s (mean over the {seconds:,} one-second windows it spans: "
               f"{n:,} messages in {span:.3f} s)")
    else:
        # the basis of window_stats' msg/s: the time recorded (first to last message, gaps left
        # out), so the headline and the table agree (issue 35: 4,943 against 5,749 msg/s)
        avg = (f"{n / recorded:,.0f} msg/s (over the {recorded:,.1f} s recorded: first to last message"
               f"{', gaps left out' if gaps else ''}; window_stats' msg/s has the same basis)")
    window = s["window_seconds"]
    busiest = (f"{s['peak_window_messages']:,} messages from {_ts(s['peak_window_start'])} "
               f"({window:g} s windows")
    if span < window and _windows_spanned(s, window) <= 1:
        busiest += f"; the recording is shorter than one {window:g} s window: this is all of it)"
    else:
        busiest += ")"
    lines = [
        f"messages        {n:,} recorded, {losses}",
        f"payload bytes   {s['bytes'] or 0:,} ({human_bytes(s['bytes'] or 0)})",
        f"time span       {_ts(s['first'])} .. {_ts(s['last'])} ({span:,.1f} s)",
        f"keys            {s['distinct_keys']:,} distinct, {s['distinct_prefixes']:,} prefixes at depth {s['prefix_depth']}",
        f"average rate    {avg}",
        f"peak rate       {s['peak_msgs_per_s']:,} msg/s (second starting {_ts(s['peak_second'])}), "
        f"{human_bytes(s['peak_bytes_per_s'] or 0)}/s",
        f"busiest window  {busiest}",
        f"payload size    min {s['size_min']}, p50 {_g(s['size_p50'])}, p90 {_g(s['size_p90'])}, "
        f"p99 {_g(s['size_p99'])}, p99.9 {_g(s['size_p999'])}, max {s['size_max']} bytes",
    ]
    for g in gaps[1:] if len(gaps) > 1 else []:
        lines.append(f"gap             nothing recorded from "
                     f"{_ts(g['from']) if g.get('from') else 'the start'} to {_ts(g['to'])}, "
                     f"after seq {g.get('after_seq')} (count unknown)")
    return "\n".join(lines)


def recorded_seconds(s: dict) -> float:
    """The time the recording covers: first to last message, less the gaps (the basis of every
    average rate: the headline's and window_stats')."""
    gaps = [(g.get("from"), g.get("to")) for g in s.get("gap_list") or []]
    cov = covered_seconds(s["first"], s["last"], s["first"], s["last"], gaps) if s.get("first") else 0.0
    return cov if cov > 0 else max(_span(s), 1e-6)


def _windows_spanned(s: dict, window: float) -> int:
    if not s.get("first") or not s.get("last"):
        return 0
    return int(s["last"].timestamp() // window) - int(s["first"].timestamp() // window) + 1


def _g(v) -> str:
    return "-" if v is None else f"{v:g}"


def write_html(out: str, directory: str, t: dict, window_seconds: float, depth: int, top_prefixes: int,
               chart_seconds: float | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    charts = []
    plt.rcParams.update({"font.size": 9})

    def save(fig, name):
        with private_file(os.path.join(out, name), "wb") as f:
            fig.savefig(f, format="png")
        plt.close(fig)

    # 1. rate over time per top prefix, in the chart's window (enough points for the span)
    w = chart_seconds or window_seconds
    rows = t.get("chart", t["windows"])
    by_prefix: dict[str, int] = {}
    for r in rows:
        if r["prefix"] is not None:
            by_prefix[r["prefix"]] = by_prefix.get(r["prefix"], 0) + r["messages"]
    top = [p for p, _ in sorted(by_prefix.items(), key=lambda kv: (-kv[1], kv[0]))[:top_prefixes]]
    seen = sorted({r["window_start"] for r in rows})
    if seen:
        width = dt.timedelta(seconds=w)
        # every window from the first to the last, those without rows too: a window the recording
        # covers without a message is a 0, one it does not cover (a gap) is no point at all
        starts = [seen[0] + k * width for k in range(int((seen[-1] - seen[0]) / width) + 1)]
        series = {p: dict.fromkeys(starts, 0) for p in top}
        other = dict.fromkeys(starts, 0)
        lost = dict.fromkeys(starts, 0)
        for r in rows:
            x = r["window_start"]
            if x not in other:
                continue
            if r["prefix"] is None:
                lost[x] += r.get("dropped") or 0
            else:
                (series[r["prefix"]] if r["prefix"] in series else other)[x] += r["messages"]
        drawn = {(p or "(empty)"): series[p] for p in top}
        if any(other.values()):
            drawn["(other)"] = other
        summ = t["summary"][0]
        gaps = [(g["from"], g["to"]) for g in summ.get("gap_list") or []]
        # a point's rate is over the time the recording covers in its window (partial windows:
        # the recording's first and last, and those a gap cuts), not over the whole window
        cover = {x: covered_seconds(x, x + width, summ.get("first"), summ.get("last"), gaps) for x in starts}
        partial = [x for x in starts if 0 < cover[x] < w - 1e-9]

        def rate(values, x):
            return values[x] / cover[x] if cover[x] > 0 else None

        fig, ax = plt.subplots(figsize=(8, 3.6), dpi=90)
        marker = "o" if len(starts) < 60 else None
        styles = {}
        for name, values in drawn.items():
            # "(other)" (often many prefixes summed) is drawn first, thin and light: it must not hide
            # a prefix's line; the prefixes above it
            style = (dict(color="grey", linestyle="--", linewidth=1.0, alpha=0.6, zorder=1)
                     if name == "(other)" else dict(linewidth=1.5, zorder=3))
            styles[name] = style
            ys = [rate(values, x) for x in starts]  # None (NaN): no line through a gap
            ax.plot(starts, [float("nan") if y is None else y for y in ys], label=name, marker=marker, **style)
            px = [x for x in partial if rate(values, x) is not None]
            if px:  # partial windows: open markers
                ax.plot(px, [rate(values, x) for x in px], linestyle="none", marker="o", markersize=5,
                        markerfacecolor="white", markeredgecolor=style.get("color", ax.lines[-1].get_color()),
                        zorder=style["zorder"] + 0.5)
        for g_from, g_to in gaps:
            if g_from is not None:
                ax.axvspan(g_from, g_to, color="red", alpha=0.12, zorder=0,
                           label="gap (recorder down)" if (g_from, g_to) == gaps[0] else None)
        lost_axis = None
        if any(lost.values()):
            # known losses are a count (where the recorder learnt of them: a restart's count lands
            # in one window), never a rate over a window that did not cover them: bars on their own
            # axis, so that they cannot squash the rates
            lost_axis = ax.twinx()
            xs = [x for x in starts if lost[x]]
            lost_axis.bar(xs, [lost[x] for x in xs], width=w / 86400.0, align="edge", color="red", alpha=0.35,
                          zorder=2, label="known lost (count per window, right axis)")
            lost_axis.set_ylabel("known lost per window (count)", color="darkred")
            lost_axis.tick_params(axis="y", colors="darkred")
            lost_axis.set_ylim(bottom=0)
        x0, x1 = starts[0], starts[-1] + width
        ax.set_xlim(x0, x1)  # the axis spans the data, not the locator's idea of a range
        peak = max([v for values in drawn.values() for x in starts
                    for v in [rate(values, x)] if v is not None] or [0])
        ax.set_ylim(0, peak * 1.35 if peak > 0 else 1)  # room above the lines for the legend
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax.xaxis.get_major_locator()))
        one = " (one window: the recording is shorter than the window)" if len(starts) == 1 else ""
        ax.set_ylabel("messages / s")
        ax.set_title(f"Message rate per key prefix (depth {depth}, {w:g} s windows, UTC){one}")
        if partial:
            ax.set_xlabel("open markers: partial windows (rate over the time the recording covers)", fontsize=7)
        handles, labels = ax.get_legend_handles_labels()
        if lost_axis is not None:
            h2, l2 = lost_axis.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
            ax.set_zorder(lost_axis.get_zorder() + 1)  # the lines above the bars
            ax.patch.set_visible(False)
        ax.legend(handles, labels, fontsize=7, loc="upper right", ncol=min(3, len(labels)), framealpha=0.9)
        ax.grid(alpha=0.3)
        fig.autofmt_xdate()
        fig.tight_layout()
        lo, hi = (mdates.num2date(v).astimezone(dt.timezone.utc) for v in ax.get_xlim())
        save(fig, "rate.png")
        data = {"window_seconds": w, "report_window_seconds": window_seconds, "points": len(starts),
                "x_axis": [lo.isoformat(), hi.isoformat()], "y_axis": list(ax.get_ylim()),
                "series": {name: [[x.isoformat(), rate(values, x)] for x in starts]
                           for name, values in drawn.items()},
                "lost_per_window": [[x.isoformat(), lost[x]] for x in starts if lost[x]],
                "partial": [[x.isoformat(), cover[x]] for x in partial],
                "gaps": [[f.isoformat() if f else None, to.isoformat()] for f, to in gaps],
                "draw_order": list(drawn),
                "style": {name: {k: v for k, v in st.items()} for name, st in styles.items()}}
        with private_file(os.path.join(out, "rate.json"), "w") as f:
            json.dump(data, f, indent=1)
        charts.append(("rate.png", "Message rate over time per top prefix"))

    # 2. top keys
    if t["top_keys"]:
        keys = t["top_keys"][::-1]
        fig, ax = plt.subplots(figsize=(8, 0.5 + 0.22 * len(keys)), dpi=90)
        ax.barh([_short(r["key"]) for r in keys], [r["messages"] for r in keys], color="tab:blue")
        ax.set_xlabel("messages")
        ax.set_title("Top keys by messages")
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        save(fig, "top_keys.png")
        charts.append(("top_keys.png", "Top keys"))

    # 3. size distribution
    if t["size_hist"]:
        h = t["size_hist"]
        fig, ax = plt.subplots(figsize=(8, 3.2), dpi=90)
        labels = [_size_label(r) for r in h]
        counts = [r["messages"] for r in h]
        ax.bar(range(len(h)), counts, color="tab:green")
        ax.set_xticks(range(len(h)), labels, rotation=45, ha="right", fontsize=7)
        scale = size_scale(counts)
        title = "Payload size distribution (power-of-two buckets)"
        if scale == "log":  # the smallest bar would vanish on a linear axis: log, and say so
            ax.set_yscale("log")
            ax.set_ylim(bottom=0.5, top=max(counts) * 2)
            ax.set_ylabel("messages (log scale)")
            title += f"; log scale: counts from {min(c for c in counts if c):,} to {max(counts):,}"
        else:  # counts from zero, so bar heights compare as the counts do
            ax.set_ylim(bottom=0, top=max(counts) * 1.05)
            ax.set_ylabel("messages")
        ax.set_xlabel("payload size (bytes)")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        save(fig, "sizes.png")
        with private_file(os.path.join(out, "sizes.json"), "w") as f:
            json.dump({"scale": scale, "y_axis": list(ax.get_ylim()), "title": title,
                       "buckets": [{"label": lb, "size_from": r["size_from"], "size_to": r["size_to"],
                                    "messages": r["messages"]} for lb, r in zip(labels, h)]}, f, indent=1)
        charts.append(("sizes.png", "Payload size distribution"))

    s = t["summary"][0]
    e = html.escape
    rows_top = "".join(f"<tr><td><code>{e(r['key'])}</code></td><td>{r['messages']:,}</td>"
                       f"<td>{r['bytes'] or 0:,}</td></tr>" for r in t["top_keys"])
    rows_win = "".join(
        f"<tr><td>{_ts(r['window_start'])}</td><td>{r['messages']:,}</td><td>{r['dropped'] or 0:,}</td>"
        f"<td>{r['bytes'] or 0:,}</td>"
        f"<td>{_rate_cell(r)}</td><td>{_g(r['size_p50'])}</td><td>{_g(r['size_p90'])}</td>"
        f"<td>{_g(r['size_p99'])}</td><td>{_g(r['size_max'])}</td></tr>" for r in t["window_stats"][:500])
    more = len(t["window_stats"]) - 500
    imgs = "".join(f'<h2>{e(title)}</h2><img src="{name}" alt="{e(title)}">' for name, title in charts)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>sbus traffic report</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:1em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}td:first-child{{text-align:left}}
pre{{background:#f4f4f4;padding:.5em}}</style></head><body>
<h1>sbus traffic report</h1>
<p>Recording <code>{e(directory)}</code>; generated {_ts(dt.datetime.now(dt.timezone.utc))};
tables as Parquet under <code>tables/</code>; the charts' data in <code>rate.json</code> and
<code>sizes.json</code>.</p>
<pre>{e(headline_text(s))}</pre>
{imgs}
<h2>Top keys</h2><table><tr><th>key</th><th>messages</th><th>bytes</th></tr>{rows_top}</table>
<h2>Per window ({window_seconds:g} s)</h2>
<table><tr><th>window start (UTC)</th><th>messages</th><th>lost</th><th>bytes</th><th>msg/s</th><th>p50</th><th>p90</th>
<th>p99</th><th>max</th></tr>{rows_win}</table>
{f"<p>... and {more} more windows in tables/window_stats.</p>" if more > 0 else ""}
<script type="application/json" id="summary">{e(json.dumps(s, default=str))}</script>
</body></html>
"""
    with private_file(os.path.join(out, "index.html"), "w") as f:
        f.write(page)


#: The sizes chart goes logarithmic when the largest bucket is over this many times the smallest
#: non-empty one (the smallest would be under 1 % of the axis: invisible on a linear one).
LOG_SPREAD = 100


def size_scale(counts) -> str:
    """"linear" (from zero) unless the counts' spread needs "log"."""
    nonzero = [c for c in counts if c > 0]
    return "log" if nonzero and max(nonzero) / min(nonzero) > LOG_SPREAD else "linear"


def _rate_cell(r) -> str:
    if r.get("msgs_per_s") is None:
        return "-"
    text = f"{r['msgs_per_s']:,.1f}"
    return text + f" (partial: {r['covered_seconds']:.3g} s covered)" if r.get("partial") else text


def _short(key: str, n: int = 48) -> str:
    return key if len(key) <= n else key[: n - 1] + "…"


def _size_label(r) -> str:
    if r["bucket"] == 0:
        return "0"
    a, b = r["size_from"], r["size_to"]
    return str(a) if a == b else f"{_k(a)}–{_k(b)}"


def _k(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) in (0, (1 << 20) - 1):
        return f"{(n + 1) >> 20}M" if n % (1 << 20) else f"{n >> 20}M"
    if n >= 1024 and n % 1024 in (0, 1023):
        return f"{(n + 1) >> 10}K" if n % 1024 else f"{n >> 10}K"
    return str(n)
