"""Copies of a waiting task that are due later wait in a backstop queue, not in a worker's
prefetch window.

A waiting task leaves the worker and comes back later: woken through its wake queue when a
release hands it a slot, or, should that wake-up be lost, by its backstop copy once that is
due. Sent as a Celery countdown (an ETA message), every backstop copy is fetched at once by
some worker and held there, unacknowledged, until it is due, and it fills that worker's
prefetch window: with ``worker_eta_task_limit`` once the limit is reached, with RabbitMQ quorum
queues (whose prefetch count cannot grow) at once. A worker whose window is full of copies that
are not due fetches nothing else, the wake copies included, and the line stalls until the
backstops fall due (2 tasks every 30 s).

So a copy that is due later is sent, at once and without an ETA, to
``<queue>.semaphore-backstop`` (declared like its queue, ``wake_queues.py``), carrying when it
is due in ``csem_due``. Each worker's main process consumes those queues on a channel of
its own (so with a window of its own, ``HOLD_AT_MOST``), holds each message on a timer, and when
it is due publishes it as an ordinary task message to the wake queue of its queue (where no
backlog of fresh tasks is ahead of it, as none was ahead of a countdown message), then
acknowledges it. The
copy is in the broker the whole time: a worker that dies holding it gives it back
unacknowledged (RabbitMQ at once, the Redis broker after its visibility timeout), and another
worker holds it; one that dies between the publish and the acknowledgement leaves two copies of
one wait, of which the run records let one run (``task.py``).

A message in a RabbitMQ queue cannot be withdrawn, so the copy of a wait whose run finished
meanwhile (the wake-up ran the task) is still held there when it falls due. Sent on, it would be
delivered only to be dropped by its run record: a second delivery for each task that waited
longer than its backstop. So when it falls due the holder reads the run record in the
semaphore's Redis first (one round trip), and acknowledges and drops the copy of a finished run
(released normally, or, without ``acks_late``, counted finished from its grant: Celery runs it
at most once), as its delivery would have dropped it. A run still running (an ``acks_late``
task: a copy looking again after its twin's lease) is sent on, since that copy takes the run
over should the twin be dead; so is a copy whose record cannot be read.
"""

from __future__ import annotations

import logging
import math
import time
import types
from typing import Any

from celery import bootsteps
from kombu.messaging import Consumer

from .._core.explain import run_finished
from .._core.multi import home_of
from .catalogue import semaphore_for_call
from .config import config_for
from .due_copies import Mover, due_copies_for
from .wait_headers import DUE_HEADER, HANDED_BACK_HEADER, QUEUE_HEADER, WaitHistory, header_in, renamed
from .wake_queues import (
    backstop_queue,
    backstop_queue_for,
    declarable,
    is_derived_queue,
    origin_declaration,
    wake_aware,
    wake_queue_for,
)

logger = logging.getLogger("celery_semaphore")

# Most copies one worker holds at once; the rest wait in the broker, and come in as held ones
# fall due (they are sent in roughly the order they fall due).
HOLD_AT_MOST = 1000
# A copy that could not be published when due is tried again this much later (still held).
REPUBLISH_PAUSE_S = 1.0
# Headers a copy does not carry on to its queue: when it was due, and what a broker added to the
# held message (a redelivery flag would make the task take itself for a redelivered first message).
_DROPPED_HEADERS = frozenset({DUE_HEADER, "redelivered", "x-delivery-count"})


def due_in(headers: dict[str, Any] | None, now: float) -> float:
    """Seconds until a held copy is due (0 when due, or when its header is missing or wrong)."""
    try:
        due = float(header_in(headers, DUE_HEADER))
    except (TypeError, ValueError):
        return 0.0
    return max(0.0, due - now) if math.isfinite(due) else 0.0


