"""The sbus wire format: one SEQPACKET packet is one message.

Plain Python, no I/O, shared by the server and every client. The server's
hot path needs only the type and the key of a packet (it forwards the bytes
it received), so `classify` returns exactly that and copies no payload;
`parse` builds typed values for clients on top of it.
"""

from __future__ import annotations

from typing import NamedTuple, Union

#: The reference client library's buffer; the server's default limit.
MAX_PACKET = 409600

#: Packet kinds returned by `classify`.
SUB, UNSUB, MSG, CMSG = 1, 2, 3, 4

_KINDS = ((b"MSG ", MSG, 4), (b"SUB ", SUB, 4), (b"UNSUB ", UNSUB, 6), (b"CMSG ", CMSG, 5))


class ProtocolError(ValueError):
    """A packet that breaks the wire format; `str()` says precisely how."""


class Sub(NamedTuple):
    pattern: bytes


class Unsub(NamedTuple):
    pattern: bytes


class Message(NamedTuple):
    """A published message (`MSG key\\0payload`)."""

    key: bytes
    payload: bytes


class Control(NamedTuple):
    """A control message (`CMSG key[\\0payload]`); payload is None when omitted."""

    key: bytes
    payload: bytes | None


Packet = Union[Sub, Unsub, Message, Control]


def classify(packet: bytes, max_size: int = MAX_PACKET) -> tuple[int, bytes]:
    """Return ``(kind, key)`` of a packet, or raise `ProtocolError`.

    For SUB/UNSUB the key is the pattern (up to the first NUL, the rest is
    ignored); for MSG/CMSG it is the routing key.
    """
    n = len(packet)
    if n > max_size:
        raise ProtocolError(f"packet of {n} bytes exceeds the {max_size}-byte limit")
    if packet[:4] == b"MSG ":
        end = packet.find(b"\0", 4)
        if end < 0:
            raise ProtocolError("MSG without a NUL between key and payload")
        return MSG, packet[4:end]
    for prefix, kind, start in _KINDS:
        if packet.startswith(prefix):
            break
    else:
        if not packet:
            raise ProtocolError("empty packet")
        head = packet[:12].split(b" ", 1)[0].split(b"\0", 1)[0]
        raise ProtocolError(f"unknown packet type {head!r}")
    end = packet.find(b"\0", start)
    return kind, packet[start:] if end < 0 else packet[start:end]


def parse(packet: bytes, max_size: int = MAX_PACKET) -> Packet:
    """Decode a packet into `Sub`, `Unsub`, `Message` or `Control`."""
    kind, key = classify(packet, max_size)
    if kind == MSG:
        return Message(key, packet[5 + len(key):])
    if kind == CMSG:
        start = 5 + len(key)
        return Control(key, packet[start + 1:] if len(packet) > start else None)
    return Sub(key) if kind == SUB else Unsub(key)


def _check_key(what: str, key: bytes) -> bytes:
    if isinstance(key, str):
        key = key.encode("utf-8")
    if b"\0" in key:
        raise ProtocolError(f"{what} contains a NUL byte")
    return key


def _check_size(packet: bytes, max_size: int) -> bytes:
    if len(packet) > max_size:
        raise ProtocolError(f"packet of {len(packet)} bytes exceeds the {max_size}-byte limit")
    return packet


def encode_sub(pattern: bytes | str, max_size: int = MAX_PACKET) -> bytes:
    return _check_size(b"SUB " + _check_key("pattern", pattern), max_size)


def encode_unsub(pattern: bytes | str, max_size: int = MAX_PACKET) -> bytes:
    return _check_size(b"UNSUB " + _check_key("pattern", pattern), max_size)


def encode_msg(key: bytes | str, payload: bytes | str = b"", max_size: int = MAX_PACKET) -> bytes:
    if isinstance(payload, str):
        payload = payload.encode("utf-8")
    return _check_size(b"MSG " + _check_key("key", key) + b"\0" + payload, max_size)


def encode_cmsg(key: bytes | str, payload: bytes | str | None = None, max_size: int = MAX_PACKET) -> bytes:
    key = b"CMSG " + _check_key("key", key)
    if payload is None:
        return _check_size(key, max_size)
    if isinstance(payload, str):
        payload = payload.encode("utf-8")
    return _check_size(key + b"\0" + payload, max_size)


