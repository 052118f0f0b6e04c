"""A delivery of a ``SemaphoreTask`` that did not get its slot: how it waits outside the worker.

The task (``task.py``) asks for the slot; when the answer is "wait", everything that follows is
here, on one object that holds what the wait needs (the task and its request, the semaphore, the
wait's history, the call's arguments, the queue it came from):

* gone past ``semaphore_max_wait``: leave the line and fail with ``SemaphoreUnavailable``;
* a start reserved at a known moment (a rate, a spacing, a pause): come back exactly then
  (``wait_for_start``), or park if that moment is far off;
* otherwise *park*: send the backstop copy (due late, kept apart from any worker:
  ``due_copies.py`` on the Redis broker, ``backstop.py`` on RabbitMQ) and leave a wake copy with
  ``parking.py``, which sends it the moment a release makes this task's turn (``wait_outside``);
* a twin of this wait holds the slot: look again once the twin's lease would have lapsed
  (``wait_for_twin``).

Each way out raises (``Retry`` or ``Ignore``, as Celery expects of a task that will run later or
never), so the body does not run; a copy that cannot be sent fails loudly instead, never lost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

from celery.exceptions import Ignore, Retry

from .._core.attempts import Duplicate, Waiting
from .._core.multi import MultiSemaphore
from .._core.semaphore import FairSemaphore
from .._core.validation import to_ms
from .._core.waiting import leave_quietly
from ..errors import SemaphoreError, SemaphoreUnavailable
from . import policy
from .backstop import holds_backstops
from .config import SemaphoreConfig, config_for
from .due_copies import send_copy, stores_copies, withdraw
from .options import WaitOptions, wait_options
from .outages import outages
from .parking import parking
from .tokens import waiter_of
from .wait_headers import (
    COPY_ID_HEADER,
    DUE_HEADER,
    DUE_IN_HEADER,
    QUEUE_HEADER,
    TicketSigner,
    WaitHistory,
    without_broker_headers,
)
from .wait_runs import AWAY_SLACK, remember_for, remember_wait
from .wake_queues import backstop_queue, origin_of_wake, wake_queue

# What a call holds: one semaphore, or (several keys, or a weight) a MultiSemaphore, driven alike.
AnySemaphore = FairSemaphore | MultiSemaphore

logger = logging.getLogger("celery_semaphore")


@dataclass
class WaitingDelivery:
    """One delivery of ``task`` (its current request) that waits for a slot of ``semaphore``."""

    task: Any  # the SemaphoreTask whose request this is
    semaphore: AnySemaphore
    history: WaitHistory
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    request: Any = field(init=False)
    config: SemaphoreConfig = field(init=False)
    options: WaitOptions = field(init=False)
    origin: str | None = field(init=False)  # the queue this wait's copies go back to
    waiter: str = field(init=False)
    run: str = field(init=False)

    def __post_init__(self) -> None:
        self.request = self.task.request
        self.config = config_for(self.task.app)
        self.options = wait_options(self.task, self.config)
        self.origin = self.history.origin or queue_of(self.task.app, self.request)
        self.waiter = waiter_of(self.semaphore, self.request, short=self.history.short_waiter)
        self.run = self.history.run_id(self.request)

    def wait(self, attempt: Waiting, waited: float) -> NoReturn:
        """Refused after ``waited`` seconds of waiting: fail past the max wait, else leave the
        worker until the turn comes."""
        options = self.options
        if options.max_wait is not None and waited >= options.max_wait:
            leave(self.semaphore, self.waiter)
            if self.history.waits:  # this wait parked before: no wake-up or sweep may bring it back
                parking().unpark(self.semaphore, self.waiter, self.run)
                self._end_run()
            raise SemaphoreUnavailable(self.semaphore.name, attempt.limit, waited, options.max_wait)
        if attempt.retry_after is not None:
            # a start reserved for this task at a known moment: come back exactly then
            due_in = attempt.retry_after
            if options.max_wait is not None:
                due_in = min(due_in, max(0.0, options.max_wait - waited) + 0.5)
            if self.config.visibility_timeout is not None and not self.keeps_copies_apart():
                due_in = min(due_in, self.config.visibility_timeout * policy.VISIBILITY_MARGIN)
            if due_in <= policy.PARKED_START_AFTER_S:
                self.wait_for_start(attempt, due_in)
            # far off (a pause until resumed): parked too, so that a resume or a looser rule wakes it
            self.wait_outside(attempt, due_in, due_in)
        countdown = policy.countdown(
            attempt, options.countdown, waits=self.history.waits, visibility_timeout=self.config.visibility_timeout
        )
        # a parked task comes back through the hand-off, so its backstop copy is late: sooner, it
        # would come back, be refused and be re-sent over and over
        backstop = self._longest_countdown(attempt)
        if options.max_wait is not None:
            left = round(options.max_wait - waited + 0.5)
            countdown, backstop = max(1, min(countdown, left)), max(1, min(backstop, left))
        self.wait_outside(attempt, countdown, backstop)

    def lost_place(self, error: SemaphoreUnavailable) -> NoReturn:
        """Its place went to another (a full line's ``drop_oldest``, or ``keep_latest``'s newer
        call): the task fails with ``error``, and no other copy of its wait runs (they find the
        run over and are dropped)."""
        if self.history.waits:
            parking().unpark(self.semaphore, self.waiter, self.run)
            self._end_run()
        raise error

    def _end_run(self) -> None:
        """The wait failed: its run is over, so its stored copy is withdrawn and any other copy
        of it (kept, moved, in flight) is dropped as it asks, instead of failing the task again."""
        remember = remember_for(self.options, self.config)
        withdraw(self.task.app, self.run, remember_s=remember)
        try:
            self.semaphore._finish_run(self.run, to_ms(remember))
        except SemaphoreError as error:  # a copy that comes back fails at its max wait again
            logger.warning("could not mark the failed wait of %s[%s] over: %s", self.task.name, self.request.id, error)

    def keeps_copies_apart(self) -> bool:
        """Whether this task's due-later copies wait apart from any worker (``due_copies.py``,
        ``backstop.py``); not where its queue cannot be told (its copies are Celery countdowns)."""
        origin = WaitHistory.of(self.request).origin or queue_of(self.task.app, self.request)
        return origin is not None and (stores_copies(self.task.app) or holds_backstops(self.task.app))

    def _longest_countdown(self, attempt: Waiting | None = None) -> float:
        """The backstop's countdown: for a refusal (``attempt``), later the further back in line."""
        return policy.backstop(
            self.options.countdown,
            visibility_timeout=self.config.visibility_timeout,
            kept_apart=self.keeps_copies_apart(),
            bounds_given=self.options.countdown_given,
            expected=0.0 if attempt is None else expected_start_of(self.semaphore, attempt),
        )

    def note_first_wait(self) -> None:
        """Before any copy of a first delivery's wait exists: a redelivery of this message
        (acks_late, its worker killed before the ack) must continue this wait, not begin a
        second one."""
        if not self.history.waits and self.history.run_part is not None:
            remember = remember_for(self.options, self.config)
            remember_wait(self.semaphore, self.request, self.history.run_part, remember)

    def copy_of_wait(self, ticket: int | None, due_in: float) -> Any:
        """A copy of this wait carrying ``ticket``, due in ``due_in`` seconds, bound for the
        queue the wait came from (a copy that came through the wake queue goes back there)."""
        return self._copy_due_in(due_in, self._headers_of_copy(ticket))

    def _came_woken(self) -> bool:
        return self.origin is not None and routing_key_of(self.request) == wake_queue(self.origin)

    def _headers_of_copy(self, ticket: int | None) -> dict[str, Any]:
        """The headers of a re-sent copy of this wait: the request's own, less what a broker
        added to the message it delivered, plus the wait's history."""
        request = self.request
        signer = TicketSigner.of(self.config)
        return {
            **without_broker_headers(request.headers),
            **self.history.next(ticket, retries=request.retries or 0, signer=signer, task_id=request.id),
            **({QUEUE_HEADER: self.origin} if self.origin else {}),
        }

    def _copy_due_in(self, countdown: float, headers: dict[str, Any]) -> Any:
        """A copy of this wait that is due in ``countdown`` seconds, waiting in the broker and
        never in a worker's prefetch window: on the Redis broker in the broker's Redis, under its
        run (``due_copies.py``); on RabbitMQ in the backstop queue of its queue, held by a worker's
        main process until due (``backstop.py``). For a task whose queue cannot be told (routed
        by a topic exchange, say), a Celery countdown, as Celery routes it."""
        app, origin = self.task.app, self.origin
        if origin is not None and (stores_copies(app) or holds_backstops(app)):
            due = (
                {DUE_IN_HEADER: countdown, COPY_ID_HEADER: self.run}
                if stores_copies(app)
                else {DUE_HEADER: time.time() + countdown}
            )
            return self._signature(queue=backstop_queue(origin), headers={**headers, **due})
        queue = origin if self._came_woken() else None
        return self._signature(queue=queue, countdown=countdown, headers=headers)

    def _signature(self, **options: Any) -> Any:
        return self.task.signature_from_request(self.request, self.args, self.kwargs, **options)

    def wait_for_twin(self, attempt: Duplicate) -> NoReturn:
        """Another copy of this wait holds the slot. It may be running, or its process may be
        dead (a SIGKILLed worker whose lease has not lapsed yet): dropping this copy would lose
        the task in the second case. So this copy comes back once the twin's lease would have
        lapsed: then the run is finished (and this copy dropped), or the twin is gone (and this
        copy runs the task), or it is still running (and this copy waits again)."""
        lease = attempt.twin_lease or self.semaphore.lease
        countdown = max(1, round(min(lease + 1.0, self._longest_countdown())))
        again = self.copy_of_wait(self.history.ticket, countdown)
        logger.info(
            "%s[%s]: another copy of this wait holds the slot; this copy looks again in %d s",
            self.task.name,
            self.request.id,
            countdown,
        )
        try:
            send_copy(self.task.app, again)
        except Exception as error:
            raise SemaphoreError(
                f"could not re-send {self.task.name}[{self.request.id}] while its twin runs: {error}",
                key=self.semaphore.name,
            ) from error
        # Ignore, not Retry: the run this copy waits on owns the task's state. A RETRY stored by
        # this copy could land just after the run's SUCCESS and hide it from ``get()``.
        raise Ignore()

    def wait_for_start(self, attempt: Waiting, due_in: float) -> NoReturn:
        """A rate, a spacing or a pause holds a start for this task, ``due_in`` seconds from now,
        and nobody else can take it: the task is sent again for that moment. It is not parked:
        no release has to tell it anything, and a wake-up now would only find its start not yet
        allowed. It keeps its place (the script kept it until then), and its ticket travels."""
        self.note_first_wait()
        again = self.copy_of_wait(attempt.ticket, due_in)
        try:
            send_copy(self.task.app, again)
        except Exception as error:
            leave(self.semaphore, self.waiter)  # no copy will come
            raise SemaphoreError(
                f"could not re-send {self.task.name}[{self.request.id}] for its start on "
                f"{self.semaphore.name!r}: {error}",
                key=self.semaphore.name,
            ) from error
        raise Retry(f"its start on {self.semaphore.name!r} comes in {due_in:.3f} s", when=due_in, sig=again)

    def wait_outside(self, attempt: Waiting, countdown: float, backstop_countdown: float) -> NoReturn:
        """Leave the worker: send the backstop copy (countdown) and park the wake copy, then
        raise Retry. While away the task holds up nobody who is present before its turn."""
        semaphore, waiter, run = self.semaphore, self.waiter, self.run
        headers = self._headers_of_copy(attempt.ticket)
        address = ""
        self.note_first_wait()
        if self.origin is not None and not outages.is_down(semaphore):
            wake_copy = self._signature(queue=wake_queue(self.origin), headers=headers)
            try:
                address = parking().park(
                    semaphore,
                    waiter,
                    wake_copy,
                    away_for=backstop_countdown + AWAY_SLACK,
                    run=run,
                    stored_in_broker=stores_copies(self.task.app),
                    stands_by_ms=policy.stands_by_ms(self.options.inline_wait),
                )
            except Exception as error:  # no wake-up then: the backstop copy must bring it back
                logger.warning(
                    "%s[%s] waits for its countdown only (could not listen for its turn): %s",
                    self.task.name,
                    self.request.id,
                    error,
                )
        if address:
            countdown = backstop_countdown
        # back where it came from: a copy that came through the wake queue goes to its origin
        backstop = self._copy_due_in(countdown, headers)
        # The backstop copy is sent before the waiter is parked: once parked, a release may
        # offer it its turn and its wake copy may start at once, withdrawing the stored copy as
        # the run begins; a copy stored after that would outlive the run (and could take a
        # killed run over when its lease lapses).
        try:
            send_copy(self.task.app, backstop)
        except Exception as error:
            leave(semaphore, waiter)  # no copy will come: give the place up
            if address:
                parking().unpark(semaphore, waiter, run)  # nor may a wake-up or a sweep send one
            raise SemaphoreError(
                f"could not re-send {self.task.name}[{self.request.id}] to wait for {semaphore.name!r}: {error}",
                key=semaphore.name,
            ) from error
        # Step away, parked: a parked waiter is offered its turn like a present one and woken
        # through this process; should its place lapse, its ticket travels in the headers and
        # puts it back where it was.
        leave(semaphore, waiter, away_for=countdown + AWAY_SLACK, wake=address)
        raise Retry(
            f"waiting for a slot of {semaphore.name!r}: place {attempt.position} in line, retry in {countdown} s",
            when=countdown,
            sig=backstop,
        )


