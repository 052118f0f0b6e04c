"""How a task's slot goes back: now, or once Celery has recorded the task's outcome.

A task that waited may exist in several copies (its backstop copy, its wake copy), and its run
is marked finished as its slot is given back, so that no other copy runs the body again
(``wait_runs.py``). Celery stores the result, and with ``acks_late`` acknowledges the message,
only after ``__call__`` returns. A pool process killed in between left the message
unacknowledged and the run finished: with ``reject_on_worker_lost`` Celery delivered the message
again, that copy found its run finished and was dropped, and the task never succeeded. Found by
the full chaos test (seed 3, 1 task of 300: SIGKILLed 0.477 s into a body of about 0.45 s).

So where a run is to be marked finished, the slot goes back in ``task_postrun``, which Celery
sends after storing the outcome, whatever it is. A process killed before that leaves the run
unfinished: the main process gives its slot back by task id, and the delivery Celery makes again
runs the task (at least once, as ``acks_late`` promises; a body that had returned runs again, as
it would without the semaphore). One killed after it finds the task's success in the result
backend and is dropped (``task.py``). The slot is held through the store too: the
rolling-restart benchmark's makespan did not move (21.8 s after, 21.9 s before).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import signals

from .._core.lease import Lease
from ..errors import RedisUnavailable
from .due_copies import withdraw

logger = logging.getLogger("celery_semaphore")

_PENDING_ATTRIBUTE = "semaphore_lease_after_outcome"
# on a request whose run the broker's Redis remembers as finished since its grant: until when
# (monotonic) its end need not say so again
_REMEMBERED_ATTRIBUTE = "_semaphore_run_remembered_until"
# A run remembered as finished from its grant (it runs at most once) is remembered this much
# longer than asked (a share of the time asked), so that a body shorter than that extra ends
# with its run remembered long enough, and its end tells the broker nothing.
REMEMBER_EXTRA = 0.1

# Releasing when Redis is unreachable: tries in the background, the lease is the backstop.
RELEASE_TRIES = 5
RELEASE_PAUSE = 0.5


def give_back(lease: Lease, *, finished: bool = True) -> None:
    """Release now; only if Redis is unreachable, keep trying briefly in a daemon thread, so the
    task's result is not held up. The lease expiring is the backstop. ``finished=False``: Celery
    will deliver the task again, so its run is not marked finished (that copy must run it)."""
    run = lease.run if finished else None
    try:
        if not lease.release(finished=finished) and lease.lost:
            logger.warning("%r: the lease had been lost before the task ended", lease)
        return
    except RedisUnavailable as error:
        logger.warning("release of %r failed, retrying in the background: %s", lease, error)

    def retry() -> None:
        for attempt in range(RELEASE_TRIES):
            time.sleep(RELEASE_PAUSE * (attempt + 1))
            try:
                lease.semaphore._release(lease.token, run, lease.remember_ms)
                return
            except RedisUnavailable:
                continue
        logger.error("%r could not be released; its slot comes back when the lease ends", lease)

    threading.Thread(target=retry, name="celery-semaphore-release", daemon=True).start()


def give_back_at_end(request: Any, lease: Lease, *, finished: bool) -> None:
    """Give back the slot of the task that ``request`` (its current request, in this process)
    runs, as its ``__call__`` ends: now, or, where its run is to be marked finished, once Celery
    has recorded its outcome (``task_postrun``)."""
    if finished and lease.run is not None:
        setattr(request, _PENDING_ATTRIBUTE, lease)
    else:
        give_back(lease, finished=finished)


def _give_back_pending(task: Any = None, **_: Any) -> None:
    request = getattr(task, "request", None)
    lease: Lease | None = getattr(request, _PENDING_ATTRIBUTE, None)
    if lease is not None:
        setattr(request, _PENDING_ATTRIBUTE, None)
        give_back(lease, finished=True)
        remembered_until = getattr(request, _REMEMBERED_ATTRIBUTE, None)
        if remembered_until is None or time.monotonic() > remembered_until:
            withdraw(task.app, lease.run, remember_s=lease.remember_ms / 1000)  # no copy of it comes back


def run_remembered(request: Any, remember_s: float) -> None:
    """The broker's Redis remembers the run of ``request`` as finished since its grant, for
    ``remember_s`` and ``REMEMBER_EXTRA`` more (it runs at most once, and its stored copy was
    withdrawn then): an end within the extra has nothing to tell it."""
    setattr(request, _REMEMBERED_ATTRIBUTE, time.monotonic() + remember_s * REMEMBER_EXTRA)


signals.task_postrun.connect(_give_back_pending, weak=False, dispatch_uid="celery_semaphore.give_back_pending")
