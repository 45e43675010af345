"""``twistd sbus-record``: record bus traffic into Parquet files.

    twistd -n sbus-record --bus /run/sbus.socket --out /var/lib/sbus/rec [--pattern P ...]

The bus keeps nothing; this service subscribes (default: the empty pattern,
i.e. all traffic, with ``!/cred/`` keys filtered out) and hands every
message to a writer thread (`sbus.pipeline.writer.RecordingWriter`) through
a bounded queue. The reactor only parses, stamps and enqueues: it never
touches the disk. Files are published atomically (see the writer).

Guarantees, and what a crash loses:

* published files (``DIR/rec-*.parquet``) are complete and never change;
* a crash (or ``kill -9``) loses the rows of the file being written and the
  queue: at most ``--roll-age`` seconds (default 60) or ``--roll-bytes`` of
  traffic, plus up to ``--queue-bytes`` not yet taken by the writer. A
  clean stop (SIGTERM/SIGINT) publishes everything first;
* when the writer cannot keep up the queue fills, further messages are
  dropped and counted, and a warning with the counts is logged every
  ``--report-interval`` seconds while it lasts. Dropped messages still use
  up a ``seq``, so gaps in ``seq`` show exactly where and how many;
* while disconnected from the bus nothing is recorded (the bus keeps no
  messages for absent clients); the service reconnects with back-off and
  logs each disconnect and reconnect.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from twisted.application import service
from twisted.internet import defer
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python import usage

from sbus.core import codec
from sbus.core.credentials import SECRET_ROOT
from sbus.core.patterns import matches
from sbus.pipeline.units import parse_duration, parse_size
from sbus.pipeline.writer import (
    DEFAULT_ROLL_AGE,
    DEFAULT_ROLL_BYTES,
    DEFAULT_ROW_GROUP_BYTES,
    ROW_OVERHEAD,
    RecordingWriter,
)

log = Logger(namespace="sbus.record")

DEFAULT_QUEUE_BYTES = 64 << 20
DEFAULT_REPORT_INTERVAL = 10.0


class BoundedWriter:
    """A worker thread that owns a `RecordingWriter`, fed through a bounded queue.

    `offer` (the reactor's side) never blocks: it appends to a deque or, when
    the bytes queued would exceed `max_bytes`, drops the row and counts it.
    The two byte counters are each written by one thread only, so no lock is
    needed on the hot path.
    """

    def __init__(self, writer: RecordingWriter, max_bytes: int = DEFAULT_QUEUE_BYTES,
                 on_done=None, report=None, tick: float = 0.05):
        self.writer = writer
        self.max_bytes = max_bytes
        self.on_done = on_done or (lambda: None)
        self.report = report or (lambda text: None)
        self.tick = tick
        self._queue: deque = deque()
        self._enq_bytes = 0  # reactor thread only
        self._deq_bytes = 0  # worker thread only
        self._wake = threading.Event()
        self._stopping = False
        self.accepted = 0
        self.dropped = 0
        self.dropped_bytes = 0
        self.write_errors = 0
        self.lost_rows = 0  # rows discarded after a write error
        #: Test hook: while set, the worker does not take rows (simulates a slow disk).
        self.paused = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sbus-record-writer", daemon=True)

    @property
    def queued_bytes(self) -> int:
        return self._enq_bytes - self._deq_bytes

    def start(self):
        self._thread.start()
        return self

    def offer(self, recv_us: int, seq: int, key: bytes, payload: bytes) -> bool:
        cost = len(key) + len(payload) + ROW_OVERHEAD
        if self._enq_bytes - self._deq_bytes + cost > self.max_bytes:
            self.dropped += 1
            self.dropped_bytes += len(key) + len(payload)
            return False
        self._queue.append((recv_us, seq, key, payload))
        self._enq_bytes += cost
        self.accepted += 1
        if not self._wake.is_set():
            self._wake.set()
        return True

    def stop(self) -> None:
        """Ask the worker to write everything queued, publish, and end."""
        self._stopping = True
        self.paused.clear()
        self._wake.set()

    def join(self, timeout=None) -> None:
        self._thread.join(timeout)

    def _run(self):
        queue, writer = self._queue, self.writer
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
                        batch.append(row)
                        cost += len(row[2]) + len(row[3]) + ROW_OVERHEAD
                    try:
                        writer.extend(batch)
                    except Exception as e:  # disk full, permissions, ...
                        self._write_failed(e)
                    self._deq_bytes += cost
                try:
                    writer.tick()
                except Exception as e:
                    self._write_failed(e)
                if stopping and not queue:
                    break
            try:
                writer.close()
            except Exception as e:
                self._write_failed(e)
        finally:
            self.on_done()

    def _write_failed(self, e: Exception) -> None:
        lost = self.writer.pending_rows
        self.write_errors += 1
        self.lost_rows += lost
        self.report(f"write failed ({type(e).__name__}: {e}); discarded the unpublished file "
                    f"({lost} messages); continuing")
        self.writer.abandon()


class Recorder:
    """What the reactor does per message: filter, number, stamp, enqueue."""

    def __init__(self, sink: BoundedWriter, next_seq: int, record_secrets: list[bytes] = ()):
        self.sink = sink
        self.next_seq = next_seq
        self.secret_patterns = [p for p in record_secrets]
        self.received = 0
        self.filtered = 0
        self._time_ns = time.time_ns

    def record(self, key: bytes, payload: bytes, match_pattern=lambda p: p) -> None:
        if key.startswith(SECRET_ROOT) and not any(
                matches(match_pattern(p), key) for p in self.secret_patterns):
            self.filtered += 1
            return
        self.received += 1
        seq = self.next_seq
        self.next_seq = seq + 1
        self.sink.offer(self._time_ns() // 1000, seq, key, payload)


def _make_protocol(recorder: Recorder):
    from sbus.client.twisted import SbusProtocol

    class RecorderProtocol(SbusProtocol):
        def messageReceived(self, key, payload, packet):
            recorder.record(key, payload, self._matchPattern)

    return RecorderProtocol


class RecordService(service.Service):
    name = "sbus-record"

    def __init__(self, bus, out: str, patterns: list[bytes], *, roll_bytes=DEFAULT_ROLL_BYTES,
                 roll_age=DEFAULT_ROLL_AGE, row_group_bytes=DEFAULT_ROW_GROUP_BYTES,
                 queue_bytes=DEFAULT_QUEUE_BYTES, retain_age=None, retain_bytes=None,
                 compression="snappy", report_interval=DEFAULT_REPORT_INTERVAL, hard=None,
                 reactor=None):
        self.bus = bus
        self.out = out
        self.patterns = patterns or [b""]
        self.settings = dict(roll_bytes=roll_bytes, roll_age=roll_age, row_group_bytes=row_group_bytes,
                             retain_age=retain_age, retain_bytes=retain_bytes, compression=compression)
        self.queue_bytes = queue_bytes
        self.report_interval = report_interval
        self.hard = hard
        self._reactor = reactor
        self.client = None
        self.sink: BoundedWriter | None = None
        self.recorder: Recorder | None = None
        self._done: defer.Deferred | None = None
        self._loop = None
        self._last = (0, 0)

    @property
    def reactor(self):
        if self._reactor is None:
            from twisted.internet import reactor
            self._reactor = reactor
        return self._reactor

    def _from_thread(self, text: str) -> None:
        self.reactor.callFromThread(log.info, "{text}", text=text)

    def startService(self):
        from sbus.client.twisted import ReconnectingClient

        super().startService()
        writer = RecordingWriter(self.out, log=self._from_thread, **self.settings)
        if writer.cleaned:
            log.warn("removed {n} unpublished leftover(s) from {tmp}: {names}",
                     n=len(writer.cleaned), tmp=writer.tmp, names=", ".join(writer.cleaned))
        self._done = defer.Deferred()
        self.sink = BoundedWriter(writer, self.queue_bytes, report=self._from_thread,
                                  on_done=lambda: self.reactor.callFromThread(self._done.callback, None))
        secret = [p for p in self.patterns if p.startswith(SECRET_ROOT)]
        self.recorder = Recorder(self.sink, writer.next_seq, secret)
        self.sink.start()
        log.info("recording {patterns} from {bus} into {out} (next seq {seq}; roll at {rb} bytes "
                 "or {ra}s; queue {qb} bytes)",
                 patterns=b", ".join(p or b'""' for p in self.patterns).decode("utf-8", "replace"),
                 bus=self.bus or "(default address)", out=self.out, seq=writer.next_seq,
                 rb=self.settings["roll_bytes"], ra=self.settings["roll_age"], qb=self.queue_bytes)

        svc = self

        class Client(ReconnectingClient):
            def connectionMade(self, protocol):
                def subscribed(_):
                    log.info("connected to the bus as {who}; subscribed",
                             who=(protocol.credentials or b"?").decode("utf-8", "replace"))

                # after the round trip the server has our subscriptions in place
                protocol.sync().addCallbacks(subscribed, lambda f: None)

            def connectionLost(self, reason):
                if svc.running:
                    log.warn("lost the bus connection ({why}); reconnecting", why=reason)

        self.client = Client(self.reactor, self.bus, _make_protocol(self.recorder), maxDelay=5.0)
        for p in self.patterns:
            self.client.subscribe(p)
        if self.hard:
            self.client.flood(hard=self.hard)
        self.client.start()
        self._loop = LoopingCall(self._report)
        self._loop.clock = self.reactor
        self._loop.start(self.report_interval, now=False)

    def _report(self):
        sink = self.sink
        dropped, dropped_bytes = sink.dropped, sink.dropped_bytes
        n, b = dropped - self._last[0], dropped_bytes - self._last[1]
        self._last = (dropped, dropped_bytes)
        if n:
            log.warn("cannot keep up: dropped {n} messages ({b} bytes) in the last {dt:g}s; "
                     "{total} dropped, {accepted} recorded since start; queue {q} of {max} bytes",
                     n=n, b=b, dt=self.report_interval, total=dropped, accepted=sink.accepted,
                     q=sink.queued_bytes, max=sink.max_bytes)
        if not self.client.connected and self.client.lastError is not None:
            log.warn("not connected to the bus: {err}", err=self.client.lastError.getErrorMessage())

    def stopService(self):
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        d = self.client.stop() if self.client is not None else defer.succeed(None)

        def flush(_):
            if self.sink is None:
                return None
            self.sink.stop()
            return self._done

        def done(_):
            s = self.sink
            if s is not None:
                self._report()
                log.info("stopped: {rec} messages recorded, {drop} dropped, {filt} secret filtered; "
                         "{files} files published",
                         rec=s.accepted, drop=s.dropped, filt=self.recorder.filtered,
                         files=s.writer.files_published)

        return d.addBoth(flush).addCallback(done)


class Options(usage.Options):
    synopsis = "--out DIR [--bus ADDRESS] [--pattern P ...] [options]"
    longdesc = (
        "Record sbus traffic into Parquet files in DIR (published atomically as "
        "rec-FIRSTSEQ-LASTSEQ.parquet; DIR/_tmp/ holds the file being written). "
        "Default subscription: everything except !/cred/ (secret) keys. Sizes take K/M/G, "
        "durations s/m/h/d."
    )
    optParameters = [
        ["bus", "b", None, "Bus address (path, /dev/unix/abstract/HEX, /dev/fd/N); "
                           "default $SBUS_SOCKET, then ./sbus.socket."],
        ["out", "o", None, "Recording directory (created if missing)."],
        ["roll-bytes", None, "128M", "Publish a file when it reaches this size on disk."],
        ["roll-age", None, "60s", "Publish a file this long after its first message: the most "
                                  "a crash can lose (plus the queue)."],
        ["row-group-bytes", None, "32M", "Buffer this much before writing a Parquet row group."],
        ["queue-bytes", None, "64M", "Queue between the bus and the writer thread; beyond it "
                                     "messages are dropped and counted."],
        ["retain-age", None, None, "Delete published files older than this (default: keep)."],
        ["retain-bytes", None, None, "Delete the oldest files beyond this total (default: keep)."],
        ["compression", None, "snappy", "Parquet compression: snappy, zstd, gzip, lz4, none."],
        ["report-interval", None, "10s", "How often to log drop counts while dropping."],
        ["hard", None, None, "Ask the server for this hard flood mode for us: discard (server "
                             "default) or block (slow publishers down instead of dropping)."],
    ]

    def __init__(self):
        super().__init__()
        self["patterns"] = []

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
        for name in ("roll-age", "retain-age", "report-interval"):
            if self[name] is not None:
                try:
                    self[name] = parse_duration(self[name])
                except ValueError as e:
                    raise usage.UsageError(f"--{name}: {e}") from None
                if self[name] <= 0:
                    raise usage.UsageError(f"--{name}: must be positive")
        if self["compression"] not in ("snappy", "zstd", "gzip", "lz4", "none", "brotli"):
            raise usage.UsageError(f"--compression: unknown codec {self['compression']!r}")
        if self["hard"] not in (None, "discard", "block"):
            raise usage.UsageError("--hard: discard or block")
        if self["bus"]:
            from sbus.client.address import AddressError, parse
            try:
                parse(self["bus"])
            except AddressError as e:
                raise usage.UsageError(f"--bus: {e}") from None
        out = self["out"]
        if os.path.exists(out) and not os.path.isdir(out):
            raise usage.UsageError(f"--out: {out} is not a directory")
        try:
            os.makedirs(os.path.join(out, "_tmp"), exist_ok=True)
        except OSError as e:
            raise usage.UsageError(f"--out: cannot create {e.filename}: {e.strerror}") from None


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
        report_interval=options["report-interval"],
        hard=options["hard"],
    )
