"""Wake queues declared like the queue they serve, with real workers.

A refused task parks and is sent again, the moment a release hands it the slot, to
``<queue>.semaphore-wake``. Each test here lets such a task wait with a 30 s backstop countdown
and checks that it starts within 2.5 s of the release: through its wake queue, which must exist,
be consumed, and be declared the same way by the worker and by the process sending the wake copy.

- RabbitMQ quorum queues: the wake queue of a quorum queue is a quorum queue, on both sides.
- ``add_consumer``: a queue a running worker starts to consume brings its wake queue along.
- ``task_create_missing_queues=False``: the wake queue needs no entry in ``task_queues``.
- Backstop copies wait in ``<queue>.semaphore-backstop`` until due, held by a worker's main
  process, and then reach the queue; a quorum queue's backstop queue is a quorum queue.
- ``self.retry(queue=...)``: the retry's own wait comes back to the retry's queue.

The RabbitMQ cases need CELERY_SEMAPHORE_TEST_AMQP_URL (they are skipped, with the reason,
without it); they use queues named for this run and delete them at the end.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from celery_semaphore import semaphore_for

from ..celery_stack import CeleryStack
from ..operations.test_rabbitmq import amqp_url_or_skip
from ..waiting import wait_until
from ..workers import Worker
from .test_celery_handoff import parked, starts

# real `celery worker` processes: `pytest -m "not workers"` leaves these out
pytestmark = pytest.mark.workers

WAKE = ".semaphore-wake"
BACKSTOP_QUEUE = ".semaphore-backstop"
# proj.handoff, but waiting 30 s for its backstop copy: a start within 2.5 s is the wake copy's
BACKSTOP = {"task_annotations": {"proj.handoff": {"semaphore_countdown": 30}}}
WOKEN_WITHIN_S = 2.5


@pytest.fixture(params=["redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def broker(request: pytest.FixtureRequest, celery_stack: CeleryStack) -> Iterator[Broker]:
    """The broker of one test: the run's throwaway Redis, or the RabbitMQ server (shared)."""
    if request.param == "redis":
        yield Broker(celery_stack.env["PROJ_BROKER_URL"])
        return
    broker = Broker(amqp_url_or_skip())
    try:
        yield broker
    finally:
        broker.delete_queues()


