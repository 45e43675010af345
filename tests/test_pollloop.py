"""Busy polling (`sbus.pollloop`): the policy alone, then a real server that must go back to
sleep when its traffic stops (the reactor that applies it: tests/test_reactor.py)."""

from __future__ import annotations

import os
import time

import pytest

from helpers import WHOAMI, connect, msg, recv, send, sub, sync, unique
from sbus import pollloop
from sbus.pollloop import Spinner


def test_the_spinner_polls_only_right_after_a_short_wait():
    s = Spinner(50e-6)
    assert s.budget(None, 0.0) == 0.0  # nothing waited yet: sleep
    s.last = 10e-6
    assert s.budget(None, 0.0) == 50e-6
    assert s.budget(1.0, 0.0) == 50e-6
    assert s.budget(20e-6, 0.0) == 20e-6  # a timed call sooner than the window
    assert s.budget(-1.0, 0.0) == 0.0
    s.last = 60e-6  # the last wait outlasted the window: sleep
    assert s.budget(None, 0.0) == 0.0
    assert Spinner(0.0).budget(None, 0.0) == 0.0


def test_the_spinner_does_not_poll_while_the_cpus_are_crowded_and_asks_at_most_every_tenth():
    answers = [True, False]
    asked = []

    def probe():
        asked.append(1)
        return answers[len(asked) - 1]
    s = Spinner(50e-6, probe)
    s.last = 10e-6
    assert s.budget(None, 100.0) == 0.0  # crowded: sleep
    assert s.budget(None, 100.05) == 0.0  # not asked again within 0.1 s
    assert len(asked) == 1
    assert s.budget(None, 100.2) == 50e-6  # asked again: not crowded any more
    assert len(asked) == 2
    s.last = 1.0
    s.budget(None, 200.0)  # no polling due: the probe is not asked at all
    assert len(asked) == 2


def test_the_crowded_probe_reads_the_kernels_runnable_count():
    assert pollloop.crowded_probe(10_000)() is False  # never 10,000 runnable here
    assert pollloop.crowded_probe(0)() is True  # the reader itself runs: "others" >= 0


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("busy_poll, pure", [("50", ""), ("1000", "1")], ids=["batch", "pure"])
def test_a_server_that_polled_through_a_burst_of_round_trips_sleeps_once_it_stops(
        start_twistd_bus, monkeypatch, busy_poll, pure):
    monkeypatch.setenv("SBUS_PURE_PYTHON", pure)
    bus = start_twistd_bus("--busy-poll", busy_poll)
    key = unique("rt/").encode()
    s = connect(bus.address)
    send(s, sub(key))
    sync(s)
    for i in range(3000):  # back to back: the server finds each within the window
        send(s, msg(key, b"%d" % i))
        assert recv(s) == msg(key, b"%d" % i)
    before = _cpu_seconds(bus.pid)
    time.sleep(1.0)  # the subject: a second with no traffic at all
    idle = _cpu_seconds(bus.pid) - before
    assert idle < 0.3, f"the server used {idle:.2f} s of CPU in an idle second"
    send(s, WHOAMI)
    assert recv(s).startswith(WHOAMI)
