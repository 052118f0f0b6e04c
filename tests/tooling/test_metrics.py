"""Prometheus metrics: counters moved by real acquires, refusals and lost leases; gauges read from Redis."""

from __future__ import annotations

import json
import math
import re
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from celery_semaphore import FairSemaphore, SemaphoreTask, limit_concurrency, metrics
from celery_semaphore._core import renewer
from celery_semaphore._core.attempts import Ask, new_token
from celery_semaphore.metrics import PrometheusMissing, StatusCollector, register_status_collector

from ..redis_server import RedisServer, free_port
from ..waiting import wait_until


def sample(name: str, family: str, **labels: str) -> float:
    """A sample of the default registry, 0 when the series does not exist yet."""
    return REGISTRY.get_sample_value(name, {"family": family, **labels}) or 0.0


def test_event_functions_move_their_counters_and_the_wait_histogram() -> None:
    """Each event function counts under its family; acquired also records the wait."""
    family = f"test-{uuid.uuid4().hex[:8]}"
    metrics.acquired(family, 0.0)
    metrics.acquired(family, 7.5)
    metrics.refused(family)
    metrics.lease_lost(family)
    metrics.reclaimed(family, 3)
    metrics.reclaimed(family, 0)
    assert sample("celery_semaphore_acquired_total", family) == 2
    assert sample("celery_semaphore_refused_total", family) == 1
    assert sample("celery_semaphore_leases_lost_total", family) == 1
    assert sample("celery_semaphore_reclaimed_total", family) == 3
    assert sample("celery_semaphore_wait_seconds_count", family) == 2
    assert sample("celery_semaphore_wait_seconds_sum", family) == 7.5
    assert sample("celery_semaphore_wait_seconds_bucket", family, le="5.0") == 1
    assert sample("celery_semaphore_wait_seconds_bucket", family, le="10.0") == 2


def test_a_refused_then_granted_task_counts_refusal_acquisition_and_wait(own_redis: RedisServer) -> None:
    """A worker's task that finds its slot taken counts a refusal, then an acquisition with its wait."""
    base = f"redis://127.0.0.1:{own_redis.port}"
    # no result backend: an AsyncResult left for the garbage collector would reconnect to this
    # test's Redis after it is gone, blocking whichever later test the collector runs in
    app = Celery("metrics_worker", broker=f"{base}/0", set_as_current=False)
    app.conf.update(
        semaphore_backend_url=f"{base}/1",
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # Celery's @app.task is shared by default, so this app also inherits the tasks of every other
        # test app in the process; a catch-all limit lets the worker's start-up check pass for them
        semaphore_limits={"*": 1},
    )
    name = f"metrics.limited.{uuid.uuid4().hex[:8]}"

    @app.task(
        base=SemaphoreTask, semaphore_limit=1, semaphore_inline_wait=0, semaphore_countdown=1, name=name, shared=False
    )
    def limited() -> str:
        return "ran"

    holder = FairSemaphore(own_redis.client(db=1), name, 1, lease=30).acquire(timeout=5)
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            limited.delay()
            wait_until(lambda: sample("celery_semaphore_refused_total", name) >= 1, timeout=20, what="a refusal")
            assert sample("celery_semaphore_acquired_total", name) == 0
            holder.release()
            wait_until(lambda: sample("celery_semaphore_acquired_total", name) >= 1, timeout=30, what="the slot")
    finally:
        # a lease left tracked would have the renewer retry a dead Redis, delaying every later test's renewals
        holder.release()
        app.close()
    assert sample("celery_semaphore_acquired_total", name) == 1
    assert sample("celery_semaphore_wait_seconds_count", name) == 1
    assert sample("celery_semaphore_wait_seconds_sum", name) > 0  # it waited from its first refusal


def test_a_lost_lease_is_counted_by_the_renewer_listener(redis_client: redis.Redis) -> None:
    """When renewal finds a lease gone and its slot taken, leases_lost counts it under the lease's family."""
    name = f"lost-{uuid.uuid4().hex[:8]}"
    semaphore = FairSemaphore(redis_client, name, 1, lease=30)
    lost = semaphore.acquire(timeout=5)
    semaphore.reset()  # the slot is forgotten in Redis while its holder still runs...
    taker = semaphore.acquire(timeout=5)  # ...and somebody else takes it
    try:
        lost.renew_due = 0.0  # renew now rather than in 10 s
        renewer.track(lost)
        wait_until(lambda: sample("celery_semaphore_leases_lost_total", name) >= 1, what="the lost lease counted")
        assert sample("celery_semaphore_leases_lost_total", name) == 1
        assert lost.lost
    finally:
        taker.release()
        lost.release()


# -- the status collector ------------------------------------------------------------------------


