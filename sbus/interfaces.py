"""Where two sides meet: transport/protocol, router/broker, service/bus."""

from zope.interface import Attribute, Interface


class IPacketTransport(Interface):
    """A connected transport that keeps packet boundaries: one write, one packet.

    It only moves bytes. What it sends comes from one queue (`sbus.core.flood.Outbox`): the
    broker gives it its client's queue (`useQueue`), decides there what is queued, and asks
    the transport to `flush`; the transport reports a full socket by returning False (and, if
    it finds one while writing, through `IPacketProtocol.sendRefused`)."""

    peer = Attribute("The peer's `Credentials` (pid, uid, gid) from SO_PEERCRED.")
    connected = Attribute("False once the connection is gone.")
    disconnecting = Attribute("True once closing has begun (nothing more is sent).")
    packets_out = Attribute("Packets sent so far.")
    bytes_out = Attribute("Bytes sent so far.")

    def useQueue(outbox):
        """Send from `outbox` from now on."""

    def flush():
        """Send from the front of the queue until it is empty (True) or the socket is full
        (False: the rest goes when the socket is writable)."""

    def write(packet):
        """Send one packet, queueing it (never dropping) if it cannot go now."""

    def sendLast(packet):
        """Send now, ahead of anything queued, if the socket takes it (before closing)."""

    def queued():
        """How many packets are queued."""

    def queuedBytes():
        """How many bytes are queued."""

    def hasRoom():
        """Is the queue under its limits (its own, its uid's, the server's)?"""

    def peerPidfd():
        """A pidfd of the process that connected; raises OSError if there is none to take."""

    def pauseProducing():
        """Stop reading from the peer."""

    def resumeProducing():
        """Read from the peer again."""

    def abortConnection():
        """Close now, throwing away anything queued."""


class IPacketProtocol(Interface):
    """What a packet transport calls on its protocol, beside IProtocol's methods."""

    def packetReceived(packet):
        """One whole packet arrived (bytes, at most the size limit)."""

    def packetTooLarge(size):
        """A packet of `size` bytes, over the limit, was received and discarded."""

    def outboxDrained():
        """Everything queued has been sent."""


class IQueueingProtocol(IPacketProtocol):
    """A protocol that keeps its peer's queue with a flood policy (the broker's clients)."""

    def readBatchDone():
        """The packets of one wakeup have all been handed over (send what they routed)."""

    def sendRefused():
        """The socket refused packets the queue had not judged (`Outbox.refused`)."""

    def packetsReceived(packets, start):
        """Optional, for a transport that reads batches: take as many of `packets[start:]` (one
        wakeup's packets, bytes each) as it handles at once, as `packetReceived` would one by
        one; return the index of the first it did not take. Offered only after `packetReceived`
        returned True (which no other caller looks at)."""


class IRouter(Interface):
    """Subscriptions and matching, as the broker and relays use them."""

    def add_client(client, secret_prefix):
        """Register a subscriber and the prefix its secret keys must start with."""

    def remove_client(client):
        """Forget a subscriber; return the patterns no one holds any more."""

    def subscribe(client, pattern):
        """Store one more instance; return True if no one held `pattern` before."""

    def unsubscribe(client, pattern):
        """Remove one instance; None if not held, True if now no one holds it."""

    def match(key):
        """Every client that must receive a message with `key`, each once."""


class IUpstream(Interface):
    """What a bus tells the link to its master (a relay), if it has one."""

    def localPublish(packet, key, client):
        """A local client published `packet`: carry it upward."""

    def patternHeld(pattern):
        """Some local client now holds `pattern` and nobody did before: subscribe upward."""

    def patternReleased(pattern):
        """The last local holder of `pattern` let it go: unsubscribe upward."""

    def stats():
        """A JSON-able dict, shown as "upstream" in the bus's `server/stats`."""


class IBus(Interface):
    """A running bus, as services beside it see it."""

    factory = Attribute("The broker factory serving the bus's clients.")
    printed_address = Attribute("The address clients connect to, as sbusd prints it.")


class ILeanReactor(Interface):
    """A reactor that can wait and dispatch the way a server's hot path wants (`sbus.reactor`):
    the server's port asks; on any other reactor it runs the same, without these."""

    def serve(lean, busy_poll):
        """Dispatch descriptors of class `lean` (or None: leave as is) without the legacy log
        context, and poll up to `busy_poll` seconds before sleeping (the largest asked stays)."""
