"""What the tasks and workers record in Redis for the demo's orchestrator.

The orchestrator judges the semaphore by what the clients and the servers saw, never by what the
semaphore believes, so every HTTP call of a story is recorded as it happens: ``record_call``, the
one line of the demo inside ``example_project/tasks.py``, which does nothing outside a demo run
(when ``example_project.tasks`` runs in a worker of your own). The rest is Celery signals, which
``wiring.py`` connects for the demo's app only: which workers are ready, which pool processes
they started, which tasks failed, and how much crawl work is still under way.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from celery import current_task, signals

from .settings import ENV_VAR, DemoSettings

# The crawl's tasks: while one of them is queued, waiting for its slot or running, the crawl is
# not finished.
CRAWL_TASKS = frozenset({"demo.fetch_robots", "demo.crawl"})


class Keys:
    """Names of the Redis keys the demo writes for the orchestrator, all under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, "data", *parts))

    @property
    def spans(self) -> str:
        """LIST of JSON spans: one per HTTP call, for the chart and the makespans."""
        return self._key("spans")

    @property
    def ready(self) -> str:
        """SET of worker hostnames that finished starting."""
        return self._key("ready")

    @property
    def pids(self) -> str:
        """SET of pool process ids, so the orchestrator can list every process it caused."""
        return self._key("pids")

    @property
    def errors(self) -> str:
        """LIST of error messages raised by the demo's tasks."""
        return self._key("errors")

    @property
    def crawl_frontier(self) -> str:
        """Prefix of the crawler's own state (the pages and hosts it has seen)."""
        return self._key("crawl")

    @property
    def sent_ids(self) -> str:
        """SET of the crawl tasks' ids sent so far: a task counts once, whichever of its
        messages is published first (its own, or a copy of its wait placed as it was sent)."""
        return self._key("crawl", "sent")

    @property
    def pending(self) -> str:
        """Crawl tasks sent and not yet ended (a wait for a slot re-sends one before it ends):
        zero when the crawl is complete."""
        return self._key("crawl", "pending")

    def done(self, series: str) -> str:
        """Finished HTTP calls of one series (a semaphore key, or the unprotected task's name)."""
        return self._key("done", series)

    def in_flight(self, series: str) -> str:
        """HTTP calls of one series running right now, as the clients count them."""
        return self._key("in-flight", series)

    def rejected(self, series: str) -> str:
        """Calls of one series answered 429, as the clients count them."""
        return self._key("rejected", series)


@dataclass
class Call:
    """One HTTP call in a task: the task sets ``status`` (0 until it does, e.g. if it raised)."""

    status: int = 0


@functools.cache
def data() -> redis.Redis:
    """The client for the demo's records (the semaphore's Redis, under the run's prefix)."""
    # timeouts: no command here blocks, so a hung connection must not hang a task or the cleanup
    return redis.Redis.from_url(DemoSettings.from_env().records_url, socket_timeout=10, socket_connect_timeout=5)


@functools.cache
def keys() -> Keys:
    return Keys(DemoSettings.from_env().prefix)


def in_demo() -> bool:
    return bool(os.environ.get(ENV_VAR))


@contextmanager
def record_call(series: str | None = None, tenant: str = "") -> Iterator[Call]:
    """Record the HTTP call made in the block for the demo's chart and makespans: in flight
    while it runs, then a span with its status, under ``series`` (the running task's name by
    default) and for ``tenant`` (the customer, if any). Outside a demo run, nothing is recorded."""
    call = Call()
    if not in_demo():
        yield call
        return
    series = series or str(current_task.name)
    client, names = data(), keys()
    client.incr(names.in_flight(series))
    start = time.time()
    try:
        yield call
    finally:
        end = time.time()
        span = {"key": series, "start": start, "end": end, "status": call.status, "pid": os.getpid(), "tenant": tenant}
        pipe = client.pipeline(transaction=False)
        pipe.decr(names.in_flight(series))
        pipe.rpush(names.spans, json.dumps(span))
        pipe.incr(names.done(series))
        if call.status == 429:
            pipe.incr(names.rejected(series))
        pipe.execute()


def connect_signals() -> None:
    """Connect the demo's bookkeeping to Celery's signals (once; ``wiring.py`` calls it)."""
    signals.worker_ready.connect(_worker_ready, weak=False, dispatch_uid="demo-worker-ready")
    signals.worker_process_init.connect(_pool_process_started, weak=False, dispatch_uid="demo-pool-process")
    signals.task_failure.connect(_task_failed, weak=False, dispatch_uid="demo-task-failed")
    signals.before_task_publish.connect(_task_sent, weak=False, dispatch_uid="demo-task-sent")
    signals.task_postrun.connect(_task_ended, weak=False, dispatch_uid="demo-task-ended")


def _worker_ready(sender: Any = None, **_: Any) -> None:
    """Tell the orchestrator this worker consumes: it starts the stories only then."""
    hostname = getattr(sender, "hostname", None) or str(os.getpid())
    data().sadd(keys().ready, hostname)


def _pool_process_started(**_: Any) -> None:
    """Record each pool process id: the orchestrator lists every process it caused to run."""
    data().sadd(keys().pids, os.getpid())


def _task_failed(
    sender: Any = None, task_id: str | None = None, exception: BaseException | None = None, **_: Any
) -> None:
    """Report every failed demo task, wherever it failed (the body, or the semaphore before it),
    so the orchestrator stops waiting at once and says why, instead of running into its deadline."""
    name = getattr(sender, "name", "") or ""
    if name.startswith("demo."):
        data().rpush(keys().errors, f"{name}[{task_id}]: {exception!r}")


def _task_sent(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """A crawl task was sent (by the orchestrator, or a task scheduling links): one more unit of
    crawl work, counted before the message leaves. A task that would wait takes its place as it
    is sent, and its first message is a copy of its wait: so a unit is a task id, counted at its
    first message, whatever that is; the later copies of its wait are the same unit."""
    task_id = (headers or {}).get("id")
    if sender in CRAWL_TASKS and task_id and data().sadd(keys().sent_ids, task_id):
        data().incr(keys().pending)


def _task_ended(sender: Any = None, state: str | None = None, **_: Any) -> None:
    """A crawl task's body ended (done or failed): one unit of crawl work less. A delivery
    re-sent to wait for its slot (RETRY) or dropped as a copy of a run done (IGNORED) is not
    the unit's end."""
    if getattr(sender, "name", None) in CRAWL_TASKS and state in ("SUCCESS", "FAILURE"):
        data().decr(keys().pending)
