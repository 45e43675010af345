"""`sbus request`, `sbus serve` and `sbus work`: request/reply and work queues from a shell.

    sbus request KEY [PAYLOAD | -]     publish a request, print the first reply
    sbus serve PATTERN -- CMD...       answer requests: CMD's output is the reply
    sbus work GROUP -- CMD...          join a work-queue group, run CMD per message, ack

(docs/request-reply.md, docs/queues.md). Registered by `sbus.cli.build_parser`.
"""

from __future__ import annotations

import argparse
import functools
import os
import pwd
import subprocess
import sys

from sbus.core.codec import ProtocolError, encode_sub
from sbus.core.reqrep import ANY, NoResponders, RemoteError, RequestTimeout
from sbus.core.workqueue import NoService, QueueFull, Refused


def _command(args, cli) -> list[str]:
    cmd = list(args.command_line)
    if cmd and cmd[0] == "--":  # argparse keeps it when options came after the positional
        cmd = cmd[1:]
    if cmd and cmd[0].startswith("-"):
        raise cli.error("options go before the pattern or group, the command after --: "
                           f"sbus {args.command} [OPTIONS] {'PATTERN' if args.command == 'serve' else 'GROUP'} "
                           "-- CMD [ARGS...]", 2)
    if not cmd:
        raise cli.error("give the command to run after --", 2)
    return cmd


def _run(cli, cmd, body: bytes, env: dict, capture: bool) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, input=body, env=env, stdout=subprocess.PIPE if capture else None)
    except FileNotFoundError:
        raise cli.error(f"{cmd[0]}: command not found", 127) from None
    except PermissionError:
        raise cli.error(f"{cmd[0]}: permission denied", 126) from None


def _ready(args, cli) -> None:
    if args.ready_file:
        cli.signal_ready(args.ready_file)
        args.ready_signalled = True


def _guard(fn):
    def run(args, cli) -> int:
        try:
            return fn(args, cli)
        except BaseException:
            if getattr(args, "ready_file", None) and not getattr(args, "ready_signalled", False):
                cli.abandon_ready(args.ready_file)
            raise
    return run


# -- request -------------------------------------------------------------------------------


def cmd_request(args, cli) -> int:
    key = os.fsencode(args.key)
    if args.payload == "-":
        body = sys.stdin.buffer.read()
    else:
        body = os.fsencode(args.payload or "")
    with cli.connect(args) as bus:
        try:
            reply = bus.request(key, body, timeout=args.timeout, check=not args.no_check,
                                responder_uid=args.from_uid)
        except NoResponders as e:
            raise cli.error(str(e)) from None
        except RequestTimeout as e:
            raise cli.error(str(e), cli.EXIT_TIMEOUT) from None
        except RemoteError as e:
            raise cli.error(f"the responder failed: {cli.printable(e.text)}") from None
        except ProtocolError as e:
            raise cli.error(f"bad request: {e}") from None
    out = sys.stdout.buffer
    out.write((reply if args.raw else cli.escape(reply)) + b"\n")
    out.flush()
    return 0


def responder_uid(text: str):
    """`--from-uid`: a uid, a user name, or 'any'."""
    if text == ANY or (text.isdigit() and int(text) < 2 ** 32):
        return ANY if text == ANY else int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise argparse.ArgumentTypeError(f"not a uid, a user name or '{ANY}': {text}") from None


# -- submit --------------------------------------------------------------------------------


def cmd_submit(args, cli) -> int:
    key = os.fsencode(args.key)
    body = sys.stdin.buffer.read() if args.payload == "-" else os.fsencode(args.payload or "")
    with cli.connect(args) as bus:
        try:
            bus.submit(args.group, [(key, body)], timeout=args.timeout, responder_uid=args.from_uid)
        except RequestTimeout as e:
            raise cli.error(f"not confirmed: {e}", cli.EXIT_TIMEOUT) from None
        except (NoService, QueueFull, ValueError, ProtocolError) as e:
            raise cli.error(f"not held: {e}") from None
    return 0


# -- serve ---------------------------------------------------------------------------------


@_guard
def cmd_serve(args, cli) -> int:
    cmd = _command(args, cli)
    pattern = os.fsencode(args.pattern)
    env = dict(os.environ)

    def handle(key: bytes, body: bytes):
        r = _run(cli, cmd, body, dict(env, SBUS_KEY=os.fsdecode(key)), capture=True)
        if r.returncode != 0:
            print(f"sbus: {cli.printable(cmd[0])} exited {r.returncode} on {cli.printable(os.fsdecode(key))}: "
                  "no reply", file=sys.stderr, flush=True)
            return None
        return r.stdout

    try:
        encode_sub(pattern)
    except ProtocolError as e:
        raise cli.error(f"bad pattern {args.pattern!r}: {e}", 2) from None
    with cli.connect(args) as bus:
        bus.serve(pattern, handle, count=args.count, ready=lambda: _ready(args, cli))
    return 0


# -- work ----------------------------------------------------------------------------------


