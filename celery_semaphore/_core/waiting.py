"""The blocking wait both semaphore classes share: try, sleep until told the turn may have
come, try again. It speaks to either class through ``Asker``, the private protocol's tries."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from ..errors import SemaphoreError, SemaphoreUnavailable
from .attempts import Ask, Attempt, Granted, Waiting, limit_of
from .lease import Lease
from .tenants import Tenant
from .validation import check_seconds
from .wakeups import WakeUps, wake_ups_for

logger = logging.getLogger("celery_semaphore")


class Asker(Protocol):
    """What the wait asks of a semaphore: one try, and giving up its place."""

    @property
    def name(self) -> str: ...

    @property
    def limit(self) -> int: ...

    def _try(self, ask: Ask) -> Attempt: ...

    def _wait(self, ask: Ask, timeout: float | None) -> Attempt: ...

    def _leave(self, waiter: str, away_for: float | None, wake: str) -> bool: ...


class WakeAddress:
    """This process's wake-up listener for a client, and a semaphore's wake address on it (the
    pub/sub channel its offers are published on). Looked up once per process: a fork makes a new
    listener with a new id, so a new address."""

    __slots__ = ("_address_of", "_cached", "_client")

    def __init__(self, client: object, address_of: Callable[[str], str]) -> None:
        self._client = client
        self._address_of = address_of
        self._cached: tuple[int, WakeUps, str] | None = None

    def get(self) -> tuple[WakeUps, str]:
        pid = os.getpid()
        cached = self._cached
        if cached is None or cached[0] != pid:
            wake_ups = wake_ups_for(self._client)
            cached = self._cached = (pid, wake_ups, self._address_of(wake_ups.listener_id))
        return cached[1], cached[2]


def wait_for_turn(semaphore: Asker, wake_ups: WakeUps, ask: Ask, *, timeout: float | None, pause: float) -> Attempt:
    """The loop of a semaphore's ``_wait``: try; while refused, sleep until this process's
    listener says the waiter was told (or ``pause`` seconds pass, the keep-alive that also claims
    an offer whose wake-up was lost), then try again; until granted, a Duplicate, or ``timeout``.
    ``ask.wake`` is this process's wake address.

    The first try registers nothing with the listener: an uncontended acquire is one round trip
    and nothing more. Only a refused waiter registers; an offer told between its refusal and its
    registration is kept by the listener meanwhile (``WakeUps.signal`` hands it over)."""
    started = time.monotonic()
    with wake_ups.gate:  # blocked threads never take the whole connection pool
        attempt = semaphore._try(ask)
    if not isinstance(attempt, Waiting):
        return attempt
    ticket = ask.ticket
    with wake_ups.signal(ask.wake, ask.waiter) as signal:
        subscribed = signal.ready()
        while True:
            if attempt.ticket is not None:
                ticket = attempt.ticket  # if the place ever lapses, come back to it
            wait = next_wait(attempt, time.monotonic() - started, timeout, pause)
            if wait is None:
                return attempt
            if subscribed:
                signal.event.wait(wait)  # takes the flag down: a wake-up from here on is kept
            else:
                # A wake-up published before the subscription was confirmed is lost: ask
                # again as soon as it is, to claim an offer made meanwhile.
                subscribed = signal.subscribe(wait)
                signal.event.clear()
            with wake_ups.gate:
                attempt = semaphore._try(replace(ask, ticket=ticket, fresh=False))
            if not isinstance(attempt, Waiting):
                return attempt


def next_wait(attempt: Waiting, waited: float, timeout: float | None, pause: float) -> float | None:
    """How long a refused waiter sleeps before it asks again unless told its turn came: ``pause``
    (the keep-alive ask, which also claims an offer whose wake-up was lost), less if its time runs
    out sooner or a start was reserved for it; None when its time is up. For both waits, the
    blocking one here and the asyncio one (``async_semaphore``)."""
    if timeout is not None and waited >= timeout:
        return None
    wait = pause if timeout is None else min(pause, timeout - waited)
    if attempt.retry_after is not None:
        # a start a rate, a spacing or a pause reserved for this waiter: claim it then
        wait = min(wait, attempt.retry_after)
    return wait


def acquire_within(
    semaphore: Asker,
    timeout: float | None,
    *,
    token: str,
    waiter: str,
    label: str | None,
    one_try: Callable[[], Attempt],
    tenant: Tenant | None = None,
    priority: float = 0,
) -> Lease:
    """``acquire(timeout)`` of either semaphore class: ``timeout`` 0 is ``one_try`` (one round
    trip that never queues), anything else a wait under ``waiter`` for at most ``timeout``
    seconds (None: as long as it takes). Raises SemaphoreUnavailable when the time runs out."""
    if timeout is not None:
        timeout = check_seconds("timeout", timeout, allow_zero=True)
    started = time.monotonic()
    if timeout == 0:
        attempt = one_try()
        if isinstance(attempt, Granted):
            return attempt.lease
        raise SemaphoreUnavailable(semaphore.name, limit_of(attempt, semaphore.limit), time.monotonic() - started)
    ask = Ask(token=token, waiter=waiter, label=label, fresh=True, tenant=tenant, priority=priority)
    return wait_or_give_up(semaphore, ask, timeout=timeout, started=started).lease


def wait_or_give_up(semaphore: Asker, ask: Ask, *, timeout: float | None, started: float) -> Granted:
    """The blocking part of ``acquire(timeout)`` of either semaphore class: wait for a slot under
    a fresh waiter id; if the time runs out, or anything interrupts the wait, give the place in
    line up at once, so the waiters behind move up."""
    try:
        attempt = semaphore._wait(ask, timeout)
    except BaseException:
        leave_quietly(semaphore, ask.waiter)
        raise
    if isinstance(attempt, Granted):
        return attempt
    leave_quietly(semaphore, ask.waiter)
    raise SemaphoreUnavailable(semaphore.name, limit_of(attempt, semaphore.limit), time.monotonic() - started)


def leave_quietly(
    semaphore: Asker,
    waiter: str,
    *,
    away_for: float | None = None,
    wake: str = "",
    quiet: Callable[[], bool] | None = None,
) -> None:
    """Give the place in line up (or, with ``away_for`` and ``wake``, park it), or say why not:
    a place not given up lapses by itself after ``patience``, so this never raises. ``quiet``
    says whether a failure goes unsaid (the Celery glue's outage line already says it)."""
    try:
        semaphore._leave(waiter, away_for, wake)
    except SemaphoreError as error:
        if quiet is None or not quiet():
            logger.warning("could not leave the line of %r (the place lapses by itself): %s", semaphore.name, error)
