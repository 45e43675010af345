"""The server's reactor: Twisted's `PosixReactorBase` on an epoll of its own, whose wait is ours.

Why our own: a round trip's wakeup is mostly the reactor's wait and dispatch (docs/
performance.md), and Twisted's `EPollReactor` offers no public way to change either. This is
that reactor, written against `PosixReactorBase`'s interface for reactor authors (its
`_removeAll` and `_disconnectSelectable` hooks, documented for subclasses), with two changes,
both in `doPoll` and both asked for by the server through `ILeanReactor.serve`:

* **Lean dispatch.** Twisted wraps every event in `log.callWithLogger` (a `logPrefix` call, two
  dict copies, a context push and pop): the largest Python cost of a wakeup that reads one
  packet. Descriptors of the class given to `serve` (the server's batch transport, which logs
  through `twisted.logger` namespaces, not the legacy context) are called without it; an
  exception from them is still caught and logged, and the descriptor disconnected.
* **Busy polling** (`sbus.pollloop.Spinner`, `--busy-poll`): right after a wait that ended
  within the window, the next wait polls (`epoll_wait` with timeout 0) for up to the window
  before it sleeps; see `sbus.pollloop` for when it does not (never on one CPU; not while the
  load leaves no CPU idle). `serve` logs at start whether it polls, and why.

Everything else (timers, threads, signals, child processes, TCP and UNIX ports) is
`PosixReactorBase`'s, and tests/test_reactor.py runs Twisted's own reactor tests on it. Regular
files, which epoll refuses (EPERM), are treated as always ready and served at least every
`FILE_POLL` seconds, as Twisted's epoll reactor does.

It becomes the global reactor through `install()`: `sbusd` does that, ``twistd --reactor sbus``
does (the reactor plugin), and so do the ``sbus`` and ``sbus-relay`` plugins, when their options
are parsed, if no reactor was chosen (`install_unless_chosen`). On any other reactor the server
works the same, without lean dispatch and polling.
"""

from __future__ import annotations

import os
import signal
import sys
from select import EPOLLERR, EPOLLHUP, EPOLLIN, EPOLLOUT, epoll
from time import monotonic

from twisted.internet import error, main
from twisted.internet.interfaces import IReactorFDSet
from twisted.internet.posixbase import PosixReactorBase
from twisted.logger import Logger
from twisted.python import log
from zope.interface import implementer

from sbus.interfaces import ILeanReactor
from sbus.pollloop import CROWD_CHECK, LoadProbe, Spinner, allowed_cpus

__all__ = ["SbusReactor", "install", "install_unless_chosen", "wake_on_signals"]

#: Seconds between two services of a regular file (epoll cannot watch one; it is always ready).
FILE_POLL = 0.01

_GONE = EPOLLHUP | EPOLLERR

_log = Logger("sbus.reactor")


