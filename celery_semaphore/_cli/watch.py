"""``celery -A proj semaphore status --watch [SECONDS]``: the status read again every SECONDS.

Where it goes decides how it prints:

* a terminal: one frame redrawn in place on the alternate screen (the shell's screen comes
  back on Ctrl-C), headed by the time and the interval, cut to the terminal's size;
* a pipe or a file: no escape codes; every refresh as a block of plain text headed by the same
  line, blocks separated by a blank line, each one flushed as it is printed;
* ``--json``, wherever it goes: one JSON document per refresh, on one line (JSON lines).

Ctrl-C (or SIGINT) ends the watch with exit status 0. Redis failing after the first refresh
does not end it: the frame says so and the next refresh tries again.

Starts per minute: a key with a rate keeps its recent starts in Redis (``starts_in_window``, the
rate's window that ends now), so its figure is exact, averaged over that window. A key without a
rate keeps no count of its starts, and adding one would cost every acquire a write; so the watch
counts the holders it has seen granted in the last minute (``StartsSeen``): a lower bound, since
a task that starts and ends between two refreshes is never seen.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, Final, TextIO

import click

from .._core.validation import check_seconds
from ..errors import ConfigurationError, SemaphoreError
from .reports import Report, detail_lines, summary_lines

WATCH_EVERY: Final = 2.0  # seconds between two refreshes of --watch without a value
MINUTE: Final = 60.0
FROM_RATE: Final = "rate window"  # starts_in_window of a key with a rate, per minute
FROM_HOLDERS: Final = "holders seen"  # holders granted in the last minute that a refresh saw

# alternate screen and hidden cursor on the way in, both undone on the way out
ENTER: Final = "\x1b[?1049h\x1b[?25l"
LEAVE: Final = "\x1b[?25h\x1b[?1049l"
HOME: Final = "\x1b[H"
CLEAR_LINE: Final = "\x1b[K"
CLEAR_BELOW: Final = "\x1b[J"


# -- the option -----------------------------------------------------------------------------


def check_watch(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """--watch's refresh interval: seconds above 0. Since --watch may come without a value, a
    KEY after it is taken for one; the message says where KEY goes."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        hint = f"; a KEY goes before --watch: status {value} --watch" if not value.startswith("-") else ""
        raise click.BadParameter(f"{value!r} is not a number of seconds{hint}", ctx=ctx, param=param) from None
    try:
        return check_seconds("--watch", seconds)
    except ConfigurationError as error:
        raise click.BadParameter(f"{value!r}: {error.reason}", ctx=ctx, param=param) from error


