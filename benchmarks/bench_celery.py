"""Slot utilization and fairness of SemaphoreTask with real workers.

    .venv/bin/python -m benchmarks.bench_celery [--tasks 40] [--hold 0.2] [--limit 3] [--rounds 3]

N tasks of `hold` seconds under a limit of L on 2 workers x 4 prefork children (Redis broker,
all servers throwaway on loopback). For each policy it reports the makespan (first start to last
end) against the ideal N * hold / L, and how far the start order strays from the order in which
tasks first asked for a slot. Baseline in the same run: the same tasks with no semaphore on one
worker of L children, where the pool size is the limit.

Policies: the default (in-process wait when the turn is near, else a countdown re-send) and
countdown-only (semaphore_inline_wait = 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.conftest import CeleryStack
from tests.workers import Worker

WORKERS, CHILDREN = 2, 4
COUNTDOWN = 1.0  # the shortest countdown: order is promised "within one countdown"


@contextmanager
def stack() -> Iterator[CeleryStack]:
    celery_stack = CeleryStack()
    os.environ.update(celery_stack.env)
    try:
        yield celery_stack
    finally:
        celery_stack.close()


@contextmanager
def workers(env: dict[str, str], count: int, children: int, conf: dict[str, Any]) -> Iterator[list[Worker]]:
    group = [Worker(env, name=f"bench{i}", concurrency=children, conf=conf) for i in range(count)]
    try:
        for worker in group:
            worker.start()
        yield group
    finally:
        for worker in group:
            worker.stop()


def _entries(client: Any, name: str) -> list[tuple[str, float]]:
    return [(entry.split()[0], float(entry.split()[1])) for entry in map(bytes.decode, client.lrange(name, 0, -1))]


def inversions(asked: list[tuple[str, float]], started: list[str], slack: float) -> tuple[int, int, int]:
    """Pairs started against their first-ask order; of those, pairs whose first asks were more
    than ``slack`` seconds apart (the design promises order "within one countdown"); and the
    largest displacement in places."""
    rank = {task: i for i, (task, _) in enumerate(asked)}
    when = dict(asked)
    order = [task for task in started if task in rank]
    pairs = late = 0
    for i, first in enumerate(order):
        for second in order[i + 1:]:
            if rank[first] > rank[second]:
                pairs += 1
                late += when[first] - when[second] > slack
    displacement = max((abs(i - rank[task]) for i, task in enumerate(order)), default=0)
    return pairs, late, displacement


def run_once(proj: Any, task: Any, name: str, tasks: int, hold: float, queue: str) -> dict[str, float]:
    key = f"bench:{name}"
    client = proj.probe(key).client
    for suffix in ("starts", "ends", "asks", "live", "max", "entries"):
        client.delete(f"probe:{key}:{suffix}")
    args = (hold, key) if task.name == "proj.unlimited" else (hold, name)
    results = [task.apply_async(args, queue=queue) for _ in range(tasks)]
    for result in results:
        result.get(timeout=300)
    starts, ends = _entries(client, f"probe:{key}:starts"), _entries(client, f"probe:{key}:ends")
    asks = _entries(client, f"probe:{key}:asks")
    makespan = max(t for _, t in ends) - min(t for _, t in starts)
    pairs, late, displacement = inversions(
        sorted(asks, key=lambda e: e[1]), [t for t, _ in sorted(starts, key=lambda e: e[1])], slack=COUNTDOWN
    )
    return {
        "makespan": makespan,
        "max_concurrency": proj.probe(key).maximum,
        "inversions": pairs,
        "inversions_beyond_countdown": late,
        "max_displacement": displacement,
        "ran": len(starts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=40)
    parser.add_argument("--hold", type=float, default=0.2)
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    ideal = args.tasks * args.hold / args.limit
    report: dict[str, Any] = {"ideal": ideal, "cases": {}}
    with stack() as celery_stack:
        import tests.proj.app as proj

        proj.app.conf.update(broker_url=celery_stack.env["PROJ_BROKER_URL"],
                             result_backend=celery_stack.env["PROJ_RESULT_URL"],
                             semaphore_backend_url=celery_stack.env["PROJ_SEMAPHORE_URL"])
        limits = {"semaphore_limits": {"bench:*": args.limit, "proj.config_only": 2, "crawl:*": 2}}
        # first asks are recorded at task_prerun of the first delivery (tests/proj/app.py)
        cases = [
            ("baseline: no semaphore, 1 worker x limit children", "base", proj.unlimited, 1, args.limit, {}),
            ("semaphore, default policy (in-process wait near the head)", "inline", proj.keyed, WORKERS,
             CHILDREN, limits),
            ("semaphore, countdown re-sends only (inline_wait=0)", "countdown", proj.keyed, WORKERS, CHILDREN,
             {**limits, "semaphore_inline_wait": 0}),
        ]
        for title, name, task, count, children, conf in cases:
            env = {**celery_stack.env, "PROJ_QUEUE": f"bench-{name}"}
            with workers(env, count, children, conf):
                runs = [run_once(proj, task, name, args.tasks, args.hold, f"bench-{name}")
                        for _ in range(args.rounds)]
            report["cases"][name] = {"title": title, "runs": runs}
    base = statistics.median(r["makespan"] for r in report["cases"]["base"]["runs"])
    pairs = args.tasks * (args.tasks - 1) // 2
    print(f"{args.tasks} tasks x {args.hold} s, limit {args.limit}; ideal makespan {ideal:.2f} s; "
          f"{args.rounds} rounds, medians; inversions out of {pairs} pairs (baseline records no asks)")
    print(f"{'case':58} {'makespan':>9} {'/ideal':>7} {'/base':>6} {'max conc':>8} {'inversions':>10} "
          f"{'>1 cntdwn':>9} {'max disp':>8}")
    for case in report["cases"].values():
        runs = case["runs"]
        makespan = statistics.median(r["makespan"] for r in runs)
        print(f"{case['title']:58} {makespan:9.2f} {makespan / ideal:7.2f} {makespan / base:6.2f} "
              f"{max(r['max_concurrency'] for r in runs):8d} "
              f"{statistics.median(r['inversions'] for r in runs):10.0f} "
              f"{statistics.median(r['inversions_beyond_countdown'] for r in runs):9.0f} "
              f"{statistics.median(r['max_displacement'] for r in runs):8.0f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
