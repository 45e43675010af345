"""Log and pid files take the bus's mode (issue 16): the one helper every service uses.

A server's log names every client's pid and uid, a service's log its peers and keys: on a
private (0700) bus it must be private too. The rule, for ``sbusd -l``, ``twistd --logfile``
(its rotated files included) and ``twist --log-file``, whichever plugin runs:

* the file's mode is the bus socket's read bits for group and others, never write, and
  always 0600 for the owner: a 0700 bus gives 0600, 0750 gives 0640, 0777 gives 0644;
* a new file is created ``O_EXCL | O_NOFOLLOW`` with mode 0600 and only then widened
  (``fchmod``) to that mode: there is no moment where it is readable by more;
* an existing file must be ours (owner = our euid) and a symlink is followed only if we or
  root own it, else one error line (a planted file or link in a shared directory);
* an existing file that is wider than the bus allows is replaced by a fresh private inode
  holding the same bytes (renamed over it): whoever opened the old, readable one keeps only
  what it already had, not what we write next. ``twist`` opens its ``--log-file`` before any
  plugin code runs (under the umask), so this is what closes that window.

twistd's ``LogFile`` takes an existing file's mode as the mode of the files it creates when
it rotates, so preparing the file before twistd opens it covers the rotated files too.
The pid file (``twistd --pidfile``) is created here ``O_EXCL | O_NOFOLLOW``, 0644 at most,
holding our pid (twistd rewrites it with the daemon's pid); ``sbusd -p`` does the same itself.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import sys

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class LogFileError(Exception):
    """A log or pid file we must not or cannot use; ``str()`` is the one line to show."""


def file_mode(bus_mode: int) -> int:
    """The mode of a log file of a bus whose socket has `bus_mode`: 0700 -> 0600, 0777 -> 0644."""
    return 0o600 | (bus_mode & 0o044)


def _wider(st_mode: int, mode: int) -> bool:
    return bool(stat.S_IMODE(st_mode) & ~mode)


def _resolve(path: str) -> str:
    """`path` itself, or where a symlink that we (or root) own points."""
    path = os.path.abspath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as e:
        raise LogFileError(f"log file {path}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (os.geteuid(), 0):
            raise LogFileError(f"log file {path} is a symlink owned by uid {st.st_uid}: not following it")
        return os.path.realpath(path)
    return path


def _fresh_copy(path: str, mode: int) -> int | None:
    """Put a new 0600 inode with `path`'s bytes in its place; its fd, or None if the directory
    does not let us (then the caller narrows the old file in place)."""
    directory, base = os.path.split(path)
    try:
        for _ in range(64):
            tmp = os.path.join(directory, f".{base}.{secrets.token_hex(6)}")
            try:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
                break
            except FileExistsError:
                continue
        else:
            return None
    except OSError:
        return None
    try:
        old = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        # buffered: a short write (a filling disk) is finished or raises, never a copy cut short
        with open(old, "rb") as src, open(fd, "wb", closefd=False) as dst:
            shutil.copyfileobj(src, dst)
        os.fchmod(fd, mode)
        os.rename(tmp, path)
    except OSError:
        os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return None
    return fd


def prepare(path: str, mode: int) -> tuple[str, int | None]:
    """Make `path` a file of ours of at most `mode` (see the module text) before it is opened.

    Returns (the path to open, an fd open on a fresh inode if the old one was replaced, else
    None). Not a regular file (``/dev/null``, a fifo, a terminal): left alone."""
    path = _resolve(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    except FileExistsError:
        pass
    except OSError as e:
        raise LogFileError(f"open {path}: {e.strerror}") from None
    else:
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        return path, None
    try:
        st = os.lstat(path)
    except OSError as e:
        raise LogFileError(f"log file {path}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):  # replaced under us between _resolve and here
        raise LogFileError(f"log file {path} is a symlink: not following it")
    if not stat.S_ISREG(st.st_mode):
        return path, None
    if st.st_uid != os.geteuid():
        raise LogFileError(f"log file {path} belongs to uid {st.st_uid}, not to us: not writing our log into it")
    if not _wider(st.st_mode, mode):
        return path, None
    fd = _fresh_copy(path, mode)
    if fd is None:
        try:
            os.chmod(path, stat.S_IMODE(st.st_mode) & mode, follow_symlinks=False)
        except (OSError, NotImplementedError):
            os.chmod(path, stat.S_IMODE(st.st_mode) & mode)
    return path, fd


def open_append(path: str, bus_mode: int):
    """`sbusd -l`: the log file as a line-buffered text stream, prepared as above."""
    mode = file_mode(bus_mode)
    path, fd = prepare(path, mode)
    if fd is None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o600)
        except OSError as e:
            raise LogFileError(f"open {path}: {e.strerror}") from None
    else:
        os.lseek(fd, 0, os.SEEK_END)
    return os.fdopen(fd, "a", buffering=1, encoding="utf-8", errors="backslashreplace")


def _rotated(path: str, mode: int) -> None:
    """Old rotated files (PATH.1, PATH.2, ...) of ours that are wider: narrowed in place."""
    directory, base = os.path.split(path)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(base + ".") and name[len(base) + 1:].isdigit():
            full = os.path.join(directory, name)
            try:
                st = os.lstat(full)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and _wider(st.st_mode, mode):
                    os.chmod(full, stat.S_IMODE(st.st_mode) & mode)
            except OSError:
                pass


# --- twistd / twist plugins -----------------------------------------------------------------


def bus_mode(options) -> int:
    """The mode of the bus socket a plugin serves: ``--mode`` for a server (sbus, sbus-relay);
    else the socket file of ``--bus`` (a bridge: of both ``--a`` and ``--b``, what both allow).
    An abstract address or one with no socket file yet: 0700 (the log is 0600)."""
    if "socket" in options and isinstance(options.get("mode"), int):
        return options["mode"] & 0o777
    from sbus.services.access import BusAccess

    modes = [BusAccess(options[key]).socket_mode()[0] for key in ("bus", "a", "b")
             if key in options and isinstance(options[key], (str, type(None)))]
    result = 0o777
    for m in modes or [0o700]:
        result &= m
    return result


def _twistd_logfile(parent) -> str | None:
    """The file twistd will log into (as `UnixAppLogger` decides), or None."""
    if parent.get("syslog"):
        return None
    name = parent.get("logfile")
    if name == "-" or (parent.get("nodaemon") and not name):
        return None
    return name or "twistd.log"


def take_bus_mode(options) -> None:
    """Called with a plugin's options before its service is made (`SbusServiceMaker`), so
    before twistd opens its log file: prepare it (raises `LogFileError`)."""
    parent = getattr(options, "parent", None)
    if parent is None:
        return
    mode = file_mode(bus_mode(options))
    if "logFile" in parent:  # `twist`: the file is open already, under the umask
        opened = parent["logFile"]
        if opened in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            return
        name = getattr(opened, "name", None)
        try:
            if not isinstance(name, str) or not stat.S_ISREG(os.fstat(opened.fileno()).st_mode):
                return
        except (OSError, ValueError, AttributeError):
            return
        _path, fd = prepare(name, mode)
        if fd is not None:
            os.lseek(fd, 0, os.SEEK_END)
            parent["logFile"] = os.fdopen(fd, "a")
            opened.close()
        return
    logfile = _twistd_logfile(parent)
    if logfile:
        path, fd = prepare(logfile, mode)
        if fd is not None:
            os.close(fd)
        _rotated(path, mode)


def take_pidfile(options) -> None:
    """Once the service is made: twistd's ``--pidfile`` (see `create_pidfile`)."""
    parent = getattr(options, "parent", None)
    pidfile = parent.get("pidfile") if parent is not None and "logFile" not in parent else None
    if pidfile:
        create_pidfile(pidfile)


def create_pidfile(path: str) -> None:
    """twistd has checked (and removed a stale) `path`; twistd then opens it following
    symlinks and under the umask: create it first, ``O_EXCL | O_NOFOLLOW``, 0644 at most."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
    except OSError as e:
        raise LogFileError(f"pid file: open {path} O_CREAT O_EXCL: {e.strerror}") from None
    try:
        os.write(fd, b"%d" % os.getpid())
    finally:
        os.close(fd)
