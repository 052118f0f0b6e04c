"""A waited task's run record says whether a copy of the wait may run the body: these tests
break it the ways operations do (a body longer than the record is remembered, a task id used
again, a body that rejects, a copy past its retries, a copy ignored after a failure), with real
workers on the Redis broker and, where the broker matters, on RabbitMQ.

Their workers remember a run for its copies' longest time away only (``PROJ_SHORT_RUN_MEMORY``
in the test app: 17 s here, not one or two hours), so that a body can outlive its record.
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

from ..celery_stack import CeleryStack
from ..waiting import wait_until
from ..workers import Worker, worker_group
from .test_exactly_once import amqp_worker_group, parked, runs, stored_copies_of

pytestmark = pytest.mark.workers

QUEUE = "run_records"
VISIBILITY_TIMEOUT = 4
# how long the workers remember a run past its grant: a 2 s backstop plus 15 s away (wait_runs)
REMEMBERED_S = 17.0
SHORT_MEMORY = {"PROJ_SHORT_RUN_MEMORY": "1"}

Brokers = tuple[list[Worker], Any, str]


@pytest.fixture(scope="module")
def redis_workers(celery_stack: CeleryStack) -> Iterator[Brokers]:
    conf = {"broker_transport_options": {"visibility_timeout": VISIBILITY_TIMEOUT}}
    env = {**celery_stack.env, **SHORT_MEMORY}
    with worker_group(env, queue=QUEUE, names=("records1",), concurrency=3, conf=conf, kill_at_end=True) as group:
        yield group, None, QUEUE


@pytest.fixture(scope="module")
def rabbitmq_workers(celery_stack: CeleryStack) -> Iterator[Brokers]:
    with amqp_worker_group(celery_stack, names=("records-amqp1",), concurrency=3, env=SHORT_MEMORY) as workers:
        yield workers


@pytest.fixture(params=["redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def brokers(request: pytest.FixtureRequest) -> Brokers:
    """The workers, the app to send with (None: the test app) and the queue, on each broker."""
    workers: Brokers = request.getfixturevalue(f"{request.param}_workers")
    return workers


@pytest.fixture
def proj(celery_stack: CeleryStack) -> Any:
    import tests.proj.app as proj

    return proj


def send(proj: Any, task: Any, args: tuple[Any, ...], brokers: Brokers, **options: Any) -> AsyncResult:
    _, sender, queue = brokers
    if sender is None:
        return task.apply_async(args, queue=queue, **options)
    return sender.send_task(task.name, args, queue=queue, **options)


def starts_of(proj: Any, key: str, task_id: str, which: str = "starts") -> list[float]:
    return [at for run_id, _, at in runs(proj, key, which) if run_id == task_id]


def logged_at(workers: list[Worker], text: str) -> list[float]:
    """When the workers logged a line containing ``text`` (epoch seconds, to the second)."""
    stamps = []
    for worker in workers:
        for line in worker.log().splitlines():
            if text in line and line.startswith("["):
                stamps.append(time.mktime(time.strptime(line[1:20], "%Y-%m-%d %H:%M:%S")))
    return stamps


def test_a_run_longer_than_its_record_is_remembered_runs_once(proj: Any, brokers: Brokers) -> None:
    """A waited body that runs past the time its run's record is remembered from the grant,
    while its backstop copy keeps coming back beside it and a slot is free: the copy is told the
    run is still running every time, and the body runs once. (Before, the record lapsed and the
    copy ran the body a second time beside the first.)"""
    workers = brokers[0]
    key, task = "outlives_its_record", proj.outlives_its_record
    semaphore = semaphore_for(proj.app, task.name)
    holders = [semaphore.acquire(timeout=5) for _ in range(2)]
    body = REMEMBERED_S + 10
    result = send(proj, task, (body, key), brokers)
    wait_until(lambda: parked(proj, task.name, result.id), timeout=30, what="the task parked")
    holders[0].release()  # the wake copy takes this slot and runs the body
    wait_until(lambda: starts_of(proj, key, result.id), timeout=30, what="its body started")
    holders[1].release()  # a free slot for a copy the run's record no longer stops
    assert result.get(timeout=body + 30) == result.id
    started = starts_of(proj, key, result.id)[0]
    looks = logged_at(workers, f"[{result.id}]: another copy of this wait holds the slot")
    assert max(looks, default=0.0) > started + REMEMBERED_S + 1, "a copy came back after the record's first lapse"
    assert len(starts_of(proj, key, result.id)) == 1


@pytest.fixture(params=["redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def empty_queue(request: pytest.FixtureRequest, celery_stack: CeleryStack) -> Iterator[tuple[dict[str, str], Any, str]]:
    """A queue no worker consumes yet, on each broker: the env that starts workers on it, the app
    to send with (None: the test app) and its name."""
    if request.param == "redis":
        queue = f"run_records_{time.time_ns()}"
        yield {**celery_stack.env, "PROJ_QUEUE": queue}, None, queue
        return
    with amqp_worker_group(celery_stack, names=()) as (_, sender, queue):
        yield {**celery_stack.env, "PROJ_BROKER_URL": sender.conf.broker_url, "PROJ_QUEUE": queue}, sender, queue


def test_a_reused_id_whose_first_message_is_redelivered_runs(
    proj: Any, empty_queue: tuple[dict[str, str], Any, str]
) -> None:
    """A fixed task id used again after a first invocation that waited and ran: the second
    invocation's first message is prefetched, handed back by a warm shutdown and delivered again.
    It runs. (Before, its redelivery took the note of the first invocation's wait for its own and
    was dropped as having run.)"""
    env, sender, queue = empty_queue
    key, task_id = "recycled", f"nightly-{time.time_ns()}"
    brokers: Brokers = ([], sender, queue)
    # one pool process and two prefetched messages: a second message waits, reserved, behind a first
    first_worker = Worker(env, name="reused1", concurrency=1, conf={"worker_prefetch_multiplier": 2}).start()
    second_worker = None
    try:
        holder = semaphore_for(proj.app, proj.recycled.name).acquire(timeout=5)
        earlier = send(proj, proj.recycled, (0.1, key), brokers, task_id=task_id)
        wait_until(lambda: parked(proj, proj.recycled.name, task_id), timeout=30, what="the first invocation parked")
        holder.release()
        assert earlier.get(timeout=30) == task_id
        wait_until(lambda: starts_of(proj, key, task_id, "ends"), timeout=10, what="the first invocation ended")
        blocker = f"reused_blocker_{time.time_ns()}"
        send(proj, proj.unlimited, (3, blocker), brokers)  # takes the only pool process
        wait_until(lambda: proj.probe(blocker).client.llen(f"probe:{blocker}:starts"), timeout=30, what="blocked")
        send(proj, proj.recycled, (0.1, key), brokers, task_id=task_id)
        control = (sender or proj.app).control
        wait_until(
            lambda: task_id in str(control.inspect(destination=["reused1@127.0.0.1"], timeout=1).reserved()),
            timeout=30,
            what="the second invocation prefetched",
        )
        # a rolling restart: a new worker, then a warm shutdown of the old one, whose running task
        # ends and whose prefetched message goes back to the broker, flagged redelivered
        second_worker = Worker(env, name="reused2", concurrency=1).start()
        first_worker.stop(timeout=60)
        wait_until(
            lambda: len(starts_of(proj, key, task_id, "ends")) > 1 or "is dropped" in second_worker.log(),
            timeout=60,
            what="the second invocation run or dropped",
        )
        assert "is dropped" not in second_worker.log()
        assert len(starts_of(proj, key, task_id, "ends")) == 2
        assert runs(proj, key, "ends")[-1][1] in second_worker.children()
    finally:
        for worker in (first_worker, second_worker):
            if worker is not None:
                worker.kill()


def finished_run(proj: Any, task: Any, task_id: str) -> bool | None:
    """Whether the run of ``task_id``'s first wait is marked finished (None: no record of it)."""
    records = semaphore_for(proj.app, task.name)
    prefix = f"{task_id}#0#"
    for field, value in records.client.hgetall(records.keys.runs).items():
        run_part = field.decode()[len(prefix) :]
        if field.decode().startswith(prefix) and run_part and "#" not in run_part:
            return bool(value == b"")
    return None


