"""Run a twistd service of the project as another uid: ``python run_as_user.py UID twistd-args...``.

The interpreter of the test environment may live where another uid cannot
read it (a home directory of mode 0700), so that uid cannot start Python
itself. This wrapper starts as root, imports what twistd and the sbus
plugins need (standard library included), then drops to UID (gid UID, no
supplementary groups) *before* reading any argument, opening any socket or
file, and runs ``twistd ARGS`` in-process: the service runs with exactly
that uid's rights.
"""

import os
import sys


def main() -> None:
    uid = int(sys.argv[1])
    args = sys.argv[2:]
    # everything the services import lazily, imported while still root
    import asyncio  # noqa: F401
    import hashlib  # noqa: F401
    import hmac  # noqa: F401
    import json  # noqa: F401
    import secrets  # noqa: F401
    import shlex  # noqa: F401
    import ssl  # noqa: F401
    import syslog  # noqa: F401

    from twisted.application import app, internet, service  # noqa: F401
    from twisted.internet import epollreactor, endpoints, ssl as tssl  # noqa: F401
    from twisted.logger import textFileLogObserver  # noqa: F401
    from twisted.plugin import IPlugin, getPlugins
    from twisted.python import logfile, syslog as tsyslog  # noqa: F401
    from twisted.scripts import _twistd_unix, twistd  # noqa: F401

    list(getPlugins(IPlugin))
    import sbus.services.bridge  # noqa: F401
    import sbus.services.link  # noqa: F401
    import sbus.services.msgbus  # noqa: F401
    import sbus.services.relay  # noqa: F401

    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    os.chdir("/")
    sys.argv = ["twistd", *args]
    twistd.run()


if __name__ == "__main__":
    main()
