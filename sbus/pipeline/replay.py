"""``sbus-replay DIR --bus ADDRESS``: publish a recording again, in order.

    sbus-replay /var/lib/sbus/rec --bus /run/sbus.socket                 # as fast as possible
    sbus-replay rec --bus b.socket --speed 1                             # at the recorded pace
    sbus-replay rec --bus b.socket --key 'sensors/' --from 2026-11-22T10:00 --to 2026-11-22T11:00

Messages go out in ``seq`` order (files by name, rows by seq). ``--speed S``
keeps the recorded spacing divided by S (1 = real time); without it, as
fast as the bus takes them (a blocking send per message: the server's
back-pressure paces us). ``--key`` takes sbus routing-key patterns
(repeatable; a message is replayed if any matches). ``--from``/``--to``
select ``from <= recv_time < to`` (ISO 8601, naive = UTC, or Unix seconds).
A progress bar goes to standard error when it is a terminal.

Exit status: 0 done, 1 bus error, 2 bad arguments or recording. Errors are one line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time

from .schema import RecordingError, check_recording

EXIT_BUS, EXIT_USAGE = 1, 2


def parse_time(text: str) -> int:
    """Microseconds since the epoch from ISO 8601 (naive = UTC) or Unix seconds."""
    try:
        return round(float(text) * 1_000_000)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not a time: {text!r} (ISO 8601 like 2026-11-22T10:00:00 or Unix seconds)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return round(t.timestamp() * 1_000_000)


class Progress:
    """A one-line progress bar on a terminal (nothing otherwise)."""

    def __init__(self, total: int, stream=sys.stderr, enabled: bool | None = None):
        self.total = max(total, 1)
        self.stream = stream
        self.enabled = stream.isatty() if enabled is None else enabled
        self.start = time.monotonic()
        self._next = 0.0

    def update(self, scanned: int, sent: int, nbytes: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + 0.2
        frac = min(scanned / self.total, 1.0)
        width = 30
        bar = "#" * int(frac * width)
        rate = sent / max(now - self.start, 1e-9)
        self.stream.write(f"\r[{bar:<{width}}] {frac * 100:5.1f}%  {sent} sent, "
                          f"{nbytes / 1e6:.1f} MB, {rate:,.0f} msg/s ")
        self.stream.flush()

    def done(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def iter_batches(files, columns=("recv_time", "key", "payload", "seq"), batch_rows=65536):
    """Yield pyarrow RecordBatches of the recording in seq order."""
    import pyarrow.parquet as pq

    for first, last, path in files:
        pf = pq.ParquetFile(path)
        for i in range(pf.num_row_groups):
            table = pf.read_row_group(i, columns=list(columns))
            seq = table.column("seq")
            if len(seq) > 1:
                import pyarrow.compute as pc
                if not pc.all(pc.greater(seq.slice(1), seq.slice(0, len(seq) - 1))).as_py():
                    table = table.sort_by("seq")
            yield from table.to_batches(max_chunksize=batch_rows)


def select(files, keys=(), time_from=None, time_to=None):
    """Yield (recv_us, key, payload, rows_scanned_so_far) of the selected messages, in order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from sbus.core.patterns import matches

    scanned = 0
    for batch in iter_batches(files):
        n = batch.num_rows
        t = batch.column(0).cast(pa.int64())
        mask = None
        if time_from is not None:
            mask = pc.greater_equal(t, time_from)
        if time_to is not None:
            m = pc.less(t, time_to)
            mask = m if mask is None else pc.and_(mask, m)
        if mask is not None:
            batch = batch.filter(mask)
            t = batch.column(0).cast(pa.int64())
        times = t.to_pylist()
        ks = batch.column(1).to_pylist()
        ps = batch.column(2).to_pylist()
        base = scanned
        scanned += n
        for i, (tt, k, p) in enumerate(zip(times, ks, ps)):
            if keys and not any(matches(pat, k) for pat in keys):
                continue
            yield tt, k, p, base + i + 1
    return scanned


