"""Random scenarios through a real server on both transport paths, checked against the
protocol's invariants on every run (issue 20):

* each publisher's messages reach every `order/queue` receiver in publishing order, and no
  receiver gets one twice;
* every request is answered exactly once;
* per receiver, messages received + drops reported (`server/dropped`) = messages published
  to it, unless it chose `error` and was disconnected (then it was told why);
* queued bytes never exceed the client's limit (plus its control budget and one batch).

Receivers pick every flood mode and order, read in bursts with pauses (stalled readers
that resume), send requests in pairs while the publishers flood (requests in the middle of
batches), and may hang up; `block` receivers pause publishers in the middle of batches.
One server per path serves every example (fresh keys each time).
"""

from __future__ import annotations

import socket
import threading
import time

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers import cmsg, connect, msg, send, sub, sync, unique

QUEUE_BYTES = 65536
SLACK = (1 << 20) + 64 * 20000  # control budget + one read batch of the largest message here

receiver = st.fixed_dictionaries({
    "soft": st.sampled_from(["queue", "discard", "block", "error"]),
    "hard": st.sampled_from(["discard", "block", "error"]),
    "order": st.sampled_from(["queue", "queue", "stack", "random"]),
    "burst": st.integers(1, 200),  # packets read before a pause
    "pause": st.sampled_from([0.0, 0.001, 0.005]),
    "hangup_after": st.one_of(st.none(), st.integers(1, 300)),
})
scenario = st.fixed_dictionaries({
    "receivers": st.lists(receiver, min_size=1, max_size=4),
    "publishers": st.lists(st.tuples(st.integers(20, 400), st.integers(1, 20000)), min_size=1, max_size=3),
})

WHOAMI, ID = b"CMSG !/cred/whoami", b"CMSG server/id"
_R = {"soft": "queue", "hard": "discard", "order": "queue", "burst": 1, "pause": 0.0, "hangup_after": None}


class Receiver(threading.Thread):
    def __init__(self, address, prefix, spec):
        super().__init__(daemon=True)
        self.spec = spec
        self.sock = connect(address, big=False)
        send(self.sock, cmsg("blocking/soft/" + spec["soft"]), cmsg("blocking/hard/" + spec["hard"]),
             cmsg("order/" + spec["order"]), sub(prefix))
        assert sync(self.sock) == []
        self.got: dict[int, list[int]] = {}
        self.noted = self.requests = self.replies = 0
        self.pending: list[bytes] = []
        self.why = ""  # the reason a `server/disconnect` notice gave
        self.disconnected = self.hung_up = False
        self.final = threading.Event()  # set by the test: send the final request, read to its reply
        self.expected = 0  # messages published to it, set by the test before `final`
        self.done = threading.Event()
        self.error = None

    def run(self):
        try:
            self._run()
        except Exception as e:  # noqa: BLE001
            self.error = e
        finally:
            self.done.set()

    def _request(self) -> None:
        """Two requests at once; sent when the socket takes them (`_pump`)."""
        self.pending += [WHOAMI, ID]

    def _pump(self) -> bool:
        """Send the requests waiting; False if the connection is gone. A socket that does not
        take them now is not a disconnection: the server is not reading this client while its
        replies wait over the control budget, so it reads on and tries again."""
        while self.pending:
            try:
                self.sock.send(self.pending[0], socket.MSG_DONTWAIT)
            except (BlockingIOError, TimeoutError):
                return True
            except OSError:  # it was disconnected (an `error` mode): the notice is in what it read
                self.disconnected = True
                return False
            del self.pending[0]
            self.requests += 1
        return True

    def _take(self, p: bytes) -> bool:
        """Account for one packet; True if it was a message."""
        if p.startswith(b"MSG "):
            j, i = p.split(b"\0", 1)[1].split(b":")[:2]
            self.got.setdefault(int(j), []).append(int(i))
            return True
        if p.startswith((WHOAMI + b"\0", ID + b"\0")):
            self.replies += 1
        elif p.startswith(b"CMSG server/dropped\0"):
            self.noted += int(p.split(b"\0")[1])
        elif p.startswith(b"CMSG server/disconnect\0"):
            self.disconnected = True
            self.why = p.split(b"\0")[1].split(b" ")[0].decode()
        else:
            raise AssertionError(f"unexpected packet {p[:40]!r}")
        return False

    def _finished(self) -> bool:
        """After the final request: its reply is a barrier in `order/queue` only. In `stack` and
        `random` a reply may leave before messages still queued (docs/protocol.md), so those read
        on until every message is accounted for (or the server falls silent: see `_run`)."""
        if self.pending or self.replies != self.requests:
            return False
        return self.spec["order"] == "queue" or sum(map(len, self.got.values())) + self.noted >= self.expected

    def _run(self):
        s, spec = self.sock, self.spec
        s.settimeout(0.2)
        read = 0  # messages read
        final_sent = False
        deadline = time.monotonic() + 120
        quiet = 0.0  # seconds without a packet since the final reply (a fault's shape: lost packets)
        while time.monotonic() < deadline:
            if self.final.is_set() and not final_sent:
                final_sent = True
                self._request()
            if not self._pump():
                return
            try:
                p = s.recv(1 << 20)
            except TimeoutError:
                if final_sent and not self.pending and self.replies == self.requests:
                    quiet += 0.2
                    if quiet >= 10:
                        return  # the final assertion names what is missing
                continue
            except OSError:
                self.disconnected = True
                return
            quiet = 0.0
            if not p:
                self.disconnected = True
                return
            if not self._take(p):
                if final_sent and self._finished():
                    return
                continue
            read += 1
            if final_sent and self._finished():
                return
            if spec["hangup_after"] is not None and read >= spec["hangup_after"] and not self.final.is_set():
                self.hung_up = True
                s.close()
                return
            if read % spec["burst"] == 0:
                if spec["pause"]:
                    time.sleep(spec["pause"])  # a reader that stalls, then resumes (load shape)
                if not final_sent:
                    self._request()  # requests amid the flood, two at once
        raise AssertionError(f"receiver {spec} never got its last reply ({self.replies}/{self.requests})")


