"""Options anywhere on an `sbus` command line: before, between and after the positionals of
every subcommand (issue 37: `sbus pub KEY --count 3 PAYLOAD` said "unrecognized arguments")."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys

import pytest

from sbus.cli import build_parser
from helpers import connect, msg, recv, send, sub, sync

#: subcommand -> (positionals, options with their values, positionals after a `--`).
#: Every subcommand of `sbus` must have a row (checked below).
CASES = {
    "pub": (["a/key", "payload"], [["--count", "3"], ["-r", "5"]], []),
    "sub": (["a/", "b/"], [["-n", "2"], ["--timeout", "4"], ["-F", "json"]], []),
    "whoami": ([], [["--bus", "/tmp/x.socket"]], []),
    "stats": ([], [["--json"], ["--wait", "2"]], []),
    "ping": ([], [["-n", "4"], ["-t", "3"]], []),
    "top": ([], [["-i", "2"], ["-n", "1"]], []),
    "request": (["svc/echo", "body"], [["-t", "3"], ["--raw"]], []),
    "serve": (["svc/"], [["-n", "2"], ["--ready-file", "/tmp/r"]], ["cat", "-n"]),
    "work": (["jobs"], [["-n", "2"], ["-t", "3"]], ["sh", "-c", "cat -n"]),
    "submit": (["jobs", "jobs/1", "body"], [["-t", "3"], ["--bus", "/tmp/x.socket"]], []),
}


def _subcommands() -> set[str]:
    """The subcommands `sbus --help` lists."""
    return set(re.findall(r"^    (\w+) ", build_parser().format_help(), re.M))


def _orders(positionals, options):
    """Every way to spread the options over the gaps around the positionals (each option's
    value stays right after it)."""
    gaps = len(positionals) + 1
    for places in itertools.product(range(gaps), repeat=len(options)):
        line = []
        for gap in range(gaps):
            line += [w for opt, where in zip(options, places) if where == gap for w in opt]
            if gap < len(positionals):
                line.append(positionals[gap])
        yield line


def test_every_subcommand_has_a_case():
    assert _subcommands() == set(CASES)


@pytest.mark.parametrize("command", sorted(CASES))
def test_options_before_between_and_after_the_positionals(command):
    positionals, options, after = CASES[command]
    tail = ["--", *after] if after else []
    parse = build_parser().parse_args
    reference = vars(parse([command, *(w for o in options for w in o), *positionals, *tail]))
    lines = list(_orders(positionals, options))
    assert len(lines) == (len(positionals) + 1) ** len(options)
    for line in lines:
        got = vars(parse([command, *line, *tail]))
        assert got == reference, (line, got, reference)
    # and every option took its value (a default would hide a lost option)
    for opt in options:
        without = [o for o in options if o is not opt]
        assert vars(parse([command, *(w for o in without for w in o), *positionals, *tail])) != reference, opt


def test_pub_options_between_key_and_payload_take_effect():
    ns = build_parser().parse_args(["pub", "k", "--count", "3", "PAYLOAD"])
    assert (ns.key, ns.message, ns.count) == ("k", "PAYLOAD", 3)


def test_a_rest_that_starts_with_a_word_stays_the_commands():
    """`serve PATTERN CMD -n 1` runs `CMD -n 1`, as before: only a rest that would begin with
    an option is read as our options up to the `--`."""
    ns = build_parser().parse_args(["serve", "svc/", "cat", "-n", "1", "--", "x"])
    assert ns.command_line == ["cat", "-n", "1", "--", "x"] and ns.count is None
    ns = build_parser().parse_args(["serve", "svc/", "-n", "1", "--", "cat", "-n"])
    assert ns.command_line == ["cat", "-n"] and ns.count == 1


def test_extra_positional_is_still_one_usage_error():
    result = subprocess.run([sys.executable, "-m", "sbus.cli", "pub", "k", "-n", "2", "a", "b"],
                            capture_output=True, timeout=30)
    err = result.stderr.decode()
    assert result.returncode == 2 and "unrecognized arguments: b" in err and "Traceback" not in err


def test_pub_count_between_key_and_payload_publishes_three(bus):
    """The command line of the issue, run against a real server."""
    s = connect(bus.address)
    send(s, sub("cli/args/"))
    sync(s)
    result = subprocess.run([sys.executable, "-m", "sbus.cli", "--bus", bus.address,
                             "pub", "cli/args/k", "--count", "3", "PAYLOAD"], capture_output=True, timeout=30)
    assert result.returncode == 0, result.stderr
    got = [recv(s, timeout=10) for _ in range(3)]
    assert got == [msg("cli/args/k", "PAYLOAD")] * 3
    send(s, msg("cli/args/end"))
    assert recv(s, timeout=10) == msg("cli/args/end")   # nothing more came before ours
