"""twistd plugins for sbus: ServiceMaker objects only.

Each points at a ``sbus.*.tap`` module by name, so listing plugins (which
imports this file) stays cheap; the module is imported only when that
plugin is used. Add a line per service (``sbus-relay`` etc.).
"""

from sbus.options import SbusServiceMaker as ServiceMaker  # start-up failures: one line

sbus = ServiceMaker(
    "sbus",
    "sbus.server.tap",
    "sbus message bus server on a unix SOCK_SEQPACKET socket",
    "sbus",
)
