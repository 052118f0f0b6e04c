"""A Celery app for the integration tests, configured from the environment so that worker
subprocesses and the test process build the same app.

Tasks record when they start and end in Redis (through the concurrency probe), so a test can
compute the true maximum of concurrent executions per semaphore key, independently of the
semaphore itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import redis
from celery import Celery, signals
from celery.exceptions import Ignore, Reject

from celery_semaphore import SemaphoreTask, limit_concurrency

from ..concurrency_probe import ConcurrencyProbe

app = Celery(
    "proj",
    broker=os.environ.get("PROJ_BROKER_URL", "redis://127.0.0.1:1/0"),
    backend=os.environ.get("PROJ_RESULT_URL", "redis://127.0.0.1:1/2"),
)
app.conf.update(
    semaphore_backend_url=os.environ.get("PROJ_SEMAPHORE_URL", "redis://127.0.0.1:1/1"),
    task_default_queue=os.environ.get("PROJ_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=600,
    # limits from configuration only (no semaphore_limit in code for these)
    semaphore_limits={
        "crawl:*": 2,
        "proj.config_only": 2,
        "bench:*": 3,
        # a line capped in the settings, not in the task's options
        "proj.capped_by_settings": {"limit": 1, "max_waiters": 2, "on_full": "reject"},
        # at most 2 of the 3 slots for one customer
        "proj.fair_capped": {"limit": 3, "per_tenant": 2},
        # the chaos run's orgs too
        "proj.chaos": {"limit": 3, "per_tenant": 2},
    },
    semaphore_shares={"big:*": 3},
)
app.conf.update(json.loads(os.environ.get("PROJ_CONF", "{}")))
# The Redis transport restores a dead worker's unacked messages under a lock that expires after
# 300 s by default. The tests SIGKILL whole workers, and all share one broker: a worker killed
# while it held the lock would stop every worker's restores for five minutes.
if str(app.conf.broker_url).startswith(("redis", "sentinel")):
    app.conf.broker_transport_options = {"unacked_mutex_expire": 5, **(app.conf.broker_transport_options or {})}

# A run's record is remembered an hour or two past its grant (wait_runs.remember_for): too long
# for a test of what outlives it. Workers started with PROJ_SHORT_RUN_MEMORY remember a run for
# its copies' longest time away only (a 2 s backstop: 17 s), or the visibility timeout if longer.
if os.environ.get("PROJ_SHORT_RUN_MEMORY"):
    from celery_semaphore._celery import wait_runs

    wait_runs.REMEMBER_SLACK = 0.0
    wait_runs.KEPT_APART_BACKSTOP_S = 0.0

_probe_client: redis.Redis | None = None


def probe(key: str) -> ConcurrencyProbe:
    """The probe of one semaphore key, in db 3 of the semaphore's Redis."""
    global _probe_client
    if _probe_client is None:
        _probe_client = redis.Redis.from_url(os.environ.get("PROJ_PROBE_URL", "redis://127.0.0.1:1/3"))
    return ConcurrencyProbe(_probe_client, f"probe:{key}")


def _held(key: str, seconds: float, task_id: str) -> None:
    """Run the limited "work", recording "<task id> <time>" at start and end."""
    p = probe(key)
    p.enter()
    p.client.rpush(f"probe:{key}:starts", f"{task_id} {time.time()}")
    try:
        time.sleep(seconds)  # the work being limited
    finally:
        p.leave()
        p.client.rpush(f"probe:{key}:ends", f"{task_id} {time.time()}")


@app.task(base=SemaphoreTask, semaphore_limit=3, bind=True, name="proj.hold")
def hold(self: Any, seconds: float, key: str = "proj.hold") -> str:
    _held(key, seconds, self.request.id)
    return str(self.request.id)


@limit_concurrency(key="crawl:{host}", app=app, bind=True, name="proj.crawl")
def crawl(self: Any, host: str, seconds: float) -> str:
    _held(f"crawl:{host}", seconds, self.request.id)
    return host


@limit_concurrency(key="bench:{name}", app=app, bind=True, name="proj.keyed")
def keyed(self: Any, seconds: float, name: str) -> str:
    """Limited per name by the bench:* glob; for the benchmarks."""
    _held(f"bench:{name}", seconds, self.request.id)
    return str(self.request.id)


@app.task(base=SemaphoreTask, name="proj.config_only", bind=True)
def config_only(self: Any, seconds: float) -> str:
    _held("proj.config_only", seconds, self.request.id)
    return "ok"


@app.task(base=SemaphoreTask, semaphore_limit=1, name="proj.fail")
def fail(message: str) -> None:
    raise RuntimeError(message)


@app.task(base=SemaphoreTask, semaphore_limit=1, bind=True, name="proj.own_retry", max_retries=1)
def own_retry(self: Any) -> str:
    if self.request.retries == 0:
        raise self.retry(countdown=1)
    return "second time"


@app.task(base=SemaphoreTask, semaphore_limit=1, name="proj.ignored")
def ignored() -> None:
    raise Ignore()


