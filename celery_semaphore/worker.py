"""What the worker does for semaphore tasks outside the task body.

* At start (a bootstep): parse the settings and check that every semaphore task has a limit
  somewhere. A bad setting or a task with no limit stops the worker before it takes any task,
  naming the setting or the task: a silent unlimited run is the one outcome we never allow.
  Also warn where countdowns could outlast the Redis broker's visibility timeout (the broker
  would then deliver a waiting task twice) and where Redis may evict lease keys.
* In the consumer: consume, next to each of the worker's queues, its wake queue, where a waiting
  task is sent again the moment a release hands it a slot (so it does not queue behind a backlog
  of fresh tasks in the queue it came from).
* In the parent process: a child killed by ``revoke(terminate=True)``, a hard time limit or a
  crash runs no ``finally``; the parent gives its slot back by task id as a best effort (the lease
  is the guarantee). Celery may report such a failure twice, so this is idempotent.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps, signals
from celery.exceptions import TimeLimitExceeded, WorkerLostError
from celery.worker.request import Request

from . import metrics
from ._backend import BackendSpec, client_for
from ._keys import sample_key
from ._options import is_semaphore_task, key_option, template_of, wait_options, weight_option
from ._parking import WAKE_QUEUE_SUFFIX, parking, wake_queue
from ._scripts import preload
from .catalogue import semaphore_for_call, semaphore_tasks
from .config import SemaphoreConfig, config_for, forget_config
from .errors import ConfigurationError, SemaphoreError
from .policy import VISIBILITY_MARGIN

logger = logging.getLogger("celery_semaphore")

_INSTALLED_FLAG = "_celery_semaphore_installed"


class SemaphoreStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Checks the semaphore configuration when the worker starts."""

    label = "Semaphore"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        check_app(worker.app)


class WakeQueueStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumes the wake queue of every queue the worker consumes."""

    label = "Semaphore wake queues"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, consumer: Any) -> None:
        names = [queue.name for queue in consumer.task_consumer.queues]
        for name in names:
            if not name.endswith(WAKE_QUEUE_SUFFIX):
                consumer.add_task_queue(wake_queue(name))


def install(app: Any) -> None:
    """Hook the semaphore into ``app``'s workers (once per app)."""
    if getattr(app, _INSTALLED_FLAG, False):
        return
    setattr(app, _INSTALLED_FLAG, True)
    app.steps["worker"].add(SemaphoreStep)
    app.steps["consumer"].add(WakeQueueStep)

    def warm(**_: Any) -> None:
        connect_early(app)
        sweep_parked_tasks(app)

    def sweep_from_the_main_process(sender: Any = None, **_: Any) -> None:
        # thread and green pools run tasks in the main process and send no worker_process_init;
        # a prefork parent runs none (its children sweep) and forks more later: it stays out
        from celery.concurrency.prefork import TaskPool as PreforkPool

        if not isinstance(getattr(sender, "pool", None), PreforkPool):
            sweep_parked_tasks(app)

    signals.worker_process_init.connect(warm, weak=False)
    signals.worker_ready.connect(sweep_from_the_main_process, weak=False)


def connect_early(app: Any) -> None:
    """In each new pool process, connect to the semaphore's Redis and load the scripts before
    the first task: its first acquire then costs one round trip, not a connect (on a cluster, the
    discovery of every node) and a script load first. A failure here changes nothing: the task
    will fail closed as usual."""
    try:
        preload(client_for(config_for(app).backend))
    except Exception as error:
        logger.debug("could not connect to the semaphore Redis early: %s", error)


def sweep_parked_tasks(app: Any) -> None:
    """Have this process sweep the deployment's parked-task records (``_parking.py``), so that a
    task parked by a worker that died with its message is sent again by the workers still alive,
    though none of them parked anything yet."""
    try:
        config = config_for(app)
        parking().sweep(app, client_for(config.backend), config.prefix)
    except Exception as error:  # a bad setting fails the worker's start check, not this
        logger.debug("could not start sweeping parked tasks: %s", error)


def check_app(app: Any) -> None:
    """Raise ConfigurationError if a setting is bad or some semaphore task has no limit."""
    forget_config(app)
    config = config_for(app)
    near_visibility_timeout = []
    for task in semaphore_tasks(app):
        high = wait_options(task, config).countdown[1]
        if config.visibility_timeout is not None and high >= config.visibility_timeout * VISIBILITY_MARGIN:
            near_visibility_timeout.append(task.name)
        check_limits(task, config)
    if near_visibility_timeout:
        logger.warning(
            "countdowns of %s may reach half the Redis broker's visibility_timeout (%s s), past which the broker "
            "would deliver a waiting task twice; they are capped there",
            ", ".join(sorted(near_visibility_timeout)), config.visibility_timeout,
        )
    _warn_about_eviction(config.backend)


