"""Slots of several semaphores, and several slots of one, taken in one all-or-nothing acquire.

A crawler capped at 3 per host *and* 20 in total; an API capped per tenant *and* globally; a GPU
job that takes 3 of 4 GPUs. Nesting two ``FairSemaphore.acquire`` calls would hold one slot while
waiting for the other (hoarding, and a deadlock between two callers that nest in opposite orders)
and would lose the fair order. ``MultiSemaphore`` instead makes one try a single Lua script over
the keys of all its semaphores (``lua/acquire_many.lua``):

* It takes ``weight`` slots of *every* semaphore in the same script, or none: a waiter holds
  nothing while it waits.
* It stands in the line of every semaphore under one ticket, so two waiters are in the same
  order in every line they share: nobody waits for someone who waits for them.
* Per semaphore, slots go in first-ask order: a waiter at the head of a line (heavy, or blocked
  by another of its semaphores) holds back those behind it, so it is never starved by light ones.
  The cost: while it waits for one semaphore, the lines it heads elsewhere wait for it too.

A weight ``w`` holds ``w`` entries in a semaphore's holders (the token, ``<token>#2`` ..
``<token>#w``), so every count, purge, renewal and status stays per slot. A weight above a limit
in force is a ConfigurationError at once, never a wait that cannot end.

On a Redis Cluster a script runs in one hash slot, so all the semaphores of a MultiSemaphore must
share one: give them the same ``hash_tag`` (``FairSemaphore(..., hash_tag="crawl")``). That
family is then served by one master; a MultiSemaphore whose keys would span slots is refused
with a ConfigurationError when it is made.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis.cluster
from redis.crc import key_slot

from . import renewer
from ._scripts import GRANTED, TOO_HEAVY, WAIT, SemaphoreKeys
from .errors import ConfigurationError, SemaphoreError, SemaphoreUnavailable
from .semaphore import FairSemaphore, Lease, default_label, logger, new_token
from .validation import check_limit, check_seconds, to_ms


@dataclass(frozen=True)
class MultiWaiting:
    """A try that got no slots. The waiter keeps its places for ``patience`` seconds."""

    position: int  # the most waiters ahead of it in any of its lines
    free: int  # the fewest free slots of any of its semaphores
    limit: int  # the limit of ``blocking``
    blocking: str  # the name of the first semaphore that held the try back
    ticket: int | None = None

    @property
    def granted(self) -> bool:
        return False


class MultiSemaphore:
    """Hold a slot (``weight`` slots) of each of ``semaphores`` at once, or wait holding none.

    ``with MultiSemaphore([per_host, total]).acquire(timeout=10): ...``; the semaphores must
    share one Redis client. The lease is the shortest of theirs, the patience the longest."""

    def __init__(self, semaphores: Sequence[FairSemaphore]) -> None:
        semaphores = list(semaphores)
        if not semaphores:
            raise ConfigurationError("semaphores", semaphores, "expected at least one FairSemaphore")
        if not all(isinstance(semaphore, FairSemaphore) for semaphore in semaphores):
            raise ConfigurationError("semaphores", semaphores, "expected FairSemaphore objects")
        client = semaphores[0].client
        if any(semaphore.client is not client for semaphore in semaphores):
            raise ConfigurationError("semaphores", [s.name for s in semaphores], "expected one shared Redis client")
        holders = [semaphore.keys.holders for semaphore in semaphores]
        if len(set(holders)) != len(holders):
            raise ConfigurationError("semaphores", [s.name for s in semaphores],
                                     "a semaphore is listed twice (use a weight to take several slots)")
        if isinstance(client, redis.cluster.RedisCluster):
            slots = {key_slot(key.encode()) for key in holders}
            if len(slots) > 1:
                raise ConfigurationError(
                    "semaphores", [s.name for s in semaphores],
                    "on a Redis Cluster one acquire runs in one hash slot, and these semaphores live in "
                    f"{len(slots)}: give them the same hash_tag (FairSemaphore(..., hash_tag=...))",
                )
        self.semaphores = semaphores
        self.client = client
        self.name = "+".join(semaphore.name for semaphore in semaphores)
        self.lease = min(semaphore.lease for semaphore in semaphores)
        self.patience = max(semaphore.patience for semaphore in semaphores)
        self.keys: list[SemaphoreKeys] = [semaphore.keys for semaphore in semaphores]
        self._lease_ms = to_ms(self.lease)
        self._patience_ms = to_ms(self.patience)
        self._scripts = semaphores[0]._scripts

    def __repr__(self) -> str:
        return f"<MultiSemaphore {self.name!r}>"

    @property
    def renewal_key(self) -> str:
        return "\n".join(key.holders for key in self.keys)

    @property
    def limits(self) -> list[int]:
        """The limits given in code (a runtime override stored in Redis wins over each)."""
        return [semaphore.limit for semaphore in self.semaphores]

    def check_weight(self, weight: int) -> int:
        """``weight`` if it fits every limit given in code; ConfigurationError if not."""
        check_limit("weight", weight)
        for semaphore in self.semaphores:
            if weight > semaphore.limit:
                raise ConfigurationError("weight", weight, f"above the limit {semaphore.limit} of {semaphore.name!r}: "
                                         "such an acquire would wait forever")
        return weight

    # -- acquiring -------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None, *, weight: int = 1, label: str | None = None) -> Lease:
        """Wait for ``weight`` slots of every semaphore: up to ``timeout`` seconds (None: as long
        as it takes; 0: one try that never queues). Raises SemaphoreUnavailable when time runs
        out, ConfigurationError when ``weight`` is above a limit in force."""
        self.check_weight(weight)
        if timeout is not None:
            timeout = check_seconds("timeout", timeout, allow_zero=True)
        started = time.monotonic()
        token = new_token() + (f"*{weight}" if weight > 1 else "")
        if timeout == 0:
            attempt = self.try_acquire(token=token, weight=weight, enqueue=False, label=label)
            if isinstance(attempt, Lease):
                return attempt
            raise SemaphoreUnavailable(attempt.blocking, attempt.limit, time.monotonic() - started)
        waiter = self.new_waiter(weight)
        try:
            attempt = self.wait_for_slots(token=token, waiter=waiter, weight=weight, timeout=timeout, label=label)
        except BaseException:
            self._leave_quietly(waiter)
            raise
        if isinstance(attempt, Lease):
            return attempt
        self._leave_quietly(waiter)
        raise SemaphoreUnavailable(attempt.blocking, attempt.limit, time.monotonic() - started)

    @staticmethod
    def new_waiter(weight: int, unique: str | None = None) -> str:
        """A waiter id for these scripts: "*<weight>*<unique>" (the lines read the weight from it)."""
        return f"*{weight}*{unique or new_token()}"

    def wait_for_slots(
        self, *, token: str, waiter: str, weight: int, timeout: float | None, label: str | None = None,
        ticket: int | None = None,
    ) -> Lease | MultiWaiting:
        """Try; while refused, sleep until a line tells this waiter that its turn may have come
        (or ``patience / 3`` seconds pass), then try again; until granted or ``timeout``."""
        started = time.monotonic()
        pause = self.patience / 3
        wake_ups, channel = self.semaphores[0]._wake_ups()
        with wake_ups.signal(channel, waiter) as signal:
            subscribed = signal.ready()
            while True:
                signal.event.clear()
                with wake_ups.gate:
                    attempt = self.try_acquire(token=token, waiter=waiter, weight=weight, label=label, ticket=ticket,
                                               wake=channel)
                if isinstance(attempt, Lease):
                    return attempt
                ticket = attempt.ticket if attempt.ticket is not None else ticket
                waited = time.monotonic() - started
                if timeout is not None and waited >= timeout:
                    return attempt
                wait = pause if timeout is None else min(pause, timeout - waited)
                if not subscribed:
                    subscribed = signal.subscribe(wait)
                    continue
                signal.event.wait(wait)

    def try_acquire(
        self, *, token: str | None = None, waiter: str | None = None, weight: int = 1, enqueue: bool = True,
        label: str | None = None, ticket: int | None = None, wake: str = "",
    ) -> Lease | MultiWaiting:
        """One try, one round trip: a held Lease, or MultiWaiting with the places in line.

        ``token`` must end in ``*<weight>`` when ``weight`` > 1 (``acquire`` makes it so);
        ``waiter`` must be ``new_waiter(weight, ...)`` (the same on every try keeps the places)."""
        if token is None:
            token = new_token() + (f"*{weight}" if weight > 1 else "")
        if (weight > 1) != token.endswith(f"*{weight}"):
            raise ConfigurationError("token", token, f"a token of weight {weight} ends in '*{weight}' (and only then)")
        if waiter is None:
            waiter, enqueue = self.new_waiter(weight), False
        elif not waiter.startswith(f"*{weight}*"):
            raise ConfigurationError("waiter", waiter, f"expected MultiSemaphore.new_waiter({weight}, ...)")
        label = default_label() if label is None else label
        with self.semaphores[0]._redis_errors("acquire"):
            reply = self._scripts.acquire_many(
                self.keys, token=token, waiter=waiter, default_limits=self.limits, lease_ms=self._lease_ms,
                patience_ms=self._patience_ms, enqueue=enqueue, label=label, ticket=ticket, wake=wake,
            )
        if reply.outcome == GRANTED:
            lease = Lease(cast(Any, self), token, label=label)
            renewer.track(lease)
            return lease
        if reply.outcome == WAIT:
            return MultiWaiting(reply.position, reply.free, reply.limit, self.semaphores[reply.index].name,
                                reply.ticket)
        if reply.outcome == TOO_HEAVY:
            semaphore = self.semaphores[reply.index]
            raise ConfigurationError("weight", weight, f"above the limit {reply.limit} in force for "
                                     f"{semaphore.name!r}: such an acquire would wait forever")
        raise SemaphoreError(f"acquire_many on {self.name!r} returned unknown code {reply.outcome!r}", key=self.name)

    def leave(self, waiter: str) -> bool:
        """Step out of every line at once, so those behind move up. True if it was in one."""
        with self.semaphores[0]._redis_errors("leave"):
            return self._scripts.leave_many(self.keys, waiter=waiter, default_limits=self.limits)

    # -- holding (Lease and the renewer call these) ----------------------------------------

    def release(self, token: str, *, run: str | None = None, remember_ms: int = 0) -> bool:
        """Give back every slot of a grant. True if it still held some. Safe to repeat."""
        with self.semaphores[0]._redis_errors("release"):
            return self._scripts.release_many(self.keys, token=token, default_limits=self.limits)

    def renew(self, token: str) -> bool:
        return self.renew_many([(token, "")], reclaim=False)[0] != renewer.RENEW_LOST

    def renew_many(self, holders: list[tuple[str, str]], *, reclaim: bool) -> list[int]:
        with self.semaphores[0]._redis_errors("renew"):
            return self._scripts.renew_many(self.keys, lease_ms=self._lease_ms, default_limits=self.limits,
                                            reclaim=reclaim, holders=holders)

    def _leave_quietly(self, waiter: str) -> None:
        try:
            self.leave(waiter)
        except SemaphoreError:
            logger.warning("could not leave the lines of %r; the places lapse by themselves", self.name)


__all__ = ["MultiSemaphore", "MultiWaiting"]
