"""``--metrics``: the server's and a service's statistics as OpenMetrics (sbus.metrics), scraped
with urllib after known traffic, and by a real Prometheus server read back through its HTTP API."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families as parse_text  # noqa: E402

from helpers import (  # noqa: E402
    REPO, SERVICE_TIMEOUT, LoggedProcess, SbusdProcess, connect, msg, recv, send, sub, sync, wait_stats,
    wait_until,
)
from sbus.metrics import MetricsAddressError, Families, metrics_address  # noqa: E402
from sbus.server.config import DEFAULT_MAX_QUEUE_BYTES, DEFAULT_MAX_UID_QUEUE_BYTES, DEFAULT_QUEUE_BYTES  # noqa: E402

DASHBOARD = Path(REPO) / "contrib" / "grafana" / "sbus-dashboard.json"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
ME = str(os.getuid())
_WHERE = re.compile(r"metrics on (http://\S+)/metrics")


def endpoint(proc: LoggedProcess) -> str:
    """The ``http://HOST:PORT`` a process started with ``--metrics tcp:0`` logged."""
    return _WHERE.search(proc.wait_log(_WHERE)).group(1)


def scrape(url: str, openmetrics: bool = False) -> dict:
    """``{(sample name, ((label, value), ...)): value}`` from one scrape of ``url/metrics``;
    the OpenMetrics form (what Prometheus asks for) goes through its strict parser."""
    headers = {"Accept": "application/openmetrics-text; version=1.0.0"} if openmetrics else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers), timeout=30) as r:
        kind = r.headers["Content-Type"]
        text = r.read().decode()
    assert kind.startswith("application/openmetrics-text" if openmetrics else "text/plain"), kind
    parse = parse_openmetrics if openmetrics else parse_text
    out = {}
    for family in parse(text):
        out[(family.name, "family")] = family.type
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape_until(url: str, ok, what: str, openmetrics: bool = False) -> dict:
    """Scrape `url` until `ok(samples)`; return those samples."""
    def once():
        samples = scrape(url, openmetrics)
        return samples if ok(samples) else None

    return wait_until(once, what)


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class Twist(LoggedProcess):
    """``twist PLUGIN OPTIONS...`` (the services' plugins as a user runs them)."""

    def __init__(self, log_path, plugin, *options):
        super().__init__([sys.executable, "-m", "twisted", "--log-format", "text", plugin, *options], log_path)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A bus and a work-queue service beside it, both with ``--metrics tcp:0``."""
    d = tmp_path_factory.mktemp("metrics")
    address = str(d / "bus.socket")
    bus = SbusdProcess(["-f", "-a", address, "--metrics", "tcp:0"], d / "sbusd.log", address=address)
    queue = Twist(d / "queue.log", "sbus-queue", "--bus", address, "--metrics", "tcp:0",
                  "--group", "jobs=metrics/jobs/", "--group", "prom=metrics/prom/")
    try:
        queue.wait_log("intake: subscribed")
        yield bus, endpoint(bus), queue, endpoint(queue)
    finally:
        queue.stop()
        bus.stop()


# --- the address ------------------------------------------------------------------------


@pytest.mark.parametrize("given, listens", [
    ("9464", "tcp:9464:interface=127.0.0.1"),
    ("tcp:9464", "tcp:9464:interface=127.0.0.1"),
    ("tcp:9464:interface=0.0.0.0", "tcp:9464:interface=0.0.0.0"),
    ("unix:/run/sbus/metrics.sock", "unix:/run/sbus/metrics.sock:mode=600"),
    ("unix:/run/sbus/metrics.sock:mode=660", "unix:/run/sbus/metrics.sock:mode=660"),
])
def test_the_address_is_private_unless_it_says_otherwise(given, listens):
    assert metrics_address(given) == listens


@pytest.mark.parametrize("bad", ["bogus:1", "tcp:port", ""])
def test_a_bad_address_is_refused(bad):
    with pytest.raises(MetricsAddressError, match="not a server endpoint"):
        metrics_address(bad)


def test_bad_metrics_option_is_one_line(tmp_path):
    for argv, status in (([sys.executable, "-m", "sbus.server.sbusd", "-f", "-a", str(tmp_path / "b"),
                           "--metrics", "bogus:1"], 1),
                         ([sys.executable, "-m", "twisted", "sbus-queue", "--group", "j=j/",
                           "--metrics", "tcp:port"], 2)):
        r = subprocess.run(argv, capture_output=True, timeout=60, cwd=REPO)
        err = r.stderr.decode()
        assert r.returncode == status, err
        assert "--metrics" in err and "not a server endpoint" in err and "Traceback" not in err
        assert err.splitlines()[0].split(": ", 1)[0] in ("sbusd", "twist sbus-queue", "twistd sbus-queue"), err


@pytest.mark.parametrize("command", [["sbus.server.sbusd", "-f", "-a"], ["twisted", "sbus", "--socket"]])
def test_a_taken_port_is_one_line_and_no_bus(stack, tmp_path, command):
    port = stack[1].rsplit(":", 1)[1]
    address = tmp_path / "b.socket"
    r = subprocess.run([sys.executable, "-m", *command, str(address), "--metrics", f"tcp:{port}"],
                       capture_output=True, timeout=60, cwd=REPO)
    err = r.stderr.decode()
    assert r.returncode == 1 and err.count("\n") == 1 and "Address already in use" in err, err
    assert "Error:" not in err and "Traceback" not in err
    assert not address.exists()


# --- scraped with urllib ------------------------------------------------------------------


def test_bus_metrics_count_known_traffic(tmp_path):
    """Bytes and packets in and out, connections by uid, disconnects by reason: exact deltas
    around traffic we made on a bus nothing else uses."""
    address = str(tmp_path / "bus.socket")
    bus = SbusdProcess(["-f", "-a", address, "--metrics", "tcp:0"], tmp_path / "sbusd.log", address=address)
    try:
        url = endpoint(bus)
        reader = connect(address)
        send(reader, sub("m/"))
        sync(reader)
        before = scrape(url)
        packet = msg("m/k", b"x" * 100)
        writer = connect(address, extensions=False)  # nothing but our 5 packets
        send(writer, *[packet] * 5)
        assert [recv(reader) for _ in range(5)] == [packet] * 5
        # (a page is served again for a moment after it is rendered: wait for the new one)
        after = scrape_until(url, lambda x: value(x, "sbus_sent_packets_total") >
                             value(before, "sbus_sent_packets_total"), "a page after the traffic", True)
        delta = {name: value(after, name) - value(before, name) for name in (
            "sbus_received_packets_total", "sbus_received_bytes_total", "sbus_sent_packets_total",
            "sbus_sent_bytes_total", "sbus_router_cache_hits_total", "sbus_router_cache_misses_total")}
        # m/k is new to the cache: the first walks the trie, the other 4 (a run, most of them) are hits
        assert delta == {"sbus_received_packets_total": 5, "sbus_received_bytes_total": 5 * len(packet),
                         "sbus_sent_packets_total": 5, "sbus_sent_bytes_total": 5 * len(packet),
                         "sbus_router_cache_hits_total": 4, "sbus_router_cache_misses_total": 1}
        assert 0 < value(after, "sbus_router_cache_bytes") <= value(after, "sbus_router_cache_limit_bytes")
        assert value(after, "sbus_connections", uid=ME) == value(before, "sbus_connections", uid=ME) + 1 == 2
        assert value(after, "sbus_clients") == 2 and value(after, "sbus_subscriptions") == 1
        assert ("sbus_uid_queued_bytes", (("uid", ME),)) in after   # all delivered: 0 queued
        assert value(after, "sbus_uid_queued_bytes", uid=ME) == 0
        assert value(after, "sbus_queued_limit_bytes", scope="client") == DEFAULT_QUEUE_BYTES
        assert value(after, "sbus_queued_limit_bytes", scope="uid") == DEFAULT_MAX_UID_QUEUE_BYTES
        assert value(after, "sbus_queued_limit_bytes", scope="bus") == DEFAULT_MAX_QUEUE_BYTES
        assert after[("sbus_drops", "family")] == after[("sbus_disconnects", "family")] == "counter"
        closed = value(after, "sbus_disconnects_total", reason="closed")
        writer.close()
        gone = scrape_until(url, lambda x: value(x, "sbus_connections", uid=ME) == 1,
                            "the writer's connection gone from the metrics")
        assert value(gone, "sbus_disconnects_total", reason="closed") == closed + 1, [k for k in gone if "disconn" in k[0]]
        assert not any(k[0].startswith("sbus_") and "pid" in dict(k[1]) for k in gone if k[1] != "family")
        reader.close()
    finally:
        bus.stop()


def test_service_metrics_count_what_it_took(stack):
    bus, _, queue, url = stack
    s = connect(bus.address)
    send(s, *[msg(f"metrics/jobs/{i}", b"job") for i in range(3)])
    sync(s)
    got = scrape_until(url, lambda x: value(x, "sbus_queue_group_received_total", group="jobs") >= 3,
                       "the queue's count of what it took", openmetrics=True)
    assert value(got, "sbus_queue_group_received_total", group="jobs") == 3
    assert value(got, "sbus_queue_group_backlog", group="jobs") == 3   # no member: all waiting
    assert value(got, "sbus_queue_bus_connected") == 1
    assert value(got, "sbus_metrics_up", service="queue") == 1
    assert got[("sbus_service_lost_messages", "family")] == "counter"
    s.close()


#: Each service beside the stack's bus, with what its page must count (a family of its own).
SERVICES = {
    "relay": (["sbus-relay", "--bus", "{bus}", "--socket", "{tmp}/relay.socket"],
              "sbus_relay_forwarded_up_total"),
    "bridge": (["sbus-bridge", "--bus-a", "{bus}", "--bus-b", "{tmp}/relay.socket", "--rule", "metrics/none/ a>b"],
               "sbus_bridge_forwarded_total"),
    "link": (["sbus-link", "--bus", "{bus}", "--listen", "tcp:0:interface=127.0.0.1", "--key-file", "{tmp}/key"],
             "sbus_link_to_remote_total"),
    "msgbus": (["sbus-msgbus", "--bus", "{bus}", "--port", "tcp:0:interface=127.0.0.1"],
               "sbus_msgbus_from_bus_total"),
    # no NATS server there: the page says so (its counters and nats_connected 0)
    "nats": (["sbus-nats", "--bus", "{bus}", "--server", "nats://127.0.0.1:9",
              "--export", "metrics/out/", "--allow-unauthenticated"], "sbus_nats_exported_total"),
}


@pytest.mark.parametrize("kind", sorted(SERVICES))
def test_each_service_serves_its_own_counters(stack, tmp_path, kind):
    """The relay's page has its bus's metrics and its own; every other service its own."""
    bus = stack[0]
    argv, own = SERVICES[kind]
    needs_relay = "{tmp}/relay.socket" in argv and kind != "relay"
    started = []
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    try:
        if needs_relay:
            relay = Twist(tmp_path / "relay.log", *[a.format(bus=bus.address, tmp=tmp_path)
                                                     for a in SERVICES["relay"][0]])
            started.append(relay)
            relay.wait_log("listening on")
        proc = Twist(tmp_path / f"{kind}.log", *[a.format(bus=bus.address, tmp=tmp_path) for a in argv],
                     "--metrics", "tcp:0")
        started.append(proc)
        url = endpoint(proc)
        samples = scrape_until(url, lambda x: value(x, "sbus_metrics_up", service=kind) == 1,
                               f"{kind} answering", openmetrics=True)
        assert own in _names(samples), sorted(n for n in _names(samples) if n.startswith(f"sbus_{kind}"))
        assert samples[("sbus_service_lost_messages", "family")] == "counter"
        assert (("sbus_clients", ()) in samples) == (kind == "relay")
        if kind == "relay":
            proc.wait_log("listening on")
            # it listens before it has reached its master: what comes before is dropped, not sent up
            scrape_until(url, lambda x: value(x, "sbus_relay_connected") == 1, "the relay connected up")
            pub = connect(str(tmp_path / "relay.socket"))
            send(pub, msg("metrics/up", b"x"))
            sync(pub)
            scrape_until(url, lambda x: value(x, "sbus_relay_forwarded_up_total") == 1 and
                         value(x, "sbus_clients") >= 1, "the relay's count of what went up")
            pub.close()
    finally:
        for p in reversed(started):
            p.stop()


def _names(samples: dict) -> set[str]:
    names = {k[0] for k in samples}
    names |= {k[0] + "_total" for k, kind in samples.items() if k[1] == "family" and kind == "counter"}
    return names


def dashboard_names() -> set[str]:
    """The metric names the Grafana dashboard's queries use."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    assert len(exprs) >= 8 and board["title"]
    return {n for e in exprs for n in re.findall(r"\bsbus_[a-z0-9_]+", e)}


