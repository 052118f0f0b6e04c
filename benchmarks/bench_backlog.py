"""What a long waiting backlog costs: N tasks sent at once under a rate, drained at that rate.

    .venv/bin/python -m benchmarks.bench_backlog [--scenario rate|throughput|waiting] [--tasks 10000]
        [--rate 20] [--limit 1000] [--hold 0.005] [--workers 3] [--concurrency 4]
        [--broker redis|amqp|both] [--rounds 3] [--quick] [--json PATH]

Scenario ``rate`` (the default) is described first; ``throughput`` at the end; ``waiting`` (N
tasks placed at send behind a paused key: Redis memory per waiting task and its split by key,
then the drain against the limit's pace) has a module and options of its own,
benchmarks/bench_waiting.py.

N tasks (``--tasks``, 10,000; 1,000 with ``--quick``) of a trivial body (``--hold``, 5 ms) are
sent back to back under ``semaphore_rate="R/s"`` (``--rate``, 20) and a concurrency limit the run
never reaches (``--limit``, 1000), to W real ``celery worker`` processes (``--workers``, 3) of C
prefork children each (``--concurrency``, 4), started by the test helpers and stopped by PID. The
first delivery of almost every task is refused with a start reserved for it up to N/R seconds
ahead, and the task waits for that start outside the pool: the whole backlog waits at once, and
this benchmark measures where it waits and what that costs while it drains.

Brokers (``--broker``): ``redis``, a throwaway broker redis-server; ``amqp``, RabbitMQ at AMQP_URL
(``CELERY_SEMAPHORE_TEST_AMQP_URL``), reported as skipped, with the reason, where it does not
answer. The semaphore has a throwaway redis-server of its own, and the probes that the workers'
app (benchmarks/bench_backlog_app.py) writes a third one, so that neither's memory counts the
benchmark's own records. Before each round's tasks, two per pool process are run on a key of
their own and the records cleared, so that the start figures are of warm workers.

Sampled about every second (``--interval``) from sending the first task to the last body's end:

* deliveries: messages received by a worker per task id (``task_received``, in the worker's main
  process, so a refused delivery and a copy held for its ETA count as they arrive), runs in a
  pool process per task id (``task_prerun``), and executions (bodies run) per task id: 1.0;
* where the backlog lives: on the Redis broker the length of the task queue (LLEN; kombu's
  priority sub-queues included), of every key whose name holds ``semaphore-`` (wake and backstop
  queues: LLEN, or ZCARD/HLEN/SCARD by the key's type; ``semaphore-backstops`` keys apart), and
  the messages held by workers (HLEN of kombu's ``unacked`` hash); on RabbitMQ the ready messages
  of the queue and its ``.semaphore-*`` queues (a passive declare, every sample) and the ready,
  unacknowledged and memory figures ``rabbitmqctl list_queues`` gives (every ``--ctl-every`` s,
  as each call costs about half a CPU-second; n/a without the binary);
* the workers' summed RSS (each worker's main process and its pool children, VmRSS from
  /proc/<pid>/status, for the PIDs this benchmark started): at the start (ready, nothing sent),
  the peak and the end (every body run), and the growth;
* Redis memory (INFO ``used_memory``) of the broker Redis and the semaphore Redis, at the start
  and the peak, and per waiting task: the growth at the peak over the tasks waiting (sent, body
  not started) at that moment;
* the drain: body starts per second over its steady part (between the 5th and the 95th
  percentile start) against the rate (>= 0.95), the most body starts in any sliding 1 s window
  (worker clock; must not exceed R) and, beside it, the most grants in any 1 s window in the
  semaphore's own clock (the Redis server time of each grant, the rule's clock), and the
  makespan (first send to last body start) against the ideal N/R.

Each broker's scenario is repeated ``--rounds`` times (3; 1 with ``--quick``) with fresh workers,
keys and Redis databases; the tables give each round and the median (min-max) over the rounds.

Scenario ``throughput``: what the semaphore costs a short-task backlog that it gates at a limit.
N tasks (20,000; 2,000 with ``--quick``) of 2 ms (``--hold``) are sent at once under a
concurrency limit of 4 (``--limit``) and no rate (``--rate 0``, the default here) to W = 3
workers x C = 4 prefork children on the Redis broker; in the same round, the order alternating
round by round, the baseline: the same N tasks with the same body as a plain task (no semaphore)
on ONE worker of C processes, whose pool is the limit. Figures, each case with fresh workers
after the same warm-up: the makespans (first send to last body start), their ratio (target
<= 2), tasks/s, runs in a pool process per task (``task_prerun``, refused runs included: target
<= 1.2), deliveries per task, bodies run per task (exactly 1) and the most bodies seen running at
once (a concurrency probe around each body, independent of the semaphore: <= the limit), with
the same memory and backlog samples as above.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from kombu import Connection  # type: ignore[attr-defined]  # kombu ships no type hints

from benchmarks.bench_celery import (
    AMQP_URL,
    ROOT,
    WAKE_QUEUE_SUFFIX,
    Lab,
    RoundFailed,
    amqp_problem,
    git,
    percentile,
    send_through_task,
    show,
    start_together,
    table,
    versions,
)
from benchmarks.bench_rates import most_in_any_window
from tests.celery_stack import CeleryStack
from tests.redis_server import RedisServer
from tests.workers import Worker

APP = "benchmarks.bench_backlog_app"
TASK = "bench.backlog.work"
# each case's task: the same body with the semaphore and without (bench_backlog_app)
TASKS = {"semaphore": TASK, "plain": "bench.backlog.plain"}
# the library's backstop queue next to each queue on RabbitMQ (celery_semaphore/_celery/wake_queues.py);
# spelled out here because the benchmark process does not import the library's Celery side
BACKSTOP_QUEUE_SUFFIX = ".semaphore-backstop"
BROKERS = ("redis", "amqp")
# give up on a round when no body has started for this long
STALL_S = 90.0
# the steady part of the drain: between these percentiles of the body starts
STEADY = (0.05, 0.95)
SEND_CHUNK = 500


@functools.cache
def log_dir() -> Path:
    """This run's directory for worker logs, made on first use."""
    return Path(tempfile.mkdtemp(prefix="bench-backlog-logs-"))


