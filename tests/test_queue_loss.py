"""Every job the bus or the service lost is counted (docs/queues.md "Over the limit"): a full
group in `block` mode whose intake the bus disconnects as stalled.
"""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, wait_until
from sbus.client import Client
from test_queue import QueueProcess, service_stats

JOBS = 20000


def test_a_stalled_intake_loses_nothing_uncounted(start_twistd_bus, tmp_path):
    """No member, `--limit 50`: the service pauses its intake, the bus holds the publisher, and
    after `--stall-timeout` disconnects the intake as stalled. The service notices at once
    (while paused), and every job is then either handed to the member that comes later or in
    a loss counter: published = acked + lost."""
    bus = start_twistd_bus("--stall-timeout", "1")
    queue = QueueProcess(bus.address, tmp_path / "queue.log", ["--group", "bulk=bulk/", "--limit", "50"])
    try:
        pub = subprocess.run(
            [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]);"
             "from sbus.client import Client\n"
             "with Client(sys.argv[2]) as c:\n"
             "    for i in range(int(sys.argv[3])): c.publish(b'bulk/%d' % i, b'x' * 10)\n"
             "    c.sync(60)", REPO, bus.address, str(JOBS)], capture_output=True, timeout=120)
        assert pub.returncode == 0, pub.stderr
        queue.wait_log("intake: the bus closed it while paused")  # at once, though not reading
        with Client(bus.address) as c:
            w = c.join("bulk", timeout=20)
            acked = 0

            def drained():
                nonlocal acked
                try:
                    while True:
                        w.ack(w.next(timeout=0.5))
                        acked += 1
                except TimeoutError:
                    pass
                st = service_stats(bus.address)
                lost = sum(st["lost"].values())
                return (acked + lost == JOBS and st["groups"]["bulk"]["backlog"] == 0) and st

            st = wait_until(drained, "every job acked or counted lost", 120)
        assert st["lost"]["restart"] > 0 and acked > 0 and st["intake_disconnects"] in (
            {"closed_while_paused": 1}, {"closed_while_paused": 1, "stalled": 1}), st
        queue.wait_log(f"the bus counted {st['lost']['restart']} messages published for us meanwhile (lost)")
    finally:
        queue.stop()
