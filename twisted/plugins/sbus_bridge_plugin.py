"""twistd plugin ``sbus-bridge``: join two sbus buses with forwarding rules.

Lazy like the other sbus plugins: only the module name is given.
"""

from sbus.options import SbusServiceMaker as ServiceMaker  # start-up failures: one line

sbus_bridge = ServiceMaker(
    "sbus-bridge",
    "sbus.services.bridge",
    "Join two sbus buses, forwarding keys by rules (see docs/deploy.md)",
    "sbus-bridge",
)
