"""The bus as a Twisted service: one listening socket, one broker factory.

Used by ``twistd sbus`` (`sbus.server.tap`) and by ``sbusd``. The socket is
opened in `privilegedStartService` (so ``twistd --uid`` can bind a path in a
directory only root may write, then drop privileges), or handed over ready
made as ``listener=`` (``sbusd`` opens it before it forks and before it
imports the reactor).
"""

from __future__ import annotations

import resource
from typing import Callable

from twisted.application import service
from twisted.internet import defer
from twisted.logger import Logger

from sbus.server.address import Listener, open_listener
from sbus.interfaces import IBus, ILeanReactor
from sbus.server.config import ServerConfig
from zope.interface import implementer


def raise_descriptor_limit(warn) -> int:
    """Take the hard RLIMIT_NOFILE as the soft one: a bus holds a descriptor per client, and
    the inherited soft limit (often 1024) is below the per-uid connection limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError) as e:
            warn(f"cannot raise the descriptor limit from {soft} to {hard}: {e}")
    return soft


@implementer(IBus)
class BusService(service.Service):
    """Listen on `address` and serve the bus there.

    `mode` is the socket file's mode (path addresses only), `reuse` removes
    an existing socket file first, `on_empty` is called when the last client
    has gone (after at least one came). `warn` receives one-line warnings
    from the address code (default: logged).
    """

    log = Logger()

    def __init__(
        self,
        address: str,
        config: ServerConfig,
        mode: int = 0o700,
        reuse: bool = False,
        on_empty: Callable[[], None] | None = None,
        *,
        listener: Listener | None = None,
        warn: Callable[[str], None] | None = None,
        reactor=None,
    ):
        self.address = address
        self.config = config
        self.mode = mode
        self.reuse = reuse
        self.on_empty = on_empty
        self.listener = listener
        self.warn = warn
        self.reactor = reactor
        self.factory = None
        self.port = None

    @property
    def printed_address(self) -> str | None:
        """``/dev/unix/abstract/<hex>`` when we bound a random abstract address."""
        return self.listener.printed_address if self.listener is not None else None

    def _warn(self, text: str) -> None:
        if self.warn is not None:
            self.warn(text)
        else:
            self.log.warn("{text}", text=text)

    def open(self) -> None:
        """Open the listening socket now (raise `AddressError`, one line) rather than when the
        service starts: ``twistd sbus`` does it in makeService, before twistd daemonises, so
        that a failure reaches the user as one line (see `sbus.options.SbusServiceMaker`)."""
        raise_descriptor_limit(self._warn)
        if self.listener is None:
            self.listener = open_listener(self.address, self.mode, self.reuse, warn=self._warn)

    def _open(self) -> None:
        self.open()
        if self.port is not None:
            return
        from sbus.server.broker import BrokerFactory
        from sbus.seqpacket import SeqPacketPort

        try:
            self.factory = BrokerFactory(self.config, self.on_empty, reactor=self.reactor)
            self.port = SeqPacketPort(self.listener.sock, self.factory, self.reactor)
            self.port.startListening()
        except BaseException:
            self.port = None
            self.listener.cleanup()
            self.listener.sock.close()
            raise
        if self.config.busy_poll > 0 and not ILeanReactor.providedBy(self.port.reactor):
            self.log.info("busy polling is off: it needs the sbus reactor (--reactor=sbus), "
                          "not {reactor}", reactor=type(self.port.reactor).__name__)
        uids = self.config.allowed_uids
        self.log.info(
            "sbus listening on {where}{who}",
            where=self.listener.description,
            who="" if uids is None else " (uids " + ",".join(map(str, sorted(uids))) + ")",
        )

    def privilegedStartService(self) -> None:
        self._open()
        service.Service.privilegedStartService(self)

    def startService(self) -> None:
        self._open()
        service.Service.startService(self)
        from sbus.services.shutdown import exit_zero_on_sigterm

        if self.reactor is None:
            from twisted.internet import reactor
        else:
            reactor = self.reactor
        exit_zero_on_sigterm(reactor)

    def stopService(self):
        service.Service.stopService(self)
        port, self.port = self.port, None
        listener = self.listener
        d = defer.maybeDeferred(port.stopListening) if port is not None else defer.succeed(None)

        def cleanup(result):
            if listener is not None:
                listener.cleanup()
            return result

        return d.addBoth(cleanup)
