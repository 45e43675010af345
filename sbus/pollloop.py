"""The one seam where the server touches Twisted's reactor loop: how its epoll reactor waits
for events and hands them out.

* **Lean dispatch.** Twisted wraps every event in `log.callWithLogger` (a `logPrefix` call, two
  dict copies and a context push and pop), which profiles as the largest Python cost of a wakeup
  that reads one packet (a round trip). Our batch transports log through `twisted.logger`
  (namespaces, not the legacy context), and `_doReadOrWrite` itself catches and logs whatever
  `doRead`/`doWrite` raise, so for them the wrapper adds nothing; other descriptors keep it.
* **Busy polling** (`--busy-poll`, like Linux's `SO_BUSY_POLL` for network sockets, and the
  spinning Go's scheduler does before it parks). Going to sleep in `epoll_wait` and being woken
  costs more than a round trip's work here (docs/performance.md: a sleeping server's wakeup is
  most of a round trip's time and CPU). So right after a wait that ended within the window, the
  loop polls (`epoll_wait` with timeout 0) for up to the window before it sleeps: a reply, the
  next request of a request/reply exchange, the next burst, is met awake. A wait that did not
  end within the window turns polling off until a wait does again (`Spinner`), so a quiet bus,
  or one with messages further apart than the window, sleeps exactly as before; so does a
  server whose CPUs are all wanted by other tasks (there a wakeup is cheap, and polling would
  take a CPU they need). The cost: while events keep coming within the window of each other
  the server uses up to one core.

Twisted's own EPollReactor is kept, unmodified: only its `doPoll`/`doIteration` (the wait) is
replaced on the instance, once, by `install`. Other reactors are left alone.
"""

from __future__ import annotations

import os
from time import monotonic

__all__ = ["Spinner", "crowded_probe", "install"]


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


def install(reactor, *, fast: type | None = None, busy_poll: float = 0.0) -> Spinner | None:
    """Replace the wait of Twisted's EPollReactor `reactor`: descriptors of class `fast` are
    dispatched without the legacy log context; `busy_poll` seconds of polling (see `Spinner`).
    Returns the Spinner, or None when nothing was done (another reactor, nothing asked, or
    installed already: the first caller's settings stay)."""
    try:
        from twisted.internet.epollreactor import EPollReactor
    except ImportError:  # pragma: no cover - not Linux
        return None
    if type(reactor) is not EPollReactor or "doIteration" in vars(reactor):
        return None
    if fast is None and busy_poll <= 0:
        return None
    from twisted.python import log as legacy_log

    poller = reactor._poller
    selectables = reactor._selectables
    drdw = reactor._doReadOrWrite
    with_logger = legacy_log.callWithLogger
    spinner = Spinner(busy_poll, crowded_probe(len(os.sched_getaffinity(0))))
    budget = spinner.budget
    poll = poller.poll

    def doPoll(timeout):
        size = len(selectables)
        start = monotonic()
        spin = budget(timeout, start) if timeout != 0 else 0.0
        try:
            events = None
            if spin:
                until = start + spin
                while True:
                    events = poll(0, size)
                    if events or monotonic() >= until:
                        break
            if not events:
                if timeout is None:
                    left = -1
                else:
                    left = timeout - (monotonic() - start) if spin else timeout
                    if left < 0:
                        left = 0
                events = poll(left, size)
        except InterruptedError:
            return
        spinner.last = monotonic() - start
        for fd, event in events:
            selectable = selectables.get(fd)
            if selectable is None:
                continue
            if selectable.__class__ is fast:
                drdw(selectable, fd, event)
            else:
                with_logger(selectable, drdw, selectable, fd, event)

    reactor.doPoll = reactor.doIteration = doPoll
    return spinner
