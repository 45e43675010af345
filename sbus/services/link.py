"""``twistd sbus-link``: carry a bus between hosts over a Twisted stream endpoint.

    # host A
    twistd -n sbus-link --bus /run/sbus.socket \\
        --listen ssl:7010:privateKey=a.key:certKey=a.pem:caCertsDir=/etc/sbus/ca
    # host B
    twistd -n sbus-link --bus /run/sbus.socket \\
        --connect ssl:host=a.example:port=7010:caCertsDir=/etc/sbus/ca:certKey=b.pem:privateKey=b.key

Each side is one client of its local bus and of one peer link (the
``--listen`` side serves one peer at a time: a newer authenticated peer
replaces the older one; run one link process per remote host).

**Framing.** Each frame on the stream is a 4-byte big-endian length and one
sbus packet: ``MSG key\\0payload`` (a message), ``CMSG link/hello\\0<json>``
(``{"version": 1, "whoami": ..., "max_packet": ...}``, sent on connection
and again when the local whoami changes; ``"ack": true`` and ``"patterns"`` say the
peer speaks the frames below; ``"carried_before"``: whether the link carried traffic when
the sender's previous peer connection went down, see "Restarts") and ``CMSG link/ping`` (keepalive). Between current peers
also: ``CMSG link/state\0{"forwarding": bool}`` (the sender's spanning-tree state, at link
up and each change), ``CMSG link/seen\0KEY\0PAYLOAD`` (a message of the sender's bus it does
not carry because it stands by: watched, never published), ``CMSG link/ack\0N`` (the first
N MSG frames of this connection are handled: published, that is, out of the process into its
bus's socket, which the bus reads to its end even after a ``kill -9`` of the writer, or counted
as dropped), ``CMSG link/sync\0N`` / ``CMSG link/synced\0N`` (a round
trip through the other half's bus). Unknown control frames are ignored.
A frame over ``--max-packet`` is refused with one log line and the
connection is closed; a sender never sends a frame over the peer's announced
``max_packet`` (it drops and counts it instead).

**What crosses.** Local messages whose key matches one of the ``--pattern``
(default: the empty pattern, everything) are sent to the peer as they are,
and the peer publishes them on its bus. The patterns are what *this* side
exports; each side chooses its own.

**No loops.** The link turns echo off on its bus, so a message it publishes
(one that came from the peer) never comes back to it and is never sent
back. Links (and bridges, and relays) must form a tree: two paths between
the same buses deliver twice; a cycle loops forever.

**Secret keys across hosts.** A client of the remote bus whose whoami there
is ``W`` appears here as ``<this link's whoami here>/W``. A message published
here to ``<link>/W/rest`` is a secret key of the link process (nobody else
here may receive it): the link strips ``<link>/`` and sends ``W/rest``,
which the peer publishes on its bus, where only ``W``'s owner receives it.
Whatever follows the link's own prefix must itself be a secret key
(``!/cred/...``); anything else is dropped. Over several links the prefixes
nest (``<link1>/<link2>/W``).

**Learning one's cross-host identity** (`sbus.services.linkauth.ask_cross_identity`).
Anyone may publish on anyone's secret key, so an answer is believed only if
it carries a nonce that only the link could have read. Subscribe to
``<own whoami>/sbus-link/whoami`` (``!/cred////sbus-link/whoami``), then:

1. publish ``MSG sbus-link/whoami\\0<own whoami>``: every link answers there
   with ``link\\0<its whoami>`` (a candidate: forgeable; believe only links of
   a trusted uid, e.g. your own, root or the bus owner);
2. publish ``MSG <link whoami>/sbus-link/whoami\\0<own whoami>\\0<nonce>``, a
   secret key of the link that only it receives: it answers
   ``answer\\0<nonce>\\0<identity>``, the identity being the name the peer's
   bus knows you by (``<peer link's whoami there>/<own whoami>``, empty while
   the peer is down). Ignore any answer without your nonce.

**Security: every transport authenticates the peer.** Nobody reaches a bus
through a link who could not open its socket.

* TLS with client certificates: on ``--listen``, ``ssl:`` takes
  ``caCertsDir=DIR`` (every ``*.pem`` in it is a trusted CA) and then requires
  and verifies a client certificate; on ``--connect``, ``ssl:`` takes
  ``caCertsDir``, ``certKey``, ``privateKey`` and ``hostname`` (required: the
  name or IP address the server's certificate must carry in its
  subjectAltName). The connecting side sends and reads nothing until it has
  checked that name itself after the handshake, failing closed on any error
  (`verify_peer_name`; Twisted's own check let a certificate without
  subjectAltName through with a log line).
* A shared key, ``--key-file FILE`` (mode 0600, the same key on both ends):
  an HMAC challenge-response both ways before anything else crosses
  (`sbus.services.linkauth`). Plain TCP needs it, loopback included (any
  local user can connect to a loopback port), and so does TLS that
  authenticates nobody. Off loopback, plain TCP also needs
  ``--allow-plain`` (the key authenticates, it does not encrypt).
* ``unix:``: the peer (``SO_PEERCRED``) must be one the bus would admit itself
  (`sbus.services.admission`), and a listening socket on a path takes the bus
  socket's mode and owner (Twisted's default is 0666).

**Down sides.** While the peer is not connected, local messages are dropped
(``drops.peer_down``); while the bus is not connected, messages from the
peer are dropped (``drops.bus_down``). When the connection dies, what we
sent that the peer had not acknowledged is counted as ``drops.in_flight``
(what it acknowledged had left it for its bus's socket: exact, but for an
acknowledgement on its way when the connection died). A half stops reading its bus while ``MAX_UNACKED``
messages (or ``MAX_UNACKED_BYTES``) await the peer's acknowledgement: what a ``kill -9`` finds in the
half nobody counts, what waits in the bus's server its session counts.

**Failover without loss** (issue 23; docs/deploy.md). Each half keeps a
`sbus.core.standby.Window` of the direction it publishes (peer's bus -> its
bus): while this link does not carry that direction (either half stands
by, or the link just came up), every message the peer streams (MSG, or
``link/seen`` while the peer stands by) waits in the window until its copy
arrives on our bus by another path. When both halves forward again, the
receiving half first makes a round trip through its bus and, with
``link/sync``, through the peer's; then it publishes what still waits, in
order, and carries from then on. The window watches only while our bus
answered a round trip since it connected, the peer is a current one and
our ``--pattern`` set covers the peer's (we must see another path's copies).
What the peer streams before it answers the ``link/sync`` sent when the window
began to watch waits apart (`Link.watchFrom`): at a takeover, only what follows
the last of it another path was seen delivering is published. Before its round trips a takeover
waits (``--takeover-wait``, 35 s at most) until no other link half's session on our bus is
``closing`` (``server/session-held``: a dead half's writes unread, e.g. held by a hard/block
subscriber; each half tells the others on its bus its session's name, ``MSG
sbus-link/session\0WHOAMI\0NAME``, never carried across): published before our bus routes
them, they arrived twice. What our bus routes to us while we catch up that pairs with the
peer's stream, and after a wait that ran out the late copies of what we published, are
another path's copies of the peer's messages: never sent back (``standby.old_path_copies``).

**Restarts** (issue 23). What a half's bus published while that half was dead, only the bus
saw: each half holds a session on its bus (``CMSG server/session\0NAME\0LINGER`` after its
subscriptions, docs/protocol.md "Sessions"; ``--session``, by default ``sbus-link
listen=ENDPOINT`` or ``connect=ENDPOINT`` without certificate and key files; ``--session-linger``,
60 s). A successor that gets ``resumed`` adds MISSED to ``lost.restart`` (``bus_down`` when it
is our own earlier connection, not a previous process) and logs one line with the gap; if its
peer's hello says the link stood by when the old process died (another path carried those
messages), the count moves to ``session.restart_standing_by``, not lost.

Both sides reconnect with back-off
(the ``--connect`` side reconnects to the peer). A stats line is logged
every ``--stats-interval`` seconds.
"""

from __future__ import annotations

import ipaddress
import math
import json
import os
import socket
from collections import Counter, deque

from twisted.application import service
from twisted.application.internet import ClientService, backoffPolicy
from twisted.internet import defer, endpoints, protocol
from twisted.internet.interfaces import IHandshakeListener, IPushProducer, ISSLTransport
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.protocols.basic import Int32StringReceiver
from twisted.protocols.policies import TimeoutMixin
from twisted.python import usage

from sbus.options import METRICS_OPTION, MISSING_BUS_HELP, RespelledOptions, positive_float, session_name_option
from twisted.python.filepath import FilePath
from zope.interface import implementer

from sbus.client import address as client_address
from sbus.client.twisted import ReconnectingClient, SbusProtocol, parse_whoami
from sbus.core import codec
from sbus.core.codec import MAX_PACKET
from sbus.core.credentials import SECRET_ROOT, CredentialError, check_key
from sbus.core.patterns import matches
from sbus.core.standby import MAX_MESSAGES, Window, parse_size
from sbus.services import access as bus_access
from sbus.services.admission import Admission
from sbus.services.bridge import HELD_COPIES_AGE, RELEASE_POLL, RELEASE_WAIT, RecentPackets
from sbus.services.linkauth import AUTH, PROOF, AuthError, Handshake, load_key
from sbus.services.shutdown import exit_zero_on_sigterm, stop_with_status
from sbus.services.session import carried_note, held_states
from sbus.core.topology import HELLO_KEY, RESERVED as TOPOLOGY
from sbus.services.spanning import Tree, default_name, opt_trust_uid, send_urgent
from sbus.services.svcstats import STATS_REQUEST, StatsResponder, lost, unknown_gaps

log = Logger(namespace="sbus.link")

