"""``twistd sbus-record``: record bus traffic into Parquet files.

    twistd -n sbus-record --bus /run/sbus.socket --out /var/lib/sbus/rec [--pattern P ...] [--lossy]

The bus keeps nothing; this service subscribes (default: the empty pattern,
i.e. all traffic, with ``!/cred/`` keys and the pipeline's own ``_pipeline/``
output filtered out) and hands every message to a writer thread
(`sbus.pipeline.writer.RecordingWriter`) through a bounded queue. The
reactor only parses, stamps and enqueues: it never touches the disk. Files
are published atomically (see the writer).

Nothing is lost silently:

* **lossless by default**: the recorder asks the bus for
  ``blocking/soft/block`` and ``blocking/hard/block``, so when it cannot
  keep up the server holds back the publishers feeding it; and when its own
  queue to the writer is full it stops reading its socket (which is how the
  bus learns that it is behind) until the queue has drained to half;
* ``--lossy``: a recorder that must never slow the bus: the server's
  default modes (queue, then discard), and a full queue drops messages;
* every loss is counted, logged (one line per report interval while it
  lasts) and **marked in the recording by a drop row** (``dropped`` = how
  many, ``key``/``payload`` = first/last lost key): messages the bus dropped
  for us (``CMSG server/dropped`` notices), messages our queue dropped
  (``--lossy``), and rows lost to a write error;
* the final log line counts recorded, lost (bus, queue, write errors) and
  filtered messages.

What a crash loses: published files (``DIR/rec-*.parquet``) are complete and
never change; the file being written has a journal (``_tmp/*.arrows``, see
the writer) that reaches the kernel with every batch the writer takes, so a
restart after a crash (or ``kill -9``) **recovers** its rows and publishes
them. Lost are the rows still queued for the writer (up to
``--queue-bytes``) and whatever was published while no recorder ran. The
bus counts the latter for the recorder's session (``server/session``,
``--session-linger``), and the next recorder marks it with a drop row of
that count. The former nobody counted, so the restart also writes a **gap row** (``dropped`` = -1,
its payload a JSON description: after which seq, between which times) and
logs it; the report's headline names it, replay warns when it crosses it,
the stop line counts it. A clean stop (SIGTERM/SIGINT) publishes
everything first. While
disconnected from the bus nothing is recorded (the bus keeps no messages for
absent clients); the service reconnects with back-off and logs each
disconnect and reconnect.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import deque

from twisted.internet import defer, threads
from twisted.logger import Logger
from twisted.python import usage

from sbus.core import codec
from sbus.core.credentials import SECRET_ROOT
from sbus.core.patterns import matches
from sbus.options import METRICS_OPTION, MISSING_BUS_HELP, RespelledOptions, session_name_option
from sbus.services.chassis import Chassis
from sbus.pipeline.schema import (
    DEFAULT_ROLL_AGE,
    DEFAULT_ROLL_BYTES,
    DEFAULT_ROW_GROUP_BYTES,
    GAP,
    PIPELINE_PREFIX,
    ROW_OVERHEAD,
    MissingExtra,
    require,
)
from sbus.pipeline.units import parse_duration, parse_size

log = Logger(namespace="sbus.record")
#: Seconds the last round trip with the bus may take when the recorder stops (see `_lastSync`).
STOP_SYNC = 5.0

DEFAULT_QUEUE_BYTES = 64 << 20
DEFAULT_REPORT_INTERVAL = 10.0
#: How long the bus counts for a recorder that went away (`server/session`), seconds.
DEFAULT_SESSION_LINGER = 60.0
#: How long the recorder stays lossy after the bus disconnected it as ``stalled``.
DEGRADED_FOR = 60.0

class DropRow(tuple):
    """``(recv_us, seq, count, first_key, last_key)``: `count` messages lost at this point."""

    __slots__ = ()


class BoundedWriter:
    """A worker thread that owns a `RecordingWriter`, fed through a bounded queue.

    `offer` (the reactor's side) never blocks. When the bytes queued would
    exceed `max_bytes`: a lossy sink drops the row and counts it; a lossless
    one (`on_full` given) keeps it and calls ``on_full(True)`` (the recorder
    stops reading the bus), then ``on_full(False)`` from the reactor thread
    once the worker has drained the queue to half. The two byte counters are
    each written by one thread only, so no lock is needed on the hot path.
    """

    def __init__(self, writer, max_bytes: int = DEFAULT_QUEUE_BYTES,
                 on_done=None, report=None, tick: float = 0.05, on_full=None, call_in_reactor=None):
        self.writer = writer
        self.max_bytes = max_bytes
        self.on_done = on_done or (lambda: None)
        self.report = report or (lambda text: None)
        self.tick = tick
        self.on_full = on_full
        self.call_in_reactor = call_in_reactor or (lambda f, *a: f(*a))
        self._queue: deque = deque()
        self._enq_bytes = 0  # reactor thread only
        self._deq_bytes = 0  # worker thread only
        self._wake = threading.Event()
        self._stopping = False
        #: Lossless: reading is paused until the worker drains (reactor thread writes it).
        self.full = False
        self._resume_asked = False
        self.accepted = 0
        self.dropped = 0
        self.dropped_bytes = 0
        self.write_errors = 0
        self.lost_rows = 0  # messages discarded after a write error
        self._loss = None  # (first seq, last seq, count) of a write error not yet marked by a drop row
        self.paused_times = 0
        #: Test hook: while set, the worker does not take rows (simulates a slow disk).
        self.paused = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sbus-record-writer", daemon=True)

    @property
    def lossless(self) -> bool:
        return self.on_full is not None

    @property
    def queued_bytes(self) -> int:
        return self._enq_bytes - self._deq_bytes

    @property
    def taken_bytes(self) -> int:
        """Bytes of every row taken into the queue since start (keys, payloads, row overhead)."""
        return self._enq_bytes

    def start(self):
        self._thread.start()
        return self

    def has_room(self, cost: int) -> bool:
        return self._enq_bytes - self._deq_bytes + cost <= self.max_bytes

    def offer(self, recv_us: int, seq: int, key: bytes, payload: bytes) -> bool:
        cost = len(key) + len(payload) + ROW_OVERHEAD
        if self._enq_bytes - self._deq_bytes + cost > self.max_bytes:
            if self.on_full is None:
                self.dropped += 1
                self.dropped_bytes += len(key) + len(payload)
                return False
            if not self.full:
                self.full = True
                self.paused_times += 1
                self.on_full(True)
        self._queue.append((recv_us, seq, key, payload))
        self._enq_bytes += cost
        self.accepted += 1
        if not self._wake.is_set():
            self._wake.set()
        return True

    def offer_drop(self, recv_us: int, seq: int, count: int, first: bytes, last: bytes) -> None:
        """Queue a drop row (always: it is small, and a loss must never go unmarked)."""
        self._queue.append(DropRow((recv_us, seq, count, first, last)))
        self._enq_bytes += len(first) + len(last) + ROW_OVERHEAD
        self._wake.set()

    def _resume(self) -> None:  # reactor thread
        self._resume_asked = False
        if self.full and self.queued_bytes <= self.max_bytes:
            self.full = False
            self.on_full(False)

    def stop(self) -> None:
        """Ask the worker to write everything queued, publish, and end."""
        self._stopping = True
        self.paused.clear()
        self._wake.set()

    def join(self, timeout=None) -> None:
        self._thread.join(timeout)

    def _run(self):
        queue, writer = self._queue, self.writer
        low = self.max_bytes // 2
        try:
            while True:
                timeout = self.tick
                left = writer.seconds_to_roll()
                if left is not None:
                    timeout = min(timeout, left)
                self._wake.wait(timeout)
                self._wake.clear()
                stopping = self._stopping
                while queue and not self.paused.is_set():
                    batch = []
                    cost = 0
                    for _ in range(min(len(queue), 8192)):
                        row = queue.popleft()
                        if row.__class__ is DropRow:
                            cost += len(row[3]) + len(row[4]) + ROW_OVERHEAD
                            self._write(batch)
                            batch = []
                            if not self._mark_loss():
                                self._lose([row])
                                continue
                            try:
                                writer.add_drop(*row)
                            except Exception as e:
                                self._write_failed(e, [row] if writer.last_taken_seq() != row[1] else [])
                            continue
                        batch.append(row)
                        cost += len(row[2]) + len(row[3]) + ROW_OVERHEAD
                    self._write(batch)
                    self._deq_bytes += cost
                    if self.full and not self._resume_asked and self.queued_bytes <= low:
                        self._resume_asked = True
                        self.call_in_reactor(self._resume)
                try:
                    if self._mark_loss():  # once the disk takes it again, even without traffic
                        writer.tick()
                except Exception as e:
                    self._write_failed(e)
                if stopping and not queue:
                    break
            for _ in range(2):  # a failed close leaves its drop row in a new file: publish that one
                try:
                    self._mark_loss()
                    writer.close()
                    break
                except Exception as e:
                    self._write_failed(e)
        finally:
            self.on_done()

    def _write(self, batch) -> None:
        if batch:
            if not self._mark_loss():
                self._lose(batch)
                return
            try:
                self.writer.extend(batch)
            except Exception as e:  # disk full, permissions, ...
                # the rows of the batch after the one that failed were never taken: lost too
                last = self.writer.last_taken_seq()
                self._write_failed(e, [r for r in batch if last is None or r[1] > last])

    def _write_failed(self, e: Exception, untaken=()) -> None:
        """Discard the unpublished file and count what it held, with the `untaken` rows, as one
        loss, marked by a drop row after them (`_mark_loss`)."""
        last = self.writer.last_taken_seq()
        first, lost = self.writer.abandon()
        messages = self.writer.abandoned_messages
        if first is not None:
            self._add_loss(first, last, lost)
        messages += self._lose(untaken, counted=False)
        self.write_errors += 1
        self.report(f"write failed ({type(e).__name__}: {e}); discarded the unpublished file "
                    f"({messages} messages; the drop row marks {self._loss[2] if self._loss else 0}); "
                    f"continuing")
        self.lost_rows += messages  # the carried drop rows' counts are counted where they began
        self._mark_loss()

    def _lose(self, rows, counted: bool = True) -> int:
        """Add `rows` (never written) to the loss to mark; the messages among them (counted in
        `lost_rows` unless the caller does)."""
        messages = 0
        for r in rows:
            drop = r.__class__ is DropRow
            messages += not drop
            self._add_loss(r[1], r[1], max(r[2], 0) if drop else 1)
        if counted:
            self.lost_rows += messages
        return messages

    def _add_loss(self, first: int, last: int, count: int) -> None:
        if self._loss is not None:
            first, last, count = min(first, self._loss[0]), max(last, self._loss[1]), count + self._loss[2]
        self._loss = (first, last, count)

    def _mark_loss(self) -> bool:
        """Write the drop row of the pending loss (`RecordingWriter.add_loss`: at its last seq, so
        offsets stay increasing and unique). False while the disk refuses it: it stays pending,
        and what comes meanwhile joins it (a row written before it would take a lower seq)."""
        if self._loss is None:
            return True
        first, last, count = self._loss
        if count:
            try:
                self.writer.add_loss(time.time_ns() // 1000, first, last, count)
            except Exception:
                self.writer.abandon()  # the file held only this drop row
                return False
        self._loss = None
        return True


class Recorder:
    """What the reactor does per message: filter, number, stamp, enqueue, mark losses."""

    def __init__(self, sink: BoundedWriter, next_seq: int, record_secrets: list[bytes] = (),
                 exclude: list[bytes] = ()):
        self.sink = sink
        self.next_seq = next_seq
        self.secret_patterns = [p for p in record_secrets]
        exclude = list(exclude)
        # a pattern ending in '/' without '*' is a prefix: str.startswith does it
        self.exclude_prefixes = tuple(p for p in exclude if p.endswith(b"/") and b"*" not in p)
        self.exclude_patterns = [p for p in exclude if p not in self.exclude_prefixes]
        self.received = 0
        self.filtered = 0  # secret keys not asked for
        self.excluded = 0  # --exclude (default: the pipeline's own output)
        self.bus_dropped = 0  # counted from the server's drop notices
        self.notices = 0
        self.gaps = 0  # gap rows written (an unclean stop before this start)
        #: Messages the bus counted for us while no recorder was connected (`server/session`).
        self.missed_away = 0
        #: A run of messages our full queue dropped (lossy), not yet marked: [count, first, last, t]
        self.lost_run = None
        self._time_ns = time.time_ns

    def record(self, key: bytes, payload: bytes, match_pattern=lambda p: p) -> None:
        if key.startswith(SECRET_ROOT) and not any(
                matches(match_pattern(p), key) for p in self.secret_patterns):
            self.filtered += 1
            return
        if (self.exclude_prefixes and key.startswith(self.exclude_prefixes)) or (
                self.exclude_patterns and any(matches(p, key) for p in self.exclude_patterns)):
            self.excluded += 1
            return
        self.received += 1
        now = self._time_ns() // 1000
        run = self.lost_run
        if run is not None:
            if not self.sink.has_room(len(key) + len(payload) + 2 * ROW_OVERHEAD + len(run[1]) + len(run[2])):
                self.sink.dropped += 1
                self.sink.dropped_bytes += len(key) + len(payload)
                run[0] += 1
                run[2] = key
                return
            self.mark_lost_run()
        if self.sink.offer(now, self.next_seq, key, payload):
            self.next_seq += 1
        else:
            self.lost_run = [1, key, key, now]

    def mark_lost_run(self) -> None:
        """Write the drop row for the run of messages our queue dropped."""
        run, self.lost_run = self.lost_run, None
        if run is not None:
            self.sink.offer_drop(run[3], self.next_seq, run[0], run[1], run[2])
            self.next_seq += 1

    def mark_gap(self, recv_us: int, description: bytes) -> int:
        """A gap row: an unknown number of messages lost here (a crash); its seq."""
        self.mark_lost_run()
        self.gaps += 1
        seq = self.next_seq
        self.sink.offer_drop(recv_us, seq, GAP, b"", description)
        self.next_seq += 1
        return seq

    def missed_while_away(self, count: int) -> None:
        """The bus counted `count` messages published for us while no recorder was connected (a
        restart, a reconnection): one drop row with that count, where we learned it (the keys
        are not known: they are empty)."""
        self.mark_lost_run()
        self.missed_away += count
        self.sink.offer_drop(self._time_ns() // 1000, self.next_seq, count, b"", b"")
        self.next_seq += 1

    def dropped_by_bus(self, count: int, first: bytes, last: bytes) -> None:
        """A drop notice: the bus dropped `count` messages meant for us."""
        self.mark_lost_run()
        self.bus_dropped += count
        self.notices += 1
        self.sink.offer_drop(self._time_ns() // 1000, self.next_seq, count, first, last)
        self.next_seq += 1


def _show(key: bytes) -> str:
    text = key[:80].decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text) + ("..." if len(key) > 80 else "")


class RecordService(Chassis):
    name = kind = "sbus-record"
    log = log

    def __init__(self, bus, out: str, patterns: list[bytes], *, roll_bytes=DEFAULT_ROLL_BYTES,
                 roll_age=DEFAULT_ROLL_AGE, row_group_bytes=DEFAULT_ROW_GROUP_BYTES,
                 queue_bytes=DEFAULT_QUEUE_BYTES, retain_age=None, retain_bytes=None,
                 compression="snappy", report_interval=DEFAULT_REPORT_INTERVAL, lossy=False,
                 exclude=(PIPELINE_PREFIX,), session: bytes | None = None,
                 session_linger: float = DEFAULT_SESSION_LINGER, reactor=None):
        super().__init__(bus, stats_interval=report_interval, reactor=reactor)
        self.out = out
        self.patterns = patterns or [b""]
        self.settings = dict(roll_bytes=roll_bytes, roll_age=roll_age, row_group_bytes=row_group_bytes,
                             retain_age=retain_age, retain_bytes=retain_bytes, compression=compression)
        self.queue_bytes = queue_bytes
        self.lossy = lossy
        self.exclude = list(exclude)
        #: `server/session`: its name (default: the recording directory) and linger (0: none).
        self.session = session or codec.session_name(f"sbus-record {os.path.abspath(out)}")
        self.session_linger = session_linger
        self.client = None
        #: The connection that answers ``sbus/services/stats`` (`sbus.services.svcstats`).
        self.control = None
        self.sink: BoundedWriter | None = None
        self.recorder: Recorder | None = None
        self._done: defer.Deferred | None = None
        self._recovering: defer.Deferred | None = defer.succeed(None)
        self._last = (0, 0)
        self._last_bus = (0, 0)  # (messages, notices) at the last log line
        self._last_bus_line = None  # when the last bus-drop line was logged
        self._bus_run = None  # [first key, last key] since the last line
        self._held = 0  # times we held the bus back, at the last report
        #: After the bus cut us off for holding publishers too long (its hold budget): lossy a while.
        self.degraded = False
        self.degraded_for = DEGRADED_FOR
        self._restore_call = None

    def statsName(self) -> str:
        return os.path.abspath(self.out)

    def _from_thread(self, text: str) -> None:
        self.reactor.callFromThread(log.info, "{text}", text=text)

    def setUp(self):
        from sbus.pipeline.writer import RecordingWriter

        # recovery (publishing a crashed run's journal) runs on a thread once we are subscribed:
        # a big journal must not keep us off the bus (issue 35: 23 s away for 263 MB)
        writer = RecordingWriter(self.out, log=self._from_thread, recover_later=True, **self.settings)
        found = writer.recovery
        self._done = defer.Deferred()
        self.sink = BoundedWriter(writer, self.queue_bytes, report=self._from_thread,
                                  on_done=lambda: self.reactor.callFromThread(self._done.callback, None),
                                  on_full=None if self.lossy else lambda full: self.client.pauseReading(full),
                                  call_in_reactor=self.reactor.callFromThread)
        secret = [p for p in self.patterns if p.startswith(SECRET_ROOT)]
        self.recorder = rec = Recorder(self.sink, writer.next_seq, secret, self.exclude)
        if found.unclean:
            self._markCrash(writer)
        self.sink.start()
        log.info("recording {patterns} from {bus} into {out} (next seq {seq}; roll at {rb} bytes "
                 "or {ra}s; queue {qb} bytes; {mode}; not recording {excl})",
                 patterns=b", ".join(p or b'""' for p in self.patterns).decode("utf-8", "replace"),
                 bus=self.bus or "(default address)", out=self.out, seq=writer.next_seq,
                 rb=self.settings["roll_bytes"], ra=self.settings["roll_age"], qb=self.queue_bytes,
                 mode="lossy: the bus discards for us when we are behind" if self.lossy else
                      "lossless: publishers are held back when we are behind",
                 excl=", ".join(_show(p) for p in [SECRET_ROOT, *self.exclude]))
        # stats requests on a connection of their own: the recording one may hold the bus
        # (lossless, writer full) or be paused, and must not count them as missed
        self.control = self.connect(stats=True, quiet=True, maxDelay=5.0)
        linger = self.session_linger > 0
        self.client = self.connect(
            subscribe=self.patterns, maxDelay=5.0, misses=not linger,
            session=(self.session, self.session_linger, False) if linger else None,
            flood=dict(soft="queue", hard="discard") if self.lossy else dict(soft="block", hard="block"),
            message=lambda key, payload, proto: rec.record(key, payload, proto.stored_pattern),
            dropped=self.dropNotice, notice=lambda n: self.disconnectNotice(n.reason, n.text),
            lost=self.connectionLost, claimed=self.sessionClaimed,
            ready=lambda proto: log.info("connected to the bus as {who}; subscribed", who=self.who(proto)))
        self._recovering = threads.deferToThreadPool(self.reactor, self.reactor.getThreadPool(), writer.recover)
        self._recovering.addCallbacks(self._recovered, lambda f: log.failure("recovering the journal failed", f))

    def sessionClaimed(self, reply) -> None:
        if reply.state == "resumed" and reply.missed:
            self.recorder.missed_while_away(reply.missed)

    def connectionLost(self, reason) -> None:
        if self.running and self.sink.full and not self.lossy and not self.degraded:
            # cut off while we held the publishers: the bus's hold budget (its disconnect
            # notice may not get through a full socket)
            self._degrade()

    def dropNotice(self, count: int, first: bytes, last: bytes) -> None:
        """CMSG server/dropped (the client has parsed it): mark it, count it, log it."""
        if count > 0:
            self.recorder.dropped_by_bus(count, first, last)
            self.noticeReceived(count, first, last)

    def _recovered(self, found) -> None:
        """Say what recovery found in ``_tmp/`` (it ran beside the new traffic)."""
        tmp = self.sink.writer.tmp
        for name, rows, published in found.recovered:
            log.warn("recovered {rows} messages from the unpublished leftover {name} in {tmp} "
                     "(the last run stopped without publishing it): published as {published}",
                     rows=rows, name=name, tmp=tmp, published=published)
        if found.removed:
            log.warn("removed {n} unpublished leftover(s) from {tmp}: {names}",
                     n=len(found.removed), tmp=tmp,
                     names="; ".join(f"{name} ({why})" for name, why in found.removed))

    def _markCrash(self, writer) -> None:
        """The last run did not stop cleanly: what it had not written and what was published
        while no recorder ran are lost, how many is unknown. One gap row marks it."""
        import json

        recv_us, count, key, payload = writer.gap_row(time.time_ns() // 1000)
        seq = self.recorder.mark_gap(recv_us, payload)
        gap = json.loads(payload)
        log.warn("the last run did not stop cleanly (crash or kill -9): the messages it had not yet "
                 "written and those published before this start are lost, how many is unknown; "
                 "marked by a gap row at seq {seq} (after seq {after}, between {t0} and {t1}; "
                 "{rec} messages recovered)", seq=seq, after=gap["after_seq"], t0=gap["from"] or "the start",
                 t1=gap["to"], rec=gap["recovered"])

    def disconnectNotice(self, reason: str, text: str) -> None:
        """The bus is about to close our connection (``CMSG server/disconnect``)."""
        log.warn("the bus is disconnecting us: {reason}: {text}", reason=reason, text=text)
        if reason == "stalled" and not self.lossy:
            self._degrade()

    def _degrade(self) -> None:
        """We held the publishers longer than the bus's hold budget (it disconnects us):
        record lossy for a while (the bus discards for us and tells us, so every loss is
        marked) rather than be cut off again and lose what is published while we reconnect."""
        if self._restore_call is not None and self._restore_call.active():
            self._restore_call.cancel()
        self.degraded = True
        self.client.flood(soft="queue", hard="discard")
        self._restore_call = self.reactor.callLater(self.degraded_for, self._restore)
        log.warn("the writer cannot keep up with the publishers for long: recording lossy for {t:g}s "
                 "(drops counted and marked in the recording), then lossless again", t=self.degraded_for)

    def _restore(self) -> None:
        self._restore_call = None
        self.degraded = False
        if self.running:
            self.client.flood(soft="block", hard="block")
            log.info("recording lossless again (publishers are held back when we are behind)")

    def noticeReceived(self, count: int, first: bytes, last: bytes) -> None:
        """Log bus drops: at once for the first notice of a quiet spell, then once per interval."""
        run = self._bus_run
        if run is None:
            self._bus_run = [first, last]
        else:
            run[1] = last
        now = self.reactor.seconds()
        if self._last_bus_line is None or now - self._last_bus_line >= self.stats_interval:
            self._logBusDrops(now)

    def _logBusDrops(self, now) -> None:
        rec = self.recorder
        n, k = rec.bus_dropped - self._last_bus[0], rec.notices - self._last_bus[1]
        if not n:
            return
        first, last = self._bus_run or (b"", b"")
        self._bus_run = None
        self._last_bus = (rec.bus_dropped, rec.notices)
        self._last_bus_line = now
        log.warn("the bus dropped {n} messages meant for us ({k} notice(s); first key {first}, last "
                 "key {last}); {total} dropped by the bus since start (marked in the recording)",
                 n=n, k=k, first=_show(first), last=_show(last), total=rec.bus_dropped)

    def report(self, final: bool = False) -> None:
        """Losses since the last report (one line per kind while it lasts); at the end, the
        stop line with every count."""
        sink, rec = self.sink, self.recorder
        if sink is None:
            return
        if rec.lost_run is not None and sink.has_room(2 * ROW_OVERHEAD + 2 * 512):
            rec.mark_lost_run()
        dropped, dropped_bytes = sink.dropped, sink.dropped_bytes
        n, b = dropped - self._last[0], dropped_bytes - self._last[1]
        self._last = (dropped, dropped_bytes)
        if n:
            log.warn("cannot keep up: dropped {n} messages ({b} bytes) in the last {dt:g}s; "
                     "{total} dropped, {accepted} recorded since start; queue {q} of {max} bytes",
                     n=n, b=b, dt=self.stats_interval, total=dropped, accepted=sink.accepted,
                     q=sink.queued_bytes, max=sink.max_bytes)
        self._logBusDrops(self.reactor.seconds())
        if sink.paused_times != self._held:
            log.info("writer behind: held the bus back {n} time(s) in the last {dt:g}s "
                     "(queue {q} of {max} bytes)", n=sink.paused_times - self._held,
                     dt=self.stats_interval, q=sink.queued_bytes, max=sink.max_bytes)
            self._held = sink.paused_times
        if not self.client.connected and self.client.lastFailure is not None:
            log.warn("not connected to the bus at {what}", what=self.client.lastFailure)

        if final:
            gaps = (f"; {rec.gaps} gap of unknown size (the last run did not stop cleanly; "
                    f"{sum(n for _, n, _ in sink.writer.recovery.recovered)} of its messages recovered)"
                    if rec.gaps else "; no gaps")
            log.info("stopped: {rec} messages recorded, {lost} lost ({bus} dropped by the bus, "
                     "{drop} dropped by our queue, {werr} lost to write errors, {away} published "
                     "while no recorder was connected){gaps}; {filt} secret "
                     "filtered, {excl} excluded; {files} files published",
                     rec=sink.accepted - sink.lost_rows,
                     lost=rec.bus_dropped + sink.dropped + sink.lost_rows + rec.missed_away,
                     bus=rec.bus_dropped, drop=sink.dropped, werr=sink.lost_rows, away=rec.missed_away,
                     gaps=gaps, filt=rec.filtered, excl=rec.excluded, files=sink.writer.files_published)

    def beforeStop(self):
        if self._restore_call is not None and self._restore_call.active():
            self._restore_call.cancel()
        return self._lastSync()

    def afterStop(self):
        def flush(_):  # the marker goes with the writer's close: only once recovery is done
            if self.sink is not None:
                self.recorder.mark_lost_run()
                self.sink.stop()
                return self._done

        return self._recovering.addBoth(flush)

    def stats(self) -> dict:
        """The recorder's counts, for ``--metrics`` (`sbus.metrics.StatsCollector` reads them
        when scraped: nothing more is counted per message). ``lost`` by reason, zeros left out,
        as every service's; a gap (an unclean stop before this start) is of unknown size."""
        sink, rec = self.sink, self.recorder
        if sink is None:
            return {"connected": False}
        writer = sink.writer
        lost = {"bus_dropped": rec.bus_dropped, "queue_full": sink.dropped, "write_error": sink.lost_rows,
                "while_away": rec.missed_away}
        return {
            "connected": bool(self.client is not None and self.client.connected),
            "received": rec.received,
            "recorded_rows": sink.accepted - sink.lost_rows,
            "recorded_bytes": sink.taken_bytes,
            "published_rows": writer.rows_published,
            "files_published": writer.files_published,
            "gaps": rec.gaps,
            "drop_notices": rec.notices,
            "dropped_bytes": sink.dropped_bytes,
            "write_errors": sink.write_errors,
            "held_the_bus": sink.paused_times,
            "filtered": rec.filtered,
            "excluded": rec.excluded,
            "queued_bytes": sink.queued_bytes,
            "queue_limit_bytes": sink.max_bytes,
            "degraded": self.degraded,
            "lost": {reason: n for reason, n in lost.items() if n},
            "unknown_gaps": self.unknownGaps(),
            "stats_requests": {"answered": self.responder.answered, "refused": self.responder.refused},
        }

    def _lastSync(self) -> defer.Deferred:
        """Before leaving, one round trip with the bus: everything it routed to us before the stop
        (in our socket, or in its queue for us) is read and recorded first, so that what was
        published before the recorder was stopped is in the recording. Bounded by STOP_SYNC
        seconds (a bus that does not answer, or a writer that stays full)."""
        if self.client is None or not self.client.connected:
            return defer.succeed(None)
        return self.client.protocol.sync().addTimeout(STOP_SYNC, self.reactor).addBoth(lambda _: None)


