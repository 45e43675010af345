"""sbus clients: blocking (here), `sbus.client.twisted`, `sbus.client.asyncio`.

    import sbus.client
    with sbus.client.connect() as bus:   # $SBUS_SOCKET, else /run/sbus.socket
        bus.subscribe("sensors/")
        for message in bus:
            ...
"""

from sbus.core.codec import MAX_PACKET, Control, DisconnectNotice, DropNotice, Message, ProtocolError

from .address import DEFAULT_ADDRESS, ENV_VAR, Address, AddressError, open_socket, parse, resolve
from sbus.core.reqrep import NoResponders, RemoteError, RequestError, RequestTimeout
from sbus.core.workqueue import Delivery, NoService, QueueFull, Refused

from .blocking import Client, ConnectionClosed, PacketTooLarge, SbusError, Worker, connect

__all__ = [
    "MAX_PACKET",
    "Address",
    "AddressError",
    "Client",
    "ConnectionClosed",
    "Control",
    "DisconnectNotice",
    "DropNotice",
    "DEFAULT_ADDRESS",
    "Delivery",
    "NoResponders",
    "NoService",
    "QueueFull",
    "Refused",
    "RemoteError",
    "RequestError",
    "RequestTimeout",
    "Worker",
    "ENV_VAR",
    "Message",
    "PacketTooLarge",
    "ProtocolError",
    "SbusError",
    "connect",
    "open_socket",
    "parse",
    "resolve",
]
