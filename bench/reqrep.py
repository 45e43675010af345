#!/usr/bin/env python3
"""Request/reply round trip against plain publish/subscribe round trips (docs/request-reply.md).

    .venv/bin/python bench/reqrep.py [--count N] [--address PATH]

Starts a bus (``python -m sbus.server.sbusd -f``) unless --address names one, then times,
one message at a time, with the blocking client (the responder and the echoer in a forked
process of their own):

* ``pubsub-self``: publish on a key the same client holds, wait for the echo (one crossing of
  the server: what `sbus ping` measures);
* ``pubsub-pair``: publish to a second client that publishes an answer back (two crossings:
  the plain publish/subscribe equivalent of a request and its reply);
* ``request``: `Client.request` to a `Client.serve` responder (two crossings, plus the
  responder's parse and the reply matching).

Prints the median and 90th percentile of each in microseconds and the ratios request /
pubsub-pair and request / pubsub-self (issue 26: request/reply within 2x a plain
publish/subscribe round trip). Exit status 0; 1 if a round trip failed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import multiprocessing
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sbus.client import Client, Message  # noqa: E402


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def time_pubsub_self(address, n):
    with Client(address) as c:
        key = c.whoami(5) + b"/bench/self"
        c.subscribe(key)
        c.sync(5)
        out = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            c.publish(key, b"%d" % i)
            while True:
                m = c.receive(timeout=10)
                if type(m) is Message and m.key == key:
                    break
            out.append((time.perf_counter_ns() - t0) / 1000)
        return out


def _other_process(target, *args):
    """Run target(ready, *args) in a forked process; return it once `ready` is set."""
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=target, args=(ready, *args), daemon=True)
    p.start()
    if not ready.wait(10):
        raise TimeoutError("the other process did not start")
    return p


def _echoer(ready, address, n):
    with Client(address) as e:
        e.echo(False)
        e.subscribe(b"bench/ping")
        e.sync(5)
        ready.set()
        for _ in range(n):
            m = e.receive(timeout=10)
            e.publish(b"bench/pong", m.payload)


def _responder(ready, address, n):
    with Client(address) as r:
        r.serve(b"bench/req", lambda k, b: b, count=n, ready=ready.set)


def time_pubsub_pair(address, n):
    t = _other_process(_echoer, address, n)
    with Client(address) as c:
        c.subscribe(b"bench/pong")
        c.sync(5)
        out = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            c.publish(b"bench/ping", b"%d" % i)
            while True:
                m = c.receive(timeout=10)
                if type(m) is Message and m.key == b"bench/pong":
                    break
            out.append((time.perf_counter_ns() - t0) / 1000)
    t.join(10)
    return out


def time_request(address, n):
    t = _other_process(_responder, address, n)
    with Client(address) as c:
        c.request(b"bench/req", b"warm-up-not-counted", timeout=10)  # the first sets up the reply inbox
        out = []
        for i in range(n - 1):
            t0 = time.perf_counter_ns()
            c.request(b"bench/req", b"%d" % i, timeout=10)
            out.append((time.perf_counter_ns() - t0) / 1000)
    t.join(10)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=2000, help="round trips per kind (default 2000)")
    ap.add_argument("--address", help="an existing bus (default: start one)")
    args = ap.parse_args()
    server = None
    tmp = tempfile.mkdtemp(prefix="sbus-bench-reqrep-")
    address = args.address
    try:
        if address is None:
            address = os.path.join(tmp, "bus.socket")
            server = subprocess.Popen([sys.executable, "-m", "sbus.server.sbusd", "-f", "-a", address],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            server.stdout.read()  # ready when its standard output ends
        results = {}
        # interleaved, so that a change of machine load hits every kind alike
        for _ in range(2):
            for name, fn in (("pubsub-self", time_pubsub_self), ("pubsub-pair", time_pubsub_pair),
                             ("request", time_request)):
                results.setdefault(name, []).extend(fn(address, args.count // 2))
        med = {k: statistics.median(v) for k, v in results.items()}
        for k, v in results.items():
            print(f"{k:12} {len(v):6d} round trips: median {med[k]:8.1f} µs, p90 {percentile(v, 0.9):8.1f} µs")
        print(f"request / pubsub-pair: {med['request'] / med['pubsub-pair']:.2f}x; "
              f"request / pubsub-self: {med['request'] / med['pubsub-self']:.2f}x")
        return 0
    except (OSError, TimeoutError) as e:
        print(f"bench/reqrep.py: {e}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.terminate()
            server.wait()
        try:
            os.rmdir(tmp)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
