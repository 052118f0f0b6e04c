"""What ``FairSemaphore.status()`` reports: the limit in force, the holders and the line, in
seconds and places rather than the scores and members they are stored as."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .rules import Rate
from .storage import OFFERED, PRESENT, is_extra_slot, slot_members

if TYPE_CHECKING:
    from .replies import GateState, StatusReply

# a pause "until resumed" is stored as ending in the far future (lua/set_gate.lua); anything
# left above a year reads as that
LONG_PAUSE_MS = 365 * 86400 * 1000

# At most this many holders and waiters are listed by status(); the counts stay exact.
STATUS_LISTING_LIMIT = 1000


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
    present: bool  # asking now or parked (True), or away with no wake-up (False)
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
    rate: Rate | None = None  # in force: at most rate.count starts in any rate.period seconds
    spacing: float | None = None  # in force: at least this many seconds between two starts
    paused_for: float | None = None  # seconds the pause has left; inf: until resumed; None: not paused
    next_start_in: float = 0.0  # seconds until the rules allow the next start (0: now, if a slot is free)
    starts_in_window: int = 0  # starts in the rate's window that ends now
    rules_source: str = "default"  # "override" when a runtime rate, spacing or pause is stored


def gate_status(gate: GateState) -> dict[str, Any]:
    """The fields of SemaphoreStatus that the rate, spacing and pause in force fill in."""
    return {
        "rate": Rate(gate.rate_count, gate.rate_ms / 1000) if gate.rate_count else None,
        "spacing": gate.spacing_ms / 1000 if gate.spacing_ms else None,
        "paused_for": (math.inf if gate.paused_ms >= LONG_PAUSE_MS else gate.paused_ms / 1000)
        if gate.paused_ms
        else None,
        "next_start_in": gate.next_start_ms / 1000,
        "starts_in_window": gate.starts_in_window,
        "rules_source": "override" if gate.override else "default",
    }


def status_of(name: str, limit: int, reply: StatusReply) -> SemaphoreStatus:
    """The status script's reply as reported: server times as seconds, places as positions. One
    function for either semaphore class, blocking or asyncio, so that both report alike."""
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
        name=name,
        limit=reply.override if reply.override is not None else limit,
        limit_source="override" if reply.override is not None else "default",
        holder_count=reply.holder_count,
        waiter_count=reply.waiter_count,
        holders=holders,
        waiters=waiters,
        override_expires_in=reply.override_ttl_ms / 1000 if reply.override_ttl_ms >= 0 else None,
        offered_count=reply.offered_count,
        **gate_status(reply.gate),
    )
