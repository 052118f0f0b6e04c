"""What the demo's orchestrator and its worker subprocesses must agree on.

The orchestrator (``python -m example_project``) decides where Redis is, which ports the HTTP
servers got and which keys this run may use; the ``celery worker`` subprocesses must wire the
tasks' app the very same way (``wiring.py``). A single JSON environment variable carries all of
it, because a worker inherits the environment and nothing else. Keeping it in one frozen
dataclass means a field cannot be forgotten on one side.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

ENV_VAR = "CELERY_SEMAPHORE_DEMO"


@dataclass(frozen=True)
class DemoSettings:
    """One demo run's wiring.

    ``prefix`` is the root of every Redis key the run writes itself (spans, counters). When the
    run shares a user's Redis (``REDIS_URL``), ``isolated`` is true: the broker and the result
    backend get a ``global_keyprefix`` under ``prefix`` too, and the semaphore a ``prefix``-based
    key prefix, so the run can delete exactly its own keys at the end and touch nothing else.
    """

    broker_url: str = "redis://127.0.0.1:6379/0"
    semaphore_url: str = "redis://127.0.0.1:6379/1"
    result_url: str = "redis://127.0.0.1:6379/2"
    prefix: str = "demo"
    isolated: bool = False
    queue: str = "demo"
    api_port: int = 0
    crawl_port: int = 0
    # the plain Redis of the demo's own records and crawl frontier: the semaphore's, unless that
    # is a Cluster or Sentinel URL (then the embedded Redis that also carries the broker)
    data_url: str = ""

    @property
    def records_url(self) -> str:
        return self.data_url or self.semaphore_url

    @property
    def semaphore_prefix(self) -> str:
        return f"{self.prefix}:semaphore" if self.isolated else "semaphore"

    @property
    def broker_keyprefix(self) -> str | None:
        return f"{self.prefix}:broker:" if self.isolated else None

    @property
    def result_keyprefix(self) -> str | None:
        return f"{self.prefix}:results:" if self.isolated else None

    def to_env(self) -> dict[str, str]:
        return {ENV_VAR: json.dumps(asdict(self), sort_keys=True)}

    @classmethod
    def from_env(cls) -> DemoSettings:
        """The settings the orchestrator exported; defaults (a local Redis) when run bare, so
        ``import example_project.demo.wiring`` works anywhere, e.g. for linters."""
        raw = os.environ.get(ENV_VAR)
        return cls() if not raw else cls(**json.loads(raw))
