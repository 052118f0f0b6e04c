"""SemaphoreTask: a Celery task that holds a semaphore slot while its body runs.

The slot is taken in the worker, right before the body, and given back in a ``finally``: so
every way out of the body (return, exception, the task's own ``retry``, ``Ignore``, ``Reject``,
a soft time limit, the ``SystemExit`` of ``revoke(terminate=True)``) releases it. What kills the
process outright (SIGKILL, OOM, a hard time limit) runs no ``finally``: the worker's parent
process then releases by task id (see ``worker.py``), and the lease is the last resort.

A task that finds no free slot is not run. It either waits a moment in-process for a release
(when its turn is near) or leaves the worker: it is re-sent with a countdown under the same task
id (the backstop copy, keeping its ticket and so its place in line) and *parks*, so that the
release that makes its turn sends it again at once (the wake copy, see ``parking.py``). Of the
copies of one wait, exactly one runs: the first to get the slot records the run in Redis, and a
copy that finds the run recorded (finished, or still running under a live lease) is dropped
with ``Ignore``: not run, not recorded as a failure.

Waiting is not retrying: ``request.retries`` and the task's ``max_retries`` are left alone; the
wait's history travels in message headers, tagged with the retry it belongs to, so that the
task's own retry (which inherits the headers) starts a fresh wait instead of counting the
earlier one, its run and its retry delay against the max wait.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any, ClassVar, NoReturn

from celery import Task, states
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Reject, Retry

from .. import metrics
from .._core.attempts import Ask, Duplicate, Granted, Waiting, default_label
from .._core.lease import Lease
from .._core.multi import MultiSemaphore
from .._core.semaphore import FairSemaphore
from .._core.validation import check_seconds
from ..errors import RedisUnavailable, SemaphoreError, SemaphoreUnavailable
from . import node_names, policy
from . import stamping as _stamping  # noqa: F401  (stamps every message sent: before_task_publish)
from .catalogue import semaphore_for_call
from .config import config_for
from .due_copies import send_copy
from .giving_back import REMEMBER_EXTRA, give_back, give_back_at_end, run_remembered
from .keys import KeyFunction
from .options import (
    FROM_SETTINGS,
    MARKER,
    KeyOption,
    PriorityFunction,
    WeightFunction,
    check_task_options,
    coalesce_of_call,
    priority_of_call,
    template_of,
    tenant_of_call,
    wait_options,
)
from .outages import outages
from .pausing import SemaphorePaused, members, pause_and_stand_first
from .placing import placed_at_send
from .pool_room import pool_room
from .run_checks import GrantedAhead
from .started import store_started, take_over_started
from .tokens import process_token, task_key, waiter_of
from .wait_headers import (
    TicketSigner,
    WaitHistory,
)
from .wait_runs import begin_at_most_once, continued_wait, remember_for, reopen_run
from .waiting_delivery import WaitingDelivery, start_by_rules_of

# What a call holds: one semaphore, or (several keys, or a weight) a MultiSemaphore, driven alike.
AnySemaphore = FairSemaphore | MultiSemaphore

logger = logging.getLogger("celery_semaphore")

# Where an execution's Lease lives: on its request (one task instance serves every thread and
# greenlet of a process), under a name no task option shares (``semaphore_held`` reads it).
HELD_LEASE_ATTRIBUTE = "_semaphore_held_lease"


class SemaphoreTask(Task):  # type: ignore[misc]
    """A task that runs only while it holds a slot of its semaphore.

    Options (class attributes, or ``app.task(base=SemaphoreTask, semaphore_limit=5, ...)``):
    ``semaphore_limit``, ``semaphore_rate``, ``semaphore_spacing``, ``semaphore_key``,
    ``semaphore_weight``, ``semaphore_lease``,
    ``semaphore_countdown``, ``semaphore_max_wait``, ``semaphore_inline_wait``,
    ``semaphore_fair_by``, ``semaphore_priority``, ``semaphore_max_waiters`` with
    ``semaphore_on_full``; each one left unset takes the app's ``semaphore_*`` setting.
    ``semaphore_key`` may be a list of keys: the body then runs only while the task holds a
    slot (``semaphore_weight`` slots) of every one. ``semaphore_fair_by`` names each call's
    tenant (a template like ``semaphore_key``'s, or a function): waiting calls are then served
    by their tenants' shares (``semaphore_shares``), not first come, first served; a pair of
    them, (org, user), is fair between orgs, then between the users of an org.
    """

    semaphore_limit: ClassVar[int | None] = None
    # at most N starts in any window ("30/m", "5/s", "10/30s" or a (count, seconds) pair)
    semaphore_rate: ClassVar[str | tuple[int, float] | None] = None
    # at least this many seconds between two starts (robots.txt Crawl-delay)
    semaphore_spacing: ClassVar[float | None] = None
    semaphore_key: ClassVar[KeyOption | None] = None
    semaphore_weight: ClassVar[int | WeightFunction | None] = None
    semaphore_lease: ClassVar[float | None] = None
    semaphore_countdown: ClassVar[float | tuple[float, float] | None] = None
    semaphore_max_wait: ClassVar[float | None] = FROM_SETTINGS
    semaphore_inline_wait: ClassVar[float | None] = None
    # the call's tenant; a pair (org, user): fair between orgs, then between an org's users
    semaphore_fair_by: ClassVar[str | KeyFunction | tuple[str | KeyFunction, str | KeyFunction] | None] = None
    # seconds a call is placed earlier in line (capped at 600); per call: the message header
    # "semaphore_priority"
    semaphore_priority: ClassVar[float | PriorityFunction | None] = None
    # a task that finds this many waiting fails at once (with semaphore_on_full="reject")
    semaphore_max_waiters: ClassVar[int | None] = None
    semaphore_on_full: ClassVar[str] = "wait"
    # with semaphore_on_full="keep_latest": calls of one coalesce key keep one place in line
    semaphore_coalesce_by: ClassVar[str | KeyFunction | None] = None
    # gives a lost pool process's slot back before its message is requeued (worker.py)
    Request: ClassVar[str] = "celery_semaphore._celery.worker:SemaphoreRequest"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_task_options(cls)

    @classmethod
    def bind(cls, app: Any) -> Any:
        bound = super().bind(app)
        take_over_started(cls)  # STARTED once the body runs, not as each copy arrives
        from .worker import install  # the task class installs its worker hooks when bound

        install(app)
        return bound

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        """Send the task; one that would wait takes its place in line now and is delivered
        once, when its turn comes (``placing.py``), instead of being delivered, refused and
        parked by a worker."""
        if shadow is None and not self.app.conf.task_always_eager:
            sent = {name: value for name, value in (("link", link), ("link_error", link_error)) if value is not None}
            placement = placed_at_send(self, args, kwargs, task_id, {**options, **sent})
            if placement is not None and placement.parked:
                return self.AsyncResult(placement.task_id)
            if placement is not None:  # it starts on arrival: sent with the start it was offered
                task_id, options["headers"] = placement.task_id, placement.headers
        return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            # a plain function call, outside Celery: not limited
            return super().__call__(*args, **kwargs)
        semaphore = semaphore_for_call(self, args, kwargs)
        if request.is_eager:
            while True:
                lease: Lease | None = self._acquire_eagerly(semaphore)
                setattr(request, HELD_LEASE_ATTRIBUTE, lease)
                with _eager_holding(semaphore if lease is not None else None):
                    try:
                        return super().__call__(*args, **kwargs)
                    except SemaphorePaused:
                        pass  # the body paused its key: run it again once the pause lets it start
                    finally:
                        if lease is not None:
                            give_back(lease)
        with pool_room.busy():  # waiting or holding: this pool process is taken (pool_room.py)
            return self._call_holding(semaphore, args, kwargs)

    def _call_holding(self, semaphore: AnySemaphore, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Take the slot (or leave the worker to wait for it), run the body, give the slot back."""
        request = self.request
        try:
            lease = self._acquire_in_worker(semaphore, args, kwargs)
        except (Retry, Ignore) as refused:
            # Celery records a Retry or Ignore with an ExceptionInfo that walks and formats
            # every frame of its traceback (on Python 3.11, parsing source for each frame's
            # position): about a third of the worker's time per refused task, measured under a
            # backlog. A refusal's frames tell nobody anything, so it leaves with this one only.
            raise refused.with_traceback(None) from None
        setattr(request, HELD_LEASE_ATTRIBUTE, lease)
        finished = True
        try:
            store_started(self)
            return super().__call__(*args, **kwargs)
        except Reject as error:
            # Requeued with acks_late: Celery delivers the message again, and that copy must run.
            # Without acks_late Celery acked it before the body and the requeue hands nothing back:
            # the run is over, and no copy of it may run it again.
            finished = not (error.requeue and self._acks_late())
            raise
        except SemaphorePaused:
            finished = False  # its copy, sent for the end of the pause, runs it
            raise
        except Exception:
            raise  # a failure, the task's own retry, Ignore: Celery delivers this message no more
        except BaseException:
            # SystemExit or KeyboardInterrupt: a cold shutdown, a terminated child. Whether Celery
            # delivers the message again is known only to it (acks_late: it stays unacked and comes
            # back; the worker's main process marks the run finished where it will not). Without
            # acks_late the message was acked before the body ran: no copy may run it again.
            finished = not self._acks_late()
            raise
        finally:
            if lease is not None:
                give_back_at_end(request, lease, finished=finished)

    def semaphore_held(self) -> Lease | None:
        """From the body: the slot this execution holds (its ``Lease``: key, token, ``renew``),
        or None outside the body, in a plain function call, or when it runs without its
        semaphore (fail open)."""
        return getattr(self.request, HELD_LEASE_ATTRIBUTE, None)

    def semaphore_pause(self, seconds: float) -> NoReturn:
        """From the body, on "429, Retry-After: <seconds>": pause this task's semaphore for every
        worker for ``seconds`` and send the task again for the end of the pause, first in line.
        Raises, like ``self.retry()``; the task's retries are left alone (a wait, not a retry)."""
        seconds = check_seconds(f"{self.name}.semaphore_pause", seconds)
        request = self.request
        lease = self.semaphore_held()
        if lease is None:
            raise SemaphoreError(f"{self.name}: semaphore_pause is for the body of a task that holds its slot")
        semaphore: AnySemaphore = lease.semaphore  # type: ignore[assignment]
        if request.is_eager:  # no message to send: the call takes its slot again, past the pause
            for member in members(semaphore):
                member.pause(seconds)
            raise SemaphorePaused(f"{semaphore.name!r} paused for {seconds:g} s", when=seconds)
        history = WaitHistory.of(request).checked(TicketSigner.of(config_for(self.app)), request)
        waiting = WaitingDelivery(self, semaphore, history, tuple(request.args or ()), dict(request.kwargs or {}))
        waiting.note_first_wait()
        reopen_run(self, semaphore, history, lease.token)
        ticket = pause_and_stand_first(semaphore, waiting.waiter, seconds)
        again = waiting.copy_of_wait(ticket, seconds)
        send_copy(self.app, again)
        logger.info("%s[%s] paused %r for %g s; it goes first after", self.name, request.id, semaphore.name, seconds)
        raise SemaphorePaused(f"{semaphore.name!r} paused for {seconds:g} s", when=seconds, sig=again)

    def _acks_late(self) -> bool:
        acks_late = getattr(self.request, "acks_late", None)
        return bool(self.acks_late if acks_late is None else acks_late)

    def _label(self) -> str:
        return f"{default_label()} {self.name}[{self.request.id}]"

    def _acquire_eagerly(self, semaphore: AnySemaphore) -> Lease | None:
        """Eager mode runs a retry at once and recursively, ignoring its countdown, so a refused
        eager task waits for its slot here instead (bounded by the max wait). An eager task
        calling another of a key it holds itself, with no slot left, would wait for ever for a
        slot only its own caller can give back: that call fails at once instead."""
        started = time.monotonic()
        config = config_for(self.app)
        max_wait = wait_options(self, config).max_wait
        try:
            attempt = semaphore.try_acquire(enqueue=False, label=self._label())
            if isinstance(attempt, Granted):
                lease = attempt.lease
            else:
                if _names_of(semaphore) & _eager_held.names:
                    raise SemaphoreError(
                        f"{self.name} was called eagerly inside a task that holds a slot of {semaphore.name!r}, "
                        f"and no slot of it is free: it would wait for ever for its own caller (limit "
                        f"{getattr(attempt, 'limit', semaphore.limit)})",
                        key=semaphore.name,
                    )
                try:
                    lease = semaphore.acquire(timeout=max_wait, label=self._label())
                except SemaphoreUnavailable as error:  # the bound that ran out is the task's max wait
                    raise SemaphoreUnavailable(semaphore.name, error.limit, error.waited, max_wait) from None
        except RedisUnavailable as error:
            if config.fail_open:
                logger.warning(
                    "%s[%s] runs WITHOUT its semaphore %r (fail open): %s",
                    self.name,
                    self.request.id,
                    semaphore.name,
                    error,
                )
                return None
            raise
        metrics.acquired(template_of(self), time.monotonic() - started, lease)
        return lease

    def _acquire_in_worker(
        self, semaphore: AnySemaphore, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Lease | None:
        config = config_for(self.app)
        options = wait_options(self, config)
        request = self.request
        history = WaitHistory.of(request).checked(TicketSigner.of(config), request)
        if not history.waits and (request.delivery_info or {}).get("redelivered"):
            history = continued_wait(semaphore, request, history)
        token, waiter = (
            f"{task_key(request.id)}:{process_token()}",
            waiter_of(semaphore, request, short=history.short_waiter),
        )
        # a copy of a wait (re-sent, so it may have a twin) names its run, so that exactly one
        # copy runs; a first delivery has no twin
        run = history.run_id(request) if history.waits else None
        remember = remember_for(options, config)
        family = template_of(self)
        try:
            # a first delivery never asked before: when nobody waits and a slot is free, the
            # grant takes the fast path (8 Redis calls, no line bookkeeping)
            ask = Ask(
                token=token,
                waiter=waiter,
                label=self._label(),
                ticket=history.ticket,
                run=run,
                remember=remember,
                fresh=history.waits == 0 and history.ticket is None,
                tenant=tenant_of_call(self, args, kwargs),
                priority=priority_of_call(self, args, kwargs),
                coalesce=coalesce_of_call(self, args, kwargs),
                at_most_once=run is not None and not self._acks_late(),
            )
            # sent by its sender with the place it took there (``placing.py``): near its turn
            placed = history.waits == 0 and history.ticket is not None
            node_names.note_held(semaphore)  # before the grant: a worker killed right after it is found
            attempt = semaphore._try(ask)
            by_rules = start_by_rules_of(semaphore, attempt) if isinstance(attempt, Waiting) else 0.0
            if (
                isinstance(attempt, Waiting)
                and policy.waits_in_process(attempt, options.inline_wait, by_rules=by_rules)
                and (
                    pool_room.leaves_one_free()
                    or (policy.stands_by(attempt, placed=placed, by_rules=by_rules) and pool_room.has_others())
                )
            ):
                attempt = semaphore._wait(
                    dataclasses.replace(ask, ticket=attempt.ticket, fresh=False), options.inline_wait
                )
            outages.back(semaphore)
        except RedisUnavailable as error:
            if config.fail_open:
                logger.warning(
                    "%s[%s] runs WITHOUT its semaphore %r (fail open): %s", self.name, request.id, semaphore.name, error
                )
                return None
            outages.down(semaphore, error)
            attempt = Waiting(position=0, free=0, limit=semaphore.limit)
        except SemaphoreUnavailable as error:
            if error.evicted is not None:  # its place went to another: the wait ends here
                WaitingDelivery(self, semaphore, history, args, kwargs).lost_place(error)
            raise  # a full line refused its first ask: it took no place, nothing to undo
        if isinstance(attempt, Duplicate):
            if not attempt.running:
                logger.info("%s[%s]: another copy of this wait has run; this copy is dropped", self.name, request.id)
                raise Ignore()
            WaitingDelivery(self, semaphore, history, args, kwargs).wait_for_twin(attempt)
        redelivered = bool((request.delivery_info or {}).get("redelivered"))
        waited_copy = history.waits or redelivered
        if isinstance(attempt, Granted) and waited_copy and self._ran_already(run, history, remember):
            # the semaphore's Redis forgot the run (restarted empty, or the copy came after the
            # run was forgotten), but the broker's Redis or the result backend remembers it
            attempt.lease.release()
            logger.info("%s[%s]: the task has run already; this copy is dropped", self.name, request.id)
            raise Ignore()
        waited = max(0.0, time.time() - history.first_refused)
        if isinstance(attempt, Granted):
            if run is not None and not self._acks_late() and not isinstance(semaphore, FairSemaphore):
                begin_at_most_once(semaphore, run, remember)  # one key's grant did it (at_most_once)
            metrics.acquired(family, waited, attempt.lease)
            return attempt.lease
        metrics.refused(family)
        WaitingDelivery(self, semaphore, history, args, kwargs).wait(attempt, waited)

    def _ran_already(self, run: str | None, history: WaitHistory, remember: float) -> bool:
        """Asked of a granted copy: whether its run finished already. Without acks_late its
        stored copy is withdrawn meanwhile and the run remembered as finished (begun at most
        once); with it, the copy stays until the run finishes. The broker's Redis and the result
        backend are asked together: the first question is sent before the second, and its answer
        read after, so that the start waits for one round trip, not two."""
        with GrantedAhead(
            self.app, run, at_most_once=not self._acks_late(), remember_s=remember * (1 + REMEMBER_EXTRA)
        ) as asked:
            succeeded = self._succeeded_since(history.since())
            in_broker = asked.answer()
        if in_broker.remembered:
            run_remembered(self.request, remember)
        return in_broker.finished or succeeded

    def _succeeded_since(self, since: float) -> bool:
        """Whether the app's result backend says this task id succeeded after this wait began
        (as Celery's own ``worker_deduplicate_successful_tasks`` asks it, but an invocation that
        reused the id of one that succeeded before must still run); False without a result
        backend, or if it cannot say."""
        backend = self.backend
        if isinstance(backend, DisabledBackend) or self.ignore_result:
            return False
        try:
            meta = backend.get_task_meta(self.request.id)
        except Exception as error:
            logger.debug("could not ask the result backend about %s[%s]: %s", self.name, self.request.id, error)
            return False
        if not meta or meta.get("status") != states.SUCCESS:
            return False
        # A success recorded before this invocation's message was sent (or, unstamped, before this
        # wait began) belongs to an earlier invocation that used the same id. (Two hosts' clocks
        # compared: if the host that ran the body is behind the sender's, its success may look
        # older, and a late copy then runs again; that needs the semaphore's Redis to have lost
        # the run too. See docs/design.md.)
        done = _epoch_seconds(meta.get("date_done"))
        return done is None or done >= since


def _names_of(semaphore: AnySemaphore) -> set[str]:
    return {member.name for member in members(semaphore)}


class _EagerHeld(threading.local):
    """The semaphores whose slots eager tasks of this thread hold now (eager calls nest)."""

    def __init__(self) -> None:
        self.names: set[str] = set()


_eager_held = _EagerHeld()


class _eager_holding:
    def __init__(self, semaphore: AnySemaphore | None) -> None:
        self.added = _names_of(semaphore) - _eager_held.names if semaphore is not None else set()

    def __enter__(self) -> None:
        _eager_held.names |= self.added

    def __exit__(self, *exc: object) -> None:
        _eager_held.names -= self.added


def _epoch_seconds(date_done: Any) -> float | None:
    """A result's ``date_done`` (a datetime, or its ISO text) as epoch seconds, None if unknown."""
    if isinstance(date_done, str):
        try:
            date_done = datetime.fromisoformat(date_done)
        except ValueError:
            return None
    if not isinstance(date_done, datetime):
        return None
    if date_done.tzinfo is None:
        date_done = date_done.replace(tzinfo=timezone.utc)  # Celery stores UTC
    return float(date_done.timestamp())


# the marker lets modules that must not import this one recognise a semaphore task
setattr(SemaphoreTask, MARKER, True)
