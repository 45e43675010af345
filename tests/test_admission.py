"""Issue 33 items 1-3: one admission rule (`sbus.services.admission`) for every service that
accepts connections and carries them onto a bus, through real processes: every service
(sbus-relay, the msgbus gateway) x every socket kind it can serve on (a path, an abstract
name, an inherited ``/dev/fd/N``, systemd's ``LISTEN_FDS``) x three peers:

* ``allowed``: uid 61001 with the master socket's group (0) as a *supplementary* group only,
  and on the master's ``-u`` list. Only ``/proc/PID/status`` knows that group (the uid has
  no user database entry): served. (Every peer has the group of the services' own path
  sockets, 61200, so that their file mode never decides.)
* ``other uid``: uid 61002, in the master's group (the mode would let it in) but not on its
  ``-u`` list (item 2): refused. The old relay asked nothing of its master.
* ``other group``: uid 61003, on the ``-u`` list, in the group of the *service's* socket
  (a setgid directory gives it group 61200) but not the master's (item 3): refused. The old
  relay judged group access by its own egid.

On an abstract, ``/dev/fd`` or systemd socket the kernel checks nothing: the rule alone
stands between a peer and a 0770 master (item 1: the old relay served everyone there).
One master, one of each service, started once for the module, side by side.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import uuid

import pytest

from helpers import LoggedProcess, SbusdProcess, run_as
from test_address import SYSTEMD_SHIM

from sbus.address import sockaddr

ALLOWED, OTHER_UID, OTHER_GROUP = 61001, 61002, 61003
SERVICE_GROUP = 61200          # the setgid directory's group: the services' path sockets get it
#: uid, supplementary groups: every peer may pass the services' own path sockets (their group)
PEERS = {"allowed": (ALLOWED, [0, SERVICE_GROUP]), "other uid": (OTHER_UID, [0, SERVICE_GROUP]),
         "other group": (OTHER_GROUP, [SERVICE_GROUP])}
KINDS = ["path", "abstract", "fd", "systemd"]
TIMEOUT = 20.0
#: Nine processes start at once: on a loaded 2-core machine that takes its time.
START_TIMEOUT = 120.0


def _abstract() -> str:
    return "/dev/unix/abstract/00" + uuid.uuid4().hex


def _listening(kind: int, address: str) -> socket.socket:
    """A listening socket bound to an abstract `address`, to hand over as /dev/fd/N or systemd's."""
    s = socket.socket(socket.AF_UNIX, kind)
    s.bind(sockaddr(address))
    s.listen(16)
    return s


class _Services:
    """The master, and each service on each socket kind: name -> (process, address to reach)."""

    def __init__(self, d: str):
        self.d = d
        self.procs = []
        self.held = []
        self.master = SbusdProcess(["-f", "-a", os.path.join(d, "master.socket"), "-g",
                                    "-u", str(ALLOWED), "-u", str(OTHER_GROUP)],
                                   os.path.join(d, "master.log"), address=os.path.join(d, "master.socket"))
        self.procs.append(self.master)
        self.open = os.path.join(d, "open")        # setgid: what the services create gets its group
        os.mkdir(self.open)
        os.chown(self.open, 0, SERVICE_GROUP)
        os.chmod(self.open, 0o2775)
        try:
            self.relays = {kind: self._relay(kind) for kind in KINDS}
            self.gateways = {kind: self._gateway(kind) for kind in KINDS}
            for proc, _ in [*self.relays.values(), *self.gateways.values()]:
                proc.wait_log("admits root", timeout=START_TIMEOUT)
        except BaseException:
            self.stop()  # none left behind for the rest of the run
            raise

    def _start(self, kind: str, args: list, handed: socket.socket | None) -> LoggedProcess:
        twistd = [sys.executable, "-m", "twisted", "--log-format", "text"]
        popen = {}
        if handed is None:
            argv = [*twistd, *args]
        else:
            self.held.append(handed)
            popen["pass_fds"] = (handed.fileno(),)
            if kind == "systemd":   # LISTEN_PID must be the service's own pid: exec keeps it
                # the names too: Twisted's systemd: endpoint wants LISTEN_FDNAMES (systemd >= 227)
                shim = SYSTEMD_SHIM.replace("LISTEN_FDS='1'", "LISTEN_FDS='1', LISTEN_FDNAMES='x'")
                argv = [sys.executable, "-c", shim, str(handed.fileno()), *twistd, *args]
            else:
                argv = [*twistd, *args]
        p = LoggedProcess(argv, os.path.join(self.d, f"{args[0]}-{kind}.log"), cwd=self.d, **popen)
        self.procs.append(p)
        return p

    def _relay(self, kind: str):
        handed = None
        if kind == "path":
            where = reach = os.path.join(self.open, "relay.socket")
        elif kind == "abstract":
            where = reach = _abstract()
        else:
            reach = _abstract()
            handed = _listening(socket.SOCK_SEQPACKET, reach)
            where = f"/dev/fd/{handed.fileno()}" if kind == "fd" else "systemd"
        args = ["sbus-relay", "--bus", self.master.address, "--socket", where, "--mode", "0770"]
        return self._start(kind, args, handed), reach

    def _gateway(self, kind: str):
        handed = None
        if kind == "path":
            reach = os.path.join(self.open, "gw.socket")
            port = f"unix:{reach}"
        elif kind == "abstract":
            reach = _abstract()
            port = f"unix:{reach}"
        else:
            reach = _abstract()
            handed = _listening(socket.SOCK_STREAM, reach)
            port = f"unix:/dev/fd/{handed.fileno()}" if kind == "fd" else "systemd:domain=UNIX:index=0"
        args = ["sbus-msgbus", "--bus", self.master.address, "--port", port]
        return self._start(kind, args, handed), reach

    def stop(self):
        for p in reversed(self.procs):
            p.stop()
        for s in self.held:
            s.close()