def test_a_requeue_rejected_without_acks_late_finishes_the_run(proj: Any, brokers: Brokers) -> None:
    """A waited task without acks_late raises Reject(requeue=True): Celery acked the message
    before the body, so the reject hands nothing back and Celery would not run it again. The run
    is marked finished, and the wait's backstop copy (RabbitMQ keeps it; the Redis broker
    withdrew it as the run began) does not run the body again. (Before, the run was left
    unfinished and the backstop copy ran the body a second time.)"""
    key, task = "rejects_after_its_ack", proj.rejects_after_its_ack
    holder = semaphore_for(proj.app, task.name).acquire(timeout=5)
    result = send(proj, task, (0.1, key), brokers)
    wait_until(lambda: parked(proj, task.name, result.id), timeout=30, what="the task parked")
    holder.release()
    wait_until(lambda: starts_of(proj, key, result.id, "ends"), timeout=30, what="its body ended, rejecting")
    finished_then_no_copy_runs(proj, brokers, task, key, result.id)


def finished_then_no_copy_runs(proj: Any, brokers: Brokers, task: Any, key: str, task_id: str) -> None:
    """The run of ``task_id``'s wait is marked finished, and its backstop copy does not run the body
    again: on RabbitMQ it comes (2 s after the wait began, or a lease + 1 s after it last found
    the run running) and is dropped; the Redis broker withdraws it (as the run began, without
    acks_late, or as it was marked finished), or one moved already comes and is dropped."""
    wait_until(lambda: finished_run(proj, task, task_id), timeout=15, what="its run marked finished")
    if brokers[1] is None:
        wait_until(lambda: not stored_copies_of(proj, task_id), timeout=10, what="no copy left in the broker's Redis")
        # a copy moved before the withdrawal would start the body within its lease (5 s) + 1 s,
        # plus the mover's second: watched that long
        with pytest.raises(AssertionError, match="timed out"):
            wait_until(lambda: len(starts_of(proj, key, task_id)) > 1, timeout=8, interval=0.1, what="a second start")
    else:
        dropped = f"[{task_id}]: another copy of this wait has run; this copy is dropped"
        # The copy that comes after the run is dropped: the backstop copy, or the wake copy where
        # the backstop copy came first (a loaded machine: it is due 2 s after the wait began) and
        # ran the body itself; then no copy may be left to come at all. Watched until a copy is
        # dropped, or for the test tasks' lease (at most 5 s, a copy finding its twin running
        # looks again after it) and a backstop, twice over.
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: any(dropped in worker.log() for worker in brokers[0]) or len(starts_of(proj, key, task_id)) > 1,
                timeout=20,
                what="a later copy dropped, or run",
            )
    assert len(starts_of(proj, key, task_id)) == 1


