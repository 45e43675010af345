"""``--metrics ADDRESS``: the server's and the services' statistics as OpenMetrics, for Prometheus.

The numbers are the ones ``server/stats`` gives root (`BrokerFactory.stats`) and the ones a
service answers ``sbus/services/stats`` with (`sbus.services.svcstats`), read when a scraper
asks (a custom collector: nothing is counted twice, nothing costs per packet). The page is
rendered in the reactor's thread, where those dicts are safe to read (prometheus_client's
own ``MetricsResource`` renders in a thread pool, which would read them while the reactor
changes them); the exposition format is prometheus_client's.

ADDRESS is a Twisted server endpoint string: ``tcp:9464:interface=127.0.0.1``,
``unix:/run/sbus/metrics.sock``, or a bare port number. A TCP address without ``interface=``
binds to loopback and a unix socket without ``mode=`` is 0600: the page shows every uid's
traffic, as root's ``server/stats`` does (docs/security.md). Prometheus scrapes ``/metrics``.

Names follow the OpenMetrics conventions (``_total`` counters, ``_bytes`` and ``_seconds``
units); labels are bounded: uid, reason, direction, queue group, never a key or a pid.
"""

from __future__ import annotations

import re
import time

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from twisted.application import service
from twisted.internet.endpoints import serverFromString
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import Site

log = Logger()

#: Where Prometheus looks by default.
METRICS_PATH = b"metrics"
DEFAULT_INTERFACE = "127.0.0.1"


class MetricsAddressError(ValueError):
    """A ``--metrics`` value that is no server endpoint; ``str()`` is the one line to show."""


def metrics_address(text: str) -> str:
    """The endpoint string to listen on for ``--metrics TEXT``: a bare port is TCP, TCP binds
    to loopback unless ``interface=`` says otherwise, a unix socket is 0600 unless ``mode=``
    says otherwise. `MetricsAddressError` if Twisted cannot parse it."""
    text = text.strip()
    if text.isdigit():
        text = f"tcp:{text}"
    kind = text.split(":", 1)[0]
    if kind in ("tcp", "tcp6") and not re.search(r"(^|:)interface=", text):
        text += ":interface=" + (DEFAULT_INTERFACE if kind == "tcp" else r"\:\:1")
    elif kind == "unix" and not re.search(r"(^|:)mode=", text):
        text += ":mode=600"
    try:
        serverFromString(None, text)  # parses only: the reactor is given when it listens
    except (ValueError, TypeError, KeyError) as e:
        raise MetricsAddressError(f"not a server endpoint ({e}): {text!r} (e.g. tcp:9464, "
                                  "tcp:9464:interface=127.0.0.1, unix:/run/sbus/metrics.sock)") from None
    return text


# --- reading the stats dicts -------------------------------------------------------------


