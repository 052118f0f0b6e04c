"""What the worker does for semaphore tasks outside the task body.

* At start (a bootstep): parse the settings and check that every semaphore task has a limit
  somewhere. A bad setting or a task with no limit stops the worker before it takes any task,
  naming the setting or the task: a silent unlimited run is the one outcome never allowed.
  Also warn where countdowns could outlast the Redis broker's visibility timeout (the broker
  would then deliver a waiting task twice) and where Redis may evict lease keys.
* At warm shutdown, once the worker stopped consuming: hand back the wake copies it received
  and will not run (``handing_back.py``), so their turn does not wait for the pool to stop.
* In the consumer: consume each queue's wake queue too (``wake_consumer.py``).
* In the parent process: a child killed by ``revoke(terminate=True)``, a hard time limit or a
  crash runs no ``finally``; the parent gives its slot back by task id as a best effort (the lease
  is the guarantee). Celery may report such a failure twice, so this is idempotent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from celery import bootsteps, signals
from celery.exceptions import Ignore, Retry, TimeLimitExceeded, WorkerLostError
from celery.worker.request import Request

from .. import metrics
from .._core.clients import client_for
from .._core.urls import BackendSpec
from .._core.validation import to_ms
from ..errors import ConfigurationError, SemaphoreError
from . import child_exits, internals, node_names, woken_first
from .backstop import BackstopStep, holds_backstops
from .catalogue import NO_CAP_ON_MANY, semaphore_for_call, semaphore_tasks
from .config import SemaphoreConfig, config_for, forget_config
from .due_copies import stores_copies, withdraw
from .handing_back import read_pending_brpop
from .keys import sample_key
from .options import is_semaphore_task, key_option, template_of, wait_options, weight_option
from .parked_scripts import preload
from .parking import parking
from .policy import VISIBILITY_MARGIN
from .pool_room import is_prefork, pool_room
from .tokens import task_key, token_rest_of, waiter_key
from .wait_headers import WaitHistory
from .wake_consumer import WakeQueueStep
from .wake_queues import wake_aware

logger = logging.getLogger("celery_semaphore")

_INSTALLED_FLAG = "_celery_semaphore_installed"


class SemaphoreStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Checks the semaphore configuration when the worker starts."""

    label = "Semaphore"
    # started once the pool is, so stopped before it: after the consumer (which stops first) and
    # before the pool's wait for the running tasks (handing_back.py)
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        check_app(worker.app)
        internals.warn_if_broken()
        # before the pool forks: its processes share which of them are busy (pool_room.py)
        autoscale = getattr(worker, "autoscale", None) or (0, 0)
        size = max(int(getattr(worker, "concurrency", 0) or 0), int(max(autoscale)))
        pool_room.prepare(size, prefork=is_prefork(worker))
        node_names.begin(worker.app, worker.hostname)  # its pool inherits the instance id
        metrics.import_early()  # not in each pool process at its first grant

    def start(self, worker: Any) -> None:
        node_names.start()
        # the pool step made the worker's line of received tasks by now (woken_first.py); where
        # its shape changed, the start's internals warning says so
        woken_first.install(worker)
        # a killed pool process gives its slot back at once (child_exits.py)
        child_exits.install(worker)

    def stop(self, worker: Any) -> None:
        read_pending_brpop(getattr(worker, "consumer", None))


def install(app: Any) -> None:
    """Hook the semaphore into ``app``'s workers (once per app)."""
    if getattr(app, _INSTALLED_FLAG, False):
        return
    setattr(app, _INSTALLED_FLAG, True)
    app.steps["worker"].add(SemaphoreStep)
    app.steps["consumer"].add(WakeQueueStep)
    app.steps["consumer"].add(BackstopStep)

    def warm(**_: Any) -> None:
        connect_early(app)
        sweep_parked_tasks(app)

    def sweep_from_the_main_process(sender: Any = None, **_: Any) -> None:
        # thread and green pools run tasks in the main process and send no worker_process_init;
        # a prefork parent runs none (its children sweep) and forks more later: it only wakes
        # the parked tasks its own releases offer a slot (a killed child's)
        from celery.concurrency.prefork import TaskPool as PreforkPool

        if not isinstance(getattr(sender, "pool", None), PreforkPool):
            sweep_parked_tasks(app)
        else:
            wake_from_the_parent(app)

    signals.worker_process_init.connect(warm, weak=False)
    signals.worker_ready.connect(sweep_from_the_main_process, weak=False)
    signals.worker_shutdown.connect(lambda **_: node_names.stop(), weak=False)


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
    """Have this process sweep the deployment's parked-task records (``parking.py``), so that a
    task parked by a worker that died with its message is sent again by the workers still alive,
    though none of them parked anything yet."""
    try:
        wake_aware(app)  # a swept wake copy goes to a wake queue declared like its origin, from here too
        config = config_for(app)
        parking().sweep(app, client_for(config.backend), config.prefix)
    except Exception as error:  # a bad setting fails the worker's start check, not this
        logger.debug("could not start sweeping parked tasks: %s", error)


