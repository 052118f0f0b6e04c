"""A slot held by a coroutine (``AsyncLease``), and what it needs of its semaphore.

The asyncio twin of :mod:`.lease`: released with ``await lease.release()`` or on leaving
``async with``, renewed meanwhile by the event loop's renewal task (:mod:`.async_renewer`). A
release runs to its end even when the coroutine releasing it is cancelled (a client that hung up
on a web handler cancels the handler inside its ``async with``): the slot must go back now, not
when its lease runs out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

from ..errors import LeaseLost
from . import async_renewer
from .lease import HeldSlot
from .replies import HandOffReply, Holder
from .script_calls import ScriptCall
from .storage import RENEW_LOST


class AsyncSlotOwner(Protocol):
    """What an AsyncLease and the renewal task ask of the semaphore that granted the slot."""

    name: str
    lease: float

    @property
    def renewal_key(self) -> str: ...

    async def _release(self, token: str) -> bool: ...

    def _send_release(self, token: str) -> tuple[asyncio.Future[Any], ScriptCall[HandOffReply]]: ...

    async def _released(self, future: Awaitable[Any], call: ScriptCall[HandOffReply]) -> bool: ...

    async def _renew_many(self, holders: list[Holder], *, reclaim: bool) -> list[int]: ...


class AsyncLease(HeldSlot[AsyncSlotOwner]):
    """One slot held by a coroutine. ``lost`` turns true when a renewal found the slot gone and
    could not take it back."""

    __slots__ = ()

    @property
    def holder(self) -> Holder:
        return (self.token, self.label, "")

    async def renew(self) -> None:
        """Extend the lease now; raises LeaseLost if the slot is no longer held."""
        if (await self.semaphore._renew_many([self.holder], reclaim=False))[0] == RENEW_LOST:
            self.lost = True
            raise LeaseLost(self.semaphore.name, self.token)
        self.renew_due = time.monotonic() + self.semaphore.lease / 3

    async def release(self) -> bool:
        """Give the slot back: True if it was still held, False if its lease had gone. Safe to
        repeat. Finishes even if the caller is cancelled meanwhile (the cancellation is raised
        once the slot is back)."""
        if self.released:
            return False
        self.released = True
        async_renewer.forget(self)
        # queued now, not from a task: a task's first step is a whole event-loop turn away, and
        # the next waiter's hand-off waits for this release; the shield is of the reply's future
        # itself (no task, no turn more for the reply), so a cancelled caller leaves it be
        future, call = self.semaphore._send_release(self.token)
        return await self.semaphore._released(asyncio.shield(future), call)

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.release()


@dataclass(frozen=True)
class AsyncGranted:
    """A try of an AsyncFairSemaphore that got a slot; the lease is held and renewed until released."""

    lease: AsyncLease

    @property
    def granted(self) -> bool:
        return True
