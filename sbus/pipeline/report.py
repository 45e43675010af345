"""``sbus-pipeline report DIR --out REPORT_DIR``: batch analytics over a recording.

Computes, with Spark:

``windows``       per window and key prefix: messages, payload bytes
``window_stats``  per window: messages, bytes, msg/s, bytes/s, payload size min/p50/p90/p99/max
``top_keys``      the busiest keys: messages, bytes
``size_hist``     payload sizes in power-of-two buckets
``summary``       one row: totals, time span, overall percentiles, peak rates

and writes them as Parquet tables under ``REPORT_DIR/tables/<name>/``, plus
a page for people: ``REPORT_DIR/index.html`` with PNG charts and the
headline figures, also in ``REPORT_DIR/summary.txt``.

Percentiles are exact (Spark's ``percentile``: linear interpolation between
closest ranks, as ``numpy.percentile``'s default). Windows are tumbling,
aligned to the epoch, in UTC. A key's prefix is its first ``--depth``
``/``-separated parts.
"""

from __future__ import annotations

import datetime as dt
import html
import json
import os
import time

from .spark import local_path, window_aggregates, with_prefix

PERCENTILES = (0.5, 0.9, 0.99)
SUMMARY_PERCENTILES = (0.5, 0.9, 0.99, 0.999)
TABLES = ("windows", "window_stats", "top_keys", "size_hist", "summary")


def _pct_expr(col: str, ps) -> str:
    return f"percentile({col}, array({', '.join(repr(p) for p in ps)}))"


def compute(spark, directory: str, window_seconds: float, depth: int = 1, top: int = 20):
    """Build the report's DataFrames: {name: DataFrame}."""
    from pyspark.sql import functions as F

    from .spark import read_schema
    from .units import spark_interval

    window = spark_interval(window_seconds)
    df = (spark.read.schema(read_schema()).parquet(directory)
          .select("recv_time", "key", "size")
          .cache())

    windows = window_aggregates(df, window, depth).orderBy("window_start", "prefix")

    pct = F.expr(_pct_expr("size", PERCENTILES))
    window_stats = (
        df.groupBy(F.window("recv_time", window).alias("w"))
        .agg(F.count(F.lit(1)).alias("messages"), F.sum("size").alias("bytes"),
             F.min("size").alias("size_min"), pct.alias("p"), F.max("size").alias("size_max"))
        .select(F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"),
                "messages", "bytes",
                (F.col("messages") / F.lit(window_seconds)).alias("msgs_per_s"),
                (F.col("bytes") / F.lit(window_seconds)).alias("bytes_per_s"),
                "size_min",
                F.col("p")[0].alias("size_p50"), F.col("p")[1].alias("size_p90"),
                F.col("p")[2].alias("size_p99"), "size_max")
        .orderBy("window_start")
    )

    top_keys = (
        df.groupBy(F.col("key").cast("string").alias("key"))
        .agg(F.count(F.lit(1)).alias("messages"), F.sum("size").alias("bytes"))
        .orderBy(F.desc("messages"), F.desc("bytes"), "key")
        .limit(top)
    )

    bucket = F.when(F.col("size") == 0, F.lit(0)).otherwise(
        F.floor(F.log2(F.col("size"))).cast("int") + 1)
    size_hist = (
        df.select(bucket.alias("bucket"))
        .groupBy("bucket").agg(F.count(F.lit(1)).alias("messages"))
        .select("bucket",
                F.expr("IF(bucket = 0, 0L, shiftleft(1L, bucket - 1))").alias("size_from"),
                F.expr("IF(bucket = 0, 0L, shiftleft(1L, bucket) - 1)").alias("size_to"),
                "messages")
        .orderBy("bucket")
    )

    per_second = (df.groupBy(F.window("recv_time", "1 second").alias("w"))
                  .agg(F.count(F.lit(1)).alias("n"), F.sum("size").alias("b")))
    peak_s = per_second.orderBy(F.desc("n"), "w.start").limit(1).select(
        F.col("w.start").alias("peak_second"), F.col("n").alias("peak_msgs_per_s"))
    peak_b = per_second.agg(F.max("b").alias("peak_bytes_per_s"))
    peak_w = window_stats.orderBy(F.desc("messages"), "window_start").limit(1).select(
        F.col("window_start").alias("peak_window_start"), F.col("messages").alias("peak_window_messages"))
    totals = with_prefix(df, depth).agg(
        F.count(F.lit(1)).alias("messages"), F.sum("size").alias("bytes"),
        F.countDistinct("key").alias("distinct_keys"),
        F.countDistinct("prefix").alias("distinct_prefixes"),
        F.min("recv_time").alias("first"), F.max("recv_time").alias("last"),
        F.min("size").alias("size_min"), F.max("size").alias("size_max"),
        F.expr(_pct_expr("size", SUMMARY_PERCENTILES)).alias("p"),
    ).select(
        "*", *[F.col("p")[i].alias(f"size_p{_pname(p)}") for i, p in enumerate(SUMMARY_PERCENTILES)]
    ).drop("p")
    summary = (totals.crossJoin(peak_s).crossJoin(peak_b).crossJoin(peak_w)
               .withColumn("window_seconds", F.lit(float(window_seconds)))
               .withColumn("prefix_depth", F.lit(depth)))
    return {"windows": windows, "window_stats": window_stats, "top_keys": top_keys,
            "size_hist": size_hist, "summary": summary}, df


