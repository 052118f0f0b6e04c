"""Eager mode (task_always_eager): the limit holds across threads with a blocking acquire."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from celery import Celery

from celery_semaphore import SemaphoreUnavailable, limit_concurrency, semaphore_for

from ..concurrency_probe import ConcurrencyProbe
from ..redis_server import RedisServer


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
    assert caught.value.max_wait == 0.3
    assert "semaphore_max_wait" in str(caught.value), "names the setting that ran out"
    assert blocked.delay().get(disable_sync_subtasks=False) == "ran"


def test_semaphore_unavailable_says_which_bound_ran_out_and_what_to_do() -> None:
    """The message of a task past its max wait names ``semaphore_max_wait`` and the remedies (a
    longer max wait, more slots, a look at the holders); that of a timed-out ``acquire`` names
    the timeout. The attributes stay, and the error rebuilds from its args, as Celery does."""
    from celery_semaphore import SemaphoreUnavailable

    task_error = SemaphoreUnavailable("api", 5, 612.25, 600)
    message = str(task_error)
    for expected in ("'api'", "limit 5", "612.250 s", "semaphore_max_wait of 600 s", "set-limit", "status api"):
        assert expected in message, message
    assert (task_error.key, task_error.limit, task_error.waited, task_error.max_wait) == ("api", 5, 612.25, 600)
    assert str(SemaphoreUnavailable(*task_error.args)) == message
    timed_out = str(SemaphoreUnavailable("reports", 2, 10.0))
    assert "timeout" in timed_out and "semaphore_max_wait" not in timed_out, timed_out


def test_a_nested_eager_call_of_a_key_its_caller_holds_fails_at_once(redis_server: RedisServer) -> None:
    """An eager task holding the only slot of a key calls a task of the same key: that call could
    only wait for its own caller, for ever. It fails at once, naming the key."""
    import time

    from celery_semaphore import SemaphoreError

    app = eager_app(redis_server)

    @limit_concurrency(1, key="shared-key", app=app, lazy=False, shared=False, name="eager.inner")
    def inner() -> str:
        return "inner ran"

    @limit_concurrency(1, key="shared-key", app=app, lazy=False, shared=False, name="eager.outer")
    def outer() -> str:
        return str(inner.delay().get(disable_sync_subtasks=False))

    started = time.monotonic()
    with pytest.raises(SemaphoreError, match="shared-key") as caught:
        outer.delay()
    assert time.monotonic() - started < 2, "at once, not after a wait"
    assert caught.value.key == "shared-key"
    assert redis_server.client().zcard("semaphore:{shared-key}:holders") == 0  # the outer slot came back


def test_a_nested_eager_call_with_a_slot_free_runs(redis_server: RedisServer) -> None:
    """With a slot left, the nested call of the same key takes it and runs."""
    app = eager_app(redis_server)

    @limit_concurrency(2, key="roomy-key", app=app, lazy=False, shared=False, name="eager.inner2")
    def inner() -> str:
        return "inner ran"

    @limit_concurrency(2, key="roomy-key", app=app, lazy=False, shared=False, name="eager.outer2")
    def outer() -> str:
        return str(inner.delay().get(disable_sync_subtasks=False))

    assert outer.delay().get(disable_sync_subtasks=False) == "inner ran"


def test_fail_open_runs_an_eager_task_when_redis_is_unreachable() -> None:
    """semaphore_fail_open holds in eager mode too: with the semaphore's Redis unreachable the
    task runs (with a warning) instead of failing."""
    from ..redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens there
    app = Celery("eager", broker="memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True, task_eager_propagates=True, semaphore_backend_url=url, semaphore_fail_open=True
    )

    @limit_concurrency(1, app=app, lazy=False, shared=False, name="eager.open")
    def work() -> str:
        return "ran"

    assert work.delay().get(disable_sync_subtasks=False) == "ran"


def test_an_eager_body_that_pauses_its_key_runs_again_after_the_pause_not_as_a_retry(
    redis_server: RedisServer,
) -> None:
    """semaphore_pause in eager mode: the call waits out the pause and runs its body again; it is
    not a retry (max_retries=0 still lets it through), and it leaves no place in line behind."""
    import time

    from celery_semaphore import SemaphoreTask

    app = eager_app(redis_server)
    runs: list[float] = []

    @app.task(
        base=SemaphoreTask, semaphore_limit=2, bind=True, max_retries=0, lazy=False, shared=False, name="eager.api"
    )
    def call_api(self: SemaphoreTask) -> int:
        runs.append(time.monotonic())
        if len(runs) == 1:
            self.semaphore_pause(0.3)  # "429, Retry-After: 0.3"
        return len(runs)

    assert call_api.delay().get(disable_sync_subtasks=False) == 2
    assert runs[1] - runs[0] >= 0.25
    status = semaphore_for(app, "eager.api").status()
    assert status.waiter_count == 0 and status.holder_count == 0