VERSION = 1
#: Seconds a connection has to prove it holds the shared key.
AUTH_TIMEOUT = 10.0
#: Bytes read from a peer connection at once (Twisted's default is 64 KiB; the same number is
#: the output queued for the peer before we stop reading our bus, though `MAX_UNACKED` stops it
#: first with a peer that acknowledges).
READ_SIZE = 1 << 20
#: Largest frame before the peer proved the key (auth and proof frames are ~100 bytes).
PREAUTH_MAX_LENGTH = 1024
HELLO = b"link/hello"
PING = b"link/ping"
#: Spanning-tree hellos on the link connection (the connection is a segment of its own).
STP = b"link/stp"
#: ``{"forwarding": bool}``: this half's spanning-tree state, sent when the link comes up and
#: at each change (a standing-by half watches its peer's stream only while the peer forwards).
STATE = b"link/state"
#: ``link/sync\0N`` asks the peer for a round trip through its bus; ``link/synced\0N`` is the
#: answer, sent once the peer's bus answered a whoami (everything the peer read before is ahead).
SYNC = b"link/sync"
SYNCED = b"link/synced"
#: ``link/seen\0KEY\0PAYLOAD``: a message of the peer's bus that it does not carry (it stands
#: by); never published, only watched (the other half keeps the window of its direction).
SEEN = b"link/seen"
#: ``link/ack\0N``: the first N messages the peer sent on this connection are handled here
#: (published: out of this process into our bus's socket, or counted as dropped).
ACK = b"link/ack"
#: Messages sent to the peer and not yet acknowledged (``link/ack``) before we stop reading our
#: bus: a kill -9 loses what a half holds for its peer (its queue, its socket) with nobody
#: counting it (its own ``in_flight`` count dies with it; our session counts only what the bus
#: still had), so we hold little, and the rest waits in our bus's server, which counts it. Up to
#: 1 MiB (the transport's limit) and the kernel's buffers were held before: a half killed right
#: after its takeover, with its peer held by a slow bus, lost them uncounted (issue 34).
MAX_UNACKED = 1024
#: ... and at most this many bytes of them (1 KiB messages: 128). The count alone at 256 cost a
#: fifth of the link's rate with small messages (bench/services.py --only link: 0.16 of direct
#: against 0.21); 2,048 small ones or 256 KiB kept it (0.20-0.21). The peer acknowledges once
#: a message left it for its bus (`Link.acknowledge`), no longer a bus round trip later, so the
#: whole budget became what a kill can find in transit (test_link_failover's
#: ..._killed_right_after_its_takeover...: 444 uncounted at 256 KiB, 256-384 before): half of
#: each bounds it as before (254 there; 1,024: 0.19-0.21 of direct against 0.20-0.22 for 2,048,
#: same runs).
MAX_UNACKED_BYTES = 128 << 10
#: How often `PeerProtocol.marks` records what was sent (bytes acknowledged are known to a mark).
_MARK_EVERY = 16
#: Default --session-linger, seconds (the server clamps it to its --max-session-linger).
SESSION_LINGER = 60.0
#: Seconds the takeover waits for the peer's answer to ``link/sync``.
SYNC_TIMEOUT = 10.0
#: The window's side names: our bus, and what the peer sent us from its bus.
BUS, PEER = "bus", "peer"
#: Our receiving direction (peer -> our bus), as the stats name it.
FROM_REMOTE = "from_remote"
STANDBY, CATCHING_UP, CARRYING = "standby", "catching up", "carrying"
BUS_PORT, PEER_PORT = 1, 2
#: ``MSG sbus-link/session\0<whoami>\0<session name>``: a half tells the other links' halves on
#: its bus the name of its session there, once its bus answered and again to each newcomer it hears
#: (they learn each other whichever came first); never carried across. A half taking over asks
#: whether one of them is still ``closing`` before it publishes its window: a dead half's writes unread.
SESSION_ANNOUNCE = b"sbus-link/session"
#: Session names of other halves on our bus remembered (the newest, by whoami).
MAX_BUS_SESSIONS = 64
#: The key clients publish their whoami on to learn their identity across the link.
WHOAMI_REQUEST = b"sbus-link/whoami"
_WHOAMI_REPLY_SUFFIX = b"/" + WHOAMI_REQUEST
#: First field of a discovery reply (``link\0<link whoami>``) and of an answer
#: to a challenge (``answer\0<nonce>\0<identity>``).
WHOAMI_LINK = b"link"
WHOAMI_ANSWER = b"answer"


def _show(b: bytes | None) -> str:
    return "" if b is None else b.decode("utf-8", "replace")


# ---------------------------------------------------------------- endpoints


class EndpointError(ValueError):
    """An endpoint string we refuse; `str()` is one line."""


_TLS_KINDS = {"ssl", "tls"}
_PLAIN_TCP = {"tcp", "tcp6"}


def _is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _kind(description: str) -> tuple[str, list, dict]:
    try:
        return bus_access.endpoint_kind(description)
    except ValueError as e:
        raise EndpointError(str(e)) from None


def require_tls() -> None:
    """TLS needs pyOpenSSL and service_identity, the [link] extra: without them, say so in one line."""
    try:
        import OpenSSL  # noqa: F401
        import service_identity  # noqa: F401
    except ImportError:
        raise EndpointError("TLS needs pyOpenSSL and service_identity, which are not installed: "
                            "pip install 'sbus[link]'") from None


def check_endpoint(description: str, listen: bool, allow_plain: bool, has_key: bool = False) -> None:
    """Raise `EndpointError` if `description` would carry the bus unprotected.

    Every transport authenticates the peer: ``unix:`` by the peer's uid
    (checked on each connection), ``ssl:`` by certificates (``caCertsDir=``),
    anything else (plain TCP, loopback included) by the shared key of
    ``--key-file``. Off loopback, plain TCP also needs ``--allow-plain``.
    """
    _check_network(description, listen, allow_plain)
    kind, args, kw = _kind(description)
    if kind == "unix" or has_key:
        return
    if kind == "ssl" and "caCertsDir" in kw:
        return
    if kind == "tls" and not listen:
        return
    raise EndpointError(f"refusing {description}: nothing authenticates the peer (any local user "
                        f"could join the bus); give --key-file FILE (a shared key, mode 0600, the "
                        f"same on both ends) or use ssl: with caCertsDir= and certificates")


def peer_name(description: str) -> str | None:
    """The name a ``--connect`` TLS endpoint must find in the peer's certificate: ``hostname=``
    of ``ssl:``, the host of ``tls:``; None for other kinds."""
    kind, args, kw = _kind(description)
    if kind == "ssl":
        return kw.get("hostname")
    if kind == "tls":
        return kw.get("host", args[0] if args else None)
    return None


def _check_network(description: str, listen: bool, allow_plain: bool) -> None:
    kind, args, kw = _kind(description)
    if kind in _TLS_KINDS:
        require_tls()
    if kind == "ssl" and not listen and not kw.get("hostname"):
        raise EndpointError(f"refusing {description}: ssl: without hostname= checks no name (any "
                            "certificate the CA signed would do); add hostname=NAME, the name or IP "
                            "address the peer's certificate carries")
    if kind == "unix" or allow_plain:
        return
    flag = "use ssl: with client certificates, a loopback address, or --allow-plain"
    if listen:
        if kind in _PLAIN_TCP:
            default = "" if kind == "tcp" else "::"
            interface = kw.get("interface", args[1] if len(args) > 1 else default)
            if not _is_loopback(interface):
                raise EndpointError(f"refusing plain TCP listening on {interface or 'all interfaces'!s} "
                                    f"({description}): {flag}")
            return
        if kind == "ssl":
            interface = kw.get("interface", args[4] if len(args) > 4 else "")
            if "caCertsDir" not in kw and not _is_loopback(interface):
                raise EndpointError(f"refusing ssl: listening without caCertsDir= on "
                                    f"{interface or 'all interfaces'} (anyone could join the bus): {flag}")
            return
        raise EndpointError(f"refusing {kind}: listening: not known to be loopback or authenticated TLS; {flag}")
    if kind in _PLAIN_TCP:
        host = kw.get("host", args[0] if args else "")
        if not _is_loopback(host):
            raise EndpointError(f"refusing plain TCP to {host} ({description}): {flag}")
        return
    if kind == "ssl":
        host = kw.get("host", args[0] if args else "")
        if "caCertsDir" not in kw and "hostname" not in kw and not _is_loopback(host):
            raise EndpointError(f"refusing ssl: to {host} without caCertsDir= (the server would not be "
                                f"verified): {flag}")
        return
    if kind == "tls":
        return
    raise EndpointError(f"refusing {kind}: connections: not known to be loopback or TLS; {flag}")


def verify_peer_name(connection, name: str) -> str | None:
    """Why the peer certificate of an OpenSSL `connection` does not prove `name` (a DNS name
    or an IP address), or None if it does. Fails closed: any error is a refusal (a certificate
    without subjectAltName raises service_identity's CertificateError, not VerificationError)."""
    try:
        from service_identity.pyopenssl import verify_hostname, verify_ip_address

        try:
            ipaddress.ip_address(name.strip("[]"))
        except ValueError:
            verify_hostname(connection, name)
        else:
            verify_ip_address(connection, name.strip("[]"))
    except Exception as e:  # noqa: BLE001 - every failure refuses
        return f"{type(e).__name__}: {e}"[:300]
    return None


def _load_cas(directory: str) -> list:
    from twisted.internet import ssl

    cas = []
    path = FilePath(directory)
    if not path.isdir():
        raise EndpointError(f"caCertsDir={directory}: not a directory")
    for child in sorted(path.children(), key=lambda p: p.path):
        if child.basename().endswith(".pem"):
            try:
                cas.append(ssl.Certificate.loadPEM(child.getContent()).original)
            except Exception:
                continue
    if not cas:
        raise EndpointError(f"caCertsDir={directory}: no CA certificate (*.pem) found")
    return cas


def server_endpoint(reactor, description: str):
    """`serverFromString`, plus ``caCertsDir=`` on ``ssl:`` (require and verify client certificates)."""
    kind, args, kw = _kind(description)
    if kind != "ssl" or "caCertsDir" not in kw:
        return endpoints.serverFromString(reactor, description)
    from twisted.internet import ssl

    kw = dict(kw)
    names = ["port", "privateKey", "certKey", "sslmethod", "interface", "backlog", "extraCertChain",
             "dhParameters"]
    for name, value in zip(names, args):
        kw.setdefault(name, value)
    cas = _load_cas(kw.pop("caCertsDir"))
    unknown = set(kw) - set(names)
    if unknown:
        raise EndpointError(f"ssl: does not take {', '.join(sorted(unknown))}")
    if "port" not in kw:
        raise EndpointError("ssl: needs a port")
    private_key = kw.get("privateKey", "server.pem")
    cert_key = kw.get("certKey") or private_key
    pem = FilePath(cert_key).getContent() + b"\n" + FilePath(private_key).getContent()
    cert = ssl.PrivateCertificate.loadPEM(pem)
    chain = None
    if kw.get("extraCertChain"):
        chain = [ssl.Certificate.loadPEM(c).original
                 for c in _split_pem(FilePath(kw["extraCertChain"]).getContent())]
    extra = {}
    if kw.get("sslmethod"):
        extra["method"] = getattr(ssl.SSL, kw["sslmethod"])
    if kw.get("dhParameters"):
        extra["dhParameters"] = ssl.DiffieHellmanParameters.fromFile(FilePath(kw["dhParameters"]))
    options = ssl.CertificateOptions(
        privateKey=cert.privateKey.original, certificate=cert.original, extraCertChain=chain,
        verify=True, caCerts=cas, requireCertificate=True, **extra,
    )
    return endpoints.SSL4ServerEndpoint(reactor, int(kw["port"]), options,
                                        backlog=int(kw.get("backlog", 50)), interface=kw.get("interface", ""))


