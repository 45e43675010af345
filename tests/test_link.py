"""``twistd sbus-link`` with real processes: two buses (sbusd) joined by two link processes.

Certificates (a CA, a server and a client certificate, and a client
certificate from another CA) are generated at test time in tmp_path with
the `cryptography` package; nothing secret is committed.

Readiness: the listener's port is read from its log ("listening on"), the
link is up when both logs say so, and traffic flows once a probe published
on one bus is received on the other (published again every 50 ms until it
is, with a timeout): no sleep is used as synchronisation.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
import shutil
import tempfile
import uuid

import pytest

from helpers import Agent, connect, msg, recv, send, sub, sync
from test_relay import TIMEOUT, Twistd, child_env, drain_until_all, wait_until

WHOAMI_REPLY = b"CMSG !/cred/whoami\0"


# ---------------------------------------------------------------- certificates


def _certs(tmp_path):
    # The test extra installs twisted[tls]: a missing TLS stack fails here, it never skips.
    import OpenSSL  # noqa: F401
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def write_key(k, path):
        path.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
        os.chmod(path, 0o600)

    def write_cert(c, path):
        path.write_bytes(c.public_bytes(serialization.Encoding.PEM))

    def ca(cn):
        k = key()
        c = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn))
             .public_key(k.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                          content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False,
                                          encipher_only=False, decipher_only=False), critical=True)
             .sign(k, hashes.SHA256()))
        return k, c

    def leaf(ca_key, ca_cert, cn, server):
        k = key()
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
             .public_key(k.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                   else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
        if server:
            b = b.add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return k, b.sign(ca_key, hashes.SHA256())

    d = tmp_path / "pki"
    (d / "ca").mkdir(parents=True)
    ca_key, ca_cert = ca("sbus test CA")
    write_cert(ca_cert, d / "ca" / "ca.pem")
    out = {"cadir": str(d / "ca")}
    for label, server in (("server", True), ("client", False)):
        k, c = leaf(ca_key, ca_cert, f"sbus-link {label}", server)
        write_key(k, d / f"{label}.key")
        write_cert(c, d / f"{label}.pem")
        out[label] = (str(d / f"{label}.pem"), str(d / f"{label}.key"))
    rogue_key, rogue_cert = ca("rogue CA")
    k, c = leaf(rogue_key, rogue_cert, "intruder", False)
    write_key(k, d / "rogue.key")
    write_cert(c, d / "rogue.pem")
    out["rogue"] = (str(d / "rogue.pem"), str(d / "rogue.key"))
    return out


@pytest.fixture
def pki(tmp_path):
    return _certs(tmp_path)


# ---------------------------------------------------------------- processes


class LinkProc(Twistd):
    def __init__(self, tmp_path, bus, *args, name=None):
        self.bus = bus
        super().__init__("sbus-link", ["--bus", bus.address, "--initial-delay", "0.05", "--max-delay", "0.5",
                                       "--stats-interval", "0", *args], tmp_path, name=name)

    def port(self) -> int:
        text = self.wait_log("listening on")
        return int(re.search(r"listening on .*port=(\d+)", text).group(1))

    def stats(self) -> dict:
        """The last statistics line (one is logged at exit)."""
        return json.loads(self.log().rsplit("sbus-link stats: ", 1)[1].splitlines()[0])


@pytest.fixture
def procs():
    started = []
    yield started
    for p in reversed(started):
        p.stop()


def tls_pair(tmp_path, procs, bus_a, bus_b, pki, *extra_a, client_cert="client"):
    server_cert, server_key = pki["server"]
    listen = (f"ssl:0:interface=127.0.0.1:privateKey={server_key}:certKey={server_cert}"
              f":caCertsDir={pki['cadir']}")
    a = LinkProc(tmp_path, bus_a, "--listen", listen, *extra_a, name="link-a")
    procs.append(a)
    connect_to = f"ssl:host=127.0.0.1:port={a.port()}:caCertsDir={pki['cadir']}:hostname=localhost"
    if client_cert:
        cert, key = pki[client_cert]
        connect_to += f":certKey={cert}:privateKey={key}"
    b = LinkProc(tmp_path, bus_b, "--connect", connect_to, name="link-b")
    procs.append(b)
    return a, b


def wait_flow(pub_address: str, receiver: socket.socket, timeout: float = TIMEOUT) -> bool:
    """Publish probes on `pub_address` every 50 ms until `receiver` (subscribed to probe/) gets one."""
    key = f"probe/{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + timeout
    with connect(pub_address) as p:
        while time.monotonic() < deadline:
            send(p, msg(key))
            try:
                while True:
                    got = recv(receiver, 0.05)
                    if got.startswith(b"MSG " + key.encode()):
                        return True
            except TimeoutError:
                continue
    raise AssertionError(f"no probe from {pub_address} within {timeout}s")


def without_probes(packets):
    """Without the probes, and without the links' spanning-tree hellos (sbus/topology/...)."""
    return [p for p in packets if not p.startswith((b"MSG probe/", b"MSG sbus/topology/"))]