@pytest.fixture(scope="module")
def services():
    d = tempfile.mkdtemp(prefix="sbus-admission-")
    os.chmod(d, 0o755)
    s = _Services(d)
    yield s
    s.stop()
    shutil.rmtree(d, ignore_errors=True)


def _whoami(address: str) -> str:
    """As the caller: 'served' (the relay answered whoami), 'refused' (closed on us) or 'EACCES'."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(TIMEOUT)
    try:
        s.connect(sockaddr(address))
    except PermissionError:
        return "EACCES"
    try:
        s.send(b"CMSG !/cred/whoami")
        reply = s.recv(4096)
    except (ConnectionResetError, BrokenPipeError):
        return "refused"
    finally:
        s.close()
    return "served" if reply.startswith(b"CMSG !/cred/whoami\0") else "refused" if not reply else repr(reply)


def _ping(address: str) -> str:
    """As the caller: 'served' (the gateway answered pong), 'refused' (error line, closed) or 'EACCES'."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(TIMEOUT)
    try:
        s.connect(sockaddr(address))
    except PermissionError:
        return "EACCES"
    got = b""
    try:
        s.sendall(b"ping\n")
        while b"\n" not in got and (chunk := s.recv(200)):
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        s.close()
    if got.startswith(b"pong"):
        return "served"
    return "refused" if not got or got.startswith(b"error uid") else repr(got)


@pytest.mark.parametrize("peer", list(PEERS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("service", ["relay", "gateway"])
def test_a_service_admits_whom_its_master_would(services, service, kind, peer):
    proc, address = (services.relays if service == "relay" else services.gateways)[kind]
    uid, groups = PEERS[peer]
    before = proc.log().count(f"uid {uid} (SO_PEERCRED) may not")
    got = run_as(uid, uid, lambda: (_whoami if service == "relay" else _ping)(address), groups=groups)
    if peer == "allowed":
        assert got == "served", (got, proc.log()[-1500:])
        return
    # the kernel let it in on every kind (the mode of the path sockets included): the rule refuses,
    # with one log line naming the uid, and why
    assert got == "refused", (got, proc.log()[-1500:])
    text = proc.wait_log(f"uid {uid} (SO_PEERCRED) may not", count=before + 1)
    assert "Traceback" not in text


def test_the_kernel_would_let_the_other_group_into_the_path_sockets(services):
    """The "other group" peer on a path really reaches the services' sockets (their group is
    the setgid directory's): what stops it there is the rule, not the file mode."""
    uid, groups = PEERS["other group"]
    for ask, (_, address) in ((_whoami, services.relays["path"]), (_ping, services.gateways["path"])):
        assert os.stat(address).st_gid == SERVICE_GROUP and os.stat(address).st_mode & 0o070
        assert run_as(uid, uid, lambda: ask(address), groups=groups) == "refused"


def test_the_master_itself_agrees(services):
    """The peers as the master sees them, so the matrix above asks the right question."""
    def direct():
        return _whoami(services.master.address)
    assert run_as(ALLOWED, ALLOWED, direct, groups=[0]) == "served"
    assert run_as(OTHER_UID, OTHER_UID, direct, groups=[0]) == "refused"        # -u list
    assert run_as(OTHER_GROUP, OTHER_GROUP, direct, groups=[SERVICE_GROUP]) == "EACCES"  # mode


def test_a_relay_that_cannot_learn_the_masters_list_admits_only_root_and_itself(tmp_path):
    """`Admission.learn`: a view of the master's statistics without ``allowed_uids`` (another
    uid's) leaves the list unknown, and an unknown list is closed."""
    from sbus.services.admission import Admission

    a = Admission(str(tmp_path / "nothing.socket"), "test")
    a.learn({"scope": "uid", "clients": 1})
    assert a.refusal(ALLOWED) is not None and a.refusal(0) is None and a.refusal(os.getuid()) is None
