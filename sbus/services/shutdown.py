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
    """Once `reactor` runs (it installs its handlers then), make SIGTERM a plain `reactor.stop()`.

    Called from `startService` before the reactor runs (twistd and twist start services first),
    it also holds SIGINT and SIGTERM until the reactor runs: Python's own SIGINT handler raised
    KeyboardInterrupt wherever start-up was, a Deferred callback swallowed it, and a service
    interrupted while it connected ran on as if nothing happened."""

    def stop():
        try:
            reactor.stop()
        except ReactorNotRunning:
            pass

    def handler(signum, frame):
        reactor.callFromThread(stop)

    early: list[int] = []

    def held(signum, frame):
        early.append(signum)

    def install():
        if signal.getsignal(signal.SIGINT) is held:
            # the reactor leaves a SIGINT handler that is not Python's default alone
            signal.signal(signal.SIGINT, reactor.sigInt)
        # only in place of the reactor's own handler (twistd/twist): a reactor run without
        # signal handlers (tests, embedding applications) keeps whatever its owner chose
        current = signal.getsignal(signal.SIGTERM)
        if getattr(current, "__self__", None) is reactor:
            signal.signal(signal.SIGTERM, handler)
        elif current is held:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if early:   # only where `held` was installed: the reactor has sigInt
            if early[0] == signal.SIGINT:
                reactor.sigInt(early[0])
            else:
                stop()

    if not hasattr(reactor, "callWhenRunning"):
        return
    if not getattr(reactor, "running", True) and hasattr(reactor, "sigInt"):
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, held)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, held)
    reactor.callWhenRunning(install)


def stop_with_status(reactor, status: int) -> None:
    """Stop `reactor` (services stop and log as usual), then exit with `status`: for a fatal
    error found once the service runs (twistd would otherwise exit 0)."""
    import os

    if reactor.running:
        reactor.addSystemEventTrigger("after", "shutdown", os._exit, status)
        reactor.stop()