def cross_identity(agent: Agent, trusted_uids=(os.getuid(), 0)) -> bytes:
    """The agent's identity across the link, the documented way (docs/relay-link.md).

    Discovery on `sbus-link/whoami` names candidate links (forgeable); a
    trusted candidate is asked on its own secret key with a nonce, and only
    an answer carrying that nonce counts. Forged replies are skipped. An empty
    identity (the link is up but has not yet had its peer's whoami: the peer
    says it again once it knows it, after "link up") is asked again.
    """
    return wait_until(lambda: ask_identity(agent, trusted_uids), "a non-empty identity from the link",
                      TIMEOUT, interval=0.1)


def ask_identity(agent: Agent, trusted_uids) -> bytes:
    """One round of `cross_identity`: the verified answer, empty if the link does not know yet."""
    w = agent.call("whoami")[1]
    reply_key = w + b"/sbus-link/whoami"
    head = b"MSG " + reply_key + b"\0"
    agent.send(sub(reply_key))
    agent.sync()
    agent.send(msg("sbus-link/whoami", w))
    nonces = {}
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        p = agent.recv(TIMEOUT)
        assert p, "no answer from a link"
        if not p.startswith(head):
            continue
        kind, _, rest = p[len(head):].partition(b"\0")
        if kind == b"link":
            m = re.fullmatch(rb"(?:.*/)?!/cred/\d+/(\d+)/\d+", rest)
            if m and int(m.group(1)) in trusted_uids and rest not in nonces:
                nonces[rest] = uuid.uuid4().hex.encode()
                agent.send(msg(rest + b"/sbus-link/whoami", w + b"\0" + nonces[rest]))
        elif kind == b"answer":
            nonce, _, identity = rest.partition(b"\0")
            if nonce in nonces.values():
                return identity
    raise AssertionError("no verified answer")


# ---------------------------------------------------------------- tests