class Families:
    """Metric families by name, filled from the stats dicts of one scrape."""

    def __init__(self):
        self.families: dict = {}

    def declare(self, kind: str, name: str, doc: str, labelnames=(), unit: str = ""):
        """The family `name` (shown even with no sample yet, so dashboards find it)."""
        family = self.families.get(name)
        if family is None:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = self.families[name] = (cls(name, doc, labels=sorted(labelnames), unit=unit), sorted(labelnames))
        return family

    def add(self, kind: str, name: str, doc: str, value, labels: dict | None = None, unit: str = "") -> None:
        labels = labels or {}
        metric, names = self.declare(kind, name, doc, labels, unit)
        if names != sorted(labels):
            return  # the same path met with other labels (a shape we do not know): keep the first
        metric.add_metric([str(labels[n]) for n in names], float(value))

    def __iter__(self):
        return (metric for metric, _ in self.families.values())


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def bus_metrics(stats: dict, out: Families) -> None:
    """The families of a bus's ``server/stats`` as root sees it (`BrokerFactory.stats(None)`)."""
    out.add("gauge", "sbus_clients", "Connected clients.", stats["clients"])
    out.add("gauge", "sbus_subscriptions", "Subscriptions held, all clients.", stats["subscriptions"])
    out.add("counter", "sbus_received_packets", "Packets received from clients.", stats["packets_in"])
    out.add("counter", "sbus_sent_packets", "Packets sent to clients: the messages delivered and the server's replies "
            "(messages not delivered are sbus_drops).", stats["packets_out"])
    out.add("counter", "sbus_received_bytes", "Bytes received from clients.", stats["bytes_in"], unit="bytes")
    out.add("counter", "sbus_sent_bytes", "Bytes sent to clients.", stats["bytes_out"], unit="bytes")
    out.add("gauge", "sbus_queued_bytes", "Bytes queued for all clients.", stats["queued_bytes"], unit="bytes")
    out.add("gauge", "sbus_uptime_seconds", "Seconds since the server started.", stats["uptime_s"], unit="seconds")
    per_uid: dict = {}
    for q in stats["queues"]:
        row = per_uid.setdefault(q["uid"], [0, 0, 0])
        row[0] += 1
        row[1] += q["queued_bytes"]
        row[2] += q["queued_packets"]
    by_uid = (("sbus_connections", "Connections open, by uid.", ""),
              ("sbus_uid_queued_bytes", "Bytes queued for the clients of a uid.", "bytes"),
              ("sbus_uid_queued_packets", "Packets queued for the clients of a uid.", ""))
    for name, doc, unit in by_uid:
        out.declare("gauge", name, doc, ("uid",), unit)
    for uid, row in sorted(per_uid.items()):
        for (name, doc, unit), value in zip(by_uid, row):
            out.add("gauge", name, doc, value, {"uid": uid}, unit)
    limits = stats["limits"]
    for scope, name in (("client", "queue_bytes"), ("uid", "max_uid_queue_bytes"), ("bus", "max_queue_bytes")):
        out.add("gauge", "sbus_queued_limit_bytes", "Queued bytes allowed: one client, one uid, all clients.",
                limits[name], {"scope": scope}, unit="bytes")
    out.add("gauge", "sbus_uid_connections_limit", "Connections one uid may hold.", limits["max_uid_connections"])
    for family, doc in (("drops", "Messages not delivered to a client, by reason."),
                        ("disconnects", "Clients gone, by reason (closed: they closed it)."),
                        ("refused", "Connections or requests refused, by reason.")):
        out.declare("counter", f"sbus_{family}", doc, ("reason",))
        for reason, n in sorted(stats[family].items()):
            out.add("counter", f"sbus_{family}", doc, n, {"reason": reason})
    cache = stats.get("router_cache")
    if cache is not None:
        out.add("counter", "sbus_router_cache_hits", "Message keys routed from the match cache.", cache["hits"])
        out.add("counter", "sbus_router_cache_misses", "Message keys routed by walking the subscription trie.",
                cache["misses"])
        out.add("gauge", "sbus_router_cache_bytes", "Estimated memory the match cache holds.", cache["bytes"],
                unit="bytes")
        out.add("gauge", "sbus_router_cache_limit_bytes", "The match cache's memory bound.",
                cache["limit_bytes"], unit="bytes")
    sessions = stats["sessions"]
    for state in ("held", "lingering"):
        out.add("gauge", "sbus_sessions", "Named sessions, live (held) or lingering after their client.",
                sessions.get(state, 0), {"state": state})
    out.add("counter", "sbus_sessions_resumed", "Lingering sessions a successor took over.", sessions.get("resumed", 0))
    out.add("counter", "sbus_sessions_expired", "Sessions that lingered past their time.", sessions.get("expired", 0))
    out.add("counter", "sbus_sessions_missed_messages", "Messages lingering sessions missed that expired unclaimed.",
            sessions.get("missed", 0))