@_guard
def cmd_work(args, cli) -> int:
    cmd = _command(args, cli)
    env = dict(os.environ)
    with cli.connect(args) as bus:
        try:
            worker = bus.join(args.group, timeout=args.timeout)
        except ValueError as e:
            raise cli.error(str(e), 2) from None
        except Refused as e:
            raise cli.error(f"refused: {e}") from None
        except TimeoutError as e:
            raise cli.error(str(e)) from None
        _ready(args, cli)
        done = 0
        for delivery in worker:
            r = _run(cli, cmd, delivery.payload, dict(env, SBUS_KEY=os.fsdecode(delivery.key),
                                                 SBUS_DELIVERIES=str(delivery.deliveries),
                                                 SBUS_REDELIVERED="1" if delivery.redelivered else "0"),
                     capture=False)
            if r.returncode != 0:
                error = f"{cmd[0]} exited {r.returncode} on {os.fsdecode(delivery.key)}"
                if args.reject:
                    worker.reject(delivery, error)
                    what = "rejected (to the dead letters)"
                else:
                    worker.nack(delivery, args.nack_delay, error)
                    what = "nacked (redelivered" + (f" after {args.nack_delay:g} s)" if args.nack_delay else ")")
                print(f"sbus: {cli.printable(error)}: {what}", file=sys.stderr, flush=True)
            else:
                worker.ack(delivery)
            done += 1
            if args.count is not None and done >= args.count:
                bus.sync(10.0)  # the acks have reached the bus before we leave
                break
    return 0


def add_commands(sub, common, cli) -> None:
    """Add the commands to `sub`. `cli` holds what they share with `sbus.cli` (connect, error,
    printable, escape, signal_ready, abandon_ready, EXIT_TIMEOUT, COUNT, SECONDS): given, not
    imported, because under ``python -m sbus.cli`` that module is ``__main__``, whose CliError
    is the one `main()` catches."""
    COUNT, SECONDS = cli.COUNT, cli.SECONDS
    p = sub.add_parser("request", parents=[common], help="send a request, print the first reply",
                       description="Publish a request on KEY (the reply key, under your own secret "
                                   "prefix, goes in front of the payload) and print the first reply. "
                                   "Fails at once if nobody is subscribed to KEY (docs/request-reply.md).")
    p.add_argument("key", metavar="KEY")
    p.add_argument("payload", metavar="PAYLOAD", nargs="?", help="the request's body, or - for stdin")
    p.add_argument("-t", "--timeout", type=SECONDS, default=5.0, metavar="S",
                   help="seconds to wait for the reply (default 5; status 124 after)")
    p.add_argument("--no-check", action="store_true",
                   help="do not fail when the server reports nobody subscribed (a responder of "
                        "another uid is invisible to you unless you are root or the bus owner)")
    p.add_argument("--raw", action="store_true", help="print the reply as it is (no escaping)")
    p.add_argument("--from-uid", type=responder_uid, metavar="UID", default=None,
                   help="accept the reply only from a responder that proves it runs as UID (a uid or "
                        "user name; default: your own uid), or 'any' for any reply, unverified "
                        "(what a responder from before verified replies can give)")
    p.set_defaults(func=functools.partial(cmd_request, cli=cli))

    p = sub.add_parser("submit", parents=[common], help="hand a job to a work queue, confirmed",
                       description="Hand the message KEY PAYLOAD to the sbus-queue service of GROUP "
                                   "and exit 0 once it holds it (journalled, with --store); status 1 "
                                   "when no service serves GROUP or the group is full, 124 with no "
                                   "answer within the timeout (docs/queues.md).")
    p.add_argument("group", metavar="GROUP")
    p.add_argument("key", metavar="KEY")
    p.add_argument("payload", metavar="PAYLOAD", nargs="?", help="the job's payload, or - for stdin")
    p.add_argument("-t", "--timeout", type=SECONDS, default=5.0, metavar="S",
                   help="seconds to wait for the confirmation (default 5; status 124 after)")
    p.add_argument("--from-uid", type=responder_uid, metavar="UID", default=ANY,
                   help="take the confirmation only from a queue service that proves it runs as UID "
                        "(a uid or user name); default 'any': any answer counts, as before verified "
                        "replies (another uid on a shared bus could answer first)")
    p.set_defaults(func=functools.partial(cmd_submit, cli=cli))

    p = sub.add_parser("serve", parents=[common], help="answer requests with a command",
                       description="Answer requests on PATTERN: CMD runs once per request with the "
                                   "request's body on stdin and $SBUS_KEY set; its standard output is "
                                   "the reply (a non-zero exit: no reply).")
    p.add_argument("pattern", metavar="PATTERN")
    p.add_argument("command_line", metavar="-- CMD", nargs=argparse.REMAINDER)
    p.add_argument("-n", "--count", type=COUNT, metavar="N", help="exit after N requests")
    p.add_argument("--ready-file", metavar="PATH", help="once subscribed, write 'ready' to PATH")
    p.set_defaults(func=functools.partial(cmd_serve, cli=cli))

    p = sub.add_parser("work", parents=[common], help="take messages of a work-queue group",
                       description="Join GROUP of twistd sbus-queue and run CMD once per message "
                                   "(payload on stdin; $SBUS_KEY, $SBUS_DELIVERIES, $SBUS_REDELIVERED "
                                   "set); exit 0 acknowledges it; another status nacks it (the service "
                                   "redelivers it, up to its --max-deliveries) or, with --reject, "
                                   "sends it to the dead letters; sbus work goes on.")
    p.add_argument("group", metavar="GROUP")
    p.add_argument("command_line", metavar="-- CMD", nargs=argparse.REMAINDER)
    p.add_argument("-n", "--count", type=COUNT, metavar="N", help="exit after N messages")
    p.add_argument("-t", "--timeout", type=SECONDS, default=5.0, metavar="S",
                   help="seconds to wait for the service to answer the join (default 5)")
    p.add_argument("--ready-file", metavar="PATH", help="once joined, write 'ready' to PATH")
    p.add_argument("--reject", action="store_true",
                   help="a command that fails rejects the message (to the dead letters) instead of nacking it")
    p.add_argument("--nack-delay", type=SECONDS, default=0.0, metavar="S",
                   help="a failed message is redelivered after S seconds (default 0)")
    p.set_defaults(func=functools.partial(cmd_work, cli=cli))
