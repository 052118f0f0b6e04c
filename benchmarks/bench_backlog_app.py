"""The Celery app that the workers of ``benchmarks.bench_backlog`` run (``celery -A`` this module).

An app of its own, like benchmarks/bench_rates_app.py, so that its workers load only these tasks
and these handlers. It reads the same environment variables as the test app
(``PROJ_BROKER_URL``, ``PROJ_SEMAPHORE_URL``, ``PROJ_PROBE_URL``, ``PROJ_QUEUE``, ``PROJ_CONF``),
so the test helpers (tests/workers.py) start and configure its workers; the task's rule comes from
``BENCH_BACKLOG_RATE`` (a rate as Celery writes one, default ``"20/s"``; empty: no rate),
``BENCH_BACKLOG_LIMIT`` (the concurrency limit, default 1000, one the rate scenario never
reaches) and its body's length from ``BENCH_BACKLOG_HOLD`` (seconds, default 0.005).

Two tasks with the same body: ``bench.backlog.work`` (SemaphoreTask, under that rule) and
``bench.backlog.plain`` (a plain task, no semaphore: the throughput scenario's baseline).

Everything the benchmark reads is recorded in the probe Redis (a redis-server of its own, so
that these records do not count in the broker's or the semaphore's memory), keyed by task id:

* ``bb:received`` (hash) and ``bb:received:total``: messages of the task that reached a worker's
  main process (``task_received``): every delivery, refused ones and copies held for their ETA
  included, counted as it arrives and before any pool process sees it;
* ``bb:runs`` (hash): runs in a pool process (``task_prerun``), refused ones included;
* ``bb:execs`` (hash) and ``bb:starts`` (list of ``"<seq> <worker time> <granted server ms or ->"``):
  bodies run, each start stamped with the worker's clock and the server time at which Redis
  granted the slot (``holder_info``), the clock the rate is kept in;
* ``bb:conc:*``: the tests' concurrency probe around each body (``bb:conc:max``: the most bodies
  seen running at once, whatever the semaphore believes);
* ``bb:ends`` (counter): bodies finished;
* ``bb:package`` (hash: worker name -> the path ``celery_semaphore`` was imported from), so the
  benchmark can say which tree it measured;
* ``bench:failures`` (list): any task that failed, so that the benchmark stops instead of waiting.
"""

# Celery's decorators are untyped: the tasks and handlers below would each need an ignore.
# mypy: disable-error-code="untyped-decorator"

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals

import celery_semaphore
from benchmarks.unread import UnreadRecords
from celery_semaphore import SemaphoreTask
from tests.concurrency_probe import ConcurrencyProbe

app = Celery(
    "bench-backlog",
    broker=os.environ.get("PROJ_BROKER_URL", "redis://127.0.0.1:1/0"),
    backend=os.environ.get("PROJ_RESULT_URL", "redis://127.0.0.1:1/2"),
)
app.conf.update(
    semaphore_backend_url=os.environ.get("PROJ_SEMAPHORE_URL", "redis://127.0.0.1:1/1"),
    task_default_queue=os.environ.get("PROJ_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    task_ignore_result=True,
)
app.conf.update(json.loads(os.environ.get("PROJ_CONF", "{}")))

RATE = os.environ.get("BENCH_BACKLOG_RATE", "20/s") or None  # empty: no rate
LIMIT = int(os.environ.get("BENCH_BACKLOG_LIMIT", "1000"))
HOLD = float(os.environ.get("BENCH_BACKLOG_HOLD", "0.005"))
NAME = "bench.backlog.work"
PLAIN = "bench.backlog.plain"
NAMES = frozenset((NAME, PLAIN))

_clients: dict[str, redis.Redis] = {}


def probe_client() -> redis.Redis:
    """The client of the probe Redis (one per process: pool children build their own)."""
    if "probe" not in _clients:
        _clients["probe"] = redis.Redis.from_url(os.environ.get("PROJ_PROBE_URL", "redis://127.0.0.1:1/3"))
    return _clients["probe"]


@functools.cache
def concurrency_probe() -> ConcurrencyProbe:
    return ConcurrencyProbe(probe_client(), "bb:conc")


# the records a worker's process sends without waiting for the reply (benchmarks/unread.py):
# none of them then lengthens the slot it is taken in, nor the way of a task to its body
_records = UnreadRecords(probe_client)


def _body(task: Any, seq: int) -> None:
    """A trivial body: record its start (and the server time of its grant), sleep ``HOLD``.

    Inside the slot only the concurrency probe waits for Redis (the truth of how many bodies run
    at once must not lag); the grant's server time is asked before the sleep and read after it,
    and the records are sent without waiting, so that the slot is held for about ``HOLD``."""
    started = time.time()
    lease = task.semaphore_held() if isinstance(task, SemaphoreTask) else None  # the plain task holds none
    concurrency_probe().enter()
    asked = _ask_granted(lease)
    try:
        if HOLD > 0:
            time.sleep(HOLD)
    finally:
        concurrency_probe().leave()
    _records.send(
        ("HINCRBY", "bb:execs", task.request.id, 1),
        ("RPUSH", "bb:starts", f"{seq} {started:.6f} {_granted(asked)}"),
        ("INCR", "bb:ends"),
    )


# asks for grants' server times, on the semaphore's Redis (built by the first grant in a process)
_grant_asks: UnreadRecords | None = None


def _ask_granted(lease: Any) -> UnreadRecords | None:
    """Ask, without waiting, when Redis granted ``lease`` (its ``holder_info``); None without one."""
    global _grant_asks
    if lease is None:
        return None
    if _grant_asks is None:
        client = lease.semaphore.client
        _grant_asks = UnreadRecords(lambda: client)
    _grant_asks.send(("HGET", lease.semaphore.keys.holder_info, f"h:{lease.token}"))
    return _grant_asks


def _granted(asked: UnreadRecords | None) -> str:
    """The server time (ms) of the grant asked for by ``_ask_granted``, or ``-``."""
    replies = asked.replies() if asked is not None else []
    info = replies[0] if replies else None
    if not info:
        return "-"
    return (info.decode() if isinstance(info, bytes) else str(info)).split("|")[0]


@app.task(
    base=SemaphoreTask, bind=True, name=NAME, semaphore_key="bb:{key}", semaphore_limit=LIMIT, semaphore_rate=RATE
)
def work(self: Any, seq: int, key: str) -> None:
    _body(self, seq)


@app.task(bind=True, name=PLAIN)
def plain(self: Any, seq: int, key: str) -> None:
    """The same body without the semaphore."""
    _body(self, seq)


@signals.task_received.connect
def _on_received(request: Any = None, **_: Any) -> None:
    if request is not None and getattr(request, "name", "") in NAMES:
        _records.send(("HINCRBY", "bb:received", request.id, 1), ("INCR", "bb:received:total"))


@signals.task_prerun.connect
def _on_prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    if task_id is not None and getattr(task, "name", "") in NAMES:
        _records.send(("HINCRBY", "bb:runs", task_id, 1))


@signals.worker_ready.connect
def _on_ready(sender: Any = None, **_: Any) -> None:
    probe_client().hset("bb:package", str(getattr(sender, "hostname", os.getpid())), celery_semaphore.__file__ or "?")


@signals.task_failure.connect
def _on_failure(
    task_id: str | None = None, sender: Any = None, exception: BaseException | None = None, **_: Any
) -> None:
    if getattr(sender, "name", "") in NAMES:
        probe_client().rpush("bench:failures", f"{task_id} {type(exception).__name__}: {exception}")
