"""The `sbus` command: publish, subscribe, ask the server, from a shell.

    sbus pub KEY [MESSAGE | -]     publish (stdin: a message per line, or --whole)
    sbus sub PATTERN...            print messages until interrupted
    sbus whoami                    the credentials the server sees
    sbus stats                     the server's statistics (--json)
    sbus ping                      round trips through the bus
    sbus top                       a live view of the bus (sbus/top.py)
    sbus request KEY [PAYLOAD]     request/reply (sbus/cliwork.py, docs/request-reply.md)
    sbus serve PATTERN -- CMD      answer requests with a command
    sbus work GROUP -- CMD         take messages of a work-queue group (docs/queues.md)

The bus is `--bus ADDRESS`, else ``$SBUS_SOCKET``, else ``/run/sbus.socket`` (where the server listens by default) in
the working directory. Errors are one line on stderr (``sbus: ...``) and a
non-zero exit status (2 for a usage error: every number is checked when the
command line is parsed); Ctrl-C exits with 130 and no traceback.

What `sub` prints is escaped unless `--raw` asks otherwise (`escape`): a message
from anyone allowed on the bus must not drive the terminal (escape sequences) or
fake a line of output (a newline or carriage return in a payload).
"""

from __future__ import annotations

import argparse
import base64
import copy
import errno
import json
import math
import os
import re
import secrets
import signal
import stat
import statistics
import sys
import tempfile
import time
import unicodedata

from sbus.core.codec import MAX_PACKET, DropNotice, Message, ProtocolError

from .client.address import ABSTRACT_PREFIX, AddressError, resolve
from .respell import respell

#: The bus was ``-s``/``--socket`` before every command called it ``--bus`` (sbus.respell).
OLD_SPELLINGS = {"-s": "-b", "--socket": "--bus"}
from .client.blocking import Client, ConnectionClosed, PacketTooLarge

#: How long to wait for the server's answer to a request (whoami, stats).
REPLY_TIMEOUT = 10.0
#: Exit status when `sub --timeout` expires before `--count` messages arrived (as timeout(1)).
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


class CliError(Exception):
    """A failure to report as one line; `status` is the exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


# -- connecting ---------------------------------------------------------------


def _connect(args) -> Client:
    try:
        addr = resolve(getattr(args, "socket", None))
    except AddressError as e:
        raise CliError(str(e)) from None
    where = addr.text
    try:
        return Client(addr)
    except FileNotFoundError:
        if addr.kind == "path" and where.startswith(ABSTRACT_PREFIX):
            # parse_address took it for a path: the part after the prefix is not hex
            raise CliError(f"{where}: not an abstract address: {ABSTRACT_PREFIX} must be followed by "
                           "an even number of hex digits, starting with 00 (as sbusd -a "
                           "/dev/unix/abstract prints it)") from None
        raise CliError(f"{where}: no such socket (is sbusd running? see --bus, $SBUS_SOCKET)") from None
    except ConnectionRefusedError:
        if addr.kind == "path":
            kind = _not_a_socket(where)
            if kind:
                raise CliError(f"{where}: not a socket ({kind})") from None
        raise CliError(f"{where}: connection refused (no server is listening there)") from None
    except PermissionError:
        raise CliError(f"{where}: permission denied") from None
    except OSError as e:
        if e.errno == errno.EPROTOTYPE:
            raise CliError(f"{where}: not an sbus socket (wrong socket type)") from None
        if e.errno == errno.ENOTSOCK:
            raise CliError(f"{where}: not a socket") from None
        reason = e.strerror or str(e)
        if where in reason:
            raise CliError(reason) from None
        raise CliError(f"{where}: {reason}") from None


def _not_a_socket(path: str) -> str | None:
    """What `path` is if it exists and is not a socket ("a directory", ...), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    return "not a socket file"


def _request(fn, what: str):
    try:
        return fn(timeout=REPLY_TIMEOUT)
    except TimeoutError:
        raise CliError(f"no {what} reply from the server within {REPLY_TIMEOUT:g} s") from None


# -- pub ------------------------------------------------------------------------


def _stdin_is_data() -> bool:
    """Is stdin a pipe, a file or a socket (data), rather than a terminal or /dev/null?"""
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)


def _too_large(what: str, limit: int) -> CliError:
    return CliError(f"message too large: {what} holds more than {limit} bytes, the most one message "
                    f"on this key can carry (the bus's {MAX_PACKET}-byte packet less 'MSG KEY\\0')")


