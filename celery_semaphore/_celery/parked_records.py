"""Where a parked task's record lives: the deployment's parked-task keys, and the names a
record and its line go by (``parking.py`` keeps and sweeps the records, with the scripts of
``parked_scripts.py``)."""

from __future__ import annotations

import json
from typing import NamedTuple

from .._core.multi import MultiSemaphore, home_of
from .._core.semaphore import FairSemaphore
from .._core.storage import RECORD_SEPARATOR

# What a record keeps in place of a wake copy on the Redis broker, where the task's backstop copy
# waits in the broker's store of due copies (``due_copies.py``) under the wait's run: its wake-up
# sends that stored message (``send_stored_copy.lua``), so no second copy waits in this Redis.
# The scripts keep it as they keep a copy (``WOKEN_COPY_MARK`` goes in front when it is woken).
STORED_COPY_MARK = "stored-in-broker"
# In front of a kept copy (or its mark) whose task waits for its offer in its pool process when a
# slot should reach it within <ms> (``policy.stands_by``): a release may wake it ahead of its
# offer (claim_parked_waiter.lua, which spells it the same). A task that would not wait there
# (``semaphore_inline_wait = 0``) is never woken ahead: it would only park again.
AHEAD_COPY_MARK = "ahead:{}\n"


def kept_copy(copy: bytes, stands_by_ms: int) -> bytes:
    """A parked task's copy as its record keeps it: marked when it may be woken ahead."""
    return AHEAD_COPY_MARK.format(stands_by_ms).encode() + copy if stands_by_ms > 0 else copy


def without_ahead_mark(copy: bytes) -> bytes:
    """A kept copy as it was given, its ``AHEAD_COPY_MARK`` (if any) taken off."""
    if copy.startswith(b"ahead:"):
        return copy.partition(b"\n")[2]
    return copy


def parked_keys(prefix: str) -> list[bytes]:
    """The keys of the parked-task records of a deployment (one hash tag: on a cluster, one
    slot for all, which the scripts on them need): the records due, their copies, the record of
    each waiter (park.lua), the lines with parked waiters, and who ticks them this round
    (lines_to_tick.lua)."""
    base = f"{prefix}:{{parked-tasks}}"
    return [f"{base}:{name}".encode() for name in ("due", "copies", "waiters", "lines", "tick-round")]


def prefix_of(semaphore: FairSemaphore | MultiSemaphore) -> str:
    return home_of(semaphore).prefix


def line_of(semaphore: FairSemaphore | MultiSemaphore) -> str:
    """The member naming a parked waiter's line for the ticks: its keys and the rules given in
    code (a MultiSemaphore parks on its first semaphore)."""
    home = home_of(semaphore)
    return parked_line(home.keys.base, home.rules.arg)


def record_of(semaphore: FairSemaphore | MultiSemaphore, waiter: str, run: str) -> str:
    """A wait's record name: all a sweep needs to tell whether some copy of it asked."""
    return ParkedRecord(semaphore.keys.deadlines, semaphore.keys.runs, waiter, run, semaphore.name).text()


class ParkedRecord(NamedTuple):
    """A parked Celery task's record in Redis: everything a sweep needs to tell whether some copy
    of the wait asked. park.lua and claim_parked.lua read fields 1 and 3 of its JSON (the
    deadlines key and the waiter) to build the waiter's entry (``parked_waiter_entry``)."""

    deadlines_key: str
    runs_key: str
    waiter: str
    run: str
    name: str

    def text(self) -> str:
        return json.dumps(list(self))

    @classmethod
    def read(cls, text: str) -> ParkedRecord:
        deadlines_key, runs_key, waiter, run, name = json.loads(text)
        return cls(deadlines_key, runs_key, waiter, run, name)


def parked_waiter_entry(deadlines_key: str, waiter: str) -> str:
    """The field of the parked tasks' waiters hash that leads from a waiter to its record."""
    return f"{deadlines_key}{RECORD_SEPARATOR}{waiter}"


def parked_line(base: str, rules: bytes) -> str:
    """The member of the parked tasks' lines set that names a line for the ticks: its keys' base
    and the rules given in code (``Rules.arg``; a bare limit is written as the number it always
    was, so a line is one member to workers of either version)."""
    text = rules.decode()
    return json.dumps([base, int(text) if text.isdigit() else text])


def read_parked_line(text: str) -> tuple[str, bytes]:
    base, rules = json.loads(text)
    return base, str(rules).encode()
