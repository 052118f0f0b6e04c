"""Hand-off for Celery tasks waiting outside the worker, with real workers on a Redis broker.

A refused task is re-sent with a countdown (the backstop) and parks; the release that makes its
turn has its process send it again at once. These tests check that it starts soon after the
release (not at its countdown), in first-ask order, and exactly once although two copies of it
exist.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_semaphore import semaphore_for
from celery_semaphore._celery.due_copies import due_copies_for
from celery_semaphore._celery.tokens import waiter_key

from ..celery_stack import CeleryStack
from ..waiting import wait_until
from ..workers import Worker, worker_group

# real `celery worker` processes: `pytest -m "not workers"` leaves these out
pytestmark = pytest.mark.workers

QUEUE = "handoff"


@pytest.fixture(scope="module")
def workers(celery_stack: CeleryStack) -> Iterator[list[Worker]]:
    with worker_group(celery_stack.env, queue=QUEUE, names=("h1", "h2")) as group:
        yield group


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
    return any(w.waiter == waiter_key(task_id) and w.present for w in status.waiters)


def has_its_place(proj: Any, semaphore_key: str, probe_key: str, task_id: str) -> bool:
    """Whether the acquire script has placed ``task_id``: it is in the line of ``semaphore_key``
    or its body has started (recorded under ``probe_key``). The order of a line is made there,
    so a test that sends tasks one at a time waits on this, not on a signal of the worker that
    fires a moment before the script runs."""
    if any(started == task_id for started, _ in starts(proj, probe_key)):
        return True
    return any(w.waiter == waiter_key(task_id) for w in semaphore_for(proj.app, semaphore_key).status().waiters)


def logs(workers: list[Worker]) -> str:
    return "".join(worker.log() for worker in workers)


def test_a_task_waiting_outside_the_worker_starts_soon_after_the_release(proj: Any, workers: list[Worker]) -> None:
    """A task re-sent with a 5 s countdown starts within a fraction of that after the slot it
    waits for is released, and its backstop copy, arriving later, is dropped: it runs once."""
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
    # its backstop copy, kept in the broker's Redis, was withdrawn as the run began (no
    # acks_late: Celery runs it at most once), so no copy of it comes back
    store = due_copies_for(proj.app)
    assert store is not None
    wait_until(
        lambda: not any(run.startswith(result.id.encode()) for run in store.client.hkeys(store.keys[1])),
        timeout=10,
        what="the backstop copy withdrawn",
    )
    assert len(starts(proj, key)) == 1
    wait_until(lambda: semaphore.status().holder_count == 0, timeout=10, what="no slot held")


def test_a_copy_arriving_while_its_twin_runs_is_dropped(proj: Any, workers: list[Worker]) -> None:
    """The backstop copy (1 s) of a woken acks_late task that runs for 3 s arrives while it runs: it is
    not run next to it, nor dropped (the twin might be dead), but looks again once the twin's
    lease would have lapsed; by then the run has finished, and the copy is dropped, not recorded
    as a failure. Nor does it record a retry while it waits: a RETRY stored just after the run's
    SUCCESS would hide the result from ``get()``; the only retry is the first refusal's (none
    when the task took its place as it was sent, and was never refused)."""
    key = "handoff-twin"
    semaphore = semaphore_for(proj.app, "proj.handoff_twin")
    holder = semaphore.acquire(timeout=5)
    result = send(proj.handoff_twin, 3.0, key)
    wait_until(lambda: parked(proj, "proj.handoff_twin", result.id), timeout=30, what="the task parked")
    holder.release()
    wait_until(
        lambda: f"{result.id}]: another copy of this wait holds the slot" in logs(workers),
        timeout=30,
        what="the backstop copy sent to look again while its twin runs",
    )
    assert result.get(timeout=30) == result.id
    assert result.state == "SUCCESS"
    # the copy looking again is withdrawn as the run finishes, or, arriving first, dropped
    store = due_copies_for(proj.app)
    assert store is not None
    wait_until(
        lambda: (
            f"{result.id}]: another copy of this wait has run" in logs(workers)
            or not any(run.startswith(result.id.encode()) for run in store.client.hkeys(store.keys[1]))
        ),
        timeout=90,
        what="the backstop copy withdrawn or dropped once the run finished",
    )
    assert proj.probe(key).entries == 1
    assert proj.probe(key).maximum == 1
    retries = proj.probe(key).client.lrange("probe:proj.handoff_twin:retries", 0, -1)
    assert [task_id.decode() for task_id in retries].count(result.id) <= 1
    assert result.state == "SUCCESS"


def test_tasks_sent_one_at_a_time_start_in_that_order(proj: Any) -> None:
    """Tasks sent one after another to two workers, each waiting outside the worker for a slot
    of limit 1, start in the order they were sent."""
    key = "handoff-order"
    results = []
    for _ in range(8):
        results.append(send(proj.handoff, 0.15, key))
        # sent one at a time: each has its place before the next is sent
        wait_until(
            lambda: has_its_place(proj, "proj.handoff", key, results[-1].id),
            timeout=30,
            what="the task to have its place",
        )
    for result in results:
        result.get(timeout=60)
    assert [task_id for task_id, _ in starts(proj, key)] == [r.id for r in results]


def inversions(started: list[str], asked: dict[str, float], resolution: float = 0.0) -> list[tuple[str, str]]:
    """Pairs that started in the opposite order to their first asks, the asks more than
    ``resolution`` seconds apart."""
    return [
        (started[i], started[j])
        for i in range(len(started))
        for j in range(i + 1, len(started))
        if asked[started[i]] - asked[started[j]] > resolution
    ]


def sent_in_order(send: Any, count: int) -> tuple[list[AsyncResult], dict[str, float]]:
    """``count`` tasks sent one after another by ``send()``, and when each was sent: a task that
    takes its place as it is sent (``semaphore_place_at_send``) first asks then."""
    results, asked = [], {}
    for _ in range(count):
        at = time.time()
        result = send()
        results.append(result)
        asked[result.id] = at
    return results, asked


def test_a_backlog_across_two_workers_starts_in_first_ask_order(proj: Any) -> None:
    """24 tasks sent at once to two workers, limit 1, all waiting outside the worker: each takes
    its place as it is sent, and they start in exactly that order (no pair inverted), each
    once, never two at once."""
    key = "handoff-backlog"
    results, asked = sent_in_order(lambda: send(proj.handoff, 0.05, key), 24)
    for result in results:
        result.get(timeout=120)
    ids = {r.id for r in results}
    started = [task_id for task_id, _ in starts(proj, key)]
    assert sorted(started) == sorted(ids), "each ran once"
    assert inversions(started, asked, resolution=0.0) == []
    assert proj.probe(key).maximum == 1


FAULT_CONF = {
    "task_acks_late": True,
    # redeliver a dead worker's unacked messages after 4 s, sweeping every second
    "broker_transport_options": {"visibility_timeout": 4, "unacked_restore_interval": 1, "unacked_restore_throttle": 1},
}


def overlap(proj: Any, key: str, killed_at: float) -> int:
    """Most bodies running at once, from the recorded starts and ends. A run ends at the first
    end recorded after its start and before the same task's next start; a run killed mid-body
    has none, and ends when its process was killed."""
    client = proj.probe(key).client
    ends: dict[str, list[float]] = {}
    for entry in client.lrange(f"probe:{key}:ends", 0, -1):
        task_id, at = entry.decode().split()
        ends.setdefault(task_id, []).append(float(at))
    runs: dict[str, list[float]] = {}
    for task_id, started_at in starts(proj, key):
        runs.setdefault(task_id, []).append(started_at)
    events = []
    for task_id, started in runs.items():
        started.sort()
        for i, started_at in enumerate(started):
            until = started[i + 1] if i + 1 < len(started) else float("inf")
            ended = [at for at in ends.get(task_id, []) if started_at <= at < until]
            events += [(started_at, 1), (min(ended) if ended else killed_at, -1)]
    running = most = 0
    for _, change in sorted(events):
        running += change
        most = max(most, running)
    return most


def _ended_once(proj: Any, key: str, results: list[AsyncResult]) -> None:
    ends = [entry.split()[0].decode() for entry in proj.probe(key).client.lrange(f"probe:{key}:ends", 0, -1)]
    assert sorted(ends) == sorted(r.id for r in results), "every task finished exactly once"


@pytest.mark.slow
def test_a_worker_sigkilled_while_it_holds_parked_tasks_loses_none(celery_stack: CeleryStack) -> None:
    """A whole worker SIGKILLed while its processes have parked waiting tasks (and it holds
    countdown copies unacked): every task still finishes, exactly once."""
    import tests.proj.app as proj

    env = {**celery_stack.env, "PROJ_QUEUE": "handoff-kill"}
    victim = Worker(env, name="kill-victim", concurrency=3, conf=FAULT_CONF).start()
    survivor = Worker(env, name="kill-survivor", concurrency=3, conf=FAULT_CONF).start()
    key = "handoff-kill"
    try:
        # sent by name, as they are: the workers refuse and park them (placed at send, no worker
        # would hold a part of their wait)
        results = [proj.app.send_task(proj.handoff_faults.name, (0.3, key), queue="handoff-kill") for _ in range(12)]
        wait_until(lambda: "retry: waiting for a slot" in victim.log(), timeout=30, what="the victim parked a task")
        victim.kill()
        killed_at = time.time()
        for result in results:
            assert result.get(timeout=120) == result.id
        _ended_once(proj, key, results)
        # (the probe's own maximum counts a killed body as running for ever: use the records)
        assert overlap(proj, key, killed_at) == 1
    finally:
        victim.kill()
        survivor.stop()


@pytest.mark.slow
def test_the_semaphore_redis_restarted_while_tasks_wait_loses_none(celery_stack: CeleryStack, proj: Any) -> None:
    """The semaphore's Redis restarts empty while tasks are parked: places, offers and run
    records are gone, yet every task finishes (copies come back with their tickets), and none
    runs again after it completed. The one exception the design documents (Failures, "Redis
    restarts and loses its data"): the stored copy of the task running at the restart (an
    acks_late task's copy stays until its run finishes) is sent with every other stored copy,
    and if it asks before that run ends, the empty Redis grants it, and the body runs twice at
    once. Seen once in a clean-clone CI run: a second run started 67 ms into a 0.3 s body."""
    key = "handoff-restart"
    results = [send(proj.handoff_faults, 0.3, key) for _ in range(8)]
    wait_until(lambda: proj.probe(key).entries >= 2, timeout=60, what="some tasks ran")
    celery_stack.semaphore.restart()
    for result in results:
        assert result.get(timeout=120) == result.id
    client = proj.probe(key).client
    ends: dict[str, list[float]] = {}
    for entry in client.lrange(f"probe:{key}:ends", 0, -1):
        task_id, at = entry.decode().split()[:2]
        ends.setdefault(task_id, []).append(float(at))
    runs: dict[str, list[float]] = {}
    for task_id, started_at in starts(proj, key):
        runs.setdefault(task_id, []).append(started_at)
    assert sorted(ends) == sorted(r.id for r in results), "every task finished"
    for task_id, started in runs.items():
        # a second run only while the first still ran (the documented window), never after it
        assert len(started) == 1 or (len(started) == 2 and max(started) < min(ends[task_id])), (
            f"{task_id} ran again after it completed: starts {started}, ends {ends[task_id]}"
        )


@pytest.mark.slow
def test_the_releasing_worker_killed_right_after_its_release_delays_nobody(celery_stack: CeleryStack) -> None:
    """The release hands the slot over and tells the waiter in one script: a releasing worker
    SIGKILLed right after it does not delay the next task, which starts long before its countdown."""
    import tests.proj.app as proj

    env = {**celery_stack.env, "PROJ_QUEUE": "handoff-releaser"}
    releaser = Worker(env, name="releaser", concurrency=1, conf=FAULT_CONF).start()
    waiter_env = {**celery_stack.env, "PROJ_QUEUE": "handoff-waiter"}
    waiter = Worker(waiter_env, name="waiter", concurrency=1, conf=FAULT_CONF).start()
    key = "handoff-releaser"
    semaphore = semaphore_for(proj.app, "proj.handoff_faults")
    try:
        first = proj.handoff_faults.apply_async((1.0, key), queue="handoff-releaser")
        wait_until(lambda: proj.probe(key).live == 1, timeout=30, what="the first task holding")
        second = proj.handoff_faults.apply_async((0.1, key), queue="handoff-waiter")
        wait_until(lambda: parked(proj, "proj.handoff_faults", second.id), timeout=30, what="the second parked")
        wait_until(lambda: first.state == "SUCCESS", timeout=30, interval=0.002, what="the first released")
        released_at = time.time()
        releaser.kill()
        assert second.get(timeout=30) == second.id
        started_at = dict(starts(proj, key))[second.id]
        assert started_at - released_at < 2.5, "woken by the release, not by its 4 s countdown"
        wait_until(lambda: semaphore.status().holder_count == 0, timeout=10, what="no slot held")
    finally:
        releaser.kill()
        waiter.stop()


def test_a_parked_backlog_does_not_bounce(proj: Any, workers: list[Worker]) -> None:
    """30 tasks of 0.1 s at limit 1, all waiting outside the worker: each is refused about once
    and then brought back by the hand-off. Their countdown copies are backstops at the countdown's
    upper bound, so none comes back early to be refused again while the line is 3 s long."""
    key = "parked-backlog"
    results = [send(proj.parked_backlog, 0.1, key) for _ in range(30)]
    for result in results:
        assert result.get(timeout=120) == result.id
    text = logs(workers)
    refusals = {r.id: text.count(f"{r.id}] retry: waiting") for r in results}
    # refused on its first delivery only (a copy whose offer lapsed on a loaded machine may be
    # refused once more, at its old place: never bounced again and again)
    assert sum(refusals.values()) <= len(results) + 2, refusals
    assert sorted(refusals.values())[-3] <= 1, refusals
    assert proj.probe(key).maximum == 1
    assert sorted(task_id for task_id, _ in starts(proj, key)) == sorted(r.id for r in results)


@pytest.mark.slow
def test_a_waited_task_whose_process_is_killed_mid_run_runs_from_its_requeued_message(
    celery_stack: CeleryStack,
) -> None:
    """acks_late with reject_on_worker_lost: a task brought back by the hand-off is SIGKILLed in
    its body. The worker gives its slot back before requeueing the message, so the redelivery
    runs it at once, instead of being dropped as the twin of a run whose 30 s lease still looks
    alive (which, with its backstop copy dropped the same way, would lose the task)."""
    import tests.proj.app as proj

    env = {**celery_stack.env, "PROJ_QUEUE": "handoff-requeued"}
    worker = Worker(env, name="requeued", concurrency=2, conf=FAULT_CONF).start()
    key = "requeued"
    client = proj.probe(key).client
    semaphore = semaphore_for(proj.app, "proj.requeued")
    try:
        holder = semaphore.acquire(timeout=5)
        result = proj.requeued.apply_async((1.0, key), queue="handoff-requeued")
        wait_until(lambda: parked(proj, "proj.requeued", result.id), timeout=30, what="the task parked")
        holder.release()
        wait_until(lambda: client.llen(f"probe:{key}:starts") == 1, timeout=30, what="the woken task running")
        _, pid, _ = client.lindex(f"probe:{key}:starts", 0).decode().split()
        killed_at = time.time()
        os.kill(int(pid), signal.SIGKILL)
        assert result.get(timeout=15) == result.id
        (second,) = client.lrange(f"probe:{key}:starts", 1, -1)
        assert float(second.decode().split()[2]) - killed_at < 10, "run again at once, not at a lease's end"
        assert client.llen(f"probe:{key}:ends") == 1
        assert f"released 1 slot(s) of proj.requeued[{result.id}] for a killed child" in worker.log()
    finally:
        worker.kill()
