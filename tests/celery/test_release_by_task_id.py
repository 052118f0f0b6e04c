"""The worker's main process gives back the slot of a pool process it lost, by task id: exactly
that process's slot (a real Redis; the task and the app are real, no worker is needed)."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_semaphore import SemaphoreTask, semaphore_for
from celery_semaphore._celery.tokens import _HOST_PART, task_key
from celery_semaphore._celery.worker import _release_by_task_id

from ..redis_server import RedisServer


def token(task_id: str, pid: int) -> str:
    """A holder token as a task running in process ``pid`` of this host makes it."""
    return f"{task_key(task_id)}:{_HOST_PART}{pid:08x}{'ab' * 8}"


@pytest.fixture
def app(redis_server: RedisServer) -> Celery:
    app = Celery("byid", broker="memory://", set_as_current=False)
    app.conf.update(semaphore_backend_url=redis_server.url, semaphore_limits={"byid.job": 3, "byid.marks": 3})
    return app


def holders(app: Celery, key: str) -> list[str]:
    return sorted(holder.token for holder in semaphore_for(app, key).status().holders)


def test_only_the_lost_process_slot_comes_back(app: Celery) -> None:
    """Ids "job:1" and "job:1:x" hold slots, and "job:1" holds a second one in another process
    (its wake copy and a redelivery, say): losing the child 111 that ran "job:1" frees that slot
    only; the other copy and the other task keep theirs (the limit holds)."""

    @app.task(base=SemaphoreTask, name="byid.job", shared=False)
    def task() -> None: ...

    semaphore = semaphore_for(app, "byid.job")
    mine, other_copy, other_task = token("job:1", 111), token("job:1", 222), token("job:1:x", 111)
    for held in (mine, other_copy, other_task):
        assert semaphore.try_acquire(token=held, enqueue=False).granted
    _release_by_task_id(task, "job:1", (), {}, pid=111)
    assert holders(app, "byid.job") == sorted([other_copy, other_task])
    for lease_token in (other_copy, other_task):
        semaphore.release(lease_token)


@pytest.mark.parametrize("task_id", ["!bang", "*2*star", "~tilde"])
def test_ids_that_look_like_marks_are_released_too(app: Celery, task_id: str) -> None:
    @app.task(base=SemaphoreTask, name="byid.marks", shared=False)
    def task() -> None: ...

    semaphore = semaphore_for(app, "byid.marks")
    assert semaphore.try_acquire(token=token(task_id, 333), enqueue=False).granted
    _release_by_task_id(task, task_id, (), {}, pid=333)
    assert holders(app, "byid.marks") == []
