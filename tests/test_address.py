"""sbus.server.address: the address forms of `sbusd -a` / `twistd sbus --socket`.

In-process tests of the parser and of `open_listener`, plus real `sbusd`
processes for inherited sockets (/dev/fd/N, systemd) and socket file modes.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import uuid

import pytest

from helpers import SbusdProcess
from sbus.server.address import (
    SUN_PATH_SIZE,
    AddressError,
    Listener,
    open_listener,
    parse_address,
    sockaddr,
)

TIMEOUT = 10.0
WHOAMI = b"CMSG !/cred/whoami"


# ------------------------------------------------------------------ helpers


def seqpacket() -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(TIMEOUT)
    return s


def connect(addr) -> socket.socket:
    s = seqpacket()
    s.connect(addr)
    return s


def whoami(addr) -> bytes:
    """Connect, ask whoami, return the reply: proves the server serves `addr`."""
    with connect(addr) as s:
        s.send(WHOAMI)
        return s.recv(4096)


def close_listener(listener: Listener) -> None:
    listener.cleanup()
    listener.sock.close()


class Sbusd(SbusdProcess):
    """`python -m sbus.server.sbusd ARGS...`, ready once its stdout reaches EOF."""

    def __init__(self, args, tmp_path, **popen):
        super().__init__(args, tmp_path / f"sbusd-{uuid.uuid4().hex[:6]}.log", **popen)


@pytest.fixture
def sbusd(tmp_path):
    procs = []

    def start(*args, **popen):
        p = Sbusd(args, tmp_path, **popen)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.stop()


# ------------------------------------------------------------------ parsing


def test_parse_path():
    a = parse_address("/run/sbus.socket")
    assert (a.kind, a.value) == ("path", "/run/sbus.socket")
    assert parse_address("rel/x.sock").value == "rel/x.sock"


def test_parse_path_too_long_or_empty():
    with pytest.raises(AddressError, match="too long"):
        parse_address("/tmp/" + "x" * SUN_PATH_SIZE)
    with pytest.raises(AddressError):
        parse_address("")


def test_parse_random_abstract():
    assert parse_address("/dev/unix/abstract").kind == "random"


def test_parse_abstract_hex_is_zero_padded_to_108_bytes():
    a = parse_address("/dev/unix/abstract/00616263")
    assert a.kind == "abstract"
    assert a.value == b"\0abc" + b"\0" * (SUN_PATH_SIZE - 4)
    full = "00" + "ab" * (SUN_PATH_SIZE - 1)
    assert parse_address("/dev/unix/abstract/" + full).value == bytes.fromhex(full)
    assert parse_address("/dev/unix/abstract/00AbCd").value[:3] == b"\0\xab\xcd"


def test_parse_abstract_hex_fallbacks_and_errors():
    # odd length, non-hex or empty: a plain path, like the C server
    for text in ("/dev/unix/abstract/006", "/dev/unix/abstract/00zz", "/dev/unix/abstract/"):
        a = parse_address(text)
        assert (a.kind, a.value) == ("path", text)
    with pytest.raises(AddressError, match="216"):
        parse_address("/dev/unix/abstract/" + "00" * (SUN_PATH_SIZE + 1))
    with pytest.raises(AddressError, match="starts with 00"):
        parse_address("/dev/unix/abstract/41")


def test_parse_fd_and_systemd():
    assert parse_address("/dev/fd/7")[:2] == ("fd", 7)
    assert parse_address("/dev/fd/x").kind == "path"
    assert parse_address("/dev/fd/-1").kind == "path"
    with pytest.raises(AddressError):
        parse_address("/dev/fd/99999999999")
    assert parse_address("systemd").kind == "systemd"


def test_sockaddr_for_clients():
    assert sockaddr("/tmp/a.sock") == "/tmp/a.sock"
    assert sockaddr("/dev/unix/abstract/0061") == b"\0a" + b"\0" * (SUN_PATH_SIZE - 2)
    for text in ("/dev/unix/abstract", "/dev/fd/3", "systemd"):
        with pytest.raises(AddressError):
            sockaddr(text)


# ------------------------------------------------------------------ open_listener


def test_path_listener_mode_and_cleanup(tmp_path):
    path = str(tmp_path / "a.sock")
    lst = open_listener(path)
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert lst.unlink_path == path and lst.printed_address is None
        assert lst.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        connect(path).close()
    finally:
        close_listener(lst)
    assert not os.path.exists(path)


@pytest.mark.parametrize("mode", [0o700, 0o770, 0o707, 0o777])
def test_path_listener_modes(tmp_path, mode):
    path = str(tmp_path / "m.sock")
    old = os.umask(0o077)  # the mode must not depend on the caller's umask
    try:
        lst = open_listener(path, mode)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == mode
    finally:
        close_listener(lst)


def _stale_socket(path: str) -> None:
    """A socket file nobody listens on, as a server killed with -9 leaves behind."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(path)
    stale.close()


