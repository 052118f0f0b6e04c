"""A held slot (``Lease``), and what it needs of the semaphore that granted it.

Both semaphore classes grant leases: a ``FairSemaphore`` one slot of one semaphore, a
``MultiSemaphore`` slots of several in one grant. A lease and the background renewer speak to
either through ``SlotOwner``, so neither class has to pass itself off as the other.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Generic, Protocol, TypeVar

import redis
import redis.cluster

from ..errors import LeaseLost
from . import renewer
from .replies import Holder
from .storage import RENEW_LOST


class SlotOwner(Protocol):
    """What a Lease and the renewer ask of the semaphore that granted the slot. The underscored
    methods belong to the private protocol: a user gives a slot back through its Lease."""

    name: str
    lease: float  # seconds a slot is held without a renewal
    client: redis.Redis | redis.cluster.RedisCluster

    @property
    def renewal_key(self) -> str: ...

    def renew(self, token: str) -> bool: ...

    def _release(self, token: str, run: str | None, remember_ms: int) -> bool: ...

    def _renew_many(self, holders: list[Holder], *, reclaim: bool) -> list[int]: ...


class _Owner(Protocol):
    name: str
    lease: float  # seconds a slot is held without a renewal


OwnerT = TypeVar("OwnerT", bound=_Owner)


class HeldSlot(Generic[OwnerT]):
    """What a lease knows of its slot, blocking (``Lease``) or asyncio (``AsyncLease``)."""

    __slots__ = (
        "__weakref__",
        "acquired_at",
        "label",
        "lost",
        "released",
        "remember_ms",
        "renew_due",
        "run",
        "semaphore",
        "token",
    )

    def __init__(
        self, semaphore: OwnerT, token: str, *, label: str, run: str | None = None, remember_ms: int = 0
    ) -> None:
        self.semaphore = semaphore
        self.token = token
        self.label = label
        # the run this slot was granted to, if any: its release marks the run finished
        self.run = run
        self.remember_ms = remember_ms
        self.acquired_at = time.monotonic()
        self.lost = False
        self.released = False
        # when the renewer should next extend this lease (monotonic seconds)
        self.renew_due = self.acquired_at + semaphore.lease / 3

    @property
    def name(self) -> str:
        return self.semaphore.name

    def __repr__(self) -> str:
        state = "released" if self.released else "lost" if self.lost else "held"
        return f"<{type(self).__name__} {self.semaphore.name!r} {self.token[:8]} {state}>"


class Lease(HeldSlot[SlotOwner]):
    """One held slot. Renewed in the background while held; a context manager that releases
    on exit. ``lost`` turns true when a renewal found the slot gone and could not take it back:
    from then on the holder no longer counts against the limit."""

    __slots__ = ()

    def renew(self) -> None:
        """Extend the lease now; raises LeaseLost if the slot is no longer held."""
        if self.semaphore._renew_many([(self.token, self.label, self.run or "")], reclaim=False)[0] == RENEW_LOST:
            self.lost = True
            raise LeaseLost(self.semaphore.name, self.token)
        self.renew_due = time.monotonic() + self.semaphore.lease / 3

    def release(self, *, finished: bool = True) -> bool:
        """Give the slot back. True if it was still held; False if the lease had already gone.
        Safe to call more than once. ``finished=False``: the slot goes back but the lease's run
        (if any) is not marked finished, so another copy of it may still run it (a Celery task
        whose message will be delivered again)."""
        if self.released:
            return False
        with renewer.cycle_lock():
            # Once forgotten, no renewal (which may register a missing token again) can run for
            # this token, so the release below cannot be undone by a renewal in flight.
            self.released = True
            renewer.forget(self)
        return self.semaphore._release(self.token, self.run if finished else None, self.remember_ms)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