def _split_pem(data: bytes) -> list[bytes]:
    end = b"-----END CERTIFICATE-----"
    return [part + end for part in data.split(end) if b"-----BEGIN CERTIFICATE-----" in part]


# ---------------------------------------------------------------- the bus session


def default_session(listen: str | None, connect: str | None) -> bytes:
    """``sbus-link listen=ENDPOINT`` or ``sbus-link connect=ENDPOINT``: the same for each process
    that replaces this one, different for two links on one bus (they listen on, or connect to,
    different ports). Files of certificates and keys are left out (`codec.session_name`: a
    name over the server's limit ends with a hash of the whole)."""
    role, where = ("listen", listen) if listen else ("connect", connect)
    kind, args, kw = _kind(where)
    kept = list(args) + [f"{k}={v}" for k, v in kw.items() if k not in ("privateKey", "certKey", "caCertsDir",
                                                            "extraCertChain", "dhParameters")]
    return codec.session_name(f"sbus-link {role}={':'.join([kind, *kept])}")


# ---------------------------------------------------------------- options


class Options(RespelledOptions):
    command = "twistd sbus-link"
    renamed = {"--allow-plain-tcp": "--allow-plain"}
    synopsis = "--bus ADDRESS (--listen ENDPOINT | --connect ENDPOINT) [--pattern P ...] [--allow-plain]"
    longdesc = (
        "Carry an sbus bus to another host's bus over a Twisted stream endpoint (ssl:, tcp:, unix:). "
        "Run --listen on one host and --connect on the other. See docs/relay-link.md."
    )
    optFlags = [
        ["allow-plain", None, "Allow plain TCP (and TLS that authenticates nobody) on non-loopback addresses."],
        ["no-spanning-tree", None, "Forward always, taking no part in the spanning tree (only if no other "
                                   "path joins these buses; see docs/deploy.md)."],
    ]
    optParameters = [
        METRICS_OPTION,
        ["bus", "b", None, "The local bus: PATH, /dev/unix/abstract/HEX or /dev/fd/N (default: $SBUS_SOCKET). "
                                 "--listen opens once the bus has answered. " + MISSING_BUS_HELP],
        ["listen", "l", None, "Server endpoint to accept the peer link on, e.g. ssl:7010:...:caCertsDir=DIR."],
        ["connect", "c", None, "Client endpoint of the peer link, e.g. ssl:host=H:port=7010:hostname=H:caCertsDir=...:certKey=...:privateKey=... (ssl: needs hostname=, the name the peer's certificate carries)"],
        ["max-packet", None, str(MAX_PACKET), "Largest packet carried, bytes (frames above it close the link)."],
        ["initial-delay", None, "0.2", "First reconnection delay, seconds (bus and --connect peer)."],
        ["max-delay", None, "30", "Longest reconnection delay, seconds."],
        ["keepalive", None, "30", "Ping the peer this often; drop it after 3 silent intervals (0: off)."],
        ["stats-interval", None, "60", "Log a statistics line this often, seconds (0: only at exit)."],
        ["key-file", "k", None, "Shared key (a file only its owner may read, the same on both ends): "
                                "both ends prove they hold it at every connection. Needed for plain TCP."],
        ["session", None, None, "Name of this half's session on its bus (default: sbus-link, the role "
                                "and the endpoint): a restarted process claims it and counts what "
                                "its bus published while it was dead (lost.restart)."],
        ["session-linger", None, str(SESSION_LINGER), "Seconds the bus keeps counting for a dead "
                                                      "process's successor (0: nothing is counted)."],
        ["takeover-wait", None, f"{RELEASE_WAIT:g}", "Taking over, wait at most this many seconds for the bus "
                                                     "to read what a dead half of another link wrote to "
                                                     "it (0: never wait; see docs/deploy.md)."],
        ["standby-window", None, str(MAX_MESSAGES), "Standing by, remember at most this many messages "
                                                    "the active path has not yet delivered (forwarded "
                                                    "if we take over; see docs/deploy.md)."],
    ]

    def __init__(self):
        super().__init__()
        self["patterns"] = []
        self["trust-uids"] = []

    opt_trust_uid = opt_trust_uid

    def opt_pattern(self, value: str) -> None:
        """Export local messages matching this pattern to the peer; repeatable (default: everything)."""
        pattern = os.fsencode(value)
        if b"\0" in pattern:
            raise usage.UsageError("--pattern: NUL in pattern")
        if pattern.startswith(SECRET_ROOT):
            raise usage.UsageError("--pattern: secret patterns cannot be exported (they are mapped by identity)")
        self["patterns"].append(pattern)

    opt_p = opt_pattern

    def postOptions(self) -> None:
        if bool(self["listen"]) == bool(self["connect"]):
            raise usage.UsageError("give exactly one of --listen ENDPOINT and --connect ENDPOINT")
        try:
            self["bus"] = str(client_address.resolve(self["bus"]))
        except client_address.AddressError as e:
            raise usage.UsageError(f"--bus: {e}") from None
        listen = bool(self["listen"])
        desc = self["listen"] or self["connect"]
        try:
            check_endpoint(desc, listen, bool(self["allow-plain"]), bool(self["key-file"]))
            if self["key-file"]:
                load_key(self["key-file"])
        except (EndpointError, AuthError) as e:
            # One line on stderr and a non-zero status, not the whole usage text.
            raise SystemExit(f"sbus-link: --{'listen' if listen else 'connect'}: {e}") from None
        try:
            self["max-packet"] = int(self["max-packet"])
        except ValueError:
            raise usage.UsageError(f"--max-packet: not an integer: {self['max-packet']!r}") from None
        if not 17 <= self["max-packet"] <= 16 << 20:
            raise usage.UsageError("--max-packet: must be > 16 and <= 16 MiB")
        for name in ("initial-delay", "max-delay"):
            self[name] = positive_float(name, self[name])
        for name in ("keepalive", "stats-interval", "session-linger"):
            self[name] = positive_float(name, self[name], zero_ok=True)
        if not math.isfinite(self["session-linger"]):
            raise usage.UsageError(f"--session-linger: not a finite number: {self['session-linger']}")
        self["takeover-wait"] = positive_float("takeover-wait", self["takeover-wait"], zero_ok=True)
        if not math.isfinite(self["takeover-wait"]):
            raise usage.UsageError(f"--takeover-wait: not a finite number: {self['takeover-wait']}")
        self["session"] = session_name_option(self["session"])
        try:
            self["standby-window"] = parse_size(self["standby-window"])
        except ValueError as e:
            raise usage.UsageError(str(e)) from None
        if not self["patterns"]:
            self["patterns"] = [b""]


# ---------------------------------------------------------------- protocols


class LocalProtocol(SbusProtocol):
    link: "Link | None" = None

    def outboxDrained(self) -> None:
        self.link.handedOn(self)

    def readBatchDone(self) -> None:
        self.link.localBatchDone(self)

    def packetReceived(self, packet: bytes) -> None:
        if packet[:4] == b"MSG ":
            end = packet.find(b"\0", 4)
            if end >= 0:
                self.link.fromLocal(packet[4:end], packet, end)
                return
        SbusProtocol.packetReceived(self, packet)


@implementer(IHandshakeListener)
class PeerProtocol(Int32StringReceiver, TimeoutMixin):
    """One stream connection to the peer link."""

    def __init__(self, link: "Link"):
        self.link = link
        self.MAX_LENGTH = link.max_packet
        self.ready = False
        self.remote_max = MAX_PACKET
        self.remote_whoami: bytes | None = None
        self.name = "?"
        self._ping = None
        #: The shared-key handshake (None: the transport authenticates the peer).
        self.auth: Handshake | None = None
        self.auth_timer = None
        #: The name a TLS server's certificate must prove, until it has (client side).
        self.unverified: str | None = None
        #: The peer acknowledges what it handled (``link/ack``; said in its hello).
        self.acks = False
        #: MSG frames sent to the peer, and how many of them it acknowledged.
        self.msgs_sent = 0
        self.acked = 0
        #: Bytes of them sent, acknowledged (as of the last mark at or before the ack), and marks
        #: (messages sent, bytes sent) every `_MARK_EVERY` messages.
        self.bytes_sent = 0
        self.bytes_acked = 0
        self.marks: deque = deque()
        #: MSG frames received from the peer, the count last acknowledged, and (N, P): the first
        #: N have left this process once our bus transport's `packets_out` reaches P (what our
        #: queue toward the bus held then), oldest first (`Link.acknowledge`).
        self.msgs_in = 0
        self.ack_sent = 0
        self.unhanded: deque = deque()
        #: The peer's spanning-tree state (None: not said yet, or an older peer).
        self.remote_forwarding: bool | None = None
        #: The peer's export patterns (its hello), None: not said.
        self.remote_patterns: list[bytes] | None = None
        self.watch_noted = False
        #: The peer's hello: did the link carry when the peer's previous connection (to the
        #: process before us) went down? None: not said.
        self.carried_before: bool | None = None
        #: Our `link/sync` requests awaiting the peer's answer: number -> (Deferred, timer).
        self.syncs: dict[int, tuple] = {}
        self.next_sync = 0
        #: The peer answered the `link/sync` sent when our window last began to watch our bus
        #: (`Link.watchFrom`): what it streams now may be replayed at a takeover.
        self.settled = False
        self.settle_sync: int | None = None

    def connectionMade(self):
        # Read what the kernel holds in big bites: when the peer resets the connection (killed
        # with our frames unread), the reactor drops it at our next write, and what we had not
        # read yet is lost though it had arrived (64 KiB bites lost 882-2,436 of 3,000 in
        # tests/test_link_failover.py; past READ_SIZE unread at the reset it still is).
        stream = self.transport.transport if ISSLTransport.providedBy(self.transport) else self.transport
        if getattr(stream, "bufferSize", None) is not None:
            stream.bufferSize = READ_SIZE
        peer = self.transport.getPeer()
        self.name = f"{getattr(peer, 'host', peer)}:{getattr(peer, 'port', '')}".rstrip(":")
        if self.link.keepalive:
            self.setTimeout(self.link.keepalive * 3)
            self._ping = LoopingCall(self.sendFrame, b"CMSG " + PING)
            self._ping.clock = self.link.reactor
            self._ping.start(self.link.keepalive, now=False)
        # A TLS client sends nothing and reads nothing until it has checked the server's name
        # itself (Twisted's check lets service_identity's CertificateError through: a
        # certificate without subjectAltName was accepted with a log line).
        self.unverified = self.link.peer_name if ISSLTransport.providedBy(self.transport) else None
        if self.unverified is None:
            self.link.peerConnected(self)
        else:
            self.setTimeout(AUTH_TIMEOUT)

    def handshakeCompleted(self):
        cert = None
        try:
            cert = self.transport.getPeerCertificate()
        except Exception:
            pass
        subject = cert.get_subject().CN if cert is not None else None
        log.info("sbus-link: TLS handshake with {peer} done (certificate CN={cn})", peer=self.name, cn=subject)
        if self.unverified is None:
            return
        name, self.unverified = self.unverified, None
        why = verify_peer_name(self.transport.getHandle(), name)
        if why is not None:
            self.link.drops["peer_name_refused"] += 1
            log.error("sbus-link: refusing {peer}: its certificate does not prove the name {name!r}: "
                      "{why}; closing", peer=self.name, name=name, why=why)
            self.transport.abortConnection()
            return
        self.setTimeout(self.link.keepalive * 3 if self.link.keepalive else None)
        self.link.peerConnected(self)

    def sendFrame(self, frame: bytes) -> None:
        if self.transport is not None and self.transport.connected:
            self.sendString(frame)

    def stringReceived(self, frame: bytes):
        if self.unverified is not None:   # cannot happen: TLS delivers data after the handshake
            self.transport.abortConnection()
            return
        self.resetTimeout()
        self.link.fromPeer(self, frame)

    def dataReceived(self, data: bytes):
        super().dataReceived(data)
        if self.msgs_in != self.ack_sent:
            self.link.acknowledge(self)

    def lengthLimitExceeded(self, length: int):
        log.warn("sbus-link: peer {peer} sent a frame of {n} bytes, over the {limit}-byte limit; closing",
                 peer=self.name, n=length, limit=self.MAX_LENGTH)
        self.transport.abortConnection()

    def timeoutConnection(self):
        log.warn("sbus-link: peer {peer} silent for {t:.0f}s; closing", peer=self.name,
                 t=self.link.keepalive * 3)
        self.transport.abortConnection()

    def connectionLost(self, reason=protocol.connectionDone):
        self.setTimeout(None)
        if self.auth_timer is not None and self.auth_timer.active():
            self.auth_timer.cancel()
        self.auth_timer = None
        if self._ping is not None and self._ping.running:
            self._ping.stop()
        self.link.peerLost(self, reason)


