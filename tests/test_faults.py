"""Fault suite (issue 7): processes killed with SIGKILL at the worst moments —
clients at every point of a conversation, a relay's master under load, the
recorder mid-recording — and the soak command's smoke run.

A subscriber that stops reading under `blocking/soft/block` / `hard/block`
(unrelated traffic flows, the stall deadline disconnects it, counted) is
`test_a_client_that_never_reads[soft-block|queue+hard-block]` in
tests/test_adversarial.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import connect, msg, recv, send, served, stats, sub, sync, unique, wait_stats
from helpers import REPO, TwistdBus, wait_until
from test_adversarial import _answers_whoami, relay, sbusd, servers  # noqa: F401

TIMEOUT = 10.0
UID_SUBS = 3000


@pytest.fixture(scope="module")
def fbus(tmp_path_factory):
    """`twistd sbus` with a per-uid subscription budget, so a leak of the dead's budget shows."""
    d = tmp_path_factory.mktemp("faults")
    address = str(d / "bus.sock")
    srv = TwistdBus(address, d / "twistd.log", ["--max-uid-subscriptions", str(UID_SUBS)])
    yield srv
    srv.stop()


# ---------------------------------------------------------------- clients killed at every point


def _victim(address: str, point: str, key: bytes, w: int) -> None:  # pragma: no cover - child
    """The conversation of a client to be SIGKILLed; writes b'.' to `w` once at the point."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(address)
    if point == "after-connect":
        os.write(w, b".")
        signal.pause()
    if point == "mid-subscribe":
        for i in range(2000):
            s.send(b"SUB %s/%d" % (key, i))
            if i == 500:
                os.write(w, b".")
        signal.pause()
    if point == "holding-secret":
        s.send(b"SUB !/cred////" + key)
        for i in range(1000):
            s.send(b"SUB %s/%d" % (key, i))
        s.send(b"CMSG !/cred/whoami")
        s.recv(4096)
        os.write(w, b".")
        signal.pause()
    if point == "mid-publish":
        s.send(b"SUB " + key)
        i = 0
        while True:
            s.send(b"MSG %s\0%d:" % (key, i) + b"p" * 500)
            if i == 200:
                os.write(w, b".")
            i += 1
    if point == "queue-pending":
        s.send(b"SUB " + key)
        s.send(b"CMSG !/cred/whoami")
        s.recv(4096)
        os.write(w, b".")
        signal.pause()  # never reads again
    if point == "mid-sub-packet-burst":
        # subscribe, publish, unsubscribe interleaved, as fast as possible
        i = 0
        while True:
            s.send(b"SUB %s/%d" % (key, i % 50))
            s.send(b"MSG %s\0x" % key)
            s.send(b"UNSUB %s/%d" % (key, i % 50))
            if i == 300:
                os.write(w, b".")
            i += 1


POINTS = ["after-connect", "mid-subscribe", "holding-secret", "mid-publish", "queue-pending", "mid-sub-packet-burst"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("point", POINTS)
def test_client_killed_at_every_point(fbus, point):
    """SIGKILL at each point: the server drops the connection and everything it held
    (connection, subscriptions and their per-uid budget, queue), counts it as `closed`,
    and nobody else notices anything but the victim's messages stopping."""
    key = unique("victim/").encode()
    watcher = connect(fbus.address, big=True)
    send(watcher, sub(key))
    sync(watcher)
    base = stats(watcher)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            _victim(fbus.address, point, key, w)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"."
        if point == "queue-pending":
            pub = connect(fbus.address, big=True)
            # fill the victim's queue (the watcher reads along)
            n = 0
            while not any(q["pid"] == pid and q["queued_bytes"] > 0 for q in stats(pub)["queues"]):
                for _ in range(50):
                    send(pub, msg(key, b"%d:" % n + b"q" * 4000))
                    n += 1
                while recv(watcher) != msg(key, b"%d:" % (n - 1) + b"q" * 4000):
                    pass
            pub.close()
        if point in ("mid-subscribe", "holding-secret"):
            wait_until(lambda: any(q["pid"] == pid and q["subscriptions"] >= 500 for q in stats(watcher)["queues"]),
                       "the victim holding subscriptions")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    st = wait_stats(watcher, lambda s: s["clients"] == base["clients"]
                    and all(q["pid"] != pid for q in s["queues"]), timeout=TIMEOUT)
    assert st["subscriptions"] == base["subscriptions"]
    gone = 1 + (point == "queue-pending")  # the victim (and the test's own publisher)
    assert st["disconnects"].get("closed", 0) == base["disconnects"].get("closed", 0) + gone
    assert sum(st["disconnects"].values()) == sum(base["disconnects"].values()) + gone
    # the watcher: whatever the victim published came whole and in order, then nothing more
    pub = connect(fbus.address)
    send(pub, msg(key, b"end"))
    expect = 0
    while (pkt := recv(watcher)) != msg(key, b"end"):
        assert pkt, "the watcher was disconnected"
        head, _, body = pkt.partition(b"\0")
        assert head == b"MSG " + key
        if point == "queue-pending":
            continue  # what the test itself published
        if point == "mid-sub-packet-burst":
            assert body == b"x"
            continue
        assert body == b"%d:" % expect + b"p" * 500, (expect, pkt[:60])
        expect += 1
    # the dead's per-uid subscription budget was given back: a live client may use all of it
    budget = UID_SUBS - st["subscriptions"]
    taker = connect(fbus.address)
    for i in range(budget):
        taker.send(b"SUB %s/taken/%d" % (key, i))
    assert sync(taker) == []
    taker.close()
    pub.close()
    watcher.close()
    served(fbus.address)
    assert fbus.proc.poll() is None


