"""SemaphoreTask on a RabbitMQ broker, with real workers.

The broker URL comes from CELERY_SEMAPHORE_TEST_AMQP_URL (CI sets it); where no broker answers
there, the test reports itself skipped with the reason. It uses a queue of its own and deletes it.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.exceptions import DuplicateTaskNameWarning
from kombu import Connection

from ..celery_stack import CeleryStack
from ..waiting import wait_until
from ..workers import Worker

# real `celery worker` processes: `pytest -m "not workers"` leaves these out
pytestmark = pytest.mark.workers

AMQP_URL = os.environ.get("CELERY_SEMAPHORE_TEST_AMQP_URL")


def _reachable(url: str) -> str | None:
    try:
        with Connection(url, connect_timeout=3) as connection:
            connection.ensure_connection(max_retries=1)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


@pytest.fixture(scope="module")
def amqp_url() -> str:
    return amqp_url_or_skip()


def amqp_url_or_skip() -> str:
    """The RabbitMQ broker to test against; the test is skipped, saying why, where there is none."""
    if not AMQP_URL:
        pytest.skip("CELERY_SEMAPHORE_TEST_AMQP_URL is not set: no RabbitMQ broker to test against")
    problem = _reachable(AMQP_URL)
    if problem:
        pytest.skip(f"RabbitMQ at {AMQP_URL} is not reachable: {problem}")
    return AMQP_URL


@pytest.fixture(scope="module")
def amqp_queue(amqp_url: str) -> Iterator[str]:
    queue = f"celery-semaphore-test-{uuid.uuid4().hex[:8]}"
    yield queue
    with Connection(amqp_url) as connection:
        channel = connection.channel()
        channel.queue_delete(queue)
        channel.queue_delete(f"{queue}.semaphore-wake")


@pytest.mark.rabbitmq
def test_the_limit_holds_on_a_rabbitmq_broker(celery_stack: CeleryStack, amqp_url: str, amqp_queue: str) -> None:
    """24 tasks (limit 3) on 2 workers over RabbitMQ: at most 3 at once, 3 reached, all run once,
    including waits by countdown re-send (whole-second delays)."""
    import tests.proj.app as proj

    env = {**celery_stack.env, "PROJ_BROKER_URL": amqp_url, "PROJ_QUEUE": amqp_queue}
    workers = [Worker(env, name=f"amqp{i}", concurrency=3).start() for i in (1, 2)]
    try:
        sender = Celery("sender", broker=amqp_url, backend=celery_stack.env["PROJ_RESULT_URL"], set_as_current=False)
        key = "amqp"
        results = [sender.send_task("proj.hold", (0.2, key), queue=amqp_queue) for _ in range(24)]
        results += [sender.send_task("proj.no_retries", (0.2,), queue=amqp_queue) for _ in range(4)]
        for result in results:
            result.get(timeout=120)
        assert proj.probe(key).maximum == 3
        assert proj.probe(key).entries == 24
        assert proj.probe("proj.no_retries").maximum == 1
    finally:
        for worker in workers:
            worker.stop()


@pytest.mark.rabbitmq
def test_hand_off_on_a_rabbitmq_broker(celery_stack: CeleryStack, amqp_url: str, amqp_queue: str) -> None:
    """Over RabbitMQ, tasks waiting outside the worker (countdown 5 s) are woken through the wake
    queue: sent one at a time, they start in that order, each once, and the whole line of six
    0.1 s tasks takes far less than one countdown per task."""
    import tests.proj.app as proj

    from ..celery.test_celery_handoff import has_its_place, starts
    from ..waiting import wait_until

    env = {**celery_stack.env, "PROJ_BROKER_URL": amqp_url, "PROJ_QUEUE": amqp_queue}
    workers = [Worker(env, name=f"amqp-handoff{i}", concurrency=3).start() for i in (1, 2)]
    try:
        sender = Celery("sender", broker=amqp_url, backend=celery_stack.env["PROJ_RESULT_URL"], set_as_current=False)
        key = "amqp-handoff"
        results = []
        for _ in range(6):
            results.append(sender.send_task("proj.handoff", (0.1, key), queue=amqp_queue))
            # the order is made by the acquire script: wait for it, not for the prerun signal
            wait_until(
                lambda: has_its_place(proj, "proj.handoff", key, results[-1].id),
                timeout=30,
                what="the task to have its place",
            )
        for result in results:
            result.get(timeout=120)
        runs = starts(proj, key)
        assert [task_id for task_id, _ in runs] == [r.id for r in results]
        assert runs[-1][1] - runs[0][1] < 5.0, "woken by releases, not by 5 s countdowns"
        assert "semaphore-wake" in "".join(worker.log() for worker in workers)
    finally:
        for worker in workers:
            worker.stop()


@pytest.mark.rabbitmq
def test_a_copy_due_later_than_the_consumer_timeout_goes_back_to_the_broker(
    celery_stack: CeleryStack, amqp_url: str, amqp_queue: str
) -> None:
    """RabbitMQ closes a consumer's channel (and the worker exits) when it holds a message
    unacknowledged past its consumer timeout (30 min by default): a rate of "500/h" holds a
    start's copy for up to an hour. With ``semaphore_broker_consumer_timeout`` at 2 s (the broker
    here keeps its default: its real timeout cannot be shortened for one test's consumer), a
    copy due 8 s later is handed back to its backstop queue at least every second, so no hold
    comes near the timeout; it still starts when due, and once."""
    import tests.proj.app as proj

    key = f"handed-back-{uuid.uuid4().hex[:6]}"
    limits = {**proj.app.conf.semaphore_limits, "proj.rated": {"rate": [1, 8]}}
    conf = {"semaphore_broker_consumer_timeout": 2, "semaphore_limits": limits}
    env = {**celery_stack.env, "PROJ_BROKER_URL": amqp_url, "PROJ_QUEUE": amqp_queue}
    worker = Worker(env, name="amqp-handed-back", concurrency=2, conf=conf).start()
    try:
        sender = Celery("sender", broker=amqp_url, backend=celery_stack.env["PROJ_RESULT_URL"], set_as_current=False)
        results = [sender.send_task("proj.rated", (0.1, key), queue=amqp_queue) for _ in range(2)]
        for result in results:
            result.get(timeout=60)
        records = proj.probe(key).client
        granted = sorted(int(entry.split()[1]) for entry in records.lrange(f"probe:{key}:granted", 0, -1))
        assert len(granted) == 2  # each once
        assert granted[1] - granted[0] >= 8000  # the rate kept through the hand-backs
        handed_back = sorted(int(count) for count in records.lrange(f"probe:{key}:handed_back", 0, -1))
        assert handed_back[0] == 0  # the first started at once
        assert handed_back[1] >= 4, handed_back  # held 1 s at most each time, for about 8 s
        assert worker.process is not None and worker.process.poll() is None  # its channel was never closed
    finally:
        worker.stop()


@pytest.mark.rabbitmq
def test_a_worker_starts_on_a_queue_that_has_messages_waiting(celery_stack: CeleryStack, amqp_url: str) -> None:
    """RabbitMQ delivers a queue's ready messages as soon as the worker consumes it. Consuming a
    wake queue before Celery's event loop had set the consumer's callback let such a delivery
    arrive with nothing to take it: kombu raised NotImplementedError ("Consumer does not have
    any callbacks") and the worker died at start. A worker started on a queue with tasks in it
    comes up and runs them."""
    queue = f"celery-semaphore-ready-{uuid.uuid4().hex[:8]}"
    env = {**celery_stack.env, "PROJ_BROKER_URL": amqp_url, "PROJ_QUEUE": queue}
    sender = Celery("sender", broker=amqp_url, backend=celery_stack.env["PROJ_RESULT_URL"], set_as_current=False)
    try:
        for attempt in range(3):  # a race at start: three fresh workers, each on a queue already full
            results = [sender.send_task("proj.hold", (0.05, f"ready-{attempt}"), queue=queue) for _ in range(20)]
            worker = Worker(env, name=f"amqp-ready{attempt}", concurrency=2).start()
            try:
                for result in results:
                    result.get(timeout=60)
                assert worker.process is not None and worker.process.poll() is None, worker.log()[-3000:]
                # and it consumes the queue's wake queue, added before its event loop began
                with Connection(amqp_url) as connection:
                    declared = connection.channel().queue_declare(f"{queue}.semaphore-wake", passive=True)
                assert declared.consumer_count == 1
            finally:
                worker.stop()
            assert "does not have any callbacks" not in worker.log()
    finally:
        with Connection(amqp_url) as connection:
            channel = connection.channel()
            for name in (queue, f"{queue}.semaphore-wake", f"{queue}.semaphore-backstop"):
                channel.queue_delete(name)


@pytest.mark.rabbitmq
def test_tasks_placed_at_send_on_a_rabbitmq_broker_are_delivered_once_in_order(
    celery_stack: CeleryStack, amqp_url: str, amqp_queue: str
) -> None:
    """Sent through the task (an app that declares it, as a producer does) while the slot is
    held: each task takes its place as it is sent, its backstop copy in the backstop queue of
    its queue, nothing in the queue itself; released, they start in the order sent, each
    delivered once (its wake copy). A RabbitMQ message cannot be withdrawn: each backstop copy,
    due 5 s after its send, is dropped by the worker holding it when it falls due, since its run
    finished; no task is delivered a second time."""
    import re

    import tests.proj.app as proj
    from celery_semaphore import SemaphoreTask, semaphore_for
    from celery_semaphore._celery.tokens import waiter_key

    from ..celery.test_celery_handoff import starts

    assert proj.handoff.name == "proj.handoff"  # the test app's task made first: it keeps the name
    env = {**celery_stack.env, "PROJ_BROKER_URL": amqp_url, "PROJ_QUEUE": amqp_queue}
    # A prefix of their own: this process sends the wake copies of the parked tasks its release
    # offers a slot, through the one app it knows for a semaphore Redis and prefix (the first to
    # park there), and earlier tests parked through the Redis-broker app under the default one.
    prefix = f"amqp-placed-{uuid.uuid4().hex[:6]}"
    conf = {"semaphore_prefix": prefix}
    workers = [Worker(env, name=f"amqp-placed{i}", concurrency=3, conf=conf).start() for i in (1, 2)]
    sender = Celery("placer", broker=amqp_url, backend=celery_stack.env["PROJ_RESULT_URL"], set_as_current=False)
    sender.conf.update(semaphore_backend_url=celery_stack.env["PROJ_SEMAPHORE_URL"], semaphore_prefix=prefix)

    # the workers' task under its name, in the sender's app (Celery warns of the same name in
    # two apps of one process; the workers have only theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DuplicateTaskNameWarning)

        @sender.task(
            base=SemaphoreTask,
            name="proj.handoff",
            shared=False,
            semaphore_limit=1,
            semaphore_inline_wait=0,
            semaphore_countdown=5,
        )
        def handoff(seconds: float, key: str) -> None: ...

        assert handoff.name == "proj.handoff"  # the task class is made here, under the filter
        sender.finalize()  # where the test app's shared tasks meet this one: this one stays
        assert sender.tasks["proj.handoff"].run.__qualname__.endswith("<locals>.handoff")

    key = "amqp-placed"
    semaphore = semaphore_for(sender, "proj.handoff")
    try:
        holder = semaphore.acquire(timeout=5)
        try:
            results = [handoff.apply_async((0.1, key), queue=amqp_queue) for _ in range(6)]
            waiters = {w.waiter for w in semaphore.status().waiters}
            assert all(waiter_key(r.id) in waiters for r in results), "each placed as it was sent"
            with Connection(amqp_url) as connection:
                ready = connection.channel().queue_declare(amqp_queue, passive=True).message_count
            assert ready == 0, "nothing sent to the queue itself"
        finally:
            holder.release()
        for result in results:
            result.get(timeout=120)
        assert [task_id for task_id, _ in starts(proj, key)] == [r.id for r in results]
        logs = "".join(worker.log() for worker in workers)
        for result in results:
            assert len(re.findall(rf"\[{re.escape(result.id)}\] received", logs)) == 1, "delivered once"
        # each backstop copy (due 5 s after its send) falls due after its run finished: the
        # worker's main process holding it drops it then, instead of sending it on to be
        # delivered and dropped
        dropped = "its run finished; its backstop copy is dropped as it falls due"
        wait_until(
            lambda: all(f"[{r.id}]: {dropped}" in "".join(w.log() for w in workers) for r in results),
            timeout=60,
            what="every backstop copy dropped by its holder",
        )
        logs = "".join(worker.log() for worker in workers)
        for result in results:
            assert len(re.findall(rf"\[{re.escape(result.id)}\] received", logs)) == 1, "still delivered once"
    finally:
        for worker in workers:
            worker.stop()
