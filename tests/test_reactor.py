"""The server's reactor (`sbus.reactor`): Twisted's own reactor tests run on it, then what it
adds (busy polling, lean dispatch, regular files), driven one iteration at a time, then the
servers that install it."""

from __future__ import annotations

import socket
import time

from twisted.internet import error, main
from twisted.internet.test.test_core import SystemEventTestsBuilder
from twisted.internet.test.test_fdset import ReactorFDSetTestsBuilder
from twisted.internet.test.test_threads import ThreadTestsBuilder
from twisted.internet.test.test_time import TimeTestsBuilder
from twisted.trial.unittest import SkipTest, SynchronousTestCase

from sbus.interfaces import ILeanReactor
from sbus.reactor import FILE_POLL, SbusReactor


def _epoll_cannot(self):
    raise SkipTest("an epoll reactor cannot detect a lost descriptor (Twisted skips it for its own)")


def _on_sbus_reactor(builder):
    """Twisted's reactor test builder `builder`, run on SbusReactor (as its makeTestCaseClasses
    does for Twisted's own reactors), skipping what it skips for its EPollReactor."""
    attrs = {"reactorFactory": SbusReactor, "__module__": __name__}
    if hasattr(builder, "test_lostFileDescriptor"):
        attrs["test_lostFileDescriptor"] = _epoll_cannot
    return type(f"Test{builder.__name__}OnSbusReactor", (builder, SynchronousTestCase), attrs)


TestFDSet = _on_sbus_reactor(ReactorFDSetTestsBuilder)
TestTime = _on_sbus_reactor(TimeTestsBuilder)
TestThreads = _on_sbus_reactor(ThreadTestsBuilder)
TestSystemEvents = _on_sbus_reactor(SystemEventTestsBuilder)


class _Reader:
    """A read descriptor on one end of a socketpair; `fail` makes doRead raise."""

    def __init__(self, sock, fail=False):
        self.sock = sock
        self.fail = fail
        self.got = []
        self.lost = []

    def fileno(self):
        return self.sock.fileno()

    def logPrefix(self):
        return "test"

    def doRead(self):
        if self.fail:
            raise ValueError("doRead failed")
        self.got.append(self.sock.recv(100))
        return None if self.got[-1] else main.CONNECTION_DONE

    def doWrite(self):
        return None

    def connectionLost(self, reason):
        self.lost.append(reason)


class _Lean(_Reader):
    """A class handed to `serve` as the lean one."""


def _iteration(reactor, timeout):
    """One wait of the reactor: (wall seconds, CPU seconds of this process)."""
    w, c = time.monotonic(), time.process_time()
    reactor.doIteration(timeout)
    return time.monotonic() - w, time.process_time() - c


def _reactor():
    r = SbusReactor()
    assert ILeanReactor.providedBy(r)
    return r


def test_a_poll_hands_events_over_and_a_quiet_one_sleeps_after_the_window():
    r = _reactor()
    assert r.spinner.window == 0.0  # never polls until a server asks
    r.serve(None, 0.01)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    reader = _Reader(b)
    r.addReader(reader)
    a.send(b"one")
    _iteration(r, None)
    assert reader.got == [b"one"]
    assert r.spinner.last < 0.01  # it was waiting already: the next wait polls first
    # Nothing comes: it polls 10 ms, then sleeps the rest of the timeout (not spinning through it).
    wall, cpu = _iteration(r, 0.2)
    assert wall >= 0.19
    assert cpu < 0.1, f"spent {cpu:.3f} s of CPU in a 0.2 s wait with a 0.01 s window"
    assert r.spinner.last >= 0.19
    # The wait outlasted the window: now it sleeps at once.
    wall, cpu = _iteration(r, 0.1)
    assert wall >= 0.09 and cpu < 0.05
    a.send(b"two")
    _iteration(r, 1.0)
    assert reader.got == [b"one", b"two"]
    r.removeReader(reader)
    a.close()
    b.close()


def test_serve_keeps_the_largest_window_and_the_lean_class():
    r = _reactor()
    r.serve(_Lean, 50e-6)
    r.serve(None, 10e-6)  # a second port asking less takes nothing away
    assert r.spinner.window == 50e-6
    r.serve(None, 1e-3)
    assert r.spinner.window == 1e-3


def test_a_lean_descriptor_that_raises_is_logged_and_disconnected_others_go_on():
    r = _reactor()
    r.serve(_Lean, 0.0)
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    bad, good = _Lean(pairs[0][1], fail=True), _Lean(pairs[1][1])
    r.addReader(bad)
    r.addReader(good)
    pairs[0][0].send(b"x")
    pairs[1][0].send(b"y")
    errors = []
    from twisted.python import log
    log.addObserver(errors.append)
    try:
        _iteration(r, 1.0)
    finally:
        log.removeObserver(errors.append)
    assert good.got == [b"y"]
    assert len(bad.lost) == 1 and bad.lost[0].check(ValueError)
    assert bad not in r.getReaders() and good in r.getReaders()
    assert any(e.get("isError") for e in errors), "the failure was not logged"
    for a, b in pairs:
        a.close()
        b.close()


def test_a_reader_that_reads_the_end_is_closed_cleanly_a_writer_whose_peer_hangs_up_is_lost():
    r = _reactor()
    r.serve(_Lean, 0.0)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    reader, writer = _Lean(b), _Reader(d)
    r.addReader(reader)
    r.addWriter(writer)
    a.close()
    c.close()
    _iteration(r, 1.0)
    assert reader.got == [b""] and reader.lost[0].check(error.ConnectionDone)
    assert writer.lost and writer.lost[0].check(error.ConnectionLost)  # EPOLLHUP, not reading
    assert reader not in r.getReaders()
    assert writer not in r.getWriters()
    b.close()
    d.close()


def test_a_regular_file_is_served_as_always_ready(tmp_path):
    """epoll refuses regular files (EPERM): they are served every FILE_POLL at least."""
    r = _reactor()
    path = tmp_path / "f"
    path.write_bytes(b"data")

    class FileReader:
        def __init__(self, f):
            self.f, self.reads = f, 0

        def fileno(self):
            return self.f.fileno()

        def logPrefix(self):
            return "file"

        def doRead(self):
            self.reads += 1

        def connectionLost(self, reason):
            pass

    with open(path, "rb") as f:
        reader = FileReader(f)
        r.addReader(reader)
        assert reader in r.getReaders()
        wall, _ = _iteration(r, 5.0)
        assert reader.reads == 1 and wall < 1.0, "a regular file's reader was not served"
        assert FILE_POLL < 1.0
        r.removeReader(reader)
        assert reader not in r.getReaders()
        _iteration(r, 0.0)
        assert reader.reads == 1
