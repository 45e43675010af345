#!/usr/bin/env python3
"""Router cost per message, in process (no sockets): the hot path and the attacks of issue 10.

    .venv/bin/python bench/router.py            # this tree's sbus.core.router
    .venv/bin/python bench/router.py --module some_module   # another Router, for before/after

* cache hit: `Router.match` on a cached key (the hot path of every delivery);
* cache miss: the trie walk for a key (cache cleared each time);
* keys containing '*', each different (never cached), among 50,000 subscriptions;
* unique 4 KiB keys (too long to cache) and a repeated 64 KiB key.

Times are CPU seconds (time.process_time / timeit minimum of repeats); on a
shared machine compare runs made side by side.
"""

from __future__ import annotations

import argparse
import importlib
import time
import timeit


def per_message(router, keys) -> float:
    start = time.process_time()
    for k in keys:
        router.match(k)
    return (time.process_time() - start) / len(keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", default="sbus.core.router", help="module with the Router to measure")
    ap.add_argument("--star-keys", type=int, default=2000, help="keys with '*' to route (old router: use ~30)")
    args = ap.parse_args()
    Router = importlib.import_module(args.module).Router

    r = Router()
    for i in range(200):
        r.add_client(("c", i), None)
    r.subscribe(("c", 0), b"app/*/temp")
    r.subscribe(("c", 1), b"app/x/")
    for i in range(1, 200):
        r.subscribe(("c", i), b"sensor/%d/*" % i)
    key = b"app/x/temp"
    r.match(key)
    n = 500_000
    hit = min(timeit.repeat(lambda: r.match(key), number=n, repeat=7)) / n
    clear = getattr(r, "clear_cache", None) or r._cache.clear

    def miss():
        clear()
        return r.match(key)

    m = 50_000
    walk = (min(timeit.repeat(miss, number=m, repeat=5)) - min(timeit.repeat(clear, number=m, repeat=5))) / m
    print(f"cache hit:                        {hit * 1e9:8.0f} ns/match")
    print(f"cache miss (trie walk):           {walk * 1e9:8.0f} ns/match")

    big = Router()
    for i in range(50_000):
        big.add_client(i, None)
        big.subscribe(i, b"sensor/%d/*" % i)
    big.add_client("w", None)
    big.subscribe("w", b"sensor/*/")
    k = args.star_keys
    print("among 50,000 subscriptions:")
    print(f"  key with '*', each different:   {per_message(big, [b'sensor/%d/x*%d' % (i % 50000, i) for i in range(k)]) * 1e6:8.1f} us/message")
    print(f"  key without '*', each different:{per_message(big, [b'sensor/%d/x%d' % (i % 50000, i) for i in range(2000)]) * 1e6:8.1f} us/message")
    print(f"  4 KiB key, each different:      {per_message(big, [b'sensor/5/%d' % i + b'y' * 4096 for i in range(2000)]) * 1e6:8.1f} us/message")
    print(f"  64 KiB key, repeated:           {per_message(big, [b'sensor/5/' + b'y' * 65536] * 200) * 1e6:8.1f} us/message")


if __name__ == "__main__":
    main()
