"""The SOCK_SEQPACKET transport (`sbus.seqpacket`), shared by server and clients.

Layering is checked in a fresh interpreter: the client package and the
transport import with the server package blocked.
"""

from __future__ import annotations

import subprocess
import sys

from helpers import child_env

_BLOCK_SERVER = r"""
import importlib, sys

class BlockServer:
    def find_spec(self, name, path=None, target=None):
        if name == "sbus.server" or name.startswith("sbus.server."):
            raise ImportError("the client side imported " + name)

sys.meta_path.insert(0, BlockServer())
for name in sys.argv[1:]:
    importlib.import_module(name)
leaked = sorted(m for m in sys.modules if m.startswith("sbus.server"))
assert not leaked, leaked
print("ok")
"""

CLIENT_SIDE = [
    "sbus.seqpacket", "sbus.address", "sbus.interfaces", "sbus.client", "sbus.client.address",
    "sbus.client.blocking", "sbus.client.twisted", "sbus.client.asyncio", "sbus.cli",
]


def test_client_package_never_imports_the_server_package():
    out = subprocess.run([sys.executable, "-c", _BLOCK_SERVER, *CLIENT_SIDE], env=child_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
