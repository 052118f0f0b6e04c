"""The calls of the scripts over several semaphores (``MultiSemaphore``, ``AsyncMultiSemaphore``),
apart from who runs them: 10 keys each, semaphore after semaphore, and on a cluster all in one
hash slot.

As ``script_calls`` for the single-semaphore scripts: a builder per script returns a
``ScriptCall`` that the blocking ``Scripts`` runs and the asyncio ``AsyncScripts`` awaits, so the
ARGV of acquire_many, release_many, renew_many and leave_many and the meaning of their replies
are written once, whichever client sends them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .replies import HandOffReply, Holder, ManyReply, RenewReply, hand_off_reply, renew_reply, waiters_of
from .script_args import number
from .script_calls import ScriptCall
from .storage import GRANTED, TOO_HEAVY, as_text

if TYPE_CHECKING:
    from .attempts import Ask
    from .rules import Rules
    from .scripts import SemaphoreKeys


def acquire_many(
    keys: list[SemaphoreKeys], ask: Ask, *, rules: list[Rules], lease_ms: int, patience_ms: int, remember_ms: int
) -> ScriptCall[ManyReply]:
    """One try of ``ask``, its token, waiter id and label already as the lines store them."""
    mode = (b"2" if ask.fresh else b"1") if ask.enqueue else b"0"
    args: list[Any] = [ask.token, ask.waiter, number(lease_ms), number(patience_ms), mode, ask.label or ""]
    args += [b"" if ask.ticket is None else number(int(ask.ticket)), ask.wake, number(len(keys))]
    args += [each.arg for each in rules]
    if ask.run:
        args += [ask.run, number(remember_ms)]
    return ScriptCall("acquire_many", _many_keys(keys, with_runs=bool(ask.run)), args, many_reply)


def many_reply(reply: Any) -> ManyReply:
    if not isinstance(reply, list):
        return ManyReply(int(reply), 0, 0, 0, 0, None)
    if int(reply[0]) == TOO_HEAVY:
        return ManyReply(TOO_HEAVY, 0, 0, int(reply[2]), int(reply[1]), None)
    if int(reply[0]) == GRANTED:  # a grant that handed slots on to waiters its caller wakes
        return ManyReply(GRANTED, 0, 0, 0, 0, None, to_wake=waiters_of(reply[1:]))
    outcome, position, free, limit, index, ticket_text, retry_ms = reply[:7]
    text = as_text(ticket_text)
    return ManyReply(
        int(outcome),
        int(position),
        int(free),
        int(limit),
        int(index),
        int(float(text)) if text else None,
        retry_ms=int(retry_ms),
        to_wake=waiters_of(reply[7:]),
    )


def release_many(
    keys: list[SemaphoreKeys], *, token: str, rules: list[Rules], run: str = "", remember_ms: int = 0
) -> ScriptCall[HandOffReply]:
    args: list[Any] = [token, number(len(keys)), *(each.arg for each in rules)]
    if run:
        args += [run, number(remember_ms)]
    return ScriptCall("release_many", _many_keys(keys, with_runs=bool(run)), args, hand_off_reply)


def renew_many(
    keys: list[SemaphoreKeys], *, lease_ms: int, rules: list[Rules], reclaim: bool, holders: list[Holder]
) -> ScriptCall[RenewReply]:
    args: list[Any] = [lease_ms, int(reclaim), len(keys), *(each.arg for each in rules)]
    args += [part for holder in holders for part in holder]
    named = _many_keys(keys, with_runs=any(run for _, _, run in holders))
    count = len(holders)
    return ScriptCall("renew_many", named, args, lambda reply: renew_reply(reply, count))


def leave_many(
    keys: list[SemaphoreKeys], *, waiter: str, rules: list[Rules], away_ms: int | None = None, wake: str = ""
) -> ScriptCall[HandOffReply]:
    args: list[Any] = [waiter, number(len(keys)), *(each.arg for each in rules)]
    if away_ms is not None:
        args += [number(away_ms), wake]
    return ScriptCall("leave_many", _many_keys(keys), args, hand_off_reply)


def _many_keys(keys: list[SemaphoreKeys], *, with_runs: bool = False) -> list[bytes]:
    """10 keys per semaphore; with a run id, then the first semaphore's run records."""
    flat = [key for semaphore in keys for key in semaphore.line_keys]
    return flat + keys[0].encoded[10:12] if with_runs else flat