@implementer(IReactorFDSet, ILeanReactor)
class SbusReactor(PosixReactorBase):
    """epoll, level-triggered, with lean dispatch and busy polling (module docstring)."""

    def __init__(self):
        self._epoll = epoll(1024)
        self._readFds: set[int] = set()
        self._writeFds: set[int] = set()
        self._byFd: dict[int, object] = {}
        #: Regular files (epoll says EPERM): selectable -> EPOLLIN/EPOLLOUT it is watched for.
        self._files: dict[object, int] = {}
        self._lean: type | None = None
        #: The busy-polling policy; its window is 0 (never polls) until `serve` asks for one.
        self.spinner = Spinner(0.0, LoadProbe(allowed_cpus()))
        PosixReactorBase.__init__(self)

    # -- ILeanReactor

    def serve(self, lean: type | None, busy_poll: float) -> None:
        if lean is not None:
            self._lean = lean
        if busy_poll > self.spinner.window:
            if self.spinner.window <= 0:
                self._sayPolling(busy_poll)
            self.spinner.window = busy_poll

    def _sayPolling(self, window: float) -> None:
        """One line at start: whether this server polls, and why (`sbus.pollloop`'s rule)."""
        probe = self.spinner.probe
        polls, why = probe.decide()
        if probe.cpus <= 1:
            _log.info("busy polling: never ({why})", why=why)
        else:
            _log.info("busy polling: up to {us:g} µs before a sleep while a CPU is idle for it, "
                      "checked every {check:g} s; {now} ({why})", us=window * 1e6, check=CROWD_CHECK,
                      now="polling now" if polls else "not now", why=why)

    # -- IReactorFDSet

    def _watch(self, xer, mine: set, other: set, flag: int, otherflag: int) -> None:
        fd = xer.fileno()
        if fd in mine:
            return
        try:
            if fd in other:
                self._epoll.modify(fd, flag | otherflag)
            else:
                self._epoll.register(fd, flag)
        except PermissionError:  # a regular file
            self._files[xer] = self._files.get(xer, 0) | flag
            return
        mine.add(fd)
        self._byFd[fd] = xer

    def _unwatch(self, xer, mine: set, other: set, flag: int, otherflag: int) -> None:
        if xer in self._files:
            left = self._files[xer] & ~flag
            if left:
                self._files[xer] = left
            else:
                del self._files[xer]
            return
        fd = xer.fileno()
        if fd == -1:  # closed already: find it by identity
            for fd, known in self._byFd.items():
                if known is xer:
                    break
            else:
                return
        if fd not in mine:
            return
        mine.remove(fd)
        if fd in other:
            self._epoll.modify(fd, otherflag)
        else:
            del self._byFd[fd]
            try:
                self._epoll.unregister(fd)
            except OSError:  # closed before it was removed: the kernel dropped it already
                pass

    def addReader(self, reader) -> None:
        self._watch(reader, self._readFds, self._writeFds, EPOLLIN, EPOLLOUT)

    def addWriter(self, writer) -> None:
        self._watch(writer, self._writeFds, self._readFds, EPOLLOUT, EPOLLIN)

    def removeReader(self, reader) -> None:
        self._unwatch(reader, self._readFds, self._writeFds, EPOLLIN, EPOLLOUT)

    def removeWriter(self, writer) -> None:
        self._unwatch(writer, self._writeFds, self._readFds, EPOLLOUT, EPOLLIN)

    def getReaders(self) -> list:
        return ([self._byFd[fd] for fd in self._readFds]
                + [f for f, flags in self._files.items() if flags & EPOLLIN])

    def getWriters(self) -> list:
        return ([self._byFd[fd] for fd in self._writeFds]
                + [f for f, flags in self._files.items() if flags & EPOLLOUT])

    def removeAll(self) -> list:
        return self._removeAll(self.getReaders(), self.getWriters())

    # -- the wait

    def doPoll(self, timeout: float | None) -> None:
        byFd = self._byFd
        poll = self._epoll.poll
        spinner = self.spinner
        if self._files and (timeout is None or timeout > FILE_POLL):
            timeout = FILE_POLL
        start = monotonic()
        spin = spinner.budget(timeout, start) if timeout != 0 else 0.0
        size = len(byFd) or 1
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
        lean = self._lean
        readOrWrite = self._readOrWrite
        for fd, event in events:
            selectable = byFd.get(fd)
            if selectable is None:
                continue
            if selectable.__class__ is lean:
                readOrWrite(selectable, fd, event)
            else:
                log.callWithLogger(selectable, readOrWrite, selectable, fd, event)
        if self._files:
            for selectable, flags in list(self._files.items()):
                if selectable in self._files:  # not removed by one served before it
                    log.callWithLogger(selectable, self._readOrWrite, selectable, -1, flags)

    doIteration = doPoll

    def _readOrWrite(self, selectable, fd: int, event: int) -> None:
        """Hand one event to its descriptor; disconnect it if it says so or raises."""
        why = None
        inRead = False
        if event & _GONE and not event & EPOLLIN:
            # Hung up with nothing left to read: a clean close if we were reading (perhaps a
            # half-close), an error otherwise.
            if fd in self._readFds:
                inRead = True
                why = main.CONNECTION_DONE
            else:
                why = main.CONNECTION_LOST
        else:
            try:
                if selectable.fileno() == -1:
                    why = error.ConnectionFdescWentAway("File descriptor lost")
                else:
                    if event & EPOLLIN:
                        why = selectable.doRead()
                        inRead = True
                    if not why and event & EPOLLOUT:
                        why = selectable.doWrite()
                        inRead = False
            except BaseException:
                why = sys.exc_info()[1]
                log.err()
        if why:
            self._disconnectSelectable(selectable, why, inRead)


def install() -> SbusReactor:
    """Make a new `SbusReactor` the global reactor (``twisted.internet.reactor``)."""
    reactor = SbusReactor()
    main.installReactor(reactor)
    return reactor


def install_unless_chosen():
    """Install `SbusReactor` as the global reactor unless one is installed already (``twistd
    --reactor NAME``, or anything that imported ``twisted.internet.reactor``); return the
    global reactor either way."""
    if "twisted.internet.reactor" not in sys.modules:
        try:
            return install()
        except error.ReactorAlreadyInstalledError:  # pragma: no cover - installed meanwhile
            pass
    from twisted.internet import reactor
    return reactor


class _SignalWakeup:
    """The read end of a pipe the C-level signal handler writes to (`signal.set_wakeup_fd`)."""

    def __init__(self):
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def fileno(self) -> int:
        return self.r

    def doRead(self) -> None:
        try:
            while os.read(self.r, 4096):
                pass
        except BlockingIOError:
            pass

    def connectionLost(self, reason) -> None:
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass

    def logPrefix(self) -> str:
        return "signal wakeup"


def wake_on_signals(reactor) -> None:
    """Make any signal end the reactor's wait, for a process that runs it with
    ``installSignalHandlers=False`` and handlers of its own (sbusd).

    Python runs a signal's handler in the main thread between two bytecodes; a signal that
    arrives after the last such check and before ``epoll_wait`` blocks interrupts nothing, and
    the handler (whose ``callFromThread`` would wake the reactor) waits for the next event,
    maybe forever: 1 to 3 sbusd in 100 ignored a SIGINT sent as they became ready. Twisted's
    own handlers prevent this with `signal.set_wakeup_fd`; so does this, on a pipe the reactor
    watches. Call it from the main thread, before the reactor runs."""
    wakeup = _SignalWakeup()
    reactor.addReader(wakeup)
    signal.set_wakeup_fd(wakeup.w, warn_on_full_buffer=False)

