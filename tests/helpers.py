"""Tiny raw-socket helpers for the server tests.

Everything here speaks the wire protocol by hand over AF_UNIX SOCK_SEQPACKET
sockets (no sbus client library), so the tests check the bytes on the wire.

Synchronisation never sleeps: the server handles one client's packets in
order and answers `CMSG !/cred/whoami` in that order, so `sync(sock)` returns
once every earlier packet of `sock` was processed, and hands back whatever
was delivered to `sock` before the reply.

`Agent` is a client in a separate (forked) process, so its pid differs from
the test process's; it is driven over a pipe.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import re
import select
import signal
import socket
import time
import traceback
import uuid

MAX_PACKET = 409600
BIG_BUF = 2 * 1024 * 1024
RECV_SIZE = 1 << 20
WHOAMI = b"CMSG !/cred/whoami"
WHOAMI_REPLY = b"CMSG !/cred/whoami\0"
STATS = b"CMSG server/stats"
STATS_REPLY = b"CMSG server/stats\0"

SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


class Disconnected(Exception):
    """The server closed the connection."""


# ---------------------------------------------------------------- packets


def sub(pattern) -> bytes:
    return b"SUB " + _b(pattern)


def unsub(pattern) -> bytes:
    return b"UNSUB " + _b(pattern)


def msg(key, payload=b"") -> bytes:
    return b"MSG " + _b(key) + b"\0" + _b(payload)


def cmsg(key, payload=None) -> bytes:
    return b"CMSG " + _b(key) + (b"" if payload is None else b"\0" + _b(payload))


def _b(x) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


def unique(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------- sockets


def set_big_buffers(sock: socket.socket, size: int = BIG_BUF) -> None:
    """Make room for 409600-byte packets in both directions (forcing as root)."""
    for opt, force in ((socket.SO_SNDBUF, SO_SNDBUFFORCE), (socket.SO_RCVBUF, SO_RCVBUFFORCE)):
        sock.setsockopt(socket.SOL_SOCKET, opt, size)
        if sock.getsockopt(socket.SOL_SOCKET, opt) < size:
            try:
                sock.setsockopt(socket.SOL_SOCKET, force, size)
            except OSError:
                pass


def connect(address: str, big: bool = False, timeout: float = 5.0, sndbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if big:
        set_big_buffers(s)
    if sndbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    s.settimeout(timeout)
    s.connect(address)
    return s


def send(sock: socket.socket, *packets: bytes) -> None:
    for p in packets:
        assert p, "empty packets cannot be sent meaningfully"
        n = sock.send(p)
        assert n == len(p), (n, len(p))


def recv(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """One packet; b"" when the server closed (EOF or ECONNRESET).

    Raises TimeoutError when nothing comes within `timeout`.
    """
    old = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        return sock.recv(RECV_SIZE)
    except ConnectionResetError:
        return b""
    finally:
        sock.settimeout(old)


def recv_ready(sock: socket.socket) -> list[bytes]:
    """Every packet readable right now, without waiting."""
    out = []
    while True:
        r, _, _ = select.select([sock], [], [], 0)
        if not r:
            return out
        p = recv(sock)
        if not p:
            raise Disconnected()
        out.append(p)


def sync(sock: socket.socket, timeout: float = 5.0) -> list[bytes]:
    """Barrier: round-trip whoami; return the packets received before its reply."""
    send(sock, WHOAMI)
    before = []
    while True:
        p = recv(sock, timeout)
        if not p:
            raise Disconnected(f"disconnected during sync; had {len(before)} packets: {[x[:40] for x in before[:3]]!r}")
        if p.startswith(WHOAMI_REPLY):
            return before
        before.append(p)


def whoami(sock: socket.socket) -> tuple[int, int, int]:
    send(sock, WHOAMI)
    while True:
        p = recv(sock)
        if not p:
            raise Disconnected()
        if p.startswith(WHOAMI_REPLY):
            return parse_cred(p[len(WHOAMI_REPLY):])


def parse_cred(payload: bytes) -> tuple[int, int, int]:
    m = re.fullmatch(rb"!/cred/(\d+)/(\d+)/(\d+)", payload)
    assert m, payload
    return tuple(int(x) for x in m.groups())


def wait_closed(sock: socket.socket, timeout: float = 5.0) -> list[bytes]:
    """Read until the server closes the connection; return what came before.

    Raises AssertionError if it is still open after `timeout`.
    """
    deadline = time.monotonic() + timeout
    got = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"still connected after {timeout}s (got {len(got)} packets: {[x[:40] for x in got[:3]]!r})")
        try:
            p = recv(sock, left)
        except TimeoutError:
            continue
        if not p:
            return got
        got.append(p)


def stats(sock: socket.socket, timeout: float = 5.0) -> dict:
    """Ask the server for its statistics (other packets received meanwhile are dropped)."""
    send(sock, STATS)
    while True:
        p = recv(sock, timeout)
        if not p:
            raise Disconnected()
        if p.startswith(STATS_REPLY):
            return json.loads(p[len(STATS_REPLY):])


def wait_stats(sock, predicate, timeout: float = 5.0) -> dict:
    """Poll the statistics until `predicate(stats)` holds (for asynchronous events like EOF)."""
    deadline = time.monotonic() + timeout
    while True:
        st = stats(sock)
        if predicate(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"stats never satisfied the condition: {st}")
        time.sleep(0.01)


def total(counts) -> int:
    return sum(counts.values()) if isinstance(counts, dict) else int(counts)


def served(address: str) -> None:
    """A fresh subscriber/publisher pair still works on the bus."""
    key = unique("served/")
    a, b = connect(address), connect(address)
    try:
        send(a, sub(key))
        sync(a)
        send(b, msg(key, b"ping"))
        assert recv(a) == msg(key, b"ping")
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- the log


def _num(n: int) -> str:
    return rf"(?<![0-9]){n}(?![0-9])"


def wait_offender_logged(bus, pid: int, uid: int, keywords=(), timeout: float = 5.0) -> list[str]:
    """Wait for a log line naming `pid` and `uid` (and one of `keywords`, if any)."""
    deadline = time.monotonic() + timeout
    while True:
        text = bus.log()
        lines = [l for l in text.splitlines() if re.search(_num(pid), l)]
        good = [
            l for l in lines
            if re.search(_num(uid), l.replace(str(pid), ""))
            and (not keywords or any(k.lower() in l.lower() for k in keywords))
        ]
        if good:
            return good
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no log line naming pid {pid}, uid {uid} and one of {keywords!r}; log:\n{text}"
            )
        time.sleep(0.02)


# ---------------------------------------------------------------- agents


class Agent:
    """A client in a forked child process (its own pid), driven over a pipe.

    Optionally drops to `uid`/`gid` before connecting.
    """

    def __init__(self, address: str, uid: int | None = None, gid: int | None = None, big: bool = False):
        self.conn, child = multiprocessing.Pipe()
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                keep = child.fileno()
                os.closerange(3, keep)
                os.closerange(keep + 1, 4096)
                if gid is not None:
                    os.setgroups([])
                    os.setgid(gid)
                if uid is not None:
                    os.setuid(uid)
                _agent_main(child, address, big)
                code = 0
            except BaseException:
                try:
                    child.send(("crash", traceback.format_exc()))
                except BaseException:
                    pass
            finally:
                os._exit(code)
        child.close()
        self.pid = pid
        status, info = self._reply(10)
        if status != "ok":
            self.kill()
            raise RuntimeError(f"agent failed to connect: {info}")

    def _reply(self, timeout=10.0):
        if not self.conn.poll(timeout):
            raise TimeoutError("agent did not answer")
        status, value = self.conn.recv()
        if status == "crash":
            raise RuntimeError(f"agent crashed:\n{value}")
        return status, value

    def call(self, *cmd, timeout=10.0):
        self.conn.send(cmd)
        status, value = self._reply(timeout)
        if status == "error":
            raise RuntimeError(value)
        return status, value

    def send(self, *packets: bytes) -> None:
        for p in packets:
            self.call("send", p)

    def sync(self) -> list[bytes]:
        """Packets received before the whoami reply; raises Disconnected if closed."""
        status, value = self.call("sync")
        if status == "closed":
            raise Disconnected(value)
        return value

    def whoami(self) -> tuple[int, int, int]:
        status, value = self.call("whoami")
        if status == "closed":
            raise Disconnected()
        return parse_cred(value)

    def recv(self, timeout: float = 5.0) -> bytes | None:
        """One packet, b"" on close, None on timeout."""
        return self.call("recv", timeout, timeout=timeout + 10)[1]

    def wait_closed(self, timeout: float = 5.0) -> bool:
        """True once the server closed the connection; False if still open at `timeout`."""
        return self.call("closed", timeout, timeout=timeout + 10)[1]

    def flood(self, key: bytes, size: int = 1000) -> None:
        """Subscribe to everything and publish on `key` forever without reading."""
        self.call("flood", key, size)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.conn.close()

    def close(self) -> None:
        try:
            self.conn.send(("exit",))
        except OSError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill()


def _agent_main(conn, address: str, big: bool) -> None:
    sock = connect(address, big=big)
    conn.send(("ok", os.getpid()))
    while True:
        cmd = conn.recv()
        op = cmd[0]
        try:
            if op == "exit":
                sock.close()
                return
            if op == "send":
                send(sock, cmd[1])
                conn.send(("ok", None))
            elif op == "sync":
                try:
                    conn.send(("ok", sync(sock)))
                except (Disconnected, BrokenPipeError, ConnectionResetError) as e:
                    conn.send(("closed", str(e)))
            elif op == "whoami":
                try:
                    send(sock, WHOAMI)
                    while True:
                        p = recv(sock)
                        if not p:
                            conn.send(("closed", None))
                            break
                        if p.startswith(WHOAMI_REPLY):
                            conn.send(("ok", p[len(WHOAMI_REPLY):]))
                            break
                except (BrokenPipeError, ConnectionResetError):
                    conn.send(("closed", None))
            elif op == "recv":
                try:
                    conn.send(("ok", recv(sock, cmd[1])))
                except TimeoutError:
                    conn.send(("ok", None))
            elif op == "closed":
                try:
                    wait_closed(sock, cmd[1])
                    conn.send(("ok", True))
                except AssertionError:
                    conn.send(("ok", False))
            elif op == "flood":
                key, size = cmd[1], cmd[2]
                send(sock, sub(b""))
                sync(sock)
                conn.send(("ok", None))
                i = 0
                payload = b"x" * size
                while True:  # until SIGKILL
                    sock.send(msg(key, b"%d:" % i + payload))
                    i += 1
            else:
                conn.send(("error", f"unknown op {op!r}"))
        except (BrokenPipeError, ConnectionResetError) as e:
            conn.send(("closed", str(e)))
        except OSError as e:
            if e.errno in (errno.EPIPE, errno.ECONNRESET):
                conn.send(("closed", str(e)))
            else:
                conn.send(("error", repr(e)))


# ---------------------------------------------------------------- fixtures

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def mbus(tmp_path_factory):
    """One server process shared by a whole test module (tests use unique keys)."""
    from conftest import BusProcess

    d = tmp_path_factory.mktemp("mbus")
    p = BusProcess(["-f", "-a", str(d / "bus.socket")], str(d / "bus.socket"), str(d / "sbusd.log"))
    yield p
    p.stop()