def wake_from_the_parent(app: Any) -> None:
    """Have a prefork worker's main process send the wake copies of the parked tasks that its
    releases offer a slot: it gives back a killed child's slot, and the waiter offered it, parked
    by a process that no longer listens (or by a sender, which never does), would otherwise come
    only once the offer lapsed and a tick handed it on (measured: 2.7 s after the release)."""
    try:
        wake_aware(app)  # a wake copy goes to a wake queue declared like its origin, from here too
        config = config_for(app)
        parking().wake_from(app, client_for(config.backend), config.prefix)
    except Exception as error:  # a bad setting fails the worker's start check, not this
        logger.debug("could not wake parked tasks from the worker's main process: %s", error)


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
    check_state_protocol(config)
    if near_visibility_timeout:
        logger.warning(
            "countdowns of %s may reach half the Redis broker's visibility_timeout (%s s), past which the broker "
            "would deliver a waiting task twice; they are capped there",
            ", ".join(sorted(near_visibility_timeout)),
            config.visibility_timeout,
        )
    _warn_about_eviction(config.backend)
    if semaphore_tasks(app):
        _warn_about_eta_task_limit(app)


def _warn_about_eta_task_limit(app: Any) -> None:
    """Where backstop copies are countdown messages (a broker that neither keeps them in its
    Redis nor in backstop queues), ``worker_eta_task_limit`` caps how many the worker holds, and
    at the cap it fetches nothing else: say so at start."""
    eta_task_limit = app.conf.get("worker_eta_task_limit")
    if eta_task_limit is not None and not holds_backstops(app) and not stores_copies(app):
        logger.warning(
            "worker_eta_task_limit=%s: a semaphore task that waits outside the worker is held here as a countdown "
            "message until its backstop is due, and once %s such messages are held this worker fetches nothing "
            "else, the wake-ups of waiting tasks included, so a line of waiting tasks advances once per backstop "
            "countdown. With this broker, unset worker_eta_task_limit or set it above the number of tasks that may "
            "wait at once (on RabbitMQ backstop copies wait in backstop queues, outside the prefetch window)",
            eta_task_limit,
            eta_task_limit,
        )


# The version of what this release keeps in Redis and in task headers (task.PROTOCOL): workers of
# two releases sharing a prefix must read each other's state (a rolling deploy), so a release
# that changes it incompatibly raises it, and older workers refuse to start against it.
STATE_PROTOCOL = 3


def check_state_protocol(config: SemaphoreConfig) -> None:
    """Refuse to start against semaphore state written by a newer, incompatible release (it
    would be misread silently); record this release's protocol where the state is older or new.
    Redis unreachable at start changes nothing here: tasks fail closed as usual."""
    key = f"{config.prefix}:protocol"
    try:
        client = client_for(config.backend)
        stored = client.get(key)
        if stored is None or int(stored) < STATE_PROTOCOL:
            client.set(key, STATE_PROTOCOL)
            return
    except Exception as error:
        logger.debug("could not read the semaphore state's protocol: %s", error)
        return
    if int(stored) > STATE_PROTOCOL:
        raise ConfigurationError(
            "semaphore_prefix",
            config.prefix,
            f"the semaphore state under this prefix is of protocol {int(stored)}, written by a newer celery-semaphore "
            f"than this worker's ({STATE_PROTOCOL}): upgrade this worker, or give the new release its own prefix "
            "(docs/deploying.md, rolling deploys)",
        )


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
        rule = config.limit_for(sample, task.name, task)
        if rule is None:
            raise ConfigurationError(
                f"{task.name}.semaphore_limit",
                None,
                "the task has no limit, rate or spacing"
                + (f" for its key {item!r}" if isinstance(key, list) else "")
                + ": set semaphore_limit (or semaphore_rate, semaphore_spacing) on it or an entry in semaphore_limits",
            )
        if rule.full_line is not None and (isinstance(key, list) or weight is not None):
            raise ConfigurationError(rule.source, rule.full_line_setting, NO_CAP_ON_MANY)
        if isinstance(weight, int) and rule.limit is not None and weight > rule.limit:
            raise ConfigurationError(
                f"{task.name}.semaphore_weight",
                weight,
                f"above the limit {rule.limit} of {sample!r}: the task would wait forever",
            )
        if isinstance(weight, int) and rule.rate is not None and weight > rule.rate.count:
            raise ConfigurationError(
                f"{task.name}.semaphore_weight",
                weight,
                f"above the rate {rule.rate} of {sample!r}: the task would wait forever",
            )


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
            maxmemory,
            policy,
        )


