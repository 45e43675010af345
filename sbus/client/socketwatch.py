"""Reconnect at once when a bus's socket file reappears (inotify), not after the back-off.

A restarted server's socket file appears at ``bind()``: a client that waits for it with
inotify on the file's directory connects within milliseconds, where the back-off alone
(doubling to ``--max-delay``) left a service away for seconds while the new server counted
nothing for it (issue 34: a link came back 5.5 s after a server's ``kill -9``, and 3,650
messages published meanwhile were lost uncounted). First written for the relay (issue 23);
every `sbus.client.twisted.ReconnectingClient` with ``watch=True`` (every service) uses it.
"""

from __future__ import annotations

import os
import stat

__all__ = ["SocketWatch", "WAKE_INTERVAL", "WAKE_WINDOW", "link_refusal", "symlink_refusal"]

#: After the socket file (re)appears, a refused attempt (the file exists from the new
#: master's bind(), before its listen()) is retried this often, seconds ...
WAKE_INTERVAL = 0.05
#: ... for this long; then the back-off resumes, doubling from WAKE_INTERVAL.
WAKE_WINDOW = 5.0


def symlink_refusal(st: os.stat_result) -> str | None:
    """Why a symlink `st` (lstat) must not be followed: one of another uid than ours or root's."""
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, os.geteuid()):
        return f"a symlink of uid {st.st_uid} (neither ours nor root's): refusing to connect through it"
    return None


def link_refusal(path: str) -> str | None:
    """Why a client must not connect through what is at `path` (a symlink of another uid than
    ours or root's), or None. Only the final component is judged, without following it."""
    try:
        return symlink_refusal(os.lstat(path))
    except OSError:
        return None  # nothing there (yet): the connect says so


class SocketWatch:
    """Calls `wake()` when a socket file appears at `path` (created, moved there,
    or its mode changed), by inotify on the file's directory (Linux).

    `arm()` sets the watch. If the directory does not exist (yet), its parent is watched
    for it (``/run/sbus/`` made by the master's service manager, ``/run/user/UID`` made at
    login), and the directory once it appears. If it is removed or renamed later, the same
    again. `changed()` is called whenever the watch changed on its own (the relay logs
    `state`)."""

    def __init__(self, reactor, path: str, wake, changed):
        self.reactor = reactor
        self.path = os.path.abspath(path)
        self.directory, name = os.path.split(self.path)
        self.parent, dirname = os.path.split(self.directory)
        self.name = os.fsencode(name)
        self.dirname = os.fsencode(dirname)
        self.wake = wake
        self.changed = changed
        self.notifier = None
        #: What is watched: "directory", "parent" or None; `state` says it in words.
        self.level: str | None = None
        self.state = "not started"

    def arm(self) -> str | None:
        """Watch (again); None when the socket's directory is watched, else why not (a line)."""
        if self.level == "directory":
            return None
        if self.level == "parent" and not os.path.isdir(self.directory):
            return self.state  # still missing: the parent's watch says when it appears
        self.disarm()
        try:
            from twisted.internet import inotify
            from twisted.python.filepath import FilePath
        except ImportError as e:
            self.state = f"no inotify on this system ({e})"
            return self.state
        gone = inotify.IN_DELETE_SELF | inotify.IN_MOVE_SELF
        appeared = inotify.IN_CREATE | inotify.IN_MOVED_TO
        try:
            notifier = inotify.INotify(self.reactor)
        except (inotify.INotifyError, OSError) as e:
            self.state = f"no inotify instance ({e})"
            return self.state
        try:
            notifier.watch(FilePath(self.directory), mask=appeared | inotify.IN_ATTRIB | gone,
                           callbacks=[self._event])
            self.level, self.state = "directory", f"watching {self.directory} (inotify)"
        except (inotify.INotifyError, OSError):
            try:
                notifier.watch(FilePath(self.parent), mask=appeared | gone, callbacks=[self._parentEvent])
                self.level = "parent"
                self.state = (f"{self.directory} cannot be watched (missing?): watching {self.parent} "
                              f"(inotify) for it")
            except (inotify.INotifyError, OSError):
                notifier.loseConnection()
                self.state = f"cannot watch {self.directory} nor {self.parent} (missing, or not ours to read)"
                return self.state
        # IN_IGNORED comes unasked when the kernel drops a watch (its file system went away)
        self._gone, self._appeared = gone | inotify.IN_IGNORED, appeared | inotify.IN_ATTRIB
        notifier.startReading()
        self.notifier = notifier
        if self.level == "parent" and os.path.isdir(self.directory):
            self.reactor.callLater(0, self._rearm)  # made while the watch was set: no event tells
        return None if self.level == "directory" else self.state

    def disarm(self) -> None:
        notifier, self.notifier, self.level = self.notifier, None, None
        if notifier is not None:
            notifier.loseConnection()

    def _rearm(self) -> None:
        self.disarm()
        self.reactor.callLater(0, self.changed)

    def _event(self, watch, filepath, mask: int) -> None:
        if self.notifier is None or self.level != "directory":
            return  # from a watch given up
        if mask & self._gone:
            self._rearm()  # the directory went away or moved: watch its parent for it
            return
        if mask & self._appeared and filepath.basename() == self.name:
            self.check()

    def _parentEvent(self, watch, filepath, mask: int) -> None:
        if self.notifier is None or self.level != "parent":
            return
        if mask & self._gone or filepath.basename() == self.dirname:
            self._rearm()

    def check(self) -> None:
        """Wake the client if a socket (or a symlink it may follow) is at the path."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return
        if stat.S_ISSOCK(st.st_mode) or (stat.S_ISLNK(st.st_mode) and link_refusal(self.path) is None):
            self.wake()
