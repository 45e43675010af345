"""``twistd sbus-queue``: shared work queues beside the bus (docs/queues.md).

Each group is a name and a pattern: every message that matches goes to exactly one live
member, round robin over the members whose window of unacknowledged deliveries has room.
Members join by subscribing to a key in their own secret space; the server's
``server/interest`` feed tells the service who joined and who left (a ``kill -9`` included),
with the credentials the server checked. What a departed member had not acknowledged goes
to another member, marked redelivered. The logic is `sbus.core.workqueue.QueueCore`; this
module moves packets:

* the **intake** connection subscribes to the groups' patterns (paused when a group in
  ``block`` mode is full: its ``blocking/hard/block`` then holds the publishers);
* the **control** connection follows ``server/interest``, receives acknowledgements and
  ``sbus/services/stats`` requests, and publishes the deliveries.
"""

from __future__ import annotations

import os
import select

from twisted.logger import Logger
from twisted.python import usage

from sbus.core import codec
from sbus.core.codec import MAX_PACKET
from sbus.core.reqrep import Ask, Responder
from sbus.core.patterns import matches
from sbus.core.workqueue import ACK_KEY, MEMBER_KEYS, MODES, NACK_KEY, OVERFLOWS, PROGRESS_KEY, REJECT_KEY, SERVES_ROOT, SUBMIT_ROOT, QueueCore, check_group
from sbus.options import METRICS_OPTION
from sbus.services.chassis import Chassis
from sbus.services.svcstats import lost

#: Seconds between looks at the deadlines (ack wait, nack delays): their resolution.
TICK = 0.1
#: Seconds between looks for a hangup of the paused intake (see `watchHangup`).
HANGUP_CHECK = 0.2
#: How long the bus counts for an intake that went away (`server/session`; the bus caps it).
SESSION_LINGER = 60.0

log = Logger()


