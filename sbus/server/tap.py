"""``twistd sbus``: the bus server as a twistd plugin.

    twistd -n sbus --socket /run/user/1000/sbus.socket --user alice --user 1001

Options mirror ``sbusd`` (see `sbus.server.sbusd`) plus the server settings
of `sbus.server.config.ServerConfig`. Every bad value is a
`usage.UsageError` with a one-line message, which twistd prints.
"""

from __future__ import annotations

import os
import re

from twisted.python import usage

from sbus.address import default_address, packet_limit_problem
from sbus.options import METRICS_OPTION, StartupError, positive_float, positive_int
from sbus.server.address import AddressError, parse_address
from sbus.server.sbusd import resolve_user
from sbus.server.config import (
    DEFAULT_BUSY_POLL,
    DEFAULT_MAX_PATTERN_SEGMENTS,
    DEFAULT_MAX_SUBSCRIPTION_BYTES,
    DEFAULT_MAX_SUBSCRIPTIONS,
    DEFAULT_MAX_UID_SUBSCRIPTION_BYTES,
    DEFAULT_MAX_QUEUE_BYTES,
    DEFAULT_MAX_UID_CONNECTIONS,
    DEFAULT_MAX_UID_QUEUE_BYTES,
    DEFAULT_MAX_UID_SUBSCRIPTIONS,
    DEFAULT_QUEUE_BYTES,
    DEFAULT_QUEUE_PACKETS,
    DEFAULT_STALL_TIMEOUT,
    ServerConfig,
    busy_poll_us,
    allowed_uid_set,
)
from sbus.core.codec import MAX_PACKET
from sbus.core.sessions import DEFAULT_MAX_LINGER
from sbus.core.credentials import SECRET_ROOT

#: A credential prefix: empty, or one or more ``!/cred/GID/UID/PID/`` links.
_CRED_PREFIX = re.compile(rb"(?:" + re.escape(SECRET_ROOT) + rb"[0-9]+/[0-9]+/[0-9]+/)*")
MIN_PACKET_LIMIT = 17  # "must be > 16"
MAX_PACKET_LIMIT = 16 * 1024 * 1024


def parse_cred_prefix(text: str | bytes) -> bytes:
    """Validate a credential prefix (empty, or ``!/cred/G/U/P/`` links)."""
    raw = os.fsencode(text)
    if not _CRED_PREFIX.fullmatch(raw):
        raise ValueError(
            f"bad credential prefix {os.fsdecode(raw)!r}: must be empty or "
            "'!/cred/GID/UID/PID/' repeated, ending with '/'"
        )
    return raw


#: Positive integer options, each named like its `ServerConfig` field.
_LIMITS = (
    "queue-bytes", "queue-packets", "max-subscriptions", "max-uid-subscriptions", "max-uid-connections",
    "max-subscription-bytes", "max-uid-subscription-bytes", "max-pattern-segments",
    "max-uid-queue-bytes", "max-queue-bytes",
)


