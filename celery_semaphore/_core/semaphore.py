"""A fair, distributed counting semaphore in Redis.

The design follows "Redis in Action" (sections 6.3 and 11.2) and drops the book's weak spots:

* One Lua script per operation: the book's fair semaphore needed several round trips and then
  a lock around them to close a race in which two clients both saw a free slot. A script runs
  atomically, so there is no such window and no lock.
* Redis server time (``TIME``) for every deadline: the book scored holders by client clocks,
  so a host whose clock ran ahead could expire, and steal, the slot of another host. Here a
  client clock is never read by the algorithm.
* Tickets order the waiters, not only the holders: a waiter takes a ticket from a counter once
  and keeps it across tries, and a slot goes to the oldest ticket first. A newcomer cannot jump
  the line, however often it asks.
* Hand-off: a freed slot is *offered* to the oldest present waiter (it counts against the limit
  while offered) and that waiter alone is told, on its process's wake-up channel. A release costs
  the same whether one or two hundred callers are blocked, and nobody races for the slot.

This module imports neither Celery nor kombu: the semaphore works in any Python process.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import redis
import redis.cluster

from ..errors import ConfigurationError, LeaseLost, RedisUnavailable, SemaphoreError, SemaphoreUnavailable
from . import renewer
from .scripts import Scripts, SemaphoreKeys, scripts_for
from .storage import (
    CLAIMED,
    GRANTED,
    OFFERED,
    PRESENT,
    RAN,
    RENEW_LOST,
    RUNNING,
    WAIT,
    is_extra_slot,
    is_offer,
    slot_members,
    token_prefix_pattern,
)
from .validation import (
    check_limit,
    check_name,
    check_prefix,
    check_seconds,
    check_semaphore_name,
    check_token,
    check_waiter,
    to_ms,
)
from .wakeups import WakeUps, wake_ups_for

logger = logging.getLogger("celery_semaphore")

# At most this many holders and waiters are listed by status(); the counts stay exact.
STATUS_LISTING_LIMIT = 1000

_LABEL = f"{socket.gethostname()}:{{pid}}"
_label_of_pid: tuple[int, str] = (-1, "")


# Told (semaphore, waiters) when a script offered a slot to waiters whose wake-up nobody heard
# (their process is gone): the Celery layer sends a parked task's wake copy itself (_celery/parking.py).
# Unset, such an offer lapses after its claim window and goes on to the next waiter.
UnheardHandler = Callable[[Any, "tuple[str, ...]"], None]
_unheard_handler: UnheardHandler | None = None


def on_unheard(handler: UnheardHandler | None) -> None:
    global _unheard_handler
    _unheard_handler = handler


def tell_unheard(semaphore: Any, waiters: tuple[str, ...]) -> None:
    """Hand ``waiters`` (offered a slot of ``semaphore``, unheard) to the handler, if any; never
    raises: the release or try that found them has done its own work."""
    handler = _unheard_handler
    if handler is None or not waiters:
        return
    try:
        handler(semaphore, waiters)
    except Exception as error:
        logger.warning("could not wake the waiters of %r that did not hear their turn (their offer lapses "
                       "after its claim window): %s", getattr(semaphore, "name", semaphore), error)


def default_label() -> str:
    """Who holds a slot, as status() shows it: host and process id."""
    global _label_of_pid
    pid = os.getpid()
    if _label_of_pid[0] != pid:  # made once per process (this runs on every acquire)
        _label_of_pid = (pid, _LABEL.format(pid=pid))
    return _label_of_pid[1]


def new_token() -> str:
    """A random holder token: nobody can guess it, so only its holder can release it. (128 random
    bits as hex, like ``uuid4().hex`` without building a UUID on every acquire.)"""
    return os.urandom(16).hex()


@dataclass(frozen=True)
class Granted:
    """A try that got a slot; the lease is held and renewed until released."""

    lease: Lease

    @property
    def granted(self) -> bool:
        return True


@dataclass(frozen=True)
class Waiting:
    """A try that got no slot. The waiter keeps its place in line for ``patience`` seconds:
    asking again within that time keeps the place; not asking gives it up."""

    position: int  # 0-based place in line
    free: int  # free slots when the try ran (may be above 0 while older waiters are ahead)
    limit: int
    hold_time: float | None = None  # recent average seconds a holder kept its slot, if known
    ticket: int | None = None  # the place-keeping ticket; None for a try that did not queue
    turn: int | None = None  # 0-based place among present waiters (slots go by this)

    @property
    def granted(self) -> bool:
        return False


@dataclass(frozen=True)
class Duplicate:
    """A try under a ``run`` id that another copy of the same run already used: that copy holds
    the slot now (``running``), or the run finished. This copy must not run now; a running twin
    may still die (its lease then lapses, after ``twin_lease`` seconds unless renewed), and the
    copy may then run it after all."""

    running: bool
    twin_lease: float = 0.0

    @property
    def granted(self) -> bool:
        return False


Attempt = Granted | Waiting | Duplicate


@dataclass(frozen=True)
class HolderInfo:
    token: str
    label: str
    held_for: float  # seconds since the slot was granted (server time)
    expires_in: float  # seconds of lease left
    weight: int = 1  # slots this holder takes (a MultiSemaphore acquire with a weight)


@dataclass(frozen=True)
class WaiterInfo:
    waiter: str
    position: int
    ticket: int
    waited: float  # seconds since the waiter first asked
    must_ask_within: float  # seconds before it loses its place unless it asks again
    present: bool  # asking now (True) or away on a countdown (False)
    offered: bool = False  # a slot is offered to it and waits for its claim (counts as taken)


@dataclass(frozen=True)
class SemaphoreStatus:
    name: str
    limit: int  # the limit in force
    limit_source: str  # "override" (stored in Redis) or "default" (the limit given in code)
    holder_count: int  # leases held now (exact)
    waiter_count: int  # waiters in line, present, away or offered (exact)
    holders: list[HolderInfo]  # at most `listed` entries, oldest deadline first
    waiters: list[WaiterInfo]  # at most `listed` entries, in line order
    override_expires_in: float | None = None  # seconds a ttl'd override has left; None: no ttl
    offered_count: int = 0  # slots offered to waiters, not claimed yet; they count as taken (exact)


class Lease:
    """One held slot. Renewed in the background while held; a context manager that releases
    on exit. ``lost`` turns true when a renewal found the slot gone and could not take it back:
    from then on the holder no longer counts against the limit."""

    __slots__ = ("__weakref__", "acquired_at", "label", "lost", "released", "remember_ms", "renew_due", "run",
                 "semaphore", "token")

    def __init__(
        self, semaphore: FairSemaphore, token: str, *, label: str, run: str | None = None, remember_ms: int = 0
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
        # when the background renewer should next extend this lease (monotonic seconds)
        self.renew_due = self.acquired_at + semaphore.lease / 3

    @property
    def name(self) -> str:
        return self.semaphore.name

    def renew(self) -> None:
        """Extend the lease now; raises LeaseLost if the slot is no longer held."""
        if not self.semaphore.renew(self.token):
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
        return self.semaphore.release(self.token, run=self.run if finished else None, remember_ms=self.remember_ms)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "lost" if self.lost else "held"
        return f"<Lease {self.semaphore.name!r} {self.token[:8]} {state}>"


class FairSemaphore:
    """At most ``limit`` holders at once across every process that uses the same Redis, name
    and prefix; waiters get slots in the order they first asked.

    ``lease`` bounds how long a crashed holder keeps its slot: a live holder's lease is renewed
    in the background every ``lease / 3`` seconds. ``patience`` is how long a waiter that stops
    asking keeps its place in line. ``limit`` applies unless a runtime override is stored in
    Redis (``set_limit``).

    ``hash_tag``: on a Redis Cluster every key of a semaphore lives in the slot of its name;
    semaphores given the same ``hash_tag`` share one slot instead, so that a ``MultiSemaphore``
    can take slots of all of them in one atomic script. The cost: that whole family is served by
    one master. Every user of a semaphore must give it the same tag (the tag is part of its keys).
    """

    def __init__(
        self,
        client: redis.Redis | redis.cluster.RedisCluster,
        name: str,
        limit: int,
        *,
        lease: float = 60.0,
        prefix: str = "semaphore",
        patience: float = 5.0,
        hash_tag: str | None = None,
    ) -> None:
        if not isinstance(client, (redis.Redis, redis.cluster.RedisCluster)):
            raise ConfigurationError(
                "client", client, "expected a redis.Redis or redis.cluster.RedisCluster client"
            )
        self.client = client
        self.name = check_semaphore_name("name", name)
        self.limit = check_limit("limit", limit)
        self.lease = check_seconds("lease", lease)
        self.prefix = check_prefix("prefix", prefix)
        self.patience = check_seconds("patience", patience)
        self.hash_tag = None if hash_tag is None else check_name("hash_tag", hash_tag)
        self.keys = SemaphoreKeys.of(self.prefix, self.name, self.hash_tag)
        self._lease_ms = to_ms(self.lease)
        self._patience_ms = to_ms(self.patience)
        self._scripts: Scripts = scripts_for(client)
        self._wake_cache: tuple[int, WakeUps, str] | None = None

    def __repr__(self) -> str:
        return f"<FairSemaphore {self.name!r} limit={self.limit} lease={self.lease}>"

    @property
    def renewal_key(self) -> str:
        """Leases with equal renewal keys (and lease lengths, on one client) renew in one call."""
        return self.keys.holders

    # -- acquiring -------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None, *, label: str | None = None) -> Lease:
        """Wait for a slot: up to ``timeout`` seconds (None: as long as it takes; 0: one try
        that never queues). Raises SemaphoreUnavailable when the time runs out.

        The returned Lease is a context manager: ``with sem.acquire(timeout=10): ...``. An
        uncontended acquire is one round trip. A refused one sleeps until a release hands it the
        slot and tells it so (see ``wait_for_slot``).
        """
        if timeout is not None:
            timeout = check_seconds("timeout", timeout, allow_zero=True)
        started = time.monotonic()
        token = new_token()
        if timeout == 0:
            # a token made here needs no checking: straight to the one round trip
            attempt = self._attempt(token, token, self._patience_ms, False, True, label, None, "", "", 0)
            if isinstance(attempt, Granted):
                return attempt.lease
            raise SemaphoreUnavailable(self.name, limit_of(attempt, self.limit), time.monotonic() - started)
        return wait_or_give_up(self, token=token, waiter=new_token(), timeout=timeout, label=label, started=started)

    def wait_for_slot(
        self,
        *,
        token: str,
        waiter: str,
        timeout: float | None,
        patience: float | None = None,
        label: str | None = None,
        ticket: int | None = None,
        fresh: bool = False,
        run: str | None = None,
        remember: float | None = None,
    ) -> Attempt:
        """Try, and while refused sleep until told a slot is offered, then claim it; until
        granted or ``timeout`` seconds pass (None: no bound). Returns the last try; a waiter that
        runs out of time keeps its place in line (call ``leave`` to give it up).

        The first try is made before anything else, so an uncontended call costs one round trip
        and subscribes to nothing. A refused waiter registers with the process's one wake-up
        listener (no connection of its own: it holds none while asleep) and asks again when
        woken, and every ``patience / 3`` seconds anyway: that keeps its place in line and claims
        an offer whose wake-up was lost. ``fresh``: this waiter never asked before (the first
        try may then skip the line bookkeeping when nobody waits). ``run``/``remember``: see
        ``try_acquire``; a Duplicate ends the wait at once.
        """
        pause = (self.patience if patience is None else check_seconds("patience", patience)) / 3
        wake_ups, channel = self._wake_ups()
        return wait_for_turn(
            self, wake_ups, channel, token=token, waiter=waiter, timeout=timeout, patience=patience, pause=pause,
            label=label, ticket=ticket, fresh=fresh, run=run, remember=remember,
        )

    def try_acquire(
        self,
        *,
        token: str | None = None,
        waiter: str | None = None,
        patience: float | None = None,
        enqueue: bool = True,
        label: str | None = None,
        ticket: int | None = None,
        fresh: bool = False,
        wake: str = "",
        run: str | None = None,
        remember: float | None = None,
    ) -> Attempt:
        """One try, one round trip: Granted with a Lease, or Waiting with the place in line.

        Pass the same ``waiter`` on every try to keep the place in line; ``token`` names the
        slot if granted (a repeat with the same token is granted again, not twice). A slot freed
        while the waiter is present (asking, not away) is offered to it: its next try claims it.
        With ``enqueue=False`` a new waiter does not take a ticket: it gets a slot only if it
        passes no present waiter. A waiter that left the line (to sleep elsewhere, not blocking
        those behind it) comes back to its old place by passing its old ``ticket``.

        ``fresh``: the caller knows this waiter never asked before; when nobody is present and a
        slot is free it is granted on the fast path (no line bookkeeping). ``wake``: the channel
        on which to PUBLISH this waiter's id when a slot is offered to it ("" for nowhere).

        ``run``: for a waiter that may exist in several copies (a Celery wait re-sent both with a
        countdown and on wake-up), the id of this run. If another copy of the run was granted in
        the last ``remember`` seconds (default: ``patience`` plus the lease), this try returns
        ``Duplicate`` (running or done) instead of a second slot.
        """
        if token is None:
            token = new_token()
        else:
            check_token("token", token)
        if waiter is None:
            # nobody will ask again under a fresh waiter id: a ticket would only block the line
            waiter, enqueue, fresh = token, False, True
        else:
            check_waiter("waiter", waiter)
        patience_ms = self._patience_ms if patience is None else to_ms(check_seconds("patience", patience))
        remember_ms = 0
        if run:
            remember_ms = to_ms(self.patience + self.lease if remember is None else check_seconds("remember", remember))
        return self._attempt(token, waiter, patience_ms, enqueue, fresh, label, ticket, wake, run or "", remember_ms)

    def _attempt(
        self, token: str, waiter: str, patience_ms: int, enqueue: bool, fresh: bool, label: str | None,
        ticket: int | None, wake: str, run: str, remember_ms: int,
    ) -> Attempt:
        """``try_acquire`` with its arguments checked (or made here, as ``acquire`` makes them):
        the one round trip, and what its reply means."""
        label = default_label() if label is None else label
        try:
            reply = self._scripts.acquire(
                self.keys,
                token=token,
                waiter=waiter,
                default_limit=self.limit,
                lease_ms=self._lease_ms,
                patience_ms=patience_ms,
                enqueue=enqueue,
                fresh=fresh,
                label=label,
                ticket=ticket,
                wake=wake,
                run=run,
                remember_ms=remember_ms,
            )
        except _REDIS_ERRORS as error:
            raise translate(error, self.name, "acquire") from error
        if reply.outcome in (GRANTED, CLAIMED):
            lease = Lease(self, token, label=label, run=run or None, remember_ms=remember_ms)
            renewer.track(lease)
            return Granted(lease)
        if reply.outcome == WAIT:
            if reply.unheard:
                tell_unheard(self, reply.unheard)
            return Waiting(
                reply.position,
                reply.free,
                reply.limit,
                hold_time=reply.hold_ms / 1000 if reply.hold_ms >= 0 else None,
                ticket=reply.ticket,
                turn=reply.turn,
            )
        if reply.outcome == RUNNING:
            return Duplicate(running=True, twin_lease=reply.twin_lease_ms / 1000)
        if reply.outcome == RAN:
            return Duplicate(running=False)
        raise SemaphoreError(f"acquire on {self.name!r} returned unknown code {reply.outcome!r}", key=self.name)

    def leave(self, waiter: str, *, away_for: float | None = None, wake: str = "") -> bool:
        """Step out of line at once, so those behind move up. True if it was in line.

        With ``away_for`` (seconds) the waiter keeps its place and shows in status while away,
        but slots pass it by until it asks again; if it does not ask within ``away_for`` its
        place lapses. A Celery task sleeping through a countdown steps away like this. A slot
        offered to the waiter and not yet claimed goes on to the next present waiter.

        With ``away_for`` and a ``wake`` address the waiter is *parked* instead: away, yet offered
        its turn like a present waiter, the offer published on ``wake`` (see _wakeups.on_wake)."""
        away_ms = None if away_for is None else to_ms(check_seconds("away_for", away_for))
        with self._redis_errors("leave"):
            reply = self._scripts.leave(
                self.keys, waiter=waiter, away_ms=away_ms, default_limit=self.limit, wake=wake
            )
        tell_unheard(self, reply.unheard)
        return reply.done

    # -- holding ---------------------------------------------------------------------------

    def release(self, token: str, *, run: str | None = None, remember_ms: int = 0) -> bool:
        """Give a slot back by its token. True if the token held it; False if its lease had
        already gone. Safe to repeat. Prefer ``Lease.release``, which also stops renewal and
        marks the lease's run (if any) finished, so that a later copy of the run is dropped."""
        try:
            reply = self._scripts.release(
                self.keys, token=token, default_limit=self.limit, run=run or "", remember_ms=remember_ms
            )
        except _REDIS_ERRORS as error:
            raise translate(error, self.name, "release") from error
        if reply.unheard:
            tell_unheard(self, reply.unheard)
        return reply.done

    def release_holders_with_prefix(self, prefix: str, *, rest: re.Pattern[str] | None = None) -> int:
        """Release every holder whose token starts with ``prefix`` (and, with ``rest``, whose
        remainder after it matches ``rest`` in full); how many were released.

        For a worker's parent process, which knows the task id of a killed child but not the
        random part of its token: ``rest`` keeps a task id that is the start of another one
        ("job:1" and "job:1:x") from releasing the other task's slots. Several round trips: for
        that rare path only."""
        pattern = token_prefix_pattern(prefix)
        with self._redis_errors("release"):
            tokens = [_text(token) for token, _ in self.client.zscan_iter(self.keys.holders, match=pattern)]
        # offers ("!<waiter>") are not holders: they go to their waiter or lapse
        return sum(self.release(token) for token in tokens
                   if not is_offer(token) and (rest is None or rest.fullmatch(token[len(prefix):])))

    def renew(self, token: str) -> bool:
        """Extend one token's lease by ``lease`` seconds from now; False if it was lost."""
        return self.renew_many([(token, "")], reclaim=False)[0] != RENEW_LOST

    def renew_many(self, holders: list[tuple[str, str]], *, reclaim: bool) -> list[int]:
        """Renew several (token, label) holders in one round trip; one RENEW_* code each.

        With ``reclaim``, a token that Redis no longer has (restarted empty, or the lease ran out
        during a stall) is registered again if a slot is free: it is still running, so it
        should count against the limit.
        """
        with self._redis_errors("renew"):
            return self._scripts.renew(
                self.keys, lease_ms=self._lease_ms, default_limit=self.limit, reclaim=reclaim, holders=holders
            )

    # -- inspecting and steering -----------------------------------------------------------

    def status(self, *, listed: int = STATUS_LISTING_LIMIT) -> SemaphoreStatus:
        """The limit in force, the holders and the line, from one read-only script.

        Counts are exact and cost O(log n) whatever the length of the line; at most ``listed``
        holders and waiters are listed (0: counts only, for a metrics scrape)."""
        with self._redis_errors("status"):
            reply = self._scripts.status(self.keys, listed=max(0, int(listed)))
        now = reply.now_ms
        # a weighted holder's extra slots ("<token>#2".."<token>#w") show as its weight
        weights = {holder.token: len(slot_members(holder.token)) for holder in reply.holders}
        holders = [
            HolderInfo(
                token=holder.token,
                label=holder.label,
                held_for=(now - (holder.granted_ms if holder.granted_ms is not None else now)) / 1000,
                expires_in=(holder.deadline_ms - now) / 1000,
                weight=weights[holder.token],
            )
            for holder in reply.holders
            if not is_extra_slot(holder.token)
        ]
        waiters = [
            WaiterInfo(
                waiter=waiter.waiter,
                position=position,
                ticket=waiter.ticket,
                waited=(now - (waiter.first_ask_ms if waiter.first_ask_ms is not None else now)) / 1000,
                must_ask_within=(waiter.must_ask_by_ms - now) / 1000,
                present=waiter.state in (PRESENT, OFFERED),  # parked waiters show as present
                offered=waiter.state == OFFERED,
            )
            for position, waiter in enumerate(reply.waiters)
        ]
        return SemaphoreStatus(
            name=self.name,
            limit=reply.override if reply.override is not None else self.limit,
            limit_source="override" if reply.override is not None else "default",
            holder_count=reply.holder_count,
            waiter_count=reply.waiter_count,
            holders=holders,
            waiters=waiters,
            override_expires_in=reply.override_ttl_ms / 1000 if reply.override_ttl_ms >= 0 else None,
            offered_count=reply.offered_count,
        )

    def set_limit(self, limit: int, *, ttl: float | None = None) -> None:
        """Store a runtime limit that wins over the one given in code, for every process.

        The override is an operator's decision, so it is kept until cleared, unless ``ttl``
        (seconds) says otherwise. Slots a higher limit frees are offered to present waiters at
        once, in the same script."""
        check_limit("limit", limit)
        ttl_ms = None if ttl is None else to_ms(check_seconds("ttl", ttl))
        with self._redis_errors("set_limit"):
            self._scripts.set_limit(self.keys, override=limit, ttl_ms=ttl_ms, default_limit=self.limit)

    def clear_limit(self) -> None:
        """Drop the runtime override; the limit given in code applies again (and if that is
        higher, the slots it frees are offered at once)."""
        with self._redis_errors("clear_limit"):
            self._scripts.set_limit(self.keys, override=None, ttl_ms=None, default_limit=self.limit)

    def reset(self) -> None:
        """Forget every holder and waiter (the limit override stays). For operators recovering
        from a mistake, such as holders left by a test run against the wrong Redis. Holders that
        are still running register again at their next renewal while slots are free; those that
        find no free slot run uncounted (and are logged as lost) until they end. Blocked waiters
        notice at their next keep-alive ask (``patience / 3``) and come back by their ticket."""
        with self._redis_errors("reset"):
            self._scripts.reset(self.keys)

    # -- plumbing --------------------------------------------------------------------------

    def _redis_errors(self, operation: str) -> _RedisErrors:
        return _RedisErrors(self.name, operation)

    def _wake_ups(self) -> tuple[WakeUps, str]:
        """This process's wake-up listener for the client, and this semaphore's channel on it;
        looked up once per process (a fork makes a new listener with a new channel)."""
        pid = os.getpid()
        cached = self._wake_cache
        if cached is None or cached[0] != pid:
            wake_ups = wake_ups_for(self.client)
            cached = self._wake_cache = (pid, wake_ups, self.keys.wake_channel(wake_ups.process_id))
        return cached[1], cached[2]

    def _leave_quietly(self, waiter: str) -> None:
        try:
            self.leave(waiter)
        except SemaphoreError:
            logger.warning("could not leave the line of %r; the place lapses by itself", self.name)