def test_a_child_lost_past_its_retries_is_not_run_again(proj: Any, brokers: Brokers) -> None:
    """A waited task with acks_late, reject_on_worker_lost and retry_on_worker_lost but no retry
    left (max_retries 0) whose pool process is SIGKILLed mid-run: Celery records the failure and
    acks, requeuing nothing. Its run is marked finished, and no copy of its wait runs the body
    again. (Before, the run was left unfinished as if Celery requeued the message, and the
    backstop copy ran the body a second time.)"""
    key, task = "lost_past_its_retries", proj.lost_past_its_retries
    holder = semaphore_for(proj.app, task.name).acquire(timeout=5)
    result = send(proj, task, (30, key), brokers)
    wait_until(lambda: parked(proj, task.name, result.id), timeout=30, what="the task parked")
    holder.release()
    wait_until(lambda: starts_of(proj, key, result.id), timeout=30, what="its body started")
    ((_, pid, _),) = [run for run in runs(proj, key) if run[0] == result.id]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(Exception, match=r"(?i)worker|lost|signal"):
        result.get(timeout=30)
    finished_then_no_copy_runs(proj, brokers, task, key, result.id)


def test_a_failed_task_stays_failed_when_a_later_copy_is_dropped(proj: Any, brokers: Brokers) -> None:
    """Under track_started, a waited task fails, and a later copy of its run (the message,
    delivered again after its pool process died past the outcome) is dropped as having run: the
    task stays FAILURE. (Before, Celery's tracer stored STARTED for the dropped copy, over the
    FAILURE, for good.)"""
    key, task = "fails_then_lost", proj.fails_then_lost
    holder = semaphore_for(proj.app, task.name).acquire(timeout=5)
    result = send(proj, task, (0.1, key), brokers)
    wait_until(lambda: parked(proj, task.name, result.id), timeout=30, what="the task parked")
    holder.release()
    dropped = f"[{result.id}]: another copy of this wait has run; this copy is dropped"
    wait_until(
        lambda: any(dropped in worker.log() for worker in brokers[0]),
        timeout=30,
        what="the message delivered again and dropped",
    )
    assert result.state == "FAILURE"
    assert len(starts_of(proj, key, result.id)) == 1


