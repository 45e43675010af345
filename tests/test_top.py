"""`sbus top` in a pseudo-terminal, against a real server with real traffic."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest

from helpers import child_env, connect, msg, send, sub, sync, unique, wait_until
from test_queue import group_stats, publish, start_queue  # noqa: F401  (fixture)

TIMEOUT = 20.0
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


class Screen:
    """`sbus top` with a pty as its controlling terminal (80x24); `.frame()` is the last redraw."""

    def __init__(self, address, *args):
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))

        def controlling_tty():  # after setsid (start_new_session): the pty becomes ours
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sbus.cli", "--socket", address, "top", *args],
            stdin=slave, stdout=slave, stderr=slave, env=child_env(), start_new_session=True,
            preexec_fn=controlling_tty,
        )
        os.close(slave)
        self.output = b""

    def read(self, timeout: float) -> bool:
        if not select.select([self.master], [], [], timeout)[0]:
            return False
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the other side is closed
            return False
        self.output += chunk
        return bool(chunk)

    def frame(self) -> str:
        last = self.output.rsplit(b"\x1b[2J", 1)[-1]
        return ANSI.sub(b"", last).decode("utf-8", "replace").replace("\r", "")

    def wait_for(self, predicate, what: str):
        deadline = time.monotonic() + TIMEOUT
        while True:
            frame = self.frame()
            if re.search(r"^ *PID +UID", frame, re.M):  # a whole frame (the table heading is near its end)
                found = predicate(frame)
                if found:
                    return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no frame with {what} in {TIMEOUT}s; last frame:\n{self.frame()}")
            if not self.read(left) and self.proc.poll() is not None:
                raise AssertionError(f"sbus top exited {self.proc.returncode}:\n{self.output.decode('utf-8', 'replace')}")

    def type(self, data: bytes):
        os.write(self.master, data)

    def wait_exit(self) -> int:
        deadline = time.monotonic() + TIMEOUT
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.read(0.1)  # drain the pty so the program never blocks writing
        code = self.proc.wait(max(0.1, deadline - time.monotonic()))
        while self.read(0):  # what it wrote last
            pass
        return code

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


@pytest.fixture
def screen():
    screens = []

    def start(address, *args):
        s = Screen(address, *args)
        screens.append(s)
        return s

    yield start
    for s in screens:
        s.close()


class Traffic:
    """A subscriber and a publisher on the bus, publishing in a background thread until stopped."""

    def __init__(self, address):
        self.key = unique("top/")
        self.reader = connect(address)
        send(self.reader, sub(self.key))
        sync(self.reader)
        self.writer = connect(address)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        for i in range(200_000):  # bounded: about 50 s at most
            if self.stop.is_set():
                return
            send(self.writer, msg(self.key, b"%d" % i))
            sync(self.writer)
            while select.select([self.reader], [], [], 0)[0]:
                self.reader.recv(65536)
            self.stop.wait(0.00025)  # pacing, not synchronisation

    def close(self):
        self.stop.set()
        self.thread.join(TIMEOUT)
        self.reader.close()
        self.writer.close()


def _rates(frame: str):
    m_in = re.search(r"^in\s+([\d.]+) (k?)msg/s", frame, re.M)
    m_out = re.search(r"^out\s+([\d.]+) (k?)msg/s", frame, re.M)
    if m_in and m_out:
        scale = {"": 1, "k": 1000}
        return float(m_in[1]) * scale[m_in[2]], float(m_out[1]) * scale[m_out[2]]
    return None


def test_top_shows_clients_and_rates_then_q_quits(bus, screen):
    traffic = Traffic(bus.address)
    try:
        top = screen(bus.address, "--interval", "0.2")
        # the two traffic clients and top itself
        frame = top.wait_for(lambda f: re.search(r"^clients 3\b", f, re.M) and f, "clients 3")
        assert "subscriptions 1" in frame
        rates = top.wait_for(lambda f: (r := _rates(f)) and r[0] > 0 and r[1] > 0 and r, "rates above 0")
        assert rates[0] > 0 and rates[1] > 0
        frame = top.frame()
        assert re.search(r"^disconnects\s", frame, re.M) and re.search(r"^drops\s", frame, re.M)
        assert "QUEUED" in frame and str(os.getpid()) in frame  # the traffic clients' queues
        # a client leaves: the count follows, and the disconnect shows with its reason
        traffic.close()
        top.wait_for(lambda f: re.search(r"^clients 1\b", f, re.M), "clients 1")
        top.wait_for(lambda f: re.search(r"^disconnects\s.*closed \d+", f, re.M), "closed disconnects")
    finally:
        traffic.close()
    top.type(b"q")
    assert top.wait_exit() == 0
    assert top.output.endswith(b"\x1b[?25h") or b"\x1b[?25h" in top.output[-64:]  # cursor shown again


def test_top_draws_on_the_alternate_screen_and_leaves_it(bus, screen):
    """Like top(1): the terminal's contents before `sbus top` are back after it (no last frame
    left over a wiped screen)."""
    top = screen(bus.address, "--interval", "0.2")
    top.wait_for(lambda f: re.search(r"^clients 1\b", f, re.M), "clients 1")
    top.type(b"q")
    assert top.wait_exit() == 0
    enter, leave = top.output.find(b"\x1b[?1049h"), top.output.rfind(b"\x1b[?1049l")
    assert 0 <= enter < top.output.find(b"\x1b[2J"), top.output[:80]   # before the first frame
    assert leave > top.output.rfind(b"\x1b[2J"), top.output[-80:]      # after the last


def test_top_ctrl_c_exits_0(bus, screen):
    top = screen(bus.address, "--interval", "0.2")
    top.wait_for(lambda f: re.search(r"^clients 1\b", f, re.M), "clients 1")
    top.type(b"\x03")  # the terminal turns it into SIGINT for its foreground process group
    assert top.wait_exit() == 0
    assert b"Traceback" not in top.output


def test_top_server_gone_is_one_line(start_bus, screen):
    bus = start_bus()
    top = screen(bus.address, "--interval", "0.2")
    top.wait_for(lambda f: re.search(r"^clients 1\b", f, re.M), "clients 1")
    bus.stop()
    assert top.wait_exit() == 1
    last = ANSI.sub(b"", top.output).rstrip(b"\r\n").rsplit(b"\n", 1)[-1]
    assert last.startswith(b"sbus: ") and b"closed" in last, top.output[-300:]
    assert b"Traceback" not in top.output


def test_top_without_a_terminal(bus):
    r = subprocess.run([sys.executable, "-m", "sbus.cli", "--socket", bus.address, "top", "-n", "2", "-i", "0.1"],
                       capture_output=True, timeout=TIMEOUT, env=child_env(), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert b"\x1b" not in r.stdout
    frames = r.stdout.decode().split("\n\n")
    assert r.stdout.decode().count("(q quits)") == 2
    assert re.search(r"^clients 1\b", r.stdout.decode(), re.M), frames


def test_top_shows_what_each_service_lost_and_why(bus, start_queue):  # noqa: F811
    """Issue 23: every loss is counted where an operator looks. A queue service over its limit
    in `discard` mode loses 20 of 30 jobs; `sbus top` shows it as `lost full 20` on its line."""
    start_queue(bus, "--group", "jobs=jobs/", "--limit", "10", "--full", "discard")
    publish(bus.address, [b"jobs/%d" % i for i in range(30)])
    wait_until(lambda: group_stats(bus.address)["received"] == 30, "30 received")
    p = subprocess.Popen([sys.executable, "-m", "sbus.cli", "--socket", bus.address, "top", "-n", "120", "-i", "0.5"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(), stdin=subprocess.DEVNULL)
    try:
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = p.stdout.readline().decode()
            assert line, f"top ended: {p.stderr.read().decode()[-300:]}"
            if line.startswith("  sbus-queue "):
                seen.append(line.strip())
                if "lost full 20" in line:
                    break
        else:
            raise AssertionError(f"top never showed the queue's loss; its lines: {seen[-2:]}")
    finally:
        p.kill()
        p.wait()


def test_services_line_keeps_lost_apart_and_shows_the_change():
    from sbus.top import render

    answer = {"service": "sbus-bridge", "name": "a<->b", "pid": 7, "stats": {"lost": {"failover_gap": 5}}}
    before = [{**answer, "stats": {"lost": {"failover_gap": 2}}}]
    hidden = {"service": "sbus-link", "name": "x", "pid": 8}
    lines = render("bus", {"clients": 1}, None, 0, 1, 120, 40, [answer, hidden], before)
    assert "services    2 answered:" in lines
    assert "  sbus-bridge a<->b pid 7: lost failover_gap 5 (+3)" in lines
    assert "  sbus-link x pid 8: (no counters for this uid)" in lines
    assert not any("services" in line for line in render("bus", {"clients": 1}, None, 0, 1, 120, 40))


def test_sessions_line_shows_lingering_stand_ins_and_what_expired_ones_missed():
    from sbus.top import render

    idle = {"held": 0, "lingering": 0, "resumed": 0, "expired": 0, "missed": 0}
    now = {"clients": 1, "sessions": {**idle, "held": 2, "lingering": 1, "expired": 1, "missed": 40}}
    before = {"clients": 1, "sessions": {**idle, "held": 2, "missed": 10}}
    lines = render("bus", now, before, 1, 1, 120, 40)
    assert "sessions    missed 40 (+30), held 2, expired 1 (+1), lingering 1 (+1)" in lines, lines[:6]
    assert not any(line.startswith("sessions") for line in render("bus", {"clients": 1, "sessions": idle},
                                                                   None, 0, 1, 120, 40))