def _pname(p: float) -> str:
    s = f"{p * 100:g}"
    return s.replace(".", "")  # 50, 90, 99, 999


def run(spark, directory: str, out: str, *, window_seconds: float = 60.0, depth: int = 1,
        top: int = 20, top_prefixes: int = 6, html_dir: str | None = None, log=print) -> dict:
    """Compute, write the tables and the HTML report; return the summary as a dict."""
    t0 = time.monotonic()
    frames, cached = compute(spark, directory, window_seconds, depth, top)
    tables = out.rstrip("/") + "/tables"
    collected = {}
    try:
        for name in TABLES:
            df = frames[name]
            # small results: one file each, collected once for the charts
            df = df.coalesce(1).cache()
            df.write.mode("overwrite").parquet(f"{tables}/{name}")
            collected[name] = [_utc(r.asDict()) for r in df.collect()]
            df.unpersist()
    finally:
        cached.unpersist()
    summary = collected["summary"][0]
    html_dir = html_dir or local_path(out)
    os.makedirs(html_dir, exist_ok=True)
    summary["compute_seconds"] = round(time.monotonic() - t0, 2)
    write_html(html_dir, directory, collected, window_seconds, depth, top_prefixes)
    text = headline_text(summary)
    with open(os.path.join(html_dir, "summary.txt"), "w") as f:
        f.write(text + "\n")
    log(text)
    return summary


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


def headline_text(s: dict) -> str:
    from .units import human_bytes

    span = (s["last"] - s["first"]).total_seconds() if s["first"] and s["last"] else 0.0
    # n messages are n - 1 intervals apart: dividing n by their span overstates the rate
    avg = (s["messages"] - 1) / span if span > 0 else float(s["messages"])
    lines = [
        f"messages        {s['messages']:,}",
        f"payload bytes   {s['bytes'] or 0:,} ({human_bytes(s['bytes'] or 0)})",
        f"time span       {_ts(s['first'])} .. {_ts(s['last'])} ({span:,.1f} s)",
        f"keys            {s['distinct_keys']:,} distinct, {s['distinct_prefixes']:,} prefixes at depth {s['prefix_depth']}",
        f"average rate    {avg:,.0f} msg/s",
        f"peak rate       {s['peak_msgs_per_s']:,} msg/s (second starting {_ts(s['peak_second'])}), "
        f"{human_bytes(s['peak_bytes_per_s'] or 0)}/s",
        f"busiest window  {s['peak_window_messages']:,} messages from {_ts(s['peak_window_start'])} "
        f"({s['window_seconds']:g} s windows)",
        f"payload size    min {s['size_min']}, p50 {s['size_p50']:g}, p90 {s['size_p90']:g}, "
        f"p99 {s['size_p99']:g}, p99.9 {s['size_p999']:g}, max {s['size_max']} bytes",
    ]
    return "\n".join(lines)