def _publish(address, prefix, j, n, size, errors):
    s = connect(address, big=True)
    s.settimeout(120)
    try:
        for i in range(n):
            s.send(msg(prefix + b"%d" % j, b"%d:%d:" % (j, i) + b"." * (i * 7919 % size)))
        assert sync(s, timeout=120) == []
    except Exception as e:  # noqa: BLE001
        errors.append(e)
    finally:
        s.close()


def _max_queued(address) -> int:
    q = connect(address)
    try:
        from helpers import stats
        return max((e["queued_bytes"] for e in stats(q, timeout=60)["queues"]), default=0)
    finally:
        q.close()


def test_random_scenarios_keep_the_protocols_promises(both_paths):
    bus = both_paths("--queue-bytes", str(QUEUE_BYTES))

    @settings(max_examples=5, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(scenario)
    # The shapes of faults 1 and 3 of issue 20, always tried: a `soft/discard` reader with a full
    # socket asking in pairs amid a flood; a lossless reader behind slow default-mode ones.
    @example({"receivers": [dict(_R, soft="discard", hard="discard", burst=1, pause=0.005)] * 2,
              "publishers": [(400, 20000)] * 2})
    # CI's find: a slow `order/stack` reader still has messages queued when its final reply,
    # which leaves first in that order, arrives.
    @example({"receivers": [dict(_R, order="stack", burst=1, pause=0.005)], "publishers": [(400, 2000)]})
    @example({"receivers": [dict(_R, burst=1, pause=0.001), dict(_R, burst=1, pause=0.001),
                            dict(_R, soft="block", hard="block", burst=10, pause=0.001)],
              "publishers": [(2000, 400)] * 4})
    def run(sc):
        prefix = unique("prop/").encode() + b"/"
        receivers = [Receiver(bus.address, prefix, spec) for spec in sc["receivers"]]
        for r in receivers:
            r.start()
        errors: list = []
        pubs = [threading.Thread(target=_publish, args=(bus.address, prefix, j, n, size, errors), daemon=True)
                for j, (n, size) in enumerate(sc["publishers"])]
        for t in pubs:
            t.start()
        worst = 0
        while any(t.is_alive() for t in pubs):
            worst = max(worst, _max_queued(bus.address))
            for t in pubs:
                t.join(0.05)
        assert not errors, errors[:1]
        for r in receivers:
            r.expected = sum(n for n, _ in sc["publishers"])
            r.final.set()
        for r in receivers:
            assert r.done.wait(150), f"receiver {r.spec} stuck"
            r.sock.close()
        assert worst <= QUEUE_BYTES + SLACK, f"{worst} bytes queued for one client"
        for r in receivers:
            assert r.error is None, f"{r.spec}: {r.error}"
            if r.hung_up:
                continue
            if r.disconnected:
                # Only a client that chose `error`, or one in a block mode that held publishers
                # past its hold budget (`stalled`: a loaded machine makes readers slow).
                modes = (r.spec["soft"], r.spec["hard"])
                assert "error" in modes or (r.why == "stalled" and "block" in modes), (
                    f"{r.spec} was disconnected ({r.why or 'no notice'})")
                continue
            assert r.replies == r.requests, f"{r.spec}: {r.replies} replies to {r.requests} requests"
            for j, (n, _) in enumerate(sc["publishers"]):
                seen = r.got.get(j, [])
                assert len(seen) == len(set(seen)), f"{r.spec}: publisher {j} duplicated"
                if r.spec["order"] == "queue":
                    assert seen == sorted(seen), f"{r.spec}: publisher {j} out of order"
            received = sum(len(v) for v in r.got.values())
            published = sum(n for n, _ in sc["publishers"])
            assert received + r.noted == published, (
                f"{r.spec}: {received} received + {r.noted} told dropped != {published} published")

    run()
