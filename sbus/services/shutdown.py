"""Clean shutdown on SIGTERM for the twistd services.

twistd's own SIGTERM handler stops the reactor and then kills the process
again with SIGTERM, so a service stopped by ``kill`` or systemd ends "killed
by signal 15" rather than with a status. sbus services treat SIGTERM as the
normal way to stop: the reactor stops once (services' `stopService` run and
log their final counters), and the process exits with status 0. A second
SIGTERM while stopping is ignored instead of raising `ReactorNotRunning`.
"""

from __future__ import annotations

import signal

from twisted.internet.error import ReactorNotRunning


def exit_zero_on_sigterm(reactor) -> None:
    """Once `reactor` runs (it installs its handlers then), make SIGTERM a plain `reactor.stop()`."""

    def stop():
        try:
            reactor.stop()
        except ReactorNotRunning:
            pass

    def handler(signum, frame):
        reactor.callFromThread(stop)

    def install():
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN,):
            signal.signal(signal.SIGTERM, handler)

    if hasattr(reactor, "callWhenRunning"):
        reactor.callWhenRunning(install)
