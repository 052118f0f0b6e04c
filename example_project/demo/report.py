"""What the demo measured: per-key results, the checks that decide its exit code, the chart.

Everything here is computed from two independent sources, never from the semaphore's own view:
the HTTP servers' counters (429s, peak concurrency they saw) and the spans the tasks recorded
(when each call started and ended, as the client saw it).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from .servers import ARRIVAL_SLACK


@dataclass(frozen=True)
class Span:
    """One HTTP call: wall-clock start and end (seconds), status (0: the call raised), and the
    customer it was made for (story 3; "" elsewhere)."""

    key: str
    start: float
    end: float
    status: int
    tenant: str = ""

    @classmethod
    def from_json(cls, raw: str | bytes) -> Span:
        value = json.loads(raw)
        return cls(
            str(value["key"]),
            float(value["start"]),
            float(value["end"]),
            int(value["status"]),
            str(value.get("tenant") or ""),
        )


def concurrency_steps(spans: Iterable[Span], origin: float) -> tuple[list[float], list[int]]:
    """The number of calls in flight over time, as a step function (x: seconds since
    ``origin``; y holds from each x to the next). A call that ends when another starts is not
    counted twice: at equal times, ends come before starts."""
    events = sorted(
        [(s.start - origin, 1) for s in spans] + [(s.end - origin, -1) for s in spans],
        key=lambda event: (event[0], event[1]),
    )
    times, levels, level = [0.0], [0], 0
    for at, change in events:
        level += change
        times.append(at)
        levels.append(level)
    return times, levels


def peak_in_flight(spans: Sequence[Span]) -> int:
    return max(concurrency_steps(spans, 0.0)[1], default=0)


def makespan(spans: Sequence[Span]) -> float:
    """Seconds from the first call's start to the last call's end."""
    if not spans:
        return 0.0
    return max(s.end for s in spans) - min(s.start for s in spans)


@dataclass(frozen=True)
class Pause:
    """The API's maintenance window as the API saw it: how long it asked callers to wait, which
    call it told to (``told``, a path), how many calls still arrived during it, how long it was
    before the next call came, which call came first after the window, and how long after that
    one the told call came back (0: it was first)."""

    seconds: float
    told: str
    calls_during: int
    quiet_for: float | None
    first_after: str | None
    told_lag: float | None
    told_place: int | None

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> Pause | None:
        if stats is None:
            return None
        return cls(
            float(stats["seconds"]),
            str(stats["told"]),
            int(stats["calls_during"]),
            stats["quiet_for"],
            stats["first_after"],
            stats["told_lag"],
            stats.get("told_place"),
        )

    @property
    def told_first(self) -> bool:
        """The told call was the first after the window, give or take ``ARRIVAL_SLACK``: calls
        the semaphore let start a ms apart may reach the API in either order."""
        return self.told_lag is not None and self.told_lag <= ARRIVAL_SLACK

    def told_in_first_wave(self, limit: int) -> bool:
        """The told call came back among the first ``limit`` calls after the window. The end of
        the pause frees every slot at once: the told call is offered the first, but the waiters
        already present in a worker claim the others at once, and may reach the API before the
        told call's copy reaches a pool process (more so on a loaded host)."""
        return self.told_first or (self.told_place is not None and self.told_place < limit)


@dataclass(frozen=True)
class Latecomer:
    """Story 3: the customer who came while another's flood waited in line, and when (wall
    clock, as the orchestrator sent its first call)."""

    tenant: str
    flooder: str
    arrived: float

    def starts(self, spans: Sequence[Span]) -> list[Span]:
        """The two customers' calls in the order they started."""
        return sorted((s for s in spans if s.tenant in (self.tenant, self.flooder)), key=lambda s: s.start)

    def order(self, spans: Sequence[Span]) -> str:
        """The order of starts, a letter per call ("aaaa|aGaG..."), "|" where the latecomer came:
        lower case the flooder's initial, upper case the latecomer's."""
        marks, came = [], False
        for s in self.starts(spans):
            if not came and s.start >= self.arrived:
                marks.append("|")
                came = True
            marks.append(self.tenant[0].upper() if s.tenant == self.tenant else self.flooder[0].lower())
        return "".join(marks)


