"""SemaphoreTask on a RabbitMQ broker, with real workers.

The broker URL comes from CELERY_SEMAPHORE_TEST_AMQP_URL (CI sets it); where no broker answers
there, the test reports itself skipped with the reason. It uses a queue of its own and deletes it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from kombu import Connection

from .celery_stack import CeleryStack
from .workers import Worker

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

    from .test_celery_handoff import starts
    from .waiting import wait_until

    env = {**celery_stack.env, "PROJ_BROKER_URL": amqp_url, "PROJ_QUEUE": amqp_queue}
    workers = [Worker(env, name=f"amqp-handoff{i}", concurrency=3).start() for i in (1, 2)]
    try:
        sender = Celery("sender", broker=amqp_url, backend=celery_stack.env["PROJ_RESULT_URL"], set_as_current=False)
        key = "amqp-handoff"
        asks = proj.probe("proj.handoff")
        asked_before = asks.client.llen("probe:proj.handoff:asks")
        results = []
        for _ in range(6):
            results.append(sender.send_task("proj.handoff", (0.1, key), queue=amqp_queue))
            wait_until(
                lambda: asks.client.llen("probe:proj.handoff:asks") - asked_before >= len(results),
                timeout=30,
                what="the task to ask",
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
