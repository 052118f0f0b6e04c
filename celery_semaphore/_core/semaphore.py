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
import re
from dataclasses import replace
from typing import Any

import redis
import redis.cluster

from ..errors import ConfigurationError
from . import renewer, script_calls
from .attempts import Ask, Attempt, Granted, OneTry, StartsOnArrival, Waiting, default_label, new_token, refusal_of
from .config import SemaphoreConfig
from .hand_offs import follower_for, tell_to_wake, woken_by
from .lease import Lease
from .redis_errors import REDIS_ERRORS, RedisErrors, translate
from .replies import Holder
from .rules import Rate, check_rate, check_spacing
from .script_calls import PLACING, LineArgs
from .scripts import Script, Scripts, scripts_for
from .status import STATUS_LISTING_LIMIT, SemaphoreStatus, status_of
from .storage import (
    CLAIMED,
    EVICTED,
    FREE,
    GRANTED,
    LINE_FULL,
    RENEW_LOST,
    WAIT,
    as_text,
    is_offer,
    token_prefix_pattern,
)
from .tenants import READ_PER_LISTED, Tenant, TenantInfo, tenant_report
from .validation import check_limit, check_seconds, check_token, check_waiter, to_ms
from .waiting import WakeAddress, acquire_within, wait_for_turn

logger = logging.getLogger("celery_semaphore")