@dataclass(frozen=True)
class KeyResult:
    """One row of the summary: a semaphore key (or the unprotected run) and what it achieved.
    The rules beyond the limit are the server's: the API's quota and maintenance window, a
    site's Crawl-delay; what the server saw of them comes with them."""

    story: str
    key: str
    limit: int  # what the server allows (and, when protected, the semaphore's limit)
    protected: bool
    calls: int  # calls the run had to make (API calls, or pages of the site)
    served: int  # answered 200
    rejected: int  # 429s the server sent (for a site: its violations)
    server_peak: int  # most requests the server saw in flight at once, rejected ones included
    client_peak: int  # most calls in flight at once, from the spans
    makespan: float
    service_time: float
    origin: float  # when the run was started, for the chart's time axis
    spans: tuple[Span, ...] = ()
    finished: bool = True  # False: the run timed out or stopped at a task failure
    quota: tuple[int, float] | None = None  # the API's plan: at most count calls in any period s
    max_in_window: int = 0  # most calls the API saw arrive within any period of its quota
    rejected_for: dict[str, int] = field(default_factory=dict)  # the API's 429s, by reason
    pause: Pause | None = None  # the API's maintenance window, if one came
    crawl_delay: float | None = None  # the site's Crawl-delay (seconds between two requests)
    min_gap: float | None = None  # the shortest time the site saw between two page requests
    too_early: int = 0  # page requests the site saw sooner than its Crawl-delay after the last
    latecomer: Latecomer | None = None  # story 3: the customer who came after another's flood

    @property
    def ideal(self) -> float:
        """The best possible makespan: every call served, as soon as the limit, the quota, the
        Crawl-delay and the pause allow (see ``ideal_makespan``)."""
        pause = self.pause.seconds if self.pause is not None else 0.0
        return ideal_makespan(self.calls, self.service_time, self.limit, self.quota, self.crawl_delay, pause)


def ideal_makespan(
    calls: int,
    service: float,
    limit: int,
    rate: tuple[int, float] | None = None,
    spacing: float | None = None,
    pause: float = 0.0,
) -> float:
    """The best possible makespan of ``calls`` calls of ``service`` seconds each: every call
    starts as soon as one of ``limit`` slots is free and the rate (count, seconds) and the
    spacing allow. With a ``pause``, a call told at 0 s to wait that long comes first: it counts
    as a start for the rate and the spacing (as it does for the semaphore), and nothing starts
    before the pause ends. Starting each call at its earliest moment is the best order, since
    the calls are all alike."""
    starts = [0.0] if pause else []
    ends: list[float] = []  # a heap: the ends of the calls started so far
    for _ in range(calls):
        at = pause
        if len(ends) >= limit:
            at = max(at, heapq.heappop(ends))
        if spacing and starts:
            at = max(at, starts[-1] + spacing)
        if rate is not None and len(starts) >= rate[0]:
            at = max(at, starts[-rate[0]] + rate[1])
        starts.append(at)
        heapq.heappush(ends, at + service)
    return max(ends, default=0.0)


@dataclass(frozen=True)
class Check:
    text: str
    ok: bool


def checks_for(results: Sequence[KeyResult], errors: Sequence[str]) -> list[Check]:
    """The checks behind the exit code: a protected key stayed within everything the server
    allows (its limit, the API's quota, a site's Crawl-delay), got no 429 but the maintenance
    window's, paused for every worker through that window, and all its work was done. The
    unprotected run is the contrast, reported but not required: whether it overshoots depends
    on timing, not on the library."""
    checks = []
    for r in results:
        if not r.protected:
            checks.append(_contrast(r))
        elif r.story == "paid API":
            checks += [*_api_checks(r), _work_done(r, "calls served")]
        elif r.latecomer is not None:
            checks += [*_api_checks(r), _fair_check(r, r.latecomer), _work_done(r, "calls served")]
        else:
            checks += [*_site_checks(r), _work_done(r, "pages crawled")]
    first = f": {errors[0]}" if errors else ""
    checks.append(Check(f"task failures: {len(errors)}{first}", not errors))
    return checks


def _contrast(r: KeyResult) -> Check:
    """The unprotected run: how it fared, never a failure."""
    reasons = ", ".join(f"{n} for {reason}" for reason, n in r.rejected_for.items() if n)
    text = f"{r.key}, the contrast: {r.rejected} answered 429{f' ({reasons})' if reasons else ''}"
    text += f", peak {r.server_peak} of limit {r.limit}"
    if r.quota is not None:
        text += f", {r.max_in_window} calls in {r.quota[1]:g} s against a quota of {r.quota[0]}"
    return Check(text + ("" if r.rejected else " (no overshoot this time)"), True)


def _work_done(r: KeyResult, what: str) -> Check:
    unfinished = "" if r.finished else " (stopped early)"
    return Check(f"{r.key}: {r.served}/{r.calls} {what}{unfinished}", r.served == r.calls and r.finished)


