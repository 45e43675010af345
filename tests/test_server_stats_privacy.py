"""`CMSG server/stats` on a multi-user bus: totals and per-client rows (pids, uids,
traffic) only for the asker's own uid, unless it is root or the server's own user."""

from __future__ import annotations

import json
import os

import pytest

from helpers import STATS, STATS_REPLY, Agent, connect, stats, sync
from test_server_secrets import NOBODY, world_bus  # noqa: F401  (fixture)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch to another uid")
def test_other_users_clients_are_not_listed(world_bus):  # noqa: F811
    bus = world_bus
    root = connect(bus.address)
    sync(root)
    with Agent(bus.address, uid=NOBODY, gid=NOBODY) as nobody:
        nobody.send(STATS)
        reply = nobody.recv()
        assert reply.startswith(STATS_REPLY)
        seen = json.loads(reply[len(STATS_REPLY):])
        assert seen["clients"] == 1  # totals are its own uid's (issue 16 item 10)
        assert [q["uid"] for q in seen["queues"]] == [NOBODY]  # rows: its own uid only
        assert seen["queues"][0]["pid"] == nobody.pid
        # root (and the server's own user) sees everyone
        assert sorted(q["uid"] for q in stats(root)["queues"]) == [0, NOBODY]
