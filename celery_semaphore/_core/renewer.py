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

When no renewal gets through at all (Redis unreachable, or not answering), nobody would say so:
the lease just runs out in Redis while its holder runs on. So each lease also has a deadline
here, the last grant or renewal known to have succeeded plus the lease length, and a second
daemon thread, the watch, marks a lease lost and logs it (naming the semaphore and the holder)
once that deadline passes. The watch never calls Redis, so it keeps time even while the renewer
thread is stuck in a call: the package's clients time out (``clients.SOCKET_TIMEOUT``), but a
client handed in by the application may not. A later renewal that gets through clears ``lost``
again (registered again, or found still held).
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

from ..errors import SemaphoreError
from .storage import RENEW_LOST, RENEW_REGISTERED_AGAIN, RENEW_RENEWED

if TYPE_CHECKING:
    from .lease import Lease, SlotOwner

logger = logging.getLogger("celery_semaphore")

__all__ = ["add_listener", "cycle_lock", "forget", "track"]

# After a failed renewal (Redis unreachable), try again this soon rather than a third of a lease.
RETRY_AFTER_ERROR = 0.5

# With nothing to renew the thread still looks again this often. Without it, a process that
# acquires and releases in a loop would wake the idle thread (a context switch, a GIL hand-over)
# on every acquire, since every new lease is due before "never"; with it, only a lease due within
# a second (a lease under 3 s) wakes it early.
IDLE_WAKE = 1.0

# The watch checks lease deadlines this much after they pass (a margin for the scheduler, so
# that one wake-up finds the lease due rather than a hair early).
WATCH_SLACK = 0.01

# Callbacks told of each lease found lost or registered again (metrics hook into this).
LeaseListener = Callable[["Lease", str], None]
_listeners: list[LeaseListener] = []


class _Held:
    """What the renewer knows of one tracked lease besides the lease itself."""

    __slots__ = ("lapsed", "ref", "until", "why")

    def __init__(self, lease: Lease) -> None:
        self.ref = weakref.ref(lease)
        # monotonic time the lease runs out in Redis unless renewed: the grant, then each
        # renewal known to have gone through, plus the lease length
        self.until = lease.acquired_at + lease.semaphore.lease
        self.why = "no renewal answered"  # why no renewal got through (for the lost log)
        self.lapsed = False  # the watch marked it lost at its deadline


