"""A task that waited runs exactly once, whatever happens to its workers (real workers, Redis broker).

Each test makes a task wait for its slot (refused, parked, woken by the release), so that it
exists in several copies (its wake copy, its backstop copy, a broker's redelivery), then does
to it what production does: kills its worker, rejects its message, SIGKILLs its child, reuses
its id. What Celery promises decides the outcome: with ``acks_late`` a message is delivered
at least once (the task must complete, once); without it at most once (the body must never
run twice).
"""

from __future__ import annotations

import contextlib
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

pytestmark = pytest.mark.workers

QUEUE = "once"
# a worker SIGKILLed with unacked messages: the Redis broker gives them to another worker after this
VISIBILITY_TIMEOUT = 4


@pytest.fixture(scope="module")
def workers(celery_stack: CeleryStack) -> Iterator[list[Worker]]:
    conf = {"broker_transport_options": {"visibility_timeout": VISIBILITY_TIMEOUT}}
    with worker_group(
        celery_stack.env, queue=QUEUE, names=("once1", "once2"), concurrency=2, conf=conf, kill_at_end=True
    ) as group:
        yield group


@pytest.fixture
def proj(celery_stack: CeleryStack, workers: list[Worker]) -> Any:
    import tests.proj.app as proj

    return proj


def runs(proj: Any, key: str, which: str = "starts") -> list[tuple[str, int, float]]:
    """(task id, process id, time) of each body start (or end) recorded under ``key``."""
    entries = proj.probe(key).client.lrange(f"probe:{key}:{which}", 0, -1)
    return [(task_id.decode(), int(pid), float(at)) for task_id, pid, at in (entry.split() for entry in entries)]


def parked(proj: Any, semaphore_key: str, task_id: str) -> bool:
    waiter = waiter_key(task_id)  # the id a task stands in line under
    return any(w.waiter == waiter and w.present for w in semaphore_for(proj.app, semaphore_key).status().waiters)


def waited_then_started(
    proj: Any,
    task: Any,
    key: str,
    *args: Any,
    task_id: str | None = None,
    workers: list[Worker] | None = None,
    sender: Any = None,
    queue: str = QUEUE,
) -> AsyncResult:
    """Send ``task`` while its only slot is held, so that it parks; release; wait for its body.
    ``sender``: the app to send with (another broker's), else the test app."""
    holder = semaphore_for(proj.app, task.name).acquire(timeout=5)
    if sender is None:
        result = task.apply_async(args, queue=queue, task_id=task_id)
    else:
        result = sender.send_task(task.name, args, queue=queue, task_id=task_id)
    wait_until(lambda: parked(proj, task.name, result.id), timeout=30, what="the task parked")
    before = len([run for run in runs(proj, key) if run[0] == result.id])
    holder.release()
    try:
        wait_until(
            lambda: len([run for run in runs(proj, key) if run[0] == result.id]) > before,
            timeout=30,
            what="its body started",
        )
    except AssertionError:
        print("".join(worker.log() for worker in workers or []))
        raise
    return result


def worker_of(workers: list[Worker], pid: int) -> Worker:
    return next(worker for worker in workers if pid in worker.children())


def test_a_whole_worker_killed_mid_run_with_acks_late_loses_nothing(proj: Any, workers: list[Worker]) -> None:
    """The redelivered copy finds the dead holder's lease (15 s) still live. It must not be
    dropped as a duplicate: it waits until the lease lapses, then runs the task, once more."""
    whole_worker_killed(proj, workers)


