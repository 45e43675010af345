"""Several `sbus-queue` services on one bus (docs/queues.md, "Several services"): each answers
only for its own groups, a join reaches the service of its group, a group nobody serves is
`NoService`, and a second service for a group gives that group up to the first.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

from helpers import REPO
from sbus.client import Client, NoService
from sbus.core import codec
from sbus.core.workqueue import SERVES_ROOT
from sbus.services.svcstats import STATS_REQUEST
from test_queue import _join, online, publish, start_queue  # noqa: F401  (a fixture)


def test_core_a_service_is_silent_about_groups_it_does_not_serve():
    alpha, beta = online([(b"alpha", b"a/")]), online([(b"beta", b"b/")])
    key, out = _join(alpha, group=b"alpha")
    hello = json.loads(codec.parse(out[0]).payload)
    assert hello["service"] == alpha.service_id.decode()
    assert beta.interest(b"+\0" + key) == [] and beta.stats()["joins_elsewhere"] == 1


def test_core_a_later_service_for_the_same_group_gives_it_up():
    first = online([(b"alpha", b"a/")])
    later = online([(b"alpha", b"a/"), (b"gamma", b"g/")])
    assert first.service_id < later.service_id
    key, out = _join(later, group=b"alpha")  # a member it saw before it knew
    assert out and later.message(b"a/1", b"x")
    for pattern in first.serves_patterns():
        later.interest(b"+\0" + pattern)
        first.interest(b"+\0" + later.serves_patterns()[0])  # the earlier one keeps its group
    assert set(later.groups) == {b"gamma"} and later.stats()["given_up"] == {"alpha": first.service_id.decode()}
    assert later.members == {} and later.tokens == {} and set(first.groups) == {b"alpha"}
    assert later.message(b"a/2", b"x") == [] and _join(later, member=b"m2", group=b"alpha")[1] == []
    assert SERVES_ROOT in first.serves_patterns()[0]


def services_stats(address, expect: int) -> dict:
    """The counters of the `expect` sbus-queue services on the bus, by their group names."""
    out = {}
    with Client(address) as c:
        reply = c.whoami(5) + b"/stats/" + secrets.token_hex(4).encode()
        c.subscribe(reply)
        c.sync(5)
        c.publish(STATS_REQUEST, reply)
        while len(out) < expect:
            m = c.receive(timeout=30)
            if getattr(m, "key", None) == reply:
                body = json.loads(m.payload)
                if body["service"] == "sbus-queue":
                    out[",".join(sorted(body["stats"]["groups"]))] = body["stats"]
    return out


def test_several_services_on_one_bus(bus, start_queue, tmp_path):
    alpha = start_queue(bus, "--group", "alpha=alpha/")
    start_queue(bus, "--group", "beta=beta/")
    ids = {name: st["service"] for name, st in services_stats(bus.address, 2).items()}
    assert set(ids) == {"alpha", "beta"}, ids
    with Client(bus.address) as c:
        for i in range(20):  # each answered by alpha's service, none refused by beta's
            w = c.join("alpha" if i % 2 else "beta", timeout=20)
            assert w.info["service"] == ids["alpha" if i % 2 else "beta"]
            w.leave()
        w = c.join("alpha", timeout=20)
        publish(bus.address, [b"alpha/1", b"beta/1"])
        d = w.next(timeout=20)
        w.ack(d)
        assert d.key == b"alpha/1"
    # a second service for alpha (and gamma): gives alpha up to the first, keeps gamma
    second = subprocess.Popen([sys.executable, "-m", "twisted", "--log-format", "text", "sbus-queue", "--bus",
                               bus.address, "--group", "alpha=alpha/", "--group", "gamma=gamma/"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        for line in second.stdout:
            if b"already served by another sbus-queue service" in line:
                break
        else:
            raise AssertionError("the second service did not give alpha up")
        assert b"group alpha is already served" in line and ids["alpha"].encode() in line, line
        with Client(bus.address) as c:
            for _ in range(5):
                w = c.join("alpha", timeout=20)
                assert w.info["service"] == ids["alpha"]
                w.leave()
            assert c.join("gamma", timeout=20).info["group"] == "gamma"
        assert services_stats(bus.address, 3)["gamma"]["given_up"] == {"alpha": ids["alpha"]}
    finally:
        second.terminate()
        second.wait(30)
        second.stdout.close()
    # nobody serves alpha any more: a clear error of its own, in the client and `sbus work`
    alpha.stop()
    with Client(bus.address) as c:
        try:
            c.join("alpha", timeout=0.5)
        except NoService as e:
            assert str(e) == "no sbus-queue service answered for group alpha within 0.5 s"
        else:
            raise AssertionError("joined a group nobody serves")
    r = subprocess.run([sys.executable, "-m", "sbus.cli", "-b", bus.address, "work", "-t", "0.5", "alpha", "--",
                        "true"], capture_output=True, timeout=60, cwd=REPO)
    assert (r.returncode, r.stderr) == (1, b"sbus: no sbus-queue service answered for group alpha within 0.5 s\n")