@pytest.fixture
def collector_app(redis_server: RedisServer) -> Any:
    """A fresh app on this test's Redis: two fixed-key tasks and one key template."""
    app = Celery("metrics_collector", broker=redis_server.url, set_as_current=False)
    app.conf.semaphore_backend_url = f"redis://127.0.0.1:{redis_server.port}/1"

    @app.task(base=SemaphoreTask, semaphore_limit=2, name="m.reports", shared=False)
    def reports() -> None: ...

    @app.task(base=SemaphoreTask, semaphore_limit=1, name="m.idle", shared=False)
    def idle() -> None: ...

    # not "crawl:{host}": the demo's shared crawl task, registered with every app once imported, has it
    @limit_concurrency(1, key="mcrawl:{host}", app=app, name="m.crawl", shared=False)
    def crawl(host: str) -> None: ...

    return app


def test_collector_reports_holders_and_waiters_per_family(collector_app: Any, redis_server: RedisServer) -> None:
    """On scrape, keys are grouped into families (task name, key template, or (other)) and counted."""
    client = redis_server.client(db=1)
    registry = CollectorRegistry()
    register_status_collector(collector_app, registry)
    crawl_a = FairSemaphore(client, "mcrawl:a.example", 1, lease=30)
    leases = []
    try:
        for semaphore in (
            FairSemaphore(client, "m.reports", 2, lease=30),
            crawl_a,
            FairSemaphore(client, "mcrawl:b.example", 1, lease=30),
            FairSemaphore(client, "adhoc", 1, lease=30),
        ):
            leases.append(semaphore.acquire(timeout=5))
        crawl_a._try(Ask(token=new_token(), waiter="waiter-a", patience=60))

        def gauge(name: str, family: str) -> float | None:
            return registry.get_sample_value(name, {"family": family})

        assert gauge("celery_semaphore_holders", "m.reports") == 1
        assert gauge("celery_semaphore_holders", "mcrawl:{host}") == 2
        assert gauge("celery_semaphore_waiters", "mcrawl:{host}") == 1
        assert gauge("celery_semaphore_holders", "(other)") == 1
        assert gauge("celery_semaphore_holders", "m.idle") == 0  # idle fixed key: series exists
        # the limits in force, summed over the keys read: mcrawl:{host} has two live keys of 1
        limits = {
            family: gauge("celery_semaphore_limit", family) for family in ("m.reports", "m.idle", "mcrawl:{host}")
        }
        assert limits == {"m.reports": 2, "m.idle": 1, "mcrawl:{host}": 2}
        assert gauge("celery_semaphore_limit", "(other)") is None  # "adhoc": no limit applies to it
        FairSemaphore(client, "m.reports", 2).set_limit(5)
        assert gauge("celery_semaphore_limit", "m.reports") == 5  # a runtime override is the limit in force
        assert gauge("celery_semaphore_holders", "mcrawl:a.example") is None  # never the per-host key
        assert registry.get_sample_value("celery_semaphore_status_up") == 1
    finally:
        for lease in leases:
            lease.release()
    assert registry.get_sample_value("celery_semaphore_holders", {"family": "mcrawl:{host}"}) == 0
    client.close()


def test_collector_reports_the_top_tenants_of_a_family_by_calls_waiting(
    collector_app: Any, redis_server: RedisServer
) -> None:
    """A task with semaphore_fair_by: its family's tenants with the most calls waiting, summed
    over its keys, at most five series (seven tenants wait here)."""

    @limit_concurrency(
        1, key="mexport:{region}", app=collector_app, name="m.export", shared=False, semaphore_fair_by="{customer}"
    )
    def export(region: str, customer: str) -> None: ...

    client = redis_server.client(db=1)
    registry = CollectorRegistry()
    register_status_collector(collector_app, registry)
    leases = []
    for region in ("eu", "us"):
        semaphore = FairSemaphore(client, f"mexport:{region}", 1, lease=30, patience=60)
        leases.append(semaphore.acquire(timeout=5))
        for n, customer in enumerate(["acme"] * 3 + ["globex"] + [f"small{i}" for i in range(5)]):
            assert not semaphore._try(
                Ask(token=new_token(), waiter=f"{region}{n}", tenant=customer, patience=60)
            ).granted
    try:
        samples = {
            sample.labels["tenant"]: sample.value
            for metric in registry.collect()
            if metric.name == "celery_semaphore_tenant_waiting"
            for sample in metric.samples
            if sample.labels["family"] == "mexport:{region}"
        }
        # acme's first call heads each line: two behind the head in each of two keys
        assert len(samples) == 5 and samples["acme"] == 4 and samples["globex"] == 2, samples
    finally:
        for lease in leases:
            lease.release()
        client.close()


