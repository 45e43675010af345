"""Credentials, `!/cred/` keys and the rules for '!' (docs/protocol.md "Credentials and secret keys").

The server decides here, once per SUB/MSG, whether a client's use of '!' is
legal and which secret space a subscription belongs to; the router then
enforces delivery. Keeping the checks pure makes every rejection testable
without sockets.
"""

from __future__ import annotations

from typing import NamedTuple

SECRET_ROOT = b"!/cred/"

_FIELDS = ("gid", "uid", "pid")
_SHOW_MAX = 200


class Credentials(NamedTuple):
    """A peer's identity, in the order of SO_PEERCRED's struct ucred."""

    pid: int
    uid: int
    gid: int


class CredentialError(ValueError):
    """An unacceptable use of '!' or `!/cred/`; `str()` is the one-line reason."""


def _show(data: bytes) -> str:
    """Readable quoted rendering for log lines, bounded in length."""
    if len(data) > _SHOW_MAX:
        return repr(data[:_SHOW_MAX])[1:] + f"... ({len(data)} bytes)"
    return repr(data)[1:]


def whoami(prefix: bytes, cred: Credentials) -> bytes:
    """The answer to `CMSG !/cred/whoami`: prefix + `!/cred/GID/UID/PID`."""
    return b"%s!/cred/%d/%d/%d" % (prefix, cred.gid, cred.uid, cred.pid)


def secret_prefix(prefix: bytes, cred: Credentials) -> bytes:
    """What a secret key must start with to be deliverable to this client."""
    return whoami(prefix, cred) + b"/"


def owner_of(key: bytes, prefix: bytes = b"") -> Credentials | None:
    """Whose secret space `key` is in on a server with credential `prefix`: the first
    ``!/cred/GID/UID/PID/`` link after the prefix, as the server delivers (ids in canonical
    decimal, within 32 bits); None if the key reaches nobody there. Whatever follows that
    link is free text the publisher wrote, never an identity."""
    root = prefix + SECRET_ROOT
    if not key.startswith(root):
        return None
    parts = key[len(root):].split(b"/", 3)
    if len(parts) < 4:
        return None
    ids = []
    for field in parts[:3]:
        if not field.isdigit() or not field.isascii() or len(field) > 10:
            return None
        value = int(field)
        if value >= 1 << 32 or b"%d" % value != field:
            return None
        ids.append(value)
    gid, uid, pid = ids
    return Credentials(pid, uid, gid)


def is_secret(key: bytes) -> bool:
    return key.startswith(SECRET_ROOT)


def _bad_bang(data: bytes, partial_ok: bool) -> bool:
    """True if a lone '!' segment is used other than to start `!/cred/`.

    With `partial_ok` (patterns) the data may end inside that token.
    """
    i = data.find(b"!")
    n = len(data)
    while i >= 0:
        if (i == 0 or data[i - 1] == 0x2F) and (i + 1 == n or data[i + 1] == 0x2F):
            if not data.startswith(SECRET_ROOT, i):
                if not (partial_ok and SECRET_ROOT.startswith(data[i:])):
                    return True
        i = data.find(b"!", i + 1)
    return False


def check_key(key: bytes) -> None:
    """Raise `CredentialError` if a MSG key uses '!' invalidly.

    Malformed `!/cred/` keys are not an error: the router delivers them to
    nobody.
    """
    if b"!" in key and _bad_bang(key, False):
        raise CredentialError(f"invalid use of '!' in key {_show(key)}")


def check_pattern(pattern: bytes, cred: Credentials, prefix: bytes = b"") -> bytes:
    """Validate a SUB pattern; return the pattern to store.

    A secret pattern gets its empty gid/uid/pid fields filled with the
    client's own ids, so what is stored is what the router will compare.
    On a server with a credential `prefix` (a relay), a secret pattern may be
    written with the prefix (``<prefix>!/cred/G/U/P/...``, as whoami answers)
    or without it (``!/cred/G/U/P/...``, ``!/cred////...``): both are the
    client's own space and are stored with the prefix.
    """
    if b"!" not in pattern:
        return pattern
    if not pattern.startswith(SECRET_ROOT):
        if _bad_bang(pattern, True):
            raise CredentialError(f"invalid use of '!' in pattern {_show(pattern)}")
        return pattern
    space = prefix + SECRET_ROOT
    if not pattern.startswith(space):
        # Below a master (a non-empty prefix), `!/cred/G/U/P/...` without the
        # prefix is the client's local form: the fields are its ids on this
        # server, so its space is prefix + that. This is what makes the
        # empty-field form `!/cred////...` work on a relay as on a master.
        if space.startswith(pattern):
            raise CredentialError(f"secret pattern {_show(pattern)} is truncated")
        rest = pattern
    else:
        rest = pattern[len(prefix):]
    parts = rest[len(SECRET_ROOT):].split(b"/", 3)
    if len(parts) < 4:
        raise CredentialError(f"secret pattern {_show(pattern)} is truncated")
    own = (cred.gid, cred.uid, cred.pid)
    fields = []
    for name, value, mine in zip(_FIELDS, parts[:3], own):
        expected = b"%d" % mine
        if not value:
            value = expected
        elif b"*" in value:
            raise CredentialError(f"secret pattern field {name} {_show(value)} may not be a wildcard")
        elif value != expected:
            raise CredentialError(
                f"secret pattern field {name} {_show(value)} is not the client's {name} {mine}"
            )
        fields.append(value)
    tail = parts[3]
    if b"!" in tail and _bad_bang(tail, True):
        raise CredentialError(f"invalid use of '!' in pattern {_show(pattern)}")
    return prefix + SECRET_ROOT + b"/".join(fields) + b"/" + tail
