"""Our own clients opt in to the server's extensions (`CMSG server/extensions`) first thing.

A connection that never sends the opt-in sees only the reference protocol (docs/protocol.md):
our clients, the `sbus` command and every service read the server's notices, so each of them
sends it right after connecting. Each case runs a real process against a listening socket of
the test's own and checks the first packet that process sends.
"""

from __future__ import annotations

import signal
import socket
import sys

import pytest

from helpers import SERVICE_TIMEOUT, LoggedProcess

OPT_IN = b"CMSG server/extensions"

CLIENT = {
    "blocking": "import sbus.client, sys; sbus.client.connect(sys.argv[1]).publish('k', 'v')",
    "asyncio": ("import asyncio, sys, sbus.client.asyncio as a\n"
                "async def main():\n"
                "    bus = await a.connect(sys.argv[1])\n"
                "    await bus.publish('k', 'v')\n"
                "asyncio.run(main())"),
    # connects once the reactor runs (its SIGINT handler in place): a SIGINT during a connect
    # made before reactor.run() ends in the connect's Deferred, and the process ran on 30 s
    "twisted": ("import sys\n"
                "from twisted.internet import reactor\n"
                "from sbus.client.twisted import connect\n"
                "reactor.callWhenRunning(connect, reactor, sys.argv[1])\n"
                "reactor.callLater(30, reactor.stop)\n"
                "reactor.run()"),
}

COMMANDS = {
    **{f"client-{name}": [sys.executable, "-c", code, "{bus}"] for name, code in CLIENT.items()},
    "sbus pub": [sys.executable, "-m", "sbus.cli", "pub", "--bus", "{bus}", "k", "v"],
    "sbus-record": [sys.executable, "-m", "twisted", "sbus-record", "--bus", "{bus}",
                    "--out", "{tmp}/rec"],
    "sbus-msgbus": [sys.executable, "-m", "twisted", "sbus-msgbus", "--bus", "{bus}",
                    "--port", "tcp:0:interface=127.0.0.1"],
    "sbus-relay": [sys.executable, "-m", "twisted", "sbus-relay", "--bus", "{bus}",
                   "--socket", "{tmp}/relay.socket"],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_first_packet_is_the_opt_in(tmp_path, name):
    path = str(tmp_path / "fake.socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(4)
    server.settimeout(SERVICE_TIMEOUT * 3)
    argv = [a.format(bus=path, tmp=tmp_path) for a in COMMANDS[name]]
    proc = LoggedProcess(argv, tmp_path / "proc.log", cwd=tmp_path)
    try:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            raise AssertionError(f"{name} never connected:\n{proc.log()[-2000:]}") from None
        with conn:
            conn.settimeout(SERVICE_TIMEOUT)
            first = conn.recv(65536)
        assert first == OPT_IN, (name, first[:60])
    finally:
        # the fake bus goes first: a process whose next connection waits in its backlog, never
        # answered (sbus-record's stats connection), is not kept from stopping by that
        server.close()
        status = proc.stop()
    # the SIGINT lands while a service starts (it connects from startService, before its reactor
    # runs): Python's KeyboardInterrupt was swallowed by a Deferred, and sbus-relay ran on until
    # it was killed 30 s later
    assert status != -signal.SIGKILL, f"{name} did not stop on SIGINT:\n{proc.log()[-1500:]}"
