"""Eager mode (task_always_eager): the limit holds across threads with a blocking acquire."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from celery import Celery

from celery_semaphore import SemaphoreUnavailable, limit_concurrency, semaphore_for

from .concurrency_probe import ConcurrencyProbe
from .redis_server import RedisServer


def eager_app(server: RedisServer, **conf: object) -> Celery:
    app = Celery("eager", broker=server.url, set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True, semaphore_backend_url=server.url, **conf)
    return app


def test_eager_tasks_hold_the_limit_across_threads(redis_server: RedisServer) -> None:
    """12 eager calls from 6 threads with limit 2: at most 2 bodies at once, and every call runs."""
    app = eager_app(redis_server)
    probe = ConcurrencyProbe(redis_server.client(db=1))

    @limit_concurrency(2, app=app, lazy=False, shared=False)
    def work(i: int) -> int:
        probe.enter()
        try:
            import time

            time.sleep(0.05)  # the work being limited
        finally:
            probe.leave()
        return i

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: work.delay(i).get(disable_sync_subtasks=False), range(12)))
    assert results == list(range(12))
    assert probe.maximum == 2
    assert redis_server.client().keys("*") == []


def test_an_eager_task_past_its_max_wait_raises_semaphore_unavailable(redis_server: RedisServer) -> None:
    """An eager call that cannot get a slot within semaphore_max_wait fails instead of recursing."""
    app = eager_app(redis_server)

    @limit_concurrency(1, app=app, lazy=False, shared=False, semaphore_max_wait=0.3, name="eager.blocked")
    def blocked() -> str:
        return "ran"

    semaphore = semaphore_for(app, "eager.blocked")
    with semaphore.acquire(timeout=0), pytest.raises(SemaphoreUnavailable) as caught:
        blocked.delay()
    assert caught.value.key == "eager.blocked"
    assert blocked.delay().get(disable_sync_subtasks=False) == "ran"
