"""The demo's Celery app and tasks: the two stories of the semaphore chapter of "Redis in Action".

Story 1, a paid API: ``call_api`` may run at most ``api_limit`` at once across every worker,
because the API answers 429 (and would bill or ban us) beyond that. ``call_api_unprotected`` is
the same call without the semaphore, for the contrast.

Story 2, a polite crawler: ``crawl(host, path)`` holds a slot of ``crawl:{host}``. Each site says
in its robots.txt how many concurrent requests it accepts; ``fetch_robots`` reads that before
the first page of a host is crawled and stores it as a runtime override of that one key. Until
then (and for a site that states nothing) the glob ``crawl:*`` gives every host a limit of 1,
the safe default.

The app is configured from the environment (see ``settings.py``), so the orchestrator and the
worker subprocesses build the same app. Every HTTP call records its start and end in Redis; the
orchestrator draws its chart and computes makespans from those records, independently of what
the semaphore believes.
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import Celery, signals

from celery_semaphore import FairSemaphore, SemaphoreTask, limit_concurrency
from celery_semaphore.backend import client_for
from celery_semaphore.config import config_for

from .servers import LOOPBACK_HOST, extract_links, http_get, parse_crawl_concurrency, resolve_link
from .settings import DemoSettings, Keys

settings = DemoSettings.from_env()
keys = Keys(settings.prefix)

# How long a robots.txt allowance is trusted: a real crawler reads robots.txt again after a
# while, and until it does, the cautious default of ``crawl:*`` is what applies.
ROBOTS_TTL = 600.0
# The glob default for every host whose robots.txt has not been read (or states no limit).
SAFE_CRAWL_LIMIT = 1
HTTP_TIMEOUT = 15.0

app = Celery("example_project", broker=settings.broker_url, backend=settings.result_url)
app.conf.update(
    semaphore_backend_url=settings.semaphore_url,
    semaphore_prefix=settings.semaphore_prefix,
    semaphore_limits={"crawl:*": SAFE_CRAWL_LIMIT},
    # A waiter re-sent with a countdown comes back within 5 s: the demo's calls are short, and a
    # long countdown would only leave a freed slot idle while its next holder sleeps.
    semaphore_countdown=(1, 5),
    task_default_queue=settings.queue,
    # One task at a time per pool process, so both workers share the backlog.
    worker_prefetch_multiplier=1,
    # The demo never inspects workers: no pidbox, so no broadcast keys in a shared Redis.
    worker_enable_remote_control=False,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
if settings.broker_keyprefix is not None:
    app.conf.broker_transport_options = {"global_keyprefix": settings.broker_keyprefix}
if settings.result_keyprefix is not None:
    app.conf.result_backend_transport_options = {"global_keyprefix": settings.result_keyprefix}

UNPROTECTED_KEY = "paid-api (no semaphore)"

_data: redis.Redis | None = None


def data() -> redis.Redis:
    """The client for the demo's own records (the semaphore's Redis, under the run's prefix)."""
    global _data
    if _data is None:
        # timeouts: no command here blocks, so a hung connection must not hang a task or the cleanup
        _data = redis.Redis.from_url(settings.semaphore_url, socket_timeout=10, socket_connect_timeout=5)
    return _data


def record_span(key: str, start: float, end: float, status: int) -> None:
    """One HTTP call as the client saw it: what the chart and the makespans are made of."""
    span = {"key": key, "start": start, "end": end, "status": status, "pid": os.getpid()}
    pipe = data().pipeline(transaction=False)
    pipe.rpush(keys.spans, json.dumps(span))
    pipe.incr(keys.done(key))
    if status == 429:
        pipe.incr(keys.rejected(key))
    pipe.execute()


def timed_call(key: str, call: Callable[[], tuple[int, str]]) -> tuple[int, str]:
    """Make one HTTP call and record it: in flight while it runs, then a span with its status
    (0 if the call raised)."""
    client = data()
    client.incr(keys.in_flight(key))
    start = time.time()
    status = 0
    try:
        status, body = call()
        return status, body
    finally:
        end = time.time()
        client.decr(keys.in_flight(key))
        record_span(key, start, end, status)