def whole_worker_killed(proj: Any, workers: list[Worker], sender: Any = None, queue: str = QUEUE) -> None:
    key = "long_acks_late"
    before = len(runs(proj, key, "ends"))
    result = waited_then_started(proj, proj.long_acks_late, key, 60, workers=workers, sender=sender, queue=queue)
    ((_, pid, _),) = [run for run in runs(proj, key) if run[0] == result.id]
    victim = worker_of(workers, pid)
    victim.kill()  # the whole worker: no parent is left to give the slot back
    survivors = [worker for worker in workers if worker is not victim]
    try:
        assert result.get(timeout=60) == result.id
        starts = [run for run in runs(proj, key) if run[0] == result.id]
        ends = [run for run in runs(proj, key, "ends")[before:] if run[0] == result.id]
        assert len(starts) == 2, "killed once, run once more"
        assert len(ends) == 1
        assert ends[0][1] != pid
    finally:
        workers[:] = [
            *survivors,
            victim.__class__(victim.env, name=victim.name, concurrency=victim.concurrency).start(),
        ]


def test_a_body_that_rejects_with_requeue_runs_again(proj: Any, workers: list[Worker]) -> None:
    """Reject(requeue=True) hands the message back: the requeued delivery is no duplicate of a
    finished run, and completes."""
    rejected_then_requeued(proj, workers)


def rejected_then_requeued(proj: Any, workers: list[Worker], sender: Any = None, queue: str = QUEUE) -> None:
    key = "reject_once"
    result = waited_then_started(proj, proj.reject_once, key, 0.1, workers=workers, sender=sender, queue=queue)
    assert result.get(timeout=30) == result.id
    assert [run[0] for run in runs(proj, key, "ends")].count(result.id) == 2


@pytest.fixture(scope="module")
def amqp_workers(celery_stack: CeleryStack) -> Iterator[tuple[list[Worker], Any, str]]:
    """Two workers on RabbitMQ (which redelivers a dead worker's unacked messages at once), the
    app to send with, and their queue (deleted at the end)."""
    with amqp_worker_group(celery_stack, names=("once-amqp1", "once-amqp2")) as workers:
        yield workers


@contextlib.contextmanager
def amqp_worker_group(
    celery_stack: CeleryStack, *, names: tuple[str, ...], concurrency: int = 2, env: dict[str, str] | None = None
) -> Iterator[tuple[list[Worker], Any, str]]:
    """Workers of the test app on RabbitMQ (skipped where none answers), the app to send with, and
    their queue (deleted at the end)."""
    from celery import Celery
    from kombu import Connection

    from ..operations.test_rabbitmq import amqp_url_or_skip

    url = amqp_url_or_skip()
    queue = f"celery-semaphore-once-{time.time_ns()}"
    env = {**celery_stack.env, **(env or {}), "PROJ_BROKER_URL": url}
    sender = Celery("sender", broker=url, backend=celery_stack.env["PROJ_RESULT_URL"], set_as_current=False)
    with worker_group(env, queue=queue, names=names, concurrency=concurrency, kill_at_end=True) as group:
        yield group, sender, queue
    with Connection(url) as connection:
        channel = connection.channel()
        for name in (queue, f"{queue}.semaphore-wake", f"{queue}.semaphore-backstop"):
            channel.queue_delete(name)


@pytest.mark.rabbitmq
def test_a_whole_worker_killed_mid_run_loses_nothing_on_rabbitmq(
    proj: Any,
    amqp_workers: tuple[list[Worker], Any, str],
) -> None:
    """RabbitMQ redelivers the dead worker's message at once, long before the dead run's 15 s
    lease lapses: the copy waits for the lapse, then runs the task."""
    workers, sender, queue = amqp_workers
    whole_worker_killed(proj, workers, sender, queue)


