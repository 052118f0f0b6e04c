"""The per-process thread that keeps held leases alive.

A lease must be short, so that a crashed holder's slot comes back soon, yet a holder may run far
longer than its lease. So one daemon thread per process renews every lease held in that process
at about a third of its length, one round trip per semaphore whatever the number of leases.

The thread holds only weak references: a Lease dropped without release stops being renewed and
its slot comes back when the lease runs out. Threads do not survive ``fork``, so the thread starts
lazily on first use and again in a forked child (a Celery prefork child, for one); a child does not
inherit its parent's leases.

When a renewal finds a lease gone (Redis restarted empty, or a stall let it run out) it registers
the lease again if a slot is free, since the holder is still running and must count; if no slot
is free the lease is marked lost and logged: the limit may be exceeded until the holder ends.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._scripts import RENEW_LOST, RENEW_REGISTERED_AGAIN, RENEW_RENEWED
from .errors import SemaphoreError

if TYPE_CHECKING:
    from .semaphore import FairSemaphore, Lease

logger = logging.getLogger("celery_semaphore")

__all__ = ["RENEW_LOST", "RENEW_REGISTERED_AGAIN", "RENEW_RENEWED", "add_listener", "cycle_lock", "forget", "track"]

# After a failed renewal (Redis unreachable), try again this soon rather than a third of a lease.
RETRY_AFTER_ERROR = 0.5

# With nothing to renew the thread still looks again this often. Without it, a process that
# acquires and releases in a loop would wake the idle thread (a context switch, a GIL hand-over)
# on every acquire, since every new lease is due before "never"; with it, only a lease due within
# a second (a lease under 3 s) wakes it early.
IDLE_WAKE = 1.0

# Callbacks told of each lease found lost or registered again (metrics hook into this).
LeaseListener = Callable[["Lease", str], None]
_listeners: list[LeaseListener] = []


class _Renewer:
    def __init__(self) -> None:
        self.leases: dict[int, weakref.ref[Lease]] = {}
        # Held while a renewal round runs, and by Lease.release while it stops tracking: a
        # renewal can then never register again a token that is being released.
        self.cycle = threading.RLock()
        self.changed = threading.Condition(threading.Lock())
        self.thread: threading.Thread | None = None
        self.wakes_at = math.inf  # monotonic time the thread's current wait ends

    def track(self, lease: Lease) -> None:
        with self.changed:
            self.leases[id(lease)] = weakref.ref(lease)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="celery-semaphore-renewer", daemon=True)
                self.thread.start()
            elif lease.renew_due < self.wakes_at:
                # waking the thread costs a context switch per acquire; only do it when this
                # lease is due before the thread would wake anyway
                self.changed.notify()

    def forget(self, lease: Lease) -> None:
        with self.changed:
            ref = self.leases.get(id(lease))
            if ref is not None and ref() is lease:
                del self.leases[id(lease)]

    def _live(self) -> list[Lease]:
        live = [lease for ref in self.leases.values() if (lease := ref()) is not None]
        self.leases = {id(lease): weakref.ref(lease) for lease in live}
        return live

    def _run(self) -> None:
        while True:
            with self.changed:
                # deciding and starting to wait under the lock that track() takes, so a lease
                # tracked meanwhile is either seen here or wakes the wait
                leases = self._live()
                now = time.monotonic()
                due = [lease for lease in leases if lease.renew_due <= now]
                if not due:
                    self.wakes_at = min((lease.renew_due for lease in leases), default=now + IDLE_WAKE)
                    self.changed.wait(timeout=max(0.0, self.wakes_at - now))
                    self.wakes_at = math.inf
                    continue
            self.renew(due)

    def renew(self, leases: list[Lease]) -> None:
        # one round trip per semaphore: leases of equal semaphores (the Celery layer makes a
        # FairSemaphore object per task run) share it
        by_semaphore: dict[tuple[int, str, float], tuple[FairSemaphore, list[Lease]]] = {}
        for lease in leases:
            semaphore = lease.semaphore
            same = (id(semaphore.client), semaphore.renewal_key, semaphore.lease)
            by_semaphore.setdefault(same, (semaphore, []))[1].append(lease)
        for semaphore, group in by_semaphore.values():
            with self.cycle:
                group = [lease for lease in group if not lease.released]
                if group:
                    self._renew_group(semaphore, group)

    def _renew_group(self, semaphore: FairSemaphore, group: list[Lease]) -> None:
        started = time.monotonic()
        try:
            codes = semaphore.renew_many([(lease.token, lease.label) for lease in group], reclaim=True)
        except SemaphoreError as error:
            logger.warning("renewing %d lease(s) on %r failed: %s", len(group), semaphore.name, error)
            for lease in group:
                lease.renew_due = time.monotonic() + RETRY_AFTER_ERROR
            return
        for lease, code in zip(group, codes, strict=True):
            lease.renew_due = started + semaphore.lease / 3
            if code == RENEW_LOST:
                if not lease.lost:
                    logger.error(
                        "lease %s on %r was lost and no slot was free to take it back: "
                        "the limit may be exceeded until this holder ends",
                        lease.token,
                        semaphore.name,
                    )
                    self._tell(lease, "lost")
                lease.lost = True
            elif code == RENEW_REGISTERED_AGAIN:
                logger.warning("lease %s on %r had gone from Redis; registered again", lease.token, semaphore.name)
                lease.lost = False
                self._tell(lease, "reclaimed")

    @staticmethod
    def _tell(lease: Lease, event: str) -> None:
        for listener in list(_listeners):
            try:
                listener(lease, event)
            except Exception:  # a metrics hook must never stop renewal
                logger.exception("lease listener %r failed", listener)


_renewer = _Renewer()


def _after_fork_in_child() -> None:
    global _renewer
    _renewer = _Renewer()


os.register_at_fork(after_in_child=_after_fork_in_child)


def track(lease: Lease) -> None:
    """Renew ``lease`` in the background until it is forgotten or garbage-collected."""
    _renewer.track(lease)


def forget(lease: Lease) -> None:
    _renewer.forget(lease)


def cycle_lock() -> contextlib.AbstractContextManager[Any]:
    """The lock a renewal round holds: ``with cycle_lock(): ...`` (the lock itself, so the
    release path pays no generator-based context manager)."""
    return _renewer.cycle


def add_listener(listener: LeaseListener) -> None:
    """Call ``listener(lease, "lost" | "reclaimed")`` when a renewal finds a lease gone."""
    if listener not in _listeners:
        _listeners.append(listener)
