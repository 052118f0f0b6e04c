"""``celery -A proj semaphore ...``: look at and steer the semaphores of a Celery app.

Plugged into Celery's own command line through the ``celery.commands`` entry point, so it loads
the app the usual way (``-A``) and reads the same ``semaphore_*`` settings the workers read:

* ``status [KEY] [--watch [SECONDS]]``: without a key, every semaphore the backend Redis knows of (found by SCAN)
  plus every semaphore task of the app whose key is fixed; with a key, its holders and waiters.
  The limit, rate and spacing are shown with where they come from, in the order the workers
  apply them: a runtime override stored in Redis, then ``semaphore_limits``, then the task's own
  option; and a pause, with when the rules let the next task start. ``--watch`` shows it again
  every few seconds, with starts per minute (``_cli/watch.py``).
* ``set-limit KEY [N] [--rate R] [--spacing S] [--ttl SECONDS]`` and ``unset-limit KEY``: the
  runtime overrides (``--rate none`` and ``--spacing none`` drop those).
* ``set-share KEY TENANT N|none``: a tenant's runtime share of a key's line.
* ``pause KEY [--for SECONDS]`` and ``resume KEY``: let nobody start, then everybody again.
* ``reset KEY``: forget every holder and waiter (asks first, unless ``--yes``).
* ``why TASK_ID [--key KEY]``: whether a task runs, waits (where, and held back by what), is
  parked, is done, or is unknown (``_celery/why.py``; printed by ``_cli/why_text.py``).

What ``status`` reports and how it prints is in ``_cli/reports.py``; which task a key belongs to
and which rules apply to it is the catalogue's answer (``_celery/catalogue.py``), the same one the
workers and the metrics collector use.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final, Literal

import click

from ._celery.catalogue import Catalogue
from ._celery.parking import parking
from ._celery.wake_queues import wake_aware
from ._celery.why import why as why_answer
from ._cli.reports import (
    Report,
    detail_lines,
    duration,
    limit_text,
    next_start_text,
    rate_text,
    report,
    spacing_text,
    summary_lines,
)
from ._cli.watch import WATCH_EVERY, Watch, WatchableCommand, check_watch
from ._cli.why_text import why_lines
from ._core.clients import client_for
from ._core.rules import Rate, check_rate, check_spacing
from ._core.storage import glob_escape
from ._core.validation import check_seconds
from .errors import ConfigurationError, SemaphoreError

__all__ = ["duration", "semaphore"]

# what --rate and --spacing take to drop a runtime rule (the configured one applies again)
DROP: Final = "none"

# -- checking arguments ---------------------------------------------------------------------


@contextmanager
def _as_click_errors() -> Iterator[None]:
    """Bad settings and an unreachable Redis end the command with a one-line message (exit 1),
    not a traceback: they are the operator's to fix, and the message names what to fix."""
    try:
        yield
    except ConfigurationError as error:
        raise click.ClickException(f"bad semaphore setting: {error}") from error
    except SemaphoreError as error:
        raise click.ClickException(str(error)) from error


def _catalogue(ctx: click.Context) -> Catalogue:
    app = ctx.obj.app
    # tasks in modules named by `include`/`imports` or autodiscovery are registered only once
    # those modules are imported, as `celery report` does
    app.loader.import_default_modules()
    return Catalogue(app)


def _waking_parked_tasks(catalogue: Catalogue) -> Catalogue:
    """``catalogue``, with this process set to send the wake copies of the parked tasks its
    command offers a start to: a resume must not wait for a process that may be gone (a pool
    process recycled after its task parked) to hear the offer."""
    app, config = catalogue.app, catalogue.config
    wake_aware(app)  # a wake copy goes to a wake queue declared like its origin, from here too
    parking().wake_from(app, client_for(config.backend), config.prefix)
    return catalogue


