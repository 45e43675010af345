"""What an idle connection costs the server's memory (issue 25: at most 1.5 KB), on both I/O
paths, with a real server process and real clients.

Measured the way `bench/run.py --only memory` measures it, by the same helper (bench/memory.py):
the server's VmRSS after one probe client, and again after 1,000 more clients, each of which
has made a whoami round trip, so the server has set every one of them up and sent it a reply
before RSS is read (nothing is timed, nothing waits for a sleep). Before issue 25 an idle
connection cost 1.9-2.9 KB: a deque kept for life by every outgoing queue (1.3 KB with the
spare block `deque.clear` leaves), bound methods kept by every transport and an instance dict
on every broker protocol.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO

IDLE_CLIENTS = 1000
#: Bytes of server RSS per idle connection (the goal row of docs/performance.md; KB = 1,000 B).
GOAL = 1500


def test_idle_connection_costs_at_most_1_5_kb(both_paths):
    bus = both_paths()
    helper = os.path.join(REPO, "bench", "memory.py")
    res = subprocess.run(
        [sys.executable, helper, "--pid", str(bus.pid), "--sock", bus.address,
         "--clients", str(IDLE_CLIENTS), "--patterns", "0", "--timeout", "60"],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, f"bench/memory.py failed: {res.stderr.strip()[-300:]}"
    bus.alive_or_raise()
    per_client = json.loads(res.stdout)["per_client_b"]
    assert per_client <= GOAL, (
        f"the server's RSS grew {per_client:,.0f} B per idle connection "
        f"({IDLE_CLIENTS:,} connections); the goal is at most {GOAL:,} B")
