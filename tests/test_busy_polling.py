"""Busy polling never loses (issue 37 item 3): the rule (`sbus.pollloop.polling_pays`), the probe
the reactor asks, and a real ``sbusd`` pinned to one CPU that says at start it never polls."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

from helpers import SbusdProcess, connect, msg, recv, send, sub, sync
from sbus.pollloop import LoadProbe, Spinner, allowed_cpus, polling_pays


@pytest.mark.parametrize("cpus, load, polls", [
    (1, 0.0, False),    # one CPU: its clients need it, whatever the load
    (1, 0.5, False),
    (2, 0.0, True),     # a quiet pair: one stays idle for the server
    (2, 1.0, True),
    (2, 1.01, False),   # the others want more than one of the two
    (2, 3.4, False),    # two CPU hogs and more
    (4, 2.9, True),
    (4, 3.2, False),
    (0, 0.0, False),    # (nonsense in: never polls)
])
def test_polling_pays_only_where_a_cpu_is_idle_for_it(cpus, load, polls):
    pays, why = polling_pays(cpus, load)
    assert pays is polls
    assert ("one CPU only" in why) == (cpus <= 1)
    if cpus > 1:
        assert f"{load:.2f}" in why and f"{cpus} CPUs" in why


def test_a_one_cpu_probe_is_always_crowded_so_the_spinner_never_polls():
    probe = LoadProbe(1)
    assert probe() is True and probe.decide()[0] is False
    s = Spinner(50e-6, probe)
    s.last = 1e-6   # a wait that ended within the window: it would poll on two CPUs
    assert s.budget(None, 100.0) == 0.0
    assert s.budget(None, 200.0) == 0.0


def test_the_probe_leaves_out_the_servers_own_share_of_the_load():
    """Its own polling is runnable time, counted in the load average: a server that spun for a
    while must not count itself among the others (it would turn itself off for good)."""
    probe = LoadProbe(2, online=2)
    probe.own = 1.0   # as after a minute of polling
    load = os.getloadavg()[0]
    assert probe.others() == pytest.approx(max(load - probe.own, 0.0), abs=0.1)
    wide = LoadProbe(2, online=8)   # 2 of 8 CPUs allowed: a quarter of the others' load is ours
    assert wide.others() == pytest.approx(max(load - wide.own, 0.0) / 4, abs=0.1)


def test_allowed_cpus_follows_the_affinity():
    assert 1 <= allowed_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.skipif(not shutil.which("taskset"), reason="no taskset (util-linux)")
def test_sbusd_pinned_to_one_cpu_says_it_never_polls_and_serves(tmp_path):
    address = str(tmp_path / "bus.socket")
    bus = SbusdProcess([], tmp_path / "sbusd.log", address=address,
                       argv=["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, "-m",
                             "sbus.server.sbusd", "-f", "-a", address])
    try:
        line = bus.wait_log("busy polling:")
        assert "busy polling: never (it may use one CPU only" in line, line
        s = connect(address)
        send(s, sub("p/"))
        sync(s)
        send(s, msg("p/k", b"x"))
        assert recv(s) == msg("p/k", b"x")
        s.close()
    finally:
        bus.stop()
