#!/usr/bin/env python3
"""Profile our server's hot path: py-spy samples while loadgen publishes.

    python bench/profile.py [--pure] [--subs 1] [--msgs 300000] [--rate 1000] [--top 20]

Starts ``python -m sbus.server.sbusd -f`` on a fresh socket (with
SBUS_PURE_PYTHON=1 when ``--pure``), attaches ``py-spy record --format raw``
to it, runs ``bench/out/loadgen fanout SOCK SUBS MSGS 64 0 0`` (built by
``make bench``), then prints the share of samples per function (self time,
py-spy attributes a system call to the Python line that makes it) and the
loadgen line (with the server's CPU seconds). Needs py-spy on PATH or beside
the interpreter.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pure", action="store_true", help="SBUS_PURE_PYTHON=1 (no batch I/O)")
    ap.add_argument("--subs", type=int, default=1)
    ap.add_argument("--msgs", type=int, default=300_000)
    ap.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    loadgen = REPO / "bench" / "out" / "loadgen"
    if not loadgen.exists():
        print("profile: build the load generator first: make bench/out/loadgen", file=sys.stderr)
        return 1
    tmp = tempfile.mkdtemp(prefix="sbus-profile-")
    sock, raw = os.path.join(tmp, "bus.sock"), os.path.join(tmp, "raw.txt")
    env = dict(os.environ)
    env["SBUS_PURE_PYTHON"] = "1" if a.pure else ""
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    srv = subprocess.Popen([sys.executable, "-m", "sbus.server.sbusd", "-f", "-a", sock], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    spy = None
    try:
        srv.stdout.read()  # ready when its standard output closes
        spy = subprocess.Popen([pyspy, "record", "--nonblocking", "-r", str(a.rate), "--format", "raw",
                                "-o", raw, "--pid", str(srv.pid)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches
        out = subprocess.run([str(loadgen), "fanout", sock, str(a.subs), str(a.msgs), "64", "0", "0"],
                             env={**env, "SBUS_BENCH_SERVER_PID": str(srv.pid)}, capture_output=True,
                             text=True, timeout=600).stdout.strip()
        spy.send_signal(signal.SIGINT)
        spy.wait(60)
    finally:
        if spy and spy.poll() is None:
            spy.kill()
        srv.send_signal(signal.SIGINT)
        srv.wait(30)
    selfs: collections.Counter = collections.Counter()
    total = 0
    for line in open(raw):
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack:
            continue
        leaf = stack.split(";")[-1]
        m = re.match(r"(.*?) \((.*?):\d+\)", leaf)
        func = f"{m.group(1)} ({os.path.basename(m.group(2))})" if m else leaf
        selfs[func] += int(n)
        total += int(n)
    print(out)
    print(f"{'share':>6}  function (self time, {total} samples)")
    for func, n in selfs.most_common(a.top):
        print(f"{n / total * 100:5.1f}%  {func}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
