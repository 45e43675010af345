"""`CMSG server/session-held`: is a session held, and is its holder's peer still there? Asked
without claiming (docs/protocol.md "Sessions", "Is a session held?"), through a real server.

The case it exists for (issue 34, a bridge's second takeover): a holder killed while the server
holds it paused (a hard/block subscriber that does not read) still has its writes unread in the
server; the name is ``closing`` until the server has read and routed them, then ``free``.
"""

from __future__ import annotations

import time

import pytest

from helpers import cmsg, connect, recv, send, stats, sub, sync, unique
from sbus.core import codec
from test_server_flood import _send_until_stalled

REPLY = b"CMSG " + codec.SESSION_HELD + b"\0"


def held(sock, name: bytes) -> tuple[bytes, str]:
    """Ask whether `name` is held; skip whatever comes before the answer."""
    send(sock, b"CMSG " + codec.SESSION_HELD + b"\0" + name)
    while True:
        p = recv(sock)
        assert p, "the server closed the connection"
        if p.startswith(REPLY):
            return codec.parse_session_held(p[len(REPLY):])


def test_the_request_and_its_answer_round_trip():
    assert codec.session_held_request(b"x") == b"CMSG server/session-held\0x"
    assert codec.parse_session_held(codec.session_held_reply(b"x", codec.HELD_CLOSING)[len(REPLY):]) \
        == (b"x", "closing")
    with pytest.raises(codec.ProtocolError):
        codec.parse_session_held(b"x\0maybe")


def test_held_free_and_refused_and_asking_claims_nothing(bus):
    name = unique("held-").encode()
    holder, asker = connect(bus.address), connect(bus.address)
    assert held(asker, name) == (name, "free")
    send(holder, codec.session_request(name, 30))
    assert sync(holder)[0].startswith(b"CMSG server/session\0" + name + b"\0new\0")
    assert held(asker, name) == (name, "held")
    assert held(holder, name) == (name, "held")            # its own: held too
    assert held(asker, b"") == (b"", "refused")            # one line in the log, still served
    assert bus.wait_log("server/session-held refused")
    assert sync(asker) == []
    send(asker, codec.session_request(name, 30))           # asking claimed nothing: still busy
    assert b"\0busy\0" in sync(asker)[0]


@pytest.mark.timeout(90)
def test_a_closed_holder_whose_writes_wait_unread_is_closing_until_they_are_routed(bus):
    """The holder publishes to a hard/block subscriber that does not read until the server stops
    reading the holder, then closes (as `kill -9` would). The name stays ``closing`` while the
    server holds its writes; once the subscriber reads, every one of them reaches it before the
    name is ``free``."""
    name = unique("held-").encode()
    key = unique("h/").encode()
    blocker = connect(bus.address)
    send(blocker, cmsg("blocking/hard/block"), sub(key))
    assert sync(blocker) == []
    holder, asker = connect(bus.address, sndbuf=65536), connect(bus.address)
    send(holder, codec.session_request(name, 30))
    assert b"\0new\0" in sync(holder)[0]
    n = _send_until_stalled(holder, connect(bus.address), key, 20000, 1000)
    holder.close()
    assert held(asker, name) == (name, "closing")
    assert held(asker, name) == (name, "closing"), "the server read the paused holder meanwhile"
    got = 0
    deadline = time.monotonic() + 60
    blocker.settimeout(1.0)
    while True:                                             # read until the name is free
        while True:
            try:
                p = blocker.recv(1 << 20)
            except TimeoutError:
                break
            got += p.startswith(b"MSG ")
            if got == n:
                break
        state = held(asker, name)[1]
        if state == "free":
            break
        assert state == "closing" and time.monotonic() < deadline, (state, got, n)
    got += sum(p.startswith(b"MSG ") for p in sync(blocker, timeout=30))   # routed, not yet read
    assert got == n, f"the name was free with {n - got} of the holder's {n} messages unrouted"
    assert stats(asker)["sessions"]["lingering"] == 1
