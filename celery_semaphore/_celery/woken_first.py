"""A woken task reaches the next free pool process before the tasks received ahead of it.

A parked task's wake copy carries its turn: a slot is offered to it alone for its claim window,
and the slot idles until the copy asks. But a prefork worker that received more tasks than it
has free processes keeps them in line, first in, first out: under a backlog of contended tasks
that line holds up to ``worker_prefetch_multiplier`` x concurrency fresh deliveries, each
refused and parked in turn (a few ms of Redis and broker work each) before the wake copy that
arrived behind them reaches a process. Measured with the rolling-restart benchmark
(``python -m benchmarks.bench_celery --only rolling``: two
workers of 4, limit 1, 200 tasks of 0.1 s): the wake copy reached the worker 20-60 ms after the
release, then waited behind 30-40 fresh deliveries, and those were every slow hand-off: p99
290 ms against a 60 ms target.

So the worker's main process puts a wake copy at the front of that line as it enters it, behind
only the wake copies already there (they keep their order). It is in the worker already: no
broker, prefetch or acknowledgement changes. The line is Celery's own: the worker's semaphore
of pool processes, which a prefork worker with ``worker_pool_putlocks`` (on by default) keeps
(the tasks waiting for a process, a deque, each entry appended as its task arrives). So this
relies on that shape and does nothing where it differs: thread, green and solo pools run a
task as they receive it, and with ``worker_pool_putlocks`` off the tasks wait in the prefork
pool's own buffer, in Celery's order, as before (its entries say nothing of their message).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .wake_queues import is_wake_queue


def is_woken(request: Any) -> bool:
    """Whether ``request`` (a Celery worker request) is a wake copy: it came from a wake queue."""
    delivery_info = getattr(request, "delivery_info", None) or {}
    routing_key = delivery_info.get("routing_key") if isinstance(delivery_info, dict) else None
    return isinstance(routing_key, str) and is_wake_queue(routing_key)


def install(worker: Any) -> bool:
    """Make ``worker``'s semaphore of pool processes put wake copies first in its line of
    waiting tasks; whether it has one (a prefork worker; it uses it with ``worker_pool_putlocks``)."""
    semaphore = getattr(worker, "semaphore", None)
    waiting = getattr(semaphore, "_waiting", None)
    if not isinstance(waiting, deque) or not callable(getattr(semaphore, "_add_waiter", None)):
        return False

    def add_waiter(entry: Any) -> None:
        # an entry is (callback, args, kwargs), args being (request,) for a task
        if is_woken_entry(entry):
            _insert_after_woken(waiting, entry)
        else:
            waiting.append(entry)

    semaphore._add_waiter = add_waiter  # type: ignore[union-attr]
    return True


def _insert_after_woken(line: deque[Any], entry: Any) -> None:
    place = 0
    while place < len(line) and is_woken_entry(line[place]):
        place += 1
    line.insert(place, entry)


def is_woken_entry(entry: Any) -> bool:
    """Whether a waiting entry, ``(callback, args, kwargs)`` with ``args == (request,)`` for a
    task, is a wake copy's."""
    if not (isinstance(entry, tuple) and len(entry) == 3):
        return False
    args: Any = entry[1]
    return bool(args) and is_woken(args[0])
