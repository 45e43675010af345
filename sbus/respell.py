"""One spelling per idea across commands (issue 34), and the old spellings still understood.

Every command that connects to a bus names it ``--bus`` (``-b``); a bridge's two buses are
``--bus-a`` and ``--bus-b``; a server's own listening socket is ``--socket`` (``sbusd`` keeps
the reference server's ``-a``). Plain TCP is allowed by ``--allow-plain``; a statistics line
comes every ``--stats-interval``; reconnecting waits ``--initial-delay``, then up to
``--max-delay``. An old spelling still works, with one warning line naming the new one, as
Mosquitto and nats-server keep renamed options working for a while. No Twisted here: the
``sbus`` command uses it too.
"""

from __future__ import annotations

import sys

__all__ = ["respell"]


def respell(argv: list[str], renamed: dict[str, str], prog: str) -> list[str]:
    """`argv` with the old spellings in `renamed` (old -> new, ``--name`` or ``-x``) replaced,
    one warning line on standard error per old spelling used; ``--`` ends the options."""
    out: list[str] = []
    warned: set[str] = set()
    for i, arg in enumerate(argv):
        if arg == "--":
            out.extend(argv[i:])
            break
        name, eq, value = arg.partition("=")
        new = renamed.get(name)
        if new is None and len(arg) > 2 and arg[0] == "-" and arg[1] != "-":
            new = renamed.get(arg[:2])  # -sVALUE
            if new is not None:
                name, eq, value = arg[:2], "", arg[2:]
        if new is not None:
            if name not in warned:
                warned.add(name)
                _warn(f"{prog}: {name} is an old spelling, deprecated: use {new}")
            arg = new + eq + value
        out.append(arg)
    return out


def _warn(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
