"""celery_semaphore: never run more than N of these at once, across every Celery worker.

A fair, distributed counting semaphore in Redis, and a Celery task class that takes a slot
before the task body runs and gives it back however the task ends.

The public names are the ones in ``__all__``, plus three public modules: ``metrics``
(Prometheus), ``testing`` (throwaway Redis servers and the pytest plugin for users' own tests)
and ``cli`` (the ``celery semaphore`` commands, through Celery's entry point). Every other module
is internal. Names are loaded on first use, so ``from celery_semaphore import FairSemaphore`` in
a process that never touches Celery loads neither celery, kombu nor click.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._celery.catalogue import semaphore_for
    from ._celery.decorators import limit_concurrency
    from ._celery.task import SemaphoreTask
    from ._celery.why import why
    from ._celery.worker import SemaphoreRequest
    from ._core.async_lease import AsyncGranted, AsyncLease
    from ._core.async_multi import AsyncMultiSemaphore
    from ._core.async_semaphore import AsyncFairSemaphore
    from ._core.attempts import Granted, Waiting
    from ._core.lease import Lease
    from ._core.masking import mask_url
    from ._core.multi import MultiSemaphore
    from ._core.rules import Rate
    from ._core.semaphore import FairSemaphore
    from ._core.status import SemaphoreStatus
    from .errors import ConfigurationError, LeaseLost, RedisUnavailable, SemaphoreError, SemaphoreUnavailable

# public name -> the module that defines it
_HOMES = {
    "AsyncFairSemaphore": "._core.async_semaphore",
    "AsyncGranted": "._core.async_lease",
    "AsyncLease": "._core.async_lease",
    "AsyncMultiSemaphore": "._core.async_multi",
    "ConfigurationError": ".errors",
    "FairSemaphore": "._core.semaphore",
    "Granted": "._core.attempts",
    "Lease": "._core.lease",
    "LeaseLost": ".errors",
    "MultiSemaphore": "._core.multi",
    "Rate": "._core.rules",
    "RedisUnavailable": ".errors",
    "SemaphoreError": ".errors",
    "SemaphoreRequest": "._celery.worker",
    "SemaphoreStatus": "._core.status",
    "SemaphoreTask": "._celery.task",
    "SemaphoreUnavailable": ".errors",
    "Waiting": "._core.attempts",
    "limit_concurrency": "._celery.decorators",
    "mask_url": "._core.masking",
    "semaphore_for": "._celery.catalogue",
    "why": "._celery.why",
}

__all__ = [
    "AsyncFairSemaphore",
    "AsyncGranted",
    "AsyncLease",
    "AsyncMultiSemaphore",
    "ConfigurationError",
    "FairSemaphore",
    "Granted",
    "Lease",
    "LeaseLost",
    "MultiSemaphore",
    "Rate",
    "RedisUnavailable",
    "SemaphoreError",
    "SemaphoreRequest",
    "SemaphoreStatus",
    "SemaphoreTask",
    "SemaphoreUnavailable",
    "Waiting",
    "limit_concurrency",
    "mask_url",
    "semaphore_for",
    "why",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
