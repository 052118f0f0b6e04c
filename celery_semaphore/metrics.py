"""Prometheus metrics, when ``prometheus_client`` is installed (the ``prometheus`` extra).

The four event functions (``acquired``, ``refused``, ``lease_lost``, ``reclaimed``) are called on
the task's hot path, so they cost nothing when ``prometheus_client`` is missing: it is imported
lazily, once, and a failed import turns them into no-ops for good. Only the calls a user makes on
purpose, ``register_status_collector`` and ``start_metrics_server``, raise when it is missing, and
their error names the ``pip install`` that fixes it.

Every metric is labelled ``family`` only: the task's key template (``crawl:{host}``) or its name,
never the per-call key. 100,000 hosts must make 100,000 Redis keys, not 100,000 time series.

Counters and the wait histogram live in ``prometheus_client``'s default registry. Under a
prefork pool they are counted in the child processes: set ``PROMETHEUS_MULTIPROC_DIR`` and
``start_metrics_server`` serves what every process wrote there. Holder and waiter gauges come
from Redis on each scrape (``register_status_collector``), so they are right whichever process
serves them, and one exporter is enough for all workers. So do the gauges of the rules in force
(rate, spacing, pause, when the next start is allowed, starts in the rate's window):

    from celery.signals import worker_init

    @worker_init.connect
    def export_metrics(sender, **_):
        metrics.register_status_collector(sender.app)
        metrics.start_metrics_server(9808)
"""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._celery.catalogue import Catalogue
from ._celery.options import fair_by_option
from ._core import fork_locks, renewer
from ._core.rules import UNLIMITED
from ._core.tenants import TenantInfo
from .errors import SemaphoreError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.metrics_core import Metric

    from ._core.lease import Lease
    from ._core.rules import Rate
    from ._core.status import SemaphoreStatus

logger = logging.getLogger("celery_semaphore")

INSTALL_HINT = "pip install celery-semaphore[prometheus]"

# Waits run from nothing (a free slot) to hours (a long backlog), so the buckets span both.
WAIT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, float("inf"))


class PrometheusMissing(SemaphoreError, ImportError):
    """``prometheus_client`` is not installed; the message says how to install it."""

    def __init__(self, wanted: str) -> None:
        Exception.__init__(self, wanted)  # args are the constructor's, as for every SemaphoreError
        self.key = None
        self.wanted = wanted

    def __str__(self) -> str:
        return f"{self.wanted} needs prometheus_client, which is not installed: {INSTALL_HINT}"


@dataclass(frozen=True)
class _Instruments:
    acquired: Counter
    refused: Counter
    leases_lost: Counter
    reclaimed: Counter
    wait_seconds: Histogram


_instruments: _Instruments | None = None
_unavailable = False  # the import failed once: stay a no-op rather than retry on every task
# Held over a fork (fork_locks.py): a worker's parent counts slots it gives back from a thread,
# and a pool process forked meanwhile must not get prometheus_client's registry or values
# half-updated, with their locks held by a thread it does not have. So every count takes it.
_lock = fork_locks.held_over_fork()


def import_early() -> None:
    """Import ``prometheus_client`` now, if it is installed: in a worker's main process before
    its pool forks, so that its pool processes have it. Its import takes tens of milliseconds
    (45 ms a pool process, measured under ``python -m benchmarks.bench_celery --only handoff``),
    which each new pool process (a worker's start, a restart, each recycling under
    ``worker_max_tasks_per_child``) otherwise paid in its first task's count: after its first
    grant, before the body, or after its first refusal, before the task parks."""
    global _unavailable
    if _instruments is not None or _unavailable:
        return
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        _unavailable = True


def _get() -> _Instruments | None:
    """The instruments, created on first use in the default registry; None without
    prometheus_client. Created once per process: a second registration of the same names
    would raise in prometheus_client."""
    global _instruments, _unavailable
    if _instruments is not None or _unavailable:
        return _instruments
    with _lock:
        if _instruments is None and not _unavailable:
            try:
                from prometheus_client import Counter, Histogram
            except ImportError:
                _unavailable = True
                return None
            labels = ["family"]
            _instruments = _Instruments(
                acquired=Counter("celery_semaphore_acquired", "Slots granted to semaphore tasks.", labels),
                refused=Counter(
                    "celery_semaphore_refused", "Tries of semaphore tasks that found no free slot and wait.", labels
                ),
                leases_lost=Counter(
                    "celery_semaphore_leases_lost",
                    "Leases a renewal found gone with no free slot to take back: the limit may be exceeded.",
                    labels,
                ),
                reclaimed=Counter(
                    "celery_semaphore_reclaimed",
                    "Slots of killed task processes given back by the worker's parent process.",
                    labels,
                ),
                wait_seconds=Histogram(
                    "celery_semaphore_wait_seconds",
                    "Seconds from a task's first refusal to its slot (0 when a slot was free at once).",
                    labels,
                    buckets=WAIT_BUCKETS,
                ),
            )
    return _instruments