def post_to_api(path: str) -> tuple[int, str]:
    """POST to the paid API on loopback; (status, body)."""
    conn = http.client.HTTPConnection(LOOPBACK_HOST, settings.api_port, timeout=HTTP_TIMEOUT)
    try:
        conn.request("POST", path, body=b"{}", headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return int(response.status), response.read().decode("utf-8", errors="replace")
    finally:
        conn.close()


# -- story 1: a paid API ----------------------------------------------------------------------


@app.task(base=SemaphoreTask, semaphore_limit=settings.api_limit, name="demo.call_api")  # type: ignore[untyped-decorator]
def call_api(i: int) -> int:
    """Call the paid API while holding one of its ``api_limit`` slots; returns the HTTP status."""
    return timed_call("demo.call_api", lambda: post_to_api(f"/v1/reports/{i}"))[0]


@app.task(name="demo.call_api_unprotected")  # type: ignore[untyped-decorator]
def call_api_unprotected(i: int) -> int:
    """The same call with no semaphore: as many at once as there are pool processes."""
    return timed_call(UNPROTECTED_KEY, lambda: post_to_api(f"/v1/reports/{i}"))[0]


# -- story 2: a polite crawler ----------------------------------------------------------------


def crawl_key(host: str) -> str:
    return f"crawl:{host}"


def schedule(host: str, path: str) -> bool:
    """Crawl ``host``/``path`` unless it was scheduled before; a host seen for the first time
    gets its robots.txt read first. True if something was scheduled."""
    client = data()
    if not client.sadd(keys.seen, f"{host}{path}"):
        return False
    client.incr(keys.pending)
    try:
        if client.sadd(keys.hosts, host):
            fetch_robots.delay(host, path)
        else:
            crawl.delay(host, path)
    except Exception:
        client.decr(keys.pending)
        raise
    return True


@app.task(name="demo.fetch_robots")  # type: ignore[untyped-decorator]
def fetch_robots(host: str, path: str) -> int | None:
    """Read a host's robots.txt, store its Crawl-concurrency as the runtime limit of
    ``crawl:{host}``, then crawl the page that led here. Returns the allowance (None: none stated).

    Not itself limited: fetching robots.txt is how a crawler learns the limit, and sites do not
    count it against their allowance.
    """
    try:
        status, text = http_get(settings.crawl_port, host, "/robots.txt", timeout=HTTP_TIMEOUT)
        allowance = parse_crawl_concurrency(text) if status == 200 else None
        if allowance is not None:
            config = config_for(app)
            key = crawl_key(host)
            rule = config.limit_for(key, crawl.name, None)
            default = rule.limit if rule is not None else SAFE_CRAWL_LIMIT
            semaphore = FairSemaphore(client_for(config.backend_url), key, default, prefix=config.prefix)
            semaphore.set_limit(allowance, ttl=ROBOTS_TTL)
        data().hset(keys.robots, host, allowance or 0)
        crawl.delay(host, path)  # the pending unit of this URL passes on to the crawl
    except Exception:
        data().decr(keys.pending)
        raise
    return allowance


@limit_concurrency(key="crawl:{host}", app=app, name="demo.crawl")
def crawl(host: str, path: str) -> int:
    """Fetch one page while holding a slot of ``crawl:{host}``, then schedule its unseen links.
    Returns the HTTP status."""
    try:
        status, body = timed_call(
            crawl_key(host), lambda: http_get(settings.crawl_port, host, path, timeout=HTTP_TIMEOUT)
        )
        if status == 200:
            for href in extract_links(body):
                schedule(*resolve_link(host, href))
        return status
    finally:
        data().decr(keys.pending)


# -- bookkeeping for the orchestrator ---------------------------------------------------------


@signals.worker_ready.connect  # type: ignore[untyped-decorator]
def _worker_ready(sender: Any = None, **_: Any) -> None:
    """Tell the orchestrator this worker consumes: it starts the stories only then."""
    hostname = getattr(sender, "hostname", None) or str(os.getpid())
    data().sadd(keys.ready, hostname)


@signals.task_failure.connect  # type: ignore[untyped-decorator]
def _task_failed(sender: Any = None, task_id: str | None = None, exception: BaseException | None = None,
                 **_: Any) -> None:
    """Report every failed demo task, wherever it failed (the body, or the semaphore before it),
    so the orchestrator stops waiting at once and says why, instead of running into its deadline."""
    name = getattr(sender, "name", "") or ""
    if name.startswith("demo."):
        data().rpush(keys.errors, f"{name}[{task_id}]: {exception!r}")


@signals.worker_process_init.connect  # type: ignore[untyped-decorator]
def _pool_process_started(**_: Any) -> None:
    """Record each pool process id: the orchestrator lists every process it caused to run."""
    data().sadd(keys.pids, os.getpid())
