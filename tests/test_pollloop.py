"""Busy polling and lean dispatch (`sbus.pollloop`): the policy alone, then Twisted's own
EPollReactor with the wait replaced (driven one iteration at a time, never `run`), then a real
server that must go back to sleep when its traffic stops."""

from __future__ import annotations

import os
import socket
import time

import pytest
from twisted.internet import epollreactor, selectreactor

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


def test_install_takes_only_twisteds_epoll_reactor_once():
    r = epollreactor.EPollReactor()
    assert pollloop.install(r) is None  # nothing asked
    spinner = pollloop.install(r, busy_poll=1e-3)
    assert isinstance(spinner, Spinner) and spinner.window == 1e-3
    assert pollloop.install(r, busy_poll=2e-3) is None  # the first settings stay
    assert pollloop.install(selectreactor.SelectReactor(), busy_poll=1e-3) is None


class _Reader:
    """A read descriptor on one end of a socketpair (what the reactor hands events to)."""

    def __init__(self, sock):
        self.sock = sock
        self.got = []

    def fileno(self):
        return self.sock.fileno()

    def logPrefix(self):
        return "test"

    def doRead(self):
        self.got.append(self.sock.recv(100))

    def connectionLost(self, reason):
        pass


def _iteration(reactor, timeout):
    """One wait of the reactor: (wall seconds, CPU seconds of this process)."""
    w, c = time.monotonic(), time.process_time()
    reactor.doIteration(timeout)
    return time.monotonic() - w, time.process_time() - c


def test_a_poll_hands_events_over_and_a_quiet_one_sleeps_after_the_window():
    r = epollreactor.EPollReactor()
    spinner = pollloop.install(r, busy_poll=0.01)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    reader = _Reader(b)
    r.addReader(reader)
    a.send(b"one")
    _iteration(r, None)
    assert reader.got == [b"one"]
    assert spinner.last < 0.01  # it was waiting already: the next wait polls first
    # Nothing comes: it polls 10 ms, then sleeps the rest of the timeout (not spinning through it).
    wall, cpu = _iteration(r, 0.2)
    assert wall >= 0.19
    assert cpu < 0.1, f"spent {cpu:.3f} s of CPU in a 0.2 s wait with a 0.01 s window"
    assert spinner.last >= 0.19
    # The wait outlasted the window: now it sleeps at once.
    wall, cpu = _iteration(r, 0.1)
    assert wall >= 0.09 and cpu < 0.05
    a.send(b"two")
    _iteration(r, 1.0)
    assert reader.got == [b"one", b"two"]
    r.removeReader(reader)
    a.close()
    b.close()


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
