"""`sbus top`: a live view of a bus, refreshed from its statistics (``CMSG server/stats``).

Plain ANSI redraws, no curses: every interval the screen is cleared and the frame written
again. The frame: the bus's totals (clients, subscriptions), messages and bytes in and out
per second (from the difference of two ``server/stats`` answers), drops, disconnects and
refusals by reason (counts since the server started, with the change since the previous
frame), what each service on the bus lost and why (its ``lost`` counters, asked with
``sbus/services/stats`` each frame and shown at the next: the answers of services, as for
``sbus stats --services``), and the queues the server shows to this uid, the fullest first.

On a terminal, the frames are drawn on the alternate screen (left at exit: the terminal shows
again what it showed before), and stdin is put in cbreak mode so that `q` quits at once; Ctrl-C quits too,
both with status 0. When stdout is not a terminal, the frames are written one after the
other without escape sequences (`--iterations N` ends it after N of them).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import sys
import time

from .client.blocking import ConnectionClosed

REPLY_TIMEOUT = 10.0
CLEAR = "\x1b[H\x1b[2J"
HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
#: The alternate screen (as top, less and vim use it): the frames go there, and leaving it puts
#: back what the terminal showed before, instead of a last frame over a wiped scrollback.
ALT_SCREEN, MAIN_SCREEN = "\x1b[?1049h", "\x1b[?1049l"


def _rate(now: dict, before: dict | None, name: str, dt: float) -> float | None:
    if before is None or dt <= 0 or name not in now or name not in before:
        return None
    return max(0, now[name] - before[name]) / dt


def _si(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f} {prefix}{unit}" if unit else f"{value / factor:.1f}{prefix}"
    if value == int(value):
        return f"{int(value)} {unit}".rstrip()
    return f"{value:.1f} {unit}".rstrip()


def _reasons(now: dict, before: dict | None) -> str:
    if not now:
        return "none"
    parts = []
    for reason, count in sorted(now.items(), key=lambda kv: (-_total(kv[1]), kv[0])):
        count = _total(count)
        text = f"{reason} {count}"
        if before is not None:
            delta = count - _total(before.get(reason, 0))
            if delta:
                text += f" (+{delta})"
        parts.append(text)
    return ", ".join(parts)


def _total(value) -> int:
    if isinstance(value, dict):
        return sum(_total(v) for v in value.values())
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _clean(value) -> str:
    """A value from the server, safe for the terminal (no control characters)."""
    text = str(value)
    return "".join(c if c.isprintable() else "?" for c in text)


def render(address: str, stats: dict, before: dict | None, dt: float, interval: float,
           width: int = 80, height: int = 24, services: list | None = None,
           services_before: list | None = None) -> list[str]:
    """The frame's lines for `stats` (and the previous answer `before`, `dt` seconds earlier);
    `services`: the services' answers to the previous frame's request (None: not asked yet)."""
    up = stats.get("uptime_s")
    head = f"sbus top (q quits)  every {interval:g}s"
    if up is not None:
        head += f"  up {_duration(up)}"
    head += f"  {address}"
    if "id" in stats:
        head += f"  bus {_clean(stats['id'])}"
    lines = [head, ""]
    line = f"clients {stats.get('clients', '-')}   subscriptions {stats.get('subscriptions', '-')}"
    if "queued_bytes" in stats:
        line += f"   queued {_si(stats['queued_bytes'], 'B')}"
    if stats.get("scope") == "uid":
        line += "   (your uid's clients only)"
    lines.append(line)
    for direction in ("in", "out"):
        msgs = _rate(stats, before, f"packets_{direction}", dt)
        nbytes = _rate(stats, before, f"bytes_{direction}", dt)
        lines.append(f"{direction:<4}{_si(msgs, 'msg/s'):>14}  {_si(nbytes, 'B/s'):>12}   "
                     f"total {stats.get(f'packets_{direction}', '-')} msgs, {_si(stats.get(f'bytes_{direction}'), 'B')}")
    for name in ("drops", "disconnects", "refused"):
        if name in stats and isinstance(stats[name], dict):
            prev = before.get(name) if before and isinstance(before.get(name), dict) else None
            lines.append(f"{name:<12}{_reasons(stats[name], prev)}")
    sessions = stats.get("sessions")
    if isinstance(sessions, dict) and any(_total(v) for v in sessions.values()):
        # Named sessions (server/session): "lingering" are dead services' stand-ins still counting.
        prev = before.get("sessions") if before and isinstance(before.get("sessions"), dict) else None
        lines.append(f"{'sessions':<12}{_reasons({k: v for k, v in sessions.items() if _total(v)}, prev)}")
    if services is not None:
        lines.extend(_services(services, services_before))
    queues = [q for q in stats.get("queues", ()) if isinstance(q, dict)]
    lines.append("")
    columns = ("PID", "UID", "SUBS", "QUEUED", "QUEUED_B", "IN/S", "OUT/S", "DROPS", "MODE")
    rows = []
    prev_rows = dict(_by_connection(before.get("queues", ()) if before else ()))
    keyed = _by_connection(queues)
    queues.sort(key=lambda q: (-_total(q.get("queued_bytes", 0)), _total(q.get("pid", 0))))
    key_of = {id(q): k for k, q in keyed}
    for q in queues:
        prev = prev_rows.get(key_of[id(q)])
        rows.append((
            _clean(q.get("pid", "-")), _clean(q.get("uid", "-")), _clean(q.get("subscriptions", "-")),
            _clean(q.get("queued_packets", "-")), _si(q.get("queued_bytes")),
            _si(_rate(q, prev, "packets_in", dt)), _si(_rate(q, prev, "packets_out", dt)),
            str(_total(q.get("drops", {}))),
            _clean(f"{q.get('soft', '-')}/{q.get('hard', '-')}"),
        ))
    room = max(0, height - len(lines) - 2)
    lines.append(f"queues ({len(queues)} shown to this user)" + (
        f", the fullest {room}:" if len(rows) > room else ":"))
    widths = [max(len(c), *(len(r[i]) for r in rows[:room])) if rows[:room] else len(c)
              for i, c in enumerate(columns)]
    lines.append("  ".join(c.rjust(w) if i < 8 else c for i, (c, w) in enumerate(zip(columns, widths))))
    for r in rows[:room]:
        lines.append("  ".join(v.rjust(w) if i < 8 else v for i, (v, w) in enumerate(zip(r, widths))))
    return [line[:width] for line in lines]


def _services(answers: list, before: list | None) -> list[str]:
    """A line per service that answered: its kind, name and what it lost, by reason."""
    def ident(a):
        return (a.get("service"), a.get("pid"), str(a.get("name")))

    prev = {ident(a): a for a in before or () if isinstance(a, dict)}
    rows = [a for a in answers if isinstance(a, dict)]
    lines = [f"services    {len(rows)} answered" + (":" if rows else "")]
    for a in sorted(rows, key=lambda a: (str(a.get("service")), str(a.get("name")))):
        stats = a.get("stats") if isinstance(a.get("stats"), dict) else {}
        if "lost" in stats and isinstance(stats["lost"], dict):
            old = (prev.get(ident(a)) or {}).get("stats") or {}
            old_lost = old.get("lost") if isinstance(old.get("lost"), dict) else None
            what = "lost " + _reasons(stats["lost"], old_lost)
        else:
            what = "(no counters for this uid)" if "stats" not in a or not stats else "lost -"
        lines.append(f"  {_clean(a.get('service', '?'))} {_clean(a.get('name', ''))} pid {_clean(a.get('pid', '-'))}: "
                     f"{_clean(what)}")
    return lines


def _by_connection(queues) -> list:
    """(key, row) for each queue row: its pid, numbered when one process has several
    connections (the server lists them in the same order each time)."""
    seen: dict = {}
    out = []
    for q in queues:
        if isinstance(q, dict):
            pid = q.get("pid")
            n = seen[pid] = seen.get(pid, -1) + 1
            out.append(((pid, n), q))
    return out


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class _Keys:
    """stdin in cbreak mode (keys arrive one by one, Ctrl-C still interrupts), restored on exit."""

    def __init__(self, enable: bool = True):
        self.fd = None
        self.saved = None
        if not enable:
            return
        try:
            fd = sys.stdin.fileno()
        except (AttributeError, ValueError, OSError):
            return
        if not os.isatty(fd):
            return
        import termios
        import tty

        self.fd = fd
        self.saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)

    def restore(self):
        if self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
            self.saved = None

    def wait_quit(self, timeout: float) -> bool:
        """Wait up to `timeout` s; True if `q` (or end of input) came."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.fd is None:
                time.sleep(left)  # the refresh interval, not synchronisation
                return False
            if select.select([self.fd], [], [], left)[0]:
                data = os.read(self.fd, 64)
                if not data or b"q" in data.lower():
                    return True


