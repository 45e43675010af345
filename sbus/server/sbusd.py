"""``sbusd``: drop-in for the reference C server's command line.

    usage: sbusd [-a address] [-f | -p pidfile] [-u user] ... [-l logfile] [-cghor]

-a ADDRESS  a path (default $SBUS_SOCKET, else /run/sbus.socket, the address
            clients use by default), /dev/fd/N, /dev/unix/abstract
            (random; printed on standard output), /dev/unix/abstract/HEX, or
            systemd (socket activation; an extension): see sbus.server.address
-f          foreground: standard input and output are closed once the socket
            listens (end of standard output = ready); SIGINT, SIGHUP and
            SIGTERM end it with status 0 and remove its socket file
-p PIDFILE  daemon's pid file (default /run/sbus.pid, created exclusively;
            /dev/null: none); without -f sbusd daemonises and the command
            returns 0 once the daemon is ready, 1 if it failed. The daemon
            ignores SIGHUP, ends on SIGINT/SIGTERM removing socket and pid file.
            Once ready it holds nothing of its caller: standard input, output
            and error are /dev/null, and it logs to syslog (or to -l LOGFILE)
-u USER     only this user (name or uid; repeatable) and our own uid may connect
-l LOGFILE  log to this file (appended to) instead of standard error / syslog
            (an extension)
-c          exit when the last client has gone (after at least one came and
            sent a packet: a connection that sends nothing, like another
            server's probe of the path, does not count)
-g, -o      socket file mode 0700 plus 0070, plus 0007
-r          also remove an empty regular file at the path (the reference's test
            touches it); a stale socket file (nobody listening) is removed with
            or without -r, a live server's socket never
-h          this help on standard output, status 0 (an extension)

Options parse like getopt(3) (``-fr``, ``-aPATH``, ``--``; ``--help`` is ``-h``).
Errors are one line ``sbusd: ...`` on standard error and status 1; a wrong
command line is that line (what was wrong) followed by the usage line.

The socket is opened, bound and listening in the original process before
anything else, so address errors reach the user, and Twisted is imported
only after forking. Keep the imports here lean: sbusd must be connectable
well within a second of exec.
"""

from __future__ import annotations

import getopt
import os
import signal
import sys
from typing import NoReturn

from sbus.address import DEFAULT_ADDRESS, default_address  # noqa: F401  (DEFAULT_ADDRESS: re-exported)
from sbus.server.address import AddressError, Listener, open_listener

PROG = "sbusd"
USAGE = f"usage: {PROG} [-a address] [-f | -p pidfile] [-u user] ... [-l logfile] [-cghor]"
HELP = f"""\
{USAGE}

The sbus message bus server (a drop-in for the reference C sbusd).

  -a ADDRESS  where to listen (default $SBUS_SOCKET, else /run/sbus.socket: where
              clients look by default): a path, /dev/unix/abstract (a random
              abstract address, printed on standard output),
              /dev/unix/abstract/HEX, /dev/fd/N (an inherited socket) or
              systemd (socket activation)
  -f          stay in the foreground; standard output closes when ready; SIGINT,
              SIGTERM or SIGHUP stop it (status 0, socket file removed)
  -p PIDFILE  without -f: daemonise, writing this pid file (default /run/sbus.pid;
              /dev/null for none); returns 0 once the daemon serves, 1 if it failed
  -u USER     only this user (name or uid) and the server's own may connect;
              repeatable
  -l LOGFILE  log to this file (appended to); default standard error with -f,
              syslog (facility daemon) for the daemon
  -c          exit once the last client has gone (after at least one came and sent
              a packet: a connection that sends nothing does not count)
  -g          socket file mode also 0070 (group)
  -o          socket file mode also 0007 (others)
  -r          also remove an empty file at the socket path first (a stale socket
              nobody listens on is removed anyway; a live server's, never)
  -h          show this help and exit
  --busy-poll=USEC
              poll for events this many microseconds before sleeping, right after a
              wait that short (default 50; 0: never): round trips are met awake, at
              up to a core while events keep coming that fast (not in the C sbusd)
  --metrics=ADDRESS
              serve the statistics as OpenMetrics (/metrics, for Prometheus) on this
              Twisted endpoint: tcp:9464 (loopback unless interface= is given) or
              unix:/run/sbus/metrics.sock (mode 0600 unless mode= is given); it shows
              what root's server/stats shows (not in the C sbusd)
  --log-connections
              log a line per client connect and ordinary disconnect (default: one
              summary line a minute; a disconnect for a fault is always logged; not
              in the C sbusd)
  --service-uid=USER
              grant this user (name or uid) of a service that carries other users'
              traffic (sbus-nats) root's view of server/interest: every uid's
              patterns; repeatable (not in the C sbusd)

Errors are one line on standard error and status 1 (a wrong command line: that
line, then the usage line).
"""
DEFAULT_PIDFILE = "/run/sbus.pid"


