"""twistd plugin ``sbus-msgbus``: the msgbus line protocol, joined to an sbus bus.

Lazy like the other sbus plugins: only the module name is given.
"""

from sbus.options import SbusServiceMaker as ServiceMaker  # start-up failures: one line

sbus_msgbus = ServiceMaker(
    "sbus-msgbus",
    "sbus.services.msgbus",
    "msgbus gateway: the msgbus TCP line protocol on top of an sbus bus (see docs/deploy.md)",
    "sbus-msgbus",
)
