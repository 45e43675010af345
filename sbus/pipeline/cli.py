"""``sbus-pipeline``: the Spark jobs' command line (``python -m sbus.pipeline``).

    sbus-pipeline report DIR --out REPORT_DIR [--window 60s] [--depth 1] [--top 20] [--master URL]
    sbus-pipeline stream DIR --out OUT --checkpoint CP [--window 60s] [--watermark 0s]
                         [--source sbus|files] [--max-records-per-trigger N] [--max-files-per-trigger 10]
                         [--keys K1,K2 | --key K ... | --key-prefix P]
                         [--trigger 10s | --available-now [--close-at-end]] [--drop-late]
                         [--publish-to KEY_PREFIX --bus ADDRESS] [--master URL]

Also runs under ``spark-submit sbus/pipeline/cli.py report ...`` (the master
then comes from spark-submit unless --master is given). Errors: one line
on standard error, exit status 2 (usage, missing or empty directory) or 1
(the job failed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

T_PROCESS = time.monotonic()

if __package__ in (None, ""):  # spark-submit sbus/pipeline/cli.py: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from sbus.pipeline.schema import MissingExtra, RecordingError, check_recording, require  # noqa: E402
from sbus.pipeline.units import parse_duration  # noqa: E402

PROG = "sbus-pipeline"
EXIT_FAILED, EXIT_USAGE = 1, 2


def _duration(text):
    try:
        v = parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Analyse sbus recordings on Apache Spark.")
    p.add_argument("--master", default=None,
                   help="Spark master URL (default: spark-submit's, else local[*])")
    p.add_argument("--quiet", "-q", action="store_true", help="no Spark progress bar, no start-up line")
    p.add_argument("--shuffle-partitions", type=int, default=None, metavar="N",
                   help="Spark shuffle partitions (default: one per core, more for a recording over "
                        "256 MiB per core; a stream keeps the number it started with in its checkpoint)")
    sub = p.add_subparsers(dest="command", required=True, metavar="{report,stream}")

    def common(sp):
        sp.add_argument("directory", metavar="DIR", help="recording directory (rec-*.parquet)")
        sp.add_argument("--window", type=_duration, default=60.0, help="window length (default 60s)")
        sp.add_argument("--depth", type=int, default=1,
                        help="key prefix depth: the first N '/'-separated parts (default 1)")
        sp.add_argument("--master", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        sp.add_argument("--quiet", "-q", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        sp.add_argument("--shuffle-partitions", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    r = sub.add_parser("report", help="batch report: Parquet tables + HTML page with charts")
    common(r)
    r.add_argument("--out", "-o", required=True, metavar="REPORT_DIR")
    r.add_argument("--top", type=int, default=20, help="how many top keys (default 20)")
    r.add_argument("--top-prefixes", type=int, default=6, help="prefixes drawn in the rate chart")
    r.add_argument("--html-dir", default=None,
                   help="local directory for index.html and the PNGs (default REPORT_DIR; "
                        "needed when REPORT_DIR is not a local path)")

    s = sub.add_parser("stream", help="Structured Streaming window aggregates into a Parquet sink")
    common(s)
    s.add_argument("--out", "-o", required=True, metavar="OUT")
    s.add_argument("--checkpoint", required=True, metavar="CP")
    s.add_argument("--watermark", type=_duration, default=0.0,
                   help="how late a message may be recorded and still count (default 0s)")
    s.add_argument("--source", choices=("sbus", "files"), default="sbus",
                   help="sbus (default): published files and the live journal, seq offsets; files: "
                        "Spark's file source over the published files only (for a recording on "
                        "hdfs://, s3a://, ... that the sbus source cannot read)")
    s.add_argument("--max-records-per-trigger", type=int, default=None, metavar="N",
                   help="sbus source: at most N rows per micro-batch (default: all available)")
    s.add_argument("--max-files-per-trigger", type=int, default=10, metavar="N",
                   help="--source files: at most N files per micro-batch (default 10)")
    s.add_argument("--keys", action="append", default=None, metavar="K1,K2",
                   help="sbus source: only the messages with one of these keys (comma-separated; "
                        "repeatable), and every drop and gap row")
    s.add_argument("--key", action="append", default=None, metavar="K", dest="key",
                   help="sbus source: like --keys, one key as written (for a key with a comma; repeatable)")
    s.add_argument("--key-prefix", default=None, metavar="P",
                   help="sbus source: only the messages whose key starts with P, and every drop and gap row")
    s.add_argument("--drop-late", action="store_true",
                   help="accept that Spark drops rows later than the watermark (counted and said; "
                        "without it such a run exits 1)")
    t = s.add_mutually_exclusive_group()
    t.add_argument("--trigger", default=None, metavar="INTERVAL", help="micro-batch interval, e.g. '10 seconds'")
    t.add_argument("--available-now", action="store_true",
                   help="process the files present now, then stop (for cron)")
    s.add_argument("--close-at-end", action="store_true",
                   help="with --available-now (sbus source): also close the windows the watermark has "
                        "not passed (the last ones), so the run writes them; rows recorded later for "
                        "them come too late (for a finished recording)")
    s.add_argument("--publish-to", default=None, metavar="NAME",
                   help="also publish each finished window on the bus under _pipeline/NAME/<prefix> "
                        "(the recorder does not record _pipeline/ unless asked to)")
    s.add_argument("--bus", default=None, help="bus address for --publish-to")
    return p


def main(argv=None) -> int:
    started_at = time.monotonic()
    args = build_parser().parse_args(argv)
    from sbus.pipeline.spark import is_remote

    if args.depth < 0:
        print(f"{PROG}: --depth must be 0 or more", file=sys.stderr)
        return EXIT_USAGE
    if args.window <= 0:
        print(f"{PROG}: --window must be positive", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "stream" and args.close_at_end and not args.available_now:
        print(f"{PROG}: --close-at-end needs --available-now", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "stream" and args.close_at_end and args.source != "sbus":
        print(f"{PROG}: --close-at-end needs the sbus source (not --source files)", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "stream" and args.source == "sbus" and is_remote(args.directory):
        print(f"{PROG}: {args.directory}: the sbus source reads a local directory (or one every "
              f"executor mounts); use --source files for a remote store", file=sys.stderr)
        return EXIT_USAGE
    for name in ("max_records_per_trigger", "max_files_per_trigger"):
        if args.command == "stream" and getattr(args, name) is not None and getattr(args, name) <= 0:
            print(f"{PROG}: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return EXIT_USAGE
    if args.command == "stream":
        try:
            keys = _stream_keys(args)
        except ValueError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return EXIT_USAGE
    if args.shuffle_partitions is not None and args.shuffle_partitions <= 0:
        print(f"{PROG}: --shuffle-partitions must be positive", file=sys.stderr)
        return EXIT_USAGE
    try:
        require("pyspark")
        require("pyarrow")
        if args.command == "report":
            require("matplotlib")
    except MissingExtra as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_FAILED
    data_bytes = None
    if not is_remote(args.directory):
        try:
            files = check_recording(args.directory[7:] if args.directory.startswith("file://") else args.directory,
                                    allow_empty=args.command == "stream" and args.source == "sbus")
        except RecordingError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return EXIT_USAGE
        data_bytes = sum(_size(path) for _, _, path in files)
    if args.command == "report" and is_remote(args.out) and not args.html_dir:
        print(f"{PROG}: --out {args.out} is not a local path: give --html-dir for the HTML page",
              file=sys.stderr)
        return EXIT_USAGE
    # what this process writes (the HTML page, the publisher's state) and the JVM it starts
    # create private files; Spark's own writes get Hadoop's umask 077 (see spark.session)
    os.umask(0o077)
    try:
        from sbus.pipeline.spark import session, shuffle_partitions

        if not args.quiet:
            print(f"{PROG}: {_starting_line(args.master)}", file=sys.stderr, flush=True)
        started = time.monotonic()
        spark = session(args.master, app_name=f"sbus-pipeline {args.command}", progress=not args.quiet)
        spark.sparkContext.setLogLevel("WARN")
        started = time.monotonic() - started
        _note_started()
    except Exception as e:
        print(f"{PROG}: cannot start Spark: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    partitions = args.shuffle_partitions or os.environ.get("SBUS_SHUFFLE_PARTITIONS")
    if not partitions:
        partitions = shuffle_partitions(spark.sparkContext.defaultParallelism, data_bytes)
    try:
        if args.command == "report":
            from sbus.pipeline import report

            report.run(spark, args.directory, args.out, window_seconds=args.window, depth=args.depth,
                       top=args.top, top_prefixes=args.top_prefixes, html_dir=args.html_dir,
                       shuffle_partitions=int(partitions),
                       timings={"cli_setup": round(started_at - T_PROCESS, 2),
                                "spark_session": round(started, 2)})
            print(f"{PROG}: report written to {args.html_dir or args.out}/index.html", file=sys.stderr)
        else:
            from sbus.pipeline import stream

            stream.run(spark, args.directory, args.out, args.checkpoint, window_seconds=args.window,
                       depth=args.depth, watermark_seconds=args.watermark, source=args.source,
                       max_records_per_trigger=args.max_records_per_trigger, drop_late=args.drop_late,
                       max_files_per_trigger=args.max_files_per_trigger, trigger=args.trigger,
                       available_now=args.available_now, publish_to=args.publish_to, bus=args.bus,
                       shuffle_partitions=int(partitions), close_at_end=args.close_at_end,
                       keys=keys, key_prefix=args.key_prefix,
                       log=lambda text: print(f"{PROG}: {text}", file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get("SBUS_DEBUG"):
            raise
        print(f"{PROG}: {args.command} failed: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        try:
            spark.stop()
        except Exception:
            pass
    return 0


def _stream_keys(args) -> list[str] | None:
    """The keys of ``--keys``/``--key`` (None: neither); ValueError (one line) for a bad combination
    or an empty key. The source takes them as a JSON list, so a key may hold a comma."""
    given = [k for text in args.keys or () for k in text.split(",")] + list(args.key or ())
    if not (args.keys or args.key or args.key_prefix is not None):
        return None
    if args.source != "sbus":
        raise ValueError("--keys, --key and --key-prefix need the sbus source (not --source files)")
    if args.key_prefix is not None:
        if args.keys or args.key:
            raise ValueError("give --keys/--key or --key-prefix, not both")
        if not args.key_prefix:
            raise ValueError("--key-prefix is empty (leave it out to read every key)")
        return None
    if "" in given:
        raise ValueError("--keys/--key: an empty key (keys are separated by commas)")
    return given


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _stamp() -> str:
    """A file that says Spark has started on this machine (for this pyspark) before."""
    import pyspark

    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "sbus", f"spark-{pyspark.__version__}-started")


def _starting_line(master: str | None) -> str:
    where = master or ("the spark-submit master" if _under_spark_submit() else "local[*]")
    line = f"starting Spark ({where})"
    try:
        first = not os.path.exists(_stamp())
    except Exception:
        first = False
    if first:
        line += ("; the first start on this machine is slow (the JVM loads Spark's jars from a cold "
                 "disk cache and fills the Ivy cache): allow up to a minute")
    return line


def _under_spark_submit() -> bool:
    from sbus.pipeline.spark import under_spark_submit

    return under_spark_submit()


def _note_started() -> None:
    try:
        path = _stamp()
        from sbus.pipeline.writer import makedirs_private

        makedirs_private(os.path.dirname(path))
        with open(path, "a"):
            pass
    except Exception:
        pass


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else type(e).__name__
    return first[:500]


if __name__ == "__main__":
    sys.exit(main())