@pytest.mark.rabbitmq
def test_a_whole_worker_killed_mid_run_without_acks_late_never_runs_twice_on_rabbitmq(
    proj: Any,
    amqp_workers: tuple[list[Worker], Any, str],
) -> None:
    """On RabbitMQ a waited task's backstop copy is held by some worker's main process until it
    is due, and cannot be withdrawn there: without acks_late, once the dead run's lease lapsed,
    that copy took the run over and ran the task a second time. Celery runs it at most once;
    the run is marked finished as it begins, so any later copy of the wait is dropped."""
    workers, sender, queue = amqp_workers
    key = "at_most_once_whole_amqp"
    result = waited_then_started(
        proj, proj.at_most_once_whole, key, 60, key, workers=workers, sender=sender, queue=queue
    )
    ((_, pid, _),) = runs(proj, key)
    victim = worker_of(workers, pid)
    victim.kill()
    survivors = [worker for worker in workers if worker is not victim]
    try:
        semaphore = semaphore_for(proj.app, "proj.at_most_once_whole")
        wait_until(lambda: semaphore.status().holder_count == 0, timeout=30, what="the dead run's slot back")
        # a held copy is due 2 s after its twin's lease (5 s) lapsed: watched well past that
        with pytest.raises(AssertionError, match="timed out"):
            wait_until(lambda: len(runs(proj, key)) > 1, timeout=15, interval=0.1, what="a second start")
        assert [run[0] for run in runs(proj, key)] == [result.id]
    finally:
        workers[:] = [
            *survivors,
            victim.__class__(victim.env, name=victim.name, concurrency=victim.concurrency).start(),
        ]


@pytest.mark.rabbitmq
def test_a_body_that_rejects_with_requeue_runs_again_on_rabbitmq(
    proj: Any,
    amqp_workers: tuple[list[Worker], Any, str],
) -> None:
    """RabbitMQ requeues the rejected message at once: that delivery runs the task."""
    workers, sender, queue = amqp_workers
    rejected_then_requeued(proj, workers, sender, queue)


def test_a_child_killed_mid_run_without_acks_late_never_runs_twice(proj: Any, workers: list[Worker]) -> None:
    """Without acks_late Celery records WorkerLostError and delivers the task no more; the
    backstop copy (4 s) of the wait arrives later and must be dropped, not run the body again."""
    key = "at_most_once"
    result = waited_then_started(proj, proj.at_most_once, key, 30)
    ((_, pid, _),) = runs(proj, key)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(Exception, match=r"(?i)worker|lost|signal"):
        result.get(timeout=30)
    # the backstop copy was withdrawn as the run began (Celery runs it at most once): none is
    # left in the broker to run the body again
    assert not stored_copies_of(proj, result.id)
    assert [run[0] for run in runs(proj, key)] == [result.id]


def stored_copies_of(proj: Any, task_id: str) -> list[bytes]:
    """The runs of ``task_id`` with a copy kept in the broker's Redis (due_copies.py)."""
    store = due_copies_for(proj.app)
    assert store is not None
    return [run for run in store.client.hkeys(store.keys[1]) if run.startswith(task_id.encode())]


def test_a_whole_worker_killed_mid_run_without_acks_late_never_runs_twice(proj: Any, workers: list[Worker]) -> None:
    """A task without acks_late that waited and is running when its whole worker is
    SIGKILLed (an OOM kill of the main process, a lost node) ran again once its lease lapsed:
    its backstop copy took the dead run over. Celery would run it at most once. Now the stored
    copy is withdrawn as the run begins: the lease lapses, the slot comes back, and nothing is
    left that could run the task again."""
    key = "at_most_once_whole"
    result = waited_then_started(proj, proj.at_most_once_whole, key, 60, workers=workers)
    ((_, pid, _),) = runs(proj, key)
    victim = worker_of(workers, pid)
    assert not stored_copies_of(proj, result.id)
    victim.kill()
    survivors = [worker for worker in workers if worker is not victim]
    try:
        semaphore = semaphore_for(proj.app, "proj.at_most_once_whole")
        # the lease (5 s) lapses: the slot is free, nobody of this task waits or is stored
        wait_until(lambda: semaphore.status().holder_count == 0, timeout=30, what="the dead run's slot back")
        assert not any(waiter.waiter == waiter_key(result.id) for waiter in semaphore.status().waiters)
        assert not stored_copies_of(proj, result.id)
        # Any copy left would start the body again by the time its twin's lease lapsed, plus its
        # backstop (2 s), plus a dead holder's redelivery (visibility timeout and the restore
        # sweep): watched that long (before, a backstop copy took the dead run over here)
        watch = 5 + 2 + VISIBILITY_TIMEOUT + 10
        with pytest.raises(AssertionError, match="timed out"):
            wait_until(lambda: len(runs(proj, key)) > 1, timeout=watch, interval=0.1, what="a second start")
        assert [run[0] for run in runs(proj, key)] == [result.id]
    finally:
        workers[:] = [
            *survivors,
            victim.__class__(victim.env, name=victim.name, concurrency=victim.concurrency).start(),
        ]


