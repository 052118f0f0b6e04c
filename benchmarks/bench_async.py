"""AsyncFairSemaphore and blocking FairSemaphore callers in one line: limit, order, hand-off, connections.

Run as ``python -m benchmarks.bench_async`` (``--help`` for the flags). The script starts its own
redis-server on a free loopback port and, in one run, on one key of limit 10:

* 1,000 coroutines in one event loop (started one every ``--ramp-ms`` ms), each acquiring once and
  holding 10 ms, with an ``redis.asyncio`` client named ``bench-loop``;
* 2 worker processes, each with ``--threads`` threads of blocking ``FairSemaphore`` callers that
  acquire, hold 10 ms and release in a loop until the coroutines are done.

It reports: the most holders ever seen (a shared counter each holder raises inside its hold, and
``status().holder_count`` sampled every 10 ms); FIFO inversions (pairs of callers started in the
other order than they first asked, out of all pairs, with their ask times at least 1 ms apart);
hand-off latency (each start after the first 10 against the release that freed its slot, the
k-th start against the (k-10)-th release: the line is never empty meanwhile); and the most
connections of the event loop's client at any sample (CLIENT LIST, by client name).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import multiprocessing
import sys
import threading
import time
from typing import Any

import redis
import redis.asyncio

from celery_semaphore import AsyncFairSemaphore, FairSemaphore
from tests.redis_server import LOOPBACK, RedisServer

NAME = "bench-async"
LIMIT = 10
HOLD_S = 0.010
COUNTER = "bench-async:held"
READY = "bench-async:process-holds"  # the coroutines start once both processes hold slots


def _hold(client: redis.Redis) -> int:
    return int(client.incr(COUNTER))


def _process_callers(port: int, threads: int, stop: Any, out: Any) -> None:
    """One worker process: ``threads`` blocking callers in a loop until ``stop`` is set."""
    records: list[tuple[str, float, float, float]] = []
    most = [0]
    lock = threading.Lock()

    def caller() -> None:
        client = redis.Redis(host=LOOPBACK, port=port)
        sem = FairSemaphore(client, NAME, limit=LIMIT)
        while not stop.is_set():
            asked = time.monotonic()
            lease = sem.acquire(timeout=60)
            started = time.monotonic()
            client.incr(READY)
            held = _hold(client)
            time.sleep(HOLD_S)
            client.decr(COUNTER)
            released = time.monotonic()
            lease.release()
            with lock:
                records.append(("process", asked, started, released))
                most[0] = max(most[0], held)

    workers = [threading.Thread(target=caller) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    out.put((records, most[0]))


async def _coroutines(port: int, count: int, ramp_s: float) -> tuple[list[tuple[str, float, float, float]], int]:
    client = redis.asyncio.Redis(host=LOOPBACK, port=port, client_name="bench-loop")
    counter = redis.asyncio.Redis(host=LOOPBACK, port=port)
    sem = AsyncFairSemaphore(client, NAME, limit=LIMIT)
    records: list[tuple[str, float, float, float]] = []
    most = 0

    async def one(delay: float) -> None:
        nonlocal most
        await asyncio.sleep(delay)
        asked = time.monotonic()
        async with sem.acquire(timeout=60):
            started = time.monotonic()
            # the shared counter goes through a client of its own: not the loop's connections
            most = max(most, int(await counter.incr(COUNTER)))
            await asyncio.sleep(HOLD_S)
            await counter.decr(COUNTER)
            released = time.monotonic()
        records.append(("coroutine", asked, started, released))

    await asyncio.gather(*(one(i * ramp_s) for i in range(count)))
    await client.aclose()
    await counter.aclose()
    return records, most


def _sampler(port: int, stop: threading.Event, out: dict[str, int]) -> None:
    client = redis.Redis(host=LOOPBACK, port=port)
    sem = FairSemaphore(client, NAME, limit=LIMIT)
    out.update(holders=0, connections=0, samples=0)
    while not stop.is_set():
        out["holders"] = max(out["holders"], sem.status(listed=0).holder_count)
        names = [entry.get("name") for entry in client.client_list()]
        out["connections"] = max(out["connections"], names.count("bench-loop"))
        out["samples"] += 1
        time.sleep(0.01)


def _inversions(records: list[tuple[str, float, float, float]]) -> tuple[int, int]:
    """Pairs started in the other order than they asked (asks >= 1 ms apart), and all such pairs."""
    by_ask = sorted(records, key=lambda record: record[1])
    asks = [record[1] for record in by_ask]
    inverted = pairs = 0
    for i, (_, asked, started, _) in enumerate(by_ask):
        later = bisect.bisect_left(asks, asked + 0.001, lo=i + 1)
        for other in by_ask[later:]:
            pairs += 1
            inverted += other[2] < started
    return inverted, pairs


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def run(coroutines: int, threads: int, ramp_ms: float) -> dict[str, Any]:
    with RedisServer().start() as server:
        context = multiprocessing.get_context("spawn")
        stop, out = context.Event(), context.Queue()
        processes = [context.Process(target=_process_callers, args=(server.port, threads, stop, out)) for _ in range(2)]
        for process in processes:
            process.start()
        sampled: dict[str, int] = {}
        sampling = threading.Event()
        sampler = threading.Thread(target=_sampler, args=(server.port, sampling, sampled))
        sampler.start()
        watcher = server.client()
        deadline = time.monotonic() + 60
        while int(watcher.get(READY) or 0) < 2 * threads and time.monotonic() < deadline:
            time.sleep(0.01)
        began = time.monotonic()
        records, most = asyncio.run(_coroutines(server.port, coroutines, ramp_ms / 1000))
        took = time.monotonic() - began
        stop.set()
        for _ in processes:
            process_records, process_most = out.get(timeout=120)
            records += process_records
            most = max(most, process_most)
        for process in processes:
            process.join(60)
        sampling.set()
        sampler.join()
    starts = sorted(record[2] for record in records)
    releases = sorted(record[3] for record in records)
    hand_offs = [(starts[k] - releases[k - LIMIT]) * 1000 for k in range(LIMIT, len(starts))]
    inverted, pairs = _inversions(records)
    return {
        "coroutines": coroutines,
        "process_holds": sum(1 for record in records if record[0] == "process"),
        "coroutine_seconds": round(took, 2),
        "most_holders_counter": most,
        "most_holders_status": sampled["holders"],
        "status_samples": sampled["samples"],
        "fifo_inversions": inverted,
        "fifo_pairs": pairs,
        "fifo_inverted_percent": round(100 * inverted / max(pairs, 1), 3),
        "hand_off_p50_ms": round(_percentile(hand_offs, 0.50), 2),
        "hand_off_p99_ms": round(_percentile(hand_offs, 0.99), 2),
        "loop_connections_max": sampled["connections"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_async", description=__doc__.split("\n")[0])
    parser.add_argument("--coroutines", type=int, default=1000, help="coroutines in the loop (default 1000)")
    parser.add_argument("--threads", type=int, default=5, help="blocking callers per worker process (default 5)")
    parser.add_argument("--ramp-ms", type=float, default=1.0, help="ms between two coroutines' starts (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    result = run(args.coroutines, args.threads, args.ramp_ms)
    for key, value in result.items():
        print(f"{key:24} {value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(result, file, indent=2)
    ok = (
        max(result["most_holders_counter"], result["most_holders_status"]) <= LIMIT
        and result["fifo_inverted_percent"] <= 1.0
        and result["hand_off_p50_ms"] <= 2.0
        and result["hand_off_p99_ms"] <= 10.0
        and result["loop_connections_max"] <= 3
    )
    print("targets met" if ok else "targets NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