class _Renewer:
    def __init__(self) -> None:
        self.leases: dict[int, _Held] = {}
        # Held while a renewal round runs, and by Lease.release while it stops tracking: a
        # renewal can then never register again a token that is being released.
        self.cycle = threading.RLock()
        # one lock guards the table; the renewer thread waits on one condition of it, the watch
        # on the other
        table = threading.Lock()
        self.changed = threading.Condition(table)
        self.watched = threading.Condition(table)
        self.thread: threading.Thread | None = None
        self.watch: threading.Thread | None = None
        self.wakes_at = math.inf  # monotonic time the thread's current wait ends
        self.watch_wakes_at = math.inf  # and the watch's

    def track(self, lease: Lease) -> None:
        held = _Held(lease)
        with self.changed:
            self.leases[id(lease)] = held
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="celery-semaphore-renewer", daemon=True)
                self.thread.start()
            elif lease.renew_due < self.wakes_at:
                # waking the thread costs a context switch per acquire; only do it when this
                # lease is due before the thread would wake anyway
                self.changed.notify()
            if self.watch is None or not self.watch.is_alive():
                self.watch = threading.Thread(target=self._watch, name="celery-semaphore-lease-watch", daemon=True)
                self.watch.start()
            elif held.until < self.watch_wakes_at:
                # as above: leases of one length end in the order they were taken, so this is
                # rare (a lease shorter than the others, or the first after the watch found none)
                self.watched.notify()

    def forget(self, lease: Lease) -> None:
        with self.changed:
            held = self.leases.get(id(lease))
            if held is not None and held.ref() is lease:
                del self.leases[id(lease)]

    def _live(self) -> list[Lease]:
        """The tracked leases still alive (under ``changed``); the dead ones are dropped."""
        live: list[Lease] = []
        for key, held in list(self.leases.items()):
            lease = held.ref()
            if lease is None:
                del self.leases[key]
            else:
                live.append(lease)
        return live

    def _held(self, lease: Lease) -> _Held | None:
        """The record of ``lease`` (under ``changed``), None once it is forgotten."""
        held = self.leases.get(id(lease))
        return held if held is not None and held.ref() is lease else None

    # The two threads hold no lease in a local while they sleep: a lease its owner dropped
    # without releasing must be collected, and so stop being renewed. Hence the helpers: what a
    # round looked at goes out of scope before the thread waits.

    def _run(self) -> None:
        while True:
            self.renew(self._due_or_wait())

    def _due_or_wait(self) -> list[Lease]:
        """The leases due for renewal now; or none, after a wait until one may be due. Decided,
        and the wait begun, under the lock that track() takes, so a lease tracked meanwhile is
        either seen here or wakes the wait."""
        with self.changed:
            now = time.monotonic()
            due, wakes_at = self._due(now)
            if due:
                return due
            self.wakes_at = wakes_at
            self.changed.wait(timeout=max(0.0, wakes_at - now))
            self.wakes_at = math.inf
            return []

    def _due(self, now: float) -> tuple[list[Lease], float]:
        """(the leases due at ``now``, when the next one is due)"""
        leases = self._live()
        due = [lease for lease in leases if lease.renew_due <= now]
        return due, min((lease.renew_due for lease in leases), default=now + IDLE_WAKE)

    def renew(self, leases: list[Lease]) -> None:
        # one round trip per semaphore: leases of equal semaphores (the Celery layer makes a
        # FairSemaphore object per task run) share it
        by_semaphore: dict[tuple[int, str, float], tuple[SlotOwner, list[Lease]]] = {}
        for lease in leases:
            semaphore = lease.semaphore
            same = (id(semaphore.client), semaphore.renewal_key, semaphore.lease)
            by_semaphore.setdefault(same, (semaphore, []))[1].append(lease)
        for semaphore, group in by_semaphore.values():
            with self.cycle:
                group = [lease for lease in group if not lease.released]
                if group:
                    self._renew_group(semaphore, group)

    def _renew_group(self, semaphore: SlotOwner, group: list[Lease]) -> None:
        started = time.monotonic()
        try:
            codes = semaphore._renew_many(
                [(lease.token, lease.label, lease.run or "") for lease in group], reclaim=True
            )
        except Exception as error:
            # SemaphoreError (RedisUnavailable: unreachable, timed out) above all; but anything
            # else too (a closed client's pool raises OSError or ValueError): the thread must
            # live on to renew the other leases and this group's next time
            logger.warning("renewing %d lease(s) on %r failed: %s", len(group), semaphore.name, error)
            why = f"the last renewal failed: {error}" if isinstance(error, SemaphoreError) else repr(error)
            with self.changed:
                for lease in group:
                    lease.renew_due = time.monotonic() + RETRY_AFTER_ERROR
                    held = self._held(lease)
                    if held is not None:
                        held.why = why
            return
        back = []
        with self.changed:
            for lease, code in zip(group, codes, strict=True):
                held = self._held(lease)
                if held is None or code == RENEW_LOST:
                    continue
                # the lease now runs until at least the call's start plus its length
                held.until = started + semaphore.lease
                if held.until < self.watch_wakes_at:
                    self.watched.notify()  # a lapsed lease the watch no longer waits for
                if held.lapsed:
                    held.lapsed = False
                    if code == RENEW_RENEWED:
                        # Redis still had it (it was stopped, not restarted, say): never gone
                        lease.lost = False  # under the lock the watch marks it lost under
                        back.append(lease)
        for lease in back:
            logger.warning(
                "lease %s of %s on %r renewed after its deadline had passed: Redis still held it",
                lease.token,
                lease.label,
                semaphore.name,
            )
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

    def _watch(self) -> None:
        """The watch thread: mark lost, and log, each lease whose deadline passed with no
        renewal getting through. It never calls Redis, so it cannot hang on it."""
        while True:
            self._report_lapsed(self._lapsed_or_wait())

    def _lapsed_or_wait(self) -> list[tuple[Lease, str]]:
        """The leases that lapsed just now, marked lost, each with why; or none, after a wait
        until the next deadline, track(), or a renewal that un-lapses one."""
        with self.changed:
            now = time.monotonic()
            lapsed, next_deadline = self._lapse(now)
            if lapsed:
                return lapsed
            if next_deadline == math.inf:
                # nothing to watch: look again in a while (as the renewer does), rather than wait
                # for track() to wake it, which a loop of acquire and release would do on every
                # acquire (a context switch and a GIL hand-over each; measured: a notify per cycle)
                next_deadline = now + IDLE_WAKE
            self.watch_wakes_at = next_deadline + WATCH_SLACK
            self.watched.wait(timeout=self.watch_wakes_at - now)
            self.watch_wakes_at = math.inf
            return []

    def _lapse(self, now: float) -> tuple[list[tuple[Lease, str]], float]:
        """(the leases whose deadline passed by ``now``, marked lapsed and lost; the next deadline)"""
        lapsed: list[tuple[Lease, str]] = []
        next_deadline = math.inf
        for lease in self._live():
            held = self.leases[id(lease)]
            if held.lapsed or lease.released:
                continue  # a lapsed lease counts again once a renewal un-lapses it
            if held.until > now:
                next_deadline = min(next_deadline, held.until)
                continue
            held.lapsed = True
            if not lease.lost:  # (a renewal that found it gone logged it already)
                lease.lost = True  # under the lock a renewal clears it under
                lapsed.append((lease, held.why))
        return lapsed, next_deadline

    def _report_lapsed(self, lapsed: list[tuple[Lease, str]]) -> None:
        for lease, why in lapsed:
            logger.error(
                "lease %s of %s on %r ran out with no renewal getting through (%s): it is lost, its slot may "
                "go to another caller and the limit may be exceeded until this holder ends",
                lease.token, lease.label, lease.semaphore.name, why,
            )  # fmt: skip
            self._tell(lease, "lost")

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
