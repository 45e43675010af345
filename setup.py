from setuptools import setup

setup(
    name="sbus",
    version="0.1.0",
    description="A local pub/sub message bus over Unix SOCK_SEQPACKET sockets, on Twisted",
    python_requires=">=3.11",
    packages=[
        "sbus",
        "sbus.core",
        "sbus.server",
        "sbus.client",
        "sbus.services",
        "sbus.pipeline",
        "twisted.plugins",
    ],
    install_requires=["twisted>=24.3", "zope.interface>=6"],
    extras_require={
        "test": [
            "pytest>=8", "pytest-twisted>=1.14", "hypothesis>=6", "pytest-timeout>=2",
            "pyspark>=4.0", "pyarrow>=15", "matplotlib>=3.8", "twisted[tls]>=24.3",
        ],
        # TLS for `twistd sbus-link` across hosts (kept out of the base install: the
        # OpenSSL import costs the server ~50 ms of start-up).
        "link": ["twisted[tls]>=24.3"],
        "pipeline": ["pyspark>=4.0", "pyarrow>=15", "matplotlib>=3.8"],
    },
    entry_points={
        "console_scripts": [
            "sbusd = sbus.server.sbusd:main",
            "sbus = sbus.cli:main",
            "sbus-replay = sbus.pipeline.replay:main",
            "sbus-pipeline = sbus.pipeline.cli:main",
        ],
    },
)
