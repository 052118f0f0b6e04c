"""What one try for a slot says (``Granted``, ``Waiting``, ``Duplicate``), and ``Ask``, the
arguments of a try in the private protocol.

A user asks through the public verbs (``acquire``, ``try_acquire``). The Celery glue needs more:
a ticket that brings a re-sent task back to its place, a wake address for a parked task, the id
of a run that several copies of one task may ask under. Those travel in an ``Ask``, to the
semaphores' underscored methods, so that no public signature promises them to users.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ..errors import SemaphoreError
from .lease import Lease
from .replies import AcquireReply
from .storage import RAN, RUNNING, WAIT
from .tenants import Tenant

_LABEL = f"{socket.gethostname()}:{{pid}}"
_label_of_pid: tuple[int, str] = (-1, "")


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


@dataclass(frozen=True, slots=True)
class Ask:
    """One try in the private protocol.

    ``token`` names the slot if granted (a repeat with the same token is granted again, not
    twice); the same ``waiter`` on every try keeps the place in line. ``patience``: seconds the
    place is kept without a try (None: the semaphore's). ``enqueue=False``: a new waiter takes no
    ticket, and gets a slot only if it passes no present waiter. ``label``: who holds the slot,
    for status (None: host and process id). ``ticket``: the place of a waiter that left the line
    and comes back to it. ``fresh``: the waiter never asked before (when nobody is present and a
    slot is free it is granted on the fast path, no line bookkeeping). ``wake``: the wake address (a channel) on
    which to PUBLISH the waiter's id when a slot is offered to it ("" for nowhere). ``run``: the
    id of a run that may ask in several copies (a Celery wait re-sent both with a countdown and on
    wake-up): if another copy was granted in the last ``remember`` seconds (None: patience plus
    the lease), the try says ``Duplicate`` instead of granting a second slot. ``tenant``: whom
    the call is for (a name, or (org, user)); a new waiter is placed by its tenant's share of the
    line (see ``tenants``).
    ``priority``: seconds a new waiter is placed earlier than its ask (see ``priority_ms``).
    ``coalesce``: with ``on_full="keep_latest"``, a new waiter takes the place of the waiter of
    the same coalesce key, which is evicted. ``at_most_once``: with a ``run``, the run counts as
    finished from its grant (a Celery task without acks_late runs at most once), so that no
    other copy takes it over once this one's lease lapses; the grant records it so, and a
    key-list or weighted semaphore (whose script does not) leaves it to the caller."""

    token: str
    waiter: str
    patience: float | None = None
    enqueue: bool = True
    label: str | None = None
    ticket: int | None = None
    fresh: bool = False
    wake: str = ""
    run: str | None = None
    remember: float | None = None
    tenant: Tenant | None = None
    priority: float = 0.0
    coalesce: str | None = None
    at_most_once: bool = False


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
    # a start a rate, a spacing or a pause reserved for it: seconds until it may claim it (and
    # nobody else can have that start meanwhile); None when it waits for a release to offer one
    retry_after: float | None = None
    # seconds until a rate, a spacing or a pause allows the next start of the line (to whoever
    # heads it then); None when they allow one now, or there are none
    opens_in: float | None = None

    @property
    def granted(self) -> bool:
        return False


@dataclass(frozen=True)
class StartsOnArrival:
    """A task being placed as it is sent that would start now: it holds an offer of the start
    (a slot, and under a rate or a spacing the start itself) under ``ticket``, which its first
    delivery claims by asking with that ticket within the claim window (2 s); later, the start
    has gone on to the next waiter and the ticket puts it back in its place."""

    ticket: int


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


def limit_of(attempt: Attempt, default: int) -> int:
    """The limit a refused try reported (``default`` for a try that says none)."""
    return attempt.limit if isinstance(attempt, Waiting) else default


def refusal_of(reply: AcquireReply, name: str) -> Waiting | Duplicate:
    """What an acquire reply that granted nothing means (either semaphore class, blocking or
    asyncio, reads it here): a place in line, or a twin run. An unknown code is a SemaphoreError."""
    if reply.outcome == WAIT:
        return Waiting(
            reply.position,
            reply.free,
            reply.limit,
            hold_time=reply.hold_ms / 1000 if reply.hold_ms >= 0 else None,
            ticket=reply.ticket,
            turn=reply.turn,
            retry_after=reply.retry_ms / 1000 if reply.retry_ms > 0 else None,
            opens_in=reply.opens_ms / 1000 if reply.opens_ms > 0 else None,
        )
    if reply.outcome == RUNNING:
        return Duplicate(running=True, twin_lease=reply.twin_lease_ms / 1000)
    if reply.outcome == RAN:
        return Duplicate(running=False)
    raise SemaphoreError(f"acquire on {name!r} returned unknown code {reply.outcome!r}", key=name)


class OneTry:
    """``try_acquire``, one signature and one promise for both blocking semaphore classes: a
    caller switching from one key to several changes nothing in its tries. Each class says how a
    try's names are made when the caller gives none (``_ask_once``) and makes the try (``_try``)."""

    def try_acquire(
        self,
        *,
        waiter: str | None = None,
        token: str | None = None,
        enqueue: bool = True,
        label: str | None = None,
    ) -> Attempt:
        """One try, one round trip: Granted with a Lease, or Waiting with the place in line.

        Pass the same ``waiter`` on every try to keep the place in line (a waiter that stops
        asking for ``patience`` seconds loses it); ``token`` names the slot if granted (a repeat
        with the same token is granted again, not twice). A slot freed while the waiter is
        present is offered to it: its next try claims it. With ``enqueue=False`` a new waiter
        takes no place in line: it gets a slot only if it passes no present waiter.

        On a ``MultiSemaphore``, ``turn`` is ``position``: the most waiters ahead in any line;
        ``token`` gets the weight written in it (``token_for``) and ``waiter`` the weight in
        front (``waiter_id``) unless they have them.
        """
        return self._try(self._ask_once(waiter, token, enqueue, label))

    def _ask_once(self, waiter: str | None, token: str | None, enqueue: bool, label: str | None) -> Ask:
        raise NotImplementedError

    def _try(self, ask: Ask) -> Attempt:
        raise NotImplementedError