# The family each lease held through the Celery layer counts under, for the lease-lost
# listener: the core knows nothing of families. Weak, so a released lease is forgotten.
_lease_families: weakref.WeakKeyDictionary[Lease, str] = weakref.WeakKeyDictionary()


def acquired(family: str, waited: float, lease: Lease | None = None) -> None:
    """A task of ``family`` got its slot (``lease``) after waiting ``waited`` seconds since it
    first asked."""
    if lease is not None:
        _lease_families[lease] = family
    instruments = _get()
    if instruments is not None:
        with _lock:
            instruments.acquired.labels(family=family).inc()
            instruments.wait_seconds.labels(family=family).observe(max(waited, 0.0))


def refused(family: str) -> None:
    """A task of ``family`` found no free slot and will wait."""
    instruments = _get()
    if instruments is not None:
        with _lock:
            instruments.refused.labels(family=family).inc()


def lease_lost(family: str) -> None:
    """A renewal found a lease gone and could not take it back."""
    instruments = _get()
    if instruments is not None:
        with _lock:
            instruments.leases_lost.labels(family=family).inc()


def reclaimed(family: str, count: int) -> None:
    """``count`` slots of dead holders were given back by a worker's parent process."""
    instruments = _get()
    if instruments is not None and count > 0:
        with _lock:
            instruments.reclaimed.labels(family=family).inc(count)


def _on_lease_event(lease: Lease, event: str) -> None:
    """Renewer listener: a lost lease is counted here, since the renewer knows nothing of metrics."""
    if event == "lost":
        lease_lost(_lease_families.get(lease, lease.semaphore.name))


# Registered at import: task.py and worker.py import this module, so every process that holds
# leases through the Celery layer counts their loss. Idempotent (add_listener skips repeats).
renewer.add_listener(_on_lease_event)


# -- holder and waiter gauges, read from Redis on each scrape ------------------------------------


@dataclass
class FamilyStatus:
    """What the status gauges say about one family, over every key of it: counts are summed;
    a rule in force is summarised by its tightest value (a fixed key's family has one key, so
    its values are that key's)."""

    holders: int = 0
    waiters: int = 0
    limit: int | None = None  # slots the keys with a limit allow, summed; None: no key has one
    paused: int = 0  # keys paused now
    pause_left: float = 0.0  # seconds the longest pause has left; inf: until resumed
    next_start_in: float = 0.0  # seconds until the rules let every key start again; inf: until resumed
    starts_in_window: int = 0  # starts in the rate windows ending now (keys with a rate)
    rate: Rate | None = None  # the rate allowing the fewest starts per second
    spacing: float | None = None  # the longest spacing
    # calls waiting per tenant, summed over the family's keys whose tasks name tenants
    tenants: dict[str, int] = field(default_factory=dict)

    def add_tenants(self, tenants: Iterable[TenantInfo]) -> None:
        for info in tenants:
            self.tenants[info.tenant] = self.tenants.get(info.tenant, 0) + info.backlog

    def top_tenants(self) -> list[tuple[str, int]]:
        """The family's tenants with the most calls waiting, at most ``TOP_TENANTS``: a bound
        on the series a scrape exports, however many tenants there are."""
        return sorted(self.tenants.items(), key=lambda item: (-item[1], item[0]))[:TOP_TENANTS]

    def add(self, status: SemaphoreStatus, *, limited: bool = True) -> None:
        """Count one key of the family in; ``limited``: a limit applies to it (the one in
        ``status`` is no stand-in)."""
        self.holders += status.holder_count
        self.waiters += status.waiter_count
        if limited and status.limit != UNLIMITED:
            self.limit = (self.limit or 0) + status.limit
        if status.paused_for is not None:
            self.paused += 1
            self.pause_left = max(self.pause_left, status.paused_for)
        # a pause until resumed has no end, whatever the script caps its wait at
        next_start = math.inf if status.paused_for == math.inf else status.next_start_in
        self.next_start_in = max(self.next_start_in, next_start)
        if status.rate is not None:
            self.starts_in_window += status.starts_in_window
            if self.rate is None or status.rate.count / status.rate.period < self.rate.count / self.rate.period:
                self.rate = status.rate
        if status.spacing is not None:
            self.spacing = max(self.spacing or 0.0, status.spacing)


