"""How a coroutine waits for its turn, whichever asyncio semaphore it asks (``AsyncWaiting``):
one slot of one key (``AsyncFairSemaphore``) or slots of several, all or nothing
(``AsyncMultiSemaphore``).

The wait is the same for both, and so is what a cancelled waiter undoes; only the try differs
(acquire or acquire_many, one line or several). So the wait lives here once and asks its
semaphore for what differs: its first ``Ask``, one ``_try``, a ``leave`` of every line it
stands in, and a ``_release`` of every slot a grant holds.

* Its calls go through the loop's batching sender (:mod:`.async_scripts`).
* A refused coroutine sleeps until the loop's one wake-up reader wakes it
  (:mod:`.async_wakeups`) when a release offers it the slot, on its semaphore's wake address (a
  key list's: its home member's), and asks again every ``patience / 3`` seconds anyway.
* The reader that hears the offer also queues the sleeping waiter's claim itself, in the same
  event-loop turn (``_send_try``), before it wakes the waiter: the waiter then only awaits the
  reply. Each turn a hand-off waits for costs the loop's whole ready queue (a thousand
  coroutines'), so the claim leaves one turn earlier, often in the batch the sender sends right
  after the release's reply.
* Cancelled while waiting, it steps out of every line at once, and a slot already offered to it
  goes on to the next waiter; a try cancelled in flight also gives back what it may have been
  granted. A killed loop's places and slots lapse as a killed process's do.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import replace
from types import TracebackType
from typing import Any

from ..errors import SemaphoreError, SemaphoreUnavailable
from .async_lease import AsyncGranted, AsyncLease
from .async_wakeups import async_wake_ups_for
from .attempts import Ask, Duplicate, Waiting, limit_of
from .redis_errors import RedisErrors
from .replies import HandOffReply, Holder
from .script_calls import ScriptCall
from .scripts import SemaphoreKeys
from .storage import RENEW_LOST
from .validation import check_seconds
from .waiting import next_wait

logger = logging.getLogger("celery_semaphore")

AsyncAttempt = AsyncGranted | Waiting | Duplicate
# A release queued on the loop's sender (``_send_release``): the future of its raw reply, its call
SentRelease = tuple["asyncio.Future[Any]", ScriptCall[HandOffReply]]


class SentTry:
    """One try queued on the loop's sender (``_send_try``) and not yet answered: the future of
    its raw reply, the call that parses it, and what makes the attempt of the parsed reply."""

    __slots__ = ("call", "finish", "future")

    def __init__(
        self, future: asyncio.Future[Any], call: ScriptCall[Any], finish: Callable[[Any], AsyncAttempt]
    ) -> None:
        self.future = future
        self.call = call
        self.finish = finish


class _Claim:
    """A refused waiter's next try, and the claim the wake-up reader sends for it as it hears the
    waiter's offer while the waiter sleeps (``AsyncWakeHandle.wait`` calls it): one small object
    per waiter, where a closure over the wait's locals took a function and a cell per local, for
    every one of a loop's thousand waiters."""

    __slots__ = ("ask", "asking", "semaphore", "sent", "ticket")

    def __init__(self, semaphore: AsyncWaiting, ask: Ask, asking: Asking) -> None:
        self.semaphore = semaphore
        self.ask = ask
        self.asking = asking
        self.ticket = ask.ticket  # the waiter's place in line, once a refusal gave it one
        self.sent: SentTry | None = None  # the claim the reader sent, until the waiter takes it

    def again(self) -> Ask:
        """The ask of the next try: the same waiter, at its place in line."""
        return replace(self.ask, ticket=self.ticket, fresh=False)

    def __call__(self) -> None:
        """Called by the wake-up reader as it hears this waiter's offer, while it sleeps."""
        self.sent = self.semaphore._send_try(self.again(), self.asking)


class Asking:
    """Whether a wait has a try in flight: a try cancelled in flight may have been granted."""

    __slots__ = ("in_flight",)

    def __init__(self) -> None:
        self.in_flight = False


class Acquiring:
    """What ``acquire`` returns: ``await`` it for the lease, or ``async with`` it to hold the
    slots for the block (they go back however the block ends)."""

    __slots__ = ("_ask", "_lease", "_semaphore", "_timeout")

    def __init__(self, semaphore: AsyncWaiting, timeout: float | None, ask: Ask) -> None:
        self._semaphore = semaphore
        self._timeout = timeout
        self._ask = ask
        self._lease: AsyncLease | None = None

    def __await__(self) -> Generator[Any, None, AsyncLease]:
        return self._semaphore._acquire(self._timeout, self._ask).__await__()

    async def __aenter__(self) -> AsyncLease:
        self._lease = await self
        return self._lease

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._lease is not None:
            await self._lease.release()