def test_a_process_killed_after_the_body_and_before_the_outcome_loses_nothing(proj: Any, workers: list[Worker]) -> None:
    """A waited task (acks_late, reject_on_worker_lost) whose pool process is SIGKILLed after the
    body returned and before Celery stored the result: Celery delivers it again, and that copy
    runs it (at least once, as acks_late promises), so it succeeds. Before, the slot went back
    with the run marked finished before Celery stored the outcome: the copy was dropped as
    "another copy of this wait has run" and the task stayed RETRY for good (the full chaos test
    lost 1 task of 300 so, seed 3)."""
    key = "killed_before_its_outcome"
    result = waited_then_started(proj, proj.killed_before_its_outcome, key, 0.1, workers=workers)
    assert result.get(timeout=30) == result.id
    ends = [run for run in runs(proj, key, "ends") if run[0] == result.id]
    assert len(ends) == 2, "the body ran, its process was killed before the outcome, and it ran once more"


def test_a_reused_task_id_runs_each_time(proj: Any, workers: list[Worker]) -> None:
    """A fixed id ("run once a night") used twice, both invocations having waited: each runs."""
    key = "recycled"
    task_id = f"nightly-{time.time_ns()}"
    first = waited_then_started(proj, proj.recycled, key, 0.1, task_id=task_id, workers=workers)
    assert first.get(timeout=30) == task_id
    second = waited_then_started(proj, proj.recycled, key, 0.1, task_id=task_id, workers=workers)
    assert second.get(timeout=30) == task_id
    # the key's probe may hold other tests' runs: count this id's
    wait_until(
        lambda: [run[0] for run in runs(proj, key, "ends")].count(task_id) >= 2, timeout=10, what="both runs ended"
    )
    assert [run[0] for run in runs(proj, key, "ends")].count(task_id) == 2


@pytest.mark.parametrize("task_id", ["!bang", "*3*star", "~tilde"])
def test_task_ids_that_look_like_markers_wait_and_run(proj: Any, workers: list[Worker], task_id: str) -> None:
    """Ids starting with the marks of an offer or a weighted waiter wait and run like any other."""
    key = "recycled"
    unique = f"{task_id}-{time.time_ns()}"
    result = waited_then_started(proj, proj.recycled, key, 0.1, task_id=unique, workers=workers)
    assert result.get(timeout=30) == unique


@pytest.mark.parametrize("prefix", ["csem_", "semaphore_"])
def test_wait_headers_not_ours_are_ignored_with_a_warning(proj: Any, workers: list[Worker], prefix: str) -> None:
    """A message whose semaphore headers do not parse starts a fresh wait: it runs, it does not
    fail, and it takes no place it did not earn. The headers are read under their names of an
    earlier release too (``semaphore_``), or this test would see no warning with those."""
    key = "recycled"
    result = proj.recycled.apply_async(
        (0.1,),
        queue=QUEUE,
        headers={
            f"{prefix}first_refused": "x",
            f"{prefix}wait_of_retry": 0,
            f"{prefix}waits": 1,
            f"{prefix}ticket": "not a ticket",
        },
    )
    assert result.get(timeout=30) == result.id
    assert any(f"{result.id}]: ignoring wait headers" in worker.log() for worker in workers)
    assert result.id in [run[0] for run in runs(proj, key, "ends")]


