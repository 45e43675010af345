"""The `sbus` command, run as a subprocess the way a user types it."""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sbus.client
from sbus.core.codec import MAX_PACKET

TIMEOUT = 15.0
SBUS = [sys.executable, "-m", "sbus.cli"]
ENTRY_POINT = Path(sys.executable).parent / "sbus"


def environ(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SBUS_SOCKET"}
    env.update(extra)
    return env


def sbus_run(*args, input=None, env=None, cwd=None, timeout=TIMEOUT, prefix=()):
    return subprocess.run([*prefix, *SBUS, *args], input=input, capture_output=True,
                          env=env if env is not None else environ(), cwd=cwd, timeout=timeout)


def assert_one_error_line(result, *needles, status=1):
    """The command failed with `status` and exactly one `sbus: ...` line on stderr."""
    err = result.stderr.decode()
    assert result.returncode == status, (result.returncode, err)
    assert err.count("\n") == 1 and err.startswith("sbus: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


class Sub:
    """`sbus sub ...` in the background, started and waited for like the docs show (--ready-file FIFO)."""

    def __init__(self, tmp_path, address, *args, stdout=subprocess.PIPE):
        self.fifo = str(tmp_path / f"ready-{time.monotonic_ns()}")
        os.mkfifo(self.fifo)
        fd = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            self.proc = subprocess.Popen([*SBUS, "--bus", address, "sub", *args, "--ready-file", self.fifo],
                                         stdout=stdout, stderr=subprocess.PIPE, env=environ())
            deadline = time.monotonic() + TIMEOUT
            got = b""
            while not got.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    self.proc.kill()
                    raise AssertionError("sbus sub not ready in time")
                chunk = os.read(fd, 64)
                if not chunk:
                    out, err = self.proc.communicate(timeout=TIMEOUT)
                    raise AssertionError(f"sbus sub failed before ready: {err!r}")
                got += chunk
            assert got == b"ready\n"
        finally:
            os.close(fd)

    def finish(self, timeout=TIMEOUT):
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err.decode()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def subs(tmp_path, bus):
    started = []

    def start(*args, **kw):
        s = Sub(tmp_path, bus.address, *args, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


def pub(bus, *args, input=None):
    r = sbus_run("--bus", bus.address, "pub", *args, input=input)
    assert r.returncode == 0, r.stderr
    assert r.stderr == b""
    return r


# --- basics ---------------------------------------------------------------------


def test_whoami(bus):
    r = sbus_run("--bus", bus.address, "whoami")
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(rb"!/cred/%d/%d/\d+\n" % (os.getgid(), os.getuid()), r.stdout)


def test_entry_point(bus):
    if not ENTRY_POINT.exists():
        pytest.skip("the sbus console script is not installed (pip install -e .)")
    r = subprocess.run([str(ENTRY_POINT), "whoami"], capture_output=True, timeout=TIMEOUT,
                       env=environ(SBUS_SOCKET=bus.address))
    assert r.returncode == 0 and r.stdout.startswith(b"!/cred/"), r.stderr


def test_pub_sub_lines(bus, subs):
    s = subs("sensors/", "--count", "3")
    pub(bus, "sensors/a", "21.5")
    pub(bus, "elsewhere", "no")
    pub(bus, "sensors/b", "-", input=b"x y\nz\n")
    assert s.finish() == (0, b"sensors/a 21.5\nsensors/b x y\nsensors/b z\n", "")


def test_pub_sources(bus, subs, tmp_path):
    s = subs("k", "--format", "json", "--count", "7")
    data = tmp_path / "blob"
    data.write_bytes(b"\xff\x00bin\n")
    pub(bus, "k", "--file", str(data))
    pub(bus, "k", "-", "--whole", input=b"all\nof it\n")
    pub(bus, "k", input=b"one\n\nthree")  # no MESSAGE, stdin is a pipe: a message per line
    pub(bus, "k", "twice", "--count", "2")
    code, out, err = s.finish()
    assert (code, err) == (0, "")
    got = [json.loads(line) for line in out.splitlines()]
    assert got[0] == {"key": "k", "payload": "/wBiaW4K", "payload_base64": True}
    assert [g["payload"] for g in got[1:]] == ["all\nof it\n", "one", "", "three", "twice", "twice"]


def test_pub_rate(bus, subs):
    s = subs("r", "--count", "5")
    t0 = time.monotonic()
    pub(bus, "r", "m", "--count", "5", "--rate", "50")
    assert time.monotonic() - t0 >= 4 / 50
    assert s.finish()[1] == b"r m\n" * 5


def test_sub_formats(bus, subs):
    raw = subs("f", "--format", "raw", "--count", "2")
    payload = subs("f", "--format", "payload", "--count", "2")
    line = subs("f", "--format", "line", "--count", "2")
    js = subs("f", "--format", "json", "--count", "2")
    pub(bus, "f", "a")
    pub(bus, "f", "b\u00e9")
    assert raw.finish()[1] == "ab\u00e9".encode()
    assert payload.finish()[1] == "a\nb\u00e9\n".encode()
    assert line.finish()[1] == "f a\nf b\u00e9\n".encode()
    assert [json.loads(x) for x in js.finish()[1].splitlines()] == [
        {"key": "f", "payload": "a"}, {"key": "f", "payload": "b\u00e9"}]


def test_sub_several_patterns_and_binary_key(bus, subs):
    s = subs("a/", "b/*/c", "--format", "json", "--count", "2")
    with sbus.client.connect(bus.address) as c:
        c.publish(b"a/\xfe", b"1")
        c.publish(b"b/x/c", b"2")
        c.sync(TIMEOUT)
    out = [json.loads(x) for x in s.finish()[1].splitlines()]
    assert out == [{"key": "YS/+", "key_base64": True, "payload": "1"}, {"key": "b/x/c", "payload": "2"}]


def test_sub_timeout(bus):
    r = sbus_run("--bus", bus.address, "sub", "quiet", "--timeout", "0.2")
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
    r = sbus_run("--bus", bus.address, "sub", "quiet", "--timeout", "0.2", "--count", "1")
    assert_one_error_line(r, "timed out", "0 of 1", status=124)


def test_sub_reports_what_the_server_dropped(bus, subs):
    """A stopped `sbus sub` overruns its queue (default hard/discard): the server's drop notices
    reach stderr, and what arrived plus what was reported dropped is everything published."""
    s = subs("flood/")
    total = 20_000
    os.kill(s.proc.pid, signal.SIGSTOP)
    try:
        with sbus.client.connect(bus.address) as publisher:
            for i in range(total):
                publisher.publish(b"flood/%d" % i, b"x" * 400)   # 8 MB: past the 4 MiB queue
            publisher.whoami()                                   # all routed (and queued or dropped)
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)
    with sbus.client.connect(bus.address) as publisher:
        publisher.publish(b"flood/end", b"")
    lines, err = [], b""
    deadline = time.monotonic() + TIMEOUT
    out_buf = b""
    while not out_buf.endswith(b"flood/end \n"):
        assert time.monotonic() < deadline, "the end marker never arrived"
        ready = select.select([s.proc.stdout, s.proc.stderr], [], [], deadline - time.monotonic())[0]
        for f in ready:
            chunk = os.read(f.fileno(), 1 << 16)
            if f is s.proc.stdout:
                out_buf += chunk
            else:
                err += chunk
    s.proc.send_signal(signal.SIGINT)
    _, rest = s.proc.communicate(timeout=TIMEOUT)
    err += rest
    received = out_buf.count(b"\n") - 1                        # without the end marker
    counts = [int(c) for c in re.findall(rb"^sbus: the server dropped (\d+) messages? for us", err, re.M)]
    assert counts, err
    assert received + sum(counts) == total, (received, counts)
    assert received < total
    assert b"first flood/" in err and b"Traceback" not in err


def test_stats(bus):
    r = sbus_run("--bus", bus.address, "stats")
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode()
    assert re.search(r"^clients\s+1$", text, re.M)
    assert re.search(r"^packets_in\s+\d+$", text, re.M)
    assert "queues:" in text and "QUEUED_BYTES" in text
    r = sbus_run("--bus", bus.address, "stats", "--json")
    stats = json.loads(r.stdout)
    assert stats["clients"] == 1 and isinstance(stats["queues"], list)


def test_ping(bus):
    r = sbus_run("--bus", bus.address, "ping", "--count", "3")
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"3 round trips: min [\d.]+ µs, median [\d.]+ µs, max [\d.]+ µs\n", r.stdout.decode())


# --- addresses ------------------------------------------------------------------


def test_address_order(start_bus, tmp_path):
    bus = start_bus(address=str(tmp_path / "sbus.socket"))
    missing = str(tmp_path / "missing.socket")
    # --bus wins over $SBUS_SOCKET
    r = sbus_run("--bus", bus.address, "whoami", env=environ(SBUS_SOCKET=missing))
    assert r.returncode == 0, r.stderr
    # after the command name too
    r = sbus_run("whoami", "--bus", bus.address, env=environ(SBUS_SOCKET=missing))
    assert r.returncode == 0, r.stderr
    # $SBUS_SOCKET, from any directory
    assert_one_error_line(sbus_run("whoami", env=environ(SBUS_SOCKET=missing), cwd=tmp_path), missing)
    r = sbus_run("whoami", env=environ(SBUS_SOCKET=bus.address), cwd="/")
    assert r.returncode == 0, r.stderr
    # then /run/sbus.socket, where sbusd listens by default; never ./sbus.socket
    if not os.path.exists("/run/sbus.socket"):  # a system bus on this machine would answer
        r = sbus_run("whoami", env=environ(SBUS_SOCKET=""), cwd=tmp_path)
        assert r.returncode == 1 and b"/run/sbus.socket" in r.stderr, r.stderr


def test_abstract_address(start_bus):
    bus = start_bus(address="/dev/unix/abstract")
    r = sbus_run("--bus", bus.printed.decode().strip(), "whoami")
    assert r.returncode == 0, r.stderr


# --- errors ------------------------------------------------------------------------


def test_error_socket_missing(tmp_path):
    path = str(tmp_path / "nothing.socket")
    assert_one_error_line(sbus_run("--bus", path, "whoami"), path, "no such socket")


def test_error_connection_refused(tmp_path):
    path = str(tmp_path / "dead.socket")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    s.close()  # the socket file stays behind, nobody listens
    assert_one_error_line(sbus_run("--bus", path, "pub", "k", "v"), "connection refused")


def test_error_permission_denied(bus):
    prefix = ()
    if os.geteuid() == 0:
        # root ignores file modes: run the command without capabilities
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot lose CAP_DAC_OVERRIDE")
        prefix = (setpriv, "--inh-caps=-all", "--bounding-set=-all")
    os.chmod(bus.address, 0)
    assert_one_error_line(sbus_run("--bus", bus.address, "whoami", prefix=prefix), "permission denied")


def test_error_server_closes_the_connection(bus, subs):
    # a subscription in another process's secret space gets us disconnected, and the server
    # says why (CMSG server/disconnect): that reason is the one line printed
    err = assert_one_error_line(sbus_run("--bus", bus.address, "sub", "!/cred/1/2/3/x"),
                                "the server closed the connection", "forbidden_subscription")
    assert "secret pattern" in err and "gid" in err, err
    # a server that goes away says nothing more specific than that
    s = subs("x")
    bus.stop()
    code, out, err = s.finish()
    assert code == 1 and err.startswith("sbus: the server closed the connection") and err.count("\n") == 1, err


def test_error_server_reason_after_a_failed_send(tmp_path):
    """The server closed while `sbus pub` was still sending: the send fails (EPIPE), and the
    reason the server sent before closing is still read and printed (it was not, at first)."""
    import threading
    path = str(tmp_path / "fake.socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)

    def fake_server():
        conn, _ = listener.accept()
        conn.recv(65536)  # the first message
        conn.send(b"CMSG server/disconnect\0oversize\0packet of 999 bytes over the 10-byte limit")
        conn.close()

    t = threading.Thread(target=fake_server, daemon=True)
    t.start()
    try:
        # paced, so that sends go on after the server has closed: one of them fails
        r = sbus_run("--bus", path, "pub", "k", "v", "--count", "1000", "--rate", "200")
        assert_one_error_line(r, "the server closed the connection", "oversize", "over the 10-byte limit")
    finally:
        t.join(TIMEOUT)
        listener.close()


def test_error_server_reason_is_escaped(tmp_path):
    """A server's reason is printed as one line of text, whatever bytes it holds."""
    import threading
    path = str(tmp_path / "fake.socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)

    def fake_server():
        conn, _ = listener.accept()
        conn.recv(65536)  # the whoami of `sbus whoami`
        conn.send(b"CMSG server/disconnect\0protocol_error\0bad \x1b[2J\nfake line")
        conn.close()

    t = threading.Thread(target=fake_server, daemon=True)
    t.start()
    try:
        err = assert_one_error_line(sbus_run("--bus", path, "whoami"), "protocol_error", "bad \\e[2J\\nfake line")
        assert "\x1b" not in err
    finally:
        t.join(TIMEOUT)
        listener.close()


def test_error_message_too_large(bus, tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"x" * MAX_PACKET)
    assert_one_error_line(sbus_run("--bus", bus.address, "pub", "k", "--file", str(big)), "too large", "409600")
    assert_one_error_line(sbus_run("--bus", bus.address, "pub", "k", input=b"ok\n" + b"y" * MAX_PACKET + b"\n"),
                   "too large")
    # exactly at the limit is fine
    big.write_bytes(b"x" * (MAX_PACKET - len(b"MSG k\0")))
    assert sbus_run("--bus", bus.address, "pub", "k", "--file", str(big)).returncode == 0


def test_error_bad_address():
    assert_one_error_line(sbus_run("--bus", "/dev/unix/abstract/61", "whoami"), "abstract")


@pytest.mark.parametrize("address", ["/dev/unix/abstract/zz", "/dev/unix/abstract/", "/dev/unix/abstract/0"])
def test_error_abstract_address_not_hex(address):
    # these parse as paths (as in the reference server): say what is wrong with them, not "no such socket"
    err = assert_one_error_line(sbus_run("--bus", address, "whoami"), address, "not an abstract address",
                                "hex digits")
    assert "no such socket" not in err


@pytest.mark.parametrize("kind", ["regular file", "directory"])
def test_error_not_a_socket(tmp_path, kind):
    path = tmp_path / "thing"
    if kind == "directory":
        path.mkdir()
    else:
        path.write_text("not a socket\n")
    err = assert_one_error_line(sbus_run("--bus", str(path), "whoami"), str(path), f"not a socket (a {kind})")
    assert "refused" not in err


@pytest.mark.parametrize("argv,option", [
    (["ping", "-t", "0"], "--timeout"), (["ping", "-t", "-1"], "--timeout"), (["ping", "-t", "nan"], "--timeout"),
    (["ping", "-n", "0"], "--count"), (["ping", "--count", "x"], "--count"),
    (["sub", "k", "--timeout", "-1"], "--timeout"), (["sub", "k", "--timeout", "0"], "--timeout"),
    (["sub", "k", "--count", "0"], "--count"), (["sub", "k", "--count", "-3"], "--count"),
    (["pub", "k", "v", "--count", "0"], "--count"), (["pub", "k", "v", "--count", "1.5"], "--count"),
    (["pub", "k", "v", "--rate", "0"], "--rate"), (["pub", "k", "v", "--rate", "inf"], "--rate"),
    (["top", "--interval", "0"], "--interval"), (["top", "-n", "0"], "--iterations"),
    (["stats", "--services", "--wait", "0"], "--wait"),
])
def test_numbers_checked_when_parsing(tmp_path, argv, option):
    # a usage error (status 2) before anything connects: the socket does not even exist
    r = sbus_run("--bus", str(tmp_path / "missing.socket"), *argv)
    err = r.stderr.decode()
    assert r.returncode == 2, (r.returncode, err)
    assert option in err and "Traceback" not in err and "no such socket" not in err, err
    assert r.stdout == b""


# --- what sub prints: escaped unless --raw -------------------------------------------

HOSTILE = [
    (b"news/title", b"\x1b]0;pwned\x07hello"),                                  # window title
    (b"news/clear", b"\x1b[2J\x1b[Hwiped"),                                     # clear screen
    (b"news/fake", b"x\n!/cred/0/0/1/secret hunter2"),                           # a fake line
    (b"news/cr", b"visible\rhidden"),                                            # overwrite a line
    (b"news/c1", "\u009b2J and \u202edesrever".encode() + b" \xff\\"),           # C1 CSI, bidi, bad UTF-8
    (b"news/\x1b[31mred key", b"k"),                                             # a key with an escape and a space
]


@pytest.fixture
def world_bus(start_bus):
    """A bus every local user can open (sbusd -o) in a directory they can reach."""
    import tempfile
    d = tempfile.mkdtemp(prefix="sbus-cli-")
    os.chmod(d, 0o755)
    try:
        yield start_bus("-o", address=os.path.join(d, "bus.socket"))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _publish_hostile(address: str) -> str:
    from helpers import connect, msg, send, sync
    s = connect(address)
    for key, payload in HOSTILE:
        send(s, msg(key, payload))
    sync(s)
    s.close()
    return "sent"


def test_sub_escapes_a_hostile_message_from_another_uid(tmp_path, world_bus):
    if os.geteuid() != 0:
        pytest.skip("needs root to publish as uid 65534")
    from helpers import run_as
    line = Sub(tmp_path, world_bus.address, "news/", "--count", str(len(HOSTILE)))
    payload = Sub(tmp_path, world_bus.address, "news/", "--count", str(len(HOSTILE)), "--format", "payload")
    raw = Sub(tmp_path, world_bus.address, "news/", "--count", str(len(HOSTILE)), "--raw")
    js = Sub(tmp_path, world_bus.address, "news/", "--count", str(len(HOSTILE)), "--format", "json")
    try:
        assert run_as(65534, 65534, lambda: _publish_hostile(world_bus.address)) == "sent"
        code, out, err = line.finish()
        assert (code, err) == (0, "")
        assert out.split(b"\n") == [
            b"news/title \\e]0;pwned\\x07hello",
            b"news/clear \\e[2J\\e[Hwiped",
            b"news/fake x\\n!/cred/0/0/1/secret hunter2",
            b"news/cr visible\\rhidden",
            b"news/c1 \\u009b2J and \\u202edesrever \\xff\\\\",
            b"news/\\e[31mred\\x20key k",
            b"",
        ]
        # nothing that a terminal acts on: no control character but the newlines ending lines
        assert not re.search(rb"[\x00-\x09\x0b-\x1f\x7f]", out) and "\u009b".encode() not in out
        code, out, err = payload.finish()
        assert code == 0 and out.count(b"\n") == len(HOSTILE) and b"\x1b" not in out and b"\r" not in out
        code, out, err = js.finish()
        assert code == 0 and out.count(b"\n") == len(HOSTILE)
        assert not re.search(rb"[\x00-\x09\x0b-\x1f\x7f]", out) and "\u009b".encode() not in out
        assert "\u202e".encode() not in out
        got = [json.loads(l) for l in out.splitlines()]
        assert [(g["key"].encode() if "key_base64" not in g else None, g.get("payload")) for g in got][:4] == [
            (k, p.decode()) for k, p in HOSTILE[:4]]
        # --raw: as they are, on request
        code, out, err = raw.finish()
        assert code == 0 and out == b"".join(k + b" " + p + b"\n" for k, p in HOSTILE)
    finally:
        for s in (line, payload, raw, js):
            s.kill()


def test_json_escapes_round_trip():
    """--format json escapes what a terminal would act on and still reads back to the same text
    (characters beyond U+FFFF as surrogate pairs, as JSON wants)."""
    from sbus.cli import _format
    from sbus.core.codec import Message
    render = _format("json")
    for text in ("plain", "x\x7f\u2028\u009b\x1b[2J", "tag\U000e0001s", "é\u202e", "line\nbreak"):
        out = render(Message(b"k", text.encode()))
        assert not re.search(rb"[\x00-\x1f\x7f]", out[:-1]) and "\u009b".encode() not in out, out
        assert json.loads(out)["payload"] == text


# --- --ready-file ------------------------------------------------------------------


def test_ready_file_regular_is_atomic_and_private(bus, tmp_path):
    (tmp_path / "r").mkdir()
    path = tmp_path / "r" / "ready"
    r = sbus_run("--bus", bus.address, "sub", "x", "--timeout", "0.1", "--ready-file", str(path))
    assert r.returncode == 0, r.stderr
    assert path.read_text() == "ready\n"
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    assert sorted(p.name for p in path.parent.iterdir()) == ["ready"]  # no temporary left behind


def test_ready_file_does_not_follow_planted_symlinks(bus, tmp_path):
    # The old code wrote PATH.PID.tmp, following a symlink planted there, into a victim file.
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    path = tmp_path / "ready"
    path.symlink_to(victim)  # the ready path itself a symlink: replaced, its target untouched
    proc = subprocess.Popen([*SBUS, "--bus", bus.address, "sub", "x", "--timeout", "0.1",
                             "--ready-file", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=environ())
    for guess in range(proc.pid, proc.pid + 3):  # what the old code would have used
        (tmp_path / f"ready.{guess}.tmp").symlink_to(victim)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert victim.read_text() == "precious\n"
    assert not path.is_symlink() and path.read_text() == "ready\n"


def test_ready_file_in_a_missing_directory(bus, tmp_path):
    r = sbus_run("--bus", bus.address, "sub", "x", "--ready-file", str(tmp_path / "no" / "ready"))
    assert_one_error_line(r, "--ready-file", "No such file or directory")


def test_ready_fifo_gets_eof_on_failure(tmp_path):
    fifo = str(tmp_path / "ready")
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        r = sbus_run("--bus", str(tmp_path / "missing"), "sub", "x", "--ready-file", fifo)
        assert_one_error_line(r, "no such socket")
        assert select.select([fd], [], [], TIMEOUT)[0] and os.read(fd, 64) == b""  # EOF, not "ready"
    finally:
        os.close(fd)


# --- signals --------------------------------------------------------------------------


def test_ctrl_c_exits_quietly(bus, subs):
    s = subs("x")
    s.proc.send_signal(signal.SIGINT)
    code, out, err = s.finish()
    assert (code, out, err) == (130, b"", "")


def test_broken_pipe_exits_quietly(bus, subs):
    s = subs("bp")
    s.proc.stdout.close()  # like `sbus sub bp | head -0`
    for _ in range(3):
        pub(bus, "bp", "x")
    code = s.proc.wait(TIMEOUT)
    err = s.proc.stderr.read().decode()
    assert (code, err) == (141, "")


# --- optional dependencies ---------------------------------------------------------


def test_link_tls_without_the_extra_is_one_line(tmp_path, bus):
    """`twistd sbus-link --listen ssl:...` without pyOpenSSL names the extra to install."""
    blocker = tmp_path / "blocker"
    for name in ("OpenSSL", "service_identity"):  # as if not installed: importing them fails
        (blocker / name).mkdir(parents=True)
        (blocker / name / "__init__.py").write_text(f"raise ImportError('No module named {name}')\n")
    env = environ(PYTHONPATH=os.pathsep.join([str(blocker), str(Path(__file__).resolve().parent.parent)]))
    for endpoint in ("--listen=ssl:0:privateKey=k.pem:certKey=c.pem:caCertsDir=ca",
                     "--connect=ssl:host=example.org:port=7010:caCertsDir=ca"):
        r = subprocess.run([sys.executable, "-m", "twisted", "sbus-link", "--bus", bus.address, endpoint],
                           capture_output=True, timeout=TIMEOUT, env=env, cwd=tmp_path)
        err = r.stderr.decode()
        assert r.returncode != 0, err
        assert "Traceback" not in err and err.count("\n") == 1, err
        assert "pip install 'sbus[link]'" in err, err
