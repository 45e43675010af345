"""twistd plugin ``sbus-nats``: carry a bus over a NATS cluster (lazy: module named only)."""

from sbus.options import SbusServiceMaker as ServiceMaker  # start-up failures: one line

sbus_nats = ServiceMaker(
    "sbus-nats",
    "sbus.services.nats",
    "Carry an sbus bus over a NATS server or cluster (see docs/deploy.md)",
    "sbus-nats",
)