@pytest.mark.parametrize("reuse", [False, True])
def test_stale_socket_is_removed_with_one_warning(tmp_path, reuse):
    path = str(tmp_path / "b.sock")
    _stale_socket(path)
    warnings = []
    lst = open_listener(path, reuse=reuse, warn=warnings.append)
    try:
        connect(path).close()
    finally:
        close_listener(lst)
    assert warnings == [f"removed the stale socket (nobody listening) at {path}"]


@pytest.mark.parametrize("reuse", [False, True])
def test_live_server_socket_is_never_taken(tmp_path, reuse):
    path = str(tmp_path / "live.sock")
    first = open_listener(path)
    try:
        with pytest.raises(AddressError) as e:
            open_listener(path, reuse=reuse)
        assert str(e.value) == f"another server is listening on {path}"
        connect(path).close()  # still the first one's
    finally:
        close_listener(first)


def test_live_socket_of_another_type_is_never_taken(tmp_path):
    path = str(tmp_path / "stream.sock")
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(path)
    other.listen(1)
    try:
        with pytest.raises(AddressError, match="another server is listening"):
            open_listener(path, reuse=True)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        other.close()


def test_empty_file_needs_reuse(tmp_path):
    """The reference's own test touches the path, then expects -r to replace the file."""
    path = tmp_path / "touched.sock"
    path.touch()
    with pytest.raises(AddressError, match="Address already in use") as e:
        open_listener(str(path))
    assert "\n" not in str(e.value) and path.exists()
    warnings = []
    lst = open_listener(str(path), reuse=True, warn=warnings.append)
    try:
        connect(str(path)).close()
    finally:
        close_listener(lst)
    assert warnings == [f"removed the empty file (-r) at {path}"]


@pytest.mark.parametrize("kind", ["data", "directory", "symlink"])
def test_reuse_refuses_to_remove_anything_else(tmp_path, kind):
    path = tmp_path / "precious"
    if kind == "data":
        path.write_text("keep me")
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(AddressError, match="not a socket nor an empty file"):
        open_listener(str(path), reuse=True)
    assert path.is_symlink() if kind == "symlink" else path.exists()
    if kind == "data":
        assert path.read_text() == "keep me"


def test_cleanup_leaves_a_socket_that_replaced_ours(tmp_path):
    path = str(tmp_path / "c.sock")
    first = open_listener(path)
    os.unlink(path)  # someone removed it; a second server binds the path
    second = open_listener(path)
    close_listener(first)
    assert os.path.exists(path), "the first listener removed its successor's socket"
    close_listener(second)
    assert not os.path.exists(path)


def test_relative_path_is_unlinked_by_absolute_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lst = open_listener("rel.sock")
    assert lst.unlink_path == str(tmp_path / "rel.sock")
    monkeypatch.chdir("/")
    close_listener(lst)
    assert not (tmp_path / "rel.sock").exists()


def test_random_abstract_listener():
    lst = open_listener("/dev/unix/abstract")
    try:
        text = lst.printed_address
        prefix = "/dev/unix/abstract/"
        assert text.startswith(prefix + "00")
        digits = text[len(prefix):]
        assert len(digits) == 2 * SUN_PATH_SIZE and digits == digits.lower()
        int(digits, 16)
        assert lst.unlink_path is None
        assert lst.sock.getsockname() == bytes.fromhex(digits)
        connect(bytes.fromhex(digits)).close()
        connect(sockaddr(text)).close()
    finally:
        close_listener(lst)


def test_two_random_abstract_addresses_differ():
    a, b = open_listener("/dev/unix/abstract"), open_listener("/dev/unix/abstract")
    try:
        assert a.printed_address != b.printed_address
    finally:
        close_listener(a)
        close_listener(b)


def test_abstract_hex_listener():
    name = "00" + ("sbus-test-" + uuid.uuid4().hex).encode().hex()
    lst = open_listener("/dev/unix/abstract/" + name)
    try:
        assert lst.printed_address is None and lst.unlink_path is None
        connect(sockaddr("/dev/unix/abstract/" + name)).close()
        with pytest.raises(AddressError, match="Address already in use"):
            open_listener("/dev/unix/abstract/" + name)
    finally:
        close_listener(lst)


def test_inherited_fd_listener_bound_not_listening(tmp_path):
    path = str(tmp_path / "inh.sock")
    outer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    outer.bind(path)
    os.chmod(path, 0o600)
    warnings = []
    lst = open_listener(f"/dev/fd/{outer.fileno()}", mode=0o777, warn=warnings.append)
    try:
        assert lst.inherited and lst.unlink_path is None
        assert outer.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, "inherited socket was chmod-ed"
        assert len(warnings) == 2 and "-g" in warnings[0] and "-o" in warnings[1]
        connect(path).close()
        lst.cleanup()
        assert os.path.exists(path), "inherited socket's path was unlinked"
    finally:
        lst.sock.detach()
        outer.close()