def _api_checks(r: KeyResult) -> list[Check]:
    """The limit, the quota and the pause, each as the API saw it."""
    over_limit = r.rejected_for.get("concurrency", 0)
    checks = [
        Check(
            f"{r.key}: concurrency never over the limit: peak {r.server_peak} of limit {r.limit}, "
            f"{over_limit} answered 429 for it",
            r.server_peak <= r.limit and over_limit == 0,
        )
    ]
    if r.quota is not None:
        count, period = r.quota
        maintenance = r.rejected_for.get("maintenance", 0)
        others = r.rejected - maintenance
        checks.append(
            Check(
                f"{r.key}: API quota never exceeded: max {r.max_in_window} calls in any {period:g} s "
                f"(quota {count}; a call may come {ARRIVAL_SLACK:g} s early), {others} answered 429"
                + (f" except the maintenance window's {maintenance}" if r.pause is not None else ""),
                r.max_in_window <= count and others == 0,
            )
        )
    if r.pause is not None:
        checks.append(_pause_check(r.key, r.pause, r.limit))
    return checks


def _pause_check(key: str, pause: Pause, limit: int) -> Check:
    """After the maintenance 429: no call until its Retry-After was over, on any worker, and
    then the call that was told to wait first (in the first wave of ``limit`` calls)."""
    told = _report(pause.told)
    if pause.calls_during:
        quiet = f"{pause.calls_during} calls during the window"
    elif pause.quiet_for is not None:
        quiet = f"no call for {pause.quiet_for:.2f} s"
    else:
        quiet = "no call after it"
    if pause.first_after == pause.told:
        first = f"then {told} first"
    elif pause.told_first and pause.told_lag is not None:
        first = f"then {told} first ({_report(pause.first_after)} came {pause.told_lag * 1000:.0f} ms before it)"
    elif pause.told_in_first_wave(limit):
        first = f"then {told} in the first {limit} ({_report(pause.first_after)} first)"
    else:
        first = f"then {_report(pause.first_after)} first, not {told}"
    return Check(
        f"{key}: pause: {told} heard 429, Retry-After {pause.seconds:g} s (maintenance); {quiet}, {first}",
        pause.calls_during == 0
        and pause.quiet_for is not None
        and pause.quiet_for >= pause.seconds
        and pause.told_in_first_wave(limit),
    )


def _fair_check(r: KeyResult, late: Latecomer) -> Check:
    """The latecomer is served within about one call's time of coming, not after the flood: at
    most two waves of the key's slots (``2 * limit`` starts: the calls running when it came
    end, and it is among the next) of the flooder's waiting calls start before its first, and
    its last starts while the flooder still has calls to start. First come, first served, all
    of the flood would start first. Two waves, not one: on a busy 2-core host the latecomer's
    tasks may reach a pool process only after the next wave was handed out."""
    starts = late.starts(r.spans)
    theirs = [s for s in starts if s.tenant == late.tenant]
    flood = [s for s in starts if s.tenant == late.flooder]
    if not theirs or not flood:
        return Check(f"{r.key}: fair share: {late.tenant} or {late.flooder} never started", False)
    first, last = theirs[0].start, theirs[-1].start
    waiting = [s for s in flood if s.start >= late.arrived]
    ahead = sum(s.start < first for s in waiting)
    after = sum(s.start > last for s in waiting)
    return Check(
        f"{r.key}: fair share: {late.tenant} came with {len(waiting)} of {late.flooder}'s calls waiting; its first "
        f"started {first - late.arrived:.2f} s later (a call takes {r.service_time:g} s), after {ahead} of them, "
        f"and its last before {after} of them",
        ahead <= 2 * r.limit and ahead < len(waiting) and after > 0,
    )


def _report(path: str | None) -> str:
    """``/v1/reports/7`` as "report 7"."""
    if path is None:
        return "nobody"
    return f"report {path.rsplit('/', 1)[-1]}" if path.startswith("/v1/reports/") else path


def _site_checks(r: KeyResult) -> list[Check]:
    """A site's Crawl-concurrency and Crawl-delay, as the site saw them."""
    held = r.rejected == 0 and r.server_peak <= r.limit
    checks = [Check(f"{r.key}: {r.rejected} violations, peak {r.server_peak} of limit {r.limit}", held)]
    if r.crawl_delay is not None:
        gap = f"min gap {r.min_gap:.3f} s" if r.min_gap is not None else "a single request"
        checks.append(
            Check(
                f"{r.key}: Crawl-delay {r.crawl_delay:g} s honoured: {gap} between {r.served + r.rejected} "
                f"page requests, {r.too_early} more than {ARRIVAL_SLACK:g} s early",
                r.too_early == 0,
            )
        )
    return checks


