"""The wake queues in the consumer: next to each of the worker's queues, its wake queue, where
a waiting task is sent again the moment a release hands it a slot (so that it does not queue
behind a backlog of fresh tasks in the queue it came from); also next to a queue added later
(``add_consumer``), and left with it (``cancel_consumer``). Each wake queue is declared like its
queue (``wake_queues.py``)."""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from .backstop import follow_backstops
from .handing_back import hand_back_before_close
from .pool_room import is_prefork
from .wake_queues import declarable, is_derived_queue, wake_queue, wake_queue_for

logger = logging.getLogger("celery_semaphore")


class WakeQueueStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumes the wake queue of every queue the worker consumes, from its start or later."""

    label = "Semaphore wake queues"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, consumer: Any) -> None:
        hand_back_before_close(consumer, prefork=is_prefork(consumer.controller))
        follow_queue_changes(consumer)
        for queue in list(consumer.task_consumer.queues):
            consume_wake_queue(consumer, queue.name)


_FOLLOWED_FLAG = "_celery_semaphore_follows_queues"


def consume_wake_queue(consumer: Any, name: str) -> None:
    """Consume the wake queue of the queue ``name`` (declared like it) too."""
    if is_derived_queue(name):
        return
    queue = wake_queue_for(consumer.app, name)
    if declarable(consumer.connection, queue):
        tasks = consumer.task_consumer
        if tasks.on_message is None and not tasks.callbacks:
            # before the event loop, which consumes every queue as it starts: consumed now, a
            # RabbitMQ delivery would find no callback yet, and the worker would die at start
            if not any(known.name == queue.name for known in tasks.queues):
                tasks.add_queue(queue)
                logger.info("consuming %s too (woken tasks of %s)", queue.name, name)
        else:
            add_task_queue = getattr(consumer, _FOLLOWED_FLAG, None) or consumer.add_task_queue
            add_task_queue(queue.name)
    follow_backstops(consumer, name)


def follow_queue_changes(consumer: Any) -> None:
    """Make ``consumer`` consume a queue's wake queue whenever it starts to consume the queue, and
    stop when it stops.

    Queues change at run time through the consumer's ``add_task_queue`` and ``cancel_task_queue``
    (the ``add_consumer`` and ``cancel_consumer`` control commands call them, as does any code
    holding the consumer), and Celery has no signal for either: so the consumer's own methods are
    wrapped, on this instance only. The consumer outlives a reconnection (its steps restart, this
    one too), hence the flag: wrapped once, and the wrapper calls the methods it found."""
    if getattr(consumer, _FOLLOWED_FLAG, None) is not None:
        return
    add_task_queue, cancel_task_queue = consumer.add_task_queue, consumer.cancel_task_queue
    setattr(consumer, _FOLLOWED_FLAG, add_task_queue)

    def add_with_wake_queue(queue: Any, *args: Any, **kwargs: Any) -> None:
        add_task_queue(queue, *args, **kwargs)
        name = getattr(queue, "name", queue)
        if isinstance(name, str) and name:
            consume_wake_queue(consumer, name)

    def cancel_with_wake_queue(queue: Any, *args: Any, **kwargs: Any) -> None:
        cancel_task_queue(queue, *args, **kwargs)
        # a worker told to leave a queue stops running its woken tasks too
        if isinstance(queue, str) and queue and not is_derived_queue(queue):
            cancel_task_queue(wake_queue(queue))

    consumer.add_task_queue = add_with_wake_queue
    consumer.cancel_task_queue = cancel_with_wake_queue