class PeerFactory(protocol.Factory):
    noisy = False

    def __init__(self, link: "Link"):
        self.link = link

    def buildProtocol(self, addr):
        return PeerProtocol(self.link)


@implementer(IPushProducer)
class _Pauser:
    """Pause/resume one side when the other side's output backs up (ignores stopProducing)."""

    def __init__(self, pause, resume):
        self.pauseProducing = pause
        self.resumeProducing = resume

    def stopProducing(self):
        pass


class _Listener(service.Service):
    """The --listen port as a service: opened when it starts, closed when it stops (Twisted's
    `StreamServerEndpointService` without reaching into it for the port or for a synchronous
    error: a port that cannot be opened goes to `failed`)."""

    def __init__(self, endpoint, factory, failed):
        self.endpoint = endpoint
        self.factory = factory
        self.failed = failed
        self.port = None

    def startService(self):
        super().startService()
        self.endpoint.listen(self.factory).addCallbacks(self._listening, self.failed)

    def _listening(self, port) -> None:
        self.port = port
        if not self.running:  # stopped before the port was open
            port.stopListening()
            return
        log.info("sbus-link: listening on {host}", host=port.getHost())

    def stopService(self):
        super().stopService()
        port, self.port = self.port, None
        if port is not None:
            return port.stopListening()
        return None


class _BusClient(ReconnectingClient):
    def __init__(self, link, *args, **kw):
        super().__init__(*args, **kw)
        self.link = link

    def connectionMade(self, proto):
        self.link.busUp(proto)

    def connectionLost(self, reason):
        self.link.busDown(reason)

    def connectionFailed(self, reason):
        if self.failureIsNews:
            self.link.busUnreachable(self.lastFailure)

    def sessionClaimed(self, reply):
        self.link.sessionClaimed(reply)


# ---------------------------------------------------------------- the link