def test_tls_link_both_ways_exactly_once_and_secret_keys(start_bus, tmp_path, procs, pki):
    bus_a, bus_b = start_bus(), start_bus()
    a, b = tls_pair(tmp_path, procs, bus_a, bus_b, pki)
    a.wait_log("link up")
    b.wait_log("link up")
    assert "certificate CN=sbus-link client" in a.wait_log("TLS handshake")
    assert "certificate CN=sbus-link server" in b.wait_log("TLS handshake")

    subs = {"a": connect(bus_a.address), "b": connect(bus_b.address)}
    spies = {"a": connect(bus_a.address), "b": connect(bus_b.address)}
    pubs = {"a": connect(bus_a.address), "b": connect(bus_b.address)}
    owner_b = Agent(bus_b.address)
    owner_a = Agent(bus_a.address)
    try:
        for side in "ab":
            send(subs[side], sub("x/"), sub("probe/"))
            send(spies[side], sub(""))
            sync(subs[side]), sync(spies[side])
        wait_flow(bus_a.address, subs["b"])
        wait_flow(bus_b.address, subs["a"])

        N = 50
        sent = []
        for i in range(N):
            for side in "ab":
                sent.append(msg(f"x/{side}", b"%d" % i))
                send(pubs[side], sent[-1])
        markers = [msg("x/marker/a"), msg("x/marker/b")]
        send(pubs["a"], markers[0])
        send(pubs["b"], markers[1])
        for side in "ab":
            for s in (subs[side], spies[side]):
                got = [p for p in without_probes(drain_until_all(s, markers)) if p not in markers]
                assert sorted(got) == sorted(sent), (side, len(got))
            # no loop: nothing comes back later
            final = msg(f"x/final/{side}")
            send(pubs[side], final)
        finals = [msg("x/final/a"), msg("x/final/b")]
        for side in "ab":
            assert sorted(without_probes(drain_until_all(subs[side], finals))) == sorted(finals)
            assert without_probes(sync(subs[side])) == []

        # Cross-host identities: <link on this bus>/<whoami there>.
        ident_b = cross_identity(owner_b)  # how bus A knows owner_b
        ident_a = cross_identity(owner_a)  # how bus B knows owner_a
        w_b, w_a = owner_b.call("whoami")[1], owner_a.call("whoami")[1]
        gid, uid = os.getgid(), os.getuid()
        assert ident_b == b"!/cred/%d/%d/%d/" % (gid, uid, a.pid) + w_b
        assert ident_a == b"!/cred/%d/%d/%d/" % (gid, uid, b.pid) + w_a
        owner_b.send(sub(w_b + b"/private/"))
        owner_a.send(sub(w_a + b"/private/"))
        owner_b.sync(), owner_a.sync()
        send(pubs["a"], msg(ident_b + b"/private/1", b"for b only"))
        send(pubs["b"], msg(ident_a + b"/private/2", b"for a only"))
        assert owner_b.recv(TIMEOUT) == msg(w_b + b"/private/1", b"for b only")
        assert owner_a.recv(TIMEOUT) == msg(w_a + b"/private/2", b"for a only")
        markers = [msg("x/marker2/a"), msg("x/marker2/b")]
        send(pubs["a"], markers[0])
        send(pubs["b"], markers[1])
        for side in "ab":  # the spies (subscribed to everything) saw nothing secret on either bus
            got = drain_until_all(spies[side], markers)
            assert [p for p in got if b"!/cred/" in p.split(b"\0", 1)[0]] == [], got
        assert owner_b.sync() == [] and owner_a.sync() == []
    finally:
        owner_a.kill()
        owner_b.kill()
        for d in (subs, spies, pubs):
            for s in d.values():
                s.close()
    a.stop(), b.stop()
    sa, sb = a.stats(), b.stats()  # the exit stats lines: counted both ways, nothing dropped
    assert sa["drops"] == {} and sb["drops"] == {}, (sa, sb)
    # (a probe sent while the other side still waited out its forward delay is counted there as standby)
    arrived = {s: st["from_remote"] + st["standby_not_forwarded"].get("from_remote", 0) for s, st in (("a", sa), ("b", sb))}
    assert sa["to_remote"] == arrived["b"] >= N + 4  # N, 3 markers, 1 secret (+ probes)
    assert sb["to_remote"] == arrived["a"] >= N + 4
    assert sa["whoami_answers"] == 1 and sb["whoami_answers"] == 1


def test_tls_refuses_client_without_certificate(start_bus, tmp_path, procs, pki):
    bus_a, bus_b = start_bus(), start_bus()
    a, b = tls_pair(tmp_path, procs, bus_a, bus_b, pki, client_cert=None)
    # the listener saw the TLS handshake fail, and says why
    assert "certificate" in a.wait_log("closed before the link was up").split("closed before the link was up")[1]
    b.wait_log("closed before the link was up")
    assert "link up" not in a.log() and "link up" not in b.log()
    b.stop()
    # A certificate from another CA is refused too.
    cert, key = pki["rogue"]
    port = a.port()
    r = LinkProc(tmp_path, bus_b, "--connect",
                 f"ssl:host=127.0.0.1:port={port}:caCertsDir={pki['cadir']}:hostname=localhost"
                 f":certKey={cert}:privateKey={key}", name="link-rogue")
    procs.append(r)
    wait_until(lambda: a.log().count("closed before the link was up") >= 2, "the rogue connection refused")
    assert "link up" not in a.log() and "link up" not in r.log()
    # and a good client still gets in
    good = LinkProc(tmp_path, bus_b, "--connect",
                    f"ssl:host=127.0.0.1:port={port}:caCertsDir={pki['cadir']}:hostname=localhost"
                    f":certKey={pki['client'][0]}:privateKey={pki['client'][1]}", name="link-good")
    procs.append(good)
    r.stop()
    good.wait_log("link up")


