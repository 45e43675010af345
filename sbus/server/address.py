"""sbusd's address forms, and the listening socket they name.

Plain Python (no Twisted import: `sbusd` opens its socket before it imports
the reactor, and before it forks). The forms, as in the reference server:

``PATH``
    A filesystem path. The socket file gets ``mode`` (0700 by default; sbusd
    adds 0070 with ``-g`` and 0007 with ``-o``) and is removed when the
    server stops. What is found at the path first (see `clear_path`):

    * a socket a server listens on (``connect`` succeeds): an error,
      ``another server is listening on PATH``, with or without ``reuse``;
    * a stale socket (``connect`` refused: its server died, e.g. ``kill -9``):
      removed with one warning line, with or without ``reuse``;
    * an empty regular file: removed with ``reuse`` (``-r``), as the
      reference server's own test expects (it ``touch``-es the path); an
      error without;
    * anything else (a non-empty file, a directory, a symbolic link, ...):
      an error, ``reuse`` or not. The C server unlinks whatever is there
      with ``-r``; we refuse to delete data a typo in ``-a`` pointed at.

``/dev/unix/abstract``
    A random abstract address: a NUL followed by 107 random bytes (retried
    on ``EADDRINUSE``). Its printable form is ``/dev/unix/abstract/``
    followed by the lowercase hex of the whole 108-byte ``sun_path``
    (216 digits, starting with ``00``); sbusd prints it on standard output.

``/dev/unix/abstract/HEX``
    That abstract address. As in the C server, the bytes are written into a
    zeroed 108-byte ``sun_path`` and the whole 108 bytes are bound, so a
    short HEX is padded with NULs: ``sockaddr()`` gives clients the same
    bytes. The first byte must be ``00`` (otherwise the kernel would take it
    for a relative path; the C server silently did that). An odd number of
    digits or a non-hex digit makes the whole string a plain path, like the
    C code (and so does an empty HEX, which C took for 108 NULs; the client
    side, `sbus.client.address`, parses the same way); more than 216 digits
    is an error.

``/dev/fd/N``
    An inherited socket: ``AF_UNIX``/``SOCK_SEQPACKET``, bound, listening or
    not (``listen()`` is called if needed). Not digits after ``/dev/fd/``:
    a plain path, like the C code.

``systemd``
    Socket activation (``sd_listen_fds``): ``LISTEN_PID`` must be our pid;
    of the ``LISTEN_FDS`` descriptors from 3 on, the first ``AF_UNIX``
    ``SOCK_SEQPACKET`` one is used. The variables are removed from the
    environment afterwards so children don't inherit them. (The C server
    has no such form: there ``systemd`` would be a relative path.)

An inherited socket (``/dev/fd/N``, ``systemd``) is never chmod-ed nor
unlinked; -g/-o are ignored for it with a warning, and so is ``reuse``.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass, field
from typing import Callable

from sbus.address import (  # noqa: F401  (re-exported: the server's address vocabulary)
    SUN_PATH_SIZE,
    ABSTRACT,
    ABSTRACT_PREFIX,
    FD_PREFIX,
    SYSTEMD,
    SD_LISTEN_FDS_START,
    AddressError,
    Address,
    abstract_text,
    parse_address,
    sockaddr,
)


# --- the listening socket -----------------------------------------------------


@dataclass
class Listener:
    """A listening ``AF_UNIX``/``SOCK_SEQPACKET`` socket and what to undo at exit."""

    sock: socket.socket
    #: The socket file we created (None for abstract and inherited sockets).
    unlink_path: str | None
    #: ``/dev/unix/abstract/<hex>`` for a random abstract address, else None.
    printed_address: str | None
    #: For log lines: where we listen.
    description: str
    inherited: bool = False
    _identity: tuple[int, int] | None = field(default=None, repr=False)

    def cleanup(self) -> None:
        """Remove the socket file we created, if it is still ours.

        Compares device and inode with what we bound, so a server that took
        the path over meanwhile (``-r``) keeps its socket. Never raises.
        """
        path, self.unlink_path = self.unlink_path, None
        if path is None:
            return
        try:
            st = os.lstat(path)
            if self._identity is None or (st.st_dev, st.st_ino) == self._identity:
                os.unlink(path)
        except OSError:
            pass


def _strerror(e: OSError) -> str:
    return e.strerror or str(e)


def _check_seqpacket(sock: socket.socket, what: str) -> None:
    family = sock.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN)
    stype = sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
    if family != socket.AF_UNIX or stype != socket.SOCK_SEQPACKET:
        raise AddressError(f"{what}: not a unix domain SOCK_SEQPACKET socket")
    if sock.getsockname() in ("", b""):
        raise AddressError(f"{what}: socket is not bound")


def _adopt(fd: int, what: str) -> socket.socket:
    """Wrap an inherited fd without taking it over unless it is usable."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        if e.errno == errno.ENOTSOCK:
            raise AddressError(f"{what}: not a socket") from None
        raise AddressError(f"{what}: {_strerror(e)}") from None
    try:
        _check_seqpacket(sock, what)
    except BaseException:
        sock.detach()
        raise
    return sock


