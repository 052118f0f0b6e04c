"""The Redis servers behind real-worker tests and the Celery benchmark.

A plain module, not part of conftest.py, because ``benchmarks.bench_celery`` needs the same
servers outside pytest: importing a conftest there would register its fixtures and hooks, or
fail, depending on how it is loaded.
"""

from __future__ import annotations

import contextlib

from .redis_server import RedisServer

__all__ = ["CeleryStack"]


class CeleryStack:
    """A broker Redis and a separate semaphore Redis for worker tests, and the env that points
    the test app (tests/proj/app.py) at them: the test process and its workers share it."""

    def __init__(self) -> None:
        self.broker = RedisServer().start()
        self.semaphore = RedisServer().start()
        self.env = {
            "PROJ_BROKER_URL": f"{self.broker.url[:-2]}/0",
            "PROJ_RESULT_URL": f"{self.broker.url[:-2]}/2",
            "PROJ_PROBE_URL": f"{self.broker.url[:-2]}/3",
            "PROJ_SEMAPHORE_URL": f"{self.semaphore.url[:-2]}/1",
        }

    def close(self) -> None:
        for server in (self.broker, self.semaphore):
            with contextlib.suppress(Exception):
                server.__exit__()