def _check_limit(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A limit as the semaphore takes it: a whole number of slots, at least 1. Refused with the
    value in the message, as a usage error (exit code 2), before anything touches Redis."""
    if value is None:
        return None
    try:
        number = int(value.strip(), 10)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a whole number of slots", ctx=ctx, param=param) from None
    if number < 1:
        raise click.BadParameter(f"{value!r} is below 1: a limit is at least one slot", ctx=ctx, param=param)
    return number


def _check_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A duration (--ttl, --for): a finite number of seconds above 0."""
    if value is None:
        return None
    try:
        return check_seconds(str(param.name), value)
    except ConfigurationError as error:
        raise click.BadParameter(f"{value!r}: {error.reason}", ctx=ctx, param=param) from error


def _check_rate(ctx: click.Context, param: click.Parameter, value: str | None) -> Rate | Literal["none"] | None:
    """A rate as the settings take it ("30/m", "5/s", "10/30s"), or "none" to drop the runtime
    rate; refused as a usage error naming the value, before anything touches Redis."""
    if value is None:
        return None
    if value.strip().lower() == DROP:
        return DROP
    try:
        return check_rate("--rate", value)
    except ConfigurationError as error:
        raise click.BadParameter(f"{value!r}: {error.reason}", ctx=ctx, param=param) from error


def _check_spacing(ctx: click.Context, param: click.Parameter, value: str | None) -> float | Literal["none"] | None:
    """Seconds between two starts, above 0, or "none" to drop the runtime spacing."""
    if value is None:
        return None
    if value.strip().lower() == DROP:
        return DROP
    try:
        return check_spacing("--spacing", float(value))
    except ValueError as error:  # a ConfigurationError is a ValueError too
        reason = error.reason if isinstance(error, ConfigurationError) else "expected a number of seconds"
        raise click.BadParameter(f"{value!r}: {reason}", ctx=ctx, param=param) from error


def _note_unknown_key(ctx: click.Context, catalogue: Catalogue, key: str, what: str) -> None:
    """An override stored under a mistyped key steers nothing; say so on stderr, and store it
    anyway: the key may belong to code the CLI cannot see (a FairSemaphore outside Celery)."""
    task = catalogue.task_for(key)
    rule = catalogue.configured_limit(key, task)
    if task is None and rule is None and key not in catalogue.scan(glob_escape(key)):
        ctx.obj.error(
            f"note: no task of this app, no semaphore_limits entry and no live semaphore "
            f"matches {key!r}; storing the {what} anyway (check the key for typos)"
        )


# -- the commands ---------------------------------------------------------------------------


@click.group(name="semaphore")
@click.pass_context
def semaphore(ctx: click.Context) -> None:
    """Look at and steer the semaphores of the app's tasks: limits, rates, spacings, pauses."""


@semaphore.command(cls=WatchableCommand)
@click.argument("key", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts (with --watch: one line per refresh).")
@click.option("--match", metavar="GLOB", help="Without KEY: only keys matching this Redis glob (e.g. 'crawl:*').")
@click.option(
    "--watch",
    metavar="[SECONDS]",
    is_flag=False,
    flag_value=str(WATCH_EVERY),
    callback=check_watch,
    help=f"Refresh every SECONDS (default {WATCH_EVERY:g}) until Ctrl-C; plain blocks when not a terminal.",
)
@click.pass_context
def status(ctx: click.Context, key: str | None, as_json: bool, match: str | None, watch: float | None) -> None:
    """Show one semaphore (KEY), or list them all.

    The list holds every semaphore with holders, waiters or a runtime limit in the backend Redis,
    and every semaphore task of the app whose key is fixed. A key is one Redis round trip: narrow
    a list of many per-argument keys with --match.
    """
    if key is not None and match is not None:
        raise click.UsageError("--match narrows the list; it cannot be combined with KEY", ctx=ctx)
    with _as_click_errors():
        catalogue = _catalogue(ctx)
        empty = (
            f"no semaphores in {catalogue.backend} (prefix {catalogue.config.prefix!r}), "
            "and no semaphore task of this app has a fixed key"
        )
        if watch is not None:

            def read() -> list[Report]:
                return [report(catalogue, k) for k in ([key] if key is not None else catalogue.known_keys(match))]

            about = {"backend": catalogue.backend, "prefix": catalogue.config.prefix}
            out = sys.stdout
            Watch(read, key=key, interval=watch, as_json=as_json, out=out, empty_text=empty, about=about).run()
            return
        if key is not None:
            r = report(catalogue, key)
            if as_json:
                ctx.obj.echo(json.dumps(r.as_json(details=True), indent=2))
            else:
                ctx.obj.echo("\n".join(detail_lines(r)))
            return
        reports = [report(catalogue, k) for k in catalogue.known_keys(match)]
    if as_json:
        data = {
            "backend": catalogue.backend,
            "prefix": catalogue.config.prefix,
            "semaphores": [r.as_json(details=False) for r in reports],
        }
        ctx.obj.echo(json.dumps(data, indent=2))
    elif not reports:
        ctx.obj.echo(empty)
    else:
        ctx.obj.echo("\n".join(summary_lines(reports)))


@semaphore.command(name="set-limit")
@click.argument("key")
@click.argument("limit", metavar="[N]", required=False, callback=_check_limit)
@click.option(
    "--rate",
    metavar="RATE",
    callback=_check_rate,
    help='At most this many starts per period: "30/m", "5/s", "500/h", "10/30s"; "none" drops the runtime rate.',
)
@click.option(
    "--spacing",
    metavar="SECONDS",
    callback=_check_spacing,
    help='At least this many seconds between two starts; "none" drops the runtime spacing.',
)
@click.option(
    "--ttl",
    type=float,
    metavar="SECONDS",
    callback=_check_seconds,
    help="Drop what this command sets by itself after this many seconds (default: keep it until unset).",
)
@click.pass_context
def set_limit(
    ctx: click.Context,
    key: str,
    limit: int | None,
    rate: Rate | Literal["none"] | None,
    spacing: float | Literal["none"] | None,
    ttl: float | None,
) -> None:
    """Override the limit of KEY with N, its rate or its spacing, for every worker.

    A runtime rule wins over semaphore_limits and the task's option until unset-limit (the limit),
    --rate none, --spacing none or --ttl drops it. Blocked waiters are woken at once, so a looser
    rule admits them now.
    """
    if limit is None and rate is None and spacing is None:
        raise click.UsageError("give N, --rate or --spacing: the runtime rule to store", ctx=ctx)
    if ttl is not None and limit is None and not isinstance(rate, Rate) and not isinstance(spacing, float):
        raise click.UsageError("--ttl needs a rule to set: 'none' drops a rule at once, for good", ctx=ctx)
    with _as_click_errors():
        catalogue = _waking_parked_tasks(_catalogue(ctx))  # a looser rule offers them starts
        _note_unknown_key(ctx, catalogue, key, "override")
        sem = catalogue.semaphore(key, placeholder_limit=True)
        if limit is not None:
            sem.set_limit(limit, ttl=ttl)
        if rate is not None:
            sem.set_rate(rate if isinstance(rate, Rate) else None, ttl=ttl if isinstance(rate, Rate) else None)
        if spacing is not None:
            spacing_value = spacing if isinstance(spacing, float) else None
            sem.set_spacing(spacing_value, ttl=ttl if spacing_value is not None else None)
        r = report(catalogue, key)
    if limit is not None:
        ctx.obj.echo(f"{key}: limit {limit_text(r)}")
    if rate is not None:
        ctx.obj.echo(f"{key}: rate {rate_text(r)}")
    if spacing is not None:
        ctx.obj.echo(f"{key}: spacing {spacing_text(r)}")


@semaphore.command(name="unset-limit")
@click.argument("key")
@click.pass_context
def unset_limit(ctx: click.Context, key: str) -> None:
    """Drop the runtime limit of KEY.

    The limit from semaphore_limits or the task's option applies again. A runtime rate or
    spacing stays: set-limit KEY --rate none --spacing none drops those.
    """
    with _as_click_errors():
        catalogue = _waking_parked_tasks(_catalogue(ctx))  # a higher limit in code offers starts
        sem = catalogue.semaphore(key, placeholder_limit=True)
        had_override = sem.status().limit_source == "override"
        sem.clear_limit()
        r = report(catalogue, key)
    if not had_override:
        ctx.obj.echo(f"{key}: there was no runtime limit; limit {limit_text(r)}")
    else:
        ctx.obj.echo(f"{key}: runtime limit removed; limit {limit_text(r)}")


@semaphore.command(name="set-share")
@click.argument("key")
@click.argument("tenant")
@click.argument("share", metavar="N|none")
@click.pass_context
def set_share(ctx: click.Context, key: str, tenant: str, share: str) -> None:
    """Give TENANT the share N of KEY's line, for every worker ("none" removes it).

    A runtime share wins over semaphore_shares for that key; it places the tenant's calls that
    join the line from now on (those waiting keep their places).
    """
    value: float | None = None
    if share.lower() != "none":
        try:
            value = float(share)
        except ValueError:
            raise click.BadParameter(
                f"{share!r}: expected a number from 0.001 to 1000, or none", param_hint="N"
            ) from None
    with _as_click_errors():
        catalogue = _catalogue(ctx)
        _note_unknown_key(ctx, catalogue, key, "share")
        catalogue.semaphore(key, placeholder_limit=True).set_share(tenant, value)
    if value is None:
        ctx.obj.echo(f"{key}: runtime share of {tenant!r} removed")
    else:
        ctx.obj.echo(f"{key}: {tenant!r} has share {value:g}")


@semaphore.command()
@click.argument("key")
@click.option(
    "--for",
    "seconds",
    type=float,
    metavar="SECONDS",
    callback=_check_seconds,
    help="End the pause by itself after this many seconds (default: until resume).",
)
@click.pass_context
def pause(ctx: click.Context, key: str, seconds: float | None) -> None:
    """Let no task of KEY start, on any worker, until resume (or for --for SECONDS).

    For an API that answered 429 with Retry-After, or a vendor's incident. Holders keep running
    and waiters keep their places; the first in line starts the moment the pause ends. Pausing
    again replaces the pause.
    """
    with _as_click_errors():
        catalogue = _waking_parked_tasks(_catalogue(ctx))
        _note_unknown_key(ctx, catalogue, key, "pause")
        catalogue.semaphore(key, placeholder_limit=True).pause(seconds)
        r = report(catalogue, key)
    length = "until resumed" if r.paused_for is None else f"for {duration(r.paused_for)}"
    ctx.obj.echo(
        f"{key}: paused {length}; {r.holder_count} holder(s) keep running, {r.waiter_count} waiter(s) keep their places"
    )


@semaphore.command()
@click.argument("key")
@click.pass_context
def resume(ctx: click.Context, key: str) -> None:
    """End the pause of KEY now: the first in line may start at once, if a slot is free and the
    rate and spacing allow."""
    with _as_click_errors():
        catalogue = _waking_parked_tasks(_catalogue(ctx))
        sem = catalogue.semaphore(key, placeholder_limit=True)
        was_paused = sem.status(listed=0).paused_for is not None
        sem.resume()
        r = report(catalogue, key)
    state = "resumed" if was_paused else "was not paused"
    ctx.obj.echo(f"{key}: {state}; next start {next_start_text(r)}")


@semaphore.command()
@click.argument("key")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def reset(ctx: click.Context, key: str, yes: bool) -> None:
    """Forget every holder and waiter of KEY, and its recent starts.

    The runtime limit, rate, spacing and pause stay. For recovering from a mistake, such as
    slots held by workers that are gone for good. A holder that is still running takes its
    slot back at its next lease renewal if one is free; if not, the limit can be exceeded
    until it ends.
    """
    with _as_click_errors():
        catalogue = _catalogue(ctx)
        before = report(catalogue, key)
    if not yes:
        click.confirm(
            f"Forget {before.holder_count} holder(s) and {before.waiter_count} waiter(s) of {key!r}? A holder "
            "still running takes its slot back at its next renewal only if one is free: the limit can be "
            "exceeded until such holders end",
            abort=True,
        )
    with _as_click_errors():
        catalogue.semaphore(key, placeholder_limit=True).reset()
    ctx.obj.echo(f"{key}: forgot {before.holder_count} holder(s) and {before.waiter_count} waiter(s)")


@semaphore.command()
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.option(
    "--key",
    "keys",
    multiple=True,
    metavar="KEY",
    help="Look at this semaphore key (repeatable): for a task whose key comes from its arguments.",
)
@click.pass_context
def why(ctx: click.Context, task_id: str, as_json: bool, keys: tuple[str, ...]) -> None:
    """Say whether task TASK_ID is running, waiting, parked, done or unknown, and why.

    While it waits: its place in each line and what holds it back now (the limit, the rate, the
    spacing, a pause, or the line ahead), the holders ahead of it, an estimate of its start.
    Read-only, a few round trips whatever the length of the line. A task id alone names the
    fixed keys of the app's tasks; a key built from a task's arguments is found through the
    result backend with result_extended = True, or given with --key.
    """
    with _as_click_errors():
        answer = why_answer(_catalogue(ctx).app, task_id, keys=list(keys))
    if as_json:
        ctx.obj.echo(json.dumps(answer, indent=2))
    else:
        ctx.obj.echo("\n".join(why_lines(answer)))
