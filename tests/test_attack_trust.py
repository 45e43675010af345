"""Issue 21: whom the services trust. Each attack runs against real processes, as uid 65534
where the attacker is another local user, and failed on the code before its fix
(docs/security.md, "Whom each service trusts").
"""

from __future__ import annotations

import encodings.idna  # noqa: F401  (uid 65534 cannot import it from the venv after the fork)
import json
import os
import socket

import pytest

from helpers import connect, msg, recv, run_as, send, sub, sync, whoami
from test_attack_services import open_dir  # noqa: F401  (fixture)
from test_bridge import TIMEOUT, start_bridge, twistd  # noqa: F401  (fixture)

from sbus.core.credentials import owner_of
from sbus.services.svcstats import reply_owner_uid

NOBODY = 65534


def _open_bus(start_bus, open_dir, name):
    bus = start_bus("-o", address=os.path.join(open_dir, name))
    os.chmod(bus.address, 0o777)
    return bus


# ---------------------------------------------------------------- 2: service statistics


def _ask_stats(address: str, tail: bytes) -> str:
    """As the caller's uid: ask every service on the bus for statistics with a reply key in
    our own secret space followed by `tail`; return the JSON answers, one per line."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(TIMEOUT)
    s.connect(address)
    gid, uid, pid = whoami(s)
    reply = b"!/cred/%d/%d/%d/%s" % (gid, uid, pid, tail)
    send(s, sub(reply))
    sync(s)
    send(s, msg(b"sbus/services/stats", reply))
    while True:
        p = recv(s, TIMEOUT)
        if not p:
            return "closed"
        if p.startswith(b"MSG " + reply + b"\0"):
            return p.split(b"\0", 1)[1].decode()


def test_service_stats_trust_the_delivering_link_not_text_after_it(start_bus, open_dir, twistd):  # noqa: F811
    """uid 65534 on a shared bus asks with ``!/cred/G/65534/P/!/cred/0/0/1/x``: the reply
    reaches 65534 (the server delivers by the first link), so it gets the public answer
    only; the bridge used to read the last link (root) and send its full counters."""
    a = _open_bus(start_bus, open_dir, "a.socket")
    b = _open_bus(start_bus, open_dir, "b.socket")
    start_bridge(twistd, a.address, b.address, "shared/ a>b")
    forged = json.loads(run_as(NOBODY, NOBODY, lambda: _ask_stats(a.address, b"!/cred/0/0/1/x")))
    assert forged["service"] == "sbus-bridge"
    assert "forwarded" not in forged["stats"], sorted(forged["stats"])
    # the owner (root) still gets everything
    full = json.loads(_ask_stats(a.address, b"x"))
    assert "forwarded" in full["stats"]


def test_reply_owner_is_the_link_the_server_delivers_by():
    """On a master: the first link. On a relay (prefix R): the first link after R, and a key
    outside R goes up to the master, which delivers by the first link (no prefix)."""
    assert reply_owner_uid(b"!/cred/5/1003/9/!/cred/0/0/1/x") == 1003
    assert reply_owner_uid(b"!/cred/5/1003/9/x", b"!/cred/5/1003/9") == 1003
    relay = b"!/cred/0/0/77/"
    on_relay = relay + b"!/cred/5/1003/9"            # a client of a relay run by root
    assert reply_owner_uid(relay + b"!/cred/5/1003/9/!/cred/0/0/1/x", on_relay) == 1003
    assert reply_owner_uid(b"!/cred/6/2000/4/x", on_relay) == 2000      # a master client
    assert reply_owner_uid(b"!/cred/0/0/77/x", on_relay) == 0           # the relay itself
    for dead in (b"!/cred/05/1003/9/x", b"!/cred/5/1003/9", b"!/cred/5/4294967296/9/x",
                 b"!/cred/5/+1/9/x", b"!/cred/5/\xd9\xa1/9/x", b"!/cred/5//9/x"):
        assert reply_owner_uid(dead) is None, dead
    assert owner_of(b"!/cred/1/2/3/x").uid == 2


# ---------------------------------------------------------------- 4: a socket wider than its bus


def _listen_as_nobody(address: str, key: bytes) -> str:
    """As uid 65534: connect to `address`, subscribe `key`, report what arrives."""
    def attack():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(TIMEOUT)
        try:
            s.connect(address)
        except OSError as e:
            return f"refused: {e.strerror}"
        send(s, sub(key))
        sync(s)
        os.write(ready_w, b"x")
        p = recv(s, TIMEOUT)
        return "read: " + p.decode(errors="replace")

    ready_r, ready_w = os.pipe()
    import threading
    result = []
    t = threading.Thread(target=lambda: result.append(run_as(NOBODY, NOBODY, attack)))
    t.start()
    return t, result, ready_r


def test_relay_wider_than_its_master_is_refused(start_bus, open_dir, tmp_path):
    """`sbus-relay -m 0777 --upstream <0700 bus>`: refused at start in one line, exit status 1.
    It used to serve, and uid 65534 read the private bus's traffic through it."""
    from test_relay import Relay

    master = start_bus(address=os.path.join(open_dir, "master.socket"))   # 0700: root only
    where = os.path.join(open_dir, "relay.socket")
    r = Relay(master.address, where, tmp_path, "--mode", "0777", wait=False)
    try:
        def exited_or_serving():
            return r.proc.poll() is not None or os.path.exists(where)
        from helpers import wait_until
        wait_until(exited_or_serving, "the relay exits or serves")
        if r.proc.poll() is None:      # the old code: it serves; show what the other uid gets
            r.wait_ready()
            t, result, ready = _listen_as_nobody(where, b"payroll/")
            os.read(ready, 1)
            with connect(master.address) as owner:
                send(owner, msg(b"payroll/1", b"salaries"))
                sync(owner)
            t.join(TIMEOUT)
            pytest.fail(f"the relay serves a 0777 socket below a 0700 bus; uid 65534: {result}")
        assert r.proc.returncode == 1, r.log()[-500:]
        lines = [line for line in r.log().splitlines() if "--mode" in line]
        assert lines and "could not open the bus" in lines[0] and "Traceback" not in r.log(), r.log()[-800:]
        assert not os.path.exists(where)
    finally:
        r.stop()


