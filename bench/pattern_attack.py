#!/usr/bin/env python3
"""Another uid's round trip under the pattern attack of issue 33 item 6.

    python bench/pattern_attack.py [--seconds 10] [--side 190] [--python PY]

A fresh `sbusd -o` (a bus every uid may use). uid 65534 (a forked child, niced, as in
bench/fairness.py: the figure is how the server shares its reactor, not how the kernel shares
the CPUs) holds side x side patterns ``a{i}*/a{j}*/z`` on one connection (190 x 190 = 36,100,
within every limit), then publishes distinct keys ``a^300/a^300/N`` that match none of them
(each one a cache miss that walks the product of the star prefixes) as fast as the server takes
them, a ``CMSG !/cred/whoami`` after every 10, so the messages the server has routed are counted
by the answers. Meanwhile root does round trips through its own subscription (one connection,
one every 20 ms) and, once a second, a new connection's first round trip (connect, SUB, MSG,
its echo). Prints root's worst and median round trip, the fresh connections' worst, and the
attacker's routed rate alone (the first seconds, root not connected) and while root is.
Needs root. Exits 1 with one line on error.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ATTACKER = 65534
WHOAMI = b"CMSG !/cred/whoami"
EVERY = 10  # attacker messages per whoami


def dial(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(120)
    s.connect(path)
    return s


def attacker(path: str, side: int, ready: int, stop: int, report: int) -> None:
    """Runs as uid ATTACKER: hold the patterns, then publish misses until told to stop; write
    to `report` the routed counts (time, messages) as the whoami answers come back."""
    c = dial(path)
    for i in range(1, side + 1):
        for j in range(1, side + 1):
            c.send(b"SUB " + b"a" * i + b"*/" + b"a" * j + b"*/z")
    c.send(WHOAMI)
    while not c.recv(1 << 16).startswith(WHOAMI):
        pass
    c.setblocking(False)
    os.write(ready, b"r")
    head = b"MSG " + b"a" * 300 + b"/" + b"a" * 300 + b"/"
    k = 0
    routed = 0
    while not select.select([stop], [], [], 0)[0]:
        readable, writable, _ = select.select([c], [c], [], 0.2)
        if readable:
            try:
                while True:
                    if c.recv(1 << 16).startswith(WHOAMI):
                        routed += EVERY
                        os.write(report, b"%.6f %d\n" % (time.monotonic(), routed))
            except BlockingIOError:
                pass
        if writable:
            try:
                while True:
                    c.send(WHOAMI if k % (EVERY + 1) == EVERY else head + b"%d\0" % k)
                    k += 1
            except BlockingIOError:
                pass


def round_trip(s: socket.socket, key: bytes) -> float:
    t0 = time.monotonic()
    s.send(b"MSG " + key + b"\0rtt")
    while not s.recv(1 << 16).startswith(b"MSG " + key + b"\0"):
        pass
    return time.monotonic() - t0


def fresh_round_trip(path: str, n: int) -> float:
    """A new connection's first round trip: connect, SUB, MSG, its echo."""
    t0 = time.monotonic()
    key = b"rtt/fresh/%d" % n
    s = dial(path)
    try:
        s.send(b"SUB " + key)
        s.send(b"MSG " + key + b"\0rtt")
        while not s.recv(1 << 16).startswith(b"MSG " + key + b"\0"):
            pass
    finally:
        s.close()
    return time.monotonic() - t0


def rate_between(counts: list, t0: float, t1: float) -> float:
    inside = [(t, n) for t, n in counts if t0 <= t <= t1]
    if len(inside) < 2:
        return 0.0
    (ta, na), (tb, nb) = inside[0], inside[-1]
    return (nb - na) / (tb - ta) if tb > ta else 0.0


def measure(path: str, side: int, seconds: float) -> dict:
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.nice(19)
            os.setgroups([])
            os.setgid(ATTACKER)
            os.setuid(ATTACKER)
            attacker(path, side, ready_w, stop_r, report_w)
        except BaseException as e:  # noqa: BLE001 - one line, then exit
            print(f"pattern_attack: attacker: {e}", file=sys.stderr)
            code = 1
        os._exit(code)
    os.close(report_w)
    os.set_blocking(report_r, False)
    reported = bytearray()

    def collect():
        try:
            while True:
                chunk = os.read(report_r, 1 << 16)
                if not chunk:
                    break
                reported.extend(chunk)
        except BlockingIOError:
            pass

    try:
        if not select.select([ready_r], [], [], 600)[0]:
            raise RuntimeError("the attacker never got its patterns in")
        t_alone = time.monotonic()
        time.sleep(min(5.0, seconds / 2))  # the attacker alone: its rate with nobody to share
        collect()
        t_root = time.monotonic()
        s = dial(path)
        key = b"rtt/root"
        s.send(b"SUB " + key)
        round_trip(s, key)
        first = time.monotonic() - t_root  # connect, SUB, MSG, its echo
        rtts, fresh = [], []
        next_fresh = time.monotonic()
        while time.monotonic() - t_root < seconds:
            rtts.append(round_trip(s, key))
            if time.monotonic() >= next_fresh:
                fresh.append(fresh_round_trip(path, len(fresh)))
                next_fresh = time.monotonic() + 1.0
            collect()
            time.sleep(0.02)
        t_end = time.monotonic()
        s.close()
    finally:
        os.write(stop_w, b"s")
        _, status = os.waitpid(pid, 0)
    collect()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("the attacker failed")
    counts = [(float(t), int(n)) for t, n in (line.split() for line in reported.decode().splitlines())]
    return {"rtts": rtts, "fresh": fresh, "first": first,
            "alone": rate_between(counts, t_alone, t_root), "attacked": rate_between(counts, t_root, t_end)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="how long root measures under the attack")
    ap.add_argument("--side", type=int, default=190, help="patterns a{i}*/a{j}*/z for i, j in 1..SIDE")
    ap.add_argument("--python", default=sys.executable, help="the Python that runs sbusd")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("pattern_attack: needs root (the attacker runs as uid 65534)", file=sys.stderr)
        return 1
    tmp = tempfile.mkdtemp(prefix="sbus-pattern-")
    os.chmod(tmp, 0o755)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(tmp, "bus.socket")
    log = open(os.path.join(tmp, "server.log"), "ab")
    srv = subprocess.Popen([args.python, "-m", "sbus.server.sbusd", "-f", "-o", "-a", path],
                           cwd=here, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(path):
            if srv.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sbusd did not start (log: {log.name})")
            time.sleep(0.05)
        r = measure(path, args.side, args.seconds)
    except (OSError, RuntimeError) as e:
        print(f"pattern_attack: {e}", file=sys.stderr)
        return 1
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(120)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    ms = [x * 1000 for x in r["rtts"]]
    fresh = [x * 1000 for x in r["fresh"]]
    print(f"patterns {args.side ** 2} (a{{i}}*/a{{j}}*/z), root measured {args.seconds:.0f} s")
    print(f"root round trips: {len(ms)}, worst {max(ms):.1f} ms, median {statistics.median(ms):.1f} ms, "
          f"p99 {sorted(ms)[int(0.99 * (len(ms) - 1))]:.1f} ms")
    print(f"root's first round trip (connect, SUB, MSG, its echo) while the attacker was alone: "
          f"{r['first'] * 1000:.1f} ms")
    if fresh:
        print(f"root new connections' first round trip: {len(fresh)}, worst {max(fresh):.1f} ms, "
              f"median {statistics.median(fresh):.1f} ms")
    print(f"attacker's routed rate: alone {r['alone']:.1f} msg/s, while root is connected {r['attacked']:.1f} msg/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