@app.task(base=SemaphoreTask, semaphore_limit=1, name="proj.rejected")
def rejected() -> None:
    raise Reject("no", requeue=False)


@app.task(name="proj.unlimited", bind=True)
def unlimited(self: Any, seconds: float, key: str) -> str:
    """No semaphore: a baseline for the benchmarks (the worker's concurrency is the limit)."""
    _held(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(name="proj.imported")
def imported(module: str) -> bool:
    """No semaphore: whether the pool process that runs it has ``module`` imported already."""
    return module in sys.modules


@app.task(base=SemaphoreTask, semaphore_limit=1, name="proj.sleepy", bind=True)
def sleepy(self: Any, seconds: float, key: str = "proj.sleepy") -> str:
    """Holds its slot for a long time: for revoke, time-limit and kill tests."""
    _held(key, seconds, self.request.id)
    return "woke"


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=1,
    bind=True,
    name="proj.no_retries",
    max_retries=0,
)
def no_retries(self: Any, seconds: float) -> dict[str, Any]:
    """Waits by countdown re-sends only; reports what waiting did to its request."""
    _held("proj.no_retries", seconds, self.request.id)
    return {
        "retries": self.request.retries,
        "waits": getattr(self.request, "csem_waits", None),
        # the package's headers its message carries (a message's headers are its request's fields)
        "headers": sorted(name for name in vars(self.request) if name.startswith(("semaphore_", "csem_"))),
    }


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_max_wait=2,
    semaphore_inline_wait=0,
    semaphore_countdown=1,
    name="proj.impatient",
)
def impatient() -> str:
    return "ran"


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_max_wait=2.5,
    semaphore_inline_wait=0,
    semaphore_countdown=1,
    name="proj.waits_then_retries",
    bind=True,
    max_retries=1,
)
def waits_then_retries(self: Any, seconds: float) -> dict[str, Any]:
    """Waits for its slot, runs, then retries itself once after a delay: the retry's wait must
    start afresh, not count the first wait, the run and the retry delay against the max wait."""
    _held("proj.waits_then_retries", seconds, self.request.id)
    if self.request.retries == 0:
        raise self.retry(countdown=2)
    return {"retries": self.request.retries, "waits": getattr(self.request, "csem_waits", None)}


@app.task(base=SemaphoreTask, semaphore_limit=1, name="proj.soft_limited", bind=True, soft_time_limit=0.5)
def soft_limited(self: Any) -> str:
    """Overruns its soft time limit: SoftTimeLimitExceeded is raised inside the body."""
    _held("proj.soft_limited", 30, self.request.id)
    return "not reached"


@app.task(base=SemaphoreTask, semaphore_limit=1, name="proj.hard_limited", bind=True, time_limit=1)
def hard_limited(self: Any) -> str:
    """Overruns its hard time limit: the pool child is killed, no finally runs."""
    _held("proj.hard_limited", 30, self.request.id)
    return "not reached"


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=5,
    name="proj.handoff",
    bind=True,
)
def handoff(self: Any, seconds: float, key: str = "proj.handoff") -> str:
    """Waits outside the worker (countdown 5 s): a release must bring it back long before that."""
    _held(key, seconds, self.request.id)
    return str(self.request.id)


def _line_task(name: str, doc: str, **options: Any) -> Any:
    """A task of limit 1 that waits outside the worker (countdown 5 s, so a release must bring
    it back long before) and records its run under the probe ``key`` of its call; ``options``
    say how its line is ordered. Its other arguments are keywords the options' templates read."""

    def run(self: Any, seconds: float, *, key: str, **call: Any) -> str:
        _held(key, seconds, self.request.id)
        return str(self.request.id)

    run.__doc__ = doc
    options = {"semaphore_limit": 1, "semaphore_inline_wait": 0, "semaphore_countdown": 5, **options}
    return app.task(base=SemaphoreTask, name=name, bind=True, **options)(run)


fair = _line_task("proj.fair", "Placed in line by its customer's share.", semaphore_fair_by="{customer}")
fair_capped = _line_task(
    "proj.fair_capped",
    "Placed in line by its customer's share; one customer holds at most 2 of the 3 slots.",
    semaphore_fair_by="{customer}",
)
fair_in_org = _line_task(
    "proj.fair_in_org",
    "Placed in line by its org's share, then served by its user's share inside the org.",
    semaphore_fair_by=("{org}", "{user}"),
)
ranked = _line_task(
    "proj.ranked",
    "Placed earlier by its priority: the option's function or the message header.",
    semaphore_priority=lambda args, kwargs: kwargs.get("urgency", 0),
)
capped = _line_task(
    "proj.capped", "At most two wait: a third fails at once.", semaphore_max_waiters=2, semaphore_on_full="reject"
)
capped_by_settings = _line_task(
    "proj.capped_by_settings", "At most two wait (semaphore_limits says so): a third fails at once."
)
dropping = _line_task(
    "proj.dropping",
    "At most two wait: a third that comes makes the oldest waiting one fail.",
    semaphore_max_waiters=2,
    semaphore_on_full="drop_oldest",
)
refresh = _line_task(
    "proj.refresh",
    "One waiting refresh per dashboard: a newer one takes the older one's place.",
    semaphore_on_full="keep_latest",
    semaphore_coalesce_by="{dashboard}",
)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=1,
    name="proj.handoff_twin",
    bind=True,
    acks_late=True,
)
def handoff_twin(self: Any, seconds: float, key: str = "proj.handoff_twin") -> str:
    """Its backstop copy (1 s) arrives while its woken copy still runs (acks_late: without it,
    the copy kept in the broker's Redis is withdrawn as the run begins)."""
    _held(key, seconds, self.request.id)
    return str(self.request.id)


