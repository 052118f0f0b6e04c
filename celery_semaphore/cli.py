"""``celery -A proj semaphore ...``: look at and steer the semaphores of a Celery app.

Plugged into Celery's own command line through the ``celery.commands`` entry point, so it loads
the app the usual way (``-A``) and reads the same ``semaphore_*`` settings the workers read:

* ``status [KEY]``: without a key, every semaphore the backend Redis knows of (found by SCAN)
  plus every semaphore task of the app whose key is fixed; with a key, its holders and waiters.
  The limit is shown with where it comes from, in the order the workers apply them: a runtime
  override stored in Redis, then ``semaphore_limits``, then the task's own option.
* ``set-limit KEY N [--ttl SECONDS]`` and ``unset-limit KEY``: the runtime override.
* ``reset KEY``: forget every holder and waiter (asks first, unless ``--yes``).

Which task a key belongs to and which limit applies to it is the catalogue's answer
(``_celery/catalogue.py``), the same one the workers and the metrics collector use.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import click

from ._celery.catalogue import Catalogue
from ._core.status import HolderInfo, SemaphoreStatus, WaiterInfo
from ._core.storage import glob_escape
from ._core.validation import check_seconds
from .errors import ConfigurationError, SemaphoreError

NO_LIMIT = "no limit configured"
OVERRIDE = "runtime override"


# -- reports --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    """What ``status`` says about one semaphore; also its ``--json`` form."""

    key: str
    task: str | None
    family: str
    limit: int | None  # the limit in force; None when nothing sets one
    source: str  # where it comes from: OVERRIDE, a LimitRule source, or NO_LIMIT
    configured: dict[str, Any] | None  # {"limit", "source"} from settings or code
    override: dict[str, Any] | None  # {"limit", "expires_in"} when a runtime override is stored
    holder_count: int
    waiter_count: int
    holders: list[HolderInfo]
    waiters: list[WaiterInfo]

    def as_json(self, *, details: bool) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not details:
            del data["holders"], data["waiters"]
        return data


def report(catalogue: Catalogue, key: str) -> Report:
    """Read one semaphore: status() (one round trip) plus where its limit comes from."""
    task = catalogue.task_for(key)
    rule = catalogue.configured_limit(key, task)
    status: SemaphoreStatus = catalogue.semaphore(key, placeholder_limit=True).status()
    override = None
    if status.limit_source == "override":
        override = {"limit": status.limit, "expires_in": status.override_expires_in}
        limit, source = status.limit, OVERRIDE
    elif rule is not None:
        limit, source = rule.limit, rule.source
    else:
        limit, source = None, NO_LIMIT
    return Report(
        key=key,
        task=str(task.name) if task is not None else None,
        family=catalogue.family_for(key),
        limit=limit,
        source=source,
        configured={"limit": rule.limit, "source": rule.source} if rule else None,
        override=override,
        holder_count=status.holder_count,
        waiter_count=status.waiter_count,
        holders=status.holders,
        waiters=status.waiters,
    )


# -- formatting -----------------------------------------------------------------------------


def duration(seconds: float) -> str:
    """Seconds as an operator reads them: ``850ms``, ``12.3s``, ``4m05s``, ``2h03m``, ``3d04h``."""
    if seconds < 1:
        return f"{max(seconds, 0) * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def table(headers: list[str], rows: list[list[str]], indent: str = "") -> list[str]:
    """Plain-text columns, each as wide as its widest cell; the last column is not padded."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=False)] + [row[-1]]
        lines.append(indent + "  ".join(cells).rstrip())
    return lines


def _limit_text(r: Report) -> str:
    if r.limit is None:
        return f"- ({NO_LIMIT})"
    text = f"{r.limit} ({r.source}"
    if r.override is not None:
        expires = r.override["expires_in"]
        text += ", kept until unset" if expires is None else f", expires in {duration(expires)}"
        configured = r.configured
        text += f"; configured: {configured['limit']} from {configured['source']}" if configured else f"; {NO_LIMIT}"
    return text + ")"


def detail_lines(r: Report) -> list[str]:
    """The human form of ``status KEY``."""
    of_limit = f" of {r.limit}" if r.limit is not None else ""
    lines = [
        f"semaphore  {r.key}",
        f"task       {r.task or '- (no task of this app uses this key)'}",
        f"family     {r.family}",
        f"limit      {_limit_text(r)}",
        f"holders    {r.holder_count}{of_limit}" + (" slots" if any(h.weight > 1 for h in r.holders) else ""),
        f"waiters    {r.waiter_count}",
        "",
    ]
    if r.holders:
        # a holder of several slots (a task with a semaphore_weight) shows its weight
        rows = [[h.label or "-", str(h.weight), duration(h.held_for), duration(h.expires_in)] for h in r.holders]
        lines += ["holders:", *table(["LABEL", "SLOTS", "AGE", "LEASE LEFT"], rows, indent="  ")]
        listed = sum(h.weight for h in r.holders)
        if r.holder_count > listed:
            lines.append(f"  ... and {r.holder_count - listed} more slots")
    else:
        lines.append("holders: none")
    if r.waiters:
        # "away": re-sent with a countdown, so it keeps its place but holds up nobody until it asks again
        rows = [
            [
                str(w.position),
                w.waiter,
                "asking" if w.present else "away",
                duration(w.waited),
                duration(w.must_ask_within),
            ]
            for w in r.waiters
        ]
        lines += ["waiters:", *table(["POS", "WAITER", "STATE", "WAITED", "MUST ASK WITHIN"], rows, indent="  ")]
        if r.waiter_count > len(r.waiters):
            lines.append(f"  ... and {r.waiter_count - len(r.waiters)} more")
    else:
        lines.append("waiters: none")
    return lines


