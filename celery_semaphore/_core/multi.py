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
from dataclasses import replace

from . import renewer
from .attempts import Ask, Attempt, Granted, OneTry
from .hand_offs import tell_to_wake
from .lease import Lease
from .multi_config import MultiConfig
from .redis_errors import RedisErrors
from .replies import Holder
from .scripts import scripts_for
from .semaphore import FairSemaphore
from .storage import GRANTED, RENEW_LOST, is_extra_slot
from .validation import check_seconds
from .waiting import WakeAddress, acquire_within, wait_for_turn

logger = logging.getLogger("celery_semaphore")


class MultiSemaphore(MultiConfig[FairSemaphore], OneTry):
    """Hold ``weight`` slots of each of ``semaphores`` at once, or wait holding none.

    ``with MultiSemaphore([per_host, total]).acquire(timeout=10): ...``; ``acquire(weight=3)``
    takes three slots of each. The semaphores must share one Redis client. The lease is the
    shortest of theirs, the patience the longest. The methods mirror FairSemaphore's (tries give
    Granted, Waiting or Duplicate), so the Celery hook drives either the same way."""

    member = FairSemaphore

    def _setup(self) -> None:
        self._scripts = scripts_for(self.client)
        # the first semaphore's wake address: a script tells a waiter of any line there
        self._wake_address = WakeAddress(self.client, self.keys.wake_address)

    # -- acquiring -------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None, *, weight: int | None = None, label: str | None = None) -> Lease:
        """Wait for ``weight`` (default: this object's) slots of every semaphore: up to
        ``timeout`` seconds (None: as long as it takes; 0: one try that never queues). Raises
        SemaphoreUnavailable when time runs out, ConfigurationError when the weight is above a
        limit in force."""
        if weight is not None and weight != self.weight:
            return type(self)(self.semaphores, weight=weight).acquire(timeout, label=label)
        token = self.token_for()
        return acquire_within(
            self,
            timeout,
            token=token,
            waiter=self.waiter_id(),
            label=label,
            one_try=lambda: self.try_acquire(token=token, enqueue=False, label=label),
        )

    def _ask_once(self, waiter: str | None, token: str | None, enqueue: bool, label: str | None) -> Ask:
        token = self.token_for(token)
        if waiter is None:
            return Ask(token=token, waiter=self.waiter_id(), enqueue=False, label=label)
        return Ask(token=token, waiter=waiter, enqueue=enqueue, label=label)

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
        many = self._acquire_call(ask)
        with RedisErrors(self.name, "acquire"):
            reply = self._scripts.run(many.call)
        tell_to_wake(self, reply.to_wake)
        if reply.outcome == GRANTED:
            lease = Lease(self, many.token, label=many.label, run=ask.run or None, remember_ms=many.remember_ms)
            renewer.track(lease)
            return Granted(lease)
        return self.refusal(reply)

    def _wait(self, ask: Ask, timeout: float | None) -> Attempt:
        """Try; while refused, sleep until a line tells this waiter that its turn may have come
        (or ``patience / 3`` seconds pass), then try again; until granted or ``timeout``."""
        pause = (self.patience if ask.patience is None else check_seconds("patience", ask.patience)) / 3
        wake_ups, address = self._wake_address.get()
        return wait_for_turn(self, wake_ups, replace(ask, wake=address), timeout=timeout, pause=pause)

    def _leave(self, waiter: str, away_for: float | None, wake: str) -> bool:
        """``leave``; with ``away_for`` and ``wake``, park, as ``FairSemaphore._leave``."""
        with RedisErrors(self.name, "leave"):
            reply = self._scripts.run(self._leave_call(waiter, away_for, wake))
        tell_to_wake(self, reply.to_wake)
        return reply.done

    def _release(self, token: str, run: str | None, remember_ms: int) -> bool:
        """Give back every slot of a grant, and mark its run, if any, finished."""
        with RedisErrors(self.name, "release"):
            reply = self._scripts.run(self._release_call(token, run, remember_ms))
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
            reply = self._scripts.run(self._renew_call(holders, reclaim=reclaim))
        tell_to_wake(self, reply.to_wake, later=True)  # the renewer's thread: it must never block
        return reply.codes


__all__ = ["MultiSemaphore"]


def home_of(semaphore: FairSemaphore | MultiSemaphore) -> FairSemaphore:
    """The semaphore whose keys hold a call's run and parked records and its wake address: itself,
    or a key list's home (``MultiSemaphore.home``)."""
    return semaphore.home if isinstance(semaphore, MultiSemaphore) else semaphore
