"""The README's and docs/clients.md's examples work as written, from a fresh clone's layout.

The README's commands use `.venv/bin/...` (what `make run` installs) and a bus on
`./sbus.socket` (what `make run` serves). The test builds that layout in a temporary
"clone": a real server on its `sbus.socket`, and a `.venv/bin` whose commands run this
tree's code with the interpreter running the tests. The examples run in bash as pasted,
from other directories where they say they can, and must leave nothing behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, child_env

TIMEOUT = 60
DOCS = [Path(REPO) / "README.md", *sorted((Path(REPO) / "docs").glob("*.md"))]


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), re.S)


@pytest.fixture
def clone(tmp_path, start_bus):
    """A fresh clone's layout after `make run`: .venv/bin commands and a bus on ./sbus.socket."""
    root = tmp_path / "clone"
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    scripts = {
        "sbus": "-m sbus.cli",
        "sbusd": "-m sbus.server.sbusd",
        "twistd": "-c 'import sys; from twisted.scripts.twistd import run; sys.argv[0] = \"twistd\"; run()'",
        "python": "",
    }
    for name, args in scripts.items():
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\nexec {sys.executable} {args} \"$@\"\n")
        script.chmod(0o755)
    bus = start_bus(address=str(root / "sbus.socket"))
    tmp = tmp_path / "tmpdir"  # $TMPDIR for the examples: must be empty again afterwards
    tmp.mkdir()
    env = child_env()
    env.pop("SBUS_SOCKET", None)
    env["TMPDIR"] = str(tmp)
    return root, bus, env, tmp


def _run(script: str, cwd, env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], cwd=cwd, env=env, capture_output=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


def test_readme_script_example(clone):
    root, bus, env, tmp = clone
    (fifo_block,) = [b for b in blocks(Path(REPO) / "README.md", "sh") if "--ready-file" in b]
    before = _files(root)
    r = _run(fifo_block, root, env)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == b"greetings/world hello, bus\n"  # what the subscriber printed
    assert _files(root) == before, "the example left files behind in the clone"
    assert not list(tmp.iterdir()), "the example left files behind in $TMPDIR"


