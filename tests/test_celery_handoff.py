"""Hand-off for Celery tasks waiting outside the worker, with real workers on a Redis broker.

A refused task is re-sent with a countdown (the backstop) and parks; the release that makes its
turn has its process send it again at once. These tests check that it starts soon after the
release (not at its countdown), in first-ask order, and exactly once although two copies of it
exist.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_semaphore import semaphore_for

from .conftest import CeleryStack
from .waiting import wait_until
from .workers import Worker

QUEUE = "handoff"


@pytest.fixture(scope="module")
def workers(celery_stack: CeleryStack) -> Iterator[list[Worker]]:
    env = {**celery_stack.env, "PROJ_QUEUE": QUEUE}
    group = [Worker(env, name=f"h{i}", concurrency=4) for i in (1, 2)]
    for worker in group:
        worker.start()
    yield group
    for worker in group:
        worker.stop()


@pytest.fixture
def proj(celery_stack: CeleryStack, workers: list[Worker]) -> Any:
    import tests.proj.app as proj

    return proj


def send(task: Any, *args: Any) -> AsyncResult:
    return task.apply_async(args, queue=QUEUE)


def starts(proj: Any, key: str) -> list[tuple[str, float]]:
    """(task id, start time) of every body run recorded under the probe ``key``, in order."""
    entries = proj.probe(key).client.lrange(f"probe:{key}:starts", 0, -1)
    return [(task_id.decode(), float(at)) for task_id, at in (entry.split() for entry in entries)]


def parked(proj: Any, semaphore_key: str, task_id: str) -> bool:
    status = semaphore_for(proj.app, semaphore_key).status()
    return any(w.waiter == task_id and w.present for w in status.waiters)


def logs(workers: list[Worker]) -> str:
    return "".join(worker.log() for worker in workers)


def test_a_task_waiting_outside_the_worker_starts_soon_after_the_release(proj: Any, workers: list[Worker]) -> None:
    """A task re-sent with a 5 s countdown starts within a fraction of that after the slot it
    waits for is released, and its countdown copy, arriving later, is dropped: it runs once."""
    key = "handoff-latency"
    semaphore = semaphore_for(proj.app, "proj.handoff")
    holder = semaphore.acquire(timeout=5)
    result = send(proj.handoff, 0.1, key)
    wait_until(lambda: parked(proj, "proj.handoff", result.id), timeout=30, what="the task parked")
    released_at = time.time()
    holder.release()
    assert result.get(timeout=30) == result.id
    ((task_id, started_at),) = starts(proj, key)
    assert task_id == result.id
    assert started_at - released_at < 2.5, "woken by the release, not by its 5 s countdown"
    # the countdown copy comes later and finds the run done
    wait_until(lambda: f"{result.id}]: another copy of this wait has run" in logs(workers), timeout=30,
               what="the countdown copy dropped")
    assert len(starts(proj, key)) == 1
    wait_until(lambda: semaphore.status().holder_count == 0, timeout=10, what="no slot held")


def test_a_copy_arriving_while_its_twin_runs_is_dropped(proj: Any, workers: list[Worker]) -> None:
    """The countdown copy (1 s) of a woken task that runs for 3 s arrives while it runs: it is
    dropped, not run next to it, and not recorded as a failure."""
    key = "handoff-twin"
    semaphore = semaphore_for(proj.app, "proj.handoff_twin")
    holder = semaphore.acquire(timeout=5)
    result = send(proj.handoff_twin, 3.0, key)
    wait_until(lambda: parked(proj, "proj.handoff_twin", result.id), timeout=30, what="the task parked")
    holder.release()
    wait_until(lambda: f"{result.id}]: another copy of this wait is running" in logs(workers), timeout=30,
               what="the countdown copy dropped while its twin runs")
    assert result.get(timeout=30) == result.id
    assert result.state == "SUCCESS"
    assert proj.probe(key).entries == 1
    assert proj.probe(key).maximum == 1


def test_tasks_sent_one_at_a_time_start_in_that_order(proj: Any) -> None:
    """Tasks sent one after another to two workers, each waiting outside the worker for a slot
    of limit 1, start in the order they were sent."""
    key = "handoff-order"
    asks = proj.probe("proj.handoff")  # first asks are recorded under the semaphore key
    asked_before = asks.client.llen("probe:proj.handoff:asks")
    results = []
    for _ in range(8):
        results.append(send(proj.handoff, 0.15, key))
        # sent one at a time: each asks before the next is sent
        wait_until(lambda: asks.client.llen("probe:proj.handoff:asks") - asked_before >= len(results),
                   timeout=30, what="the task to ask")
    for result in results:
        result.get(timeout=60)
    assert [task_id for task_id, _ in starts(proj, key)] == [r.id for r in results]
