"""What ``celery semaphore status`` says about one semaphore: ``Report`` (also its ``--json``
form), read by ``report``, and its human forms: one line per key, or one key in detail.

A report says where each rule in force comes from, in the order the workers apply them: a
runtime override stored in Redis, then ``semaphore_limits``, then the task's own option. Which
task a key belongs to and which rule applies to it is the catalogue's answer
(``_celery/catalogue.py``), the same one the workers and the metrics collector use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._celery.catalogue import Catalogue
from .._celery.tokens import shown_waiter
from .._core.rules import UNLIMITED, Rate
from .._core.status import HolderInfo, SemaphoreStatus, WaiterInfo
from .._core.tenants import TenantInfo
from .._core.validation import to_ms

NO_LIMIT = "no limit configured"
OVERRIDE = "runtime override"


@dataclass(frozen=True)
class Report:
    """What ``status`` says about one semaphore; also its ``--json`` form."""

    key: str
    task: str | None
    family: str
    limit: int | None  # the limit in force; None when nothing sets one, or the settings set none
    source: str  # where it comes from: OVERRIDE, a LimitRule source, or NO_LIMIT
    configured: dict[str, Any] | None  # {"limit", "source", "rate", "spacing"} from settings or code
    override: dict[str, Any] | None  # {"limit", "expires_in"} when a runtime limit is stored
    holder_count: int
    waiter_count: int
    rate: Rate | None  # in force: at most rate.count starts in any rate.period seconds
    rate_source: str | None  # OVERRIDE or a LimitRule source; None without a rate
    spacing: float | None  # in force: at least this many seconds between two starts
    spacing_source: str | None  # OVERRIDE or a LimitRule source; None without a spacing
    paused: bool
    paused_for: float | None  # seconds the pause has left; None while paused: until resumed
    next_start_in: float | None  # seconds until the rules allow a start; None: once resumed
    starts_in_window: int  # starts in the rate's window that ends now
    holders: list[HolderInfo]
    waiters: list[WaiterInfo]
    # the tenants with the most calls waiting (keys whose calls name tenants; at most 10)
    tenants: list[TenantInfo] = dataclasses.field(default_factory=list)
    per_tenant: int | None = None  # most slots one tenant may hold (semaphore_limits); None: no cap

    @property
    def gated(self) -> bool:
        """A rate, a spacing or a pause applies: only then are the rules worth a line of text."""
        return self.rate is not None or self.spacing is not None or self.paused

    def as_json(self, *, details: bool) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not details:
            del data["holders"], data["waiters"], data["tenants"]
        return data


def _limit(value: int | None) -> int | None:
    """A limit as reports show it: the semaphore's stand-in for "no limit" is no limit."""
    return None if value is None or value == UNLIMITED else value


def _source(in_force: object, default: object, rule: Any) -> str | None:
    """Where a rate or a spacing in force comes from. The status says only that some runtime
    rule is stored, so one that differs from the semaphore's own (the configured one) is the
    override; one equal to it changes nothing, and reads as configured."""
    if in_force is None:
        return None
    if in_force != default or rule is None:
        return OVERRIDE
    return str(rule.source)