def test_inherited_fd_must_be_a_seqpacket_unix_socket(tmp_path):
    stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stream.bind(str(tmp_path / "stream.sock"))
    unbound = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        with pytest.raises(AddressError, match="not a unix domain SOCK_SEQPACKET"):
            open_listener(f"/dev/fd/{stream.fileno()}")
        with pytest.raises(AddressError, match="not bound"):
            open_listener(f"/dev/fd/{unbound.fileno()}")
        with pytest.raises(AddressError, match="not a socket"):
            open_listener(f"/dev/fd/{r}")
        # the fds we did not take stay open and usable
        os.fstat(r)
        assert stream.fileno() >= 0 and stream.getsockname()
    finally:
        stream.close()
        unbound.close()
        os.close(r)
        os.close(w)


def test_systemd_without_environment_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("LISTEN_PID", raising=False)
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    with pytest.raises(AddressError, match="systemd: no socket passed"):
        open_listener("systemd")
    monkeypatch.setenv("LISTEN_PID", "1")
    monkeypatch.setenv("LISTEN_FDS", "1")
    with pytest.raises(AddressError, match="not our pid"):
        open_listener("systemd")


# ------------------------------------------------------------------ through sbusd


def test_sbusd_dev_fd_inherited_socket(sbusd, tmp_path):
    path = str(tmp_path / "passed.sock")
    outer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    outer.bind(path)
    os.chmod(path, 0o640)
    fd = outer.fileno()
    bus = sbusd("-f", "-g", "-a", f"/dev/fd/{fd}", pass_fds=[fd])
    outer.close()  # the server holds its own copy now
    assert whoami(path).startswith(WHOAMI + b"\0!/cred/")
    assert "ignoring -g due to using passed down socket" in bus.log()
    assert bus.stop() == 0
    assert os.path.exists(path), "sbusd unlinked an inherited socket's path"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


def test_sbusd_dev_fd_not_a_socket(tmp_path):
    r, w = os.pipe()
    try:
        res = subprocess.run(
            [sys.executable, "-m", "sbus.server.sbusd", "-f", "-a", f"/dev/fd/{r}"],
            pass_fds=[r], capture_output=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
        )
    finally:
        os.close(r)
        os.close(w)
    assert res.returncode == 1
    assert res.stderr.decode().splitlines() == [f"sbusd: /dev/fd/{r}: not a socket"]


#: exec's the rest of argv with the socket on fd 3 and LISTEN_PID/LISTEN_FDS set
#: for the exec-ed process itself (exec keeps the pid), as systemd does.
SYSTEMD_SHIM = (
    "import os, sys\n"
    "fd = int(sys.argv[1])\n"
    "if fd != 3:\n"
    "    os.dup2(fd, 3)\n"
    "    os.close(fd)\n"
    "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _systemd_argv(fd: int, *args: str) -> list[str]:
    return [sys.executable, "-c", SYSTEMD_SHIM, str(fd), sys.executable, "-m", "sbus.server.sbusd", *args]


def test_sbusd_systemd_socket_activation(sbusd, tmp_path):
    path = str(tmp_path / "activated.sock")
    outer = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    outer.bind(path)
    outer.listen(8)
    fd = outer.fileno()
    bus = sbusd(argv=_systemd_argv(fd, "-f", "-a", "systemd"), pass_fds=[fd])
    outer.close()
    assert whoami(path).startswith(WHOAMI + b"\0")
    assert "systemd fd 3" in bus.log()
    env = open(f"/proc/{bus.proc.pid}/environ", "rb").read()
    assert b"LISTEN_PID" in env  # exec-time environment; ours was cleaned in-process
    assert bus.stop(signal.SIGTERM) == 0
    assert os.path.exists(path), "sbusd unlinked a systemd socket's path"


def test_sbusd_systemd_wrong_socket_type(tmp_path):
    outer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    outer.bind(str(tmp_path / "stream.sock"))
    outer.listen(1)
    fd = outer.fileno()
    try:
        res = subprocess.run(_systemd_argv(fd, "-f", "-a", "systemd"), pass_fds=[fd],
                             capture_output=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    finally:
        outer.close()
    assert res.returncode == 1
    lines = res.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sbusd: systemd: ") and "SEQPACKET" in lines[0]


@pytest.mark.parametrize("flags,mode", [((), 0o700), (("-g",), 0o770), (("-o",), 0o707), (("-go",), 0o777)])
def test_sbusd_socket_file_mode(sbusd, tmp_path, flags, mode):
    path = str(tmp_path / "mode.sock")
    bus = sbusd("-f", *flags, "-a", path)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
    assert bus.stop() == 0
    assert not os.path.exists(path)
