"""pyfloor: the least a sbus server written in Python can do per message, for bench/run.py
(`--floor-python`) to set beside our server and the reference in the same run.

    python bench/pyfloor.py SOCK

One process, no Twisted: a level-triggered `select.epoll` loop, our C extension's
`recv_batch`/`send_batch` (recvmmsg/sendmmsg) for every read and send, and a dict from
exact key to the subscribers' descriptors. No patterns, no secrets, no flood control, no
queues, no accounting: what is left is the Python interpreter's own cost of a wakeup (the
poll's list, a loop, a call, a slice, a dict lookup). Whatever our server costs above this is
ours to cut; what this costs above the C reference no Python server can remove (docs/
performance.md, "The round trip under load"). Runs until killed.
"""

from __future__ import annotations

import os
import select
import socket
import sys


def main(path: str) -> int:
    try:
        from sbus._speedups import recv_batch, send_batch
    except ImportError:
        print("pyfloor: needs the C extension (pip install -e . with a compiler)", file=sys.stderr)
        return 2
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(128)
    listener.setblocking(False)
    lfd = listener.fileno()
    ep = select.epoll()
    ep.register(lfd, select.EPOLLIN)
    conns: dict[int, socket.socket] = {}
    subs: dict[bytes, list[int]] = {}
    while True:
        for fd, _ in ep.poll():
            if fd == lfd:
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(False)
                conns[conn.fileno()] = conn
                ep.register(conn.fileno(), select.EPOLLIN)
                continue
            try:
                packets = recv_batch(fd, 64, 65536)
            except OSError:
                packets = [b""]
            for p in packets:
                if p.__class__ is int:
                    continue
                if not p:  # the peer closed
                    ep.unregister(fd)
                    conns.pop(fd).close()
                    for fds in subs.values():
                        while fd in fds:
                            fds.remove(fd)
                    break
                end = p.find(b"\0")
                if p.startswith(b"MSG "):
                    for to in subs.get(p[4:end], ()):
                        try:
                            send_batch(to, [p])
                        except OSError:
                            pass
                elif p.startswith(b"SUB "):
                    subs.setdefault(p[4:end if end >= 0 else None], []).append(fd)
                elif p.startswith(b"UNSUB "):
                    fds = subs.get(p[6:end if end >= 0 else None])
                    if fds and fd in fds:
                        fds.remove(fd)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: pyfloor.py SOCK", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
