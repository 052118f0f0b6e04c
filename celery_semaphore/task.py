"""SemaphoreTask: a Celery task that holds a semaphore slot while its body runs.

The slot is taken in the worker, right before the body, and given back in a ``finally``: so
every way out of the body (return, exception, the task's own ``retry``, ``Ignore``, ``Reject``,
a soft time limit, the ``SystemExit`` of ``revoke(terminate=True)``) releases it. What kills the
process outright (SIGKILL, OOM, a hard time limit) runs no ``finally``: the worker's parent
process then releases by task id (see ``worker.py``), and the lease is the last resort.

A task that finds no free slot is not run. It either waits a moment in-process for a release
(when its turn is near) or leaves the worker: it is re-sent with a countdown under the same task
id (the backstop copy, keeping its ticket and so its place in line) and *parks*, so that the
release that makes its turn sends it again at once (the wake copy, see ``_parking.py``). Of the
copies of one wait, exactly one runs: the first to get the slot records the run in Redis, and a
copy that finds the run recorded (finished, or still running under a live lease) is dropped
with ``Ignore``: not run, not recorded as a failure.

Waiting is not retrying: ``request.retries`` and the task's ``max_retries`` are left alone; the
wait's history travels in message headers, tagged with the retry it belongs to, so that the
task's own retry (which inherits the headers) starts a fresh wait instead of counting the
earlier one, its run and its retry delay against the max wait.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

from celery import Task
from celery.exceptions import Ignore, Retry

from . import metrics, policy
from ._options import (
    FROM_SETTINGS,
    MARKER,
    KeyOption,
    WaitOptions,
    WeightFunction,
    check_task_options,
    template_of,
    wait_options,
)
from ._parking import WAKE_QUEUE_SUFFIX, parking, wake_queue
from .catalogue import semaphore_for_call
from .config import SemaphoreConfig, config_for
from .errors import RedisUnavailable, SemaphoreError, SemaphoreUnavailable
from .multi import MultiSemaphore
from .semaphore import Duplicate, FairSemaphore, Granted, Lease, Waiting, default_label, new_token

# What a call holds: one semaphore, or (several keys, or a weight) a MultiSemaphore, driven alike.
AnySemaphore = FairSemaphore | MultiSemaphore

logger = logging.getLogger("celery_semaphore")

# Message headers that carry a waiting task's history across re-sends.
WAITS_HEADER = "semaphore_waits"
FIRST_REFUSED_HEADER = "semaphore_first_refused"
TICKET_HEADER = "semaphore_ticket"
# request.retries when the wait began: a run whose retries differ is the task's own retry
WAIT_OF_RETRY_HEADER = "semaphore_wait_of_retry"
# the queue the task first came from: its copies go back there (the wake copy to its wake queue)
QUEUE_HEADER = "semaphore_queue"

# A finished run is remembered this much longer than any copy of it can arrive late: the
# backstop's countdown, or a Redis broker's redelivery of a dead worker's unacked copy
# (visibility_timeout, plus kombu's restore sweep).
REMEMBER_SLACK = 300.0

# A waiter away on a countdown keeps its place this much longer than the countdown, to cover
# the broker's delivery and a busy worker's delay in starting it.
AWAY_SLACK = 15.0

# Releasing when Redis is unreachable: tries in the background, the lease is the backstop.
RELEASE_TRIES = 5
RELEASE_PAUSE = 0.5


class SemaphoreTask(Task):  # type: ignore[misc]
    """A task that runs only while it holds a slot of its semaphore.

    Options (class attributes, or ``app.task(base=SemaphoreTask, semaphore_limit=5, ...)``):
    ``semaphore_limit``, ``semaphore_key``, ``semaphore_weight``, ``semaphore_lease``,
    ``semaphore_countdown``, ``semaphore_max_wait``, ``semaphore_inline_wait``; each one left
    unset takes the app's ``semaphore_*`` setting. ``semaphore_key`` may be a list of keys: the
    body then runs only while the task holds a slot (``semaphore_weight`` slots) of every one.
    """

    semaphore_limit: ClassVar[int | None] = None
    semaphore_key: ClassVar[KeyOption | None] = None
    semaphore_weight: ClassVar[int | WeightFunction | None] = None
    semaphore_lease: ClassVar[float | None] = None
    semaphore_countdown: ClassVar[float | tuple[float, float] | None] = None
    semaphore_max_wait: ClassVar[float | None] = FROM_SETTINGS
    semaphore_inline_wait: ClassVar[float | None] = None
    # gives a lost pool process's slot back before its message is requeued (worker.py)
    Request: ClassVar[str] = "celery_semaphore.worker:SemaphoreRequest"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_task_options(cls)

    @classmethod
    def bind(cls, app: Any) -> Any:
        bound = super().bind(app)
        from .worker import install  # the task class installs its worker hooks when bound

        install(app)
        return bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            # a plain function call, outside Celery: not limited
            return super().__call__(*args, **kwargs)
        semaphore = semaphore_for_call(self, args, kwargs)
        if request.is_eager:
            lease: Lease | None = self._acquire_eagerly(semaphore)
        else:
            lease = self._acquire_in_worker(semaphore, args, kwargs)
        request.semaphore_lease = lease
        try:
            return super().__call__(*args, **kwargs)
        finally:
            if lease is not None:
                give_back(lease)

    def _label(self) -> str:
        return f"{default_label()} {self.name}[{self.request.id}]"

    def _acquire_eagerly(self, semaphore: AnySemaphore) -> Lease:
        """Eager mode runs a retry at once and recursively, ignoring its countdown, so a refused
        eager task waits for its slot here instead (bounded by the max wait)."""
        started = time.monotonic()
        max_wait = wait_options(self, config_for(self.app)).max_wait
        lease = semaphore.acquire(timeout=max_wait, label=self._label())
        metrics.acquired(template_of(self), time.monotonic() - started, lease)
        return lease

    def _acquire_in_worker(
        self, semaphore: AnySemaphore, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Lease | None:
        config = config_for(self.app)
        options = wait_options(self, config)
        request = self.request
        history = WaitHistory.of(request)
        token, waiter = f"{request.id}:{new_token()}", _waiter_of(semaphore, request)
        # a copy of a wait (re-sent, so it may have a twin) names its run, so that exactly one
        # copy runs; a first delivery has no twin
        run = f"{request.id}#{request.retries or 0}" if history.waits else None
        remember = _remember_for(options, config)
        family = template_of(self)
        try:
            # a first delivery never asked before: when nobody waits and a slot is free, the
            # grant takes the fast path (8 Redis calls, no line bookkeeping)
            attempt = semaphore.try_acquire(
                token=token, waiter=waiter, label=self._label(), ticket=history.ticket, run=run, remember=remember,
                fresh=history.waits == 0 and history.ticket is None,
            )
            if isinstance(attempt, Waiting) and policy.waits_in_process(attempt, options.inline_wait):
                attempt = semaphore.wait_for_slot(
                    token=token, waiter=waiter, timeout=options.inline_wait, label=self._label(),
                    ticket=attempt.ticket, run=run, remember=remember,
                )
            outages.back(semaphore)
        except RedisUnavailable as error:
            if config.fail_open:
                logger.warning("%s[%s] runs WITHOUT its semaphore %r (fail open): %s", self.name, request.id,
                               semaphore.name, error)
                return None
            outages.down(semaphore, error)
            attempt = Waiting(position=0, free=0, limit=semaphore.limit)
        if isinstance(attempt, Duplicate):
            logger.info("%s[%s]: another copy of this wait %s; this copy is dropped", self.name, request.id,
                        "is running" if attempt.running else "has run")
            raise Ignore()
        waited = max(0.0, time.time() - history.first_refused)
        if isinstance(attempt, Granted):
            metrics.acquired(family, waited, attempt.lease)
            return attempt.lease
        metrics.refused(family)
        if options.max_wait is not None and waited >= options.max_wait:
            _leave_quietly(semaphore, waiter)
            if run is not None:  # this wait parked before: no wake-up or sweep may bring it back
                parking().unpark(semaphore, waiter, run)
            raise SemaphoreUnavailable(semaphore.name, attempt.limit, waited)
        countdown = policy.countdown(
            attempt, options.countdown, waits=history.waits, visibility_timeout=config.visibility_timeout
        )
        # a parked task comes back through the hand-off, so its countdown copy is only the
        # backstop: late, or it would come back, be refused and be re-sent over and over
        backstop = policy.backstop(options.countdown, visibility_timeout=config.visibility_timeout)
        if options.max_wait is not None:
            left = round(options.max_wait - waited + 0.5)
            countdown, backstop = max(1, min(countdown, left)), max(1, min(backstop, left))
        self._wait_outside(semaphore, attempt, history, args, kwargs, countdown, backstop)

    def _wait_outside(
        self, semaphore: AnySemaphore, attempt: Waiting, history: WaitHistory, args: tuple[Any, ...],
        kwargs: dict[str, Any], countdown: int, backstop_countdown: int,
    ) -> NoReturn:
        """Leave the worker: send the backstop copy (countdown) and park the wake copy, then
        raise Retry. While away the task holds up nobody who is present before its turn."""
        request = self.request
        waiter = _waiter_of(semaphore, request)
        origin = _header(request, QUEUE_HEADER) or _queue_of(self.app, request)
        headers = {
            **(request.headers or {}),
            **history.next(attempt.ticket, retries=request.retries or 0),
            **({QUEUE_HEADER: origin} if origin else {}),
        }
        address = ""
        run = f"{request.id}#{request.retries or 0}"
        if origin is not None and not outages.is_down(semaphore):
            wake_copy = self.signature_from_request(request, args, kwargs, queue=wake_queue(origin), headers=headers)
            try:
                address = parking().park(semaphore, waiter, wake_copy, away_for=backstop_countdown + AWAY_SLACK,
                                         run=run)
            except Exception as error:  # no wake-up then: the countdown copy must bring it back
                logger.warning("%s[%s] waits for its countdown only (could not listen for its turn): %s",
                               self.name, request.id, error)
        if address:
            countdown = backstop_countdown
        away_for = countdown + AWAY_SLACK
        # back where it came from: a copy that came through the wake queue goes to its origin
        came_woken = origin is not None and _routing_key(request) == wake_queue(origin)
        backstop = self.signature_from_request(request, args, kwargs, queue=origin if came_woken else None,
                                               countdown=countdown, headers=headers)
        # Step away, parked: a parked waiter is offered its turn like a present one and woken
        # through this process; should its place lapse, its ticket travels in the headers and
        # puts it back where it was.
        _leave_quietly(semaphore, waiter, away_for=away_for, wake=address)
        try:
            backstop.apply_async()
        except Exception as error:
            _leave_quietly(semaphore, waiter)  # no copy will come: give the place up
            if address:
                parking().unpark(semaphore, waiter, run)  # nor may a wake-up or a sweep send one
            raise SemaphoreError(f"could not re-send {self.name}[{request.id}] to wait for {semaphore.name!r}: "
                                 f"{error}", key=semaphore.name) from error
        raise Retry(
            f"waiting for a slot of {semaphore.name!r}: place {attempt.position} in line, retry in {countdown} s",
            when=countdown,
            sig=backstop,
        )


def _waiter_of(semaphore: AnySemaphore, request: Any) -> str:
    """The id a task's wait stands in line under: its task id (with the weight in front for a
    MultiSemaphore, whose lines read it from there)."""
    return semaphore.waiter_id(str(request.id)) if isinstance(semaphore, MultiSemaphore) else str(request.id)


def _routing_key(request: Any) -> str | None:
    routing_key = (request.delivery_info or {}).get("routing_key")
    return routing_key if isinstance(routing_key, str) and routing_key else None


def _queue_of(app: Any, request: Any) -> str | None:
    """The name of the queue a request came from, when it can be told: Celery's routing by
    queue name (the routing key names the queue). A task routed otherwise (a topic exchange,
    say) gets no wake copy, whose queue the workers would not consume: its countdown copy
    brings it back, as before."""
    routing_key = _routing_key(request)
    if routing_key is None:
        return None
    name = routing_key.removesuffix(WAKE_QUEUE_SUFFIX)
    exchange = (request.delivery_info or {}).get("exchange")
    if name in app.amqp.queues or exchange in ("", None, name):
        return name
    return None


def _remember_for(options: WaitOptions, config: SemaphoreConfig) -> float:
    """How long a finished run of a waited task is remembered, to drop its late copies."""
    return max(options.countdown[1] + AWAY_SLACK, config.visibility_timeout or 0.0) + REMEMBER_SLACK


# the marker lets modules that must not import this one recognise a semaphore task
setattr(SemaphoreTask, MARKER, True)


@dataclass(frozen=True)
class WaitHistory:
    """What earlier tries of this wait left in the message headers."""

    waits: int  # refusals so far
    first_refused: float  # epoch seconds of the first refusal (now, for a fresh wait)
    ticket: int | None  # the place in line to come back to

    @classmethod
    def of(cls, request: Any) -> WaitHistory:
        """The history of the wait this run continues, or a fresh one.

        Celery copies a request's headers into the task's own retry, so headers of a wait that
        belonged to an earlier retry (another ``request.retries``) describe a finished wait."""
        retries = request.retries or 0
        of_retry = _header(request, WAIT_OF_RETRY_HEADER)
        first_refused = _header(request, FIRST_REFUSED_HEADER)
        if first_refused is None or of_retry is None or int(of_retry) != retries:
            return cls(waits=0, first_refused=time.time(), ticket=None)
        ticket = _header(request, TICKET_HEADER)
        return cls(
            waits=int(_header(request, WAITS_HEADER) or 0),
            first_refused=float(first_refused),
            ticket=int(ticket) if ticket else None,
        )

    def next(self, ticket: int | None, *, retries: int) -> dict[str, Any]:
        """The headers of the re-sent message that continues this wait."""
        return {
            WAITS_HEADER: self.waits + 1,
            FIRST_REFUSED_HEADER: self.first_refused,
            TICKET_HEADER: ticket if ticket is not None else self.ticket,
            WAIT_OF_RETRY_HEADER: retries,
        }


def _header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


class _Outages:
    """Says once per outage per process that the semaphore Redis is unreachable, and once when
    it answers again, instead of a warning on every refused try (hundreds a second)."""

    def __init__(self) -> None:
        self._down: set[int] = set()  # id() of the clients known to be unreachable
        self._lock = threading.Lock()

    def down(self, semaphore: AnySemaphore, error: Exception) -> None:
        with self._lock:
            first = id(semaphore.client) not in self._down
            self._down.add(id(semaphore.client))
        if first:
            logger.warning("semaphore Redis unavailable: tasks wait (fail closed) until it is back: %s", error)

    def back(self, semaphore: AnySemaphore) -> None:
        if not self._down:  # the common case costs one truth test
            return
        with self._lock:
            was_down = id(semaphore.client) in self._down
            self._down.discard(id(semaphore.client))
        if was_down:
            logger.warning("semaphore Redis is back: waiting tasks take their slots again")

    def is_down(self, semaphore: AnySemaphore) -> bool:
        return id(semaphore.client) in self._down


outages = _Outages()


def _leave_quietly(semaphore: AnySemaphore, waiter: str, *, away_for: float | None = None, wake: str = "") -> None:
    try:
        semaphore.leave(waiter, away_for=away_for, wake=wake)
    except SemaphoreError as error:
        if not outages.is_down(semaphore):  # during an outage, the outage line says it all
            logger.warning("could not leave the line of %r (it lapses by itself): %s", semaphore.name, error)


def give_back(lease: Lease) -> None:
    """Release now; only if Redis is unreachable, keep trying briefly in a daemon thread, so the
    task's result is not held up. The lease expiring is the backstop."""
    try:
        if not lease.release() and lease.lost:
            logger.warning("%r: the lease had been lost before the task ended", lease)
        return
    except RedisUnavailable as error:
        logger.warning("release of %r failed, retrying in the background: %s", lease, error)

    def retry() -> None:
        for attempt in range(RELEASE_TRIES):
            time.sleep(RELEASE_PAUSE * (attempt + 1))
            try:
                lease.semaphore.release(lease.token, run=lease.run, remember_ms=lease.remember_ms)
                return
            except RedisUnavailable:
                continue
        logger.error("%r could not be released; its slot comes back when the lease ends", lease)

    threading.Thread(target=retry, name="celery-semaphore-release", daemon=True).start()