def _listen(sock: socket.socket, what: str) -> None:
    try:
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.listen(socket.SOMAXCONN)
    except OSError as e:
        raise AddressError(f"listen {what}: {_strerror(e)}") from None


def _describe_inherited(sock: socket.socket, what: str) -> str:
    name = sock.getsockname()
    if isinstance(name, bytes):
        name = abstract_text(name) if name[:1] == b"\0" else os.fsdecode(name)
    return f"{what} ({name})"


def _systemd_fd() -> int:
    env = os.environ
    pid, count = env.get("LISTEN_PID"), env.get("LISTEN_FDS")
    if not pid or not count:
        raise AddressError("systemd: no socket passed (LISTEN_PID/LISTEN_FDS not set)")
    try:
        pid_n, count_n = int(pid), int(count)
    except ValueError:
        raise AddressError(f"systemd: bad LISTEN_PID={pid!r} or LISTEN_FDS={count!r}") from None
    if pid_n != os.getpid():
        raise AddressError(f"systemd: LISTEN_PID={pid_n} is not our pid {os.getpid()}")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(name, None)
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count_n):
        try:
            probe = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            ok = probe.family == socket.AF_UNIX and probe.type == socket.SOCK_SEQPACKET
        finally:
            probe.detach()
        if ok:
            return fd
    raise AddressError(f"systemd: none of the {count_n} passed fds is a unix SOCK_SEQPACKET socket")


def _bound_by_a_socket(path: str) -> bool:
    """Does any socket (of this network namespace) hold `path`'s inode as its bound name?

    Asked of the kernel with a ``sock_diag`` dump of unix sockets showing their file's
    inode (``UDIAG_SHOW_VFS``, what ``ss -x`` uses). A server between its ``bind`` and its
    ``listen`` refuses connections like a dead one's file; this tells them apart (two
    servers starting at once both ran, one unreachable). False if the kernel cannot say."""
    import struct

    try:
        st = os.stat(path)
    except OSError:
        return False
    req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, 0x2, 0xFFFFFFFF, 0xFFFFFFFF)
    hdr = struct.pack("=IHHII", 16 + len(req), 20, 0x301, 1, 0)  # SOCK_DIAG_BY_FAMILY, REQUEST|DUMP
    try:
        nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 4)  # NETLINK_SOCK_DIAG
    except OSError:
        return False
    with nl:
        try:
            nl.settimeout(2.0)
            nl.sendto(hdr + req, (0, 0))
            while True:
                data = nl.recv(1 << 16)
                off = 0
                while off + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, off)
                    if length < 16:
                        return False
                    if kind in (2, 3):  # NLMSG_ERROR, NLMSG_DONE
                        return False
                    at, end = off + 16 + 16, off + length  # after nlmsghdr and unix_diag_msg
                    while at + 4 <= end:
                        alen, atype = struct.unpack_from("=HH", data, at)
                        if alen < 4:
                            break
                        if atype == 1 and alen >= 12:  # UNIX_DIAG_VFS: inode, device
                            ino, dev = struct.unpack_from("=II", data, at + 4)
                            if ino == st.st_ino and (dev >> 20, dev & 0xFFFFF) == (
                                    os.major(st.st_dev), os.minor(st.st_dev)):
                                return True
                        at += (alen + 3) & ~3
                    off += (length + 3) & ~3
                if not data:
                    return False
        except OSError:
            return False


