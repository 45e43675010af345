"""Credentials, '!' rules and secret-pattern checks (docs/protocol.md "Credentials and secret keys")."""

import pytest

from sbus.core.credentials import (
    SECRET_ROOT,
    CredentialError,
    Credentials,
    check_key,
    check_pattern,
    is_secret,
    secret_prefix,
    whoami,
)

ME = Credentials(pid=1234, uid=1000, gid=100)
SLAVE = b"!/cred/100/1000/1111/"


def test_credentials_order_is_ucred():
    assert Credentials(1, 2, 3) == (1, 2, 3)
    assert Credentials(1, 2, 3).pid == 1 and Credentials(1, 2, 3).gid == 3


def test_whoami():
    assert whoami(b"", ME) == b"!/cred/100/1000/1234"
    assert whoami(b"", Credentials(0, 0, 0)) == b"!/cred/0/0/0"
    assert whoami(b"", Credentials(4194304, 65534, 12)) == b"!/cred/12/65534/4194304"
    assert whoami(SLAVE, Credentials(19211, 1000, 1000)) == b"!/cred/100/1000/1111/!/cred/1000/1000/19211"
    assert secret_prefix(b"", ME) == b"!/cred/100/1000/1234/"
    assert secret_prefix(SLAVE, ME) == SLAVE + b"!/cred/100/1000/1234/"


def test_is_secret():
    assert SECRET_ROOT == b"!/cred/"
    assert is_secret(b"!/cred/1/2/3/x")
    assert is_secret(b"!/cred/")
    assert not is_secret(b"!/cred")
    assert not is_secret(b"x/!/cred/1/2/3/")


@pytest.mark.parametrize(
    "key",
    [b"", b"a", b"a!b", b"!x/y", b"x/!y", b"!!", b"a/!!/b", b"!/cred/1/2/3/x", b"!/cred/1/2",
     b"!/cred/x/y/z/k", b"!/cred/", b"x/!/cred/1/2/3/y", b"!/cred/1/2/3/!/cred/4/5/6/z", b"a/b!"],
)
def test_valid_keys(key):
    check_key(key)


@pytest.mark.parametrize("key", [b"a/!/b", b"!", b"x/!", b"!/", b"!/cre", b"!/cred", b"!/x", b"a/!/credx/",
                                 b"!/cred/1/2/3/!", b"!/cred/1/2/3/!/x"])
def test_invalid_keys(key):
    with pytest.raises(CredentialError) as e:
        check_key(key)
    assert str(e.value) == f"invalid use of '!' in key {repr(key)[1:]}"


def test_invalid_key_message():
    with pytest.raises(CredentialError, match=r"^invalid use of '!' in key 'a/!/b'$"):
        check_key(b"a/!/b")


@pytest.mark.parametrize(
    "pattern",
    [b"", b"*", b"a!b", b"!x/y", b"x/!y", b"!", b"!/", b"!/c", b"!/cr", b"!/cre", b"!/cred", b"x/!",
     b"a/!/cr", b"*/", b"*/cred/*/", b"x/!/cred/1/2/3/y"],
)
def test_ordinary_patterns_unchanged(pattern):
    assert check_pattern(pattern, ME) == pattern


@pytest.mark.parametrize("pattern", [b"a/!/b", b"!/x", b"!/credx", b"!/cre/", b"x/!/y/", b"!*/!/a"])
def test_invalid_patterns(pattern):
    with pytest.raises(CredentialError) as e:
        check_pattern(pattern, ME)
    assert str(e.value) == f"invalid use of '!' in pattern {repr(pattern)[1:]}"


@pytest.mark.parametrize(
    "pattern,stored",
    [
        (b"!/cred////", b"!/cred/100/1000/1234/"),
        (b"!/cred///1234/x", b"!/cred/100/1000/1234/x"),
        (b"!/cred/100//1234/x/*", b"!/cred/100/1000/1234/x/*"),
        (b"!/cred/100/1000/1234/", b"!/cred/100/1000/1234/"),
        (b"!/cred/100/1000//a/b/", b"!/cred/100/1000/1234/a/b/"),
        (b"!/cred////!", b"!/cred/100/1000/1234/!"),
        (b"!/cred////!/cred/5/6/7/x", b"!/cred/100/1000/1234/!/cred/5/6/7/x"),
        (b"!/cred////a\nb", b"!/cred/100/1000/1234/a\nb"),  # DOTALL tail
    ],
)
def test_secret_patterns_filled(pattern, stored):
    assert check_pattern(pattern, ME) == stored


def test_id_zero_and_multi_digit():
    root = Credentials(pid=0, uid=0, gid=0)
    assert check_pattern(b"!/cred/0/0/0/x", root) == b"!/cred/0/0/0/x"
    assert check_pattern(b"!/cred////x", root) == b"!/cred/0/0/0/x"
    big = Credentials(pid=4194304, uid=65534, gid=4294967294)
    assert check_pattern(b"!/cred/4294967294/65534/4194304/", big) == b"!/cred/4294967294/65534/4194304/"
    with pytest.raises(CredentialError, match="is not the client's gid 4294967294"):
        check_pattern(b"!/cred/429496729/65534/4194304/", big)


