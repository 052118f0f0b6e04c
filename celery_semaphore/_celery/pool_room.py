"""Keeps one pool process of each worker free of waiting tasks.

A refused task whose turn is near waits for it in its pool process (``semaphore_inline_wait``)
rather than leave the worker. But a worker whose every process is taken, by bodies and by such
waits, cannot start a task that may run now: a parked task woken for its turn (its wake copy),
or one coming back for a start a rate reserved for it, waits in the worker's buffer until some
wait ends, up to ``semaphore_inline_wait`` later, while its slot idles. Those were the slow
hand-offs of the rolling-restart benchmark (``python -m benchmarks.bench_celery --only
rolling``: p99 79 ms against a 60 ms target, restarts or
none). So a task may wait in-process only while another process of its worker is free.

The pool processes of a prefork worker share one flag each, in memory the worker's main process
maps before the pool forks: a process sets its flag while it runs a semaphore task (waiting or
holding) and clears it after. A flag is per process index, not a counter, so a process killed
mid-task (SIGKILL, OOM) leaves no count behind for ever: the process that replaces it takes its
index and its flag. Thread and green pools run tasks in the main process: a counter there.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from billiard.process import current_process


class PoolRoom:
    """Which pool processes of this worker are busy in a semaphore task."""

    def __init__(self) -> None:
        self._flags: Any = None  # a shared byte per prefork process, by index
        self._size = 0  # processes of the pool (its most, under autoscale); 0: not a worker
        self._busy = 0  # thread and green pools: tasks busy in this process
        self._lock = threading.Lock()

    def prepare(self, size: int, *, prefork: bool) -> None:
        """In the worker's main process, before the pool starts: ``size`` processes (or threads)."""
        self._size = max(0, int(size))
        self._flags = multiprocessing.RawArray("b", self._size) if prefork and self._size else None

    @contextmanager
    def busy(self) -> Iterator[None]:
        """This process (or thread) runs a semaphore task meanwhile."""
        index = self._index()
        if index is not None:
            self._flags[index] = 1
        else:
            with self._lock:
                self._busy += 1
        try:
            yield
        finally:
            if index is not None:
                self._flags[index] = 0
            else:
                with self._lock:
                    self._busy -= 1

    def leaves_one_free(self) -> bool:
        """Whether a task busy here (counted already) may wait in-process and still leave a
        process of the worker free. True outside a worker: nothing to keep free there."""
        if self._size == 0:
            return True
        busy = sum(self._flags) if self._index() is not None else self._busy
        return busy < self._size

    def has_others(self) -> bool:
        """Whether a task here shares its worker with other processes (or threads): a worker of
        one runs nothing else while a task waits in it."""
        return self._size != 1

    def _index(self) -> int | None:
        if self._flags is None:
            return None
        index = getattr(current_process(), "index", None)
        return index if isinstance(index, int) and 0 <= index < self._size else None


pool_room = PoolRoom()


def is_prefork(worker: Any) -> bool:
    """Whether ``worker`` (a WorkController) runs a prefork pool."""
    from celery.concurrency.prefork import TaskPool as PreforkPool

    pool_cls = getattr(worker, "pool_cls", None)
    return isinstance(pool_cls, type) and issubclass(pool_cls, PreforkPool)