class Broker:
    """A broker URL, and the queue names a test made there (so RabbitMQ's can be deleted)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.names: list[str] = []

    def queue(self, role: str) -> str:
        name = f"celery-semaphore-wq-{role}-{uuid.uuid4().hex[:8]}"
        self.names.append(name)
        return name

    def delete_queues(self) -> None:
        """Every queue and exchange a worker or a sender may have declared for our queues (the
        old code gave each wake queue an exchange of its own)."""
        with Connection(self.url) as connection:
            for name in self.names:
                for delete in ("queue_delete", "exchange_delete"):
                    for entity in (name, name + WAKE, name + BACKSTOP_QUEUE):
                        with contextlib.suppress(Exception):
                            getattr(connection.channel(), delete)(entity)


def sender_app(celery_stack: CeleryStack, broker: Broker, conf: dict[str, Any]) -> Celery:
    """A client app on ``broker`` with the workers' queue settings (a queue must be declared alike
    by everyone: a quorum queue by its senders too)."""
    app = Celery("sender", broker=broker.url, backend=celery_stack.env["PROJ_RESULT_URL"], set_as_current=False)
    app.conf.update(conf)
    return app


def worker(celery_stack: CeleryStack, broker: Broker, queue: str, name: str, conf: dict[str, Any]) -> Worker:
    env = {**celery_stack.env, "PROJ_BROKER_URL": broker.url, "PROJ_QUEUE": queue}
    return Worker(env, name=f"{name}-{uuid.uuid4().hex[:6]}", concurrency=2, conf={**BACKSTOP, **conf}).start()


def assert_woken_by_the_release(proj: Any, sender: Celery, queue: str, workers: list[Worker]) -> None:
    """Hold proj.handoff's one slot, send a task to ``queue``, wait until it parked, release:
    it must start within WOKEN_WITHIN_S (its backstop copy would take 30 s)."""
    key = f"wq-{uuid.uuid4().hex[:8]}"
    holder = semaphore_for(proj.app, "proj.handoff").acquire(timeout=5)
    try:
        result = sender.send_task("proj.handoff", (0.1, key), queue=queue)
        wait_until(lambda: parked(proj, "proj.handoff", result.id), timeout=30, what="the task parked")
    finally:
        released_at = time.time()
        holder.release()
    try:
        wait_until(lambda: starts(proj, key), timeout=10, what="the parked task to start (its backstop is 30 s)")
    except AssertionError:
        raise AssertionError("not woken by the release; worker logs:\n" + logs(workers)[-6000:]) from None
    ((task_id, started_at),) = starts(proj, key)
    assert task_id == result.id
    assert started_at - released_at < WOKEN_WITHIN_S, "woken by the release, not by its backstop countdown"
    assert result.get(timeout=30) == result.id


def logs(workers: list[Worker]) -> str:
    return "".join(worker.log() for worker in workers)


@pytest.mark.rabbitmq
@pytest.mark.parametrize("missing_queue_type", ["classic", "quorum"])
def test_a_parked_task_of_a_quorum_queue_is_woken(celery_stack: CeleryStack, missing_queue_type: str) -> None:
    """With ``task_default_queue_type="quorum"`` the wake queue is a quorum queue, declared so by
    the worker and by the pool process sending the wake copy, whatever Celery would make of a
    queue it does not know (``task_create_missing_queue_type``): no PRECONDITION_FAILED, and the
    parked task starts within 2.5 s of the release."""
    import tests.proj.app as proj

    broker = Broker(amqp_url_or_skip())
    queue = broker.queue("quorum")
    conf = {"task_default_queue_type": "quorum", "task_create_missing_queue_type": missing_queue_type}
    workers: list[Worker] = []
    try:
        workers.append(worker(celery_stack, broker, queue, "quorum", conf))
        sender = sender_app(celery_stack, broker, {**conf, "task_default_queue": queue})
        assert_woken_by_the_release(proj, sender, queue, workers)
        assert "inequivalent arg" not in logs(workers)
        with Connection(broker.url) as connection:  # RabbitMQ refuses this if the wake queue is not a quorum one
            _, _, consumers = connection.channel().queue_declare(
                queue + WAKE, durable=True, auto_delete=False, arguments={"x-queue-type": "quorum"}
            )
            assert consumers >= 1
    finally:
        for started in workers:
            started.stop()
        broker.delete_queues()


def test_a_queue_added_by_add_consumer_brings_its_wake_queue(celery_stack: CeleryStack, broker: Broker) -> None:
    """``add_consumer`` on a running worker: it consumes the new queue's wake queue too, so a task
    of that queue, parked, starts within 2.5 s of the release; ``cancel_consumer`` drops both."""
    import tests.proj.app as proj

    first, added = broker.queue("first"), broker.queue("added")
    workers = [worker(celery_stack, broker, first, "added", {})]
    try:
        sender = sender_app(celery_stack, broker, {"task_default_queue": first})
        destination = [f"{workers[0].name}@127.0.0.1"]
        replies = sender.control.add_consumer(added, destination=destination, reply=True, timeout=10)
        assert replies, "the worker answered add_consumer"
        wait_until(
            lambda: f"Started consuming from {added}" in logs(workers), timeout=30, what=f"the worker consuming {added}"
        )
        assert_woken_by_the_release(proj, sender, added, workers)

        sender.control.cancel_consumer(added, destination=destination, reply=True, timeout=10)

        def consumed() -> set[str]:
            (reply,) = sender.control.inspect(destination=destination, timeout=10).active_queues().values()
            return {queue["name"] for queue in reply}

        wait_until(lambda: not {added, added + WAKE} & consumed(), timeout=30, what="both queues cancelled")
        assert {first, first + WAKE} <= consumed()
    finally:
        for started in workers:
            started.stop()


def test_wake_copies_need_no_missing_queues(celery_stack: CeleryStack, broker: Broker) -> None:
    """``task_create_missing_queues=False`` with the queue in ``task_queues`` (and no wake queue
    there): the pool process still routes the wake copy, to a wake queue declared like its queue."""
    import tests.proj.app as proj

    queue = broker.queue("declared")
    conf = {
        "task_create_missing_queues": False,
        "task_queues": {queue: {"exchange": queue, "exchange_type": "direct", "routing_key": queue}},
    }
    workers = [worker(celery_stack, broker, queue, "declared", conf)]
    try:
        sender = sender_app(celery_stack, broker, {**conf, "task_default_queue": queue})
        assert_woken_by_the_release(proj, sender, queue, workers)
        assert "missing from task_queues" not in logs(workers)
    finally:
        for started in workers:
            started.stop()


def test_a_backstop_copy_comes_back_when_due(celery_stack: CeleryStack, broker: Broker) -> None:
    """A parked task that is never woken (its slot stays held) comes back through its backstop
    copy when it is due (3 s here), not before: on RabbitMQ sent at once to
    ``<queue>.semaphore-backstop`` and held by the worker's main process (the test checks that
    queue and its consumer), on the Redis broker as a countdown message."""
    backstop_copy_waits_until_due(celery_stack, broker, "classic")


@pytest.mark.rabbitmq
def test_a_backstop_copy_of_a_quorum_queue_waits_in_a_quorum_backstop_queue(celery_stack: CeleryStack) -> None:
    """The same with ``task_default_queue_type="quorum"``: the backstop queue is a quorum queue
    (RabbitMQ refuses the declaration below otherwise), and its copies are not held in the
    workers' prefetch windows, whose size quorum queues fix."""
    broker = Broker(amqp_url_or_skip())
    try:
        backstop_copy_waits_until_due(celery_stack, broker, "quorum")
    finally:
        broker.delete_queues()


