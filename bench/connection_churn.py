"""Log lines written while clients come and go (issue 34, "Logs that scale").

Starts `sbusd -f -l LOG`, then for --seconds keeps --clients connections churning: each round
opens them all, asks whoami on each (a real client, not a probe), and closes them. Prints the
connections made and the log's line count, with and without --log-connections.

    .venv/bin/python bench/connection_churn.py --clients 1000 --seconds 60
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

WHOAMI = b"CMSG !/cred/whoami\0"


def churn(address: str, clients: int, seconds: float) -> int:
    made = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        socks = []
        for _ in range(clients):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(address)
            s.send(WHOAMI)
            socks.append(s)
        for s in socks:
            s.recv(4096)
            s.close()
        made += clients
    return made


def run(extra: list[str], clients: int, seconds: float) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as d:
        address, log = os.path.join(d, "bus.socket"), os.path.join(d, "bus.log")
        proc = subprocess.Popen([sys.executable, "-m", "sbus.server.sbusd", "-f", "-a", address, "-l", log,
                                 *extra], stdout=subprocess.PIPE)
        proc.stdout.read()  # closed when ready
        try:
            made = churn(address, clients, seconds)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        with open(log, "rb") as f:
            return made, sum(1 for _ in f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=60.0)
    a = ap.parse_args()
    for label, extra in (("default (summary)", []), ("--log-connections", ["--log-connections"])):
        made, lines = run(extra, a.clients, a.seconds)
        print(f"{label}: {made} connections in {a.seconds:.0f} s, {lines} log lines")


if __name__ == "__main__":
    main()
