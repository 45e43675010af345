"""twistd plugin ``sbus-link``: carry a bus between hosts over a stream endpoint (lazy: module named only)."""

from sbus.options import SbusServiceMaker as ServiceMaker  # start-up failures: one line

sbus_link = ServiceMaker(
    "sbus-link",
    "sbus.services.link",
    "Carry an sbus bus to another host over TLS/TCP/unix streams (see docs/relay-link.md)",
    "sbus-link",
)
