"""``sbus-replay DIR --bus ADDRESS``: publish a recording again, in order.

    sbus-replay /var/lib/sbus/rec --bus /run/sbus.socket                 # as fast as possible
    sbus-replay rec --bus b.socket --speed 1                             # at the recorded pace
    sbus-replay rec --bus b.socket --key 'sensors/' --from 2026-11-22T10:00 --to 2026-11-22T11:00

Messages go out in ``seq`` order (files by name, rows by seq); drop rows
(messages the recorder knew it lost) are counted, not replayed. ``--speed
S`` keeps the recorded spacing divided by S (1 = real time); without it, as
fast as the bus takes them. ``--key`` takes sbus routing-key patterns
(repeatable; a message is replayed if any matches). ``--from``/``--to``
select ``from <= recv_time < to`` (ISO 8601, naive = UTC, or Unix seconds).
A progress bar goes to standard error when it is a terminal.

**Lossless by default.** A subscriber in the bus's default flood mode (soft
``queue``, hard ``discard``: 16,384 packets or 4 MiB queued, then dropped)
loses a replayed burst it cannot read as fast as it comes; blocking sends do
not help (the server takes our packets at once and queues them for the
subscriber). So replay paces itself by the subscribers' queues: every 512
messages (or 256 KiB) it asks the server for ``server/stats`` and, while
the fullest default-mode queue it can see is over a quarter of its limit,
waits for it to drain (to a twentieth). The stats show the queues of your
own uid's clients (all of them to root); a subscriber that does not drain
at all for 10 s is warned about once and no longer waited for.
Subscribers in ``block`` modes pace the replay through the server, those in
``discard`` modes chose to lose. ``--lossy`` replays without pacing.

When a slow subscriber sets the pace (replay has waited over a second in
total for its queue, or the bus held our sends back that long for a
block-mode subscriber), replay says so once, naming it (pid and uid), and
again at the end with the total wait.

A *gap row* in the recording (the recorder stopped without publishing: an
unknown number of messages lost) is warned about where replay crosses it,
and counted at the end.

When replay falls behind the pace ``--speed`` asks for (the bus, a slow
subscriber or replay itself), it says so on standard error: one line at
most every 5 s, and one at the end.

Exit status: 0 done, 1 bus error, 2 bad arguments or recording. Errors are one line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time

from .schema import MissingExtra, RecordingError, check_recording, require

EXIT_BUS, EXIT_USAGE = 1, 2
#: Replay says once what paces it when it has been held this many seconds (in total) by a slow
#: subscriber: waiting for a default-mode queue to drain, or in a send the bus held back.
HELD_SAY_AFTER = 1.0
#: A send that took longer than this was held back by the bus (a block-mode subscriber behind).
HELD_SEND = 0.01


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


def iter_batches(files, columns=("recv_time", "key", "payload", "seq", "dropped"), batch_rows=65536):
    """Yield pyarrow RecordBatches of the recording in seq order (``dropped`` is 0 in the
    batches of a recording made before drop rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for first, last, path in files:
        pf = pq.ParquetFile(path)
        have = set(pf.schema_arrow.names)
        for i in range(pf.num_row_groups):
            table = pf.read_row_group(i, columns=[c for c in columns if c in have])
            if "dropped" in columns and "dropped" not in have:
                table = table.append_column("dropped", pa.array([0] * table.num_rows, type=pa.int64()))
            seq = table.column("seq")
            if len(seq) > 1:
                import pyarrow.compute as pc
                if not pc.all(pc.greater(seq.slice(1), seq.slice(0, len(seq) - 1))).as_py():
                    table = table.sort_by("seq")
            yield from table.to_batches(max_chunksize=batch_rows)


def select(files, keys=(), time_from=None, time_to=None, lost=None, on_gap=None):
    """Yield (recv_us, key, payload, rows_scanned_so_far) of the selected messages, in order.

    Drop rows are not yielded; `lost` (a one-item list) adds up their counts; a gap row
    (an unknown number lost) calls ``on_gap(seq, recv_us, payload)`` where it is crossed."""
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
        drops = batch.column(4)
        marked = pc.any(pc.not_equal(drops, 0)).as_py() if n else False
        drops = drops.to_pylist() if marked else None
        base = scanned
        scanned += n
        for i, (tt, k, p) in enumerate(zip(times, ks, ps)):
            if drops is not None and drops[i]:
                if drops[i] > 0:
                    if lost is not None:
                        lost[0] += drops[i]
                elif on_gap is not None:
                    on_gap(batch.column(3)[i].as_py(), tt, p)
                continue
            if keys and not any(matches(pat, k) for pat in keys):
                continue
            yield tt, k, p, base + i + 1
    return scanned


class RateLimitedWarning:
    """One line on standard error, at most every `interval` seconds."""

    def __init__(self, stream=None, interval: float = 5.0, clock=time.monotonic, prog="sbus-replay"):
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self.prog = prog
        self._last = None
        self.lines = 0

    def __call__(self, text: str, force: bool = False) -> bool:
        now = self.clock()
        if not force and self._last is not None and now - self._last < self.interval:
            return False
        self._last = now
        self.lines += 1
        stream = self.stream or sys.stderr
        clear = "\r\x1b[K" if stream.isatty() else ""  # over a progress bar on a terminal
        stream.write(f"{clear}{self.prog}: {text}\n")
        stream.flush()
        return True


class Pacer:
    """Keeps the default-mode subscribers' queues on the server well below their limits.

    Asks ``server/stats`` every `check_packets` messages or `check_bytes` payload bytes;
    while the fullest queue of a client in soft ``queue`` / hard ``discard`` mode is over
    `high` of its limit (packets or bytes), waits (polling, 1 ms doubling to 50 ms) until
    it is under `low`. A client whose queue does not shrink for `stuck_after` seconds is
    reported once and no longer waited for.
    """

    def __init__(self, client, *, sleep=time.sleep, clock=time.monotonic, warn=None,
                 check_packets: int = 512, check_bytes: int = 256 << 10, high: float = 0.25,
                 low: float = 0.05, stuck_after: float = 10.0, say_after: float = HELD_SAY_AFTER):
        self.client = client
        self.sleep = sleep
        self.clock = clock
        self.warn = warn or (lambda text, force=False: None)
        self.check_packets = check_packets
        self.check_bytes = check_bytes
        self.high = high
        self.low = low
        self.stuck_after = stuck_after
        self.say_after = say_after
        self.said = False
        #: {(pid, uid): seconds waited for that subscriber's queue}
        self.waited_for: dict = {}
        self.ignored: set = set()
        self.waits = 0
        self.waited = 0.0
        self.checks = 0
        self._n = self._b = 0

    def sent(self, nbytes: int) -> None:
        self._n += 1
        self._b += nbytes
        if self._n >= self.check_packets or self._b >= self.check_bytes:
            self.check()

    def fullest(self) -> tuple[float, tuple | None, dict | None]:
        self.checks += 1
        st = self.client.stats(timeout=30)
        limits = st.get("limits") or {}
        max_p = limits.get("queue_packets") or 16384
        max_b = limits.get("queue_bytes") or (4 << 20)
        worst, who, row = 0.0, None, None
        for q in st.get("queues") or ():
            if q.get("soft") != "queue" or q.get("hard") != "discard":
                continue  # block modes pace us through the server; discard modes chose to lose
            ident = (q.get("pid"), q.get("uid"))
            if ident in self.ignored:
                continue
            f = max((q.get("queued_packets") or 0) / max_p, (q.get("queued_bytes") or 0) / max_b)
            if f > worst:
                worst, who, row = f, ident, q
        return worst, who, row

    def check(self) -> None:
        self._n = self._b = 0
        worst, who, row = self.fullest()
        if worst <= self.high:
            return
        self.waits += 1
        began = last_progress = self.clock()
        best = worst
        delay = 0.001
        while worst > self.low:
            self.sleep(delay)
            delay = min(delay * 2, 0.05)
            worst, who2, row2 = self.fullest()
            if who2 is not None:
                who, row = who2, row2
            now = self.clock()
            if worst < best - 0.001:
                best, last_progress = worst, now
            elif now - last_progress >= self.stuck_after:
                self.warn(f"a subscriber (pid {who[0]}, uid {who[1]}) has drained nothing for "
                          f"{self.stuck_after:g} s with {row.get('queued_packets')} packets queued: "
                          f"no longer waiting for it (it may lose messages)", force=True)
                self.ignored.add(who)
                break
        took = self.clock() - began
        self.waited += took
        if who is not None:
            self.waited_for[who] = self.waited_for.get(who, 0.0) + took
        if not self.said and self.waited > self.say_after:
            self.said = True
            self.warn(f"paced by a slow subscriber: {self.slowest()} (its queue on the bus was over "
                      f"{self.high:.0%} full; replay waits for it to drain instead of letting the bus "
                      f"drop for it; --lossy does not wait)", force=True)

    def slowest(self) -> str:
        """The subscriber waited for longest, and how long: 'pid P (uid U), waited S s'."""
        if not self.waited_for:
            return "none"
        (pid, uid), secs = max(self.waited_for.items(), key=lambda kv: kv[1])
        return f"pid {pid} (uid {uid}), waited for {secs:.1f} s so far"


def replay(directory, bus, *, keys=(), time_from=None, time_to=None, speed=None, progress=None,
           sleep=time.sleep, clock=time.monotonic, lossless: bool = True, warn=None,
           behind_threshold: float = 0.5) -> tuple[int, int]:
    """Publish the selected messages of a recording to `bus`; (messages, payload bytes).

    `lossless` paces the replay by the subscribers' queues (`Pacer`); `warn(text)` gets the
    rate-limited lines about falling behind `speed` (default: standard error)."""
    import sbus.client

    files = check_recording(directory)
    total = sum(_num_rows(path) for _, _, path in files)
    bar = progress(total) if progress else None
    warn = warn or RateLimitedWarning(clock=clock)
    client = bus if hasattr(bus, "publish") else sbus.client.connect(bus)
    pacer = Pacer(client, sleep=sleep, clock=clock, warn=warn) if lossless else None
    sent = nbytes = 0
    first_t = start = None
    scanned = 0
    lost = [0]
    gaps = []
    behind = worst_behind = 0.0
    held = 0.0  # seconds spent in sends the bus held back (block-mode subscribers behind)
    said_held = False

    def on_gap(seq, recv_us, payload):
        from .writer import parse_gap

        g = parse_gap(payload)
        gaps.append(seq)
        warn(f"crossing a gap in the recording at seq {seq}: the recorder stopped without publishing "
             f"(nothing recorded from {g.get('from') or 'the start'} to {g.get('to') or '?'}); an unknown "
             f"number of messages was lost there and cannot be replayed", force=True)

    try:
        for t, key, payload, scanned in select(files, keys, time_from, time_to, lost, on_gap):
            if speed:
                if first_t is None:
                    first_t, start = t, clock()
                else:
                    due = start + (t - first_t) / 1e6 / speed
                    delay = due - clock()
                    if delay > 0:
                        if bar:
                            bar.update(scanned, sent, nbytes, force=True)
                        sleep(delay)
                    elif -delay > behind_threshold:
                        behind = -delay
                        worst_behind = max(worst_behind, behind)
                        rate = sent / max(clock() - start, 1e-9)
                        paced = f"; waited {pacer.waited:.1f} s for slow subscribers" if pacer and pacer.waited else ""
                        warn(f"{behind:.1f} s behind the requested pace (--speed {speed:g}); "
                             f"replaying at {rate:,.0f} msg/s{paced}")
            t_send = clock()
            client.publish(key, payload)
            took = clock() - t_send
            if took > HELD_SEND:
                held += took
                if not said_held and held > HELD_SAY_AFTER:
                    said_held = True
                    warn(f"paced by the bus: it held our sends back for {held:.1f} s so far (a "
                         f"subscriber in a block flood mode is reading slowly)", force=True)
            sent += 1
            nbytes += len(payload)
            if pacer is not None:
                pacer.sent(len(key) + len(payload))
            if bar and not sent & 1023:
                bar.update(scanned, sent, nbytes)
        client.sync(timeout=30)  # everything sent has reached the server
    finally:
        if bar:
            bar.update(total, sent, nbytes, force=True)
            bar.done()
        if client is not bus:
            client.close()
    if worst_behind:
        end_late = clock() - (start + ((t - first_t) / 1e6 / speed)) if sent and first_t is not None else 0.0
        warn(f"fell behind the requested pace (--speed {speed:g}): up to {worst_behind:.1f} s, "
             f"{max(end_late, 0):.1f} s late at the end", force=True)
    if lost[0]:
        warn(f"the recording marks {lost[0]} messages as lost (drop rows): they cannot be replayed",
             force=True)
    if gaps:
        warn(f"crossed {len(gaps)} gap(s) of unknown size (at seq {', '.join(map(str, gaps))})", force=True)
    if (pacer is not None and pacer.said) or said_held:
        why = []
        if pacer is not None and pacer.said:
            why.append(f"waited {pacer.waited:.1f} s for slow subscribers' queues (slowest: "
                       f"{pacer.slowest().replace(' so far', '')})")
        if said_held:
            why.append(f"the bus held our sends back for {held:.1f} s")
        warn("the replay was paced by slow subscribers: " + "; ".join(why), force=True)
    return sent, nbytes


def _bus_problem(e: BaseException, bus) -> str:
    """One line naming the bus's address (the default one too) and what went wrong."""
    from sbus.client.address import AddressError, resolve

    try:
        where = resolve(bus).text
    except AddressError:
        where = bus or "the bus"
    text = e.strerror if isinstance(e, OSError) and e.strerror else _first_line(e)
    if isinstance(e, (FileNotFoundError, ConnectionRefusedError)):
        text += " (is sbusd running? see --bus, $SBUS_SOCKET)"
    return f"{where}: {text}"


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
                   help="bus address (default $SBUS_SOCKET, else /run/sbus.socket)")
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
    p.add_argument("--lossy", action="store_true",
                   help="do not pace by the subscribers' queues (a slow default-mode subscriber may "
                        "lose messages)")
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
    try:
        require("pyarrow")
    except MissingExtra as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_BUS
    enabled = {"auto": None, "always": True, "never": False}[args.progress]
    began = time.monotonic()
    try:
        sent, nbytes = replay(args.directory, args.bus, keys=keys, time_from=t_from, time_to=t_to,
                              speed=args.speed, progress=lambda n: Progress(n, enabled=enabled),
                              lossless=not args.lossy)
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
        print(f"{prog}: {_bus_problem(e, args.bus)}", file=sys.stderr)
        return EXIT_BUS
    if not args.quiet:
        took = time.monotonic() - began
        print(f"{prog}: replayed {sent} messages ({nbytes} payload bytes) in {took:.2f}s",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
