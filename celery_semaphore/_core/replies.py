"""What the scripts answer, named: each reply as a frozen dataclass, so that nobody outside
``scripts.py`` unpacks a script's reply by position; and the holder a renewal is asked for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .storage import CLAIMED, GRANTED, RAN, as_text

# A holder to renew: (token, label, run), run "" unless the slot was granted for a run (whose
# record a renewal keeps as long as the lease, so that no copy takes a long run over).
Holder = tuple[str, str, str]


@dataclass(frozen=True)
class AcquireReply:
    outcome: int  # GRANTED, CLAIMED, WAIT, RUNNING or RAN
    position: int
    free: int
    limit: int
    hold_ms: int  # -1: unknown
    ticket: int | None
    turn: int
    to_wake: tuple[str, ...] = ()  # waiters offered a slot whom the caller wakes: parked, or unheard
    twin_lease_ms: int = 0  # RUNNING: how long the lease of the copy that runs lasts (unless renewed)
    retry_ms: int = 0  # WAIT: ms until a slot reserved for it under a rate, spacing or pause may be claimed
    opens_ms: int = 0  # WAIT: ms until a rate, spacing or pause allows the line's next start


@dataclass(frozen=True)
class HandOffReply:
    """The reply of a script that may hand a slot on: its own answer, and the waiters offered a
    slot whose wake-up nobody heard (lua/_lib.lua, notify)."""

    done: bool
    to_wake: tuple[str, ...] = ()


# A grant or a finished run is answered with its bare code; its other fields mean nothing then.
BARE_REPLIES = {code: AcquireReply(code, 0, 0, 0, -1, None, 0) for code in (GRANTED, CLAIMED, RAN)}


@dataclass(frozen=True)
class ManyReply:
    outcome: int  # GRANTED, WAIT or TOO_HEAVY
    position: int  # the most waiters ahead of it in any line
    free: int  # the fewest free slots of any semaphore
    limit: int  # the limit of the semaphore named by ``index``
    index: int  # WAIT: the first semaphore holding the try back; TOO_HEAVY: the one too small
    ticket: int | None
    retry_ms: int = 0  # WAIT at the head of every line: ms until a rate, spacing or pause allows it
    to_wake: tuple[str, ...] = ()  # waiters told their turn whom the caller wakes: parked, or unheard


@dataclass(frozen=True)
class RenewReply:
    codes: list[int]  # one RENEW_* code per holder, in order
    to_wake: tuple[str, ...] = ()  # waiters offered a slot whom the caller wakes: parked, or unheard


@dataclass(frozen=True)
class ListedHolder:
    token: str
    deadline_ms: int
    granted_ms: int | None
    label: str


@dataclass(frozen=True)
class ListedWaiter:
    waiter: str
    ticket: int
    must_ask_by_ms: int
    first_ask_ms: int | None
    state: int  # AWAY, PRESENT or OFFERED


@dataclass(frozen=True)
class StatusReply:
    now_ms: int
    override: int | None
    override_ttl_ms: int  # -1 kept until cleared, -2 no override
    holder_count: int
    offered_count: int
    waiter_count: int
    holders: list[ListedHolder]
    waiters: list[ListedWaiter]
    gate: GateState


@dataclass(frozen=True)
class GateState:
    """The rate, spacing and pause in force (0 for none), as status reads them."""

    rate_count: int
    rate_ms: int
    spacing_ms: int
    paused_ms: int  # left of the pause; 0 not paused
    next_start_ms: int  # until the next start is allowed; 0 now
    starts_in_window: int  # starts in the rate's window ending now
    override: str | None  # the stored runtime rules, as stored


@dataclass(frozen=True)
class GateReply:
    """The rules in force after ``set_gate`` (0 for none; ``paused_ms`` -1: until resumed)."""

    limit: int
    rate_count: int
    rate_ms: int
    spacing_ms: int
    paused_ms: int
    to_wake: tuple[str, ...] = ()  # waiters told they may start whom the caller wakes: parked, or unheard


def waiters_of(items: list[Any]) -> tuple[str, ...]:
    """The waiters at the end of a reply whom the caller must wake: offered a slot, or told
    their turn, and parked or unheard (lua/_lib.lua, notify)."""
    return tuple(as_text(waiter) for waiter in items)


def renew_reply(reply: list[Any], holders: int) -> RenewReply:
    """One code per holder, then the waiters the caller must wake."""
    return RenewReply(codes=[int(code) for code in reply[:holders]], to_wake=waiters_of(reply[holders:]))


def hand_off_reply(reply: Any) -> HandOffReply:
    """A bare 1 or 0, or that code followed by the waiters the caller must wake."""
    if isinstance(reply, list):
        return HandOffReply(bool(int(reply[0])), waiters_of(reply[1:]))
    return HandOffReply(bool(int(reply)))
