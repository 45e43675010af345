"""twistd plugin ``sbus-relay``: a slave sbus server below a master (lazy: module named only)."""

from sbus.options import SbusServiceMaker as ServiceMaker  # start-up failures: one line

sbus_relay = ServiceMaker(
    "sbus-relay",
    "sbus.services.relay",
    "sbus slave server (relay) below a master bus (see docs/relay-link.md)",
    "sbus-relay",
)