# what the workers' app records per task id, and every record of a round (the worker names apart)
PER_TASK = ("bb:received", "bb:runs", "bb:execs")
PER_ROUND_RECORDS = (*PER_TASK, "bb:received:total", "bb:starts", "bb:ends", "bb:conc:live", "bb:conc:max")
SCENARIOS = ("rate", "throughput")
# per scenario: tasks (quick, full), rate, limit, hold, broker, the timeout in ideal times (+ 180 s)
DEFAULTS: dict[str, dict[str, Any]] = {
    "rate": {"tasks": (1000, 10_000), "rate": 20, "limit": 1000, "hold": 0.005, "broker": "both", "timeout": 3},
    "throughput": {"tasks": (2000, 20_000), "rate": None, "limit": 4, "hold": 0.002, "broker": "redis", "timeout": 20},
}
# the throughput scenario's targets: makespan against the plain run's, runs in a pool process per task
MAX_OVER_PLAIN = 2.0
MAX_RUNS_PER_TASK = 1.2


@dataclass(frozen=True)
class Settings:
    scenario: str  # "rate" or "throughput"
    tasks: int
    rate: int | None  # starts per second; None: no rate
    workers: int
    concurrency: int
    limit: int
    hold: float
    interval: float
    ctl_every: float
    timeout: float  # seconds the drain may take before the round is cut short
    # "task": the semaphore case is sent through its task's apply_async in an app of the
    # sender's own (placed at send where it would wait); "by-name": app.send_task, as before
    send: str = "task"

    @property
    def ideal(self) -> float:
        """N/R under a rate; else N x hold / limit."""
        return self.tasks / self.rate if self.rate else self.tasks * self.hold / self.limit

    @property
    def env(self) -> dict[str, str]:
        return {
            "BENCH_BACKLOG_RATE": f"{self.rate}/s" if self.rate else "",
            "BENCH_BACKLOG_LIMIT": str(self.limit),
            "BENCH_BACKLOG_HOLD": f"{self.hold:g}",
        }


# -- what the host and the brokers say -----------------------------------------------------------