def family_status(app: Any) -> dict[str, FamilyStatus]:
    """Holders, waiters and the rules in force per family, over every semaphore of ``app``: the
    fixed-key tasks (present even when idle, so their series exist) and every key SCAN finds in
    the backend, grouped by the task key template it matches (unmatched keys go to ``(other)``).

    One status() round trip per key: a cost that grows with the number of live keys."""
    catalogue = Catalogue(app)
    families: dict[str, FamilyStatus] = {}
    for fixed_key in catalogue.fixed:
        families.setdefault(catalogue.family_for(fixed_key), FamilyStatus())
    for key in catalogue.known_keys():
        semaphore = catalogue.semaphore(key, placeholder_limit=True)
        status = semaphore.status(listed=0)  # counts only
        # a key no setting or task limits is read with a stand-in limit, which is no limit
        limited = status.limit_source == "override" or catalogue.configured_limit(key) is not None
        entry = families.setdefault(catalogue.family_for(key), FamilyStatus())
        entry.add(status, limited=limited)
        task = catalogue.task_for(key)
        if status.waiter_count and task is not None and fair_by_option(type(task)) is not None:
            entry.add_tenants(semaphore.tenants(most=TOP_TENANTS))  # one more round trip
    return families


def family_counts(app: Any) -> dict[str, tuple[int, int]]:
    """Holders and waiters per family (see ``family_status``)."""
    return {family: (entry.holders, entry.waiters) for family, entry in family_status(app).items()}


# (name, help) of the status gauges, in the order they are exported; all labelled ``family``
_FAMILY_GAUGES = (
    ("celery_semaphore_holders", "Slots held now, per semaphore family."),
    ("celery_semaphore_waiters", "Tasks in line for a slot now, per semaphore family."),
    (
        "celery_semaphore_limit",
        "Slots the limits in force allow, summed over the family's keys read. Absent where no limit applies.",
    ),
    ("celery_semaphore_paused", "Keys of the family paused now (0 or 1 for a fixed key)."),
    (
        "celery_semaphore_pause_remaining_seconds",
        "Seconds the family's longest pause has left; +Inf until resumed; 0 when none is paused.",
    ),
    (
        "celery_semaphore_next_start_seconds",
        "Seconds until the rate, spacing and pause let every key of the family start again (a free slot aside).",
    ),
    (
        "celery_semaphore_rate_starts",
        "Starts the rate in force allows per period: the family's tightest rate. Absent without a rate.",
    ),
    ("celery_semaphore_rate_period_seconds", "The period of that rate, in seconds. Absent without a rate."),
    (
        "celery_semaphore_starts_in_window",
        "Starts in the rate's window that ends now, summed over the family's keys. Absent without a rate.",
    ),
    (
        "celery_semaphore_spacing_seconds",
        "Seconds between two starts in force: the family's longest spacing. Absent without one.",
    ),
)


def _family_values(entry: FamilyStatus) -> dict[str, float]:
    """The gauges of one family by name; a rate's and a spacing's only where one is in force
    (a rate of 0 would read as "nothing may start")."""
    values: dict[str, float] = {
        "celery_semaphore_holders": entry.holders,
        "celery_semaphore_waiters": entry.waiters,
        "celery_semaphore_paused": entry.paused,
        "celery_semaphore_pause_remaining_seconds": entry.pause_left,
        "celery_semaphore_next_start_seconds": entry.next_start_in,
    }
    if entry.limit is not None:
        values["celery_semaphore_limit"] = entry.limit
    if entry.rate is not None:
        values["celery_semaphore_rate_starts"] = entry.rate.count
        values["celery_semaphore_rate_period_seconds"] = entry.rate.period
        values["celery_semaphore_starts_in_window"] = entry.starts_in_window
    if entry.spacing is not None:
        values["celery_semaphore_spacing_seconds"] = entry.spacing
    return values


