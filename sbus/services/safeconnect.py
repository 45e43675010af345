"""Connecting to a bus as the user it belongs to, not as root (the bridge's connector).

A bridge run as root could reach every bus on the machine. A socket path is
a name anybody who owns a directory on it can repoint: a user replaces their
own ``/run/user/1000/sbus.socket`` with a symlink to a third user's private
socket, and a root process that follows it connects into that private bus.

So, when the process is root, each connection is made by a short-lived
child that has **dropped to the side's user** first, and the connected
socket comes back to the bridge over ``SCM_RIGHTS``. The kernel then
applies that user's permissions to the whole path, symlinks included: a
user can reach through the bridge exactly the buses it could open itself.

How a side's user is chosen (`resolve_side`):

* ``--a-user`` / ``--b-user`` (name or uid) when given;
* otherwise the owner of the directory holding the socket, found without
  following any symlink (each component is opened with
  ``O_PATH | O_NOFOLLOW``; a symlink anywhere in the directory part is an
  error that asks for an explicit user), e.g. uid 1000 for
  ``/run/user/1000/sbus.socket``;
* when that directory belongs to root (``/run/sbus.socket``), the owner of
  the socket file itself (``lstat``, not followed); if that is root too, the
  connection is made as root: it is root's own bus.

The child keeps the directory it was given open (an ``O_PATH`` descriptor,
pinned: renaming directories afterwards changes nothing), ``fchdir``\\ s into
it, drops to the user (its groups from the user database), refuses a final
component that is a symlink not owned by that user, and connects to the
name relative to it. The connect is non-blocking: a full backlog comes back
as `BlockingIOError` and the client retries, as for a plain connect.

The helper lives as long as the connection (the bus checks, before each
secret delivery, that the process that connected is alive). If it dies
(``kill -9`` by the side's user, whose uid it runs as, or the OOM killer),
the bridge sees the end of its keeper socket, logs it, shuts the connection
down and reconnects with a new helper, rather than keep a connection that
would silently get no secret key.

Without root nothing of this is needed (the process has only its own
rights) and a plain connect is made. An abstract address or ``/dev/fd/N`` has
no directory: with an explicit user the child drops to it, else the
process's own credentials are used.
"""

from __future__ import annotations

import array
import errno
import os
import pwd
import socket
import stat
from typing import NamedTuple

from twisted.internet import defer
from twisted.logger import Logger

from sbus.address import size_buffers
from sbus.client.address import resolve
from sbus.core.codec import MAX_PACKET

log = Logger(namespace="sbus.bridge")


class SideError(OSError):
    """A side that cannot be connected safely; `str()` is one line."""


class Side(NamedTuple):
    uid: int
    gid: int
    groups: list
    dirfd: int | None      # O_PATH descriptor of the socket's directory (None: no directory)
    name: str | bytes      # the socket's name in dirfd, or the whole address without a directory
    why: str               # how the user was chosen, for the log


def parse_user(text: str) -> tuple[int, int]:
    """(uid, gid) of a user name or number."""
    try:
        pw = pwd.getpwnam(text)
        return pw.pw_uid, pw.pw_gid
    except KeyError:
        pass
    if text.isdigit():
        uid = int(text)
        try:
            return uid, pwd.getpwuid(uid).pw_gid
        except KeyError:
            return uid, uid
    raise ValueError(f"no such user: {text!r}")


def _groups(uid: int, gid: int) -> list:
    try:
        return sorted(set(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid)))
    except (KeyError, OSError):
        return [gid]


def open_dir_nofollow(path: str) -> int:
    """An O_PATH descriptor of directory `path`, reached without following any symlink."""
    if not os.path.isabs(path):
        path = os.path.abspath(path)
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [p for p in path.split("/") if p]:
            try:
                nfd = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise SideError(errno.ELOOP, f"{path}: {part!r} is a symlink or not a directory; "
                                                 f"refusing to follow it as root (name the user to "
                                                 f"connect as)") from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def resolve_side(address, user: str | None = None) -> Side:
    """Who connects to `address`, and where (see the module text). Root only."""
    addr = resolve(address)
    explicit = parse_user(user) if user else None
    if addr.kind != "path":
        if explicit is None:
            return Side(os.getuid(), os.getgid(), os.getgroups(), None, addr.value, "no directory: self")
        uid, gid = explicit
        return Side(uid, gid, _groups(uid, gid), None, addr.value, f"--user {user}")
    directory, name = os.path.split(os.path.abspath(addr.value))
    if not name:
        raise SideError(errno.EINVAL, f"{addr.text}: no socket name")
    dirfd = open_dir_nofollow(directory)
    try:
        if explicit is not None:
            uid, gid = explicit
            why = f"user {user}"
        else:
            st = os.fstat(dirfd)
            uid, gid, why = st.st_uid, st.st_gid, f"owner of {directory}"
            if uid == 0:
                try:
                    sst = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                except OSError as e:
                    raise SideError(e.errno, f"{addr.text}: {e.strerror}") from None
                if stat.S_ISLNK(sst.st_mode):
                    raise SideError(errno.ELOOP, f"{addr.text}: a symlink in a directory of root's; "
                                                 f"refusing to follow it as root")
                uid, gid, why = sst.st_uid, sst.st_gid, f"owner of {addr.text}"
            if uid != 0:
                try:
                    gid = pwd.getpwuid(uid).pw_gid
                except KeyError:
                    pass
        groups = _groups(uid, gid) if uid != 0 else [0]
        return Side(uid, gid, groups, dirfd, name, why)
    except BaseException:
        os.close(dirfd)
        raise