@signals.task_retry.connect
def _record_handoff_twin_retry(request: Any = None, **_: Any) -> None:
    """Every retry proj.handoff_twin records in the result backend (a copy that waits on its
    twin must record none: the run owns the task's state)."""
    if getattr(request, "task", None) == "proj.handoff_twin":
        probe("proj.handoff_twin").client.rpush("probe:proj.handoff_twin:retries", str(request.id))


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=4,
    semaphore_lease=2,
    name="proj.handoff_faults",
    bind=True,
    acks_late=True,
)
def handoff_faults(self: Any, seconds: float, key: str = "proj.handoff_faults") -> str:
    """For the fault tests: waits outside the worker, short lease, acks late."""
    _held(key, seconds, self.request.id)
    return str(self.request.id)


# --- several keys and weights ---------------------------------------------------


@limit_concurrency(
    3,
    key=["crawl:{host}", "crawl-all"],
    app=app,
    bind=True,
    name="proj.crawl_multi",
    semaphore_inline_wait=0,
    semaphore_countdown=5,
)
def crawl_multi(self: Any, host: str, seconds: float) -> str:
    """At most 2 per host ("crawl:*" in semaphore_limits) and 3 in all (its own limit); it waits
    outside the worker (countdown 5 s), so hand-off must bring it back."""
    total = probe("crawl-all")
    total.enter()
    try:
        _held(f"crawl:{host}", seconds, self.request.id)
    finally:
        total.leave()
    return host


@limit_concurrency(1, key=["pair-x", "pair-y"], app=app, bind=True, name="proj.pair_xy")
def pair_xy(self: Any, seconds: float) -> str:
    _held("pair", seconds, self.request.id)
    return "xy"


@limit_concurrency(1, key=["pair-y", "pair-x"], app=app, bind=True, name="proj.pair_yx")
def pair_yx(self: Any, seconds: float) -> str:
    _held("pair", seconds, self.request.id)
    return "yx"


def _gpus(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    return int(kwargs["gpus"] if "gpus" in kwargs else args[0])


@limit_concurrency(
    4,
    key="gpu",
    app=app,
    bind=True,
    name="proj.gpu",
    semaphore_weight=_gpus,
    semaphore_inline_wait=0,
    semaphore_countdown=5,
    acks_late=True,
)
def gpu(self: Any, gpus: int, seconds: float, key: str = "gpu") -> str:
    """Takes ``gpus`` of 4 GPUs; records each GPU it takes in the probe of ``key``."""
    p = probe(key)
    for _ in range(gpus):
        p.enter()
    p.client.rpush(f"probe:{key}:starts", f"{self.request.id} {time.time()} {gpus}")
    try:
        time.sleep(seconds)
    finally:
        for _ in range(gpus):
            p.leave()
    return str(self.request.id)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=(1, 30),
    name="proj.parked_backlog",
    bind=True,
)
def parked_backlog(self: Any, seconds: float, key: str = "proj.parked_backlog") -> str:
    """Waits outside the worker with countdowns from 1 to 30 s: a backlog of these must not
    bounce (refused, re-sent, refused again) while the line is long."""
    _held(key, seconds, self.request.id)
    return str(self.request.id)


# --- the chaos run (tests/operations/test_chaos.py) ---------------------------------------------------


