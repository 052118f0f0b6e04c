"""celery_semaphore in two stories (the semaphore chapter of "Redis in Action", 6.3): copy this.

Story 1, a paid API: ``call_api`` runs at most ``API_LIMIT`` at once across every worker, because
the API answers 429 (and would bill or ban us) beyond that. ``call_api_unprotected`` is the same
call without the semaphore, for the contrast.

Story 2, a polite crawler: ``crawl(host, path)`` holds a slot of ``crawl:{host}``, one semaphore
per host. Each site says in its robots.txt how many concurrent requests it accepts:
``fetch_robots`` reads that before the first page of a host and stores it as a runtime limit of
that one key, which every worker obeys from then on. Until then (and for a site that states
nothing) the glob ``crawl:*`` in ``semaphore_limits`` gives each host the safe default of 1.

Everything here uses the public API only. Not about the semaphore, and so elsewhere: the HTTP
and HTML plumbing (``web.py``) and the demo that runs these tasks on real workers against local
stand-ins of the API and the sites (``demo/``, ``python -m example_project``). Of the demo, only
``record_call`` shows here: it records each HTTP call for the demo's chart (nothing outside a
demo run), so drop it in your copy. A worker of your own: ``celery -A example_project.tasks
worker``.
"""

from __future__ import annotations

import functools

import redis
from celery import Celery

from celery_semaphore import SemaphoreTask, limit_concurrency, semaphore_for

from . import web
from .demo.records import record_call

API_LIMIT = 4  # the paid API's plan: concurrent calls beyond this are answered 429
SAFE_CRAWL_LIMIT = 1  # a host whose robots.txt is not read (or states nothing): one page at a time
ROBOTS_TTL = 600.0  # a robots.txt is trusted this long; then crawl:* applies until it is read again
HTTP_TIMEOUT = 15.0

app = Celery("example_project")
app.conf.update(
    broker_url="redis://127.0.0.1:6379/0",
    semaphore_backend_url="redis://127.0.0.1:6379/1",
    semaphore_limits={"crawl:*": SAFE_CRAWL_LIMIT},
    # A waiter re-sent with a countdown comes back within 5 s: the calls are short, and a long
    # countdown would only leave a freed slot idle while its next holder sleeps.
    semaphore_countdown=(1, 5),
    # One task at a time per pool process, so every worker shares the backlog.
    worker_prefetch_multiplier=1,
    # This module's own settings: where the services listen, where the crawl keeps its frontier.
    paid_api_port=8000,
    sites_port=8001,
    crawl_frontier_url="redis://127.0.0.1:6379/1",
    crawl_frontier_prefix="crawl",
)


# -- story 1: a paid API ----------------------------------------------------------------------


@app.task(base=SemaphoreTask, semaphore_limit=API_LIMIT, name="demo.call_api")  # type: ignore[untyped-decorator]
def call_api(i: int) -> int:
    """Call the paid API while holding one of its ``API_LIMIT`` slots; returns the HTTP status."""
    return post_report(i)


@app.task(name="demo.call_api_unprotected")  # type: ignore[untyped-decorator]
def call_api_unprotected(i: int) -> int:
    """The same call with no semaphore: as many at once as there are pool processes."""
    return post_report(i)


def post_report(i: int) -> int:
    """POST report ``i`` to the paid API; the HTTP status. One body for both tasks, so the
    semaphore is the only difference between them."""
    with record_call() as call:
        call.status, _ = web.http_post(app.conf.paid_api_port, f"/v1/reports/{i}", timeout=HTTP_TIMEOUT)
    return call.status


# -- story 2: a polite crawler ----------------------------------------------------------------


@functools.cache
def frontier() -> redis.Redis:
    """The crawl's shared state: which pages and hosts any worker has seen."""
    return redis.Redis.from_url(app.conf.crawl_frontier_url, socket_timeout=10, socket_connect_timeout=5)


def schedule(host: str, path: str) -> bool:
    """Crawl ``host``/``path`` unless it was scheduled before; a host seen for the first time
    gets its robots.txt read first. True if something was scheduled."""
    prefix = app.conf.crawl_frontier_prefix
    if not frontier().sadd(f"{prefix}:seen", f"{host}{path}"):
        return False
    if frontier().sadd(f"{prefix}:hosts", host):
        fetch_robots.delay(host, path)
    else:
        crawl.delay(host, path)
    return True


@app.task(name="demo.fetch_robots")  # type: ignore[untyped-decorator]
def fetch_robots(host: str, path: str) -> int | None:
    """Read a host's robots.txt, store its Crawl-concurrency as the limit of ``crawl:{host}``
    for every worker, then crawl the page that led here. Returns the allowance (None: none).

    Not itself limited: fetching robots.txt is how a crawler learns the limit, and sites do not
    count it against their allowance.
    """
    status, text = web.http_get(app.conf.sites_port, host, "/robots.txt", timeout=HTTP_TIMEOUT)
    allowance = web.parse_crawl_concurrency(text) if status == 200 else None
    if allowance is not None:
        # the semaphore the workers use for this key; the override lapses with our trust in it
        semaphore_for(app, f"crawl:{host}").set_limit(allowance, ttl=ROBOTS_TTL)
    crawl.delay(host, path)
    return allowance


@limit_concurrency(key="crawl:{host}", app=app, name="demo.crawl")
def crawl(host: str, path: str) -> int:
    """Fetch one page while holding a slot of ``crawl:{host}``, then schedule its unseen links.
    Returns the HTTP status."""
    with record_call(f"crawl:{host}") as call:
        call.status, body = web.http_get(app.conf.sites_port, host, path, timeout=HTTP_TIMEOUT)
    if call.status == 200:
        for href in web.extract_links(body):
            schedule(*web.resolve_link(host, href))
    return call.status