def test_gateway_unix_socket_no_wider_than_the_path_to_the_bus_lets_in(start_bus, open_dir, tmp_path):
    """The bus socket is 0777 but lies in a 0700 directory: only its owner can open it. The
    gateway's `unix:` socket took the socket's bits alone (0777, in an open directory); now
    judged as `allows` judges (the whole path): 0700."""
    import stat as stat_mod

    from test_bridge import TwistdProcess

    private = os.path.join(open_dir, "private")
    os.mkdir(private, 0o700)
    bus = start_bus("-o", address=os.path.join(private, "bus.socket"))
    os.chmod(bus.address, 0o777)
    path = os.path.join(open_dir, "gw.sock")
    p = TwistdProcess(["sbus-msgbus", "--bus", bus.address, "--port", f"unix:{path}"], tmp_path)
    try:
        p.wait_log(r"msgbus gateway listening on")
        assert stat_mod.S_IMODE(os.stat(path).st_mode) == 0o700
    finally:
        p.stop()


# ---------------------------------------------------------------- 1: sbus-link over TLS, the wrong peer


def _make_pki(d: str, servers: dict) -> dict:
    """A CA, a client certificate, and one server certificate per entry of `servers`
    (label -> list of subjectAltName entries, [] for none; CN is always 'a.example')."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(label, k, c):
        cert, key = os.path.join(d, f"{label}.pem"), os.path.join(d, f"{label}.key")
        with open(cert, "wb") as f:
            f.write(c.public_bytes(serialization.Encoding.PEM))
        with open(key, "wb") as f:
            f.write(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
        os.chmod(key, 0o644)               # the attacker (uid 65534) runs a listener with it
        return cert, key

    def build(cn, issuer, issuer_key, sans=(), ca=False):
        k = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer)
             .public_key(k.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return k, b.sign(issuer_key or k, hashes.SHA256())

    ca_key, ca_cert = build("trust test CA", name("trust test CA"), None, ca=True)
    os.makedirs(os.path.join(d, "ca"))
    with open(os.path.join(d, "ca", "ca.pem"), "wb") as f:
        f.write(ca_cert.public_bytes(serialization.Encoding.PEM))
    out = {"cadir": os.path.join(d, "ca"), "client": write("client", *build("client", ca_cert.subject, ca_key))}
    for label, sans in servers.items():
        entries = [x509.IPAddress(ipaddress.ip_address(v)) if v[0].isdigit() else x509.DNSName(v) for v in sans]
        out[label] = write(label, *build("a.example", ca_cert.subject, ca_key, entries))
    return out


_SERVERS = {"good": ["a.example"], "no_san": [], "other_name": ["b.example"], "ip_only": ["127.0.0.1"],
            "other_ip": ["127.0.0.2"]}


@pytest.mark.parametrize("cert, hostname", [
    ("no_san", "a.example"),       # CN=a.example, no subjectAltName (service_identity: CertificateError)
    ("other_name", "a.example"),   # signed by the same CA for b.example
    ("ip_only", "a.example"),      # an IP address, not the name asked for
    ("other_ip", "127.0.0.1"),     # hostname= an IP: the certificate is for another one
])
def test_link_refuses_a_tls_peer_whose_certificate_names_someone_else(start_bus, open_dir, tmp_path, cert,
                                                                      hostname):
    """uid 65534 runs a link listener with a certificate the CA signed for someone else. The
    connecting link (root, on a private bus) used to log Twisted's critical line and go 'link up'
    (a certificate without subjectAltName), messages crossing both ways. Now refused after the
    handshake, nothing crosses; the right certificate still works (the control below)."""
    from test_link import LinkProc, run_link_as, stop_child
    from helpers import wait_until

    pki = _make_pki(os.path.join(open_dir, "pki"), _SERVERS)
    private = start_bus()
    shared = _open_bus(start_bus, open_dir, "shared.socket")
    log_path = os.path.join(open_dir, "rogue.log")
    srv_cert, srv_key = pki[cert]
    rogue = run_link_as(NOBODY, log_path, [
        "--bus", shared.address, "--listen",
        f"ssl:0:interface=127.0.0.1:privateKey={srv_key}:certKey={srv_cert}:caCertsDir={pki['cadir']}"])
    victim = None
    try:
        def rogue_log():
            with open(log_path, errors="replace") as f:
                return f.read()
        wait_until(lambda: "listening on" in rogue_log() or rogue.poll() is not None, "the rogue listener")
        import re
        port = int(re.search(r"listening on .*port=(\d+)", rogue_log()).group(1))
        secret_sub = connect(private.address)
        send(secret_sub, sub(b"inject/"))
        sync(secret_sub)
        spy = connect(shared.address)
        send(spy, sub(b"payroll/"))
        sync(spy)
        cli_cert, cli_key = pki["client"]
        victim = LinkProc(tmp_path, private, "--connect",
                          f"ssl:host=127.0.0.1:port={port}:caCertsDir={pki['cadir']}:hostname={hostname}"
                          f":certKey={cli_cert}:privateKey={cli_key}", name="victim")
        decided = ("link up", "does not prove the name", "closed before the link was up")
        wait_until(lambda: any(w in victim.log() for w in decided), "the victim decides")
        with connect(private.address) as p, connect(shared.address) as q:
            send(p, msg(b"payroll/1", b"salaries"))
            send(q, msg(b"inject/1", b"shutdown"))
            sync(p), sync(q)
        assert "link up" not in victim.log(), "the link accepted the wrong certificate: " + \
            [line for line in victim.log().splitlines() if "link up" in line][0][-200:]
        assert "does not prove the name" in victim.log() or "VerificationError" in victim.log()
        for s in (secret_sub, spy):
            with pytest.raises(TimeoutError):
                got = recv(s, 0.5)                       # nothing crossed (never-arrives check)
                pytest.fail(f"crossed: {got[:80]!r}")
    finally:
        if victim is not None:
            victim.stop()
        stop_child(rogue)


def test_link_tls_control_the_right_certificate_links(start_bus, open_dir, tmp_path):
    """The control of the test above: the certificate for a.example (and one for the IP asked
    for) is accepted, messages cross."""
    from test_link import LinkProc, wait_flow

    pki = _make_pki(os.path.join(open_dir, "pki"), _SERVERS)
    bus_a, bus_b = start_bus(), start_bus()
    for cert, hostname in (("good", "a.example"), ("ip_only", "127.0.0.1")):
        srv_cert, srv_key = pki[cert]
        a = LinkProc(tmp_path, bus_a, "--listen", f"ssl:0:interface=127.0.0.1:privateKey={srv_key}"
                     f":certKey={srv_cert}:caCertsDir={pki['cadir']}", name=f"a-{cert}")
        cli_cert, cli_key = pki["client"]
        b = LinkProc(tmp_path, bus_b, "--connect", f"ssl:host=127.0.0.1:port={a.port()}:caCertsDir={pki['cadir']}"
                     f":hostname={hostname}:certKey={cli_cert}:privateKey={cli_key}", name=f"b-{cert}")
        try:
            b.wait_log("link up")
            r = connect(bus_b.address)
            send(r, sub(b"probe/"))
            assert sync(r) == []
            assert wait_flow(bus_a.address, r), f"nothing crossed the link with the {cert} certificate"
            r.close()
        finally:
            b.stop()
            a.stop()


def test_link_ssl_connect_without_hostname_is_refused(tmp_path):
    """An ssl: connect without hostname= checks no name: refused at start, one line."""
    import subprocess
    import sys

    from test_relay import child_env

    r = subprocess.run([sys.executable, "-m", "twisted", "sbus-link", "--bus", "x.sock", "--connect",
                        "ssl:host=127.0.0.1:port=7010:caCertsDir=ca:certKey=c.pem:privateKey=c.key"],
                       capture_output=True, timeout=TIMEOUT, cwd=tmp_path, env=child_env(),
                       stdin=subprocess.DEVNULL)
    err = r.stderr.decode().strip()
    assert r.returncode != 0 and len(err.splitlines()) == 1 and "hostname=" in err, err


# ---------------------------------------------------------------- 5: forged spanning-tree hellos

ZERO = "0" * 36


def _capture_announcement(address: str) -> bytes:
    """As the caller: the payload of the first public ``sbus/topology/hello`` heard on the bus."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(TIMEOUT)
    s.connect(address)
    send(s, sub(b"sbus/topology/hello"))
    while True:
        p = recv(s, 3 * TIMEOUT)
        if p.startswith(b"MSG sbus/topology/hello\0"):
            s.close()
            return p.split(b"\0", 1)[1]