@app.task(
    base=SemaphoreTask,
    semaphore_limit=3,
    semaphore_inline_wait=0,
    semaphore_countdown=(1, 3),
    semaphore_lease=2,
    # three orgs of four users, so that the chaos also runs the line's fair-share ordering, the
    # choice of an org's user at each hand-off and (semaphore_limits) the cap of 2 slots an org
    semaphore_fair_by=(
        lambda args, kwargs: f"org{int(args[0] * 1000) % 3}",
        lambda args, kwargs: f"user{int(args[0] * 10000) % 4}",
    ),
    name="proj.chaos",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
)
def chaos(self: Any, seconds: float, key: str = "chaos") -> str:
    """Every wait is a re-sent message (no in-process wait), a killed holder's slot comes back
    within 2 s, and a child killed mid-body has its message redelivered. Records its process id
    with its start and end, so a run cut short by a kill ends when that process was killed.
    Its calls belong to three orgs of four users each (semaphore_fair_by), at most 2 slots an org."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


def _held_by_process(key: str, seconds: float, task_id: str) -> None:
    """The limited "work", recording "<task id> <process id> <time>" at start and end (no end
    when its process is killed)."""
    client = probe(key).client
    client.rpush(f"probe:{key}:starts", f"{task_id} {os.getpid()} {time.time()}")
    time.sleep(seconds)  # the work being limited
    client.rpush(f"probe:{key}:ends", f"{task_id} {os.getpid()} {time.time()}")


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=20,
    semaphore_lease=30,
    name="proj.requeued",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
)
def requeued(self: Any, seconds: float, key: str = "requeued") -> str:
    """Its message is requeued when its process is killed mid-run; its slot's lease (30 s) and
    its backstop (20 s) are far off, so only the worker giving the slot back brings it back soon."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=3,
    semaphore_countdown=(1, 3),
    semaphore_lease=2,
    name="proj.chaos_standing_by",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
)
def chaos_standing_by(self: Any, seconds: float, key: str = "chaos_standing_by") -> str:
    """The chaos run's task on a line with a bare limit and the default inline wait: its holds
    are short, so a release wakes the next two parked tasks ahead of their offer and they wait
    for it in their pool process (standing by), where the SIGKILLs also find them."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


# the probe key of each chaos task's records
CHAOS_KEYS = {"proj.chaos": "chaos", "proj.chaos_standing_by": "chaos_standing_by"}


@signals.task_prerun.connect
def _record_chaos_delivery(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    """Every delivery of a chaos task, so a task never seen by any worker (lost by the broker
    before delivery) can be told from one lost while it waited."""
    key = CHAOS_KEYS.get(getattr(task, "name", None) or "")
    if key is not None:
        probe(key).client.rpush(f"probe:{key}:deliveries", f"{task_id} {os.getpid()} {time.time()}")


# --- exactly once, whatever happens to the workers ------------------------------


def _first_run_of(key: str, task_id: str) -> bool:
    """Whether this is the first body run of ``task_id`` under the probe ``key`` (counted in Redis,
    so across processes and workers)."""
    return int(probe(key).client.hincrby(f"probe:{key}:runs", task_id, 1)) == 1


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=30,
    name="proj.reject_once",
    bind=True,
    acks_late=True,
)
def reject_once(self: Any, seconds: float, key: str = "reject_once") -> str:
    """Rejects its message with requeue on its first run (a body that cannot work now and hands
    the message back to the broker); the requeued delivery must run and complete."""
    _held_by_process(key, seconds, self.request.id)
    if _first_run_of(key, self.request.id):
        raise Reject("not now", requeue=True)
    return str(self.request.id)


class _KilledBeforeItsOutcome(SemaphoreTask):  # type: ignore[misc]
    """The first run of each task id has its process SIGKILLed after ``__call__`` returned (the
    body done, the semaphore's part of the call ended) and before Celery stores the result and
    acknowledges the message: the window in which a pool process killed left a waited task
    with its run marked finished and no success (the full chaos test hit it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = super().__call__(*args, **kwargs)
        if _first_run_of("killed_before_its_outcome:calls", self.request.id):
            os.kill(os.getpid(), 9)
        return result


@app.task(
    base=_KilledBeforeItsOutcome,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=30,
    name="proj.killed_before_its_outcome",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
)
def killed_before_its_outcome(self: Any, seconds: float, key: str = "killed_before_its_outcome") -> str:
    """acks_late and reject_on_worker_lost: Celery delivers it again when its process is lost."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=30,
    semaphore_lease=15,
    name="proj.long_acks_late",
    bind=True,
    acks_late=True,
)
def long_acks_late(self: Any, seconds: float, key: str = "long_acks_late") -> str:
    """acks_late, a 15 s lease: the first run takes ``seconds`` (its worker is killed meanwhile),
    a later one a moment."""
    first = _first_run_of(key, self.request.id)
    _held_by_process(key, seconds if first else 0.1, self.request.id)
    return str(self.request.id)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=4,
    name="proj.at_most_once",
    bind=True,
)
def at_most_once(self: Any, seconds: float, key: str = "at_most_once") -> str:
    """No acks_late: Celery delivers it at most once; its waits are re-sent (4 s backstop)."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=2,
    semaphore_lease=5,
    name="proj.at_most_once_whole",
    bind=True,
)
def at_most_once_whole(self: Any, seconds: float, key: str = "at_most_once_whole") -> str:
    """No acks_late, a 5 s lease and a 2 s backstop: a whole worker killed mid-run must not
    see it run again once the lease lapses."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=30,
    name="proj.recycled",
    bind=True,
)
def recycled(self: Any, seconds: float, key: str = "recycled") -> str:
    """Waits outside the worker with a 30 s backstop: only hand-off brings it back in time."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=30,
    semaphore_lease=3,
    name="proj.short_lease",
    bind=True,
    acks_late=True,
)
def short_lease(self: Any, seconds: float, key: str = "short_lease") -> str:
    """A 3 s lease and a 30 s backstop: a slot whose holder's worker died comes back with the
    lease, and must reach a parked waiter then, not at its backstop."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=2,
    semaphore_inline_wait=0,
    semaphore_countdown=30,
    name="proj.two_slots",
    bind=True,
)
def two_slots(self: Any, seconds: float, key: str = "two_slots") -> str:
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


# --- the full chaos run (tests/operations/test_chaos.py) -------------------------------------


def rejects_first_attempt(task_id: str) -> bool:
    """Whether ``proj.chaos_full`` rejects the first attempt of ``task_id`` (about 1 in 20): a hash
    of the id, so the worker that runs it and the test that counts agree without telling each other."""
    import zlib  # here, not at the top: this section is appended to the module

    return zlib.crc32(task_id.encode()) % 20 == 0


@app.task(
    base=SemaphoreTask,
    semaphore_limit=3,
    semaphore_inline_wait=0,
    semaphore_countdown=(1, 3),
    name="proj.chaos_full",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
)
def chaos_full(self: Any, seconds: float, key: str = "chaos_full") -> str:
    """proj.chaos with the default 60 s lease (a whole worker's death strands its slots for up to
    a minute), a result backend (a copy whose run record the semaphore's Redis lost finds the
    success there), and ``Reject(requeue=True)`` on some first attempts.

    Attempts are counted per task id in Redis (HINCRBY), so "first" holds across processes.
    Records, with the process id: each start; each end, in a ``finally`` so that a run cut short
    by SystemExit (a cold shutdown's SIGTERM of the pool) ends before its slot is given back; each
    body that returned (no record when it was rejected or cut short); and (below) each run that
    completed: its success stored in the result backend, as Celery counts a task done."""
    client = probe(key).client
    task_id, pid = str(self.request.id), os.getpid()
    attempt = int(client.hincrby(f"probe:{key}:attempts", task_id, 1))
    client.rpush(f"probe:{key}:starts", f"{task_id} {pid} {time.time()}")
    try:
        if attempt == 1 and rejects_first_attempt(task_id):
            client.rpush(f"probe:{key}:rejects", f"{task_id} {pid} {time.time()}")
            raise Reject("not on the first attempt", requeue=True)
        time.sleep(seconds)  # the work being limited
        client.rpush(f"probe:{key}:returned", f"{task_id} {pid} {time.time()}")
    finally:
        client.rpush(f"probe:{key}:ends", f"{task_id} {pid} {time.time()}")
    return task_id


@signals.task_prerun.connect
def _record_chaos_full_delivery(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    """Every delivery of a proj.chaos_full task (copies dropped or re-sent included), so a task
    no worker ever saw can be told from one lost while it waited."""
    if getattr(task, "name", None) == "proj.chaos_full":
        probe("chaos_full").client.rpush("probe:chaos_full:deliveries", f"{task_id} {os.getpid()} {time.time()}")


@signals.task_success.connect
def _record_chaos_full_completion(sender: Any = None, result: Any = None, **_: Any) -> None:
    """A proj.chaos_full run whose success was stored (Celery sends task_success after that).
    A body that returned but whose process was killed before its success was stored did not
    complete: with acks_late Celery delivers its message again, and it runs again."""
    if getattr(sender, "name", None) == "proj.chaos_full":
        probe("chaos_full").client.rpush("probe:chaos_full:completed", f"{result} {os.getpid()} {time.time()}")


@app.task(base=SemaphoreTask, semaphore_limit=1, name="proj.stubborn", bind=True, time_limit=1)
def stubborn(self: Any, key: str = "stubborn") -> str:
    """Overruns its hard time limit and ignores the SIGTERM that comes first: it runs on until
    the SIGKILL. Beats "<task id> <time>" every 5 ms, so a test sees exactly how long it lived."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    client = probe(key).client
    client.rpush(f"probe:{key}:starts", f"{self.request.id} {os.getpid()} {time.time()}")
    while True:
        client.hset(f"probe:{key}:alive", self.request.id, time.time())
        time.sleep(0.005)


@app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_key="proj.stubborn", name="proj.after_stubborn", bind=True)
def after_stubborn(self: Any, key: str = "stubborn") -> str:
    """Waits for the slot proj.stubborn holds; records its start."""
    probe(key).client.rpush(f"probe:{key}:starts", f"{self.request.id} {os.getpid()} {time.time()}")
    return str(self.request.id)


