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

This module imports neither Celery nor kombu: the semaphore works in any Python process.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import redis
import redis.cluster

from . import renewer
from .errors import ConfigurationError, LeaseLost, RedisUnavailable, SemaphoreError, SemaphoreUnavailable
from .renewer import RENEW_LOST
from .scripts import scripts_for
from .validation import check_limit, check_name, check_prefix, check_seconds, to_ms

logger = logging.getLogger("celery_semaphore")

# At most this many holders and waiters are listed by status(); the counts stay exact.
STATUS_LISTING_LIMIT = 1000

_LABEL = f"{socket.gethostname()}:{{pid}}"


def default_label() -> str:
    """Who holds a slot, as status() shows it: host and process id."""
    return _LABEL.format(pid=os.getpid())


def new_token() -> str:
    """A random holder token: nobody can guess it, so only its holder can release it."""
    return uuid.uuid4().hex


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


Attempt = Granted | Waiting


@dataclass(frozen=True)
class HolderInfo:
    token: str
    label: str
    held_for: float  # seconds since the slot was granted (server time)
    expires_in: float  # seconds of lease left


@dataclass(frozen=True)
class WaiterInfo:
    waiter: str
    position: int
    ticket: int
    waited: float  # seconds since the waiter first asked
    must_ask_within: float  # seconds before it loses its place unless it asks again
    present: bool  # asking now (True) or away on a countdown (False)


@dataclass(frozen=True)
class SemaphoreStatus:
    name: str
    limit: int  # the limit in force
    limit_source: str  # "override" (stored in Redis) or "default" (the limit given in code)
    holder_count: int
    waiter_count: int
    holders: list[HolderInfo]  # at most STATUS_LISTING_LIMIT entries, oldest deadline first
    waiters: list[WaiterInfo]  # at most STATUS_LISTING_LIMIT entries, in line order
    override_expires_in: float | None = None  # seconds a ttl'd override has left; None: no ttl