def test_the_dashboard_parses_and_names_existing_metrics(stack):
    known = _names(scrape(stack[1])) | _names(scrape(stack[3]))
    named = {n for n in dashboard_names() if not n.startswith("sbus_record_")}  # (the recorder's test)
    assert named and named <= known, named - known


# --- scraped by a real Prometheus -----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(api: str, expr: str):
    url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
    except OSError:
        return None
    assert body["status"] == "success", body
    return body["data"]["result"]


def _one(api: str, expr: str):
    """The single value of `expr` now, or None (no sample yet)."""
    result = _query(api, expr)
    return float(result[0]["value"][1]) if result else None


def test_a_real_prometheus_scrapes_the_bus_and_a_service(stack, tmp_path):
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.skip("no prometheus binary (apt-get install prometheus)")
    bus, bus_url, queue, queue_url = stack
    s = connect(bus.address)
    send(s, *[msg(f"metrics/prom/{i}", b"p" * 10) for i in range(4)])
    sync(s)
    scrape_until(queue_url, lambda x: value(x, "sbus_queue_group_received_total", group="prom") == 4,
                 "the queue took the 4 messages")
    sent_by_then = value(scrape(bus_url), "sbus_received_packets_total")
    port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: sbus\n    static_configs: [{{targets: ['{bus_url.split('//')[1]}']}}]\n"
        f"  - job_name: sbus-queue\n    static_configs: [{{targets: ['{queue_url.split('//')[1]}']}}]\n")
    prom = LoggedProcess([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                         tmp_path / "prometheus.log", cwd=str(tmp_path))
    api = f"http://127.0.0.1:{port}"
    try:
        took = wait_until(lambda: prom.alive_or_raise() and
                          _one(api, 'sbus_queue_group_received_total{group="prom"}'),
                          "Prometheus to have scraped the queue", timeout=max(60.0, 4 * SERVICE_TIMEOUT))
        assert took == 4
        received = wait_until(lambda: _one(api, 'sbus_received_packets_total{job="sbus"}'),
                              "Prometheus to have scraped the bus", timeout=60.0)
        assert _one(api, 'up{job="sbus"}') == 1 and _one(api, 'up{job="sbus-queue"}') == 1
        assert received >= sent_by_then >= 4
        by_uid = _query(api, f'sbus_connections{{job="sbus",uid="{ME}"}}')
        assert by_uid and float(by_uid[0]["value"][1]) >= 3   # us, the queue's intake and control
        assert _one(api, 'sbus_queue_group_backlog{group="prom"}') == 4
        # the 4 keys were new to the bus: each walked the trie once, before Prometheus started
        assert _one(api, 'sbus_router_cache_misses_total{job="sbus"}') >= 4
        assert _one(api, 'sbus_router_cache_hits_total{job="sbus"}') is not None
    finally:
        prom.stop()
        s.close()


def test_a_scraper_asking_in_a_loop_gets_the_same_page_until_its_share_has_passed():
    """Rendering walks every client; a page is served again until RENDER_SHARE of the time since
    it was rendered was spent on it (a local user hammering /metrics cannot take the server)."""
    from prometheus_client import CollectorRegistry
    from twisted.web.test.requesthelper import DummyRequest

    from sbus.metrics import RENDER_SHARE, MetricsPage

    now = [100.0]
    calls = []

    class Counting:
        def collect(self):
            calls.append(now[0])
            now[0] += 0.01   # each rendering takes 10 ms
            out = Families()
            out.add("counter", "sbus_renders", "Renderings.", len(calls))
            return iter(out)

    registry = CollectorRegistry()
    registry.register(Counting())
    page = MetricsPage(registry, clock=lambda: now[0])
    first = page.render_GET(DummyRequest([b"metrics"]))
    assert page.render_GET(DummyRequest([b"metrics"])) == first and len(calls) == 1
    now[0] += 0.01 * (1 / RENDER_SHARE - 1) - 0.001
    assert page.render_GET(DummyRequest([b"metrics"])) == first and len(calls) == 1
    now[0] += 0.002
    assert page.render_GET(DummyRequest([b"metrics"])) != first and len(calls) == 2
    assert b"sbus_renders_total 2.0" in page.render_GET(DummyRequest([b"metrics"]))


def test_the_recorder_counts_rows_files_bytes_gaps_and_what_it_missed(start_bus, tmp_path):
    """A real ``twistd sbus-record --metrics``: after known traffic its page counts the rows and
    bytes it took, the files it published, a gap (an unclean stop before it started) and the
    messages the bus counted for its session while no recorder ran (a drop row's count)."""
    pytest.importorskip("pyarrow")
    from pipeline_conftest import RecorderProcess

    from sbus.core import codec

    bus = start_bus()
    out = tmp_path / "rec"
    (out / "_tmp").mkdir(parents=True, mode=0o700)
    (out / "_tmp" / "running").write_text("1\n")   # a writer's marker left behind: an unclean stop
    # the session the recorder will claim, lingering with 5 messages counted for it
    away = connect(bus.address)
    send(away, codec.session_request(b"metrics-rec", 60), sub("metrics/rec/"))
    sync(away)
    away.close()
    probe = connect(bus.address)
    wait_stats(probe, lambda st: st["sessions"]["lingering"] == 1)
    send(probe, *[msg(f"metrics/rec/away/{i}", b"a") for i in range(5)])
    sync(probe)
    rec = RecorderProcess(bus.address, out, ["--session", "metrics-rec", "--roll-age", "300ms",
                                             "--metrics", "tcp:0"], log_path=str(tmp_path / "record.log"))
    try:
        rec.wait_ready()
        url = endpoint(rec)
        payloads = [(f"metrics/rec/{i}", b"r" * i) for i in range(10)]
        send(probe, *[msg(k, p) for k, p in payloads])
        sync(probe)
        got = scrape_until(url, lambda x: value(x, "sbus_record_received_total") == 10 and
                           value(x, "sbus_record_files_published_total") >= 1 and
                           value(x, "sbus_record_published_rows_total") >= 10 + 2,
                           "the recorder's page after the traffic", openmetrics=True)
        assert value(got, "sbus_record_recorded_rows_total") == 10
        assert value(got, "sbus_record_gaps_total") == 1
        assert value(got, "sbus_service_lost_messages_total", service="record", reason="while_away") == 5
        # every message's key and payload, and a row's overhead each, went into the writer's queue
        assert value(got, "sbus_record_recorded_bytes_total") > sum(len(k) + len(p) for k, p in payloads)
        assert got[("sbus_record_queued_bytes", "family")] == "gauge"
        assert value(got, "sbus_record_queue_limit_bytes") == 64 * 2**20
        assert value(got, "sbus_record_connected") == 1 and value(got, "sbus_metrics_up", service="record") == 1
        assert value(got, "sbus_record_dropped_bytes_total") == 0 and ("sbus_record_gaps", "family") in got
        on_dashboard = {n for n in dashboard_names() if n.startswith("sbus_record_")}
        assert on_dashboard and on_dashboard <= _names(got), on_dashboard - _names(got)
    finally:
        rec.stop()
        probe.close()