def _payloads(args, key: bytes):
    """Yield the payloads to publish, in order. Never reads more than one message can carry
    plus one byte: `yes | sbus pub k --whole` is an error at once, not a few GB later."""
    limit = MAX_PACKET - len(b"MSG \0") - len(key)
    stdin = args.message == "-" or (args.message is None and args.file is None and _stdin_is_data())
    if args.file is not None:
        if args.message is not None:
            raise CliError("give either MESSAGE or --file, not both", 2)
        try:
            with open(args.file, "rb") as f:
                data = f.read(limit + 1)
        except OSError as e:
            raise CliError(f"{args.file}: {e.strerror}") from None
        if len(data) > limit:
            raise _too_large(args.file, limit)
        yield data
    elif stdin:
        data = sys.stdin.buffer
        if args.whole:
            whole = data.read(limit + 1)
            if len(whole) > limit:
                raise _too_large("standard input", limit)
            yield whole
        else:
            while line := data.readline(limit + 2):  # the message, its newline, one more
                if line.endswith(b"\n"):
                    line = line[:-1]
                if len(line) > limit:
                    raise _too_large("a line of standard input", limit)
                yield line
    elif args.message is not None:
        yield os.fsencode(args.message)
    else:
        yield b""


def cmd_pub(args) -> int:
    key = os.fsencode(args.key)
    payloads = _payloads(args, key)
    with _connect(args) as bus:
        interval = None if args.rate is None else 1.0 / args.rate
        start = time.monotonic()
        sent = 0
        for payload in payloads:
            for _ in range(args.count):
                if interval is not None:
                    wait = start + sent * interval - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)  # pacing, not synchronisation
                try:
                    bus.publish(key, payload)
                except ProtocolError as e:
                    raise CliError(f"message too large: {e}") from None
                sent += 1
        # A round trip: the server has routed everything (or closed on us) before we exit,
        # so a following command on the same bus comes after these messages.
        _request(bus.whoami, "whoami")
    return 0


# -- sub ------------------------------------------------------------------------


def _text_or_base64(data: bytes) -> tuple[str, bool]:
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), True


# Bytes that may need escaping: C0 controls but tab, backslash, DEL, and every non-ASCII byte
# (checked further: C1 controls, invalid UTF-8, line separators, bidirectional overrides).
_SUSPECT = re.compile(rb"[\x00-\x08\x0a-\x1f\\\x7f-\xff]")
_SUSPECT_KEY = re.compile(rb"[\x00-\x20\\\x7f-\xff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\x1b": "\\e", "\\": "\\\\", "\t": "\t", " ": " "}


def _unsafe_char(c: str) -> bool:
    """A character that can drive a terminal or reorder/fake a line: controls (C0, DEL, C1),
    line and paragraph separators, and format characters (bidirectional overrides, ...)."""
    return unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Cs")


def escape(data: bytes, space: bool = False) -> bytes:
    """`data` for a terminal line: controls as ``\\n``, ``\\r``, ``\\e``, ``\\xHH`` or ``\\uHHHH``, invalid
    UTF-8 bytes as ``\\xHH``, a backslash doubled (so the output is unambiguous); tabs stay.
    With `space`, a space is escaped too (``\\x20``: a key never contains an unescaped one)."""
    if (_SUSPECT_KEY if space else _SUSPECT).search(data) is None:
        return data  # printable ASCII: the common case, no copy
    out = []
    for c in data.decode("utf-8", "surrogateescape"):
        if c == " ":
            out.append("\\x20" if space else c)
        elif c in _NAMED:
            out.append(_NAMED[c])
        elif "\udc80" <= c <= "\udcff":  # a byte that is not UTF-8
            out.append(f"\\x{ord(c) - 0xdc00:02x}")
        elif _unsafe_char(c):
            o = ord(c)
            out.append(f"\\x{o:02x}" if o < 0x80 else f"\\u{o:04x}" if o <= 0xFFFF else f"\\U{o:08x}")
        else:
            out.append(c)
    return "".join(out).encode("utf-8")


def _json_safe(text: str) -> str:
    """JSON text with every character `_unsafe_char` names as a \\uXXXX escape (json.dumps
    with ensure_ascii=False leaves DEL, C1 controls and U+2028 raw)."""
    if text.isascii() and "\x7f" not in text:
        return text
    return "".join(_json_escape(c) if _unsafe_char(c) else c for c in text)


