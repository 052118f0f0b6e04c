"""Where one waiter or holder stands on a semaphore, and what holds it back: the core of
``celery semaphore why`` (``_celery/why.py`` finds a task's keys, this reads them).

Read-only and bounded: each key is one run of ``lua/why.lua`` (no script that writes), and all
the keys of one question go in one pipeline, so an answer costs one round trip to the semaphore's
Redis whatever the length of the lines (on a Redis Cluster, whose pipelines refuse scripts, one
round trip per key). ``blocked_by`` is a pure function of what was read, so
that a rule added to the line later (tenants, priorities) adds a reason here and a field to the
script, and nothing else changes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError

from .rules import UNLIMITED
from .scripts import SemaphoreKeys, script_source
from .status import LONG_PAUSE_MS
from .storage import INFO_SEPARATOR, PARKED_MARK, as_text, is_extra_slot

# At most this many holders, and waiters just ahead, are listed per key.
LISTED = 5

# What holds a waiter back now, the first that applies (see ``blocked_by``).
PAUSE, LIMIT, RATE, SPACING, LINE = "pause", "limit", "rate", "spacing", "line"
TENANT_CAP = "tenant_cap"  # its tenant holds the key's cap per tenant (per_tenant)


@dataclass(frozen=True)
class Holding:
    token: str
    label: str  # who holds it: host, pid, task name and id, as the worker wrote it
    held_for: float  # seconds since the slot was granted
    lease_left: float  # seconds of lease left unless renewed


@dataclass(frozen=True)
class Place:
    position: int  # 0-based place in line, waiters away included
    ticket: int
    waited: float | None  # seconds since it first asked
    must_ask_within: float  # seconds its place is kept unless a copy of it asks
    present: bool  # asking now, or parked (offered its turn like a present waiter)
    parked: bool  # left the workers; its wake copy is sent when a slot is offered to it
    offer_opens_in: float | None  # None: no slot offered to it; else seconds until it may claim it
    tenant: str | None = None  # its tenant, as kept on a key with a cap per tenant
    tenant_slots: int = 0  # the slots that tenant holds now (offers included)


@dataclass(frozen=True)
class Gate:
    paused_for: float  # seconds the pause has left (0: not paused)
    spacing_wait: float  # seconds until the spacing allows a start (0: now)
    rate_wait: float  # seconds until the rate's window allows a start (0: now)
    rate_count: int
    rate_period: float
    spacing: float


@dataclass(frozen=True)
class KeyView:
    """One semaphore as one waiter or holder sees it."""

    key: str
    held: list[Holding]
    place: Place | None
    holder_count: int
    offered_count: int
    waiter_count: int
    limit: int
    gate: Gate
    hold_time: float | None  # moving average of recent hold times (seconds); None: none seen yet
    holders: list[Holding] = field(default_factory=list)  # the first few, by lease deadline
    per_tenant: int | None = None  # the key's cap per tenant; None: none
    ahead: list[str] = field(default_factory=list)  # the waiters just ahead of it, nearest last

    @property
    def free(self) -> int:
        """Slots neither held nor offered."""
        return max(0, self.limit - self.holder_count - self.offered_count)

    def blocked_by(self) -> str:
        """What holds the waiter back now, the first of: a pause; for the head of the line (or a
        waiter offered a slot, or one within the free slots), no free slot, then the spacing or
        the rate (whichever opens later); for everyone else, the line ahead. A waiter whose
        turn it is, a slot free and allowed, waits for its own copy to come and claim it: the
        line (its place in it) is all that is left. Under a cap per tenant, a waiter not offered
        a slot whose tenant holds the cap is held back by the cap, before anything but a pause."""
        assert self.place is not None
        place, gate = self.place, self.gate
        if gate.paused_for > 0:
            return PAUSE
        capped = self.per_tenant is not None and place.tenant is not None and place.tenant_slots >= self.per_tenant
        if capped and place.offer_opens_in is None:
            return TENANT_CAP
        gated = gate.rate_wait > 0 or gate.spacing_wait > 0
        offered = place.offer_opens_in is not None
        head = offered or place.position == 0 or (not gated and place.position < self.free)
        if not head:
            return LINE
        if not offered and self.free == 0:
            return LIMIT
        if gated and (not offered or (place.offer_opens_in or 0) > 0):
            return SPACING if gate.spacing_wait >= gate.rate_wait else RATE
        return LINE

    def estimate(self) -> float | None:
        """A rough estimate of the seconds until the waiter starts: the slots it needs freed at
        the recent hold time (or, none seen yet, the age of the current holders), the rate's
        windows and the spacings of the starts ahead of it, the pause. None when nothing to go
        by; ``math.inf`` for a pause until resumed."""
        assert self.place is not None
        position, gate = self.place.position, self.gate
        if gate.paused_for >= LONG_PAUSE_MS / 1000:
            return math.inf
        guesses = [gate.paused_for]
        if self.place.offer_opens_in is not None:
            return max(gate.paused_for, self.place.offer_opens_in)
        limited = self.limit < UNLIMITED
        needed = position - self.free + 1
        if limited and needed > 0:
            hold = self.hold_time
            if hold is None and self.holders:
                hold = sum(h.held_for for h in self.holders) / len(self.holders)
            if hold is None:
                return None
            guesses.append(math.ceil(needed / max(1, self.limit)) * hold)
        if gate.rate_count:
            guesses.append(gate.rate_wait + (position // gate.rate_count) * gate.rate_period)
        if gate.spacing:
            guesses.append(gate.spacing_wait + position * gate.spacing)
        return max(guesses)


@dataclass(frozen=True)
class Look:
    """One key to look at: its keys, the waiter id and token pattern to look for, its rules."""

    key: str
    keys: SemaphoreKeys
    waiter: str
    tokens: str  # ZSCAN MATCH pattern of the holder tokens
    rules: bytes


_SOURCE = script_source("why")
_SHA = hashlib.sha1(_SOURCE.encode("utf-8")).hexdigest()


def look(client: Any, looks: Sequence[Look]) -> list[KeyView]:
    """Read every key of ``looks``: one pipeline of read-only scripts, one round trip (two the
    first time a server sees the script: it is loaded, then the pipeline runs again); on a
    cluster, one script call per key."""
    if not looks:
        return []
    if isinstance(client, RedisCluster):
        # a cluster pipeline refuses EVALSHA: one script per key, each one round trip
        return [_view(item.key, _run(client, item)) for item in looks]
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        for item in looks:
            pipe.evalsha(_SHA, 10, *item.keys.line_keys, item.waiter, item.tokens, item.rules, LISTED)
        replies = pipe.execute(raise_on_error=False)
        if attempt == 0 and any(isinstance(reply, NoScriptError) for reply in replies):
            client.script_load(_SOURCE)
            continue
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return [_view(item.key, reply) for item, reply in zip(looks, replies, strict=True)]
    raise AssertionError("unreachable")  # pragma: no cover


def _run(client: Any, item: Look) -> Any:
    args = (*item.keys.line_keys, item.waiter, item.tokens, item.rules, LISTED)
    try:
        return client.evalsha(_SHA, 10, *args)
    except NoScriptError:
        client.script_load(_SOURCE)
        return client.evalsha(_SHA, 10, *args)


def _holdings(flat: list[Any], now: int) -> list[Holding]:
    out = []
    for i in range(0, len(flat), 3):
        token = as_text(flat[i])
        if is_extra_slot(token):
            continue
        granted, _, label = as_text(flat[i + 2]).partition(INFO_SEPARATOR)
        out.append(
            Holding(
                token=token,
                label=label,
                held_for=(now - int(granted)) / 1000 if granted else 0.0,
                lease_left=(int(float(flat[i + 1])) - now) / 1000,
            )
        )
    return out


def _view(key: str, reply: list[Any]) -> KeyView:
    now_ms, held, place, counts, gate, hold_ms, holders, ahead = reply
    now = int(now_ms)
    where = None
    if place:
        rank, ticket, must_ask_by, info, present, offer, tenant, tenant_slots = place
        first, _, address = as_text(info).partition(INFO_SEPARATOR)
        offer_ms = int(offer)
        where = Place(
            position=int(rank),
            ticket=int(float(ticket)),
            waited=(now - int(first)) / 1000 if first else None,
            must_ask_within=(int(must_ask_by) - now) / 1000,
            present=bool(int(present)),
            parked=address.startswith(PARKED_MARK),
            # an offer's claim window opens CLAIM_MS (2 s) before its deadline
            offer_opens_in=max(0.0, (offer_ms - 2000 - now) / 1000) if offer_ms else None,
            tenant=as_text(tenant) or None,
            tenant_slots=int(tenant_slots),
        )
    paused, spacing_left, rate_left, rate_count, rate_ms, spacing_ms = (int(x) for x in gate)
    return KeyView(
        key=key,
        held=_holdings(held, now),
        place=where,
        holder_count=int(counts[0]),
        offered_count=int(counts[1]),
        waiter_count=int(counts[2]),
        limit=int(counts[3]),
        gate=Gate(
            paused_for=paused / 1000,
            spacing_wait=spacing_left / 1000,
            rate_wait=rate_left / 1000,
            rate_count=rate_count,
            rate_period=rate_ms / 1000,
            spacing=spacing_ms / 1000,
        ),
        hold_time=int(hold_ms) / 1000 if int(hold_ms) >= 0 else None,
        holders=_holdings(holders, now),
        ahead=[as_text(ahead[i]) for i in range(0, len(ahead), 2)],
        per_tenant=int(counts[4]) or None,
    )


@dataclass(frozen=True)
class WaitState:
    """Where a parked wait stands, for a sweep."""

    granted: bool  # a copy of it was granted its slot (it runs or ran): nothing to send, ever
    left_ms: int | None  # its place in line lasts this much longer (a copy asked, or it is still
    # parked within its time); None: its place lapsed with no copy asking, so its copies are lost


def wait_state(client: Any, deadlines_key: str, runs_key: str, waiter: str, run: str) -> WaitState:
    """Where a waiter that stepped away stands, read from the keys of its semaphore (a parked
    record names them): for a caller that holds no semaphore object for it, such as a sweep of
    parked Celery tasks."""
    return wait_states(client, [(deadlines_key, runs_key, waiter, run)])[0]


def wait_states(client: Any, waits: Sequence[tuple[str, str, str, str]]) -> list[WaitState]:
    """``wait_state`` of each of ``waits`` (deadlines key, runs key, waiter, run), in one round
    trip: a sweep takes a hundred records at once."""

    def reads(pipe: Any) -> None:
        for deadlines_key, runs_key, waiter, run in waits:
            pipe.zscore(deadlines_key, waiter)
            pipe.hexists(runs_key, run)

    now_ms, replies = _read_at_server_time(client, reads)
    states = []
    for deadline_ms, granted in zip(replies[::2], replies[1::2], strict=True):
        left = None if deadline_ms is None or float(deadline_ms) <= now_ms else int(float(deadline_ms)) - now_ms
        states.append(WaitState(granted=bool(granted), left_ms=left))
    return states


def run_finished(client: Any, runs_key: str, run_expiry_key: str, run: str) -> bool:
    """Whether ``run`` finished, as the acquire script judges it (``run_taken`` in
    ``lua/_lib.lua``: recorded as "" and not yet forgotten), read from the keys of its semaphore:
    for a caller that holds a copy of the run and no semaphore script, such as a RabbitMQ
    worker holding a backstop copy until it falls due."""
    now_ms, (value, forget_at) = _read_at_server_time(
        client, lambda pipe: (pipe.hget(runs_key, run), pipe.zscore(run_expiry_key, run))
    )
    return value is not None and not value and forget_at is not None and float(forget_at) > now_ms


def _read_at_server_time(client: Any, reads: Callable[[Any], Any]) -> tuple[int, list[Any]]:
    """The server's time in ms and the replies of ``reads`` (queued on a pipeline), in one round
    trip: the keys' deadlines are in that clock, not in this host's."""
    pipe = client.pipeline(transaction=False)
    pipe.time()
    reads(pipe)
    (seconds, micros), *replies = pipe.execute()
    return int(seconds) * 1000 + int(micros) // 1000, replies