def report(catalogue: Catalogue, key: str) -> Report:
    """Read one semaphore: status() (one round trip) plus where its rules come from."""
    task = catalogue.task_for(key)
    rule = catalogue.configured_limit(key, task)
    semaphore = catalogue.semaphore(key, placeholder_limit=True)
    status: SemaphoreStatus = semaphore.status()
    override = None
    if status.limit_source == "override":
        override = {"limit": _limit(status.limit), "expires_in": status.override_expires_in}
        limit, source = _limit(status.limit), OVERRIDE
    elif rule is not None:
        limit, source = _limit(rule.limit), rule.source
    else:
        limit, source = None, NO_LIMIT
    configured = None
    if rule is not None:  # rate and spacing: once the settings carry them
        rates = {"rate": getattr(rule, "rate", None), "spacing": getattr(rule, "spacing", None)}
        configured = {"limit": _limit(rule.limit), "source": rule.source, **rates}
    until_resumed = status.paused_for == math.inf
    return Report(
        key=key,
        task=str(task.name) if task is not None else None,
        family=catalogue.family_for(key),
        limit=limit,
        source=source,
        configured=configured,
        override=override,
        holder_count=status.holder_count,
        waiter_count=status.waiter_count,
        rate=status.rate,
        rate_source=_source(
            status.rate.arg if status.rate else None, semaphore.rate.arg if semaphore.rate else None, rule
        ),
        spacing=status.spacing,
        spacing_source=_source(
            to_ms(status.spacing) if status.spacing else None,
            to_ms(semaphore.spacing) if semaphore.spacing else None,
            rule,
        ),
        paused=status.paused_for is not None,
        paused_for=None if until_resumed else status.paused_for,
        next_start_in=None if until_resumed else status.next_start_in,
        starts_in_window=status.starts_in_window,
        holders=status.holders,
        # a task's waiter id as its task id, not written short (tokens.waiter_key)
        waiters=[dataclasses.replace(w, waiter=shown_waiter(w.waiter)) for w in status.waiters],
        # one more round trip, only for a key with a line
        tenants=semaphore.tenants() if status.waiter_count else [],
        per_tenant=rule.per_tenant if rule is not None else None,
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


def limit_text(r: Report) -> str:
    """``2 (runtime override, kept until unset; configured: 3 from semaphore_limits['crawl:*'])``."""
    if r.limit is None:
        return f"- ({NO_LIMIT})" if r.source == NO_LIMIT else f"none ({r.source})"
    text = f"{r.limit} ({r.source}"
    if r.override is not None:
        expires = r.override["expires_in"]
        text += ", kept until unset" if expires is None else f", expires in {duration(expires)}"
        configured = r.configured
        if configured:
            text += f"; configured: {'none' if configured['limit'] is None else configured['limit']}"
            text += f" from {configured['source']}"
        else:
            text += f"; {NO_LIMIT}"
    text += ")"
    return text if r.per_tenant is None else f"{text}, at most {r.per_tenant} per tenant"


def _rule_text(r: Report, name: str, source: str | None, show: Callable[[Any], str]) -> str:
    """A rate or a spacing in force, where it comes from, and for an override what it replaces."""
    value = getattr(r, name)
    if value is None:
        return "- (none)"
    text = f"{show(value)} ({source}"
    if source == OVERRIDE:
        configured = r.configured.get(name) if r.configured else None
        if configured is not None and r.configured is not None:
            text += f"; configured: {show(configured)} from {r.configured['source']}"
        else:
            text += "; none configured"
    return text + ")"


def rate_text(r: Report) -> str:
    """``2/s (runtime override; configured: 5/s from semaphore_limits['api'])``."""
    return _rule_text(r, "rate", r.rate_source, str)


def spacing_text(r: Report) -> str:
    """``500ms (runtime override; none configured)``."""
    return _rule_text(r, "spacing", r.spacing_source, duration)


def pause_text(r: Report) -> str:
    if not r.paused:
        return "no"
    return "until resumed" if r.paused_for is None else f"{duration(r.paused_for)} left"


def next_start_text(r: Report) -> str:
    """When the rate, spacing and pause let the next task start (a free slot is needed too)."""
    if r.next_start_in is None:
        return "once resumed"
    return "now" if r.next_start_in <= 0 else f"in {duration(r.next_start_in)}"


def rules_lines(r: Report) -> list[str]:
    """The rate, spacing and pause of ``status KEY``; none when none applies, so a plain
    concurrency semaphore reads as it always did."""
    if not r.gated:
        return []
    lines = [
        f"rate       {rate_text(r)}",
        f"spacing    {spacing_text(r)}",
        f"paused     {pause_text(r)}",
        f"next start {next_start_text(r)}" + (", if a slot is free" if r.next_start_in == 0 else ""),
    ]
    if r.rate is not None:
        lines.append(f"starts     {r.starts_in_window} of {r.rate.count} in the last {duration(r.rate.period)}")
    return lines


def detail_lines(r: Report, extra: Sequence[str] = ()) -> list[str]:
    """The human form of ``status KEY``; ``extra`` lines (``--watch``'s starts per minute) go
    under the counts."""
    of_limit = f" of {r.limit}" if r.limit is not None else ""
    lines = [
        f"semaphore  {r.key}",
        f"task       {r.task or '- (no task of this app uses this key)'}",
        f"family     {r.family}",
        f"limit      {limit_text(r)}",
        *rules_lines(r),
        f"holders    {r.holder_count}{of_limit}" + (" slots" if any(h.weight > 1 for h in r.holders) else ""),
        f"waiters    {r.waiter_count}",
        *extra,
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
        # "asking" includes parked tasks (woken when offered); "away" keeps its place, holds up nobody
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
    if r.tenants:
        rows = [
            [t.tenant, f"{t.share:g}" + (" (runtime)" if t.runtime_share else ""), str(t.backlog)] for t in r.tenants
        ]
        lines += ["tenants (most waiting first):", *table(["TENANT", "SHARE", "WAITING"], rows, indent="  ")]
    return lines


def _rules_cells(r: Report) -> list[str]:
    """RATE, SPACING, PAUSED, NEXT START and STARTS (in the rate's window) of one summary row."""
    paused = "-" if not r.paused else "until resumed" if r.paused_for is None else duration(r.paused_for)
    return [
        str(r.rate) if r.rate else "-",
        duration(r.spacing) if r.spacing else "-",
        paused,
        next_start_text(r).removeprefix("in "),
        f"{r.starts_in_window}/{r.rate.count}" if r.rate else "-",
    ]


def summary_lines(reports: list[Report], per_minute: Mapping[str, str] | None = None) -> list[str]:
    """The human form of ``status``: one line per semaphore. The rule columns appear when some
    listed semaphore has a rate, a spacing or a pause: a list of plain concurrency semaphores
    reads as it always did. ``per_minute`` (``--watch``: starts per minute by key) adds a
    STARTS/MIN column and shows the rule columns whatever the rules."""
    gated = per_minute is not None or any(r.gated for r in reports)
    rows = [
        [
            r.key,
            str(r.limit) if r.limit is not None else "none" if r.source != NO_LIMIT else "-",
            r.source,
            str(r.holder_count),
            str(r.waiter_count),
            *(_rules_cells(r) if gated else []),
            *([per_minute.get(r.key, "-")] if per_minute is not None else []),
            r.task or "-",
        ]
        for r in reports
    ]
    rules = ["RATE", "SPACING", "PAUSED", "NEXT START", "STARTS"] if gated else []
    rules += ["STARTS/MIN"] if per_minute is not None else []
    return table(["KEY", "LIMIT", "SOURCE", "HOLDERS", "WAITERS", *rules, "TASK"], rows)