def summary_lines(reports: list[Report]) -> list[str]:
    """The human form of ``status``: one line per semaphore."""
    rows = [
        [
            r.key,
            str(r.limit) if r.limit is not None else "-",
            r.source,
            str(r.holder_count),
            str(r.waiter_count),
            r.task or "-",
        ]
        for r in reports
    ]
    return table(["KEY", "LIMIT", "SOURCE", "HOLDERS", "WAITERS", "TASK"], rows)


# -- the commands ---------------------------------------------------------------------------


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


def _check_limit(ctx: click.Context, param: click.Parameter, value: str) -> int:
    """A limit as the semaphore takes it: a whole number of slots, at least 1. Refused with the
    value in the message, as a usage error (exit code 2), before anything touches Redis."""
    try:
        number = int(value.strip(), 10)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a whole number of slots", ctx=ctx, param=param) from None
    if number < 1:
        raise click.BadParameter(f"{value!r} is below 1: a limit is at least one slot", ctx=ctx, param=param)
    return number


def _check_ttl(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is None:
        return None
    try:
        return check_seconds("ttl", value)
    except ConfigurationError as error:
        raise click.BadParameter(f"{value!r}: {error.reason}", ctx=ctx, param=param) from error


@click.group(name="semaphore")
@click.pass_context
def semaphore(ctx: click.Context) -> None:
    """Look at and steer the concurrency semaphores of the app's tasks."""


@semaphore.command()
@click.argument("key", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.option("--match", metavar="GLOB", help="Without KEY: only keys matching this Redis glob (e.g. 'crawl:*').")
@click.pass_context
def status(ctx: click.Context, key: str | None, as_json: bool, match: str | None) -> None:
    """Show one semaphore (KEY), or list them all.

    The list holds every semaphore with holders, waiters or a runtime limit in the backend Redis,
    and every semaphore task of the app whose key is fixed. A key is one Redis round trip: narrow
    a list of many per-argument keys with --match.
    """
    if key is not None and match is not None:
        raise click.UsageError("--match narrows the list; it cannot be combined with KEY", ctx=ctx)
    with _as_click_errors():
        catalogue = _catalogue(ctx)
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
        ctx.obj.echo(
            f"no semaphores in {catalogue.backend} (prefix {catalogue.config.prefix!r}), "
            "and no semaphore task of this app has a fixed key"
        )
    else:
        ctx.obj.echo("\n".join(summary_lines(reports)))


@semaphore.command(name="set-limit")
@click.argument("key")
@click.argument("limit", metavar="N", callback=_check_limit)
@click.option(
    "--ttl",
    type=float,
    metavar="SECONDS",
    callback=_check_ttl,
    help="Drop the override by itself after this many seconds (default: keep it until unset).",
)
@click.pass_context
def set_limit(ctx: click.Context, key: str, limit: int, ttl: float | None) -> None:
    """Override the limit of KEY with N, for every worker.

    The runtime limit wins over semaphore_limits and the task's option until unset-limit (or
    --ttl) drops it. Blocked waiters are woken at once, so a higher limit admits them now.
    """
    with _as_click_errors():
        catalogue = _catalogue(ctx)
        task = catalogue.task_for(key)
        rule = catalogue.configured_limit(key, task)
        if task is None and rule is None and key not in catalogue.scan(glob_escape(key)):
            ctx.obj.error(
                f"note: no task of this app, no semaphore_limits entry and no live semaphore "
                f"matches {key!r}; storing the override anyway (check the key for typos)"
            )
        catalogue.semaphore(key, placeholder_limit=True).set_limit(limit, ttl=ttl)
        r = report(catalogue, key)
    ctx.obj.echo(f"{key}: limit {_limit_text(r)}")


@semaphore.command(name="unset-limit")
@click.argument("key")
@click.pass_context
def unset_limit(ctx: click.Context, key: str) -> None:
    """Drop the runtime limit of KEY.

    The limit from semaphore_limits or the task's option applies again.
    """
    with _as_click_errors():
        catalogue = _catalogue(ctx)
        sem = catalogue.semaphore(key, placeholder_limit=True)
        had_override = sem.status().limit_source == "override"
        sem.clear_limit()
        r = report(catalogue, key)
    if not had_override:
        ctx.obj.echo(f"{key}: there was no runtime limit; limit {_limit_text(r)}")
    else:
        ctx.obj.echo(f"{key}: runtime limit removed; limit {_limit_text(r)}")


@semaphore.command()
@click.argument("key")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def reset(ctx: click.Context, key: str, yes: bool) -> None:
    """Forget every holder and waiter of KEY.

    The runtime limit stays. For recovering from a mistake, such as slots held by
    workers that are gone for good. A holder that is still running takes its slot
    back at its next lease renewal if one is free; if not, the limit can be
    exceeded until it ends.
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
