"""What Redis ran, from INFO commandstats: the counting the script-cost tests and the benchmarks
share, so that "Redis calls per operation" means the same thing in both."""

from __future__ import annotations

from collections.abc import Iterable

import redis

# Commands a measurement's client runs around the scripts (loading them, resetting and reading
# the stats, connecting, publishing a wake-up): not the scripts' work.
NOT_SCRIPTED = frozenset(
    {"evalsha", "eval", "info", "config", "config|resetstat", "script", "script|load", "ping", "hello", "client",
     "publish"}
)  # fmt: skip


def command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT (commands run by scripts included)."""
    return {name.removeprefix("cmdstat_"): int(stat["calls"]) for name, stat in client.info("commandstats").items()}


def scripted(counts: dict[str, int], also_not: Iterable[str] = ()) -> int:
    """The calls of ``counts`` that the scripts made (less ``also_not``, other commands a
    measurement runs itself)."""
    skip = NOT_SCRIPTED | frozenset(also_not)
    return sum(n for name, n in counts.items() if name not in skip)
