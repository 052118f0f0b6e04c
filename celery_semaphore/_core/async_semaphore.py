"""``AsyncFairSemaphore``: the fair semaphore for coroutines, on a ``redis.asyncio`` client.

Same arguments, keys, Lua scripts and line as ``FairSemaphore``: a Celery task, a blocking
caller and a coroutine asking for the same name stand in one line, served first come, first
served together. What differs is only how a caller waits (the wait, shared with
``AsyncMultiSemaphore``, is :mod:`.async_waiting`'s):

* Its calls go through the loop's batching sender (:mod:`.async_scripts`), so a thousand
  coroutines share one command connection and a burst of asks costs one round trip.
* A refused coroutine sleeps until the loop's one wake-up reader wakes it
  (:mod:`.async_wakeups`) when a release offers it the slot, and asks again every
  ``patience / 3`` seconds anyway.
* Its lease is renewed by the loop's renewal task (:mod:`.async_renewer`).
* Cancelled while waiting (a timeout around it, a web client that hung up), it steps out of the
  line at once, and a slot already offered to it goes on to the next waiter; a try cancelled in
  flight also gives back the slot it may have been granted. A killed loop's places and slots
  lapse as a killed process's do: by ``patience`` and by ``lease``.

Offers to parked Celery tasks that a script reports unheard are not sent on from here (that is a
worker's job, :mod:`.semaphore`'s ``tell_to_wake``): they lapse after their claim window and go on.
"""

from __future__ import annotations

import logging
from typing import TypeAlias

import redis.asyncio

from ..errors import ConfigurationError
from . import async_renewer
from . import script_calls as calls
from .async_lease import AsyncGranted, AsyncLease
from .async_scripts import AsyncScripts, async_scripts_for
from .async_waiting import Acquiring, Asking, AsyncAttempt, AsyncWaiting, SentRelease, SentTry
from .async_wakeups import async_wake_ups_for
from .attempts import Ask, default_label, new_token, refusal_of
from .config import SemaphoreConfig
from .redis_errors import RedisErrors
from .replies import AcquireReply, Holder
from .rules import Rate, check_rate, check_spacing
from .status import STATUS_LISTING_LIMIT, SemaphoreStatus, status_of
from .storage import CLAIMED, EVICTED, GRANTED, LINE_FULL
from .tenants import Tenant
from .validation import check_limit, check_seconds, check_token, check_waiter, to_ms

logger = logging.getLogger("celery_semaphore")

AsyncClient: TypeAlias = "redis.asyncio.Redis | redis.asyncio.RedisCluster"