def _release_by_task_id(
    task: Any, task_id: str, args: Any, kwargs: Any, *, pid: int | None, finished_run: str | None = None
) -> None:
    """Give back the slot that task id holds in pool process ``pid`` (gone, or about to be), take
    the task out of the line, and with ``finished_run`` mark that run finished: Celery will not
    deliver the task again, so no other copy of its wait may run it. Only that process's slot: a
    copy of the same task may hold another, rightly, in another process."""
    from .wait_runs import remember_for

    released = 0
    try:
        semaphore = semaphore_for_call(task, tuple(args or ()), dict(kwargs or {}))
        if pid is not None:
            released = semaphore._release_holders_with_prefix(f"{task_key(task_id)}:", token_rest_of(pid))
        semaphore.leave(waiter_key(task_id))
        if waiter_key(task_id) != task_key(task_id):  # a wait begun before protocol 3 stands under this
            semaphore.leave(task_key(task_id))
        if finished_run is not None:
            config = config_for(task.app)
            remember = remember_for(wait_options(task, config), config)
            semaphore._finish_run(finished_run, to_ms(remember))
            withdraw(task.app, finished_run, remember_s=remember)
    except SemaphoreError as error:
        logger.warning("could not release the slot of %s[%s] by task id: %s", task.name, task_id, error)
        return
    if released:
        metrics.reclaimed(template_of(task), released)
        logger.info("released %d slot(s) of %s[%s] for a killed child", released, task.name, task_id)


def delivers_again(task: Any, exception: BaseException) -> bool:
    """Whether Celery delivers a task's message again after the pool process running it was lost
    (``exception``: WorkerLostError) or killed by its hard time limit (TimeLimitExceeded), as
    ``celery.worker.request.Request.on_failure`` decides it."""
    if not task.acks_late:
        return False  # acked before the body ran
    if isinstance(exception, TimeLimitExceeded):
        acks = getattr(task, "acks_on_timeout", None)
        if acks is None:
            acks = getattr(task, "acks_on_failure_or_timeout", True)
        return not acks
    if getattr(task, "retry_on_worker_lost", False):
        # Sent again as the task's own retry (a new run) while retries are left; once they are
        # exhausted (``request.retries`` >= ``max_retries``) Celery records the failure and acks:
        # no requeue, whatever ``reject_on_worker_lost`` says. Either way this run is over.
        return False
    return bool(task.reject_on_worker_lost)


def run_of(request: Any) -> str | None:
    """The run a delivery of a waiting task asks under (None for a first delivery, which has no
    other copy), read from its message headers as the task will read them."""
    shim = SimpleNamespace(
        id=request.id,
        retries=getattr(request, "retries", 0) or 0,
        task=request.task_name,
        headers=dict(getattr(request, "request_dict", None) or {}),
    )
    history = WaitHistory.of(shim)
    return history.run_id(shim) if history.waits else None


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")  # a zombie runs nothing
    except (OSError, IndexError):
        return True


def _after_exit(pid: int | None, action: Callable[[], None]) -> None:
    """Run ``action`` once process ``pid`` has exited (at most CHILD_EXIT_WAIT_S from now), in a
    thread: on a hard time limit Celery reports the failure before the pool kills the child, and
    the child's body may run on until then: its slot must not go to another task meanwhile."""
    if pid is None or pid == os.getpid():
        action()
        return

    def wait_then_act() -> None:
        deadline = time.monotonic() + CHILD_EXIT_WAIT_S
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(CHILD_EXIT_POLL_S)
        action()

    threading.Thread(target=wait_then_act, name="celery-semaphore-release-after-exit", daemon=True).start()