class AsyncWaiting:
    """The acquire, wait, give-up, release and renew of an asyncio semaphore; a subclass says
    how to ask (``_first_ask``, ``_try``), leave (``leave``), release and renew (``_release``,
    ``_renew_many``)."""

    name: str
    limit: int
    patience: float
    client: Any
    keys: SemaphoreKeys  # the keys whose wake address the wait listens on

    def _first_ask(self, label: str | None = None, *, once: bool) -> Ask:
        """The first try of an acquire (``once``: a one-shot try that never queues)."""
        raise NotImplementedError

    def _send_try(self, ask: Ask, asking: Asking, *, urgent: bool = True) -> SentTry:
        """Queue one try of ``ask`` on the loop's sender now, without yielding (the wake-up
        reader calls it from its own turn), and mark ``asking`` in flight."""
        raise NotImplementedError

    async def _try(self, ask: Ask, asking: Asking, *, urgent: bool = True) -> AsyncAttempt:
        """One try: queued, then answered."""
        return await self._tried(self._send_try(ask, asking, urgent=urgent), asking)

    async def _tried(self, sent: SentTry, asking: Asking) -> AsyncAttempt:
        """The attempt of a try already queued (cancelled, the call is dropped if not yet sent)."""
        with RedisErrors(self.name, "acquire"):
            reply = sent.call.parse(await sent.future)
        asking.in_flight = False
        return sent.finish(reply)

    async def leave(self, waiter: str, *, away_for: float | None = None) -> bool:
        raise NotImplementedError

    async def _release(self, token: str) -> bool:
        raise NotImplementedError

    async def _released(self, future: Awaitable[Any], call: ScriptCall[HandOffReply]) -> bool:
        """Whether a release already queued (``_send_release``) found its slot held (``future``:
        its reply's, or a shield of it)."""
        with RedisErrors(self.name, "release"):
            return call.parse(await future).done

    async def _renew_many(self, holders: list[Holder], *, reclaim: bool) -> list[int]:
        raise NotImplementedError

    # -- acquiring -------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None, *, label: str | None = None) -> Acquiring:
        """Wait for a slot: up to ``timeout`` seconds (None: as long as it takes; 0: one try that
        never queues). Raises SemaphoreUnavailable when the time runs out, as the blocking class
        does. ``await`` it for an AsyncLease, or ``async with`` it."""
        return self._acquiring(timeout, label=label)

    def _acquiring(self, timeout: float | None, **first: Any) -> Acquiring:
        """``acquire`` with its first ask made of ``first`` (``_first_ask``'s keywords)."""
        if timeout is not None:
            timeout = check_seconds("timeout", timeout, allow_zero=True)
        return Acquiring(self, timeout, self._first_ask(once=timeout == 0, **first))

    async def _acquire(self, timeout: float | None, ask: Ask) -> AsyncLease:
        started = time.monotonic()
        asking = Asking()
        try:
            attempt = await (self._try(ask, asking) if timeout == 0 else self._wait(ask, timeout, asking))
        except BaseException:
            await self._give_up(ask, release=asking.in_flight)
            raise
        if isinstance(attempt, AsyncGranted):
            return attempt.lease
        if timeout != 0:
            await self._give_up(ask, release=False)
        raise SemaphoreUnavailable(self.name, limit_of(attempt, self.limit), time.monotonic() - started)

    async def _give_up(self, ask: Ask, *, release: bool) -> None:
        """Leave the lines (and, for a try cancelled in flight, give back what it may have got)
        now, even if the caller is cancelled again meanwhile; never raises but the cancellation:
        a place not given up lapses by itself after ``patience``, a slot after ``lease``."""

        async def undo() -> None:
            try:
                if ask.enqueue:
                    await self.leave(ask.waiter)
                if release:
                    await self._release(ask.token)
            except SemaphoreError as error:
                logger.warning("could not leave the line of %r (the place lapses by itself): %s", self.name, error)

        await asyncio.shield(undo())

    async def _wait(self, ask: Ask, timeout: float | None, asking: Asking) -> AsyncAttempt:
        """Try; while refused, sleep until the loop's reader says a slot is offered (or the
        keep-alive pause passes), then try again; until granted or ``timeout`` (None: no bound).

        A lone first try subscribes to nothing: an uncontended acquire is one round trip. A first
        try made while another of this loop is in flight on the same line (a burst) waits for the
        subscription first, so that no offer can be published unheard after it, and it need not
        ask again once subscribed: a burst of a thousand costs a thousand asks, not two."""
        started = time.monotonic()
        wake_ups = async_wake_ups_for(self.client)
        ask = replace(ask, wake=self.keys.wake_address(wake_ups.listener_id))
        with wake_ups.first_try(ask.wake) as crowded:
            if crowded:
                await wake_ups.subscribed(ask.wake, self.patience / 3)
            heard_from_start = wake_ups.ready(ask.wake)
            attempt = await self._try(ask, asking)
        if not isinstance(attempt, Waiting):
            return attempt
        claim = _Claim(self, ask, asking)
        with wake_ups.signal(ask.wake, ask.waiter) as signal:
            subscribed = heard_from_start
            try:
                while True:
                    if attempt.ticket is not None:
                        claim.ticket = attempt.ticket  # if the place ever lapses, come back to it
                    # the keep-alive pause, spread so that waiters who came together ask apart
                    pause = self.patience / 3 * random.uniform(0.8, 1.0)
                    wait = next_wait(attempt, time.monotonic() - started, timeout, pause)
                    if wait is None:
                        return attempt
                    if subscribed:
                        told = await signal.wait(wait, claim, claim.ticket)
                    else:
                        # an offer published before the subscription was confirmed is lost: ask
                        # again as soon as it is
                        subscribed = told = await signal.subscribe(wait)
                    sent, claim.sent = claim.sent, None
                    if sent is not None:  # the reader has sent the claim already
                        attempt = await self._tried(sent, asking)
                    else:
                        attempt = await self._try(claim.again(), asking, urgent=told)
                    if not isinstance(attempt, Waiting):
                        return attempt
            finally:
                if claim.sent is not None:  # sent by the reader, but the waiter was cancelled meanwhile
                    claim.sent.future.cancel()

    # -- holding ---------------------------------------------------------------------------

    async def release(self, token: str) -> bool:
        """Give back what a token holds (prefer ``AsyncLease.release``, which also stops its
        renewal). True if the token held it; False if its lease had already gone."""
        return await self._release(token)

    async def renew(self, token: str) -> bool:
        """Extend one token's lease by ``lease`` seconds from now; False if it was lost."""
        return (await self._renew_many([(token, "", "")], reclaim=False))[0] != RENEW_LOST
