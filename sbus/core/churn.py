"""Connections that come and go, told in one log line per interval (no Twisted here).

A bus with a thousand short-lived clients wrote a line per connect and per disconnect: 9,266
lines in 40 s, and twistd rotated its log twice (issue 34). As nats-server logs connections
only at debug level and dbus-broker not at all, the server counts ordinary arrivals and
departures here and logs a summary line per interval; what is unusual (a disconnect for a
fault, a refusal) is still logged one line each, as it happens (`ConnectionChurn.ordinary`).
``--log-connections`` brings back a line per connection.
"""

from __future__ import annotations

from collections import Counter

from sbus.core.reasons import Disconnect

__all__ = ["ConnectionChurn", "ORDINARY"]

#: Reasons that say nothing went wrong: counted in the summary, not logged one by one.
ORDINARY = frozenset({Disconnect.CLOSED, Disconnect.SHUTDOWN})


class ConnectionChurn:
    """Arrivals and departures since the last summary."""

    def __init__(self) -> None:
        self.connected = 0
        self.disconnected: Counter[str] = Counter()

    @staticmethod
    def ordinary(reason: str) -> bool:
        """Whether a departure for `reason` goes only into the summary."""
        return reason in ORDINARY

    def arrived(self) -> None:
        self.connected += 1

    def left(self, reason: str) -> None:
        self.disconnected[reason] += 1

    def pending(self) -> bool:
        return bool(self.connected or self.disconnected)

    def summary(self, now_connected: int, seconds: float) -> str | None:
        """The line for what happened since the last one (None: nothing did), and start again."""
        if not self.pending():
            return None
        gone = sum(self.disconnected.values())
        reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(self.disconnected.items()))
        line = (f"clients in the last {seconds:.0f} s: {self.connected} connected, {gone} disconnected"
                f"{f' ({reasons})' if reasons else ''}; {now_connected} connected now")
        self.connected = 0
        self.disconnected.clear()
        return line