def rss_kb(pid: int) -> int:
    """VmRSS of one process, kB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def workers_rss_kb(group: Sequence[Worker]) -> tuple[int, int]:
    """Summed RSS of the workers this benchmark started, kB: (each main process and its pool
    children, the main processes alone)."""
    total = main = 0
    for worker in group:
        if worker.process is None or worker.process.poll() is not None:
            continue
        main += rss_kb(worker.process.pid)
        total += sum(rss_kb(pid) for pid in worker.children())
    return total + main, main


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _name(raw: bytes | str) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def key_size(client: redis.Redis, key: str) -> int:
    """Entries in a key, whatever its type (0 when it is gone)."""
    kind = _name(client.type(key))
    sizes = {"list": client.llen, "zset": client.zcard, "hash": client.hlen, "set": client.scard}
    return int(sizes[kind](key)) if kind in sizes else 0


def redis_broker_view(client: redis.Redis, queue: str) -> dict[str, Any]:
    """Where the backlog lives on the Redis broker: the queue (with kombu's priority sub-queues,
    named ``<queue>\\x06\\x16<n>``), each ``*semaphore-*`` key, and the messages workers hold."""
    queued = 0
    derived: dict[str, int] = {}
    backstops: dict[str, int] = {}
    for raw in client.scan_iter(count=1000):
        name = _name(raw)
        if name == queue or name.startswith(queue + "\x06\x16"):
            queued += key_size(client, name)
        elif "semaphore-backstops" in name:
            backstops[name] = key_size(client, name)
        elif "semaphore-" in name:
            derived[name] = key_size(client, name)
    return {
        "queue": queued,
        "semaphore_keys": derived,
        "backstops": backstops,
        "unacked": int(client.hlen("unacked")),
    }


def amqp_ready(broker_url: str, queues: Sequence[str]) -> dict[str, int | None]:
    """Ready messages per queue (a passive declare: cheap; None where the queue does not exist)."""
    found: dict[str, int | None] = {}
    with Connection(broker_url, connect_timeout=3) as connection:  # type: ignore[no-untyped-call]
        for name in queues:
            channel = connection.channel()
            try:
                found[name] = int(channel.queue_declare(name, passive=True).message_count)
            except Exception:
                found[name] = None
            finally:
                with contextlib.suppress(Exception):
                    channel.close()
    return found


RABBITMQCTL = shutil.which("rabbitmqctl")


def rabbitmqctl_queues(prefix: str) -> dict[str, dict[str, int]] | None:
    """``rabbitmqctl list_queues`` for the queues named ``prefix...``: ready, unacknowledged and
    memory (bytes) each; None without the binary or when it fails."""
    if RABBITMQCTL is None:
        return None
    try:
        out = subprocess.run(
            [RABBITMQCTL, "-q", "list_queues", "name", "messages_ready", "messages_unacknowledged", "memory"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = {}
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) == 4 and parts[0].startswith(prefix) and parts[1].isdigit():
            found[parts[0]] = {"ready": int(parts[1]), "unacked": int(parts[2]), "memory": int(parts[3])}
    return found


# -- sampling ------------------------------------------------------------------------------------


class Sampler:
    """Samples the round about every ``interval`` s in a thread of its own, until stopped."""

    def __init__(self, lab: Lab, round_: Round, group: Sequence[Worker], settings: Settings) -> None:
        self.lab, self.round, self.group, self.settings = lab, round_, group, settings
        self.semaphore = redis.Redis.from_url(lab.stack.env["PROJ_SEMAPHORE_URL"])
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._ctl: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="bench-backlog-sampler", daemon=True)
        self._ctl_thread = threading.Thread(target=self._run_ctl, name="bench-backlog-rabbitmqctl", daemon=True)

    def __enter__(self) -> Sampler:
        self.sample()  # the start: workers ready, nothing sent
        self._thread.start()
        if self.round.broker == "amqp" and RABBITMQCTL is not None:
            self._ctl_thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self._ctl_thread.is_alive():
            self._ctl_thread.join(timeout=30)
        self.semaphore.close()

    def _run(self) -> None:
        while not self._stop.wait(self.settings.interval):
            try:
                self.sample()
            except Exception as error:  # a sample missed is reported, the round goes on
                self.errors.append(f"{type(error).__name__}: {error}")

    def _run_ctl(self) -> None:
        while not self._stop.is_set():
            began = time.time()
            queues = rabbitmqctl_queues(self.round.queue)
            if queues is not None:
                self._ctl = {"at": began - self.round.began, "queues": queues}
            self._stop.wait(self.settings.ctl_every)

    def sample(self) -> dict[str, Any]:
        lab, r = self.lab, self.round
        probe = lab.probe.pipeline(transaction=False)
        probe.llen("bb:starts")
        probe.get("bb:ends")
        probe.get("bb:received:total")
        started, ends, received = probe.execute()
        started, ends, received = int(started), int(ends or 0), int(received or 0)
        now = time.time()
        total_rss, main_rss = workers_rss_kb(self.group)
        sample: dict[str, Any] = {
            "t": now - r.began if r.began else 0.0,
            "sent": r.sent,
            "started": started,
            "waiting": max(0, r.sent - started),
            "ended": ends,
            "received": received,
            "rss_kb": total_rss,
            "rss_main_kb": main_rss,
            "semaphore_memory": used_memory(self.semaphore),
        }
        if r.broker == "redis":
            sample["broker_memory"] = used_memory(r.broker_client)
            sample.update(redis_broker_view(r.broker_client, r.queue))
        else:
            ready = amqp_ready(r.broker_url, [r.queue, r.queue + WAKE_QUEUE_SUFFIX, r.queue + BACKSTOP_QUEUE_SUFFIX])
            sample["queue"] = ready[r.queue]
            sample["semaphore_keys"] = {name: n for name, n in ready.items() if name != r.queue and n is not None}
            sample["backstops"] = {}
            ctl = self._ctl
            if ctl:
                queues = ctl["queues"]
                sample["ctl_at"] = ctl["at"]
                sample["unacked"] = sum(q["unacked"] for q in queues.values())
                sample["broker_queue_memory"] = sum(q["memory"] for q in queues.values())
                sample["ctl"] = queues
            else:
                sample["unacked"] = None
        self.samples.append(sample)
        return sample


# -- one round -----------------------------------------------------------------------------------


@dataclass
class Round:
    broker: str
    broker_url: str
    queue: str
    key: str
    broker_client: redis.Redis | None = None
    began: float = 0.0
    sent: int = 0


@contextlib.contextmanager
def backlog_workers(lab: Lab, broker_url: str, queue: str, settings: Settings) -> Iterator[list[Worker]]:
    """W workers of the backlog app on ``queue``, started together, stopped together (SIGTERM each,
    by PID, at once)."""
    tag = uuid.uuid4().hex[:4]
    group = [
        Worker(
            {**lab.env, **settings.env, "PROJ_BROKER_URL": broker_url, "PROJ_QUEUE": queue},
            name=f"backlog{i}-{tag}",
            concurrency=settings.concurrency,
            conf={},
            app=APP,
        )
        for i in range(settings.workers)
    ]
    for worker in group:
        # logs in a directory of this run's own: a clean-up of the test helpers' temporary
        # directories (celery-semaphore-worker-*) by another process must not fail a long round
        worker.logfile = log_dir() / worker.logfile.name
    try:
        start_together(group)
        yield group
    finally:
        stoppers = [threading.Thread(target=worker.stop, daemon=True) for worker in group]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join(timeout=60)


def drain(lab: Lab, group: Sequence[Worker], tasks: int, timeout: float) -> None:
    """Until ``tasks`` bodies have ended; RoundFailed on a failure, a dead worker, a stall or the
    timeout."""
    deadline = time.monotonic() + timeout
    seen, progress = -1, time.monotonic()
    while True:
        ended = int(lab.probe.get("bb:ends") or 0)
        if ended >= tasks:
            return
        started = int(lab.probe.llen("bb:starts"))
        if started != seen:
            seen, progress = started, time.monotonic()
        failures = lab.failures()
        if failures:
            raise RoundFailed(f"{len(failures)} task(s) failed, first: {failures[0]}")
        for worker in group:
            if worker.process is not None and worker.process.poll() is not None:
                raise RoundFailed(f"worker {worker.name} died:\n{worker.log()[-3000:]}")
        now = time.monotonic()
        if now - progress > STALL_S or now > deadline:
            raise RoundFailed(
                f"{tasks - ended} of {tasks} bodies not run; {started} started, last start {now - progress:.0f} s ago"
            )
        time.sleep(0.2)


_PRODUCERS: dict[tuple[str, str], Any] = {}


@contextlib.contextmanager
def backlog_lab() -> Iterator[Lab]:
    """The lab of a backlog run: throwaway servers, and the probes in a redis-server of their
    own, so that the broker's memory is the broker's alone; all stopped at the end."""
    stack = CeleryStack()
    probe_server = RedisServer().start()
    try:
        stack.env["PROJ_PROBE_URL"] = f"{probe_server.url[:-2]}/0"
        yield Lab(stack)
    finally:
        with contextlib.suppress(Exception):
            probe_server.__exit__()
        stack.close()


def producer_task(lab: Lab, broker_url: str, settings: Settings) -> Any:
    """The semaphore task as an application's producer has it: declared in an app of the
    sender's own, with the rule the workers declare (both read ``settings.env``), so that
    ``apply_async`` asks the line as it sends (``semaphore_place_at_send``). Imported here only:
    the by-name sender (``--send by-name``) runs while the library is broken."""
    key = (broker_url, json.dumps(settings.env, sort_keys=True))
    if key not in _PRODUCERS:
        from celery_semaphore import SemaphoreTask

        app = Celery("bench-backlog-producer", broker=broker_url, set_as_current=False)
        app.conf.update(semaphore_backend_url=lab.env["PROJ_SEMAPHORE_URL"], task_ignore_result=True)
        rate = settings.env["BENCH_BACKLOG_RATE"] or None

        @app.task(
            base=SemaphoreTask,
            name=TASK,
            shared=False,
            semaphore_key="bb:{key}",
            semaphore_limit=settings.limit,
            semaphore_rate=rate,
        )
        def work(seq: int, key: str) -> None: ...

        _PRODUCERS[key] = work
    return _PRODUCERS[key]


def backlog_round(
    lab: Lab, settings: Settings, broker: str, broker_url: str, round_no: int, case: str = "semaphore"
) -> dict[str, Any]:
    """One round of ``case``'s task (``TASKS``) on ``settings.workers`` fresh workers."""
    task = TASKS[case]
    key = f"{broker}-{case}-r{round_no}-{lab.nonce}"
    r = Round(broker, broker_url, queue=f"bb-{key}", key=key)
    if broker == "redis":
        r.broker_client = redis.Redis.from_url(broker_url)
    lab.clean(broker_url)
    calls = [(seq, key) for seq in range(settings.tasks)]
    ids: list[str] = []
    incomplete: str | None = None
    try:
        with backlog_workers(lab, broker_url, r.queue, settings) as group:
            packages = {_name(k): _name(v) for k, v in lab.probe.hgetall("bb:package").items()}
            # warm up: a task or two per pool process on a key of their own (imports, connections
            # and the first allocations are not the backlog's cost), then the records start afresh
            warm = settings.workers * settings.concurrency * 2
            lab.send(broker_url, task, [(-1 - i, f"{key}-warm-up") for i in range(warm)], r.queue)
            drain(lab, group, warm, 120)
            time.sleep(1.0)
            lab.probe.delete(*PER_ROUND_RECORDS)
            sampler = Sampler(lab, r, group, settings)
            with sampler:
                r.began = time.time()
                placing = settings.send == "task" and case == "semaphore"
                through = producer_task(lab, broker_url, settings) if placing else None
                for first in range(0, settings.tasks, SEND_CHUNK):
                    chunk = calls[first : first + SEND_CHUNK]
                    if through is not None:
                        ids += send_through_task(through, chunk, r.queue)
                    else:
                        ids += lab.send(broker_url, task, chunk, r.queue)
                    r.sent = min(settings.tasks, first + SEND_CHUNK)
                send_s = time.time() - r.began
                try:
                    drain(lab, group, settings.tasks, settings.timeout)
                except RoundFailed as error:
                    # what was recorded until then is still reported, marked incomplete
                    incomplete = str(error).splitlines()[0]
            # the end, once the sampling thread has stopped: every body run, workers still up
            end_rss = sampler.sample()["rss_kb"]
    finally:
        lab.delete_amqp_queue(broker_url, r.queue)
        if broker == "amqp":
            with contextlib.suppress(Exception), Connection(broker_url, connect_timeout=3) as connection:  # type: ignore[no-untyped-call]
                connection.channel().queue_delete(r.queue + BACKSTOP_QUEUE_SUFFIX)
        if r.broker_client is not None:
            r.broker_client.close()
    result = figures_of(lab, settings, r, ids, sampler.samples, end_rss)
    result.update({"send_s": send_s, "packages": packages, "sample_errors": sampler.errors, "incomplete": incomplete})
    return result


