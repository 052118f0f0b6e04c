"""``AsyncMultiSemaphore``: slots of several semaphores, or several slots of one, all or nothing,
for coroutines on a ``redis.asyncio`` client.

The asyncio form of ``MultiSemaphore``: the same members' keys, the same scripts
(acquire_many, release_many, renew_many, leave_many, built by :mod:`.script_calls_many`), the
same waiter ids and tokens (:mod:`.multi_config`), so a blocking ``MultiSemaphore``, a Celery
task with a key list or a weight, and a coroutine on the same keys stand in the same lines, served
first come, first served together. It waits as ``AsyncFairSemaphore`` does (:mod:`.async_waiting`):
through the loop's sender, on the loop's wake-up reader at its home member's wake address, with
its lease renewed by the loop's renewal task (renew_many); cancelled, it leaves every line at once
(leave_many), and a slot offered to it goes on.
"""

from __future__ import annotations

from . import async_renewer
from .async_lease import AsyncGranted, AsyncLease
from .async_scripts import AsyncScripts, async_scripts_for
from .async_semaphore import AsyncFairSemaphore
from .async_waiting import Acquiring, Asking, AsyncAttempt, AsyncWaiting, SentRelease, SentTry
from .attempts import Ask
from .multi_config import MultiConfig
from .redis_errors import RedisErrors
from .replies import Holder, ManyReply
from .storage import GRANTED


class AsyncMultiSemaphore(MultiConfig[AsyncFairSemaphore], AsyncWaiting):
    """Hold ``weight`` slots of each of ``semaphores`` at once, or wait holding none.

    ``async with AsyncMultiSemaphore([per_host, total]).acquire(timeout=10): ...``;
    ``acquire(weight=3)`` takes three slots of each. The members are ``AsyncFairSemaphore``s on
    one shared client. The lease is the shortest of theirs, the patience the longest."""

    member = AsyncFairSemaphore

    @property
    def _scripts(self) -> AsyncScripts:
        return async_scripts_for(self.client)

    # -- acquiring -------------------------------------------------------------------------

    def acquire(
        self, timeout: float | None = None, *, weight: int | None = None, label: str | None = None
    ) -> Acquiring:
        """Wait for ``weight`` (default: this object's) slots of every semaphore: up to
        ``timeout`` seconds (None: as long as it takes; 0: one try that never queues). Raises
        SemaphoreUnavailable when time runs out, ConfigurationError when the weight is above a
        limit in force. ``await`` it for an AsyncLease that holds them all, or ``async with`` it."""
        if weight is not None and weight != self.weight:
            return type(self)(self.semaphores, weight=weight).acquire(timeout, label=label)
        return super().acquire(timeout, label=label)

    def _first_ask(self, label: str | None = None, *, once: bool) -> Ask:
        return Ask(token=self.token_for(), waiter=self.waiter_id(), enqueue=not once, label=label, fresh=True)

    async def try_acquire(
        self, *, waiter: str | None = None, token: str | None = None, enqueue: bool = True, label: str | None = None
    ) -> AsyncAttempt:
        """One try, one round trip: AsyncGranted, or Waiting (``turn`` is ``position``: the most
        waiters ahead in any line), as ``MultiSemaphore.try_acquire``: the same ``waiter`` on
        every try keeps the places in line."""
        token = self.token_for(token)
        if waiter is None:
            return await self._try(Ask(token=token, waiter=self.waiter_id(), enqueue=False, label=label), Asking())
        return await self._try(Ask(token=token, waiter=waiter, enqueue=enqueue, label=label), Asking())

    async def leave(self, waiter: str, *, away_for: float | None = None) -> bool:
        """Step out of every line at once; True if it was in one. A slot offered to it and not
        claimed goes on to the next waiter."""
        with RedisErrors(self.name, "leave"):
            reply = await self._scripts.run(self._leave_call(waiter, away_for, ""))
        return reply.done

    def _send_try(self, ask: Ask, asking: Asking, *, urgent: bool = True) -> SentTry:
        many = self._acquire_call(ask)
        future = self._scripts.submit(many.call, urgent=urgent)
        asking.in_flight = True

        def finish(reply: ManyReply) -> AsyncAttempt:
            if reply.outcome == GRANTED:
                lease = AsyncLease(self, many.token, label=many.label)
                async_renewer.track(lease)
                return AsyncGranted(lease)
            return self.refusal(reply)

        return SentTry(future, many.call, finish)

    # -- holding ---------------------------------------------------------------------------

    async def _release(self, token: str) -> bool:
        return await self._released(*self._send_release(token))

    def _send_release(self, token: str) -> SentRelease:
        """Queue the release now, without yielding: the future of its raw reply and its call."""
        call = self._release_call(token, None, 0)
        return self._scripts.submit(call), call

    async def _renew_many(self, holders: list[Holder], *, reclaim: bool) -> list[int]:
        with RedisErrors(self.name, "renew"):
            reply = await self._scripts.run(self._renew_call(holders, reclaim=reclaim))
        return reply.codes


__all__ = ["AsyncMultiSemaphore"]