def test_collector_reports_down_instead_of_failing_the_scrape(collector_app: Any) -> None:
    """With the backend Redis unreachable, a scrape still succeeds and says status_up 0."""
    collector_app.conf.semaphore_backend_url = f"redis://127.0.0.1:{free_port()}/1"
    registry = CollectorRegistry()
    register_status_collector(collector_app, registry)
    assert registry.get_sample_value("celery_semaphore_status_up") == 0
    assert registry.get_sample_value("celery_semaphore_holders", {"family": "m.reports"}) is None


def test_registering_the_collector_does_not_touch_redis(collector_app: Any) -> None:
    """describe() names the gauges without reading Redis, so registering works while Redis is down."""
    collector_app.conf.semaphore_backend_url = f"redis://127.0.0.1:{free_port()}/1"
    collector = StatusCollector(collector_app)
    assert [family.name for family in collector.describe()] == [
        "celery_semaphore_holders",
        "celery_semaphore_waiters",
        "celery_semaphore_limit",
        "celery_semaphore_paused",
        "celery_semaphore_pause_remaining_seconds",
        "celery_semaphore_next_start_seconds",
        "celery_semaphore_rate_starts",
        "celery_semaphore_rate_period_seconds",
        "celery_semaphore_starts_in_window",
        "celery_semaphore_spacing_seconds",
        "celery_semaphore_tenant_waiting",
        "celery_semaphore_status_up",
    ]


def test_collector_reports_the_rate_spacing_and_pause_of_a_fixed_key(
    collector_app: Any, redis_server: RedisServer
) -> None:
    """A fixed key's family shows its rate, spacing, starts in the window and the wait they
    impose; a pause shows as paused with the time it has left. Without a rate or a spacing
    those series are absent (a rate of 0 would read as "nothing may start")."""
    client = redis_server.client(db=1)
    registry = CollectorRegistry()
    register_status_collector(collector_app, registry)

    def gauge(name: str) -> float | None:
        return registry.get_sample_value(name, {"family": "m.reports"})

    assert gauge("celery_semaphore_rate_starts") is None
    assert gauge("celery_semaphore_spacing_seconds") is None
    assert (gauge("celery_semaphore_paused"), gauge("celery_semaphore_next_start_seconds")) == (0, 0)
    reports = FairSemaphore(client, "m.reports", 2, lease=30)
    reports.set_rate("10/m")
    reports.set_spacing(30)
    try:
        with reports.acquire(timeout=5):
            assert (gauge("celery_semaphore_rate_starts"), gauge("celery_semaphore_rate_period_seconds")) == (10, 60)
            assert gauge("celery_semaphore_starts_in_window") == 1
            assert gauge("celery_semaphore_spacing_seconds") == 30
            assert 29 < (gauge("celery_semaphore_next_start_seconds") or 0) <= 30
            assert gauge("celery_semaphore_paused") == 0
            reports.pause(45)
            assert gauge("celery_semaphore_paused") == 1
            assert 44 < (gauge("celery_semaphore_pause_remaining_seconds") or 0) <= 45
            assert 44 < (gauge("celery_semaphore_next_start_seconds") or 0) <= 45  # the pause outlasts the spacing
            reports.resume()
            assert (gauge("celery_semaphore_paused"), gauge("celery_semaphore_pause_remaining_seconds")) == (0, 0)
    finally:
        client.close()


def test_collector_summarises_the_rules_of_a_template_family(collector_app: Any, redis_server: RedisServer) -> None:
    """Over the keys of one template: paused keys and starts are counted, the tightest rate and the
    longest pause and wait are shown, all under the template, never the per-host key."""
    client = redis_server.client(db=1)
    registry = CollectorRegistry()
    register_status_collector(collector_app, registry)

    def gauge(name: str, family: str = "mcrawl:{host}") -> float | None:
        return registry.get_sample_value(name, {"family": family})

    fast, slow = (FairSemaphore(client, f"mcrawl:{host}.example", 1, lease=30) for host in ("fast", "slow"))
    fast.set_rate("5/s")
    slow.set_rate("100/m")  # fewer starts per second than 5/s: the family's tightest rate
    leases = [fast.acquire(timeout=5), slow.acquire(timeout=5)]  # holders make the keys live
    try:
        assert (gauge("celery_semaphore_rate_starts"), gauge("celery_semaphore_rate_period_seconds")) == (100, 60)
        assert gauge("celery_semaphore_starts_in_window") == 2
        fast.pause(20)
        assert gauge("celery_semaphore_paused") == 1
        assert 19 < (gauge("celery_semaphore_pause_remaining_seconds") or 0) <= 20
        slow.pause()  # until resumed
        assert gauge("celery_semaphore_paused") == 2
        assert gauge("celery_semaphore_pause_remaining_seconds") == math.inf
        assert gauge("celery_semaphore_next_start_seconds") == math.inf
        assert (
            'celery_semaphore_pause_remaining_seconds{family="mcrawl:{host}"} +Inf'
            in generate_latest(registry).decode()
        )
        assert gauge("celery_semaphore_paused", "mcrawl:slow.example") is None
        slow.resume()
        fast.resume()
        assert gauge("celery_semaphore_paused") == 0
    finally:
        for lease in leases:
            lease.release()
        client.close()


