"""Where a parked task's record lives: the deployment's parked-task keys, and the names a
record and its line go by (``parking.py`` keeps and sweeps the records)."""

from __future__ import annotations

from .._core.multi import MultiSemaphore, home_of
from .._core.semaphore import FairSemaphore
from .._core.storage import ParkedRecord, parked_line


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
