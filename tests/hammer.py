"""A process-level client for the hammering tests: acquires and releases in a loop."""

from __future__ import annotations

import time

import redis

from celery_semaphore import FairSemaphore

from .concurrency_probe import ConcurrencyProbe


def hammer(port: int, name: str, limit: int, rounds: int, hold: float) -> int:
    """Acquire, hold ``hold`` seconds while counted by the probe, release; ``rounds`` times."""
    client = redis.Redis(host="127.0.0.1", port=port)
    probe = ConcurrencyProbe(redis.Redis(host="127.0.0.1", port=port, db=1))
    semaphore = FairSemaphore(client, name, limit, lease=30)
    for _ in range(rounds):
        with semaphore.acquire(timeout=60):
            probe.enter()
            time.sleep(hold)  # the work being limited
            probe.leave()
    return rounds
