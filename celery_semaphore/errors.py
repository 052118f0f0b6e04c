"""The one error family of celery_semaphore.

Every error the package raises derives from :class:`SemaphoreError`, so callers can catch the
whole family in one ``except`` and still tell the cases apart by subclass. Each error carries the
context an operator needs to act (the semaphore key, its limit, how long a caller waited) as
attributes, not only in the message.
"""

from __future__ import annotations

from typing import Any


class SemaphoreError(Exception):
    """Root of every error raised by celery_semaphore."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ConfigurationError(SemaphoreError, ValueError):
    """A limit, key, duration or URL that cannot work, caught before anything runs.

    It is also a ``ValueError`` so that code validating its own input the usual way catches it.
    """

    def __init__(self, setting: str, value: Any, reason: str) -> None:
        super().__init__(f"{setting}={value!r}: {reason}")
        self.setting = setting
        self.value = value
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Celery pickles exceptions into results; keep the constructor's arguments.
        return (type(self), (self.setting, self.value, self.reason))


class SemaphoreUnavailable(SemaphoreError):
    """No slot was granted within the time the caller allowed."""

    def __init__(self, key: str, limit: int, waited: float) -> None:
        super().__init__(
            f"semaphore {key!r} (limit {limit}) granted no slot within {waited:.3f} s",
            key=key,
        )
        self.limit = limit
        self.waited = waited

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.limit, self.waited))


class LeaseLost(SemaphoreError):
    """A holder's lease expired (or Redis lost it) before the holder gave it back.

    While a lease is lost, the slot may have been granted to somebody else: the holder can no
    longer count on exclusivity within the limit.
    """

    def __init__(self, key: str, token: str) -> None:
        super().__init__(f"lease {token!r} on semaphore {key!r} was lost", key=key)
        self.token = token

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.token))


class RedisUnavailable(SemaphoreError):
    """Redis could not be reached, even after redis-py's own retries.

    The redis-py error is kept as ``__cause__``.
    """

    def __init__(self, key: str | None, operation: str, error: BaseException) -> None:
        super().__init__(f"{operation} on semaphore {key!r}: Redis unavailable: {error}", key=key)
        self.operation = operation

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.operation, RuntimeError(str(self))))
