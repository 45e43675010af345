#!/usr/bin/env python3
"""Work queues through `kill -9`: sbus-queue --store against NATS JetStream, same machine, same work.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python bench/queue_kill.py [--jobs N] [--rounds R]

Per round, alternating, on each system: a producer process submits N jobs (100 B) in confirmed
batches of 100, paced to 2,500 jobs/s and retrying a batch that was not confirmed; 4 worker
processes each record a job as it arrives (key, delivery count, time), work 1 ms, acknowledge,
and record it done. Once 5,000 jobs are confirmed the queue service is killed with `kill -9`
and started again with the same command; once 12,000 are, a worker is killed with `kill -9`
and started again. Then it waits until every confirmed job is done (60 s at most).

* sbus: `sbusd`, `twistd sbus-queue --store DIR --ack-wait 5 --max-deliveries 5`,
  `Client.submit`, `Client.join` workers.
* JetStream: `nats-server -js -sd DIR`, a file-storage stream on jobs.>, one durable
  explicit-ack pull consumer shared by the workers (`ack_wait=5`, `max_deliver=5`, fetch 64),
  `js.publish` 100 at a time with `asyncio.gather`, each confirmed by its PubAck.

Prints per system, medians over the rounds: jobs lost (confirmed, never done), jobs done twice
(done lines beyond the first; of them, the jobs whose first ack went to a live service that
had delivered it, i.e. acked 0.1 s or more before the service's kill or delivered after its
restart, and
the jobs done twice with a delivery count of 1 both times: submitted twice, or their count
lost), and the redelivery delay after the worker's kill: from the kill
to the arrival at another worker of the jobs the victim had received and not acknowledged
(first and last of them). With QUEUE_KILL_DEBUG=1 in the environment it prints the records of
each job lost, or done twice after its ack reached the service.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from queue_jetstream import free_port, wait_log  # noqa: E402

BATCH = 100
PACE = 2500.0        # jobs/s the producer submits at most
WORK = 0.001         # seconds of work per job
KILL_SERVICE_AT = 5000
KILL_WORKER_AT = 12000
#: An ack sent this long before the service's kill has reached it (read, and journalled).
ACK_MARGIN = 0.1


async def _quiet(e) -> None:
    """nats-py's error callback: the server's kill is expected (its default prints each error)."""


def _record(fd, kind: bytes, key: bytes, n: int) -> None:
    os.write(fd, b"%s %s %d %.6f\n" % (kind, key, n, time.monotonic()))


# -- the processes --------------------------------------------------------------------------


def sbus_worker(address: str, out: str) -> None:
    from sbus.client import Client

    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    with Client(address) as c:
        w = c.join("jobs", timeout=30)
        print("joined", flush=True)
        while True:
            got = [w.next()]
            while len(got) < 64:  # what is at hand, as a JetStream fetch returns it
                try:
                    got.append(w.next(timeout=0))
                except TimeoutError:
                    break
            for d in got:
                _record(fd, b"got", d.key, d.deliveries)
            for d in got:
                time.sleep(WORK)
                _record(fd, b"done", d.key, d.deliveries)  # done, then acked: a kill between is redone
                w.ack(d)


def js_worker(url: str, out: str) -> None:
    import nats

    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    async def run():
        nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=_quiet)
        js = nc.jetstream()
        psub = await js.pull_subscribe("jobs.>", durable="workers")
        print("joined", flush=True)
        while True:
            try:
                msgs = await psub.fetch(64, timeout=1)
            except Exception:  # a timeout, or the server away: fetch again
                await asyncio.sleep(0.01)
                continue
            for m in msgs:
                _record(fd, b"got", m.subject.encode(), m.metadata.num_delivered)
            for m in msgs:
                time.sleep(WORK)
                _record(fd, b"done", m.subject.encode(), m.metadata.num_delivered)
                try:
                    await m.ack()
                except Exception:
                    continue

    asyncio.run(run())


def _paced(jobs: int):
    start = time.monotonic()
    for i in range(0, jobs, BATCH):
        ahead = start + i / PACE - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
        yield i, min(jobs, i + BATCH)


def sbus_producer(address: str, out: str, jobs: int) -> None:
    from sbus.client import Client

    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    payload = b"x" * 100
    with Client(address) as c:
        for lo, hi in _paced(jobs):
            batch = [(b"jobs/%d" % j, payload) for j in range(lo, hi)]
            while True:
                try:
                    c.submit("jobs", batch, timeout=2)
                    break
                except Exception:  # no service (killed), no answer: the batch again
                    time.sleep(0.05)
            os.write(fd, b"%d %d\n" % (lo, hi))


def js_producer(url: str, out: str, jobs: int) -> None:
    import nats

    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    payload = b"x" * 100

    async def run():
        nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2, error_cb=_quiet)
        js = nc.jetstream()
        for lo, hi in _paced(jobs):
            while True:
                try:
                    await asyncio.gather(*(js.publish(f"jobs.{j}", payload, timeout=2, headers={"Nats-Msg-Id": str(j)}) for j in range(lo, hi)))
                    break
                except Exception:
                    await asyncio.sleep(0.05)
            os.write(fd, b"%d %d\n" % (lo, hi))
        await nc.close()

    asyncio.run(run())


# -- the orchestration ----------------------------------------------------------------------


def _confirmed(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(int(b) - int(a) for a, b in (line.split() for line in f.read().splitlines()))
    except FileNotFoundError:
        return 0


def _spawn(*argv) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], stdout=subprocess.PIPE, cwd=ROOT)
    if p.stdout.readline() != b"joined\n":
        raise SystemExit(f"worker {argv} did not join")
    return p


class _System:
    """A queue system under test: `kind` names its worker and producer, `target` is where they connect."""

    kind = target = ""

    def worker(self, out):
        return _spawn("--worker", self.kind, self.target, out)

    def producer(self, out, jobs):
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--producer", self.kind, self.target,
                                 out, str(jobs)], cwd=ROOT)


class Sbus(_System):
    name = "sbus-queue --store"
    kind = "sbus"

    def __init__(self, d: str):
        self.d = d
        self.address = self.target = os.path.join(d, "bus.socket")
        self.server = subprocess.Popen([sys.executable, "-m", "sbus.server.sbusd", "-f", "-a", self.address],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.server.stdout.read()
        self.starts = 0
        self.start_service()

    def start_service(self) -> None:
        self.starts += 1
        log = os.path.join(self.d, f"queue{self.starts}.log")
        with open(log, "wb") as f:
            self.service = subprocess.Popen(
                [sys.executable, "-m", "twisted", "--log-format", "text", "sbus-queue", "--bus", self.address,
                 "--group", "jobs=jobs/", "--store", os.path.join(self.d, "store"), "--ack-wait", "5",
                 "--max-deliveries", "5", "--max-jobs", "100000"], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        wait_log(log, b"control: following the members", self.service)

    def close(self):
        for p in (self.service, self.server):
            p.terminate()
            p.wait()


class JetStream(_System):
    name = "JetStream (file)"
    kind = "js"

    def __init__(self, d: str):
        import shutil

        self.d = d
        self.exe = shutil.which("nats-server") or os.path.join(os.path.dirname(sys.executable), "nats-server")
        self.port = free_port()
        self.url = self.target = f"nats://127.0.0.1:{self.port}"
        self.starts = 0
        self.start_service()

        async def setup():
            import nats
            from nats.js.api import AckPolicy, ConsumerConfig

            nc = await nats.connect(self.url)
            js = nc.jetstream()
            await js.add_stream(name="JOBS", subjects=["jobs.>"], storage="file")
            await js.add_consumer("JOBS", ConsumerConfig(durable_name="workers", ack_policy=AckPolicy.EXPLICIT,
                                                         ack_wait=5, max_deliver=5, max_ack_pending=1000))
            await nc.close()
        asyncio.run(setup())

    def start_service(self) -> None:
        self.starts += 1
        log = os.path.join(self.d, f"nats{self.starts}.log")
        with open(log, "wb") as f:
            self.service = subprocess.Popen([self.exe, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd",
                                             os.path.join(self.d, "js")], stdout=f, stderr=subprocess.STDOUT)
        wait_log(log, b"Server is ready", self.service)

    def close(self):
        self.service.terminate()
        self.service.wait()


def _lines(path):
    with open(path, "rb") as f:
        for line in f.read().splitlines():
            kind, key, n, t = line.split()
            yield kind, key, int(n), float(t)


def one_round(system_class, jobs: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        system = system_class(d)
        outs = [os.path.join(d, f"worker{i}.out") for i in range(4)]
        workers = [system.worker(out) for out in outs]
        victim_out = os.path.join(d, "victim.out")
        confirmed = os.path.join(d, "confirmed")
        producer = system.producer(confirmed, jobs)
        kill_worker_at = None
        try:
            while _confirmed(confirmed) < KILL_SERVICE_AT:
                time.sleep(0.01)
            service_killed = time.monotonic()
            system.service.send_signal(signal.SIGKILL)
            system.service.wait()
            system.start_service()
            service_back = time.monotonic()
            while _confirmed(confirmed) < KILL_WORKER_AT:
                time.sleep(0.01)
            os.rename(outs[0], victim_out)   # the restarted worker writes afresh
            workers[0].send_signal(signal.SIGKILL)
            kill_worker_at = time.monotonic()
            workers[0].wait()
            workers[0] = system.worker(outs[0])
            if producer.wait(300) != 0:
                raise SystemExit(f"{system.name}: the producer failed")
            want = _confirmed(confirmed)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                done = {key for out in outs for kind, key, _, _ in _lines(out) if kind == b"done"}
                done |= {key for kind, key, _, _ in _lines(victim_out) if kind == b"done"}
                if len(done) >= want:
                    break
                time.sleep(0.2)
        finally:
            for w in workers:
                w.kill()
                w.wait()
            if producer.poll() is None:
                producer.kill()
                producer.wait()
            system.close()
        records = [r for out in outs + [victim_out] for r in _lines(out)]
        done_counts: dict[bytes, int] = {}
        firsts: dict[bytes, int] = {}   # done with delivery count 1: more than one is a resubmission
        got_at: dict[bytes, float] = {}
        done_at: dict[bytes, float] = {}
        for kind, key, n, t in records:
            if kind == b"done":
                done_counts[key] = done_counts.get(key, 0) + 1
                firsts[key] = firsts.get(key, 0) + (n == 1)
                done_at[key] = min(t, done_at.get(key, t))
            else:
                got_at[key] = min(t, got_at.get(key, t))
        # done twice although its first ack went to a live service that had delivered it: acked
        # ACK_MARGIN before the service's kill (time to read and journal it), or delivered by the
        # restarted service
        # (the victim's last jobs done but maybe not acked when it was killed do not count)
        victim_last = {key for kind, key, _, t in _lines(victim_out)
                       if kind == b"done" and t > kill_worker_at - ACK_MARGIN}
        reached = sum(1 for key, n in done_counts.items() if n > 1 and key not in victim_last and (
            done_at[key] < service_killed - ACK_MARGIN or got_at[key] > service_back))
        if os.environ.get("QUEUE_KILL_DEBUG"):
            confirmed_keys = set()
            with open(confirmed, "rb") as f:
                for line in f.read().splitlines():
                    lo, hi = map(int, line.split())
                    confirmed_keys.update(b"jobs%s%d" % (b"/" if system_class is Sbus else b".", j) for j in range(lo, hi))
            for key in confirmed_keys - set(done_counts):
                print("LOST", key, [(k.decode(), n, round(t - service_killed, 4)) for k, kk, n, t in records if kk == key],
                      "back", round(service_back - service_killed, 4), "worker", round(kill_worker_at - service_killed, 4))
            for key, n in done_counts.items():
                if n > 1 and key not in victim_last and (
                        done_at[key] < service_killed - ACK_MARGIN or got_at[key] > service_back):
                    print(key, [(k.decode(), n, round(t - service_killed, 4)) for k, kk, n, t in records if kk == key],
                          "back", round(service_back - service_killed, 4), "worker", round(kill_worker_at - service_killed, 4))
        victim = list(_lines(victim_out))
        victim_done = {key for kind, key, _, _ in victim if kind == b"done"}
        unacked = {key for kind, key, _, _ in victim if kind == b"got"} - victim_done
        again = {}
        for out in outs:
            for kind, key, n, t in _lines(out):
                if kind == b"got" and key in unacked and t > kill_worker_at and key not in again:
                    again[key] = t - kill_worker_at
        return {"lost": want - len(done_counts), "twice": sum(n - 1 for n in done_counts.values()),
                "resubmitted": sum(n - 1 for n in firsts.values() if n > 1), "twice_acked": reached,
                "unacked": len(unacked), "redelivered": len(again),
                "first": min(again.values(), default=float("nan")), "last": max(again.values(), default=float("nan"))}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        (sbus_worker if sys.argv[2] == "sbus" else js_worker)(sys.argv[3], sys.argv[4])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--producer":
        (sbus_producer if sys.argv[2] == "sbus" else js_producer)(sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, list] = {Sbus.name: [], JetStream.name: []}
    for r in range(args.rounds):
        for cls in (Sbus, JetStream):
            res = one_round(cls, args.jobs)
            print(f"round {r + 1} {cls.name}: {res}", flush=True)
            results[cls.name].append(res)
    print(f"{args.jobs} jobs, 4 workers, kill -9 of the service and of a worker; medians of {args.rounds} rounds")
    print("| system | jobs lost | done twice | of them, ack had reached the service | of them, a first delivery "
          "both times | victim's unacked jobs | redelivered after the worker's kill, first / last |")
    print("|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        med = {k: statistics.median([r[k] for r in rs if r[k] == r[k]] or [float("nan")]) for k in rs[0]}
        print(f"| {name} | {med['lost']:g} | {med['twice']:g} | {med['twice_acked']:g} | {med['resubmitted']:g} "
              f"| {med['unacked']:g} | "
              f"{med['first']:.2f} / {med['last']:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