# ---------------------------------------------------------------- the relay's master killed under load


class Publisher(threading.Thread):
    """Publishes `key` with payloads 0, 1, 2, ... until stopped or the bus goes away."""

    def __init__(self, address, key: bytes):
        super().__init__(daemon=True)
        self.sock = connect(address)
        self.key = key
        self.sent = 0
        self.stopped = threading.Event()
        self.error = None

    def run(self):
        try:
            while not self.stopped.is_set():
                self.sock.send(msg(self.key, b"%d" % self.sent))
                self.sent += 1
                if self.sent % 200 == 0:
                    time.sleep(0.001)  # pacing, not synchronisation: keep the load moderate
        except OSError as e:
            self.error = e

    def stop(self) -> int:
        self.stopped.set()
        self.join(TIMEOUT)
        return self.sent


def _seqs(packets, key: bytes) -> list[int]:
    head = b"MSG " + key + b"\0"
    return [int(p[len(head):]) for p in packets if p.startswith(head)]


@pytest.mark.timeout(90)
def test_relay_master_killed_and_restarted_under_load(tmp_path, servers):
    master = sbusd(tmp_path)
    servers.append(master)
    r = relay(tmp_path, master.address, str(tmp_path / "relay.sock"), "--initial-delay", "0.05", "--max-delay", "0.3")
    servers.append(r)
    s = connect(r.address, big=True)
    send(s, b"CMSG blocking/soft/block", sub(b"load/"))  # lossless for what reaches the relay
    sync(s)
    wait_until(lambda: any(q["pid"] == r.pid and q["subscriptions"] == 1 for q in stats(connect(master.address))["queues"]),
               "the relay's upward subscription")
    received: list[bytes] = []
    reader_stop = threading.Event()

    def read():
        while not reader_stop.is_set():
            try:
                p = recv(s, 0.2)
            except TimeoutError:
                continue
            if not p:
                return
            received.append(p)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    local = Publisher(r.address, b"load/local")
    above = Publisher(master.address, b"load/master")
    local.start()
    above.start()
    wait_until(lambda: len(received) > 2000, "traffic through the relay")

    master.proc.kill()  # SIGKILL: its socket file stays behind
    master.proc.wait()
    r.wait_log("lost the master")
    above.join(TIMEOUT)
    assert above.error is not None  # its bus died under it
    n_local = len(_seqs(received, b"load/local"))
    wait_until(lambda: len(_seqs(received, b"load/local")) > n_local + 500, "local traffic during the outage")

    master2 = sbusd(tmp_path, "-r", address=master.address)
    servers.append(master2)
    wait_until(lambda: any(q["pid"] == r.pid and q["subscriptions"] == 1
                           for q in stats(connect(master2.address))["queues"]), "re-subscribed upward", timeout=20)
    # downward after the restart
    with connect(master2.address) as m:
        send(m, *[msg(b"load/again", b"%d" % i) for i in range(300)])
        sync(m)
    # upward after the restart: the relay's local traffic reaches the new master
    with connect(master2.address) as up:
        send(up, sub(b"load/local"))
        sync(up)
        wait_until(lambda: any(q["pid"] == r.pid and q["subscriptions"] == 1
                               for q in stats(up)["queues"]), "still one upward pattern")
        p = recv(up, TIMEOUT)
        assert p.startswith(b"MSG load/local\0")
    n_local = local.stop()
    assert local.error is None, local.error
    send(local.sock, msg(b"load/end", b""))
    # The end marker follows every local message (one publisher's order); the master's 300 may
    # come before or after it (two feeders of one block-mode subscriber resume in either order).
    end = msg(b"load/end", b"")
    wait_until(lambda: end in received[-400:] and len(_seqs(received, b"load/again")) == 300,
               "the end marker and the new master's messages", timeout=20)
    reader_stop.set()
    reader.join(TIMEOUT)

    # local traffic: every message, in order, once — the outage did not touch it
    assert _seqs(received, b"load/local") == list(range(n_local))
    # from the dead master: a gap-free prefix of what was published (the tail died with it)
    from_above = _seqs(received, b"load/master")
    assert from_above == list(range(len(from_above))) and 0 < len(from_above) <= above.sent
    # from the new master: everything, in order
    assert _seqs(received, b"load/again") == list(range(300))
    with connect(r.address) as c:
        up = stats(c)["upstream"]
    assert up["connected"] and up["reconnects"] >= 1
    assert up["drops"].get("master_down", 0) > 0  # local publishes not carried upward while it was away: counted
    assert r.proc.poll() is None
    assert "Traceback" not in r.log()


