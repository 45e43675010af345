"""Secret keys and credentials through a real server (docs/protocol.md "Credentials and secret keys").

Owners and spies live in separate processes (`Agent` forks), so their pids
differ; the publisher is the test process itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from helpers import (  # noqa: F401
    Agent, Disconnected, connect, mbus, msg, recv, send, served, sub, sync, unique, unsub,
    wait_offender_logged,
)

CRED_WORDS = ("cred", "!", "secret", "forbid", "permi", "allow", "refus", "reject", "invalid")


def _fill(template: str, g: int, u: int, p: int) -> bytes:
    return template.format(G=g, U=u, P=p, P1=p + 1, U1=u + 1000, G1=g + 1000, PARENT=os.getpid()).encode()


def test_secret_reaches_its_owner_only(mbus):
    owner = Agent(mbus.address)
    try:
        g, u, p = owner.whoami()
        assert p == owner.pid
        mine = b"!/cred/%d/%d/%d/" % (g, u, p)
        marker = unique("marker/").encode()
        owner.send(sub(mine), sub(marker))
        assert owner.sync() == []

        spy_patterns = [
            b"", b"*", b"*/", b"!", b"!/", b"!/*", b"!/*/", b"!/cred", b"*/cred/", b"*/cred/*/*/*/",
            b"*/*/*/*/*/", b"*/*/*/*/*/*", b"*/*/*/*/*/*/",
            b"!/cred/*/*/*/", b"!/cred/%d/%d/*/" % (g, u), b"!/cred/", b"!/cred/%d/%d/" % (g, u),
            mine, mine + b"x/*", mine + b"x/y",                # the owner's keys, from another pid
            b"!/cred////", b"!/cred/%d/%d//" % (g, u),         # legal: filled with the spy's own pid
        ]
        spies = []
        for pattern in spy_patterns:
            s = connect(mbus.address)
            try:
                send(s, sub(pattern), sub(marker))
                sync(s)
                spies.append((pattern, s))
            except (Disconnected, BrokenPipeError, ConnectionResetError):
                s.close()  # a forbidden subscription may cost the spy its connection

        # the legal ones are not disconnected
        connected = {pat for pat, _ in spies}
        for legal in (b"", b"*", b"*/", b"*/*/*/*/*/", b"!/cred////", b"!/cred/%d/%d//" % (g, u)):
            assert legal in connected, legal

        pub = connect(mbus.address)
        secrets = [msg(mine + b"x/y", b"s1"), msg(mine, b"s2"), msg(mine + b"x/y/z", b"s3\0s3")]
        send(pub, *secrets, msg(marker, b"m"))
        assert [owner.recv() for _ in secrets] == secrets
        assert owner.recv() == msg(marker, b"m")
        for pattern, s in spies:
            assert recv(s) == msg(marker, b"m"), f"spy {pattern!r} got a secret"
            assert sync(s) == []
            s.close()
        # anyone may publish to a secret key: the publisher is still served
        assert sync(pub) == []
        pub.close()
    finally:
        owner.kill()


def test_secret_between_two_processes(mbus):
    """Both directions of the README's identity exchange, across processes."""
    a, b = Agent(mbus.address), Agent(mbus.address)
    try:
        ca, cb = a.whoami(), b.whoami()
        assert ca[2] == a.pid and cb[2] == b.pid and a.pid != b.pid
        a.send(sub(b"!/cred/%d/%d/%d/" % ca))
        b.send(sub(b"!/cred/%d/%d/%d/" % cb))
        a.sync()
        b.sync()
        b.send(msg(b"!/cred/%d/%d/%d/hello" % ca, b"from b"))
        a.send(msg(b"!/cred/%d/%d/%d/hello" % cb, b"from a"))
        assert a.recv() == msg(b"!/cred/%d/%d/%d/hello" % ca, b"from b")
        assert b.recv() == msg(b"!/cred/%d/%d/%d/hello" % cb, b"from a")
        assert a.sync() == [] and b.sync() == []
    finally:
        a.kill()
        b.kill()