def test_a_redelivered_first_message_does_not_rerun_a_success_the_redis_forgot(
    celery_stack: CeleryStack, proj: Any
) -> None:
    """A refused first delivery sends the copy of its wait; its worker dies before the ack; the
    semaphore's Redis restarts empty (the note that tied the message to its wait is gone). The
    copy runs the task; the broker then delivers the first message again (acks_late), which
    looks like a new wait to Redis. It must find the task's success in the result backend (its
    message's send stamp says the success is its own) and be dropped, not run the body twice."""
    key, queue = "dies_at_first_refusal", "once_refusal"
    # the first message comes back after 12 s, well after the copy (2 s backstop) has run; a
    # prefetch of one leaves the copy in the queue while the first message is unacked
    conf = {
        "broker_transport_options": {
            "visibility_timeout": 12,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        "worker_prefetch_multiplier": 1,
    }
    env = {**celery_stack.env, "PROJ_QUEUE": queue}
    first = Worker(env, name="refusal1", concurrency=1, conf=conf).start()
    second = None
    try:
        semaphore_for(proj.app, proj.dies_at_first_refusal.name).acquire(timeout=5)  # the task is refused
        # sent by name, as it is: a first message that its worker refuses (placed at send, the
        # task would have no first message to deliver again)
        result = proj.app.send_task(proj.dies_at_first_refusal.name, queue=queue)
        assert first.process is not None
        wait_until(
            lambda: first.process is not None and first.process.poll() is not None,
            timeout=30,
            what="the worker killed at the task's first refusal",
        )
        celery_stack.semaphore.restart()  # the note of the wait and the slot held above are gone
        second = Worker(env, name="refusal2", concurrency=1, conf=conf).start()
        assert result.get(timeout=30) == result.id, second.log()  # the copy of the wait ran the task
        # the only other message of the task is its first one (the wake copy went with the Redis)
        wait_until(
            lambda: "the task has run already" in second.log() or len(runs(proj, key, "ends")) > 1,
            timeout=40,
            what="the first message delivered again, and dropped or run",
        )
        assert [run[0] for run in runs(proj, key, "ends")] == [result.id], second.log()
    finally:
        for worker in (first, second):
            if worker is not None:
                worker.kill()


def test_a_cold_shutdown_mid_run_with_acks_late_runs_the_task_once_more(proj: Any, workers: list[Worker]) -> None:
    """A cold shutdown (SIGQUIT: the pool's children get SIGTERM, the body is cut short by
    SystemExit) of the worker running a task that had waited: the run is given back unfinished,
    the broker delivers the message again (acks_late), and another worker runs the task once
    more, to its end; no slot is left held."""
    key = "long_acks_late"
    before = len(runs(proj, key, "ends"))
    result = waited_then_started(proj, proj.long_acks_late, key, 60, workers=workers)
    ((_, pid, _),) = [run for run in runs(proj, key) if run[0] == result.id]
    victim = worker_of(workers, pid)
    assert victim.process is not None
    os.kill(victim.process.pid, signal.SIGQUIT)
    victim.wait_exit(timeout=60)
    survivors = [worker for worker in workers if worker is not victim]
    try:
        assert result.get(timeout=60) == result.id
        starts = [run for run in runs(proj, key) if run[0] == result.id]
        ends = [run for run in runs(proj, key, "ends")[before:] if run[0] == result.id]
        assert len(starts) == 2, "cut short once, run once more"
        assert len(ends) == 1 and ends[0][1] != pid
        semaphore = semaphore_for(proj.app, proj.long_acks_late.name)
        wait_until(lambda: semaphore.status().holder_count == 0, timeout=30, what="no slot left held")
    finally:
        workers[:] = [
            *survivors,
            victim.__class__(victim.env, name=victim.name, concurrency=victim.concurrency).start(),
        ]