def test_plain_tcp_refused_off_loopback_without_flag(tmp_path, pki):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "twisted", "sbus-link", "--bus", "x.sock", *args],
                              capture_output=True, timeout=TIMEOUT, cwd=tmp_path, env=child_env(),
                              stdin=subprocess.DEVNULL)

    for args in (["--listen", "tcp:7999:interface=0.0.0.0"], ["--listen", "tcp:7999"],
                 ["--connect", "tcp:host=192.0.2.1:port=7999"], ["--connect", "tcp:example.org:7999"],
                 ["--listen", f"ssl:7999:privateKey={pki['server'][1]}:certKey={pki['server'][0]}"]):
        r = run(*args)
        err = r.stderr.decode().strip()
        assert r.returncode != 0, args
        assert len(err.splitlines()) == 1 and "refusing" in err and "--allow-plain" in err, (args, err)
    r = run("--listen", "tcp:1", "--connect", "tcp:2")
    assert r.returncode != 0


def shared_key(tmp_path, name="link.key", owner=None) -> str:
    path = tmp_path / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32).hex().encode() + b"\n")
    os.close(fd)
    if owner is not None:
        os.chown(path, owner, owner)
    return str(path)


def test_plain_tcp_allowed_with_flag_and_on_loopback(start_bus, tmp_path, procs):
    bus_a, bus_b = start_bus(), start_bus()
    key = shared_key(tmp_path)
    a = LinkProc(tmp_path, bus_a, "--listen", "tcp:0:interface=0.0.0.0", "--allow-plain",
                 "--key-file", key, name="link-a")
    procs.append(a)
    port = a.port()
    b = LinkProc(tmp_path, bus_b, "--connect", f"tcp:host=127.0.0.1:port={port}",
                 "--pattern", "only/", "--key-file", key, name="link-b")
    procs.append(b)
    a.wait_log("link up"), b.wait_log("link up")
    with connect(bus_a.address) as ra, connect(bus_b.address) as rb, \
            connect(bus_b.address) as pb:
        send(ra, sub("only/"), sub("probe/"), sub("not/"))
        send(rb, sub("probe/"))
        sync(ra), sync(rb)
        wait_flow(bus_a.address, rb)
        # B exports only/ (its --pattern): not/ stays on B.
        send(pb, msg("not/1"), msg("only/1", b"yes"))
        got = []
        while not got or got[-1] != msg("only/1", b"yes"):
            p = recv(ra, TIMEOUT)
            if not p.startswith(b"MSG probe/"):
                got.append(p)
        assert got == [msg("only/1", b"yes")]
    # An oversize frame closes the connection with a clear log line (before the key is
    # proven, frames over 1,024 bytes are refused: an unauthenticated peer buffers nothing big).
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        s.sendall(struct.pack(">I", 409601) + b"x" * 100)
        a.wait_log("over the 1024-byte limit; closing")


def test_link_survives_a_bus_restart(start_bus, tmp_path, procs):
    bus_a, bus_b = start_bus(), start_bus()
    a = LinkProc(tmp_path, bus_a, "--listen", f"unix:{tmp_path / 'link.sock'}", name="link-a")
    procs.append(a)
    a.wait_log("listening on")
    b = LinkProc(tmp_path, bus_b, "--connect", f"unix:{tmp_path / 'link.sock'}", name="link-b")
    procs.append(b)
    a.wait_log("link up"), b.wait_log("link up")
    with connect(bus_a.address) as ra:
        send(ra, sub("probe/"))
        sync(ra)
        wait_flow(bus_b.address, ra)
    path = bus_b.address
    bus_b.stop()
    b.wait_log("lost bus")
    bus_b2 = start_bus(address=path)
    wait_until(lambda: b.log().count("connected to bus") == 2, "link-b back on its bus")
    with connect(bus_a.address) as ra, connect(path) as rb:
        send(ra, sub("probe/"))
        send(rb, sub("probe/"))
        sync(ra), sync(rb)
        wait_flow(path, ra)           # B -> A again
        wait_flow(bus_a.address, rb)  # A -> B again
    b.stop()
    assert b.stats()["bus_reconnects"] == 1
    bus_b2.stop()


# ---------------------------------------------------------------- attacks (issue 11 item 5, issue 16 items 4, 9)

NOBODY = 65534