@pytest.mark.parametrize(
    "pattern,message",
    [
        (b"!/cred/", "secret pattern '!/cred/' is truncated"),
        (b"!/cred/1", "secret pattern '!/cred/1' is truncated"),
        (b"!/cred/1/2", "secret pattern '!/cred/1/2' is truncated"),
        (b"!/cred/100/1000/1234", "secret pattern '!/cred/100/1000/1234' is truncated"),
        (b"!/cred///", "secret pattern '!/cred///' is truncated"),
        (b"!/cred/*/1000/1234/", "secret pattern field gid '*' may not be a wildcard"),
        (b"!/cred/100/*/1234/", "secret pattern field uid '*' may not be a wildcard"),
        (b"!/cred/100/1000/*/", "secret pattern field pid '*' may not be a wildcard"),
        (b"!/cred/100/1000/12*/", "secret pattern field pid '12*' may not be a wildcard"),
        (b"!/cred/100/1000/01234/", "secret pattern field pid '01234' is not the client's pid 1234"),
        (b"!/cred/100/1000/+1234/", "secret pattern field pid '+1234' is not the client's pid 1234"),
        (b"!/cred/100/1000/ 1234/", "secret pattern field pid ' 1234' is not the client's pid 1234"),
        (b"!/cred/100/1000/1235/", "secret pattern field pid '1235' is not the client's pid 1234"),
        (b"!/cred/100/1001/1234/", "secret pattern field uid '1001' is not the client's uid 1000"),
        (b"!/cred/0/1000/1234/", "secret pattern field gid '0' is not the client's gid 100"),
        (b"!/cred/100/1000/12345/", "secret pattern field pid '12345' is not the client's pid 1234"),
        (b"!/cred/1x0/1000/1234/", "secret pattern field gid '1x0' is not the client's gid 100"),
        (b"!/cred////a/!/b", "invalid use of '!' in pattern '!/cred////a/!/b'"),
    ],
)
def test_secret_rejections(pattern, message):
    with pytest.raises(CredentialError) as e:
        check_pattern(pattern, ME)
    assert str(e.value) == message


def test_leading_zero_pid_seven():
    seven = Credentials(pid=7, uid=1, gid=1)
    with pytest.raises(CredentialError) as e:
        check_pattern(b"!/cred/1/1/007/", seven)
    assert str(e.value) == "secret pattern field pid '007' is not the client's pid 7"


def test_slave_prefix_chain():
    # a client of a slave whose own whoami on its master is SLAVE[:-1]
    assert check_pattern(SLAVE + b"!/cred////x", ME, SLAVE) == SLAVE + b"!/cred/100/1000/1234/x"
    # the tail may name another process (the one it talks with)
    assert check_pattern(SLAVE + b"!/cred////!/cred/9/9/9/", ME, SLAVE) == SLAVE + b"!/cred/100/1000/1234/!/cred/9/9/9/"
    assert check_pattern(SLAVE + b"!/cred/100/1000/1234/", ME, SLAVE) == SLAVE + b"!/cred/100/1000/1234/"
    # two levels
    deeper = SLAVE + b"!/cred/5/5/5/"
    assert check_pattern(deeper + b"!/cred////", ME, deeper) == deeper + b"!/cred/100/1000/1234/"
    # ordinary patterns on a slave are untouched
    assert check_pattern(b"a/!/cr", ME, SLAVE) == b"a/!/cr"


def test_slave_local_form():
    """Issue 11 item 4: below a master, a secret pattern without the prefix is the client's
    local form (its ids on this server) and lands in its own space, as on a master. It used
    to be refused, so `!/cred////...` disconnected clients of relays."""
    assert check_pattern(b"!/cred////x", ME, SLAVE) == SLAVE + b"!/cred/100/1000/1234/x"
    assert check_pattern(b"!/cred////", ME, SLAVE) == SLAVE + b"!/cred/100/1000/1234/"
    assert check_pattern(b"!/cred/100/1000/1234/y*", ME, SLAVE) == SLAVE + b"!/cred/100/1000/1234/y*"
    assert check_pattern(b"!/cred//1000//!/cred/9/9/9/", ME, SLAVE) == SLAVE + b"!/cred/100/1000/1234/!/cred/9/9/9/"
    # the local form names the client's ids, nobody else's: the relay's own pid is not its pid
    with pytest.raises(CredentialError, match="field pid '1111' is not the client's pid 1234"):
        check_pattern(b"!/cred/100/1000/1111/x", ME, SLAVE)
    with pytest.raises(CredentialError, match="field pid '\\*' may not be a wildcard"):
        check_pattern(b"!/cred//1000/*/", ME, SLAVE)
    for truncated in (b"!/cred/", b"!/cred/1", b"!/cred/100/1000/1234", b"!/cred/7/"):
        with pytest.raises(CredentialError) as e:
            check_pattern(truncated, ME, SLAVE)
        assert str(e.value) == f"secret pattern {truncated!r}"[:-1].replace("b'", "'", 1) + "' is truncated"


def test_slave_rejections():
    with pytest.raises(CredentialError, match="is truncated$"):
        check_pattern(SLAVE, ME, SLAVE)
    with pytest.raises(CredentialError, match="is truncated$"):
        check_pattern(SLAVE + b"!/cred/1", ME, SLAVE)
    with pytest.raises(CredentialError, match="field pid '1111' is not the client's pid 1234"):
        check_pattern(SLAVE + b"!/cred/100/1000/1111/", ME, SLAVE)


def test_long_values_shortened_in_messages():
    with pytest.raises(CredentialError) as e:
        check_key(b"x" * 1000 + b"/!/b")
    assert len(str(e.value)) < 300 and "1004 bytes" in str(e.value)