class FairSemaphore(SemaphoreConfig["redis.Redis | redis.cluster.RedisCluster"], OneTry):
    """At most ``limit`` holders at once across every process that uses the same Redis, name
    and prefix; waiters get slots in the order they first asked.

    ``lease`` bounds how long a crashed holder keeps its slot: a live holder's lease is renewed
    in the background every ``lease / 3`` seconds. ``patience`` is how long a waiter that stops
    asking keeps its place in line. ``limit`` applies unless a runtime override is stored in
    Redis (``set_limit``).

    ``per_tenant``: most slots the calls of one tenant may hold at once (with two levels, one
    org's). A free slot then passes over the waiters of a tenant that holds its cap to the
    next waiter of another one, so the cap never leaves a slot idle while another tenant waits
    near the head of the line (the first 32 present waiters are looked at).

    ``hash_tag``: on a Redis Cluster every key of a semaphore lives in the slot of its name;
    semaphores given the same ``hash_tag`` share one slot instead, so that a ``MultiSemaphore``
    can take slots of all of them in one atomic script. The cost: that whole family is served by
    one master. Every user of a semaphore must give it the same tag (the tag is part of its keys).
    """

    def _accept(self, client: redis.Redis | redis.cluster.RedisCluster) -> redis.Redis | redis.cluster.RedisCluster:
        if not isinstance(client, (redis.Redis, redis.cluster.RedisCluster)):
            raise ConfigurationError("client", client, "expected a redis.Redis or redis.cluster.RedisCluster client")
        return client

    def _setup(self) -> None:
        self._scripts: Scripts = scripts_for(self.client)
        self._wake_address = WakeAddress(self.client, self.keys.wake_address)

    # -- acquiring -------------------------------------------------------------------------

    def acquire(
        self,
        timeout: float | None = None,
        *,
        label: str | None = None,
        tenant: Tenant | None = None,
        priority: float = 0,
    ) -> Lease:
        """Wait for a slot: up to ``timeout`` seconds (None: as long as it takes; 0: one try
        that never queues). Raises SemaphoreUnavailable when the time runs out.

        The returned Lease is a context manager: ``with sem.acquire(timeout=10): ...``. An
        uncontended acquire is one round trip. A refused one sleeps until a release hands it the
        slot and tells it so, registered with the process's one wake-up listener (no connection
        of its own: it holds none while asleep), and asks again every ``patience / 3`` seconds
        anyway: that keeps its place in line and claims an offer whose wake-up was lost.

        ``tenant``: whom the call is made for (a customer, say). Waiting calls of different
        tenants are served in proportion to their ``shares`` rather than first come, first
        served (see ``FairSemaphore``); inside one tenant, first come, first served. A pair
        ``(org, user)`` is fair between orgs first, then between the users of an org (a user's
        share is that of ``"<org>/<user>"``), so an org gets no more by using more user names.

        ``priority``: seconds; a waiting call is placed as if it had asked that much earlier
        (negative: later), capped at 600 either way. With a tenant, it moves the call ahead
        within the tenants' virtual time, a second for a start of a share-1 tenant.
        """
        token = new_token()
        return acquire_within(
            self,
            timeout,
            token=token,
            waiter=new_token(),
            label=label,
            tenant=tenant,
            priority=priority,
            # a token made here needs no checking: straight to the one round trip (a try that
            # never queues takes no place, so its tenant matters only to a cap per tenant)
            one_try=lambda: self._attempt(
                token, token, self._patience_ms, False, True, label, None, "", "", 0, self._one_try_line(tenant)
            ),
        )

    def _ask_once(self, waiter: str | None, token: str | None, enqueue: bool, label: str | None) -> Ask:
        if token is None:
            token = new_token()
        if waiter is None:
            # nobody will ask again under a fresh waiter id: a ticket would only block the line
            return Ask(token=token, waiter=token, enqueue=False, label=label, fresh=True)
        return Ask(token=token, waiter=waiter, enqueue=enqueue, label=label)

    def leave(self, waiter: str, *, away_for: float | None = None) -> bool:
        """Step out of line at once, so those behind move up. True if it was in line.

        With ``away_for`` (seconds) the waiter keeps its place and shows in status while away,
        but slots pass it by until it asks again; if it does not ask within ``away_for`` its
        place lapses. A Celery task sleeping through a countdown steps away like this. A slot
        offered to the waiter and not yet claimed goes on to the next present waiter."""
        return self._leave(waiter, away_for, "")

    # -- holding ---------------------------------------------------------------------------

    def release(self, token: str) -> bool:
        """Give a slot back by its token. True if the token held it; False if its lease had
        already gone. Safe to repeat. Prefer ``Lease.release``, which also stops renewal and
        marks the lease's run (if any) finished, so that a later copy of the run is dropped."""
        return self._release(token, None, 0)

    def renew(self, token: str) -> bool:
        """Extend one token's lease by ``lease`` seconds from now; False if it was lost."""
        return self._renew_many([(token, "", "")], reclaim=False)[0] != RENEW_LOST

    # -- the private protocol (the Celery glue, the renewer and the wait) -------------------

    def _try(self, ask: Ask) -> Attempt:
        """One try with everything a re-sent Celery task carries (see ``Ask``)."""
        check_token("token", ask.token)
        check_waiter("waiter", ask.waiter)
        patience_ms = self._patience_ms if ask.patience is None else to_ms(check_seconds("patience", ask.patience))
        remember_ms = 0
        if ask.run:
            remember = ask.remember
            remember_ms = to_ms(self.patience + self.lease if remember is None else check_seconds("remember", remember))
        return self._attempt(
            ask.token,
            ask.waiter,
            patience_ms,
            ask.enqueue,
            ask.fresh,
            ask.label,
            ask.ticket,
            ask.wake,
            ask.run or "",
            remember_ms,
            self._line_args(ask),
            at_most_once=ask.at_most_once,
        )

    def _place(self, ask: Ask) -> Waiting | StartsOnArrival | None:
        """Take a place in line for a task being sent, never a slot: Waiting, and the Celery
        glue parks the task there at once, so that its first delivery is the one its turn
        sends; or, where it would start now, StartsOnArrival: offered the start, which its first
        delivery claims. None when its line is full or the waiter is in line already (a task id
        sent twice): nothing was placed, and the task is sent as it is, to ask in its worker."""
        check_waiter("waiter", ask.waiter)
        try:
            reply = self._scripts.acquire(
                self.keys,
                token=ask.token,
                waiter=ask.waiter,
                rules=self.rules,
                lease_ms=self._lease_ms,
                patience_ms=self._patience_ms,
                enqueue=PLACING,
                fresh=True,
                label=ask.label or "",
                ticket=None,
                wake="",
                line=self._line_args(ask),
            )
        except REDIS_ERRORS as error:
            raise translate(error, self.name, "acquire") from error
        tell_to_wake(self, reply.to_wake)
        if reply.outcome == FREE and reply.ticket is not None:
            return StartsOnArrival(reply.ticket)
        if reply.outcome != WAIT:  # already in line, or LINE_FULL (its worker refuses it, loudly)
            return None
        attempt = refusal_of(reply, self.name)
        return attempt if isinstance(attempt, Waiting) else None

    def _wait(self, ask: Ask, timeout: float | None) -> Attempt:
        """Try, and while refused sleep until told a slot is offered, then claim it; until
        granted or ``timeout`` seconds pass (None: no bound). Returns the last try; a waiter that
        runs out of time keeps its place in line (``leave`` gives it up). A Duplicate ends the
        wait at once. The first try is made before anything else, so an uncontended call costs
        one round trip and subscribes to nothing."""
        pause = (self.patience if ask.patience is None else check_seconds("patience", ask.patience)) / 3
        wake_ups, address = self._wake_address.get()
        return wait_for_turn(self, wake_ups, replace(ask, wake=address), timeout=timeout, pause=pause)

    def _attempt(
        self,
        token: str,
        waiter: str,
        patience_ms: int,
        enqueue: bool,
        fresh: bool,
        label: str | None,
        ticket: int | None,
        wake: str,
        run: str,
        remember_ms: int,
        line: LineArgs | None = None,
        *,
        at_most_once: bool = False,
    ) -> Attempt:
        """A try with its arguments checked (or made here, as ``acquire`` makes them): the one
        round trip, and what its reply means."""
        label = default_label() if label is None else label
        try:
            reply = self._scripts.acquire(
                self.keys,
                token=token,
                waiter=waiter,
                rules=self.rules,
                lease_ms=self._lease_ms,
                patience_ms=patience_ms,
                enqueue=enqueue,
                fresh=fresh,
                label=label,
                ticket=ticket,
                wake=wake,
                run=run,
                remember_ms=remember_ms,
                line=line,
                at_most_once=at_most_once,
            )
        except REDIS_ERRORS as error:
            raise translate(error, self.name, "acquire") from error
        if reply.outcome in (GRANTED, CLAIMED):
            lease = Lease(self, token, label=label, run=run or None, remember_ms=remember_ms)
            renewer.track(lease)
            if reply.to_wake:
                tell_to_wake(self, reply.to_wake)
            return Granted(lease)
        if reply.outcome == WAIT and reply.to_wake:
            tell_to_wake(self, reply.to_wake)
        if reply.outcome in (LINE_FULL, EVICTED):
            raise self._full_line_error(reply.outcome == EVICTED)
        return refusal_of(reply, self.name)

    def _leave(self, waiter: str, away_for: float | None, wake: str) -> bool:
        """``leave``; with ``away_for`` and a ``wake`` address the waiter is *parked* instead:
        away, yet offered its turn like a present waiter, the offer published on ``wake`` (see
        wakeups.on_wake)."""
        away_ms = None if away_for is None else to_ms(check_seconds("away_for", away_for))
        with RedisErrors(self.name, "leave"):
            reply = self._scripts.leave(self.keys, waiter=waiter, away_ms=away_ms, rules=self.rules, wake=wake)
        tell_to_wake(self, reply.to_wake)
        return reply.done

    def _park_after(self, first: tuple[Script, list[bytes], list[Any]], waiter: str, away_for: float, wake: str) -> Any:
        """``first`` (a script of this semaphore's client: a task's parked record), then park
        ``waiter`` as ``_leave`` does, in one round trip: what ``first`` replied, or the error
        it raised. Raises what parking raised."""
        call = script_calls.leave(
            self.keys, waiter=waiter, away_ms=to_ms(check_seconds("away_for", away_for)), rules=self.rules, wake=wake
        )
        with RedisErrors(self.name, "leave"):
            first_reply, reply = self._scripts.run_after(first, call)
        tell_to_wake(self, reply.to_wake)
        return first_reply

    def _release(self, token: str, run: str | None, remember_ms: int) -> bool:
        """``release``, marking the run ``run`` (if any) finished for ``remember_ms``."""
        follower = follower_for(self)
        call = script_calls.release(
            self.keys,
            token=token,
            rules=self.rules,
            run=run or "",
            remember_ms=remember_ms,
            caller_takes_parked=follower is not None and follower.takes_parked,
        )
        try:
            if follower is None:
                reply = self._scripts.run(call)
            else:
                reply, followed = self._scripts.run_before(call, follower.run)
        except REDIS_ERRORS as error:
            raise translate(error, self.name, "release") from error
        to_wake = reply.to_wake
        if follower is not None:
            woken = woken_by(follower, followed)
            to_wake = tuple(waiter for waiter in to_wake if waiter not in woken)
        tell_to_wake(self, to_wake)
        return reply.done

    def _line_front(self) -> int | None:
        """The ticket of the head of the line; None when nobody waits (read by a task that pauses
        its key and must stand first)."""
        with RedisErrors(self.name, "status"):
            head = self.client.zrange(self.keys.queue, 0, 0, withscores=True)
        return int(head[0][1]) if head else None

    def _noted_run(self, note: str) -> str | None:
        """What the run records hold under ``note`` (a first delivery's note, ``remember_wait``)."""
        with RedisErrors(self.name, "status"):
            value = self.client.hget(self.keys.runs, note)
        return None if value is None else as_text(value)

    def _finish_run(self, run: str, remember_ms: int) -> None:
        """Mark the run ``run`` finished for ``remember_ms`` (its later copies are told so and
        dropped) without giving back a slot: a run that ends holding nothing."""
        self._release("", run, remember_ms)

    def _release_holders_with_prefix(self, prefix: str, rest: re.Pattern[str] | None = None) -> int:
        """Release every holder whose token starts with ``prefix`` (and, with ``rest``, whose
        remainder after it matches ``rest`` in full); how many were released.

        For a worker's parent process, which knows the task id of a killed child but not the
        random part of its token: ``rest`` keeps a task id that is the start of another one
        ("job:1" and "job:1:x") from releasing the other task's slots. Several round trips: for
        that rare path only."""
        return sum(self._release(token, None, 0) for token in self._tokens_with_prefix(prefix, rest))

    def _tokens_with_prefix(self, prefix: str, rest: re.Pattern[str] | None) -> list[str]:
        """The holder tokens ``_release_holders_with_prefix`` gives back, scanned from Redis."""
        pattern = token_prefix_pattern(prefix)
        with RedisErrors(self.name, "release"):
            tokens = [as_text(token) for token, _ in self.client.zscan_iter(self.keys.holders, match=pattern)]
        # offers ("!<waiter>") are not holders: they go to their waiter or lapse
        return [
            token for token in tokens if not is_offer(token) and (rest is None or rest.fullmatch(token[len(prefix) :]))
        ]

    def _renew_many(self, holders: list[Holder], *, reclaim: bool) -> list[int]:
        """Renew several (token, label, run) holders in one round trip; one RENEW_* code each.

        With ``reclaim``, a token that Redis no longer has (restarted empty, or the lease ran out
        during a stall) is registered again if a slot is free: it is still running, so it
        should count against the limit.
        """
        with RedisErrors(self.name, "renew"):
            reply = self._scripts.renew(
                self.keys, lease_ms=self._lease_ms, rules=self.rules, reclaim=reclaim, holders=holders
            )
        tell_to_wake(self, reply.to_wake, later=True)  # the renewer's thread: it must never block
        return reply.codes

    # -- inspecting and steering -----------------------------------------------------------

    def status(self, *, listed: int = STATUS_LISTING_LIMIT) -> SemaphoreStatus:
        """The limit in force, the holders and the line, from one read-only script.

        Counts are exact and cost O(log n) whatever the length of the line; at most ``listed``
        holders and waiters are listed (0: counts only, for a metrics scrape)."""
        with RedisErrors(self.name, "status"):
            reply = self._scripts.status(self.keys, listed=max(0, int(listed)), rules=self.rules)
        return status_of(self.name, self.limit, reply)

    def set_limit(self, limit: int, *, ttl: float | None = None) -> None:
        """Store a runtime limit that wins over the one given in code, for every process.

        The override is an operator's decision, so it is kept until cleared, unless ``ttl``
        (seconds) says otherwise. Slots a higher limit frees are offered to present waiters at
        once, in the same script."""
        check_limit("limit", limit)
        ttl_ms = None if ttl is None else to_ms(check_seconds("ttl", ttl))
        with RedisErrors(self.name, "set_limit"):
            to_wake = self._scripts.set_limit(self.keys, override=limit, ttl_ms=ttl_ms, rules=self.rules)
        tell_to_wake(self, to_wake)

    def clear_limit(self) -> None:
        """Drop the runtime override; the limit given in code applies again (and if that is
        higher, the slots it frees are offered at once)."""
        with RedisErrors(self.name, "clear_limit"):
            to_wake = self._scripts.set_limit(self.keys, override=None, ttl_ms=None, rules=self.rules)
        tell_to_wake(self, to_wake)

    def set_rate(self, rate: Rate | str | tuple[int, float] | None, *, ttl: float | None = None) -> None:
        """Store a runtime rate (``"500/m"``) that wins over the one given in code, for every
        process; None clears it (the rate given in code applies again). A quota cut for the rest
        of the day, say, with ``ttl`` in seconds."""
        checked = check_rate("rate", rate)
        self._set_gate("r", "" if checked is None else checked.arg, ttl)

    def set_spacing(self, spacing: float | None, *, ttl: float | None = None) -> None:
        """Store a runtime spacing (seconds between two starts); None clears it."""
        checked = check_spacing("spacing", spacing)
        self._set_gate("s", "" if checked is None else str(to_ms(checked)), ttl)

    def pause(self, seconds: float | None = None) -> None:
        """Let nobody start, anywhere, for ``seconds`` (None: until ``resume``): an API that
        answered 429 with ``Retry-After``. Holders keep running; waiters keep their places, and
        the head of the line is offered the moment the pause ends (it starts then, not at its
        next guess). Pausing again replaces the pause."""
        value = "0" if seconds is None else str(to_ms(check_seconds("seconds", seconds)))
        self._set_gate("p", value, None)

    def resume(self) -> None:
        """End a pause now: the head of the line may start at once."""
        self._set_gate("p", "", None)

    def tenants(self, *, most: int = 10) -> list[TenantInfo]:
        """The ``most`` tenants with the most calls waiting (their backlogs, from their clocks:
        O(log n) in waiters and tenants), largest first, with the shares in force. Empty when
        nobody waits or the key's calls name no tenant."""
        keys = self.keys
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.zrange(keys.queue, 0, 0, withscores=True)
            pipe.zrevrange(keys.tenants, 0, READ_PER_LISTED * max(1, most) - 1, withscores=True)
            pipe.hgetall(keys.shares)
            head, clocks, overrides = pipe.execute()
        except REDIS_ERRORS as error:
            raise translate(error, self.name, "tenants") from error
        return tenant_report(head, clocks, overrides, self.shares, most)

    def set_share(self, tenant: str, share: float | None) -> None:
        """Store a runtime share for ``tenant`` on this key, for every client at once (it wins
        over the ``shares`` settings); ``None`` removes it. It applies to calls that join the
        line from now on: those waiting keep their places."""
        key, tenant, value = self._share_override(tenant, share)
        try:
            if value is None:
                self.client.hdel(key, tenant)
            else:
                self.client.hset(key, tenant, value)
        except REDIS_ERRORS as error:
            raise translate(error, self.name, "set_share") from error

    def _set_gate(self, kind: str, value: str, ttl: float | None) -> None:
        ttl_ms = None if ttl is None else to_ms(check_seconds("ttl", ttl))
        with RedisErrors(self.name, "set_gate"):
            reply = self._scripts.set_gate(self.keys, kind=kind, value=value, ttl_ms=ttl_ms, rules=self.rules)
        tell_to_wake(self, reply.to_wake)

    def reset(self) -> None:
        """Forget every holder and waiter (the limit override stays). For operators recovering
        from a mistake, such as holders left by a test run against the wrong Redis. Holders that
        are still running register again at their next renewal while slots are free; those that
        find no free slot run uncounted (and are logged as lost) until they end. Blocked waiters
        notice at their next keep-alive ask (``patience / 3``) and come back by their ticket."""
        with RedisErrors(self.name, "reset"):
            self._scripts.reset(self.keys)
