"""Where the optional C extension is loaded, for the server's transport and the clients alike.

`sbus._speedups` (recvmmsg/sendmmsg batches) is built when a compiler is there; without it,
or with ``SBUS_PURE_PYTHON=1``, everything runs on the pure path with the same results.
This module imports no Twisted, so the blocking and asyncio clients can use it too.
"""

from __future__ import annotations

import os

__all__ = ["load"]


def load():
    """The extension module, or None when it is not built or SBUS_PURE_PYTHON=1."""
    if os.environ.get("SBUS_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from sbus import _speedups
    except ImportError:
        return None
    return _speedups
