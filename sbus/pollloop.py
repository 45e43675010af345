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

This module is the policy alone (no I/O but the probe's read of /proc/loadavg); the reactor
applies it.
"""

from __future__ import annotations

__all__ = ["Spinner", "crowded_probe"]


#: How often (seconds) a polling server asks whether the CPUs are crowded (`Spinner.crowded`).
CROWD_CHECK = 0.1


class Spinner:
    """Whether to poll before sleeping, and for how long: adaptive, from the last wait, and only
    while the CPUs are not crowded. Polling pays when a CPU would otherwise go idle, since
    waking an idle one is what costs; when other tasks are waiting for every CPU, a wakeup is
    cheap and polling would take a CPU they need (measured: docs/performance.md)."""

    __slots__ = ("window", "last", "crowded", "_probe", "_checked")

    def __init__(self, window: float, probe=None):
        #: Seconds to poll at most; 0 never polls.
        self.window = window
        #: How long the last wait lasted (seconds), polling and sleeping together.
        self.last = float("inf")
        #: Whether the probe last said the CPUs are crowded; `probe()` -> bool (None: never).
        self.crowded = False
        self._probe = probe
        self._checked = float("-inf")

    def budget(self, timeout: float | None, now: float) -> float:
        """Seconds to poll before sleeping, for a wait of at most `timeout` (None: no limit),
        at time `now` (monotonic seconds)."""
        window = self.window
        if window <= 0 or self.last > window:
            return 0.0
        if self._probe is not None and now - self._checked >= CROWD_CHECK:
            self._checked = now
            self.crowded = self._probe()
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
