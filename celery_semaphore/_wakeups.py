"""Wake-ups for blocked callers: one subscription per process and client, shared by every waiter.

A release hands its slot to the oldest present waiter and PUBLISHes that waiter's id on the
waiter's *wake address*: the channel of the waiter's process for that semaphore
(``{prefix}:{<name>}:wake:<process id>``). Here, one daemon thread per (process, client) owns the
one pub/sub connection, subscribes to the channels its waiters need, and sets the
``threading.Event`` of the waiter named in each message. A sleeping waiter holds no connection at
all: it waits on its Event and borrows a pool connection only to ask.

Why the listener thread, and only it, touches the PubSub: redis-py's ``PubSub`` serialises
*sending* under a lock, but reading (``get_message``) runs outside it and may reconnect and
resubscribe on its own; a SUBSCRIBE sent from a waiter's thread while the listener is blocked
reading the same socket would race that. So a waiter that needs a new channel records it and
wakes the listener by publishing on the listener's control channel, a channel it always listens
on; the listener then subscribes itself and reports the channel ready.

A wake-up can be lost (the subscription is being set up, Redis restarted, the connection dropped):
each waiter still asks again every ``patience / 3`` seconds, which both keeps its place in line
and claims any offer whose message went astray. After the listener's connection is re-established
every waiter is woken to ask at once.

``Subscription`` is the one class that subscribes and ``notify`` in lua/_lib.lua the one place
that publishes, so that sharded pub/sub (SSUBSCRIBE/SPUBLISH) can replace both on a cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import redis

logger = logging.getLogger("celery_semaphore")

# A channel nobody waits on is unsubscribed after this long: per-key semaphores (one per host,
# say) must not pile up subscriptions, yet a busy semaphore should not churn them.
IDLE_CHANNEL_S = 60.0
# The listener blocks this long per read at most, then drops idle channels (and exits when
# it has nothing left to listen for).
READ_TIMEOUT_S = 5.0
# After the connection failed, try again this soon, backing off to RECONNECT_MAX_S.
RECONNECT_AFTER_S = 0.5
RECONNECT_MAX_S = 5.0
# A payload waiters never have (waiter ids are never empty): "check your subscriptions".
_POKE = b""


def _new_process_id() -> str:
    return uuid.uuid4().hex[:16]


_process_id = _new_process_id()


class Subscription:
    """The pub/sub connection, behind the few calls the listener needs. Only the listener thread
    calls these. (On a cluster, sharded pub/sub would go here.)"""

    def __init__(self, client: Any, on_reconnect: Callable[[], None]) -> None:
        self._pubsub = client.pubsub()
        self._on_reconnect = on_reconnect
        self._watching: Any = None

    def subscribe(self, *channels: str) -> None:
        self._pubsub.subscribe(*channels)
        if self._watching is None and getattr(self._pubsub, "connection", None) is not None:
            # redis-py resubscribes by itself after a reconnect; messages published meanwhile
            # are lost, so the listener wants to know (registered after the first connect, so
            # only reconnects call it; redis-py keeps a weak reference to this bound method)
            self._watching = self._pubsub.connection
            self._watching.register_connect_callback(self._reconnected)

    def _reconnected(self, _connection: Any) -> None:
        self._on_reconnect()

    def unsubscribe(self, *channels: str) -> None:
        self._pubsub.unsubscribe(*channels)

    def next_message(self, timeout: float) -> dict[str, Any] | None:
        message: dict[str, Any] | None = self._pubsub.get_message(timeout=timeout)
        return message

    def close(self) -> None:
        try:
            if self._watching is not None:
                self._watching.deregister_connect_callback(self._reconnected)
            self._pubsub.close()
        except Exception:  # closing a broken connection may fail too; it is gone either way
            pass


class _Channel:
    def __init__(self) -> None:
        self.users = 0
        self.ready = threading.Event()  # the listener's SUBSCRIBE was confirmed
        self.requested = False  # the listener sent SUBSCRIBE on its current connection
        self.idle_since = time.monotonic()


class Gate:
    """A counting semaphore for ``with``, built on ``queue.SimpleQueue`` (C code: a put and a get
    per use, against a dozen Python calls for ``threading.BoundedSemaphore``), since every try
    of a blocked caller passes through it."""

    __slots__ = ("_permits",)

    def __init__(self, permits: int) -> None:
        self._permits: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(permits):
            self._permits.put(None)

    def __enter__(self) -> None:
        self._permits.get()

    def __exit__(self, *exc: object) -> None:
        self._permits.put(None)


class Flag:
    """A one-bit event for one waiter, cheaper to make than ``threading.Event`` (which builds a
    Condition): a lock held while the flag is down. ``wait`` takes the flag down again."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # raised when the flag is already up
            self._lock.release()

    def clear(self) -> None:
        self._lock.acquire(blocking=False)

    def is_set(self) -> bool:
        return not self._lock.locked()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the flag; True if it was up (it is down again now)."""
        return self._lock.acquire(timeout=max(timeout, 0.0))


class WakeHandle:
    """One waiter's registration with the listener: ``callback`` runs (on the listener thread:
    keep it short) when a wake-up names the waiter. For a blocked caller the callback sets
    ``event``. Close when done: the channel is unsubscribed once nobody has used it for a while."""

    def __init__(
        self, wake_ups: WakeUps, channel: str, waiter: str, callback: Callable[[], None] | None = None,
    ) -> None:
        self.wake_ups = wake_ups
        self.channel = channel
        self.waiter = waiter
        self.event = Flag()
        self.callback = self.event.set if callback is None else callback
        # a blocked caller asks again after a reconnect (wake-ups may have been lost meanwhile);
        # a callback fires only for a real wake-up
        self.poll_on_reconnect = callback is None
        self.counted = False  # counted among the channel's users (keeps it subscribed)

    def ready(self) -> bool:
        """Wake-ups on the channel are being delivered (the subscription is confirmed)."""
        with self.wake_ups._lock:
            entry = self.wake_ups._channels.get(self.channel)
        return entry is not None and entry.ready.is_set()

    def subscribe(self, timeout: float) -> bool:
        """Have the listener subscribe to the channel (if it does not yet); wait up to
        ``timeout`` s for the server to confirm. True once wake-ups are delivered."""
        return self.wake_ups._subscribe(self).ready.wait(timeout)

    def close(self) -> None:
        self.wake_ups._unregister(self)

    def __enter__(self) -> WakeHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WakeUps:
    """The wake-up listener of one process for one Redis client."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.process_id = _process_id
        self.control = f"celery-semaphore:wake-control:{self.process_id}:{id(self):x}"
        self._lock = threading.Lock()
        self._channels: dict[str, _Channel] = {}
        self._signals: dict[tuple[str, str], WakeHandle] = {}
        self._thread: threading.Thread | None = None
        self._listening = threading.Event()  # the control channel is subscribed: pokes arrive
        pool = getattr(client, "connection_pool", None)
        most = getattr(pool, "max_connections", 100)
        # Waiters' asks take at most half the pool, so that releases, renewals and everyone
        # else using this client always find a connection, however many threads are blocked.
        self.gate = Gate(max(1, min(most, 2**16) // 2))

    # -- the waiter's side ----------------------------------------------------------------------

    def signal(self, channel: str, waiter: str) -> WakeHandle:
        """Register a blocked caller, ``waiter`` of ``channel``: a wake-up for it sets the
        returned handle's event from now on, if the channel is subscribed (``subscribe`` sees to
        that). Registering is cheap and opens nothing: an uncontended acquire never subscribes."""
        return self.on_wake(channel, waiter, None)

    def on_wake(self, channel: str, waiter: str, callback: Callable[[], None] | None) -> WakeHandle:
        """Register ``callback`` to run (on the listener thread) when a wake-up names ``waiter``
        on ``channel``; a later registration of the same waiter replaces it. Call
        ``subscribe`` on the handle to be sure the channel is listened to."""
        signal = WakeHandle(self, channel, waiter, callback)
        with self._lock:
            self._signals[(channel, waiter)] = signal
            entry = self._channels.get(channel)
            if entry is not None:
                entry.users += 1
                signal.counted = True
        return signal

    def _subscribe(self, signal: WakeHandle) -> _Channel:
        with self._lock:
            entry = self._channels.get(signal.channel)
            new = entry is None
            if entry is None:
                entry = self._channels[signal.channel] = _Channel()
            if not signal.counted:
                entry.users += 1
                signal.counted = True
            self._start()
        if new:
            self._poke()
        return entry

    def _unregister(self, signal: WakeHandle) -> None:
        with self._lock:
            key = (signal.channel, signal.waiter)
            if self._signals.get(key) is signal:
                del self._signals[key]
            entry = self._channels.get(signal.channel)
            if signal.counted and entry is not None:
                entry.users -= 1
                if entry.users <= 0:
                    entry.users = 0
                    entry.idle_since = time.monotonic()
            signal.counted = False

    def _poke(self) -> None:
        if not self._listening.is_set():
            return  # the listener is starting: it reads the channel table before its first wait
        # if this fails the listener is reconnecting and will read the table; waiters also poll
        with contextlib.suppress(redis.RedisError):
            self.client.publish(self.control, _POKE)

    # -- the listener's side --------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._listening.clear()
            self._thread = threading.Thread(target=self._run, name="celery-semaphore-wake-ups", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        subscription: Subscription | None = None
        failing = False
        pause = RECONNECT_AFTER_S
        while True:
            try:
                if subscription is None:
                    subscription = Subscription(self.client, self._wake_everyone)
                    subscription.subscribe(self.control)
                    if failing:
                        logger.warning("wake-up subscription is back")
                        failing = False
                        pause = RECONNECT_AFTER_S
                        self._wake_everyone()
                if not self._sync(subscription):
                    subscription.close()
                    return
                message = subscription.next_message(READ_TIMEOUT_S)
                if message is not None:
                    self._dispatch(message)
            except Exception as error:  # the listener must outlive any failure
                # (a closed client's pool, for one, surfaces as ValueError/OSError, not RedisError)
                if not failing:
                    logger.warning("wake-up subscription failed (waiters poll meanwhile): %s", error)
                    failing = True
                with self._lock:
                    for entry in self._channels.values():
                        entry.ready.clear()
                        entry.requested = False
                self._listening.clear()
                if subscription is not None:
                    subscription.close()
                subscription = None
                if not self._keep_going():
                    return  # nobody waits any more: no reason to keep knocking on a dead server
                time.sleep(pause)
                pause = min(pause * 2, RECONNECT_MAX_S)

    def _keep_going(self) -> bool:
        """Drop channels idle for long; False (and the thread is forgotten) when nothing is
        left to listen for."""
        now = time.monotonic()
        with self._lock:
            for name in [
                name for name, entry in self._channels.items()
                if entry.users == 0 and now - entry.idle_since > IDLE_CHANNEL_S
            ]:
                del self._channels[name]
            if not self._channels and not self._signals:
                self._thread = None
                self._listening.clear()
                return False
        return True

    def _sync(self, subscription: Subscription) -> bool:
        """Subscribe to new channels and drop idle ones; False when there is nothing left to
        listen for (the thread then ends, and starts again with the next waiter)."""
        now = time.monotonic()
        with self._lock:
            add = [name for name, entry in self._channels.items() if not entry.requested]
            for name in add:
                self._channels[name].requested = True
            drop = [
                name for name, entry in self._channels.items()
                if entry.users == 0 and now - entry.idle_since > IDLE_CHANNEL_S
            ]
            for name in drop:
                del self._channels[name]
            if not self._channels and not self._signals:
                self._thread = None
                self._listening.clear()
                return False
        if drop:
            subscription.unsubscribe(*drop)
        if add:
            # ready is set when the server confirms (a "subscribe" message), not here
            subscription.subscribe(*add)
        return True

    def _dispatch(self, message: dict[str, Any]) -> None:
        channel = _text(message.get("channel"))
        kind = _text(message.get("type"))
        if kind == "subscribe":
            if channel == self.control:
                self._listening.set()
                return
            with self._lock:
                entry = self._channels.get(channel)
            if entry is not None:
                entry.ready.set()
            return
        if kind != "message" or channel == self.control:
            return
        waiter = _text(message.get("data"))
        with self._lock:
            handle = self._signals.get((channel, waiter))
        if handle is not None:
            try:
                handle.callback()
            except Exception:  # a callback must never stop the listener
                logger.exception("wake-up callback for %r failed", waiter)

    def _wake_everyone(self) -> None:
        """Wake-ups may have been lost (new or re-established connection): everyone asks again."""
        with self._lock:
            handles = [handle for handle in self._signals.values() if handle.poll_on_reconnect]
        for handle in handles:
            handle.event.set()


_registry: weakref.WeakKeyDictionary[Any, WakeUps] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def wake_ups_for(client: Any) -> WakeUps:
    """The wake-up listener of this process for ``client``, made on first use."""
    with _registry_lock:
        wake_ups = _registry.get(client)
        if wake_ups is None:
            wake_ups = _registry[client] = WakeUps(client)
        return wake_ups


def _after_fork_in_child() -> None:
    # The parent's listener thread does not exist here, and its channels carry the parent's
    # process id: a child starts from nothing, under an id of its own.
    global _process_id, _registry, _registry_lock
    _process_id = _new_process_id()
    _registry = weakref.WeakKeyDictionary()
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