def _forge_hellos(address: str, heard: bytes, n: int) -> str:
    """As uid 65534: every forgery we know of, `n` times each, then a round trip (all routed)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(TIMEOUT)
    s.connect(address)
    gid, uid, pid = whoami(s)
    mine = "!/cred/%d/%d/%d" % (gid, uid, pid)
    body = json.loads(heard)
    victim = body.get("who")
    # the bridge's hello, replayed with the lowest node id and one hop less: "side b already
    # reaches the root" (an announcement names no root: any will do, it is refused anyway)
    old = dict(body, v=1, root=body.get("root", "8" * 36), node=ZERO, cost=max(body.get("cost", 0) - 1, 0),
               port=1, role="designated", name="forged")
    old.pop("who", None)
    forged = json.dumps(old).encode()
    packets = [msg(b"sbus/topology/hello", forged),
               msg(b"sbus/topology/hello", json.dumps({"v": 2, "who": mine}).encode()),
               msg(b"sbus/topology/change", b"forged")]
    if victim:
        w = victim.encode()
        packets += [msg(w + b"/sbus-topology/hello", b"\0".join((b"0" * 64, b"0" * 16, b"!/cred/0/0/1", forged))),
                    msg(w + b"/sbus-topology/auth", json.dumps({"from": "!/cred/0/0/1", "n": "1" * 32,
                                                                  "echo": "2" * 32}).encode()),
                    msg(w + b"/sbus-topology/auth", json.dumps({"from": "!/cred/0/0/1", "echo": "3" * 32}).encode())]
    for i in range(n):
        send(s, *packets)
        # a claim of a trusted uid's (non-existent) process: makes the bridge ask, rate-limited
        send(s, msg(b"sbus/topology/hello", json.dumps({"v": 2, "who": f"!/cred/0/0/{4000000 + i}"}).encode()))
    sync(s, 3 * TIMEOUT)
    s.close()
    return "sent"


def test_forged_hellos_of_another_uid_do_not_make_a_bridge_stand_by(start_bus, open_dir, twistd):  # noqa: F811
    """uid 65534 on the shared side of a bridge into a private bus replays the bridge's hello
    with node 000…0 and cost 0, announces itself, claims root's processes, sends forged hellos
    and handshake answers to the bridge's secret key and change notices: thousands of each.
    The bridge used to stand by ("loop: side b is already reached through forged") and lose
    the probes. Now nothing of it reaches the tree: every probe crosses, no stand-by."""
    private = start_bus()
    shared = _open_bus(start_bus, open_dir, "shared.socket")
    bridge = start_bridge(twistd, private.address, shared.address, "probe/ b>a")
    heard = _capture_announcement(shared.address)
    receiver = connect(private.address)
    send(receiver, sub(b"probe/"))
    sync(receiver)
    assert run_as(NOBODY, NOBODY, lambda: _forge_hellos(shared.address, heard, 2000)) == "sent"
    # the bridge reads side b in order: everything forged comes before these probes
    with connect(shared.address) as pub:
        for i in range(20):
            send(pub, msg(b"probe/%d" % i, b"x"))
            got = recv(receiver, TIMEOUT)
            assert got == msg(b"probe/%d" % i, b"x"), (i, got[:80], bridge.log()[-600:])
    assert "standing by" not in bridge.log(), [l for l in bridge.log().splitlines() if "standing by" in l][0]
    st = json.loads(_ask_stats(shared.address, b"x"))["stats"]["spanning_tree"]
    assert st["forwarding"] and st["refused"].get("untrusted") and st["refused"].get("forged"), st["refused"]
    assert st["refused"].get("throttled"), st["refused"]
    receiver.close()


def _announce_and_listen(address: str) -> str:
    """As the caller: announce ourselves as a tree node, then ask for statistics (the bridge
    answers after it has handled the announcement); return 'challenged' if a challenge to our
    secret key came first, else 'ignored'."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(TIMEOUT)
    s.connect(address)
    gid, uid, pid = whoami(s)
    mine = b"!/cred/%d/%d/%d" % (gid, uid, pid)
    send(s, sub(mine + b"/"))
    sync(s)
    send(s, msg(b"sbus/topology/hello", json.dumps({"v": 2, "who": mine.decode()}).encode()),
         msg(b"sbus/services/stats", mine + b"/stats"))
    while True:
        p = recv(s, TIMEOUT)
        if p.startswith(b"MSG " + mine + b"/sbus-topology/auth\0"):
            return "challenged"
        if p.startswith(b"MSG " + mine + b"/stats\0"):
            return "ignored"


