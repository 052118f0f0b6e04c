"""A copy due later reaches the broker's store in one round trip, not two.

On the Redis broker a copy due later is published, as kombu writes it, to its backstop list, and
``move_due_copies.lua`` stows it from there into the store (``due_copies.py``). The sender stows
at once, so that a wake-up or a withdraw finds the copy: published through the app's producer and
then stowed, that was two round trips to the broker's Redis, two of the five a task placed at send
paid, and each one, on a busy host, a wait to be scheduled again.

Here the copy is published through a kombu connection of this module's own, whose channel differs
from kombu's in its last step only: where kombu's ``_put`` pushes the finished message to the list,
this one sends the same push and the stowing script in one pipeline. The message is built by
kombu's own code and is kombu's to the byte; a process killed between the two leaves it in the
list, where any worker's mover stows it, as before. Anything unexpected (a transport whose channel
does not look like kombu's Redis channel, ``internals.py``) publishes the copy the old way.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from kombu.messaging import Producer
from kombu.utils.json import dumps

from .internals import STOWING_CHANNEL_METHODS
from .wake_queues import BACKSTOP_QUEUE_SUFFIX, origin_of_derived

logger = logging.getLogger("celery_semaphore")


class _Publisher:
    """One thread's connection and producer for one app's copies, in the process that made them."""

    def __init__(self, app: Any, store: Any) -> None:
        self.pid = os.getpid()
        self.connection = app.connection_for_write()
        base = self.connection.get_transport_cls()
        missing = [name for name in STOWING_CHANNEL_METHODS if not callable(getattr(base.Channel, name, None))]
        if missing:  # not kombu's Redis channel as this module knows it: published and stowed apart
            raise TypeError(f"{base.Channel.__name__} has no {', '.join(missing)}")
        channel_class = _stowing_channel(base.Channel, store)
        transport = type(f"Stowing{base.__name__}", (base,), {"Channel": channel_class})
        self.connection = self.connection.clone(transport=transport)
        self.producer: Any = Producer(self.connection)  # type: ignore[no-untyped-call]


def _stowing_channel(base: type[Any], store: Any) -> type[Any]:
    """kombu's Redis channel class ``base`` with a ``_put`` that stows what it pushes to a
    backstop list in the same round trip."""

    def _put(self: Any, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        if not queue.endswith(BACKSTOP_QUEUE_SUFFIX) or kwargs.get("_publish_batch") is not None:
            base._put(self, queue, message, **kwargs)
            return
        priority = self._get_message_priority(message, reverse=False)
        payload = dumps(message)  # type: ignore[no-untyped-call]
        store.push_and_stow(self._q_for_pri(queue, priority), payload, origin_of_derived(queue))

    return type(f"Stowing{base.__name__}", (base,), {"_put": _put})


_local = threading.local()


def stowing_producer(app: Any, store: Any) -> Any:
    """The producer of this thread that publishes ``app``'s copies into ``store`` (a
    ``DueCopies``); a kombu connection is not for sharing between threads, nor across a fork."""
    publishers: dict[int, tuple[Any, _Publisher]] = getattr(_local, "publishers", None) or {}
    _local.publishers = publishers
    entry = publishers.get(id(app))
    if entry is None or entry[0] is not app or entry[1].pid != os.getpid():
        entry = publishers[id(app)] = (app, _Publisher(app, store))  # a forked child's: never used, not closed
    return entry[1].producer


def forget_producer(app: Any) -> None:
    """Drop this thread's producer of ``app`` (after a failed publish: the next one connects anew)."""
    publishers: dict[int, tuple[Any, _Publisher]] = getattr(_local, "publishers", None) or {}
    entry = publishers.pop(id(app), None)
    if entry is not None and entry[1].pid == os.getpid():
        try:
            entry[1].connection.release()
        except Exception as error:  # already broken: nothing to give back
            logger.debug("could not close a connection of waiting tasks' copies: %s", error)
