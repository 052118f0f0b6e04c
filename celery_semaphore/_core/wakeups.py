"""Wake-ups for blocked callers: one subscription per process and client, shared by every waiter.

Which waiter in this process waits for which channel, and the listener thread that delivers
their wake-ups. Separate from :mod:`.pubsub`, which knows how to subscribe through redis-py on
each kind of deployment: this module is the registry and its rules (who is registered, when a
channel is subscribed or dropped, who is woken after a loss), and the only one the rest of the
package calls.

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

A blocked caller registers only once its first try was refused (an uncontended acquire costs one
round trip and touches nothing here), so an offer may be told before its waiter registered: the
listener keeps such a wake-up for ``UNCLAIMED_S`` in a small mailbox, and the registration takes
it from there (the waiter then asks at once).

A wake-up can be lost (the subscription is being set up, Redis restarted, the connection dropped):
each waiter still asks again every ``patience / 3`` seconds, which both keeps its place in line
and claims any offer whose message went astray. After the listener's connection is re-established
every waiter is woken to ask at once.

The classes of :mod:`.pubsub` are the one place that subscribes (and how a sharded listener holds
its connections and follows a moved slot), ``notify`` in lua/_lib.lua the one that publishes.

Sharded wake-ups. On a ``RedisCluster`` client whose masters all run Redis >= 7 the listener
SSUBSCRIBEs each wake channel on the master of its slot (inside the semaphore's hash tag: the
master of its keys) and the scripts SPUBLISH, so a wake-up travels to one shard, not over the
whole bus. Its id (``listener_id``) has ``SHARDED_MARK`` in front, so its addresses end in
``:wake:s.<id>`` and ``notify`` SPUBLISHes on exactly those: every address carries its kind. On a
single Redis, Sentinel, or a cluster with a master before 7 (or whose versions cannot be read),
it is the classic PUBLISH/SUBSCRIBE as above.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import redis
import redis.cluster

from .pubsub import ShardedSubscription, Subscription, uses_sharded_pubsub
from .storage import CLUSTER_MARK, SHARDED_MARK, TAKEN_RECORD_MARK, as_text

logger = logging.getLogger("celery_semaphore")
Call = Callable[[], None]

# A channel nobody waits on is unsubscribed after this long: per-key semaphores must not pile up
# subscriptions, yet a busy one should not churn them.
IDLE_CHANNEL_S = 60.0
READ_TIMEOUT_S = 5.0  # the longest read, then idle channels go (and the listener, once none is left)
RECONNECT_AFTER_S = 0.5  # after the connection failed, try again this soon, backing off to:
RECONNECT_MAX_S = 5.0
_POKE = b""  # a payload waiters never have (waiter ids are never empty): "check your subscriptions"
# A wake-up naming a waiter that has not registered (yet) is kept this long, at most
# UNCLAIMED_MAX of them: its waiter was refused a moment ago and is registering now (an offer
# waits CLAIM_MS, 2 s, for its claim: one kept longer could not be claimed anyway).
UNCLAIMED_S = 2.0
UNCLAIMED_MAX = 10_000


def _new_listener_id() -> str:
    return uuid.uuid4().hex[:16]


_listener_id = _new_listener_id()


class _Channel:
    def __init__(self) -> None:
        self.users = 0
        self.ready = threading.Event()  # the listener's SUBSCRIBE was confirmed
        self.requested = False  # the listener sent SUBSCRIBE on its current connection
        self.idle_since = time.monotonic()
        self.lost = False  # sharded: the server dropped it (its slot moved); waiters ask once back


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

    def __init__(self, wake_ups: WakeUps, channel: str, waiter: str, callback: Call | None = None) -> None:
        self.wake_ups, self.channel, self.waiter = wake_ups, channel, waiter
        self.event = Flag()
        self.callback = self.event.set if callback is None else callback
        self.on_taken: Call | None = None  # for "~<waiter>": its record was taken (lua/_lib.lua, notify)
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
        # sharded pub/sub on a Redis >= 7 cluster (see the module docstring); the mark in the
        # listener's id puts it in every wake address, where the scripts read it
        self.sharded = uses_sharded_pubsub(client)
        is_cluster = isinstance(client, redis.cluster.RedisCluster)
        self.listener_id = (SHARDED_MARK if self.sharded else CLUSTER_MARK if is_cluster else "") + _listener_id
        # a sharded listener is poked through a local socket pair, not a control channel
        self._poke_in: socket.socket | None = None
        self._poke_out: socket.socket | None = None
        if self.sharded:
            self._poke_out, self._poke_in = socket.socketpair()
            self._poke_out.setblocking(False)
            self._poke_in.setblocking(False)
            # Closed by a finalizer (holding the sockets, not this object; run when it is collected
            # or at exit): left to the sockets' own, a listener alive at shutdown warned of an
            # unclosed socket. close() without shutdown(): a forked child closing its copies
            # leaves the parent's listener as it was.
            weakref.finalize(self, _close_all, self._poke_out, self._poke_in)
        self.control = f"celery-semaphore:wake-control:{self.listener_id}:{id(self):x}"
        self._lock = threading.Lock()
        self._channels: dict[str, _Channel] = {}
        self._signals: dict[tuple[str, str], WakeHandle] = {}
        self._resubscribed_since_read = False  # redis-py subscribed again by itself
        # wake-ups for waiters not registered yet: (channel, waiter) -> monotonic arrival time,
        # oldest first (see UNCLAIMED_S)
        self._unclaimed: dict[tuple[str, str], float] = {}
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
        that), and one that came in the last ``UNCLAIMED_S`` before this call sets it at once.
        Registering is cheap and opens nothing."""
        return self.on_wake(channel, waiter, None)

    def on_wake(self, channel: str, waiter: str, callback: Call | None, *, on_taken: Call | None = None) -> WakeHandle:
        """Register ``callback`` to run (on the listener thread) when a wake-up names ``waiter``
        on ``channel``, and ``on_taken`` when one says another process took its record (a
        parked waiter's); a later registration of the same waiter replaces it. Call
        ``subscribe`` on the handle to be sure the channel is listened to."""
        signal = WakeHandle(self, channel, waiter, callback)
        signal.on_taken = on_taken
        key = (channel, waiter)
        with self._lock:
            self._signals[key] = signal
            entry = self._channels.get(channel)
            if entry is not None:
                entry.users += 1
                signal.counted = True
            told_at = self._unclaimed.pop(key, None) if self._unclaimed else None
        if told_at is not None and callback is None and time.monotonic() - told_at < UNCLAIMED_S:
            signal.event.set()  # told between its refusal and now: it asks at once
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
        if self._poke_in is not None:
            # a full buffer already holds a poke, the listener reads the table either way; a
            # pair closed at exit has no listener left to poke (waiters poll)
            with contextlib.suppress(OSError):
                self._poke_in.send(b"\0")
            return
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
        subscription: Subscription | ShardedSubscription | None = None
        failing = False
        pause = RECONNECT_AFTER_S
        while True:
            try:
                if subscription is None:
                    subscription = self._connect(refresh=failing)
                if not self._sync(subscription):
                    subscription.close()
                    return
                if failing:
                    # back once the channels are subscribed again (a sharded subscription
                    # connects to the masters only then): wake-ups may have been lost meanwhile
                    logger.warning("wake-up subscription is back")
                    failing = False
                    pause = RECONNECT_AFTER_S
                    self._wake_everyone()
                message = subscription.next_message(READ_TIMEOUT_S)
                if self._resubscribed_since_read and self._ends_after_resubscribing(subscription):
                    return
                if message is not None:
                    self._dispatch(message)
            except Exception as error:  # the listener must outlive any failure
                # (a closed client's pool, for one, surfaces as ValueError/OSError, not RedisError)
                if subscription is not None:
                    subscription.close()
                subscription = None
                if self._poke_out is not None and self._poke_out.fileno() < 0:
                    return  # its socket pair was closed at exit: no failure to report or retry
                # A lost subscription has to subscribe every channel again anyway, so the idle
                # ones (kept only to spare the next wait a subscribe) go now.
                with self._lock:
                    nobody_waits = self._drop_idle(0.0) is None
                    for entry in self._channels.values():
                        entry.ready.clear()
                        entry.requested = False
                if nobody_waits:
                    # Nobody was affected (the usual cause: the application closed its client,
                    # which closes the listener's connection too): no warning, and no knocking
                    # on a server or a client nobody needs; the next waiter starts a new listener.
                    logger.debug("wake-up subscription ended with nobody waiting: %s", error)
                    return
                if not failing:
                    logger.warning("wake-up subscription failed (waiters poll meanwhile): %s", error)
                    failing = True
                self._listening.clear()
                time.sleep(pause)
                pause = min(pause * 2, RECONNECT_MAX_S)

    def _connect(self, *, refresh: bool) -> Subscription | ShardedSubscription:
        """A new subscription that hears pokes. ``refresh``: after a failure (a master may have
        been replaced), read the cluster's slot map again before subscribing."""
        if self._poke_out is None:
            subscription = Subscription(self.client, self._resubscribed)
            subscription.subscribe(self.control)  # _listening is set once this is confirmed
            return subscription
        sharded = ShardedSubscription(self.client, self._resubscribed, self._poke_out, refresh=refresh)
        self._listening.set()  # pokes wait in the socket pair until the first read
        return sharded

    def _resubscribed(self) -> None:
        """redis-py subscribed again by itself: wake-ups were lost, so everyone asks again."""
        self._resubscribed_since_read = True
        self._wake_everyone()

    def _ends_after_resubscribing(self, subscription: Subscription | ShardedSubscription) -> bool:
        """The idle channels go, as after any lost subscription; with nobody waiting the listener
        ends (True). The usual cause then: the application closed its client, whose pool took
        this connection too, and redis-py 8.2 reconnects where earlier versions raised."""
        self._resubscribed_since_read = False
        with self._lock:
            drop = self._drop_idle(0.0)
        if drop is None:
            subscription.close()
            return True
        if drop:
            subscription.unsubscribe(*drop)
        return False

    def _drop_idle(self, idle_for: float) -> list[str] | None:
        """With the lock held: forget the channels nobody has used for ``idle_for`` s and return
        their names; None, and the thread is forgotten, when nothing is left to listen for."""
        now = time.monotonic()
        drop = [
            name for name, entry in self._channels.items() if entry.users == 0 and now - entry.idle_since >= idle_for
        ]
        for name in drop:
            del self._channels[name]
        if not self._channels and not self._signals:
            self._thread = None
            self._listening.clear()
            return None
        return drop

    def _sync(self, subscription: Subscription | ShardedSubscription) -> bool:
        """Subscribe to new channels and drop idle ones; False when there is nothing left to
        listen for (the thread then ends, and starts again with the next waiter)."""
        with self._lock:
            add = [name for name, entry in self._channels.items() if not entry.requested]
            for name in add:
                self._channels[name].requested = True
            drop = self._drop_idle(IDLE_CHANNEL_S)
            if drop is None:
                return False
        if drop:
            subscription.unsubscribe(*drop)
        if add:
            # ready is set when the server confirms (a "subscribe" message), not here
            subscription.subscribe(*add)
        return True

    def _dispatch(self, message: dict[str, Any]) -> None:
        channel = as_text(message.get("channel"))
        kind = as_text(message.get("type"))
        if kind in ("subscribe", "ssubscribe"):
            if channel == self.control:
                self._listening.set()
                return
            with self._lock:
                entry = self._channels.get(channel)
                lost = False
                if entry is not None:
                    lost, entry.lost = entry.lost, False
            if entry is not None:
                entry.ready.set()
            if lost:
                self._wake_everyone(channel)  # wake-ups published while it moved are lost
            return
        if kind == "lost":
            with self._lock:
                entry = self._channels.get(channel)
                if entry is not None:
                    entry.ready.clear()
                    entry.requested = False  # _sync subscribes it again, on its new master
                    entry.lost = True
            return
        if kind not in ("message", "smessage") or channel == self.control:
            return
        key = (channel, as_text(message.get("data")))
        with self._lock:
            handle = self._signals.get(key)  # a waiter whose own id begins with "~" matches whole
            taken = key[1].startswith(TAKEN_RECORD_MARK) and self._signals.get((channel, key[1][1:]))
            callback = handle.callback if handle is not None else taken.on_taken if taken else None
            if handle is None and not taken:
                self._keep_unclaimed(key)
        if callback is not None:
            try:
                callback()
            except Exception:  # a callback must never stop the listener
                logger.exception("wake-up callback for %r failed", key[1])

    def _keep_unclaimed(self, key: tuple[str, str]) -> None:
        """Keep a wake-up whose waiter has not registered (under ``_lock``); forget the ones
        older than UNCLAIMED_S, and the oldest beyond UNCLAIMED_MAX."""
        unclaimed = self._unclaimed
        now = time.monotonic()
        unclaimed.pop(key, None)  # re-inserted last: the dict stays ordered by arrival
        unclaimed[key] = now
        while unclaimed:
            oldest, told_at = next(iter(unclaimed.items()))
            if now - told_at < UNCLAIMED_S and len(unclaimed) <= UNCLAIMED_MAX:
                break
            del unclaimed[oldest]

    def _wake_everyone(self, channel: str | None = None) -> None:
        """Wake-ups may have been lost (new or re-established connection, or ``channel`` moved to
        another master): everyone (of that channel) asks again."""
        with self._lock:
            handles = [
                handle
                for handle in self._signals.values()
                if handle.poll_on_reconnect and (channel is None or handle.channel == channel)
            ]
        for handle in handles:
            handle.event.set()


def _close_all(*sockets: socket.socket) -> None:
    for sock in sockets:
        sock.close()


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
    global _listener_id, _registry, _registry_lock
    _listener_id = _new_listener_id()
    _registry = weakref.WeakKeyDictionary()
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
