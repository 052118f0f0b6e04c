"""The scripts only the Celery glue runs on the semaphore's Redis: a parked task's record
(``park``, ``claim_parked``, ``claim_parked_waiter``, which also take an earlier release's
records), the ticks of lines whose waiters are all parked (``lines_to_tick``, ``tick``) and the
note of the wait a first delivery began (``remember_wait``).

They live in ``lua/`` here, not with the semaphore's own, because nothing but the glue runs
them; they are built on the semaphore's library (``_core/lua/_lib.lua``: its key schema and
storage format) by ``built_script``, and run by the semaphore's ``Script``, so that their keys
and marks are the semaphore's to the byte. Their contract (KEYS, ARGV, reply) is in the head of
each ``.lua`` file and, once, in the typed methods below.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from .._core import fork_locks
from .._core.multi import MultiSemaphore
from .._core.replies import waiters_of
from .._core.script_args import number
from .._core.scripts import Script, SemaphoreKeys, built_script
from .._core.scripts import preload as preload_the_semaphores
from .._core.semaphore import FairSemaphore
from .._core.storage import WOKEN_COPY_MARK, as_text
from .parked_records import (
    OldParkedRecord,
    ParkedKeys,
    ParkedRecord,
    entry_of,
    line_of,
    parked_keys,
    prefix_of,
    record_bucket,
    record_header,
    record_value,
    without_ahead_mark,
)

logger = logging.getLogger("celery_semaphore")

# The package whose lua/ folder holds these scripts.
_PACKAGE = __name__.rpartition(".")[0]
_NAMES = (
    "park",
    "claim_parked",
    "claim_parked_waiter",
    "lines_to_tick",
    "tick",
    "remember_wait",
)


class ParkedScripts:
    """The glue's scripts registered on one Redis client, one typed method per script."""

    def __init__(self, client: Any) -> None:
        self._scripts = {name: Script(client, built_script(_PACKAGE, name)) for name in _NAMES}

    def park(
        self,
        keys: ParkedKeys,
        *,
        entry: str,
        look_in_ms: int,
        record: bytes,
        only_if_absent: bool = False,
        line: str = "",
    ) -> bool:
        """Keep a parked task's record (``parked_records.record_value``) under ``entry``;
        ``keys`` are ``parked_records.parked_keys``. With ``only_if_absent``, a record that
        exists is left as it is (and False returned). ``line``: the member naming the waiter's
        line for the ticks."""
        args: list[Any] = [entry, look_in_ms, record, b"nx" if only_if_absent else b"", line, record_bucket(entry)]
        return bool(self._scripts["park"](keys=keys.parking(entry), args=args))

    def forget(self, keys: ParkedKeys, *, entry: str, header: bytes, old: tuple[str, str]) -> None:
        """Drop the record under ``entry`` if it is still the one of the wait ``header`` names
        (``parked_records.record_header``): the wait was given up. ``old``: the name an earlier
        release gave the same wait's record, and its waiter's entry there, dropped too."""
        args = [entry, 0, header, b"forget", b"", record_bucket(entry), *old]
        self._scripts["park"](keys=keys.forgetting(entry), args=args)

    def park_run(
        self, semaphore: FairSemaphore | MultiSemaphore, *, waiter: str, run: str, kept: bytes, look_in_ms: int
    ) -> tuple[Script, list[bytes], list[Any]]:
        """``park`` of the record of ``waiter``'s wait under ``run`` in its line of ``semaphore``,
        keeping ``kept`` (``parked_records.kept_copy``), as its script, keys and arguments: to run
        in one round trip with another script (``scripts.run_in_order``)."""
        entry = entry_of(semaphore, waiter)
        args = [entry, look_in_ms, record_value(waiter, run, kept), b"", line_of(semaphore), record_bucket(entry)]
        return self._scripts["park"], parked_keys(prefix_of(semaphore)).parking(entry), args

    def forget_wait(self, semaphore: FairSemaphore | MultiSemaphore, *, waiter: str, run: str) -> None:
        """``forget`` the record of ``waiter``'s wait under ``run`` in its line of ``semaphore``,
        and the record an earlier release kept of it."""
        earlier = OldParkedRecord.of(semaphore, waiter, run)
        self.forget(
            parked_keys(prefix_of(semaphore)),
            entry=entry_of(semaphore, waiter),
            header=record_header(waiter, run),
            old=(earlier.text(), earlier.waiter_entry()),
        )

    def claim_parked(self, keys: ParkedKeys, *, prefix: str, most: int) -> list[ParkedRecord | None]:
        """The parked-task records now due (this release's and an earlier release's), taken by
        this caller alone; None for one that cannot be read, or whose copy is gone. ``prefix``:
        the deployment's."""
        return records_claimed(self._scripts["claim_parked"](keys=keys.claims, args=[most]), prefix)

    def claim_parked_waiter(
        self, keys: ParkedKeys, *, prefix: str, base: str, waiter: str, lease_ms: int
    ) -> ParkedRecord | None:
        """The parked-task record of ``waiter`` of the line whose keys start with ``base``,
        taken now by this caller alone and leased for ``lease_ms`` (a sweep sends its copy
        again after that, unless its run was granted); None when it has none (or another caller
        took it)."""
        claimed = self.claim_parked_waiters(keys, prefix=prefix, base=base, waiters=[waiter], lease_ms=lease_ms)
        return claimed[0] if claimed else None

    def claim_parked_waiters(
        self, keys: ParkedKeys, *, prefix: str, base: str, waiters: list[str], lease_ms: int
    ) -> list[ParkedRecord]:
        """``claim_parked_waiter`` of each of ``waiters`` of one line, in one round trip: the
        records taken."""
        reply = self._scripts["claim_parked_waiter"](keys=keys.claims, args=[base, number(lease_ms), *waiters])
        return [record for record in records_claimed(reply, prefix) if record is not None]

    def claim_offered_run(
        self, keys: ParkedKeys, line: SemaphoreKeys, *, lease_ms: int, ahead: int, limit: int
    ) -> tuple[Script, list[bytes], list[Any]]:
        """``claim_parked_waiter`` of every parked waiter holding a live offer of ``line``, and
        of those among its first ``ahead`` present waiters whose slot should come, by the line's
        average hold and ``limit``, within what their record's ``AHEAD_COPY_MARK`` says (woken
        ahead), as its script, keys and arguments: to run right after a release of the line, in
        its round trip (a single Redis only: the line's keys and the records' are two hash
        tags). Its reply: ``records_claimed``."""
        named = [*keys.claims, *(key.encode() for key in (line.holders, line.waiter_info, line.present, line.gate))]
        args = [line.base, number(lease_ms), number(ahead), number(limit)]
        return self._scripts["claim_parked_waiter"], named, args

    def lines_to_tick(self, keys: ParkedKeys, *, round_ms: int, most: int) -> list[str]:
        """The lines with parked waiters to tick this round, or [] when another process has it."""
        return [as_text(line) for line in self._scripts["lines_to_tick"](keys=keys.ticks, args=[round_ms, most])]

    def remember_wait(self, keys: SemaphoreKeys, *, first_delivery: str, wait_id: str, remember_ms: int) -> None:
        """Note the wait a first delivery began (lua/remember_wait.lua)."""
        self._scripts["remember_wait"](keys=keys.encoded, args=[first_delivery, wait_id, number(remember_ms)])

    def tick(self, keys: SemaphoreKeys, *, rules: bytes) -> tuple[str, ...]:
        """Purge a line one step and hand freed slots on; the waiters the caller must wake
        (offered a slot: parked, or nobody heard; see notify in _core/lua/_lib.lua).
        ``rules``: as ``Rules.arg`` (a parked line's record carries them as text)."""
        return waiters_of(self._scripts["tick"](keys=keys.line_keys, args=[rules]))


