"""What ``FairSemaphore.status()`` reports: the limit in force, the holders and the line, in
seconds and places rather than the scores and members they are stored as."""

from __future__ import annotations

from dataclasses import dataclass

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