def _json_escape(c: str) -> str:
    o = ord(c)
    if o > 0xFFFF:  # JSON escapes UTF-16 code units: a surrogate pair
        o -= 0x10000
        return f"\\u{0xD800 + (o >> 10):04x}\\u{0xDC00 + (o & 0x3FF):04x}"
    return f"\\u{o:04x}"


def _format(fmt: str, raw: bool = False):
    if fmt == "raw":
        return lambda m: m.payload
    if fmt == "payload":
        if raw:
            return lambda m: m.payload + b"\n"
        return lambda m: escape(m.payload) + b"\n"
    if fmt == "line":
        if raw:
            return lambda m: m.key + b" " + m.payload + b"\n"
        return lambda m: escape(m.key, space=True) + b" " + escape(m.payload) + b"\n"

    def as_json(m):
        key, key_b64 = _text_or_base64(m.key)
        payload, payload_b64 = _text_or_base64(m.payload)
        obj = {"key": key, "payload": payload}
        if key_b64:
            obj["key_base64"] = True
        if payload_b64:
            obj["payload_base64"] = True
        text = json.dumps(obj, ensure_ascii=False)
        return ((text if raw else _json_safe(text)) + "\n").encode("utf-8")

    return as_json


def _signal_ready(path: str) -> None:
    """Write "ready" to `path`.

    A FIFO (not a symlink to one) is opened as it is: a reader waits on it. Anything else is
    replaced atomically by a new file (mode 0600): written under a random name that
    mkstemp creates exclusively (O_EXCL, never following a symlink) in the same directory,
    then renamed over `path` (which replaces a symlink at `path`, never its target).
    """
    tmp = None
    try:
        try:
            is_fifo = stat.S_ISFIFO(os.lstat(path).st_mode)
        except OSError:
            is_fifo = False
        if is_fifo:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with open(fd, "w") as f:
                f.write("ready\n")
        else:
            directory, name = os.path.split(path)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory or ".")
            with open(fd, "w") as f:
                f.write("ready\n")
            os.replace(tmp, path)
            tmp = None
    except BrokenPipeError:
        pass
    except OSError as e:
        if is_fifo:
            raise CliError(f"--ready-file {path}: cannot open the FIFO: {e.strerror}") from None
        where = os.path.dirname(os.path.abspath(path))
        raise CliError(f"--ready-file {path}: cannot create a file in {where} ({e.strerror}); "
                       "give a path in a directory you can write to, or a FIFO") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _abandon_ready(path: str) -> None:
    """Failed before ready: close a FIFO's write end unwritten, so a waiting reader sees end of file."""
    try:
        if stat.S_ISFIFO(os.stat(path).st_mode):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # nobody is reading (ENXIO) or no FIFO: nothing to tell


def cmd_sub(args) -> int:
    try:
        return _sub(args)
    except BaseException:
        if args.ready_file and not getattr(args, "ready_signalled", False):
            _abandon_ready(args.ready_file)
        raise


#: Other systems' match-everything wildcards (MQTT '#', NATS '>'): literal keys on sbus.
_FOREIGN_WILDCARD = re.compile(r"(^|/)#$|(^|\.)>$")


def _wildcard_hint(pattern: str) -> None:
    if _FOREIGN_WILDCARD.search(pattern):
        print(f"sbus: hint: {pattern!r} is a literal key on sbus, not a wildcard; '' matches every key, "
              "'a/' everything under a/, '*' one segment", file=sys.stderr, flush=True)


def _sub(args) -> int:
    for pattern in args.patterns:
        _wildcard_hint(pattern)
    render = _format(args.format, args.raw)
    out = sys.stdout.buffer
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    with _connect(args) as bus:
        for pattern in args.patterns:
            try:
                bus.subscribe(os.fsencode(pattern))
            except ProtocolError as e:
                raise CliError(f"bad pattern {pattern!r}: {e}") from None
        # The server handles a client's packets in order: once whoami is answered, the
        # subscriptions are in place and nothing published from now on is missed.
        _request(bus.whoami, "whoami")
        if args.ready_file:
            _signal_ready(args.ready_file)
            args.ready_signalled = True
        received = dropped = 0
        while args.count is None or received < args.count:
            left = None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
            try:
                m = bus.receive(timeout=left)
            except TimeoutError:
                break
            except PacketTooLarge as e:
                print(f"sbus: {_printable(str(e))}", file=sys.stderr)
                continue
            if type(m) is DropNotice:
                # What the server dropped for us is said, not hidden (docs/protocol.md, notices).
                dropped += m.count
                print(f"sbus: the server dropped {m.count} message{'s' if m.count != 1 else ''} for us"
                      f" (first {_printable(os.fsdecode(m.first))}, last {_printable(os.fsdecode(m.last))};"
                      f" {dropped} in all)", file=sys.stderr, flush=True)
                continue
            if type(m) is not Message:
                continue
            out.write(render(m))
            out.flush()
            received += 1
        if args.count is not None and received < args.count:
            raise CliError(
                f"timed out after {args.timeout:g} s: received {received} of {args.count} messages",
                EXIT_TIMEOUT,
            )
    return 0


