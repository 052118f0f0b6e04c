"""celery_semaphore in two stories (the semaphore chapter of "Redis in Action", 6.3): copy this.

Story 1, a paid API: its plan allows ``API_LIMIT`` calls at once and ``API_QUOTA`` calls in any
window, and answers 429 (and would bill or ban us) beyond either. ``call_api`` keeps to both
across every worker: the limit and the rate of one semaphore, on one fair line. A 429 can come
all the same (the API is down for maintenance, or another client of the account spent the
quota): the task then pauses the key for every worker for as long as ``Retry-After`` says, and
goes first when the pause ends. ``call_api_unprotected`` is the same call without the semaphore,
for the contrast.

Story 2, a polite crawler: ``crawl(host, path)`` holds a slot of ``crawl:{host}``, one semaphore
per host. Each site says in its robots.txt how many concurrent requests it accepts
(``Crawl-concurrency``) and how long to wait between two (``Crawl-delay``): ``fetch_robots``
reads both before the first page of a host and stores them as the runtime limit and spacing of
that one key, which every worker obeys from then on; they lapse after ``ROBOTS_TTL``, and the
host's robots.txt is read again before they do. Until then (and for a site that states
nothing) the glob ``crawl:*`` in ``semaphore_limits`` gives each host the safe default of one
page at a time, one a second.

Story 3, two customers on one plan: ``export_report(customer, i)`` calls the same paid API for
one of our customers. One customer's flood must not starve the others: ``semaphore_fair_by``
puts each waiting call in line by its customer's share, not by its arrival, so a customer who
comes after another's flood of calls is served within about one call's time, and the two share
the API's slots from then on. With ``semaphore_inline_wait=0`` a refused call leaves the worker
at once: the workers take the whole flood off the broker's queue and into the semaphore's line,
where the customer's share can place it (a call still waiting in the broker's queue is in no
line yet). Its key is its own here only so the demo can tell the stories one after the other:
in your project, put ``semaphore_fair_by`` on the one task that calls the API.

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

API_LIMIT = 4  # the paid API's plan: concurrent calls beyond this are answered 429,
API_QUOTA = (20, 10.0)  # and so are calls beyond 20 in any 10 s ("1000/m" in real life: scaled down)
RETRY_AFTER = 5.0  # how long to pause on a 429 whose Retry-After says no number of seconds
SAFE_CRAWL_LIMIT = 1  # a host whose robots.txt is not read (or states nothing): one page at a time,
SAFE_CRAWL_DELAY = 1.0  # and one a second
ROBOTS_TTL = 600.0  # a robots.txt is trusted this long: what was read from it lapses then,
ROBOTS_REREAD = 540.0  # so a host's next page after this long reads it again, before the lapse
HTTP_TIMEOUT = 15.0
FAIR_BY = "{customer}"  # story 3: the tenant of a call, a template over the task's arguments

app = Celery("example_project")
app.conf.update(
    broker_url="redis://127.0.0.1:6379/0",
    semaphore_backend_url="redis://127.0.0.1:6379/1",
    semaphore_limits={"crawl:*": {"limit": SAFE_CRAWL_LIMIT, "spacing": SAFE_CRAWL_DELAY}},
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


# shared=False throughout: the demo's tasks belong to its app alone (a shared task joins every app
# of the process, and the tests build many)
@app.task(  # type: ignore[untyped-decorator]
    base=SemaphoreTask,
    bind=True,
    semaphore_limit=API_LIMIT,
    semaphore_rate=API_QUOTA,
    name="demo.call_api",
    shared=False,
)
def call_api(self: SemaphoreTask, i: int) -> int:
    """Call the paid API while holding one of its ``API_LIMIT`` slots, started within its
    ``API_QUOTA``; returns the HTTP status.

    On a 429 all the same, backing off alone would help nobody: the other workers would keep
    calling and keep hitting the wall. ``semaphore_pause`` holds every start of the key on every
    worker for as long as the API asks, and sends this task again, first in line (it raises,
    like ``self.retry()``)."""
    reply = post_report(i)
    if reply.status == 429:
        self.semaphore_pause(reply.retry_after or RETRY_AFTER)
    return reply.status


@app.task(name="demo.call_api_unprotected", shared=False)  # type: ignore[untyped-decorator]
def call_api_unprotected(i: int) -> int:
    """The same call with no semaphore: as many at once as there are pool processes, and no
    heed of the quota."""
    return post_report(i).status


def post_report(i: int, customer: str = "") -> web.Reply:
    """POST report ``i`` (of ``customer``, in story 3) to the paid API. One body for every task,
    so the semaphore is the only difference between them."""
    path = f"/v1/customers/{customer}/reports/{i}" if customer else f"/v1/reports/{i}"
    with record_call(tenant=customer) as call:
        reply = web.http_post(app.conf.paid_api_port, path, timeout=HTTP_TIMEOUT)
        call.status = reply.status
    return reply


# -- story 2: a polite crawler ----------------------------------------------------------------


@functools.cache
def frontier() -> redis.Redis:
    """The crawl's shared state: which pages and hosts any worker has seen."""
    return redis.Redis.from_url(app.conf.crawl_frontier_url, socket_timeout=10, socket_connect_timeout=5)


