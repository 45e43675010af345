"""Checks shared by the twistd plugins' options: a bad value is one usage line."""

from __future__ import annotations

import os

from twisted.application.service import ServiceMaker
from twisted.python import usage

from sbus.respell import respell


#: What every service does when its bus is missing; its --help says so (issue 22).
MISSING_BUS_HELP = ("A bus that is not there (yet) is named once in the log, with its full path and "
                    "why; then the service retries quietly, with back-off.")


def positive_int(name: str, value: str) -> int:
    try:
        n = int(value, 10)
    except ValueError:
        raise usage.UsageError(f"--{name}: not an integer: {value!r}") from None
    if n <= 0:
        raise usage.UsageError(f"--{name}: must be positive, got {n}")
    return n


def positive_float(name: str, value: str, zero_ok: bool = False) -> float:
    try:
        n = float(value)
    except ValueError:
        raise usage.UsageError(f"--{name}: not a number: {value!r}") from None
    if not n > 0 and not (zero_ok and n == 0):
        raise usage.UsageError(f"--{name}: must be positive, got {value}")
    return n


def session_name_option(value: str | None) -> bytes | None:
    """``--session NAME`` of a service (docs/protocol.md "Sessions"): None stays None."""
    if value is None:
        return None
    from sbus.core.codec import check_session_name

    try:
        return check_session_name(os.fsencode(value))
    except ValueError as e:
        raise usage.UsageError(f"--session: {e}") from None


def metrics_option(value: str) -> str:
    """``--metrics VALUE`` checked (`sbus.metrics.metrics_address`); a `usage.UsageError` says
    what is wrong, a missing prometheus_client included."""
    try:
        from sbus.metrics import MetricsAddressError, metrics_address
    except ImportError as e:
        raise usage.UsageError(f"--metrics needs prometheus_client ({e}): pip install 'sbus[metrics]'") from None
    try:
        return metrics_address(value)
    except MetricsAddressError as e:
        raise usage.UsageError(f"--metrics: {e}") from None


#: ``--metrics ADDRESS``, one row of a plugin's ``optParameters`` (every service's and the
#: bus's): serve the stats as OpenMetrics there (`sbus.metrics`; `SbusServiceMaker` starts it).
METRICS_OPTION = [
    "metrics", None, None,
    "Serve the statistics as OpenMetrics for Prometheus (/metrics) on this Twisted endpoint: "
    "tcp:9464 (loopback unless interface= is given), unix:/run/sbus/metrics.sock (mode 0600 "
    "unless mode= is given). It shows what root's stats show. Default: off.",
    metrics_option,
]


# --- one spelling per idea (issue 34): sbus.respell --------------------------------------


class RespelledOptions(usage.Options):
    """A plugin's options whose old spellings (`renamed`) still parse, with a warning each."""

    #: old option -> new option, and the command that warns
    renamed: dict[str, str] = {}
    command = "twistd"

    def parseOptions(self, options=None):
        import sys

        if options is None:
            options = sys.argv[1:]
        super().parseOptions(respell(list(options), self.renamed, self.command))


# --- twistd plugins: start-up failures are one line ---------------------------------------


class StartupError(Exception):
    """A service cannot start; ``str()`` is the one line the user sees (no traceback)."""


def _stderr_is_devnull() -> bool:
    import os

    try:
        return os.path.samestat(os.fstat(2), os.stat(os.devnull))
    except OSError:
        return True


def _say(prog: str, text: str) -> None:
    import sys

    plugin = prog.split()[-1]
    for prefix in (prog + ": ", plugin + ": "):  # a message that names its plugin already
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    out = sys.__stderr__
    if out is None:
        return
    try:
        out.write(f"{prog}: {text}\n")
        out.flush()
    except (OSError, ValueError):
        pass


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")
    if isinstance(exc, (StartupError, usage.UsageError)) or type(exc).__name__ == "AddressError":
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _quiet_startup_errors() -> None:
    """At the top level, a `StartupError` was already said in one line: no traceback."""
    import sys

    previous = sys.excepthook
    if getattr(previous, "_sbus_quiet", False):
        return

    def hook(kind, value, tb):
        if isinstance(value, StartupError):
            return  # exit status 1, as for any uncaught exception
        previous(kind, value, tb)

    hook._sbus_quiet = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _start_failed(prog: str, exc: BaseException):
    """A service's (privileged)startService raised: one line, a non-zero exit."""
    import os

    from twisted.internet import reactor

    text = _one_line(exc)
    if getattr(reactor, "running", False):
        # `twist` starts services inside the running reactor, which would log this and go on.
        _say(prog, text)
        os._exit(1)
    if not _stderr_is_devnull():
        _say(prog, text)
    # twistd removes its pid file, and a daemonising twistd reports it to the waiting parent.
    raise StartupError(text) from None


class _OneLineStart:
    """Wraps a service's start methods so that their failure is one line (see `_start_failed`)."""

    def __init__(self, prog: str, service):
        self.prog = prog
        for name in ("privilegedStartService", "startService"):
            method = getattr(service, name, None)
            if method is not None:
                setattr(service, name, self._guard(method))

    def _guard(self, method):
        prog = self.prog

        def guarded(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except SystemExit as e:
                if e.code in (None, 0):
                    raise
                _start_failed(prog, StartupError(e.code if isinstance(e.code, str) else f"exit status {e.code}"))
            except Exception as e:
                _start_failed(prog, e)

        return guarded


def one_line_options(options_class, prog: str):
    """`options_class`, except that a usage error is one line on standard error and status 2
    (twistd would print the whole help text before it)."""

    class OneLine(options_class):
        def parseOptions(self, options=None):
            try:
                return super().parseOptions(options)
            except usage.UsageError as e:
                _say(prog, f"{e} (see --help)")
                raise SystemExit(2) from None

    OneLine.__name__ = options_class.__name__
    OneLine.__qualname__ = options_class.__qualname__
    return OneLine


class SbusServiceMaker(ServiceMaker):
    """A twistd plugin whose start-up failures are one line on standard error and a
    non-zero exit: bad options (2), a module that cannot be imported, a failing
    ``makeService`` or a failing start (1). No traceback. (Used by twisted/plugins/*.)"""

    @property
    def prog(self) -> str:
        return f"twistd {self.tapname}"

    @property
    def options(self):
        try:
            cls = super().options
        except ImportError as e:
            _say(self.prog, _one_line(e))
            raise SystemExit(1) from None
        return one_line_options(cls, self.prog)

    def makeService(self, options):
        from sbus.logfiles import LogFileError, take_bus_mode, take_pidfile

        _quiet_startup_errors()
        try:
            take_bus_mode(options)  # log files take the bus's mode (sbus.logfiles, issue 16)
            metrics = None
            if options.get("metrics"):
                from sbus.metrics import MetricsService

                # Listen now, before the service binds its own socket and before twistd
                # daemonises: a taken port is one line, and leaves no bus socket behind.
                metrics = MetricsService(options["metrics"])
                metrics.listen()
            service = super().makeService(options)
            if metrics is not None:
                service = metrics.beside(service, self.tapname)
            take_pidfile(options)
        except usage.UsageError as e:
            _say(self.prog, f"{e} (see --help)")
            raise SystemExit(2) from None
        except SystemExit as e:
            if isinstance(e.code, str):  # sys.exit("message")
                _say(self.prog, e.code)
                raise SystemExit(1) from None
            raise
        except LogFileError as e:
            _say(self.prog, str(e))
            raise SystemExit(1) from None
        except Exception as e:
            _say(self.prog, _one_line(e))
            raise SystemExit(1) from None
        _OneLineStart(self.prog, service)
        return service
