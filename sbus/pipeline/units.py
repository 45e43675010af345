"""Parsing sizes ("64M") and durations ("90s", "5m") for the command lines; one-line errors."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.I)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|sec|secs|seconds?|m|min|mins|minutes?|h|hours?|d|days?)?\s*$", re.I)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_size(text: str) -> int:
    """Bytes from "1000", "64K", "64M", "1.5G" (binary multiples); ValueError otherwise."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 512K, 64M, 1G)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(text: str) -> float:
    """Seconds from "90", "90s", "5m", "2h", "7d", "250ms"; ValueError otherwise."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 5m, 2h, 7d)")
    unit = (m.group(2) or "s").lower()
    unit = "ms" if unit == "ms" else unit[0]
    return float(m.group(1)) * _DURATION_UNITS[unit]


def spark_interval(seconds: float) -> str:
    """A Spark interval string for a whole number of milliseconds ("60 seconds")."""
    ms = round(seconds * 1000)
    if ms <= 0:
        raise ValueError("a window must be longer than 0")
    if ms % 1000 == 0:
        return f"{ms // 1000} seconds"
    return f"{ms} milliseconds"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