def records_claimed(reply: Any, prefix: str) -> list[ParkedRecord | None]:
    """The records a run of claim_parked_waiter.lua or claim_parked.lua took (this release's,
    then an earlier release's), each copy as it was given (behind its woken mark, if any); None
    for one that cannot be read (logged) or whose copy is gone."""
    records: list[ParkedRecord | None] = []
    ours, earlier = reply
    for kind, pairs in ((ParkedRecord, ours), (OldParkedRecord, earlier)):
        for i in range(0, len(pairs), 2):
            name, value = as_text(pairs[i]), bytes(pairs[i + 1])
            records.append(_read(kind, name, value, prefix) if value else None)
    return [None if record is None else record._replace(copy=bare_copy(record.copy)) for record in records]


def _read(kind: type[ParkedRecord | OldParkedRecord], name: str, value: bytes, prefix: str) -> ParkedRecord | None:
    """One record a claim took: this release's (entry and value) or an earlier release's (its
    JSON name and its copy)."""
    try:
        if kind is ParkedRecord:
            return ParkedRecord.read(name, value, prefix)
        return OldParkedRecord.read(name).as_record(value, prefix)
    except (ValueError, TypeError, IndexError) as error:
        logger.warning("could not read a parked task's record (%s): its backstop copy is its only way back", error)
        return None


def bare_copy(copy: bytes) -> bytes:
    """A kept copy with its ``AHEAD_COPY_MARK`` off, its woken mark (if any) still in front."""
    woken = WOKEN_COPY_MARK.encode()
    mark = woken if copy.startswith(woken) else b""
    return mark + without_ahead_mark(copy[len(mark) :])


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