@app.task(base=SemaphoreTask, semaphore_limit=1, name="proj.rolling", bind=True)
def rolling(self: Any, seconds: float, key: str = "rolling") -> str:
    """The default wait policy, limit 1: for the rolling-restart test."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=(1, 2),
    name="proj.dies_at_first_refusal",
    bind=True,
    acks_late=True,
)
def dies_at_first_refusal(self: Any, key: str = "dies_at_first_refusal") -> str:
    """acks_late, a 2 s backstop: its first refusal kills its whole worker (below) after the
    copy of its wait was sent and before its message was acked."""
    _held_by_process(key, 0.1, self.request.id)
    return str(self.request.id)


@signals.task_retry.connect
def _kill_the_worker_at_a_first_refusal(request: Any = None, **_: Any) -> None:
    """Fault injection, for a moment no outside signal can hit: proj.dies_at_first_refusal's
    first refusal SIGKILLs its worker's main process (then its own), after the refused
    delivery re-sent the copy of its wait and before the main process acked the message, so
    that the broker delivers that first message again."""
    import signal

    if getattr(request, "task", None) != "proj.dies_at_first_refusal":
        return
    if (
        int(probe("dies_at_first_refusal").client.hincrby("probe:dies_at_first_refusal:refusals", str(request.id), 1))
        == 1
    ):
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=30,
    name="proj.retries_elsewhere",
    bind=True,
)
def retries_elsewhere(self: Any, queue: str, key: str) -> str:
    """Its first run records "<task id> <pid> <queue it came from>", holds the slot 0.5 s (so
    that a caller can queue up behind it) and retries itself into ``queue``; the retry records
    its queue and ends."""
    client = probe(key).client
    delivery = self.request.delivery_info or {}
    came_from = str(delivery.get("routing_key") or "").removesuffix(".semaphore-wake")
    client.rpush(f"probe:{key}:starts", f"{self.request.id} {os.getpid()} {came_from}")
    if self.request.retries == 0:
        time.sleep(0.5)
        raise self.retry(queue=queue, countdown=0)
    return str(self.request.id)


def _record_grant(task: Any, key: str) -> None:
    """Record "<task id> <granted ms>": the server time Redis granted the running task its slot
    (as the acquire script wrote it), so windows are checked in the server time rules use."""
    lease = task.semaphore_held()
    info = lease.semaphore.client.hget(lease.semaphore.keys.holder_info, f"h:{lease.token}")
    probe(key).client.rpush(f"probe:{key}:granted", f"{task.request.id} {info.decode().split('|')[0]}")


@app.task(base=SemaphoreTask, semaphore_rate=(5, 1.0), bind=True, name="proj.rated")
def rated(self: Any, seconds: float, key: str = "rated") -> str:
    """At most 5 starts in any second, no concurrency limit."""
    _record_grant(self, key)
    # how often its copy, due later than a worker may hold it, went back to the broker
    probe(key).client.rpush(f"probe:{key}:handed_back", int(getattr(self.request, "csem_handed_back", 0) or 0))
    _held(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(base=SemaphoreTask, semaphore_rate=(10, 1.0), bind=True, name="proj.rated_placed")
def rated_placed(self: Any, seconds: float, key: str = "rated_placed") -> str:
    """10 starts a second, no concurrency limit: once its line knows its holds are short, they
    say a slot comes at once, and only its rate says when (tests/celery/test_celery_rates.py)."""
    _record_grant(self, key)
    _held(key, seconds, self.request.id)
    return str(self.request.id)


@signals.task_prerun.connect
def _record_rated_placed_delivery(task_id: str | None = None, task: Any = None, args: Any = None, **_: Any) -> None:
    """Every run of a proj.rated_placed task in a pool process, refused ones included."""
    if getattr(task, "name", None) == "proj.rated_placed" and task_id is not None:
        key = args[1] if args and len(args) > 1 else "rated_placed"
        probe(key).client.hincrby(f"probe:{key}:deliveries", task_id, 1)


@app.task(base=SemaphoreTask, semaphore_limit=3, semaphore_spacing=0.3, bind=True, name="proj.spaced")
def spaced(self: Any, seconds: float, key: str = "spaced") -> str:
    """A host with a Crawl-delay of 0.3 s, 3 at once."""
    _record_grant(self, key)
    _held(key, seconds, self.request.id)
    return str(self.request.id)


def _server_ms(client: Any) -> int:
    """The semaphore's Redis server time, in ms (what its scripts stamp grants and pauses with)."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


