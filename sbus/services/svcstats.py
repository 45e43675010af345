"""Statistics a person can ask a service for, over the bus (relay, bridge, link, NATS, queue,
recorder, msgbus gateway).

Request: publish ``MSG sbus/services/stats\\0<REPLY KEY>`` on a bus, where
REPLY KEY is a secret key of the asker (``<own whoami>/anything``, e.g.
``!/cred////stats-reply/1`` expanded: only the asker receives it). Every
service connected to that bus answers once on REPLY KEY with a JSON object::

    {"service": "sbus-bridge", "name": "...", "pid": 1234, "uid": 1000, "stats": {...}}

The asker's uid is the uid of the ``!/cred/G/U/P/`` link the server
delivers REPLY KEY by: the first link after the bus's credential prefix (on
a relay, keys outside its space go up to the master, which delivers by the
first link after *its* prefix). Everything after that link is free text the
asker wrote (``!/cred/1003/1003/P/!/cred/0/0/1/x`` reaches uid 1003, not
root). Full counters go to the service's own uid and root; other uids get
the service's kind, name and state only (counters would tell them about
other users' traffic). A request whose reply key is not a valid secret key is ignored
and counted. ``sbus stats --services`` asks and prints the answers.
"""

from __future__ import annotations

import json
import os

from sbus.client.twisted import parse_whoami
from sbus.core.credentials import SECRET_ROOT, CredentialError, check_key, owner_of

STATS_REQUEST = b"sbus/services/stats"
_MAX_REPLY_KEY = 1024


def lost(*counts: dict) -> dict:
    """The ``lost`` entry of a service's stats: the messages it did not pass on, by reason
    (``failover_gap``, ``peer_down``, ``nats_down``, ...), summed over directions, zeros left
    out. Every service's stats carry it under that one name, apart from normal traffic (a
    standby's messages that the active path delivered are not lost), for `sbus top`."""
    total: dict[str, int] = {}
    for c in counts:
        for reason, n in c.items():
            n = sum(n.values()) if isinstance(n, dict) else n
            if n:
                total[reason] = total.get(reason, 0) + n
    return dict(sorted(total.items()))


def unknown_gaps(*clients) -> dict:
    """The ``unknown_gaps`` entry of a service's stats: the times its `ReconnectingClient`s came
    back to a bus that had counted nothing for them (restarted, or a session lingered out), and
    their seconds in all; what was published meanwhile is lost in a number nobody knows (each
    interval has its log line, `ReconnectingClient.gapEnded`)."""
    return {"count": sum(c.unknownGaps for c in clients),
            "seconds": round(sum(c.unknownGapSeconds for c in clients), 3)}


def reply_owner_uid(key: bytes, whoami: bytes | None = None) -> int | None:
    """The uid a secret reply key reaches, published by a client whose whoami is `whoami`.

    The bus delivers a key under its own prefix + ``!/cred/`` by the first link after that
    prefix; a relay sends any other secret key up to its master, whose prefix is ours minus
    its last link, and so on up to the top (prefix empty). Text after the deciding link is
    the asker's own and proves nothing.
    """
    if not key.startswith(SECRET_ROOT) or len(key) > _MAX_REPLY_KEY:
        return None
    try:
        check_key(key)
    except CredentialError:
        return None
    mine = parse_whoami(whoami) if whoami else None
    prefix = mine[0] if mine is not None else b""
    while not key.startswith(prefix + SECRET_ROOT):
        if not prefix:
            return None
        prefix = prefix[:prefix.rstrip(b"/").rfind(SECRET_ROOT)]   # the master's prefix
    owner = owner_of(key, prefix)
    return None if owner is None else owner.uid


class StatsResponder:
    """Answer ``sbus/services/stats`` requests with `stats()` (a JSON-able dict)."""

    def __init__(self, service: str, name, stats, public=None):
        self.service = service
        self.name = name                # str or callable
        self.stats = stats
        self.public = public            # callable: what other uids may see (default: nothing more)
        self.answered = 0
        self.refused = 0

    def serve(self, client) -> None:
        """Answer the requests that reach `client` (a `ReconnectingClient`, on every connection
        it makes): each on the connection it came by, whose whoami decides the reply key."""
        def received(key: bytes, payload: bytes) -> None:
            if client.protocol is not None and client.protocol.connected:
                self.reply(client.protocol, payload)

        client.subscribe(STATS_REQUEST, received)

    def reply(self, proto, payload: bytes) -> None:
        """Answer a request that came on `proto` (an `SbusProtocol`), if it fits a packet."""
        packet = self.answer(payload, proto.credentials)
        if packet is not None and len(packet) <= proto.max_packet:
            proto.sendPacket(packet)

    def answer(self, payload: bytes, whoami: bytes | None = None) -> bytes | None:
        """The packet to publish for a request with this payload, received on a connection
        whose whoami is `whoami` (its prefix decides how the reply key is delivered), or None."""
        key = payload.strip()
        uid = reply_owner_uid(key, whoami)
        if uid is None:
            self.refused += 1
            return None
        body = {"service": self.service, "name": self.name() if callable(self.name) else self.name,
                "pid": os.getpid(), "uid": os.getuid()}
        if uid in (0, os.getuid()):
            body["stats"] = self.stats()
        elif self.public is not None:
            body["stats"] = self.public()
        self.answered += 1
        return b"MSG " + key + b"\0" + json.dumps(body, separators=(",", ":"), default=str).encode()
