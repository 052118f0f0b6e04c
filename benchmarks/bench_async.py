"""AsyncFairSemaphore and blocking FairSemaphore callers in one line: limit, order, hand-off, connections.

Run as ``python -m benchmarks.bench_async`` (``--help`` for the flags). The script starts its own
redis-server on a free loopback port and, in one run, on one key of limit 10:

* 1,000 coroutines in one event loop (started one every ``--ramp-ms`` ms), each acquiring once and
  holding 10 ms, with an ``redis.asyncio`` client named ``bench-loop``;
* 2 worker processes, each with ``--threads`` threads of blocking ``FairSemaphore`` callers that
  acquire, hold 10 ms and release in a loop until the coroutines are done.

It reports: the most holders ever seen (a shared counter each holder raises inside its hold, and
``status().holder_count`` sampled every 10 ms); FIFO inversions, judged by the order callers
joined the line: the ticket Redis gave a caller's first refused try (a pair of callers is
inverted when the one with the later ticket started first; a caller granted at its first ask
took no ticket and is counted apart, in no pair); each kind's wait (ask to start); hand-off
latency (each start after the first 10 against the moment a holder let go of the slot that it
took, the k-th start against the (k-10)-th release, a release timed as the holder sends it: the
line is never empty meanwhile); and the most connections of the event loop's client at any
sample (CLIENT LIST, by client name).

Then, on another key of limit 1 held by one coroutine, ``--cancel-rounds`` times: 500 coroutines
join its line, and once all 500 stand in it (``status().waiter_count``) they are all cancelled at
once; it reports the ms from the cancel until the line is empty again (status asked every ms),
each round's figure.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import json
import multiprocessing
import sys
import threading
import time
from typing import Any

import redis
import redis.asyncio

from celery_semaphore import AsyncFairSemaphore, FairSemaphore, Waiting
from celery_semaphore._core.async_waiting import Asking, AsyncAttempt
from celery_semaphore._core.attempts import Ask, Attempt
from tests.redis_server import LOOPBACK, RedisServer

NAME = "bench-async"
LIMIT = 10
HOLD_S = 0.010
COUNTER = "bench-async:held"
READY = "bench-async:process-holds"  # the coroutines start once both processes hold slots
CANCELLED = 500  # waiters cancelled at once, in each cancel round


# (kind, asked, started, released, ticket): times in time.monotonic() seconds (one clock for every
# process of the machine); ticket None for a caller granted at its first ask
Record = tuple[str, float, float, float, "int | None"]


class _TicketedSemaphore(FairSemaphore):
    """FairSemaphore noting the ticket of each acquire's first refused try, by lease token."""

    tickets: dict[str, int]

    def _try(self, ask: Ask) -> Attempt:
        attempt = super()._try(ask)
        if isinstance(attempt, Waiting) and attempt.ticket is not None:
            self.tickets.setdefault(ask.token, attempt.ticket)
        return attempt


class _TicketedAsyncSemaphore(AsyncFairSemaphore):
    """AsyncFairSemaphore noting the ticket of each acquire's first refused try, by lease token."""

    tickets: dict[str, int]

    async def _try(self, ask: Ask, asking: Asking, *, urgent: bool = True) -> AsyncAttempt:
        attempt = await super()._try(ask, asking, urgent=urgent)
        if isinstance(attempt, Waiting) and attempt.ticket is not None:
            self.tickets.setdefault(ask.token, attempt.ticket)
        return attempt


def _hold(client: redis.Redis) -> int:
    return int(client.incr(COUNTER))


