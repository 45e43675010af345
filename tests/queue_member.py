"""A work-queue member for the tests: ``python queue_member.py ADDRESS GROUP OUT [--never-ack]``.

Joins GROUP, and for each delivery writes ``KEY DELIVERIES`` as a line to OUT, flushed to the
file *before* it acknowledges (so a line exists for every acknowledged message, even after a
``kill -9``). Acknowledges in batches of what is at hand (at most 32). Prints ``joined`` on
standard output once the service said hello. With --never-ack it records and never acknowledges.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sbus.client import connect  # noqa: E402


def main() -> None:
    address, group, out = sys.argv[1:4]
    never_ack = "--never-ack" in sys.argv[4:]
    bus = connect(address)
    worker = bus.join(group, timeout=10)
    print("joined", flush=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    batch = []
    while True:
        try:
            d = worker.next(timeout=0 if batch else None)
        except TimeoutError:
            d = None
        if d is not None:
            batch.append(d)
        if batch and (d is None or len(batch) >= 32):
            os.write(fd, b"".join(b"%s %d\n" % (x.key, x.deliveries) for x in batch))
            if not never_ack:
                worker.ack(*batch)
            batch = []


if __name__ == "__main__":
    main()
