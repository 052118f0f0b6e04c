"""Rates and spacings with real workers: their targets, and Celery's own rate_limit beside them.

    .venv/bin/python -m benchmarks.bench_rates [--minutes 2] [--compare-minutes 1] [--rounds 3]
        [--only compare,exact-redis,exact-amqp,spacing] [--json PATH]

Every figure is measured with real ``celery worker`` processes (prefork, each worker a process of
its own, started by the test helpers and stopped by PID), throwaway redis-servers on loopback (a
broker Redis that also holds the probes, and a separate semaphore Redis: never a shared one), and
RabbitMQ at AMQP_URL (``CELERY_SEMAPHORE_TEST_AMQP_URL``) where it answers (else the RabbitMQ
scenario is reported as skipped, with the reason). The workers run benchmarks/bench_rates_app.py,
which records each body's start: its place in the sending order, the worker's clock, and the server
time at which Redis granted the slot (the clock the rules are kept in).

Scenarios (``--only`` takes their names):

* ``compare``: Celery's own ``rate_limit="30/m"`` on a plain task against ``semaphore_rate="30/m"``,
  side by side in the same round (both sets of workers run at once): 3 workers x 2 prefork
  children per side, a backlog queued for each side (120 tasks, more when a longer run needs
  them), bodies of 0.1 s. After a warm-up (``--warmup``, 10 s from the end of sending) the starts
  of each side are counted in each full minute for ``--compare-minutes`` minutes (worker clock,
  one host), and per worker. Celery's rate limit is a token bucket in each worker: 30/m per
  worker, 90/m for three; ``semaphore_rate`` is one line over every worker: 30 in any 60 s.
* ``exact-redis`` and ``exact-amqp``: exactness and full use over a long run: 2 workers x 4, a
  rate of N per P s (``--rate-count``, ``--rate-period``: 20 per 10 s, so that a 10-minute run has
  60 periods), bodies of 0.2 s, a backlog that outlasts the run, on the Redis broker and on
  RabbitMQ. Measured for ``--minutes`` from the first grant, in server time: the most grants in
  any window of P s (sliding, over the whole round: must be <= N), the grants in each full period
  from the first grant (>= 0.95 N: the rate is used in full), the use (grants / (N x periods)),
  the lag of each grant past the moment the rate allowed it (the N-th earlier grant + P), and
  FIFO inversions: pairs of tasks that started in the opposite order to their sending (a task
  sent before the last one that started but not started itself counts as starting after every
  one that did), as a share of the pairs; beside them the same against the order of the tasks'
  first asks (stamped at ``task_prerun`` of their first run), which leaves out the order in which
  Celery's prefetch hands the backlog to the two workers' pool processes.
* ``spacing``: a key with a spacing S (``--spacing``, 0.5 s) and a limit of 3 (bodies of 1.0 s,
  under limit x S, so that the spacing alone sets when the next start is allowed), 2 workers x 4,
  a backlog, Redis broker, for ``--minutes``: each gap between consecutive grants minus S (how
  late each start came after its allowed moment): p50, p90, p99, max, and the smallest gap
  (must be >= S); inversions as above.

Wherever there is a grant, the time from the grant (server clock) to the body's start (worker
clock, the same host) is given too: a task granted while it waits in-process starts at once, one
granted while parked outside the worker starts when its wake copy reaches a free pool process.

Each scenario is repeated ``--rounds`` times, with fresh workers, keys and Redis databases each
round; the tables give each round and the median (min-max) over the rounds, or the figure over
every round's samples pooled where a percentile is asked for.

Targets: compare: ours 30 per minute while Celery's lets about 90 through; exact: max
in any P-window <= N, every full period >= 0.95 N; spacing: late p50 <= 15 ms, p99 <= 60 ms, min
gap >= S.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from benchmarks.bench_celery import (
    AMQP_URL,
    Lab,
    RoundFailed,
    amqp_problem,
    git,
    inversions,
    percentile,
    show,
    start_together,
    table,
    versions,
)
from tests.celery_stack import CeleryStack
from tests.workers import Worker

APP = "benchmarks.bench_rates_app"
SCENARIOS = ("compare", "exact-redis", "exact-amqp", "spacing")
COMPARE_WORKERS, COMPARE_CHILDREN, COMPARE_RATE, COMPARE_HOLD = 3, 2, 30, 0.1
WORKERS, CHILDREN = 2, 4
EXACT_HOLD, SPACED_HOLD = 0.2, 1.0
MIN_BACKLOG = 120
# give up on a round when no task has started for this long past what the rule makes it wait
STALL_S = 90.0


# -- what one round recorded --------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    seq: int  # place in the sending order
    at: float  # worker clock, s
    granted_ms: int | None  # server time of the grant, ms (None: no semaphore)
    worker: str


def read_starts(probe: redis.Redis, key: str) -> list[Start]:
    """Every body start of ``key``, by grant moment (then worker clock) where there is one."""
    found = []
    for raw in probe.lrange(f"br:starts:{key}", 0, -1):
        seq, at, granted, worker = (raw.decode() if isinstance(raw, bytes) else str(raw)).split()
        found.append(Start(int(seq), float(at), None if granted == "-" else int(granted), worker))
    return sorted(found, key=lambda s: (s.granted_ms if s.granted_ms is not None else s.at * 1000, s.at))


def most_in_any_window(moments: Sequence[float], window: float) -> int:
    """The most moments (sorted) in any half-open window [t, t + window)."""
    most, first = 0, 0
    for last, moment in enumerate(moments):
        while moment - moments[first] >= window:
            first += 1
        most = max(most, last - first + 1)
    return most


def body_lags(starts: Sequence[Start]) -> list[float]:
    """Grant (server clock) to body start (worker clock), ms: one host, one clock. A task granted
    while it waits in-process starts at once; one granted while parked starts when its wake
    copy reaches a free pool process."""
    return [s.at * 1000 - s.granted_ms for s in starts if s.granted_ms is not None]


def body_lag(lags: Sequence[float]) -> str:
    if not lags:
        return "-"
    return f"{percentile(lags, 50):.0f}/{percentile(lags, 99):.0f}/{max(lags):.0f}"


def per_window(moments: Sequence[float], begin: float, width: float, count: int) -> list[int]:
    """How many moments fall in each of ``count`` windows [begin + k width, begin + (k+1) width)."""
    counts = [0] * count
    for moment in moments:
        k = math.floor((moment - begin) / width)
        if 0 <= k < count:
            counts[k] += 1
    return counts


def fifo(starts: Sequence[Start], reference: Sequence[int]) -> tuple[int, int, int]:
    """(inverted pairs, pairs, tasks overtaken and not started) of the start order against
    ``reference`` (the sending order, or the order of the first asks), over the tasks up to the
    last one in ``reference`` that started; one not started counts as starting after every one
    that did."""
    started: list[str] = []
    seen: set[str] = set()
    for start in starts:
        if str(start.seq) not in seen:
            seen.add(str(start.seq))
            started.append(str(start.seq))
    place = {str(seq): i for i, seq in enumerate(reference)}
    if not seen or not seen <= set(place):
        return 0, 0, 0
    prefix = [str(seq) for seq in reference[: max(place[seq] for seq in seen) + 1]]
    skipped = [seq for seq in prefix if seq not in seen]
    pairs, _ = inversions(prefix, started + skipped)
    return pairs, len(prefix) * (len(prefix) - 1) // 2, len(skipped)


def asked_order(probe: redis.Redis, key: str) -> list[int]:
    """The tasks of ``key`` by their first ask (``task_prerun`` of their first run)."""
    stamps = {int(seq): float(at) for seq, at in probe.hgetall(f"br:asked:{key}").items()}
    return sorted(stamps, key=lambda seq: (stamps[seq], seq))


# -- workers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def rate_workers(
    lab: Lab, broker_url: str, queues: Sequence[str], children: int, env: dict[str, str]
) -> Iterator[list[Worker]]:
    """One worker of the rates app per queue, started together, stopped together (SIGTERM each,
    by PID, at once: a warm shutdown waits for the bodies and in-process waits under way)."""
    tag = uuid.uuid4().hex[:4]
    group = [
        Worker(
            {**lab.env, **env, "PROJ_BROKER_URL": broker_url, "PROJ_QUEUE": queue},
            name=f"rates{i}-{tag}",
            concurrency=children,
            conf={},
            app=APP,
        )
        for i, queue in enumerate(queues)
    ]
    try:
        start_together(group)
        yield group
    finally:
        stoppers = [threading.Thread(target=worker.stop, daemon=True) for worker in group]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join(timeout=60)


def watch(lab: Lab, group: Sequence[Worker], until: float, stalled: Any = None) -> None:
    """Sleep until ``until`` (time.time()), checking every half second for a failed task, a dead
    worker, or ``stalled()`` returning a reason."""
    while time.time() < until:
        failures = lab.failures()
        if failures:
            raise RoundFailed(f"{len(failures)} task(s) failed, first: {failures[0]}")
        for worker in group:
            if worker.process is not None and worker.process.poll() is not None:
                raise RoundFailed(f"worker {worker.name} died:\n{worker.log()[-3000:]}")
        reason = stalled() if stalled is not None else None
        if reason:
            raise RoundFailed(reason)
        time.sleep(min(0.5, max(0.0, until - time.time())))


def first_grant(lab: Lab, group: Sequence[Worker], key: str, timeout: float = 120) -> Start:
    deadline = time.time() + timeout
    while True:
        starts = read_starts(lab.probe, key)
        if starts:
            return starts[0]
        if time.time() > deadline:
            raise RoundFailed(f"no task of {key} started within {timeout:.0f} s")
        watch(lab, group, time.time() + 0.2)


def stall_check(lab: Lab, key: str, allowed_gap: float) -> Any:
    """A ``stalled`` for ``watch``: a reason when no start of ``key`` came for ``allowed_gap`` s."""
    state = {"count": 0, "since": time.time()}

    def stalled() -> str | None:
        count = int(lab.probe.llen(f"br:starts:{key}"))
        if count != state["count"]:
            state["count"], state["since"] = count, time.time()
        elif time.time() - state["since"] > allowed_gap:
            return f"{key}: no start for {allowed_gap:.0f} s after {count} starts"
        return None

    return stalled


# -- scenarios ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    minutes: float
    compare_minutes: int
    warmup: float
    rate_count: int
    rate_period: float
    spacing: float
    spaced_limit: int

    @property
    def env(self) -> dict[str, str]:
        return {
            "BENCH_RATES_WINDOW": f"{self.rate_count}/{self.rate_period:g}s",
            "BENCH_RATES_SPACING": f"{self.spacing:g}",
            "BENCH_RATES_SPACED_LIMIT": str(self.spaced_limit),
        }


def compare_round(lab: Lab, settings: Settings, round_no: int) -> dict[str, Any]:
    """Both sides at once: 3 workers x 2 on Celery's rate limit, 3 x 2 on ours, each side with
    its own queue and backlog; starts per full minute after the warm-up, worker clock."""
    broker = lab.redis_broker
    measured = settings.compare_minutes * 60.0
    # enough for Celery's 30/m per worker over the warm-up and the measured minutes, with room
    backlog = max(MIN_BACKLOG, math.ceil(1.3 * COMPARE_WORKERS * COMPARE_RATE * (settings.warmup + measured) / 60) + 10)
    sides = {
        "celery": ("bench.rates.celery_30m", f"cmp-celery-r{round_no}-{lab.nonce}"),
        "ours": ("bench.rates.ours_30m", f"cmp-ours-r{round_no}-{lab.nonce}"),
    }
    queues = [f"br-{key}" for _, key in sides.values()]
    lab.clean(broker)
    with rate_workers(
        lab, broker, [queue for queue in queues for _ in range(COMPARE_WORKERS)], COMPARE_CHILDREN, settings.env
    ) as group:
        order = list(sides) if round_no % 2 == 0 else list(reversed(sides))
        for side in order:
            task, key = sides[side]
            lab.send(broker, task, [(seq, key, COMPARE_HOLD) for seq in range(backlog)], f"br-{key}")
        sent = time.time()
        begin = sent + settings.warmup
        watch(lab, group, begin + measured + 1.0)
    result: dict[str, Any] = {"backlog": backlog}
    for side, (_, key) in sides.items():
        starts = read_starts(lab.probe, key)
        moments = sorted(s.at for s in starts)
        minutes = per_window(moments, begin, 60.0, settings.compare_minutes)
        inside = [s for s in starts if begin <= s.at < begin + measured]
        workers = sorted({s.worker for s in starts})
        per_worker = sorted((sum(1 for s in inside if s.worker == w) for w in workers), reverse=True)
        result[side] = {
            "per_minute": minutes,
            "per_worker": [count / settings.compare_minutes for count in per_worker],
            "max_any_60s": most_in_any_window(moments, 60.0),
            "max_any_60s_server": (
                most_in_any_window(sorted(s.granted_ms for s in starts if s.granted_ms is not None), 60_000)
                if side == "ours"
                else None
            ),
            "started": len(starts),
            "body_lags_ms": body_lags(starts),
        }
    return result


def exact_round(lab: Lab, settings: Settings, round_no: int, broker: str, broker_url: str) -> dict[str, Any]:
    """A rate of N per P s over a backlog, for ``settings.minutes`` from the first grant."""
    n, period = settings.rate_count, settings.rate_period
    measured = settings.minutes * 60.0
    periods = math.floor(measured / period)
    backlog = math.ceil(n * (periods + 2) * 1.2) + WORKERS * CHILDREN
    key = f"exact-{broker}-r{round_no}-{lab.nonce}"
    queue = f"br-{key}"
    lab.clean(broker_url)
    try:
        with rate_workers(lab, broker_url, [queue] * WORKERS, CHILDREN, settings.env) as group:
            lab.send(broker_url, "bench.rates.window", [(seq, key, EXACT_HOLD) for seq in range(backlog)], queue)
            first = first_grant(lab, group, key)
            assert first.granted_ms is not None
            until = first.granted_ms / 1000 + measured + 1.0
            watch(lab, group, until, stall_check(lab, key, period + STALL_S))
    finally:
        lab.delete_amqp_queue(broker_url, queue)
    starts = read_starts(lab.probe, key)
    grants = [s.granted_ms for s in starts if s.granted_ms is not None]
    t0 = grants[0]
    counts = per_window(grants, t0, period * 1000, periods)
    # each grant past the moment the rate allowed it: the N-th earlier grant + P
    lags = [
        grants[i] - (grants[i - n] + period * 1000) for i in range(n, len(grants)) if grants[i] < t0 + measured * 1000
    ]
    pairs, all_pairs, overtaken = fifo(starts, range(backlog))
    asked_pairs, asked_all, _ = fifo(starts, asked_order(lab.probe, key))
    return {
        "backlog": backlog,
        "started": len(starts),
        "in_run": sum(counts),
        "max_any_window": most_in_any_window(grants, period * 1000),
        "periods": periods,
        "period_min": min(counts),
        "period_median": statistics.median(counts),
        "periods_full": sum(1 for c in counts if c >= 0.95 * n),
        "use_pct": 100.0 * sum(counts) / (n * periods),
        "lags_ms": lags,
        "lag_p50_ms": percentile(lags, 50),
        "lag_p99_ms": percentile(lags, 99),
        "inversions": pairs,
        "pairs": all_pairs,
        "inversions_pct": 100.0 * pairs / all_pairs if all_pairs else 0.0,
        "overtaken": overtaken,
        "asked_inversions_pct": 100.0 * asked_pairs / asked_all if asked_all else 0.0,
        "body_lags_ms": body_lags(starts),
        "ran_twice": len(starts) - len({s.seq for s in starts}),
        "start_order": [s.seq for s in starts],
    }


def spacing_round(lab: Lab, settings: Settings, round_no: int) -> dict[str, Any]:
    """A spacing S and a small limit over a backlog, for ``settings.minutes`` from the first grant."""
    spacing_ms = settings.spacing * 1000
    measured = settings.minutes * 60.0
    backlog = math.ceil(1.2 * (measured / settings.spacing + 3)) + WORKERS * CHILDREN
    key = f"spacing-r{round_no}-{lab.nonce}"
    queue = f"br-{key}"
    broker = lab.redis_broker
    lab.clean(broker)
    with rate_workers(lab, broker, [queue] * WORKERS, CHILDREN, settings.env) as group:
        lab.send(broker, "bench.rates.spaced", [(seq, key, SPACED_HOLD) for seq in range(backlog)], queue)
        first = first_grant(lab, group, key)
        assert first.granted_ms is not None
        watch(lab, group, first.granted_ms / 1000 + measured + 1.0, stall_check(lab, key, STALL_S))
    starts = read_starts(lab.probe, key)
    grants = [s.granted_ms for s in starts if s.granted_ms is not None]
    grants = [g for g in grants if g < grants[0] + measured * 1000]
    gaps = [later - earlier for earlier, later in itertools.pairwise(grants)]
    late = [gap - spacing_ms for gap in gaps]
    pairs, all_pairs, _ = fifo(starts, range(backlog))
    asked_pairs, asked_all, _ = fifo(starts, asked_order(lab.probe, key))
    return {
        "backlog": backlog,
        "starts": len(grants),
        "late_ms": late,
        "min_gap_ms": min(gaps),
        "late_p50_ms": percentile(late, 50),
        "late_p90_ms": percentile(late, 90),
        "late_p99_ms": percentile(late, 99),
        "late_max_ms": max(late),
        "inversions_pct": 100.0 * pairs / all_pairs if all_pairs else 0.0,
        "asked_inversions_pct": 100.0 * asked_pairs / asked_all if asked_all else 0.0,
        "body_lags_ms": body_lags(starts),
        "ran_twice": len(starts) - len({s.seq for s in starts}),
        "start_order": [s.seq for s in starts],
    }


# -- the run, the tables ------------------------------------------------------------------------


def run(
    lab: Lab, scenario: str, settings: Settings, rounds: int, amqp: str | None
) -> tuple[list[dict[str, Any]], list[str], str | None]:
    """(each round's figures, errors, why skipped)"""
    if scenario == "exact-amqp" and amqp is None:
        return [], [], f"RabbitMQ at {AMQP_URL} not reachable: {amqp_problem(AMQP_URL)}"
    results, errors = [], []
    for round_no in range(rounds):
        print(f"  {scenario} round {round_no + 1}/{rounds} ...", file=sys.stderr, flush=True)
        began = time.monotonic()
        try:
            if scenario == "compare":
                result = compare_round(lab, settings, round_no)
            elif scenario == "spacing":
                result = spacing_round(lab, settings, round_no)
            elif scenario == "exact-redis":
                result = exact_round(lab, settings, round_no, "redis", lab.redis_broker)
            else:
                assert amqp is not None
                result = exact_round(lab, settings, round_no, "amqp", amqp)
        except RoundFailed as error:
            errors.append(f"{scenario} round {round_no + 1}: {error}")
            print(f"  FAILED: {error}", file=sys.stderr, flush=True)
            continue
        result["round"] = round_no + 1
        result["seconds"] = time.monotonic() - began
        results.append(result)
    return results, errors, None


def pick(results: Sequence[dict[str, Any]], name: str, side: str | None = None) -> list[float]:
    return [float((r[side] if side else r)[name]) for r in results if (r[side] if side else r).get(name) is not None]


def report_compare(results: Sequence[dict[str, Any]], settings: Settings) -> list[str]:
    rows = [
        [
            "side",
            "starts per full minute",
            "median (min-max)",
            "per worker per minute",
            "max in any 60 s",
            "grant->body p50/p99/max ms",
        ]
    ]
    titles = {"celery": 'Celery rate_limit="30/m"', "ours": 'semaphore_rate="30/m"'}
    for side, title in titles.items():
        minutes = [m for r in results for m in r[side]["per_minute"]]
        workers = [r[side]["per_worker"] for r in results]
        width = max((len(w) for w in workers), default=0)
        per_worker = " / ".join(
            show([w[i] for w in workers if len(w) > i], 1 if settings.compare_minutes > 1 else 0) for i in range(width)
        )
        most = show(pick(results, "max_any_60s", side), 0)
        if side == "ours":
            most += f" (server: {show(pick(results, 'max_any_60s_server', side), 0)})"
        rows.append(
            [
                title,
                " | ".join(",".join(str(m) for m in r[side]["per_minute"]) for r in results),
                show([float(m) for m in minutes], 0),
                per_worker,
                most,
                body_lag([ms for r in results for ms in r[side]["body_lags_ms"]]),
            ]
        )
    celery = [m for r in results for m in r["celery"]["per_minute"]]
    ours = [m for r in results for m in r["ours"]["per_minute"]]
    out = [table(rows)]
    if celery and ours:
        ratio = [
            c / o for r in results for c, o in zip(r["celery"]["per_minute"], r["ours"]["per_minute"], strict=True) if o
        ]
        out.append(f"Celery's / ours, per minute: {show(ratio, 2)}")
    return out


def report_exact(results: Sequence[dict[str, Any]], settings: Settings) -> list[str]:
    n, period = settings.rate_count, settings.rate_period
    head = [
        "",
        "backlog",
        "started",
        "periods",
        f"max in any {period:g} s",
        "per period min",
        "median",
        f">= {0.95 * n:g}",
        "use %",
        "lag p50 ms",
        "lag p99 ms",
        "inv. vs sent % (pairs)",
        "overtaken",
        "inv. vs asked %",
        "grant->body p50/p99/max ms",
        "ran twice",
        "round s",
    ]
    rows = [head]
    for r in results:
        rows.append(
            [
                f"round {r['round']}",
                str(r["backlog"]),
                str(r["started"]),
                str(r["periods"]),
                str(r["max_any_window"]),
                str(r["period_min"]),
                f"{r['period_median']:g}",
                f"{r['periods_full']}/{r['periods']}",
                f"{r['use_pct']:.1f}",
                f"{r['lag_p50_ms']:.0f}",
                f"{r['lag_p99_ms']:.0f}",
                f"{r['inversions_pct']:.2f} ({r['inversions']}/{r['pairs']})",
                str(r["overtaken"]),
                f"{r['asked_inversions_pct']:.2f}",
                body_lag(r["body_lags_ms"]),
                str(r["ran_twice"]),
                f"{r['seconds']:.0f}",
            ]
        )
    if len(results) > 1:
        lags = [lag for r in results for lag in r["lags_ms"]]
        rows.append(
            [
                "all rounds",
                "",
                "",
                str(sum(r["periods"] for r in results)),
                str(max(r["max_any_window"] for r in results)),
                str(min(r["period_min"] for r in results)),
                show(pick(results, "period_median"), 0),
                f"{sum(r['periods_full'] for r in results)}/{sum(r['periods'] for r in results)}",
                show(pick(results, "use_pct"), 1),
                f"{percentile(lags, 50):.0f}",
                f"{percentile(lags, 99):.0f}",
                show(pick(results, "inversions_pct"), 2),
                show(pick(results, "overtaken"), 0),
                show(pick(results, "asked_inversions_pct"), 2),
                body_lag([ms for r in results for ms in r["body_lags_ms"]]),
                str(sum(r["ran_twice"] for r in results)),
                "",
            ]
        )
    return [table(rows)]


def report_spacing(results: Sequence[dict[str, Any]]) -> list[str]:
    rows = [
        [
            "",
            "backlog",
            "starts",
            "min gap ms",
            "late p50 ms",
            "p90 ms",
            "p99 ms",
            "max ms",
            "inv. vs sent %",
            "inv. vs asked %",
            "grant->body p50/p99/max ms",
            "ran twice",
        ]
    ]
    for r in results:
        rows.append(
            [
                f"round {r['round']}",
                str(r["backlog"]),
                str(r["starts"]),
                f"{r['min_gap_ms']:.0f}",
                *(f"{r[k]:.0f}" for k in ("late_p50_ms", "late_p90_ms", "late_p99_ms", "late_max_ms")),
                f"{r['inversions_pct']:.2f}",
                f"{r['asked_inversions_pct']:.2f}",
                body_lag(r["body_lags_ms"]),
                str(r["ran_twice"]),
            ]
        )
    if len(results) > 1:
        late = [ms for r in results for ms in r["late_ms"]]
        rows.append(
            [
                "all rounds",
                "",
                str(sum(r["starts"] for r in results)),
                f"{min(r['min_gap_ms'] for r in results):.0f}",
                *(f"{percentile(late, q):.0f}" for q in (50, 90, 99, 100)),
                show(pick(results, "inversions_pct"), 2),
                show(pick(results, "asked_inversions_pct"), 2),
                body_lag([ms for r in results for ms in r["body_lags_ms"]]),
                str(sum(r["ran_twice"] for r in results)),
            ]
        )
    return [table(rows)]


def verdicts(outcomes: dict[str, list[dict[str, Any]]], settings: Settings) -> list[list[str]]:
    n = settings.rate_count
    found: list[list[str]] = []

    def add(scenario: str, figure: str, measured: str, target: str, met: bool) -> None:
        found.append([scenario, figure, measured, target, "yes" if met else "NO"])

    if outcomes.get("compare"):
        results = outcomes["compare"]
        ours = [m for r in results for m in r["ours"]["per_minute"]]
        celery = [m for r in results for m in r["celery"]["per_minute"]]
        add("compare", "ours: starts per full minute, worst", str(max(ours)), f"<= {COMPARE_RATE}", max(ours) <= 30)
        add(
            "compare",
            "ours: starts per full minute, least",
            str(min(ours)),
            f">= {0.95 * COMPARE_RATE:g}",
            min(ours) >= 0.95 * COMPARE_RATE,
        )
        add(
            "compare",
            "Celery's: starts per full minute (median)",
            f"{statistics.median(celery):g}",
            f"about {COMPARE_WORKERS * COMPARE_RATE} (30 per worker)",
            abs(statistics.median(celery) - COMPARE_WORKERS * COMPARE_RATE) <= 0.1 * COMPARE_WORKERS * COMPARE_RATE,
        )
    for name in ("exact-redis", "exact-amqp"):
        results = outcomes.get(name) or []
        if not results:
            continue
        worst = max(r["max_any_window"] for r in results)
        add(name, f"max grants in any {settings.rate_period:g} s window", str(worst), f"<= {n}", worst <= n)
        least = min(r["period_min"] for r in results)
        add(name, "grants per full period, least", str(least), f">= {0.95 * n:g}", least >= 0.95 * n)
        pct = statistics.median(pick(results, "inversions_pct"))
        add(name, "FIFO inversions vs sending order, % of pairs (median)", f"{pct:.2f}", "reported", True)
        pct = statistics.median(pick(results, "asked_inversions_pct"))
        add(name, "FIFO inversions vs first asks, % of pairs (median)", f"{pct:.2f}", "reported", True)
    results = outcomes.get("spacing") or []
    if results:
        late = [ms for r in results for ms in r["late_ms"]]
        spacing_ms = settings.spacing * 1000
        add("spacing", "late p50 ms (pooled)", f"{percentile(late, 50):.0f}", "<= 15", percentile(late, 50) <= 15)
        add("spacing", "late p99 ms (pooled)", f"{percentile(late, 99):.0f}", "<= 60", percentile(late, 99) <= 60)
        gap = min(r["min_gap_ms"] for r in results)
        add("spacing", "min gap ms", f"{gap:.0f}", f">= {spacing_ms:g}", gap >= spacing_ms)
    return found


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=2.0, help="measured minutes of exact-* and spacing (2)")
    parser.add_argument("--compare-minutes", type=int, default=1, help="measured full minutes per side of compare (1)")
    parser.add_argument("--warmup", type=float, default=10.0, help="compare: seconds before the first minute (10)")
    parser.add_argument("--rounds", type=int, default=3, help="repeat each scenario this many times (3)")
    parser.add_argument("--rate-count", type=int, default=20, help="exact-*: N starts ... (20)")
    parser.add_argument("--rate-period", type=float, default=10.0, help="... per P seconds (10)")
    parser.add_argument("--spacing", type=float, default=0.5, help="spacing: seconds between starts (0.5)")
    parser.add_argument("--spaced-limit", type=int, default=3, help="spacing: the key's limit (3)")
    parser.add_argument("--only", help=f"comma-separated scenarios: {', '.join(SCENARIOS)}")
    parser.add_argument("--json", help="also write every round's figures, versions and the commit here")
    args = parser.parse_args(argv)
    wanted = [name.strip() for name in args.only.split(",")] if args.only else list(SCENARIOS)
    unknown = [name for name in wanted if name not in SCENARIOS]
    if unknown:
        parser.error(f"--only: no scenario {unknown[0]!r} (expected {', '.join(SCENARIOS)})")
    settings = Settings(
        args.minutes,
        args.compare_minutes,
        args.warmup,
        args.rate_count,
        args.rate_period,
        args.spacing,
        args.spaced_limit,
    )
    began = time.monotonic()
    meta: dict[str, Any] = {
        "commit": git("log", "--oneline", "-1") or "unknown (not a git checkout)",
        "library_changes_not_committed": git("status", "--porcelain", "--", "celery_semaphore").splitlines(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m benchmarks.bench_rates", *(argv if argv is not None else sys.argv[1:])]),
        "settings": settings.__dict__,
        "rounds": args.rounds,
        "load_at_start": os.getloadavg(),
        **versions(),
    }
    amqp = AMQP_URL if "exact-amqp" in wanted and amqp_problem(AMQP_URL) is None else None
    meta["rabbitmq"] = AMQP_URL if amqp else "unreachable: skipped" if "exact-amqp" in wanted else "not used"
    outcomes: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    stack = CeleryStack()
    try:
        lab = Lab(stack)
        for scenario in wanted:
            print(f"{scenario} ...", file=sys.stderr, flush=True)
            outcomes[scenario], errors[scenario], why = run(lab, scenario, settings, args.rounds, amqp)
            if why:
                skipped[scenario] = why
    finally:
        stack.close()
    meta["seconds"] = time.monotonic() - began
    meta["load_at_end"] = os.getloadavg()
    dirty = meta["library_changes_not_committed"]
    changes = f" + {len(dirty)} uncommitted change(s) in celery_semaphore/" if dirty else ""
    print(f"\n{meta['command']}   ({meta['started']})")
    print(f"commit {meta['commit'][:72]}{changes}")
    print(
        f"celery {meta['celery']}, kombu {meta['kombu']}, redis-py {meta['redis-py']}, "
        f"redis-server {meta['redis-server']}, Python {meta['python']}, {meta['cpus']} CPUs; "
        f"RabbitMQ: {meta['rabbitmq']}; ran {meta['seconds']:.0f} s"
    )
    heads = {
        "compare": (
            f"compare: Celery's rate_limit vs semaphore_rate, both 30/m, side by side: {COMPARE_WORKERS} workers x "
            f"{COMPARE_CHILDREN} per side, {COMPARE_HOLD} s bodies, Redis broker; starts per full minute after a "
            f"{settings.warmup:g} s warm-up, {settings.compare_minutes} minute(s) per round (worker clock)"
        ),
        "exact-redis": "exact-redis",
        "exact-amqp": "exact-amqp",
        "spacing": (
            f"spacing: limit {settings.spaced_limit}, spacing {settings.spacing:g} s, {WORKERS} workers x {CHILDREN}, "
            f"{SPACED_HOLD} s bodies, Redis broker, {settings.minutes:g} min from the first grant; late = gap between "
            f"consecutive grants (server ms) - spacing"
        ),
    }
    for broker in ("redis", "amqp"):
        heads[f"exact-{broker}"] = (
            f"exact-{broker}: {settings.rate_count} per {settings.rate_period:g} s, {WORKERS} workers x {CHILDREN}, "
            f"{EXACT_HOLD} s bodies, {'Redis broker' if broker == 'redis' else 'RabbitMQ'}, {settings.minutes:g} min "
            f"from the first grant (server ms); lag = grant - (N-th earlier grant + P)"
        )
    for scenario in wanted:
        print()
        print(f"{heads[scenario]}; {args.rounds} round(s)")
        if scenario in skipped:
            print(f"  SKIPPED: {skipped[scenario]}")
            continue
        results = outcomes[scenario]
        if results:
            if scenario == "compare":
                lines = report_compare(results, settings)
            elif scenario == "spacing":
                lines = report_spacing(results)
            else:
                lines = report_exact(results, settings)
            print("\n".join(lines))
        for error in errors[scenario]:
            print(f"  FAILED {error.splitlines()[0]}")
    found = verdicts(outcomes, settings)
    if found:
        print("\ntargets")
        print(table([["scenario", "figure", "measured", "target", "met"], *found], left=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"meta": meta, "scenarios": outcomes, "errors": errors, "skipped": skipped, "targets": found},
                out,
                indent=2,
                default=str,
            )


if __name__ == "__main__":
    main()
