"""Every reason the server gives, in one vocabulary (no Twisted here): why a client was
disconnected, why a message for it was dropped, why a connection was refused.

The values are what statistics, `server/disconnect` notices and metrics carry; docs/protocol.md
lists them, and tests/test_reasons.py holds the list and these enums equal. As `StrEnum`s they
are the strings themselves (JSON, Counter keys, comparisons with what a client parsed).
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Disconnect", "Drop", "Refusal"]


class Disconnect(StrEnum):
    """Why the server let a client go (statistics' ``disconnects``)."""

    CLOSED = "closed"  # the client went
    PROTOCOL_ERROR = "protocol_error"
    OVERSIZE = "oversize"
    INVALID_BANG = "invalid_bang"
    FORBIDDEN = "forbidden_subscription"
    SOFT_ERROR = "soft_error"
    HARD_ERROR = "hard_error"
    STALLED = "stalled"
    TOO_MANY_SUBSCRIPTIONS = "too_many_subscriptions"
    OWNER_GONE = "owner_exited"
    INTERNAL_ERROR = "internal_error"  # serving it raised: the server's bug, the others go on
    SHUTDOWN = "shutdown"


class Drop(StrEnum):
    """Why a message for a client was dropped (statistics' ``drops``)."""

    SOFT_DISCARD = "soft_discard"
    HARD_DISCARD = "hard_discard"


class Refusal(StrEnum):
    """Why a connection was refused at accept (statistics' ``refused``)."""

    USER_NOT_ALLOWED = "user_not_allowed"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    #: Its uid's queue budget has no room even for the kernel's smallest send buffer (issue 33.7).
    OVER_UID_QUEUE_CAP = "over_uid_queue_cap"
