#!/usr/bin/env python3
"""Fuzz target for the wire codec and the `!/cred/` pattern check (issue 7).

    .venv/bin/python fuzz/codec_fuzz.py -atheris_runs=2000000     # coverage-guided, with atheris
    .venv/bin/python fuzz/codec_fuzz.py -max_total_time=300        # (any libFuzzer flag works)
    .venv/bin/python fuzz/codec_fuzz.py --plain --runs 200000      # no atheris: random + mutated inputs

Not part of the test run. Properties checked on every input:

* `codec.classify` / `codec.parse` either return or raise `codec.ProtocolError`,
  nothing else; a packet over the limit is always refused;
* `parse` is stable through `encode`: `parse(encode(parse(p))) == parse(p)`, and
  `encode` of a parsed MSG/CMSG gives the packet back byte for byte;
* `credentials.check_pattern` either returns or raises `CredentialError`; what it
  returns is idempotent (checking it again gives it back), keeps every non-secret
  pattern unchanged, and turns a secret pattern into one that starts with the
  client's own `<prefix>!/cred/GID/UID/PID/` (so it can never name someone else);
* `credentials.check_key` either returns or raises `CredentialError`.
"""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sbus.core import codec  # noqa: E402
from sbus.core.credentials import CredentialError, Credentials, check_key, check_pattern  # noqa: E402

CREDS = [Credentials(4242, 1000, 100), Credentials(7, 0, 0), Credentials(2**31 - 1, 65534, 65534)]
PREFIXES = [b"", b"!/cred/1/2/3/"]
LIMIT = 4096  # a small limit so that the "over the limit" branch is reachable by the fuzzer


def check_packet(data: bytes) -> None:
    try:
        kind, key = codec.classify(data, LIMIT)
    except codec.ProtocolError:
        return
    assert len(data) <= LIMIT
    assert b"\0" not in key
    p = codec.parse(data, LIMIT)
    again = codec.encode(p, LIMIT * 2)
    assert codec.parse(again, LIMIT * 2) == p, (data, p, again)
    if kind in (codec.MSG, codec.CMSG):
        assert again == data, (data, again)


def check_credentials(data: bytes) -> None:
    pattern = data.split(b"\0", 1)[0]
    for cred in CREDS:
        for prefix in PREFIXES:
            try:
                stored = check_pattern(pattern, cred, prefix)
            except CredentialError:
                continue
            own = prefix + b"!/cred/%d/%d/%d/" % (cred.gid, cred.uid, cred.pid)
            if pattern.startswith(b"!/cred/"):
                assert stored.startswith(own), (pattern, stored, own)
            else:
                assert stored == pattern, (pattern, stored)
            assert check_pattern(stored, cred, prefix) == stored, (pattern, stored)
    try:
        check_key(pattern)
    except CredentialError:
        pass


def TestOneInput(data: bytes) -> None:
    check_packet(data)
    check_credentials(data[4:] if data[:4] == b"SUB " else data)


SEEDS = [b"SUB ", b"SUB a/*/c/", b"UNSUB x\0y", b"MSG k\0p", b"MSG \0", b"CMSG !/cred/whoami", b"CMSG echo/off\0x",
         b"!/cred/100/1000/4242/x", b"!/cred////", b"!/cred/*/*/*/", b"!/cred/0100/1000/4242/", b"a/!/b", b"!/cr",
         b"!/cred/1/2/3/!/cred/100/1000/4242/k", b"!/cred/+100/1000/4242/", b"!/cred/100/1000/4242"]


def plain(runs: int, seed: int) -> None:
    rnd = random.Random(seed)
    alphabet = b"!/*cred0123456789 +-\0SUBMSGCUNa"
    for i in range(runs):
        base = bytearray(rnd.choice(SEEDS))
        for _ in range(rnd.randint(0, 6)):
            op = rnd.randrange(4)
            pos = rnd.randint(0, len(base))
            if op == 0:
                base[pos:pos] = bytes([rnd.choice(alphabet)])
            elif op == 1 and base:
                del base[min(pos, len(base) - 1)]
            elif op == 2:
                base[pos:pos] = rnd.choice(SEEDS)
            else:
                base[pos:pos] = os.urandom(rnd.randint(1, 4))
        if rnd.random() < 0.01:
            base += b"x" * LIMIT
        TestOneInput(bytes(base))
        if i and i % 100000 == 0:
            print(f"{i} inputs", file=sys.stderr)
    print(f"plain fuzzing: {runs} inputs, no property violated")


def main() -> None:
    if "--plain" in sys.argv:
        runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 100000
        plain(runs, int(os.environ.get("SEED", "1")))
        return
    try:
        import atheris
    except ImportError:
        print("atheris is not installed (pip install atheris); running the plain random loop", file=sys.stderr)
        plain(100000, 1)
        return
    with atheris.instrument_imports():
        pass  # the sbus modules are imported above; instrument them explicitly:
    import sbus.core.codec
    import sbus.core.credentials
    atheris.instrument_func(sbus.core.codec.classify)
    atheris.instrument_func(sbus.core.codec.parse)
    atheris.instrument_func(sbus.core.credentials.check_pattern)
    atheris.instrument_func(sbus.core.credentials._bad_bang)
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