def run_link_as(uid: int, log_path, argv) -> subprocess.Popen:
    """`twistd -n sbus-link ARGV` as `uid` (tests/run_as_user.py drops to it before anything else)."""
    log = open(log_path, "wb")
    return subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "run_as_user.py"), str(uid),
         "-n", "--pidfile=", "sbus-link", "--initial-delay", "0.05",
         "--max-delay", "0.5", "--stats-interval", "0", *argv],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=child_env())


def stop_child(proc) -> None:
    proc.terminate()
    try:
        proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_loopback_tcp_needs_the_shared_key(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "twisted", "sbus-link", "--bus", "x.sock", *args],
                              capture_output=True, timeout=TIMEOUT, cwd=tmp_path, env=child_env(),
                              stdin=subprocess.DEVNULL)

    for args in (["--listen", "tcp:0:interface=127.0.0.1"], ["--connect", "tcp:host=127.0.0.1:port=7999"],
                 ["--listen", "tcp:0:interface=0.0.0.0", "--allow-plain"]):
        r = run(*args)
        err = r.stderr.decode().strip()
        assert r.returncode != 0 and len(err.splitlines()) == 1 and "--key-file" in err, (args, err)
    loose = tmp_path / "loose.key"
    loose.write_text("x" * 40)
    loose.chmod(0o644)
    r = run("--listen", "tcp:0:interface=127.0.0.1", "--key-file", str(loose))
    err = r.stderr.decode().strip()
    assert r.returncode != 0 and "chmod 600" in err and len(err.splitlines()) == 1, err


def test_another_uid_on_a_loopback_link_injects_and_reads_nothing(start_bus, tmp_path, procs):
    from helpers import run_as

    bus_a, bus_b = start_bus(), start_bus()
    attacker_bus = start_bus(address="/dev/unix/abstract/00" + uuid.uuid4().hex)  # nobody can connect
    from sbus.address import sockaddr
    attacker_addr = sockaddr(attacker_bus.address)
    key = shared_key(tmp_path)
    a = LinkProc(tmp_path, bus_a, "--listen", "tcp:0:interface=127.0.0.1", "--key-file", key, name="link-a")
    procs.append(a)
    port = a.port()
    b = LinkProc(tmp_path, bus_b, "--connect", f"tcp:host=127.0.0.1:port={port}", "--key-file", key,
                 name="link-b")
    procs.append(b)
    a.wait_log("link up"), b.wait_log("link up")
    assert "proved it holds the shared key" in a.log()

    # The attacker: the project's own link command, as uid 65534, with a key of its own.
    wrong = tempfile.mkdtemp(prefix="sbus-nobody-")
    os.chown(wrong, NOBODY, NOBODY)
    wrong_key = os.path.join(wrong, "guess.key")
    fd = os.open(wrong_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"0123456789abcdef0123456789abcdef\n")
    os.close(fd)
    os.chown(wrong_key, NOBODY, NOBODY)
    attacker_log = tmp_path / "attacker.log"
    with connect(bus_a.address) as victim_sub, connect(bus_a.address) as victim_pub, \
            connect(attacker_addr) as loot:
        send(victim_sub, sub(""))
        send(loot, sub(""))
        sync(victim_sub), sync(loot)
        attacker = run_link_as(NOBODY, attacker_log, ["--bus", attacker_bus.address, "--connect",
                                                 f"tcp:host=127.0.0.1:port={port}", "--key-file", wrong_key])
        try:
            # it retried: still refused (whichever end checks the other's proof first says so)
            wait_until(lambda: a.log().count("authentication failed: wrong key") + (
                attacker_log.read_text().count("authentication failed: wrong key")
                if attacker_log.exists() else 0) >= 2, "the attacker refused twice")
            with connect(attacker_addr) as inject:                 # what it tries to inject
                send(inject, msg("cmd/shutdown", b"now"))
                sync(inject)
            send(victim_pub, msg("payroll/alice", b"secret salary"))      # what it tries to read
        finally:
            stop_child(attacker)
        # a raw client of uid 65534 speaking the link protocol without the key
        port_ = port

        def raw():
            s = socket.create_connection(("127.0.0.1", port_), timeout=TIMEOUT)
            hello = b'CMSG link/hello\0{"version": 1, "whoami": null, "max_packet": 409600}'
            got = b""
            try:
                for frame in (hello, b"MSG cmd/shutdown\0raw"):
                    s.sendall(len(frame).to_bytes(4, "big") + frame)
                while chunk := s.recv(65536):
                    got += chunk
            except OSError:
                pass
            return repr(got)

        "127.0.0.1".encode("idna")  # the codec loads lazily, from where uid 65534 cannot read
        got = run_as(NOBODY, NOBODY, raw)
        assert got.startswith("b") and "x00MSG " not in got and "hello" not in got, got  # closed
        a.wait_log("before authentication")
        marker = msg("marker/a", b"end")
        send(victim_pub, marker)
        seen = without_probes(drain_until_all(victim_sub, [marker]))
        assert seen == [msg("payroll/alice", b"secret salary"), marker], seen  # nothing injected
        send(loot, msg("marker/loot"))
        loot_got = drain_until_all(loot, [msg("marker/loot")])
        assert [p for p in loot_got if b"payroll" in p] == [], loot_got           # nothing read
    log = attacker_log.read_text()
    assert "link up" not in log and "authentication failed" in log, log
    # the real peer was never displaced
    assert "replaces the link" not in a.log() and a.log().count("link up") == 1
    with connect(bus_b.address) as rb:
        send(rb, sub("probe/"))
        sync(rb)
        wait_flow(bus_a.address, rb)


