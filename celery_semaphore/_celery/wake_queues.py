"""Wake queues declared like the queues they serve.

A wake copy (``parking.py``) is sent to ``<queue>.semaphore-wake``, and the workers consume that
queue next to ``<queue>``. Every process that declares it (each worker consuming it, each process
sending a wake copy to it) must declare it the same way: RabbitMQ refuses a second declaration
that differs (``PRECONDITION_FAILED - inequivalent arg 'x-queue-type'`` when one side makes it
classic and the other quorum), and Celery itself refuses to route to a name missing from
``app.amqp.queues`` under ``task_create_missing_queues=False``. Left to Celery, the two sides
took their declaration from different rules (the worker's ``add_task_queue`` defaults, the
sender's missing-queue defaults), neither of which looks at the queue being served.

So here every wake queue is derived from one source, the declaration of its origin queue in
``app.amqp.queues``: the same queue type and arguments, durability and exchange, bound under its
own name as routing key. It is derived on lookup: the app's ``Queues`` mapping resolves any
``*.semaphore-wake`` name itself, so Celery's router finds the right declaration wherever a wake
copy is sent from, by name: the process that parked the task, or any process sweeping a parked
record written by another (``parking.py``), with no Queue object in the serialized copy.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from kombu.entity import Exchange, Queue

from .._core import fork_locks

# A wake queue is the task's queue with this suffix; workers consume it next to each queue.
WAKE_QUEUE_SUFFIX = ".semaphore-wake"
# A waiting task's copy that is due later (its backstop) waits in ``<queue>.semaphore-backstop``,
# held by the workers' main processes until it is due (``backstop.py``): derived the same way.
BACKSTOP_QUEUE_SUFFIX = ".semaphore-backstop"
_DERIVED_SUFFIXES = (WAKE_QUEUE_SUFFIX, BACKSTOP_QUEUE_SUFFIX)

# Exchange types whose routing ignores the routing key: a wake queue bound to one would get a copy
# of every fresh task sent there, so it gets a direct exchange of its own instead.
_KEYLESS_EXCHANGE_TYPES = frozenset({"fanout", "headers"})

# Queue settings a wake queue takes from its origin (RabbitMQ compares them on each declaration).
# Not taken: the name, the routing key and bindings (its own), an alias (one name, one queue), and
# ``no_declare``: a wake queue nobody declares does not exist, and wake copies sent to it vanish.
_COPIED = (
    "durable",
    "exclusive",
    "auto_delete",
    "no_ack",
    "expires",
    "message_ttl",
    "max_length",
    "max_length_bytes",
    "max_priority",
)

logger = logging.getLogger("celery_semaphore")

_lock = fork_locks.reset_in_child()
_aware_classes: dict[type, type] = {}


def wake_queue(queue_name: str) -> str:
    """The wake queue of ``queue_name`` (itself, if it is one)."""
    return queue_name if queue_name.endswith(WAKE_QUEUE_SUFFIX) else queue_name + WAKE_QUEUE_SUFFIX


def origin_of_wake(name: str) -> str:
    """The queue a wake queue serves (any other name: itself)."""
    return name.removesuffix(WAKE_QUEUE_SUFFIX)


def is_wake_queue(name: str) -> bool:
    return name.endswith(WAKE_QUEUE_SUFFIX)


def is_derived_queue(name: str) -> bool:
    """A wake or backstop queue: one that serves another, never served itself."""
    return name.endswith(_DERIVED_SUFFIXES)


def backstop_queue(queue_name: str) -> str:
    return queue_name if queue_name.endswith(BACKSTOP_QUEUE_SUFFIX) else queue_name + BACKSTOP_QUEUE_SUFFIX


def origin_of_derived(name: str) -> str:
    """The queue a wake or backstop queue serves."""
    for suffix in _DERIVED_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def wake_queue_for(app: Any, origin_name: str) -> Queue:
    """The wake queue of the queue ``origin_name``, declared like it and registered in
    ``app.amqp.queues`` (so that a wake copy routed by name finds this declaration). A queue the
    app declares itself under the wake queue's name (in ``task_queues``) is left as it is."""
    queues = wake_aware(app)
    return queues[wake_queue(origin_name)]  # type: ignore[no-any-return]


