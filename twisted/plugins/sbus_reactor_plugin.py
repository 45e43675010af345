"""twistd reactor plugin ``sbus``: ``twistd --reactor sbus ...`` runs on `sbus.reactor`
(epoll with lean dispatch and busy polling). The ``sbus`` and ``sbus-relay`` plugins install it
themselves when no ``--reactor`` is given; this names it for everything else."""

from twisted.application.reactors import Reactor

sbusReactor = Reactor(
    "sbus", "sbus.reactor",
    "epoll, with busy polling and lean dispatch for an sbus server (Linux)",
)
