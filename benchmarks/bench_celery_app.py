"""The Celery app that the workers of ``benchmarks.bench_celery`` run (``celery -A`` this module).

Why an app of its own rather than tests/proj/app.py: the benchmark must measure the library and
nothing else, so its workers load only the tasks and signal handlers below (the test app's
handlers would add Redis calls to every delivery), and the benchmark does not break when the
test app changes. It reads the same environment variables as the test app (``PROJ_BROKER_URL``,
``PROJ_RESULT_URL``, ``PROJ_SEMAPHORE_URL``, ``PROJ_PROBE_URL``, ``PROJ_QUEUE``, ``PROJ_CONF``),
so the test helpers (tests/workers.py, tests/celery_stack.py) start and configure its workers.

Everything the benchmark reports is recorded here, *independently of the semaphore*, in the
probe database (db 3 of the broker's Redis), keyed by task id:

* ``bench:received`` (hash): messages of the task that reached a worker (``task_received``, in the
  worker's main process): how often the broker delivered it, copies that never ran included;
* ``bench:runs`` (hash): times the task was run in a pool child (``task_prerun``): deliveries;
* ``bench:asks`` (list of ``"<id> <time>"``): the first ``task_prerun`` of each task, one way to
  order the tasks by their first ask for a slot, whatever the semaphore believes;
* ``bench:calls`` (list of ``"<id> <time>"``): the same first run, stamped as the task's ``__call__``
  begins, the moment before the library (or the naive code) asks: the other way, and the closer
  one. Two tasks asking a millisecond apart in two pool children may be stamped in one order at
  prerun and reach the semaphore in the other. Both are pushed in ``task_postrun``, once the run's
  count has said it was the first, so they add nothing between the stamps and the ask;
* ``bench:starts`` / ``bench:ends`` (lists of ``"<id> <time> <worker> <key>"``): the body of the
  limited work, start and end; with the concurrency probe (``probe:<key>``) around it, the true
  number of bodies running at once per key;
* ``bench:released`` (list of ``"<id> <time> <worker> <key>"``): the moment the task's release
  began (stamped as the library's ``_release`` is entered), the start of a hand-off. Stamped
  there, not once the release returns: the release also sends the next waiter's wake copy from
  this process, and a stamp after it would leave that time out of the hand-off. A waited task
  releases in ``task_postrun``, after Celery stored its result: ``bench:call_ends`` (the same
  shape) is when its ``__call__`` returned, so that the hold through the store is seen apart;
* ``bench:received_at`` and ``bench:prerun_at`` (lists of ``"<id> <time>"``): every delivery's
  ``task_received`` (the worker's main process) and every run's ``task_prerun`` (a pool child),
  sent with the counts above; and ``bench:sent`` (the same shape): each wake-up's
  copy sent to a wake queue (the stored copy on the Redis broker, the wake copy on RabbitMQ),
  stamped after the send, in the process that sent it; ``bench:granted_at`` (the same shape): when
  a try of a key's semaphore (``FairSemaphore._try``, a claim of an offer among them) returned a
  grant, pushed with the body's start. With them the hand-off is split into its hops
  (``bench_celery``'s ``handoff`` breakdown);
* ``bench:durations`` (list of ``"<id> <ms>"``): ``task_prerun`` to ``task_postrun`` per run, the
  per-task cost with and without the semaphore;
* ``bench:failures`` (list): any task that failed, so that the benchmark stops instead of
  waiting for it.

No record waits for Redis on a task's way to its body: the counts and stamps of
``task_received`` and ``task_prerun`` are sent ahead on a connection of the probe client's pool,
without waiting for the reply (benchmarks/unread.py). Inside the slot only the body's start
(which the hand-off chains block on) and the concurrency probe wait; the rest are pushed in one
round trip in ``task_postrun``, after the library's release, the body's end last, so that a
benchmark that has seen a task end sees every record of it. A scenario that reads only starts,
ends, releases and failures (``rolling``) sets ``bench_records = "hand-off"`` in the workers'
configuration, and the other records are not kept.
"""

# Celery's decorators are untyped: the tasks and handlers below would each need an ignore.
# mypy: disable-error-code="untyped-decorator"

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from typing import Any

import redis
from celery import Celery, Task, signals