def write_html(out: str, directory: str, t: dict, window_seconds: float, depth: int, top_prefixes: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    charts = []
    plt.rcParams.update({"font.size": 9})

    # 1. rate over time per top prefix
    by_prefix: dict[str, int] = {}
    for r in t["windows"]:
        by_prefix[r["prefix"]] = by_prefix.get(r["prefix"], 0) + r["messages"]
    top = [p for p, _ in sorted(by_prefix.items(), key=lambda kv: (-kv[1], kv[0]))[:top_prefixes]]
    starts = sorted({r["window_start"] for r in t["window_stats"]})
    if starts:
        series = {p: dict.fromkeys(starts, 0) for p in top}
        other = dict.fromkeys(starts, 0)
        for r in t["windows"]:
            (series[r["prefix"]] if r["prefix"] in series else other)[r["window_start"]] += r["messages"]
        fig, ax = plt.subplots(figsize=(8, 3.6), dpi=90)
        for p in top:
            ax.plot(starts, [series[p][s] / window_seconds for s in starts], label=p or "(empty)",
                    marker="." if len(starts) < 60 else None)
        if any(other.values()):
            ax.plot(starts, [other[s] / window_seconds for s in starts], label="(other)", color="grey",
                    linestyle="--")
        ax.set_ylabel("messages / s")
        ax.set_title(f"Message rate per key prefix (depth {depth}, {window_seconds:g} s windows, UTC)")
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
        fig.autofmt_xdate()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "rate.png"))
        plt.close(fig)
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
        fig.savefig(os.path.join(out, "top_keys.png"))
        plt.close(fig)
        charts.append(("top_keys.png", "Top keys"))

    # 3. size distribution
    if t["size_hist"]:
        h = t["size_hist"]
        fig, ax = plt.subplots(figsize=(8, 3.2), dpi=90)
        labels = [_size_label(r) for r in h]
        ax.bar(range(len(h)), [r["messages"] for r in h], color="tab:green")
        ax.set_xticks(range(len(h)), labels, rotation=45, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("payload size (bytes)")
        ax.set_ylabel("messages")
        ax.set_title("Payload size distribution (power-of-two buckets)")
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "sizes.png"))
        plt.close(fig)
        charts.append(("sizes.png", "Payload size distribution"))

    s = t["summary"][0]
    e = html.escape
    rows_top = "".join(f"<tr><td><code>{e(r['key'])}</code></td><td>{r['messages']:,}</td>"
                       f"<td>{r['bytes'] or 0:,}</td></tr>" for r in t["top_keys"])
    rows_win = "".join(
        f"<tr><td>{_ts(r['window_start'])}</td><td>{r['messages']:,}</td><td>{r['bytes'] or 0:,}</td>"
        f"<td>{r['msgs_per_s']:,.1f}</td><td>{r['size_p50']:g}</td><td>{r['size_p90']:g}</td>"
        f"<td>{r['size_p99']:g}</td><td>{r['size_max']}</td></tr>" for r in t["window_stats"][:500])
    more = len(t["window_stats"]) - 500
    imgs = "".join(f'<h2>{e(title)}</h2><img src="{name}" alt="{e(title)}">' for name, title in charts)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>sbus traffic report</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:1em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}td:first-child{{text-align:left}}
pre{{background:#f4f4f4;padding:.5em}}</style></head><body>
<h1>sbus traffic report</h1>
<p>Recording <code>{e(directory)}</code>; generated {_ts(dt.datetime.now(dt.timezone.utc))};
tables as Parquet under <code>tables/</code>.</p>
<pre>{e(headline_text(s))}</pre>
{imgs}
<h2>Top keys</h2><table><tr><th>key</th><th>messages</th><th>bytes</th></tr>{rows_top}</table>
<h2>Per window ({window_seconds:g} s)</h2>
<table><tr><th>window start (UTC)</th><th>messages</th><th>bytes</th><th>msg/s</th><th>p50</th><th>p90</th>
<th>p99</th><th>max</th></tr>{rows_win}</table>
{f"<p>... and {more} more windows in tables/window_stats.</p>" if more > 0 else ""}
<script type="application/json" id="summary">{e(json.dumps(s, default=str))}</script>
</body></html>
"""
    with open(os.path.join(out, "index.html"), "w") as f:
        f.write(page)


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