@app.task(base=SemaphoreTask, semaphore_limit=2, bind=True, name="proj.throttled_api")
def throttled_api(self: Any, seconds: float, answer_429_for: float = 0.0, key: str = "throttled_api") -> str:
    """An API call; a call given ``answer_429_for`` hears "429, Retry-After" on its first run
    and pauses the key for that long."""
    _record_grant(self, key)
    if answer_429_for and probe(key).client.sadd(f"probe:{key}:told", self.request.id):
        server = self.semaphore_held().semaphore.client
        probe(key).client.rpush(f"probe:{key}:paused", f"{self.request.id} {_server_ms(server)}")
        try:
            self.semaphore_pause(answer_429_for)
        finally:  # in force from here: a grant between the stamp above and the pause came before it
            probe(key).client.rpush(f"probe:{key}:paused_after", f"{self.request.id} {_server_ms(server)}")
    _held(key, seconds, self.request.id)
    return str(self.request.id)


def _wait_for_gate(gate: str) -> None:
    """Block until the test opens ``gate`` (pushes to the key), for at most 60 s (in short
    BLPOPs: a client's socket timeout would end a long one)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not probe(gate).client.blpop([f"gate:{gate}"], timeout=1):
        pass


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=30,
    name="proj.gated_slot",
    bind=True,
)
def gated_slot(self: Any, gate: str, key: str = "proj.gated_slot") -> str:
    """Holds the only slot of its task until ``gate`` opens (an empty gate: not at all); ``key``
    names its probe."""
    _held(key, 0, self.request.id)
    if gate:
        _wait_for_gate(gate)
    return str(self.request.id)


@app.task(name="proj.gated", bind=True)
def gated(self: Any, gate: str) -> str:
    """No semaphore: keeps its pool process busy until ``gate`` opens."""
    _wait_for_gate(gate)
    return str(self.request.id)


# --- chaos with the semaphore's Redis restarted empty and no result backend (tests/operations/test_chaos.py) ---


@app.task(
    base=SemaphoreTask,
    semaphore_limit=3,
    semaphore_inline_wait=0,
    semaphore_countdown=(1, 10),
    semaphore_lease=6,
    name="proj.chaos_restart",
    bind=True,
    acks_late=False,
    ignore_result=True,
)
def chaos_restart(self: Any, seconds: float, key: str = "chaos_restart") -> str:
    """No result backend to ask (``ignore_result``, and the test's workers run with none): once
    the semaphore's Redis lost the run records, only the withdrawal of a finished run's stored
    copy keeps that run from coming back. Without acks_late: Celery runs it at most once."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=3,
    semaphore_inline_wait=0,
    semaphore_countdown=(1, 10),
    semaphore_lease=6,
    name="proj.chaos_restart_late",
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
)
def chaos_restart_late(self: Any, seconds: float, key: str = "chaos_restart_late") -> str:
    """proj.chaos_restart with acks_late and reject_on_worker_lost: a body killed mid-run is
    delivered again."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@signals.task_prerun.connect
def _record_chaos_restart_delivery(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    """Every delivery of a proj.chaos_restart(_late) task, under its own probe key."""
    name = getattr(task, "name", None)
    if name in ("proj.chaos_restart", "proj.chaos_restart_late"):
        key = name.removeprefix("proj.")
        probe(key).client.rpush(f"probe:{key}:deliveries", f"{task_id} {os.getpid()} {time.time()}")


# --- a refused delivery's memory (tests/celery/test_refusal_memory.py) ----------------------------


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1000,
    semaphore_rate="1/h",
    semaphore_inline_wait=0,
    name="proj.quota_refused",
    bind=True,
)
def quota_refused(self: Any) -> str:
    """One start an hour: every delivery after the first is refused, its start hours away."""
    return str(self.request.id)


@app.task(name="proj.exception_infos_alive")
def exception_infos_alive() -> int:
    """How many billiard ExceptionInfo objects this pool process keeps alive (each refused
    delivery built one of about 0.3 MB)."""
    import gc

    return sum(1 for thing in gc.get_objects() if type(thing).__name__ == "ExceptionInfo")


# The tasks of test_run_records: each waits outside the worker, its backstop copy due in 2 s.
_BACKSTOP_IN_2_S: dict[str, Any] = {
    "base": SemaphoreTask,
    "semaphore_inline_wait": 0,
    "semaphore_countdown": 2,
    "bind": True,
}


@app.task(**_BACKSTOP_IN_2_S, semaphore_limit=2, semaphore_lease=2, acks_late=True, name="proj.outlives_its_record")
def outlives_its_record(self: Any, seconds: float, key: str = "outlives_its_record") -> str:
    """A 2 s lease and a 2 s backstop: a body of ``seconds`` outlives its run's record as first
    remembered, while its backstop copy keeps coming back (every lease + 1 s) beside it."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(**_BACKSTOP_IN_2_S, semaphore_limit=1, name="proj.rejects_after_its_ack")