ACCEPTED = [
    # (subscription template, key template that must reach it)
    ("!/cred/{G}/{U}/{P}/", "!/cred/{G}/{U}/{P}/k"),
    ("!/cred////", "!/cred/{G}/{U}/{P}/k"),
    ("!/cred/{G}///", "!/cred/{G}/{U}/{P}/k"),
    ("!/cred//{U}//", "!/cred/{G}/{U}/{P}/k/l/"),
    ("!/cred///{P}/", "!/cred/{G}/{U}/{P}/"),
    ("!/cred////sub/", "!/cred/{G}/{U}/{P}/sub/x"),
    ("!/cred/{G}/{U}/{P}/a/*/", "!/cred/{G}/{U}/{P}/a/b/c"),
    ("!/cred/{G}/{U}/{P}/exact", "!/cred/{G}/{U}/{P}/exact"),
]


@pytest.mark.parametrize("template,key", ACCEPTED)
def test_accepted_secret_subscription(mbus, template, key):
    with Agent(mbus.address) as a:
        g, u, p = a.whoami()
        assert (g, u) == (os.getgid(), os.getuid())  # 0/0 here: id 0 accepted too
        marker = unique("marker/").encode()
        a.send(sub(_fill(template, g, u, p)), sub(marker))
        assert a.sync() == []  # not disconnected
        pub = connect(mbus.address)
        other_pid = _fill(key, g, u, p).replace(b"/%d/" % p, b"/%d/" % (p + 1), 1)
        send(pub, msg(other_pid, b"not for a"), msg(_fill(key, g, u, p), b"for a"), msg(marker))
        # empty fields were filled with a's own ids, not turned into wildcards
        assert a.recv() == msg(_fill(key, g, u, p), b"for a")
        assert a.recv() == msg(marker)
        assert a.sync() == []
        pub.close()


FORBIDDEN = [
    # '*' in a field
    "!/cred/*/{U}/{P}/", "!/cred/{G}/*/{P}/", "!/cred/{G}/{U}/*/", "!/cred/*/*/*/", "!/cred/{G}/{U}/*",
    "!/cred/*//{P}/",
    # another pid
    "!/cred/{G}/{U}/1/", "!/cred/{G}/{U}/{P1}/", "!/cred/{G}/{U}/{PARENT}/", "!/cred///{PARENT}/",
    # another uid / gid
    "!/cred/{G}/{U1}/{P}/", "!/cred/{G1}/{U}/{P}/", "!/cred//{U1}//", "!/cred/{G1}///",
    # truncated
    "!/cred/", "!/cred//", "!/cred///", "!/cred/{G}", "!/cred/{G}/", "!/cred/{G}/{U}", "!/cred/{G}/{U}/",
    "!/cred/{G}/{U}/{P}", "!/cred//{U}/",
    # not numbers
    "!/cred/+{G}/{U}/{P}/", "!/cred/{G}/{U}/+{P}/", "!/cred/ {G}/{U}/{P}/", "!/cred/{G}/{U}/-{P}/",
    "!/cred/{G}/{U}/{P}x/", "!/cred/{G}/{U}/{P}.0/", "!/cred/{G}/{U}/0x{P:x}/",
]

PADDED = ["!/cred/0{G}/{U}/{P}/", "!/cred/{G}/0{U}/{P}/", "!/cred/{G}/{U}/0{P}/", "!/cred/{G}/{U}/00{P}/"]


def _assert_refused(bus, template):
    with Agent(bus.address) as a:
        g, u, p = a.whoami()
        pattern = _fill(template, g, u, p)
        a.send(sub(pattern))
        assert a.wait_closed(), f"{pattern!r} accepted"
        wait_offender_logged(bus, p, u, CRED_WORDS)
    served(bus.address)


