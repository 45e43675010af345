#!/usr/bin/env python3
"""The round trip pinned to one CPU and unpinned, ours against the reference C server, with busy
polling as the server decides it and forced off (issue 37 item 3: "busy polling never loses").

    python bench/rtt_pinned.py --reference /tmp/refsbus/sbusd [--rounds 7] [--trips 20000] [--cpu 0]
                               [--baseline TREE]

Each round runs, interleaved, for each condition (``pinned``: server and client under
``taskset -c CPU``; ``unpinned``: as the scheduler likes) three servers: ``ours`` (sbusd with
its default ``--busy-poll``, so polling as `sbus.pollloop` decides), ``ours-nopoll``
(``--busy-poll=0``) and ``ref`` (the reference, ``PATH -f -a SOCK``), each a fresh process
measured by ``loadgen rtt`` (bench/run.py builds it); with ``--baseline TREE`` (a checkout of
an earlier commit, its accelerator built or copied in) also ``baseline``, that tree's sbusd with
its default polling. Prints the medians of the rounds' medians,
the ratios, and the line each of our servers logged about polling; writes the samples to
``bench/out/rtt_pinned.json``. Exit 1 (one line) when a run fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import OUT, RTT_RE, BenchError, Server, build_tools, kill_all, run_client  # noqa: E402

SERVERS = ("ours", "ours-nopoll", "ref")
CONDITIONS = ("pinned", "unpinned")


def _server_cmd(name: str, sock: str, args) -> list[str]:
    if name == "ref":
        return [args.reference, "-f", "-a", sock]
    if name == "baseline":  # (-m would import this tree's sbus first: it runs from here)
        return [sys.executable, "-c", "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
                "sys.argv[0] = 'sbusd'; runpy.run_module('sbus.server.sbusd', run_name='__main__')",
                args.baseline, "-f", "-a", sock]
    extra = ["--busy-poll=0"] if name == "ours-nopoll" else []
    return [sys.executable, "-m", "sbus.server.sbusd", "-f", "-a", sock, *extra]


def _polling_line(log: Path) -> str:
    for line in log.read_text(errors="replace").splitlines():
        if "busy polling:" in line:
            return line.split("busy polling:", 1)[1].strip()
    return "(no line)"


def one(name: str, condition: str, rnd: int, args, tmp: str, loadgen: str) -> tuple[float, str]:
    """One fresh server, one `loadgen rtt`: (median µs, what the server said about polling)."""
    pin = ["taskset", "-c", str(args.cpu)] if condition == "pinned" else []
    sock = f"{tmp}/{name}-{condition}-{rnd}.sock"
    log = OUT / "logs" / f"rtt_pinned-{name}-{condition}-r{rnd}.log"
    impl = "ref" if name == "ref" else "ours"  # (how Server waits for it to be ready)
    with Server(impl, pin + _server_cmd(name, sock, args), sock, log) as srv:
        rc, out, err = run_client(pin + [loadgen, "rtt", sock, str(args.trips)], 300)
        srv.check_alive("rtt")
        m = RTT_RE.search(out)
        if rc != 0 or not m:
            raise BenchError(f"loadgen rtt against {name} ({condition}) failed: {(err or out).strip()[-200:]}")
    return float(m.group(1)), ("" if name == "ref" else _polling_line(log))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", required=True, help="the reference C sbusd (docs/performance.md)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--trips", type=int, default=20_000, help="round trips per run")
    p.add_argument("--cpu", type=int, default=0, help="the CPU of the pinned runs")
    p.add_argument("--baseline", help="a tree of an earlier commit: its sbusd runs too, as 'baseline'")
    args = p.parse_args()
    servers = SERVERS + (("baseline",) if args.baseline else ())
    if not shutil.which("taskset"):
        print("rtt_pinned: taskset not found (util-linux)", file=sys.stderr)
        return 1
    samples: dict = {c: {s: [] for s in servers} for c in CONDITIONS}
    said: dict = {c: {} for c in CONDITIONS}
    tmp = tempfile.mkdtemp(prefix="sbus-rtt-pinned-")
    try:
        _, loadgen, _ = build_tools()
        for rnd in range(1, args.rounds + 1):
            for condition in CONDITIONS:
                for name in servers:
                    us, line = one(name, condition, rnd, args, tmp, str(loadgen))
                    samples[condition][name].append(us)
                    if line:
                        said[condition].setdefault(name, line)
                    print(f"r{rnd} {condition:8} {name:11} {us:7.1f} µs", flush=True)
    except BenchError as e:
        print(f"rtt_pinned: {e}", file=sys.stderr)
        return 1
    finally:
        kill_all()
        shutil.rmtree(tmp, ignore_errors=True)
    base = args.baseline is not None
    print("\n| condition | ours | ours, --busy-poll=0 | reference | ours / reference | ours / ours without polling |"
          + (" baseline | baseline / reference |" if base else ""))
    print("|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if base else ""))
    for condition in CONDITIONS:
        med = {s: statistics.median(samples[condition][s]) for s in servers}
        print(f"| {condition} | {med['ours']:.1f} µs | {med['ours-nopoll']:.1f} µs | {med['ref']:.1f} µs "
              f"| {med['ours'] / med['ref']:.2f} × | {med['ours'] / med['ours-nopoll']:.2f} × |"
              + (f" {med['baseline']:.1f} µs | {med['baseline'] / med['ref']:.2f} × |" if base else ""))
    for condition in CONDITIONS:
        for name in ("ours", "baseline")[:1 + base]:
            print(f"{condition}: {name} said: busy polling: {said[condition].get(name, '(nothing)')}")
    (OUT / "rtt_pinned.json").write_text(json.dumps({"args": vars(args), "samples": samples, "said": said},
                                                    indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