# the tenants per family the tenant gauge exports (the most waiting first)
TOP_TENANTS = 5
_TENANT_GAUGE = (
    "celery_semaphore_tenant_waiting",
    "Calls waiting per tenant (semaphore_fair_by), the family's top five by calls waiting.",
)


class StatusCollector:
    """A Prometheus collector that reads the semaphores of ``app`` from Redis on each scrape.

    Gauges labelled ``family``: ``celery_semaphore_holders``, ``celery_semaphore_waiters`` and
    ``celery_semaphore_limit``, and the rules in force (``_paused``, ``_pause_remaining_seconds``,
    ``_next_start_seconds``, ``_rate_starts``, ``_rate_period_seconds``, ``_starts_in_window``,
    ``_spacing_seconds``);
    and ``celery_semaphore_status_up`` (1 if Redis answered, else 0: a scrape never fails
    because the semaphore backend is down, so the other metrics of the process still arrive).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    @staticmethod
    def _families() -> tuple[dict[str, GaugeMetricFamily], GaugeMetricFamily]:
        from prometheus_client.core import GaugeMetricFamily

        gauges = {name: GaugeMetricFamily(name, text, labels=["family"]) for name, text in _FAMILY_GAUGES}
        gauges[_TENANT_GAUGE[0]] = GaugeMetricFamily(*_TENANT_GAUGE, labels=["family", "tenant"])
        up = GaugeMetricFamily(
            "celery_semaphore_status_up", "1 if the semaphore backend Redis answered this scrape, else 0."
        )
        return gauges, up

    def describe(self) -> Iterable[Metric]:
        """The metric names, without reading Redis: registering must not need the backend."""
        gauges, up = self._families()
        return [*gauges.values(), up]

    def collect(self) -> Iterable[Metric]:
        gauges, up = self._families()
        try:
            families = family_status(self.app)
        except SemaphoreError as error:  # bad settings or Redis down: say so, do not fail the scrape
            logger.warning("semaphore status for metrics failed: %s", error)
            up.add_metric([], 0)
            return [up]
        for family, entry in sorted(families.items()):
            for name, value in _family_values(entry).items():
                gauges[name].add_metric([family], value)
            for tenant, waiting in entry.top_tenants():
                gauges[_TENANT_GAUGE[0]].add_metric([family, tenant], waiting)
        up.add_metric([], 1)
        return [*gauges.values(), up]


def _require(wanted: str) -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError as error:
        raise PrometheusMissing(wanted) from error


_exported: CollectorRegistry | None = None


def exported_registry() -> CollectorRegistry:
    """The registry ``start_metrics_server`` serves and ``register_status_collector`` fills when
    not given one: the default registry, or, with ``PROMETHEUS_MULTIPROC_DIR`` set (prefork
    workers count in their children), one registry that merges what every process wrote there.
    Either way the status gauges and the counters come out of the same endpoint."""
    global _exported
    _require("exported_registry")
    from prometheus_client import REGISTRY, CollectorRegistry

    with _lock:
        if _exported is None:
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                from prometheus_client import multiprocess

                _exported = CollectorRegistry()
                multiprocess.MultiProcessCollector(_exported)  # type: ignore[no-untyped-call]
            else:
                _exported = REGISTRY
        return _exported


def register_status_collector(app: Any, registry: CollectorRegistry | None = None) -> StatusCollector:
    """Export holder and waiter gauges of ``app``'s semaphores from ``registry`` (default:
    ``exported_registry()``). Register it in one process only (a worker's parent, or a separate
    exporter): every process reads the same Redis, so more would only repeat the numbers."""
    _require("register_status_collector")
    collector = StatusCollector(app)
    (registry if registry is not None else exported_registry()).register(collector)
    return collector


def start_metrics_server(
    port: int, addr: str = "127.0.0.1", *, registry: CollectorRegistry | None = None
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``/metrics`` over HTTP on ``addr:port`` in a daemon thread (default registry:
    ``exported_registry()``); returns the server and its thread (``server.shutdown()`` stops it).

    Binds to loopback unless told otherwise: the metrics name tasks and their key templates.
    """
    _require("start_metrics_server")
    from prometheus_client import start_http_server

    server, thread = start_http_server(port, addr=addr, registry=registry or exported_registry())
    return server, thread