# How long the main process waits for a timed-out child to exit before giving its slot back
# anyway (the pool kills it right after reporting), and how often it looks.
CHILD_EXIT_WAIT_S = 10.0
CHILD_EXIT_POLL_S = 0.01


class SemaphoreRequest(Request):  # type: ignore[misc]
    """A semaphore task's request as the worker's main process handles it. When the pool process
    running it is lost (killed, out of memory, a hard time limit), its slot is given back by task
    id *before* Celery acts on the message: with ``acks_late`` and ``reject_on_worker_lost`` (or
    a time limit not acked) Celery requeues the message at once, and that delivery should find
    the slot free. Where Celery will not deliver the message again (no ``acks_late``, and the
    rest of Celery's rules in ``delivers_again``), the run is also marked finished, so that no
    other copy of the task's wait (its backstop or wake copy) runs the body a second time.

    ``SemaphoreTask`` uses it. A task class that sets a ``Request`` of its own must derive it
    from this class, or a lost process's slot comes back only when its lease runs out."""

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exception = getattr(exc_info.exception, "exc", exc_info.exception)  # unwrap ExceptionWithTraceback
        cancelled = getattr(self, "_already_cancelled", False) or getattr(self, "_already_revoked", False)
        lost = isinstance(exception, (WorkerLostError, TimeLimitExceeded, SystemExit, KeyboardInterrupt))
        if lost and not cancelled and is_semaphore_task(self.task):
            as_lost = exception if isinstance(exception, TimeLimitExceeded) else WorkerLostError()
            try:
                run = None if delivers_again(self.task, as_lost) else run_of(self)
            except Exception as error:  # never in the way of Celery's own handling
                logger.warning("could not tell the run of %s[%s]: %s", self.task.name, self.id, error)
                run = None
            task, task_id, args, kwargs, pid = self.task, self.id, self.args, self.kwargs, self.worker_pid

            def give_back() -> None:
                _release_by_task_id(task, task_id, args, kwargs, pid=pid, finished_run=run)

            if isinstance(exception, TimeLimitExceeded):
                _after_exit(self.worker_pid, give_back)
            else:
                give_back()
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


def _on_revoked(sender: Any = None, request: Any = None, terminated: bool = False, **_: Any) -> None:
    if is_semaphore_task(sender) and request is not None:
        # a revoked task runs no more: no copy of its wait may run it either
        try:
            run = run_of(request)
        except Exception:
            run = None
        _release_by_task_id(
            sender, request.id, request.args, request.kwargs, pid=getattr(request, "worker_pid", None), finished_run=run
        )


def _on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    # The request class did the release (it knows the lost process); a task class with a Request
    # of its own gets here only: its slot comes back with its lease, and it leaves the line now.
    if is_semaphore_task(sender) and task_id and isinstance(exception, WorkerLostError):
        _release_by_task_id(sender, task_id, args, kwargs, pid=None)


signals.task_revoked.connect(_on_revoked, weak=False, dispatch_uid="celery_semaphore.revoked")
signals.task_failure.connect(_on_failure, weak=False, dispatch_uid="celery_semaphore.failure")


def _drop_frames(task: Any = None, retval: Any = None, **_: Any) -> None:
    """A refused delivery (``Retry``, or ``Ignore`` for a dropped copy) leaves the pool process
    through Celery's tracer, whose frame holds the exception and the ``ExceptionInfo`` built
    from it, while the exception's traceback holds that frame: a cycle only the cyclic GC frees.
    That ``ExceptionInfo`` copies the tracer's code positions (billiard, Python 3.11: about
    0.3 MB a refusal), and hundreds piled up before a full collection, in every pool process:
    +930 MB over 3 workers x 4 for 10,000 waiting tasks. Celery is done with the traceback once
    ``task_postrun`` is sent: dropping it frees it all as the tracer returns."""
    if isinstance(retval, (Retry, Ignore)) and is_semaphore_task(task):
        retval.__traceback__ = None


signals.task_postrun.connect(_drop_frames, weak=False, dispatch_uid="celery_semaphore.drop_frames")