# ---------------------------------------------------------------- the recorder killed with SIGKILL


@pytest.mark.timeout(120)
def test_recorder_killed_and_restarted(tmp_path, servers):
    """docs/pipeline.md: a crash loses what was queued for the writer and what is published
    while no recorder runs, and marks it. Check exactly that: every published file is readable
    and unchanged by the restart; the rows of the open file are recovered from its journal;
    what the first run kept is a gap-free prefix of what was sent; one gap row follows it; the
    second run continues the seq numbering and records everything sent after it subscribed;
    nothing is duplicated."""
    import pyarrow.parquet as pq

    from pipeline_conftest import RecorderProcess, read_recording
    from sbus.client import connect as bus_connect
    from sbus.pipeline.schema import ARROW_SCHEMA, published_files

    bus = sbusd(tmp_path)
    servers.append(bus)
    out = tmp_path / "rec"
    recorders = []
    try:
        rec1 = RecorderProcess(bus.address, out, ["--roll-age", "200ms"], log_path=str(tmp_path / "rec1.log"))
        recorders.append(rec1)
        rec1.wait_ready()
        pub = bus_connect(bus.address)

        def publish(lo, hi):
            for i in range(lo, hi):
                pub.publish(b"rec/%d" % (i % 7), b"%08d" % i + b"." * (i % 300))
            pub.sync(timeout=TIMEOUT)

        def published_rows():
            return sum(pq.ParquetFile(p).metadata.num_rows for _, _, p in published_files(str(out)))

        publish(0, 3000)
        wait_until(lambda: published_rows() >= 1000, "rows published by the first recorder", timeout=20)
        publish(3000, 4000)
        rec1.proc.kill()  # SIGKILL mid-recording: rows queued and in the open file are lost
        rec1.proc.wait()
        publish(4000, 5000)  # nobody records these
        before = {p: os.path.getsize(p) for _, _, p in published_files(str(out))}
        rows1 = read_recording(out)
        k = len(rows1)

        rec2 = RecorderProcess(bus.address, out, ["--roll-age", "200ms"], log_path=str(tmp_path / "rec2.log"))
        recorders.append(rec2)
        rec2.wait_ready()
        assert "gap row at seq" in rec2.log()
        assert not any(n.endswith(".arrows") and n < "rec-%016d" % (k + 1) for n in os.listdir(out / "_tmp"))
        publish(5000, 7000)
        last = b"%08d" % 6999

        def last_published():
            rows = read_recording(out)
            return rows and rows[-1]["payload"].startswith(last)

        wait_until(last_published, "the last message published", timeout=30)
        assert rec2.stop() in (0, -15)
        pub.close()
    finally:
        for rec in recorders:
            rec.stop()

    # every file readable, with the schema; the first run's files untouched
    files = published_files(str(out))
    for _, _, path in files:
        assert pq.read_table(path).schema.equals(ARROW_SCHEMA, check_metadata=False)
    for path, size in before.items():
        assert os.path.getsize(path) == size
    rows = read_recording(out)
    assert rows[:k] == rows1
    seqs = [r["seq"] for r in rows]
    assert seqs == list(range(1, len(rows) + 1))  # continued across the crash, no duplicate
    gaps = [i for i, r in enumerate(rows) if r["dropped"] == -1]
    # One drop row beside the gap row: what the bus counted for the recorder's session while none
    # was connected (4000..4999, and what it still held for the killed one): issue 23.
    away = [r["dropped"] for r in rows if r["dropped"] > 0]
    assert len(gaps) == 1 and gaps[0] >= k and len(away) == 1, (gaps, away)
    g = gaps[0]
    rows = [r for r in rows if r["dropped"] == 0]
    idx = [int(r["payload"][:8]) for r in rows]
    first, second = idx[:g], idx[g:]
    assert first == list(range(g)) and k >= 1000  # published or recovered: a gap-free prefix
    assert second == list(range(second[0], 7000)) and second[0] >= g  # no duplicate, no gap after restart
    assert second[0] <= 5000  # everything sent after the restart was recorded
    assert 1000 <= away[0] <= second[0] - g, (away, second[0] - g)  # counted, never more than lost
    for r in rows:
        assert r["key"] == b"rec/%d" % (int(r["payload"][:8]) % 7) and r["size"] == len(r["payload"])
    assert "Traceback" not in Path(tmp_path / "rec2.log").read_text()


# ---------------------------------------------------------------- the soak command, smoke run


@pytest.mark.timeout(120)
def test_soak_smoke(tmp_path):
    report = tmp_path / "soak.json"
    res = subprocess.run([sys.executable, os.path.join(REPO, "bench", "soak.py"), "--minutes", "0.2",
                          "--clients", "60", "--json", str(report)],
                         capture_output=True, text=True, timeout=110, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["ok"] is True
    assert data["clients_total"] >= 60
    for flow in data["flows"]:
        if flow["lossless"]:
            assert flow["received"] == flow["expected"] and flow["expected"] > 0, flow
            assert flow["gaps"] == 0 and flow["duplicates"] == 0
        else:
            assert flow["received"] + flow["server_drops"] == flow["expected"], flow
    assert data["server_alive"] and len(data["rss_kib"]) >= 2
