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
``$SBUS_SOCKET``, then ``/run/sbus.socket``: the same as the server (``sbusd``,
``twistd sbus``) listens on when it is given none.
"""

from __future__ import annotations

import errno
import os
import socket

from sbus.address import (  # noqa: F401  (re-exported for clients)
    ABSTRACT_PREFIX,
    DEFAULT_ADDRESS,
    ENV_VAR,
    default_address,
    FD_PREFIX,
    SUN_PATH_SIZE,
    Address,
    AddressError,
    parse_address,
    size_buffers,
)
from sbus.core.codec import MAX_PACKET



def parse(text: str | bytes | os.PathLike) -> Address:
    """Parse an address a client can connect to; raise `AddressError` for a bad one."""
    if isinstance(text, Address):
        return text
    addr = parse_address(os.fsdecode(os.fspath(text)))
    if addr.kind in ("random", "systemd"):
        raise AddressError(f"{addr.text}: a server-side address; clients connect to a path, "
                           "/dev/unix/abstract/HEX or /dev/fd/N")
    return addr


def resolve(address: str | bytes | os.PathLike | Address | None = None, environ=None) -> Address:
    """The address to use: `address` if given, else ``$SBUS_SOCKET``, else ``/run/sbus.socket``."""
    if address is None or address == "":
        address = default_address(environ)
    return parse(address)


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
