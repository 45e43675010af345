"""Who a service lets onto its bus: the one admission rule of every service that accepts
connections and carries them onto a bus (``sbus-relay``, the msgbus gateway, ``sbus-link``'s
unix listeners, and any later one).

**A peer is admitted only if the bus the service reaches would admit that uid itself:**

* root, and the service's own uid (it is on the bus already);
* the bus's ``-u`` list, asked of the bus (its ``server/stats`` names it as ``allowed_uids``
  to root and its own uid: `Admission.learn`). Until the bus has answered, or when it does not
  say (the service is not privileged there), nobody else is admitted: an unknown list is a
  closed one;
* a bus on a path: the kernel's own answer for that uid with the peer process's own groups
  (search on every directory of the path, write on the socket, judged against the bus
  socket's owner and group: `sbus.services.access.could_connect`). The groups are the peer's
  egid (``SO_PEERCRED``) and supplementary groups from ``/proc/PID/status`` (the user
  database's when that process cannot be read as the same uid), never the service's own;
* a bus with no file mode (abstract, ``/dev/fd/N``): only the uids its ``-u`` list names.

It is checked per connection, from ``SO_PEERCRED`` (or the TCP owner, `access.peer_credentials`),
whatever kind of socket the service listens on: a path, an abstract name, ``/dev/fd/N`` or
systemd's. The service's own socket mode is a second fence (`access.BusAccess.wider`), never
the decision. A refused peer gets one log line (`Admission.admit`) and is closed.
"""

from __future__ import annotations

import json

from twisted.logger import Logger

from sbus.services.access import BusAccess, could_connect, peer_credentials, user_groups

log = Logger(namespace="sbus.admission")


def process_groups(pid: int | None, uid: int, gid: int | None) -> set[int]:
    """The groups the kernel would judge the peer by: its egid and its supplementary groups,
    read from ``/proc/PID/status`` while that process still has our peer's uid (and egid);
    the user database's for the uid otherwise (a process gone, or unreadable)."""
    groups = {gid} if gid is not None else set()
    if pid:
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            uids = fields["Uid"].split()
            gids = fields["Gid"].split()
            if int(uids[1]) == uid and (gid is None or int(gids[1]) == gid):
                return groups | {int(g) for g in fields.get("Groups", "").split()}
        except (OSError, KeyError, IndexError, ValueError):
            pass
    return groups | user_groups(uid)