class WatchableCommand(click.Command):
    """A command whose --watch takes its value or none: click then reads ``--watch -1`` (and
    ``--watch=-1``) as --watch with no value followed by an unknown option ``-1``. Said as what it
    is instead: a bad --watch."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        value = _watch_value(args)
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption:
            if value is not None and _is_number(value):
                # a number that looks like an option is below 0: refused here, as a bad --watch
                check_watch(ctx, next(param for param in self.params if param.name == "watch"), value)
            raise


def _watch_value(args: list[str]) -> str | None:
    """What follows --watch in ``args`` (as its value or as the next argument), if anything."""
    for at, arg in enumerate(args):
        if arg.startswith("--watch="):
            return arg.partition("=")[2]
        if arg == "--watch":
            return args[at + 1] if at + 1 < len(args) else None
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# -- the loop -------------------------------------------------------------------------------


class StartsSeen:
    """Starts per minute of each key a watch shows (see the module's docstring)."""

    def __init__(self) -> None:
        self._granted: dict[str, dict[str, float]] = {}  # key -> holder token -> when granted

    def per_minute(self, r: Report, now: float) -> tuple[float, str]:
        """The figure for ``r`` read at ``now`` (time.monotonic()), and where it comes from."""
        if r.rate is not None:
            return r.starts_in_window * MINUTE / r.rate.period, FROM_RATE
        granted = self._granted.setdefault(r.key, {})
        for holder in r.holders:
            granted.setdefault(holder.token, now - holder.held_for)
        for token, at in list(granted.items()):
            if at <= now - MINUTE:
                del granted[token]
        return float(len(granted)), FROM_HOLDERS


def per_minute_text(value: float, source: str) -> str:
    """``12`` or ``0.5`` from a rate's window, ``>=3`` from holders seen (a lower bound)."""
    number = f"{value:.0f}" if value == int(value) else f"{value:.1f}"
    return number if source == FROM_RATE or value == 0 else f">={number}"


class Watch:
    """One ``status --watch``: ``read`` gives the reports of a refresh, ``key`` is the one
    asked for (None: the list), and ``out`` is where frames go."""

    def __init__(
        self,
        read: Callable[[], list[Report]],
        *,
        key: str | None,
        interval: float,
        as_json: bool,
        out: TextIO,
        empty_text: str,
        about: dict[str, Any],
    ) -> None:
        self.read, self.key, self.interval, self.as_json, self.out = read, key, interval, as_json, out
        self.empty_text, self.about = empty_text, about  # what an empty list says; JSON's backend, prefix
        self.on_screen = not as_json and out.isatty()
        self.starts = StartsSeen()
        self.refreshed = False

    def run(self) -> None:
        """Refresh every ``interval`` seconds until Ctrl-C; the terminal is restored however it ends."""
        try:
            if self.on_screen:
                self._write(ENTER)
            while True:
                due = time.monotonic() + self.interval
                self._show(self._frame())
                time.sleep(max(due - time.monotonic(), 0.0))
        except KeyboardInterrupt:
            pass
        except BrokenPipeError:  # `... --watch | head`: the reader is gone, so is the point
            # nothing more can reach the pipe, not even the flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.out.fileno())
        finally:
            if self.on_screen:
                self._write(LEAVE)

    def _frame(self) -> list[str]:
        """The lines of one refresh (for --json, one line). A Redis error on the first refresh
        ends the command as without --watch; later, the frame shows it and the watch goes on."""
        stamp = datetime.now().astimezone()
        try:
            reports = self.read()
        except SemaphoreError as error:
            if not self.refreshed:
                raise
            if self.as_json:
                return [json.dumps({"at": stamp.isoformat(timespec="seconds"), "error": str(error)})]
            return [self._header(stamp), f"error: {error}; trying again every {self.interval:g}s"]
        self.refreshed = True
        now = time.monotonic()
        figures = {r.key: self.starts.per_minute(r, now) for r in reports}
        if self.as_json:
            return [self._json(stamp, reports, figures)]
        texts = {key: per_minute_text(*figure) for key, figure in figures.items()}
        if self.key is not None:
            body = detail_lines(reports[0], [f"starts/min {texts[self.key]}"])
        elif reports:
            body = summary_lines(reports, texts)
        else:
            body = [self.empty_text]
        return [self._header(stamp), *([""] if self.on_screen else []), *body]

    def _header(self, stamp: datetime) -> str:
        what = f"status {self.key}" if self.key is not None else "status"
        hint = "  (Ctrl-C to quit)" if self.on_screen else ""
        return f"{stamp:%Y-%m-%d %H:%M:%S}  every {self.interval:g}s: {what}{hint}"

    def _json(self, stamp: datetime, reports: list[Report], figures: dict[str, tuple[float, str]]) -> str:
        semaphores = []
        for r in reports:
            value, source = figures[r.key]
            data = r.as_json(details=self.key is not None)
            semaphores.append({**data, "starts_per_minute": value, "starts_per_minute_from": source})
        data = {"at": stamp.isoformat(timespec="seconds"), "interval": self.interval, **self.about}
        return json.dumps({**data, "semaphores": semaphores})

    def _show(self, lines: list[str]) -> None:
        if not self.on_screen:
            # a blank line between blocks; JSON lines need none
            self._write("\n".join(lines) + ("\n" if self.as_json else "\n\n"))
            return
        columns, rows = shutil.get_terminal_size()
        shown = [line[:columns] + CLEAR_LINE for line in lines[:rows]]
        self._write(HOME + "\n".join(shown) + CLEAR_BELOW)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