# -- whoami, stats, ping ----------------------------------------------------------


def cmd_whoami(args) -> int:
    with _connect(args) as bus:
        me = _request(bus.whoami, "whoami")
    sys.stdout.buffer.write(me + b"\n")
    sys.stdout.flush()
    return 0


def _cell(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={_cell(v)}" for k, v in value.items()) or "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(_cell(v) for v in value) or "-"
    if value is None:
        return "-"
    return str(value)


def format_stats(stats: dict) -> str:
    """The statistics as aligned text: scalars and dicts first, lists of objects as tables."""
    rows, tables = [], []
    for name, value in stats.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables.append((name, value))
        elif isinstance(value, list) and not value:
            tables.append((name, value))
        elif isinstance(value, dict) and value and all(not isinstance(v, (dict, list)) for v in value.values()):
            for k, v in value.items():
                rows.append((f"{name}.{k}", _cell(v)))
        else:
            rows.append((name, _cell(value)))
    lines = []
    width = max((len(n) for n, _ in rows), default=0)
    for name, value in rows:
        lines.append(f"{name.ljust(width)}  {value}")
    for name, items in tables:
        lines.append("")
        if not items:
            lines.append(f"{name}: none")
            continue
        lines.append(f"{name}:")
        columns: list[str] = []
        for item in items:
            for k in item:
                if k not in columns:
                    columns.append(k)
        cells = [[_cell(item.get(c)) for c in columns] for item in items]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
        lines.append("  " + "  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip())
        for row in cells:
            lines.append("  " + "  ".join(v.rjust(w) if v.lstrip("-").replace(".", "", 1).isdigit()
                                          else v.ljust(w) for v, w in zip(row, widths)).rstrip())
    return "\n".join(lines) + "\n"


def _service_stats(args) -> int:
    """Ask every bridge and link on the bus (``sbus/services/stats``, docs/deploy.md); print their answers."""
    import os as _os
    import time as _time

    from sbus.services.svcstats import STATS_REQUEST

    answers = []
    with _connect(args) as bus:
        me = _request(bus.whoami, "whoami")
        reply = me + b"/sbus-stats/" + _os.urandom(4).hex().encode()
        bus.subscribe(reply)
        bus.sync()
        bus.publish(STATS_REQUEST, reply)
        deadline = _time.monotonic() + args.wait
        while (left := deadline - _time.monotonic()) > 0:
            try:
                m = bus.receive(timeout=left)
            except TimeoutError:
                break
            if getattr(m, "key", None) == reply:
                try:
                    answers.append(json.loads(m.payload))
                except ValueError:
                    continue
    sys.stdout.write(json.dumps(answers, indent=2) + "\n")
    sys.stdout.flush()
    if not answers:
        # like grep or pgrep: status 1 when nothing was found, and say so where a person looks
        print(f"sbus: no service answered within {args.wait:g} s (no bridge, link or NATS bridge on "
              "this bus? --wait gives slow ones longer)", file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_stats(args) -> int:
    if getattr(args, "services", False):
        return _service_stats(args)
    with _connect(args) as bus:
        try:
            stats = _request(bus.stats, "server/stats")
        except ValueError as e:
            raise CliError(f"the server's statistics are not JSON: {e}") from None
    if args.json:
        sys.stdout.write(json.dumps(stats, indent=2) + "\n")
    else:
        sys.stdout.write(format_stats(stats))
    sys.stdout.flush()
    return 0


def cmd_ping(args) -> int:
    with _connect(args) as bus:
        me = _request(bus.whoami, "whoami")
        # A secret key of our own: nobody else can receive it, and nobody else's traffic interferes.
        key = me + b"/sbus-ping/" + secrets.token_hex(8).encode()
        bus.echo(True)
        bus.subscribe(key)
        _request(bus.whoami, "whoami")
        times = []
        for seq in range(args.count):
            payload = b"%d" % seq
            t0 = time.perf_counter_ns()
            bus.publish(key, payload)
            deadline = time.monotonic() + args.timeout
            while True:
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise TimeoutError
                    m = bus.receive(timeout=left)
                except TimeoutError:
                    raise CliError(f"ping {seq}: no echo within {args.timeout:g} s") from None
                if type(m) is Message and m.key == key and m.payload == payload:
                    break
            times.append((time.perf_counter_ns() - t0) / 1000.0)
    print(f"{len(times)} round trips: min {min(times):.1f} µs, median {statistics.median(times):.1f} µs, "
          f"max {max(times):.1f} µs")
    return 0


# -- the parser -----------------------------------------------------------------


def _number(kind, minimum, inclusive: bool):
    """An argparse type: a finite `kind` (int, float) >= or > `minimum` (a usage error otherwise)."""
    bound = f"{'at least' if inclusive else 'more than'} {minimum:g}"

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {bound}")
        return value

    convert.__name__ = f"{kind.__name__} {bound}"
    return convert


COUNT = _number(int, 1, True)          # how many (messages, round trips): 1 or more
SECONDS = _number(float, 0, False)     # a time: more than 0
RATE = _number(float, 0, False)        # per second: more than 0


class _OptionsAnywhere(argparse.ArgumentParser):
    """A subcommand's parser that takes its options anywhere among its positionals
    (``sbus pub KEY --count 3 PAYLOAD``): plain parsing hands ``KEY`` to both KEY and the
    optional MESSAGE before it sees ``--count``, and PAYLOAD is left over. A command that
    passes the rest of its line on (``serve PATTERN -- CMD``) takes its options anywhere
    before the ``--`` too, where that rest would otherwise begin with an option; a rest that
    begins with a word (``serve PATTERN CMD -n 1``) is the command's, as it always was."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixing:  # parse_known_intermixed_args calls back in here
            return super().parse_known_args(args, namespace)
        args = list(sys.argv[1:] if args is None else args)
        rest = [a for a in self._actions if a.nargs == argparse.REMAINDER]
        tail = None
        if rest:
            plain = super().parse_known_args(args, None if namespace is None else copy.copy(namespace))
            given = [word for a in rest for word in getattr(plain[0], a.dest)]
            if not (given and given[0].startswith("-") and given[0] != "--" and "--" in given):
                return plain
            cut = args.index("--")
            args, tail = args[:cut], args[cut + 1:]
        self._intermixing = True
        saved = [a.nargs for a in rest]
        try:
            for a in rest:
                a.nargs = argparse.ZERO_OR_MORE  # nothing of the command's is left before --
            namespace, extras = self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False
            for a, nargs in zip(rest, saved):
                a.nargs = nargs
        for a in rest:
            setattr(namespace, a.dest, getattr(namespace, a.dest) + tail)
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-b", "--bus", metavar="ADDRESS", default=argparse.SUPPRESS, dest="socket",
                        help="the bus: a path, /dev/unix/abstract/HEX or /dev/fd/N "
                             "(default: $SBUS_SOCKET, else /run/sbus.socket)")
    parser = argparse.ArgumentParser(
        prog="sbus",
        description="Publish and subscribe on an sbus message bus.",
        epilog="The address: --bus, else $SBUS_SOCKET, else /run/sbus.socket (where sbusd and "
               "twistd sbus listen when given no address).",
        parents=[common],
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=_OptionsAnywhere)

    p = sub.add_parser("pub", parents=[common], help="publish a message",
                       description="Publish MESSAGE on KEY. With '-', or no MESSAGE and stdin a pipe or a file, "
                                   "every line of stdin is a message (--whole: all of it is one).")
    p.add_argument("key", metavar="KEY")
    p.add_argument("message", metavar="MESSAGE", nargs="?", help="the payload, or - for stdin")
    p.add_argument("-f", "--file", metavar="FILE", help="publish the contents of FILE as one message")
    p.add_argument("-w", "--whole", action="store_true", help="stdin is one message, not one per line")
    p.add_argument("-n", "--count", type=COUNT, default=1, metavar="N",
                   help="publish each message N times (N >= 1)")
    p.add_argument("-r", "--rate", type=RATE, metavar="R", help="at most R messages per second (R > 0)")
    p.set_defaults(func=cmd_pub)

    p = sub.add_parser("sub", parents=[common], help="print messages matching patterns",
                       description="Subscribe to the PATTERNs and print what arrives, until interrupted, "
                                   "--count messages or --timeout seconds.")
    p.add_argument("patterns", metavar="PATTERN", nargs="+",
                   help="'' matches every key (but the services' sbus/topology/ chatter: name it, 'sbus/topology/'); a trailing '/' matches everything below it ('a/'); "
                        "'*' matches one segment ('a/*/c'). '#' and '>' are literal keys here")
    p.add_argument("-n", "--count", type=COUNT, metavar="N", help="exit after N messages (N >= 1)")
    p.add_argument("-t", "--timeout", type=SECONDS, metavar="S",
                   help="exit after S seconds (S > 0; status 124 if --count messages did not arrive)")
    p.add_argument("-F", "--format", choices=("line", "raw", "payload", "json"), default="line",
                   help="line: 'KEY PAYLOAD' per message (default); raw: the payload bytes only; "
                        "payload: payload and a newline; json: a JSON object per line. Control "
                        "characters are escaped (\\n, \\e, \\xHH; raw excepted) unless --raw")
    p.add_argument("--raw", action="store_true",
                   help="print keys and payloads as they are, control characters included "
                        "(a message could then drive the terminal or fake a line)")
    p.add_argument("--ready-file", metavar="PATH",
                   help="once subscribed, write 'ready' to PATH (a FIFO, or a file created atomically)")
    p.set_defaults(func=cmd_sub)

    p = sub.add_parser("whoami", parents=[common], help="print the credentials the server sees")
    p.set_defaults(func=cmd_whoami)

    p = sub.add_parser("stats", parents=[common], help="print the server's statistics")
    p.add_argument("--json", action="store_true", help="as JSON")
    p.add_argument("--services", action="store_true",
                   help="ask the bridges and links on the bus instead (JSON, one object each; "
                        "none answering: [] and a line on stderr, status 1)")
    p.add_argument("--wait", type=SECONDS, default=1.0, metavar="S",
                   help="with --services: seconds to collect answers (default 1)")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("ping", parents=[common], help="measure round trips through the bus")
    p.add_argument("-n", "--count", type=COUNT, default=10, metavar="N", help="round trips (default 10)")
    p.add_argument("-t", "--timeout", type=SECONDS, default=5.0, metavar="S",
                   help="seconds for each round trip (default 5)")
    p.set_defaults(func=cmd_ping)

    p = sub.add_parser("top", parents=[common], help="a live view of the bus (q quits)",
                       description="A live view of the bus, refreshed from its statistics: clients, "
                                   "messages in and out per second, queues, drops and disconnects by "
                                   "reason. q or Ctrl-C quits.")
    p.add_argument("-i", "--interval", type=SECONDS, default=1.0, metavar="S",
                   help="seconds between refreshes (default 1)")
    p.add_argument("-n", "--iterations", type=COUNT, metavar="N",
                   help="exit after N refreshes (default: until q)")
    p.set_defaults(func=_cmd_top)

    from types import SimpleNamespace

    from .cliwork import add_commands  # request, serve, work

    add_commands(sub, common, SimpleNamespace(
        connect=_connect, error=CliError, printable=_printable, escape=escape, signal_ready=_signal_ready,
        abandon_ready=_abandon_ready, EXIT_TIMEOUT=EXIT_TIMEOUT, COUNT=COUNT, SECONDS=SECONDS))
    return parser


def _cmd_top(args) -> int:
    from .top import cmd_top  # the terminal code only for this command

    return cmd_top(args, _connect, CliError)


def _printable(text: str) -> str:
    """An error text for one line on a terminal (a server's reason could hold anything)."""
    return escape(text.encode("utf-8", "surrogateescape")).decode("utf-8", "replace")


def _quiet_stdout():
    """After a broken pipe on stdout: point it at /dev/null so the exit-time flush is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def main(argv=None) -> int:
    try:
        if argv is None:
            argv = sys.argv[1:]
        args = build_parser().parse_args(respell(list(argv), OLD_SPELLINGS, "sbus"))
        return args.func(args) or 0
    except KeyboardInterrupt:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        except (ValueError, OSError):
            pass
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except CliError as e:
        print(f"sbus: {_printable(str(e))}", file=sys.stderr)
        return e.status
    except ConnectionClosed as e:
        # the server's reason when it gave one (CMSG server/disconnect), else a plain statement
        print(f"sbus: {_printable(str(e) or 'the server closed the connection')}", file=sys.stderr)
        return 1
    except ProtocolError as e:
        print(f"sbus: {_printable(str(e))}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"sbus: {e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
