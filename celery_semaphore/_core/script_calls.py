"""The calls of the single-semaphore scripts, apart from who runs them: for each script, what
to send (KEYS and ARGV) and what its reply means.

The blocking ``Scripts`` and the asyncio ``AsyncScripts`` run the same calls, the one with
``client.evalsha`` and the other with ``await client.evalsha``. So the contract of each script is
written once, here, as a function with keyword-only arguments that returns a ``ScriptCall``: the
script's name, its keys, its arguments, and the parser of its reply into a named result. A caller
never builds ARGV or unpacks a reply by position itself, whichever client it has.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .replies import (
    BARE_REPLIES,
    AcquireReply,
    GateReply,
    GateState,
    HandOffReply,
    Holder,
    ListedHolder,
    ListedWaiter,
    RenewReply,
    StatusReply,
    hand_off_reply,
    renew_reply,
    waiters_of,
)
from .rules import Rules
from .script_args import number
from .storage import CLAIMED, FREE, GRANTED, INFO_SEPARATOR, RUNNING, as_text

if TYPE_CHECKING:
    from .scripts import SemaphoreKeys

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class ScriptCall(Generic[R]):
    """One call of one script: run ``name`` with ``keys`` and ``args``, then ``parse`` its reply."""

    name: str
    keys: list[bytes]
    args: list[Any]
    parse: Callable[[Any], R]


@dataclass(frozen=True)
class LineArgs:
    """How a new waiter takes its place, beyond its arrival (ARGV[8..10] of lua/acquire.lua):
    ``tenant`` "<share>|<tenant>" or ""; ``priority_ms`` placed that much earlier; ``full``
    "<max waiters>|<policy>|<coalesce key>" or "". Absent (None) for a plain call, which then
    sends none of it."""

    tenant: str = ""
    priority_ms: int = 0
    full: str = ""


# acquire's enqueue flag (in ARGV[3]) for a task being sent: take a place, never a slot
PLACING = 2


def acquire(
    keys: SemaphoreKeys,
    *,
    token: str,
    waiter: str,
    rules: Rules,
    lease_ms: int,
    patience_ms: int,
    enqueue: int,
    fresh: bool,
    label: str,
    ticket: int | None,
    wake: str,
    run: str = "",
    remember_ms: int = 0,
    line: LineArgs | None = None,
    at_most_once: bool = False,
) -> ScriptCall[AcquireReply]:
    encoded = token.encode()
    if at_most_once:  # sent negative: the grant records the run finished (see acquire.lua)
        remember_ms = -remember_ms
    args: list[Any] = [
        encoded,
        encoded if waiter is token else waiter.encode(),
        settings(rules.arg, lease_ms, patience_ms, enqueue, fresh, label),
    ]
    # trailing arguments that are empty are not sent (the script reads them as ""): the
    # uncontended acquire of a blocked caller or a one-shot try sends three
    if line is not None:  # who the call is for, how early it goes, what a full line does
        args += [b"" if ticket is None else number(int(ticket)), wake, run, number(remember_ms), line.tenant]
        args += [number(line.priority_ms) if line.priority_ms else b"", line.full]
        return ScriptCall("acquire", keys.policy_keys if line.full else keys.tenant_keys, args, acquire_reply)
    if run:
        args += [b"" if ticket is None else number(int(ticket)), wake, run, number(remember_ms)]
    elif wake:
        args += [b"" if ticket is None else number(int(ticket)), wake]
    elif ticket is not None:
        args.append(number(int(ticket)))
    return ScriptCall("acquire", keys.encoded if run else keys.line_keys, args, acquire_reply)


def acquire_reply(reply: Any) -> AcquireReply:
    if not isinstance(reply, list):
        return BARE_REPLIES.get(int(reply)) or AcquireReply(int(reply), 0, 0, 0, -1, None, 0)
    code = int(reply[0])
    if code == RUNNING:  # with the lease left of the copy that runs
        return AcquireReply(code, 0, 0, 0, -1, None, 0, twin_lease_ms=int(reply[1]))
    if code == FREE:  # placing: offered the start it would take now, under this ticket ("": none)
        text = as_text(reply[1])
        ticket = int(float(text)) if text else None
        return AcquireReply(code, 0, 0, 0, -1, ticket, 0, to_wake=waiters_of(reply[2:]))
    if code in (GRANTED, CLAIMED):  # a grant that handed slots to waiters its caller wakes
        return AcquireReply(code, 0, 0, 0, -1, None, 0, to_wake=waiters_of(reply[1:]))
    outcome, position, free, limit, hold_ms, ticket_text, turn, retry_ms, opens_ms = reply[:9]
    text = as_text(ticket_text)
    return AcquireReply(
        outcome=int(outcome),
        position=int(position),
        free=int(free),
        limit=int(limit),
        hold_ms=int(hold_ms),
        ticket=int(float(text)) if text else None,
        turn=int(turn),
        to_wake=waiters_of(reply[9:]),
        retry_ms=int(retry_ms),
        opens_ms=int(opens_ms),
    )


def release(
    keys: SemaphoreKeys,
    *,
    token: str,
    rules: Rules,
    run: str = "",
    remember_ms: int = 0,
    caller_takes_parked: bool = False,
) -> ScriptCall[HandOffReply]:
    named = keys.encoded if run else keys.line_keys  # a run: its records too
    if caller_takes_parked:
        return ScriptCall("release", named, [token, rules.arg, run, number(remember_ms), "1"], hand_off_reply)
    if run:
        return ScriptCall("release", named, [token, rules.arg, run, number(remember_ms)], hand_off_reply)
    return ScriptCall("release", named, [token, rules.arg], hand_off_reply)


def renew(
    keys: SemaphoreKeys, *, lease_ms: int, rules: Rules, reclaim: bool, holders: list[Holder]
) -> ScriptCall[RenewReply]:
    args: list[Any] = [lease_ms, rules.arg, int(reclaim), *(part for holder in holders for part in holder)]
    named = keys.encoded if any(run for _, _, run in holders) else keys.line_keys  # runs: their records too
    count = len(holders)
    return ScriptCall("renew", named, args, lambda reply: renew_reply(reply, count))


def leave(
    keys: SemaphoreKeys, *, waiter: str, away_ms: int | None, rules: Rules, wake: str = ""
) -> ScriptCall[HandOffReply]:
    args = [waiter, "" if away_ms is None else away_ms, rules.arg, wake]
    return ScriptCall("leave", keys.line_keys, args, hand_off_reply)


def status(keys: SemaphoreKeys, *, listed: int, rules: Rules) -> ScriptCall[StatusReply]:
    return ScriptCall("status", keys.line_keys, [listed, rules.arg], status_reply)


def status_reply(reply: Any) -> StatusReply:
    now, override, ttl, holder_count, offered_count, waiter_count, holders, waiters, gate = reply
    listed_holders = []
    for i in range(0, len(holders), 3):
        granted, _, label = as_text(holders[i + 2]).partition(INFO_SEPARATOR)
        listed_holders.append(
            ListedHolder(
                token=as_text(holders[i]),
                deadline_ms=int(float(holders[i + 1])),
                granted_ms=int(granted) if granted else None,
                label=label,
            )
        )
    listed_waiters = []
    for i in range(0, len(waiters), 5):
        first = as_text(waiters[i + 3])
        listed_waiters.append(
            ListedWaiter(
                waiter=as_text(waiters[i]),
                ticket=int(float(waiters[i + 1])),
                must_ask_by_ms=int(float(waiters[i + 2])),
                first_ask_ms=int(first) if first else None,
                state=int(waiters[i + 4]),
            )
        )
    return StatusReply(
        now_ms=int(now),
        override=int(override) if override else None,
        override_ttl_ms=int(ttl),
        holder_count=int(holder_count),
        offered_count=int(offered_count),
        waiter_count=int(waiter_count),
        holders=listed_holders,
        waiters=listed_waiters,
        gate=GateState(
            rate_count=int(gate[0]),
            rate_ms=int(gate[1]),
            spacing_ms=int(gate[2]),
            paused_ms=int(gate[3]),
            next_start_ms=int(gate[4]),
            starts_in_window=int(gate[5]),
            override=as_text(gate[6]) if gate[6] else None,
        ),
    )


def set_limit(
    keys: SemaphoreKeys, *, override: int | None, ttl_ms: int | None, rules: Rules
) -> ScriptCall[tuple[str, ...]]:
    """The waiters the new limit offered a slot whose wake-up nobody heard (see set_limit.lua)."""
    args = ["" if override is None else override, "" if ttl_ms is None else ttl_ms, rules.arg]
    return ScriptCall("set_limit", keys.line_keys, args, lambda reply: waiters_of(reply[1:]))


def set_gate(keys: SemaphoreKeys, *, kind: str, value: str, ttl_ms: int | None, rules: Rules) -> ScriptCall[GateReply]:
    """Store (``value``) or clear (``""``) one runtime rule: ``kind`` "r" a rate ``<count>/<ms>``,
    "s" a spacing ``<ms>``, "p" a pause ``<ms>`` from now ("0": until resumed)."""
    args = [kind, value, "" if ttl_ms is None else ttl_ms, rules.arg]
    return ScriptCall("set_gate", keys.line_keys, args, gate_reply)


def gate_reply(reply: Any) -> GateReply:
    limit, rate_count, rate_ms, spacing_ms, paused_ms = (int(value) for value in reply[:5])
    return GateReply(limit, rate_count, rate_ms, spacing_ms, paused_ms, to_wake=waiters_of(reply[5:]))


def reset(keys: SemaphoreKeys) -> ScriptCall[int]:
    return ScriptCall("reset", keys.tenant_keys, [], int)  # the run records and tenants' clocks too


@functools.lru_cache(maxsize=1024)
def settings(rules: bytes, lease_ms: int, patience_ms: int, enqueue: int, fresh: bool, label: str) -> bytes:
    """acquire's ARGV[3]: the arguments that rarely change between calls, packed once (see
    lua/acquire.lua): every argument sent costs the client a trip through redis-py's encoder."""
    return b"%s|%d|%d|%d%d|%s" % (rules, lease_ms, patience_ms, enqueue, fresh, label.encode())