def cmd_top(args, connect, error) -> int:
    out = sys.stdout
    tty = out.isatty()
    keys = _Keys(enable=tty)
    frames = 0
    try:
        with connect(args) as bus:
            address = bus_address(args)
            before, t_before = None, None
            services = Services(bus)
            if tty:
                out.write(ALT_SCREEN + HIDE_CURSOR)
            while True:
                answers, answers_before = services.collect()
                try:
                    stats = bus.stats(timeout=REPLY_TIMEOUT)
                except TimeoutError:
                    raise error(f"no server/stats reply from the server within {REPLY_TIMEOUT:g} s") from None
                except ValueError as e:
                    raise error(f"the server's statistics are not JSON: {e}") from None
                now = time.monotonic()
                size = shutil.get_terminal_size()
                lines = render(address, stats, before, 0 if t_before is None else now - t_before,
                               args.interval, size.columns, size.lines if tty else 10_000,
                               answers, answers_before)
                if tty:
                    out.write(CLEAR + "\n".join(lines) + "\n")  # the terminal adds the \r
                else:
                    out.write("\n".join(lines) + "\n\n")
                out.flush()
                frames += 1
                before, t_before = stats, now
                services.ask()
                if args.iterations is not None and frames >= args.iterations:
                    return 0
                if keys.wait_quit(args.interval):
                    return 0
    except KeyboardInterrupt:
        return 0
    except ConnectionClosed as e:
        raise error(str(e) or "the server closed the connection") from None
    finally:
        keys.restore()
        if tty:
            try:
                out.write(SHOW_CURSOR + MAIN_SCREEN)
                out.flush()
            except OSError:
                pass


