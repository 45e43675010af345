#!/usr/bin/env python3
"""sbus benchmark runner: our server against the reference C server and a minimal forwarder.

    python bench/run.py [--quick] [--rounds N] [--json out.json] [--reference PATH]

Compiles ``bench/loadgen.c`` and ``bench/forwarder.c`` into ``bench/out/``
with ``gcc -O2`` (``make bench`` does it first), then runs every scenario
against our server (``python -m sbus.server.sbusd -f -a PATH``), the
reference C ``sbusd`` when given (``--reference PATH`` or ``SBUS_REFERENCE``;
run as ``PATH -f -a SOCK``), and ``bench/out/forwarder SOCK`` (the floor),
alternating ours / reference / floor for N rounds, with a fresh server
process per round and scenario.  Prints a table of medians and same-run
ratios, with the server's CPU time per delivery (utime + stime from
/proc/PID/stat over the publishing phase), and writes every raw sample to
``bench/out/results.json`` (``--json``), and the table as Markdown beside
it (``results.md``).

Exit status: 0 when every run completed; 1 when a run lost messages, a
server failed to start or died, or a client failed (one line on stderr);
2 on bad usage.  Interrupting (Ctrl-C) kills every process started here.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import resource
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
OUT = BENCH / "out"
DEFAULT_OURS = "{python} -m sbus.server.sbusd -f -a {sock}"
IMPLS = ("ours", "pure", "ref", "floor")

START_TIMEOUT = 10.0  # s until a server must be ready
FANOUT_TIMEOUT = 180.0  # loadgen itself gives up after 60 s of silence
RTT_TIMEOUT = 120.0
MEMORY_TIMEOUT = 180.0


class BenchError(Exception):
    """A run that failed: lost messages, a server that did not start, ..."""


# --------------------------------------------------------------------------
# processes


_live: set[subprocess.Popen] = set()


def _kill(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 3.0) -> None:
    """End a process we started (it leads its own session) and its children."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:  # whatever is left in its group (a forked publisher, ...)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    _live.discard(proc)
    for f in (proc.stdout, proc.stderr, proc.stdin):
        if f is not None:
            try:
                f.close()
            except OSError:
                pass


def kill_all() -> None:
    for proc in list(_live):
        _kill(proc, signal.SIGKILL, 1.0)


def _spawn(cmd: list[str], **kw) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, start_new_session=True, cwd=REPO, **kw)
    _live.add(proc)
    return proc


def run_client(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, str]:
    """Run a client (loadgen, memory helper) bounded by ``timeout``."""
    proc = _spawn(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc, signal.SIGKILL, 1.0)
        raise BenchError(f"timed out after {timeout:.0f} s: {shlex.join(cmd)}")
    finally:
        _kill(proc, signal.SIGKILL, 1.0)  # and any child it left in its group
    return proc.returncode, out, err


def last_line(*texts: str) -> str:
    for t in texts:
        lines = (t or "").strip().splitlines()
        if lines:
            return lines[-1].strip()
    return "no output"


PROBE_KEY = b"bench/startup/probe"
PROBE_MSG = b"MSG " + PROBE_KEY + b"\0hello"


