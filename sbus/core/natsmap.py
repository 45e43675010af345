"""Routing keys <-> NATS subjects, both ways, exactly (sans-I/O; used by `twistd sbus-nats`).

NATS subjects are tokens joined by ``.``; ``*`` matches one token and ``>``
one or more trailing tokens. A token must be non-empty and may not hold
``.``, ``*``, ``>`` or white space; NATS recommends ASCII letters, digits,
``-`` and ``_`` (docs.nats.io, "Subject-Based Messaging"), and names starting
with ``$`` are reserved. So the mapping keeps exactly those bytes and
escapes every other one:

* a key is split at ``/`` into segments, each segment becomes one token,
  and the tokens are joined with ``.`` after the subject prefix
  (``sbus`` by default): ``sensors/t`` -> ``sbus.sensors.t``;
* in a segment, ASCII letters, digits and ``-`` stay as they are; every
  other byte (``_`` itself, ``.``, space, ``*``, ``>``, ``$``, control
  bytes, bytes >= 0x80, ...) becomes ``_`` and two upper-case hex digits:
  ``a.b c`` -> ``a_2Eb_20c``; ``cpu_load`` -> ``cpu_5Fload``;
* an empty segment (``a//b``, the trailing one of ``a/``, the only one of
  the empty key) becomes the token ``_`` alone: ``a/`` -> ``sbus.a._``.

Every key without NUL (keys cannot hold NUL) has exactly one subject, made
only of ``[A-Za-z0-9_-]`` tokens, and `subject_to_key` gives it back;
anything else under the prefix (a token that is not in this canonical form,
e.g. published by a foreign NATS client) is refused with `MappingError`.

Patterns: a segment that is exactly ``*`` becomes the NATS ``*`` (sbus's
``*`` may match an empty segment between two ``/``; NATS's needs a token,
and here the empty segment *is* a token, ``_``, so the two agree; but the
reference matcher's ``*`` does not match an empty *last* segment, ``a/*``
does not match ``a/``, so a pattern ending in ``*`` is flagged not exact
and filtered), and a trailing ``/``
becomes ``>`` (sbus's ``a/`` matches the key ``a/`` itself, which is
``sbus.a._``, one more token, so ``sbus.a.>`` matches it too: no second
subscription is needed). The empty pattern, which matches every key, is
``sbus.>``. A ``*`` inside a segment (``a/b*``) has no NATS equivalent: it
becomes ``*`` for that token and `pattern_to_subject` says the match is not
exact, so the caller filters what arrives with the reference matcher
(`sbus.core.patterns.matches`).
"""

from __future__ import annotations

__all__ = ["MappingError", "key_to_subject", "subject_to_key", "pattern_to_subject",
           "check_prefix", "subject_matches", "subjects_overlap", "subject_meet", "subject_covers", "EMPTY_TOKEN"]

#: The token of an empty segment, and the escape character.
EMPTY_TOKEN = "_"
_ESC = "_"
_SAFE_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")
_SAFE_CHARS = frozenset(chr(b) for b in _SAFE_BYTES)
_HEX = "0123456789ABCDEF"
_ENC = [chr(b) if b in _SAFE_BYTES else f"_{b:02X}" for b in range(256)]
_STAR = b"*"


class MappingError(ValueError):
    """A subject or prefix that does not map; `str()` is one line."""


def check_prefix(prefix: str) -> str:
    """Validate a subject prefix (``""`` or literal tokens joined by ``.``); return it."""
    if prefix == "":
        return prefix
    for tok in prefix.split("."):
        if not tok:
            raise MappingError(f"subject prefix {prefix!r}: empty token")
        if tok in ("*", ">") or any(c in tok for c in "*> \t\r\n") or not tok.isprintable():
            raise MappingError(f"subject prefix {prefix!r}: token {tok!r} is not a literal NATS token")
    if prefix.startswith("$"):
        raise MappingError(f"subject prefix {prefix!r}: names starting with '$' are reserved by NATS")
    return prefix


def encode_segment(seg: bytes) -> str:
    if not seg:
        return EMPTY_TOKEN
    if seg.isalnum() and seg.isascii():  # the common case: nothing to escape
        return seg.decode("ascii")
    enc = _ENC
    return "".join([enc[b] for b in seg])


