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

import logging
import re
from collections.abc import Sequence
from dataclasses import replace

import redis.cluster
from redis.crc import key_slot

from ..errors import ConfigurationError, SemaphoreError
from . import renewer
from .attempts import Ask, Attempt, Duplicate, Granted, Waiting, default_label, new_token
from .lease import Lease
from .redis_errors import RedisErrors
from .replies import Holder
from .rules import Rules
from .scripts import SemaphoreKeys, scripts_for
from .semaphore import FairSemaphore, tell_to_wake
from .storage import (
    GRANTED,
    RAN,
    RENEW_LOST,
    RUNNING,
    TOO_HEAVY,
    WAIT,
    is_extra_slot,
    is_weighted_waiter,
    weighted_token,
    weighted_waiter,
)
from .validation import check_limit, check_seconds, to_ms
from .waiting import WakeAddress, acquire_within, wait_for_turn

logger = logging.getLogger("celery_semaphore")


class MultiSemaphore:
    """Hold ``weight`` slots of each of ``semaphores`` at once, or wait holding none.

    ``with MultiSemaphore([per_host, total]).acquire(timeout=10): ...``; ``acquire(weight=3)``
    takes three slots of each. The semaphores must share one Redis client. The lease is the
    shortest of theirs, the patience the longest. The methods mirror FairSemaphore's (tries give
    Granted, Waiting or Duplicate), so the Celery hook drives either the same way."""

    def __init__(self, semaphores: Sequence[FairSemaphore], *, weight: int = 1) -> None:
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
            raise ConfigurationError(
                "semaphores",
                [s.name for s in semaphores],
                "a semaphore is listed twice (use a weight to take several slots)",
            )
        if isinstance(client, redis.cluster.RedisCluster):
            slots = {key_slot(key.encode()) for key in holders}
            if len(slots) > 1:
                raise ConfigurationError(
                    "semaphores",
                    [s.name for s in semaphores],
                    "on a Redis Cluster one acquire runs in one hash slot, and these semaphores live in "
                    f"{len(slots)}: give them the same hash_tag (FairSemaphore(..., hash_tag=...); for Celery "
                    "tasks, the semaphore_hash_tag setting)",
                )
        self.semaphores = semaphores
        self.client = client
        self.name = "+".join(semaphore.name for semaphore in semaphores)
        self.lease = min(semaphore.lease for semaphore in semaphores)
        self.patience = max(semaphore.patience for semaphore in semaphores)
        # the home's keys (the first semaphore's): its wake address, and its run records
        self.keys = semaphores[0].keys
        self.all_keys: list[SemaphoreKeys] = [semaphore.keys for semaphore in semaphores]
        self.weight = self.check_weight(weight)
        self._lease_ms = to_ms(self.lease)
        self._patience_ms = to_ms(self.patience)
        self._scripts = scripts_for(client)
        # the first semaphore's wake address: a script tells a waiter of any line there
        self._wake_address = WakeAddress(client, self.keys.wake_address)

    def __repr__(self) -> str:
        return f"<MultiSemaphore {self.name!r} weight={self.weight}>"

    @property
    def home(self) -> FairSemaphore:
        """The member whose keys hold what a key list keeps once: its wake address, the records
        of its runs and of its parked waiters (the first)."""
        return self.semaphores[0]

    @property
    def renewal_key(self) -> str:
        return "\n".join(key.holders for key in self.all_keys)

    @property
    def limits(self) -> list[int]:
        """The limits given in code (a runtime override stored in Redis wins over each)."""
        return [semaphore.limit for semaphore in self.semaphores]

    @property
    def rules(self) -> list[Rules]:
        """Each semaphore's limit, rate and spacing given in code (runtime overrides win)."""
        return [semaphore.rules for semaphore in self.semaphores]

    @property
    def limit(self) -> int:
        """The smallest limit given in code (for messages)."""
        return min(self.limits)

    def check_weight(self, weight: int) -> int:
        """``weight`` if it fits every limit given in code; ConfigurationError if not."""
        check_limit("weight", weight)
        for semaphore in self.semaphores:
            if weight > semaphore.limit:
                raise ConfigurationError(
                    "weight",
                    weight,
                    f"above the limit {semaphore.limit} of {semaphore.name!r}: such an acquire would wait forever",
                )
            if semaphore.rate is not None and weight > semaphore.rate.count:
                raise ConfigurationError(
                    "weight",
                    weight,
                    f"above the rate {semaphore.rate} of {semaphore.name!r}: such an acquire would wait forever",
                )
        return weight

    def waiter_id(self, unique: str | None = None) -> str:
        """The id a waiter of this weight stands in line under: "*<weight>*<unique>" (the lines
        read the weight from it)."""
        return weighted_waiter(self.weight, unique or new_token())

    def token_for(self, token: str | None = None) -> str:
        """A holder token of this weight: a weight w > 1 is written in it ("...*<w>")."""
        token = new_token() if token is None else token
        return weighted_token(token, self.weight)

    # -- acquiring -------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None, *, weight: int | None = None, label: str | None = None) -> Lease:
        """Wait for ``weight`` (default: this object's) slots of every semaphore: up to
        ``timeout`` seconds (None: as long as it takes; 0: one try that never queues). Raises
        SemaphoreUnavailable when time runs out, ConfigurationError when the weight is above a
        limit in force."""
        if weight is not None and weight != self.weight:
            return MultiSemaphore(self.semaphores, weight=weight).acquire(timeout, label=label)
        token = self.token_for()
        return acquire_within(
            self,
            timeout,
            token=token,
            waiter=self.waiter_id(),
            label=label,
            one_try=lambda: self.try_acquire(token=token, enqueue=False, label=label),
        )

    def try_acquire(
        self,
        *,
        waiter: str | None = None,
        token: str | None = None,
        enqueue: bool = True,
        label: str | None = None,
    ) -> Attempt:
        """One try, one round trip: Granted, or Waiting (``turn`` is ``position``: the most
        waiters ahead in any line), as ``FairSemaphore.try_acquire``. ``token`` gets the weight
        written in it (``token_for``) and ``waiter`` the weight in front (``waiter_id``) unless
        they have them; the same waiter on every try keeps the places in line."""
        token = self.token_for(token)
        if waiter is None:
            return self._try(Ask(token=token, waiter=self.waiter_id(), enqueue=False, label=label))
        return self._try(Ask(token=token, waiter=waiter, enqueue=enqueue, label=label))

    def leave(self, waiter: str, *, away_for: float | None = None) -> bool:
        """Step out of every line at once, so those behind move up. True if it was in one.
        ``away_for``: step away, as ``FairSemaphore.leave``."""
        return self._leave(waiter, away_for, "")

    # -- holding ---------------------------------------------------------------------------

    def release(self, token: str) -> bool:
        """Give back every slot of a grant. True if it still held some. Safe to repeat."""
        return self._release(token, None, 0)

    def renew(self, token: str) -> bool:
        return self._renew_many([(token, "", "")], reclaim=False)[0] != RENEW_LOST

    # -- the private protocol (the Celery glue, the renewer and the wait) -------------------

    def _try(self, ask: Ask) -> Attempt:
        """One try with everything a re-sent Celery task carries (see ``Ask``); Duplicate too."""
        token = self.token_for(ask.token)
        waiter = ask.waiter if is_weighted_waiter(ask.waiter, self.weight) else self.waiter_id(ask.waiter)
        label = default_label() if ask.label is None else ask.label
        patience_ms = self._patience_ms if ask.patience is None else to_ms(check_seconds("patience", ask.patience))
        remember_ms = 0
        if ask.run:
            remember = ask.remember
            remember_ms = to_ms(self.patience + self.lease if remember is None else check_seconds("remember", remember))
        with RedisErrors(self.name, "acquire"):
            reply = self._scripts.acquire_many(
                self.all_keys,
                token=token,
                waiter=waiter,
                rules=self.rules,
                lease_ms=self._lease_ms,
                patience_ms=patience_ms,
                enqueue=ask.enqueue,
                label=label,
                ticket=ask.ticket,
                wake=ask.wake,
                run=ask.run or "",
                remember_ms=remember_ms,
                fresh=ask.fresh,
            )
        tell_to_wake(self, reply.to_wake)
        if reply.outcome == GRANTED:
            lease = Lease(self, token, label=label, run=ask.run or None, remember_ms=remember_ms)
            renewer.track(lease)
            return Granted(lease)
        if reply.outcome == WAIT:
            return Waiting(
                reply.position,
                max(0, reply.free),
                reply.limit,
                ticket=reply.ticket,
                turn=reply.position,
                retry_after=reply.retry_ms / 1000 if reply.retry_ms > 0 else None,
            )
        if reply.outcome in (RUNNING, RAN):
            return Duplicate(running=reply.outcome == RUNNING)
        if reply.outcome == TOO_HEAVY:
            semaphore = self.semaphores[reply.index]
            raise ConfigurationError(
                "weight",
                self.weight,
                f"above the limit (or the rate's count) {reply.limit} in force for {semaphore.name!r}: such an "
                "acquire would wait forever",
            )
        raise SemaphoreError(f"acquire_many on {self.name!r} returned unknown code {reply.outcome!r}", key=self.name)

    def _wait(self, ask: Ask, timeout: float | None) -> Attempt:
        """Try; while refused, sleep until a line tells this waiter that its turn may have come
        (or ``patience / 3`` seconds pass), then try again; until granted or ``timeout``."""
        pause = (self.patience if ask.patience is None else check_seconds("patience", ask.patience)) / 3
        wake_ups, address = self._wake_address.get()
        return wait_for_turn(self, wake_ups, replace(ask, wake=address), timeout=timeout, pause=pause)

    def _leave(self, waiter: str, away_for: float | None, wake: str) -> bool:
        """``leave``; with ``away_for`` and ``wake``, park, as ``FairSemaphore._leave``."""
        if not is_weighted_waiter(waiter, self.weight):
            waiter = self.waiter_id(waiter)
        away_ms = None if away_for is None else to_ms(check_seconds("away_for", away_for))
        with RedisErrors(self.name, "leave"):
            reply = self._scripts.leave_many(self.all_keys, waiter=waiter, rules=self.rules, away_ms=away_ms, wake=wake)
        tell_to_wake(self, reply.to_wake)
        return reply.done

    def _release(self, token: str, run: str | None, remember_ms: int) -> bool:
        """Give back every slot of a grant, and mark its run, if any, finished."""
        with RedisErrors(self.name, "release"):
            reply = self._scripts.release_many(
                self.all_keys, token=token, rules=self.rules, run=run or "", remember_ms=remember_ms
            )
        tell_to_wake(self, reply.to_wake)
        return reply.done

    def _finish_run(self, run: str, remember_ms: int) -> None:
        """Mark the run ``run`` finished, as ``FairSemaphore._finish_run``."""
        self._release("", run, remember_ms)

    def _release_holders_with_prefix(self, prefix: str, rest: re.Pattern[str] | None = None) -> int:
        """Release each grant whose token starts with ``prefix`` (a killed Celery child's task
        id), the remainder matching ``rest`` if given (see
        ``FairSemaphore._release_holders_with_prefix``): every slot of it on every semaphore, in
        one release each, so that a weight-w grant gives back w slots at once, not one, and the
        waiters they free are told; how many slot entries were released."""
        tokens: dict[str, None] = {}
        for semaphore in self.semaphores:
            for token in semaphore._tokens_with_prefix(prefix, rest):
                if not is_extra_slot(token):  # "<token>#k" goes with its token
                    tokens.setdefault(token)
        entries = len(self.semaphores) * self.weight
        return sum(entries for token in tokens if self._release(token, None, 0))

    def _renew_many(self, holders: list[Holder], *, reclaim: bool) -> list[int]:
        with RedisErrors(self.name, "renew"):
            reply = self._scripts.renew_many(
                self.all_keys, lease_ms=self._lease_ms, rules=self.rules, reclaim=reclaim, holders=holders
            )
        tell_to_wake(self, reply.to_wake, later=True)  # the renewer's thread: it must never block
        return reply.codes


__all__ = ["MultiSemaphore"]


def home_of(semaphore: FairSemaphore | MultiSemaphore) -> FairSemaphore:
    """The semaphore whose keys hold a call's run and parked records and its wake address: itself,
    or a key list's home (``MultiSemaphore.home``)."""
    return semaphore.home if isinstance(semaphore, MultiSemaphore) else semaphore
