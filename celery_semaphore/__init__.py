"""celery_semaphore: never run more than N of these at once, across every Celery worker.

A fair, distributed counting semaphore in Redis, and a Celery task class that takes a slot
before the task body runs and gives it back however the task ends.
"""

from __future__ import annotations

from .decorators import limit_concurrency
from .errors import ConfigurationError, LeaseLost, RedisUnavailable, SemaphoreError, SemaphoreUnavailable
from .semaphore import FairSemaphore, Granted, Lease, SemaphoreStatus, Waiting
from .task import SemaphoreTask

__all__ = [
    "ConfigurationError",
    "FairSemaphore",
    "Granted",
    "Lease",
    "LeaseLost",
    "RedisUnavailable",
    "SemaphoreError",
    "SemaphoreStatus",
    "SemaphoreTask",
    "SemaphoreUnavailable",
    "Waiting",
    "limit_concurrency",
]
