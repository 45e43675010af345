"""twistd plugin ``sbus-queue``: shared work queues beside the bus (docs/queues.md)."""

from sbus.options import SbusServiceMaker as ServiceMaker  # start-up failures: one line

sbus_queue = ServiceMaker(
    "sbus-queue",
    "sbus.services.queue",
    "Shared work queues: each matching message to one member of a group, with acknowledgements "
    "(see docs/queues.md)",
    "sbus-queue",
)
