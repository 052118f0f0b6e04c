"""What the demo's orchestrator and its worker subprocesses must agree on.

The orchestrator (``python -m example_project``) decides where Redis is, which ports the HTTP
servers got and which keys this run may use; the ``celery worker`` subprocesses must build the
very same Celery app. A single JSON environment variable carries all of it, because a worker
inherits the environment and nothing else. Keeping it in one frozen dataclass means a field
cannot be forgotten on one side.
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
    api_limit: int = 4
    crawl_port: int = 0

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
        ``import example_project.tasks`` works anywhere, e.g. for linters."""
        raw = os.environ.get(ENV_VAR)
        return cls() if not raw else cls(**json.loads(raw))


class Keys:
    """Names of the Redis keys the tasks write for the orchestrator, all under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def _key(self, *parts: str) -> str:
        return ":".join((self.prefix, "data", *parts))

    @property
    def spans(self) -> str:
        """LIST of JSON spans: one per HTTP call, for the chart and the makespans."""
        return self._key("spans")

    @property
    def ready(self) -> str:
        """SET of worker hostnames that finished starting."""
        return self._key("ready")

    @property
    def pids(self) -> str:
        """SET of pool process ids, so the orchestrator can list every process it caused."""
        return self._key("pids")

    @property
    def errors(self) -> str:
        """LIST of error messages raised by task bodies."""
        return self._key("errors")

    @property
    def seen(self) -> str:
        """SET of ``host/path`` the crawler has scheduled: the dedupe of the crawl."""
        return self._key("crawl", "seen")

    @property
    def hosts(self) -> str:
        """SET of hosts whose robots.txt was (or is being) read."""
        return self._key("crawl", "hosts")

    @property
    def robots(self) -> str:
        """HASH host -> the Crawl-concurrency its robots.txt published (0: none)."""
        return self._key("crawl", "robots")

    @property
    def pending(self) -> str:
        """Crawl work scheduled but not finished; zero when the crawl is complete."""
        return self._key("crawl", "pending")

    def done(self, key: str) -> str:
        """Finished HTTP calls of one key (a semaphore key, or the unprotected run's label)."""
        return self._key("done", key)

    def in_flight(self, key: str) -> str:
        """HTTP calls of one key running right now, as the clients count them."""
        return self._key("in-flight", key)

    def rejected(self, key: str) -> str:
        """Calls of one key answered 429, as the clients count them."""
        return self._key("rejected", key)
