"""``twistd sbus-nats``: carry a bus over a NATS server or cluster.

    twistd -n --reactor=asyncio sbus-nats --bus /run/sbus.socket \\
        --server nats://n1.example:4222 --server nats://n2.example:4222 --tls-ca ca.pem \\
        --export sensors/ --import cmd/

The service is an ordinary client of the bus and of NATS (nats-py, asyncio,
run under Twisted's asyncio reactor; the plugin installs that reactor when
none is chosen, and refuses another one in one line).

* Messages published on the bus whose keys match an ``--export`` pattern
  are published on NATS under ``PREFIX.<subject of the key>``
  (`sbus.core.natsmap`: exact and reversible), with a header
  ``Sbus-Origin: <bus id>``.
* NATS messages whose subjects map to keys matching an ``--import`` pattern
  are published on the bus.
* Nothing crosses until asked: no ``--export``, nothing leaves; no
  ``--import``, nothing comes in.

Loops and duplicates. The bus connection has echo off, so what the service
publishes on the bus never comes back to it; the NATS connection has
``no_echo``, so what it publishes on NATS never comes back either; a
message whose ``Sbus-Origin`` is this bus's own id (``CMSG server/id``; a
random id of this process if the server does not answer it) is dropped, so
two sbus-nats on one bus do not feed each other.

Interest. Like a relay upward, the service subscribes on NATS only to what
local clients want: it asks the bus to be told which patterns other clients
hold (``CMSG server/interest``, docs/protocol.md "Server notices") and, for each
held pattern and each ``--import`` pattern that can select a common key,
subscribes to the NATS subject of their common part (`subject_meet`: a client
holding ``cmd/lamp/`` under ``--import cmd/`` makes ``sbus.cmd.lamp.>``); the
subscription goes when the last local holder leaves. Its own subscriptions
(its exports) do not count. A server that does not answer (the reference C
server, older ones) is detected (no end-of-listing before the sync reply) and
every ``--import`` pattern is subscribed for the life of the service, as does
``--static-imports`` (for a bus whose wanted messages are not all held on it:
a relay's master above it, for example). A subject inside another one needs
no subscription. Two overlapping subscriptions (``sbus.a.>`` and
``sbus.*.b``) each get a copy of what both match: the earlier one takes it,
the other skips it, so each message is published on the bus once and a key
always comes through the same subscription, in order. A subscription no
longer wanted is drained (what it received is still handed over) after the
ones that replace it are in place.

Reserved keys. ``sbus/topology/...`` (the spanning tree's announcements) and
``sbus/services/...`` (service requests such as stats) belong to one bus:
they are neither exported nor imported (``reserved_skipped``).

Secrets. Keys under ``!/cred/`` are exported only if an export pattern
names ``!/cred/`` itself (``""`` or ``*/`` do not), and imported only if an
import pattern does: a process id is local to a host, so a remote ``!/cred/``
key names whichever local process happens to have those ids. An explicit
``--import '!/cred/...'`` says "remote hosts may send private messages to
these local identities" (the sender is not authenticated by sbus: it is
whoever NATS lets publish on that subject).

Back-pressure and drops. When nats-py's outgoing buffer holds more than
``--max-pending`` bytes, the service stops reading the bus (the server's
flood control, ``hard block`` for this connection, then holds the
publishers) and reads again when the buffer drained to half. While NATS is
unreachable, nats-py buffers up to ``8 x --max-pending`` for the reconnect;
beyond that messages are dropped (reason ``nats_down``). The other way,
NATS cannot be asked to wait: imported messages queue for the bus up to
``--import-buffer`` bytes (64 MiB), beyond that they are dropped
(``bus_slow``). Every drop is
counted by reason in `stats()`; a stats line is logged every
``--stats-interval`` seconds if it changed, and at stop; the service also
answers ``sbus/services/stats`` requests on the bus (`sbus.services.svcstats`).

Restarts (docs/deploy.md "Restarts"). What a killed sbus-nats missed is counted
as ``lost["restart"]`` by someone alive. Bus -> NATS: the service holds the
bus session ``sbus-nats/<--name>`` (``CMSG server/session``), which the
server keeps counting for ``--session-linger`` seconds after a crash; the
successor subscribes, claims it and adds the count. NATS -> bus: exported
messages carry ``Sbus-Seq: <instance>.<n>``; importers acknowledge, per
exporter instance and at most every ACK_INTERVAL, the first and last number
they handled on ``_SBUS.ack.<instance>``; an exporter that hears a new
instance of an importer (same bus id and name) counts the numbers between the
predecessor's last acknowledgement and the successor's first. One sbus-nats
per name per bus: a second one exits.

Authentication. A NATS server anyone can reach is a way into the bus: whoever
connects to it reads what is exported and publishes what is imported, as the
bus's owner. So the service refuses to start without an authentication of its
own (``--creds``, ``--token-file``, ``--user``/``--password-file``, or
``--tls-cert``) unless ``--allow-unauthenticated`` names the risk; loopback is no
exception (every local user can reach a loopback port, the rule ``sbus-link``
applies to plain TCP). No secret is taken from the command line, which every local user
reads in ``/proc/PID/cmdline``: ``--token`` and ``--password``, and a password or token in
a ``--server`` URL, are refused in one line naming the file option; the files are read
at start and must be readable by their owner only (as ``sbus-link``'s ``--key-file``).

What it sees of the bus. Following what clients hold (not ``--static-imports``) needs
every uid's patterns in ``server/interest``: root, the bus's own uid, and uids the bus
owner grants (``sbusd``/``twistd sbus --service-uid``) see them; any other uid sees its
own only, and the service says so in one line at start.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import ssl
import stat
import sys
from urllib.parse import urlsplit

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python import usage

from sbus.core import codec
from sbus.core.codec import MAX_PACKET, ProtocolError
from sbus.core.credentials import SECRET_ROOT, CredentialError, check_key
from sbus.core.natsmap import (MappingError, check_prefix, key_to_subject, pattern_to_subject,
                               subject_covers, subject_matches, subject_meet, subject_to_key,
                               subjects_overlap)
from sbus.core.patterns import matches
from sbus.options import METRICS_OPTION, MISSING_BUS_HELP, RespelledOptions
from sbus.services.chassis import Chassis
from sbus.services.session import carried_note
from sbus.services.shutdown import stop_with_status
from sbus.services.svcstats import lost, unknown_gaps

#: Exit status when another sbus-nats of the same --name runs on the bus (a configuration error,
#: sysexits' EX_CONFIG: contrib/systemd's unit does not restart on it).
EXIT_NAME_TAKEN = 78
log = Logger(namespace="sbus.nats")

ORIGIN_HEADER = "Sbus-Origin"
#: ``<exporter instance>.<n>``: n counts what this exporter instance published on NATS (1, 2, ...).
SEQ_HEADER = "Sbus-Seq"
#: Importers acknowledge per exporter instance on ``_SBUS.ack.<instance>`` (no key maps to a
#: subject beginning with ``_SBUS``: natsmap escapes ``_``).
CONTROL_PREFIX = "_SBUS."
ACK_SUBJECT = CONTROL_PREFIX + "ack."
#: Seconds between an importer's acknowledgements (only when something new arrived).
ACK_INTERVAL = 0.02
#: Exporter instances an importer tracks, importer identities an exporter tracks.
MAX_EXPORTERS = 1024
MAX_PEERS = 1000
#: An exporter instance nothing arrived from for this long is forgotten by importers.
EXPORTER_IDLE = 300.0
MAX_ACK = 1024
#: Messages read from the bus before the session is claimed wait for the answer (a round trip).
MAX_HELD = 10000
NAME_RE = re.compile(r"[A-Za-z0-9._:@-]{1,100}\Z")
_INSTANCE_RE = re.compile(r"[0-9a-f]{16}\Z")
#: Control keys of one bus's services (the spanning tree's announcements, stats requests):
#: never exported nor imported, like a bridge or link never forwards them.
RESERVED = (b"sbus/topology/", b"sbus/services/")
#: NATS's default max_control_line is 4096 bytes: PUB/HPUB, subject and sizes must fit.
MAX_SUBJECT = 4000
EXTRA = "pip install 'sbus[nats]'"
#: Seconds to wait for the bus's interest listing (or any answer) before importing everything.
INTEREST_WAIT = 5.0


def _b(text) -> bytes:
    return os.fsencode(text) if isinstance(text, str) else bytes(text)


def _is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_servers(urls, tls: bool, allow_plain: bool) -> list[str]:
    """Validate ``--server`` URLs; plain ones off loopback need `allow_plain`. Returns them."""
    out = []
    for url in urls:
        u = urlsplit(url if "://" in url else f"nats://{url}")
        if u.scheme not in ("nats", "tls"):
            raise usage.UsageError(f"--server {url!r}: scheme must be nats:// or tls://")
        if not u.hostname:
            raise usage.UsageError(f"--server {url!r}: no host")
        if not (tls or u.scheme == "tls" or allow_plain or _is_loopback(u.hostname)):
            raise usage.UsageError(
                f"--server {url!r}: refusing a plain (unencrypted) connection to a host that is not "
                "loopback; use tls:// or --tls-ca, or --allow-plain")
        out.append(u.geturl())
    return out


def check_authenticated(servers, options) -> None:
    """Refuse a NATS connection that authenticates nobody unless --allow-unauthenticated says
    so: whoever can reach the NATS server (on loopback: every local user, as for sbus-link's
    plain TCP) could read what is exported and publish what is imported, as the bus's owner.
    TLS without a client certificate authenticates the server, not us: it does not count."""
    if options["allow-unauthenticated"]:
        return
    if options["creds"] or options["token-file"] or options["user"] or options["tls-cert"]:
        return
    raise usage.UsageError(
        "refusing a NATS connection without authentication: anyone who can reach "
        f"{', '.join(servers)} (on loopback: every local user) could read what is exported and "
        "publish what is imported; give --creds, --token-file, --user/--password-file or "
        "--tls-cert, or --allow-unauthenticated")


def check_no_inline_secret(options) -> None:
    """Every local user reads a command line (/proc/PID/cmdline): a secret there is public."""
    for inline, instead in (("token", "--token-file FILE"), ("password", "--password-file FILE")):
        if options[inline]:
            raise usage.UsageError(f"--{inline}: a secret on the command line is readable by every "
                                   f"local user (/proc/PID/cmdline); put it in a file of mode 0600 "
                                   f"and give {instead}")
    for url in options["servers"]:
        parts = urlsplit(url)
        if parts.username or parts.password:
            raise usage.UsageError(f"--server {parts.hostname or ''!s}: a token or password in the URL "
                                   "is readable by every local user (/proc/PID/cmdline); give "
                                   "--token-file FILE or --user NAME --password-file FILE instead")


def read_secret_file(option: str, path: str) -> str:
    """The secret in `path` (surrounding whitespace stripped), if only its owner (us or root)
    may read it; a UsageError of one line otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise usage.UsageError(f"--{option} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise usage.UsageError(f"--{option} {path}: not a regular file")
        if st.st_mode & 0o077:
            raise usage.UsageError(f"--{option} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets others "
                                   "read or change it; chmod 600 it")
        if st.st_uid not in (os.getuid(), 0):
            raise usage.UsageError(f"--{option} {path}: owned by uid {st.st_uid}, not by this user or root")
        data = os.read(fd, 65536)
    except OSError as e:
        raise usage.UsageError(f"--{option} {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    try:
        secret = data.decode().strip()
    except UnicodeDecodeError:
        raise usage.UsageError(f"--{option} {path}: not UTF-8 text") from None
    if not secret or "\n" in secret:
        raise usage.UsageError(f"--{option} {path}: must hold one line, the secret")
    return secret


def default_name(prefix: str, exports, imports) -> str:
    """The --name of an sbus-nats not given one: the same for the same subject prefix and
    patterns (a restarted process claims its predecessor's session), different otherwise
    (two sbus-nats with other patterns may share a bus)."""
    h = hashlib.sha256(repr((prefix, sorted(set(map(bytes, exports))),
                             sorted(set(map(bytes, imports))))).encode()).hexdigest()
    return f"{prefix or '-'}-{h[:12]}"


def _drive(coro, failed):
    """Run coroutine `coro` now, without a Task when it does not suspend (nats-py's publish
    only suspends when its buffer is over its limit); `failed(exc)` gets its exception."""
    try:
        fut = coro.send(None)
    except StopIteration:
        return
    except Exception as e:
        failed(e)
        return

    def resume(_):
        try:
            nxt = coro.send(None)
        except StopIteration:
            return
        except Exception as e:
            failed(e)
            return
        nxt.add_done_callback(resume)

    fut.add_done_callback(resume)


class _Sub:
    """One NATS subscription: its subject, and the earlier subscriptions that overlap it (they
    take the messages both see)."""

    __slots__ = ("subject", "seq", "sub", "earlier", "active")

    def __init__(self, subject: str, seq: int):
        self.subject = subject
        self.seq = seq
        self.sub = None
        self.earlier: list[_Sub] = []
        self.active = True


class AckGate:
    """What an importer may acknowledge: only numbers whose messages have left this process.

    With nothing queued for the bus, everything seen. With a queue, the numbers seen when a
    mark was set, once the transport has written every packet queued then (`packets_out`
    reached the mark): a queue that never empties on a loaded machine still lets acks through,
    one mark behind, where waiting for an empty queue starved them and a restart went uncounted.
    """

    def __init__(self):
        self._mark = None   # (transport, packets_out to reach, {instance: last seen})

    def upto(self, seen: dict, transport) -> dict | None:
        """Per exporter instance, the last number that may be acknowledged now; None: all of
        `seen` (nothing is queued); {}: nothing yet."""
        if transport is None or not transport.queuedBytes():
            self._mark = None
            return None
        mark = self._mark
        ready: dict = {}
        if mark is not None and mark[0] is transport and transport.packets_out >= mark[1]:
            ready, mark = mark[2], None
        if mark is None or mark[0] is not transport:
            self._mark = (transport, transport.packets_out + transport.queued(),
                          {inst: s[1] for inst, s in seen.items()})
        return ready


class NatsService(Chassis):
    name = kind = "sbus-nats"

    def __init__(self, bus, servers: list[str], *, exports=(), imports=(), prefix: str = "sbus",
                 connect_options: dict | None = None, max_pending: int = 64 << 10,
                 import_buffer: int = 64 << 20,
                 stats_interval: float = 60.0, reconnect_wait: float = 1.0,
                 max_packet: int = MAX_PACKET, static_imports: bool = False,
                 max_subscriptions: int = 1000, name: str | None = None,
                 session_linger: float = 30.0, reactor=None):
        super().__init__(bus, stats_interval=stats_interval, reactor=reactor)
        self.log = log  # the chassis's lines as ours (a Logger class attribute renames its namespace)
        self.servers = list(servers)
        self.exports = [_b(p) for p in exports]
        self.imports = [_b(p) for p in imports]
        self.prefix = check_prefix(prefix)
        self.connect_options = dict(connect_options or {})
        self.max_pending = max_pending
        self.import_buffer = import_buffer
        self.reconnect_wait = reconnect_wait
        self.max_packet = max_packet
        self.secret_exports = [p for p in self.exports if p.startswith(SECRET_ROOT)]
        self.secret_imports = [p for p in self.imports if p.startswith(SECRET_ROOT)]
        #: Each import pattern: (pattern, its subject, whether the subject selects exactly it).
        self.import_subjects = [(p, *pattern_to_subject(p, self.prefix)) for p in dict.fromkeys(self.imports)]
        self.static_imports = static_imports
        self.max_subscriptions = max_subscriptions
        #: Local interest (`server/interest`): "waiting" for the first listing, "live", or
        #: "static" (every import subscribed: asked for, or the server does not tell).
        self.interest_mode = "static" if static_imports else "waiting"
        self.interest: set[bytes] = set()
        self._listing: set[bytes] | None = None
        #: NATS subject -> whether each message on it needs no filtering (what we want), and
        #: subject -> nats-py subscription (what we have).
        self._wanted: dict[str, bool] = {}
        self._nats_subs: dict[str, object] = {}
        self._reconcile_due = False
        self._reconciling = self._reconcile_again = False
        self._sub_seq = 0
        self.duplicates = 0
        self.nats_subscribes = 0
        self.nats_unsubscribes = 0
        #: Random per process; replaced by the bus's `server/id` when the server answers it.
        self.bus_id = os.urandom(16).hex()
        self.bus_id_from_server = False
        self.nc = None
        self.client = None
        self.exported = 0
        self.imported = 0
        self.drops: dict[str, int] = {}
        self.secret_filtered = 0
        self.secret_refused = 0
        self.filtered = 0
        self.own_origin = 0
        self.reserved = 0
        self.pauses = 0
        self.nats_connects = 0
        self._drain_call = None
        self._subject_cache: dict[bytes, str] = {}
        self._logged: set = set()
        self._nats_task = None
        self._closing = None
        self._stopping = False
        #: What identifies this sbus-nats on its bus (the bus session's name, the importer
        #: identity its acknowledgements carry), and this process among its restarts.
        self.name = name or default_name(self.prefix, self.exports, self.imports)
        self.session_name = b"sbus-nats/" + self.name.encode()
        self.session_linger = session_linger
        self.session = {"name": self.session_name.decode(), "state": None, "missed": 0, "gap": 0.0}
        #: Messages read from the bus while the session claim is unanswered (None: not waiting).
        self._held: list | None = []
        self.instance = os.urandom(8).hex()
        self._seq = 0
        #: Losses this process learnt of (a predecessor's gap, a peer's gap), by reason.
        self.gaps: dict[str, int] = {}
        #: Importer side: exporter instance -> [first seq, last seq (str), last acked, when].
        self._seen: dict[str, list] = {}
        #: Exporter side: (bus id, name) of an importer -> [instance, last acked, counted to, when].
        self._peers: dict[tuple, list] = {}
        self.acks = {"sent": 0, "received": 0, "refused": 0, "clamped": 0}
        self.seq_refused = 0
        self.importer_restarts = 0
        self._ack_gate = AckGate()
        self._sweep_at = 0.0

    def _drop(self, reason: str, n: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + n

    def _once(self, what: str, text: str, **kw) -> None:
        """Log a warning once per distinct `what` (bad input must not flood the log)."""
        if what not in self._logged and len(self._logged) < 1000:
            self._logged.add(what)
            log.warn(text, **kw)

    # -- life cycle

    def setUp(self):
        import asyncio

        self.client = self.connect(
            "bus", subscribe=dict.fromkeys(self.exports), stats=True, echo=False,
            flood={"hard": "block"},  # lossless toward NATS: when we stop reading, the server holds the publishers
            message=lambda key, payload, proto: self._from_bus(proto, key, payload),
            control=self._control, made=self._bus_connected, batch=self.handedOn,
            initialDelay=0.1, maxDelay=10.0, max_packet=self.max_packet)
        log.info("{name}: exporting {e}; importing {i}; subject prefix {p!r}; {how}; "
                 "instance {inst}", name=self.name, inst=self.instance,
                 e=", ".join(repr(p) for p in self.exports) or "nothing",
                 i=", ".join(f"{p!r} as {subj}{'' if exact else ' (filtered)'}"
                             for p, subj, exact in self.import_subjects) or "nothing", p=self.prefix,
                 how="NATS subscriptions: every import (--static-imports)" if self.static_imports
                 else "NATS subscriptions follow local interest")
        if self.static_imports:
            self._want_everything()
        self._nats_task = asyncio.ensure_future(self._run_nats())
        if self.imports:
            self.every(ACK_INTERVAL, self._send_acks)

    def lostLine(self, client, prefix: str, reason) -> None:
        log.warn("{prefix}lost the connection to {addr} ({why}); reconnecting", prefix=prefix, addr=self.bus,
                 why=reason.getErrorMessage() if hasattr(reason, "getErrorMessage") else reason)

    def failedLine(self, client, prefix: str, reason) -> None:
        if client.failureIsNews:
            log.warn("{prefix}cannot connect to {what}; retrying quietly with back-off", prefix=prefix,
                     what=client.lastFailure)

    def beforeStop(self):
        import asyncio
        self._stopping = True
        if self.imports:
            self._send_acks(final=True)   # what arrived until now: a successor's gap starts here
        if self._drain_call is not None and self._drain_call.active():
            self._drain_call.cancel()
        # NATS closes beside the bus connection, which the chassis closes next (`afterStop` waits)
        if self.nc is not None and not self.nc.is_closed:
            self._closing = defer.Deferred.fromFuture(asyncio.ensure_future(self._close_nats()))
            self._closing.addErrback(lambda f: None)
        elif self._nats_task is not None:
            self._nats_task.cancel()

    def afterStop(self):
        return self._closing

    async def _close_nats(self):
        try:
            await self.nc.flush(timeout=2)
        except Exception:
            pass
        await self.nc.close()

    # -- the bus side

    def _bus_connected(self, proto) -> None:
        self._claim_session(proto)
        if self.import_subjects and not self.static_imports:
            # a fresh listing; until it is complete the subscriptions of before stay
            self._listing = set()
            proto.sendControl(codec.INTEREST)
            # a server that answers nothing at all (not even the sync below) is no feed either
            self.reactor.callLater(INTEREST_WAIT, self._no_interest_feed, proto)
            if self.client.connects == 1:
                proto.stats().addCallbacks(self._interest_scope, lambda f: None)
        answer: list = []
        proto.server_request(codec.SERVER_ID).addCallbacks(answer.append, lambda f: None)

        def synced(_):
            ident = answer[0] if answer else None
            if ident and len(ident) == 32 and all(c in b"0123456789abcdef" for c in ident):
                self.bus_id = ident.decode()
                self.bus_id_from_server = True
            else:
                log.warn("bus: the server did not answer server/id; origin id {id} is this "
                         "process's own", id=self.bus_id)
            # The listing ends before the answer to anything asked after it: no end, no feed.
            self._no_interest_feed(proto)
            log.info("bus: {what} to {addr} as {who}; bus id {id}",
                     what="connected" if self.client.connects == 1 else "reconnected",
                     addr=self.bus or "(default address)",
                     who=(proto.credentials or b"").decode("utf-8", "replace"), id=self.bus_id)

        proto.sync().addCallbacks(synced, lambda f: None)

    # -- the bus session: what was published for export while this sbus-nats was away

    def _claim_session(self, proto) -> None:
        """Claim this service's lingering session on the bus (docs/protocol.md
        `server/session`): its export patterns are already subscribed (the client sends them
        first), so the count the server gives is what nobody exported between the
        predecessor's end and now. Until the answer, messages read from the bus wait."""
        if self._held is None:
            self._held = []
        answered: list = []

        def answer(reply) -> None:
            answered.append(1)
            self._session_answer(proto, reply)

        def malformed(failure) -> None:
            if failure.check(ProtocolError):
                log.warn("bus: {err}", err=failure.value)
                answer(codec.SessionReply(self.session_name, "malformed", 0, 0.0, 0.0))

        proto.session(self.session_name, self.session_linger, confirm=True).addCallbacks(answer, malformed)

        def synced(_):
            if not answered and proto is self.client.protocol:
                self._once("no-session", "bus: the server does not answer server/session: what "
                           "is published on the bus while this sbus-nats is not running is not "
                           "counted anywhere")
                self.session["state"] = "unsupported"
                self._release_held()

        proto.sync().addCallbacks(synced, lambda f: None)

    def _session_answer(self, proto, reply: "codec.SessionReply") -> None:
        if self.client is None or proto is not self.client.protocol:
            return
        state = reply.state
        self.session["state"] = state
        if state in ("new", "resumed"):
            self.client.gapEnded(state == "resumed", reply.name)  # a restarted bus: said and counted
            missed = max(0, min(reply.missed, 1 << 62))
            gap = max(0.0, reply.gap)
            self.session.update(missed=self.session["missed"] + missed, gap=gap, linger=reply.linger)
            if state == "resumed":
                # a predecessor's gap on the first connection; later, our own bus connection's
                reason = "restart" if self.client.connects == 1 else "bus_down"
                if missed:
                    self.gaps[reason] = self.gaps.get(reason, 0) + missed
                log.warn("bus: resumed session {name} after a gap of {gap:.3f} s: {n} message(s) "
                         "published for export meanwhile were not exported; counted as lost ({why}){carried}",
                         name=self.session["name"], gap=gap, n=missed, why=reason, carried=carried_note(reply))
                proto.confirmSession(self.session_name)  # logged and counted: the bus may forget it
            else:
                log.info("bus: session {name} claimed (new: nothing lingered); lingers {l:.3f} s "
                         "after this process ends", name=self.session["name"], l=reply.linger)
            self._release_held()
        elif state == "busy":
            log.error("bus: another sbus-nats named {name} is running on this bus (server/session "
                      "busy); one per name per bus: give the other one a different --name; exiting",
                      name=self.name)
            self._held = []
            stop_with_status(self.reactor, EXIT_NAME_TAKEN)
        else:
            log.warn("bus: the server refused session {name} ({state}; its log says why): what is "
                     "published while this sbus-nats is not running is not counted",
                     name=self.session["name"], state=state)
            self._release_held()

    def handedOn(self, proto) -> None:
        """A read batch from the bus is exported (into nats-py's buffer, at most `max_pending`
        bytes before we stop reading): tell the bus (`server/session-ack`), so that a kill -9
        from now on is counted by our session, what the bus's kernel held for us included.
        Not while messages wait for the claim's answer (`_held`)."""
        if (self._held is None and proto is self.client.protocol
                and self.session.get("state") in ("new", "resumed")):
            proto.acknowledgeSession(self.session_name)

    def _release_held(self) -> None:
        held, self._held = self._held, None
        for proto, key, payload in held or ():
            self._export(proto, key, payload)

    # -- local interest

    def _interest_scope(self, stats) -> None:
        """One line at start when the bus shows us only our own uid's view: then
        `server/interest` lists every uid's patterns only by the bus owner's grant."""
        if isinstance(stats, dict) and stats.get("scope") == "uid" and stats.get("interest_scope") != "all":
            uid = os.getuid()
            log.warn("bus: uid {uid} is neither root nor the bus's own uid: server/interest lists "
                     "only uid {uid}'s patterns unless the bus owner grants it every uid's "
                     "(sbusd/twistd sbus --service-uid {uid}, or the same User= in systemd); "
                     "without the grant, imports reach only uid {uid}'s subscribers "
                     "(--static-imports imports everything)", uid=uid)

    def _no_interest_feed(self, proto) -> None:
        if self._listing is None or self.client is None or proto is not self.client.protocol:
            return
        self._listing = None
        if self.interest_mode != "static":
            self.interest_mode = "static"
            log.warn("bus: the server does not report local interest (server/interest); "
                     "subscribing to every --import pattern on NATS")
            self._want_everything()

    def _control(self, key: bytes, payload: bytes) -> None:
        if key == codec.INTEREST:
            self._interest_notice(payload or b"")

    def _interest_notice(self, payload: bytes) -> None:
        """`CMSG server/interest\0+\0P`, `-\0P` or `=` (the first listing is complete)."""
        listing = self._listing
        if payload == b"=":
            if listing is None:
                return
            self._listing = None
            if self.interest_mode == "static":
                return
            if self.interest_mode == "waiting":
                log.info("bus: the server reports local interest; NATS subscriptions follow it")
            self.interest_mode = "live"
            self.interest = listing
            self._want_interest()
            return
        sign, _, pattern = payload.partition(b"\0")
        target = self.interest if listing is None else listing
        if sign == b"+":
            target.add(pattern)
        elif sign == b"-":
            target.discard(pattern)
        else:
            return
        if listing is None and self.interest_mode == "live":
            self._want_interest()

    def _subjects_for(self, held: bytes):
        """(subject, exact) of each import's common part with held pattern `held`."""
        secret = held.startswith(SECRET_ROOT)
        try:
            hsubj, hexact = pattern_to_subject(held, self.prefix)
        except MappingError:
            hsubj, hexact = pattern_to_subject(b"", self.prefix)[0], False
        for pattern, subj, exact in self.import_subjects:
            if secret and not pattern.startswith(SECRET_ROOT):
                continue  # a secret key is imported only if an import names !/cred/
            meet = subject_meet(hsubj, subj)
            if meet is not None:
                yield meet, exact

    def _want_interest(self) -> None:
        cap = self.max_subscriptions
        wanted: dict[str, bool] = {}
        if len(self.interest) <= 50 * cap:  # beyond, not even worth computing
            for held in self.interest:
                for subj, exact in self._subjects_for(held):
                    wanted[subj] = wanted.get(subj, False) or exact
                if len(wanted) > cap:
                    break
        if len(self.interest) > 50 * cap or len(wanted) > cap:
            # More than we follow one by one: the imports themselves are a superset of what
            # local clients want (and cost no per-pattern work).
            self._once("too-many-held", "bus: local clients hold more than --max-subscriptions "
                       "{m} patterns that select imported keys; subscribing to the --import "
                       "patterns themselves while they do", m=cap)
            self._want_everything()
            return
        self._set_wanted(wanted)

    def _want_everything(self) -> None:
        wanted: dict[str, bool] = {}
        for _, subj, exact in self.import_subjects:
            wanted[subj] = wanted.get(subj, False) or exact
        self._set_wanted(wanted)

    def _set_wanted(self, wanted: dict[str, bool]) -> None:
        self._wanted = wanted
        if not self._reconcile_due:
            self._reconcile_due = True
            import asyncio
            asyncio.get_event_loop().call_soon(lambda: asyncio.ensure_future(self._reconcile()))

    async def _reconcile(self) -> None:
        """Bring NATS's subscriptions to `_wanted`: one pass at a time (a change during a pass
        makes one more), coalesced (one pass for a burst of changes)."""
        self._reconcile_due = False
        if self._reconciling:
            self._reconcile_again = True
            return
        self._reconciling = True
        try:
            while True:
                self._reconcile_again = False
                await self._reconcile_once()
                if not self._reconcile_again:
                    return
        finally:
            self._reconciling = False

    async def _reconcile_once(self) -> None:
        nc = self.nc
        if nc is None or nc.is_closed:
            return  # `_run_nats` subscribes what is wanted once connected
        wanted = self._wanted
        # A subject inside another wanted one needs no subscription of its own (only a subject
        # with a wildcard covers another one).
        wild = [y for y in wanted if "*" in y or ">" in y]
        cover = [x for x in wanted if not any(y != x and subject_covers(y, x) for y in wild)]
        keep = set(cover)
        added = []
        for subj in cover:
            if subj in self._nats_subs:
                continue
            if nc.is_closed:
                return
            entry = _Sub(subj, self._sub_seq)
            self._sub_seq += 1
            try:
                entry.sub = await nc.subscribe(subj, cb=self._make_cb(entry),
                                               pending_msgs_limit=1 << 20,
                                               pending_bytes_limit=256 << 20)
            except Exception as e:
                self._once("sub:" + type(e).__name__, "NATS: subscribing to {s} failed: {err!r}",
                           s=subj, err=e)
                continue
            # earlier overlapping subscriptions take what both see (each message once, and a
            # key always through the same subscription: its order kept)
            entry.earlier = [o for o in self._nats_subs.values() if subjects_overlap(o.subject, subj)]
            self._nats_subs[subj] = entry
            added.append(entry)
        gone = [e for subj, e in self._nats_subs.items() if subj not in keep]
        for entry in gone:
            # Make before break: what only it took, later overlapping subscriptions take from
            # now on; what it already has it still hands over (drain), so nothing in flight is lost.
            del self._nats_subs[entry.subject]
            entry.active = False
            for other in self._nats_subs.values():
                if entry in other.earlier:
                    other.earlier.remove(entry)
        if added:
            try:
                await nc.flush(timeout=5)
            except Exception:
                pass
        for entry in gone:
            try:
                await entry.sub.drain()
            except Exception as e:  # closed meanwhile: nothing to withdraw
                self._once("unsub:" + type(e).__name__, "NATS: unsubscribing failed: {err!r}", err=e)
        self.nats_subscribes += len(added)
        self.nats_unsubscribes += len(gone)
        if added or gone:
            log.debug("NATS: {n} subscription(s) (+{a} -{r}) for {h} locally held pattern(s)",
                      n=len(self._nats_subs), a=len(added), r=len(gone), h=len(self.interest))

    def _from_bus(self, proto, key: bytes, payload: bytes) -> None:
        held = self._held
        if held is not None:
            if len(held) < MAX_HELD:
                held.append((proto, key, payload))
            else:
                self._drop("session_wait")
            return
        self._export(proto, key, payload)

    def _export(self, proto, key: bytes, payload: bytes) -> None:
        if key.startswith(RESERVED):
            self.reserved += 1
            return
        if key.startswith(SECRET_ROOT):
            match = proto.stored_pattern
            if not any(matches(match(p), key) for p in self.secret_exports):
                self.secret_filtered += 1
                return
        subject = self._subject_cache.get(key)
        if subject is None:
            subject = key_to_subject(key, self.prefix)
            if len(self._subject_cache) > 4096:
                self._subject_cache.clear()
            self._subject_cache[key] = subject
        if len(subject) > MAX_SUBJECT:
            self._drop("subject_too_long")
            self._once("long", "not exporting {key!r}...: its subject is longer than {n} bytes "
                       "(NATS's control line); counted as subject_too_long", key=key[:60], n=MAX_SUBJECT)
            return
        nc = self.nc
        if nc is None or nc.is_closed:
            self._drop("nats_down")
            return
        if len(payload) > nc.max_payload:
            self._drop("too_large")
            self._once("large", "not exporting {key!r}: {n} bytes is more than the NATS server's "
                       "max_payload {m}; counted as too_large", key=key[:60], n=len(payload), m=nc.max_payload)
            return
        self._seq += 1
        _drive(nc.publish(subject, payload, headers={ORIGIN_HEADER: self.bus_id,
                                                     SEQ_HEADER: f"{self.instance}.{self._seq}"}),
               self._publish_failed)
        self.exported += 1
        if nc.pending_data_size > self.max_pending and not self.client.paused and nc.is_connected:
            self._pause()

    def _publish_failed(self, exc) -> None:
        import nats.errors as ne
        self.exported -= 1
        if isinstance(exc, (ne.OutboundBufferLimitError, ne.ConnectionClosedError,
                            ne.ConnectionReconnectingError)):
            self._drop("nats_down")
        else:
            self._drop("publish_error")
            self._once("pub:" + type(exc).__name__, "NATS publish failed: {err!r}", err=exc)

    def _pause(self) -> None:
        self.pauses += 1
        self.client.pauseReading(True)
        self._drain_call = self.reactor.callLater(0.002, self._check_drained)

    def _check_drained(self) -> None:
        nc = self.nc
        if nc is None or not nc.is_connected or nc.pending_data_size <= self.max_pending // 2:
            self.client.pauseReading(False)
            return
        self._drain_call = self.reactor.callLater(0.002, self._check_drained)

    # -- the NATS side

    async def _run_nats(self) -> None:
        import asyncio

        import nats

        delay = 0.1
        while not self._stopping:
            try:
                nc = await nats.connect(
                    servers=self.servers, no_echo=True, allow_reconnect=True,
                    max_reconnect_attempts=-1, reconnect_time_wait=self.reconnect_wait,
                    connect_timeout=2, pending_size=8 * self.max_pending, name=self._nats_name(),
                    error_cb=self._nats_error, disconnected_cb=self._nats_disconnected,
                    reconnected_cb=self._nats_reconnected, closed_cb=self._nats_closed,
                    **self.connect_options)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                why = str(e) or type(e).__name__
                self._once("nats-fail:" + why, "NATS: cannot connect to {servers}: {why}; retrying",
                           servers=" ".join(self.servers), why=why)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self.nc = nc
            self.nats_connects += 1
            self._nats_subs = {}
            if self.exports:
                # importers' acknowledgements of what we published (nats-py renews it on reconnects)
                await nc.subscribe(ACK_SUBJECT + self.instance, cb=self._ack_cb)
            await self._reconcile()
            await nc.flush()
            log.info("NATS: connected to {url}; {n} subscription(s); ready",
                     url=self._url(), n=len(self._nats_subs))
            return

    def _nats_name(self) -> str:
        """The connection's name in NATS's monitoring (`/connz`): which process, which bus."""
        return f"sbus-nats pid={os.getpid()} bus={self.bus or '(default)'}"[:200]

    def _url(self) -> str:
        try:
            u = self.nc.connected_url
            return f"{u.scheme}://{u.hostname}:{u.port}"
        except Exception:
            return "?"

    async def _nats_error(self, exc) -> None:
        import nats.errors as ne
        if isinstance(exc, ne.SlowConsumerError):
            self._drop("nats_slow_consumer")
            return
        self._once("nats-err:" + str(exc), "NATS: {err}", err=str(exc) or type(exc).__name__)

    async def _nats_disconnected(self) -> None:
        if not self._stopping:
            log.warn("NATS: disconnected; reconnecting (to any of the cluster's servers)")

    async def _nats_reconnected(self) -> None:
        self.nats_connects += 1
        log.info("NATS: reconnected to {url}", url=self._url())

    async def _nats_closed(self) -> None:
        if not self._stopping:
            log.warn("NATS: connection closed; starting over")
            import asyncio
            self.nc = None
            self._nats_task = asyncio.ensure_future(self._run_nats())

    def _make_cb(self, entry: "_Sub"):
        async def cb(msg):
            self._from_nats(entry, msg)
        return cb

    def _from_nats(self, entry: "_Sub", msg) -> None:
        subject = msg.subject
        for earlier in entry.earlier:
            if subject_matches(earlier.subject, subject):
                self.duplicates += 1      # an earlier subscription takes this one
                return
        hdr = msg.headers
        if hdr:
            if hdr.get(ORIGIN_HEADER) == self.bus_id:
                self.own_origin += 1
                return
            seq = hdr.get(SEQ_HEADER)
            if seq is not None:
                # acknowledged to its exporter by `_send_acks`: whatever happens to it next is
                # counted here (imported or a drop), so an exporter counts only a restart's gap
                inst, _, n = seq.partition(".")
                seen = self._seen.get(inst)
                if seen is not None:
                    seen[1] = n
                elif len(self._seen) < MAX_EXPORTERS:
                    self._seen[inst] = [n, n, None, 0.0]
                else:
                    self.seq_refused += 1
                    self._once("exporters", "NATS: messages from more than {n} exporter instances; "
                               "the others are not acknowledged (a restart of this sbus-nats "
                               "is not counted by them)", n=MAX_EXPORTERS)
        try:
            key = subject_to_key(subject, self.prefix)
        except MappingError as e:
            if subject.startswith(CONTROL_PREFIX):
                self.reserved += 1     # another sbus-nats's acknowledgement (prefix '')
                return
            self._drop("bad_subject")
            self._once("subj:" + subject[:40], "not importing NATS subject {s!r}: {err}",
                       s=subject[:200], err=e)
            return
        if key.startswith(RESERVED):
            self.reserved += 1
            return
        if not self._wanted.get(entry.subject, False) and not any(matches(p, key) for p in self.imports):
            self.filtered += 1
            return
        if key.startswith(SECRET_ROOT):
            if not any(matches(p, key) for p in self.secret_imports):
                self.secret_refused += 1
                return
            try:
                check_key(key)
            except CredentialError as e:
                self._drop("bad_key")
                self._once("key:" + str(e), "not importing {key!r}: {err}", key=key[:80], err=e)
                return
        try:
            packet = codec.encode_msg(key, msg.data, self.max_packet)
        except ProtocolError:
            self._drop("too_large")
            return
        proto = self.client.protocol if self.client else None
        if proto is None or not proto.connected:
            self._drop("bus_down")
            return
        if proto.transport.queuedBytes() > self.import_buffer:
            self._drop("bus_slow")
            return
        proto.sendPacket(packet)
        self.imported += 1

    # -- restarts: importers acknowledge, exporters count an importer's gap

    def _send_acks(self, final: bool = False) -> None:
        """Tell each exporter instance up to which of its sequence numbers this importer has
        handled (imported or counted as dropped): one message per exporter per ACK_INTERVAL,
        only when something new arrived. Nothing is acknowledged before it has left this process
        for the bus (kill -9 would lose it uncounted): an ack may lag, never lead (`AckGate`)."""
        if not self._seen:
            return
        nc = self.nc
        if nc is None or not nc.is_connected:
            return
        proto = self.client.protocol if self.client else None
        transport = proto.transport if proto is not None else None
        upto = None if final else self._ack_gate.upto(self._seen, transport)
        if upto == {}:
            return
        now = self.reactor.seconds()
        for inst, seen in list(self._seen.items()):
            first, last, acked, when = seen
            if upto is not None:
                last = upto.get(inst)
                if last is None:
                    continue
            if last == acked:
                if now - when > EXPORTER_IDLE:
                    del self._seen[inst]     # that exporter instance is gone
                continue
            try:
                if not _INSTANCE_RE.match(inst):
                    raise ValueError("instance")
                f, n = int(first), int(last)
                if not 0 < f <= n < 1 << 62:
                    raise ValueError("sequence")
            except ValueError:
                del self._seen[inst]
                self.seq_refused += 1
                self._once("bad-seq", "NATS: ignoring a malformed {h} header {v!r} (not from an "
                           "sbus-nats, or forged): not acknowledged", h=SEQ_HEADER,
                           v=f"{inst}.{last}"[:80])
                continue
            body = json.dumps({"bus": self.bus_id, "name": self.name, "inst": self.instance,
                               "first": f, "last": n}, separators=(",", ":")).encode()
            _drive(nc.publish(ACK_SUBJECT + inst, body), self._ack_failed)
            seen[2], seen[3] = last, now
            self.acks["sent"] += 1

    def _ack_failed(self, exc) -> None:
        self._once("ack:" + type(exc).__name__, "NATS: sending an acknowledgement failed: {err!r}",
                   err=exc)

    async def _ack_cb(self, msg) -> None:
        self._ack_received(msg.data)

    def _ack_received(self, data: bytes) -> None:
        """An importer's acknowledgement of our sequence numbers. A new instance of a known
        importer (same bus id and name) means it restarted: what we published between its
        predecessor's last acknowledgement and the first it received is lost to it."""
        self.acks["received"] += 1
        try:
            if len(data) > MAX_ACK:
                raise ValueError("too long")
            a = json.loads(data)
            bus, name, inst, first, last = a["bus"], a["name"], a["inst"], a["first"], a["last"]
            if not (isinstance(bus, str) and isinstance(name, str) and isinstance(inst, str)
                    and len(bus) <= 64 and len(name) <= 200 and len(inst) <= 64):
                raise ValueError("bad names")
            if not (type(first) is int and type(last) is int and 0 < first <= last):
                raise ValueError("bad sequence numbers")
        except (ValueError, KeyError, TypeError) as e:
            self.acks["refused"] += 1
            self._once("ack-bad", "NATS: ignoring a malformed acknowledgement ({why}): not from "
                       "an sbus-nats, or forged", why=e)
            return
        if last > self._seq:
            self.acks["clamped"] += 1
            self._once("ack-clamp", "NATS: an acknowledgement from {name!r} of bus {bus!r} names "
                       "sequence number {n}, beyond the {m} this sbus-nats published: clamped "
                       "(forged, or another NATS client's)", name=name[:60], bus=bus[:64],
                       n=last, m=self._seq)
            last = self._seq
            first = min(first, last)
        now = self.reactor.seconds()
        key = (bus, name)
        peer = self._peers.get(key)
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self._peers.pop(next(iter(self._peers)))
                self._once("peers", "NATS: more than {n} importers acknowledge; forgetting the "
                           "oldest (its next restart is not counted)", n=MAX_PEERS)
            self._peers[key] = [inst, last, 0, now]
            return
        if peer[0] == inst:
            peer[1] = max(peer[1], last)
            peer[3] = now
            return
        # a new instance: the seqs after both its predecessor's last ack and what an earlier
        # restart counted, up to the first it received, did not reach that bus
        base = max(peer[1], peer[2])
        gap = first - 1 - base
        self.importer_restarts += 1
        if gap > 0:
            self.gaps["restart"] = self.gaps.get("restart", 0) + gap
        if self.importer_restarts <= 100 or self.importer_restarts % 100 == 0:
            log.warn("NATS: importer {name!r} of bus {bus} restarted: {n} message(s) published "
                     "after its predecessor's last acknowledgement ({t:.3f} s before) did not "
                     "reach it; counted as lost (restart){more}", name=name[:60], bus=bus[:64],
                     n=max(gap, 0), t=now - peer[3],
                     more="" if self.importer_restarts <= 100 else
                     f" ({self.importer_restarts} importer restarts; logging every 100th)")
        peer[:] = [inst, last, max(peer[2], first - 1), now]

    # -- statistics

    def stats(self) -> dict:
        nc = self.nc
        return {
            "exported": self.exported,
            "imported": self.imported,
            "drops": dict(sorted(self.drops.items())),
            "lost": lost(self.drops, self.gaps),
            "unknown_gaps": unknown_gaps(self.client) if self.client is not None else unknown_gaps(),
            "secret_filtered": self.secret_filtered,
            "secret_refused": self.secret_refused,
            "own_origin_dropped": self.own_origin,
            "duplicates_suppressed": self.duplicates,
            "interest": {"mode": self.interest_mode, "held_patterns": len(self.interest),
                         "nats_subscriptions": sorted(self._nats_subs),
                         "subscribed": self.nats_subscribes, "unsubscribed": self.nats_unsubscribes},
            "filtered": self.filtered,
            "reserved_skipped": self.reserved,
            "paused": self.pauses,
            "restarts": {"session": dict(self.session), "instance": self.instance,
                         "published_seq": self._seq, "importers": len(self._peers),
                         "importer_restarts": self.importer_restarts, "acks": dict(self.acks),
                         "exporters": len(self._seen), "seq_refused": self.seq_refused},
            "bus": {"connected": bool(self.client and self.client.connected),
                    "reconnects": self.reconnects(), "id": self.bus_id},
            "nats": {"connected": bool(nc is not None and nc.is_connected),
                     "reconnects": max(0, self.nats_connects - 1),
                     "server": self._url() if nc is not None and nc.is_connected else None,
                     "pending_bytes": nc.pending_data_size if nc is not None else 0},
        }

    def statsName(self) -> str:
        return f"{self.bus_id[:8]}->{','.join(self.servers)}"

    def publicStats(self) -> dict:
        return {"nats_connected": bool(self.nc is not None and self.nc.is_connected)}

    def reportedStats(self) -> dict:
        st = self.stats()
        st["nats"].pop("pending_bytes", None)
        return st


# -- twistd options


def _ensure_asyncio_reactor() -> None:
    """Install Twisted's asyncio reactor if none is installed yet; refuse another one."""
    if "twisted.internet.reactor" not in sys.modules:
        from twisted.internet import asyncioreactor
        asyncioreactor.install()
        return
    from twisted.internet import reactor
    from twisted.internet.asyncioreactor import AsyncioSelectorReactor
    if not isinstance(reactor, AsyncioSelectorReactor):
        raise usage.UsageError(f"sbus-nats runs on the asyncio reactor, not {type(reactor).__name__}: "
                               "use twistd --reactor=asyncio (or no --reactor)")


class Options(RespelledOptions):
    command = "twistd sbus-nats"
    renamed = {"--reconnect-wait": "--initial-delay"}
    synopsis = ("--bus ADDRESS --server URL [--server URL ...] [--export PATTERN ...] "
                "[--import PATTERN ...]")
    longdesc = (
        "Carry an sbus bus over a NATS server or cluster (several --server URLs: one cluster, "
        "failed over between). Nothing is exported or imported unless asked: --export PATTERN "
        "publishes the bus's matching messages on NATS, --import PATTERN publishes NATS's "
        "matching messages on the bus (both repeatable; '' is everything), subscribing on NATS "
        "only to what clients of the bus hold (--static-imports: to every import). Keys map to "
        "subjects PREFIX.seg1.seg2 with bytes other than [A-Za-z0-9-] escaped as _XX "
        "(docs/deploy.md). !/cred/ keys cross only if a pattern names !/cred/. A plain "
        "connection to a host that is not loopback needs --allow-plain; a connection without "
        "authentication (loopback too) needs --allow-unauthenticated. Needs nats-py: "
        f"{EXTRA}; runs on the asyncio reactor (installed unless another is chosen)."
    )
    optParameters = [
        METRICS_OPTION,
        ["bus", "b", None, "Address of the bus (path, /dev/unix/abstract/HEX); default: the default bus. "
                                + MISSING_BUS_HELP],
        ["subject-prefix", None, "sbus", "Subject prefix (literal tokens joined by '.'; '' for none)."],
        ["creds", None, None, "NATS credentials file (JWT + nkey seed)."],
        ["token-file", None, None, "File holding the NATS authentication token (mode 0600)."],
        ["user", None, None, "NATS user name (with --password-file)."],
        ["password-file", None, None, "File holding the NATS password (with --user; mode 0600)."],
        ["token", None, None, "Refused: a secret on the command line; use --token-file."],
        ["password", None, None, "Refused: a secret on the command line; use --password-file."],
        ["tls-ca", None, None, "CA certificate(s) to verify the NATS servers with (turns TLS on)."],
        ["tls-cert", None, None, "Client certificate for TLS (with --tls-key)."],
        ["tls-key", None, None, "Client private key for TLS."],
        ["max-pending", None, str(64 << 10), "Stop reading the bus while nats-py has this many bytes "
                                             "unsent; read again at half (a kill -9 loses them "
                                             "uncounted: keep it small)."],
        ["import-buffer", None, str(64 << 20), "Bytes of imported messages to queue for a bus "
                                               "that does not take them; beyond, they are dropped "
                                               "(bus_slow): NATS cannot be told to wait."],
        ["initial-delay", None, "1", "Seconds before retrying a NATS server just tried."],
        ["max-subscriptions", None, "1000", "Follow at most this many locally held patterns one by "
                                            "one; beyond, subscribe to the --import patterns "
                                            "themselves."],
        ["stats-interval", None, "60", "Seconds between stats lines in the log (only if changed)."],
        ["name", None, None, "What identifies this sbus-nats on its bus (letters, digits, "
                             "'._:@-'; default: derived from --subject-prefix and the patterns): "
                             "its bus session, the identity its peers count its restarts by. One "
                             "per name per bus: a second one exits."],
        ["session-linger", None, "30", "Seconds the bus keeps counting, after this process ends, "
                                       "what it would have exported (its successor adds that to "
                                       "lost.restart); 0: nothing lingers. The server caps it "
                                       "(--max-session-linger)."],
    ]
    optFlags = [
        ["allow-plain", None, "Allow an unencrypted connection to a NATS server that is not loopback."],
        ["allow-unauthenticated", None, "Connect to NATS without --creds, --token, --user or "
                                        "--tls-cert: whoever can reach the NATS server (on "
                                        "loopback: every local user) reads the exports and "
                                        "publishes the imports."],
        ["static-imports", None, "Subscribe on NATS to every --import pattern for the life of the "
                                 "service. Default: only to what clients of the bus hold (as the "
                                 "server reports it), withdrawn when the last holder leaves."],
    ]

    def __init__(self):
        super().__init__()
        self["servers"] = []
        self["exports"] = []
        self["imports"] = []

    def opt_server(self, value: str) -> None:
        """A NATS server URL, nats://HOST:PORT or tls://HOST:PORT (repeatable: one cluster)."""
        self["servers"].append(value)

    def opt_export(self, value: str) -> None:
        """Publish the bus's messages matching this pattern on NATS (repeatable; default: none)."""
        self["exports"].append(_b(value))

    def opt_import(self, value: str) -> None:
        """Publish NATS's messages matching this pattern on the bus (repeatable; default: none)."""
        self["imports"].append(_b(value))

    def postOptions(self):
        from sbus.options import positive_float, positive_int

        if not self["servers"]:
            raise usage.UsageError("at least one --server URL is required")
        if not self["exports"] and not self["imports"]:
            raise usage.UsageError("nothing to do: give --export and/or --import patterns")
        for what in ("exports", "imports"):
            for p in self[what]:
                if b"\0" in p:
                    raise usage.UsageError(f"--{what[:-1]}: a pattern cannot contain NUL")
        try:
            check_prefix(self["subject-prefix"])
        except MappingError as e:
            raise usage.UsageError(f"--subject-prefix: {e}") from None
        Chassis.checkBus(self["bus"])
        check_no_inline_secret(self)
        if bool(self["user"]) != bool(self["password-file"]):
            raise usage.UsageError("--user and --password-file go together")
        if self["token-file"] and self["user"]:
            raise usage.UsageError("--token-file or --user/--password-file, not both")
        for name, key in (("token-file", "token"), ("password-file", "password")):
            if self[name]:
                self[key] = None  # never on the command line (refused above): read from the file
                self[f"{key}-secret"] = read_secret_file(name, self[name])
        if bool(self["tls-cert"]) != bool(self["tls-key"]):
            raise usage.UsageError("--tls-cert and --tls-key go together")
        for name in ("creds", "tls-ca", "tls-cert", "tls-key"):
            if self[name] and not os.path.isfile(self[name]):
                raise usage.UsageError(f"--{name}: no such file: {self[name]}")
        tls = bool(self["tls-ca"] or self["tls-cert"])
        self["servers"] = check_servers(self["servers"], tls, self["allow-plain"])
        check_authenticated(self["servers"], self)
        self["max-pending"] = positive_int("max-pending", self["max-pending"])
        self["import-buffer"] = positive_int("import-buffer", self["import-buffer"])
        self["initial-delay"] = positive_float("initial-delay", self["initial-delay"])
        self["max-subscriptions"] = positive_int("max-subscriptions", self["max-subscriptions"])
        self["stats-interval"] = positive_float("stats-interval", self["stats-interval"])
        self["session-linger"] = positive_float("session-linger", self["session-linger"], zero_ok=True)
        if self["name"] is not None and not NAME_RE.match(self["name"]):
            raise usage.UsageError(f"--name {self['name'][:60]!r}: 1-100 letters, digits or '._:@-'")
        _ensure_asyncio_reactor()


def _connect_options(options) -> dict:
    kw: dict = {}
    if options["creds"]:
        kw["user_credentials"] = options["creds"]
    if options.get("token-secret"):
        kw["token"] = options["token-secret"]
    if options["user"]:
        kw["user"], kw["password"] = options["user"], options["password-secret"]
    if options["tls-ca"] or options["tls-cert"] or any(s.startswith("tls://") for s in options["servers"]):
        ctx = ssl.create_default_context(cafile=options["tls-ca"] or None)
        if options["tls-cert"]:
            ctx.load_cert_chain(options["tls-cert"], options["tls-key"])
        kw["tls"] = ctx
    return kw


def makeService(options) -> NatsService:
    try:
        import nats  # noqa: F401
    except ImportError:
        raise SystemExit(f"sbus-nats needs nats-py: {EXTRA}") from None
    return NatsService(options["bus"], options["servers"], exports=options["exports"],
                       imports=options["imports"], prefix=options["subject-prefix"],
                       connect_options=_connect_options(options), max_pending=options["max-pending"],
                       import_buffer=options["import-buffer"],
                       stats_interval=options["stats-interval"],
                       reconnect_wait=options["initial-delay"],
                       static_imports=bool(options["static-imports"]),
                       max_subscriptions=options["max-subscriptions"], name=options["name"],
                       session_linger=options["session-linger"])