def check_limits(task: Any, config: SemaphoreConfig) -> None:
    """Every key of ``task`` (each of a list) must have a limit somewhere, and a fixed weight
    must fit each: ConfigurationError otherwise. A key function is only known per call; a
    missing limit, or a weight above it, fails that call loudly."""
    key = key_option(type(task))
    weight = weight_option(type(task))
    for item in key if isinstance(key, list) else [key]:
        if callable(item):
            continue
        sample = sample_key(item) if isinstance(item, str) else task.name
        rule = config.limit_for(sample, task.name, task.semaphore_limit)
        if rule is None:
            raise ConfigurationError(
                f"{task.name}.semaphore_limit",
                None,
                "the task has no limit" + (f" for its key {item!r}" if isinstance(key, list) else "")
                + ": set semaphore_limit on it or an entry in semaphore_limits",
            )
        if isinstance(weight, int) and weight > rule.limit:
            raise ConfigurationError(f"{task.name}.semaphore_weight", weight,
                                     f"above the limit {rule.limit} of {sample!r}: the task would wait forever")


def may_evict(maxmemory: int, policy: str) -> bool:
    """Whether Redis may evict our keys: only with a memory limit and an evicting policy. Every
    semaphore key carries an expiry, so the ``volatile-*`` policies may pick them too."""
    return maxmemory > 0 and policy != "noeviction"


def _warn_about_eviction(backend: BackendSpec | str) -> None:
    try:
        settings = client_for(backend).config_get("maxmemory*")
        maxmemory = int(settings.get("maxmemory") or 0)
        policy = str(settings.get("maxmemory-policy", "noeviction"))
    except Exception:  # managed Redis often forbids CONFIG; unreachable Redis fails closed later
        return
    if may_evict(maxmemory, policy):
        logger.warning(
            "the semaphore Redis has maxmemory %d with maxmemory-policy %s: it may evict lease keys under memory "
            "pressure and so admit more holders than the limit; use noeviction",
            maxmemory, policy,
        )


def _release_by_task_id(task: Any, task_id: str, args: Any, kwargs: Any) -> None:
    try:
        semaphore = semaphore_for_call(task, tuple(args or ()), dict(kwargs or {}))
        released = semaphore.release_holders_with_prefix(f"{task_id}:")
        semaphore.leave(task_id)
    except SemaphoreError as error:
        logger.warning("could not release the slot of %s[%s] by task id: %s", task.name, task_id, error)
        return
    if released:
        metrics.reclaimed(template_of(task), released)
        logger.info("released %d slot(s) of %s[%s] for a killed child", released, task.name, task_id)


class SemaphoreRequest(Request):  # type: ignore[misc]
    """A semaphore task's request as the worker's main process handles it. When the pool process
    running it is lost (killed, out of memory, a hard time limit), its slot is given back by task
    id *before* Celery acts on the message: with ``acks_late`` and ``reject_on_worker_lost`` (or
    a time limit not acked) Celery requeues the message at once, and that delivery must find the
    slot free, else it would be dropped as the twin of a run that looks alive until its lease
    runs out (and a copy dropped then is a task lost)."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exception = getattr(exc_info.exception, "exc", exc_info.exception)  # unwrap ExceptionWithTraceback
        cancelled = getattr(self, "_already_cancelled", False) or getattr(self, "_already_revoked", False)
        lost = isinstance(exception, (WorkerLostError, TimeLimitExceeded, SystemExit, KeyboardInterrupt))
        if lost and not cancelled and is_semaphore_task(self.task):
            _release_by_task_id(self.task, self.id, self.args, self.kwargs)
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


def _on_revoked(sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
    if is_semaphore_task(sender) and request is not None:
        _release_by_task_id(sender, request.id, request.args, request.kwargs)


def _on_failure(
    sender: Any = None, task_id: str | None = None, exception: BaseException | None = None,
    args: Any = None, kwargs: Any = None, **_: Any,
) -> None:
    if is_semaphore_task(sender) and task_id and isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
        _release_by_task_id(sender, task_id, args, kwargs)


signals.task_revoked.connect(_on_revoked, weak=False, dispatch_uid="celery_semaphore.revoked")
signals.task_failure.connect(_on_failure, weak=False, dispatch_uid="celery_semaphore.failure")
