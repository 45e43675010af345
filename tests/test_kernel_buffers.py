"""The server's kernel send buffers are small and counted (issue 33 item 7).

The server sized SO_SNDBUF of every accepted socket to the packet limit, so each connection
that never reads pinned about 880 KB of kernel memory outside every cap (400 of one uid:
453 MiB while `queued_bytes` sat at the uid's 64 MiB). Now it is kept at
`sbus.seqpacket.SERVER_SNDBUF` (128 KiB as the kernel counts it) and raised only for the send of
one packet that does not fit. What the kernel holds is read from `ss -x -m` (its `t`, bytes
queued to send, and `tb`, SO_SNDBUF, of each of the server's accepted sockets).
"""

from __future__ import annotations

import os
import re
import select
import shutil
import socket
import subprocess
import threading

import pytest

from helpers import connect, msg, recv, run_as, send, stats, sub, sync, unique, wait_until

ATTACKER = 65534
CONNECTIONS = 200

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")


def server_send_queues(address: str) -> list[tuple[int, int]]:
    """(bytes queued to send, SO_SNDBUF) of each connection the server at `address` accepted."""
    out = subprocess.run(["ss", "-x", "-m", "-H", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    found = []
    for line in re.split(r"\n(?=\S)", out):
        fields = line.split()
        if len(fields) > 4 and fields[3] == address:
            m = re.search(r"skmem:\(r\d+,rb\d+,t(\d+),tb(\d+)", line)
            if m:
                found.append((int(m.group(1)), int(m.group(2))))
    return found


def _hold_not_reading(address: str, key: bytes, ready_w: int, stop_r: int) -> str:
    """As uid 65534: CONNECTIONS connections subscribed to `key` that never read after that."""
    conns = []
    for _ in range(CONNECTIONS):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        c.connect(address)
        c.settimeout(60)
        c.send(sub(key))
        conns.append(c)
    for c in conns:
        c.send(b"CMSG !/cred/whoami")
        while not c.recv(1 << 16).startswith(b"CMSG !/cred/whoami"):
            pass
    os.write(ready_w, b"r")
    select.select([stop_r], [], [], 300)
    return "held"


@pytest.mark.timeout(180)
def test_connections_of_one_uid_that_never_read_pin_little_kernel_memory(start_bus, shared_dir):
    address = os.path.join(shared_dir, "bus.socket")
    start_bus("-o", address=address)
    key = unique("kbuf/").encode()
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    result = []
    t = threading.Thread(target=lambda: result.append(run_as(
        ATTACKER, ATTACKER, lambda: _hold_not_reading(address, key, ready_w, stop_r))), daemon=True)
    t.start()
    try:
        assert select.select([ready_r], [], [], 120)[0], f"the non-readers never got ready: {result}"
        p = connect(address, big=True, timeout=60)
        payload = b"x" * 1000
        for _ in range(1200):  # 1.2 MB for each: more than the 880 KB a socket took before
            send(p, msg(key, payload))
        sync(p, timeout=120)

        def all_full():  # every non-reader's socket refused: the rest is queued or dropped
            rows = [q for q in stats(p, timeout=30)["queues"] if q["uid"] == ATTACKER]
            return len(rows) == CONNECTIONS and all(q["queued_bytes"] or sum(q["drops"].values()) for q in rows)

        wait_until(all_full, "every non-reader's kernel send buffer full", timeout=60)
        queues = server_send_queues(address)
        p.close()
    finally:
        os.write(stop_w, b"s")
        t.join(60)
    assert result == ["held"], result
    held = sorted(queues, reverse=True)[:CONNECTIONS]  # (the publisher's own socket holds nothing)
    assert len(held) == CONNECTIONS, queues
    pinned = sum(q for q, _ in held)
    # Before: about 880 KB each (177 MB for 200); now at most twice SERVER_SNDBUF's 128 KiB.
    assert pinned <= CONNECTIONS * (256 << 10), f"{pinned} bytes in the kernel for {CONNECTIONS} non-readers"
    assert all(tb <= 128 << 10 for _, tb in held), sorted({tb for _, tb in held})
    assert pinned >= CONNECTIONS * (32 << 10), f"only {pinned} bytes: the sockets were not full"


@pytest.mark.timeout(120)
def test_packets_of_the_size_limit_still_reach_a_reader_and_wait_whole_for_a_non_reader(start_bus):
    """A packet bigger than the server's small SO_SNDBUF is sent with the buffer raised for that send;
    several in a row reach a reader whole and in order, and a subscriber that does not read
    holds at most one of them in the kernel (the rest wait in its queue, counted)."""
    bus = start_bus()
    key = unique("big/").encode()
    reader = connect(bus.address, big=True, timeout=30)
    idle = connect(bus.address, big=True, timeout=30)
    send(reader, sub(key))
    send(idle, sub(key))
    sync(reader)
    sync(idle)
    pub = connect(bus.address, big=True, timeout=30)
    limit = stats(pub)["limits"]["max_packet"]
    head = msg(key, b"")
    sent = [msg(key, bytes([n]) * (limit - len(head))) for n in range(5)]
    assert all(len(p) == limit for p in sent)
    for packet in sent:
        send(pub, packet)
    for packet in sent:
        assert recv(reader, timeout=30) == packet
    sync(pub)
    rows = server_send_queues(bus.address)
    in_kernel = max(q for q, _ in rows)
    assert limit <= in_kernel < 2 * limit, rows  # the idle one: one big packet, the rest queued
    got = [recv(idle, timeout=30) for _ in sent]
    assert got == sent
