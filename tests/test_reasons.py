"""One vocabulary: the reasons docs/protocol.md lists are the server's own (sbus.core.reasons)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from sbus.core.reasons import Disconnect, Drop

DOCS = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def _listed(heading: str) -> set[str]:
    text = DOCS.read_text()
    start = text.index(heading)
    end = text.index(".\n", start)
    return set(re.findall(r"`([a-z_]+)`", text[start:end]))


def test_the_documented_disconnect_reasons_are_the_servers():
    assert _listed("Disconnect reasons:") == {r.value for r in Disconnect}


def test_every_drop_reason_is_documented():
    text = DOCS.read_text()
    for reason in Drop:
        assert f"`{reason.value}`" in text, reason


def test_reasons_are_the_strings_statistics_carry():
    counts = Counter({Disconnect.CLOSED: 2, Drop.SOFT_DISCARD: 1})
    assert json.loads(json.dumps(counts)) == {"closed": 2, "soft_discard": 1}
    assert counts["closed"] == 2 and Disconnect("owner_exited") is Disconnect.OWNER_GONE
