"""The kernel's answers a service's admission needs (the rule itself: `sbus.services.admission`).

* `could_connect(path, uid, gids)`: could a process of that uid and those groups
  ``connect()`` to the unix socket at `path`: root, or search (``x``) permission on every
  directory of the path (symlinks followed as the kernel does) and write permission on the
  socket file. `may_connect(uid, path)` is the same with the uid's groups from the user
  database. Modes only; ACLs are not read.
* `peer_credentials(transport)`: (pid, uid, gid) of whoever is at the other end of a
  connection we accepted: ``SO_PEERCRED`` on a unix socket; for a TCP connection whose peer
  is on this host (loopback, or one of our own addresses) the uid owning the peer's socket
  (an exact ``sock_diag`` lookup, else ``/proc/net/tcp`` and ``tcp6``); uid None when it
  cannot be known (a remote host).
* `BusAccess`: the bus's socket file (path, mode, owner), and `BusAccess.wider(mode)`: the
  bits of a socket we would serve that let in someone who could not open the bus (judged on
  the whole path). That is the second fence, never the decision: the relay refuses to start
  with such a ``--mode``; the endpoints below drop them.
* `server_endpoint(...)`: a Twisted server endpoint from a description; a ``unix:`` one is
  created with the bus socket's mode (never wider, whatever ``mode=`` says, nor wider than the
  path to the bus lets in) under a restrictive umask (no window where it is 0666), and given
  to the bus socket's owner when we run as root; ``unix:/dev/unix/abstract/HEX`` binds that
  abstract name and ``unix:/dev/fd/N`` adopts an inherited listening socket (admission alone
  guards those: they have no mode); TCP and SSL get the service's default ``backlog=`` unless
  the description names one.
"""

from __future__ import annotations

import grp
import ipaddress
import os
import pwd
import socket
import stat
import struct

from twisted.internet import defer
from twisted.logger import Logger

from sbus.address import AddressError

log = Logger(namespace="sbus.access")

SO_PEERCRED = getattr(socket, "SO_PEERCRED", 17)


# ---------------------------------------------------------------- who could open the bus


