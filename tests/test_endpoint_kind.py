"""`sbus.services.access.endpoint_kind`: Twisted endpoint descriptions read without Twisted's
private parser (the link and the gateways decide from it how to protect a listening socket)."""

from __future__ import annotations

import pytest

from sbus.services.access import endpoint_kind


@pytest.mark.parametrize("description, expected", [
    ("tcp:host=example.com:port=1234", ("tcp", [], {"host": "example.com", "port": "1234"})),
    ("TCP:1234", ("tcp", ["1234"], {})),
    (r"unix:/tmp/x\:y.sock:mode=0600", ("unix", ["/tmp/x:y.sock"], {"mode": "0600"})),
    (r"tcp6:port=99:interface=\:\:1", ("tcp6", [], {"port": "99", "interface": "::1"})),
    ("tcp:host=a=b:port=1", ("tcp", [], {"host": "a=b", "port": "1"})),
    (r"unix:path=/a\=b", ("unix", [], {"path": "/a=b"})),
    (r"unix:/a\=b", ("unix", ["/a=b"], {})),
    ("ssl:port=4433:certKey=/k.pem:privateKey=/p.pem",
     ("ssl", [], {"port": "4433", "certKey": "/k.pem", "privateKey": "/p.pem"})),
])
def test_descriptions_split_as_twisted_reads_them(description, expected):
    assert endpoint_kind(description) == expected


@pytest.mark.parametrize("description", ["", ":port=1", "port=1"])
def test_a_description_without_a_type_is_refused(description):
    with pytest.raises(ValueError, match="has no type"):
        endpoint_kind(description)