class BusOptions(usage.Options):
    """The options of every bus server (`twistd sbus`, `twistd sbus-relay`)."""

    synopsis = "[options]"
    longdesc = (
        "Run an sbus message bus server on a unix SOCK_SEQPACKET socket. "
        "--socket takes a path, /dev/unix/abstract (random abstract address, logged), "
        "/dev/unix/abstract/HEX, /dev/fd/N (inherited socket) or systemd (socket activation)."
    )

    optFlags = [
        ["reuse", "r", "Also remove an empty file at the socket path (a stale socket is removed "
                       "anyway; a live server's never)."],
        ["log-connections", None, "Log a line per client connect and ordinary disconnect (default: one "
                                  "summary line a minute; a disconnect for a fault is always logged)."],
    ]
    optParameters = [
        METRICS_OPTION,
        ["socket", "s", None,
         "Address: PATH, /dev/unix/abstract[/HEX], /dev/fd/N or systemd (default: $SBUS_SOCKET, "
         "else /run/sbus.socket, where clients look by default)."],
        ["mode", "m", "0700", "Socket file mode, octal (path sockets only)."],
        ["max-packet", None, str(MAX_PACKET), "Largest packet accepted, in bytes (17 .. 16 MiB)."],
        ["queue-bytes", None, str(DEFAULT_QUEUE_BYTES), "Per-client output queue limit, bytes."],
        ["queue-packets", None, str(DEFAULT_QUEUE_PACKETS), "Per-client output queue limit, packets."],
        ["max-uid-queue-bytes", None, str(DEFAULT_MAX_UID_QUEUE_BYTES),
         "Queued bytes all clients of one uid may pin together (then their hard mode applies)."],
        ["max-queue-bytes", None, str(DEFAULT_MAX_QUEUE_BYTES),
         "Queued bytes all clients together may pin (then their hard mode applies)."],
        ["stall-timeout", None, str(DEFAULT_STALL_TIMEOUT),
         "Hold budget: seconds a client in a block mode may hold publishers paused beyond the time "
         "it lets them run; past it, it is disconnected (stalled)."],
        ["max-subscriptions", None, str(DEFAULT_MAX_SUBSCRIPTIONS), "Subscriptions one client may hold."],
        ["max-uid-subscriptions", None, str(DEFAULT_MAX_UID_SUBSCRIPTIONS),
         "Subscriptions all clients of one uid may hold together."],
        ["max-uid-connections", None, str(DEFAULT_MAX_UID_CONNECTIONS), "Connections one uid may hold open."],
        ["max-subscription-bytes", None, str(DEFAULT_MAX_SUBSCRIPTION_BYTES),
         "Estimated memory one client's patterns may pin (bytes + 128 per segment)."],
        ["max-uid-subscription-bytes", None, str(DEFAULT_MAX_UID_SUBSCRIPTION_BYTES),
         "The same for all clients of one uid together."],
        ["max-pattern-segments", None, str(DEFAULT_MAX_PATTERN_SEGMENTS), "'/'-separated segments in one pattern (each '*' counts as one more)."],
        ["max-session-linger", None, str(DEFAULT_MAX_LINGER),
         "Seconds a closed connection's named session (server/session) may keep its patterns, "
         "counting what they match for its successor; 0: sessions never linger."],
        ["busy-poll", None, str(round(DEFAULT_BUSY_POLL * 1e6)),
         "Microseconds to poll for events before sleeping, right after a wait that short "
         "(round trips met awake; up to a core busy while events keep coming that fast); 0: never."],
    ]

    def __init__(self):
        super().__init__()
        self["users"] = []
        self["service-uids"] = []

    def opt_service_uid(self, value: str) -> None:
        """Grant this user (name or uid) of a service that carries other uids' traffic (sbus-nats)
        the view root has of server/interest: every uid's patterns; repeatable."""
        try:
            self["service-uids"].append(resolve_user(value))
        except ValueError as e:
            raise usage.UsageError(f"--service-uid: {e}") from None

    def opt_user(self, value: str) -> None:
        """Allow this user (name or uid); repeatable. Then only they and we may connect."""
        try:
            self["users"].append(resolve_user(value))
        except ValueError as e:
            raise usage.UsageError(f"--user: {e}") from None

    opt_u = opt_user

    def postOptions(self) -> None:
        if not self["socket"]:
            self["socket"] = default_address()
        try:
            parse_address(self["socket"])
        except AddressError as e:
            raise usage.UsageError(f"--socket: {e}") from None
        try:
            mode = int(self["mode"], 8)
        except ValueError:
            raise usage.UsageError(f"--mode: not an octal number: {self['mode']!r}") from None
        if not 0 <= mode <= 0o777:
            raise usage.UsageError(f"--mode: must be between 0 and 0777, got {self['mode']}")
        self["mode"] = mode
        max_packet = positive_int("max-packet", self["max-packet"])
        if not MIN_PACKET_LIMIT <= max_packet <= MAX_PACKET_LIMIT:
            raise usage.UsageError(
                f"--max-packet: must be > 16 and <= {MAX_PACKET_LIMIT}, got {max_packet}"
            )
        problem = packet_limit_problem(max_packet)
        if problem:
            raise usage.UsageError(f"--max-packet: {problem}")
        self["max-packet"] = max_packet
        for name in _LIMITS:
            self[name] = positive_int(name, self[name])
        self["stall-timeout"] = positive_float("stall-timeout", self["stall-timeout"])
        try:
            linger = float(self["max-session-linger"])
        except ValueError:
            linger = -1.0
        if not 0 <= linger < float("inf"):
            raise usage.UsageError(f"--max-session-linger: not a number of seconds >= 0: "
                                   f"{self['max-session-linger']!r}")
        self["max-session-linger"] = linger
        try:
            self["busy-poll"] = busy_poll_us(self["busy-poll"])
        except ValueError as e:
            raise usage.UsageError(str(e)) from None
        # The server's own reactor (sbus.reactor), unless `--reactor` chose one: installed now,
        # as twistd's --reactor does, since `twist` installs its default right after parsing.
        from sbus.reactor import install_unless_chosen

        install_unless_chosen()


class Options(BusOptions):
    """``twistd sbus``: a bus server, which may be given its credential prefix (a relay takes
    its own from its master, so `sbus.services.relay` builds on `BusOptions`)."""

    optParameters = [
        ["cred-prefix", None, "",
         "Credential prefix for whoami replies: empty or '!/cred/G/U/P/' chain."],
    ]

    def postOptions(self) -> None:
        super().postOptions()
        try:
            self["cred-prefix"] = parse_cred_prefix(self["cred-prefix"])
        except ValueError as e:
            raise usage.UsageError(f"--cred-prefix: {e}") from None


def config_from_options(options: BusOptions) -> ServerConfig:
    users = options["users"]
    settings = {name.replace("-", "_"): options[name] for name in ("max-packet", "stall-timeout", "max-session-linger", "busy-poll", *_LIMITS)}
    settings["cred_prefix"] = options.get("cred-prefix", b"")
    settings["log_connections"] = bool(options.get("log-connections"))
    return ServerConfig(allowed_uids=allowed_uid_set(users or None),
                        service_uids=frozenset(options["service-uids"]), **settings)


def makeService(options: Options):
    from sbus.server.service import BusService

    bus = BusService(
        options["socket"],
        config_from_options(options),
        mode=options["mode"],
        reuse=bool(options["reuse"]),
    )
    # Bind now, before twistd daemonises: "another server is listening on PATH", a stale
    # socket's removal or any other address error reaches the user as one line.
    try:
        bus.open()
    except AddressError as e:
        raise StartupError(str(e)) from None
    return bus
