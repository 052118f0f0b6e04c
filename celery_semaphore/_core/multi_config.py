"""What a list of semaphores taken all or nothing is, apart from its client: the members, the
weight, and what follows from them, checked once.

Both key-list classes, ``MultiSemaphore`` (``FairSemaphore`` members on a blocking client) and
``AsyncMultiSemaphore`` (``AsyncFairSemaphore`` members on a ``redis.asyncio`` client), send the
same scripts the same keys, waiter ids and tokens: a blocking caller and a coroutine asking for
the same keys stand in the same lines. So the members are checked, and the weight written into
ids, here, in one place; each class adds only how it reaches Redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

import redis.asyncio
import redis.cluster
from redis.crc import key_slot

from ..errors import ConfigurationError, SemaphoreError
from . import script_calls_many as calls
from .attempts import Ask, Duplicate, Waiting, default_label, new_token
from .config import SemaphoreConfig
from .replies import HandOffReply, Holder, ManyReply, RenewReply
from .rules import Rules
from .script_calls import ScriptCall
from .scripts import SemaphoreKeys
from .storage import RAN, RUNNING, TOO_HEAVY, WAIT, is_weighted_waiter, weighted_token, weighted_waiter
from .validation import check_limit, check_seconds, to_ms

MemberT = TypeVar("MemberT", bound=SemaphoreConfig[Any])


class ManyAsk(NamedTuple):
    """A try made ready to send: the acquire_many call, and what a grant of it is held under."""

    call: ScriptCall[ManyReply]
    token: str
    label: str
    remember_ms: int


class MultiConfig(Generic[MemberT]):
    """``weight`` slots of each of ``semaphores`` (of type ``member``, on one shared client). The
    lease is the shortest of theirs, the patience the longest."""

    member: ClassVar[type[SemaphoreConfig[Any]]]

    def __init__(self, semaphores: Sequence[MemberT], *, weight: int = 1) -> None:
        semaphores = list(semaphores)
        kind = self.member.__name__
        if not semaphores:
            raise ConfigurationError("semaphores", semaphores, f"expected at least one {kind}")
        if not all(isinstance(semaphore, self.member) for semaphore in semaphores):
            raise ConfigurationError("semaphores", semaphores, f"expected {kind} objects")
        client = semaphores[0].client
        names = [semaphore.name for semaphore in semaphores]
        if any(semaphore.client is not client for semaphore in semaphores):
            raise ConfigurationError("semaphores", names, "expected one shared Redis client")
        holders = [semaphore.keys.holders for semaphore in semaphores]
        if len(set(holders)) != len(holders):
            raise ConfigurationError(
                "semaphores", names, "a semaphore is listed twice (use a weight to take several slots)"
            )
        if isinstance(client, (redis.cluster.RedisCluster, redis.asyncio.RedisCluster)):
            slots = {key_slot(key.encode()) for key in holders}
            if len(slots) > 1:
                raise ConfigurationError(
                    "semaphores",
                    names,
                    "on a Redis Cluster one acquire runs in one hash slot, and these semaphores live in "
                    f"{len(slots)}: give them the same hash_tag ({kind}(..., hash_tag=...); for Celery "
                    "tasks, the semaphore_hash_tag setting)",
                )
        self.semaphores: list[MemberT] = semaphores
        self.client = client
        self.name = "+".join(names)
        self.lease = min(semaphore.lease for semaphore in semaphores)
        self.patience = max(semaphore.patience for semaphore in semaphores)
        self.limit = min(semaphore.limit for semaphore in semaphores)  # the smallest in code (for messages)
        # the home's keys (the first semaphore's): its wake address, and its run records
        self.keys = semaphores[0].keys
        self.all_keys: list[SemaphoreKeys] = [semaphore.keys for semaphore in semaphores]
        self.weight = self.check_weight(weight)
        self._lease_ms = to_ms(self.lease)
        self._patience_ms = to_ms(self.patience)
        self._setup()

    def _setup(self) -> None:
        """Made once the members are checked: the scripts on the client, the wake address."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} weight={self.weight}>"

    @property
    def home(self) -> MemberT:
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

    def refusal(self, reply: ManyReply) -> Waiting | Duplicate:
        """What an acquire_many reply that granted nothing means (the blocking and the asyncio
        class read it here): a place in every line, or a twin run. TOO_HEAVY is a
        ConfigurationError, an unknown code a SemaphoreError."""
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
            raise ConfigurationError(
                "weight",
                self.weight,
                f"above the limit (or the rate's count) {reply.limit} in force for "
                f"{self.semaphores[reply.index].name!r}: such an acquire would wait forever",
            )
        raise SemaphoreError(f"acquire_many on {self.name!r} returned unknown code {reply.outcome!r}", key=self.name)

    # -- the calls, whichever client runs them ----------------------------------------------

    def _acquire_call(self, ask: Ask) -> ManyAsk:
        """One try of ``ask`` (see ``Ask``): the weight written into its token and waiter id."""
        waiter = ask.waiter if is_weighted_waiter(ask.waiter, self.weight) else self.waiter_id(ask.waiter)
        label = default_label() if ask.label is None else ask.label
        ask = replace(ask, token=self.token_for(ask.token), waiter=waiter, label=label)
        patience_ms = self._patience_ms if ask.patience is None else to_ms(check_seconds("patience", ask.patience))
        remember_ms = 0
        if ask.run:
            remember = ask.remember
            remember_ms = to_ms(self.patience + self.lease if remember is None else check_seconds("remember", remember))
        call = calls.acquire_many(
            self.all_keys,
            ask,
            rules=self.rules,
            lease_ms=self._lease_ms,
            patience_ms=patience_ms,
            remember_ms=remember_ms,
        )
        return ManyAsk(call, ask.token, label, remember_ms)

    def _leave_call(self, waiter: str, away_for: float | None, wake: str) -> ScriptCall[HandOffReply]:
        """Step out of every line (``away_for``: park, keeping the places that long)."""
        if not is_weighted_waiter(waiter, self.weight):
            waiter = self.waiter_id(waiter)
        away_ms = None if away_for is None else to_ms(check_seconds("away_for", away_for))
        return calls.leave_many(self.all_keys, waiter=waiter, rules=self.rules, away_ms=away_ms, wake=wake)

    def _release_call(self, token: str, run: str | None, remember_ms: int) -> ScriptCall[HandOffReply]:
        """Give back every slot of a grant, and mark its run, if any, finished."""
        return calls.release_many(self.all_keys, token=token, rules=self.rules, run=run or "", remember_ms=remember_ms)

    def _renew_call(self, holders: list[Holder], *, reclaim: bool) -> ScriptCall[RenewReply]:
        return calls.renew_many(
            self.all_keys, lease_ms=self._lease_ms, rules=self.rules, reclaim=reclaim, holders=holders
        )