def rejects_after_its_ack(self: Any, seconds: float, key: str = "rejects_after_its_ack") -> str:
    """No acks_late: Celery acked its message before the body, so its Reject(requeue=True) hands
    nothing back, and Celery never runs it again. Its wait's backstop copy is due 2 s after."""
    _held_by_process(key, seconds, self.request.id)
    raise Reject("not now", requeue=True)


@app.task(
    **_BACKSTOP_IN_2_S,
    semaphore_limit=1,
    semaphore_lease=5,
    acks_late=True,
    reject_on_worker_lost=True,
    retry_on_worker_lost=True,
    max_retries=0,
    name="proj.lost_past_its_retries",
)
def lost_past_its_retries(self: Any, seconds: float, key: str = "lost_past_its_retries") -> str:
    """A lost worker's task is retried while retries are left, then fails (retry_on_worker_lost
    takes precedence over reject_on_worker_lost): with no retry left, a pool process killed mid-run
    ends it, and Celery requeues nothing. Its wait's backstop copy is due 2 s after."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@app.task(
    **_BACKSTOP_IN_2_S,
    semaphore_limit=1,
    acks_late=True,
    reject_on_worker_lost=True,
    track_started=True,
    name="proj.fails_then_lost",
)
def fails_then_lost(self: Any, seconds: float, key: str = "fails_then_lost") -> str:
    """Tracked (STARTED) and failing; the pool process of its first run is SIGKILLed (below) once
    Celery stored the FAILURE and the run was marked finished, before the ack: the message comes
    back (reject_on_worker_lost) as a copy of a run that finished, to be dropped."""
    _held_by_process(key, seconds, self.request.id)
    raise RuntimeError("the body failed")


@signals.task_postrun.connect
def _kill_after_the_outcome(task: Any = None, task_id: str | None = None, state: str | None = None, **_: Any) -> None:
    """Fault injection: the first run of each proj.fails_then_lost dies after its outcome (this
    receiver runs after celery_semaphore's, which marks the run finished) and before its ack. Only
    after the body failed: a refused delivery ends in task_postrun too (state RETRY)."""
    import signal

    if (
        getattr(task, "name", None) == "proj.fails_then_lost"
        and state == "FAILURE"
        and _first_run_of("fails_then_lost:killed", str(task_id))
    ):
        os.kill(os.getpid(), signal.SIGKILL)


# --- wake-ups the glue owes: a resume, a key list, a killed weighted holder (tests/celery/test_prompt_wakes.py) ---


@signals.task_retry.connect
def _record_gated_slot_retry(request: Any = None, **_: Any) -> None:
    """Every refusal of proj.gated_slot: a copy asked, was refused and left the worker."""
    if getattr(request, "task", None) == "proj.gated_slot":
        probe("proj.gated_slot").client.rpush("probe:proj.gated_slot:retries", str(request.id))


@signals.task_received.connect
def _record_receipt(request: Any = None, **_: Any) -> None:
    """When the worker's main process received each copy of proj.two_keys and proj.one_key
    (before any pool process takes it: a recycled pool's respawns do not count)."""
    name = getattr(request, "name", None)
    if name in ("proj.two_keys", "proj.one_key"):
        key = name.removeprefix("proj.")
        probe(key).client.rpush(f"probe:{key}:received", f"{request.id} {time.time()}")


@limit_concurrency(
    1, key=["z:a", "z:b"], app=app, bind=True, name="proj.two_keys", semaphore_inline_wait=0, semaphore_countdown=30
)
def two_keys(self: Any, seconds: float, key: str = "two_keys") -> str:
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@limit_concurrency(
    1, key="z:one", app=app, bind=True, name="proj.one_key", semaphore_inline_wait=0, semaphore_countdown=30
)
def one_key(self: Any, seconds: float, key: str = "one_key") -> str:
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


@limit_concurrency(
    4,
    key="heavy",
    app=app,
    bind=True,
    name="proj.heavy",
    # not shared: an app of another test inherits the shared tasks, and a fixed weight of 3 fails
    # its start check against a catch-all limit below 3
    shared=False,
    semaphore_weight=3,
    semaphore_inline_wait=0,
    semaphore_countdown=60,
)
def heavy(self: Any, seconds: float, key: str = "heavy") -> str:
    """Takes 3 of 4 slots; a 60 s backstop and the default 60 s lease, so that only the release
    of a killed holder's slots brings the next one in early."""
    _held_by_process(key, seconds, self.request.id)
    return str(self.request.id)


# --- where a task stands (tests/celery/test_why.py) -------------------------------------------------


@app.task(
    base=SemaphoreTask,
    semaphore_limit=1,
    semaphore_inline_wait=0,
    semaphore_countdown=30,
    name="proj.why_parks",
    bind=True,
)
def why_parks(self: Any, gate: str = "") -> str:
    """Holds its only slot until ``gate`` opens; its waiters park (no in-process wait)."""
    if gate:
        _wait_for_gate(gate)
    return str(self.request.id)


@app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_inline_wait=60, name="proj.why_waits", bind=True)
def why_waits(self: Any, gate: str = "") -> str:
    """Holds its only slot until ``gate`` opens; its first waiters wait in their worker."""
    if gate:
        _wait_for_gate(gate)
    return str(self.request.id)


@app.task(base=SemaphoreTask, semaphore_rate="1/m", semaphore_inline_wait=90, name="proj.why_rated", bind=True)
def why_rated(self: Any) -> str:
    """One start a minute: the second waits in its worker for the rate's window."""
    return str(self.request.id)


@app.task(
    base=SemaphoreTask,
    semaphore_limit=5,
    semaphore_spacing=60,
    semaphore_inline_wait=90,
    name="proj.why_spaced",
    bind=True,
)
def why_spaced(self: Any) -> str:
    """A minute between two starts: the second waits in its worker for the spacing."""
    return str(self.request.id)


@app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_inline_wait=90, name="proj.why_paused", bind=True)
def why_paused(self: Any) -> str:
    """For a key the test pauses."""
    return str(self.request.id)