# Answers that mean "not now" rather than "wrong": the caller should wait and try again.
_NOT_NOW = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)
_CLUSTER_NOT_NOW = (
    redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError, redis.exceptions.RedisClusterException,
)


# What redis-py raises (RedisClusterException, no node for a slot say, is not a RedisError).
_REDIS_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


def translate(error: BaseException, name: str, operation: str) -> SemaphoreError:
    """redis-py's error as the package's: unreachable, full, read-only or loading is
    RedisUnavailable (callers wait, fail closed); anything else a SemaphoreError."""
    # a cluster between owners of a slot (failover, resharding) or unreachable is "not now" too
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError, *_CLUSTER_NOT_NOW)):
        return RedisUnavailable(name, operation, error)
    # a full Redis (maxmemory with noeviction) or one still loading its data set is unavailable
    # for now, like an unreachable one: callers wait, they do not fail
    if isinstance(error, redis.ResponseError) and (
        isinstance(error, _NOT_NOW) or str(error).startswith(("OOM", "LOADING", "BUSY", "MASTERDOWN"))
    ):
        return RedisUnavailable(name, operation, error)
    return SemaphoreError(f"{operation} on semaphore {name!r}: {error}", key=name)


class _RedisErrors:
    """``with``: redis-py's errors raised inside come out translated (``translate``). The hot
    paths (acquire, release) use a bare ``try`` instead, which costs nothing when nothing fails."""

    __slots__ = ("name", "operation")

    def __init__(self, name: str, operation: str) -> None:
        self.name = name
        self.operation = operation

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if error is not None and isinstance(error, _REDIS_ERRORS):
            raise translate(error, self.name, self.operation) from error


