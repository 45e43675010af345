"""Statistics a person can ask a service for, over the bus (bridge, link, msgbus gateway).

Request: publish ``MSG sbus/services/stats\\0<REPLY KEY>`` on a bus, where
REPLY KEY is a secret key of the asker (``<own whoami>/anything``, e.g.
``!/cred////stats-reply/1`` expanded: only the asker receives it). Every
service connected to that bus answers once on REPLY KEY with a JSON object::

    {"service": "sbus-bridge", "name": "...", "pid": 1234, "uid": 1000, "stats": {...}}

The asker's uid is the last ``!/cred/G/U/P`` link of REPLY KEY (whoever else
publishes the request can only have the answer sent to that uid). Full
counters go to the service's own uid and root; other uids get the service's
kind, name and state only (counters would tell them about other users'
traffic). A request whose reply key is not a valid secret key is ignored
and counted. ``sbus stats --services`` asks and prints the answers.
"""

from __future__ import annotations

import json
import os

from sbus.core.credentials import SECRET_ROOT, CredentialError, check_key

STATS_REQUEST = b"sbus/services/stats"
_MAX_REPLY_KEY = 1024


def reply_owner_uid(key: bytes) -> int | None:
    """The uid that a secret reply key reaches (the innermost link of its credential chain)."""
    if not key.startswith(SECRET_ROOT) or len(key) > _MAX_REPLY_KEY:
        return None
    try:
        check_key(key)
    except CredentialError:
        return None
    uid = None
    rest = key
    while rest.startswith(SECRET_ROOT):
        parts = rest[len(SECRET_ROOT):].split(b"/", 3)
        if len(parts) < 3 or not all(p.isdigit() for p in parts[:3]):
            return uid
        uid = int(parts[1])
        rest = parts[3] if len(parts) == 4 else b""
    return uid


class StatsResponder:
    """Answer ``sbus/services/stats`` requests with `stats()` (a JSON-able dict)."""

    def __init__(self, service: str, name, stats, public=None):
        self.service = service
        self.name = name                # str or callable
        self.stats = stats
        self.public = public            # callable: what other uids may see (default: nothing more)
        self.answered = 0
        self.refused = 0

    def answer(self, payload: bytes) -> bytes | None:
        """The packet to publish for a request with this payload, or None (ignored)."""
        key = payload.strip()
        uid = reply_owner_uid(key)
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