def try_connect(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(path)
        return s
    except OSError:
        s.close()
        return None


class Server:
    """One server process under test (ours or the floor) on a fresh socket."""

    def __init__(self, impl: str, cmd: list[str], sock: str, log: Path):
        self.impl, self.cmd, self.sock, self.log = impl, cmd, sock, log
        self.proc: subprocess.Popen | None = None
        self.connect_s: float | None = None  # exec -> first successful connect
        self.ready_s: float | None = None  # exec -> readiness signal (ours: stdout EOF)
        self.served_s: float | None = None  # exec -> first message echoed back

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> "Server":
        """Exec the server and wait until it (a) accepts a connection, (b) has
        given its readiness signal (ours: end of stdout) and (c) has served a
        first round trip (SUB + MSG echoed back, which both servers do)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log, "wb")
        ours = self.impl in ("ours", "pure")
        t0 = time.perf_counter()
        self.proc = _spawn(self.cmd, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE if ours else subprocess.DEVNULL,
                           stderr=logf)
        logf.close()
        deadline = t0 + START_TIMEOUT
        out = self.proc.stdout
        eof = not ours
        probe: socket.socket | None = None
        try:
            while True:
                rl = ([] if eof else [out]) + ([probe] if probe and self.served_s is None else [])
                r = select.select(rl, [], [], 0.001)[0] if rl else time.sleep(0.001) or []
                now = time.perf_counter()
                if out in r and os.read(out.fileno(), 65536) == b"":
                    eof = True
                    self.ready_s = now - t0
                if probe in r:
                    data = probe.recv(65536)
                    if data.startswith(PROBE_MSG[:len(PROBE_KEY) + 4]):
                        self.served_s = now - t0
                if probe is None:
                    probe = try_connect(self.sock)
                    if probe is not None:
                        self.connect_s = time.perf_counter() - t0
                        if not ours:
                            self.ready_s = self.connect_s
                        probe.setblocking(False)
                        probe.send(b"SUB " + PROBE_KEY)
                        probe.send(PROBE_MSG)
                if eof and self.served_s is not None:
                    return self
                if self.proc.poll() is not None:
                    self.stop()
                    raise BenchError(f"{self.impl} server exited with status {self.proc.returncode}"
                                     f" before it was ready (log: {self._rel_log()})")
                if now > deadline:
                    what = ("did not close stdout (readiness signal)" if not eof
                            else "did not accept a connection" if probe is None
                            else "did not answer a first message")
                    self.stop()
                    raise BenchError(f"{self.impl} server {what} within {START_TIMEOUT:.0f} s "
                                     f"(log: {self._rel_log()})")
        except OSError as e:
            self.stop()
            raise BenchError(f"{self.impl} server: probe client failed: {e} "
                             f"(log: {self._rel_log()})") from None
        finally:
            if probe is not None:
                probe.close()

    def check_alive(self, during: str) -> None:
        if self.proc.poll() is not None:
            raise BenchError(f"{self.impl} server died (status {self.proc.returncode}) "
                             f"during {during} (log: {self._rel_log()})")

    def stop(self) -> None:
        if self.proc is not None:
            # sbusd -f ends cleanly on SIGINT; the C servers only die.
            _kill(self.proc, signal.SIGINT if self.impl in ("ours", "pure") else signal.SIGTERM)

    def _rel_log(self) -> str:
        try:
            return str(self.log.relative_to(REPO))
        except ValueError:
            return str(self.log)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------
# scenarios

FANOUT_RE = re.compile(
    r"delivered=(\d+)/(\d+) wall=([\d.]+) s published/s=(\d+) delivered/s=(\d+)"
    r"(?: server_cpu_s=([\d.]+))?(?: out_of_order=(\d+))?")
RTT_RE = re.compile(r"median_us=([\d.]+) p99_us=([\d.]+)")

# name, subs, msgs (full, quick), size, noise clients, noise patterns each
FANOUT = [
    ("fanout_1x64", "1→1, 64 B", 1, (200_000, 50_000), 64),
    ("fanout_1x4k", "1→1, 4 KiB", 1, (100_000, 25_000), 4096),
    ("fanout_8x64", "1→8, 64 B (deliveries)", 8, (75_000, 20_000), 64),
]
NOISE = [(0, 0), (10, 1), (100, 10), (1000, 10)]  # clients x patterns
NOISE_MSGS = (50_000, 12_500)  # the reference does ~15k msgs/s with 10,000 patterns
RTT_ROUNDS = (20_000, 5_000)
# many clients: connected clients, publishers (each key matched by clients/publishers), msgs each
MANY = (1000, 100, (500, 200))
MEM_CLIENTS, MEM_PATTERNS = 1000, 10


class Bench:
    def __init__(self, args: argparse.Namespace, loadgen: Path, forwarder: Path):
        self.args = args
        self.loadgen = str(loadgen)
        self.forwarder = str(forwarder)
        self.impls = tuple(i for i in IMPLS if (i != "ref" or args.reference) and (i != "pure" or args.pure))
        self.q = 1 if args.quick else 0
        self.tmp = tempfile.mkdtemp(prefix="sbus-bench-")
        self.seq = 0
        self.results: dict[str, dict] = {}
        self.failures: list[str] = []

    # servers ---------------------------------------------------------
    def server(self, impl: str, scenario: str, rnd: int) -> Server:
        self.seq += 1
        sock = os.path.join(self.tmp, f"{impl}-{self.seq}.sock")
        if impl in ("ours", "pure"):
            cmd = [a.format(python=self.args.python, sock=sock)
                   for a in shlex.split(self.args.ours)]
            if impl == "pure":
                cmd = ["env", "SBUS_PURE_PYTHON=1"] + cmd  # env execs: the pid is the server's
        elif impl == "ref":
            cmd = [self.args.reference, "-f", "-a", sock]
        elif self.args.floor_python:
            cmd = [self.args.python, str(Path(__file__).with_name("pyfloor.py")), sock]
        else:
            cmd = [self.forwarder, "-b", sock] if self.args.floor_batched else [self.forwarder, sock]
        log = OUT / "logs" / f"{scenario}-{impl}-r{rnd}.log"
        return Server(impl, cmd, sock, log)

    def cleanup(self) -> None:
        kill_all()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # bookkeeping -----------------------------------------------------
    def scenario(self, key: str, **info) -> dict:
        d = self.results.setdefault(key, {"samples": {i: [] for i in IMPLS}})
        d.update(info)
        return d

    def attempt(self, key: str, impl: str, rnd: int, fn) -> dict | None:
        """Run one sample; record a failure (and stop unless --keep-going)."""
        try:
            sample = fn()
        except BenchError as e:
            msg = f"{key} round {rnd} ({impl}): {e}"
            self.failures.append(msg)
            self.results[key]["samples"][impl].append({"round": rnd, "error": str(e)})
            if not self.args.keep_going:
                raise BenchError(msg) from None
            print(f"  FAILED: {msg}", file=sys.stderr)
            return None
        sample["round"] = rnd
        self.results[key]["samples"][impl].append(sample)
        return sample

    def progress(self, text: str) -> None:
        if not self.args.silent:
            print(text, file=sys.stderr, flush=True)

    # loadgen ----------------------------------------------------------
    def fanout(self, srv: Server, subs: int, msgs: int, size: int,
               nclients: int = 0, npats: int = 0, many: tuple | None = None) -> dict:
        if many:
            cmd = [self.loadgen, "many", srv.sock, *map(str, many), str(size)]
        else:
            cmd = [self.loadgen, "fanout", srv.sock, str(subs), str(msgs), str(size),
                   str(nclients), str(npats)]
        rc, out, err = run_client(cmd, FANOUT_TIMEOUT,
                                  env={**os.environ, "SBUS_BENCH_SERVER_PID": str(srv.pid)})
        m = FANOUT_RE.search(out)
        line = out.strip().splitlines()[-1] if out.strip() else ""
        if rc == 1 and m:
            srv.check_alive("fanout")
            raise BenchError(f"{srv.impl} server lost messages: delivered "
                             f"{m.group(1)}/{m.group(2)} ({last_line(err) if err.strip() else 'silence for 60 s'})")
        if rc != 0 or not m:
            srv.check_alive("fanout")
            raise BenchError(f"loadgen fanout failed (status {rc}): "
                             f"{last_line(err, out)}")
        srv.check_alive("fanout")
        d = {"value": float(m.group(5)), "published_per_s": float(m.group(4)),
             "delivered": int(m.group(1)), "expected": int(m.group(2)),
             "wall_s": float(m.group(3)), "line": line}
        if m.group(6) is not None and d["delivered"]:
            d["server_cpu_s"] = float(m.group(6))
            d["cpu_us_per_delivery"] = d["server_cpu_s"] * 1e6 / d["delivered"]
        return d

    def run_fanout(self, key: str, label: str, subs: int, msgs: int, size: int,
                   many: tuple | None = None) -> None:
        unit = "deliveries/s" if subs > 1 or many else "msgs/s"
        target = {"kind": "ref_min", "value": 1.0} if size == 64 and not many else None
        self.scenario(key, label=label, unit=unit, target=target,
                      params={"subs": subs, "msgs": msgs, "size": size, "many": many})
        cpu_key = f"cpu_{key}"
        # Against the batched forwarder (--floor-batched), issue 25's goal: within 1.2x of it.
        cpu_target = None if not target else (
            {"kind": "ratio_max", "value": 1.2} if self.args.floor_batched and not self.args.floor_python
            else {"kind": "ref_max", "value": 1.0})
        self.scenario(cpu_key, label=f"server CPU per delivery, {label.split(' (')[0]}",
                      unit="µs", target=cpu_target, params={"of": key})
        for rnd in range(1, self.args.rounds + 1):
            for impl in self.impls:
                def one():
                    with self.server(impl, key, rnd) as srv:
                        return self.fanout(srv, subs, msgs, size, many=many)
                s = self.attempt(key, impl, rnd, one)
                if s:
                    cpu = s.get("cpu_us_per_delivery")
                    if cpu is not None:
                        self.results[cpu_key]["samples"][impl].append({"round": rnd, "value": cpu})
                    self.progress(f"  {key} r{rnd} {impl:5}: {s['value']:,.0f} {unit}"
                                  + (f", server CPU {cpu:.2f} µs/delivery" if cpu is not None else ""))

    def run_noise(self, msgs: int) -> None:
        """1→1, 64 B with non-matching patterns held by other clients (ours and the
        reference; the forwarder's linear scan is no floor for this)."""
        keys = {}
        for nc, npat in NOISE:
            key = f"noise_{nc * npat}"
            keys[(nc, npat)] = key
            target = ({"kind": "ref_min", "value": 10.0} if nc * npat == 10_000 and self.args.reference
                      else {"kind": "own0_min", "value": 0.85} if nc * npat == 10_000 else None)
            self.scenario(key, label=f"1→1, 64 B, {nc * npat:,} noise patterns ({nc}×{npat})",
                          unit="msgs/s", target=target, own0_ratios=[],
                          params={"subs": 1, "msgs": msgs, "size": 64,
                                  "noise_clients": nc, "noise_patterns": npat})
        for rnd in range(1, self.args.rounds + 1):
            base = None
            for (nc, npat), key in keys.items():
                for impl in [i for i in self.impls if i != "floor"]:
                    def one():
                        with self.server(impl, key, rnd) as srv:
                            return self.fanout(srv, 1, msgs, 64, nc, npat)
                    s = self.attempt(key, impl, rnd, one)
                    if not s:
                        continue
                    note = ""
                    if impl == "ours":
                        if nc == 0:
                            base = s["value"]
                        if base:
                            s["own0_ratio"] = s["value"] / base
                            self.results[key]["own0_ratios"].append(s["own0_ratio"])
                            note = f" ({s['own0_ratio']:.2f} of own 0)"
                    self.progress(f"  {key} r{rnd} {impl:5}: {s['value']:,.0f} msgs/s{note}")

    def run_rtt(self, rounds: int) -> None:
        self.scenario("rtt_median", label="round trip, median", unit="µs",
                      target={"kind": "ref_max", "value": 1.0} if self.args.reference
                      else {"kind": "ratio_max", "value": 4.0}, params={"rounds": rounds})
        self.scenario("rtt_p99", label="round trip, p99", unit="µs", target=None,
                      params={"rounds": rounds})
        for rnd in range(1, self.args.rounds + 1):
            for impl in self.impls:
                def one():
                    with self.server(impl, "rtt", rnd) as srv:
                        cmd = [self.loadgen, "rtt", srv.sock, str(rounds)]
                        rc, out, err = run_client(cmd, RTT_TIMEOUT)
                        srv.check_alive("rtt")
                        m = RTT_RE.search(out)
                        if rc != 0 or not m:
                            raise BenchError(f"loadgen rtt failed (status {rc}): "
                                             f"{last_line(err, out)}")
                        return {"value": float(m.group(1)), "p99_us": float(m.group(2)),
                                "line": out.strip()}
                s = self.attempt("rtt_median", impl, rnd, one)
                if s:
                    self.results["rtt_p99"]["samples"][impl].append(
                        {"round": rnd, "value": s["p99_us"]})
                    self.progress(f"  rtt r{rnd} {impl:5}: median {s['value']} µs, p99 {s['p99_us']} µs")

    def run_startup(self) -> None:
        self.scenario("startup", label="start-up: exec → accepting", unit="ms",
                      target={"kind": "abs_max", "value": 300.0})
        self.scenario("startup_ready", label="start-up: exec → readiness signal", unit="ms",
                      target=None)
        self.scenario("startup_served", label="start-up: exec → first message echoed",
                      unit="ms", target=None)
        for rnd in range(1, self.args.rounds + 1):
            for impl in self.impls:
                def one():
                    srv = self.server(impl, "startup", rnd)
                    with srv:
                        pass
                    return {"value": srv.connect_s * 1000, "ready_ms": srv.ready_s * 1000,
                            "served_ms": srv.served_s * 1000}
                s = self.attempt("startup", impl, rnd, one)
                if s:
                    for k, f in (("startup_ready", "ready_ms"), ("startup_served", "served_ms")):
                        self.results[k]["samples"][impl].append({"round": rnd, "value": s[f]})
                    self.progress(f"  startup r{rnd} {impl:5}: {s['value']:.1f} ms "
                                  f"(readiness signal {s['ready_ms']:.1f} ms, "
                                  f"first echo {s['served_ms']:.1f} ms)")

    def run_memory(self) -> None:
        self.scenario("mem_client", label="memory per idle client", unit="B",
                      target={"kind": "abs_max", "value": 1500.0},  # issue 25's goal (issue 4's: 8 KB)
                      params={"clients": MEM_CLIENTS})
        self.scenario("mem_pattern", label="memory per stored pattern", unit="B",
                      target={"kind": "abs_max", "value": 400.0},
                      params={"clients": MEM_CLIENTS, "patterns": MEM_PATTERNS})
        helper = str(BENCH / "memory.py")
        for rnd in range(1, self.args.rounds + 1):
            for impl in self.impls:  # the floor (no whoami, no patterns) counts accepted descriptors
                def one():
                    with self.server(impl, "memory", rnd) as srv:
                        cmd = [sys.executable, helper, "--pid", str(srv.pid), "--sock", srv.sock,
                               "--clients", str(MEM_CLIENTS),
                               "--patterns", str(MEM_PATTERNS if impl != "floor" else 0),
                               "--sync", "whoami" if impl != "floor" else "accept"]
                        rc, out, err = run_client(cmd, MEMORY_TIMEOUT)
                        srv.check_alive("memory")
                        if rc != 0:
                            raise BenchError(f"memory helper failed (status {rc}): "
                                             f"{last_line(err, out)}")
                        d = json.loads(out)
                        d["value"] = d["per_client_b"]
                        return d
                s = self.attempt("mem_client", impl, rnd, one)
                if s:
                    msg = f"  memory r{rnd} {impl:5}: {s['per_client_b']:,.0f} B/client"
                    if s.get("per_pattern_b") is not None:
                        self.results["mem_pattern"]["samples"][impl].append(
                            {"round": rnd, "value": s["per_pattern_b"]})
                        msg += f", {s['per_pattern_b']:,.0f} B/pattern"
                    self.progress(msg)

    # all ----------------------------------------------------------------
    def run(self) -> None:
        only = set(self.args.only or [])

        def want(group: str) -> bool:
            return not only or group in only

        for key, label, subs, msgs, size in FANOUT:
            if want(key.split("_")[0]) or want(key):
                self.progress(f"{label} ...")
                self.run_fanout(key, label, subs, msgs[self.q], size)
        if want("many"):
            clients, pubs, msgs = MANY
            label = f"many clients: {clients:,}, {pubs} publishing, {clients // pubs} per key"
            self.progress(f"{label} ...")
            self.run_fanout("many", label, clients // pubs, msgs[self.q], 64,
                            many=(clients, pubs, msgs[self.q]))
        if want("noise"):
            self.progress("noise patterns ...")
            self.run_noise(NOISE_MSGS[self.q])
        if want("rtt"):
            self.progress("round trip ...")
            self.run_rtt(RTT_ROUNDS[self.q])
        if want("startup"):
            self.progress("start-up ...")
            self.run_startup()
        if want("memory"):
            self.progress("memory ...")
            self.run_memory()


# --------------------------------------------------------------------------
# summary


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarise(results: dict[str, dict]) -> None:
    for key, d in results.items():
        vals = {impl: [s["value"] for s in d["samples"].get(impl, []) if "value" in s]
                for impl in IMPLS}
        d["median"] = {impl: _median(v) for impl, v in vals.items()}
        d["min"] = {impl: min(v) if v else None for impl, v in vals.items()}
        d["max"] = {impl: max(v) if v else None for impl, v in vals.items()}
        med = d["median"]["ours"]
        d["spread_ours"] = ((d["max"]["ours"] - d["min"]["ours"]) / med
                            if med and len(vals["ours"]) > 1 else None)
        o, r, f = d["median"]["ours"], d["median"]["ref"], d["median"]["floor"]
        d["ratio_ours_floor"] = o / f if o is not None and f else None
        d["ratio_ours_ref"] = o / r if o is not None and r else None
        if "own0_ratios" in d:
            d["ratio_own0"] = _median(d["own0_ratios"])
        t = d.get("target")
        met = None
        if t and o is not None:
            ratio = {"ratio_min": d["ratio_ours_floor"], "ratio_max": d["ratio_ours_floor"],
                     "ref_min": d["ratio_ours_ref"], "ref_max": d["ratio_ours_ref"],
                     "own0_min": d.get("ratio_own0"), "abs_max": o}[t["kind"]]
            if ratio is not None:
                met = ratio >= t["value"] if t["kind"].endswith("_min") else ratio <= t["value"]
        d["met"] = met


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "µs" and v < 10:
        return f"{v:,.2f}"
    if unit in ("µs", "ms"):
        return f"{v:,.1f}"
    return f"{v:,.0f}"


def _target_text(t: dict | None) -> str:
    if not t:
        return "—"
    v = t["value"]
    return {"ratio_min": f"≥ {v:.2f}× floor", "ratio_max": f"≤ {v:g}× floor",
            "ref_min": f"≥ {v:g}× ref", "ref_max": f"≤ {v:g}× ref",
            "own0_min": f"≥ {v:.2f}× own 0", "abs_max": f"≤ {v:,.0f}"}[t["kind"]]


def _ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def table_rows(results: dict[str, dict]) -> list[list[str]]:
    rows = []
    for key, d in results.items():
        unit = d.get("unit", "")
        floor = _ratio(d.get("ratio_ours_floor"))
        if d.get("ratio_own0") is not None:
            floor = f"{d['ratio_own0']:.2f} (own 0)"
        met = {True: "yes", False: "NO", None: "—" if not d.get("target") else "?"}[d.get("met")]
        n = f"{len([s for s in d['samples']['ours'] if 'value' in s])}"
        spread = "—" if d.get("spread_ours") is None else f"{d['spread_ours'] * 100:.0f}%"
        rows.append([d.get("label", key), unit, _fmt(d["median"]["ours"], unit),
                     _fmt(d["median"]["pure"], unit), _fmt(d["median"]["ref"], unit), _fmt(d["median"]["floor"], unit),
                     _ratio(d.get("ratio_ours_ref")), floor, _target_text(d.get("target")),
                     met, n, spread])
    return rows


LEGEND = ("ours, pure, reference, floor: medians over n rounds (fresh server each run, alternating "
          "ours/pure/reference/floor); pure: our server with SBUS_PURE_PYTHON=1 (--pure); reference: the C sbusd of maandree/sbus (--reference); floor: "
          "bench/forwarder.c (with --floor-batched its -b mode: recvmmsg and sendmmsg batches; with --floor-python, bench/pyfloor.py, the least Python server); ratios: of medians (time rows: lower is better), for the noise rows "
          "ours/floor is the median per-round ratio to our own 0-pattern run; server CPU: utime + "
          "stime of the server process over the publishing phase / messages delivered; spread: "
          "(max - min) / median of ours. The floor does not run the noise rows (its linear "
          "pattern scan is not a floor there).")

HEADER = ["scenario", "unit", "ours", "pure", "reference", "floor", "ours/ref", "ours/floor",
          "target", "met", "n", "spread"]
RIGHT = {2, 3, 4, 5, 6, 7, 10, 11}


def text_table(rows: list[list[str]]) -> str:
    w = [max(len(r[i]) for r in [HEADER] + rows) for i in range(len(HEADER))]
    right = RIGHT

    def line(r):
        return "  ".join(c.rjust(w[i]) if i in right else c.ljust(w[i])
                         for i, c in enumerate(r)).rstrip()
    return "\n".join([line(HEADER), line(["-" * x for x in w])] + [line(r) for r in rows])


def md_table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "|".join(
        "---:" if i in RIGHT else "---" for i in range(len(HEADER))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# --------------------------------------------------------------------------
# setup


def _cmd_out(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None


def environment(args: argparse.Namespace, loadgen_c: Path) -> dict:
    cpu = None
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    twisted = _cmd_out([args.python, "-c", "import twisted; print(twisted.__version__)"])
    pyver = _cmd_out([args.python, "-c", "import sys; print(sys.version.split()[0])"])
    return {
        "command": shlex.join([Path(sys.executable).name] + sys.argv),
        "argv": sys.argv,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": pyver, "python_executable": args.python, "twisted": twisted,
        "kernel": platform.release(), "uname": " ".join(platform.uname()),
        "cpu": cpu, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
        "gcc": ((_cmd_out(["gcc", "--version"]) or "").splitlines() or [None])[0],
        "loadgen_c": str(loadgen_c),
        "loadgen_sha256": hashlib.sha256(loadgen_c.read_bytes()).hexdigest(),
        "reference": args.reference,
        "speedups": _cmd_out([args.python, "-c", "import sbus.seqpacket as s; print(s.BATCH_IO)"]),
        "git_commit": _cmd_out(["git", "rev-parse", "HEAD"]),
        "git_dirty": bool(_cmd_out(["git", "status", "--porcelain", "--untracked-files=no"])),
        "ours_command": args.ours,
        "rounds": args.rounds, "quick": args.quick,
    }


def build_tools() -> tuple[Path, Path, Path]:
    """Compile bench/loadgen.c and bench/forwarder.c (if their binaries are missing or older)."""
    OUT.mkdir(parents=True, exist_ok=True)
    exes = []
    for name in ("loadgen", "forwarder"):
        src, exe = BENCH / f"{name}.c", OUT / name
        newest = max(src.stat().st_mtime, (BENCH / "loadgen_common.h").stat().st_mtime)
        if exe.exists() and exe.stat().st_mtime >= newest:
            exes.append(exe)
            continue
        try:
            r = subprocess.run(["gcc", "-O2", "-Wall", "-o", str(exe), str(src)],
                               capture_output=True, text=True, timeout=120)
        except FileNotFoundError:
            raise BenchError("gcc not found: install a C compiler") from None
        except subprocess.TimeoutExpired:
            raise BenchError(f"gcc timed out compiling {src.name}") from None
        if r.returncode:
            raise BenchError(f"gcc failed on {src.name}: "
                             f"{r.stderr.strip().splitlines()[0] if r.stderr.strip() else r.returncode}")
        exes.append(exe)
    return BENCH / "loadgen.c", exes[0], exes[1]


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8192 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < 2 * MEM_CLIENTS + 100:
        raise BenchError(f"open-file limit {soft} too low for {MEM_CLIENTS} clients "
                         f"(raise the hard limit: ulimit -Hn)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/run.py",
        description="sbus benchmarks: our server vs the reference C server and a minimal forwarder.")
    p.add_argument("--quick", action="store_true",
                   help="2 rounds and a quarter of the messages (a smoke run)")
    p.add_argument("--rounds", type=int, help="rounds per scenario (default 5, --quick 2)")
    p.add_argument("--json", type=Path, default=OUT / "results.json",
                   help="where to write raw samples and medians (default bench/out/results.json)")
    p.add_argument("--only", action="append", metavar="GROUP",
                   choices=["fanout", "fanout_1x64", "fanout_1x4k", "fanout_8x64", "many", "noise",
                            "rtt", "startup", "memory"],
                   help="run only this scenario group (repeatable)")
    p.add_argument("--keep-going", action="store_true",
                   help="record a failed run and go on (still exits 1 at the end)")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter for our server (default: this one)")
    p.add_argument("--ours", default=DEFAULT_OURS,
                   help="command line of our server; {python} and {sock} are substituted "
                        f"(default: {DEFAULT_OURS!r})")
    p.add_argument("--reference", metavar="PATH", default=os.environ.get("SBUS_REFERENCE") or None,
                   help="the reference C sbusd to compare against (default: $SBUS_REFERENCE); "
                        "docs/performance.md says how to build it")
    p.add_argument("--pure", action="store_true",
                   help="also run our server with SBUS_PURE_PYTHON=1 (no batch I/O) in every round")
    p.add_argument("--floor-batched", action="store_true",
                   help="the floor batches like our server: one recvmmsg per readable client, one "
                        "sendmmsg per subscriber (bench/forwarder.c -b; issue 25's limit)")
    p.add_argument("--floor-python", action="store_true",
                   help="the floor is bench/pyfloor.py instead: the least a Python server does per "
                        "message (epoll, our recvmmsg/sendmmsg, a dict; no Twisted), to show what "
                        "the interpreter alone costs beside the reference")
    p.add_argument("--silent", action="store_true", help="no progress lines on stderr")
    a = p.parse_args(argv)
    if a.reference and not os.access(a.reference, os.X_OK):
        p.error(f"--reference {a.reference}: not an executable file")
    if a.rounds is None:
        a.rounds = 2 if a.quick else 5
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)

    bench = None
    env: dict = {}
    error = None
    try:
        raise_nofile()
        src, exe, fwd = build_tools()
        env = environment(args, src)
        bench = Bench(args, exe, fwd)
        load = os.getloadavg()[0]
        if load > (os.cpu_count() or 1) * 0.5:
            print(f"bench: note: load average {load:.1f} on {os.cpu_count()} CPUs before "
                  f"starting; figures will be noisy", file=sys.stderr)
        bench.run()
    except BenchError as e:
        error = str(e)
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        if bench is not None:
            bench.cleanup()
        kill_all()

    results = bench.results if bench else {}
    summarise(results)
    rows = table_rows(results)
    if rows:
        print(text_table(rows))
        print(textwrap.fill(LEGEND, 100))
    if env:
        env["loadavg_end"] = os.getloadavg()
        env["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    failures = bench.failures if bench else []
    doc = {"meta": env, "error": error, "failures": failures, "scenarios": results,
           "table_markdown": md_table(rows) if rows else None}
    try:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        if rows:
            md = args.json.with_suffix(".md")
            md.parent.mkdir(parents=True, exist_ok=True)
            md.write_text(f"Command: `{env.get('command')}`  \nDate: {env.get('date')}  \n"
                          f"Python {env.get('python')}, Twisted {env.get('twisted')}, "
                          f"Linux {env.get('kernel')}, {env.get('cpus')} CPUs ({env.get('cpu')}), "
                          f"load average {env.get('loadavg_start', [0])[0]:.1f} at start\n\n"
                          + md_table(rows) + "\n\n" + LEGEND + "\n")
    except OSError as e:
        print(f"bench: cannot write {args.json}: {e}", file=sys.stderr)
        return 1
    if error:
        print(f"bench: FAILED: {error}", file=sys.stderr)
        return 1
    if failures:
        print(f"bench: FAILED: {len(failures)} run(s) failed; first: {failures[0]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