def schedule(host: str, path: str) -> bool:
    """Crawl ``host``/``path`` unless it was scheduled before; a host seen for the first time,
    or not read for ``ROBOTS_REREAD`` seconds, gets its robots.txt read first. True if something
    was scheduled."""
    prefix = app.conf.crawl_frontier_prefix
    if not frontier().sadd(f"{prefix}:seen", f"{host}{path}"):
        return False
    # The limit and spacing read from robots.txt lapse after ROBOTS_TTL (a site may change them):
    # this mark lapses a minute sooner, so the host's next page reads robots.txt again and renews
    # them before the safe default of crawl:* takes over.
    if frontier().set(f"{prefix}:robots-read:{host}", 1, nx=True, px=round(ROBOTS_REREAD * 1000)):
        fetch_robots.delay(host, path)
    else:
        crawl.delay(host, path)
    return True


@app.task(name="demo.fetch_robots", shared=False)  # type: ignore[untyped-decorator]
def fetch_robots(host: str, path: str) -> dict[str, float | None]:
    """Read a host's robots.txt, store its Crawl-concurrency as the limit of ``crawl:{host}``
    and its Crawl-delay as the spacing, for every worker, then crawl the page that led here.
    Returns what the site stated (None: nothing, and the safe default stays).

    Not itself limited: fetching robots.txt is how a crawler learns the rules, and sites do not
    count it against them.
    """
    status, text = web.http_get(app.conf.sites_port, host, "/robots.txt", timeout=HTTP_TIMEOUT)
    allowance = web.parse_crawl_concurrency(text) if status == 200 else None
    delay = web.parse_crawl_delay(text) if status == 200 else None
    # the semaphore the workers use for this key; each override lapses with our trust in it
    semaphore = semaphore_for(app, f"crawl:{host}")
    if allowance is not None:
        semaphore.set_limit(allowance, ttl=ROBOTS_TTL)
    if delay is not None:
        semaphore.set_spacing(delay, ttl=ROBOTS_TTL)
    crawl.delay(host, path)
    return {"crawl_concurrency": allowance, "crawl_delay": delay}


@limit_concurrency(key="crawl:{host}", app=app, name="demo.crawl", shared=False)
def crawl(host: str, path: str) -> int:
    """Fetch one page while holding a slot of ``crawl:{host}``, then schedule its unseen links.
    Returns the HTTP status."""
    with record_call(f"crawl:{host}") as call:
        call.status, body = web.http_get(app.conf.sites_port, host, path, timeout=HTTP_TIMEOUT)
    if call.status == 200:
        for href in web.extract_links(body):
            schedule(*web.resolve_link(host, href))
    return call.status


# -- story 3: two customers on one plan -------------------------------------------------------


@app.task(  # type: ignore[untyped-decorator]
    base=SemaphoreTask,
    semaphore_limit=API_LIMIT,
    semaphore_rate=API_QUOTA,
    semaphore_fair_by=FAIR_BY,
    semaphore_inline_wait=0,
    name="demo.export_report",
    shared=False,
)
def export_report(customer: str, i: int) -> int:
    """Post report ``i`` of ``customer`` to the paid API, in line by the customer's
    share (``semaphore_shares`` could give a customer more: 1 each here); the HTTP status."""
    return post_report(i, customer).status