@pytest.mark.parametrize("template", FORBIDDEN)
def test_forbidden_secret_subscription_disconnects(mbus, template):
    _assert_refused(mbus, template)


@pytest.mark.parametrize("template", PADDED)
def test_zero_padded_ids_are_refused(mbus, template):
    """`007` for 7 is not the client's id as the server writes it (issue brief: padded => refused)."""
    _assert_refused(mbus, template)


def test_refused_subscription_leaves_no_trace(mbus):
    """A client refused for `!/cred/*/*/*/` must not have had that pattern stored on the way out."""
    with Agent(mbus.address) as owner:
        g, u, p = owner.whoami()
        owner.send(sub(b"!/cred/%d/%d/%d/" % (g, u, p)))
        owner.sync()
        spy = connect(mbus.address)
        marker = unique("marker/").encode()
        # either disconnected (then the secret cannot reach it) or it must never match
        try:
            send(spy, sub(marker), sub(b"!/cred/*/*/*/"))
            sync(spy)
        except (Disconnected, BrokenPipeError, ConnectionResetError):
            spy.close()
            return
        pub = connect(mbus.address)
        send(pub, msg(b"!/cred/%d/%d/%d/x" % (g, u, p), b"s"), msg(marker))
        assert recv(spy) == msg(marker)
        pub.close()
        spy.close()


@pytest.fixture
def world_bus(start_bus):
    """A bus in a directory anyone can enter, socket mode 0777 (-g -o)."""
    d = tempfile.mkdtemp(prefix="sbus-world-")
    os.chmod(d, 0o755)
    try:
        yield start_bus("-g", "-o", address=os.path.join(d, "bus.socket"))
    finally:
        shutil.rmtree(d, ignore_errors=True)


NOBODY = 65534


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch to another uid")
def test_multi_digit_uid_and_gid(world_bus):
    bus = world_bus
    nob = Agent(bus.address, uid=NOBODY, gid=NOBODY)
    root = Agent(bus.address)
    try:
        g, u, p = nob.whoami()
        assert (g, u, p) == (NOBODY, NOBODY, nob.pid)
        rg, ru, rp = root.whoami()
        assert (rg, ru) == (0, 0)
        mine = b"!/cred/%d/%d/%d/" % (g, u, p)
        nob.send(sub(mine), sub(b"!/cred////filled/"))
        assert nob.sync() == []
        root.send(sub(b"!/cred/0/0/%d/" % rp))
        assert root.sync() == []
        # root publishes to nobody's key, nobody to root's: each gets its own only
        root.send(msg(mine + b"a", b"to nobody"), msg(mine + b"filled/x", b"filled"))
        nob.send(msg(b"!/cred/0/0/%d/b" % rp, b"to root"))
        assert nob.recv() == msg(mine + b"a", b"to nobody")
        assert nob.recv() == msg(mine + b"filled/x", b"filled")
        assert root.recv() == msg(b"!/cred/0/0/%d/b" % rp, b"to root")
        assert nob.sync() == [] and root.sync() == []
    finally:
        nob.kill()
        root.kill()

    # refusals name the multi-digit uid in the log
    for who, template in [
        ("nobody", "!/cred/0/{U}/{P}/"),       # gid 0 is not nobody's
        ("nobody", "!/cred/{G}/0/{P}/"),       # uid 0 is not nobody's
        ("root", "!/cred/65534/65534/{P}/"),   # root is not nobody
        ("root", "!/cred//65534//"),
    ]:
        kw = {"uid": NOBODY, "gid": NOBODY} if who == "nobody" else {}
        with Agent(bus.address, **kw) as a:
            g, u, p = a.whoami()
            a.send(sub(_fill(template, g, u, p)))
            assert a.wait_closed(), (who, template)
            wait_offender_logged(bus, p, u, CRED_WORDS)
    served(bus.address)


