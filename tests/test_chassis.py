"""The service chassis (`sbus.services.chassis`) on its own: a service of a few hooks, a real
sbusd killed -9 and restarted under it, its stats asked over the bus, SIGTERM."""

from __future__ import annotations

import json
import signal
import sys

from helpers import LoggedProcess, child_env
from sbus.cli import main
from sbus.client import Client

#: A service (a .tac file) that counts what it receives, and says which steps of its stop ran when.
COUNTER = r"""
import os
from twisted.application.service import Application
from twisted.logger import Logger
from sbus.services.chassis import Chassis

class Counter(Chassis):
    kind = "sbus-chassis-test"
    log = Logger(namespace="chassis-test")
    seen = 0

    def setUp(self):
        self.client = self.connect(subscribe=[b"chassis/"], misses=True, stats=True, message=self.count,
                                   ready=lambda proto: self.log.info("ready {n}", n=self.client.connects))

    def count(self, key, payload, proto):
        self.seen += 1

    def stats(self):
        return {"seen": self.seen, "reconnects": self.reconnects(), "unknown_gaps": self.unknownGaps()}

    def beforeStop(self):
        self.log.info("step: before, connected={c}", c=bool(self.client.connected))

    def afterStop(self):
        self.log.info("step: after, connected={c}", c=bool(self.client.connected))

application = Application("chassis-test")
Counter(os.environ["CHASSIS_BUS"], stats_interval=3600).setServiceParent(application)
"""


def ask_stats(address, capsys) -> dict:
    """The test service's stats, asked with `sbus stats --services` (in this process). What was
    published (and synced) before reaches the service before the request does."""
    assert main(["-b", address, "stats", "--services"]) == 0
    return next(a["stats"] for a in json.loads(capsys.readouterr().out) if a["service"] == "sbus-chassis-test")


def publish(address, n: int) -> None:
    with Client(address) as c:
        for i in range(n):
            c.publish(b"chassis/%d" % i, b"x")
        c.sync(5)


def test_a_service_on_the_chassis_survives_a_bus_kill_and_stops_in_order(start_bus, tmp_path, capsys):
    bus = start_bus()
    (tmp_path / "counter.tac").write_text(COUNTER)
    # under twistd, whose own SIGTERM handler would end the process "killed by signal 15"
    svc = LoggedProcess([sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n",
                         "--pidfile=", "--logfile=-", "-y", str(tmp_path / "counter.tac")],
                        tmp_path / "svc.log", env={**child_env(), "CHASSIS_BUS": bus.address})
    try:
        svc.wait_log("ready 1")
        publish(bus.address, 3)
        assert ask_stats(bus.address, capsys)["seen"] == 3

        bus.stop(signal.SIGKILL)
        svc.wait_log("lost the bus connection")
        bus = start_bus(address=bus.address)  # the same path: its stale socket file replaced
        svc.wait_log("ready 2")
        publish(bus.address, 2)
        stats = ask_stats(bus.address, capsys)
        # the restarted bus counted nothing for it: one gap, logged and counted
        assert stats["seen"] == 5 and stats["reconnects"] == 1 and stats["unknown_gaps"]["count"] == 1, stats
        assert "is missed, in a number nobody counted" in svc.log()

        svc.proc.terminate()
        assert svc.proc.wait(30) == 0, svc.log()[-2000:]
    finally:
        svc.stop()
    text = svc.log()
    steps = [text.find(s) for s in ("step: before, connected=True", "step: after, connected=False",
                                    'sbus-chassis-test stopped: {"seen":5,"reconnects":1')]
    assert -1 not in steps and steps == sorted(steps), text[-2000:]
