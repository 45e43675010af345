"""Replay a fast burst onto a subscriber in the bus's default flood mode: how much it loses.

    python bench/replay_burst.py [--messages 600000] [--speed 10] [--work DIR]

Writes a synthetic recording (``--messages`` rows 10 µs apart: 100,000 msg/s
recorded), starts ``sbusd`` and one subscriber process in the default flood
mode (soft queue, hard discard, 16,384 packets) that counts what it gets,
then runs ``sbus-replay --speed S`` twice: with ``--lossy`` (no pacing: what
replay did before issue 15) and with the default (paced by the subscribers'
queues). Prints, per run: wall time, messages received, lost, and replay's
stderr warnings. Docs: docs/pipeline.md, "Replay".
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def subscriber(address: str, expect: int) -> None:
    """Child: count messages until `expect` or 5 s of silence; print the count."""
    import sbus.client

    with sbus.client.connect(address) as c:
        c.subscribe(b"burst/")
        c.sync(timeout=10)
        print("ready", flush=True)
        n = 0
        try:
            for _ in c.messages(timeout=5):
                n += 1
                if n == expect:
                    break
        except TimeoutError:
            pass
        print(n, flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--messages", type=int, default=600_000)
    p.add_argument("--speed", default="10")
    p.add_argument("--work", default=None)
    p.add_argument("--subscriber", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.subscriber:
        subscriber(args.subscriber[0], int(args.subscriber[1]))
        return 0
    from sbus.pipeline.writer import RecordingWriter

    work = args.work or tempfile.mkdtemp(prefix="sbus-replay-burst-")
    rec = os.path.join(work, "rec")
    shutil.rmtree(rec, ignore_errors=True)
    w = RecordingWriter(rec, fsync=False)
    t0 = 1_700_000_000_000_000
    w.extend((t0 + i * 10, i + 1, b"burst/%d" % (i % 7), b"%08d" % i) for i in range(args.messages))
    w.close()
    address = os.path.join(work, "bus.socket")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bus = subprocess.Popen([sys.executable, "-m", "sbus.server.sbusd", "-f", "-r", "-a", address],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    bus.stdout.read()  # closed when listening
    try:
        for mode in (["--lossy"], []):
            sub = subprocess.Popen([sys.executable, __file__, "--subscriber", address, str(args.messages)],
                                   stdout=subprocess.PIPE, text=True, env=env)
            assert sub.stdout.readline().strip() == "ready"
            t = time.monotonic()
            r = subprocess.run([sys.executable, "-m", "sbus.pipeline.replay", rec, "--bus", address,
                                "--speed", args.speed, "--progress", "never", *mode],
                               capture_output=True, text=True, env=env)
            took = time.monotonic() - t
            got = int(sub.stdout.readline() or 0)
            sub.wait()
            warnings = [ln for ln in r.stderr.splitlines() if "replayed" not in ln]
            print(f"{' '.join(mode) or 'default (paced)':16} replay {took:6.1f} s  received {got:,} of "
                  f"{args.messages:,}  lost {args.messages - got:,}  warnings {len(warnings)}")
            for ln in warnings[:3] + (["..."] if len(warnings) > 4 else []) + warnings[-1:] * (len(warnings) > 3):
                print("    " + ln)
    finally:
        bus.terminate()
        bus.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
