"""How far a publisher's packets continue a run: the rule, in plain Python.

A run (`sbus.server.broker`) is a publisher's messages of one read batch that go to the same
recipients, queued a run at a time. Once one is open, what the broker would do with each
following packet is known without routing it: a plain MSG (no `!` in its key) whose cached
recipients are the run's own, while the run fits the room its recipients' queues gave it, is
one more message of the run. `run_extent` says how far that goes, so a batch's run is taken
with one call instead of a Python call per message. `sbus._speedups.run_extent` is the same
rule in C (tests/test_runs.py holds the two equal); `extent` is whichever is loaded.
"""

from __future__ import annotations

from typing import Callable

from sbus import speedups

__all__ = ["extent", "run_extent"]


def run_extent(packets: list, start: int, cached: Callable, clients, room_bytes: int,
               room_packets: int) -> tuple[int, int]:
    """(end, nbytes): packets[start:end] continue the run to `clients`, and hold nbytes bytes."""
    total = 0
    j = max(start, 0)
    stop = min(len(packets), j + max(room_packets, 0))
    while j < stop:
        packet = packets[j]
        if packet.__class__ is not bytes or packet[:4] != b"MSG ":
            break
        end = packet.find(b"\0", 4)
        if end < 0:
            break
        key = packet[4:end]
        if 33 in key or total + len(packet) > room_bytes or cached(key) is not clients:
            break
        total += len(packet)
        j += 1
    return j, total


_c = speedups.load()
#: The rule as the server runs it: in C when the extension is there, else `run_extent`.
extent = _c.run_extent if _c is not None else run_extent
