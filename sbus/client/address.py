"""Client-side addresses: which bus to talk to, and a socket connected to it.

The forms (the ones ``sbusd -a`` takes, as far as a client can use them):

``PATH``
    A filesystem path to the server's socket file.

``/dev/unix/abstract/HEX``
    An abstract address, as ``sbusd -a /dev/unix/abstract`` prints it: the
    hex of the whole ``sun_path``, leading ``00`` included. The server binds
    all 108 bytes of ``sun_path`` (a short HEX is padded with NULs, as in the
    reference C server), so the client connects with the same 108 bytes.

``/dev/fd/N``
    An already connected ``AF_UNIX``/``SOCK_SEQPACKET`` socket on descriptor
    N (for example handed down by a parent). The client takes it over:
    closing the client closes N.

Which address is used when none is given (`resolve`): ``--socket``, then
``$SBUS_SOCKET``, then ``sbus.socket`` in the working directory.
"""

from __future__ import annotations

import errno
import os
import socket
from typing import NamedTuple

from sbus.core.codec import MAX_PACKET

#: Size of ``sockaddr_un.sun_path`` on Linux.
SUN_PATH_SIZE = 108
ABSTRACT_PREFIX = "/dev/unix/abstract/"
FD_PREFIX = "/dev/fd/"
#: The environment variable consulted when no address is given.
ENV_VAR = "SBUS_SOCKET"
#: The last resort: a socket file in the working directory.
DEFAULT_ADDRESS = "sbus.socket"
_HEX = frozenset("0123456789abcdefABCDEF")
#: Kernel bookkeeping per SEQPACKET packet on top of the payload (DESIGN.md: 32 bytes; keep room).
_SKB_OVERHEAD = 32 * 1024


class AddressError(ValueError):
    """An address that cannot name a bus; ``str()`` is one line."""


class Address(NamedTuple):
    """A parsed client address.

    ``kind`` is ``"path"`` (value: str), ``"abstract"`` (value: the 108-byte
    ``sun_path``) or ``"fd"`` (value: int); ``text`` is what was parsed.
    """

    kind: str
    value: object
    text: str

    def __str__(self) -> str:
        return self.text


def parse(text: str | bytes | os.PathLike) -> Address:
    """Parse an address string; raise `AddressError` for a bad one."""
    if isinstance(text, Address):
        return text
    text = os.fsdecode(os.fspath(text))
    if not text:
        raise AddressError("empty socket address")
    if text.startswith(FD_PREFIX):
        digits = text[len(FD_PREFIX):]
        if digits.isascii() and digits.isdigit():
            return Address("fd", int(digits), text)
    elif text.startswith(ABSTRACT_PREFIX):
        digits = text[len(ABSTRACT_PREFIX):]
        if digits and len(digits) % 2 == 0 and all(c in _HEX for c in digits):
            if len(digits) > 2 * SUN_PATH_SIZE:
                raise AddressError(f"{text}: more than {2 * SUN_PATH_SIZE} hex digits")
            raw = bytes.fromhex(digits)
            if raw[0] != 0:
                raise AddressError(f"{text}: an abstract address starts with 00")
            return Address("abstract", raw.ljust(SUN_PATH_SIZE, b"\0"), text)
    if "\0" in text:
        raise AddressError(f"{text!r}: a path may not contain NUL")
    if len(os.fsencode(text)) >= SUN_PATH_SIZE:
        raise AddressError(f"{text}: path too long for a unix socket (max {SUN_PATH_SIZE - 1} bytes)")
    return Address("path", text, text)


def resolve(address: str | bytes | os.PathLike | Address | None = None, environ=None) -> Address:
    """The address to use: `address` if given, else ``$SBUS_SOCKET``, else ``sbus.socket``."""
    if address is None or address == "":
        env = os.environ if environ is None else environ
        address = env.get(ENV_VAR) or DEFAULT_ADDRESS
    return parse(address)


def size_buffers(sock: socket.socket, max_packet: int = MAX_PACKET) -> None:
    """Raise SO_SNDBUF/SO_RCVBUF so a `max_packet`-byte packet can be sent and received.

    The kernel refuses a SEQPACKET packet bigger than SO_SNDBUF - 32 bytes
    (about 212 kB by default) with EMSGSIZE.
    """
    want = max_packet + _SKB_OVERHEAD
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            if sock.getsockopt(socket.SOL_SOCKET, opt) < want:
                sock.setsockopt(socket.SOL_SOCKET, opt, want)
        except OSError:
            pass


def _adopt_fd(addr: Address) -> socket.socket:
    fd = addr.value
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        if e.errno == errno.ENOTSOCK:
            raise OSError(errno.ENOTSOCK, f"{addr.text}: not a socket") from None
        raise
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
        sock.detach()
        raise OSError(errno.EPROTOTYPE, f"{addr.text}: not a unix SOCK_SEQPACKET socket")
    try:
        sock.getpeername()
    except OSError:
        sock.detach()
        raise OSError(errno.ENOTCONN, f"{addr.text}: socket is not connected") from None
    return sock


def open_socket(address=None, *, max_packet: int = MAX_PACKET, blocking: bool = True) -> socket.socket:
    """Return a ``SOCK_SEQPACKET`` socket connected to the bus at `address`.

    Connection failures raise the usual `OSError` subclasses
    (`FileNotFoundError`, `ConnectionRefusedError`, `PermissionError`, ...)
    with ``filename`` set to the address text. With ``blocking=False`` the
    connect itself does not wait either: a server whose listen backlog is
    full gives `BlockingIOError` (try again later) instead of a wait.
    """
    addr = resolve(address)
    if addr.kind == "fd":
        sock = _adopt_fd(addr)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.setblocking(blocking)
        try:
            sock.connect(addr.value)
        except OSError as e:
            sock.close()
            if e.errno is not None:
                raise type(e)(e.errno, e.strerror or os.strerror(e.errno), addr.text) from None
            raise
    size_buffers(sock, max_packet)
    sock.setblocking(blocking)
    return sock