def encode(packet: Packet, max_size: int = MAX_PACKET) -> bytes:
    """Encode a typed packet; the inverse of `parse`."""
    if isinstance(packet, Message):
        return encode_msg(packet.key, packet.payload, max_size)
    if isinstance(packet, Control):
        return encode_cmsg(packet.key, packet.payload, max_size)
    if isinstance(packet, Sub):
        return encode_sub(packet.pattern, max_size)
    if isinstance(packet, Unsub):
        return encode_unsub(packet.pattern, max_size)
    raise TypeError(f"not an sbus packet: {packet!r}")


#: Control keys the protocol defines.
WHOAMI = b"!/cred/whoami"
STATS = b"server/stats"
ECHO_OFF, ECHO_ON = b"echo/off", b"echo/on"
SOFT_MODES = (b"queue", b"discard", b"block", b"error")
HARD_MODES = (b"discard", b"block", b"error")
ORDERS = (b"queue", b"stack", b"random")

#: Control messages the server sends of its own accord (docs/protocol.md, "Server notices").
SERVER_ID = b"server/id"
DROPPED = b"server/dropped"
DISCONNECT = b"server/disconnect"
#: Asked for by a watcher; then sent by the server as patterns become held and released.
INTEREST = b"server/interest"
#: A client asks for the notices above (docs/protocol.md "Extensions"); a client that never
#: sends it sees only packets the reference server would send.
EXTENSIONS = b"server/extensions"
#: A request (docs/protocol.md "Sessions"): hold a named session that lingers after this
#: connection closes, or claim the one a predecessor left.
SESSION = b"server/session"
#: A session's holder says it has recorded the count its claim was told (docs/protocol.md
#: "Sessions", "Confirming the count"): until then the server keeps it with the session.
SESSION_CONFIRM = b"server/session-confirm"
#: A request (docs/protocol.md "Sessions", "Is a session held?"): is a session of this uid held,
#: and is its holder's peer still there? It claims nothing (a standby asks before it takes over).
SESSION_HELD = b"server/session-held"
#: A session's holder says how many packets it has read on this connection and handed on
#: (docs/protocol.md "Sessions", "Acknowledging what was read"): at a close the server counts
#: what it sent past that as missed (the kernel's buffer toward a killed holder). No answer.
SESSION_ACK = b"server/session-ack"
#: Its answers: nobody holds it; a connection whose peer is there holds it; the holder's peer has
#: closed and the server has not yet read all it sent (routed before the name is free); bad name.
HELD_FREE, HELD_LIVE, HELD_CLOSING, HELD_REFUSED = "free", "held", "closing", "refused"


def msg_key(packet: bytes) -> bytes:
    """The routing key of a MSG packet (bytes 4 up to the first NUL)."""
    end = packet.find(b"\0", 4)
    return packet[4:end] if end >= 0 else packet[4:]


class DropNotice(NamedTuple):
    """`CMSG server/dropped\\0COUNT\\0FIRST\\0LAST`: `count` messages meant for this client were
    dropped since the previous notice, the first with key `first`, the last with `last`."""

    count: int
    first: bytes
    last: bytes


class DisconnectNotice(NamedTuple):
    """`CMSG server/disconnect\\0REASON\\0TEXT`: why the server is about to close the connection."""

    reason: str
    text: str

    def __str__(self) -> str:
        return f"the server closed the connection: {self.text} ({self.reason})"


def parse_drop_notice(payload: bytes | None) -> DropNotice:
    parts = (payload or b"").split(b"\0", 2)
    if len(parts) != 3 or not parts[0].isdigit():
        raise ProtocolError(f"malformed {DROPPED.decode()} payload {bytes(payload or b'')[:60]!r}")
    return DropNotice(int(parts[0]), parts[1], parts[2])


class SessionReply(NamedTuple):
    """`CMSG server/session\0NAME\0STATE\0MISSED\0GAP\0LINGER[\0CARRIED]` (docs/protocol.md
    "Sessions"): `state` is new, resumed, busy or refused; a resumed session's predecessor
    missed `missed` messages during a gap of `gap` seconds. `carried` (only when the claim
    asked to confirm): of `missed`, what an earlier claimer was told and never confirmed."""

    name: bytes
    state: str
    missed: int
    gap: float
    linger: float
    carried: int = 0


#: The longest session name a server takes.
MAX_SESSION_NAME = 200


