"""A server killed (-9) and started again with the same command, under each service (issue 34,
"Restarts counted end to end"): the service notices its socket come back and connects at once
(inotify on the socket's directory, `sbus.client.socketwatch`), not after its back-off; one
whose bus forgot its session says which interval it missed, in a number nobody counted."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SERVICE_TIMEOUT, LoggedProcess, child_env, service_answer, wait_until

TWISTD = [sys.executable, "-c", "import sys; from twisted.scripts.twistd import run; sys.argv[0] = 'twistd'; run()",
          "-n", "--pidfile="]
APPEARED = "a socket appeared at"
UNKNOWN = "the bus did not know it (restarted, or it lingered out)"
#: A service holding no session: each reconnection is a gap nobody counted.
SESSIONLESS = "holding no session there"

def _answers(service):
    return lambda proc, address, n: service_answer(address, service) is not None


def _logged(line):
    return lambda proc, address, n: proc.log().count(line) >= n


#: name -> (twistd arguments, serving check (process, bus address, nth connection), the line
#: a reconnection to a bus that counted nothing for it logs, or None). The link waits 30 s
#: before it retries: only the watch can bring it back before the test's wait ends.
SERVICES = {
    "sbus-record": (["sbus-record", "--bus", "{bus}", "--out", "rec"], _answers("sbus-record"), UNKNOWN),
    "sbus-link": (["sbus-link", "--bus", "{bus}", "--listen", "unix:link.socket", "--initial-delay", "30",
                   "--max-delay", "60"], _answers("sbus-link"), UNKNOWN),
    "sbus-bridge": (["sbus-bridge", "--bus-a", "{bus}", "--bus-b", "{bus_b}", "--rule", "x/ a>b"],
                    _answers("sbus-bridge"), UNKNOWN),
    "sbus-queue": (["sbus-queue", "--bus", "{bus}", "--group", "jobs=jobs/"], _answers("sbus-queue"), UNKNOWN),
    "sbus-msgbus": (["sbus-msgbus", "--bus", "{bus}", "--port", "unix:gw.socket"],
                    _answers("sbus-msgbus"), SESSIONLESS),
    # the relay answers askers on its own bus only; its own claim on the master says "new"
    "sbus-relay": (["sbus-relay", "--bus", "{bus}", "--socket", "relay.socket", "--max-delay", "60"],
                   _logged("connected to the master at"), UNKNOWN),
}
#: Services whose stats show the gap nobody counted (`svcstats.unknown_gaps`), and the bus
#: (relative to the test's directory: their own, or None for the one they serve) to ask on.
GAPS_IN_STATS = {"sbus-record": None, "sbus-msgbus": None, "sbus-relay": "relay.socket", "sbus-queue": None,
                 "sbus-bridge": None, "sbus-link": None}


def answers_on(address: str) -> list[dict]:
    """What the services answer `sbus stats --services` with on the bus at `address`."""
    res = subprocess.run([sys.executable, "-m", "sbus.cli", "--bus", address, "stats", "--services"],
                         capture_output=True, timeout=SERVICE_TIMEOUT, env=child_env())
    return json.loads(res.stdout) if res.returncode == 0 else []


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_a_service_serves_again_when_its_server_restarts(name, tmp_path: Path, start_bus):
    args, serving, uncounted = SERVICES[name]
    bus, bus_b = start_bus(), start_bus()
    argv = TWISTD + [a.format(bus=bus.address, bus_b=bus_b.address) for a in args]
    proc = LoggedProcess(argv, tmp_path / "service.log", cwd=tmp_path)
    try:
        wait_until(lambda: proc.alive_or_raise() and serving(proc, bus.address, 1),
                   f"{name} serving on its bus", SERVICE_TIMEOUT * 2)
        bus.proc.kill()
        bus.proc.wait()
        again = start_bus(address=bus.address)
        wait_until(lambda: proc.alive_or_raise() and serving(proc, again.address, 2),
                   f"{name} serving on the restarted bus", SERVICE_TIMEOUT * 2)
        if name == "sbus-link":
            assert APPEARED in proc.log()  # 30 s of back-off: only the watch brought it back
        if uncounted:
            proc.wait_log(uncounted)
        if name in GAPS_IN_STATS:
            where = str(tmp_path / GAPS_IN_STATS[name]) if GAPS_IN_STATS[name] else again.address

            def gaps():
                mine = service_answer(where, name)
                return mine and mine["stats"]["unknown_gaps"]

            counted = wait_until(lambda: (g := gaps()) and g["count"] == 1 and g, f"{name}'s stats count the gap",
                                 SERVICE_TIMEOUT)
            assert counted["seconds"] > 0, counted
    finally:
        proc.stop(signal.SIGTERM)
    log = proc.log()
    assert "Traceback" not in log, log[-2000:]