#: Service stats leaves that are levels, not counts (everything else numeric is a counter).
_GAUGES = frozenset({
    "clients", "connected", "bus_connected", "peer_connected", "watching", "receiving", "held_up_patterns",
    "subscriptions_up", "queued_up_bytes", "blocked_publishers", "last_seconds", "now_seconds",
    "last_gap_seconds", "limit", "max_bytes", "window", "window_bytes", "members", "backlog", "backlog_bytes",
    "in_flight",
    "intake_paused", "held_patterns", "importers", "exporters", "pending_bytes", "missed", "seen",
    "instance", "published_seq", "restart_standing_by", "enabled", "forwarding", "size", "active",
    "standing_by", "state_seconds", "queued_bytes", "queue_limit_bytes", "degraded",
})
#: Dicts keyed by a reason, and the keys that are directions.
_REASONS = frozenset({"drops", "lost", "drop_reasons", "refused"})
#: Dicts whose every number is a level (a standby's replay window: its size and bounds).
_GAUGE_TREES = frozenset({"window"})
_DIRECTIONS = frozenset({"a>b", "b>a", "from_remote", "to_remote"})
#: Dicts keyed by the name of something bounded the operator configured.
_NAMED = {"groups": "group"}
#: Parts of the stats that are not counts of this process's traffic.
_SKIP = frozenset({"master_limits", "spanning_tree", "upstream"})