def check_session_name(name: bytes) -> bytes:
    """`name` if a server takes it as a session name (1 to 200 bytes, no NUL), else ValueError."""
    if not 1 <= len(name) <= MAX_SESSION_NAME:
        raise ValueError(f"a session name is 1 to {MAX_SESSION_NAME} bytes, not {len(name)}")
    if b"\0" in name:
        raise ValueError("a session name has no NUL")
    return name


def session_name(text: str) -> bytes:
    """A session name made of what identifies a service (its role and where it works, the same
    for the process that replaces it): over the limit, it ends with a hash of the whole."""
    name = text.encode("utf-8", "surrogateescape").replace(b"\0", b"?")
    if len(name) > MAX_SESSION_NAME:
        import hashlib
        name = name[:MAX_SESSION_NAME - 17] + b"~" + hashlib.sha256(name).hexdigest()[:16].encode()
    return name or b"?"


#: The flag a claim ends with to keep its count with the session until it is confirmed.
CONFIRM_FLAG = b"confirm"


def session_request(name: bytes, linger: float, confirm: bool = False) -> bytes:
    """The CMSG that holds (or claims) session `name`, lingering `linger` seconds after a close;
    `confirm`: the server keeps the count it tells until `session_confirm(name)`."""
    text = (b"%.3f" % linger).rstrip(b"0").rstrip(b".") or b"0"  # decimal, never an exponent
    if confirm:
        return b"CMSG %s\0%s\0%s\0%s" % (SESSION, name, text, CONFIRM_FLAG)
    return b"CMSG %s\0%s\0%s" % (SESSION, name, text)


def session_confirm(name: bytes) -> bytes:
    """The CMSG that tells the server the count of session `name`'s claim is recorded."""
    return b"CMSG %s\0%s" % (SESSION_CONFIRM, name)


def session_ack(name: bytes, count: int) -> bytes:
    """The CMSG that tells the server `count` packets of this connection were read and handed on."""
    return b"CMSG %s\0%s\0%d" % (SESSION_ACK, name, count)


def session_reply(name: bytes, state: bytes, missed: int = 0, gap: float = 0.0, linger: float = 0.0,
                  carried: int | None = None) -> bytes:
    """The answer to a claim; `carried` is given (a sixth field) only to a claim that confirms."""
    packet = b"CMSG %s\0%s\0%s\0%d\0%.3f\0%.3f" % (SESSION, name, state, missed, gap, linger)
    return packet if carried is None else packet + b"\0%d" % carried


def session_held_request(name: bytes) -> bytes:
    """The CMSG that asks whether session `name` is held (`SESSION_HELD`)."""
    return b"CMSG %s\0%s" % (SESSION_HELD, check_session_name(name))


def session_held_reply(name: bytes, state: str) -> bytes:
    """The answer to `session_held_request`: one of `HELD_FREE`, `HELD_LIVE`, `HELD_CLOSING`,
    `HELD_REFUSED`."""
    return b"CMSG %s\0%s\0%s" % (SESSION_HELD, name, state.encode("ascii"))


def parse_session_held(payload: bytes | None) -> tuple[bytes, str]:
    """``NAME\0STATE`` -> (name, state); `ProtocolError` if malformed or an unknown state."""
    name, sep, state = (payload or b"").rpartition(b"\0")
    text = state.decode("ascii", "replace")
    if not sep or text not in (HELD_FREE, HELD_LIVE, HELD_CLOSING, HELD_REFUSED):
        raise ProtocolError(f"malformed {SESSION_HELD.decode()} payload {bytes(payload or b'')[:60]!r}")
    return name, text


def parse_session_reply(payload: bytes | None) -> SessionReply:
    parts = (payload or b"").split(b"\0")
    try:
        if len(parts) not in (5, 6):
            raise ValueError
        name, state, missed, gap, linger = parts[:5]
        carried = int(parts[5]) if len(parts) == 6 else 0
        return SessionReply(name, state.decode("ascii"), int(missed), float(gap), float(linger), carried)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError(f"malformed {SESSION.decode()} payload {bytes(payload or b'')[:60]!r}") from None


def parse_disconnect(payload: bytes | None) -> DisconnectNotice:
    reason, _, text = (payload or b"").partition(b"\0")
    return DisconnectNotice(reason.decode("utf-8", "replace"), text.decode("utf-8", "replace"))
