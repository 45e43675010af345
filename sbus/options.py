"""Checks shared by the twistd plugins' options: a bad value is one usage line."""

from __future__ import annotations

from twisted.python import usage


def positive_int(name: str, value: str) -> int:
    try:
        n = int(value, 10)
    except ValueError:
        raise usage.UsageError(f"--{name}: not an integer: {value!r}") from None
    if n <= 0:
        raise usage.UsageError(f"--{name}: must be positive, got {n}")
    return n


def positive_float(name: str, value: str, zero_ok: bool = False) -> float:
    try:
        n = float(value)
    except ValueError:
        raise usage.UsageError(f"--{name}: not a number: {value!r}") from None
    if not n > 0 and not (zero_ok and n == 0):
        raise usage.UsageError(f"--{name}: must be positive, got {value}")
    return n