def probe_socket(path: str) -> str:
    """Is a server listening on the socket file at `path`? ``"live"``, ``"stale"`` (connect
    refused: nobody is bound to it any more), ``"gone"`` (no file) or ``"unknown: <why>"``.

    A live server sees one connection that closes at once.
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.setblocking(False)
        probe.connect(path)
    except ConnectionRefusedError:
        # Refused: nobody listens. But a server that has bound the file and not yet called
        # listen() (it is starting) is refused too: it still holds a socket bound to this inode.
        if _bound_by_a_socket(path):
            return "live"
        return "stale"
    except BlockingIOError:  # EAGAIN: its backlog is full, so it is very much alive
        return "live"
    except FileNotFoundError:
        return "gone"
    except OSError as e:
        if e.errno == errno.EPROTOTYPE:  # bound by a live socket of another type
            return "live"
        return f"unknown: {_strerror(e)}"
    finally:
        probe.close()
    return "live"


def clear_path(path: str, reuse: bool, warn: Callable[[str], None] | None = None) -> None:
    """Make room to bind a socket at `path`, or raise `AddressError` (see the module doc)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise AddressError(f"stat {path}: {_strerror(e)}") from None
    if stat.S_ISSOCK(st.st_mode):
        state = probe_socket(path)
        if state == "gone":
            return
        if state == "live":
            raise AddressError(f"another server is listening on {path}")
        if state != "stale":
            raise AddressError(f"{path}: cannot tell whether a server listens there ({state[9:]}); "
                               "not removing it")
        what = "stale socket (nobody listening)"
    elif reuse and stat.S_ISREG(st.st_mode) and st.st_size == 0:
        what = "empty file (-r)"
    elif reuse:
        raise AddressError(f"{path}: exists and is not a socket nor an empty file, refusing to remove it")
    else:
        raise AddressError(f"bind {path}: Address already in use (file exists; -r removes an empty file)")
    # Move it aside atomically, then look at what was moved: a server starting
    # at the same moment may have put its live socket at `path` after our
    # probe (checking the inode and then unlinking left that moment open).
    directory, base = os.path.split(path)
    trash = os.path.join(directory, f".{base}.stale.{os.urandom(6).hex()}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError as e:
        raise AddressError(f"unlink {path}: {_strerror(e)}") from None
    try:
        now = os.lstat(trash)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):  # replaced while we looked: put it back
            try:
                os.link(trash, path)
            except OSError:
                pass
            return
    finally:
        try:
            os.unlink(trash)
        except OSError:
            pass
    if warn is not None:
        warn(f"removed the {what} at {path}")


