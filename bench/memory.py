#!/usr/bin/env python3
"""Memory scenario helper for bench/run.py: resident bytes per idle client
and per stored pattern of a running sbus server.

    python bench/memory.py --pid PID --sock PATH [--clients 1000]
                           [--patterns 10] [--sync whoami|accept]

1. One probe client connects (and does a whoami round trip); the server's
   VmRSS is read from /proc/PID/status: the baseline.
2. CLIENTS clients connect, each doing a whoami round trip (``--sync
   whoami``; for a server that doesn't answer CMSG, ``--sync accept`` waits
   until the server holds that many more descriptors); VmRSS again.
   Per client = delta / CLIENTS.
3. Each client subscribes PATTERNS distinct patterns that nothing publishes
   to, then does a whoami round trip (so all are stored); VmRSS again.
   Per pattern = delta / (CLIENTS * PATTERNS).

Prints one JSON object on stdout.  Exits 1 with a one-line message on error.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import time

WHOAMI = b"CMSG !/cred/whoami"
#: s to let the server finish before reading RSS with ``--sync accept``; a whoami round trip
#: is proof enough that the server has done all it does for that client (no sleep).
SETTLE = 0.3


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def nfds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def dial(path: str, timeout: float) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    s.connect(path)
    return s


def whoami_reply(s: socket.socket) -> None:
    while True:
        data = s.recv(65536)
        if not data:
            raise RuntimeError("server closed a client")
        if data.startswith(WHOAMI + b"\0") or data == WHOAMI:
            return


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--sock", required=True)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--patterns", type=int, default=10)
    p.add_argument("--sync", choices=["whoami", "accept"], default="whoami")
    p.add_argument("--timeout", type=float, default=20.0)
    a = p.parse_args()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < a.clients + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, a.clients + 1024), hard))

    t0 = time.monotonic()
    probe = dial(a.sock, a.timeout)
    if a.sync == "whoami":
        probe.send(WHOAMI)
        whoami_reply(probe)
    else:
        time.sleep(SETTLE)
    fds0 = nfds(a.pid)
    rss0 = rss(a.pid)

    clients = []
    for _ in range(a.clients):
        s = dial(a.sock, a.timeout)
        if a.sync == "whoami":
            s.send(WHOAMI)
            whoami_reply(s)
        clients.append(s)
    if a.sync == "accept":
        deadline = time.monotonic() + a.timeout
        while nfds(a.pid) < fds0 + a.clients:
            if time.monotonic() > deadline:
                raise RuntimeError(f"server accepted only {nfds(a.pid) - fds0}/{a.clients} clients")
            time.sleep(0.01)
        time.sleep(SETTLE)
    rss1 = rss(a.pid)
    res = {"clients": a.clients, "patterns_each": a.patterns, "rss_base": rss0,
           "rss_clients": rss1, "per_client_b": (rss1 - rss0) / a.clients,
           "rss_patterns": None, "per_pattern_b": None}

    if a.patterns:
        for c, s in enumerate(clients):
            for i in range(a.patterns):
                s.send(b"SUB bench/x/n%d_%d/" % (c, i))
            s.send(WHOAMI)
        for s in clients:
            whoami_reply(s)
        rss2 = rss(a.pid)
        res["rss_patterns"] = rss2
        res["per_pattern_b"] = (rss2 - rss1) / (a.clients * a.patterns)
    res["helper_s"] = time.monotonic() - t0
    print(json.dumps(res))
    for s in clients:
        s.close()
    probe.close()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (OSError, RuntimeError) as e:
        print(f"memory: {e}", file=sys.stderr)
        sys.exit(1)
