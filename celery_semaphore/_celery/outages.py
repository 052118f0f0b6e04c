"""Says once per outage per process that the semaphore Redis is unreachable, and once when it
answers again, instead of a warning on every refused try (hundreds a second)."""

from __future__ import annotations

import logging
from typing import Any

from .._core import fork_locks

logger = logging.getLogger("celery_semaphore")


class _Outages:
    """Says once per outage per process that the semaphore Redis is unreachable, and once when
    it answers again, instead of a warning on every refused try (hundreds a second)."""

    def __init__(self) -> None:
        self._down: set[int] = set()  # id() of the clients known to be unreachable
        self._lock = fork_locks.reset_in_child()

    def down(self, semaphore: Any, error: Exception) -> None:
        with self._lock:
            first = id(semaphore.client) not in self._down
            self._down.add(id(semaphore.client))
        if first:
            logger.warning("semaphore Redis unavailable: tasks wait (fail closed) until it is back: %s", error)

    def back(self, semaphore: Any) -> None:
        if not self._down:  # the common case costs one truth test
            return
        with self._lock:
            was_down = id(semaphore.client) in self._down
            self._down.discard(id(semaphore.client))
        if was_down:
            logger.warning("semaphore Redis is back: waiting tasks take their slots again")

    def is_down(self, semaphore: Any) -> bool:
        return id(semaphore.client) in self._down


outages = _Outages()
