"""Busy polling: when the server's reactor (`sbus.reactor`) polls before it sleeps.

Like Linux's `SO_BUSY_POLL` for network sockets (Unix sockets have none), and the spinning Go's
scheduler does before it parks. Going to sleep in `epoll_wait` and being woken costs more than a
round trip's work here (docs/performance.md: a sleeping server's wakeup is most of a round trip's
time and CPU). So right after a wait that ended within the window, the loop polls (`epoll_wait`
with timeout 0) for up to the window before it sleeps: a reply, the next request of a
request/reply exchange, the next burst, is met awake. A wait that did not end within the window
turns polling off until a wait does again (`Spinner`), so a quiet bus, or one with messages
further apart than the window, sleeps exactly as before; so does a server whose CPUs are all
wanted by other tasks (there a wakeup is cheap, and polling would take a CPU they need). The
cost: while events keep coming within the window of each other the server uses up to one core.

**The rule** (`polling_pays`, asked by `LoadProbe`): a server that may use one CPU only (its
affinity, ``taskset -c 0``, or a cgroup CPU quota under 2, a container's ``--cpus 1``) never
polls: its clients run on that CPU, and every microsecond it spins is one they wait. With more,
it polls only while the load the others put on its CPUs (the 1-minute load average, scaled to
the CPUs it may use, less its own CPU share averaged the same way) leaves at least one CPU idle
for it, and while fewer other tasks than its CPUs are runnable at that instant (the kernel's
count: the average takes a minute to show a burst). Both are read at most every
`CROWD_CHECK` seconds, and only while it would poll.

This module is the policy alone (no I/O but the probe's reads of /proc/loadavg and the cgroup's
CPU quota); the reactor applies it.
"""

from __future__ import annotations

import math
import os
import time

__all__ = ["LoadProbe", "Spinner", "allowed_cpus", "crowded_probe", "polling_pays"]


#: How often (seconds) a polling server asks whether the CPUs are crowded (`Spinner.crowded`).
CROWD_CHECK = 0.1


class Spinner:
    """Whether to poll before sleeping, and for how long: adaptive, from the last wait, and only
    while the CPUs are not crowded. Polling pays when a CPU would otherwise go idle, since
    waking an idle one is what costs; when other tasks are waiting for every CPU, a wakeup is
    cheap and polling would take a CPU they need (measured: docs/performance.md)."""

    __slots__ = ("window", "last", "crowded", "probe", "_checked")

    def __init__(self, window: float, probe=None):
        #: Seconds to poll at most; 0 never polls.
        self.window = window
        #: How long the last wait lasted (seconds), polling and sleeping together.
        self.last = float("inf")
        #: Whether the probe last said the CPUs are crowded; `probe()` -> bool (None: never).
        self.crowded = False
        self.probe = probe
        self._checked = float("-inf")

    def budget(self, timeout: float | None, now: float) -> float:
        """Seconds to poll before sleeping, for a wait of at most `timeout` (None: no limit),
        at time `now` (monotonic seconds)."""
        window = self.window
        if window <= 0 or self.last > window:
            return 0.0
        if self.probe is not None and now - self._checked >= CROWD_CHECK:
            self._checked = now
            self.crowded = self.probe()
        if self.crowded:
            return 0.0
        return window if timeout is None or timeout > window else max(timeout, 0.0)


def crowded_probe(cpus: int):
    """A probe for `Spinner`: True while at least `cpus` other tasks are runnable (the kernel's
    instant count, the fourth field of /proc/loadavg, less ourselves); False if unreadable."""
    def crowded() -> bool:
        try:
            with open("/proc/loadavg", "rb") as f:
                running = int(f.read().split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):
            return False
        return running - 1 >= cpus
    return crowded


def polling_pays(cpus: int, load: float) -> tuple[bool, str]:
    """Whether a server allowed `cpus` CPUs may busy-poll while others put `load` (runnable
    tasks on average, the server left out) on those CPUs, and why, in words for its log.
    Polling pays only on a CPU nobody else wants: with one CPU, its clients want it."""
    if cpus <= 1:
        return False, "it may use one CPU only, which its clients need"
    if load > cpus - 1:
        return False, f"the others' load {load:.2f} leaves none of its {cpus} CPUs idle"
    return True, f"the others' load {load:.2f} leaves one of its {cpus} CPUs idle"


def allowed_cpus() -> int:
    """The CPUs this process may use: its affinity, bounded by its cgroup's CPU quota (rounded
    down: a 1.5-CPU quota is shared with its clients as one CPU is), at least 1."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return cpus


def _cgroup_quota() -> float | None:
    """CPUs' worth of time the cgroup allows (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``
    over its period, as seen from inside a container), or None: no quota, or none readable."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


#: Seconds over which the kernel averages the load that `os.getloadavg()[0]` reports.
LOAD_PERIOD = 60.0


class LoadProbe:
    """The probe `Spinner` asks: crowded (True) unless `polling_pays` for the load others put on
    our `cpus` CPUs, or while the kernel's instant count says they are crowded
    (`crowded_probe`). The others' load is the 1-minute load average scaled from the `online`
    CPUs to ours, less our own CPU share, averaged as the kernel averages the load (our
    polling is runnable time, and counted in it)."""

    def __init__(self, cpus: int, online: int | None = None):
        self.cpus = cpus
        self.online = max(online or os.cpu_count() or cpus, cpus)
        self.own = 0.0
        self._instant = crowded_probe(cpus)
        self._at = time.monotonic()
        self._cpu = time.process_time()

    def others(self) -> float:
        """The load others put on our CPUs now (see the class)."""
        now, cpu = time.monotonic(), time.process_time()
        dt = now - self._at
        if dt > 0:
            share = min((cpu - self._cpu) / dt, float(self.cpus))
            self.own += (share - self.own) * (1 - math.exp(-dt / LOAD_PERIOD))
        self._at, self._cpu = now, cpu
        return max(os.getloadavg()[0] - self.own, 0.0) * self.cpus / self.online

    def decide(self) -> tuple[bool, str]:
        """`polling_pays` now, for the start line of the log."""
        return polling_pays(self.cpus, self.others() if self.cpus > 1 else 0.0)

    def __call__(self) -> bool:
        if self.cpus <= 1:
            return True
        return not polling_pays(self.cpus, self.others())[0] or self._instant()
