"""One task per event loop that keeps the loop's held leases alive.

The asyncio twin of :mod:`.renewer`: a lease is short, so that a crashed holder's slot comes back
soon, yet a coroutine may hold it far longer. The task wakes when the first lease is due (a third
of its length after its grant or last renewal) and renews, per semaphore, every lease of the loop
due within the next sixth of a lease, in one round trip whatever their number.

A task of the loop, not a thread: it dies with its loop, and a killed loop's leases then lapse in
Redis like a killed process's. It holds weak references only, so a lease dropped without release
stops being renewed and its slot comes back when the lease runs out. A renewal that finds a lease
gone registers it again if a slot is free (the holder still runs and must count); if none is free
the lease is marked lost and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from typing import TYPE_CHECKING

from ..errors import SemaphoreError
from .storage import RENEW_LOST, RENEW_REGISTERED_AGAIN

if TYPE_CHECKING:
    from .async_lease import AsyncLease

logger = logging.getLogger("celery_semaphore")

# After a failed renewal, try again this soon rather than a third of a lease.
RETRY_AFTER_ERROR = 0.5


class _LoopRenewer:
    def __init__(self) -> None:
        self.leases: weakref.WeakSet[AsyncLease] = weakref.WeakSet()
        self.task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()
        self.wakes_at = math.inf  # monotonic time the task's current sleep ends (inf: not asleep)

    def track(self, lease: AsyncLease) -> None:
        self.leases.add(lease)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run(), name="celery-semaphore-renewer")
        elif lease.renew_due < self.wakes_at:
            # Waking the task costs a loop turn and a new timed wait (a task of its own); a grant
            # is a step of every hand-off, so wake it only when this lease is due before it would
            # wake anyway (leases of one length fall due in the order they were granted).
            self.changed.set()

    async def _run(self) -> None:
        try:
            while self.leases:
                now = time.monotonic()
                due = min(lease.renew_due for lease in self.leases)
                if due > now:
                    self.changed.clear()
                    self.wakes_at = due
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), due - now)
                    continue
                self.wakes_at = -math.inf  # renewing now: a lease tracked meanwhile is looked at next
                await self._renew_due(now)
        finally:
            self.wakes_at = math.inf

    async def _renew_due(self, now: float) -> None:
        groups: dict[tuple[int, str], list[AsyncLease]] = {}
        for lease in list(self.leases):
            if not lease.released and lease.renew_due <= now + lease.semaphore.lease / 6:
                groups.setdefault((id(lease.semaphore), lease.semaphore.renewal_key), []).append(lease)
        for leases in groups.values():
            semaphore = leases[0].semaphore
            try:
                codes = await semaphore._renew_many([lease.holder for lease in leases], reclaim=True)
            except SemaphoreError as error:
                logger.warning("could not renew %d lease(s) of %r: %s", len(leases), semaphore.name, error)
                for lease in leases:
                    lease.renew_due = time.monotonic() + RETRY_AFTER_ERROR
                continue
            renewed_at = time.monotonic()
            for lease, code in zip(leases, codes, strict=True):
                if lease.released:
                    continue
                lease.renew_due = renewed_at + semaphore.lease / 3
                if code == RENEW_LOST:
                    if not lease.lost:
                        logger.error(
                            "lease of %r (%s) is lost: no slot was free to take it back", semaphore.name, lease.label
                        )
                    lease.lost = True
                elif code == RENEW_REGISTERED_AGAIN:
                    lease.lost = False
                    logger.warning(
                        "lease of %r (%s) was gone from Redis and is registered again", semaphore.name, lease.label
                    )


_renewers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopRenewer] = weakref.WeakKeyDictionary()


def track(lease: AsyncLease) -> None:
    """Renew ``lease`` from the running loop's renewal task until it is released or dropped."""
    loop = asyncio.get_running_loop()
    renewer = _renewers.get(loop)
    if renewer is None:
        renewer = _renewers[loop] = _LoopRenewer()
    renewer.track(lease)


def forget(lease: AsyncLease) -> None:
    """Renew ``lease`` no more (it is being released)."""
    for renewer in list(_renewers.values()):
        renewer.leases.discard(lease)