def backstop_copy_waits_until_due(celery_stack: CeleryStack, broker: Broker, queue_type: str) -> None:
    import tests.proj.app as proj

    queue = broker.queue(f"backstop-{queue_type}")
    conf: dict[str, Any] = {"task_annotations": {"proj.handoff": {"semaphore_countdown": 3}}}
    if queue_type == "quorum":
        conf["task_default_queue_type"] = "quorum"
    env = {**celery_stack.env, "PROJ_BROKER_URL": broker.url, "PROJ_QUEUE": queue}
    workers = [Worker(env, name=f"backstop-{uuid.uuid4().hex[:6]}", concurrency=2, conf=conf).start()]
    holder = semaphore_for(proj.app, "proj.handoff").acquire(timeout=5)
    try:
        sender = sender_app(celery_stack, broker, {**conf, "task_default_queue": queue})
        result = sender.send_task("proj.handoff", (0.1, f"backstop-{uuid.uuid4().hex[:8]}"), queue=queue)
        refused = f"proj.handoff[{result.id}] retry: waiting for a slot"
        wait_until(lambda: parked(proj, "proj.handoff", result.id), timeout=30, what="the task parked")
        parked_at = time.time()
        wait_until(
            lambda: logs(workers).count(refused) >= 2,
            timeout=15,
            interval=0.05,
            what="the backstop copy back, and refused again",
        )
        came_back_after = time.time() - parked_at
        assert 2.0 <= came_back_after <= 6.0, f"the backstop copy came {came_back_after:.2f} s after the park"
        if broker.url.startswith("amqp"):
            arguments = {"x-queue-type": "quorum"} if queue_type == "quorum" else None
            with Connection(broker.url) as connection:  # refused unless declared exactly so
                _, _, consumers = connection.channel().queue_declare(
                    queue + BACKSTOP_QUEUE, durable=True, auto_delete=False, arguments=arguments
                )
            assert consumers == 1, "the worker's main process holds the backstop queue"
        holder.release()
        assert result.get(timeout=30) == result.id
    finally:
        holder.release()  # a second release is a no-op
        for started in workers:
            started.stop()
    assert "Traceback" not in logs(workers)


def test_a_retry_to_another_queue_waits_in_that_queue(celery_stack: CeleryStack, broker: Broker) -> None:
    """A task that waited in one queue retries itself into another (``self.retry(queue=...)``),
    and the retry must wait too: its wake copy goes to the wake queue of the retry's queue (the
    wait it began there), not of the first one. Only a worker of the second queue may run it."""
    import tests.proj.app as proj

    first, second = broker.queue("retry-first"), broker.queue("retry-second")
    key = f"retry-{uuid.uuid4().hex[:8]}"
    workers = [
        worker(celery_stack, broker, first, "retry-first", {}),
        worker(celery_stack, broker, second, "retry-second", {}),
    ]
    semaphore = semaphore_for(proj.app, "proj.retries_elsewhere")
    try:
        sender = sender_app(celery_stack, broker, {"task_default_queue": first})
        result = sender.send_task("proj.retries_elsewhere", (second, key), queue=first)
        wait_until(
            lambda: len(proj.probe(key).client.lrange(f"probe:{key}:starts", 0, -1)) == 1,
            timeout=30,
            what="the first run, which retries into the second queue",
        )
        # queue behind the first run, so that the retry finds the slot held and waits
        holder = semaphore.acquire(timeout=10)
        try:
            wait_until(lambda: parked(proj, "proj.retries_elsewhere", result.id), timeout=30, what="the retry parked")
        finally:
            holder.release()
        assert result.get(timeout=30) == result.id
    finally:
        for started in workers:
            started.stop()
    runs = [entry.decode().split() for entry in proj.probe(key).client.lrange(f"probe:{key}:starts", 0, -1)]
    assert [queue for _, _, queue in runs] == [first, second], logs(workers)[-4000:]