@pytest.mark.parametrize("trust", [False, True])
def test_bridge_talks_only_to_trusted_uids(start_bus, open_dir, twistd, trust):  # noqa: F811
    """A tree node announced by uid 65534 is not even challenged (the bridge trusts its own
    uids and root); with --trust-uid 65534 it is (and would be proven, as any peer)."""
    private = start_bus()
    shared = _open_bus(start_bus, open_dir, "shared.socket")
    extra = ("--trust-uid", str(NOBODY)) if trust else ()
    start_bridge(twistd, private.address, shared.address, "probe/ b>a", extra=extra)
    assert run_as(NOBODY, NOBODY, lambda: _announce_and_listen(shared.address)) == \
        ("challenged" if trust else "ignored")


# ---------------------------------------------------------------- still open before: the gateway's memory per uid


def test_gateway_memory_is_bounded_per_uid(start_bus, open_dir, tmp_path):
    """uid 65534 (allowed: the bus is open) opens connection after connection, each holding an
    unfinished 250 KB send. Each connection was within its own bounds, so with --max-clients
    (4,096) one uid could pin about 1.6 GB. Now everything its connections hold counts against
    --max-uid-bytes: the connection that goes over is told and closed; the owner is served."""
    import re

    from test_bridge import TwistdProcess

    bus = _open_bus(start_bus, open_dir, "bus.socket")
    gw = TwistdProcess(["sbus-msgbus", "--bus", bus.address, "--port", "tcp:0:interface=127.0.0.1",
                        "--max-uid-bytes", "2100000"], tmp_path)
    try:
        text = gw.wait_log(r"msgbus gateway listening on 127\.0\.0\.1:\d+")
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", text).group(1))
        gw.wait_log(r"connected to the bus")

        def attack():
            conns, told = [], []
            for i in range(12):
                c = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
                c.sendall(b"ping\n")
                assert c.recv(100) == b"pong\n"
                c.sendall(b"send 300000 chan\n" + b"x" * 250_000)
                c.sendall(b"ping\n")                       # inside the message: no answer expected
                conns.append(c)
            # 8 x 250,005 bytes fit in 2,100,000: those are served (finish the message, ping);
            # each later one went over: told in one line, closed
            for c in conns[8:]:
                c.settimeout(TIMEOUT)
                got = b""
                while chunk := c.recv(4096):
                    got += chunk
                told.append(got.decode(errors="replace").strip())
            served = 0
            for c in conns[:8]:
                c.sendall(b"x" * (300_000 - 250_005) + b"ping\n")
                c.settimeout(TIMEOUT)
                got = b""  # `ack send` lines (as the original msgbus server) come first
                while b"pong\n" not in got and (chunk := c.recv(4096)):
                    got += chunk
                served += got.endswith(b"pong\n")
            return f"{len(told)} told, {served} served: {told[:1]}"

        result = run_as(NOBODY, NOBODY, attack)
        assert result.startswith("4 told, 8 served") and "--max-uid-bytes" in result, result
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as owner:
            owner.sendall(b"ping\n")
            assert owner.recv(100) == b"pong\n"
    finally:
        gw.stop()