def backstop_queue_for(app: Any, origin_name: str) -> Queue:
    """The backstop queue of the queue ``origin_name``, declared like it (as ``wake_queue_for``)."""
    queues = wake_aware(app)
    return queues[backstop_queue(origin_name)]  # type: ignore[no-any-return]


def wake_aware(app: Any) -> Any:
    """Make ``app.amqp.queues`` resolve wake queue names itself, and return it.

    The mapping's class is swapped for a subclass (one per class, so an app's own ``queues_cls``
    keeps its behaviour) rather than the mapping replaced: Celery's router holds the mapping it
    was made with, and must see the wake queues too. Called once the configuration is final (a
    worker's start, a pool process's start, the first park), never when a task class is bound:
    ``app.amqp.queues`` is built once, from the settings of the moment it is first read."""
    queues = app.amqp.queues
    cls = type(queues)
    if not issubclass(cls, _WakeQueues):
        with _lock:
            aware = _aware_classes.get(cls)
            if aware is None:
                aware = _aware_classes[cls] = type(f"WakeAware{cls.__name__}", (_WakeQueues, cls), {})
            if not isinstance(queues, _WakeQueues):
                queues.__class__ = aware
    return queues


class _WakeQueues:
    """Mixed into the class of ``app.amqp.queues``: an unknown wake (or backstop) queue name is a declaration
    derived from its origin's, added to the mapping, whatever ``task_create_missing_queues`` says
    (Celery's own answer would be a missing-queue default or a KeyError)."""

    __slots__ = ()

    def __missing__(self, name: str) -> Any:
        if not is_derived_queue(name):
            return super().__missing__(name)  # type: ignore[misc]
        origin = origin_declaration(self, origin_of_derived(name))
        return self.add(declared_like(origin, name))  # type: ignore[attr-defined]


def origin_declaration(queues: Any, name: str) -> Queue:
    """The origin queue as this process declares it; one it does not know (a queue only another
    process declared: added by ``add_consumer`` in a worker's main process, or made on the fly by
    a sender) as Celery makes a queue it does not know, which is how that process made it too."""
    if name in queues:  # ``in``: a lookup would add the origin to the mapping
        return queues[name]  # type: ignore[no-any-return]
    new_missing = getattr(queues, "new_missing", None)
    if new_missing is not None:
        return new_missing(name)  # type: ignore[no-any-return]
    return Queue(name, Exchange(name), name)  # type: ignore[no-untyped-call]


def declared_like(origin: Queue, name: str) -> Queue:
    """A queue called ``name`` declared like ``origin``: same queue type and arguments (so
    ``x-queue-type``), durability and exchange, bound under ``name`` as routing key so that a
    message for it reaches it alone (on an exchange that routes by key)."""
    exchange = origin.exchange
    if exchange is None or exchange.type in _KEYLESS_EXCHANGE_TYPES:
        exchange = Exchange(name, "direct", durable=origin.durable)  # type: ignore[no-untyped-call]
    settings = {attribute: getattr(origin, attribute, None) for attribute in _COPIED}
    for attribute in ("queue_arguments", "consumer_arguments"):  # copies: Celery may add to them
        arguments = getattr(origin, attribute, None)
        settings[attribute] = dict(arguments) if arguments else None
    return Queue(  # type: ignore[no-untyped-call]
        name,
        exchange,
        name,
        **{attribute: value for attribute, value in settings.items() if value is not None},
    )


def declarable(connection: Any, queue: Queue) -> bool:
    """Declare ``queue`` on a channel of its own first: a wake or backstop queue that exists
    declared otherwise (a classic one made by an earlier version, now that its queue is a quorum
    queue) makes RabbitMQ close the channel that declares it, and on the consumer's channel that
    would stop the worker. Without it the worker runs, and its parked tasks come back later."""
    try:
        channel = connection.channel()
    except Exception:  # no connection to try on: the consumer's own declaration will tell
        return True
    try:
        queue(channel).declare()  # type: ignore[no-untyped-call]
    except connection.channel_errors as error:
        logger.error(
            "not consuming %s: it exists declared otherwise than its queue (%s); delete it once no task waits, and "
            "restart: until then waiting tasks of that queue come back later than they could",
            queue.name,
            error,
        )
        return False
    finally:
        with contextlib.suppress(Exception):
            channel.close()
    return True
