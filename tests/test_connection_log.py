"""Logs that scale (issue 34): clients that come and go are one summary line, not a line each;
a disconnect for a fault is still its own line; ``--log-connections`` gives a line each."""

import re
import signal

from sbus.core.churn import ConnectionChurn
from sbus.core.reasons import Disconnect

CLIENTS = 300


def test_the_summary_counts_arrivals_and_departures_by_reason_then_starts_again():
    churn = ConnectionChurn()
    assert churn.summary(0, 60) is None
    for _ in range(3):
        churn.arrived()
    churn.left(Disconnect.CLOSED)
    churn.left(Disconnect.CLOSED)
    assert churn.ordinary(Disconnect.CLOSED) and churn.ordinary(Disconnect.SHUTDOWN)
    assert not churn.ordinary(Disconnect.STALLED) and not churn.ordinary(Disconnect.PROTOCOL_ERROR)
    assert churn.summary(1, 60) == ("clients in the last 60 s: 3 connected, 2 disconnected (closed 2); "
                                    "1 connected now")
    assert churn.summary(1, 60) is None


def _come_and_go(bus, n):
    for _ in range(n):
        s = bus.connect()
        s.close()


def _protocol_error(bus):
    """A client that sends a packet that is no message: disconnected as protocol_error."""
    s = bus.connect()
    s.send(b"NOT A MESSAGE\n\n")
    s.settimeout(30)
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass
    s.close()


def _stopped_log(bus) -> str:
    assert bus.stop(signal.SIGTERM) == 0
    return bus.log()


def test_hundreds_of_clients_that_come_and_go_are_one_line_and_a_fault_is_its_own(start_bus):
    bus = start_bus()
    _come_and_go(bus, CLIENTS)
    _protocol_error(bus)
    bus.wait_log("(protocol_error)")
    log = _stopped_log(bus)
    assert "client connected:" not in log and "(closed)" not in log, log[-800:]
    summaries = re.findall(r"clients in the last \d+ s: (\d+) connected, (\d+) disconnected \(([^)]*)\)", log)
    assert len(summaries) == 1, log[-800:]
    connected, disconnected, reasons = summaries[0]
    # the readiness probe connects too; the protocol error is logged on its own, not counted here
    assert int(connected) >= CLIENTS + 1 and int(disconnected) >= CLIENTS, summaries
    assert "protocol_error" not in reasons, reasons
    assert len(log.splitlines()) < 20, f"{len(log.splitlines())} lines"


def test_log_connections_gives_a_line_per_connection(start_bus):
    bus = start_bus("--log-connections")
    _come_and_go(bus, 20)
    bus.wait_log("(closed)", count=20)
    log = _stopped_log(bus)
    assert log.count("client connected:") >= 20 and log.count("(closed)") >= 20, log[-800:]
    assert "clients in the last" not in log


def test_twistd_sbus_summarises_and_takes_log_connections_too(start_twistd_bus):
    quiet, loud = start_twistd_bus(), start_twistd_bus("--log-connections")
    for bus in (quiet, loud):
        _come_and_go(bus, 5)
    loud.wait_log("(closed)", count=5)
    quiet_log = _stopped_log(quiet)
    assert "(closed)" not in quiet_log and "clients in the last" in quiet_log, quiet_log[-800:]
