"""redis-py's errors told as the package's: "not now" (``RedisUnavailable``: callers wait, or
fail closed) or "wrong" (``SemaphoreError``). One place, so that every operation of either
semaphore class tells a failover, a full Redis or a lost connection the same way."""

from __future__ import annotations

from types import TracebackType

import redis
import redis.cluster

from ..errors import RedisUnavailable, SemaphoreError

# Answers that mean "not now" rather than "wrong": the caller should wait and try again.
_NOT_NOW = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)
_CLUSTER_NOT_NOW = (
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.RedisClusterException,
)


# What redis-py raises (RedisClusterException, no node for a slot say, is not a RedisError).
REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


def translate(error: BaseException, name: str, operation: str) -> SemaphoreError:
    """redis-py's error as the package's: unreachable, full, read-only or loading is
    RedisUnavailable (callers wait, fail closed); anything else a SemaphoreError."""
    # a cluster between owners of a slot (failover, resharding) or unreachable is "not now" too
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError, *_CLUSTER_NOT_NOW)):
        return RedisUnavailable(name, operation, error)
    # a full Redis (maxmemory with noeviction) or one still loading its data set is unavailable
    # for now, like an unreachable one: callers wait, they do not fail
    if isinstance(error, redis.ResponseError) and (
        isinstance(error, _NOT_NOW) or str(error).startswith(("OOM", "LOADING", "BUSY", "MASTERDOWN"))
    ):
        return RedisUnavailable(name, operation, error)
    return SemaphoreError(f"{operation} on semaphore {name!r}: {error}", key=name)


class RedisErrors:
    """``with RedisErrors(name, operation):`` redis-py's errors raised inside come out translated
    (``translate``). The hot paths (acquire, release) use a bare ``try`` instead, which costs
    nothing when nothing fails."""

    __slots__ = ("name", "operation")

    def __init__(self, name: str, operation: str) -> None:
        self.name = name
        self.operation = operation

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if error is not None and isinstance(error, REDIS_ERRORS):
            raise translate(error, self.name, self.operation) from error
