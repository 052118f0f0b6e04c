"""What the demo measured: per-key results, the checks that decide its exit code, the chart.

Everything here is computed from two independent sources, never from the semaphore's own view:
the HTTP servers' counters (429s, peak concurrency they saw) and the spans the tasks recorded
(when each call started and ended, as the client saw it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table


@dataclass(frozen=True)
class Span:
    """One HTTP call: wall-clock start and end (seconds), status (0: the call raised)."""

    key: str
    start: float
    end: float
    status: int

    @classmethod
    def from_json(cls, raw: str | bytes) -> Span:
        value = json.loads(raw)
        return cls(str(value["key"]), float(value["start"]), float(value["end"]), int(value["status"]))


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
class KeyResult:
    """One row of the summary: a semaphore key (or the unprotected run) and what it achieved."""

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

    @property
    def ideal(self) -> float:
        """The best possible makespan: every call served, the limit's slots never idle."""
        return self.calls * self.service_time / self.limit


@dataclass(frozen=True)
class Check:
    text: str
    ok: bool


def checks_for(results: Sequence[KeyResult], errors: Sequence[str]) -> list[Check]:
    """The checks behind the exit code: a protected key got no 429 and stayed within its limit,
    and all its work was done. The unprotected run is the contrast, reported but not required:
    whether it overshoots depends on timing, not on the library."""
    checks = []
    for r in results:
        peak = f"peak {r.server_peak} of limit {r.limit}"
        if r.story == "paid API":
            rejected, work = f"{r.rejected} answered 429", f"{r.served}/{r.calls} calls served"
        else:
            rejected, work = f"{r.rejected} violations", f"{r.served}/{r.calls} pages crawled"
        if not r.protected:
            note = "" if r.rejected else " (no overshoot this time)"
            checks.append(Check(f"{r.key}, the contrast: {rejected}, {peak}{note}", True))
            continue
        checks.append(Check(f"{r.key}: {rejected}, {peak}", r.rejected == 0 and r.server_peak <= r.limit))
        unfinished = "" if r.finished else " (stopped early)"
        checks.append(Check(f"{r.key}: {work}{unfinished}", r.served == r.calls and r.finished))
    first = f": {errors[0]}" if errors else ""
    checks.append(Check(f"task failures: {len(errors)}{first}", not errors))
    return checks


def summary_table(results: Sequence[KeyResult]) -> Table:
    """Per key: limit, work done, 429s (or violations), the peak the server saw, the makespan
    against the ideal ``calls * service_time / limit``. Fits an 80-column terminal."""
    table = Table(title="Summary", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("key (semaphore)", min_width=16)
    for column in ("limit", "served", "429s", "peak", "makespan", "ideal", "ratio"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in results:
        peak_style = "red" if r.server_peak > r.limit else "green"
        rejected_style = "green" if r.rejected == 0 else ("yellow" if not r.protected else "red")
        complete = r.served == r.calls
        ratio = f"{r.makespan / r.ideal:.2f}" if r.protected and r.ideal > 0 and complete else "-"
        table.add_row(
            r.key,
            f"{r.limit}" if r.protected else f"none ({r.limit})",
            f"[{'default' if complete else 'yellow'}]{r.served}/{r.calls}[/]",
            f"[{rejected_style}]{r.rejected}[/]",
            f"[{peak_style}]{r.server_peak}[/]",
            f"{r.makespan:.1f} s",
            f"{r.ideal:.1f} s",
            ratio,
        )
    table.caption = (
        "429s: rejected by the server (for a site: robots.txt violations); peak: most requests the "
        "server saw at once; ideal: calls x service time / limit"
    )
    table.caption_justify = "left"
    return table


def draw_chart(results: Sequence[KeyResult], path: Path) -> Path:
    """Concurrency over time per key, the limit as a dashed line, 429s marked: story 1's two
    runs on the top row, one panel per crawled host below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    api = [r for r in results if r.story == "paid API"]
    sites = [r for r in results if r.story != "paid API"]
    rows = [
        (title, row)
        for title, row in (
            ("Story 1: paid API, 429 beyond its limit (same time scale for both runs)", api),
            ("Story 2: polite crawler, one semaphore per host, limit from robots.txt", sites),
        )
        if row
    ]
    columns = max((len(row) for _, row in rows), default=1)
    fig = plt.figure(figsize=(max(4.4 * columns, 9.0), 3.6 * len(rows) + 0.4), layout="constrained")
    fig.suptitle("celery_semaphore demo: calls in flight over time, from the tasks' own records", fontsize=13)
    subfigs = fig.subfigures(len(rows), 1, squeeze=False)[:, 0]
    for subfig, (title, row) in zip(subfigs, rows, strict=True):
        subfig.suptitle(title, fontsize=11)
        axes = subfig.subplots(1, len(row), squeeze=False)[0]
        # one scale per row, so a run that took longer also looks longer
        top = max(max(r.client_peak, r.limit) for r in row) + 1
        right = max((s.end - r.origin for r in row for s in r.spans), default=1.0) * 1.03
        for ax, r in zip(axes, row, strict=True):
            _panel(ax, r, top, right)
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
    served = f"{r.served}/{r.calls} served"
    ax.set_title(
        f"{r.key}\npeak {r.client_peak} in flight, {served}, {r.rejected} rejected, {r.makespan:.1f} s", fontsize=9
    )
    ax.set_xlabel("seconds since start", fontsize=8)
    ax.set_ylabel("calls in flight (task view)", fontsize=8)
    ax.set_ylim(0, top)
    ax.set_xlim(0, right)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
