"""What one key's line costs Redis as it grows in waiters and tenants: the server time of a join,
and of a release that hands the slot on plus the claim of it, read from INFO commandstats.

The fair-share tests and ``benchmarks/bench_tenants.py`` (``--scenarios cost``) share it, so that
"within 2x of 10 tenants" means the same thing in both. A line of many waiters is built with the
acquire script itself, pipelined (the same script run a blocked caller's first ask makes), so a
line of 100,000 takes seconds to build.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from celery_semaphore import FairSemaphore
from celery_semaphore._core import script_calls
from celery_semaphore._core.attempts import Ask, new_token
from celery_semaphore._core.tenants import Tenant

from .commandstats import command_calls, scripted

# joins sent in one pipeline while the line is built
BATCH = 2000


@dataclass(frozen=True)
class LineCost:
    """Server microseconds per script run: a join (a new waiter placed), and a hand-off cycle
    (a release offering the slot to the head, and that waiter's claim), each the median over
    ``rounds`` rounds; and the Redis calls of one cycle (the same whatever the line's size)."""

    join_us: float
    cycle_us: float
    cycle_calls: float


def _evalsha_usec(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {"usec": 0, "calls": 0})
    return int(stats["usec"]), int(stats["calls"])


def _scripted_calls(client: redis.Redis, lookups: int) -> int:
    """The calls the scripts made since the last reset, less this module's own ``lookups``
    (one ZRANGEBYSCORE each)."""
    counts = command_calls(client)
    counts["zrangebyscore"] = counts.get("zrangebyscore", 0) - lookups
    return scripted(counts)


def _ask(
    semaphore: FairSemaphore, token: str, waiter: str, *, fresh: bool, line: script_calls.LineArgs | None
) -> script_calls.ScriptCall[Any]:
    """The acquire script's call for one ask of ``waiter`` (a long lease and patience: the line
    must outlive its measurement)."""
    return script_calls.acquire(
        semaphore.keys,
        token=token,
        waiter=waiter,
        rules=semaphore.rules,
        lease_ms=600_000,
        patience_ms=3_600_000,
        enqueue=1,
        fresh=fresh,
        label="",
        ticket=None,
        wake="",
        line=line,
    )


def join_all(semaphore: FairSemaphore, tenant_of: Callable[[int], Tenant | None], first: int, count: int) -> None:
    """``count`` new waiters "w<n>" (n from ``first``) join the line, each for ``tenant_of(n)``."""
    client = semaphore.client
    sha = semaphore._scripts._scripts["acquire"]._sha
    pipe = client.pipeline(transaction=False)
    for n in range(first, first + count):
        ask = Ask(token=f"t{n}", waiter=f"w{n}", tenant=tenant_of(n), patience=3600)
        call = _ask(semaphore, ask.token, ask.waiter, fresh=True, line=semaphore._line_args(ask))
        pipe.evalsha(sha, len(call.keys), *call.keys, *call.args)
        if len(pipe) >= BATCH:
            pipe.execute()
    pipe.execute()


def line_cost(
    client: redis.Redis,
    name: str,
    waiters: int,
    tenant_of: Callable[[int], Tenant | None],
    *,
    rounds: int = 5,
    per_round: int = 100,
) -> LineCost:
    """Build a line of ``waiters`` behind one held slot (limit 1), then measure ``rounds`` rounds
    of ``per_round`` joins and of ``per_round`` hand-off cycles. The key is reset afterwards."""
    semaphore = FairSemaphore(client, name, 1, patience=3600)
    semaphore.reset()
    holder = new_token()
    assert semaphore._try(Ask(token=holder, waiter=new_token())).granted
    join_all(semaphore, tenant_of, 0, waiters)
    joins, cycles, calls = [], [], []
    joined = waiters
    for _ in range(rounds):
        client.config_resetstat()
        join_all(semaphore, tenant_of, joined, per_round)
        usec, runs = _evalsha_usec(client)
        joins.append(usec / runs)
        joined += per_round
        client.config_resetstat()
        for _ in range(per_round):
            semaphore.release(holder)
            offered: list[bytes] = client.zrangebyscore(semaphore.keys.holders, "-inf", 0, start=0, num=1)  # type: ignore[assignment]
            waiter = offered[0].decode()[1:]  # "!<waiter>", scored minus its claim deadline
            holder = new_token()
            claim = _ask(semaphore, holder, waiter, fresh=False, line=None)
            semaphore._scripts.run(claim)
        usec, runs = _evalsha_usec(client)
        cycles.append(usec / (runs / 2))
        calls.append(_scripted_calls(client, per_round) / per_round)
    semaphore.reset()
    return LineCost(statistics.median(joins), statistics.median(cycles), statistics.median(calls))
