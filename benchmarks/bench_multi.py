"""Cost of a multi-key acquire against a one-key acquire, in the same run.

Run as ``python -m benchmarks.bench_multi`` (``--help`` for the flags). The script starts its own
redis-server on a free loopback port and measures, one client, uncontended (a limit that never
refuses), one acquire(timeout=0) + release cycle of:

* ``fair-1``: FairSemaphore, one key (the single-key scripts);
* ``multi-1``: MultiSemaphore over that one key, weight 1 (acquire_many / release_many);
* ``multi-1-w3``: MultiSemaphore over one key, weight 3;
* ``multi-2``: MultiSemaphore over two keys (per host + total), weight 1;
* ``multi-4``: MultiSemaphore over four keys.

The cases run in interleaved rounds (``--rounds``), so noise on a shared host hits each alike;
the ratio of each case's cycle time to ``fair-1`` is taken per round, and reported as its median
with the min and max over rounds. The same for the Redis server time of the scripts per cycle
(INFO commandstats, EVALSHA usec), which a loaded client host disturbs less. Also the Redis calls
one cycle makes inside its scripts, which do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import redis

from celery_semaphore import FairSemaphore, MultiSemaphore
from tests.commandstats import command_calls, scripted
from tests.redis_server import RedisServer


def cases(client: redis.Redis) -> dict[str, Callable[[], None]]:
    fair = FairSemaphore(client, "bench:one", 1000, lease=60)
    host = FairSemaphore(client, "bench:host", 1000, lease=60)
    total = FairSemaphore(client, "bench:total", 1000, lease=60)
    extra = [FairSemaphore(client, f"bench:extra{i}", 1000, lease=60) for i in range(2)]
    one = MultiSemaphore([fair])
    one_w3 = MultiSemaphore([fair], weight=3)
    two = MultiSemaphore([host, total])
    four = MultiSemaphore([host, total, *extra])
    return {
        "fair-1": lambda: fair.acquire(timeout=0).release() and None,
        "multi-1": lambda: one.acquire(timeout=0).release() and None,
        "multi-1-w3": lambda: one_w3.acquire(timeout=0).release() and None,
        "multi-2": lambda: two.acquire(timeout=0).release() and None,
        "multi-4": lambda: four.acquire(timeout=0).release() and None,
    }


def scripted_calls(client: redis.Redis, cycle: Callable[[], None]) -> int:
    cycle()
    client.config_resetstat()
    cycle()
    return scripted(command_calls(client))


def server_us(client: redis.Redis, cycle: Callable[[], None], cycles: int = 2000) -> float:
    """Redis server time (INFO commandstats, EVALSHA usec) per cycle: what the scripts cost the
    server, less exposed than the wall clock to a loaded client host."""
    client.config_resetstat()
    for _ in range(cycles):
        cycle()
    return int(client.info("commandstats")["cmdstat_evalsha"]["usec"]) / cycles


def time_cycles(cycle: Callable[[], None], seconds: float) -> float:
    """Microseconds per cycle over ``seconds``."""
    count = 0
    started = time.perf_counter()
    deadline = started + seconds
    while True:
        for _ in range(50):
            cycle()
        count += 50
        now = time.perf_counter()
        if now >= deadline:
            return (now - started) / count * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_multi", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="duration of each case per round (default 1)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)

    with RedisServer() as server:
        client = server.client()
        version = client.info("server")["redis_version"]
        named = cases(client)
        calls = {name: scripted_calls(client, cycle) for name, cycle in named.items()}
        for cycle in named.values():  # warm up: scripts loaded, connections open
            time_cycles(cycle, 0.2)
        per_round: dict[str, list[float]] = {name: [] for name in named}
        server: dict[str, list[float]] = {name: [] for name in named}
        for round_number in range(args.rounds):
            order = list(named) if round_number % 2 == 0 else list(reversed(named))
            for name in order:
                per_round[name].append(time_cycles(named[name], args.seconds))
                server[name].append(server_us(client, named[name], cycles=500))
        client.close()

    base = per_round["fair-1"]
    print(
        f"# bench_multi: redis {version}, python {platform.python_version()}, {args.rounds} rounds x "
        f"{args.seconds} s per case, one client, uncontended"
    )
    print(
        f"{'case':<12} {'us/cycle':>9} {'ratio to fair-1 (min..max)':>28} {'server us':>10} "
        f"{'server ratio (min..max)':>24} {'redis calls':>12}"
    )
    results = {}
    for name, times in per_round.items():
        ratios = [t / b for t, b in zip(times, base, strict=True)]
        server_ratios = [t / b for t, b in zip(server[name], server["fair-1"], strict=True)]
        results[name] = {
            "us_per_cycle_median": statistics.median(times),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "server_us_per_cycle_median": statistics.median(server[name]),
            "server_ratio_median": statistics.median(server_ratios),
            "server_ratio_min": min(server_ratios),
            "server_ratio_max": max(server_ratios),
            "scripted_calls": calls[name],
        }
        spread = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f})"
        server_spread = f"{statistics.median(server_ratios):.2f} ({min(server_ratios):.2f}..{max(server_ratios):.2f})"
        print(
            f"{name:<12} {statistics.median(times):>9.1f} {spread:>28} {statistics.median(server[name]):>10.1f} "
            f"{server_spread:>24} {calls[name]:>12}"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(
                {"redis": version, "rounds": args.rounds, "seconds": args.seconds, "results": results}, out, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
