"""Wake-ups for coroutines waiting on an ``AsyncFairSemaphore``: one subscription per event loop
and client, shared by every waiter of that loop.

The asyncio twin of :mod:`.wakeups`, under the same protocol: a release offers the freed slot to
the oldest present waiter and the script PUBLISHes that waiter's id on the waiter's wake address,
``{prefix}:{<name>}:wake:<listener id>``. Here the listener is one reader task per (event loop,
client): it owns one pub/sub connection, and for each message wakes the waiter it names (its
``AsyncWakeHandle``), having first queued that waiter's claim itself if the waiter sleeps (see
``AsyncWakeHandle.wait``). A waiting coroutine holds no connection and polls nothing: it awaits
its wake-up, and asks again only when told, or every ``patience / 3`` seconds anyway (the slow
safety ask that keeps its place in line and claims an offer whose message was lost).

Each listener has an id of its own (a loop is not a process: two loops of one process must not
hear each other's offers), so a killed loop's waiters are simply never heard again: their offers
lapse after the claim window and their places after ``patience``, as a killed process's do.

Only the reader task reads the connection. The first coroutine that needs a channel starts a
task that subscribes it (SUBSCRIBE only writes; the confirmation comes back through the reader,
which marks the channel ready); it and every coroutine after it wait for that mark in the order
they came, so a burst's first tries reach Redis, and the line, in the order they were made.
A wake-up told before its waiter registered is kept for ``UNCLAIMED_S``, as in :mod:`.wakeups`.
After the connection fails every waiter is woken to ask at once, and the next one to wait opens
a new subscription.

On a Redis Cluster the listener subscribes classically (its id carries ``CLUSTER_MARK``): a
PUBLISH reaches every node of a cluster, so one connection to any node hears every offer.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import redis.asyncio

from .loop_local import LoopLocal
from .storage import CLUSTER_MARK, as_text
from .wakeups import IDLE_CHANNEL_S, READ_TIMEOUT_S, UNCLAIMED_MAX, UNCLAIMED_S

logger = logging.getLogger("celery_semaphore")


# (ticket, order of sleeping, the handle, its claim): an entry of AsyncWakeUps._sleepers
_Sleeper = tuple[int, int, "AsyncWakeHandle", Callable[[], None]]
# a channel's heap of sleepers is compacted past this many entries (and twice the live handles)
COMPACT_ABOVE = 256


class _Channel:
    __slots__ = ("failed", "idle_since", "ready", "subscribing", "users")

    def __init__(self) -> None:
        self.ready = asyncio.Event()  # the server confirmed the SUBSCRIBE, or it failed
        self.failed = False  # set with ``ready`` when the SUBSCRIBE failed
        self.users = 0
        self.idle_since = time.monotonic()
        self.subscribing: asyncio.Task[None] | None = None

    def heard(self) -> bool:
        """Offers published on the channel are heard now."""
        return self.ready.is_set() and not self.failed


class AsyncWakeHandle:
    """One waiting coroutine's registration: ``wait`` returns when a wake-up names it (or a
    failure wakes everyone), or after a timeout. Close when done (``with``).

    The flag is a bool and the sleep a bare future with a timer, not an ``asyncio.Event`` under
    ``asyncio.timeout``: a thousand coroutines of one loop each sleep here between their tries,
    and the event's waiter list, its wait coroutine, the timeout's context manager and their
    callbacks were a dozen objects more per sleeping waiter for the garbage collector to walk,
    and more loop work per hand-off."""

    __slots__ = ("_sleep", "channel", "claim", "told", "waiter", "wake_ups")

    def __init__(self, wake_ups: AsyncWakeUps, channel: str, waiter: str) -> None:
        self.wake_ups = wake_ups
        self.channel = channel
        self.waiter = waiter
        self.told = False  # a wake-up came and ``wait`` has not returned it yet
        self.claim: Callable[[], None] | None = None  # while it sleeps in ``wait``: see there
        self._sleep: asyncio.Future[None] | None = None  # while it sleeps in ``wait``

    def set(self) -> None:
        """Raise the flag; wake the waiter if it sleeps in ``wait``."""
        self.told = True
        sleep = self._sleep
        if sleep is not None and not sleep.done():
            sleep.set_result(None)

    def ready(self) -> bool:
        """Wake-ups on the channel are delivered now."""
        return self.wake_ups.ready(self.channel)

    async def subscribe(self, timeout: float) -> bool:
        """See that the channel is subscribed; wait up to ``timeout`` s for the confirmation."""
        return await self.wake_ups.subscribed(self.channel, timeout)

    async def wait(self, timeout: float, claim: Callable[[], None] | None = None, ticket: int | None = None) -> bool:
        """Wait up to ``timeout`` s for a wake-up; True if told. The flag is down again after.

        ``claim``, if given, is called by the reader as it hears the wake-up, before it wakes
        this waiter, and only while the waiter sleeps here (so never with a try of its own in
        flight): it queues the waiter's claim from the reader's turn, one event-loop turn (the
        whole ready queue) sooner than the woken waiter could. With the waiter's ``ticket``, a
        release of this loop may call it sooner still (``AsyncWakeUps.claim_next``)."""
        if not self.told:
            loop = asyncio.get_running_loop()
            sleep = self._sleep = loop.create_future()
            timer = loop.call_later(max(timeout, 0.0), _time_up, sleep)
            self.claim = claim
            if claim is not None and ticket is not None:
                self.wake_ups._sleeping(self, claim, ticket)
            try:
                await sleep
            finally:
                timer.cancel()
                self._sleep = None
                self.claim = None
        told, self.told = self.told, False
        return told

    def __enter__(self) -> AsyncWakeHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wake_ups._unregister(self)


def _claim_and_wake(handle: AsyncWakeHandle) -> None:
    """Send the claim of a sleeping waiter (if it sleeps and has not been told already) and wake
    it: it then only awaits the reply."""
    claim, handle.claim = handle.claim, None
    if claim is not None and not handle.told:
        try:
            claim()
        except Exception as error:  # the waiter asks itself once woken
            logger.debug("could not send the claim of %s: %s", handle.waiter, error)
    handle.set()


def _time_up(sleep: asyncio.Future[None]) -> None:
    if not sleep.done():
        sleep.set_result(None)


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``event`` (a channel's confirmation); True if it is set."""
    if event.is_set():
        return True
    if sys.version_info >= (3, 11):  # no task per wait, as wait_for makes
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(timeout, 0.0)):
                await event.wait()
    else:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), max(timeout, 0.0))
    return event.is_set()


