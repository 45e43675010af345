#!/usr/bin/env python3
"""Micro-benchmark of the ways to move a batch of SEQPACKET packets from Python.

    python bench/batchio.py [--batch 64] [--size 64] [--seconds 2]

Over one socketpair: send BATCH packets of SIZE bytes, then receive them,
repeatedly, and report the cost per packet of each variant (send and receive
side measured separately, alternating variants, median of 5):

* ``pure``: ``socket.send`` and ``socket.recv_into`` + one copy, per packet
  (the pure-Python transport);
* ``ctypes``: libc ``sendmmsg``/``recvmmsg`` through ctypes, arrays prepared
  once, one ``bytes`` copy per packet;
* ``cext``: ``sbus._speedups.send_batch``/``recv_batch``.

This chose the C extension (docs/performance.md has the figures).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MSG_DONTWAIT, MSG_TRUNC, MSG_NOSIGNAL = 0x40, 0x20, 0x4000


class iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class msghdr(ctypes.Structure):
    _fields_ = [("msg_name", ctypes.c_void_p), ("msg_namelen", ctypes.c_uint32),
                ("msg_iov", ctypes.POINTER(iovec)), ("msg_iovlen", ctypes.c_size_t),
                ("msg_control", ctypes.c_void_p), ("msg_controllen", ctypes.c_size_t),
                ("msg_flags", ctypes.c_int)]


class mmsghdr(ctypes.Structure):
    _fields_ = [("msg_hdr", msghdr), ("msg_len", ctypes.c_uint)]


class CtypesBatch:
    """recvmmsg/sendmmsg through ctypes: the best a pure-Python-install can do."""

    def __init__(self, batch: int, size: int):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.recvmmsg, self.sendmmsg = libc.recvmmsg, libc.sendmmsg
        self.recvmmsg.argtypes = [ctypes.c_int, ctypes.POINTER(mmsghdr), ctypes.c_uint,
                                  ctypes.c_int, ctypes.c_void_p]
        self.sendmmsg.argtypes = [ctypes.c_int, ctypes.POINTER(mmsghdr), ctypes.c_uint, ctypes.c_int]
        self.batch, self.size = batch, size
        self.buf = ctypes.create_string_buffer(batch * size)
        self.riov = (iovec * batch)()
        self.rmsgs = (mmsghdr * batch)()
        base = ctypes.addressof(self.buf)
        for i in range(batch):
            self.riov[i].iov_base = base + i * size
            self.riov[i].iov_len = size
            self.rmsgs[i].msg_hdr.msg_iov = ctypes.pointer(self.riov[i])
            self.rmsgs[i].msg_hdr.msg_iovlen = 1
        self.siov = (iovec * batch)()
        self.smsgs = (mmsghdr * batch)()
        for i in range(batch):
            self.smsgs[i].msg_hdr.msg_iov = ctypes.pointer(self.siov[i])
            self.smsgs[i].msg_hdr.msg_iovlen = 1
        self.view = memoryview(self.buf).cast("B")

    def recv(self, fd: int) -> list:
        n = self.recvmmsg(fd, self.rmsgs, self.batch, MSG_DONTWAIT | MSG_TRUNC, None)
        if n < 0:
            return []
        view, size, msgs = self.view, self.size, self.rmsgs
        return [view[i * size:i * size + msgs[i].msg_len].tobytes() for i in range(n)]

    def send(self, fd: int, packets: list) -> int:
        siov = self.siov
        keep = []
        for i, p in enumerate(packets):
            b = ctypes.c_char_p(p)
            keep.append(b)
            siov[i].iov_base = ctypes.cast(b, ctypes.c_void_p)
            siov[i].iov_len = len(p)
        return self.sendmmsg(fd, self.smsgs, len(packets), MSG_NOSIGNAL | MSG_DONTWAIT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a_sock, b_sock):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.setblocking(False)
    fa, fb = a_sock.fileno(), b_sock.fileno()
    packets = [b"MSG bench/x/y\0" + bytes(a.size) for _ in range(a.batch)]
    slot = 409600
    rbuf = memoryview(bytearray(slot))

    def pure_send():
        send = a_sock.send
        for p in packets:
            send(p)

    def pure_recv():
        recv_into = b_sock.recv_into
        out = []
        for _ in range(a.batch):
            n = recv_into(rbuf, slot, MSG_TRUNC)
            out.append(rbuf[:n].tobytes())
        return out

    variants = {"pure": (pure_send, pure_recv)}
    try:
        ct = CtypesBatch(a.batch, slot)
        variants["ctypes"] = (lambda: ct.send(fa, packets), lambda: ct.recv(fb))
    except (OSError, AttributeError) as e:
        print(f"ctypes variant unavailable: {e}", file=sys.stderr)
    try:
        from sbus import _speedups
        variants["cext"] = (lambda: _speedups.send_batch(fa, packets),
                            lambda: _speedups.recv_batch(fb, a.batch, slot))
    except ImportError:
        print("sbus._speedups not built (python setup.py build_ext --inplace)", file=sys.stderr)

    res: dict[str, dict[str, list[float]]] = {v: {"send": [], "recv": []} for v in variants}
    for _ in range(a.rounds):
        for name, (snd, rcv) in variants.items():
            ts = tr = 0.0
            n = 0
            end = time.perf_counter() + a.seconds
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                snd()
                t1 = time.perf_counter()
                got = rcv()
                t2 = time.perf_counter()
                assert len(got) == a.batch, (name, len(got))
                ts += t1 - t0
                tr += t2 - t1
                n += a.batch
            res[name]["send"].append(ts / n * 1e9)
            res[name]["recv"].append(tr / n * 1e9)
    print(f"batch {a.batch}, {len(packets[0])}-byte packets, ns per packet (median of {a.rounds}):")
    print(f"{'variant':8} {'send':>8} {'recv':>8} {'total':>8}")
    for name, d in res.items():
        s, r = statistics.median(d["send"]), statistics.median(d["recv"])
        print(f"{name:8} {s:8.0f} {r:8.0f} {s + r:8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