def test_metrics_server_serves_the_gauges(collector_app: Any, redis_server: RedisServer) -> None:
    """start_metrics_server serves a registry over HTTP on loopback."""
    registry = CollectorRegistry()
    register_status_collector(collector_app, registry)
    client = redis_server.client(db=1)
    port = free_port()
    server, thread = metrics.start_metrics_server(port, registry=registry)
    try:
        with (
            FairSemaphore(client, "m.reports", 2, lease=30).acquire(timeout=5),
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response,
        ):
            body = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        client.close()
    assert 'celery_semaphore_holders{family="m.reports"} 1.0' in body
    assert "celery_semaphore_status_up 1.0" in body


def test_without_prometheus_client_events_are_no_ops_and_setup_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, collector_app: Any
) -> None:
    """Without prometheus_client the task-path functions do nothing; the setup calls say what to install."""
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes the import fail
    monkeypatch.setattr(metrics, "_instruments", None)
    monkeypatch.setattr(metrics, "_unavailable", False)
    metrics.acquired("nothing", 1.0)
    metrics.refused("nothing")
    metrics.lease_lost("nothing")
    metrics.reclaimed("nothing", 1)
    assert metrics._unavailable
    for setup in (lambda: register_status_collector(collector_app), lambda: metrics.start_metrics_server(free_port())):
        with pytest.raises(PrometheusMissing, match=r"pip install celery-semaphore\[prometheus\]") as caught:
            setup()
        assert isinstance(caught.value, ImportError)


# -- the Grafana dashboard in the docs -----------------------------------------------------------

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
METRIC = re.compile(r"\bcelery_semaphore_\w+")


def exported_names(collector_app: Any, redis_server: RedisServer) -> set[str]:
    """Every series name the package exports, as a scrape shows them: the events counted once
    under a family of this test, and the status of a key with every rule in force (a rate, a
    spacing and a pause), read from Redis by a real collector."""
    family = f"dashboard-{uuid.uuid4().hex[:8]}"
    metrics.acquired(family, 0.2)
    metrics.refused(family)
    metrics.lease_lost(family)
    metrics.reclaimed(family, 1)
    registry = CollectorRegistry()
    register_status_collector(collector_app, registry)
    client = redis_server.client(db=1)
    reports = FairSemaphore(client, "m.reports", 2, lease=30)
    reports.set_rate("10/m")
    reports.set_spacing(5)
    reports.pause(30)
    try:
        scrapes = [*REGISTRY.collect(), *registry.collect()]
    finally:
        client.close()
    names = {sample.name for metric in scrapes for sample in metric.samples}
    return {name for name in names if name.startswith("celery_semaphore")}


def panel_exprs(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every target, rows' nested panels included."""
    for panel in panels:
        yield from panel_exprs(panel.get("panels", []))
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_the_dashboard_queries_only_metrics_the_package_exports(collector_app: Any, redis_server: RedisServer) -> None:
    """Every metric name in every panel's PromQL is one a scrape really shows (histogram series by
    their _bucket, _sum and _count names), and the dashboard imports as is: a datasource variable
    that every panel and query uses, unique panel ids."""
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_names(collector_app, redis_server)
    assert {"celery_semaphore_wait_seconds_bucket", "celery_semaphore_limit", "celery_semaphore_status_up"} <= exported
    named = {(title, name) for title, expr in panel_exprs(dashboard["panels"]) for name in METRIC.findall(expr)}
    assert {(title, name) for title, name in named if name not in exported} == set()
    used = {name for _, name in named}
    # the panels the docs list: holders and limit, waiters, wait percentiles, refusals, lost leases, pause, rate use
    assert {
        "celery_semaphore_holders",
        "celery_semaphore_limit",
        "celery_semaphore_waiters",
        "celery_semaphore_wait_seconds_bucket",
        "celery_semaphore_refused_total",
        "celery_semaphore_leases_lost_total",
        "celery_semaphore_paused",
        "celery_semaphore_starts_in_window",
        "celery_semaphore_rate_starts",
    } <= used
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    panels = [*dashboard["panels"], *(p for row in dashboard["panels"] for p in row.get("panels", []))]
    assert len({panel["id"] for panel in panels}) == len(panels)
    for panel in panels:
        for target in panel.get("targets", []):
            assert panel["datasource"] == target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