class QueueService(Chassis):
    kind = "sbus-queue"
    log = log

    def __init__(self, bus, groups, *, limit: int = 10000, full: str = "block", window: int = 64,
                 window_bytes: int = 1 << 20, allowed_uids=(), max_packet: int = MAX_PACKET,
                 stats_interval: float = 60.0, ack_wait: float | None = None,
                 max_deliveries: int | None = None, dead_letter: bytes | None = None, store=None,
                 max_bytes: int | None = None, overflow: str = "reject-publish", caps=None,
                 reactor=None):
        self.core = QueueCore(groups, limit=limit, full=full, window=window, window_bytes=window_bytes,
                              allowed_uids=allowed_uids, max_packet=max_packet, ack_wait=ack_wait,
                              max_deliveries=max_deliveries, dead_letter=dead_letter,
                              clock=lambda: self.reactor.seconds(), store=store,
                              max_bytes=max_bytes, overflow=overflow, caps=caps)
        super().__init__(bus, stats_interval=stats_interval, reactor=reactor)
        self.store = store
        self._flush = None  # the call that writes this turn's journal records
        self.full = full
        self.max_packet = max_packet
        self.intake = self.control = None
        self.paused = False
        self.pauses = 0
        self.intake_ready = False   # the intake is connected and subscribed
        self.following = False      # the control connection asked for the interest feed
        #: Confirmed submissions are requests: answered verified when the submitter asks
        #: (`responder_uid`), through the one request/reply responder.
        self.submits = Responder(max_packet)
        self._hangup = None  # LoopingCall: watches a paused intake for the bus closing it
        #: Disconnections of the intake by the bus, by the reason it gave (e.g. `stalled`).
        self.intake_disconnects: dict[str, int] = {}
        #: Groups given up to an earlier service for the same group (logged once each).
        self.given_up: set[bytes] = set()
        #: What the bus counted for the intake's session while no intake was connected (a
        #: restart of this service, a reconnection): lost, reason `restart`.
        self.restart_lost = 0

    def statsName(self) -> str:
        return ",".join(f"{g.name.decode()}={g.pattern.decode('utf-8', 'replace')}"
                        for g in self.core.groups.values())

    def publicStats(self) -> dict:
        return {"groups": sorted(g.decode() for g in self.core.groups)}

    # -- life cycle

    def setUp(self):
        # the control connection starts once the intake is subscribed (and see `follow`); its
        # serves patterns tell a later service for our groups to give them up
        self.control = self.connect(
            "control", subscribe=[ACK_KEY, *MEMBER_KEYS, *(SUBMIT_ROOT + name for name in self.core.groups),
                                  *self.core.serves_patterns()],
            stats=True, start=False, max_packet=self.max_packet, message=self.controlMessage,
            control=self.interestNotice, made=self.controlMade, lost=self.controlLost)
        self.intake = self.connect(
            "intake", subscribe=[g.pattern for g in self.core.groups.values()],
            flood={"hard": "block"} if self.full == "block" else None, max_packet=self.max_packet,
            session=(codec.session_name(f"sbus-queue {self.statsName()}"), SESSION_LINGER, True),
            message=self.intakeMessage, dropped=self.intakeDropped, notice=self.intakeNotice,
            ready=self.intakeReady, lost=self.intakeLost, claimed=self.intakeClaimed)
        log.info("sbus-queue: groups {g}; waiting at most: {caps}; publishes over a reject-publish cap: {mode}; "
                 "window {w} per member", g=self.statsName(), caps=self.core.caps_text(),
                 mode=self.full, w=next(iter(self.core.groups.values())).window)
        self.every(TICK, self._tick)  # ack deadlines, nack delays, fsync of the journals
        self._hangup = self.every(HANGUP_CHECK, self._checkHangup, start=False)

    def intakeDropped(self, count, first, last) -> None:
        self.core.intake_dropped(count)
        log.warn("intake: the server dropped {n} messages for us (counted lost)", n=count)

    def intakeNotice(self, notice) -> None:
        self.intake_disconnects[notice.reason] = self.intake_disconnects.get(notice.reason, 0) + 1
        log.warn("intake: the bus disconnected it ({reason}: {text}); what it still held "
                 "for us is lost, counted in lost.restart once the intake is back",
                 reason=notice.reason, text=notice.text)

    def intakeClaimed(self, reply) -> None:
        # What the bus still held for the previous intake (this process's or a dead one's) and
        # what came while none was connected: counted there, told here (then confirmed).
        if reply.state == "resumed":
            self.restart_lost += reply.missed

    def intakeLost(self, reason) -> None:
        self.intake_ready = False

    def controlMade(self, proto) -> None:
        self.following = False
        self.follow()
        proto.whoami().addCallbacks(self.identified, lambda f: None)
        log.info("control: connected to {bus} as {who}", bus=self.bus or "(default bus)", who=self.who(proto))

    def controlLost(self, reason) -> None:
        self.core.control_lost()
        self.following = False

    def interestNotice(self, key: bytes, payload: bytes) -> None:
        if key == codec.INTEREST:
            self.sendAll(self.core.interest(payload))
            if len(self.core.conflicts) > len(self.given_up):
                self.giveUp()
            if payload == b"=":
                log.info("control: following the members ({n} now)", n=len(self.core.members))

    def _tick(self) -> None:
        self.sendAll(self.core.tick())
        if self.store is not None:
            self.store.flush(sync=True)

    def journalled(self) -> None:
        """Records were added this turn: write them to the kernel at its end (one write per
        journal per turn), so a kill -9 loses none."""
        if self.store is not None and self.store.dirty and self._flush is None:
            self._flush = self.reactor.callLater(0, self._flushStore)

    def _flushStore(self) -> None:
        self._flush = None
        self.store.flush()

    def intakeReady(self, proto) -> None:
        log.info("intake: subscribed to {p}", p=", ".join(repr(g.pattern) for g in self.core.groups.values()))
        self.intake_ready = True
        if self.running and not self.control.running:
            self.control.start()
        self.follow()

    def follow(self) -> None:
        """Ask for the interest feed (and so learn the members, tell them hello and deliver) only
        while the intake is subscribed: a member told hello can have work published for it at
        once, after a start as after the bus came back."""
        if self.following or not self.intake_ready or self.control is None or not self.control.connected:
            return
        self.following = True
        self.core.relisting()
        self.control.protocol.sendControl(codec.INTEREST)

    def giveUp(self) -> None:
        """Another service serves a group of ours and started first: stop serving it here (one
        error line); with no group left, stop the process."""
        served = {g.pattern for g in self.core.groups.values()}
        for name, (other, pattern) in self.core.conflicts.items():
            if name in self.given_up:
                continue
            self.given_up.add(name)
            log.error("group {g} is already served by another sbus-queue service ({other}) on this bus: "
                      "not serving it here (one service per group)", g=name.decode(), other=other.decode())
            self.control.unsubscribe(SERVES_ROOT + name + b"/" + self.core.service_id)
            self.control.unsubscribe(SUBMIT_ROOT + name)
            if pattern not in served:
                self.intake.unsubscribe(pattern)
        if not self.core.groups and self.running:
            log.error("sbus-queue: no group left to serve; stopping")
            self.reactor.stop()

    def afterStop(self):
        if self.store is not None:
            self.store.flush(sync=True)
            self.store.close()

    # -- traffic

    def sendAll(self, packets) -> None:
        if not packets:
            return
        proto = self.control.protocol if self.control is not None else None
        if proto is None or not proto.connected:
            return  # deliveries wait in the members' in-flight sets; redelivered if they leave
        for packet in packets:
            proto.sendPacket(packet)

    def intakeMessage(self, key: bytes, payload: bytes, proto=None) -> None:
        self.sendAll(self.core.message(key, payload))
        self.journalled()
        if not self.paused and self.core.should_pause():
            self.paused = True
            self.pauses += 1
            self.intake.pauseReading()
            self.watchHangup()

    def identified(self, whoami: bytes) -> None:
        """The control connection's whoami: verified submissions are answered from now on (the
        submitter's token comes on our challenge key, which only this process can read)."""
        if self.submits.whoami != whoami:
            self.submits.identify(whoami)
            self.control.subscribe(self.submits.challenge_key)

    def _submit(self, proto, name: bytes, payload: bytes) -> None:
        """A confirmed submission: held (in the journal, fsynced, with a store) before the
        answer goes out. A verified one from a submitter whose token we lack yet is offered
        first, and held when the token comes (`_challenged`)."""
        ask = self.submits.accept(payload, SUBMIT_ROOT + name)
        if ask is None:
            return
        offer = self.submits.offer(ask)
        if offer is not None:
            proto.sendPacket(offer)
        else:
            self._hold(proto, ask)

    def _hold(self, proto, ask) -> None:
        answer, packets = self.core.submit(ask.key[len(SUBMIT_ROOT):], ask.body)
        if self.store is not None and answer.startswith(b"ok"):
            self.store.flush(sync=True)
        self.sendAll(packets)
        proto.sendPacket(self.submits.reply(ask, answer))

    def _challenged(self, proto, payload: bytes) -> None:
        out = self.submits.challenge(payload)
        if type(out) is Ask:
            self._hold(proto, out)
        elif out is not None:
            proto.sendPacket(out)

    def _maybeResume(self) -> None:
        if self.paused and self.core.may_resume():
            self.paused = False
            if self._hangup is not None and self._hangup.running:
                self._hangup.stop()
            self.intake.pauseReading(False)

    def watchHangup(self) -> None:
        """A paused intake is not read, so the reactor would not see the bus close it (a stall):
        look for the hangup itself, every `HANGUP_CHECK` seconds while paused."""
        if self._hangup is not None and not self._hangup.running:
            self._hangup.start(HANGUP_CHECK, now=False)

    def _checkHangup(self) -> None:
        proto = self.intake.protocol if self.intake is not None else None
        if proto is None or not proto.connected:
            return
        poller = select.poll()
        poller.register(proto.transport.fileno(), select.POLLRDHUP)
        if poller.poll(0):
            # Read what the socket still holds (kept, in block mode), then the end: the intake
            # reconnects, and its session claim tells what the bus lost (lost.restart).
            log.warn("intake: the bus closed it while paused (a stall: the server's --stall-timeout; its "
                     "notice cannot pass a full socket); reading what it holds, then reconnecting; what the "
                     "bus still held for us is lost, counted in lost.restart once the intake is back")
            self.intake_disconnects["closed_while_paused"] = self.intake_disconnects.get("closed_while_paused", 0) + 1
            proto.transport.resumeProducing()

    def controlMessage(self, key: bytes, payload: bytes, proto) -> None:
        self._controlMessage(proto, key, payload)
        self.journalled()

    def answerStats(self, proto, payload: bytes) -> None:
        if self.store is not None:
            self.store.flush()  # what the answer counts is in the kernel before it is told
        super().answerStats(proto, payload)

    def _controlMessage(self, proto, key: bytes, payload: bytes) -> None:
        if key == ACK_KEY:
            self.sendAll(self.core.ack(payload))
            self._maybeResume()
        elif key == NACK_KEY:
            self.sendAll(self.core.nack(payload))
        elif key == REJECT_KEY:
            self.sendAll(self.core.reject(payload))
            self._maybeResume()
        elif key == PROGRESS_KEY:
            self.core.progress(payload)
        elif key.startswith(SUBMIT_ROOT):
            self._submit(proto, key[len(SUBMIT_ROOT):], payload)
        elif key == self.submits.challenge_key:
            self._challenged(proto, payload)

    # -- statistics

    def stats(self) -> dict:
        st = self.core.stats()
        st["lost"] = lost(*(g["lost"] for g in st["groups"].values()), {"intake": st["lost_intake"]},
                          {"restart": self.restart_lost})
        st["intake_paused"] = self.paused
        st["pauses"] = self.pauses
        st["intake_disconnects"] = dict(self.intake_disconnects)
        # what the bus counted nothing for while the intake was away (restarted, lingered out)
        st["unknown_gaps"] = self.unknownGaps()
        st["bus"] = {"connected": bool(self.control and self.control.connected
                                       and self.intake and self.intake.connected),
                     "reconnects": self.reconnects()}
        return st