def user_groups(uid: int) -> set[int]:
    """The uid's primary and supplementary gids, from the user database (empty if unknown)."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return set()
    gids = {pw.pw_gid}
    try:
        gids.update(os.getgrouplist(pw.pw_name, pw.pw_gid))
    except OSError:
        gids.update(g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem)
    return gids


def _permits(st: os.stat_result, uid: int, gids: set[int], bit: int) -> bool:
    """Would the permission `bit` (4 r, 2 w, 1 x) be granted to uid/gids by these mode bits?"""
    mode = st.st_mode
    if st.st_uid == uid:
        return bool(mode & (bit << 6))
    if st.st_gid in gids:
        return bool(mode & (bit << 3))
    return bool(mode & bit)


def _walk(path: str, uid: int, gids: set[int], hops: int = 40) -> str | None:
    """Resolve `path` as the kernel's path walk would for uid: the physical path, or None
    where uid lacks search permission on a directory it must look a name up in.

    Symlinks are followed one component at a time, so the directories of every
    symlink's target are checked too (a path through a symlink into a 0700
    directory is refused, as the kernel refuses it)."""
    parts = [p for p in path.split("/") if p]
    parts.reverse()                      # a stack: the next component last
    cur = "/"
    while parts:
        name = parts.pop()
        if name == ".":
            continue
        if not _permits(os.stat(cur), uid, gids, 1):
            return None
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, name)
        if stat.S_ISLNK(os.lstat(nxt).st_mode):
            hops -= 1
            if hops < 0:
                return None
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur = "/"
            parts.extend(reversed([p for p in target.split("/") if p]))
            continue
        cur = nxt
    return cur


def may_connect(uid: int, path: str) -> bool:
    """Could `uid` connect() to the unix socket at `path` (mode bits; ACLs are not read)?"""
    return could_connect(path, uid, user_groups(uid))


def could_connect(path: str, uid: int, gids: set[int]) -> bool:
    """Could a process of `uid` with exactly the groups `gids` connect() to the socket at `path`?"""
    if uid == 0:
        return True
    try:
        real = _walk(os.path.abspath(path), uid, gids)
        if real is None:
            return False
        st = os.stat(real)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and _permits(st, uid, gids, 2)


#: A uid no file belongs to: what the mode bits give "anyone else".
_NOBODY_IN_PARTICULAR = -1


class BusAccess:
    """The bus at `address`: its socket file, and the fence for sockets we serve (module text)."""

    def __init__(self, address):
        from sbus.client.address import resolve

        self.path = None
        try:
            addr = resolve(address)  # None: $SBUS_SOCKET, else /run/sbus.socket, as clients do
        except AddressError:
            addr = None
        self.text = str(addr) if addr is not None else ""
        if addr is not None and addr.kind == "path":
            self.path = os.path.abspath(addr.value)  # twistd may chdir later
        self.own_uid = os.getuid()

    def socket_mode(self) -> tuple[int, int | None, int | None]:
        """(permission bits, owner uid, group gid) of the bus socket; 0600 and None for no file."""
        if self.path is not None:
            try:
                st = os.stat(self.path)
                return stat.S_IMODE(st.st_mode) & 0o777, st.st_uid, st.st_gid
            except OSError:
                pass
        return 0o600, None, None

    def wider(self, mode: int, gid: int | None = None) -> tuple[int, str | None]:
        """The connect bits of a unix socket of `mode` and group `gid` (our own by default),
        created by this process, that would let in a uid that could not open the bus, and why
        (``(0, None)``: none). The one rule for every socket a service serves: the relay's,
        the gateway's and the link's ``unix:`` sockets. Only write bits count (``connect``)."""
        gid = os.getegid() if gid is None else gid
        bits = 0
        why = []
        if mode & 0o002 and not self._admits(set()):
            bits |= 0o007
            why.append("every local user")
        if mode & 0o020 and not self._admits({gid}):
            bits |= 0o070
            why.append(f"group {gid}")
        if not bits:
            return 0, None
        return bits, (f"mode {mode:04o} would let {' and '.join(why)} connect, who could not open "
                      f"the bus: {self.describe()}")

    def _admits(self, gids: set[int]) -> bool:
        """Could any uid with exactly these groups (owning nothing) open the bus?"""
        return self.path is not None and could_connect(self.path, _NOBODY_IN_PARTICULAR, gids)

    def describe(self) -> str:
        if self.path is None:
            return "the service's own uid and root (the bus address has no file mode)"
        mode, uid, gid = self.socket_mode()
        return f"uids that could open {self.path} (mode {mode:04o}, owner uid {uid}, gid {gid})"


# ---------------------------------------------------------------- who is at the other end


def unix_peer_cred(sock: socket.socket) -> tuple[int | None, int | None, int | None]:
    """(pid, uid, gid) of a unix socket's peer, from SO_PEERCRED (all None if unreadable)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None, None, None
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    addr = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _proc_addr(field: str):
    """Decode ``HEX:PORT`` of /proc/net/tcp(6) (32-bit words in host order) into (ip, port)."""
    hexaddr, hexport = field.split(":")
    raw = b"".join(struct.pack("=I", int(hexaddr[i:i + 8], 16)) for i in range(0, len(hexaddr), 8))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr, int(hexport, 16)


NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF


def _diag_lookup(family: int, src: bytes, sport: int, dst: bytes, dport: int) -> int | None:
    """The uid of the TCP socket src:sport -> dst:dport, by an exact sock_diag query (no dump)."""
    pad = lambda a: a + b"\0" * (16 - len(a))  # noqa: E731
    sockid = (struct.pack("!HH", sport, dport) + pad(src) + pad(dst)
              + struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    hdr = struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, 1, 1, 0)  # NLM_F_REQUEST
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(hdr + req, (0, 0))
        data = nl.recv(65536)
    length, kind = struct.unpack_from("=IH", data)
    if kind == NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", data, 16)
        if err == 0:
            return None
        raise OSError(-err, os.strerror(-err))
    if kind != SOCK_DIAG_BY_FAMILY or length < 16 + 72:
        return None
    (uid,) = struct.unpack_from("=I", data, 16 + 64)
    return uid