def summary_table(results: Sequence[KeyResult]) -> Table:
    """Per key: its rules, work done, 429s (or violations), the peak the server saw, the
    makespan against the ideal (``ideal_makespan``). Fits an 80-column terminal."""
    table = Table(title="Summary", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("key (semaphore)", min_width=16)
    for column in ("rules", "served", "429s", "peak", "makespan", "ideal", "ratio"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in results:
        peak_style = "red" if r.server_peak > r.limit else "green"
        rejected_style = "green" if r.rejected == 0 else ("yellow" if not r.protected else "red")
        if r.protected and r.pause is not None and r.rejected == r.rejected_for.get("maintenance", 0):
            rejected_style = "green"  # the maintenance window's 429 is the API's, not an overshoot
        complete = r.served == r.calls
        ratio = f"{r.makespan / r.ideal:.2f}" if r.protected and r.ideal > 0 and complete else "-"
        table.add_row(
            r.key,
            _rules(r),
            f"[{'default' if complete else 'yellow'}]{r.served}/{r.calls}[/]",
            f"[{rejected_style}]{r.rejected}[/]",
            f"[{peak_style}]{r.server_peak}[/]",
            f"{r.makespan:.1f} s",
            f"{r.ideal:.1f} s" if r.protected else "-",
            ratio,
        )
    table.caption = (
        "rules: limit, then the API's quota (calls/seconds) or the site's Crawl-delay; 429s: rejected "
        "by the server (for a site: robots.txt violations); peak: most requests the server saw at "
        "once; ideal: every call as soon as the rules allow"
    )
    table.caption_justify = "left"
    return table


def _rules(r: KeyResult) -> str:
    """The limit and what else the server asks, "4·20/10s", "1·0.5s"; "none" for the
    unprotected run, which heeds none of it."""
    if not r.protected:
        return "none"
    rules = f"{r.limit}"
    if r.quota is not None:
        rules += f"·{r.quota[0]}/{r.quota[1]:g}s"
    if r.crawl_delay is not None:
        rules += f"·{r.crawl_delay:g}s"
    return rules


def draw_chart(results: Sequence[KeyResult], path: Path) -> Path:
    """Story 1 on the top row: calls in flight for its two runs (the limit dashed, 429s
    marked, the pause shaded) and the calls started in the quota's trailing window against
    the quota. Story 2 below: calls in flight per host, and the page requests per host over
    time, so the Crawl-delay shows as the gaps. Story 3 last: calls in flight, and each
    customer's calls started over time, from when the latecomer came."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    api = [r for r in results if r.story == "paid API"]
    sites = [r for r in results if r.story == "crawler"]
    customers = [r for r in results if r.latecomer is not None]
    rows = [
        (title, row, extra)
        for title, row, extra in (
            ("Story 1: paid API, 429 beyond its limit or its quota (same time scale for both runs)", api, _quota_panel),
            ("Story 2: polite crawler, a semaphore per host, rules from robots.txt", sites, _gaps_panel),
            ("Story 3: two customers share the paid API, semaphore_fair_by", customers, _customers_panel),
        )
        if row
    ]
    columns = max((len(row) + 1 for _, row, _ in rows), default=1)
    fig = plt.figure(figsize=(max(4.4 * columns, 9.0), 3.8 * len(rows) + 0.4), layout="constrained")
    fig.suptitle("celery_semaphore demo: calls over time, from the tasks' own records", fontsize=13)
    subfigs = fig.subfigures(len(rows), 1, squeeze=False)[:, 0]
    for subfig, (title, row, extra) in zip(subfigs, rows, strict=True):
        subfig.suptitle(title, fontsize=11)
        axes = subfig.subplots(1, len(row) + 1, squeeze=False)[0]
        # one scale per row, so a run that took longer also looks longer
        top = max(max(r.client_peak, r.limit) for r in row) + 1
        right = max((s.end - r.origin for r in row for s in r.spans), default=1.0) * 1.03
        for ax, r in zip(axes, row, strict=False):
            _panel(ax, r, top, right)
        extra(axes[-1], row, right)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _panel(ax: Any, r: KeyResult, top: int, right: float) -> None:
    times, levels = concurrency_steps(r.spans, r.origin)
    colour = "tab:blue" if r.protected else "tab:orange"
    ax.step(times, levels, where="post", color=colour, linewidth=1.6, label="in flight")
    ax.fill_between(times, levels, step="post", color=colour, alpha=0.2)
    ax.axhline(r.limit, color="tab:red", linestyle="--", linewidth=1.4, label=f"limit {r.limit}")
    rejected = [s.start - r.origin for s in r.spans if s.status == 429]
    if rejected:
        ax.plot(
            rejected, [top - 0.4] * len(rejected), "|", color="tab:red", markersize=9, label=f"429 ({len(rejected)})"
        )
    if r.pause is not None and rejected:
        ax.axvspan(rejected[0], rejected[0] + r.pause.seconds, color="tab:gray", alpha=0.25, label="paused")
    served = f"{r.served}/{r.calls} served"
    ax.set_title(
        f"{r.key}\npeak {r.client_peak} in flight, {served}, {r.rejected} rejected, {r.makespan:.1f} s", fontsize=9
    )
    _axes(ax, "calls in flight (task view)", right)
    ax.set_ylim(0, top)
    ax.yaxis.get_major_locator().set_params(integer=True)


def _quota_panel(ax: Any, row: Sequence[KeyResult], right: float) -> None:
    """Calls started in the quota's trailing window, for each run, against the quota. The
    window is the API's, ``ARRIVAL_SLACK`` short of the period: a start at the very moment the
    rate allows it may be recorded a ms before the one it replaces leaves a window of the full
    period, and would show as a spike above the quota that no server saw."""
    quota = next((r.quota for r in row if r.quota is not None), None)
    if quota is None:
        ax.set_visible(False)
        return
    count, period = quota
    for r in row:
        # a call counts from its start for one window: "in flight" for that long
        windows = [Span(s.key, s.start, s.start + period - ARRIVAL_SLACK, s.status) for s in r.spans]
        times, levels = concurrency_steps(windows, r.origin)
        colour = "tab:blue" if r.protected else "tab:orange"
        label = "with the semaphore" if r.protected else "no semaphore"
        ax.step(times, levels, where="post", color=colour, linewidth=1.6, label=label)
    ax.axhline(count, color="tab:red", linestyle="--", linewidth=1.4, label=f"quota {count}")
    ax.set_title(f"calls started in the last {period:g} s\nagainst the quota of {count} per {period:g} s", fontsize=9)
    _axes(ax, f"calls in the last {period:g} s", right)
    ax.set_ylim(0, max(count, *(len(r.spans) for r in row)) + 2)


def _gaps_panel(ax: Any, row: Sequence[KeyResult], right: float) -> None:
    """A mark per page request, a line per host: the gaps between them are the Crawl-delay."""
    for line, r in enumerate(row):
        starts = [s.start - r.origin for s in r.spans]
        ax.eventplot([starts], lineoffsets=line, linelengths=0.6, colors="tab:blue")
    labels = [
        f"{r.key.removeprefix('crawl:')}\n"
        + (f"delay {r.crawl_delay:g} s" if r.crawl_delay else "no delay")
        + (f", min {r.min_gap:.2f} s" if r.min_gap is not None else "")
        for r in row
    ]
    ax.set_yticks(range(len(row)), labels, fontsize=7)
    ax.set_ylim(-0.6, len(row) - 0.4)
    ax.invert_yaxis()
    ax.set_title("page requests per host\n(min gap: as the site saw it)", fontsize=9)
    _axes(ax, "", right)


def _customers_panel(ax: Any, row: Sequence[KeyResult], right: float) -> None:
    """Each customer's calls started so far, over time, when the latecomer came, and the
    flooder's last start (first come, first served, the latecomer would start only then): from
    its coming on the two lines climb together, each at its share."""
    for r in row:
        late = r.latecomer
        if late is None:
            continue
        for tenant, colour in ((late.flooder, "tab:orange"), (late.tenant, "tab:green")):
            starts = [s.start - r.origin for s in late.starts(r.spans) if s.tenant == tenant]
            times, counts = [0.0, *starts], list(range(len(starts) + 1))
            ax.step(times, counts, where="post", color=colour, linewidth=1.6, label=f"{tenant} ({len(starts)})")
        came = late.arrived - r.origin
        ax.axvline(came, color="tab:green", linestyle=":", linewidth=1.4, label=f"{late.tenant} comes")
        # first come, first served, the latecomer's first call would start after the whole flood
        flood = max((s.start - r.origin for s in r.spans if s.tenant == late.flooder), default=came)
        ax.axvline(flood, color="tab:gray", linestyle="--", linewidth=1.2, label="first come, first served")
        ax.set_title(f"calls started per customer\n({late.tenant} comes after {late.flooder}'s flood)", fontsize=9)
    _axes(ax, "calls started", right)
    ax.yaxis.get_major_locator().set_params(integer=True)


def _axes(ax: Any, ylabel: str, right: float) -> None:
    ax.set_xlabel("seconds since start", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_xlim(0, right)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper right")
