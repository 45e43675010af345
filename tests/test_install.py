"""Every install path gives working commands: `pip install .` and `pip install -e .`, with
and without extras, one after the other into a venv that already has the project.

Each venv is real (`python -m venv`), and pip really builds and installs the project
(PEP 517/660, setuptools). To stay fast and offline, the dependencies are not downloaded:
a directory of symlinks to the running interpreter's installed distributions (exactly the
requirement closure of the extras asked for, so pyarrow is absent without [pipeline]) is
put on the venv's path with a .pth file, and pip runs with --no-index --no-build-isolation.
The checks run the console scripts and `twistd` from the venv's bin/, from a directory
outside the source tree, so nothing but the install can make them work.

Marked slow (about a minute): `make test PYTEST_ARGS='-m slow'`, or
`pytest -m slow tests/test_install.py` (the default run leaves it out).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 300
EXTRA_DEPS = {"base": (), "link": ("link",), "pipeline": ("pipeline",)}


def _closure(extras) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions sbus needs with `extras` (the build backend included)."""
    setup_py = (REPO / "setup.py").read_text()
    # The requirements as setup.py lists them, read without running setuptools' setup().
    import setuptools
    config: dict = {}
    real_setup, setuptools.setup = setuptools.setup, lambda **kw: config.update(kw)
    try:
        exec(compile(setup_py, "setup.py", "exec"), {"__name__": "setup_config"})  # noqa: S102
    finally:
        setuptools.setup = real_setup
    todo = [Requirement(r) for r in config["install_requires"]] + [Requirement("setuptools>=70.1")]
    for extra in extras:
        todo += [Requirement(r) for r in config["extras_require"][extra]]
    found: dict[str, importlib.metadata.Distribution] = {}
    seen_extras: set[tuple[str, str]] = set()
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{req.name} is not installed here (pip install -e '.[test]')")
        new = name not in found
        found[name] = dist
        wanted = [("", None)] if new else []
        wanted += [(e, e) for e in req.extras if (name, e) not in seen_extras]
        for label, extra in wanted:
            if extra:
                seen_extras.add((name, extra))
            for text in dist.requires or ():
                sub = Requirement(text)
                env = {"extra": extra or ""}
                if sub.marker is None:
                    ok = extra is None
                else:
                    ok = sub.marker.evaluate(env) and (extra is None) == ("extra" not in str(sub.marker))
                if ok:
                    todo.append(sub)
    return found


def _deps_dir(root: Path, extras) -> Path:
    """A site directory of symlinks to the closure's files; twisted/plugins without sbus's."""
    d = root / f"deps-{'-'.join(extras) or 'base'}"
    if d.exists():
        return d
    d.mkdir()
    for dist in _closure(extras).values():
        base = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops - {"__pycache__"}:
            if top.endswith(".pth") or (d / top).exists() or not (base / top).exists():
                continue
            if top == "twisted":
                # Twisted's own plugins only: an sbus installed in the running interpreter
                # must not make the venv under test look right.
                (d / top).mkdir()
                for entry in (base / top).iterdir():
                    if entry.name != "plugins":
                        (d / top / entry.name).symlink_to(entry)
                (d / top / "plugins").mkdir()
                for entry in (base / top / "plugins").iterdir():
                    if not entry.name.startswith(("sbus", "dropin")):
                        (d / top / "plugins" / entry.name).symlink_to(entry)
            else:
                (d / top).symlink_to(base / top)
    return d