class BackstopHolder:
    """Holds one worker's share of the backstop copies, each until it is due."""

    def __init__(self, consumer: Any) -> None:
        self.app = consumer.app
        # RabbitMQ closes the channel of a consumer that holds a message unacknowledged past its
        # consumer timeout (and the worker exits): a copy due later than half of it is handed
        # back to its backstop queue before, and held again by whoever takes it
        self.hold_at_most_s = config_for(self.app).broker_consumer_timeout / 2
        self.timer = consumer.timer
        self.connection = consumer.connection
        self.channel = consumer.connection.channel()
        self.consumer: Any = Consumer(  # type: ignore[no-untyped-call]
            self.channel,
            queues=[],
            on_message=self._on_message,
            no_ack=False,
            prefetch_count=HOLD_AT_MOST,
        )
        self.origins: dict[str, str] = {}  # backstop queue name -> the queue it serves
        self.targets: dict[str, Any] = {}  # the queue served -> where its copies go when due
        self.backstop_queues: dict[str, Any] = {}  # the queue served -> its backstop queue
        self.timers: dict[int, Any] = {}  # id of a held message -> its timer entry
        self.closed = False

    def follow(self, origin: str) -> None:
        """Hold the backstop copies of the queue ``origin`` too."""
        if is_derived_queue(origin) or backstop_queue(origin) in self.origins or self.closed:
            return
        queue = backstop_queue_for(self.app, origin)
        if not declarable(self.connection, queue):
            return
        self.origins[queue.name] = origin
        self.backstop_queues[origin] = queue
        # a copy that is due goes to the wake queue, so that it does not queue up again behind
        # a backlog of fresh tasks (a countdown message did not); to the queue itself if its
        # wake queue cannot be declared here
        wake = wake_queue_for(self.app, origin)
        self.targets[origin] = (
            wake if declarable(self.connection, wake) else origin_declaration(wake_aware(self.app), origin)
        )
        self.consumer.add_queue(queue)
        self.consumer.consume()

    def close(self) -> None:
        """Stop holding. Nothing is published after this, and nothing is acknowledged: the held
        copies go back to the broker when the worker's connection closes (or is gone), as its
        countdown messages do. The consumer is not cancelled: on the Redis broker a message that
        a poll in flight brings in for a cancelled consumer is "undeliverable", and a worker on
        its way out (a cold shutdown) can lose it. It takes no more instead: its window is cut
        to the copies it holds (at least one), and a copy that comes in after this is held too."""
        self.closed = True
        held = len(self.timers)
        for entry in self.timers.values():
            entry.cancel()
        self.timers.clear()
        try:
            self.consumer.qos(prefetch_count=max(1, held))
        except Exception as error:  # the connection is gone already: so are the held copies
            logger.debug("could not narrow the backstop consumer's window: %s", error)

    def _on_message(self, message: Any) -> None:
        if self.closed:  # held unacknowledged until the connection closes (see close)
            return
        delay = due_in(message.headers, time.time())
        if delay > self.hold_at_most_s:
            self.timers[id(message)] = self.timer.call_after(self.hold_at_most_s, self._publish, (message, True))
        else:
            self.timers[id(message)] = self.timer.call_after(delay, self._publish, (message,))

    def _publish(self, message: Any, hand_back: bool = False) -> None:
        """Send a held copy on to its wake queue, now that it is due; or, ``hand_back``, to its
        backstop queue again (due as it was), since it would be held past the consumer timeout."""
        self.timers.pop(id(message), None)
        if self.closed:
            return
        if not hand_back and _run_finished(self.app, message):
            try:
                message.ack()
            except Exception as error:  # given back: held again, and dropped again when due
                logger.debug("could not acknowledge the backstop copy of a finished run: %s", error)
            return
        origin = self._origin_of(message)
        headers = {
            name: value
            for name, value in renamed(message.headers).items()
            if name not in _DROPPED_HEADERS and not name.startswith("x-")
        }
        if hand_back:
            queue = self.backstop_queues.get(origin) or backstop_queue_for(self.app, origin)
            headers[DUE_HEADER] = header_in(message.headers, DUE_HEADER)
            headers[HANDED_BACK_HEADER] = int(headers.get(HANDED_BACK_HEADER) or 0) + 1
        else:
            queue = self.targets.get(origin) or origin_declaration(wake_aware(self.app), origin)
        properties = message.properties or {}
        try:
            with self.app.producer_or_acquire() as producer:
                producer.publish(
                    message.body,
                    exchange=queue.exchange,
                    routing_key=queue.routing_key,
                    declare=[queue],
                    headers=headers,
                    content_type=message.content_type,
                    content_encoding=message.content_encoding,
                    **{
                        name: properties[name]
                        for name in ("correlation_id", "reply_to", "priority", "delivery_mode")
                        if properties.get(name) is not None
                    },
                )
        except Exception as error:  # still held (not acknowledged): try again shortly
            logger.warning(
                "could not send a waiting task's backstop copy on to %s (trying again in %.0f s): %s",
                origin,
                REPUBLISH_PAUSE_S,
                error,
            )
            if not self.closed:
                self.timers[id(message)] = self.timer.call_after(REPUBLISH_PAUSE_S, self._publish, (message, hand_back))
            return
        try:
            message.ack()
        except Exception as error:  # the broker gives it back: a second copy of a wait, run once
            logger.debug("could not acknowledge a backstop copy sent on to %s: %s", origin, error)

    def _origin_of(self, message: Any) -> str:
        routing_key = (message.delivery_info or {}).get("routing_key")
        if isinstance(routing_key, str) and routing_key in self.origins:
            return self.origins[routing_key]
        queue = header_in(message.headers, QUEUE_HEADER)
        if isinstance(queue, str) and queue:
            return queue
        # one consumer, several queues, and a transport that does not say which: the only one
        return next(iter(self.origins.values()))