def throughput_round(lab: Lab, settings: Settings, broker: str, broker_url: str, round_no: int) -> dict[str, Any]:
    """The semaphore case on ``settings.workers`` workers and, as its baseline, the plain case
    (the same tasks without the semaphore) on one worker of as many processes, the order
    alternating round by round: the semaphore case's figures, with the plain one's under
    ``plain`` and the two set against each other."""
    plain_settings = dataclasses.replace(settings, workers=1)
    order = ["plain", "semaphore"] if round_no % 2 == 0 else ["semaphore", "plain"]
    found = {
        case: backlog_round(lab, plain_settings if case == "plain" else settings, broker, broker_url, round_no, case)
        for case in order
    }
    result, plain = found["semaphore"], found["plain"]
    result["plain"] = plain
    result["incomplete"] = (
        "; ".join(f"{case}: {found[case]['incomplete']}" for case in order if found[case]["incomplete"]) or None
    )
    for figures in (result, plain):
        figures["tasks_per_s"] = settings.tasks / figures["makespan_s"] if figures["makespan_s"] else None
    if result["makespan_s"] and plain["makespan_s"]:
        result["over_plain"] = result["makespan_s"] / plain["makespan_s"]
    return result


def figures_of(
    lab: Lab, settings: Settings, r: Round, ids: Sequence[str], samples: list[dict[str, Any]], end_rss: int
) -> dict[str, Any]:
    n = settings.tasks
    starts = []
    for raw in lab.probe.lrange("bb:starts", 0, -1):
        seq, at, granted = _name(raw).split()
        if int(seq) < 0:  # a warm-up task's
            continue
        starts.append((int(seq), float(at), None if granted == "-" else int(granted)))
    starts.sort(key=lambda s: s[1])
    moments = [at for _, at, _ in starts]
    grants = sorted(g for _, _, g in starts if g is not None)
    lags = [at * 1000 - g for _, at, g in starts if g is not None]
    worst = worst_window(starts, 1.0)
    received, runs, execs = ([int(v or 0) for v in lab.probe.hmget(name, list(ids))] for name in PER_TASK)
    if not moments:
        raise RoundFailed("no body started")
    done = len(moments) == n
    lo, hi = math.floor(STEADY[0] * (len(moments) - 1)), math.ceil(STEADY[1] * (len(moments) - 1))
    steady_rate = (hi - lo) / (moments[hi] - moments[lo]) if moments[hi] > moments[lo] else float("nan")
    seconds = per_second(moments, moments[lo], moments[hi])
    start, peak_rss = samples[0], max(s["rss_kb"] for s in samples)
    peak_main = max(s["rss_main_kb"] for s in samples)

    def memory(name: str) -> dict[str, Any]:
        at = [s for s in samples if s.get(name) is not None]
        if not at:
            return {}
        top = max(at, key=lambda s: s[name])
        growth = top[name] - at[0][name]
        return {
            "start": at[0][name],
            "peak": top[name],
            "peak_at_s": top["t"],
            "waiting_at_peak": top["waiting"],
            "per_waiting": growth / top["waiting"] if top["waiting"] else None,
            "end": at[-1][name],
        }

    def most(name: str) -> int | None:
        values = [s[name] for s in samples if s.get(name) is not None]
        return max(values) if values else None

    derived = Counter[str]()
    backstops = Counter[str]()
    for s in samples:
        for name, size in s.get("semaphore_keys", {}).items():
            derived[name] = max(derived[name], size)
        for name, size in s.get("backstops", {}).items():
            backstops[name] = max(backstops[name], size)
    return {
        "tasks": n,
        "started": len(starts),
        "executed_tasks": sum(1 for e in execs if e),
        "execs_per_task": sum(execs) / n,
        "execs_max": max(execs, default=0),
        "never_executed": sum(1 for e in execs if not e),
        "ran_twice": sum(1 for e in execs if e > 1),
        "received_per_task": sum(received) / n,
        "received_max": max(received, default=0),
        "received_histogram": dict(sorted(Counter(received).items())),
        "runs_per_task": sum(runs) / n,
        "runs_max": max(runs, default=0),
        "runs_histogram": dict(sorted(Counter(runs).items())),
        "max_concurrency": int(lab.probe.get("bb:conc:max") or 0),
        "steady_rate": steady_rate,
        "rate_ratio": steady_rate / settings.rate if settings.rate else None,
        "per_second_min": min(seconds, default=0),
        "per_second_median": statistics.median(seconds) if seconds else 0,
        "max_any_1s_body": most_in_any_window(moments, 1.0),
        "max_any_1s_grant": most_in_any_window(grants, 1000) if grants else None,
        "granted_starts": len(grants),
        "grant_to_body_ms": {q: percentile(lags, q) for q in (50, 99, 100)} if lags else {},
        "worst_1s_body": {
            "at_s": worst[0][1] - r.began if worst else None,
            "starts": len(worst),
            "grant_span_ms": (max(g for _, _, g in worst if g) - min(g for _, _, g in worst if g))
            if any(g for _, _, g in worst)
            else None,
        },
        "makespan_s": moments[-1] - r.began if done else None,
        "drain_s": moments[-1] - moments[0],
        "first_start_s": moments[0] - r.began,
        "over_ideal": (moments[-1] - r.began) / settings.ideal if done else None,
        "rss_start_kb": start["rss_kb"],
        "rss_peak_kb": peak_rss,
        "rss_end_kb": end_rss,
        "rss_growth_kb": end_rss - start["rss_kb"],
        "rss_peak_growth_kb": peak_rss - start["rss_kb"],
        "rss_main_start_kb": start["rss_main_kb"],
        "rss_main_peak_kb": peak_main,
        "broker_memory": memory("broker_memory"),
        "semaphore_memory": memory("semaphore_memory"),
        "broker_queue_memory": memory("broker_queue_memory"),
        "queue_max": most("queue"),
        "unacked_max": most("unacked"),
        "unacked_end": samples[-1].get("unacked"),
        "waiting_max": most("waiting"),
        "semaphore_keys_max": dict(derived),
        "backstops_max": dict(backstops),
        "samples": samples,
        "starts": [[seq, round(at - r.began, 4), g] for seq, at, g in starts],
    }


