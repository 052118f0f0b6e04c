"""A stopping worker hands back at once the wake copies it received and will not run.

A warm shutdown stops consuming first, then waits for the running tasks, and only when it
closes its broker connection, at the very end, does the broker get back the messages the worker
received and did not run. A wake copy among them carries a turn: a slot is offered to that task
alone for its claim window, and the slot idles until the copy asks. Measured in issue 17's
rolling-restart test (two workers of 4, one warm-restarted every 10 s, limit 1): the wake copy
a worker received as its shutdown began came back 1.4-1.7 s later, when its pool had stopped;
with a task of 8 s running in that worker, the offer lapsed instead, and the slot reached the
next task 2.6 s after its release (a claim window, then a tick).

Two places hold such a copy, and both are emptied as soon as the worker has stopped consuming:

* a pending ``BRPOP`` (Redis broker): the consumer sent it before the shutdown, and Redis pops
  the next message for it though nobody reads the reply until the connection closes. Reading
  the reply now (it comes within kombu's ``BRPOP`` timeout, a second) hands the message, whose
  queue no longer has a consumer here, back to that queue: kombu requeues it at once.
* the worker's line of received tasks waiting for a pool process (``woken_first.py``): a wake
  copy there is taken out of the line and rejected with requeue.

Any other message the worker holds (a task it will not start, a backstop copy with a
countdown) still goes back when the connection closes, as Celery does it.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from .woken_first import is_woken_entry

logger = logging.getLogger("celery_semaphore")


def hand_back(worker: Any) -> int:
    """Give the broker back the wake copies ``worker`` (stopping, no longer consuming) holds and
    will not run; how many were in its line of received tasks (a copy read from a pending
    ``BRPOP`` goes back through kombu, uncounted)."""
    _read_pending_brpop(getattr(worker, "consumer", None))
    return _requeue_waiting_wake_copies(worker)


def _read_pending_brpop(consumer: Any) -> None:
    task_consumer = getattr(consumer, "task_consumer", None)
    channel = getattr(task_consumer, "channel", None)
    read = getattr(channel, "_brpop_read", None)
    if not getattr(channel, "_in_poll", None) or not callable(read):
        return  # not the Redis transport, or no BRPOP out
    try:
        read()
    except Exception as error:  # Empty (nothing popped), or the broker is gone: the close restores
        logger.debug("no pending wake copy to hand back: %r", error)


def _requeue_waiting_wake_copies(worker: Any) -> int:
    waiting = getattr(getattr(worker, "semaphore", None), "_waiting", None)
    if not isinstance(waiting, deque):
        return 0
    handed = 0
    for entry in [entry for entry in waiting if is_woken_entry(entry)]:
        waiting.remove(entry)
        request = entry[1][0]
        try:
            request.reject(requeue=True)
        except Exception as error:  # the broker is gone: the close restores it, or its backstop
            logger.debug("could not hand back a wake copy: %r", error)
            continue
        handed += 1
    return handed