def test_unix_link_socket_takes_the_bus_mode_and_checks_the_peer_uid(start_bus, tmp_path, procs):
    from helpers import run_as

    bus_a = start_bus()
    d = tempfile.mkdtemp(prefix="sbus-link-test-")   # a directory every uid may search
    os.chmod(d, 0o755)
    path = os.path.join(d, "link.sock")
    a = LinkProc(tmp_path, bus_a, "--listen", f"unix:{path}", name="link-a")
    procs.append(a)
    a.wait_log("listening on")
    assert os.stat(bus_a.address).st_mode & 0o777 == 0o700
    assert os.stat(path).st_mode & 0o777 == 0o700          # Twisted's default was 0666

    def attacker():
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(str(path))
        except PermissionError:
            return "EACCES"
        hello = b'CMSG link/hello\0{"version": 1, "whoami": null, "max_packet": 409600}'
        got = b""
        try:
            s.sendall(len(hello).to_bytes(4, "big") + hello)
            while chunk := s.recv(65536):
                got += chunk
        except OSError:
            pass
        return "closed: " + repr(got)

    assert run_as(NOBODY, NOBODY, attacker) == "EACCES"
    os.chmod(path, 0o777)                                   # an operator's mistake: still refused
    got = run_as(NOBODY, NOBODY, attacker)
    assert got.startswith("closed: ") and "hello" not in got, got
    a.wait_log("uid 65534 (SO_PEERCRED) may not open the bus")
    assert "link up" not in a.log()
    a.stop()
    shutil.rmtree(d)


def test_a_forged_whoami_answer_is_ignored(start_bus, tmp_path, procs):
    from sbus.address import sockaddr

    bus_a = start_bus(address="/dev/unix/abstract/00" + uuid.uuid4().hex)  # no file mode: 65534 connects
    bus_b = start_bus()
    key = shared_key(tmp_path)
    a = LinkProc(tmp_path, bus_a, "--listen", "tcp:0:interface=127.0.0.1", "--key-file", key, name="link-a")
    procs.append(a)
    b = LinkProc(tmp_path, bus_b, "--connect", f"tcp:host=127.0.0.1:port={a.port()}", "--key-file", key,
                 name="link-b")
    procs.append(b)
    a.wait_log("link up"), b.wait_log("link up")
    asker = Agent(sockaddr(bus_a.address))
    forger = Agent(sockaddr(bus_a.address), uid=NOBODY, gid=NOBODY)
    try:
        w = asker.call("whoami")[1]
        reply_key = w + b"/sbus-link/whoami"
        asker.send(sub(reply_key))
        asker.sync()
        # the forger answers first, in every form: the old one, a discovery naming itself, a
        # guessed challenge answer, and a discovery naming the real link (which is harmless)
        fw = forger.call("whoami")[1]
        for payload in (b"!/cred/0/0/1/" + w, b"link\0" + fw, b"answer\0" + b"0" * 32 + b"\0FORGED",
                        b"answer\0\0FORGED"):
            forger.send(msg(reply_key, payload))
        forger.sync()
        identity = cross_identity(asker)
        assert identity == b"!/cred/%d/%d/%d/" % (os.getgid(), os.getuid(), b.pid) + w, identity
    finally:
        asker.kill()
        forger.kill()


