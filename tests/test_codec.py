"""The packet codec: classification, parsing, encoding, and bad input."""

import pytest
from hypothesis import given, settings, strategies as st

from sbus.core.codec import (
    CMSG,
    MAX_PACKET,
    MSG,
    SUB,
    UNSUB,
    Control,
    Message,
    ProtocolError,
    Sub,
    Unsub,
    classify,
    encode,
    encode_cmsg,
    encode_msg,
    encode_sub,
    encode_unsub,
    parse,
)


@pytest.mark.parametrize(
    "packet,kind,key",
    [
        (b"SUB a/b", SUB, b"a/b"),
        (b"SUB ", SUB, b""),
        (b"SUB a\0ignored\0more", SUB, b"a"),
        (b"UNSUB a/*", UNSUB, b"a/*"),
        (b"UNSUB a\0x", UNSUB, b"a"),
        (b"MSG k\0payload", MSG, b"k"),
        (b"MSG \0", MSG, b""),
        (b"MSG k\0pay\0load", MSG, b"k"),
        (b"CMSG echo/off", CMSG, b"echo/off"),
        (b"CMSG !/cred/whoami\0", CMSG, b"!/cred/whoami"),
        (b"CMSG k\0p\0q", CMSG, b"k"),
    ],
)
def test_classify(packet, kind, key):
    assert classify(packet) == (kind, key)


@pytest.mark.parametrize(
    "packet,value",
    [
        (b"SUB a/b", Sub(b"a/b")),
        (b"SUB a\0junk", Sub(b"a")),
        (b"UNSUB \0junk", Unsub(b"")),
        (b"MSG k\0pay\0load", Message(b"k", b"pay\0load")),
        (b"MSG k\0", Message(b"k", b"")),
        (b"CMSG k", Control(b"k", None)),
        (b"CMSG k\0", Control(b"k", b"")),
        (b"CMSG k\0p\0q", Control(b"k", b"p\0q")),
        (b"CMSG ", Control(b"", None)),
    ],
)
def test_parse(packet, value):
    assert parse(packet) == value


@pytest.mark.parametrize(
    "packet,message",
    [
        (b"", "empty packet"),
        (b"PUB x\0y", "unknown packet type b'PUB'"),
        (b"SUB", "unknown packet type b'SUB'"),
        (b"SUBa", "unknown packet type b'SUBa'"),
        (b"UNSUB", "unknown packet type b'UNSUB'"),
        (b"CMSG", "unknown packet type b'CMSG'"),
        (b"sub a", "unknown packet type b'sub'"),
        (b"MSG", "unknown packet type b'MSG'"),
        (b"MSG key without nul", "MSG without a NUL between key and payload"),
        (b"MSG ", "MSG without a NUL between key and payload"),
    ],
)
def test_malformed(packet, message):
    with pytest.raises(ProtocolError) as e:
        classify(packet)
    assert str(e.value) == message
    with pytest.raises(ProtocolError):
        parse(packet)


def test_over_max_size():
    with pytest.raises(ProtocolError) as e:
        classify(b"MSG k\0" + b"x" * MAX_PACKET)
    assert str(e.value) == f"packet of {MAX_PACKET + 6} bytes exceeds the {MAX_PACKET}-byte limit"
    with pytest.raises(ProtocolError, match="packet of 11 bytes exceeds the 10-byte limit"):
        parse(b"SUB abcdefg", max_size=10)
    assert classify(b"SUB abcdef", max_size=10) == (SUB, b"abcdef")
    with pytest.raises(ProtocolError, match="exceeds the 10-byte limit"):
        encode_msg(b"k", b"x" * 10, max_size=10)
    assert len(encode_msg(b"k", b"x" * (MAX_PACKET - 6))) == MAX_PACKET


def test_encoders():
    assert encode_sub(b"a/*") == b"SUB a/*"
    assert encode_sub("a/é") == "SUB a/é".encode()
    assert encode_unsub(b"a") == b"UNSUB a"
    assert encode_msg(b"k", b"p") == b"MSG k\0p"
    assert encode_msg("k", "p") == b"MSG k\0p"
    assert encode_msg(b"k") == b"MSG k\0"
    assert encode_cmsg(b"echo/off") == b"CMSG echo/off"
    assert encode_cmsg(b"k", b"") == b"CMSG k\0"
    assert encode_cmsg(b"k", "p") == b"CMSG k\0p"


def test_encoders_reject_nul_in_key():
    with pytest.raises(ProtocolError, match="pattern contains a NUL byte"):
        encode_sub(b"a\0b")
    with pytest.raises(ProtocolError, match="key contains a NUL byte"):
        encode_msg(b"a\0b", b"")
    with pytest.raises(ProtocolError, match="key contains a NUL byte"):
        encode(Control(b"\0", None))
    with pytest.raises(TypeError):
        encode(("MSG", b"k"))


KEYS = st.binary(max_size=40).map(lambda b: b.replace(b"\0", b"x"))
PACKETS = st.one_of(
    st.builds(Sub, KEYS),
    st.builds(Unsub, KEYS),
    st.builds(Message, KEYS, st.binary(max_size=60)),
    st.builds(Control, KEYS, st.none() | st.binary(max_size=60)),
)


@settings(max_examples=500)
@given(PACKETS)
def test_round_trip(packet):
    data = encode(packet)
    assert parse(data) == packet
    assert encode(parse(data)) == data
    kind, key = classify(data)
    assert key == packet[0]
    assert kind == {Sub: SUB, Unsub: UNSUB, Message: MSG, Control: CMSG}[type(packet)]


@given(KEYS, st.binary(max_size=30))
def test_sub_pattern_stops_at_first_nul(pattern, junk):
    assert parse(b"SUB " + pattern + b"\0" + junk) == Sub(pattern)
    assert parse(b"UNSUB " + pattern + b"\0" + junk) == Unsub(pattern)


@given(st.binary(max_size=50))
def test_arbitrary_bytes_parse_or_protocol_error(data):
    try:
        value = parse(data)
    except ProtocolError:
        return
    # whatever parses re-encodes to a packet that parses to the same value
    assert parse(encode(value)) == value