class Lease:
    """One held slot. Renewed in the background while held; a context manager that releases
    on exit. ``lost`` turns true when a renewal found the slot gone and could not take it back:
    from then on the holder no longer counts against the limit."""

    def __init__(self, semaphore: FairSemaphore, token: str, *, label: str) -> None:
        self.semaphore = semaphore
        self.token = token
        self.label = label
        # what metrics group this lease under: the semaphore name, or (set by the Celery layer)
        # the key template it came from, so per-host keys do not explode label cardinality
        self.family = semaphore.name
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

    def release(self) -> bool:
        """Give the slot back. True if it was still held; False if the lease had already gone.
        Safe to call more than once."""
        if self.released:
            return False
        with renewer.cycle_lock():
            # Once forgotten, no renewal (which may register a missing token again) can run for
            # this token, so the release below cannot be undone by a renewal in flight.
            self.released = True
            renewer.forget(self)
        return self.semaphore.release(self.token)

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
    ) -> None:
        if not isinstance(client, (redis.Redis, redis.cluster.RedisCluster)):
            raise ConfigurationError(
                "client", client, "expected a redis.Redis or redis.cluster.RedisCluster client"
            )
        self.client = client
        self.name = check_name("name", name)
        self.limit = check_limit("limit", limit)
        self.lease = check_seconds("lease", lease)
        self.prefix = check_prefix("prefix", prefix)
        self.patience = check_seconds("patience", patience)
        base = f"{self.prefix}:{{{self.name}}}"
        # Order matters: the Lua scripts read KEYS by position (see lua/_lib.lua).
        self.keys = [
            f"{base}:{part}"
           for part in ("holders", "queue", "seen", "ticket", "limit", "since", "present")
        ]
        self.channel = f"{base}:wake"
        self._scripts = scripts_for(client)

    def __repr__(self) -> str:
        return f"<FairSemaphore {self.name!r} limit={self.limit} lease={self.lease}>"

    # -- acquiring -------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None, *, label: str | None = None) -> Lease:
        """Wait for a slot: up to ``timeout`` seconds (None: as long as it takes; 0: one try
        that never queues). Raises SemaphoreUnavailable when the time runs out.

        The returned Lease is a context manager: ``with sem.acquire(timeout=10): ...``. While
        blocked, the waiter sleeps on the semaphore's wake-up channel, so a release wakes it at
        once; it also asks again every ``patience / 3`` seconds to keep its place in line.
        """
        if timeout is not None:
            timeout = check_seconds("timeout", timeout, allow_zero=True)
        started = time.monotonic()
        token, waiter = new_token(), new_token()
        if timeout == 0:
            attempt = self.try_acquire(token=token, waiter=waiter, enqueue=False, label=label)
            if isinstance(attempt, Granted):
                return attempt.lease
            raise SemaphoreUnavailable(self.name, attempt.limit, time.monotonic() - started)
        try:
            attempt = self.wait_for_slot(token=token, waiter=waiter, timeout=timeout, label=label)
        except BaseException:
            self._leave_quietly(waiter)
            raise
        if isinstance(attempt, Granted):
            return attempt.lease
        self._leave_quietly(waiter)
        raise SemaphoreUnavailable(self.name, attempt.limit, time.monotonic() - started)

    def wait_for_slot(
        self,
        *,
        token: str,
        waiter: str,
        timeout: float | None,
        patience: float | None = None,
        label: str | None = None,
        ticket: int | None = None,
    ) -> Attempt:
        """Try, then sleep on the wake-up channel and try again on every release, until granted
        or ``timeout`` seconds pass (None: no bound). Returns the last try; a waiter that runs
        out of time keeps its place in line (call ``leave`` to give it up)."""
        started = time.monotonic()
        patience_s = self.patience if patience is None else patience
        with self._wake_ups() as wait_for_wake_up:
            while True:
                attempt = self.try_acquire(token=token, waiter=waiter, patience=patience_s, label=label, ticket=ticket)
                if isinstance(attempt, Waiting):
                    ticket = attempt.ticket  # if the place ever lapses, come back to it
                waited = time.monotonic() - started
                if isinstance(attempt, Granted) or (timeout is not None and waited >= timeout):
                    return attempt
                pause = patience_s / 3
                if timeout is not None:
                    pause = min(pause, timeout - waited)
                wait_for_wake_up(pause)

    def try_acquire(
        self,
        *,
        token: str | None = None,
        waiter: str | None = None,
        patience: float | None = None,
        enqueue: bool = True,
        label: str | None = None,
        ticket: int | None = None,
    ) -> Attempt:
        """One try, one round trip: Granted with a Lease, or Waiting with the place in line.

        Pass the same ``waiter`` on every try to keep the place in line; ``token`` names the
        slot if granted (a repeat with the same token is granted again, not twice). With
        ``enqueue=False`` a new waiter does not take a ticket: it gets a slot only if every
        waiter in line would get one too. A waiter that left the line (to sleep elsewhere, not
        blocking those behind it) comes back to its old place by passing its old ``ticket``.
        """
        token = token or new_token()
        if waiter is None:
            # nobody will ask again under a fresh waiter id: a ticket would only block the line
            waiter, enqueue = token, False
        label = default_label() if label is None else label
        patience_s = self.patience if patience is None else check_seconds("patience", patience)
        granted, position, free, limit, hold_ms, ticket_text, turn = self._run(
            "acquire",
            self._scripts.acquire,
            [token, waiter, self.limit, to_ms(self.lease), to_ms(patience_s), int(enqueue), label,
             "" if ticket is None else int(ticket)],
        )
        if granted == 1:
            lease = Lease(self, token, label=label)
            renewer.track(lease)
            return Granted(lease)
        if granted == 0:
            hold_time = int(hold_ms) / 1000 if int(hold_ms) >= 0 else None
            ticket_value = int(float(ticket_text)) if _text(ticket_text) else None
            return Waiting(
                int(position), int(free), int(limit), hold_time=hold_time, ticket=ticket_value, turn=int(turn)
            )
        raise SemaphoreError(f"acquire on {self.name!r} returned unknown code {granted!r}", key=self.name)

    def leave(self, waiter: str, *, away_for: float | None = None) -> bool:
        """Step out of line at once, so those behind move up. True if it was in line.

        With ``away_for`` (seconds) the waiter keeps its place and shows in status while away,
        but slots pass it by until it asks again; if it does not ask within ``away_for`` its
        place lapses. A Celery task sleeping through a countdown steps away like this."""
        away = "" if away_for is None else to_ms(check_seconds("away_for", away_for))
        return bool(self._run("leave", self._scripts.leave, [waiter, away]))

    # -- holding ---------------------------------------------------------------------------

    def release(self, token: str) -> bool:
        """Give a slot back by its token. True if the token held it; False if its lease had
        already gone. Safe to repeat. Prefer ``Lease.release``, which also stops renewal."""
        return bool(self._run("release", self._scripts.release, [token]))

    def release_holders_with_prefix(self, prefix: str) -> int:
        """Release every holder whose token starts with ``prefix``; how many were released.

        For a worker's parent process, which knows the task id of a killed child but not the
        random part of its token. Several round trips: for that rare path only."""
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "*"
        with self._redis_errors("release"):
            tokens = [_text(token) for token, _ in self.client.zscan_iter(self.keys[0], match=pattern)]
        return sum(self.release(token) for token in tokens)

    def renew(self, token: str) -> bool:
        """Extend one token's lease by ``lease`` seconds from now; False if it was lost."""
        return self.renew_many([(token, "")], reclaim=False)[0] != RENEW_LOST

    def renew_many(self, holders: list[tuple[str, str]], *, reclaim: bool) -> list[int]:
        """Renew several (token, label) holders in one round trip; one RENEW_* code each.

        With ``reclaim``, a token that Redis no longer has (restarted empty, or the lease ran
        out during a stall) is registered again if a slot is free: it is still running, so it
        should count against the limit.
        """
        argv: list[Any] = [to_ms(self.lease), self.limit, int(reclaim)]
        for token, label in holders:
            argv += [token, label]
        codes = self._run("renew", self._scripts.renew, argv)
        return [int(code) for code in codes]

    # -- inspecting and steering -----------------------------------------------------------

    def status(self) -> SemaphoreStatus:
        """The limit in force, the holders and the line, from one read-only script."""
        now, override, holder_count, waiter_count, holders, waiters, override_ttl = self._run(
            "status", self._scripts.status, [STATUS_LISTING_LIMIT], channel=False
        )
        now = int(now)
        holder_list = []
        for i in range(0, len(holders), 3):
            granted_ms, _, label = _text(holders[i + 2]).partition("|")
            holder_list.append(
                HolderInfo(
                    token=_text(holders[i]),
                    label=label,
                    held_for=(now - int(granted_ms or now)) / 1000,
                    expires_in=(float(holders[i + 1]) - now) / 1000,
                )
            )
        waiter_list = []
        for i in range(0, len(waiters), 5):
            first_ask = _text(waiters[i + 3]) or str(now)
            waiter_list.append(
                WaiterInfo(
                    waiter=_text(waiters[i]),
                    position=i // 5,
                    ticket=int(float(waiters[i + 1])),
                    waited=(now - int(first_ask)) / 1000,
                    must_ask_within=(float(waiters[i + 2]) - now) / 1000,
                    present=bool(int(waiters[i + 4])),
                )
            )
        return SemaphoreStatus(
            name=self.name,
            limit=int(override) if override else self.limit,
            limit_source="override" if override else "default",
            holder_count=int(holder_count),
            waiter_count=int(waiter_count),
            holders=holder_list,
            waiters=waiter_list,
            override_expires_in=int(override_ttl) / 1000 if int(override_ttl) >= 0 else None,
        )

    def set_limit(self, limit: int, *, ttl: float | None = None) -> None:
        """Store a runtime limit that wins over the one given in code, for every process.

        The override is an operator's decision, so it is kept until cleared, unless ``ttl``
        (seconds) says otherwise. Waiters are woken: a higher limit may admit some at once.
        """
        check_limit("limit", limit)
        px = None if ttl is None else to_ms(check_seconds("ttl", ttl))
        with self._redis_errors("set_limit"):
            pipe = self.client.pipeline(transaction=True)
            pipe.set(self.keys[4], limit, px=px)
            pipe.publish(self.channel, "1")
            pipe.execute()

    def clear_limit(self) -> None:
        """Drop the runtime override; the limit given in code applies again."""
        with self._redis_errors("clear_limit"):
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self.keys[4])
            pipe.publish(self.channel, "1")
            pipe.execute()

    def reset(self) -> None:
        """Forget every holder and waiter (the limit override stays). For operators recovering
        from a mistake, such as holders left by a test run against the wrong Redis. Holders that
        are still running register again at their next renewal while slots are free; those that
        find no free slot run uncounted (and are logged as lost) until they end."""
        with self._redis_errors("reset"):
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(*(key for key in self.keys if key != self.keys[4]))
            pipe.publish(self.channel, "1")
            pipe.execute()

    # -- plumbing --------------------------------------------------------------------------

    def _run(self, operation: str, script: Any, argv: list[Any], *, channel: bool = True) -> Any:
        args = [self.channel, *argv] if channel else argv
        with self._redis_errors(operation):
            return script(keys=self.keys, args=args)

    @contextmanager
    def _redis_errors(self, operation: str) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as error:
            raise RedisUnavailable(self.name, operation, error) from error
        except redis.ResponseError as error:
            # a full Redis (maxmemory with noeviction) or one still loading its data set is
            # unavailable for now, like an unreachable one: callers wait, they do not fail
            if isinstance(error, _NOT_NOW) or str(error).startswith(("OOM", "LOADING", "BUSY", "MASTERDOWN")):
                raise RedisUnavailable(self.name, operation, error) from error
            raise SemaphoreError(f"{operation} on semaphore {self.name!r}: {error}", key=self.name) from error
        except redis.RedisError as error:
            raise SemaphoreError(f"{operation} on semaphore {self.name!r}: {error}", key=self.name) from error

    @contextmanager
    def _wake_ups(self) -> Iterator[Callable[[float], None]]:
        """Subscribe to the wake-up channel for the duration of a blocking acquire.

        Subscribing before the first try means a release between a refused try and the wait
        is not missed: its message is already queued on the subscription.
        """
        with self._redis_errors("acquire"):
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            pubsub.subscribe(self.channel)

        def wait_for_wake_up(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            with self._redis_errors("acquire"):
                while (left := deadline - time.monotonic()) > 0:
                    if pubsub.get_message(timeout=left) is not None:
                        # drain what else arrived: one try answers every queued wake-up
                        while pubsub.get_message(timeout=0) is not None:
                            pass
                        return

        try:
            yield wait_for_wake_up
        finally:
            pubsub.close()

    def _leave_quietly(self, waiter: str) -> None:
        try:
            self.leave(waiter)
        except SemaphoreError:
            logger.warning("could not leave the line of %r; the place lapses by itself", self.name)


# Answers that mean "not now" rather than "wrong": the caller should wait and try again.
_NOT_NOW = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