def _proc_scan(peer, ours, tables) -> int | None:
    """The same answer from /proc/net/tcp and tcp6 (slower: a table scan)."""
    for table in tables:
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) < 8:
                        continue
                    try:
                        if _proc_addr(fields[1]) == peer and _proc_addr(fields[2]) == ours:
                            return int(fields[7])
                    except ValueError:
                        continue
        except OSError:
            continue
    return None


def tcp_owner_uid(peer_host: str, peer_port: int, our_host: str, our_port: int,
                  tables=("/proc/net/tcp", "/proc/net/tcp6")) -> int | None:
    """The uid owning the socket at peer_host:peer_port connected to our_host:our_port, if local.

    The peer's socket exists on this host only if the peer is on this host;
    a remote peer gives None. Asked of the kernel by an exact ``sock_diag``
    lookup (what ``ss`` uses; one socket, no table dump), else by scanning
    ``/proc/net/tcp`` and ``tcp6``.
    """
    peer = (_ip(peer_host), peer_port)
    ours = (_ip(our_host), our_port)
    try:
        if peer[0].version == 4 and ours[0].version == 4:
            uid = _diag_lookup(socket.AF_INET, peer[0].packed, peer_port, ours[0].packed, our_port)
            if uid is not None:
                return uid
            # a client on an IPv6 socket reaching our IPv4 address, as ::ffff:a.b.c.d
            mapped = lambda a: ipaddress.IPv6Address("::ffff:" + str(a)).packed  # noqa: E731
            return _diag_lookup(socket.AF_INET6, mapped(peer[0]), peer_port, mapped(ours[0]), our_port)
        if peer[0].version == 6 and ours[0].version == 6:
            return _diag_lookup(socket.AF_INET6, peer[0].packed, peer_port, ours[0].packed, our_port)
        return None
    except OSError:
        return _proc_scan(peer, ours, tables)


def peer_credentials(transport) -> tuple[int | None, int | None, int | None, str]:
    """(pid, uid, gid, how) of the peer of a connected Twisted transport; uid None if unknown
    (remote); pid and gid None where only the uid can be known (TCP)."""
    handle = getattr(transport, "getHandle", None)
    sock = handle() if handle is not None else None
    # TLS transports wrap the TCP one
    inner = getattr(transport, "transport", None)
    if not isinstance(sock, socket.socket) and inner is not None and hasattr(inner, "getHandle"):
        sock = inner.getHandle()
    if not isinstance(sock, socket.socket):
        return None, None, None, "no socket"
    if sock.family == socket.AF_UNIX:
        return (*unix_peer_cred(sock), "SO_PEERCRED")
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            peer = sock.getpeername()
            ours = sock.getsockname()
        except OSError:
            return None, None, None, "not connected"
        return None, tcp_owner_uid(peer[0], peer[1], ours[0], ours[1]), None, "sock_diag"
    return None, None, None, f"address family {sock.family}"


# ---------------------------------------------------------------- sockets we create


def _split_description(description: str) -> tuple[list, dict]:
    """A Twisted endpoint description (``tcp:host=h:port=1``) as (positional, keyword) parts:
    split on ``:``, a part with ``=`` is ``key=value``, ``\\`` escapes the next character (the
    grammar of `twisted.internet.endpoints.clientFromString`, which has no public parser)."""
    parts, part, escaped, equals = [], [], False, None
    for ch in description:
        if escaped:
            part.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == ":":
            parts.append(("".join(part), equals))
            part, equals = [], None
        else:
            if ch == "=" and equals is None:
                equals = len(part)
            part.append(ch)
    parts.append(("".join(part), equals))
    args, kw = [], {}
    for text, equals in parts:
        if equals is None:
            args.append(text)
        else:
            kw[text[:equals]] = text[equals + 1:]
    return args, kw


def endpoint_kind(description: str) -> tuple[str, list, dict]:
    args, kw = _split_description(description)
    if not args or not args[0]:
        raise ValueError(f"endpoint {description!r} has no type (tcp:, ssl:, unix:, ...)")
    return args[0].lower(), list(args[1:]), dict(kw)