def check_bindable(text: str, reuse: bool = False) -> None:
    """Raise `AddressError` (one line) if a listener for `text` would fail to bind for a
    reason known now: a live server on the path, a file that is in the way, a directory that
    does not exist. Removes nothing. For services that bind later (``sbus-relay`` binds once
    its master answers), so that these failures are start-up failures."""
    addr = parse_address(text)
    if addr.kind != "path":
        return
    path = addr.value
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))  # type: ignore[arg-type]
        if not os.path.isdir(parent):
            raise AddressError(f"bind {path}: No such file or directory") from None
        return
    except OSError as e:
        raise AddressError(f"stat {path}: {_strerror(e)}") from None
    if stat.S_ISSOCK(st.st_mode):
        if probe_socket(path) == "live":  # type: ignore[arg-type]
            raise AddressError(f"another server is listening on {path}")
    elif not (reuse and stat.S_ISREG(st.st_mode) and st.st_size == 0):
        raise AddressError(f"bind {path}: Address already in use (file exists; -r removes an empty file)"
                           if not reuse else
                           f"{path}: exists and is not a socket nor an empty file, refusing to remove it")


def _bind_path(sock: socket.socket, path: str, mode: int, reuse: bool,
               warn: Callable[[str], None] | None = None) -> tuple[int, int]:
    clear_path(path, reuse, warn)
    # The socket file's mode comes from the socket inode's mode and the umask
    # at bind time (as in the C server: fchmod then bind under umask 0). The
    # chmod afterwards makes sure on kernels/filesystems that differ.
    try:
        os.fchmod(sock.fileno(), mode)
    except OSError:
        pass
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            # Someone bound it between our look and our bind.
            raise AddressError(f"bind {path}: Address already in use") from None
        raise AddressError(f"bind {path}: {_strerror(e)}") from None
    finally:
        os.umask(old)
    try:
        st = os.lstat(path)
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)
    except OSError as e:
        raise AddressError(f"chmod {path}: {_strerror(e)}") from None
    return st.st_dev, st.st_ino


def open_listener(
    text: str,
    mode: int = 0o700,
    reuse: bool = False,
    warn: Callable[[str], None] | None = None,
) -> Listener:
    """Open, bind and listen on the socket `text` names; raise `AddressError`.

    `mode` applies to a socket file we create; `warn` receives one-line
    warnings (-g/-o ignored for an inherited socket).
    """
    addr = parse_address(text)
    if addr.kind in ("fd", "systemd"):
        if addr.kind == "fd":
            fd = addr.value
            what = text
        else:
            fd = _systemd_fd()
            what = f"systemd fd {fd}"
        sock = _adopt(fd, what)  # type: ignore[arg-type]
        try:
            if warn is not None:
                if mode & 0o070:
                    warn("ignoring -g due to using passed down socket")
                if mode & 0o007:
                    warn("ignoring -o due to using passed down socket")
            _listen(sock, what)
            sock.set_inheritable(False)
            return Listener(sock, None, None, _describe_inherited(sock, what), inherited=True)
        except BaseException:
            sock.detach()
            raise

    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError as e:
        raise AddressError(f"socket PF_UNIX SOCK_SEQPACKET: {_strerror(e)}") from None
    try:
        identity = None
        unlink_path = None
        printed = None
        if addr.kind == "path":
            identity = _bind_path(sock, addr.value, mode, reuse, warn)  # type: ignore[arg-type]
            # Absolute: the daemon chdirs to / before it removes the file at exit.
            unlink_path = os.path.abspath(addr.value)  # type: ignore[arg-type]
            description = addr.value
        elif addr.kind == "abstract":
            try:
                sock.bind(addr.value)
            except OSError as e:
                raise AddressError(f"bind <abstract:{text[len(ABSTRACT_PREFIX):]}>: {_strerror(e)}") from None
            description = text
        else:  # random
            while True:
                raw = b"\0" + os.urandom(SUN_PATH_SIZE - 1)
                try:
                    sock.bind(raw)
                    break
                except OSError as e:
                    if e.errno != errno.EADDRINUSE:
                        raise AddressError(f"bind <random abstract address>: {_strerror(e)}") from None
            printed = description = abstract_text(raw)
        listener = Listener(sock, unlink_path, printed, description, _identity=identity)
        try:
            _listen(sock, description)
        except BaseException:
            listener.cleanup()
            raise
        return listener
    except BaseException:
        sock.close()
        raise
