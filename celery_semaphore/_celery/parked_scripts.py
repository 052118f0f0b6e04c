"""The scripts only the Celery glue runs on the semaphore's Redis: a parked task's record
(``park``, ``claim_parked``, ``claim_parked_waiter``), the ticks of lines whose waiters are all
parked (``lines_to_tick``, ``tick``) and the note of the wait a first delivery began
(``remember_wait``).

They live in ``lua/`` here, not with the semaphore's own, because nothing but the glue runs
them; they are built on the semaphore's library (``_core/lua/_lib.lua``: its key schema and
storage format) by ``built_script``, and run by the semaphore's ``Script``, so that their keys
and marks are the semaphore's to the byte. Their contract (KEYS, ARGV, reply) is in the head of
each ``.lua`` file and, once, in the typed methods below.
"""

from __future__ import annotations

import weakref
from typing import Any

from .._core import fork_locks
from .._core.replies import waiters_of
from .._core.script_args import number
from .._core.scripts import Script, SemaphoreKeys, built_script
from .._core.scripts import preload as preload_the_semaphores
from .._core.storage import WOKEN_COPY_MARK, as_text
from .parked_records import without_ahead_mark

# The package whose lua/ folder holds these scripts.
_PACKAGE = __name__.rpartition(".")[0]
_NAMES = ("park", "claim_parked", "claim_parked_waiter", "lines_to_tick", "tick", "remember_wait")


class ParkedScripts:
    """The glue's scripts registered on one Redis client, one typed method per script."""

    def __init__(self, client: Any) -> None:
        self._scripts = {name: Script(client, built_script(_PACKAGE, name)) for name in _NAMES}

    def park(
        self,
        keys: list[bytes],
        *,
        record: str,
        look_in_ms: int,
        copy: bytes,
        only_if_absent: bool = False,
        line: str = "",
    ) -> bool:
        """Keep (or, with an empty ``copy``, forget) a parked task's record; ``keys`` are
        ``parked_records.parked_keys``. With ``only_if_absent``, a record that exists is left as
        it is (and False returned). ``line``: the member naming the waiter's line for the ticks."""
        args: list[Any] = [record, look_in_ms, copy, b"nx" if only_if_absent else b"", line]
        return bool(self._scripts["park"](keys=keys[:4], args=args))

    def park_run(
        self, keys: list[bytes], record: str, look_in_ms: int, copy: bytes, line: str
    ) -> tuple[Script, list[bytes], list[Any]]:
        """``park`` of a record to keep, as its script, keys and arguments: to run in one round
        trip with another script (``scripts.run_in_order``)."""
        return self._scripts["park"], keys[:4], [record, look_in_ms, copy, b"", line]

    def claim_parked(self, keys: list[bytes], *, most: int) -> list[tuple[str, bytes]]:
        """The parked-task records now due, (record, copy) each, taken by this caller alone."""
        return records_claimed(self._scripts["claim_parked"](keys=keys[:3], args=[most]))

    def claim_parked_waiter(
        self, keys: list[bytes], *, deadlines_key: str, waiter: str, lease_ms: int
    ) -> tuple[str, bytes] | None:
        """The parked-task record of ``waiter`` of the line with ``deadlines_key``, taken now by
        this caller alone and leased for ``lease_ms`` (a sweep sends its copy again after that,
        unless its run was granted); None when it has none (or another caller took it)."""
        claimed = self.claim_parked_waiters(keys, deadlines_key=deadlines_key, waiters=[waiter], lease_ms=lease_ms)
        return claimed[0] if claimed else None

    def claim_parked_waiters(
        self, keys: list[bytes], *, deadlines_key: str, waiters: list[str], lease_ms: int
    ) -> list[tuple[str, bytes]]:
        """``claim_parked_waiter`` of each of ``waiters`` of one line, in one round trip: the
        (record, copy) pairs taken."""
        reply = self._scripts["claim_parked_waiter"](keys=keys[:3], args=[deadlines_key, number(lease_ms), *waiters])
        return records_claimed(reply)

    def claim_offered_run(
        self, keys: list[bytes], line: SemaphoreKeys, *, lease_ms: int, ahead: int, limit: int
    ) -> tuple[Script, list[bytes], list[Any]]:
        """``claim_parked_waiter`` of every parked waiter holding a live offer of ``line``, and
        of those among its first ``ahead`` present waiters whose slot should come, by the line's
        average hold and ``limit``, within what their record's ``AHEAD_COPY_MARK`` says (woken
        ahead), as its script, keys and arguments: to run right after a release of the line, in
        its round trip (a single Redis only: the line's keys and the records' are two hash
        tags). Its reply: ``records_claimed``."""
        named = [*keys[:3], *(key.encode() for key in (line.holders, line.waiter_info, line.present, line.gate))]
        args = [line.deadlines, number(lease_ms), number(ahead), number(limit)]
        return self._scripts["claim_parked_waiter"], named, args

    def lines_to_tick(self, keys: list[bytes], *, round_ms: int, most: int) -> list[str]:
        """The lines with parked waiters to tick this round, or [] when another process has it."""
        return [as_text(line) for line in self._scripts["lines_to_tick"](keys=keys[3:5], args=[round_ms, most])]

    def remember_wait(self, keys: SemaphoreKeys, *, first_delivery: str, wait_id: str, remember_ms: int) -> None:
        """Note the wait a first delivery began (lua/remember_wait.lua)."""
        self._scripts["remember_wait"](keys=keys.encoded, args=[first_delivery, wait_id, number(remember_ms)])

    def tick(self, keys: SemaphoreKeys, *, rules: bytes) -> tuple[str, ...]:
        """Purge a line one step and hand freed slots on; the waiters the caller must wake
        (offered a slot: parked, or nobody heard; see notify in _core/lua/_lib.lua).
        ``rules``: as ``Rules.arg`` (a parked line's record carries them as text)."""
        return waiters_of(self._scripts["tick"](keys=keys.line_keys, args=[rules]))


def records_claimed(reply: Any) -> list[tuple[str, bytes]]:
    """The (record, copy) pairs a run of claim_parked_waiter.lua or claim_parked.lua took, each
    copy as it was given (behind its woken mark, if any)."""
    woken = WOKEN_COPY_MARK.encode()
    pairs = []
    for i in range(0, len(reply), 2):
        copy = bytes(reply[i + 1])
        mark = woken if copy.startswith(woken) else b""
        pairs.append((as_text(reply[i]), mark + without_ahead_mark(copy[len(mark) :])))
    return pairs


_registered: weakref.WeakKeyDictionary[Any, ParkedScripts] = weakref.WeakKeyDictionary()
_registering = fork_locks.reset_in_child()


def parked_scripts_for(client: Any) -> ParkedScripts:
    """The glue's scripts registered on ``client``, registering them the first time it is seen."""
    scripts = _registered.get(client)
    if scripts is None:
        with _registering:
            scripts = _registered.setdefault(client, ParkedScripts(client))
    return scripts


def preload(client: Any) -> None:
    """Load the semaphore's scripts and the glue's into the server's script cache now, so that
    a worker's first acquire, park or tick is one EVALSHA, not NOSCRIPT, SCRIPT LOAD and a retry."""
    preload_the_semaphores(client)
    for name in _NAMES:
        client.script_load(built_script(_PACKAGE, name))