def replay(directory, bus, *, keys=(), time_from=None, time_to=None, speed=None, progress=None,
           sleep=time.sleep, clock=time.monotonic) -> tuple[int, int]:
    """Publish the selected messages of a recording to `bus`; (messages, payload bytes)."""
    import sbus.client

    files = check_recording(directory)
    total = sum(_num_rows(path) for _, _, path in files)
    bar = progress(total) if progress else None
    client = bus if hasattr(bus, "publish") else sbus.client.connect(bus)
    sent = nbytes = 0
    first_t = start = None
    scanned = 0
    try:
        for t, key, payload, scanned in select(files, keys, time_from, time_to):
            if speed:
                if first_t is None:
                    first_t, start = t, clock()
                else:
                    delay = start + (t - first_t) / 1e6 / speed - clock()
                    if delay > 0:
                        if bar:
                            bar.update(scanned, sent, nbytes, force=True)
                        sleep(delay)
            client.publish(key, payload)
            sent += 1
            nbytes += len(payload)
            if bar and not sent & 1023:
                bar.update(scanned, sent, nbytes)
        client.sync(timeout=30)  # everything sent has reached the server
    finally:
        if bar:
            bar.update(total, sent, nbytes, force=True)
            bar.done()
        if client is not bus:
            client.close()
    return sent, nbytes


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _num_rows(path) -> int:
    import pyarrow.parquet as pq
    return pq.ParquetFile(path).metadata.num_rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sbus-replay", description=__doc__.split("\n\n")[0])
    p.add_argument("directory", metavar="DIR", help="recording directory (rec-*.parquet)")
    p.add_argument("--bus", "-b", default=None,
                   help="bus address (default $SBUS_SOCKET, then ./sbus.socket)")
    p.add_argument("--speed", type=float, default=None,
                   help="replay at S times the recorded pace (1 = as recorded); default: as fast as possible")
    p.add_argument("--key", "-k", action="append", default=[], metavar="PATTERN",
                   help="only keys matching this sbus pattern (repeatable)")
    p.add_argument("--from", dest="time_from", default=None, metavar="TIME",
                   help="only messages received at or after TIME (ISO 8601, naive = UTC, or Unix seconds)")
    p.add_argument("--to", dest="time_to", default=None, metavar="TIME",
                   help="only messages received before TIME")
    p.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                   help="progress bar on standard error (auto: when it is a terminal)")
    p.add_argument("--quiet", "-q", action="store_true", help="no summary line")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    prog = "sbus-replay"
    try:
        if args.speed is not None and args.speed <= 0:
            raise ValueError("--speed must be positive")
        keys = [os.fsencode(k) for k in args.key]
        t_from = parse_time(args.time_from) if args.time_from else None
        t_to = parse_time(args.time_to) if args.time_to else None
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    enabled = {"auto": None, "always": True, "never": False}[args.progress]
    began = time.monotonic()
    try:
        sent, nbytes = replay(args.directory, args.bus, keys=keys, time_from=t_from, time_to=t_to,
                              speed=args.speed, progress=lambda n: Progress(n, enabled=enabled))
    except RecordingError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        import pyarrow

        if isinstance(e, pyarrow.ArrowException):
            print(f"{prog}: {args.directory}: unreadable recording: {_first_line(e)}", file=sys.stderr)
            return EXIT_USAGE
        if not isinstance(e, (OSError, ValueError)):  # connect errors, ConnectionClosed, AddressError
            print(f"{prog}: failed: {type(e).__name__}: {_first_line(e)}", file=sys.stderr)
            return EXIT_BUS
        where = args.bus or "the bus"
        text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"{prog}: {where}: {text}", file=sys.stderr)
        return EXIT_BUS
    if not args.quiet:
        took = time.monotonic() - began
        print(f"{prog}: replayed {sent} messages ({nbytes} payload bytes) in {took:.2f}s",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
