"""A copy due later reaches the broker's store in one round trip, not two, and packed.

On the Redis broker a copy due later waits in the broker's store (``due_copies.py``). The
sender stores it at once, so that a wake-up or a withdraw finds the copy: published through the
app's producer to its backstop list and then stowed from there, that was two round trips to the
broker's Redis, two of the five a task placed at send paid, and each one, on a busy host, a wait
to be scheduled again.

Here the copy is published through a kombu connection of this module's own, whose channel differs
from kombu's in its last step only: where kombu's ``_put`` pushes the finished message to the list,
this one packs the message (``packing.py``) and stores it with one script (``stow_copy.lua``). The
message is built by kombu's own code; the store sends it on as the same text. A message that
cannot be packed is pushed to the list and stowed from there in one pipeline, whole: a process
killed between the two leaves it in the list, where any worker's mover stows it. Anything
unexpected (a transport whose channel does not look like kombu's Redis channel, ``internals.py``)
publishes the copy the old way.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from kombu.messaging import Producer
from kombu.utils.json import dumps

from .._core import fork_locks
from .internals import STOWING_CHANNEL_METHODS
from .packing import pack
from .wake_queues import BACKSTOP_QUEUE_SUFFIX, origin_of_derived, wake_queue

logger = logging.getLogger("celery_semaphore")

# Most idle connections a process keeps per app for these copies (more publish at once: closed after).
MOST_IDLE = 8


class StowingUnavailable(Exception):
    """This kombu's transport cannot stow as it publishes: publish and stow apart."""


class _Publisher:
    """A connection and producer for one app's copies, used by one thread at a time."""

    def __init__(self, app: Any, store: Any) -> None:
        self.connection = app.connection_for_write()
        base = self.connection.get_transport_cls()
        missing = [name for name in STOWING_CHANNEL_METHODS if not callable(getattr(base.Channel, name, None))]
        if missing:  # not kombu's Redis channel as this module knows it: published and stowed apart
            raise StowingUnavailable(f"{base.Channel.__name__} has no {', '.join(missing)}")
        channel_class = _stowing_channel(base.Channel, store)
        transport = type(f"Stowing{base.__name__}", (base,), {"Channel": channel_class})
        self.connection = self.connection.clone(transport=transport)
        self.producer: Any = Producer(self.connection)  # type: ignore[no-untyped-call]


def _stowing_channel(base: type[Any], store: Any) -> type[Any]:
    """kombu's Redis channel class ``base`` with a ``_put`` that stores what it would push to a
    backstop list, in one round trip."""

    def _put(self: Any, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        if not queue.endswith(BACKSTOP_QUEUE_SUFFIX) or kwargs.get("_publish_batch") is not None:
            base._put(self, queue, message, **kwargs)
            return
        priority = self._get_message_priority(message, reverse=False)
        origin = origin_of_derived(queue)
        target = self._q_for_pri(wake_queue(origin), priority)
        headers = message.get("headers") or {}
        run = headers.get("csem_backstop") or headers.get("semaphore_backstop") or f"?{uuid.uuid4().hex}"
        packed = pack(_routed_to(message, queue, wake_queue(origin)), copy_id=str(run))
        if packed is None:
            store.push_and_stow(self._q_for_pri(queue, priority), dumps(message), origin)  # type: ignore[no-untyped-call]
            return
        store.stow(target, str(run), _due_in(headers), packed)

    return type(f"Stowing{base.__name__}", (base,), {"_put": _put})


def _due_in(headers: dict[str, Any]) -> float:
    """The seconds a copy is due in, as its header (or an earlier release's) says; 0 if unreadable."""
    try:
        return max(0.0, float(headers.get("csem_due_in") or headers.get("semaphore_due_in") or 0))
    except (TypeError, ValueError):
        return 0.0


def _routed_to(message: dict[str, Any], queue: str, target: str) -> dict[str, Any]:
    """``message``, published to the backstop ``queue``, as kombu would have published it to
    ``target``: its routing key is what a consumer of ``target`` sees."""
    properties = message.get("properties")
    info = properties.get("delivery_info") if isinstance(properties, dict) else None
    if not isinstance(properties, dict) or not isinstance(info, dict) or info.get("routing_key") != queue:
        return message
    return {**message, "properties": {**properties, "delivery_info": {**info, "routing_key": target}}}


class _Publishers:
    """The idle publishers of each app in this process: a thread takes one (or makes one) for
    one publish and gives it back, so that a process holds as many connections as it publishes
    at once, not one per thread it ever ran (a server may run a thread per request)."""

    def __init__(self) -> None:
        self._lock = fork_locks.reset_in_child()  # guards dict and list steps only
        self._idle: dict[int, tuple[Any, int, list[_Publisher]]] = {}

    @contextmanager
    def publisher(self, app: Any, store: Any) -> Iterator[Any]:
        with self._lock:
            entry = self._idle.get(id(app))
            if entry is None or entry[0] is not app or entry[1] != os.getpid():  # a forked child's: left alone
                entry = self._idle[id(app)] = (app, os.getpid(), [])
            idle = entry[2]
            taken = idle.pop() if idle else None
        try:
            publisher = taken or _Publisher(app, store)
        except Exception as error:  # nothing was published
            raise StowingUnavailable(str(error)) from error
        try:
            yield publisher.producer
        except BaseException:
            _close(publisher)  # the next publish connects anew
            raise
        with self._lock:
            if len(idle) < MOST_IDLE:
                idle.append(publisher)
                return
        _close(publisher)


def _close(publisher: _Publisher) -> None:
    try:
        publisher.connection.release()
    except Exception as error:  # already broken: nothing to give back
        logger.debug("could not close a connection of waiting tasks' copies: %s", error)


_publishers = _Publishers()


def stowing_producer(app: Any, store: Any) -> AbstractContextManager[Any]:
    """A producer that publishes ``app``'s copies into ``store`` (a ``DueCopies``), for one
    publish: a kombu connection is not for sharing between threads, nor across a fork."""
    return _publishers.publisher(app, store)