def _helper(side: Side, sender: socket.socket) -> None:  # pragma: no cover - in the helper
    """Connect as the side's user, hand the socket over, then live as long as the connection."""
    err = b"E%d connect failed" % errno.EIO
    try:
        if side.dirfd is not None:
            os.fchdir(side.dirfd)
        keep = sender.fileno()
        os.closerange(3, keep)              # nothing of the bridge stays open here
        os.closerange(keep + 1, 1 << 16)
        os.setgroups(side.groups)
        os.setgid(side.gid)
        os.setuid(side.uid)
        name = side.name
        if side.dirfd is not None:
            st = os.lstat(name)
            if stat.S_ISLNK(st.st_mode) and st.st_uid != side.uid:
                raise OSError(errno.ELOOP, f"{name} is a symlink of uid {st.st_uid}, not of uid {side.uid}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        sock.connect(name)
        sender.sendmsg([b"ok"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [sock.fileno()]))])
        sock.close()
        # The server checks that the process that connected is alive before it delivers a
        # secret key (!/cred/G/U/PID/...) to the connection: that process is this one, so it
        # stays until the bridge lets go of the connection (end of file on `sender`).
        try:
            sender.recv(1)
        except OSError:
            pass
        return
    except BlockingIOError:
        err = b"E%d backlog full" % errno.EAGAIN
    except OSError as e:
        err = b"E%d %s" % (e.errno or errno.EIO, (e.strerror or str(e)).encode("utf-8", "replace"))
    except BaseException as e:  # noqa: BLE001
        err = b"E%d %s" % (errno.EIO, repr(e).encode("utf-8", "replace"))
    try:
        sender.send(err)
    except OSError:
        pass


def connect_as(side: Side, text: str, max_packet: int = MAX_PACKET,
               timeout: float = 5.0) -> tuple[socket.socket, socket.socket]:
    """(connected SOCK_SEQPACKET socket, keeper): made by a helper process running as `side.uid`.

    The helper (a grandchild, so nobody has to reap it) lives until `keeper`
    is closed: close it when the connection is gone.
    """
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                parent.close()
                if os.fork() == 0:
                    _helper(side, child)
            finally:
                os._exit(0)
        child.close()
        os.waitpid(pid, 0)
        parent.settimeout(timeout)
        try:
            data, ancdata, _flags, _addr = parent.recvmsg(256, socket.CMSG_SPACE(4))
        except TimeoutError:
            raise TimeoutError(errno.ETIMEDOUT, "the connecting helper did not answer", text) from None
        fds = array.array("i")
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        if data == b"ok" and len(fds) == 1:
            sock = socket.socket(fileno=fds[0])
            size_buffers(sock, max_packet)
            parent.setblocking(False)
            keeper, parent = parent, None
            return sock, keeper
        for fd in fds:
            os.close(fd)
        code, _, why = data[1:].partition(b" ")
        n = int(code) if code.isdigit() else errno.EIO
        exc = {errno.EAGAIN: BlockingIOError, errno.ENOENT: FileNotFoundError,
               errno.EACCES: PermissionError, errno.ECONNREFUSED: ConnectionRefusedError}.get(n, OSError)
        raise exc(n, f"{why.decode('utf-8', 'replace')} (connecting as uid {side.uid})", text)
    finally:
        if parent is not None:
            parent.close()
        child.close()


class _HelperWatch:
    """Ends the connection when its helper exits (`kill -9`, OOM): the bus sees the helper as
    the connecting process and gives the connection no secret key once it is gone, so a
    connection outliving it would lose every secret message silently. The connection is
    shut down (through a duplicate descriptor) and the client reconnects with a new helper."""

    def __init__(self, reactor, keeper: socket.socket, sock: socket.socket, what: str):
        self.reactor = reactor
        self.keeper = keeper
        self.what = what
        self.conn = socket.socket(fileno=os.dup(sock.fileno()))
        reactor.addReader(self)

    def fileno(self) -> int:
        return self.keeper.fileno()

    def logPrefix(self) -> str:
        return "sbus-helper-watch"

    def doRead(self):
        try:
            if self.keeper.recv(1):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        log.warn("the helper process that connected {what} exited; reconnecting (the bus gives no "
                 "secret key to a connection whose connecting process is gone)", what=self.what)
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.stop()

    def connectionLost(self, reason):
        pass

    def stop(self) -> None:
        if self.conn is not None:
            self.reactor.removeReader(self)
            self.conn.close()
            self.conn = None


class OwnerConnector:
    """A `ReconnectingClient` connector for one side: as the side's user when we are root."""

    def __init__(self, user: str | None = None):
        self.user = user
        self.last_why = None
        self._keeper = None
        self._watch = None

    def release(self) -> None:
        """The connection is gone: let its helper process exit."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.close()

    def __call__(self, reactor, address, max_packet, timeout):
        from sbus.client.twisted import connect_socket

        if os.geteuid() != 0:
            return connect_socket(reactor, address, max_packet, timeout)
        d = defer.Deferred()
        deadline = reactor.seconds() + timeout
        text = str(resolve(address))

        def attempt():
            try:
                side = resolve_side(address, self.user)
                try:
                    sock, keeper = connect_as(side, text, max_packet)
                finally:
                    if side.dirfd is not None:
                        os.close(side.dirfd)
            except BlockingIOError:
                if reactor.seconds() < deadline:
                    reactor.callLater(0.01, attempt)
                else:
                    d.errback(TimeoutError(errno.ETIMEDOUT, "connect timed out (backlog full)", text))
                return
            except Exception:
                d.errback()
                return
            self.release()
            self._keeper = keeper
            self.last_why = f"as uid {side.uid} ({side.why})"
            self._watch = _HelperWatch(reactor, keeper, sock, f"{text} as uid {side.uid}")
            d.callback(sock)

        attempt()
        return d