def test_readme_python_example_from_any_directory(clone, tmp_path):
    root, bus, env, tmp = clone
    (code,) = blocks(Path(REPO) / "README.md", "python")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(env, SBUS_SOCKET=str(root / "sbus.socket"))
    r = subprocess.run([str(root / ".venv" / "bin" / "python"), "-c", code], cwd=elsewhere, env=env,
                       capture_output=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode() == "Message(key=b'greetings/world', payload=b'hello, bus')\n"
    assert not list(elsewhere.iterdir())


def test_readme_more_commands(clone):
    """Every `.venv/bin/X` the README names exists after `make run`, and the help commands work."""
    root, bus, env, tmp = clone
    readme = (Path(REPO) / "README.md").read_text()
    named = set(re.findall(r"\.venv/bin/([\w-]+)", readme))
    setup = (Path(REPO) / "setup.py").read_text()
    console = set(re.findall(r'"([\w-]+) = [\w.]+:\w+"', setup))
    assert named - {"twistd", "python", "pip", "activate"} <= console, named
    for cmd in ("twistd sbus --help", "sbusd -h", "sbus --help", "sbus top --help"):
        argv = cmd.split()
        r = subprocess.run([str(root / ".venv" / "bin" / argv[0]), *argv[1:]], cwd=root, env=env,
                           capture_output=True, timeout=TIMEOUT)
        assert r.returncode == 0, (cmd, r.stderr.decode())
        assert b"Traceback" not in r.stderr


def test_readme_states_platform_and_prerequisites():
    readme = (Path(REPO) / "README.md").read_text()
    for needle in ("Linux only", "Python 3.11", "Java 17", "make"):
        assert needle in readme, needle
    # the "More" section: no bare twistd/sbusd a newcomer does not have on PATH
    more = readme.split("## More", 1)[1]
    bare = re.findall(r"`(twistd|sbusd)\b[^`]*`", more)
    assert not bare, bare


def test_clients_doc_shell_example(clone):
    """docs/clients.md's --ready-file script, as written there, with the commands on PATH."""
    root, bus, env, tmp = clone
    doc = Path(REPO) / "docs" / "clients.md"
    (script,) = [b for b in blocks(doc, "sh") if "mkfifo" in b]
    env = dict(env, SBUS_SOCKET=str(root / "sbus.socket"),
               PATH=f"{root / '.venv' / 'bin'}{os.pathsep}{env['PATH']}")
    work = root / "work"
    work.mkdir()
    r = _run(script, work, env)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == b"sensors/a 1\nsensors/b 2\nsensors/c 3\n"
    assert not list(work.iterdir()) and not list(tmp.iterdir()), "left files behind"


# Being fixed elsewhere this round: the doc says so, the test waits for it (remove when done).
PENDING: dict[str, str] = {}


def test_clients_doc_python_examples(clone, tmp_path):
    """Every Python example of docs/clients.md runs as written, from another directory,
    against the bus named by $SBUS_SOCKET (the doc's set-up exports it)."""
    root, bus, env, tmp = clone
    examples = blocks(Path(REPO) / "docs" / "clients.md", "python")
    assert len(examples) >= 4
    env = dict(env, SBUS_SOCKET=str(root / "sbus.socket"))
    for code in examples:
        r = subprocess.run([str(root / ".venv" / "bin" / "python"), "-c", code], cwd=tmp_path, env=env,
                           capture_output=True, timeout=TIMEOUT)
        assert r.returncode == 0, (code, r.stderr.decode())
        assert b"!/cred/" in r.stdout or b"Message(" in r.stdout, (code, r.stdout)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_cite_nothing_outside_the_repository(doc):
    text = doc.read_text()
    if doc.name in PENDING and re.search(r"shared/tools", text):
        pytest.xfail(PENDING[doc.name])
    for pattern in (r"shared/(seeds|spec|tools)", r"NOTES(\.md)? ?§", r"sbus-README\.txt", r"\.\./shared",
                    r"DESIGN\.md", r"STYLE\.md"):
        assert not re.search(pattern, text), (doc.name, pattern)
    # relative links point at files that exist
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (doc.parent / link).exists(), (doc.name, link)


# ---------------------------------------------------------------- man pages

MAN = Path(REPO) / "docs" / "man"


@pytest.mark.parametrize("page", sorted(p.name for p in MAN.glob("*.[18]")))
def test_man_page_renders_cleanly(page):
    import shutil
    groff = shutil.which("groff")
    if groff is None:
        pytest.skip("groff is not installed (apt-get install groff-base)")
    r = subprocess.run([groff, "-man", "-ww", "-z", "-Tutf8", str(MAN / page)], capture_output=True,
                       timeout=TIMEOUT, env=dict(os.environ, LC_ALL="C.UTF-8"))
    assert r.returncode == 0 and r.stderr == b"", r.stderr.decode()  # -ww: every warning shows
    r = subprocess.run([groff, "-man", "-Tutf8", str(MAN / page)], capture_output=True, timeout=TIMEOUT,
                       env=dict(os.environ, LC_ALL="C.UTF-8"))
    text = re.sub(r".\x08", "", r.stdout.decode())  # no overstrike
    for section in ("NAME", "SYNOPSIS", "DESCRIPTION", "EXIT STATUS", "SEE ALSO"):
        assert re.search(rf"^{section}$", text, re.M), section


def test_sbusd_man_page_has_every_option():
    """Each option letter sbusd parses has its own entry (.B -x or .BI -x arg) in sbusd.8."""
    src = (Path(REPO) / "sbus" / "server" / "sbusd.py").read_text()
    (spec,) = re.findall(r'getopt\.getopt\(argv, "([^"]+)"', src)
    page = (MAN / "sbusd.8").read_text().replace("\\-", "-")
    for letter in spec.replace(":", "") + "h":
        assert re.search(rf"^\.TP\n\.BI? -{letter}\b", page, re.M), letter


def test_sbus_man_page_has_every_command_and_option():
    import argparse
    from sbus.cli import build_parser
    page = (MAN / "sbus.1").read_text().replace("\\-", "-")
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, p in sub.choices.items():
        assert re.search(rf"\b{name}\b", page), name
        for action in p._actions:
            for opt in action.option_strings:
                if opt not in ("-h", "--help", "-b", "--bus"):
                    assert opt in page, (name, opt)


# ---------------------------------------------------------------- docs/queues.md, docs/request-reply.md


def _on_path(root, env) -> dict:
    return dict(env, SBUS_SOCKET=str(root / "sbus.socket"))


def test_request_reply_doc_examples(clone, tmp_path):
    """docs/request-reply.md's shell and Python examples, verbatim."""
    root, bus, env, tmp = clone
    doc = Path(REPO) / "docs" / "request-reply.md"
    (script,) = [b for b in blocks(doc, "sh") if "sbus serve" in b]
    before = _files(root)
    r = _run(script, root, env)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == b"it is 12 o clock (time/now)\nstatus 1\n", r.stdout
    assert r.stderr == b"sbus: no responders: nobody is subscribed to time/now\n", r.stderr
    assert _files(root) == before and not list(tmp.iterdir()), "left files behind"
    (code,) = blocks(doc, "python")
    r = subprocess.run([str(root / ".venv" / "bin" / "python"), "-c", code], cwd=tmp_path, env=_on_path(root, env),
                       capture_output=True, timeout=TIMEOUT)
    assert r.returncode == 0 and r.stdout == b"b'42'\n", r.stderr.decode()


def test_queues_doc_examples(clone, tmp_path):
    """docs/queues.md's shell example (it starts and stops its own sbus-queue) and its Python
    example (against a service with the group it names), verbatim."""
    from helpers import LoggedProcess

    root, bus, env, tmp = clone
    doc = Path(REPO) / "docs" / "queues.md"
    (script,) = [b for b in blocks(doc, "sh") if "sbus work" in b]
    before = _files(root)
    r = _run(script, root, env)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == (b"images/a.png: 1 (delivery 1)\nimages/b.png: 2 (delivery 1)\n"
                        b"images/c.png: 3 (delivery 1)\n"), r.stdout
    assert _files(root) == before and not list(tmp.iterdir()), "left files behind"
    (code,) = blocks(doc, "python")
    run = [str(root / ".venv" / "bin" / "python"), "-c", code]
    r = subprocess.run(run, cwd=tmp_path, env=_on_path(root, env), capture_output=True, timeout=TIMEOUT)
    assert r.returncode == 1 and r.stderr == b"no twistd sbus-queue serves the group thumbnails\n", r.stderr
    service = LoggedProcess([sys.executable, "-m", "twisted", "--log-format", "text", "sbus-queue", "--bus",
                             bus.address, "--group", "thumbnails=images/"], tmp_path / "queue.log")
    try:
        service.wait_log("control: following the members")
        r = subprocess.run(run, cwd=tmp_path, env=_on_path(root, env), capture_output=True, timeout=TIMEOUT)
        assert r.returncode == 0 and r.stdout == b"b'images/x.png' False\n", r.stderr.decode()
    finally:
        service.stop()