def expected_start_of(semaphore: AnySemaphore, attempt: Waiting) -> float:
    """Seconds until a refused task's turn at the earliest, by the rules of its semaphore (of its
    first key, for several: the line it waits in longest is at least that long)."""
    return policy.expected_start(attempt, _first(semaphore).rules)


def start_by_rules_of(semaphore: AnySemaphore, attempt: Waiting) -> float:
    """``policy.start_by_rules`` of a refused task, by the rate and spacing of its semaphore (of
    its first key, for several, as ``expected_start_of``)."""
    return policy.start_by_rules(attempt, _first(semaphore).rules)


def _first(semaphore: AnySemaphore) -> FairSemaphore:
    return semaphore if isinstance(semaphore, FairSemaphore) else semaphore.semaphores[0]


def leave(semaphore: AnySemaphore, waiter: str, *, away_for: float | None = None, wake: str = "") -> None:
    """Give the place up (or park it), never raising: during an outage the outage line says it all."""
    leave_quietly(semaphore, waiter, away_for=away_for, wake=wake, quiet=lambda: outages.is_down(semaphore))


def routing_key_of(request: Any) -> str | None:
    routing_key = (request.delivery_info or {}).get("routing_key")
    return routing_key if isinstance(routing_key, str) and routing_key else None


def queue_of(app: Any, request: Any) -> str | None:
    """The name of the queue a request came from, when it can be told: Celery's routing by
    queue name (the routing key names the queue). A task routed otherwise (a topic exchange,
    say) gets no wake copy, whose queue the workers would not consume: its backstop copy
    brings it back, as before."""
    routing_key = routing_key_of(request)
    if routing_key is None:
        return None
    name = origin_of_wake(routing_key)
    exchange = (request.delivery_info or {}).get("exchange")
    if name in app.amqp.queues or exchange in ("", None, name):
        return name
    return None