def decode_token(tok: str) -> bytes:
    """The segment of a canonical token; `MappingError` for anything else."""
    if tok == EMPTY_TOKEN:
        return b""
    if not tok:
        raise MappingError("empty token")
    if _ESC not in tok:
        if not all(c in _SAFE_CHARS for c in tok):
            raise MappingError(f"token {tok!r} has a byte that would be escaped")
        return tok.encode("ascii")
    out = bytearray()
    i, n = 0, len(tok)
    while i < n:
        c = tok[i]
        if c == _ESC:
            h = tok[i + 1:i + 3]
            if len(h) != 2 or h[0] not in _HEX or h[1] not in _HEX:
                raise MappingError(f"token {tok!r}: bad escape at {i}")
            b = int(h, 16)
            if b == 0 or b in _SAFE_BYTES:
                raise MappingError(f"token {tok!r}: escape of {h} is not canonical")
            out.append(b)
            i += 3
        elif c in _SAFE_CHARS:
            out.append(ord(c))
            i += 1
        else:
            raise MappingError(f"token {tok!r} has a byte that would be escaped")
    return bytes(out)


def _join(prefix: str, tokens) -> str:
    body = ".".join(tokens)
    return f"{prefix}.{body}" if prefix else body


def key_to_subject(key: bytes, prefix: str = "sbus") -> str:
    """The subject a message with routing key `key` is published on."""
    if b"\0" in key:
        raise MappingError("a routing key cannot contain NUL")
    return _join(prefix, [encode_segment(s) for s in key.split(b"/")])


def subject_to_key(subject: str, prefix: str = "sbus") -> bytes:
    """The routing key of a subject made by `key_to_subject`; `MappingError` otherwise."""
    if prefix:
        if not subject.startswith(prefix) or subject[len(prefix):len(prefix) + 1] != ".":
            raise MappingError(f"subject {subject[:80]!r} is not under the prefix {prefix!r}")
        subject = subject[len(prefix) + 1:]
    return b"/".join([decode_token(t) for t in subject.split(".")])


def pattern_to_subject(pattern: bytes, prefix: str = "sbus") -> tuple[str, bool]:
    """(NATS subscription subject, exact) for sbus pattern `pattern`.

    When `exact` is False the subject is broader than the pattern (a ``*``
    inside a segment) and what arrives must be checked with the reference
    matcher.
    """
    if b"\0" in pattern:
        raise MappingError("a pattern cannot contain NUL")
    if pattern == b"":
        return (_join(prefix, [">"]), True)
    tokens = []
    exact = True
    trailing = pattern.endswith(b"/")
    body = pattern[:-1] if trailing else pattern
    segs = body.split(b"/")
    for seg in segs:
        if _STAR not in seg:
            tokens.append(encode_segment(seg))
        else:
            tokens.append("*")
            if seg != _STAR:
                exact = False
    if not trailing and segs[-1] == _STAR:
        # the reference matcher's '*' matches an empty segment between two '/' but not at
        # the very end of a key ('a/*' does not match 'a/'): NATS's '*' takes '_' there
        exact = False
    if trailing:
        tokens.append(">")
    return (_join(prefix, tokens), exact)


def subject_matches(filter_: str, subject: str) -> bool:
    """NATS's own rule: does subscription subject `filter_` match literal `subject`?"""
    ft = filter_.split(".")
    st = subject.split(".")
    for i, f in enumerate(ft):
        if f == ">":
            return len(st) > i
        if i >= len(st):
            return False
        if f != "*" and f != st[i]:
            return False
    return len(ft) == len(st)


def subjects_overlap(a: str, b: str) -> bool:
    """Could one literal subject match both subscription subjects `a` and `b`?"""
    at = a.split(".")
    bt = b.split(".")
    for i in range(max(len(at), len(bt))):
        x = at[i] if i < len(at) else None
        y = bt[i] if i < len(bt) else None
        if x == ">" or y == ">":
            return x is not None and y is not None
        if x is None or y is None:
            return False
        if x != "*" and y != "*" and x != y:
            return False
    return True


def subject_meet(a: str, b: str) -> str | None:
    """The subscription subject matching exactly the literal subjects that match both `a` and
    `b`, or None if none does: token by token, a literal beats ``*``, ``>`` takes the rest of
    the other. (The meet of two NATS filters is always one filter.)"""
    at = a.split(".")
    bt = b.split(".")
    out = []
    for i in range(max(len(at), len(bt))):
        x = at[i] if i < len(at) else None
        y = bt[i] if i < len(bt) else None
        if x == ">" and y is not None:
            return ".".join(out + bt[i:])
        if y == ">" and x is not None:
            return ".".join(out + at[i:])
        if x is None or y is None:
            return None
        if x == "*":
            out.append(y)
        elif y == "*" or x == y:
            out.append(x)
        else:
            return None
    return ".".join(out)


def subject_covers(a: str, b: str) -> bool:
    """Does every literal subject that matches filter `b` also match filter `a`?"""
    at = a.split(".")
    bt = b.split(".")
    for i, x in enumerate(at):
        if x == ">":
            return len(bt) > i
        if i >= len(bt):
            return False
        y = bt[i]
        if y == ">":
            return False
        if x != "*" and x != y:
            return False
    return len(at) == len(bt)
