#!/usr/bin/env python3
"""Soak test: hundreds of clients publishing and subscribing with churn, then a report.

    .venv/bin/python bench/soak.py --minutes 10            # the report in docs/reliability.md
    .venv/bin/python bench/soak.py --minutes 0.2 --clients 60   # smoke run (tests/test_faults.py)

Starts its own server (`python -m sbus.server.sbusd -f`, or `--server-cmd`), then
`--workers` processes drive `--clients` connections between them, non-blocking,
one selector loop each. Three flows, each on four keys `soak/<flow>/k0..k3`:

* `block`: subscribers in `blocking/soft/block` — lossless, publishers are paced
  by back-pressure;
* `hardblock`: subscribers in `blocking/soft/queue` + `blocking/hard/block` — lossless;
* `discard`: subscribers in `blocking/soft/discard` that read slowly on purpose —
  drops allowed, and every one must be counted by the server (`soft_discard`).

Roles: stable subscribers (whole flow, from before the first publish to after the
last), churning subscribers (one key, subscribe/unsubscribe/reconnect every few
seconds), publishers (half of them churn: connect, publish a burst, sync, leave),
and idle clients that come and go holding patterns nobody publishes on.
Every payload is `<publisher id>:<seq>`; subscribers check per-publisher order.

The verdict (exit status 0 only if all hold):

* lossless flows: every stable subscriber received exactly what was sent
  (per publisher, 0..n-1, no gap, no duplicate); churning subscribers saw no gap
  and no duplicate inside any session;
* discard flow: missing deliveries == the server's `soft_discard` count, exactly;
* no drop or disconnect of any other kind; the server alive at the end;
* server RSS flat after warm-up: the highest sample of the second half is at most
  max(16 MiB, 10 %) above the highest sample up to the end of the warm-up (first 25 %).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import random
import resource
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

WHOAMI = b"CMSG !/cred/whoami"
WHOAMI_REPLY = b"CMSG !/cred/whoami\0"
STATS = b"CMSG server/stats"
STATS_REPLY = b"CMSG server/stats\0"
FLOWS = {
    "block": ([b"CMSG blocking/soft/block"], True),
    "hardblock": ([b"CMSG blocking/soft/queue", b"CMSG blocking/hard/block"], True),
    "discard": ([b"CMSG blocking/soft/discard"], False),
}
KEYS = 4


# ====================================================================== worker side


class Conn:
    """One non-blocking client connection."""

    def __init__(self, w: "Worker", role: str, flow: str | None = None):
        self.w, self.role, self.flow = w, role, flow
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(w.address)
        self.sock.setblocking(False)
        self.out: collections.deque = collections.deque()
        self.events = 0
        self.replies_wanted = 0
        self.on_reply = None
        self.closed = False
        self.last: dict[bytes, int] = {}   # publisher id -> last seq seen (subscribers)
        self.received = 0
        self.gaps = self.dups = 0
        self.slow = False
        w.connections += 1
        self._update()

    def _update(self):
        ev = (selectors.EVENT_READ if not self.slow else 0) | (selectors.EVENT_WRITE if self.out else 0)
        if ev != self.events:
            if self.events == 0:
                self.w.sel.register(self.sock, ev, self)
            elif ev == 0:
                self.w.sel.unregister(self.sock)
            else:
                self.w.sel.modify(self.sock, ev, self)
            self.events = ev

    def send(self, pkt: bytes):
        if self.closed:
            return
        if not self.out:
            try:
                self.sock.send(pkt)
                return
            except BlockingIOError:
                pass
        self.out.append(pkt)
        self._update()

    def ask(self, on_reply):
        self.replies_wanted += 1
        self.on_reply = on_reply
        self.send(WHOAMI)

    def writable(self):
        while self.out:
            try:
                self.sock.send(self.out[0])
            except BlockingIOError:
                return
            self.out.popleft()
        self._update()

    def readable(self, budget: int = 512):
        for _ in range(budget):
            try:
                pkt = self.sock.recv(1 << 20)
            except BlockingIOError:
                return
            except ConnectionResetError:
                pkt = b""
            if not pkt:
                self.w.errors.append(f"{self.role}/{self.flow}: disconnected by the server")
                self.close()
                return
            self.packet(pkt)
            if self.closed:
                return

    def packet(self, pkt: bytes):
        if pkt.startswith(WHOAMI_REPLY):
            self.replies_wanted -= 1
            if self.replies_wanted == 0 and self.on_reply:
                cb, self.on_reply = self.on_reply, None
                cb(self)
            return
        if not pkt.startswith(b"MSG "):
            return
        payload = pkt.split(b"\0", 1)[1]
        pub, seq = payload.split(b":", 2)[:2]
        seq = int(seq)
        last = self.last.get(pub)
        if last is None:
            if self.role == "stable" and seq != 0:
                self.gaps += 1
        elif seq <= last:
            self.dups += 1
        elif seq != last + 1:
            self.gaps += 1
        self.last[pub] = seq
        self.received += 1

    def close(self):
        if not self.closed:
            self.closed = True
            if self.events:
                self.w.sel.unregister(self.sock)
                self.events = 0
            self.sock.close()


class Worker:
    def __init__(self, index, address, ctl, plan, seed):
        self.index, self.address, self.ctl, self.plan = index, address, ctl, plan
        self.rnd = random.Random(seed)
        self.sel = selectors.DefaultSelector()
        self.errors: list[str] = []
        self.connections = 0
        self.stable: list[Conn] = []
        self.pubs: list[dict] = []       # live publisher sessions
        self.sent: dict[str, dict[str, int]] = {f: {} for f in FLOWS}  # flow -> pub id -> sent
        self.churn_subs: list[dict] = []
        self.idle: list[dict] = []
        self.sessions = collections.Counter()
        self.churn_gaps = self.churn_dups = self.churn_discard_gaps = 0
        self.next_pub = 0
        self.phase = "setup"
        self.pending = 0
        self.last_tick = time.monotonic()

    # -- roles

    def new_pub(self, flow, churn):
        self.next_pub += 1
        pid = b"%d.%d" % (self.index, self.next_pub)
        c = Conn(self, "pub", flow)
        p = {"conn": c, "id": pid, "flow": flow, "churn": churn, "sent": 0, "t0": time.monotonic(),
             "key": b"soak/%s/k%d" % (flow.encode(), self.next_pub % KEYS),
             "pad": b"." * (4000 if flow == "discard" else 0),
             "limit": self.rnd.randint(50, 400) if churn else None, "closing": False}
        self.sent[flow][pid.decode()] = 0
        self.pubs.append(p)

    def end_pub(self, p, replace):
        p["closing"] = True

        def done(c):
            c.close()
            self.pubs.remove(p)
            self.sessions["pub"] += 1
            if replace and self.phase == "go":
                self.new_pub(p["flow"], True)
            self._maybe_stopped()

        p["conn"].ask(done)

    def new_churn_sub(self, flow):
        c = Conn(self, "churn", flow)
        # (churning subscribers of the discard flow read at full speed in the default mode, so that
        # every soft_discard drop belongs to a stable subscriber and the accounting stays exact)
        for pkt in FLOWS[flow][0] if flow != "discard" else []:
            c.send(pkt)
        key = b"soak/%s/k%d" % (flow.encode(), self.rnd.randrange(KEYS))
        c.send(b"SUB " + key)
        s = {"conn": c, "flow": flow, "key": key, "until": time.monotonic() + self.rnd.uniform(0.5, 4), "closing": False}
        self.churn_subs.append(s)

    def end_churn_sub(self, s):
        s["closing"] = True
        c = s["conn"]
        c.send(b"UNSUB " + s["key"])

        def done(c):
            self.churn_gaps += c.gaps
            self.churn_dups += c.dups
            if s["flow"] == "discard":
                self.churn_discard_gaps += c.gaps
            c.close()
            self.churn_subs.remove(s)
            self.sessions["churn_sub"] += 1
            if self.phase == "go":
                self.new_churn_sub(s["flow"])
            self._maybe_stopped()

        c.ask(done)

    def new_idle(self):
        c = Conn(self, "idle")
        for _ in range(self.rnd.randint(1, 8)):
            c.send(b"SUB noise/%d/%d/*" % (self.index, self.rnd.randrange(10**6)))
        i = {"conn": c, "until": time.monotonic() + self.rnd.uniform(0.2, 3), "closing": False}
        self.idle.append(i)

    def end_idle(self, i):
        i["closing"] = True

        def done(c):
            c.close()
            self.idle.remove(i)
            self.sessions["idle"] += 1
            if self.phase == "go":
                self.new_idle()
            self._maybe_stopped()

        i["conn"].ask(done)

    # -- phases

    def setup(self):
        p = self.plan
        flows = list(FLOWS)
        for n in range(p["stable"]):
            flow = flows[n % len(flows)]
            c = Conn(self, "stable", flow)
            for pkt in FLOWS[flow][0]:
                c.send(pkt)
            c.send(b"SUB soak/%s/" % flow.encode())
            c.send(b"SUB soak/%s/*" % flow.encode())  # overlapping: still one copy per message
            c.slow = flow == "discard"
            self.stable.append(c)
        self.pending = len(self.stable)

        def ready(c):
            self.pending -= 1
            if self.pending == 0:
                self.ctl.send(("ready", None))

        for c in self.stable:
            c.ask(ready)
            c.slow_was = c.slow
            if c.slow:  # the reply must be read: read it now, blocking, once
                c.slow = False
                c._update()

    def go(self):
        self.phase = "go"
        for c in self.stable:
            c.slow = getattr(c, "slow_was", False)
            c._update()
        flows = list(FLOWS)
        p = self.plan
        for n in range(p["pubs"]):
            self.new_pub(flows[n % len(flows)], churn=n % 2 == 1)
        for n in range(p["churn_subs"]):
            self.new_churn_sub(flows[n % len(flows)])
        for _ in range(p["idle"]):
            self.new_idle()

    def stop(self):
        self.phase = "stop"
        for p in list(self.pubs):
            if not p["closing"]:
                self.end_pub(p, replace=False)
        for s in list(self.churn_subs):
            if not s["closing"]:
                self.end_churn_sub(s)
        for i in list(self.idle):
            if not i["closing"]:
                self.end_idle(i)
        self._maybe_stopped()

    def _maybe_stopped(self):
        if self.phase == "stop" and not self.pubs and not self.churn_subs and not self.idle:
            self.phase = "stopped"
            self.ctl.send(("stopped", self.sent))

    def final(self):
        self.phase = "final"
        self.pending = len(self.stable)

        def done(c):
            self.pending -= 1
            if self.pending == 0:
                self.ctl.send(("final", self.results()))

        for c in self.stable:
            c.slow = False
            c._update()
            c.ask(done)

    def results(self):
        stable = [{"flow": c.flow, "received": c.received, "gaps": c.gaps, "dups": c.dups,
                   "per_pub": {k.decode(): v + 1 for k, v in c.last.items()}} for c in self.stable]
        return {"stable": stable, "churn_gaps": self.churn_gaps, "churn_dups": self.churn_dups,
                "sessions": dict(self.sessions), "connections": self.connections, "errors": self.errors[:20]}

    # -- loop

    def tick(self, now):
        rate = self.plan["rate"]
        if self.phase == "go":
            for p in list(self.pubs):
                if p["closing"]:
                    continue
                c = p["conn"]
                if c.out:
                    continue  # back-pressure: wait until the socket takes more
                due = min(int((now - p["t0"]) * rate) - p["sent"], 50)
                for _ in range(max(0, due)):
                    c.send(b"MSG %s\0%s:%d:" % (p["key"], p["id"], p["sent"]) + b"." * (p["sent"] % 200) + p["pad"])
                    p["sent"] += 1
                    self.sent[p["flow"]][p["id"].decode()] = p["sent"]
                    if c.out:
                        break
                if p["churn"] and p["sent"] >= p["limit"]:
                    self.end_pub(p, replace=True)
            for s in list(self.churn_subs):
                if not s["closing"] and now > s["until"]:
                    self.end_churn_sub(s)
            for i in list(self.idle):
                if not i["closing"] and now > i["until"]:
                    self.end_idle(i)
        if self.phase in ("go", "stop", "stopped"):
            # slow readers: `slow_read` packets per second in all, fewer than their flow carries
            self.slow_credit = getattr(self, "slow_credit", 0.0) + self.plan["slow_read"] * (now - self.last_tick)
            budget = int(self.slow_credit)
            if budget:
                self.slow_credit -= budget
                for c in self.stable:
                    if c.slow and not c.closed:
                        c.readable(budget)
        self.last_tick = now

    def run(self):
        self.sel.register(self.ctl.fileno(), selectors.EVENT_READ, None)
        self.setup()
        last = time.monotonic()
        while True:
            for key, ev in self.sel.select(0.01):
                if key.data is None:
                    cmd = self.ctl.recv()
                    if cmd == "go":
                        self.go()
                    elif cmd == "stop":
                        self.stop()
                    elif cmd == "final":
                        self.final()
                    elif cmd == "exit":
                        return
                    continue
                conn = key.data
                if ev & selectors.EVENT_WRITE and not conn.closed:
                    conn.writable()
                if ev & selectors.EVENT_READ and not conn.closed:
                    conn.readable()
            now = time.monotonic()
            if now - last >= 0.01:
                self.tick(now)
                last = now


def worker_main(index, address, ctl, plan, seed):
    try:
        Worker(index, address, ctl, plan, seed).run()
    except BaseException:  # noqa: BLE001
        import traceback
        ctl.send(("crash", traceback.format_exc()))
        raise


# ====================================================================== parent side


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_stats(address):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(30)
    s.connect(address)
    try:
        s.send(STATS)
        while True:
            p = s.recv(1 << 20)
            if not p:
                raise RuntimeError("server closed the stats connection")
            if p.startswith(STATS_REPLY):
                return json.loads(p[len(STATS_REPLY):])
    finally:
        s.close()


def start_server(cmd, address, log):
    proc = subprocess.Popen([*cmd, "-f", "-a", address], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=log)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0] and not os.read(proc.stdout.fileno(), 4096):
            return proc
        if proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"soak: the server did not start: {cmd}")


def plan_for(clients, workers, rate):
    per = max(8, clients // workers)
    stable = max(3, per * 20 // 100)
    pubs = max(3, per * 20 // 100)
    churn_subs = max(3, per * 35 // 100)
    idle = max(1, per - stable - pubs - churn_subs)
    return {"stable": stable, "pubs": pubs, "churn_subs": churn_subs, "idle": idle, "rate": rate,
            "slow_read": rate}


def wait_all(conns, what, timeout):
    """Wait for message `what` from every worker."""
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(conns):
        left = deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(f"soak: workers did not report {what!r} within {timeout}s")
        for i, c in enumerate(conns):
            if i not in out and c.poll(min(0.2, max(0.0, left))):
                kind, value = c.recv()
                if kind == "crash":
                    raise SystemExit(f"soak: worker {i} crashed:\n{value}")
                if kind != what:
                    raise SystemExit(f"soak: worker {i} said {kind!r}, expected {what!r}")
                out[i] = value
    return [out[i] for i in range(len(conns))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=300, help="concurrent clients (default 300)")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rate", type=float, default=20.0, help="messages/s per publisher (default 20)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the report as JSON here too")
    ap.add_argument("--server-cmd", default=f"{sys.executable} -m sbus.server.sbusd",
                    help="server command; gets '-f -a SOCKET' appended")
    args = ap.parse_args(argv)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.clients * 2 + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    tmp = tempfile.mkdtemp(prefix="sbus-soak-")
    address = os.path.join(tmp, "bus.sock")
    log_path = os.path.join(tmp, "server.log")
    log = open(log_path, "wb")
    server = start_server(args.server_cmd.split(), address, log)
    plan = plan_for(args.clients, args.workers, args.rate)
    ctx = mp.get_context("fork")
    conns, procs = [], []
    duration = args.minutes * 60
    report = {"command": "bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "minutes": args.minutes, "workers": args.workers, "plan_per_worker": plan}
    try:
        for i in range(args.workers):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(i, address, child, plan, args.seed * 1000 + i), daemon=True)
            p.start()
            conns.append(parent)
            procs.append(p)
        wait_all(conns, "ready", 60)
        base_rss = rss_kib(server.pid)
        t0 = time.monotonic()
        cpu0 = cpu_s(server.pid)
        for c in conns:
            c.send("go")
        interval = max(1.0, duration / 40)
        samples = []   # (seconds, rss KiB, clients)
        next_sample = 0.0
        max_clients = 0
        while True:
            now = time.monotonic() - t0
            if now >= next_sample:
                st = server_stats(address)
                max_clients = max(max_clients, st["clients"])
                samples.append((round(now, 1), rss_kib(server.pid), st["clients"]))
                next_sample += interval
            if now >= duration:
                break
            for c in conns:
                if c.poll(0):
                    kind, value = c.recv()
                    raise SystemExit(f"soak: worker said {kind!r} during the run: {value}")
            time.sleep(min(0.2, max(0.0, next_sample - now)))
        for c in conns:
            c.send("stop")
        sent = wait_all(conns, "stopped", 120)
        for c in conns:
            c.send("final")
        results = wait_all(conns, "final", 120)
        elapsed = time.monotonic() - t0
        cpu = cpu_s(server.pid) - cpu0
        samples.append((round(elapsed, 1), rss_kib(server.pid), None))
        st = server_stats(address)
        alive = server.poll() is None
    finally:
        for c in conns:
            try:
                c.send("exit")
            except OSError:
                pass
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()

    # ---- accounting
    sent_by_flow = {f: {} for f in FLOWS}
    for s in sent:
        for f, d in s.items():
            sent_by_flow[f].update(d)
    flows = []
    ok = True
    problems = []
    soft_drops = st["drops"].get("soft_discard", 0)
    for f, (_, lossless) in FLOWS.items():
        subs = [x for r in results for x in r["stable"] if x["flow"] == f]
        per_pub = sent_by_flow[f]
        total_sent = sum(per_pub.values())
        expected = total_sent * len(subs)
        received = sum(x["received"] for x in subs)
        gaps = sum(x["gaps"] for x in subs)
        dups = sum(x["dups"] for x in subs)
        exact = all(x["per_pub"].get(k, 0) == n for x in subs for k, n in per_pub.items() if n)
        flow = {"flow": f, "lossless": lossless, "publishers": len(per_pub), "published": total_sent,
                "stable_subscribers": len(subs), "expected": expected, "received": received,
                "gaps": gaps, "duplicates": dups}
        if lossless:
            flow["server_drops"] = 0
            if received != expected or gaps or dups or not exact or expected == 0:
                ok = False
                problems.append(f"flow {f}: sent {expected} deliveries, received {received}, gaps {gaps}, dups {dups}")
        else:
            flow["server_drops"] = soft_drops
            if received + soft_drops != expected or dups:
                ok = False
                problems.append(f"flow {f}: received {received} + dropped {soft_drops} != expected {expected}")
        flows.append(flow)
    churn_gaps = sum(r["churn_gaps"] for r in results)
    churn_dups = sum(r["churn_dups"] for r in results)
    if churn_gaps or churn_dups:
        ok = False
        problems.append(f"churning subscribers: {churn_gaps} gaps, {churn_dups} duplicates in lossless sessions")
    other_drops = {k: v for k, v in st["drops"].items() if k != "soft_discard"}
    bad_disconnects = {k: v for k, v in st["disconnects"].items() if k != "closed"}
    if other_drops or bad_disconnects:
        ok = False
        problems.append(f"unexpected drops {other_drops} / disconnects {bad_disconnects}")
    errors = [e for r in results for e in r["errors"]]
    if errors:
        ok = False
        problems.append(f"client errors: {errors[:5]}")
    if not alive:
        ok = False
        problems.append("the server died")
    rss = [s[1] for s in samples]
    warm_end = max(1, len(rss) // 4)
    warm_max = max(rss[:warm_end + 1])
    late_max = max(rss[len(rss) // 2:])
    allowed = max(16 * 1024, warm_max // 10)
    flat = late_max - warm_max <= allowed
    if not flat and args.minutes >= 1:
        ok = False
        problems.append(f"server RSS grew {(late_max - warm_max) / 1024:.1f} MiB after warm-up")
    sessions = collections.Counter()
    for r in results:
        sessions.update(r["sessions"])
    report.update({
        "ok": ok, "problems": problems, "server_alive": alive,
        "elapsed_s": round(elapsed, 1), "server_cpu_s": round(cpu, 1),
        "clients_total": sum(r["connections"] for r in results), "clients_max_concurrent": max_clients,
        "sessions": dict(sessions), "messages_published": sum(f["published"] for f in flows),
        "deliveries": st["packets_out"], "flows": flows,
        "churn": {"gaps": churn_gaps, "duplicates": churn_dups},
        "server_drops": st["drops"], "server_disconnects": st["disconnects"],
        "rss_kib": [s[1] for s in samples], "rss_samples": samples, "rss_base_kib": base_rss,
        "rss_flat": flat, "rss_warmup_max_kib": warm_max, "rss_late_max_kib": late_max,
    })
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    server.send_signal(signal.SIGINT)
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()
    if ok:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"server log kept in {log_path}", file=sys.stderr)
    return 0 if ok else 1


def print_report(r):
    print(f"sbus soak: {r['minutes']} min, {r['elapsed_s']} s wall, server CPU {r['server_cpu_s']} s")
    print(f"clients: {r['clients_total']} connections over the run, at most {r['clients_max_concurrent']} at once; "
          f"sessions ended: {r['sessions']}")
    print(f"messages published: {r['messages_published']:,}; deliveries by the server: {r['deliveries']:,}")
    print(f"{'flow':<10} {'mode':<9} {'pubs':>5} {'published':>10} {'subs':>5} {'expected':>11} "
          f"{'received':>11} {'drops':>9} {'gaps':>5} {'dups':>5}")
    for f in r["flows"]:
        print(f"{f['flow']:<10} {'lossless' if f['lossless'] else 'lossy':<9} {f['publishers']:>5} "
              f"{f['published']:>10,} {f['stable_subscribers']:>5} {f['expected']:>11,} {f['received']:>11,} "
              f"{f['server_drops']:>9,} {f['gaps']:>5} {f['duplicates']:>5}")
    print(f"churning subscribers (lossless flows + discard): gaps {r['churn']['gaps']}, "
          f"duplicates {r['churn']['duplicates']}")
    print(f"server drops by reason: {r['server_drops']}; disconnects by reason: {r['server_disconnects']}")
    rss = r["rss_samples"]
    print(f"server RSS (MiB) before traffic {r['rss_base_kib'] / 1024:.1f}; samples (s: MiB):")
    print("  " + ", ".join(f"{t:g}: {k / 1024:.1f}" for t, k, _ in rss))
    print(f"  warm-up max {r['rss_warmup_max_kib'] / 1024:.1f} MiB, second-half max {r['rss_late_max_kib'] / 1024:.1f} MiB"
          f" -> {'flat' if r['rss_flat'] else 'GROWING'}")
    print("verdict: " + ("OK" if r["ok"] else "FAILED: " + "; ".join(r["problems"])))


if __name__ == "__main__":
    sys.exit(main())