class FramedPeer:
    """A hand-made link peer over TCP: the shared-key handshake, then frames as we choose."""

    def __init__(self, port: int, key_path: str):
        from sbus.services.linkauth import Handshake, load_key

        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.buf = b""
        auth = Handshake(load_key(key_path), "connect")
        self.send(auth.opening())
        while not auth.done:
            frame = self.recv()
            if frame.startswith(b"CMSG link/ping"):
                continue
            key, _, payload = frame[5:].partition(b"\0")
            for reply in auth.receive(key, payload):
                self.send(reply)

    def send(self, frame: bytes) -> None:
        self.sock.sendall(struct.pack(">I", len(frame)) + frame)

    def recv(self) -> bytes:
        while len(self.buf) < 4 or len(self.buf) < 4 + struct.unpack(">I", self.buf[:4])[0]:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            self.buf += data
        n = struct.unpack(">I", self.buf[:4])[0]
        frame, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
        return frame

    def closed(self) -> bool:
        try:
            while True:
                self.recv()
        except (ConnectionError, OSError):
            return True


def test_a_peer_s_watch_frames_are_never_published_and_a_false_ack_closes_the_link(start_bus, tmp_path, procs):
    """A peer's link/seen (what it does not carry) is only watched, never published on our bus;
    a link/ack of more than we sent is a protocol error (it would hide losses): one log line and
    the connection is closed."""
    bus = start_bus()
    key = shared_key(tmp_path)
    a = LinkProc(tmp_path, bus, "--listen", "tcp:0:interface=127.0.0.1", "--key-file", key, name="link-a")
    procs.append(a)
    peer = FramedPeer(a.port(), key)
    hello = {"version": 1, "whoami": None, "max_packet": 65536, "ack": True, "patterns": [""]}
    peer.send(b"CMSG link/hello\0" + json.dumps(hello).encode())
    a.wait_log("link up")
    with connect(bus.address) as spy:
        send(spy, sub("x/"))
        sync(spy)
        peer.send(b'CMSG link/state\0{"forwarding": false}')
        for i in range(50):
            peer.send(b"CMSG link/seen\0x/seen%d\0payload" % i)
        peer.send(msg("x/carried", b"1"))   # a MSG from a standing-by peer: not published either
        peer.send(b"CMSG link/sync\x007")
        while peer.recv() != b"CMSG link/synced\x007":   # the link read all the frames before
            pass
        assert sync(spy) == []
    peer.send(b"CMSG link/ack\x00999")
    assert peer.closed()
    a.wait_log("link/ack of 999: sent 0")


def test_identity_across_a_link_whose_peer_is_not_on_its_bus_yet(start_bus, tmp_path, procs):
    """The race CI once hit: a link is up before the peer has had its whoami from its own bus
    (here held back, without timing, by stopping that bus's server). The link says so in its
    "link up" line, answers an empty identity meanwhile (docs: empty while not known), and
    once the peer is on its bus says who it is there and answers the right identity."""
    import signal

    bus_a, bus_b = start_bus(), start_bus()
    key = shared_key(tmp_path)
    os.kill(bus_b.proc.pid, signal.SIGSTOP)  # link b connects to it, but gets no whoami
    try:
        a = LinkProc(tmp_path, bus_a, "--listen", "tcp:0:interface=127.0.0.1", "--key-file", key, name="link-a")
        procs.append(a)
        b = LinkProc(tmp_path, bus_b, "--connect", f"tcp:host=127.0.0.1:port={a.port()}", "--key-file", key,
                     name="link-b")
        procs.append(b)
        up = a.wait_log("link up")
        assert "ours there as not known yet" in up, up[-300:]
        asker = Agent(bus_a.address)
        assert ask_identity(asker, (os.getuid(), 0)) == b"", "an identity before the peer knew its own"
    finally:
        os.kill(bus_b.proc.pid, signal.SIGCONT)
    try:
        a.wait_log(re.compile(r"peer \S+ is now !/cred/\d+/\d+/%d on its bus" % b.pid))
        assert cross_identity(asker) == b"!/cred/%d/%d/%d/" % (os.getgid(), os.getuid(), b.pid) + \
            asker.call("whoami")[1]
    finally:
        asker.kill()