class Admission:
    """The rule (module text) for one service in front of the bus at `address`."""

    def __init__(self, address, service: str):
        self.service = service
        #: The bus's path, mode and owner; the fence for the sockets the service creates.
        self.access = BusAccess(address)
        self.own_uid = self.access.own_uid
        #: The bus's ``-u`` list; ``known`` once the bus answered (None in it: no list).
        self.known = False
        self.server_users: frozenset[int] | None = None
        self.refused = 0
        #: Has the bus had its chance to say (`settle`)? Until then a service holds new peers.
        self.settled = False
        self._waiting: list = []

    def whenSettled(self, call) -> None:
        """Call `call()` once the bus has answered ``server/stats`` or shown it will not (`settle`)."""
        if self.settled:
            call()
        else:
            self._waiting.append(call)

    def ask(self, proto) -> None:
        """Ask the bus `proto` has just connected to whom it admits (`learn`), then `settleAfter`."""
        proto.server_request(b"server/stats").addCallbacks(self.learn, lambda f: None)
        self.settleAfter(proto)

    def settleAfter(self, proto) -> None:
        """`settle` once a round trip sent now comes back: a bus answers in order, so by then it
        has answered a ``server/stats`` request sent before, or never will (a reference server).
        A connection lost first settles nothing: the next one asks again."""
        if not self.settled:
            proto.sync().addCallbacks(lambda _: self.settle(), lambda f: None)

    def settle(self) -> None:
        """The round trip after the ``server/stats`` request came back: what the bus tells, it
        told (`learn`); from now on `refusal` is final. Runs the `whenSettled` calls."""
        self.settled = True
        waiting, self._waiting = self._waiting, []
        for call in waiting:
            call()

    def learn(self, stats) -> None:
        """Take the ``-u`` list from the bus's ``server/stats`` (a dict, or its JSON payload).
        An answer that does not name one (the uid-scoped view another uid gets) leaves the list
        unknown: closed to everyone but root and us. Logs one line when what it admits changes."""
        if isinstance(stats, (bytes, str)):
            try:
                stats = json.loads(stats)
            except (ValueError, UnicodeDecodeError):
                return
        if not isinstance(stats, dict) or "allowed_uids" not in stats:
            return
        users = stats["allowed_uids"]
        if users is not None and not (isinstance(users, list) and all(type(u) is int for u in users)):
            return
        before = (self.known, self.server_users)
        self.server_users, self.known = (None if users is None else frozenset(users)), True
        if (self.known, self.server_users) != before:
            log.info("{service}: admits {who}", service=self.service, who=self.describe())

    def refusal(self, uid: int | None, pid: int | None = None, gid: int | None = None,
                how: str = "SO_PEERCRED") -> str | None:
        """None if the bus would admit `uid` (process `pid`, egid `gid`) itself; else why not
        (`how`: where the uid was read)."""
        if uid is None:
            return f"uid unknown ({how})"
        if uid == self.own_uid or uid == 0:
            return None
        if not self.known:
            return (f"uid {uid} ({how}) may not reach the bus: its -u list is not known to us (it has not "
                    f"answered, or does not tell uid {self.own_uid}); only root and uid {self.own_uid} pass")
        no = f"uid {uid} ({how}) may not open the bus; allowed: {self.describe()}"
        if self.server_users is not None and uid not in self.server_users:
            return no
        path = self.access.path
        if path is None:
            return None if self.server_users is not None else no  # only the bus's own -u list names
        return None if could_connect(path, uid, process_groups(pid, uid, gid)) else no

    def admit(self, uid: int | None, pid: int | None = None, gid: int | None = None,
              peer: str = "", how: str = "SO_PEERCRED") -> str | None:
        """`refusal`, with the one log line a refused peer gets (the caller closes it)."""
        why = self.refusal(uid, pid, gid, how)
        if why is not None:
            self.refused += 1
            log.warn("{service}: refused {peer}pid {pid}: {why}", service=self.service,
                     peer=f"{peer}, " if peer else "", pid=pid, why=why)
        return why

    def admit_transport(self, transport, peer: str = "") -> str | None:
        """`admit` for a connected Twisted transport (unix: SO_PEERCRED; TCP: its local owner)."""
        pid, uid, gid, how = peer_credentials(transport)
        return self.admit(uid, pid, gid, peer, how)

    def describe(self) -> str:
        users = ("its -u list not known yet" if not self.known else "no -u list" if self.server_users is None
                 else "-u users " + ",".join(map(str, sorted(self.server_users))))
        if self.access.path is None:
            where = "an address with no file mode: only the uids its -u list names"
        else:
            mode, uid, gid = self.access.socket_mode()
            where = f"uids that could open {self.access.path} (mode {mode:04o}, owner uid {uid}, gid {gid})"
        return f"root, uid {self.own_uid} and {where}; {users}"


class AdmittingFactory:
    """A listening port's factory that asks the rule before the bus's own factory builds a
    protocol for a connection (``addr.cred``: ``SO_PEERCRED``); None refuses (the port closes)."""

    def __init__(self, factory, admission: Admission):
        self.factory = factory
        self.admission = admission

    def buildProtocol(self, addr):
        cred = addr.cred
        if self.admission.admit(cred.uid, cred.pid, cred.gid) is not None:
            return None
        return self.factory.buildProtocol(addr)

    def smallSendBuffer(self, uid: int) -> bool:
        """As the bus's own factory decides (`BrokerFactory.smallSendBuffer`)."""
        small = getattr(self.factory, "smallSendBuffer", None)
        return small is None or small(uid)

    def doStart(self):
        self.factory.doStart()

    def doStop(self):
        self.factory.doStop()