def wait_for_turn(
    semaphore: Any, wake_ups: WakeUps, channel: str, *, token: str, waiter: str, timeout: float | None,
    patience: float | None, pause: float, label: str | None, ticket: int | None, fresh: bool, run: str | None,
    remember: float | None,
) -> Attempt:
    """The loop of ``wait_for_slot`` of a FairSemaphore or a MultiSemaphore: try; while refused,
    sleep until this process's listener says the waiter was told (or ``pause`` seconds pass, the
    keep-alive that also claims an offer whose wake-up was lost), then try again; until granted,
    a Duplicate, or ``timeout``.

    The first try registers nothing with the listener: an uncontended acquire is one round trip
    and nothing more. Only a refused waiter registers; an offer told between its refusal and its
    registration is kept by the listener meanwhile (``WakeUps.signal`` hands it over)."""
    started = time.monotonic()
    with wake_ups.gate:  # blocked threads never take the whole connection pool
        attempt: Attempt = semaphore.try_acquire(
            token=token, waiter=waiter, patience=patience, label=label, ticket=ticket, fresh=fresh,
            wake=channel, run=run, remember=remember,
        )
    if not isinstance(attempt, Waiting):
        return attempt
    with wake_ups.signal(channel, waiter) as signal:
        subscribed = signal.ready()
        while True:
            if attempt.ticket is not None:
                ticket = attempt.ticket  # if the place ever lapses, come back to it
            waited = time.monotonic() - started
            if timeout is not None and waited >= timeout:
                return attempt
            wait = pause if timeout is None else min(pause, timeout - waited)
            if subscribed:
                signal.event.wait(wait)  # takes the flag down: a wake-up from here on is kept
            else:
                # A wake-up published before the subscription was confirmed is lost: ask
                # again as soon as it is, to claim an offer made meanwhile.
                subscribed = signal.subscribe(wait)
                signal.event.clear()
            with wake_ups.gate:
                attempt = semaphore.try_acquire(
                    token=token, waiter=waiter, patience=patience, label=label, ticket=ticket, fresh=False,
                    wake=channel, run=run, remember=remember,
                )
            if not isinstance(attempt, Waiting):
                return attempt


def limit_of(attempt: Attempt, default: int) -> int:
    """The limit a refused try reported (``default`` for a try that says none)."""
    return attempt.limit if isinstance(attempt, Waiting) else default


def wait_or_give_up(
    semaphore: Any, *, token: str, waiter: str, timeout: float | None, label: str | None, started: float
) -> Lease:
    """The blocking part of ``acquire(timeout)`` of a FairSemaphore or a MultiSemaphore: wait for
    a slot under a fresh waiter id; if the time runs out, or anything interrupts the wait, give
    the place in line up at once, so the waiters behind move up."""
    try:
        attempt = semaphore.wait_for_slot(token=token, waiter=waiter, timeout=timeout, label=label, fresh=True)
    except BaseException:
        semaphore._leave_quietly(waiter)
        raise
    if isinstance(attempt, Granted):
        return attempt.lease
    semaphore._leave_quietly(waiter)
    raise SemaphoreUnavailable(semaphore.name, limit_of(attempt, semaphore.limit), time.monotonic() - started)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