def test_unsub_of_a_filled_in_pattern(mbus):
    """`UNSUB !/cred////` removes what `SUB !/cred////` stored (the same fill-in applies)."""
    with Agent(mbus.address) as a:
        g, u, p = a.whoami()
        marker = unique("marker/").encode()
        a.send(sub(b"!/cred////x/"), sub(marker))
        a.sync()
        pub = connect(mbus.address)
        key = b"!/cred/%d/%d/%d/x/1" % (g, u, p)
        send(pub, msg(key, b"held"))
        assert a.recv() == msg(key, b"held")
        a.send(b"UNSUB !/cred////x/")
        assert a.sync() == []  # not disconnected
        send(pub, msg(key, b"after unsub"), msg(marker))
        assert a.recv() == msg(marker), "UNSUB !/cred////x/ did not remove the filled-in subscription"
        pub.close()


SECRET_LOOKING = [
    b"!/cred/%(G)d/%(U)d/%(P)d/x", b"!/cred/%(G)d/%(U)d/0%(P)d/x", b"!/cred////x", b"!/cred////",
    b"!/cred/%(G)d/%(U)d/%(P)d", b"!/cred/", b"!/cred/a/b/c/d", b"!/cred/%(G)d/%(U)d/%(P)d/!/cred/1/2/3/x",
]


@pytest.mark.parametrize("key", SECRET_LOOKING)
def test_secret_looking_keys_never_reach_catch_all_patterns(mbus, key):
    """Whatever the server does with these (deliver to the owner, refuse the
    publisher), clients holding only non-secret patterns never get them."""
    with Agent(mbus.address) as owner:
        g, u, p = owner.whoami()
        key = key % {b"G": g, b"U": u, b"P": p}
        spies = []
        marker = unique("marker/").encode()
        for pattern in (b"", b"*/", b"!/", b"*/*/*/*/", b"*/*/*/*/*/", b"*/*/*/*/*/*/"):
            s = connect(mbus.address)
            try:
                send(s, sub(pattern), sub(marker))
                sync(s)
                spies.append((pattern, s))
            except (Disconnected, BrokenPipeError, ConnectionResetError):
                s.close()
        assert len(spies) >= 4
        pub = connect(mbus.address)
        try:
            send(pub, msg(key, b"secret?"))
            sync(pub)
        except (Disconnected, BrokenPipeError, ConnectionResetError):
            pass  # refusing the publisher is fine too
        send(connect(mbus.address), msg(marker, b"m"))
        for pattern, s in spies:
            # the marker came from another client: drain until it, nothing secret before
            assert recv(s) == msg(marker, b"m"), f"{pattern!r} got {key!r}"
            s.close()
        pub.close()


def test_owner_gets_one_copy_and_fill_in_counts_as_a_duplicate(mbus):
    with Agent(mbus.address) as a:
        g, u, p = a.whoami()
        mine = b"!/cred/%d/%d/%d/" % (g, u, p)
        marker = unique("marker/").encode()
        # the same stored pattern twice (once written out, once filled in), plus catch-alls
        a.send(sub(mine), sub(b"!/cred////"), sub(b"!/cred/%d///" % g), sub(b""), sub(b"*/"), sub(marker))
        assert a.sync() == []
        pub = connect(mbus.address)
        send(pub, msg(mine + b"k", b"once"), msg(marker))
        assert a.recv() == msg(mine + b"k", b"once")
        assert a.recv() == msg(marker)
        # remove the catch-alls and two of the three secret instances: one is left
        a.send(unsub(b""), unsub(b"*/"), unsub(mine), unsub(b"!/cred////"))
        a.sync()
        send(pub, msg(mine + b"k", b"still"), msg(marker))
        assert a.recv() == msg(mine + b"k", b"still")
        assert a.recv() == msg(marker)
        a.send(unsub(mine))  # the last one (stored from "!/cred/G///")
        a.sync()
        send(pub, msg(mine + b"k", b"gone"), msg(marker))
        assert a.recv() == msg(marker)
        pub.close()