def _cancel_requested() -> bool:
    """This task was asked to stop (Python >= 3.11 counts the requests; 3.10 cannot tell)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() > 0


async def _pubsub_of(client: Any) -> Any:
    """A PubSub on ``client``; on a cluster, on one of its masters (redis-py's asyncio cluster
    PubSub routes SUBSCRIBE by slot and fails before its slot map is complete): a classic PUBLISH
    reaches every node, so any one hears every offer."""
    if not isinstance(client, redis.asyncio.RedisCluster):
        return client.pubsub()
    await client.initialize()
    node = client.get_primaries()[0]
    kwargs = {key: value for key, value in node.connection_kwargs.items() if key not in ("host", "port")}
    return redis.asyncio.Redis(
        connection_pool=redis.asyncio.ConnectionPool(
            host=node.host, port=node.port, connection_class=node.connection_class, **kwargs
        )
    ).pubsub()


class AsyncWakeUps:
    """The wake-up listener of one event loop for one ``redis.asyncio`` client."""

    def __init__(self, client: Any) -> None:
        self.client = client
        cluster = isinstance(client, redis.asyncio.RedisCluster)
        self.listener_id = (CLUSTER_MARK if cluster else "") + "a" + uuid.uuid4().hex[:15]
        self._channels: dict[str, _Channel] = {}
        self._handles: dict[tuple[str, str], AsyncWakeHandle] = {}
        self._unclaimed: dict[tuple[str, str], float] = {}
        self._pubsub: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._subscribing = asyncio.Lock()
        self._first_tries: dict[str, int] = {}  # channel -> first tries in flight
        # channel -> its sleeping waiters by ticket (see claim_next); an entry is stale once its
        # waiter woke, and is dropped when it comes to the top or the heap is compacted
        self._sleepers: dict[str, list[_Sleeper]] = {}
        self.sleeps = 0  # sleeps begun with a ticket: each one's order among them

    def signal(self, channel: str, waiter: str) -> AsyncWakeHandle:
        """Register ``waiter`` of ``channel``; a wake-up that came for it in the last
        ``UNCLAIMED_S`` (between its refusal and now) raises its flag at once."""
        handle = AsyncWakeHandle(self, channel, waiter)
        key = (channel, waiter)
        self._handles[key] = handle
        entry = self._channels.get(channel)
        if entry is not None:
            entry.users += 1
        told_at = self._unclaimed.pop(key, None)
        if told_at is not None and time.monotonic() - told_at < UNCLAIMED_S:
            handle.told = True
        return handle

    def claim_next(self, channel: str) -> bool:
        """Send the claim of the first sleeping waiter of ``channel`` (the lowest ticket) and
        wake it, as the reader does when it hears its offer; True if there was one.

        A release of this loop calls it as it queues the release: the claim then leaves in the
        same batch, right behind the release, and runs in Redis just after it. Where the release
        offered its slot to that waiter (the common case, the line's head being this loop's
        oldest sleeper), the hand-off costs one round trip, not the release's and then, once the
        offer is heard, the claim's. Where it did not (the head is another process's, or asks
        itself just now), the claim is one early try that is refused, as a keep-alive is: any
        try is fair, so a wrong guess costs a try and never a place."""
        heap = self._sleepers.get(channel)
        while heap:
            _, _, handle, claim = heapq.heappop(heap)
            if handle.claim is claim and not handle.told:
                _claim_and_wake(handle)
                return True
        return False

    def _sleeping(self, handle: AsyncWakeHandle, claim: Callable[[], None], ticket: int) -> None:
        heap = self._sleepers.setdefault(handle.channel, [])
        self.sleeps += 1
        heapq.heappush(heap, (ticket, self.sleeps, handle, claim))
        if len(heap) > COMPACT_ABOVE and len(heap) > 2 * len(self._handles):
            # keep-alives put a waiter in again at every sleep: keep one live entry per waiter
            live = {id(entry[2]): entry for entry in heap if entry[2].claim is entry[3] and not entry[2].told}
            heap[:] = live.values()
            heapq.heapify(heap)

    def ready(self, channel: str) -> bool:
        """Offers published on ``channel`` from now on are heard."""
        entry = self._channels.get(channel)
        return entry is not None and entry.heard()

    @contextlib.contextmanager
    def first_try(self, channel: str) -> Iterator[bool]:
        """Around a waiter's first try: True if another first try on ``channel`` is in flight
        (a burst: the caller should subscribe before it asks)."""
        crowded = self._first_tries.get(channel, 0) > 0
        self._first_tries[channel] = self._first_tries.get(channel, 0) + 1
        try:
            yield crowded
        finally:
            left = self._first_tries[channel] - 1
            if left:
                self._first_tries[channel] = left
            else:
                del self._first_tries[channel]

    async def subscribed(self, channel: str, timeout: float) -> bool:
        """See that ``channel`` is subscribed; wait up to ``timeout`` s for the confirmation.

        Callers are woken in the order they called, the one whose call opened the subscription
        included: a burst's first tries wait here, and their asks must reach Redis in the order
        the coroutines asked (FIFO within a loop). So the entry is found or made and the wait
        begun without yielding, and the SUBSCRIBE itself runs in a task of its own."""
        entry = self._channels.get(channel)
        if entry is None:
            entry = self._channels[channel] = _Channel()
            entry.users = sum(1 for key in self._handles if key[0] == channel)
            entry.subscribing = asyncio.create_task(self._subscribe(channel, entry), name="celery-semaphore-subscribe")
        await _wait(entry.ready, timeout)
        return entry.heard()

    def _unregister(self, handle: AsyncWakeHandle) -> None:
        key = (handle.channel, handle.waiter)
        if self._handles.get(key) is handle:
            del self._handles[key]
            entry = self._channels.get(handle.channel)
            if entry is not None and entry.users > 0:
                entry.users -= 1
                if entry.users == 0:
                    entry.idle_since = time.monotonic()
                    self._sleepers.pop(handle.channel, None)  # nobody left to claim for

    async def _subscribe(self, channel: str, entry: _Channel) -> None:
        """SUBSCRIBE ``channel`` (the reader marks it ready on the confirmation); on failure,
        forget it and wake its waiters, who then ask without it (the next wait tries again)."""
        try:
            async with self._subscribing:
                if self._channels.get(channel) is not entry:
                    return  # forgotten meanwhile (the connection failed): its waiters were woken
                if self._pubsub is None:
                    self._pubsub = await _pubsub_of(self.client)
                await self._pubsub.subscribe(channel)
                if self._reader is None:
                    self._reader = asyncio.create_task(self._read(self._pubsub), name="celery-semaphore-wake-ups")
        except Exception as error:
            logger.warning("could not subscribe to %s (waiters ask without it): %s", channel, error)
            if self._channels.get(channel) is entry:
                del self._channels[channel]
            entry.failed = True
            entry.ready.set()
        finally:
            entry.subscribing = None

    async def _read(self, pubsub: Any) -> None:
        """The reader task: deliver wake-ups, drop idle channels, end when none is left."""
        try:
            while True:
                message = await pubsub.get_message(timeout=READ_TIMEOUT_S)
                if _cancel_requested():
                    # redis-py's read can swallow a cancellation that lands as a reply arrives:
                    # the reader would then outlive its loop's end by IDLE_CHANNEL_S
                    raise asyncio.CancelledError
                if message is not None:
                    self._dispatch(message)
                elif not await self._drop_idle(pubsub):
                    return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # the connection failed: waiters ask at once, and subscribe again
            if self._handles:
                logger.warning("wake-up subscription failed (waiters ask again at once): %s", error)
            self._forget(pubsub)
            for handle in self._handles.values():
                handle.set()
        finally:
            if self._pubsub is pubsub:
                self._forget(pubsub)

    def _forget(self, pubsub: Any) -> None:
        self._pubsub = None
        self._reader = None
        self._sleepers.clear()  # every waiter is woken, and sleeps again where it sleeps
        for entry in self._channels.values():
            if not entry.ready.is_set():  # a first try waiting for it asks now, unsubscribed
                entry.failed = True
                entry.ready.set()
        self._channels.clear()
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().create_task(pubsub.aclose())

    async def _drop_idle(self, pubsub: Any) -> bool:
        """Unsubscribe the channels nobody has waited on for ``IDLE_CHANNEL_S``; False (and the
        reader ends) when no channel is left."""
        now = time.monotonic()
        drop = [
            name
            for name, entry in self._channels.items()
            if entry.users == 0 and now - entry.idle_since >= IDLE_CHANNEL_S
        ]
        for name in drop:
            del self._channels[name]
        if not self._channels:
            self._forget(pubsub)
            return False
        if drop:
            await pubsub.unsubscribe(*drop)
        return True

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = as_text(message.get("type"))
        channel = as_text(message.get("channel"))
        if kind == "subscribe":
            entry = self._channels.get(channel)
            if entry is not None:
                entry.ready.set()
            return
        if kind != "message":
            return
        key = (channel, as_text(message.get("data")))
        handle = self._handles.get(key)
        if handle is not None:
            _claim_and_wake(handle)
            return
        unclaimed = self._unclaimed
        now = time.monotonic()
        unclaimed.pop(key, None)
        unclaimed[key] = now  # ordered by arrival: the oldest go first
        while unclaimed:
            oldest, told_at = next(iter(unclaimed.items()))
            if now - told_at < UNCLAIMED_S and len(unclaimed) <= UNCLAIMED_MAX:
                break
            del unclaimed[oldest]


_per_loop: LoopLocal[AsyncWakeUps] = LoopLocal(AsyncWakeUps)


def async_wake_ups_for(client: Any) -> AsyncWakeUps:
    """The wake-up listener of the running event loop for ``client``, made on first use."""
    return _per_loop.get(client)
