"""A task that would wait takes its place in line as it is sent, and is delivered once.

Without this, every task is sent to its queue, delivered, refused when no slot is free, and
parked (``waiting_delivery.py``): it leaves the worker, and its turn sends it again. Under a
long line that is two deliveries per task, and the first only learns what Redis knew before
the task was sent. So ``SemaphoreTask.apply_async`` asks first, in one script run that takes a
place but never a slot (``FairSemaphore._place``):

* the task would start now (a slot free, nobody to pass): the script offers it that start, and
  it is sent to its queue carrying the ticket (``csem_ticket``, a wait of no refusal yet); its
  delivery claims the offer (one delivery, as ever). Until then the offer counts as a slot taken
  (and as a start, under a rate), so that a burst of sends is not all sent on as free, and the
  tasks sent after it wait behind it, not in front;
* it would wait, but its turn is near (fewer than ``limit`` waiters ahead, a slot expected within
  half a second, ``policy.sent_to_stand_by``): it is sent to its queue carrying the ticket of the
  place it took, and its delivery stands by for its offer in a pool process (``policy.stands_by``),
  as a task woken ahead does. Until it arrives its place is present: an offer made to it waits
  for its claim, as an offered start does;
* otherwise it is parked from the sender, exactly as a refused first delivery parks: its backstop
  copy waits in the broker (``due_copies.py``), its parked record (``parking.py``) names it (on
  RabbitMQ the record keeps a wake copy), and its place in line is parked under a wake address
  nobody listens on. The release that makes its turn finds it parked and unheard, and sends the
  stored message to the wake queue from the record (as it does for a task whose worker is gone):
  the task's one delivery. A start that a
  rate or a spacing reserves for it at a known moment is sent due then, from the broker's store.

Each step leaves the task somewhere that brings it back: killed after its place was taken and
before its backstop copy was sent, the sender never returned from ``apply_async`` (the call
failed, as a failed publish does) and the place lapses unclaimed; after the copy, the copy is
due within the backstop time; after the record, the record's sweep or the copy sends it.

Only where the copies wait in the broker (the broker's Redis, or RabbitMQ's backstop queues), for
a task with one key and no weight, routed to a queue by name, sent without a countdown or an
ETA, and not itself a copy of a wait (a wake, backstop or retry copy carries the wait's headers and is sent as it is).
``semaphore_place_at_send = False`` turns it off. Any doubt (Redis down, a send option a copy
cannot carry) sends the task as it is: placing is an optimisation, never a new way to fail.
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass
from typing import Any

from kombu.utils.uuid import uuid

from .._core.attempts import Ask, StartsOnArrival, Waiting, default_label
from .._core.semaphore import FairSemaphore
from .._core.validation import priority_ms
from ..errors import ConfigurationError, SemaphoreError
from . import policy
from .backstop import holds_backstops
from .catalogue import semaphore_for_call
from .config import config_for
from .due_copies import send_copy, stores_copies
from .options import (
    PRIORITY_HEADER,
    coalesce_of_call,
    priority_option,
    tenant_of_call,
    wait_options,
)
from .outages import outages
from .parking import parking
from .stamping import stamp
from .tokens import task_key, waiter_key
from .wait_headers import (
    COPY_ID_HEADER,
    DUE_HEADER,
    DUE_IN_HEADER,
    FIRST_REFUSED_HEADER,
    QUEUE_HEADER,
    SENT_HEADER,
    WAITS_HEADER,
    TicketSigner,
    WaitHistory,
    header_in,
)
from .wait_runs import AWAY_SLACK
from .waiting_delivery import expected_start_of, leave, start_by_rules_of
from .wake_copies import serialized
from .wake_queues import backstop_queue, is_derived_queue, wake_aware, wake_queue

logger = logging.getLogger("celery_semaphore")

# The listener id of the wake address a task placed at send is parked under: no process listens
# on it, so an offer is always reported unheard to the script's caller, who sends the wake copy.
SENDER_LISTENER = "at-send"
# apply_async options that say how or when to publish: a task sent with one is sent as it is
_LOCAL_OPTIONS = frozenset({"connection", "router", "publisher", "countdown", "eta"})
# what only the sending call can use: left out of the copies (they are sent on a producer of the
# app's pool, and apply_async returns the task's AsyncResult)
_CALL_ONLY_OPTIONS = frozenset({"headers", "result_cls", "exchange", "exchange_type", "routing_key"})


@dataclass(frozen=True)
class Placement:
    """What the asking at send decided for one call: ``parked`` (its copies are sent: nothing
    more to publish), or to be sent to its queue under ``task_id`` with ``headers`` (its own,
    stamped, and the ticket of the start it was offered, which its first delivery claims)."""

    task_id: str
    parked: bool
    headers: dict[str, Any]


def placed_at_send(
    task: Any, args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None, task_id: str | None, options: dict[str, Any]
) -> Placement | None:
    """Ask ``task``'s line for one call before it is sent: parked from here if it would wait,
    or offered the start it would take now. None: sent as it is (placing does not apply here,
    or the asking failed)."""
    app = task.app
    if not _applies(task, options):
        return None
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    queue = _queue_by_name(app, task, args, kwargs, options)
    if queue is None:
        return None
    try:
        semaphore = semaphore_for_call(task, args, kwargs)
    except SemaphoreError:
        return None  # the worker reports a bad key or limit, as it does for any call
    if not isinstance(semaphore, FairSemaphore) or outages.is_down(semaphore):
        return None
    copied = {name: value for name, value in options.items() if name not in _CALL_ONLY_OPTIONS}
    if not stores_copies(app) and serialized(task.signature(args, kwargs, copied)) is None:
        return None  # its record keeps a wake copy (RabbitMQ) that no worker could read back
    task_id = task_id or uuid()
    headers = dict(options.get("headers") or {})
    stamp(headers)  # every copy keeps the one message's stamps
    waiter = waiter_key(task_id)
    try:  # any doubt sends the task as it is: its worker asks, and reports what is wrong
        attempt = semaphore._place(
            Ask(
                token=task_key(task_id),
                waiter=waiter,
                label=f"{default_label()} {task.name}[{task_id}]",
                tenant=tenant_of_call(task, args, kwargs),
                priority=_priority_at_send(task, headers, args, kwargs),
                coalesce=coalesce_of_call(task, args, kwargs),
            )
        )
    except Exception as error:
        logger.debug("%s[%s] is sent as it is (could not take its place): %s", task.name, task_id, error)
        return None
    if attempt is None:
        return None
    if isinstance(attempt, StartsOnArrival):
        return Placement(task_id, False, {**headers, **_offered_start(task, task_id, headers, attempt.ticket)})
    if attempt.ticket is not None and policy.sent_to_stand_by(
        attempt, wait_options(task, config_for(app)).inline_wait, by_rules=start_by_rules_of(semaphore, attempt)
    ):
        # near its turn: its delivery keeps the place its ticket names, and stands by for it
        return Placement(task_id, False, {**headers, **_offered_start(task, task_id, headers, attempt.ticket)})
    _ParkedAtSend(task, args, kwargs, task_id, options, headers, queue, semaphore, attempt).park()
    return Placement(task_id, True, headers)


def _offered_start(task: Any, task_id: str, headers: dict[str, Any], ticket: int) -> dict[str, Any]:
    """The headers that let a first delivery claim the start offered at send, or keep the place
    taken then: a wait of no refusal yet (``csem_waits`` 0), with its signed ticket."""
    history = WaitHistory.fresh(headers.get(SENT_HEADER))
    signer = TicketSigner.of(config_for(task.app))
    return {**history.next(ticket, retries=0, signer=signer, task_id=task_id), WAITS_HEADER: 0}


def _applies(task: Any, options: dict[str, Any]) -> bool:
    app = task.app
    try:
        if app.conf.task_always_eager or not config_for(app).place_at_send:
            return False
        if not stores_copies(app) and not holds_backstops(app):
            return False  # a broker where a copy due later would be a countdown held by a worker
    except ConfigurationError:  # a worker refuses to start on it; a sender sends as it did
        return False
    if any(options.get(name) is not None for name in _LOCAL_OPTIONS):
        return False
    headers = options.get("headers") or {}
    # a copy of a wait (or the task's own retry, which inherits its headers) is sent as it is
    return header_in(headers, WAITS_HEADER) is None and header_in(headers, FIRST_REFUSED_HEADER) is None


def _queue_by_name(
    app: Any, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any]
) -> str | None:
    """The queue the call is routed to, where its routing key names it (the wake queue then
    exists beside it); None for any other routing (a topic exchange, say)."""
    try:
        route = app.amqp.router.route({**task._get_exec_options(), **options}, task.name, args, kwargs)
    except Exception:  # the send that follows reports a bad route
        return None
    queue = route.get("queue")
    name = getattr(queue, "name", None)
    if not isinstance(name, str) or not name or is_derived_queue(name):
        return None
    routing_key = route.get("routing_key") or queue.routing_key
    exchange = route.get("exchange") or getattr(queue.exchange, "name", "")
    exchange = getattr(exchange, "name", exchange)
    return name if routing_key == name and exchange in ("", None, name) else None


def _priority_at_send(task: Any, headers: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """A call's priority as its worker would read it: the message header, else the option."""
    if headers.get(PRIORITY_HEADER) is not None:
        return priority_ms(f"{task.name}: header {PRIORITY_HEADER}", headers[PRIORITY_HEADER]) / 1000
    option = priority_option(type(task))
    if option is None:
        return 0.0
    value = option(args, kwargs) if callable(option) else option
    return priority_ms(f"{task.name}.semaphore_priority", value) / 1000