def worst_window(starts: Sequence[tuple[int, float, int | None]], window: float) -> list[tuple[int, float, int | None]]:
    """The body starts (sorted by worker clock) in the fullest window [t, t + window)."""
    best: tuple[int, int] = (0, 0)
    first = 0
    for last, (_, at, _) in enumerate(starts):
        while at - starts[first][1] >= window:
            first += 1
        if last - first + 1 > best[1] - best[0]:
            best = (first, last + 1)
    return list(starts[best[0] : best[1]])


def per_second(moments: Sequence[float], begin: float, end: float) -> list[int]:
    """Starts in each full second [begin + k, begin + k + 1) that ends by ``end``."""
    count = math.floor(end - begin)
    counts = [0] * count
    for moment in moments:
        k = math.floor(moment - begin)
        if 0 <= k < count:
            counts[k] += 1
    return counts


# -- the run, the tables ------------------------------------------------------------------------


def run(lab: Lab, settings: Settings, broker: str, rounds: int) -> tuple[list[dict[str, Any]], list[str], str | None]:
    """(each round's figures, errors, why skipped)"""
    if broker == "amqp":
        problem = amqp_problem(AMQP_URL)
        if problem is not None:
            return [], [], f"RabbitMQ at {AMQP_URL} not reachable: {problem}"
        url = AMQP_URL
    else:
        url = lab.redis_broker
    results, errors = [], []
    for round_no in range(rounds):
        print(f"  {broker} round {round_no + 1}/{rounds} ...", file=sys.stderr, flush=True)
        began = time.monotonic()
        try:
            result = (throughput_round if settings.scenario == "throughput" else backlog_round)(
                lab, settings, broker, url, round_no
            )
        except RoundFailed as error:
            errors.append(f"{broker} round {round_no + 1}: {error}")
            print(f"  FAILED: {error}", file=sys.stderr, flush=True)
            continue
        result["round"] = round_no + 1
        result["seconds"] = time.monotonic() - began
        result["load_at_end"] = os.getloadavg()
        results.append(result)
        if result["incomplete"]:
            errors.append(f"{broker} round {round_no + 1} incomplete (figures so far reported): {result['incomplete']}")
            print(f"  INCOMPLETE: {result['incomplete']}", file=sys.stderr, flush=True)
            continue
        plain = f" (plain {result['plain']['makespan_s']:.1f} s)" if "plain" in result else ""
        print(
            f"  done in {result['seconds']:.0f} s: makespan {result['makespan_s']:.1f} s{plain}, "
            f"{result['received_per_task']:.2f} deliveries and {result['runs_per_task']:.2f} runs per task; "
            f"load average {result['load_at_end'][0]:.2f}",
            file=sys.stderr,
            flush=True,
        )
    return results, errors, None


