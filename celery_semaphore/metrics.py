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
serves them, and one exporter is enough for all workers:

    from celery.signals import worker_init

    @worker_init.connect
    def export_metrics(sender, **_):
        metrics.register_status_collector(sender.app)
        metrics.start_metrics_server(9808)
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._celery.catalogue import Catalogue
from ._core import renewer
from .errors import SemaphoreError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.metrics_core import Metric

    from ._core.lease import Lease

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
_lock = threading.Lock()


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
        instruments.acquired.labels(family=family).inc()
        instruments.wait_seconds.labels(family=family).observe(max(waited, 0.0))


def refused(family: str) -> None:
    """A task of ``family`` found no free slot and will wait."""
    instruments = _get()
    if instruments is not None:
        instruments.refused.labels(family=family).inc()


def lease_lost(family: str) -> None:
    """A renewal found a lease gone and could not take it back."""
    instruments = _get()
    if instruments is not None:
        instruments.leases_lost.labels(family=family).inc()


def reclaimed(family: str, count: int) -> None:
    """``count`` slots of dead holders were given back by a worker's parent process."""
    instruments = _get()
    if instruments is not None and count > 0:
        instruments.reclaimed.labels(family=family).inc(count)


def _on_lease_event(lease: Lease, event: str) -> None:
    """Renewer listener: a lost lease is counted here, since the renewer knows nothing of metrics."""
    if event == "lost":
        lease_lost(_lease_families.get(lease, lease.semaphore.name))


# Registered at import: task.py and worker.py import this module, so every process that holds
# leases through the Celery layer counts their loss. Idempotent (add_listener skips repeats).
renewer.add_listener(_on_lease_event)


# -- holder and waiter gauges, read from Redis on each scrape ------------------------------------


def family_counts(app: Any) -> dict[str, tuple[int, int]]:
    """Holders and waiters per family, over every semaphore of ``app``: the fixed-key tasks
    (present even when idle, so their series exist) and every key SCAN finds in the backend,
    grouped by the task key template it matches (unmatched keys go to ``(other)``).

    One status() round trip per key: a cost that grows with the number of live keys."""
    catalogue = Catalogue(app)
    counts: dict[str, list[int]] = {}
    for fixed_key in catalogue.fixed:
        counts.setdefault(catalogue.family_for(fixed_key), [0, 0])
    for key in catalogue.known_keys():
        status = catalogue.semaphore(key, placeholder_limit=True).status(listed=0)  # counts only
        entry = counts.setdefault(catalogue.family_for(key), [0, 0])
        entry[0] += status.holder_count
        entry[1] += status.waiter_count
    return {family: (holders, waiters) for family, (holders, waiters) in counts.items()}


class StatusCollector:
    """A Prometheus collector that reads the semaphores of ``app`` from Redis on each scrape.

    Gauges ``celery_semaphore_holders`` and ``celery_semaphore_waiters`` (label ``family``), and
    ``celery_semaphore_status_up`` (1 if Redis answered, else 0: a scrape never fails because
    the semaphore backend is down, so the other metrics of the process still arrive).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        from prometheus_client.core import GaugeMetricFamily

        return (
            GaugeMetricFamily("celery_semaphore_holders", "Slots held now, per semaphore family.", labels=["family"]),
            GaugeMetricFamily(
                "celery_semaphore_waiters", "Tasks in line for a slot now, per semaphore family.", labels=["family"]
            ),
            GaugeMetricFamily(
                "celery_semaphore_status_up", "1 if the semaphore backend Redis answered this scrape, else 0."
            ),
        )

    def describe(self) -> Iterable[Metric]:
        """The metric names, without reading Redis: registering must not need the backend."""
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        holders, waiters, up = self._families()
        try:
            counts = family_counts(self.app)
        except SemaphoreError as error:  # bad settings or Redis down: say so, do not fail the scrape
            logger.warning("semaphore status for metrics failed: %s", error)
            up.add_metric([], 0)
            return [up]
        for family, (held, waiting) in sorted(counts.items()):
            holders.add_metric([family], held)
            waiters.add_metric([family], waiting)
        up.add_metric([], 1)
        return [holders, waiters, up]


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