class Venv:
    def __init__(self, root: Path, name: str, source: Path):
        self.root, self.source = root, source
        self.path = root / name
        venv.create(self.path, with_pip=False, symlinks=True)
        self.bin = self.path / "bin"
        self.python = self.bin / "python"
        (self.site,) = self.path.glob("lib/python*/site-packages")
        self.extras: set[str] = set()
        # Twisted, borrowed from the running interpreter, brings no script: twistd's, as pip writes it
        twistd = self.bin / "twistd"
        twistd.write_text(f"#!{self.python}\nimport sys\nfrom twisted.scripts.twistd import run\n"
                          "sys.exit(run())\n")
        twistd.chmod(0o755)
        self.workdir = root / f"{name}-cwd"
        self.workdir.mkdir()

    def pip_install(self, spec: str, extras=(), editable=False):
        """`pip install [-e] SOURCE[extras]`, dependencies from the symlinked site dirs."""
        self.extras.update(extras)
        lines = [str(_deps_dir(self.root, ()))] + [str(_deps_dir(self.root, (e,))) for e in sorted(self.extras)]
        (self.site / "_sbus_test_deps.pth").write_text("\n".join(lines) + "\n")
        target = f"{self.source}[{','.join(extras)}]" if extras else str(self.source)
        argv = [sys.executable, "-m", "pip", "--python", str(self.python), "install", "-q",
                "--no-index", "--no-build-isolation", *(["-e"] if editable else []), target]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, cwd=self.workdir,
                           env=_env())
        assert r.returncode == 0, f"{spec}: {r.stdout}\n{r.stderr}"
        warnings = [l for l in r.stderr.splitlines() if "deprecat" in l.lower() or "warning" in l.lower()]
        assert not warnings, f"{spec}: {r.stderr}"

    def run(self, *argv, **kw):
        return subprocess.run([str(self.bin / argv[0]), *argv[1:]], capture_output=True, text=True,
                              timeout=TIMEOUT, cwd=self.workdir, env=_env(), **kw)

    def check(self, what: str):
        """The commands work, in the venv alone."""
        r = self.run("twistd", "sbus", "--help")
        assert r.returncode == 0 and "Usage: twistd [options] sbus" in r.stdout, (what, r.stdout, r.stderr)
        r = self.run("twistd", "--help")
        for plugin in ("sbus-relay", "sbus-bridge", "sbus-link", "sbus-msgbus", "sbus-record", "sbus-queue"):
            assert plugin in r.stdout, (what, plugin, r.stdout)
        r = self.run("sbus", "--help")
        assert r.returncode == 0 and "pub" in r.stdout and "top" in r.stdout, (what, r.stdout, r.stderr)
        r = self.run("sbusd", "-h")
        assert r.returncode == 0 and "-a ADDRESS" in r.stdout and "Traceback" not in r.stderr, (what, r)
        r = self.run("sbus-pipeline", "--help")
        assert "Traceback" not in r.stderr, (what, r.stderr)
        if "pipeline" in self.extras:
            assert r.returncode == 0 and "usage" in r.stdout.lower(), (what, r.stdout, r.stderr)
        elif r.returncode != 0:  # one line naming the extra
            assert r.stderr.count("\n") == 1 and "sbus[pipeline]" in r.stderr, (what, r.stderr)
        else:  # or the help, which needs none of it
            assert "usage" in r.stdout.lower(), (what, r.stdout)
        for argv in (("sbus-replay", "--help"), ("twistd", "sbus-record", "--help")):
            r = self.run(*argv)
            assert "Traceback" not in r.stderr, (what, argv, r.stderr)
            assert r.returncode == 0 or ("sbus[pipeline]" in r.stderr and r.stderr.count("\n") == 1), \
                (what, argv, r.stderr)
        r = self.run("python", "-c", "import OpenSSL")
        if r.returncode != 0:  # no [link] extra here: TLS is one line naming it
            sock = self.root / "nothing.socket"
            r = self.run("twistd", "sbus-link", "--bus", str(sock), "--listen",
                         "ssl:0:privateKey=k.pem:certKey=c.pem:caCertsDir=ca")
            assert r.returncode != 0 and "Traceback" not in r.stderr, (what, r.stderr)
            assert "pip install 'sbus[link]'" in r.stderr and r.stderr.count("\n") == 1, (what, r.stderr)
        else:
            assert "link" in self.extras, what
        for page in ("man1/sbus.1", "man8/sbusd.8"):
            assert (self.path / "share" / "man" / page).is_file(), (what, page)
        # the right copy: editable installs run the source tree, regular ones site-packages
        r = self.run("python", "-c", "import sbus, twisted.plugins.sbus_plugins as p; print(sbus.__file__, p.__file__)")
        assert r.returncode == 0, (what, r.stderr)
        return r.stdout.split()


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "SBUS_SOCKET")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.pop("PIP_FIND_LINKS", None)
    return env


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A copy of the source tree, as a fresh clone would have it (the build writes into it)."""
    dst = tmp_path_factory.mktemp("src") / "sbus"
    shutil.copytree(REPO, dst, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
        "dropin.cache", "*.socket", "out"))
    return dst


def test_regular_then_editable_then_regular(tmp_path_factory, source):
    root = tmp_path_factory.mktemp("venvs")
    v = Venv(root, "a", source)
    v.pip_install(". (regular)")
    mod, plugins = v.check("pip install .")
    assert str(v.site) in mod and str(v.site) in plugins
    v.pip_install("-e .[pipeline] over a regular install", extras=("pipeline",), editable=True)
    mod, plugins = v.check("pip install -e .[pipeline]")
    assert mod.startswith(str(source)) and plugins.startswith(str(source))
    v.pip_install(". over an editable install")
    mod, plugins = v.check("pip install . again")
    assert str(v.site) in mod and str(v.site) in plugins
    assert not list((v.site / "twisted").glob("plugins/sbus_*.py")) or str(v.site) in plugins


def test_editable_then_regular_with_extras_then_editable(tmp_path_factory, source):
    root = tmp_path_factory.mktemp("venvs")
    v = Venv(root, "b", source)
    v.pip_install("-e .", editable=True)
    mod, plugins = v.check("pip install -e .")
    assert mod.startswith(str(source)) and plugins.startswith(str(source))
    v.pip_install(".[link] over an editable install", extras=("link",))
    mod, plugins = v.check("pip install .[link]")
    assert str(v.site) in plugins
    r = v.run("python", "-c", "import OpenSSL")
    assert r.returncode == 0, r.stderr
    v.pip_install("-e . over a regular install", editable=True)
    mod, plugins = v.check("pip install -e . again")
    assert plugins.startswith(str(source))
    # the regular install's plugin files went with it: only the source tree's remain
    assert not list((v.site / "twisted").glob("plugins/sbus_*.py"))
    # and the installed commands serve a bus
    sock = root / "b.socket"
    server = subprocess.Popen([str(v.bin / "sbusd"), "-f", "-a", str(sock)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, cwd=v.workdir, env=_env())
    try:
        assert server.stdout.read() == b""  # end of standard output: listening
        r = v.run("sbus", "--bus", str(sock), "whoami")
        assert r.returncode == 0 and r.stdout.startswith("!/cred/"), r.stderr
    finally:
        server.terminate()
        server.communicate(timeout=TIMEOUT)


def test_make_reinstalls_when_needed(tmp_path_factory, source):
    """`make run`/`make test` reinstall when setup.py or pyproject.toml change, or when the
    venv's sbus is not this tree's any more (a later `pip install .`), and not otherwise."""
    import time
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    tree = tmp_path_factory.mktemp("make") / "sbus"
    shutil.copytree(source, tree, symlinks=True)
    v = Venv(tree, ".venv", tree)  # the Makefile's own venv
    v.pip_install("-e . into the Makefile's venv", editable=True)
    for marker in (".installed", ".test-installed"):
        (tree / ".venv" / marker).touch()

    def plan(target):
        r = subprocess.run(["make", "-n", target], cwd=tree, capture_output=True, text=True, timeout=TIMEOUT,
                           env=_env())
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "pip install" not in plan("run") and "pip install" not in plan("test")
    later = time.time() + 5
    os.utime(tree / "setup.py", (later, later))  # an extra or an entry point changed
    assert "pip install -e ." in plan("run")
    assert "pip install -e '.[test]'" in plan("test")
    for marker in (".installed", ".test-installed"):
        os.utime(tree / ".venv" / marker, (later + 1, later + 1))
    assert "pip install" not in plan("test")
    v.pip_install(". over the Makefile's editable install")  # the venv no longer runs this tree
    assert "pip install -e '.[test]'" in plan("test")