class Services:
    """Asks the services on the bus for their stats each frame (``sbus/services/stats``,
    docs/deploy.md); their answers, which come while the frame waits, show in the next one.
    Its reply key is held only between the request and the next frame, never while the
    server's stats are taken: top's own subscription does not show in the figures it draws."""

    def __init__(self, bus):
        from .services.svcstats import STATS_REQUEST

        self.bus = bus
        self.request = STATS_REQUEST
        self.base = bus.whoami(timeout=REPLY_TIMEOUT) + b"/sbus-top/" + os.urandom(4).hex().encode() + b"/"
        self.reply: bytes | None = None
        self.rounds = 0
        self.answers: list | None = None

    def collect(self) -> tuple[list | None, list | None]:
        """The answers to the previous request (None before the first) and the ones before them."""
        from .core.codec import Message

        before = self.answers
        if self.reply is not None:
            got = []
            while True:
                try:
                    m = self.bus.receive(timeout=0)
                except TimeoutError:
                    break
                if isinstance(m, Message) and m.key == self.reply:
                    try:
                        got.append(json.loads(m.payload))
                    except ValueError:
                        continue
            self.bus.unsubscribe(self.reply)
            self.reply = None
            self.answers = got
        return self.answers, before

    def ask(self) -> None:
        self.rounds += 1
        self.reply = self.base + b"%d" % self.rounds  # a late answer to an earlier round is not this one's
        self.bus.subscribe(self.reply)
        self.bus.publish(self.request, self.reply)


def bus_address(args) -> str:
    from .client.address import resolve

    try:
        return _clean(resolve(getattr(args, "socket", None)).text)
    except Exception:  # noqa: BLE001 - only a label
        return "?"