def _clean(part: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", part.lower()).strip("_")


def service_metrics(kind: str, stats: dict, out: Families) -> None:
    """The families of a service's stats dict (`StatsResponder`'s ``stats()``), named
    ``sbus_<kind>_<path>``: numbers and flags become counters or gauges, dicts keyed by
    reason, direction or group become labels. ``lost`` is one family for every service."""
    lost = ("counter", "sbus_service_lost_messages", "Messages a service did not pass on, by reason.")
    out.declare(*lost, ("service", "reason"))
    for reason, n in sorted((stats.get("lost") or {}).items()):
        out.add(*lost, n, {"service": kind, "reason": reason})
    _walk(f"sbus_{_clean(kind)}", stats, {}, out, None, False)


def _walk(prefix: str, value, labels: dict, out: Families, parent: str | None, levels: bool) -> None:
    if isinstance(value, dict):
        keys = set(value)
        if keys and keys <= _DIRECTIONS:
            for direction, v in value.items():
                _walk(prefix, v, {**labels, "direction": direction}, out, parent, levels)
        elif parent in _REASONS and all(_number(v) or isinstance(v, dict) for v in value.values()):
            for reason, v in value.items():
                _walk(prefix, v, {**labels, "reason": reason}, out, parent, levels)
        elif parent in _NAMED:
            for name, v in value.items():
                _walk(prefix, v, {**labels, _NAMED[parent]: name}, out, None, levels)
        else:
            for key, v in value.items():
                if key in _SKIP or (key == "lost" and not labels):
                    continue
                name = key[len("total_"):] if key.startswith("total_") else _NAMED.get(key, key)
                name = prefix if name == "count" else f"{prefix}_{_clean(name)}"
                _walk(name, v, labels, out, key, levels or key in _GAUGE_TREES)
        return
    if not (_number(value) or isinstance(value, bool)):
        return  # text, lists, None: not a level or a count
    unit = next((u for u in ("bytes", "seconds") if prefix.endswith("_" + u)), "")
    if isinstance(value, bool) or levels or parent in _GAUGES:
        out.add("gauge", prefix, f"{prefix} (the service's stats).", value, labels, unit=unit)
    else:
        out.add("counter", prefix, f"{prefix} (the service's stats, a count).", value, labels, unit=unit)


class StatsCollector:
    """A prometheus_client collector over `service`'s stats, read at scrape time: the bus's
    (``service.factory.stats(None)``, once it serves) and the service's own
    (``service.stats()``, for every service but the plain bus)."""

    def __init__(self, service, kind: str):
        self.service = service
        self.kind = kind

    def collect(self):
        out = Families()
        factory = getattr(self.service, "factory", None)
        if factory is not None:
            bus_metrics(factory.stats(None), out)
        own = getattr(self.service, "stats", None)
        if callable(own):
            service_metrics(self.kind, own(), out)
        out.add("gauge", "sbus_metrics_up", "1: the bus or service answered this scrape.", 1,
                {"service": self.kind})
        return iter(out)


# --- serving ---------------------------------------------------------------------------------


#: The share of the process's time rendering may take, as for ``server/stats`` (broker.py):
#: after a rendering that took T, the same page is served again for T * (1 / share - 1).
RENDER_SHARE = 0.1


class MetricsPage(Resource):
    """``/metrics``, rendered in the reactor's thread (see the module's docstring), in the
    format the scraper asks for (OpenMetrics for Prometheus, else the text format). Anyone
    who reaches the endpoint may ask in a loop: the stats read for one page serve every page
    until that reading's share of the time (`RENDER_SHARE`) has passed."""

    isLeaf = True

    def __init__(self, registry, clock=time.monotonic):
        super().__init__()
        self.registry = registry
        self.clock = clock
        self.snapshot: Snapshot | None = None
        self.fresh_until = 0.0

    def render_GET(self, request):
        encoder, content_type = choose_encoder(request.getHeader("accept") or "")
        start = self.clock()
        try:
            if self.snapshot is None or start >= self.fresh_until:
                self.snapshot = Snapshot(list(self.registry.collect()))
                end = self.clock()
                self.fresh_until = end + (end - start) * (1 / RENDER_SHARE - 1)
            body = encoder(self.snapshot)
        except Exception:
            log.failure("metrics: reading the stats failed")
            request.setResponseCode(500)
            return b"reading the stats failed (see the log)\n"
        request.setHeader("Content-Type", content_type)
        return body


class Snapshot:
    """Metric families read once, for the exposition encoders (which ask a registry's
    ``collect()``)."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return iter(self.families)


def _page(registry) -> Resource:
    root = Resource()
    root.putChild(METRICS_PATH, MetricsPage(registry))
    return root


class QuietSite(Site):
    """A scrape every few seconds is not news: no access log line, no factory start lines."""

    noisy = False

    def log(self, request):
        pass


class MetricsService(service.Service):
    """Serve ``/metrics`` on the endpoint `address` (see `metrics_address`), from the reactor,
    for the collectors given to `watch`. A failure to listen is a `StartupError` (one line)."""

    def __init__(self, address: str, reactor=None):
        self.address = metrics_address(address)
        self.reactor = reactor
        self.registry = CollectorRegistry()
        self.port = None

    def watch(self, collector) -> None:
        self.registry.register(collector)

    def listen(self) -> None:
        if self.port is not None:
            return
        from sbus.options import StartupError

        if self.reactor is None:
            from twisted.internet import reactor
        else:
            reactor = self.reactor
        got: list = []
        serverFromString(reactor, self.address).listen(QuietSite(_page(self.registry))).addBoth(got.append)
        if not got:
            raise StartupError(f"--metrics {self.address}: the endpoint did not listen at once")
        if isinstance(got[0], Failure):
            raise StartupError(f"--metrics {self.address}: {got[0].getErrorMessage()}")
        self.port = got[0]
        log.info("metrics on {where}/metrics", where=self.describe())

    def describe(self) -> str:
        """Where a scraper finds us: ``http://HOST:PORT`` or the unix socket's path."""
        host = self.port.getHost()
        if hasattr(host, "port"):
            where = f"[{host.host}]" if ":" in host.host else host.host
            return f"http://{where}:{host.port}"
        return f"unix:{host.name.decode() if isinstance(host.name, bytes) else host.name}"

    def privilegedStartService(self) -> None:
        self.listen()  # before twistd drops privileges: a port below 1024, a root-only directory
        service.Service.privilegedStartService(self)

    def startService(self) -> None:
        self.listen()
        service.Service.startService(self)

    def stopService(self):
        service.Service.stopService(self)
        port, self.port = self.port, None
        if port is not None:
            return port.stopListening()
        return None

    def beside(self, svc, tapname: str):
        """`svc` and this service over its stats (`StatsCollector`), as one service for twistd."""
        parent = service.MultiService()
        self.setServiceParent(parent)
        svc.setServiceParent(parent)
        self.watch(StatsCollector(svc, tapname[len("sbus-"):] if tapname.startswith("sbus-") else tapname))
        return parent
