"""Fair share between tenants on one key: the core semaphore with real threads.

Run as ``python -m benchmarks.bench_tenants`` (``--help`` for the flags). The script starts its
own redis-server on a free loopback port and runs, in interleaved rounds:

* ``flood``: tenant A sends ``--flood`` calls (1,000) of 50 ms to a key of limit 4, each in a
  thread of its own; tenant B sends 20 one second later. Reported: how long B's first call
  waited from its arrival to its start, B's calls' waits (p50, p99), and when B's last and A's
  last finished, with ``tenant=`` and without (first come, first served), in the same round.
* ``equal``: 10 tenants, 4 threads each, saturate a key of limit 4 (calls of 20 ms, each thread
  asking again at once) for ``--seconds``: Jain's fairness index of the starts per tenant
  (1.0: perfectly even).
* ``shares``: two tenants of shares 3 and 1, 8 threads each, the same way: the share of starts
  the first one got (the target is 75 %).
* ``levels``: two levels, (org, user). Org "one" calls under one user name from 50 threads, org
  "fifty" under 50 user names, one thread each, saturating the key the same way: the share of
  starts org "one" got (the target: no less than half), and the same threads with the user
  names alone as one-level tenants for comparison. And the flood inside one org: user A of org
  "acme" sends the flood, user B of acme the 20 a second later (``tenant=("acme", user)``).
* ``cost`` (not in the default set): a line of ``--waiters`` (100,000) behind one held slot,
  over 10 tenants, over 10,000, over 10 users of 10 orgs and over 10,000 users of 100 orgs:
  the server time of a join and of a hand-off cycle (a release offering the slot, and the
  claim), from INFO commandstats (``tests/line_cost.py``), and their ratios to 10 tenants'.

What it shows is the order the acquire script gives; the threads hold the slot with a sleep, so
the machine's speed shows only in the hand-off between one call and the next.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from celery_semaphore import FairSemaphore
from celery_semaphore._core.tenants import Tenant
from tests.line_cost import line_cost
from tests.redis_server import RedisServer

LIMIT = 4
FLOOD_HOLD = 0.05
LOOP_HOLD = 0.02
B_CALLS = 20
B_AFTER = 1.0
# levels: threads per org; org "one" asks under one user name, org "fifty" under one a thread
ORG_THREADS = {"one": 50, "fifty": 50}
# cost: the lines measured, by what their waiters ask as (the first is the baseline)
COST_LINES: dict[str, Callable[[int], Tenant | None]] = {
    "10 tenants": lambda n: f"t{n % 10}",
    "10,000 tenants": lambda n: f"t{n % 10_000}",
    "10 users of 10 orgs": lambda n: (f"o{n % 10}", f"u{n % 10}"),
    "10,000 users of 100 orgs": lambda n: (f"o{n % 100}", f"u{(n // 100) % 100}"),
    "no tenant": lambda n: None,
}


@dataclass
class Starts:
    """Calls' start times, by tenant, kept under a lock (threads append)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    by_tenant: dict[str, list[float]] = field(default_factory=dict)
    ends: dict[str, float] = field(default_factory=dict)

    def start(self, tenant: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.by_tenant.setdefault(tenant, []).append(now)

    def end(self, tenant: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.ends[tenant] = max(self.ends.get(tenant, 0.0), now)


def flood(client: redis.Redis, name: str, *, calls: int, fair: bool, org: str | None = None) -> dict[str, float]:
    """One flood run: A's ``calls`` at once, B's 20 a second later. Seconds, from B's arrival.
    ``org``: A and B are users of that org (two levels)."""
    semaphore = FairSemaphore(client, name, LIMIT, patience=30)
    starts = Starts()
    b_waits: list[float] = []

    def call(tenant: str, waits: list[float] | None) -> None:
        asked = time.monotonic()
        as_tenant: Tenant | None = tenant if org is None else (org, tenant)
        with semaphore.acquire(timeout=600, tenant=as_tenant if fair else None):
            starts.start(tenant)
            if waits is not None:
                waits.append(time.monotonic() - asked)
            time.sleep(FLOOD_HOLD)
        starts.end(tenant)

    threads = [threading.Thread(target=call, args=("A", None), daemon=True) for _ in range(calls)]
    for thread in threads:
        thread.start()
    time.sleep(B_AFTER)
    b_arrived = time.monotonic()
    b_threads = [threading.Thread(target=call, args=("B", b_waits), daemon=True) for _ in range(B_CALLS)]
    for thread in b_threads:
        thread.start()
    for thread in threads + b_threads:
        thread.join()
    ordered = sorted(b_waits)
    return {
        "b_first_wait": min(starts.by_tenant["B"]) - b_arrived,
        "b_wait_p50": statistics.median(ordered),
        "b_wait_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "b_done": starts.ends["B"] - b_arrived,
        "a_done": starts.ends["A"] - b_arrived,
    }


def saturate(
    client: redis.Redis,
    name: str,
    threads_of: dict[str, int],
    shares: dict[str, float],
    seconds: float,
    tenant_of: Callable[[str, int], Tenant] | None = None,
) -> dict[str, int]:
    """Threads of each tenant call again and again for ``seconds``: starts per tenant (the
    keys of ``threads_of``). ``tenant_of(tenant, thread number)``: what a thread asks as
    (default: the tenant itself)."""
    semaphore = FairSemaphore(client, name, LIMIT, patience=30, shares=shares)
    starts = Starts()
    stop = threading.Event()

    def loop(tenant: str, number: int) -> None:
        as_tenant = tenant if tenant_of is None else tenant_of(tenant, number)
        while not stop.is_set():
            with semaphore.acquire(timeout=60, tenant=as_tenant):
                if not stop.is_set():
                    starts.start(tenant)
                time.sleep(LOOP_HOLD)

    threads = [
        threading.Thread(target=loop, args=(tenant, number), daemon=True)
        for tenant, count in threads_of.items()
        for number in range(count)
    ]
    for thread in threads:
        thread.start()
    # the first second fills the line; starts are counted after it
    time.sleep(1.0)
    with starts.lock:
        starts.by_tenant.clear()
    time.sleep(seconds)
    with starts.lock:
        counted = {tenant: len(starts.by_tenant.get(tenant, [])) for tenant in threads_of}
    stop.set()
    for thread in threads:
        thread.join()
    return counted


def jain(values: list[int]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


def spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    scaled = [v * scale for v in values]
    return f"{statistics.median(scaled):.{digits}f} (min {min(scaled):.{digits}f}, max {max(scaled):.{digits}f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flood", type=int, default=1000, help="tenant A's calls in the flood (default 1000)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the equal and shares runs")
    parser.add_argument("--scenarios", default="flood,equal,shares,levels")
    parser.add_argument("--waiters", type=int, default=100_000, help="the line's length in the cost scenario")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    threading.stack_size(256 * 1024)  # a thousand waiting threads
    results: dict[str, list[dict[str, float]]] = {}
    with RedisServer() as server:
        client = server.client(max_connections=2000)
        for round_ in range(args.rounds):
            runs: dict[str, Callable[[], dict[str, float]]] = {}
            if "flood" in scenarios:
                runs["flood-fair"] = lambda r=round_: flood(client, f"flood-fair-{r}", calls=args.flood, fair=True)
                runs["flood-fifo"] = lambda r=round_: flood(client, f"flood-fifo-{r}", calls=args.flood, fair=False)
            if "equal" in scenarios:

                def equal(r: int = round_) -> dict[str, float]:
                    counts = saturate(client, f"equal-{r}", {f"t{n}": 4 for n in range(10)}, {}, args.seconds)
                    return {"jain": jain(list(counts.values())), "starts": float(sum(counts.values()))}

                runs["equal"] = equal
            if "shares" in scenarios:

                def shares(r: int = round_) -> dict[str, float]:
                    counts = saturate(client, f"shares-{r}", {"big": 8, "small": 8}, {"big": 3}, args.seconds)
                    return {"big_share": counts["big"] / max(1, counts["big"] + counts["small"])}

                runs["shares"] = shares
            if "levels" in scenarios:

                def user_of(org: str, number: int) -> str:
                    return "u" if org == "one" else f"user-{number}"

                def levels(r: int = round_) -> dict[str, float]:
                    counts = saturate(
                        client, f"levels-{r}", ORG_THREADS, {}, args.seconds, lambda org, n: (org, user_of(org, n))
                    )
                    return {"one_share": counts["one"] / max(1, sum(counts.values()))}

                def users_alone(r: int = round_) -> dict[str, float]:
                    counts = saturate(
                        client,
                        f"users-alone-{r}",
                        ORG_THREADS,
                        {},
                        args.seconds,
                        lambda org, n: f"{org}.{user_of(org, n)}",
                    )
                    return {"one_share": counts["one"] / max(1, sum(counts.values()))}

                runs["levels"] = levels
                runs["levels-users-alone"] = users_alone
                runs["flood-in-org"] = lambda r=round_: flood(
                    client, f"flood-in-org-{r}", calls=args.flood, fair=True, org="acme"
                )
            if "cost" in scenarios:
                for label, tenant_of in COST_LINES.items():

                    def cost(tenant_of: Callable[[int], Tenant | None] = tenant_of) -> dict[str, float]:
                        measured = line_cost(client, "cost", args.waiters, tenant_of)
                        return {"join_us": measured.join_us, "cycle_us": measured.cycle_us}

                    runs[f"cost {label}"] = cost
            for name, run in runs.items():
                outcome = run()
                results.setdefault(name, []).append(outcome)
                print(
                    f"round {round_ + 1} {name}: " + ", ".join(f"{k}={v:.3f}" for k, v in outcome.items()),
                    file=sys.stderr,
                )
        client.close()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"# bench_tenants: limit {LIMIT}, {args.rounds} rounds, Python {platform.python_version()}")
    for name in ("flood-fair", "flood-fifo", "flood-in-org"):
        if name in results:
            runs_ = results[name]
            print(
                f"{name}: B's first start after its arrival {spread([r['b_first_wait'] for r in runs_], 1000, 0)} ms;"
                f" B's waits p50 {spread([r['b_wait_p50'] for r in runs_], 1000, 0)} ms,"
                f" p99 {spread([r['b_wait_p99'] for r in runs_], 1000, 0)} ms;"
                f" B done {spread([r['b_done'] for r in runs_], 1, 2)} s,"
                f" A done {spread([r['a_done'] for r in runs_], 1, 2)} s"
            )
    if "equal" in results:
        print(f"equal (10 tenants): Jain's index {spread([r['jain'] for r in results['equal']], 1, 4)}")
    if "shares" in results:
        print(
            f"shares 3:1: the share-3 tenant's starts {spread([r['big_share'] for r in results['shares']], 100, 1)} %"
        )
    for label in COST_LINES:
        name = f"cost {label}"
        if name in results:
            base = results[f"cost {next(iter(COST_LINES))}"]
            join = [r["join_us"] / b["join_us"] for r, b in zip(results[name], base, strict=True)]
            cycle = [r["cycle_us"] / b["cycle_us"] for r, b in zip(results[name], base, strict=True)]
            print(
                f"{args.waiters} waiters over {label}: join {spread([r['join_us'] for r in results[name]], 1, 1)} us"
                f" ({spread(join, 1, 2)}x), release + claim {spread([r['cycle_us'] for r in results[name]], 1, 1)} us"
                f" ({spread(cycle, 1, 2)}x)"
            )
    for name, what in (("levels", "two levels"), ("levels-users-alone", "the user names alone as tenants")):
        if name in results:
            print(
                f"org of 1 user against org of 50 users, {what}: the 1-user org's starts"
                f" {spread([r['one_share'] for r in results[name]], 100, 1)} %"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