class Options(RespelledOptions):
    command = "twistd sbus-record"
    renamed = {"--report-interval": "--stats-interval"}
    synopsis = "--out DIR [--bus ADDRESS] [--pattern P ...] [options]"
    longdesc = (
        "Record sbus traffic into Parquet files in DIR (published atomically as "
        "rec-FIRSTSEQ-LASTSEQ.parquet; DIR/_tmp/ holds the file being written). "
        "Default subscription: everything except !/cred/ (secret) keys and the pipeline's own "
        "output (_pipeline/). Lossless by default: when the recorder is behind, the bus holds "
        "the publishers back (--lossy: it discards for us instead; every loss is counted, "
        "logged and marked in the recording). Sizes take K/M/G, durations s/m/h/d."
    )
    optFlags = [
        ["lossy", None, "Never slow the bus down: when we are behind, the bus (and our queue) "
                        "drop messages instead; each loss is counted, logged and marked by a drop row."],
        ["record-pipeline", None, "Also record the pipeline's own output (keys under _pipeline/, "
                                  "e.g. sbus-pipeline stream --publish-to): its analytics would then "
                                  "count their own output."],
    ]
    optParameters = [
        ["bus", "b", None, "Bus address (path, /dev/unix/abstract/HEX, /dev/fd/N); "
                           "default $SBUS_SOCKET, else /run/sbus.socket. " + MISSING_BUS_HELP],
        ["out", "o", None, "Recording directory (created if missing)."],
        ["roll-bytes", None, "128M", "Publish a file when it reaches this size on disk."],
        ["roll-age", None, "60s", "Publish a file this long after its first message: the most "
                                  "a crash can lose (plus the queue)."],
        ["row-group-bytes", None, "32M", "Buffer this much before writing a Parquet row group."],
        ["queue-bytes", None, "64M", "Queue between the bus and the writer thread; when it is "
                                     "full we stop reading the bus (--lossy: drop and count)."],
        ["retain-age", None, None, "Delete published files older than this (default: keep)."],
        ["retain-bytes", None, None, "Delete the oldest files beyond this total (default: keep)."],
        ["compression", None, "snappy", "Parquet compression: snappy, zstd, gzip, lz4, none."],
        ["stats-interval", None, "10s", "At most one log line per this interval for each kind "
                                         "of loss (bus, queue) while it lasts."],
        ["session", None, None, "Name of the recorder's session on the bus (default: sbus-record "
                                "and the recording directory): a restarted recorder claims it and "
                                "marks what was published while none ran with a drop row."],
        ["session-linger", None, "60s", "How long the bus counts for a recorder that went away "
                                        "(0: not at all; the bus caps it, 60 s by default)."],
        METRICS_OPTION,
    ]

    def __init__(self):
        super().__init__()
        self["patterns"] = []
        self["exclude"] = []

    def opt_exclude(self, value: str) -> None:
        """Do not record keys matching this pattern (repeatable; _pipeline/ is always excluded unless --record-pipeline or a --pattern under _pipeline/)."""
        try:
            self["exclude"].append(codec.encode_sub(os.fsencode(value))[4:])
        except codec.ProtocolError as e:
            raise usage.UsageError(f"--exclude: {e}") from None

    def opt_pattern(self, value: str) -> None:
        """Subscribe to this routing-key pattern (repeatable; default: the empty pattern)."""
        try:
            self["patterns"].append(codec.encode_sub(os.fsencode(value))[4:])
        except codec.ProtocolError as e:
            raise usage.UsageError(f"--pattern: {e}") from None

    opt_p = opt_pattern

    def postOptions(self):
        if not self["out"]:
            raise usage.UsageError("--out DIR is required")
        for name in ("roll-bytes", "row-group-bytes", "queue-bytes", "retain-bytes"):
            if self[name] is not None:
                try:
                    self[name] = parse_size(self[name])
                except ValueError as e:
                    raise usage.UsageError(f"--{name}: {e}") from None
                if self[name] <= 0:
                    raise usage.UsageError(f"--{name}: must be positive")
        self["session"] = session_name_option(self["session"])
        try:
            self["session-linger"] = parse_duration(self["session-linger"])
        except ValueError as e:
            raise usage.UsageError(f"--session-linger: {e}") from None
        for name in ("roll-age", "retain-age", "stats-interval"):
            if self[name] is not None:
                try:
                    self[name] = parse_duration(self[name])
                except ValueError as e:
                    raise usage.UsageError(f"--{name}: {e}") from None
                if self[name] <= 0:
                    raise usage.UsageError(f"--{name}: must be positive")
        if self["compression"] not in ("snappy", "zstd", "gzip", "lz4", "none", "brotli"):
            raise usage.UsageError(f"--compression: unknown codec {self['compression']!r}")
        asked = any(p.startswith(PIPELINE_PREFIX) for p in self["patterns"])
        if not self["record-pipeline"] and not asked:  # a --pattern '_pipeline/...' asks on purpose
            self["exclude"].insert(0, PIPELINE_PREFIX)
        try:
            require("pyarrow")
        except MissingExtra as e:
            raise usage.UsageError(str(e)) from None
        Chassis.checkBus(self["bus"])
        out = self["out"]
        if os.path.exists(out) and not os.path.isdir(out):
            raise usage.UsageError(f"--out: {out} is not a directory")
        from sbus.pipeline.writer import private_dir

        if os.path.isdir(out):  # one another user prepared could hold planted files, take ours away
            st = os.stat(out)
            if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o002:
                who = f"belongs to uid {st.st_uid}" if st.st_uid not in (os.geteuid(), 0) \
                    else f"is writable by everyone (mode {stat.S_IMODE(st.st_mode):04o})"
                raise usage.UsageError(f"--out: {out} {who}: refusing to record into a directory "
                                       f"another user controls")
        tmp = os.path.join(out, "_tmp")
        try:  # created 0700; a _tmp that is a symlink or someone else's is refused
            os.close(private_dir(tmp))
        except OSError as e:
            why = "a symlink (refusing to follow it)" if os.path.islink(tmp) else e.strerror
            raise usage.UsageError(f"--out: cannot use {tmp}: {why}") from None


def makeService(options) -> RecordService:
    return RecordService(
        options["bus"],
        options["out"],
        options["patterns"],
        roll_bytes=options["roll-bytes"],
        roll_age=options["roll-age"],
        row_group_bytes=options["row-group-bytes"],
        queue_bytes=options["queue-bytes"],
        retain_age=options["retain-age"],
        retain_bytes=options["retain-bytes"],
        compression=options["compression"],
        report_interval=options["stats-interval"],
        lossy=options["lossy"],
        exclude=options["exclude"],
        session=options["session"],
        session_linger=options["session-linger"],
    )