# ---------------------------------------------------------------- the server's -u list


def test_gateway_honours_the_servers_user_list(start_bus, open_dir, tmp_path):
    """The bus socket is 0777 but the server admits only root (-u 0): uid 65534 cannot use it.
    The gateway judges from the mode bits alone, so it admits 65534, who then publishes on the
    bus as the gateway's uid."""
    import re

    from test_bridge import TwistdProcess

    bus = start_bus("-o", "-u", "0", address=os.path.join(open_dir, "bus.socket"))
    os.chmod(bus.address, 0o777)
    gw = TwistdProcess(["sbus-msgbus", "--bus", bus.address, "--port", "tcp:0:interface=127.0.0.1"], tmp_path)
    try:
        text = gw.wait_log(r"msgbus gateway listening on 127\.0\.0\.1:\d+")
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", text).group(1))
        gw.wait_log(r"connected to the bus")

        def attack():
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as c:
                c.sendall(b"ping\n")
                return c.recv(200).decode(errors="replace").strip()

        assert run_as(NOBODY, NOBODY, attack).startswith("error uid 65534")
    finally:
        gw.stop()


def test_access_takes_the_servers_user_list_when_reported(start_bus, open_dir):
    """The service side of the test above: until the server's statistics name its -u list, only
    root and our own uid pass (an unknown list is closed); then a uid the mode bits let in but
    the list does not is refused (root and our own uid always pass)."""
    from sbus.services.admission import Admission

    bus = _open_bus(start_bus, open_dir, "bus.socket")
    access = Admission(bus.address, "test")
    assert access.refusal(NOBODY) is not None and access.refusal(0) is None
    access.learn(b'{"clients": 1, "scope": "uid"}')   # a view that does not say: still unknown
    assert access.refusal(NOBODY) is not None
    access.learn(b'{"allowed_uids": null}')           # no -u list: the modes decide
    assert access.refusal(NOBODY) is None
    access.learn(b'{"allowed_uids": [0, 1000]}')
    assert access.refusal(NOBODY) is not None and access.refusal(0) is None
    assert access.refusal(os.getuid()) is None
    assert "-u users 0,1000" in access.describe()