def mb(kb_or_bytes: float | None, *, kb: bool = False) -> str:
    if kb_or_bytes is None:
        return "n/a"
    return f"{kb_or_bytes / (1024 if kb else 1024 * 1024):.1f}"


def pick(results: Sequence[dict[str, Any]], *path: str) -> list[float]:
    found = []
    for r in results:
        value: Any = r
        for name in path:
            value = value.get(name) if isinstance(value, dict) else None
        if value is not None:
            found.append(float(value))
    return found


Column = tuple[str, Callable[[Sequence[dict[str, Any]]], str]]


def col(head: str, *path: str, digits: int, scale: float = 1.0, missing: str = "-") -> Column:
    """A column of the figure at ``path`` in each round's dict, divided by ``scale``."""
    return head, lambda group: show([v / scale for v in pick(group, *path)], digits) if pick(group, *path) else missing


def rounds_table(results: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A row per round and, with several, their median (min-max)."""
    rows = [["", *(head for head, _ in columns)]]

    def add(label: str, group: Sequence[dict[str, Any]]) -> None:
        rows.append([label, *(cell(group) for _, cell in columns)])

    for r in results:
        add(f"round {r['round']}" + (" INCOMPLETE" if r.get("incomplete") else ""), [r])
    if len(results) > 1:
        add("median (min-max)", results)
    return table(rows)


def never_twice(group: Sequence[dict[str, Any]]) -> str:
    return f"{sum(r['never_executed'] for r in group)}/{sum(r['ran_twice'] for r in group)}"


DELIVERIES = [
    col("deliv./task", "received_per_task", digits=2),
    col("max", "received_max", digits=0),
    col("runs/task", "runs_per_task", digits=2),
    col("max", "runs_max", digits=0),
    col("execs/task", "execs_per_task", digits=3),
    ("never/twice", never_twice),
]
RATE_COLUMNS = [
    *DELIVERIES,
    col("steady starts/s", "steady_rate", digits=2),
    col("/ rate", "rate_ratio", digits=3),
    ("min/med per 1 s", lambda g: "/".join(show(pick(g, f"per_second_{k}"), 0) for k in ("min", "median"))),
    col("max any 1 s body", "max_any_1s_body", digits=0),
    col("grant", "max_any_1s_grant", digits=0),
    col("makespan s", "makespan_s", digits=1),
    col("/ ideal", "over_ideal", digits=3),
]
THROUGHPUT_COLUMNS = [
    col("makespan s", "makespan_s", digits=1),
    col("plain s", "plain", "makespan_s", digits=1),
    col("/ plain", "over_plain", digits=2),
    col("tasks/s", "tasks_per_s", digits=1),
    col("plain tasks/s", "plain", "tasks_per_s", digits=1),
    col("/ ideal", "over_ideal", digits=2),
    *DELIVERIES,
    col("max conc.", "max_concurrency", digits=0),
    col("plain max conc.", "plain", "max_concurrency", digits=0),
]


def main_growth(group: Sequence[dict[str, Any]]) -> str:
    peaks, starts = (pick(group, f"rss_main_{k}_kb") for k in ("peak", "start"))
    return show([(p - s) / 1024 for p, s in zip(peaks, starts, strict=True)], 1)


def cost_columns(broker: str) -> list[Column]:
    name = "broker_memory" if broker == "redis" else "broker_queue_memory"
    return [
        col("RSS MB start", "rss_start_kb", digits=1, scale=1024),
        col("peak", "rss_peak_kb", digits=1, scale=1024),
        col("end", "rss_end_kb", digits=1, scale=1024),
        col("growth end", "rss_growth_kb", digits=1, scale=1024),
        col("growth peak", "rss_peak_growth_kb", digits=1, scale=1024),
        ("of which main processes", main_growth),
        col("broker MB start", name, "start", digits=1, scale=2**20),
        col("peak", name, "peak", digits=1, scale=2**20),
        col("B/waiting", name, "per_waiting", digits=0, missing="n/a")
        if broker == "redis"
        else ("B/waiting", lambda _: "n/a"),
        col("semaphore MB start", "semaphore_memory", "start", digits=2, scale=2**20),
        col("peak", "semaphore_memory", "peak", digits=2, scale=2**20),
        col("B/waiting", "semaphore_memory", "per_waiting", digits=0),
        col("max waiting", "waiting_max", digits=0),
        col("max queue", "queue_max", digits=0),
        col("max held (unacked)", "unacked_max", digits=0, missing="n/a"),
        col("held at end", "unacked_end", digits=0, missing="n/a"),
    ]


def report(broker: str, results: Sequence[dict[str, Any]], settings: Settings) -> list[str]:
    """Per round and median (min-max) over the rounds."""
    throughput = settings.scenario == "throughput"
    out = [rounds_table(results, THROUGHPUT_COLUMNS if throughput else RATE_COLUMNS)]
    out.append(
        ("cost of the semaphore case's backlog" if throughput else "cost of the waiting backlog")
        + ("" if broker == "redis" else " (broker MB: the round's queues, rabbitmqctl)")
    )
    out.append(rounds_table(results, cost_columns(broker)))
    if throughput:
        out.append("the plain case's cost")
        out.append(rounds_table([{**r["plain"], "round": r["round"]} for r in results], cost_columns(broker)))

    for r in results:
        keys = {**r["semaphore_keys_max"], **r["backstops_max"]}
        if keys:
            sizes = ", ".join(f"{name!r} {size}" for name, size in sorted(keys.items()))
            out.append(f"round {r['round']}: largest '*semaphore-*' queues/keys: {sizes}")
        else:
            out.append(f"round {r['round']}: no '*semaphore-*' queue or key held anything when sampled")
        out.append(f"round {r['round']}: deliveries per task (count: tasks): {r['received_histogram']}")
        out.append(f"round {r['round']}: runs in a pool process per task (count: tasks): {r['runs_histogram']}")
        lag, worst = r["grant_to_body_ms"], r["worst_1s_body"]
        if lag:
            out.append(
                f"round {r['round']}: grant -> body start ms p50 {lag[50]:.0f}, p99 {lag[99]:.0f}, max {lag[100]:.0f}; "
                f"the fullest 1 s of body starts (t = {worst['at_s']:.1f} s) holds {worst['starts']}, "
                f"granted over {worst['grant_span_ms']} ms"
            )
    last = results[-1]
    out.append(f"where the backlog lives, round {last['round']} (about 12 samples of {len(last['samples'])}):")
    out.append(timeline(broker, last["samples"]))
    return out


def timeline(broker: str, samples: Sequence[dict[str, Any]], rows_wanted: int = 12) -> str:
    step = max(1, len(samples) // rows_wanted)
    chosen = list(samples[::step])
    if chosen[-1] is not samples[-1]:
        chosen.append(samples[-1])
    rows = [
        [
            "t s",
            "sent",
            "started",
            "waiting",
            "queue",
            "*semaphore-*",
            "held (unacked)",
            "RSS MB",
            "main RSS MB",
            "broker MB" if broker == "redis" else "queues MB (ctl)",
            "semaphore MB",
        ]
    ]
    for s in chosen:
        derived = sum(s.get("semaphore_keys", {}).values()) + sum(s.get("backstops", {}).values())
        broker_memory = s.get("broker_memory") if broker == "redis" else s.get("broker_queue_memory")
        rows.append(
            [
                f"{s['t']:.0f}",
                str(s["sent"]),
                str(s["started"]),
                str(s["waiting"]),
                "n/a" if s.get("queue") is None else str(s["queue"]),
                str(derived),
                "n/a" if s.get("unacked") is None else str(s["unacked"]),
                mb(s["rss_kb"], kb=True),
                mb(s["rss_main_kb"], kb=True),
                mb(broker_memory),
                f"{s['semaphore_memory'] / 2**20:.2f}",
            ]
        )
    return table(rows, left=0)


def verdicts(outcomes: dict[str, list[dict[str, Any]]], settings: Settings) -> list[list[str]]:
    found: list[list[str]] = []
    for broker, results in outcomes.items():
        if not results:
            continue

        def add(figure: str, values: list[float], digits: int, target: str, met: bool) -> None:
            found.append([broker, figure, show(values, digits), target, "yes" if met else "NO"])  # noqa: B023

        execs = pick(results, "execs_per_task")
        never = sum(r["never_executed"] + r["ran_twice"] for r in results)
        once = never == 0 and all(e == 1 for e in execs)
        if settings.scenario == "throughput":
            over = pick(results, "over_plain")
            add(
                "makespan / plain makespan (same round)",
                over,
                2,
                f"<= {MAX_OVER_PLAIN}",
                max(over, default=math.inf) <= MAX_OVER_PLAIN,
            )
            runs = pick(results, "runs_per_task")
            add("runs in a pool process per task", runs, 2, f"<= {MAX_RUNS_PER_TASK}", max(runs) <= MAX_RUNS_PER_TASK)
            add("bodies run per task", execs, 3, "exactly 1 (none never, none twice)", once)
            most = pick(results, "max_concurrency")
            add("most bodies running at once", most, 0, f"<= {settings.limit}", max(most) <= settings.limit)
            add("tasks/s with the semaphore", pick(results, "tasks_per_s"), 1, "reported", True)
            add("tasks/s plain (1 worker)", pick(results, "plain", "tasks_per_s"), 1, "reported", True)
        else:
            add("executions per task", execs, 3, "1.0 (none never, none twice)", once)
            rate = settings.rate or 0
            ratio = pick(results, "rate_ratio")
            add("steady starts/s / rate", ratio, 3, ">= 0.95", min(ratio) >= 0.95)
            body = pick(results, "max_any_1s_body")
            add("most body starts in any 1 s (worker clock)", body, 0, f"<= {rate}", max(body) <= rate)
            grant = pick(results, "max_any_1s_grant")
            if grant:
                add("most grants in any 1 s (server clock)", grant, 0, f"<= {rate}", max(grant) <= rate)
            add("makespan / ideal N/R", pick(results, "over_ideal"), 3, "reported", True)
        add("deliveries per task", pick(results, "received_per_task"), 2, "reported", True)
    return found


def main(argv: Sequence[str] | None = None) -> None:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--scenario")
    if first.parse_known_args(argv)[0].scenario == "waiting":  # options of its own: its module parses them
        from benchmarks.bench_waiting import main as waiting

        waiting(argv)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--scenario",
        choices=(*SCENARIOS, "waiting"),
        default="rate",
        help="rate, throughput or waiting (rate; waiting: see benchmarks/bench_waiting.py and its --help)",
    )
    parser.add_argument(
        "--tasks", type=int, help="tasks sent at once (rate: 10000, throughput: 20000; a tenth with --quick)"
    )
    parser.add_argument(
        "--rate", type=int, help="semaphore_rate, starts per second; 0: none (rate: 20, throughput: none)"
    )
    parser.add_argument("--workers", type=int, default=3, help="celery worker processes (3)")
    parser.add_argument("--concurrency", type=int, default=4, help="prefork children per worker (4)")
    parser.add_argument("--limit", type=int, help="the concurrency limit (rate: 1000, never reached; throughput: 4)")
    parser.add_argument("--hold", type=float, help="seconds each body takes (rate: 0.005, throughput: 0.002)")
    parser.add_argument(
        "--broker", choices=(*BROKERS, "both"), help="redis, amqp or both (rate: both, throughput: redis)"
    )
    parser.add_argument(
        "--send",
        choices=("task", "by-name"),
        default="task",
        help="how the semaphore case is sent: through its task's apply_async in a producer app that "
        "declares it (placed at send where it would wait; the default), or by name (app.send_task: "
        "every task goes to its queue and asks there)",
    )
    parser.add_argument("--rounds", type=int, help="rounds per broker (3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a tenth of the tasks and 1 round unless told otherwise")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples (1)")
    parser.add_argument("--ctl-every", type=float, default=5.0, help="seconds between rabbitmqctl calls (5)")
    parser.add_argument(
        "--timeout",
        type=float,
        help="seconds the drain may take; past them the round is cut short and reported as incomplete "
        "(rate: 3 x N/R + 180; throughput: 20 x N x hold / limit + 180)",
    )
    parser.add_argument("--json", help="also write every round's figures and samples, versions and the commit here")
    args = parser.parse_args(argv)
    defaults = DEFAULTS[args.scenario]
    rate = defaults["rate"] if args.rate is None else args.rate
    settings = Settings(
        scenario=args.scenario,
        tasks=args.tasks or defaults["tasks"][0 if args.quick else 1],
        rate=rate or None,
        workers=args.workers,
        concurrency=args.concurrency,
        limit=args.limit or defaults["limit"],
        hold=defaults["hold"] if args.hold is None else args.hold,
        interval=args.interval,
        ctl_every=args.ctl_every,
        timeout=0.0,
        send=args.send,
    )
    settings = dataclasses.replace(
        settings, timeout=args.timeout if args.timeout is not None else defaults["timeout"] * settings.ideal + 180
    )
    rounds = args.rounds or (1 if args.quick else 3)
    broker_arg = args.broker or defaults["broker"]
    brokers = list(BROKERS) if broker_arg == "both" else [broker_arg]
    began = time.monotonic()
    meta: dict[str, Any] = {
        "commit": git("log", "--oneline", "-1") or "unknown (not a git checkout)",
        "library_changes_not_committed": git("status", "--porcelain", "--", "celery_semaphore").splitlines(),
        "tree": str(ROOT),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(["python -m benchmarks.bench_backlog", *(argv if argv is not None else sys.argv[1:])]),
        "settings": asdict(settings),
        "rounds": rounds,
        "load_at_start": os.getloadavg(),
        "rabbitmqctl": RABBITMQCTL or "n/a",
        **versions(),
    }
    outcomes: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    with backlog_lab() as lab:
        for broker in brokers:
            print(f"{broker} ...", file=sys.stderr, flush=True)
            outcomes[broker], errors[broker], why = run(lab, settings, broker, rounds)
            if why:
                skipped[broker] = why
    meta["seconds"] = time.monotonic() - began
    meta["load_at_end"] = os.getloadavg()
    dirty = meta["library_changes_not_committed"]
    changes = f" + {len(dirty)} uncommitted change(s) in celery_semaphore/" if dirty else ""
    print(f"\n{meta['command']}   ({meta['started']})")
    print(f"commit {meta['commit'][:72]}{changes}; tree {meta['tree']}")
    print(
        f"celery {meta['celery']}, kombu {meta['kombu']}, redis-py {meta['redis-py']}, "
        f"redis-server {meta['redis-server']}, Python {meta['python']}, {meta['cpus']} CPUs; "
        f"RabbitMQ {AMQP_URL}; rabbitmqctl {meta['rabbitmqctl']}; ran {meta['seconds']:.0f} s; load average "
        f"{meta['load_at_start'][0]:.2f} at the start, {meta['load_at_end'][0]:.2f} at the end; "
        f"worker logs in {log_dir() if outcomes else '-'}"
    )
    packages = {path for results in outcomes.values() for r in results for path in r["packages"].values()}
    stray = sorted(path for path in packages if not path.startswith(str(ROOT) + os.sep))
    print(f"workers imported celery_semaphore from: {', '.join(sorted(packages)) or '?'}")
    if stray:
        print(f"  WARNING: not from the tree measured ({ROOT}): {', '.join(stray)}")
    for broker in brokers:
        print()
        rule = f"semaphore_rate {settings.rate}/s" if settings.rate else "no rate"
        baseline = ""
        if settings.scenario == "throughput":
            baseline = f"; baseline: the same tasks plain (no semaphore) on 1 worker x {settings.concurrency}"
        print(
            f"{broker}: {settings.tasks} tasks sent at once, {rule}, limit {settings.limit}, "
            f"{settings.hold * 1000:g} ms bodies, {settings.workers} workers x {settings.concurrency} prefork, "
            f"{'Redis broker' if broker == 'redis' else 'RabbitMQ'}{baseline}; "
            f"ideal {'N/R' if settings.rate else 'N x hold / limit'} = {settings.ideal:g} s; {rounds} round(s)"
        )
        if broker in skipped:
            print(f"  SKIPPED: {skipped[broker]}")
            continue
        if outcomes[broker]:
            print("\n".join(report(broker, outcomes[broker], settings)))
        for error in errors[broker]:
            print(f"  FAILED {error.splitlines()[0]}")
    found = verdicts(outcomes, settings)
    if found:
        print("\ntargets: median (min-max) over the rounds; judged on the worst round")
        print(table([["broker", "figure", "measured", "target", "met"], *found], left=2))
    if settings.scenario == "throughput":
        legend = (
            "makespan: first send to last body start, of the semaphore case (W workers) and of the plain case "
            "(no semaphore, 1 worker of as many processes), run in the same round, the order alternating; "
            "tasks/s: N / makespan; ideal: N x hold / limit. max conc.: the most bodies seen running at once "
            "(a probe around each body, independent of the semaphore). "
        )
    else:
        legend = (
            f"steady: between the {STEADY[0]:.0%} and {STEADY[1]:.0%} percentile body starts. max any 1 s: most "
            "body starts (worker clock) / grants (Redis server clock) in any sliding 1 s window. makespan: first "
            "send to last body start (a window that starts empty lets the first R start at once: the last can "
            "start at (N - R)/R). "
        )
    print(
        "\ndeliv.: messages a worker received per task id (task_received: refused deliveries and ETA copies "
        f"included); runs: runs in a pool process (task_prerun, refused runs included); execs: bodies run. {legend}"
        "waiting: sent, body not started. held: unacked messages (Redis: HLEN unacked; RabbitMQ: rabbitmqctl); "
        "held at end: copies still outstanding once every body has run (each comes back once more, to be dropped). "
        "B/waiting: memory growth at its peak / tasks waiting then (n/a for RabbitMQ's queue memory, which "
        "peaks after the backlog). of which main processes: the growth of the workers' main processes' RSS to its peak."
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"meta": meta, "brokers": outcomes, "errors": errors, "skipped": skipped, "targets": found},
                out,
                indent=2,
                default=str,
            )


if __name__ == "__main__":
    main()
