"""Secrets are not inherited: once the process that connected has exited, its pid
may belong to someone else, so the connection (held on by another process) gets
no secret key any more and may not subscribe to one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from helpers import connect, msg, send, sync

# The owner connects, optionally subscribes its own secret space and `marker`,
# hands the socket to a holder process (sharing our stdin/stdout), prints its
# whoami and exits. The holder obeys commands on stdin.
OWNER = textwrap.dedent("""
    import socket, subprocess, sys
    address, subscribe_first, holder = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(address)
    def whoami():
        s.send(b"CMSG !/cred/whoami")
        while True:
            p = s.recv(65536)
            if p.startswith(b"CMSG !/cred/whoami\\0"):
                return p.split(b"\\0", 1)[1]
    who = whoami()
    if subscribe_first:
        s.send(b"SUB " + who + b"/")
        s.send(b"SUB marker")
        whoami()
    subprocess.Popen([sys.executable, "-c", holder, str(s.fileno())], pass_fds=[s.fileno()])
    print(who.decode(), flush=True)
""")

HOLDER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(fileno=int(sys.argv[1]))
    s.settimeout(10)
    def out(text):
        print(text, flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        try:
            if cmd == "sub":
                s.send(b"SUB " + arg.encode())
            elif cmd == "sync":
                s.send(b"CMSG !/cred/whoami")
                while True:
                    p = s.recv(65536)
                    if not p:  # closed: end of file when the server had read all we sent
                        raise ConnectionResetError
                    if p.startswith(b"CMSG !/cred/whoami"):
                        break
                out("synced")
            elif cmd == "recv-until":
                keys = []
                while True:
                    p = s.recv(65536)
                    if not p:
                        raise ConnectionResetError
                    key = p[4:].split(b"\\0", 1)[0].decode()
                    keys.append(key)
                    if key == arg:
                        break
                out(" ".join(keys))
        except (ConnectionResetError, BrokenPipeError):
            out("closed")
            break
""")


def start_owner(bus, subscribe_first: bool):
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, bus.address, "1" if subscribe_first else "0", HOLDER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    who = proc.stdout.readline().strip()
    assert who.startswith("!/cred/")
    assert proc.wait(10) == 0  # the owner is gone (and reaped); the holder keeps its socket
    return proc, who


def ask(proc, command: str) -> str:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


@pytest.mark.timeout(30)
def test_a_connection_whose_owner_exited_cannot_subscribe_to_its_secret_keys(bus):
    proc, who = start_owner(bus, subscribe_first=False)
    try:
        proc.stdin.write(f"sub {who}/\n")
        assert ask(proc, "sync") == "closed"
        bus.wait_log("has exited, its pid is not this connection's any more")
    finally:
        proc.stdin.close()


@pytest.mark.timeout(30)
def test_secret_keys_stop_reaching_a_connection_whose_owner_exited(bus):
    proc, who = start_owner(bus, subscribe_first=True)
    try:
        publisher = connect(bus.address)
        send(publisher, msg(f"{who}/secret", b"for the owner only"), msg("marker", b""))
        sync(publisher)
        assert ask(proc, "recv-until marker") == "marker"
        bus.wait_log("the process that connected has exited")
    finally:
        proc.stdin.close()


@pytest.mark.timeout(30)
def test_while_the_owner_lives_its_secret_keys_reach_it(bus):
    """The control case: the same holder arrangement, with the owner still alive."""
    script = OWNER.replace(
        'print(who.decode(), flush=True)',
        'print(who.decode(), flush=True)\nimport signal\nsignal.sigwait([signal.SIGTERM])',
    )
    proc = subprocess.Popen([sys.executable, "-c", script, bus.address, "1", HOLDER],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        who = proc.stdout.readline().strip()
        publisher = connect(bus.address)
        send(publisher, msg(f"{who}/secret", b"x"), msg("marker", b""))
        sync(publisher)
        assert ask(proc, "recv-until marker") == f"{who}/secret marker"
    finally:
        proc.terminate()
        proc.stdin.close()
        proc.wait(10)
