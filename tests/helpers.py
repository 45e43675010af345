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
import subprocess
import sys
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


def connect(address: str, big: bool = False, timeout: float = 5.0, sndbuf: int | None = None,
            extensions: bool = True) -> socket.socket:
    """A raw client socket. `extensions`: ask for the server's notices (`server/dropped`,
    `server/disconnect`) as the project's own clients do; False is a reference-protocol client."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if big:
        set_big_buffers(s)
    if sndbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    s.settimeout(timeout)
    s.connect(address)
    if extensions:
        try:
            s.send(b"CMSG server/extensions")
        except OSError:
            pass  # refused at accept: the caller's next operation says so
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
            raise AssertionError(f"stats never satisfied the condition: {str(st)[:300]}")
        time.sleep(0.01)


def total(counts) -> int:
    return sum(counts.values()) if isinstance(counts, dict) else int(counts)


def answers_whoami(address: str) -> bool:
    """Does a server answer a whoami on `address` now (its reactor runs, not only its socket)?"""
    try:
        with connect(address, timeout=2) as s:
            send(s, WHOAMI)
            return recv(s, 2).startswith(WHOAMI_REPLY)
    except (OSError, AssertionError):
        return False


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
    d = tmp_path_factory.mktemp("mbus")
    p = SbusdProcess(["-f", "-a", str(d / "bus.socket")], d / "sbusd.log", address=str(d / "bus.socket"))
    yield p
    p.stop()


# ---------------------------------------------------------------- service processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: An upper bound on a service's event (a log line, an answer), never waited out: a service that
#: starts Python and Twisted took over 10 s on a loaded CI machine (a queue's first log line).
SERVICE_TIMEOUT = 30.0


def wait_until(predicate, what: str, timeout: float = SERVICE_TIMEOUT, interval: float = 0.02):
    """Poll `predicate` until it returns something true (returned); fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def service_answer(address: str, service: str, wait: float = 1.0) -> dict | None:
    """`service`'s answer on the bus at `address` to `sbus/services/stats` (what `sbus stats
    --services` prints for it), or None: none within `wait` s, or no bus there. In process and
    back as soon as it answered, where the command starts Python and waits out its window."""
    from sbus.client import Client
    from sbus.services.svcstats import STATS_REQUEST

    try:
        with Client(address) as c:
            reply = c.whoami(SERVICE_TIMEOUT) + b"/sbus-stats/" + uuid.uuid4().hex.encode()
            c.subscribe(reply)
            c.sync(SERVICE_TIMEOUT)
            c.publish(STATS_REQUEST, reply)
            deadline = time.monotonic() + wait
            while (left := deadline - time.monotonic()) > 0:
                m = c.receive(timeout=left)
                if getattr(m, "key", None) == reply:
                    body = json.loads(m.payload)
                    if body.get("service") == service:
                        return body
    except OSError:  # no bus (yet), it closed, or nothing within `wait` (TimeoutError)
        return None
    return None


def child_env() -> dict:
    """The environment for service processes: the work tree first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class LoggedProcess:
    """A service process whose output goes to a log file; stopped by a signal."""

    stop_signal = signal.SIGINT
    stop_timeout = SERVICE_TIMEOUT

    def __init__(self, argv, log_path, *, cwd=None, stdout=None, **popen):
        self.argv = list(argv)
        self.log_path = str(log_path)
        self._log = open(self.log_path, "wb")
        popen.setdefault("env", child_env())
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=self._log if stdout is None else stdout,
            stderr=self._log, cwd=cwd or REPO, **popen,
        )
        self.pid = self.proc.pid

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def alive_or_raise(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.argv[2:4]} exited {self.proc.returncode}:\n{self.log()}")
        return True

    def wait_log(self, needle, timeout: float = SERVICE_TIMEOUT, count: int = 1) -> str:
        """Wait until `needle` (a string, or a compiled regex) is in the log `count` times."""
        def found():
            text = self.log()
            n = len(needle.findall(text)) if isinstance(needle, re.Pattern) else text.count(needle)
            return text if n >= count else self.alive_or_raise() and None

        try:
            return wait_until(found, f"{needle!r} x{count} in the log", timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.log()[-3000:]}") from None

    def stop(self, sig=None) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal if sig is None else sig)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode


class SbusdProcess(LoggedProcess):
    """`sbusd ARGS...` (normally `-f -a ADDRESS`), ready when its standard output ends (docs/protocol.md "The `sbusd` command line")."""

    def __init__(self, args, log_path, *, address=None, argv=None, **popen):
        self.address = address
        super().__init__(argv or [sys.executable, "-m", "sbus.server.sbusd", *args], log_path,
                         stdout=subprocess.PIPE, **popen)
        self.printed = b""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + SERVICE_TIMEOUT
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                raise RuntimeError(f"sbusd not ready in {SERVICE_TIMEOUT}s: {self.log()}")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                self.printed += chunk
        if self.proc.poll() is not None:
            raise RuntimeError(f"sbusd exited with {self.proc.returncode}: {self.log()}")

    def connect(self) -> socket.socket:
        return connect(self.address)


class TwistdBus(LoggedProcess):
    """`twistd sbus --socket ADDRESS OPTIONS...`, ready once the socket accepts."""

    def __init__(self, address, log_path, options=()):
        self.address = address
        super().__init__([sys.executable, "-m", "twisted", "--log-format", "text", "sbus",
                          "--socket", address, *options], log_path)
        wait_until(lambda: self.alive_or_raise() and self._accepts(), f"twistd sbus accepting on {address}", timeout=60)

    def _accepts(self) -> bool:
        try:
            self.connect().close()
        except OSError:
            return False
        return True

    def connect(self) -> socket.socket:
        return connect(self.address)


def run_as(uid: int, gid: int, fn, groups=()) -> str:
    """Run `fn()` in a forked child as uid/gid (and supplementary `groups`); return its result string."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        out = "child failed"
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(gid)
            os.setuid(uid)
            out = fn()
        except BaseException as e:  # noqa: BLE001
            out = f"error {type(e).__name__}: {e}"
        finally:
            os.write(w, out.encode())
            os._exit(0)
    os.close(w)
    try:
        chunks = []
        while chunk := os.read(r, 4096):
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return b"".join(chunks).decode()


def try_whoami(address) -> str:
    """'served', 'refused' (the server closed on us) or 'EACCES' (the file mode stopped us)."""
    try:
        s = connect(address, timeout=3)
    except PermissionError:
        return "EACCES"
    except OSError as e:
        return f"connect failed: {e}"
    try:
        s.send(WHOAMI)
        reply = s.recv(4096)
    except (ConnectionResetError, BrokenPipeError):
        return "refused"
    except TimeoutError:
        return "no answer"
    finally:
        s.close()
    if reply == b"":
        return "refused"
    return "served" if reply.startswith(WHOAMI_REPLY) else f"odd reply {reply!r}"