class Options(usage.Options):
    synopsis = ("--group NAME=PATTERN [--group ...] [--bus ADDRESS] [--max-jobs [GROUP=]N] "
                "[--max-bytes [GROUP=]N] [--overflow [GROUP=]reject-publish|drop-oldest] [--full MODE]")
    longdesc = ("Shared work queues (docs/queues.md): each message matching a group's PATTERN goes "
                "to exactly one member of the group, round robin over the members with room in "
                "their window; members acknowledge each message, and what a member that left or "
                "died had not acknowledged goes to another, marked redelivered. Members join by "
                "subscribing in their own secret space (sbus work GROUP -- CMD, or join() in the "
                "clients); only the service's own uid, root and --allow-uid may join.")
    optParameters = [
        METRICS_OPTION,
        ["bus", "b", None, "Address of the bus (path, /dev/unix/abstract/HEX); default: the default bus."],
        ["limit", None, "10000", "The same as --max-jobs N (every group)."],
        ["full", None, "block", "Over the limit (--overflow reject-publish): block (hold the "
                                "publishers through the server's flood control), discard (drop, counted lost) or error (drop, count, "
                                "and publish sbus/services/queue/full/GROUP once)."],
        ["window", None, "64", "Unacknowledged deliveries per member at most."],
        ["window-bytes", None, str(1 << 20), "Bytes of unacknowledged deliveries per member at most "
                                             "(one delivery of any size when it has none): under the "
                                             "server's 4 MiB queue per client, so the server never "
                                             "drops a slow member's deliveries."],
        ["max-packet", None, str(MAX_PACKET), "The bus's packet size limit (a delivery that would "
                                              "not fit is dropped and counted too_big)."],
        ["stats-interval", None, "60", "Seconds between stats lines in the log (only if changed)."],
        ["store", None, None, "A directory for the groups' journals (DIR/GROUP.journal): what the "
                              "service took and has not seen done survives a kill -9 and is "
                              "delivered again after a restart (default: in memory only)."],
    ]

    def __init__(self):
        super().__init__()
        self["groups"] = []
        self["allow-uids"] = []
        #: --max-jobs/--max-bytes/--overflow: None (every group) or a group name -> {cap: value}
        self["caps"] = {}

    def _cap(self, option: str, field: str, value: str) -> None:
        """``[GROUP=]VALUE``: for one group, or without GROUP= for every group (repeatable; a
        group's own value wins)."""
        from sbus.options import positive_float, positive_int

        if field == "dead_letter":
            # A key may hold '=': what is before the first one is a group only if it names one.
            group, sep, text = value.partition("=")
            if not (sep and _is_group(group)):
                group, sep, text = "", "", value
        else:
            group, sep, text = value.rpartition("=")
        if sep:
            try:
                group = check_group(group)
            except ValueError as e:
                raise usage.UsageError(f"--{option}: {e}") from None
        if field == "dead_letter":
            parsed = os.fsencode(text)
            try:
                codec.encode_msg(parsed, b"")
            except codec.ProtocolError as e:
                raise usage.UsageError(f"--{option}: bad key: {e}") from None
        elif field == "overflow":
            if text not in OVERFLOWS:
                raise usage.UsageError(f"--{option}: one of {', '.join(OVERFLOWS)}, not {text!r}")
            parsed = text
        elif field == "ack_wait":
            parsed = positive_float(option, text)
        else:
            parsed = positive_int(option, text)
        self["caps"].setdefault(group if sep else None, {})[field] = parsed

    def opt_max_jobs(self, value: str) -> None:
        """[GROUP=]N: jobs waiting in a group, beyond those in flight (default 10000; repeatable)"""
        self._cap("max-jobs", "limit", value)

    def opt_max_bytes(self, value: str) -> None:
        """[GROUP=]N: bytes (keys, payloads) of the jobs waiting in a group (default: no cap)"""
        self._cap("max-bytes", "max_bytes", value)

    def opt_overflow(self, value: str) -> None:
        """[GROUP=]reject-publish|drop-oldest: a group at its caps refuses a job, or drops its oldest waiting one"""
        self._cap("overflow", "overflow", value)

    def opt_ack_wait(self, value: str) -> None:
        """[GROUP=]SECONDS a member has to ack a delivery (or send progress) before it goes to another member (default: no deadline; a member's work comes back only when it leaves; repeatable)"""
        self._cap("ack-wait", "ack_wait", value)

    def opt_max_deliveries(self, value: str) -> None:
        """[GROUP=]N deliveries of a job at most: one that comes back after that (nack, ack wait, its member gone) goes to --dead-letter (default: no limit; repeatable)"""
        self._cap("max-deliveries", "max_deliveries", value)

    def opt_dead_letter(self, value: str) -> None:
        """[GROUP=]KEY dead letters are published on (JSON header with group, key, attempts, error; a NUL; the payload); without it they are dropped and counted lost.max_deliveries (repeatable)"""
        self._cap("dead-letter", "dead_letter", value)

    def opt_group(self, value: str) -> None:
        """A group: NAME=PATTERN (repeatable). NAME: 1-64 of A-Z a-z 0-9 _ . -"""
        name, sep, pattern = value.partition("=")
        if not sep:
            raise usage.UsageError(f"--group: expected NAME=PATTERN, got {value!r}")
        try:
            name_b = check_group(name)
        except ValueError as e:
            raise usage.UsageError(f"--group: {e}") from None
        pattern_b = os.fsencode(pattern)
        try:
            codec.encode_sub(pattern_b)
        except codec.ProtocolError as e:
            raise usage.UsageError(f"--group {name}: bad pattern: {e}") from None
        if pattern_b.startswith(b"!") or pattern_b.startswith(b"sbus/services/"):
            raise usage.UsageError(f"--group {name}: the pattern may not name secret keys or "
                                   "sbus/services/ keys")
        if any(n == name_b for n, _ in self["groups"]):
            raise usage.UsageError(f"--group: {name} given twice")
        self["groups"].append((name_b, pattern_b))

    def opt_allow_uid(self, value: str) -> None:
        """A uid (besides the service's own and root) whose clients may join (repeatable)."""
        try:
            uid = int(value, 10)
            if uid < 0:
                raise ValueError
        except ValueError:
            import pwd
            try:
                uid = pwd.getpwnam(value).pw_uid
            except KeyError:
                raise usage.UsageError(f"--allow-uid: no such user: {value!r}") from None
        self["allow-uids"].append(uid)

    def postOptions(self):
        from sbus.options import positive_float, positive_int

        if not self["groups"]:
            raise usage.UsageError("give at least one --group NAME=PATTERN")
        if self["full"] not in MODES:
            raise usage.UsageError(f"--full: one of {', '.join(MODES)}, not {self['full']!r}")
        self["limit"] = positive_int("limit", self["limit"])
        every = self["caps"].pop(None, {})
        self["limit"] = every.get("limit", self["limit"])
        self["max-bytes"] = every.get("max_bytes")
        self["overflow"] = every.get("overflow", "reject-publish")
        self["ack-wait"] = every.get("ack_wait")
        self["max-deliveries"] = every.get("max_deliveries")
        self["dead-letter"] = every.get("dead_letter")
        names = {n for n, _ in self["groups"]}
        for name in self["caps"]:
            if name not in names:
                raise usage.UsageError(f"--max-jobs/--max-bytes/--overflow/--ack-wait/--max-deliveries/"
                                       f"--dead-letter: no --group named {name.decode()}")
        for key in [self["dead-letter"]] + [c["dead_letter"] for c in self["caps"].values() if "dead_letter" in c]:
            if key is not None and (any(matches(p, key) for _, p in self["groups"])
                                    or key.startswith(b"sbus/services/")):
                raise usage.UsageError("--dead-letter: the key may not match a group's pattern "
                                       "(a dead letter would be queued again) nor be under sbus/services/")
        self["window"] = positive_int("window", self["window"])
        self["window-bytes"] = positive_int("window-bytes", self["window-bytes"])
        self["max-packet"] = positive_int("max-packet", self["max-packet"])
        self["stats-interval"] = positive_float("stats-interval", self["stats-interval"])
        if self["store"]:
            from sbus.core.queuestore import JournalError, QueueStore
            try:
                self["store"] = QueueStore(self["store"])
            except JournalError as e:
                raise usage.UsageError(str(e)) from None
        Chassis.checkBus(self["bus"])


def makeService(options) -> QueueService:
    return QueueService(options["bus"], options["groups"], limit=options["limit"], full=options["full"],
                        window=options["window"], window_bytes=options["window-bytes"], allowed_uids=options["allow-uids"],
                        max_packet=options["max-packet"], stats_interval=options["stats-interval"],
                        ack_wait=options["ack-wait"], max_deliveries=options["max-deliveries"],
                        dead_letter=options["dead-letter"], store=options["store"],
                        max_bytes=options["max-bytes"], overflow=options["overflow"], caps=options["caps"])


def _is_group(name: str) -> bool:
    try:
        check_group(name)
    except ValueError:
        return False
    return True
