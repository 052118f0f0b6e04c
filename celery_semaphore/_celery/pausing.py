"""A task body that hears "429, Retry-After: 30" pauses its semaphore for every worker and goes
back in line at the front, to be the first to start when the pause ends.

Backing off alone helps nobody: the other workers keep calling the API and keep hitting the
wall. A pause stored with the semaphore (``FairSemaphore.pause``) holds every start everywhere,
and the line keeps its order through it; the task that was told to wait was running, so it was
ahead of everyone waiting, and it takes a ticket ahead of them.
"""

from __future__ import annotations

from celery.exceptions import Retry

from .._core.attempts import Ask, Granted, new_token
from .._core.multi import MultiSemaphore
from .._core.semaphore import FairSemaphore

# A paused task's place is kept this much longer than the pause: its copy's delivery, and a
# busy worker's delay in starting it.
PLACE_SLACK = 15.0


class SemaphorePaused(Retry):  # type: ignore[misc]
    """What ``SemaphoreTask.semaphore_pause`` raises: a Retry to Celery (the task's state is
    RETRY, its copy is on its way), but not the end of the task's run: the copy runs it."""


def members(semaphore: FairSemaphore | MultiSemaphore) -> list[FairSemaphore]:
    return list(semaphore.semaphores) if isinstance(semaphore, MultiSemaphore) else [semaphore]


def front_ticket(semaphore: FairSemaphore | MultiSemaphore) -> int | None:
    """A ticket ahead of everyone in any of the semaphore's lines; None when nobody waits (a
    new ticket is then the front)."""
    fronts = [front - 1 for front in (member._line_front() for member in members(semaphore)) if front is not None]
    return min(fronts) if fronts else None


def pause_and_stand_first(semaphore: FairSemaphore | MultiSemaphore, waiter: str, seconds: float) -> int | None:
    """Pause every semaphore of the call for ``seconds`` and put ``waiter`` first in line, its
    place kept through the pause: when the caller's slot is given back, the start at the end of
    the pause is reserved for it (a delayed offer). Returns its ticket, for its copy to carry."""
    for member in members(semaphore):
        member.pause(seconds)
    ticket = front_ticket(semaphore)
    attempt = semaphore._try(
        Ask(token=new_token(), waiter=waiter, ticket=ticket, patience=seconds + PLACE_SLACK, label="paused")
    )
    if isinstance(attempt, Granted):  # the pause ended already (a pause of a millisecond): no slot is wanted now
        attempt.lease.release()
    return getattr(attempt, "ticket", None) or ticket