from benchmarks.unread import UnreadRecords
from celery_semaphore import FairSemaphore, Granted, MultiSemaphore, SemaphoreTask
from celery_semaphore._celery import parked_sends, parking
from celery_semaphore._celery.due_copies import DueCopies
from tests.concurrency_probe import ConcurrencyProbe

app = Celery(
    "bench",
    broker=os.environ.get("PROJ_BROKER_URL", "redis://127.0.0.1:1/0"),
    backend=os.environ.get("PROJ_RESULT_URL", "redis://127.0.0.1:1/2"),
)
app.conf.update(
    semaphore_backend_url=os.environ.get("PROJ_SEMAPHORE_URL", "redis://127.0.0.1:1/1"),
    task_default_queue=os.environ.get("PROJ_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=600,
    semaphore_limits={"bc:*": 3},
)
app.conf.update(json.loads(os.environ.get("PROJ_CONF", "{}")))

_clients: dict[str, redis.Redis] = {}


def probe_client() -> redis.Redis:
    """The client of the probe database (one per process: pool children build their own)."""
    if "probe" not in _clients:
        _clients["probe"] = redis.Redis.from_url(os.environ.get("PROJ_PROBE_URL", "redis://127.0.0.1:1/3"))
    return _clients["probe"]


# a record on a task's way to its body is sent without waiting for its reply (unread.py)
_received_records = UnreadRecords(probe_client)
_run_records = UnreadRecords(probe_client)


def semaphore_client() -> redis.Redis:
    """The semaphore's Redis, where the naive baseline keeps its own holders."""
    if "semaphore" not in _clients:
        _clients["semaphore"] = redis.Redis.from_url(os.environ.get("PROJ_SEMAPHORE_URL", "redis://127.0.0.1:1/1"))
    return _clients["semaphore"]


def _worker(task: Task) -> str:
    """The worker node that runs this call (both benchmark workers share one host)."""
    return str(task.request.hostname or "?")


def _hold(task: Task, seconds: float, key: str) -> None:
    """The limited work: sleep, with the body's start and end recorded and counted by the probe.

    The start is also pushed on ``bench:start:<id>``, so that the benchmark can block on it (the
    hand-off chains send their next task the moment the previous one starts)."""
    started = time.time()
    client = probe_client()
    concurrency = ConcurrencyProbe(client, f"probe:{key}")
    concurrency.enter()
    with client.pipeline(transaction=False) as pipe:
        # the queue it came from, and its earlier refusals: a start through a wake queue (a parked
        # task woken) or on a first delivery (granted at once, or after an in-process wait)
        came = str((task.request.delivery_info or {}).get("routing_key") or "?")
        waits = getattr(task.request, "csem_waits", None) or 0
        pipe.rpush("bench:starts", f"{task.request.id} {started} {_worker(task)} {key} {came} {waits}")
        granted_at = getattr(_granted, "at", None)
        if granted_at is not None:
            pipe.rpush("bench:granted_at", f"{task.request.id} {granted_at}")
            _granted.at = None
        pipe.rpush(f"bench:start:{task.request.id}", started)
        pipe.expire(f"bench:start:{task.request.id}", 3600)
        pipe.execute()
    try:
        if seconds > 0:
            time.sleep(seconds)
    finally:
        concurrency.leave()
        # pushed in task_postrun, after this run's other records (see _on_postrun)
        task.request.bench_end = f"{task.request.id} {time.time()} {_worker(task)} {key}"


class AskStamped(Task):  # type: ignore[misc]
    """Stamps each run as its ``__call__`` begins: a first run's is kept (``bench:calls``, pushed
    in ``task_postrun``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.request.bench_asked = time.time()
        return super().__call__(*args, **kwargs)


# The moment this thread last began a release (see bench:released).
_release_began = threading.local()


def _stamped(release: Any) -> Any:
    def stamped_release(self: Any, token: str, *args: Any, **kwargs: Any) -> Any:
        # a release with no token gives no slot back: it marks a run finished (at a waited
        # grant without acks_late, ``begin_at_most_once``), before the body; stamped, it would
        # pass for the start of the hand-off
        if token:
            _release_began.at = time.time()
        return release(self, token, *args, **kwargs)

    return stamped_release


# The moment this thread's latest try was granted (see bench:granted_at).
_granted = threading.local()


def _stamped_try(attempt_of: Any) -> Any:
    def stamped_try(self: Any, *args: Any, **kwargs: Any) -> Any:
        attempt = attempt_of(self, *args, **kwargs)
        if isinstance(attempt, Granted):
            _granted.at = time.time()
        return attempt

    return stamped_try


FairSemaphore._try = _stamped_try(FairSemaphore._try)  # type: ignore[method-assign]
FairSemaphore._release = _stamped(FairSemaphore._release)  # type: ignore[method-assign]
MultiSemaphore._release = _stamped(MultiSemaphore._release)  # type: ignore[method-assign]


class TimedSemaphoreTask(AskStamped, SemaphoreTask):
    """SemaphoreTask that notes the moment its slot was given back (and stamps its first ask).

    A task whose run is marked finished gives its slot back in ``task_postrun``, after Celery has
    stored its result (``giving_back.py``), not as ``__call__`` returns: the moment that release
    began is the start of the hand-off that the benchmark times to the next waiter's body start,
    and the end of ``__call__`` is noted beside it (``bench:call_ends``), so that the time the
    slot is held through the result store is seen apart. Both are pushed in this app's
    ``task_postrun`` handler, which runs after the library's. A refused call (no body ran)
    released nothing and records nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.request.bench_key = None
        _release_began.at = None
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self.request.bench_call_end = time.time()


def _record_release(task: Any, pipe: Any) -> None:
    """``bench:released`` and ``bench:call_ends`` of a task whose body ran (see TimedSemaphoreTask)."""
    request = task.request
    key = getattr(request, "bench_key", None)
    if key is None:
        return
    call_end = getattr(request, "bench_call_end", None) or time.time()
    released = getattr(_release_began, "at", None) or call_end
    _release_began.at = None
    pipe.rpush("bench:released", f"{request.id} {released} {_worker(task)} {key}")
    pipe.rpush("bench:call_ends", f"{request.id} {call_end} {_worker(task)} {key}")


def _stamp_sent(task_id: str) -> None:
    """A wake-up's copy of ``task_id`` is on its way to a wake queue (``bench:sent``), from
    whichever process sent it: after the send returned, so nothing is added before it."""
    if _all_records():
        probe_client().rpush("bench:sent", f"{task_id} {time.time()}")


def _stamped_send_now(send_now: Any) -> Any:
    def stamped(self: Any, run: str) -> int:
        sent = int(send_now(self, run))
        if sent > 0:
            _stamp_sent(run.split("#", 1)[0])
        return sent

    return stamped


def _stamped_wake_copy(send: Any) -> Any:
    def stamped(wake_copy: Any, name: str) -> None:
        send(wake_copy, name)
        task_id = (getattr(wake_copy, "options", None) or {}).get("task_id")
        if task_id:
            _stamp_sent(str(task_id))

    return stamped


DueCopies.send_now = _stamped_send_now(DueCopies.send_now)  # type: ignore[method-assign]
# the wake copy as a message of its own (RabbitMQ): called by name from both modules
parked_sends.send_wake_copy = _stamped_wake_copy(parked_sends.send_wake_copy)
parking.send_wake_copy = _stamped_wake_copy(parking.send_wake_copy)  # type: ignore[attr-defined]


@app.task(base=TimedSemaphoreTask, semaphore_key="bc:{key}", bind=True, name="bench.fair")
def fair(self: Any, seconds: float, key: str) -> None:
    """Limited by the semaphore: ``semaphore_limits`` gives ``bc:*`` its limit (set per worker)."""
    _limited(self, seconds, key)


def _limited(task: Task, seconds: float, key: str) -> None:
    """The body of a task holding a slot of ``bc:{key}``: its release is timed, its hold recorded."""
    task.request.bench_key = f"bc:{key}"
    _hold(task, seconds, f"bc:{key}")


@app.task(
    base=TimedSemaphoreTask, semaphore_key="bc:{key}", semaphore_fair_by="{tenant}", bind=True, name="bench.tenant"
)
def tenant_fair(self: Any, seconds: float, key: str, tenant: str) -> None:
    """``bench.fair`` with a tenant: placed in line by its tenant's virtual time."""
    _limited(self, seconds, key)


@app.task(base=TimedSemaphoreTask, semaphore_key="bc:{key}", bind=True, name="bench.tenant_fifo")
def tenant_fifo(self: Any, seconds: float, key: str, tenant: str) -> None:
    """The same task without ``semaphore_fair_by``: one first-come line, the baseline."""
    _limited(self, seconds, key)


# A plain one-shot semaphore, as a user writes one by hand: drop expired holders, and take a slot
# if fewer than ``limit`` hold. No line, no tickets. Server time, so clocks do not matter.
_NAIVE_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
    return 1
end
return 0
"""
NAIVE_COUNTDOWN = 1
NAIVE_LEASE_MS = 60_000


@app.task(base=AskStamped, bind=True, name="bench.naive", max_retries=None)
def naive(self: Any, seconds: float, key: str, limit: int) -> None:
    """The naive baseline: one try of a plain semaphore, and ``self.retry(countdown=1)`` when
    refused. What a user writes by hand; its order is whatever the broker's timers make it."""
    holders = f"naive:{key}"
    token = uuid.uuid4().hex
    client = semaphore_client()
    if not client.eval(_NAIVE_ACQUIRE, 1, holders, limit, token, NAIVE_LEASE_MS):
        raise self.retry(countdown=NAIVE_COUNTDOWN, max_retries=None)
    try:
        _hold(self, seconds, f"naive:{key}")
    finally:
        client.zrem(holders, token)


@app.task(base=AskStamped, bind=True, name="bench.plain")
def plain(self: Any, seconds: float, key: str) -> None:
    """No semaphore: the baseline run on a pool whose size is the limit."""
    _hold(self, seconds, f"plain:{key}")


@app.task(base=SemaphoreTask, semaphore_key="bc:{key}", name="bench.fair_noop")
def fair_noop(key: str) -> None:
    """Holds a slot of a key whose limit is never reached, and does nothing: the semaphore's cost."""


@app.task(name="bench.plain_noop")
def plain_noop(key: str) -> None:
    """The same task without the semaphore."""


def _ours(task: Any) -> bool:
    return str(getattr(task, "name", "")).startswith("bench.")


_prerun_at: dict[str, float] = {}


def _all_records() -> bool:
    """Whether this worker keeps every record, or only those of a hand-off (module docstring)."""
    return app.conf.get("bench_records", "all") != "hand-off"


@signals.task_received.connect
def _on_received(request: Any = None, **_: Any) -> None:
    if request is not None and str(getattr(request, "name", "")).startswith("bench.") and _all_records():
        now = time.time()
        _received_records.send(
            ("HINCRBY", "bench:received", request.id, 1), ("RPUSH", "bench:received_at", f"{request.id} {now}")
        )


@signals.task_prerun.connect
def _on_prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    if task_id is None or not _ours(task):
        return
    if _all_records():
        now = time.time()
        _run_records.send(("HINCRBY", "bench:runs", task_id, 1), ("RPUSH", "bench:prerun_at", f"{task_id} {now}"))
        task.request.bench_prerun = now
    # timed from here, so that the bookkeeping above is not counted as the task's cost
    _prerun_at[task_id] = time.perf_counter()


@signals.task_postrun.connect
def _on_postrun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    """The run's records, in one round trip after the library's own ``task_postrun`` (its
    release): its duration, and, for a task's first run, when it asked (``bench:asks``,
    ``bench:calls``); then its release and its body's end, last, so that a benchmark that has
    seen a task end sees every record of it."""
    if task_id is None or not _ours(task):
        return
    started = _prerun_at.pop(task_id, None)
    duration_ms = None if started is None else (time.perf_counter() - started) * 1000
    request = task.request
    replies = _run_records.replies()
    with probe_client().pipeline(transaction=False) as pipe:
        if duration_ms is not None:
            pipe.rpush("bench:durations", f"{task_id} {duration_ms:.4f}")
        prerun = getattr(request, "bench_prerun", None)
        if replies and replies[0] == 1 and prerun is not None:  # its first run, in any worker
            pipe.rpush("bench:asks", f"{task_id} {prerun}")
            asked = getattr(request, "bench_asked", None)
            if asked is not None:
                pipe.rpush("bench:calls", f"{task_id} {asked}")
        _record_release(task, pipe)
        end = getattr(request, "bench_end", None)
        if end is not None:
            pipe.rpush("bench:ends", end)
        pipe.execute()


@signals.task_failure.connect
def _on_failure(
    task_id: str | None = None, sender: Any = None, exception: BaseException | None = None, **_: Any
) -> None:
    if _ours(sender):
        probe_client().rpush("bench:failures", f"{task_id} {type(exception).__name__}: {exception}")