def _run_finished(app: Any, message: Any) -> bool:
    """Whether the run a held backstop copy belongs to finished (``explain.run_finished``, one
    round trip to the semaphore's Redis). False where it cannot be told."""
    headers = renamed(message.headers or {})
    try:
        task = app.tasks[headers["task"]]
        args, kwargs, _ = message.decode()
        request = types.SimpleNamespace(id=headers["id"], retries=headers.get("retries") or 0, headers=headers)
        history = WaitHistory.of(request)
        if history.run_part is None:
            return False  # not a copy of a wait this version writes
        home = home_of(semaphore_for_call(task, tuple(args), dict(kwargs)))
        finished = run_finished(home.client, home.keys.runs, home.keys.run_expiry, history.run_id(request))
    except Exception as error:  # sent on: its delivery asks the run record itself
        logger.debug("could not tell whether a backstop copy's run finished: %s", error)
        return False
    if finished:
        logger.info("%s[%s]: its run finished; its backstop copy is dropped as it falls due", task.name, request.id)
    return finished


HOLDER_ATTRIBUTE = "_celery_semaphore_backstop_holder"
MOVER_ATTRIBUTE = "_celery_semaphore_due_copy_mover"
# Transports whose workers hold backstop copies: RabbitMQ, whose broker keeps a held message until
# it is acked and hands it on the moment its holder's connection goes.
_HOLDING_TRANSPORTS = frozenset({"amqp"})
_holding_by_app: dict[int, tuple[Any, bool]] = {}


def holds_backstops(app: Any) -> bool:
    """Whether waiting tasks of ``app`` send their backstop copies to backstop queues (RabbitMQ),
    or as Celery countdowns (the Redis broker and the rest).

    **Design change, argued by measurement.** On the Redis broker the backstop queue was
    measured worse: in the full chaos test (whole workers SIGKILLed, a cold shutdown) 2 of 6
    seeded runs lost a task that had waited, its copy caught in flight in the extra hop (popped
    by one more ``BRPOP``, whose message lives only in the popping process until kombu records
    it as unacked), where countdowns lost no waiting task in 13 runs. One holder taking up to
    ``HOLD_AT_MOST`` copies that a SIGKILL strands for the visibility timeout does not help
    either. See docs/design.md."""
    cached = _holding_by_app.get(id(app))
    if cached is not None and cached[0] is app:
        return cached[1]
    try:
        with app.connection_for_write() as connection:  # never connected: it only names the transport
            driver = connection.transport.driver_type
    except Exception:  # no broker to tell by: as Celery would send it
        driver = None
    holding = driver in _HOLDING_TRANSPORTS
    _holding_by_app[id(app)] = (app, holding)
    return holding


class BackstopStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Holds, in the worker's main process, the backstop copies of every queue it consumes
    (RabbitMQ), or moves them from the broker's Redis to their queues when due (the Redis
    broker, ``due_copies.py``)."""

    label = "Semaphore backstop queues"
    # after the wake queues: a queue added later gets its backstop queue from the same hook
    requires = ("celery_semaphore._celery.wake_consumer:WakeQueueStep",)

    def start(self, consumer: Any) -> None:
        if not holds_backstops(consumer.app):
            store = due_copies_for(consumer.app)
            if store is not None and getattr(consumer, MOVER_ATTRIBUTE, None) is None:
                mover = Mover(consumer.app, store)
                setattr(consumer, MOVER_ATTRIBUTE, mover)
                for queue in list(consumer.task_consumer.queues):
                    mover.follow(queue.name)
                mover.start()
            return
        holder = BackstopHolder(consumer)
        setattr(consumer, HOLDER_ATTRIBUTE, holder)
        for queue in list(consumer.task_consumer.queues):
            follow_backstops(consumer, queue.name)

    def stop(self, consumer: Any) -> None:
        # the mover keeps moving through a reconnection (its own client); it stops with the worker
        holder = getattr(consumer, HOLDER_ATTRIBUTE, None)
        if holder is not None:
            setattr(consumer, HOLDER_ATTRIBUTE, None)
            holder.close()

    def shutdown(self, consumer: Any) -> None:
        self.stop(consumer)
        mover = getattr(consumer, MOVER_ATTRIBUTE, None)
        if mover is not None:
            setattr(consumer, MOVER_ATTRIBUTE, None)
            mover.stop()


def follow_backstops(consumer: Any, origin: str) -> None:
    """Have ``consumer``'s worker hold the backstop copies of the queue ``origin`` (a queue it
    consumes, from its start or added later)."""
    mover = getattr(consumer, MOVER_ATTRIBUTE, None)
    if mover is not None:
        mover.follow(origin)
    holder = getattr(consumer, HOLDER_ATTRIBUTE, None)
    if holder is None:
        return
    try:
        holder.follow(origin)
    except Exception as error:
        logger.error(
            "not holding the backstop copies of %s: %s; waiting tasks of that queue whose wake-up is lost "
            "are not sent again until a worker that can hold them starts",
            origin,
            error,
        )
