"""A restarted `twistd sbus-nats` and its peer count what the dead one lost (issue 23).

Real processes: a nats-server, two buses (`sbusd -f`), an exporting sbus-nats on bus A and
an importing one on bus B. A publisher sends numbered messages on A at a steady rate; a
subscriber on B reads them. One sbus-nats is killed (-9) mid-flow and restarted after 0.2 s;
then sent = received + counted as lost (within 1 % of sent: what the killed exporter had read
from its bus but not yet written to NATS, and one acknowledgement interval, are the slack; and,
for each kill of the exporter, what bus A's kernel held in the socket toward it, which nobody
counts: `KERNEL_HELD`), nothing is duplicated and the order is kept. The only sleep is the deliberate 0.2 s pause.

Where the count comes from: bus -> NATS, the successor's `server/session` on its bus
(`lost.restart` of the exporter); NATS -> bus, the exporter, told by the importer's successor
that a new instance acknowledges (`lost.restart` of the exporter too).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import uuid

import pytest

from helpers import SERVICE_TIMEOUT, SbusdProcess, child_env, connect, msg, recv, send, sync, wait_stats, wait_until
from sbus.core import codec
from test_failover import Receiver, SteadyPublisher, far_subscriber
from test_lossless import routed
from test_server_restart_under_services import answers_on
from test_nats import UNAUTH, NatsNode, Twistd, free_ports, nats

RATE = 2000
KILL_AT = 2000          # the far subscriber has message KILL_AT: kill
AFTER = 14000           # messages after that (7 s: longer than a restart on a loaded machine)
TAIL = 2000             # and at least this many after the last restart brought the flow back
DONE = 120.0
READY = r"NATS: connected to .*; ready"
#: The lines that say a count was added to lost (a dead instance's count is in its log only).
COUNTED = re.compile(r"(?:resumed session .*?: (\d+) message\(s\) published for export|"
                     r"restarted: (\d+) message\(s\) published after)")
#: Packets of this flow that the kernel holds in a socket from the server to a root client that
#: does not read (the server's send buffer for root, as the kernel counts it, over one small
#: packet's size: 1,152 measured, 5,000 published to a subscriber that never read, 3,848 queued
#: in the server). A loaded CI run's exporter, starved of CPU, had let it fill when it was
#: killed: 1,145 uncounted. Counted since the exporter acknowledges what it exported
#: (`server/session-ack`, the test below the others); kept as slack for what nats-py still held
#: unsent (at most --max-pending, 64 KiB), which nobody counts.
KERNEL_HELD = 1200
RESUMED_LINE = re.compile(r"resumed session .*?: \d+ message\(s\) published for export")
CARRIED = re.compile(r"; (\d+) of them were told to a predecessor that was killed before confirming")


class Pair:
    """Bus A --sbus-nats (export r/)--> NATS --sbus-nats (import r/)--> bus B."""

    def __init__(self, tmp):
        self.tmp = tmp
        port, cport = free_ports(2)
        self.url = f"nats://127.0.0.1:{port}"
        self.procs = []
        self.node = NatsNode(f"r{port}", port, cport, [], tmp)
        self.node.wait_log("Server is ready")
        self.buses = {}
        for side in "ab":
            addr = str(tmp / f"{side}.socket")
            self.buses[side] = SbusdProcess(["-f", "-a", addr], tmp / f"sbusd-{side}.log", address=addr)
            self.procs.append(self.buses[side])
        self.args = {"a": ["--export", "r/"], "b": ["--import", "r/"]}
        #: every instance of each side, the live one last
        self.instances = {"a": [], "b": []}
        #: kill -9s of the exporter: each may lose what bus A's kernel held toward it
        self.exporter_kills = 0
        for side in "ab":
            self.start(side)
        for side in "ab":
            self.instances[side][-1].wait_re(READY)

    def start(self, side) -> Twistd:
        p = Twistd(["sbus-nats", UNAUTH, "--bus", self.buses[side].address, "--server", self.url,
                    "--initial-delay", "0.2", "--stats-interval", "1", *self.args[side]], self.tmp)
        self.instances[side].append(p)
        self.procs.append(p)
        return p

    def live(self, side) -> Twistd:
        return self.instances[side][-1]

    def kill(self, side) -> None:
        self.exporter_kills += side == "a"
        p = self.live(side)
        p.proc.kill()
        p.proc.wait()

    def restart(self, side, pause=0.2) -> Twistd:
        self.kill(side)
        time.sleep(pause)     # the deliberate pause before the restart (what systemd would do)
        return self.start(side)

    def stats(self, side) -> dict:
        """The live sbus-nats's stats on that side's bus (`sbus stats --services`), asked again
        while it gives no answer within the command's 1 s (one just restarted, catching up on a
        loaded machine, once did not)."""
        def mine():
            return [a for a in answers_on(self.buses[side].address) if a.get("service") == "sbus-nats"]

        (st,) = wait_until(mine, f"sbus-nats's stats on bus {side}", SERVICE_TIMEOUT)
        return st["stats"]

    def lost(self) -> dict:
        """The live instances' `lost` counters, summed by reason."""
        total: dict = {}
        for side in "ab":
            for why, n in self.stats(side)["lost"].items():
                total[why] = total.get(why, 0) + n
        return total

    def top_line(self, side) -> str:
        """The sbus-nats line of `sbus top` on that side's bus (the answers asked for in a frame
        are shown in the next: the second frame's)."""
        r = subprocess.run([sys.executable, "-m", "sbus.cli", "--bus", self.buses[side].address,
                            "top", "-n", "2", "-i", "0.5"], capture_output=True, timeout=30,
                           env=child_env(), stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr[-300:]
        lines = [line for line in r.stdout.decode().splitlines() if "sbus-nats" in line]
        assert lines, r.stdout[-500:]
        return lines[-1]

    def logged(self) -> int:
        """What every instance, dead or live, logged as counted; a count carried over from a
        predecessor killed before it confirmed is taken once (the predecessor logged it, or not)."""
        total = 0
        for side in "ab":
            before = None
            for p in self.instances[side]:
                text = p.log()
                total += sum(int(a or b) for a, b in COUNTED.findall(text))
                carried = sum(int(n) for n in CARRIED.findall(text))
                if carried and before is not None and RESUMED_LINE.search(before):
                    total -= carried  # in the predecessor's line too
                before = text
        return total

    def slack(self, sent: int) -> float:
        """How far sent = received + counted may be off (the module's docstring)."""
        return 0.01 * sent + KERNEL_HELD * self.exporter_kills

    def close(self):
        for p in reversed(self.procs):
            p.stop()
        self.node.stop()


@pytest.fixture
def pair(tmp_path):
    p = Pair(tmp_path)
    try:
        yield p
    finally:
        p.close()


class OpenPublisher(SteadyPublisher):
    """A SteadyPublisher that publishes on until `finish(n)`: its flow outlasts the kills and
    restarts however long a loaded machine takes over them (a fixed count once ran out during
    a third restart, and the flow it waited to see resume never could)."""

    def __init__(self, address, prefix: bytes, rate: float):
        super().__init__(address, prefix, 0, rate)
        self.n = None

    def finish(self, n: int) -> int:
        """End at `n` messages, or the TAIL beyond those sent by now if that is more: the count."""
        self.n = max(n, self.sent + TAIL)
        return self.n

    def run(self):
        start = time.monotonic()
        try:
            while self.n is None or self.sent < self.n:
                ahead = start + self.sent / self.rate - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
                self.client.publish(self.prefix + b"%d" % self.sent, b"%d" % self.sent)
                self.sent += 1
        except Exception as e:  # noqa: BLE001
            self.error = e


def flow(pair, during, n=KILL_AT + AFTER):
    """Publish numbered messages on bus A at RATE; once B's subscriber has message KILL_AT,
    call `during()` (kills and restarts); then publish up to n in all (TAIL more if the restarts
    took longer), wait for the last message and return (sent, the numbers received)."""
    prefix = f"r/{uuid.uuid4().hex[:6]}/".encode()
    s = far_subscriber(pair.buses["b"].address, prefix)
    routed(pair.buses["a"].address, s, prefix, timeout=30)
    r = Receiver(s, prefix)
    r.start()
    pub = OpenPublisher(pair.buses["a"].address, prefix, RATE)
    pub.start()
    wait_until(lambda: r.has(KILL_AT), f"message {KILL_AT} across", DONE)
    during(r)
    n = pub.finish(n)
    wait_until(lambda: r.has(n - 1) or (pub.error and pytest.fail(str(pub.error))),
               f"the last message ({len(r.got)} received)", DONE)
    pub.join(DONE)
    r.stopping = True
    r.join(5)
    s.close()
    got = r.got
    assert len(got) == len(set(got)), f"{len(got) - len(set(got))} duplicated"
    back = sum(1 for x, y in zip(got, got[1:]) if y <= x)
    assert back == 0, f"{back} out of order"
    return pub.sent, got


def resumed_through(r):
    """The flow comes through again: B gets messages beyond what it had."""
    mark = r.got[-1] + 1 if r.got else 0
    wait_until(lambda: r.has(mark + 1), "the flow resumed", DONE)


def check_accounted(pair, sent, got, lost_now):
    missing = sent - len(got)
    counted = sum(lost_now.values())
    print(f"sent {sent}, received {len(got)}, missing {missing}, counted {lost_now} "
          f"(logged {pair.logged()})")
    assert missing > 0, "the kill lost nothing: it proves nothing"
    assert abs(missing - counted) <= pair.slack(sent), \
        f"sent {sent} = received {len(got)} + lost {counted}? off by {missing - counted}"


def settled_lost(pair, sent, got, reason="restart"):
    """The live instances' lost counters, once they account for what is missing (the importer's
    successor acknowledges within milliseconds of its first message: an event to wait for)."""
    missing = sent - len(got)
    seen = {}

    def done():
        seen.update(pair.lost())
        return abs(missing - sum(seen.values())) <= pair.slack(sent)
    try:
        wait_until(done, "the lost counters to account for the missing messages", 30, interval=0.2)
    except AssertionError:
        pass   # the assertion below says by how much
    return seen


@pytest.mark.parametrize("side", ["a", "b"])
def test_killed_and_restarted_after_0_2s_its_loss_is_counted(pair, side):
    """kill -9 of bus A's sbus-nats (exporter: its successor's bus session counts what was
    published meanwhile) or of bus B's (importer: the exporter counts the sequence numbers its
    successor never got); old code: 2,000+ missing, counted nowhere."""
    def during(r):
        pair.restart(side).wait_re(READY)
        resumed_through(r)

    sent, got = flow(pair, during)
    lost_now = settled_lost(pair, sent, got)
    check_accounted(pair, sent, got, lost_now)
    assert lost_now.get("restart", 0) > 0
    assert pair.logged() == lost_now["restart"]
    if side == "b":
        assert pair.stats("a")["restarts"]["importer_restarts"] == 1
    else:
        assert pair.stats("a")["restarts"]["session"]["state"] == "resumed"
    # where an operator looks: sbus top, and the stop line
    assert f"restart {lost_now['restart']}" in pair.top_line("a")
    pair.live("a").stop()
    assert re.search(r'sbus-nats stopped: .*"lost":\{[^}]*"restart":%d' % lost_now["restart"],
                     pair.live("a").log())


def check_logged(pair, sent, got):
    """sent = received + what every instance, dead or live, logged as counted (a count held
    by an instance that died again is in its log line only), + the live ones' drops. (Not
    `settled_lost` first: the live counters alone never account for a gap counted by an
    instance that died again, so that wait only ever ran out its 30 s.)"""
    missing = sent - len(got)

    def counted():
        return pair.logged() + sum(n for why, n in pair.lost().items() if why != "restart")

    wait_until(lambda: abs(missing - counted()) <= pair.slack(sent),
               f"the logged counts to account for the {missing} missing messages", 30, interval=0.2)
    print(f"sent {sent}, received {len(got)}, missing {missing}, counted {counted()} "
          f"(logged {pair.logged()})")
    assert missing > 0


@pytest.mark.parametrize("side", ["a", "b"])
def test_killed_again_in_its_first_second(pair, side):
    """The successor is killed again as soon as it logged its start line (within its first
    second: it may or may not have claimed its session or acknowledged), restarted after
    0.2 s: both gaps are counted, by the second successor or in the first one's log line."""
    def during(r):
        first = pair.restart(side)
        first.wait_re(r"exporting .*; importing ")     # its first log line
        pair.restart(side).wait_re(READY)
        resumed_through(r)

    sent, got = flow(pair, during)
    check_logged(pair, sent, got)


def test_a_successor_killed_before_it_recorded_its_count_leaves_it_to_the_next(pair):
    """The window CI once hit: the bus answered a successor's claim, and the successor died
    before it read the answer. Played here, without timing, by a connection of the same uid
    that claims the exporter's session as sbus-nats does (asking to confirm) and closes
    unconfirmed: the next sbus-nats is told that count too, counts it (lost.restart) and says
    it is carried. Old code: told once, to the connection that died; the next one counted 0."""
    name = pair.stats("a")["restarts"]["session"]["name"].encode()
    pair.kill("a")
    bus = connect(pair.buses["a"].address)
    wait_stats(bus, lambda st: st["sessions"]["lingering"] == 1, timeout=30)
    send(bus, *[msg(b"r/dead/%d" % i, b"x") for i in range(40)])
    sync(bus)
    send(bus, codec.session_request(name, 60, confirm=True))
    reply = recv(bus, 30)
    assert reply.startswith(b"CMSG server/session\0" + name + b"\0resumed\x0040\0"), reply[:120]
    bus.close()  # "killed" before it confirmed
    again = connect(pair.buses["a"].address)
    wait_stats(again, lambda st: st["sessions"]["lingering"] == 1, timeout=30)
    again.close()
    successor = pair.start("a")
    successor.wait_re(r"resumed session .*: 40 message\(s\) published for export .*; 40 of them were told "
                      r"to a predecessor that was killed before confirming")
    wait_until(lambda: pair.stats("a")["lost"].get("restart") == 40, "lost.restart of the successor: 40", 30)


def test_what_its_bus_held_for_a_killed_exporter_is_counted_by_its_successor(pair):
    """Issue 34, "restarts counted end to end": the exporter stopped (SIGSTOP) while bus A sends
    it 2,000 messages, then killed (-9) and started again. Bus A's kernel held some of them for
    it, unread (about 1,150 small packets for a client of the same uid), its queue the rest.
    The exporter acknowledges each read batch it has exported (`server/session-ack`), so its
    session counts both, and the successor reports all 2,000 lost (restart). The code before
    counted only the queue (848)."""
    import signal as _signal

    prefix = b"r/held/"
    s = far_subscriber(pair.buses["b"].address, prefix)
    routed(pair.buses["a"].address, s, prefix, timeout=DONE)
    exporter = pair.live("a")
    exporter.proc.send_signal(_signal.SIGSTOP)
    try:
        with connect(pair.buses["a"].address) as pub:
            send(pub, *[msg(prefix + b"%d" % i, b"x") for i in range(2000)])
            sync(pub)
    finally:
        pair.kill("a")
    s.close()
    successor = pair.start("a")
    found = re.search(r"resumed session .*?: (\d+) message\(s\) published for export",
                      successor.wait_re(r"resumed session .*?: \d+ message\(s\) published for export"))
    assert 2000 <= int(found.group(1)) <= 2002, f"counted {found.group(1)} of the 2000 the killed exporter never read"


@pytest.mark.parametrize("side", ["a", "b"])
def test_two_kills_in_a_row(pair, side):
    """Killed, restarted, flowing again, killed again: each gap is counted; the first
    successor's count died with it (only its log line has it), so the check adds the counts
    every instance logged."""
    def during(r):
        for _ in range(2):
            pair.restart(side).wait_re(READY)
            resumed_through(r)

    sent, got = flow(pair, during)
    check_logged(pair, sent, got)


def test_the_counting_peer_restarts_too(pair):
    """The importer (B) restarts, then the exporter (A) that counted B's gap restarts too: the
    new exporter knows nothing of B and counts its own gap; B's next restart is counted again
    by the new exporter (it learnt B's instance from its acknowledgements). The exporter is
    killed once it has counted B's gap: it counts on hearing B's successor acknowledge, and one
    killed before that counts nothing (docs/deploy.md: "Both ends dead at once"); on a loaded
    CI run it was killed first once, 2,714 left uncounted."""
    def during(r):
        pair.restart("b").wait_re(READY)
        resumed_through(r)
        pair.live("a").wait_re(r"importer .* restarted: \d+ message\(s\)")
        for side in ("a", "b"):
            if side == "b":  # the new exporter knows B's instance from its acknowledgements: one first
                wait_until(lambda: pair.stats("a")["restarts"]["acks"]["received"] > 0,
                           "the new exporter's first acknowledgement from B", DONE)
            pair.restart(side).wait_re(READY)
            resumed_through(r)

    sent, got = flow(pair, during)
    check_logged(pair, sent, got)
    assert pair.stats("a")["restarts"]["importer_restarts"] == 1


def test_a_second_one_with_the_same_name_refuses(pair):
    """One sbus-nats per name per bus: a second with the same patterns (so the same default
    name) exits non-zero with one line, and the first goes on."""
    twin = pair.start("a")
    assert twin.proc.wait(30) == 78  # EX_CONFIG: systemd's unit does not restart it
    errors = [line for line in twin.log().splitlines() if "another sbus-nats named" in line]
    assert len(errors) == 1 and "give the other one a different --name" in errors[0]
    assert "Traceback" not in twin.log()
    assert pair.live("a") is twin
    pair.instances["a"].pop()
    assert pair.live("a").proc.poll() is None
    other = Twistd(["sbus-nats", UNAUTH, "--bus", pair.buses["a"].address, "--server", pair.url,
                    "--export", "r/", "--name", "second"], pair.tmp)
    pair.procs.append(other)
    other.wait_re(r"session sbus-nats/second claimed \(new")


def forge(url, subject, data, headers=None):
    async def go():
        nc = await nats.connect(url)
        await nc.publish(subject, data, headers=headers)
        await nc.flush()
        await nc.close()
    asyncio.run(go())


def test_forged_acknowledgements_and_sequence_numbers(pair):
    """Another NATS client sends acknowledgements and Sbus-Seq headers of its own: malformed
    ones are ignored, beyond-the-end ones clamped (one log line each), and the exporter's lost
    counter never goes negative nor beyond what it published, however many forged restarts."""
    a, b = pair.live("a"), pair.live("b")
    prefix = b"r/forge/"
    s = far_subscriber(pair.buses["b"].address, prefix)
    routed(pair.buses["a"].address, s, prefix, timeout=30)
    inst = re.search(r"instance ([0-9a-f]{16})", a.log()).group(1)
    subject = f"_SBUS.ack.{inst}"
    published = pair.stats("a")["restarts"]["published_seq"]
    ack = {"bus": "f" * 32, "name": "x", "inst": "1" * 16, "first": 1, "last": 1}
    for bad in (b"{", b"[]", b"x" * 5000, json.dumps({**ack, "first": -5}).encode(),
                json.dumps({**ack, "last": "9"}).encode(), json.dumps({**ack, "first": True}).encode()):
        forge(pair.url, subject, bad)
    # a forged importer restarting 50 times, each claiming a huge gap
    for i in range(50):
        forge(pair.url, subject, json.dumps({**ack, "inst": f"{i:016x}", "first": 10 ** 15,
                                             "last": 10 ** 15}).encode())
    # forged sequence numbers toward the importer
    for v in ("nothex.5", f"{inst}.-3", f"{inst}.99999999999999999999", "zz.zz"):
        forge(pair.url, "sbus.r.forge.x", b"f", {"Sbus-Seq": v})
    wait_until(lambda: pair.stats("a")["restarts"]["acks"]["received"] >= 56, "the forged acks")
    st = pair.stats("a")
    print(st["lost"], st["restarts"])
    assert st["restarts"]["acks"]["refused"] == 6
    assert st["restarts"]["acks"]["clamped"] >= 49
    assert 0 <= st["lost"].get("restart", 0) <= st["restarts"]["published_seq"]
    assert published <= st["restarts"]["published_seq"] < published + 100
    for needle in ("ignoring a malformed acknowledgement", "beyond the"):
        assert a.log().count(needle) == 1, needle
    wait_until(lambda: "malformed Sbus-Seq" in b.log(), "the importer's line on a forged seq")
    assert b.log().count("malformed Sbus-Seq") == 1
    assert b.proc.poll() is None and a.proc.poll() is None
    s.close()
