"""Link authentication by a shared key: HMAC challenge-response, both ways (sans-I/O).

A link on plain TCP (loopback included) or on TLS that verifies no client
certificate must prove, at the start of every connection, that both ends
hold the same secret key: a file readable only by its owner (``--key-file``;
`load_key` refuses a file that a group or others may read or write, or that
belongs to someone else than the process's user or root).

The exchange, before anything else is accepted on the connection (any other
frame, or a wrong proof, closes it):

1. each side sends ``CMSG link/auth\\0<role> <nonce>``: its role (``listen``
   or ``connect``) and 32 fresh random bytes in hex;
2. on the peer's ``auth``, each side sends ``CMSG link/proof\\0<hex mac>``,
   ``HMAC-SHA256(key, "sbus-link-auth-v1" NUL own role NUL peer nonce NUL
   own nonce)``;
3. each side checks the peer's proof with `hmac.compare_digest` against the
   same computation from the peer's side. Then, and only then, it sends its
   ``link/hello``, and the link may carry messages.

The role in the MAC stops reflection (sending a side's own challenge back to
it), a peer announcing our own role is refused, and fresh nonces on both
sides stop replay of an earlier connection. The key is never sent. This
authenticates; it does not encrypt (use ``ssl:`` for that off the host).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

AUTH = b"link/auth"
PROOF = b"link/proof"
ROLES = (b"listen", b"connect")
_LABEL = b"sbus-link-auth-v1"
MIN_KEY_BYTES = 16


class AuthError(Exception):
    """Authentication failed or the key file is unusable; `str()` is one line."""


def load_key(path: str) -> bytes:
    """The key in `path` (surrounding whitespace stripped), if only its owner may read it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise AuthError(f"--key-file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AuthError(f"--key-file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise AuthError(f"--key-file {path}: mode {stat.S_IMODE(st.st_mode):04o} lets others read "
                            f"or change it; chmod 600 it")
        if st.st_uid not in (os.getuid(), 0):
            raise AuthError(f"--key-file {path}: owned by uid {st.st_uid}, not by this user or root")
        key = os.read(fd, 65536).strip()
    finally:
        os.close(fd)
    if len(key) < MIN_KEY_BYTES:
        raise AuthError(f"--key-file {path}: under {MIN_KEY_BYTES} bytes; make one with "
                        f"'head -c 32 /dev/urandom | base64 > FILE'")
    return key


def _mac(key: bytes, role: bytes, their_nonce: bytes, our_nonce: bytes) -> bytes:
    return hmac.new(key, b"\0".join((_LABEL, role, their_nonce, our_nonce)), hashlib.sha256).hexdigest().encode()


class Handshake:
    """One side's state: `opening()` to send first, then `receive(key, payload)` per frame.

    `receive` returns the frames to send and raises `AuthError` on any
    failure; `done` is True once the peer proved it holds the key.
    """

    def __init__(self, key: bytes, role: str):
        self.key = key
        self.role = role.encode()
        assert self.role in ROLES
        self.nonce = os.urandom(32).hex().encode()
        self.peer_nonce: bytes | None = None
        self.done = False

    def opening(self) -> bytes:
        return b"CMSG " + AUTH + b"\0" + self.role + b" " + self.nonce

    def receive(self, key: bytes, payload: bytes | None) -> list[bytes]:
        if key == AUTH:
            if self.peer_nonce is not None:
                raise AuthError("a second link/auth")
            role, _, nonce = (payload or b"").partition(b" ")
            if role not in ROLES or role == self.role:
                raise AuthError(f"bad role in link/auth: {role[:20]!r}")
            if len(nonce) != 64 or not all(c in b"0123456789abcdef" for c in nonce):
                raise AuthError("bad nonce in link/auth")
            self.peer_nonce = nonce
            return [b"CMSG " + PROOF + b"\0" + _mac(self.key, self.role, nonce, self.nonce)]
        if key == PROOF:
            if self.peer_nonce is None:
                raise AuthError("link/proof before link/auth")
            peer_role = ROLES[1] if self.role == ROLES[0] else ROLES[0]
            expected = _mac(self.key, peer_role, self.nonce, self.peer_nonce)
            if not hmac.compare_digest(expected, payload or b""):
                raise AuthError("wrong key (the proof does not match)")
            self.done = True
            return []
        raise AuthError(f"{key[:30]!r} before authentication")


# ---------------------------------------------------------------- asking a link who we are across it


def trusted_link_uids(address=None) -> set[int]:
    """Whose links to believe by default: our own uid, root, and the owner of the bus socket."""
    from sbus.client.address import resolve

    uids = {os.getuid(), 0}
    addr = resolve(address)
    if addr.kind == "path":
        try:
            uids.add(os.stat(addr.value).st_uid)
        except OSError:
            pass
    return uids


def ask_cross_identity(address=None, trusted_uids=None, timeout: float = 5.0) -> tuple[bytes, bytes]:
    """(link whoami, our identity across that link), proven to come from the link.

    1. Publish ``sbus-link/whoami`` with our whoami: links answer on our
       secret key ``<us>/sbus-link/whoami`` with ``link\\0<link whoami>``.
       Anyone may publish there, so this only names candidates; a candidate
       whose uid is not in `trusted_uids` is ignored.
    2. Publish ``<us>\\0<nonce>`` on ``<link whoami>/sbus-link/whoami``: a
       secret key of the link, which only the process with those credentials
       receives. It answers ``answer\\0<nonce>\\0<identity>`` on our key; an
       answer without our nonce is a forgery and is ignored.

    The identity is empty while the link's peer is down. Raises
    `TimeoutError` if no trusted link answers within `timeout`.
    """
    import time

    from sbus.client.blocking import Client
    from sbus.client.twisted import parse_whoami
    from sbus.core.codec import Message

    trusted = trusted_link_uids(address) if trusted_uids is None else set(trusted_uids)
    deadline = time.monotonic() + timeout
    with Client(address) as bus:
        me = bus.whoami(timeout)
        reply_key = me + b"/sbus-link/whoami"
        bus.subscribe(reply_key)
        bus.sync(timeout)
        bus.publish(b"sbus-link/whoami", me)
        asked: dict[bytes, bytes] = {}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no trusted sbus-link answered")
            m = bus.receive(timeout=left)
            if not isinstance(m, Message) or m.key != reply_key:
                continue
            kind, _, rest = m.payload.partition(b"\0")
            if kind == b"link":
                parsed = parse_whoami(rest)
                if parsed is None or parsed[1].uid not in trusted or rest in asked:
                    continue
                nonce = os.urandom(16).hex().encode()
                asked[rest] = nonce
                bus.publish(rest + b"/sbus-link/whoami", me + b"\0" + nonce)
            elif kind == b"answer":
                nonce, _, identity = rest.partition(b"\0")
                for link, sent in asked.items():
                    if hmac.compare_digest(sent, nonce):
                        return link, identity