class PrivateUNIXServerEndpoint:
    """A ``unix:`` server endpoint whose socket gets the bus socket's mode and owner."""

    def __init__(self, reactor, path: str, access: BusAccess, mode: int | None = None,
                 backlog: int = 50, lockfile: bool = True):
        self.reactor = reactor
        self.path = path
        self.access = access
        self.mode = mode
        self.backlog = backlog
        self.lockfile = lockfile

    def listen(self, factory):
        from sbus.server.address import clear_path

        bus_mode, owner, group = self.access.socket_mode()
        mode = bus_mode if self.mode is None else (self.mode & bus_mode)
        try:
            # as the bus server does: a socket nobody answers on (its service was killed) is
            # removed with one log line; a live one, or any other file, is an error
            clear_path(self.path, False, lambda text: log.warn("{text}", text=text))
        except Exception:
            return defer.fail()
        give_away = os.getuid() == 0 and owner is not None and owner != 0
        mode &= ~self.access.wider(mode, group if give_away and group is not None else None)[0]
        old = os.umask(0o777 & ~mode)
        try:
            port = self.reactor.listenUNIX(self.path, factory, backlog=self.backlog, mode=mode,
                                           wantPID=self.lockfile)
        except Exception:
            return defer.fail()
        finally:
            os.umask(old)
        if give_away:
            try:
                os.lchown(self.path, owner, group if group is not None else -1)
            except OSError as e:
                log.warn("could not give {path} to uid {uid}: {err}", path=self.path, uid=owner, err=e)
        return defer.succeed(port)


class ModelessUNIXServerEndpoint:
    """A ``unix:`` stream endpoint with no socket file: an abstract name
    (``/dev/unix/abstract/HEX``, bound) or an inherited listening socket (``/dev/fd/N``,
    adopted). Nothing but the admission rule guards it: it has no mode."""

    def __init__(self, reactor, address: str, backlog: int = 50):
        from sbus.client.address import parse

        self.reactor = reactor
        self.addr = parse(address)  # AddressError: one line
        self.backlog = backlog

    def listen(self, factory):
        import errno

        try:
            if self.addr.kind == "fd":
                sock = socket.socket(fileno=os.dup(self.addr.value))
                try:
                    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                        raise OSError(errno.ENOTSOCK,
                                      f"/dev/fd/{self.addr.value} is not a unix stream socket")
                    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                        sock.listen(self.backlog)
                    sock.setblocking(False)  # Twisted accepts until EAGAIN
                    return defer.succeed(self.reactor.adoptStreamPort(sock.fileno(), socket.AF_UNIX, factory))
                finally:
                    sock.close()  # adoptStreamPort took a copy
            return defer.succeed(self.reactor.listenUNIX(self.addr.value, factory, backlog=self.backlog))
        except Exception:
            return defer.fail()


def server_endpoint(reactor, description: str, access: BusAccess, default_backlog: int | None = None):
    """`serverFromString`, but ``unix:`` takes the bus's mode and TCP/SSL a default backlog."""
    kind, args, kw = endpoint_kind(description)
    if kind == "unix":
        names = ["address", "mode", "backlog", "lockfile"]
        for name, value in zip(names, args):
            kw.setdefault(name, value)
        unknown = set(kw) - set(names)
        if unknown:
            raise ValueError(f"unix: does not take {', '.join(sorted(unknown))}")
        if "address" not in kw:
            raise ValueError("unix: needs a path")
        mode = int(kw["mode"], 8) if "mode" in kw else None
        backlog = int(kw.get("backlog", default_backlog or 50))
        lockfile = bool(int(kw.get("lockfile", 1)))
        if kw["address"].startswith(("/dev/unix/abstract/", "/dev/fd/")):
            return ModelessUNIXServerEndpoint(reactor, kw["address"], backlog)
        return PrivateUNIXServerEndpoint(reactor, kw["address"], access, mode, backlog, lockfile)
    if default_backlog is not None and kind in ("tcp", "tcp6", "ssl") \
            and "backlog" not in kw and len(args) < (3 if kind != "ssl" else 6):
        description = f"{description}:backlog={default_backlog}"
    # imported here, not at start: importing it takes systemd's LISTEN_FDS out of the
    # environment (Twisted's systemd: parser), before a relay on ``systemd`` took its socket
    from twisted.internet import endpoints

    return endpoints.serverFromString(reactor, description)