def _process_callers(port: int, threads: int, stop: Any, out: Any) -> None:
    """One worker process: ``threads`` blocking callers in a loop until ``stop`` is set."""
    _collect_start_up_garbage()
    records: list[Record] = []
    most = [0]
    lock = threading.Lock()

    def caller() -> None:
        client = redis.Redis(host=LOOPBACK, port=port)
        sem = _TicketedSemaphore(client, NAME, limit=LIMIT)
        sem.tickets = {}
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
                records.append(("process", asked, started, released, sem.tickets.pop(lease.token, None)))
                most[0] = max(most[0], held)

    workers = [threading.Thread(target=caller) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    out.put((records, most[0]))


async def _coroutines(port: int, count: int, ramp_s: float) -> tuple[list[Record], int]:
    client = redis.asyncio.Redis(host=LOOPBACK, port=port, client_name="bench-loop")
    counter = redis.asyncio.Redis(host=LOOPBACK, port=port)
    sem = _TicketedAsyncSemaphore(client, NAME, limit=LIMIT)
    sem.tickets = {}
    records: list[Record] = []
    most = 0

    async def one(delay: float) -> None:
        nonlocal most
        await asyncio.sleep(delay)
        asked = time.monotonic()
        async with sem.acquire(timeout=60) as lease:
            started = time.monotonic()
            # the shared counter goes through a client of its own: not the loop's connections
            most = max(most, int(await counter.incr(COUNTER)))
            await asyncio.sleep(HOLD_S)
            await counter.decr(COUNTER)
            released = time.monotonic()  # as the release is sent, as a blocking caller's
        records.append(("coroutine", asked, started, released, sem.tickets.pop(lease.token, None)))

    await asyncio.gather(*(one(i * ramp_s) for i in range(count)))
    await client.aclose()
    await counter.aclose()
    return records, most


async def _cancelling(port: int, waiters: int, rounds: int) -> list[float]:
    """Each round: ``waiters`` coroutines in line behind a holder, all cancelled at once; the ms
    until none of them is left in the line."""
    client = redis.asyncio.Redis(host=LOOPBACK, port=port)
    sem = AsyncFairSemaphore(client, NAME + "-cancel", limit=1)
    holder = await sem.acquire()
    took = []

    async def in_line() -> None:
        await sem.acquire(timeout=60)  # never granted: the holder keeps the one slot

    for _ in range(rounds):
        line = [asyncio.ensure_future(in_line()) for _ in range(waiters)]
        while (await sem.status(listed=0)).waiter_count < waiters:
            await asyncio.sleep(0.005)
        started = time.monotonic()
        for waiter in line:
            waiter.cancel()
        while (await sem.status(listed=0)).waiter_count > 0:
            await asyncio.sleep(0.001)
        took.append(round((time.monotonic() - started) * 1000, 1))
        await asyncio.gather(*line, return_exceptions=True)
    await holder.release()
    await client.aclose()
    return took


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


def _scripts_run(client: redis.Redis) -> int:
    """Scripts the server has run so far (EVALSHA and EVAL calls, INFO commandstats)."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval"))


def _inversions(records: list[Record]) -> tuple[int, int]:
    """Pairs of ticketed callers that started in the other order than their tickets, and all
    such pairs (a merge count: n log n)."""
    starts = [record[2] for record in sorted(records, key=lambda record: record[4] or 0) if record[4] is not None]
    return _count_inversions(starts), len(starts) * (len(starts) - 1) // 2


def _count_inversions(values: list[float]) -> int:
    if len(values) < 2:
        return 0
    middle = len(values) // 2
    left, right = sorted(values[:middle]), sorted(values[middle:])
    inverted = _count_inversions(values[:middle]) + _count_inversions(values[middle:])
    for value in right:  # each later-ticket start before an earlier-ticket one
        inverted += len(left) - bisect.bisect_right(left, value)
    return inverted


def _percentile(values: list[float], fraction: float) -> float:
    if not values:  # no blocking callers (--threads 0)
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def _collect_start_up_garbage() -> None:
    """One full collection before measuring, in each process of the benchmark.

    Each process here is new: its heap is what importing redis-py, the package and the benchmark
    made, and the collector has never run a full pass over it (the first one falls due once that
    heap has gone through the younger generations, in the first second of the coroutines). That
    one pass over the start-up heap, some 20-50 ms, stalls every hand-off behind it, whatever
    the code under test does; a long-running service paid it long ago. So it runs here, before
    the clock starts. Nothing else about the collector is changed: its thresholds are Python's,
    and every collection the measured phase causes falls in it."""
    gc.collect()


def run(coroutines: int, threads: int, ramp_ms: float, cancel_rounds: int = 5) -> dict[str, Any]:
    _collect_start_up_garbage()
    with RedisServer() as server:
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
        scripts_before, samples_before = _scripts_run(watcher), sampled["samples"]
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
        # the sampler's status calls are scripts too, one per sample: not the callers' work
        scripts = _scripts_run(watcher) - scripts_before - (sampled["samples"] - samples_before)
        sampling.set()
        sampler.join()
        cancelled = asyncio.run(_cancelling(server.port, CANCELLED, cancel_rounds)) if cancel_rounds else []
    by_start = sorted(records, key=lambda record: record[2])
    releases = sorted(record[3] for record in records)
    hand_offs = [(by_start[k][2] - releases[k - LIMIT]) * 1000 for k in range(LIMIT, len(by_start))]
    to_kind = {
        kind: [ms for ms, record in zip(hand_offs, by_start[LIMIT:], strict=True) if record[0] == kind]
        for kind in ("coroutine", "process")
    }
    inverted, pairs = _inversions(records)
    waits = {
        kind: [(record[2] - record[1]) * 1000 for record in records if record[0] == kind]
        for kind in ("coroutine", "process")
    }
    return {
        "coroutines": coroutines,
        "process_holds": sum(1 for record in records if record[0] == "process"),
        "granted_at_first_ask": sum(1 for record in records if record[4] is None),
        "coroutine_wait_p50_ms": round(_percentile(waits["coroutine"], 0.50), 1),
        "process_wait_p50_ms": round(_percentile(waits["process"], 0.50), 1),
        "coroutine_seconds": round(took, 2),
        "most_holders_counter": most,
        "most_holders_status": sampled["holders"],
        "status_samples": sampled["samples"],
        "fifo_inversions": inverted,
        "fifo_pairs": pairs,
        "fifo_inverted_percent": round(100 * inverted / max(pairs, 1), 3),
        "hand_off_p50_ms": round(_percentile(hand_offs, 0.50), 2),
        "hand_off_p99_ms": round(_percentile(hand_offs, 0.99), 2),
        "hand_off_to_coroutine_p50_p99_ms": [round(_percentile(to_kind["coroutine"], f), 2) for f in (0.5, 0.99)],
        "hand_off_to_process_p50_p99_ms": [round(_percentile(to_kind["process"], f), 2) for f in (0.5, 0.99)],
        "loop_connections_max": sampled["connections"],
        "scripts_per_hold": round(scripts / max(len(records), 1), 2),
        "cancel_500_to_empty_ms": cancelled,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_async", description=__doc__.split("\n")[0])
    parser.add_argument("--coroutines", type=int, default=1000, help="coroutines in the loop (default 1000)")
    parser.add_argument("--threads", type=int, default=5, help="blocking callers per worker process (default 5)")
    parser.add_argument("--ramp-ms", type=float, default=1.0, help="ms between two coroutines' starts (default 1)")
    parser.add_argument("--cancel-rounds", type=int, default=5, help="rounds of 500 cancelled waiters (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    result = run(args.coroutines, args.threads, args.ramp_ms, args.cancel_rounds)
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
        and max(result["cancel_500_to_empty_ms"], default=0.0) <= 100.0
    )
    print("targets met" if ok else "targets NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
