"""The one error family of celery_semaphore.

Every error the package raises derives from :class:`SemaphoreError`, so callers can catch the
whole family in one ``except`` and still tell the cases apart by subclass. Each error carries the
context an operator needs to act (the semaphore key, its limit, how long a caller waited) as
attributes, not only in the message.

Each error's ``args`` are its constructor's arguments: Celery stores a failed task's exception as
its class and args and rebuilds it for ``AsyncResult.get()``, so a caller sees the real class
with its attributes, not a generic stand-in.
"""

from __future__ import annotations

from typing import Any


class SemaphoreError(Exception):
    """Root of every error raised by celery_semaphore."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message, key)
        self.key = key

    def __str__(self) -> str:
        return str(self.args[0])


class ConfigurationError(SemaphoreError, ValueError):
    """A limit, key, duration or URL that cannot work, caught before anything runs.

    It is also a ``ValueError`` so that code validating its own input the usual way catches it.
    """

    def __init__(self, setting: str, value: Any, reason: str) -> None:
        Exception.__init__(self, setting, value, reason)
        self.key = None
        self.setting = setting
        self.value = value
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.setting}={self.value!r}: {self.reason}"


class SemaphoreUnavailable(SemaphoreError):
    """No slot was granted within the time the caller allowed: the ``timeout`` of an
    ``acquire``, or, for a Celery task, its ``semaphore_max_wait`` (then in ``max_wait``); or the
    call was refused a place because ``max_waiters`` calls waited already (then in
    ``max_waiters``), or lost its place to another (then ``evicted`` names the policy)."""

    def __init__(
        self,
        key: str,
        limit: int,
        waited: float,
        max_wait: float | None = None,
        max_waiters: int | None = None,
        evicted: str | None = None,
    ) -> None:
        Exception.__init__(self, key, limit, waited, max_wait, max_waiters, evicted)
        self.key = key
        self.limit = limit
        self.waited = waited
        self.max_wait = max_wait
        # set when the call was refused a place because its line was full (on_full "reject")
        self.max_waiters = max_waiters
        # set when the call lost its place in line to another: the policy, "drop_oldest" (the
        # line was full) or "keep_latest" (a newer call of the same coalesce key took it)
        self.evicted = evicted

    def __str__(self) -> str:
        limit = "no concurrency limit" if self.limit >= NO_LIMIT else f"limit {self.limit}"
        if self.evicted == "keep_latest":
            return (
                f"semaphore {self.key!r} ({limit}): a newer call of the same coalesce key took this "
                "call's place in line (on_full 'keep_latest'); the newer one runs instead"
            )
        if self.evicted is not None:
            return (
                f"semaphore {self.key!r} ({limit}): this call was dropped from its line, the oldest "
                f"waiting when a newer call found {self.max_waiters} waiting, its max_waiters "
                f"(on_full {self.evicted!r}): send it again, or raise max_waiters"
            )
        if self.max_waiters is not None:
            return (
                f"semaphore {self.key!r} ({limit}) refused the call a place in line: "
                f"{self.max_waiters} calls wait already, its max_waiters: send it again later, raise "
                "max_waiters (semaphore_max_waiters), or give the key more slots"
            )
        head = f"semaphore {self.key!r} ({limit}) granted no slot within {self.waited:.3f} s"
        if self.max_wait is None:
            return (
                f"{head}, the acquire's timeout: pass a longer timeout, raise the limit, or look for "
                "holders that do not give their slots back (status())"
            )
        # the operator's remedies, in the order they are usually right
        return (
            f"{head}, the task's semaphore_max_wait of {self.max_wait:g} s: set a longer "
            "semaphore_max_wait (on the task or as a setting), give the key more slots "
            f"(semaphore_limits, or celery semaphore set-limit), or look for holders that do not "
            f"give their slots back (celery semaphore status {self.key})"
        )


# The limit of a semaphore that has a rate or a spacing and no concurrency limit (_core.rules
# names it UNLIMITED; it imports this module, so the value is written here once more).
NO_LIMIT = 2**31 - 1


class LeaseLost(SemaphoreError):
    """A holder's lease expired (or Redis lost it) before the holder gave it back.

    While a lease is lost, the slot may have been granted to somebody else: the holder can no
    longer count on exclusivity within the limit.
    """

    def __init__(self, key: str, token: str) -> None:
        Exception.__init__(self, key, token)
        self.key = key
        self.token = token

    def __str__(self) -> str:
        return f"lease {self.token!r} on semaphore {self.key!r} was lost"


class RedisUnavailable(SemaphoreError):
    """Redis could not be reached, even after redis-py's own retries.

    The redis-py error is kept as ``__cause__``; its text is part of the message.
    """

    def __init__(self, key: str | None, operation: str, error: object) -> None:
        Exception.__init__(self, key, operation, str(error))
        self.key = key
        self.operation = operation

    def __str__(self) -> str:
        return f"{self.operation} on semaphore {self.key!r}: Redis unavailable: {self.args[2]}"
