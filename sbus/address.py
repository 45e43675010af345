"""Addresses and socket set-up shared by the server, its services and the clients.

No Twisted here. The address forms are the reference C server's:

* a filesystem path;
* ``/dev/unix/abstract`` (server only: bind a random abstract address);
* ``/dev/unix/abstract/HEX`` (the hex of the whole 108-byte ``sun_path``,
  leading ``00`` included; shorter forms are padded with NULs, as C binds all
  108 bytes);
* ``/dev/fd/N`` (an inherited socket);
* ``systemd`` (server only: socket activation).
"""

from __future__ import annotations

import os
import socket
import struct
from typing import NamedTuple

from sbus.core.credentials import Credentials

#: Size of ``sockaddr_un.sun_path`` on Linux.
SUN_PATH_SIZE = 108
ABSTRACT = "/dev/unix/abstract"
ABSTRACT_PREFIX = ABSTRACT + "/"
FD_PREFIX = "/dev/fd/"
SYSTEMD = "systemd"
#: First fd systemd passes (SD_LISTEN_FDS_START).
SD_LISTEN_FDS_START = 3
_INT_MAX = 2**31 - 1
_HEX = frozenset("0123456789abcdefABCDEF")


#: The environment variable that names the bus: for the servers (``sbusd``, ``twistd sbus``) where
#: to listen, for clients and services where to connect, when no address is given.
ENV_VAR = "SBUS_SOCKET"
#: Without one and without ``$SBUS_SOCKET``: the reference server's default, for both sides.
DEFAULT_ADDRESS = "/run/sbus.socket"


def default_address(environ=None) -> str:
    """The bus when no address is given: ``$SBUS_SOCKET``, else ``/run/sbus.socket``."""
    env = os.environ if environ is None else environ
    return env.get(ENV_VAR) or DEFAULT_ADDRESS


class AddressError(ValueError):
    """A bad address or a socket that cannot be opened; ``str()`` is one line."""


# --- parsing ------------------------------------------------------------------


class Address(NamedTuple):
    """A parsed address. ``kind`` is one of ``path``, ``abstract``, ``random``, ``fd``, ``systemd``."""

    kind: str
    #: path: str; abstract: 108 bytes (leading NUL); fd: int; random/systemd: None.
    value: object
    text: str

    def __str__(self) -> str:
        return self.text


def abstract_text(sun_path: bytes) -> str:
    """The printable form of an abstract address: ``/dev/unix/abstract/<hex>``."""
    return ABSTRACT_PREFIX + sun_path.hex()


def parse_address(text: str) -> Address:
    """Parse one of the forms above; raise `AddressError` for a bad one."""
    if not isinstance(text, str):
        text = os.fsdecode(text)
    if text.startswith(FD_PREFIX):
        digits = text[len(FD_PREFIX):]
        if digits.isascii() and digits.isdigit():
            n = int(digits)
            if n > _INT_MAX:
                raise AddressError(f"bad unix socket address {text}: Bad file descriptor")
            return Address("fd", n, text)
    elif text == ABSTRACT:
        return Address("random", None, text)
    elif text.startswith(ABSTRACT_PREFIX):
        digits = text[len(ABSTRACT_PREFIX):]
        if digits and len(digits) % 2 == 0 and all(c in _HEX for c in digits):
            if len(digits) > 2 * SUN_PATH_SIZE:
                raise AddressError(
                    f"bad unix socket address {text}: more than {2 * SUN_PATH_SIZE} hex digits"
                )
            raw = bytes.fromhex(digits).ljust(SUN_PATH_SIZE, b"\0")
            if raw[0] != 0:
                raise AddressError(
                    f"bad unix socket address {text}: an abstract address starts with 00"
                )
            return Address("abstract", raw, text)
    elif text == SYSTEMD:
        return Address("systemd", None, text)
    if not text:
        raise AddressError("bad unix socket address: empty")
    if len(os.fsencode(text)) >= SUN_PATH_SIZE:
        raise AddressError(f"bad unix socket address {text}: File name too long")
    if "\0" in text:
        raise AddressError(f"bad unix socket address {text!r}: contains a NUL")
    return Address("path", text, text)


def sockaddr(text: str) -> str | bytes:
    """What a client passes to ``connect()`` for a path or an abstract address."""
    addr = parse_address(text)
    if addr.kind in ("path", "abstract"):
        return addr.value  # type: ignore[return-value]
    raise AddressError(f"{text}: not an address a client can connect to")


#: Kernel bookkeeping per SEQPACKET packet on top of the payload (about 32 bytes; keep room).
_SKB_OVERHEAD = 32 * 1024
_UCRED = struct.Struct("3i")


_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def size_buffers(sock: socket.socket, max_packet: int) -> None:
    """Let a packet of `max_packet` bytes be sent and received on `sock`.

    The kernel refuses a SEQPACKET packet bigger than SO_SNDBUF - 32 bytes
    (about 212 kB by default) with EMSGSIZE. SO_SNDBUF is capped by
    net.core.wmem_max (the kernel doubles the value asked for); a process with
    CAP_NET_ADMIN passes the cap with SO_SNDBUFFORCE, others cannot: see
    `packet_limit_problem`.
    """
    want = max_packet + _SKB_OVERHEAD
    for opt, force in ((socket.SO_SNDBUF, _SO_SNDBUFFORCE), (socket.SO_RCVBUF, _SO_RCVBUFFORCE)):
        try:
            if sock.getsockopt(socket.SOL_SOCKET, opt) < want:
                sock.setsockopt(socket.SOL_SOCKET, opt, want)
                if sock.getsockopt(socket.SOL_SOCKET, opt) < want:
                    sock.setsockopt(socket.SOL_SOCKET, force, want)
        except OSError:
            pass


def _sysctl(name: str) -> str:
    try:
        with open("/proc/sys/" + name.replace(".", "/")) as f:
            return f.read().strip()
    except OSError:
        return "?"


def _can_send(size: int, max_packet: int) -> OSError | None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        size_buffers(a, max_packet)
        size_buffers(b, max_packet)
        a.setblocking(False)
        try:
            a.send(bytes(size))
        except OSError as e:
            return e
        return None
    finally:
        a.close()
        b.close()


def packet_limit_problem(max_packet: int) -> str | None:
    """None if this process can send a `max_packet`-byte packet on a SEQPACKET socket sized
    by `size_buffers`; else one line saying why not and what to do. Tried for real, at start:
    a server that cannot would fail to forward big packets (EMSGSIZE, ENOBUFS)."""
    err = _can_send(max_packet, max_packet)
    if err is None:
        return None
    lo, hi = 0, max_packet  # the largest size that goes: a few sends, once, on failure only
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _can_send(mid, max_packet) is None:
            lo = mid
        else:
            hi = mid
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        size_buffers(probe, max_packet)
        sndbuf = probe.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    finally:
        probe.close()
    if sndbuf < max_packet + 32:
        why = (f"SO_SNDBUF stops at {sndbuf}: net.core.wmem_max is {_sysctl('net.core.wmem_max')} "
               f"and only CAP_NET_ADMIN passes it")
    else:
        why = "the kernel cannot allocate one packet that big"
    return f"packet size limit {max_packet} is more than this kernel sends ({err.strerror}; {why}); " \
           f"the largest that works here is {lo}"


def peer_credentials(sock: socket.socket) -> Credentials:
    """The connecting process's (pid, uid, gid), from SO_PEERCRED."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return Credentials(pid, uid, gid)