class AsyncFairSemaphore(SemaphoreConfig[AsyncClient], AsyncWaiting):
    """At most ``limit`` holders at once across every process and event loop that uses the same
    Redis, name and prefix; waiters get slots in the order they first asked, whether they are
    coroutines, blocking callers or Celery tasks.

    ``async with sem.acquire(timeout=10): ...``. The arguments are ``FairSemaphore``'s (``rate``,
    ``spacing``, ``lease``, ``patience``, ``prefix``, ``hash_tag``) and mean the same; the client
    is a ``redis.asyncio.Redis`` or ``redis.asyncio.RedisCluster``. One object may serve several
    event loops (each has its own wake-up reader, sender and renewal task)."""

    def _accept(self, client: AsyncClient) -> AsyncClient:
        if not isinstance(client, (redis.asyncio.Redis, redis.asyncio.RedisCluster)):
            raise ConfigurationError(
                "client", client, "expected a redis.asyncio.Redis or redis.asyncio.RedisCluster client"
            )
        return client

    @property
    def _scripts(self) -> AsyncScripts:
        return async_scripts_for(self.client)

    # -- acquiring -------------------------------------------------------------------------

    def acquire(
        self,
        timeout: float | None = None,
        *,
        label: str | None = None,
        tenant: Tenant | None = None,
        priority: float = 0,
    ) -> Acquiring:
        """Wait for a slot: up to ``timeout`` seconds (None: as long as it takes; 0: one try that
        never queues). Raises SemaphoreUnavailable when the time runs out, as the blocking class
        does. ``await`` it for an AsyncLease, or ``async with`` it. ``tenant`` and ``priority``
        place a waiting call as for ``FairSemaphore.acquire``."""
        return self._acquiring(timeout, label=label, tenant=tenant, priority=priority)

    def _first_ask(
        self, label: str | None = None, *, once: bool, tenant: Tenant | None = None, priority: float = 0
    ) -> Ask:
        token = new_token()
        if once:  # a try that never queues takes no place: only a cap per tenant needs its tenant
            tenant = tenant if self.per_tenant is not None else None
            return Ask(token=token, waiter=token, enqueue=False, label=label, fresh=True, tenant=tenant)
        return Ask(token=token, waiter=new_token(), label=label, fresh=True, tenant=tenant, priority=priority)

    async def try_acquire(
        self, *, waiter: str | None = None, token: str | None = None, enqueue: bool = True, label: str | None = None
    ) -> AsyncAttempt:
        """One try, one round trip: AsyncGranted with an AsyncLease, or Waiting with the place in
        line. As ``FairSemaphore.try_acquire``: the same ``waiter`` on every try keeps the place."""
        token = new_token() if token is None else token
        if waiter is None:
            return await self._try(Ask(token=token, waiter=token, enqueue=False, label=label, fresh=True), Asking())
        return await self._try(Ask(token=token, waiter=waiter, enqueue=enqueue, label=label), Asking())

    async def leave(self, waiter: str, *, away_for: float | None = None) -> bool:
        """Step out of line at once (``away_for``: keep the place that long, passed by); True if
        it was in line. A slot offered to it and not claimed goes on to the next waiter."""
        away_ms = None if away_for is None else to_ms(check_seconds("away_for", away_for))
        with RedisErrors(self.name, "leave"):
            reply = await self._scripts.run(calls.leave(self.keys, waiter=waiter, away_ms=away_ms, rules=self.rules))
        return reply.done

    def _send_try(self, ask: Ask, asking: Asking, *, urgent: bool = True) -> SentTry:
        check_token("token", ask.token)
        check_waiter("waiter", ask.waiter)
        label = default_label() if ask.label is None else ask.label
        patience_ms = self._patience_ms if ask.patience is None else to_ms(check_seconds("patience", ask.patience))
        call = calls.acquire(
            self.keys,
            token=ask.token,
            waiter=ask.waiter,
            rules=self.rules,
            lease_ms=self._lease_ms,
            patience_ms=patience_ms,
            enqueue=ask.enqueue,
            fresh=ask.fresh,
            label=label,
            ticket=ask.ticket,
            wake=ask.wake,
            line=self._line_args(ask),
        )
        future = self._scripts.submit(call, urgent=urgent)
        asking.in_flight = True

        def finish(reply: AcquireReply) -> AsyncAttempt:
            if reply.outcome in (LINE_FULL, EVICTED):
                raise self._full_line_error(reply.outcome == EVICTED)
            if reply.outcome in (GRANTED, CLAIMED):
                lease = AsyncLease(self, ask.token, label=label)
                async_renewer.track(lease)
                return AsyncGranted(lease)
            return refusal_of(reply, self.name)

        return SentTry(future, call, finish)

    # -- holding ---------------------------------------------------------------------------

    async def _release(self, token: str) -> bool:
        return await self._released(*self._send_release(token))

    def _send_release(self, token: str) -> SentRelease:
        """Queue the release now, without yielding: the future of its raw reply and its call
        (``_released`` makes the answer of them)."""
        call = calls.release(self.keys, token=token, rules=self.rules)
        future = self._scripts.submit(call)
        # the claim of this loop's first sleeper goes in the same batch (see claim_next)
        wake_ups = async_wake_ups_for(self.client)
        wake_ups.claim_next(self.keys.wake_address(wake_ups.listener_id))
        return future, call

    async def _renew_many(self, holders: list[Holder], *, reclaim: bool) -> list[int]:
        with RedisErrors(self.name, "renew"):
            reply = await self._scripts.run(
                calls.renew(self.keys, lease_ms=self._lease_ms, rules=self.rules, reclaim=reclaim, holders=holders)
            )
        return reply.codes

    # -- inspecting and steering (as FairSemaphore's) --------------------------------------

    async def status(self, *, listed: int = STATUS_LISTING_LIMIT) -> SemaphoreStatus:
        """The limit in force, the holders and the line (``FairSemaphore.status``)."""
        with RedisErrors(self.name, "status"):
            reply = await self._scripts.run(calls.status(self.keys, listed=max(0, int(listed)), rules=self.rules))
        return status_of(self.name, self.limit, reply)

    async def set_limit(self, limit: int | None, *, ttl: float | None = None) -> None:
        """Store a runtime limit for every process (None: clear it; ``FairSemaphore.set_limit``)."""
        override = None if limit is None else check_limit("limit", limit)
        ttl_ms = None if ttl is None else to_ms(check_seconds("ttl", ttl))
        with RedisErrors(self.name, "set_limit"):
            await self._scripts.run(calls.set_limit(self.keys, override=override, ttl_ms=ttl_ms, rules=self.rules))

    async def clear_limit(self) -> None:
        """Drop the runtime limit: the one given in code applies again."""
        await self.set_limit(None)

    async def set_rate(self, rate: Rate | str | tuple[int, float] | None, *, ttl: float | None = None) -> None:
        """Store a runtime rate (``"500/m"``) for every process; None clears it."""
        checked = check_rate("rate", rate)
        await self._set_gate("r", "" if checked is None else checked.arg, ttl)

    async def set_spacing(self, spacing: float | None, *, ttl: float | None = None) -> None:
        """Store a runtime spacing (seconds between two starts); None clears it."""
        checked = check_spacing("spacing", spacing)
        await self._set_gate("s", "" if checked is None else str(to_ms(checked)), ttl)

    async def pause(self, seconds: float | None = None) -> None:
        """Let nobody start, anywhere, for ``seconds`` (None: until ``resume``)."""
        await self._set_gate("p", "0" if seconds is None else str(to_ms(check_seconds("seconds", seconds))), None)

    async def resume(self) -> None:
        """End a pause now: the head of the line may start at once."""
        await self._set_gate("p", "", None)

    async def _set_gate(self, kind: str, value: str, ttl: float | None) -> None:
        ttl_ms = None if ttl is None else to_ms(check_seconds("ttl", ttl))
        with RedisErrors(self.name, "set_gate"):
            await self._scripts.run(calls.set_gate(self.keys, kind=kind, value=value, ttl_ms=ttl_ms, rules=self.rules))

    async def reset(self) -> None:
        """Forget every holder and waiter (``FairSemaphore.reset``)."""
        with RedisErrors(self.name, "reset"):
            await self._scripts.run(calls.reset(self.keys))
