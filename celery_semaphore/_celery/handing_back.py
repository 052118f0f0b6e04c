"""A stopping worker hands back at once the wake copies it received and will not run.

A warm shutdown stops consuming first, then waits for the running tasks, and only when it
closes its broker connection, at the very end, does the broker get back the messages the worker
received and did not run. A wake copy among them carries a turn: a slot is offered to that task
alone for its claim window, and the slot idles until the copy asks. Measured in the
rolling-restart test (``tests/operations/test_stranded_waiters.py -k rolling``: two workers of 4, one
warm-restarted every 10 s, limit 1): the wake copy a worker received as its shutdown began came
back 1.4-1.7 s later, when its pool had stopped;
with a task of 8 s running in that worker, the offer lapsed instead, and the slot reached the
next task 2.6 s after its release (a claim window, then a tick).

Two places hold such a copy, and both are emptied as the worker stops consuming:

* a pending ``BRPOP`` (Redis broker): the consumer sent it before the shutdown, and Redis pops
  the next message for it though nobody reads the reply until the connection closes. Reading
  the reply once the consumer is cancelled (``read_pending_brpop``, from the worker's stop; it
  comes within kombu's ``BRPOP`` timeout, a second) hands the message, whose queue no longer has
  a consumer here, back to that queue: kombu requeues it at once.
* the wake copies received and not yet accepted by a pool process: waiting in the worker's line
  for a free process (``woken_first.py``), or handed to the pool and still in its outgoing
  buffer. A prefork pool that stops drops every job no process accepted ("the broker will
  redeliver it"), and the broker does, at the close. Those copies are rejected with requeue now
  (and taken out of the line, so that a process freed during the shutdown does not run them).
  Measured in the rolling-restart benchmark: a copy received 10 ms before the SIGTERM, in the
  pool's buffer, came back 1.5 s later, at the close. This is done first thing as the
  consumer stops, before Celery forgets those tasks (``hand_back_before_close``).

Thread, green and solo pools are left as they are: a thread or green pool runs the tasks it was
given before it stops, and a solo one runs each as it receives it. Any other message the worker
holds (a task it will not start, a backstop copy with a countdown) still goes back when the
connection closes, as Celery does it.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from .woken_first import is_woken, is_woken_entry

logger = logging.getLogger("celery_semaphore")

_WRAPPED_FLAG = "_celery_semaphore_hands_back"


def hand_back_before_close(consumer: Any, *, prefork: bool) -> None:
    """Make ``consumer`` (a prefork worker's) hand back the wake copies no process accepted right
    before it forgets them: its blueprint's ``on_close``, the first thing it runs as it stops
    (and after losing its broker connection), empties the line, drops Celery's record of the
    received tasks and has the pool drop the jobs no process accepted."""
    blueprint = getattr(consumer, "blueprint", None)
    if not prefork or blueprint is None or getattr(blueprint, _WRAPPED_FLAG, False):
        return
    on_close = blueprint.on_close

    def hand_back_then_close() -> None:
        try:
            handed = _requeue_unaccepted_wake_copies(getattr(consumer, "controller", None))
        except Exception as error:  # never in the way of Celery's own close
            logger.debug("could not hand back the wake copies: %r", error)
        else:
            if handed:
                logger.info("handed %d woken task(s) back to the broker: this worker stops consuming", handed)
        if on_close is not None:
            on_close()

    blueprint.on_close = hand_back_then_close
    setattr(blueprint, _WRAPPED_FLAG, True)


def read_pending_brpop(consumer: Any) -> None:
    """Read the reply of ``consumer``'s pending ``BRPOP`` (Redis broker), once it no longer
    consumes: a message in it, whose queue has no consumer here any more, kombu requeues at once."""
    task_consumer = getattr(consumer, "task_consumer", None)
    channel = getattr(task_consumer, "channel", None)
    read = getattr(channel, "_brpop_read", None)
    if not getattr(channel, "_in_poll", None) or not callable(read):
        return  # not the Redis transport, or no BRPOP out
    try:
        read()
    except Exception as error:  # Empty (nothing popped), or the broker is gone: the close restores
        logger.debug("no pending wake copy to hand back: %r", error)


def _requeue_unaccepted_wake_copies(worker: Any) -> int:
    from celery.worker import state as worker_state

    waiting = getattr(getattr(worker, "semaphore", None), "_waiting", None)
    if isinstance(waiting, deque):
        for entry in [entry for entry in waiting if is_woken_entry(entry)]:
            waiting.remove(entry)
    accepted = set(worker_state.active_requests)
    handed = 0
    for request in list(worker_state.reserved_requests):
        if request in accepted or not is_woken(request) or getattr(request, "acknowledged", True):
            continue
        try:
            request.reject(requeue=True)
        except Exception as error:  # the broker is gone: the close restores it, or its backstop
            logger.debug("could not hand back a wake copy: %r", error)
            continue
        handed += 1
    return handed