class Link(service.MultiService):
    def __init__(self, bus: str, listen: str | None = None, connect: str | None = None,
                 patterns=(b"",), max_packet: int = MAX_PACKET, initialDelay: float = 0.2,
                 maxDelay: float = 30.0, keepalive: float = 30.0, statsInterval: float = 60.0,
                 reactor=None, key_file: str | None = None, spanning_tree: bool = True,
                 trusted_uids=(), standby_window: int = MAX_MESSAGES, session: bytes | None = None,
                 session_linger: float = SESSION_LINGER, takeover_wait: float = RELEASE_WAIT):
        super().__init__()
        #: Who may reach the bus: a unix peer must be one of them (`sbus.services.admission`).
        self.admission = Admission(bus, "sbus-link")
        #: The shared key (`sbus.services.linkauth`); None: the transport authenticates.
        self.key = load_key(key_file) if key_file else None
        self.role = "listen" if listen else "connect"
        if reactor is None:
            from twisted.internet import reactor as default_reactor
            reactor = default_reactor
        self.reactor = reactor
        self.bus_address = bus
        self.listen = listen
        self.connect = connect
        #: What a TLS server we connect to must prove it is (None: listening, or not TLS).
        self.peer_name = peer_name(connect) if connect else None
        self.patterns = list(patterns)
        self.export_all = b"" in self.patterns
        self.max_packet = max_packet
        self.keepalive = keepalive
        self.statsInterval = statsInterval
        self.local: LocalProtocol | None = None
        self.whoami: bytes | None = None
        self._own_secret: bytes | None = None
        self.peer: PeerProtocol | None = None
        #: Every open stream connection (the active peer, and any still saying hello).
        self.conns: set[PeerProtocol] = set()
        self._local_paused = False
        #: Why we do not read our bus: "buffer" (the peer's transport is full), "acks" (the peer
        #: has `MAX_UNACKED` of ours unacknowledged).
        self._local_holds: set[str] = set()
        self._peer_paused = False
        self.to_remote = 0
        self.from_remote = 0
        self.whoami_answers = 0
        self.peer_connects = 0
        self.bus_connects = 0
        self.drops = Counter()
        #: Messages not carried while this link stands by (another path carries them), by direction.
        self.standby = Counter()
        #: (messages sent to the peer, bus packets read) at the end of each bus read batch whose
        #: messages the peer has not all acknowledged: what `server/session-ack` may say next.
        self._bus_marks: deque = deque()
        #: Our receiving direction (peer's bus -> ours) while this link does not carry it: what
        #: the peer saw on its bus (its stream: MSG, or link/seen while it stands by) that has
        #: not arrived on our bus by another path (sbus.core.standby, sides PEER and BUS);
        #: published when the link carries again. Each half keeps the window of the direction
        #: it publishes: the peer keeps the other one.
        self.window = Window((PEER, BUS), max_messages=standby_window)
        #: Our bus answered a round trip since it connected (our subscriptions are in force).
        self._bus_ready = False
        #: STANDBY (messages from the peer go to the window), CATCHING_UP (round trips before
        #: the window is published), CARRYING (published as they come).
        self._receiving = STANDBY
        self._takeovers = 0
        #: Messages from the peer not carried while the window could not watch, by direction.
        self.unwatched = Counter()
        #: What the peer streamed before it settled (`watchFrom`), apart from `window`, and its
        #: order; the deliveries by another path `window` had seen when we began to watch; how
        #: many of it takeovers published.
        self.unsettled = Window((PEER, BUS), max_messages=standby_window)
        self._unsettled_order: deque = deque(maxlen=standby_window)
        self._delivered_at_watch = 0
        self.unsettled_replayed = 0
        #: What a takeover could not forward (the peer or bus went away during its round trip).
        self.takeover_lost = 0
        #: Seconds a takeover waits for our bus to read what a dead half of another link wrote to
        #: it (its session ``closing``: `_awaitRelease`), and the poll waiting for the next round.
        self.takeover_wait = takeover_wait
        self._release = None
        #: Other links' halves on our bus: whoami -> session name (``sbus-link/session``).
        self.bus_sessions: dict[bytes, bytes] = {}
        #: After a takeover that stopped waiting with a dead half's writes still unread in our
        #: bus: what we published from the window, whose late copies (the dead half's, routed to
        #: us too) must never go back to the peer's bus; how many were recognised.
        self.held_copies: RecentPackets | None = None
        self.old_path_copies = 0
        self._warned = set()
        #: Our session on the bus (``server/session``): a successor of this process claims it
        #: and counts what the bus published while we were dead (`sessionClaimed`).
        self.session_name = session if session is not None else default_session(listen, connect)
        self.session_linger = session_linger
        self.session: dict = {"name": _show(self.session_name), "state": None, "linger": None}
        #: What the bus published while the process before us was dead, if the peer then said
        #: the link stood by (another path carried it): not lost.
        self.restart_standing_by = 0
        #: Did the link carry traffic when the last peer connection went down (None: no peer
        #: yet, or not known)? Told to the next peer in the hello (``carried_before``).
        self.carried_before: bool | None = None
        where = (listen or connect or "").split(":privateKey=")[0].split(":caCertsDir=")[0][:80]
        self.tree = Tree(reactor, default_name("sbus-link", f"bus={bus} {'listen' if listen else 'connect'}="
                                                            f"{where}"),
                         {BUS_PORT: "bus", PEER_PORT: "peer"}, self._sendTree, log, enabled=spanning_tree,
                         trusted_uids=trusted_uids, transport_ports=(PEER_PORT,),
                         on_change=self._forwardingChanged)
        self.responder = StatsResponder("sbus-link", self.tree.node.name, self.stats, self._publicStats)

        def localFactory():
            p = LocalProtocol()
            p.link = self
            return p

        self.bus = _BusClient(self, reactor, bus, localFactory, initialDelay=initialDelay,
                              maxDelay=maxDelay, max_packet=max_packet, watch=True)
        self.bus.echo(False)
        # claimed after the subscriptions; the count is confirmed once logged and counted
        self.bus.holdSession(self.session_name, session_linger, confirm=True)
        # Lossless: when we stop reading the bus (the peer is slow), the bus holds the publishers.
        self.bus.flood(hard="block")
        self.bus.subscribe(TOPOLOGY)
        self.bus.subscribe(STATS_REQUEST)
        for pattern in self.patterns:
            self.bus.subscribe(pattern)
        self.bus.subscribe(WHOAMI_REQUEST)
        self.bus.subscribe(SESSION_ANNOUNCE)

        factory = PeerFactory(self)
        if listen:
            if _kind(listen)[0] == "unix":
                self.endpoint = bus_access.server_endpoint(reactor, listen, self.admission.access)
            else:
                self.endpoint = server_endpoint(reactor, listen)
            # Started once the bus has answered (`_listenNow`): a peer that connects
            # before we have a bus would get nothing, and a port open without a bus looks served.
            self.server = _Listener(self.endpoint, factory, self._cannotListen)
        else:
            self.endpoint = endpoints.clientFromString(reactor, connect)
            self.server = ClientService(self.endpoint, factory,
                                        retryPolicy=backoffPolicy(initialDelay, maxDelay))
            self.server.setServiceParent(self)
        self._stats = LoopingCall(self.logStats)
        self._stats.clock = reactor

    # -- service life

    def startService(self):
        log.info("sbus-link: bus {bus}, {how} {where}, exporting {patterns}", bus=self.bus_address,
                 how="listening (once the bus answers) on" if self.listen else "connecting to",
                 where=self.listen or self.connect, patterns=", ".join(repr(_show(p)) for p in self.patterns))
        exit_zero_on_sigterm(self.reactor)
        super().startService()
        self.bus.start()
        self.tree.start()
        if self.statsInterval:
            self._stats.start(self.statsInterval, now=False)

    def stopService(self):
        self.tree.stop()
        if self._release is not None and self._release.active():
            self._release.cancel()
        self._release = None
        if self._stats.running:
            self._stats.stop()
        self.logStats()
        ds = [defer.maybeDeferred(super().stopService), self.bus.stop()]
        for conn in list(self.conns):
            conn.transport.unregisterProducer()  # a TLS transport closes only once no producer is registered
            conn.transport.loseConnection()
        return defer.DeferredList(ds)

    def stats(self) -> dict:
        return {
            "bus_connected": self.local is not None,
            "peer_connected": self.peer is not None,
            "whoami": _show(self.whoami),
            "peer_whoami": _show(self.peer.remote_whoami) if self.peer is not None else None,
            "to_remote": self.to_remote,
            "from_remote": self.from_remote,
            "bus_reconnects": max(0, self.bus_connects - 1),
            "peer_connects": self.peer_connects,
            "whoami_answers": self.whoami_answers,
            "drops": dict(self.drops),
            "lost": lost(self.drops, {"failover_gap": self._failoverGap()}),
            "unknown_gaps": unknown_gaps(self.bus),
            "standby_not_forwarded": dict(self.standby),
            "standby": {
                "delivered_by_active": self._byDirection(self.window.delivered),
                "replayed_at_takeover": {FROM_REMOTE: self.window.replayed[PEER] + self.unsettled_replayed},
                "skipped_by_active": self._byDirection(self.window.skipped),
                "unwatched": dict(self.unwatched),
                "watching": self._watched(self.peer),
                "receiving": self._receiving,
                "window": self.window.stats(),
                "old_path_copies": {FROM_REMOTE: self.old_path_copies},
            },
            "failover_gap": self._failoverGap(),
            "session": dict(self.session, restart_standing_by=self.restart_standing_by),
            "spanning_tree": self.tree.stats(),
        }

    def _byDirection(self, counts: dict) -> dict:
        return {FROM_REMOTE: counts[PEER]}

    def _failoverGap(self) -> dict:
        return {FROM_REMOTE: self.window.gap[PEER] + self.takeover_lost}

    def _publicStats(self) -> dict:
        return {"bus_connected": self.local is not None, "peer_connected": self.peer is not None,
                "forwarding": self.tree.forwarding}

    def _sendTree(self, port: int, key: bytes, payload: bytes) -> None:
        if port == BUS_PORT:
            if self.local is not None and self.local.connected:
                send_urgent(self.local.transport, b"MSG " + key + b"\0" + payload)
        elif self.peer is not None:
            self.peer.sendFrame(b"CMSG " + STP + b"\0" + payload)

    def logStats(self):
        log.info("sbus-link stats: {stats}", stats=json.dumps(self.stats(), separators=(",", ":")))

    # -- the local bus

    def busUnreachable(self, what: str):
        """`what`: the failure in one line (full address and why); logged once per error."""
        log.warn("sbus-link: cannot connect to the bus at {what}; retrying quietly with back-off",
                 what=what)

    def busUp(self, proto: LocalProtocol):
        whoami = proto.credentials
        if parse_whoami(whoami or b"") is None:
            log.error("sbus-link: the bus answered whoami with {w!r}; disconnecting", w=whoami)
            proto.transport.abortConnection()
            return
        self.bus_connects += 1
        self.local = proto
        self._bus_marks.clear()
        changed = whoami != self.whoami
        self.whoami = whoami
        self._own_secret = whoami + b"/"
        # Our own secret space: the keys other clients use to reach the peer's clients.
        proto.subscribe(self._own_secret)
        proto.transport.registerProducer(_Pauser(self._pausePeer, self._resumePeer), True)
        if self._local_paused:
            proto.transport.pauseProducing()
        log.info("sbus-link: connected to bus {bus} as {who}", bus=self.bus_address, who=_show(whoami))
        # the server's -u list, if its statistics name it (a unix peer is judged by modes and it)
        self.admission.ask(proto)
        if self.listen and self.server.parent is None:
            # Once it has answered: a unix peer of another uid that came before would be refused
            # ("its -u list is not known to us"), as at a relay's start.
            self.admission.whenSettled(lambda: self._listenNow() if self.server.parent is None else None)
        self.tree.port_up(BUS_PORT, whoami)
        self._bus_ready = False
        proto.sync().addCallbacks(lambda _: self._busReady(proto), lambda f: None)
        if changed:
            for conn in self.conns:
                if conn.auth is None or conn.auth.done:  # mid-handshake: its hello follows the proof
                    conn.sendFrame(self._hello())

    def sessionClaimed(self, reply: codec.SessionReply) -> None:
        """The bus's answer to our session claim (`ReconnectingClient.holdSession`, sent on each
        bus connection after the subscriptions). ``resumed``: the process before us (or our own
        previous connection to the bus) died, and the bus counted MISSED messages of ours since,
        GAP seconds ago: lost."""
        name, state, missed, gap, linger = reply.name, reply.state, reply.missed, reply.gap, reply.linger
        if missed < 0 or not (math.isfinite(gap) and math.isfinite(linger)):
            log.warn("sbus-link: the bus answered our session claim with {r!r}; ignored", r=reply)
            return
        first = self.bus_connects == 1
        self.session.update(state=state, linger=linger)
        if state == "resumed":
            reason = "restart" if first else "bus_down"
            self.drops[reason] += missed
            self.session.update(missed=self.session.get("missed", 0) + missed, gap=round(gap, 3),
                                reason=reason)
            who = "the previous sbus-link process" if first else "our previous bus connection"
            log.warn("sbus-link: resumed session {name}: {n} message(s) published on our bus while "
                     "{who} was down are lost ({reason}), gap {gap:.3f} s{carried}", name=_show(name), n=missed,
                     who=who, reason=reason, gap=gap, carried=carried_note(reply))
            self.bus.confirmSession()
            if first and self.peer is not None:
                self._standingByBefore(self.peer)
        elif state == "new":
            log.info("sbus-link: holding session {name} on the bus (lingers {linger:g} s after a crash)",
                     name=_show(name), linger=linger)
        elif state == "busy":
            log.warn("sbus-link: another process of our uid holds session {name} on the bus (two links "
                     "with the same endpoint? give each its own --session); a restart of this process "
                     "is not counted", name=_show(name))
        else:
            log.warn("sbus-link: the bus refused our session {name} ({state}; its log says why); a "
                     "restart of this process is not counted", name=_show(name), state=state[:40])

    def _standingByBefore(self, peer: PeerProtocol) -> None:
        """The peer said the link stood by when its connection to the process before us went
        down: another path carried what our bus published meanwhile, it is not lost."""
        missed = self.session.get("missed", 0) if self.session.get("reason") == "restart" else 0
        if peer.carried_before is not False or not missed or self.restart_standing_by:
            return
        self.drops.pop("restart", None)
        self.restart_standing_by = missed
        log.info("sbus-link: the link stood by when the process before us died: the {n} message(s) "
                 "of its gap went another way (not lost)", n=missed)

    def _listenNow(self):
        """Open the --listen port (the first time the bus answers); a port that cannot be
        opened is fatal: one log line, exit status 1."""
        self.server.setServiceParent(self)  # (started at once: we are running)

    def _cannotListen(self, failure) -> None:
        log.critical("sbus-link: cannot listen on {where}: {why}; exiting", where=self.listen, why=failure.value)
        stop_with_status(self.reactor, 1)

    def _busReady(self, proto) -> None:
        if proto is self.local:
            self._bus_ready = True
            self._announceSession()
            if self.peer is not None:
                self.watchFrom(self.peer)
            self._noteWatched()

    def _noteWatched(self) -> None:
        peer = self.peer
        if peer is not None and not peer.watch_noted and self._watched(peer):
            peer.watch_noted = True
            log.info("sbus-link: watching the peer's stream and our bus: if this link takes over, it "
                     "publishes what another path had not delivered")

    def busDown(self, reason):
        self.local = None
        self.held_copies = None   # the late copies were routed to the connection that went
        self._bus_marks.clear()
        self._bus_ready = False
        if self.peer is not None:   # what waited in the lost connection's queue: as before, ours
            self.acknowledge(self.peer)
        self._resetWindows()
        self.tree.port_down(BUS_PORT)
        if self._peer_paused:
            self._resumePeer()
        if self.running:
            log.warn("sbus-link: lost bus {bus} ({why}); reconnecting", bus=self.bus_address, why=reason)

    def _pausePeer(self):
        self._peer_paused = True
        self.tree.paused(PEER_PORT, True)
        if self.peer is not None:
            self.peer.transport.pauseProducing()

    def _resumePeer(self):
        self._peer_paused = False
        self.tree.paused(PEER_PORT, False)
        if self.peer is not None:
            self.peer.transport.resumeProducing()

    def _pauseLocal(self, why: str = "buffer"):
        first = not self._local_holds
        self._local_holds.add(why)
        if not first:
            return
        self._local_paused = True
        self.tree.paused(BUS_PORT, True)
        if self.local is not None:
            self.local.transport.pauseProducing()

    def _resumeLocal(self, why: str = "buffer"):
        self._local_holds.discard(why)
        if self._local_holds:
            return
        self._local_paused = False
        self.tree.paused(BUS_PORT, False)
        if self.local is not None:
            self.local.transport.resumeProducing()

    def fromLocal(self, key: bytes, packet: bytes, end: int) -> None:
        own = self._own_secret
        if key.startswith(SECRET_ROOT):
            if own is None or not key.startswith(own):
                self.drops["foreign_secret"] += 1
                return
            rest = key[len(own):]
            if self.tree.owns(BUS_PORT, key):
                self.tree.received(BUS_PORT, key, packet[end + 1:])
                return  # the spanning tree's own keys: never carried across
            if rest == WHOAMI_REQUEST:
                # <link>/sbus-link/whoami: only this process receives it (a secret key of ours)
                self._answerChallenge(packet[end + 1:])
                return
            if not rest.startswith(SECRET_ROOT):
                self.drops["bad_mapped_key"] += 1
                return
            # <link>/W/x here is W/x on the peer's bus.
            packet = b"MSG " + packet[4 + len(own):]
        elif key == WHOAMI_REQUEST:
            self._answerWhoami(packet[end + 1:])
            return
        elif key == SESSION_ANNOUNCE:
            self._sessionAnnounced(packet[end + 1:])
            return  # never carried across: each bus's halves are its own
        elif key.startswith(TOPOLOGY):
            self.tree.received(BUS_PORT, key, packet[end + 1:])
            return  # never carried across: each segment's hellos are its own
        elif key == STATS_REQUEST:
            answer = self.responder.answer(packet[end + 1:], self.whoami)
            if answer is not None and self.local is not None:
                self.local.sendPacket(answer)
            return
        elif not self.export_all:
            for p in self.patterns:
                if matches(p, key):
                    break
            else:
                return
        peer = self.peer
        if peer is None:
            self.drops["peer_down"] += 1
            return
        public = not key.startswith(SECRET_ROOT)
        copy = False
        if public and self._receiving != CARRYING and self._watched(peer):
            # possibly another path's copy of something from the peer's bus (our window)
            paired = self.window.delivered[PEER] + self.unsettled.delivered[PEER]
            self.window.seen_on(BUS, key, packet[end + 1:], ())
            if len(self.unsettled) or not peer.settled:
                if self.window.delivered[PEER] > self._delivered_at_watch:
                    self._resetUnsettled()   # another path went past them (`_unsettledOut`)
                else:
                    self.unsettled.seen_on(BUS, key, packet[end + 1:], ())
            copy = self.window.delivered[PEER] + self.unsettled.delivered[PEER] > paired
        if not self.tree.forwarding:
            self.standby["to_remote"] += 1
            if public and peer.acks:
                # the peer watches what we do not carry (its window of this direction)
                shadow = b"CMSG " + SEEN + b"\0" + packet[4:]
                if len(shadow) <= peer.remote_max:
                    peer.sendString(shadow)
            return
        if copy:
            # we forward, our receiving direction still catching up: it paired with what the peer
            # streamed, a copy another path (a dead half's writes our bus read late, during the
            # takeover's wait) delivered of a message from the peer's bus: never back there
            self.old_path_copies += 1
            return
        held = self.held_copies
        if held is not None:
            if held.take(packet):
                self.old_path_copies += 1   # its original came from the peer's bus: never back
                return
            if not held:
                self.held_copies = None   # expired: a packet like one of them is its own again
        self._toPeer(peer, packet)

    def _toPeer(self, peer: PeerProtocol, packet: bytes) -> None:
        if len(packet) > peer.remote_max:
            self.drops["too_large_for_peer"] += 1
            return
        peer.sendString(packet)
        peer.msgs_sent += 1
        peer.bytes_sent += len(packet)
        self.to_remote += 1
        if not peer.msgs_sent % _MARK_EVERY:
            peer.marks.append((peer.msgs_sent, peer.bytes_sent))
        if (peer.acks and (peer.msgs_sent - peer.acked >= MAX_UNACKED
                           or peer.bytes_sent - peer.bytes_acked >= MAX_UNACKED_BYTES)
                and peer.msgs_in == peer.ack_sent and "acks" not in self._local_holds):
            # the rest waits in our bus's server, which counts it; not while we owe the peer
            # acknowledgements (ours wait only for our queue toward our bus: never held long)
            self._pauseLocal("acks")

    def _replyKey(self, asker: bytes) -> bytes | None:
        if parse_whoami(asker) is None or self.local is None:
            return None
        key = asker + _WHOAMI_REPLY_SUFFIX
        try:
            check_key(key)
        except CredentialError:
            return None
        return key

    def _answerWhoami(self, asker: bytes) -> None:
        """Discovery: tell the asker this link's whoami (anyone can forge this; see the challenge)."""
        key = self._replyKey(asker)
        if key is None:
            self.drops["bad_whoami_request"] += 1
            return
        self.local.sendPacket(b"MSG " + key + b"\0" + WHOAMI_LINK + b"\0" + self.whoami)

    def _announceSession(self) -> None:
        """Tell the other links' halves on our bus our session's name (`SESSION_ANNOUNCE`)."""
        if self.local is not None and self.whoami is not None:
            self.local.sendPacket(b"MSG " + SESSION_ANNOUNCE + b"\0" + self.whoami + b"\0" + self.session_name)

    def _sessionAnnounced(self, payload: bytes) -> None:
        """Another half on our bus said its session's name: remember it (a takeover asks whether
        it is closing) and, a newcomer, tell it ours. Anyone may publish this: a forged name
        costs a takeover at most `takeover_wait` (and only a closing session of our uid)."""
        who, nul, name = payload.partition(b"\0")
        try:
            codec.check_session_name(name)
        except ValueError:
            name = b""
        if not nul or not name or parse_whoami(who) is None or who == self.whoami:
            return      # malformed: ignored (not a message of anyone's, nothing lost)
        new = who not in self.bus_sessions
        self.bus_sessions.pop(who, None)
        self.bus_sessions[who] = name
        while len(self.bus_sessions) > MAX_BUS_SESSIONS:
            del self.bus_sessions[next(iter(self.bus_sessions))]
        if new:
            self._announceSession()

    def _answerChallenge(self, request: bytes) -> None:
        """``<asker whoami>\\0<nonce>`` on our secret key: the answer carries the nonce back.

        Only this process could read the nonce, so an answer with it came from
        here: a forged answer (anyone may publish on the asker's key) lacks it.
        """
        asker, _, nonce = request.partition(b"\0")
        key = self._replyKey(asker)
        if key is None or not 8 <= len(nonce) <= 128 or b"\0" in nonce:
            self.drops["bad_whoami_request"] += 1
            return
        peer = self.peer
        remote = peer.remote_whoami if peer is not None else None
        answer = remote + b"/" + asker if remote else b""
        self.local.sendPacket(b"MSG " + key + b"\0" + WHOAMI_ANSWER + b"\0" + nonce + b"\0" + answer)
        self.whoami_answers += 1

    # -- the peer

    def _hello(self) -> bytes:
        body = {"version": VERSION, "whoami": _show(self.whoami) if self.whoami else None,
                "max_packet": self.max_packet, "ack": True,
                "patterns": [p.decode("utf-8", "surrogateescape") for p in self.patterns]}
        if self.carried_before is not None:
            body["carried_before"] = self.carried_before
        return b"CMSG " + HELLO + b"\0" + json.dumps(body).encode()

    def peerConnected(self, peer: PeerProtocol):
        log.info("sbus-link: connection from/to {peer}", peer=peer.name)
        sock = peer.transport.getHandle() if hasattr(peer.transport, "getHandle") else None
        if isinstance(sock, socket.socket) and sock.family == socket.AF_UNIX and \
                self.admission.admit_transport(peer.transport, peer.name) is not None:
            self.drops["peer_refused"] += 1  # a unix peer the bus would not admit (one line logged)
            peer.transport.abortConnection()
            return
        self.conns.add(peer)
        if self.key is not None:
            # until it proves the key, a peer gets no more than the handshake's small frames
            peer.MAX_LENGTH = PREAUTH_MAX_LENGTH
            peer.auth = Handshake(self.key, self.role)
            peer.sendFrame(peer.auth.opening())
            peer.auth_timer = self.reactor.callLater(AUTH_TIMEOUT, self._authTimeout, peer)
        else:
            peer.sendFrame(self._hello())

    def _authTimeout(self, peer: PeerProtocol):
        peer.auth_timer = None
        if peer.auth is not None and not peer.auth.done:
            self._peerError(peer, f"not authenticated within {AUTH_TIMEOUT:.0f}s")

    def _authFrame(self, peer: PeerProtocol, frame: bytes):
        """A frame before the peer proved it holds the key: only link/auth and link/proof."""
        try:
            if frame[:5] != b"CMSG ":
                raise AuthError(f"{frame[:12]!r} before authentication")
            key = codec.classify(frame, self.max_packet)[1]
            if key == PING:
                return None
            payload = frame[5 + len(key) + 1:] if len(frame) > 5 + len(key) else None
            replies = peer.auth.receive(key, payload)
        except (AuthError, codec.ProtocolError) as e:
            self.drops["peer_auth_failed"] += 1
            # closed, not aborted: the peer still reads our proof and can tell its operator
            # "wrong key" (an abort's RST could discard it first: "connection lost" only)
            log.warn("sbus-link: protocol error from peer {peer}: authentication failed: {detail}; closing",
                     peer=peer.name, detail=e)
            peer.transport.loseConnection()
            return None
        for reply in replies:
            peer.sendFrame(reply)
        if peer.auth.done:
            peer.MAX_LENGTH = self.max_packet
            if peer.auth_timer is not None and peer.auth_timer.active():
                peer.auth_timer.cancel()
            peer.auth_timer = None
            log.info("sbus-link: {peer} proved it holds the shared key", peer=peer.name)
            peer.sendFrame(self._hello())
        return None

    def peerLost(self, peer: PeerProtocol, reason):
        why = reason.getErrorMessage() if hasattr(reason, "getErrorMessage") else reason
        self.conns.discard(peer)
        for d, timer in peer.syncs.values():
            if timer.active():
                timer.cancel()
            d.errback(ConnectionError("the link went down"))
        peer.syncs.clear()
        if peer is self.peer:
            self.carried_before = bool(self.tree.forwarding and peer.remote_forwarding)
            self.peer = None
            self._resetWindows()
            self._receiving = STANDBY
            # What we sent that the peer had not said it handled: lost, unless it published it
            # in its last round trip (so counted at most one round trip's worth too many).
            in_flight = peer.msgs_sent - peer.acked if peer.acks else 0
            if in_flight > 0:
                self.drops["in_flight"] += in_flight
            self._bus_marks.clear()   # counted here: handed on, for our session on the bus
            if self.local is not None:
                self.bus.acknowledgeSession()
            self.tree.port_down(PEER_PORT)
            if self._local_paused:
                self._local_holds.clear()
                self._resumeLocal()
            log.warn("sbus-link: link to {peer} down ({why}); {n} message(s) sent it had not confirmed "
                     "(counted lost: in_flight); local messages are dropped until it is back",
                     peer=peer.name, why=why, n=in_flight)
        else:
            log.warn("sbus-link: connection {peer} closed before the link was up ({why})", peer=peer.name, why=why)

    def _activate(self, peer: PeerProtocol):
        old = self.peer
        if old is peer:
            return
        if old is not None:
            log.warn("sbus-link: {new} replaces the link to {old}", new=peer.name, old=old.name)
            self.peer = None
            self._bus_marks.clear()   # (counts of the old peer's messages)
            old.transport.abortConnection()
        if old is not None:
            self.tree.port_down(PEER_PORT)
        self.peer = peer
        self.peer_connects += 1
        if "acks" in self._local_holds:   # held for the old peer's acknowledgements
            self._resumeLocal("acks")
        peer.ready = True
        self.tree.port_up(PEER_PORT)
        peer.transport.registerProducer(_Pauser(self._pauseLocal, self._resumeLocal), True)
        if self._peer_paused:
            peer.transport.pauseProducing()
        self._resetWindows()
        self._receiving = STANDBY
        self.watchFrom(peer)
        self._sendState(peer)
        self._update()
        # the peer may not be on its own bus yet: its name there comes later ("is now")
        theirs = (f"{_show(peer.remote_whoami)}/<our whoami>" if peer.remote_whoami else
                  "not known yet (the peer is not on its bus yet; it says when it is)")
        log.info("sbus-link: link up with {peer}; its clients appear here as {mine}/<their whoami>, "
                 "ours there as {theirs}", peer=peer.name, mine=_show(self.whoami), theirs=theirs)

    def fromPeer(self, peer: PeerProtocol, frame: bytes) -> None:
        if getattr(peer.transport, "disconnecting", False):
            return None  # frames after the one we closed for, in the same read
        if peer.auth is not None and not peer.auth.done:
            return self._authFrame(peer, frame)
        if frame[:4] == b"MSG " and peer.ready:
            peer.msgs_in += 1
            end = frame.find(b"\0", 4)
            if end < 0:
                return self._peerError(peer, "MSG without a NUL")
            key = frame[4:end]
            if b"!" in key:
                try:
                    check_key(key)
                except CredentialError as e:
                    self.drops["invalid_key"] += 1
                    if "invalid_key" not in self._warned:
                        self._warned.add("invalid_key")
                        log.warn("sbus-link: dropping a message from {peer}: {err}", peer=peer.name, err=e)
                    return None
            local = self.local
            if local is None:
                self.drops["bus_down"] += 1
                return None
            if key.startswith(TOPOLOGY):
                self.drops["reserved_key"] += 1
                return None
            if self._receiving != CARRYING:
                self.standby["from_remote"] += 1
                self._intoWindow(peer, key, frame[end + 1:])
                return None
            out = local.transport
            before = out.packets_out + out.queued()   # the frames before it: out once this is
            out.write(frame)
            if out.queued() and peer.acks:
                peer.unhanded.append((peer.msgs_in - 1, before))
            self.from_remote += 1
            return None
        if frame[:5] == b"CMSG ":
            try:
                kind, key = codec.classify(frame, self.max_packet)
            except codec.ProtocolError as e:
                return self._peerError(peer, str(e))
            if key == PING:
                return None
            if key == STP:
                self.tree.received(PEER_PORT, HELLO_KEY, frame[len(b"CMSG " + STP) + 1:])
                return None
            body = frame[5 + len(key) + 1:]
            if key == ACK and peer.ready:
                return self._acked(peer, body)
            if key == STATE and peer.ready:
                return self._peerState(peer, body)
            if key == SYNC and peer.ready:
                return self._syncRequested(peer, body)
            if key == SYNCED and peer.ready:
                return self._synced(peer, body)
            if key == SEEN and peer.ready:
                seen_key, nul, payload = body.partition(b"\0")
                if not nul:
                    return self._peerError(peer, "link/seen without a NUL")
                if self.local is not None:
                    self._intoWindow(peer, seen_key, payload)
                return None
            if key == HELLO:
                return self._hello_received(peer, frame[len(b"CMSG " + HELLO) + 1:])
            return None  # unknown control: ignored, for later versions
        if frame[:4] == b"MSG ":
            return self._peerError(peer, "MSG before hello")
        return self._peerError(peer, f"unexpected frame {frame[:12]!r}")

    def _hello_received(self, peer: PeerProtocol, body: bytes):
        try:
            hello = json.loads(body)
            version = int(hello.get("version", 0))
            remote_max = int(hello.get("max_packet", MAX_PACKET))
            whoami = hello.get("whoami")
        except (ValueError, TypeError, AttributeError) as e:
            return self._peerError(peer, f"bad hello: {e}")
        if version != VERSION:
            return self._peerError(peer, f"unsupported link protocol version {version}")
        if whoami is not None:
            whoami = whoami.encode()
            if parse_whoami(whoami) is None:
                return self._peerError(peer, f"bad whoami in hello: {whoami!r}")
        peer.remote_max = remote_max
        peer.remote_whoami = whoami
        peer.acks = hello.get("ack") is True
        patterns = hello.get("patterns")
        if isinstance(patterns, list) and all(isinstance(p, str) for p in patterns):
            peer.remote_patterns = [p.encode("utf-8", "surrogateescape") for p in patterns]
        if isinstance(hello.get("carried_before"), bool):
            peer.carried_before = hello["carried_before"]
            self._standingByBefore(peer)
        if not peer.ready:
            self._activate(peer)
        elif whoami is not None:
            log.info("sbus-link: peer {peer} is now {who} on its bus", peer=peer.name, who=_show(whoami))
        return None

    # -- acknowledgements: what the peer handled, so that a dead peer's share is counted

    def acknowledge(self, peer: PeerProtocol) -> None:
        """Tell the peer how many of its messages we handled, once all we published of them has
        left this process for our bus's socket: the bus reads a socket to its end, a killed
        writer's too, so a ``kill -9`` of ours loses none of them, and the peer counts exactly
        what we never handed on (``in_flight``). Waiting for our bus's answer to a round trip
        instead, a half stopped and killed under load had published the last one or two round
        trips' worth and they were counted lost too (119 of 8,000 over: issue 34)."""
        if peer is not self.peer or not peer.acks:
            return
        local = self.local
        if local is None:       # dropped as bus_down (counted here): handled
            peer.unhanded.clear()
            self._sendAck(peer, peer.msgs_in)
            return
        queued = local.transport.queued()
        if queued and (not peer.unhanded or peer.unhanded[-1][0] != peer.msgs_in):
            peer.unhanded.append((peer.msgs_in, local.transport.packets_out + queued))
        self.handedOn(local)

    def handedOn(self, local: LocalProtocol) -> None:
        """Our queue toward the bus moved or emptied (`LocalProtocol.outboxDrained`):
        acknowledge what has left it."""
        peer = self.peer
        if peer is None or local is not self.local or not peer.acks:
            return
        if not local.transport.queued():
            peer.unhanded.clear()
            self._sendAck(peer, peer.msgs_in)
            return
        written, n = local.transport.packets_out, None
        while peer.unhanded and peer.unhanded[0][1] <= written:
            n = peer.unhanded.popleft()[0]
        if n is not None:
            self._sendAck(peer, n)

    def localBatchDone(self, local: LocalProtocol) -> None:
        """A read batch from our bus is handled: once the peer has acknowledged every message of
        it we carried (at once, if we carried none), tell the bus it is handed on
        (`server/session-ack`), so a kill -9 of ours from then on is counted by our session,
        what the bus's kernel held for us and our unacknowledged window too."""
        if local is not self.local:
            return
        peer, read = self.peer, local.transport.packets_in
        if peer is None or peer.msgs_sent == peer.acked:
            self._bus_marks.clear()
            self.bus.acknowledgeSession(read)
        elif peer.acks:
            marks = self._bus_marks
            if marks and marks[-1][0] == peer.msgs_sent:
                marks[-1] = (peer.msgs_sent, read)
            else:
                marks.append((peer.msgs_sent, read))

    def _sendAck(self, peer: PeerProtocol, n: int) -> None:
        if n > peer.ack_sent:
            peer.ack_sent = n
            peer.sendFrame(b"CMSG " + ACK + b"\0%d" % n)

    def _acked(self, peer: PeerProtocol, body: bytes) -> None:
        try:
            n = int(body)
        except ValueError:
            return self._peerError(peer, "bad link/ack")
        if not peer.acked <= n <= peer.msgs_sent:
            return self._peerError(peer, f"link/ack of {n}: sent {peer.msgs_sent}, acknowledged {peer.acked}")
        peer.acked = n
        if peer is self.peer and self._bus_marks and self._bus_marks[0][0] <= n:
            read = None
            while self._bus_marks and self._bus_marks[0][0] <= n:
                read = self._bus_marks.popleft()[1]
            self.bus.acknowledgeSession(read)
        marks = peer.marks
        if n == peer.msgs_sent:
            marks.clear()
            peer.bytes_acked = peer.bytes_sent
        else:
            while marks and marks[0][0] <= n:
                peer.bytes_acked = marks.popleft()[1]   # (at most a mark's worth under: holds longer)
        if ("acks" in self._local_holds and peer is self.peer and peer.msgs_sent - n < MAX_UNACKED
                and peer.bytes_sent - peer.bytes_acked < MAX_UNACKED_BYTES):
            self._resumeLocal("acks")
        return None

    # -- standing by and taking over (sbus.core.standby)

    def _sendState(self, peer: PeerProtocol) -> None:
        body = json.dumps({"forwarding": bool(self.tree.forwarding)}).encode()
        peer.sendFrame(b"CMSG " + STATE + b"\0" + body)

    def _peerState(self, peer: PeerProtocol, body: bytes) -> None:
        try:
            forwarding = json.loads(body)["forwarding"]
        except (ValueError, TypeError, KeyError):
            return self._peerError(peer, "bad link/state")
        if not isinstance(forwarding, bool):
            return self._peerError(peer, "bad link/state")
        peer.remote_forwarding = forwarding
        self._noteWatched()
        self._update()
        return None

    def _forwardingChanged(self, forwarding: bool) -> None:
        peer = self.peer
        if peer is not None and peer.ready:
            self._sendState(peer)
        self._update()

    def _watched(self, peer: PeerProtocol | None) -> bool:
        """Does the window see both sightings of what the peer's bus carries: our bus answered
        a round trip, the peer streams everything (a current peer: MSG or link/seen), and our
        subscriptions cover what it exports?"""
        if peer is None or not self._bus_ready or not peer.acks or peer.remote_patterns is None:
            return False
        return self.export_all or set(peer.remote_patterns) <= set(self.patterns)

    def _intoWindow(self, peer: PeerProtocol, key: bytes, payload: bytes) -> None:
        """A message of the peer's bus that we do not publish now."""
        if b"!" in key or key.startswith(TOPOLOGY) or not self._watched(peer):
            self.unwatched[FROM_REMOTE] += 1
            return
        if peer.settled:
            self.window.seen_on(PEER, key, payload, (key,))
        else:
            self.unsettled.seen_on(PEER, key, payload, (key,))
            self._unsettled_order.append((key, payload))

    def _resetWindows(self) -> None:
        self.window.reset()
        self._resetUnsettled()

    def _resetUnsettled(self) -> None:
        self.unsettled.reset()
        self._unsettled_order.clear()

    def watchFrom(self, peer: PeerProtocol) -> None:
        """Our window begins to watch our bus now (the peer is new, our bus answered again, or we
        stop carrying). Another path's copy of what the peer streams next may have been read
        here already, unwatched: the peer read the original from its bus before we began, we
        read the copy before (a restarted peer half read messages a moment after its link came
        up whose copies reached us before its hello did: published again at the next takeover,
        they arrived twice). What the peer streams until it answers a `link/sync` sent now waits
        in `unsettled` (see `_unsettledOut`); what follows the answer it read from its bus after
        our request, published after we began to watch: its copy, if any, is still to come."""
        if not peer.acks:
            return      # an older peer: never watched
        peer.settled = False
        n = peer.settle_sync = peer.next_sync
        self._delivered_at_watch = self.window.delivered[PEER]

        def settled(_):
            if peer.settle_sync == n:
                peer.settled = True

        self._peerSync(peer).addCallbacks(settled, lambda f: None)

    def _update(self) -> None:
        """Does this link carry our receiving direction now? It does while both halves forward.
        When it starts to, it first publishes what the window holds (after round trips through
        both buses: then every copy another path made has met its original)."""
        peer = self.peer
        carried = bool(self.tree.forwarding and peer is not None and peer.ready
                       and peer.remote_forwarding is not False)
        if not carried:
            if self._receiving == CARRYING and peer is not None and peer.ready:
                self.watchFrom(peer)   # our bus was not watched while we carried
            self._receiving = STANDBY   # catching up: the window stays as it is
            return
        if self._receiving != STANDBY:
            return
        if peer.remote_forwarding is None or not self._watched(peer) or self.local is None:
            self._resetWindows()        # nothing watched: carry from now on
            self._receiving = CARRYING
            return
        self._receiving = CATCHING_UP
        self._takeovers += 1
        self._awaitRelease(self._takeovers, self.reactor.seconds() + self.takeover_wait, False)

    def _awaitRelease(self, generation: int, deadline: float, waited: bool) -> None:
        """One round of the takeover's wait: is the session of another link's half on our bus
        (`bus_sessions`) still ``closing`` (`codec.SESSION_HELD`: that half is dead, but our bus
        has not read all it wrote, e.g. held paused by a hard/block subscriber)? Its writes are
        copies of what our window holds: published before our bus routes them, they arrive
        twice, and once routed to us too we would send them back to the peer's bus. Ask again
        in `RELEASE_POLL` s until none is closing or `deadline` passed, then the round trips
        (`_catchUp`). A server that does not know the request answers the round trip first."""
        self._release = None
        if generation != self._takeovers or self._receiving != CATCHING_UP:
            return
        local = self.local
        names = [name for name in dict.fromkeys(self.bus_sessions.values()) if name != self.session_name]
        if local is None or not names:
            self._catchUp(generation, ())
            return
        try:
            done = held_states({name: (local, name) for name in names})
        except Exception as e:  # noqa: BLE001 - the bus went away
            self._takeoverFailed(generation, e)
            return

        def answered(states):
            if generation != self._takeovers or self._receiving != CATCHING_UP:
                return
            closing = sorted(name for name, state in states.items() if state == codec.HELD_CLOSING)
            if closing and self.reactor.seconds() < deadline:
                if not waited:
                    log.info("sbus-link: taking over: our bus's server has not yet read what a dead link "
                             "half wrote to it (session {names} closing); waiting up to {s:g} s for it",
                             names=", ".join(_show(n) for n in closing), s=self.takeover_wait)
                self._release = self.reactor.callLater(RELEASE_POLL, self._awaitRelease, generation,
                                                       deadline, True)
                return
            if closing:
                log.warn("sbus-link: taking over: our bus still holds what a dead link half wrote to it "
                         "unread after {s:g} s (session {names} closing); publishing the window now: "
                         "messages it wrote there may arrive twice", s=self.takeover_wait,
                         names=", ".join(_show(n) for n in closing))
            self._catchUp(generation, closing)

        done.addCallbacks(answered, lambda f: self._takeoverFailed(generation, f))

    def _catchUp(self, generation: int, closing) -> None:
        """A round trip through our bus and, with ``link/sync``, through the peer's: then every
        copy another path made has met its original in the window, which goes out (`_replay`)."""
        peer, local = self.peer, self.local
        if peer is None or local is None:
            self._takeoverFailed(generation, ConnectionError("the bus or the peer went away"))
            return

        def caught_up(_):
            if generation == self._takeovers and self._receiving == CATCHING_UP:
                self._receiving = CARRYING
                self._replay(bool(closing))

        defer.gatherResults([local.sync(), self._peerSync(peer)], consumeErrors=True).addCallbacks(
            caught_up, lambda f: self._takeoverFailed(generation, f))

    def _takeoverFailed(self, generation: int, why) -> None:
        if generation != self._takeovers or self._receiving != CATCHING_UP:
            return
        self._receiving = STANDBY
        out = self._unsettledOut() + self.window.drain()
        self.takeover_lost += len(out)
        log.warn("sbus-link: taking over failed ({why}): {n} message(s) the old path had not "
                 "delivered are lost (failover_gap)",
                 why=why.getErrorMessage() if hasattr(why, "getErrorMessage") else why, n=len(out))

    def _peerSync(self, peer: PeerProtocol) -> defer.Deferred:
        """Fires once the peer's bus answered a round trip after this request: everything the
        peer read from its bus before then is ahead of the answer in its stream."""
        n = peer.next_sync
        peer.next_sync += 1
        d = defer.Deferred()

        def expired():
            entry = peer.syncs.pop(n, None)
            if entry is not None:
                entry[0].errback(TimeoutError(f"the peer did not answer link/sync in {SYNC_TIMEOUT:.0f}s"))

        peer.syncs[n] = (d, self.reactor.callLater(SYNC_TIMEOUT, expired))
        peer.sendFrame(b"CMSG " + SYNC + b"\0%d" % n)
        return d

    def _syncRequested(self, peer: PeerProtocol, body: bytes) -> None:
        answer = b"CMSG " + SYNCED + b"\0" + body[:20]
        if self.local is None:
            peer.sendFrame(answer)
            return
        self.local.sync().addBoth(lambda _: peer.sendFrame(answer))

    def _synced(self, peer: PeerProtocol, body: bytes) -> None:
        try:
            entry = peer.syncs.pop(int(body), None)
        except ValueError:
            entry = None
        if entry is not None:
            d, timer = entry
            if timer.active():
                timer.cancel()
            d.callback(None)

    def _unsettledOut(self) -> list:
        """At a takeover, what of `unsettled` to publish. Another path delivers in order, and
        its copies of what it delivered before our watch began were not seen here: what waits
        before the last message it was seen delivering went past it (delivered before we
        watched, or skipped), what waits after it is the other path's to deliver still: ours
        now. If it delivered something the peer streamed after it settled, it went past all
        (`fromLocal` forgot them). If it delivered none of them: all (no other path, or it was
        gone; the one case left that repeats messages: another path that delivered some just
        before our watch began and stopped exactly then)."""
        out = self.unsettled.drain()
        order = self._unsettled_order
        if out and self.window.delivered[PEER] > self._delivered_at_watch:
            out = []
        tail = 0            # how many of `out` follow the last one delivered, in `order`
        for key, payload in reversed(order):
            if tail == len(out) or out[-1 - tail][1:] != (key, payload):
                break       # delivered by the other path
            tail += 1
        self._resetUnsettled()
        return out[len(out) - tail:]

    def _replay(self, held: bool = False) -> None:
        """Publish the window. `held`: our bus still holds a dead half's writes unread (the wait
        ran out): their late copies, routed to us too, we recognise (`held_copies`, for
        `HELD_COPIES_AGE` or `takeover_wait`, the longer) and never send back to the peer's
        bus; our bus's subscribers may get them twice, as the warning said."""
        pending = self._unsettledOut()
        self.unsettled_replayed += len(pending)
        out = pending + self.window.drain()
        local = self.local
        copies = None
        if held and local is not None:
            # a packet like one of them that a client of our bus publishes meanwhile is taken
            # for a copy (not carried)
            copies = self.held_copies = RecentPackets(max_items=max(1, len(out)),
                                                      max_age=max(self.takeover_wait, HELD_COPIES_AGE))
        for _, key, payload in out:
            if local is None:
                self.drops["bus_down"] += 1
                continue
            # counted in standby.replayed_at_takeover (already in standby_not_forwarded), not
            # again in from_remote: the peer's to_remote = our from_remote + standby_not_forwarded
            packet = b"MSG " + key + b"\0" + payload
            local.transport.write(packet)
            if copies is not None:
                copies.add(packet)
        log.info("sbus-link: taking over: published {n} message(s) from the peer's bus that the "
                 "old path had not delivered; failover gap {gap}", n=len(out), gap=self.window.last_gap[PEER])

    def _peerError(self, peer: PeerProtocol, detail: str):
        log.warn("sbus-link: protocol error from peer {peer}: {detail}; closing", peer=peer.name, detail=detail)
        peer.transport.abortConnection()


def makeService(options: Options) -> Link:
    try:
        return Link(
            options["bus"], listen=options["listen"], connect=options["connect"],
            patterns=options["patterns"], max_packet=options["max-packet"],
            initialDelay=options["initial-delay"], maxDelay=options["max-delay"],
            keepalive=options["keepalive"], statsInterval=options["stats-interval"],
            key_file=options["key-file"],
            spanning_tree=not options["no-spanning-tree"],
            trusted_uids=options["trust-uids"], standby_window=options["standby-window"],
            session=options["session"], session_linger=options["session-linger"],
            takeover_wait=options["takeover-wait"],
        )
    except EndpointError as e:
        raise usage.UsageError(str(e)) from None
    except Exception as e:  # unreadable or malformed certificate files, bad endpoint arguments
        raise usage.UsageError(f"{'--listen' if options['listen'] else '--connect'}: {e}") from None