class Fatal(Exception):
    """A one-line error: ``sbusd: <message>`` and status 1."""


#: Once the daemon has let go of its caller's standard error: where error lines go instead.
_late_errors = None


def _eprint(text: str) -> None:
    if _late_errors is not None:
        _late_errors(text)
        return
    try:
        sys.stderr.write(f"{PROG}: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _open_logfile(path: str, mode: int):
    """The log names every client: it takes the bus's mode (sbus.logfiles, issue 16)."""
    from sbus.logfiles import LogFileError, open_append

    try:
        return open_append(path, mode)
    except LogFileError as e:
        raise Fatal(str(e)) from None


def _file_observer(logfile):
    from twisted.logger import textFileLogObserver

    return textFileLogObserver(logfile)


def _syslog_observer():
    """Log events to syslog (ident sbusd, facility daemon): where a daemon's log goes."""
    import syslog

    from twisted.logger import LogLevel, eventAsText

    syslog.openlog(PROG, syslog.LOG_PID, syslog.LOG_DAEMON)
    priorities = {
        LogLevel.debug: syslog.LOG_DEBUG, LogLevel.info: syslog.LOG_INFO, LogLevel.warn: syslog.LOG_WARNING,
        LogLevel.error: syslog.LOG_ERR, LogLevel.critical: syslog.LOG_CRIT,
    }

    def observe(event) -> None:
        text = eventAsText(event, includeTimestamp=False, includeSystem=False)
        priority = priorities.get(event.get("log_level"), syslog.LOG_INFO)
        for line in text.splitlines():
            syslog.syslog(priority, line)

    def error_line(text: str) -> None:
        syslog.syslog(syslog.LOG_ERR, text)

    return observe, error_line




def _usage(problem: str) -> NoReturn:
    """What was wrong, then the usage line; status 1."""
    try:
        sys.stderr.write(f"{PROG}: {problem}\n{USAGE}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    sys.exit(1)


def resolve_user(text: str) -> int:
    """A user name or a numeric uid -> uid; `ValueError` with a one-line message.

    (The C server meant the same; its numeric branch fell through to
    getpwnam("") and failed.)
    """
    if text.isascii() and text.isdigit():
        uid = int(text)
        if uid >= 2**32 - 1:
            raise ValueError(f"bad uid {text}")
        return uid
    import pwd

    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise ValueError(f"getpwnam {text}: no such user") from None


class Args:
    def __init__(self):
        self.address = default_address()
        self.pidfile: str | None = DEFAULT_PIDFILE
        self.foreground = False
        self.auto_close = False
        self.reuse = False
        self.mode = 0o700
        self.users: list[int] = []
        self.service_uids: list[int] = []
        self.logfile: str | None = None
        self.busy_poll: float | None = None  # seconds; None: the server's default
        self.metrics: str | None = None  # a server endpoint for OpenMetrics (sbus.metrics)
        self.log_connections = False  # a line per connection, not a summary a minute

    def allowed_uids(self) -> frozenset[int] | None:
        from sbus.server.config import allowed_uid_set

        return allowed_uid_set(self.users or None)


def parse_args(argv: list[str]) -> Args:
    """Parse the command line; bad usage prints the usage line and exits 1."""
    try:
        opts, rest = getopt.getopt(argv, "a:cfghl:op:ru:", ["help", "busy-poll=", "service-uid=", "metrics=", "log-connections"])
    except getopt.GetoptError as e:
        if e.opt and not e.msg.startswith("option --"):
            what = f"option -{e.opt} needs an argument" if "requires argument" in e.msg else \
                f"unknown option -{e.opt}"
        else:
            what = f"unknown option --{e.opt}" if e.opt else e.msg
        _usage(what)
    if rest:
        _usage(f"unexpected argument {rest[0]!r} (options only)")
    args = Args()
    for opt, val in opts:
        if opt == "-a":
            args.address = val
        elif opt == "-c":
            args.auto_close = True
        elif opt == "-f":
            args.foreground = True
        elif opt == "-g":
            args.mode |= 0o070
        elif opt in ("-h", "--help"):
            try:
                sys.stdout.write(HELP)
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
            sys.exit(0)
        elif opt == "-l":
            args.logfile = os.path.abspath(val)
        elif opt == "-o":
            args.mode |= 0o007
        elif opt == "-p":
            args.pidfile = val
        elif opt == "-r":
            args.reuse = True
        elif opt == "-u":
            try:
                args.users.append(resolve_user(val))
            except ValueError as e:
                raise Fatal(str(e)) from None
        elif opt == "--service-uid":
            try:
                args.service_uids.append(resolve_user(val))
            except ValueError as e:
                raise Fatal(f"--service-uid: {e}") from None
        elif opt == "--metrics":
            args.metrics = _metrics_address(val)
        elif opt == "--log-connections":
            args.log_connections = True
        elif opt == "--busy-poll":
            from sbus.server.config import busy_poll_us

            try:
                args.busy_poll = busy_poll_us(val)
            except ValueError as e:
                _usage(str(e))
    if args.foreground or args.pidfile == "/dev/null":
        args.pidfile = None
    elif args.pidfile:
        # Absolute: the daemon chdirs to / before it removes the file at exit.
        args.pidfile = os.path.abspath(args.pidfile)
    return args


def _metrics_address(text: str) -> str:
    from twisted.python.usage import UsageError

    from sbus.options import metrics_option

    try:
        return metrics_option(text)
    except UsageError as e:
        _usage(str(e))


def _devnull_over(*fds: int) -> None:
    """Close `fds` by putting /dev/null in their place (so the numbers stay taken)."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            os.dup2(null, fd)
    finally:
        if null not in fds:
            os.close(null)


def _write_pidfile(path: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        raise Fatal(f"open {path} O_WRONLY O_CREAT O_EXCL: {e.strerror}") from None
    try:
        os.write(fd, b"%d\n" % os.getpid())
    except OSError as e:
        os.close(fd)
        _unlink_quiet(path)
        raise Fatal(f"write {path}: {e.strerror}") from None
    os.close(fd)


def _unlink_quiet(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            _eprint(f"unlink {path}: {e.strerror}")


def _reactor_without_tls():
    """The server's reactor (`sbus.reactor`), installed without pyOpenSSL: sbusd never speaks
    TLS, and twisted.internet.tcp imports it (and cryptography) when it is installed, about
    0.3 s of a 0.8 s start (the reference's test gives a server 1 s). Twisted falls
    back cleanly when it is missing; it is importable again afterwards."""
    hide = "OpenSSL" not in sys.modules
    if hide:
        sys.modules["OpenSSL"] = None  # type: ignore[assignment]
    try:
        from sbus.reactor import install_unless_chosen

        reactor = install_unless_chosen()
    finally:
        if hide and "OpenSSL" in sys.modules and sys.modules["OpenSSL"] is None:
            del sys.modules["OpenSSL"]
    return reactor


def serve(args: Args, listener: Listener, ready, log_observer=None) -> int:
    """Run the bus on `listener` until a signal (or -c); return the exit status.

    `ready()` is called once the server accepts connections (and signal
    handlers are in place), right before the reactor runs. The log goes to
    `log_observer`, by default to standard error.
    """
    reactor = _reactor_without_tls()
    from twisted.logger import globalLogBeginner, textFileLogObserver

    from sbus.server.config import ServerConfig
    from sbus.server.service import BusService

    if log_observer is None:
        log_observer = textFileLogObserver(sys.stderr)
    globalLogBeginner.beginLoggingTo([log_observer], discardBuffer=True, redirectStandardIO=False)

    stopping = []

    def stop() -> None:
        if not stopping:
            stopping.append(True)
            reactor.stop()

    def on_signal(signo, frame) -> None:
        reactor.callFromThread(stop)

    def on_empty() -> None:
        # -c: a connection that sent nothing is not a client. Another server
        # starting on this path (its probe), or a health check, connects and
        # closes at once: that stopped a fresh -c bus before its first client.
        if bus.factory is not None and bus.factory.stats()["packets_in"]:
            stop()

    config = ServerConfig(allowed_uids=args.allowed_uids(), service_uids=frozenset(args.service_uids),
                          log_connections=args.log_connections)
    if args.busy_poll is not None:
        config.busy_poll = args.busy_poll
    bus = BusService(
        args.address,
        config,
        mode=args.mode,
        reuse=args.reuse,
        on_empty=on_empty if args.auto_close else None,
        listener=listener,
        warn=_eprint,
    )
    from sbus.reactor import wake_on_signals

    wake_on_signals(reactor)  # a signal that comes as the reactor starts to wait still wakes it
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal if args.foreground else signal.SIG_IGN)
    if _early_signals:  # a signal came while we were starting up
        reactor.callWhenRunning(stop)
    if args.metrics:
        from sbus.metrics import MetricsService, StatsCollector
        from sbus.options import StartupError

        metrics = MetricsService(args.metrics, reactor)
        metrics.watch(StatsCollector(bus, "sbus"))
        try:
            metrics.startService()
        except StartupError as e:
            raise Fatal(str(e)) from None
    bus.startService()
    reactor.addSystemEventTrigger("before", "shutdown", bus.stopService)
    ready()
    reactor.run(installSignalHandlers=False)
    listener.cleanup()
    return 0


#: Signals received before the reactor's handlers were in place (-f only).
_early_signals: list[int] = []


def _note_early_signal(signo, frame) -> None:
    _early_signals.append(signo)


def _print_address(listener: Listener) -> None:
    """Print a random abstract address (both modes, before forking, like C)."""
    if listener.printed_address:
        try:
            sys.stdout.write(listener.printed_address + "\n")
            sys.stdout.flush()
        except (OSError, ValueError) as e:
            raise Fatal(f"failed print generated address: {getattr(e, 'strerror', None) or e}") from None


def _run_foreground(args: Args, listener: Listener, logfile=None) -> int:
    def ready() -> None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        _devnull_over(0, 1)

    return serve(args, listener, ready, _file_observer(logfile) if logfile is not None else None)


def _daemonise(args: Args, listener: Listener, logfile=None) -> int:
    """Fork, setsid, fork; the parent returns 0 once the daemon is ready, else 1."""
    rfd, wfd = os.pipe()
    try:
        pid = os.fork()
    except OSError as e:
        raise Fatal(f"fork: {e.strerror}") from None
    if pid:
        os.close(wfd)
        try:
            _, status = os.waitpid(pid, 0)
            ok = status == 0 and os.read(rfd, 1) == b"\0"
        finally:
            os.close(rfd)
        if not ok:
            listener.cleanup()  # only removes the file if it is still ours
            return 1
        # The daemon owns the socket now: don't let our exit remove anything.
        listener.unlink_path = None
        return 0

    # First child: new session, then fork again so the daemon is no session leader.
    os.close(rfd)
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
    except OSError as e:
        _eprint(f"fork: {e.strerror}")
        os._exit(1)

    # The daemon.
    status = 1
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if args.pidfile:
            _write_pidfile(args.pidfile)
        pidfile = args.pidfile
        try:
            os.chdir("/")

            # The daemon logs to its log file or syslog from the start; only a start-up
            # failure (one line) reaches the caller's standard error.
            if logfile is None:
                observer, late_errors = _syslog_observer()
            else:
                observer = _file_observer(logfile)
                late_errors = lambda text: logfile.write(f"{PROG}: {text}\n")  # noqa: E731

            def ready() -> None:
                # Let go of everything of the caller's: a caller that waits for our standard
                # error to close (subprocess.run(capture_output=True)) would wait forever, and
                # a pipe nobody drains would block our logging. (The C server keeps a non-tty
                # standard error.)
                global _late_errors
                _late_errors = late_errors
                try:
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
                _devnull_over(0, 1, 2)
                os.write(wfd, b"\0")
                os.close(wfd)

            status = serve(args, listener, ready, observer)
        finally:
            if pidfile:
                _unlink_quiet(pidfile)
    except Fatal as e:
        _eprint(str(e))
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001 - last resort in a daemon
        _eprint(f"{type(e).__name__}: {e}")
    finally:
        listener.cleanup()
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os._exit(status)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    try:
        args = parse_args(argv)
        if args.foreground:
            # Until the reactor runs, a stop signal is remembered rather than
            # killing us halfway with the socket file left behind.
            for signo in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signo, _note_early_signal)
        from sbus.address import packet_limit_problem
        from sbus.core.codec import MAX_PACKET

        problem = packet_limit_problem(MAX_PACKET)
        if problem:
            raise Fatal(problem)
        logfile = _open_logfile(args.logfile, args.mode) if args.logfile else None
        try:
            listener = open_listener(args.address, args.mode, args.reuse, warn=_eprint)
        except AddressError as e:
            raise Fatal(str(e)) from None
        try:
            _print_address(listener)
            if args.foreground:
                status = _run_foreground(args, listener, logfile)
                # Done: socket file removed, nothing left to flush but our own streams. Skip
                # the interpreter's teardown of Twisted (0.1-0.3 s): a caller waiting for us
                # (the reference's test gives a server one second in all) need not.
                listener.cleanup()
                for stream in (logfile, sys.stdout, sys.stderr):
                    try:
                        if stream is not None:
                            stream.flush()
                    except (OSError, ValueError):
                        pass
                os._exit(status)
            return _daemonise(args, listener, logfile)
        finally:
            listener.cleanup()
    except Fatal as e:
        _eprint(str(e))
        return 1
    except Exception as e:  # noqa: BLE001 - one line, like every other error
        _eprint(f"{type(e).__name__}: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
