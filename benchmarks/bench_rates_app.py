"""The Celery app that the workers of ``benchmarks.bench_rates`` run (``celery -A`` this module).

An app of its own, like benchmarks/bench_celery_app.py, so that its workers load only these
tasks and the benchmark does not change when the test app does. It reads the same environment
variables as the test app (``PROJ_BROKER_URL``, ``PROJ_RESULT_URL``, ``PROJ_SEMAPHORE_URL``,
``PROJ_PROBE_URL``, ``PROJ_QUEUE``, ``PROJ_CONF``), so the test helpers (tests/workers.py,
tests/celery_stack.py) start and configure its workers, and the rules of the measured tasks from
``BENCH_RATES_WINDOW`` (a rate as Celery writes one, default ``"20/10s"``), ``BENCH_RATES_SPACING``
(seconds, default 0.5) and ``BENCH_RATES_SPACED_LIMIT`` (default 3).

Each body start is recorded in the probe database (db 3 of the broker's Redis) on
``br:starts:<key>`` as ``"<seq> <worker time> <granted server ms or -> <worker>"``: ``seq`` is the
task's place in the sending order, the worker time is ``time.time()`` as the body began (one host:
one clock for every worker), and the granted moment is the server time Redis wrote when it gave the
running task its slot (``holder_info``), the clock the rules are kept in. The first run of each
task is stamped at ``task_prerun`` on ``br:asked:<key>`` (hash: seq -> worker time), the order of
the tasks' first asks for a slot. A failure is pushed on
``bench:failures``, so that the benchmark stops instead of waiting.
"""

# Celery's decorators are untyped: the tasks and handlers below would each need an ignore.
# mypy: disable-error-code="untyped-decorator"

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task, signals

from celery_semaphore import SemaphoreTask

app = Celery(
    "bench-rates",
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

WINDOW_RATE = os.environ.get("BENCH_RATES_WINDOW", "20/10s")
SPACING = float(os.environ.get("BENCH_RATES_SPACING", "0.5"))
SPACED_LIMIT = int(os.environ.get("BENCH_RATES_SPACED_LIMIT", "3"))

_clients: dict[str, redis.Redis] = {}


def probe_client() -> redis.Redis:
    """The client of the probe database (one per process: pool children build their own)."""
    if "probe" not in _clients:
        _clients["probe"] = redis.Redis.from_url(os.environ.get("PROJ_PROBE_URL", "redis://127.0.0.1:1/3"))
    return _clients["probe"]


def _start(task: Task, seq: int, key: str, seconds: float) -> None:
    """Record the body's start (and, under the semaphore, the server time of the grant), then
    hold for ``seconds``."""
    started = time.time()
    granted = "-"
    lease = task.semaphore_held()
    if lease is not None:
        info = lease.semaphore.client.hget(lease.semaphore.keys.holder_info, f"h:{lease.token}")
        if info:
            granted = (info.decode() if isinstance(info, bytes) else str(info)).split("|")[0]
    probe_client().rpush(f"br:starts:{key}", f"{seq} {started:.6f} {granted} {task.request.hostname or '?'}")
    if seconds > 0:
        time.sleep(seconds)


@app.task(bind=True, name="bench.rates.celery_30m", rate_limit="30/m")
def celery_30m(self: Any, seq: int, key: str, seconds: float) -> None:
    """A plain task under Celery's own ``rate_limit="30/m"`` (a token bucket in each worker)."""
    _start(self, seq, key, seconds)


@app.task(base=SemaphoreTask, bind=True, name="bench.rates.ours_30m", semaphore_key="br:{key}", semaphore_rate="30/m")
def ours_30m(self: Any, seq: int, key: str, seconds: float) -> None:
    """The same task under ``semaphore_rate="30/m"``: 30 starts in any 60 s, over every worker."""
    _start(self, seq, key, seconds)


@app.task(
    base=SemaphoreTask, bind=True, name="bench.rates.window", semaphore_key="br:{key}", semaphore_rate=WINDOW_RATE
)
def window(self: Any, seq: int, key: str, seconds: float) -> None:
    """N starts in any P seconds (``BENCH_RATES_WINDOW``), no concurrency limit."""
    _start(self, seq, key, seconds)


@app.task(
    base=SemaphoreTask,
    bind=True,
    name="bench.rates.spaced",
    semaphore_key="br:{key}",
    semaphore_limit=SPACED_LIMIT,
    semaphore_spacing=SPACING,
)
def spaced(self: Any, seq: int, key: str, seconds: float) -> None:
    """A host with a Crawl-delay (``BENCH_RATES_SPACING`` s between starts), a few at once."""
    _start(self, seq, key, seconds)


@signals.task_prerun.connect
def _on_prerun(task: Any = None, args: Any = None, **_: Any) -> None:
    """The first run of each task, as it begins (right before it asks for a slot): one way to
    order the tasks by their first ask, apart from the order Celery's prefetch hands them out in."""
    if str(getattr(task, "name", "")).startswith("bench.rates.") and args and len(args) >= 2:
        probe_client().hsetnx(f"br:asked:{args[1]}", str(args[0]), f"{time.time():.6f}")


@signals.task_failure.connect
def _on_failure(
    task_id: str | None = None, sender: Any = None, exception: BaseException | None = None, **_: Any
) -> None:
    if str(getattr(sender, "name", "")).startswith("bench.rates."):
        probe_client().rpush("bench:failures", f"{task_id} {type(exception).__name__}: {exception}")