class _ParkedAtSend:
    """One call parked from its sender: the copies a refused first delivery would have left."""

    def __init__(
        self,
        task: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        task_id: str,
        options: dict[str, Any],
        headers: dict[str, Any],
        queue: str,
        semaphore: FairSemaphore,
        attempt: Waiting,
    ) -> None:
        self.task, self.args, self.kwargs, self.task_id = task, args, kwargs, task_id
        self.options = {name: value for name, value in options.items() if name not in _CALL_ONLY_OPTIONS}
        self.queue, self.semaphore, self.attempt = queue, semaphore, attempt
        config = config_for(task.app)
        history = WaitHistory.fresh(headers.get(SENT_HEADER))
        self.run = history.run_id(types.SimpleNamespace(id=task_id, retries=0))
        self.waiter = waiter_key(task_id)
        self.headers = {
            **headers,
            **history.next(attempt.ticket, retries=0, signer=TicketSigner.of(config), task_id=task_id),
            QUEUE_HEADER: queue,
        }
        self.wait_options = wait_options(task, config)

    def park(self) -> None:
        """Send the copies and park the place; on a failed send the place is given up and the
        error raised, as a failed publish raises from ``apply_async``."""
        wake_aware(self.task.app)  # its wake and backstop queues are declared like its queue
        reserved = self.attempt.retry_after
        if reserved is not None and reserved <= policy.PARKED_START_AFTER_S:
            # a start held for it at a known moment, soon: its copy is due then
            self._send(self._stored_copy(reserved))
            return
        # further off (a pause until resumed: a day) it is parked too, due then at the latest,
        # so that a resume or a looser rule wakes it; and its reservation is not left to hold a
        # slot for a day
        backstop = self._backstop_s(reserved)
        wake_copy = self._copy(queue=wake_queue(self.queue), headers=self.headers)
        self._send(self._stored_copy(backstop))
        self._record_and_park(wake_copy, backstop + AWAY_SLACK)

    def _record_and_park(self, wake_copy: Any, away_for: float) -> None:
        """Keep the parked record, then park the place for ``away_for`` seconds, in one round
        trip, in that order: a wake-up finds the record. A place parked without its record
        (the record's script failed) is parked again with no wake address: its backstop copy
        brings it back. Never raises: a place not parked lapses by itself."""
        semaphore, waiter, records = self.semaphore, self.waiter, parking()
        script_run = records.record_run(
            semaphore,
            waiter,
            self.run,
            wake_copy,
            away_for,
            stores_copies(self.task.app),
            policy.stands_by_ms(self.wait_options.inline_wait),
        )
        try:
            if script_run is not None:
                wake = semaphore.keys.wake_address(SENDER_LISTENER)
                recorded = semaphore._park_after(script_run, waiter, away_for, wake)
                if not isinstance(recorded, Exception):
                    records.sweep_from_here(semaphore, wake_copy.app)
                    return
                logger.warning("%s[%s] waits for its backstop copy only: %s", self.task.name, self.task_id, recorded)
            semaphore._leave(waiter, away_for, "")
        except SemaphoreError as error:
            if not outages.is_down(semaphore):
                logger.warning("could not leave the line of %r (the place lapses by itself): %s", semaphore.name, error)

    def _backstop_s(self, reserved: float | None) -> float:
        options = self.wait_options
        backstop = (
            policy.backstop(
                options.countdown,
                kept_apart=True,
                bounds_given=options.countdown_given,
                expected=expected_start_of(self.semaphore, self.attempt),
            )
            if reserved is None
            else reserved
        )
        if options.max_wait is not None:
            backstop = max(1, min(backstop, round(options.max_wait + 0.5)))
        return float(backstop)

    def _stored_copy(self, due_in: float) -> Any:
        """A copy due in ``due_in`` seconds, waiting in the broker: in the broker's Redis under
        its run (the Redis broker), or in its backstop queue, held by a worker's main process
        until due (RabbitMQ)."""
        app = self.task.app
        due = (
            {DUE_IN_HEADER: due_in, COPY_ID_HEADER: self.run}
            if stores_copies(app)
            else {DUE_HEADER: time.time() + due_in}
        )
        return self._copy(queue=backstop_queue(self.queue), headers={**self.headers, **due})

    def _copy(self, *, queue: str, headers: dict[str, Any]) -> Any:
        options = {**self.options, "task_id": self.task_id, "queue": queue, "headers": headers}
        return self.task.signature(self.args, self.kwargs, options)

    def _send(self, copy: Any) -> None:
        try:
            send_copy(self.task.app, copy)
        except Exception:
            leave(self.semaphore, self.waiter)  # no copy will come: give the place up
            raise