def test_a_tracked_task_is_started_while_its_body_runs(proj: Any, redis_workers: Brokers) -> None:
    """Under track_started the task stores STARTED itself as its body begins (the tracer no
    longer does, for every delivery): a running body reads STARTED, with its process id."""
    key, task = "fails_then_lost", proj.fails_then_lost
    result = send(proj, task, (5, key), redis_workers)
    wait_until(lambda: starts_of(proj, key, result.id), timeout=30, what="its body started")
    ((_, pid, _),) = [run for run in runs(proj, key) if run[0] == result.id]
    assert result.state == "STARTED"
    assert result.info["pid"] == pid
    # it did not wait, so it names no run: killed past its outcome, it runs again, and fails again
    wait_until(lambda: len(starts_of(proj, key, result.id, "ends")) > 1, timeout=30, what="its second end")


def finished_marks(proj: Any, task_id: str) -> list[float]:
    """Until when the broker's Redis remembers each run of ``task_id`` as finished (ms)."""
    store = due_copies_for(proj.app)
    assert store is not None
    marks = store.client.zrange(store.keys[3], 0, -1, withscores=True)
    return [score for run, score in marks if run.startswith(task_id.encode())]


def test_a_run_without_acks_late_is_remembered_at_its_grant_and_a_short_one_ends_without_a_word(
    proj: Any, redis_workers: Brokers
) -> None:
    """Without acks_late a waited run counts as finished from its grant (Celery runs it at most
    once): the round trip that asks the broker's Redis at the grant also tells it so, for the
    run's memory and a tenth more (45 s and 4.5 s for this task). A body shorter than that tenth
    ends with nothing more to tell the broker: its mark stays as its grant set it. A longer one
    sets it again at its end, so that every run is remembered its whole memory after its end."""
    key = "remembered_at_grant"
    semaphore = semaphore_for(proj.app, proj.sleepy.name)
    holder = semaphore.acquire(timeout=5)
    try:
        short = send(proj, proj.sleepy, (0.3, key), redis_workers)
        long = send(proj, proj.sleepy, (6.0, key), redis_workers)
        for result in (short, long):
            wait_until(lambda r=result: parked(proj, proj.sleepy.name, r.id), timeout=30, what="both tasks in line")
        assert finished_marks(proj, short.id) == [] and finished_marks(proj, long.id) == []
    finally:
        holder.release()
    (at_grant,) = wait_until(lambda: finished_marks(proj, short.id), timeout=30, what="the short run marked")
    assert at_grant / 1000 - time.time() > REMEMBERED_S, "remembered its memory and more from its grant"
    (at_long_grant,) = wait_until(lambda: finished_marks(proj, long.id), timeout=30, what="the long run marked")
    assert long.get(timeout=30) == "woke"
    # its grant's mark ends 49.5 s after its grant; its end's (task_postrun, just after the
    # result is stored), 45 s after its end, 6 s later
    wait_until(lambda: finished_marks(proj, long.id) != [at_long_grant], timeout=10, what="the long run marked again")
    (at_end,) = finished_marks(proj, long.id)
    assert at_end > at_long_grant + 1000
    assert finished_marks(proj, short.id) == [at_grant], "the short run's end told the broker nothing"
