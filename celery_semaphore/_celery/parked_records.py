"""Where a parked task's record lives: the deployment's parked-task keys, and the names a
record and its line go by (``parking.py`` keeps and sweeps the records, with the scripts of
``parked_scripts.py``)."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from .._core.multi import MultiSemaphore, home_of
from .._core.scripts import SemaphoreKeys
from .._core.semaphore import FairSemaphore
from .._core.storage import RECORD_SEPARATOR, TAKEN_RECORD_MARK, bucket_of
from .tokens import SHORT_ID_MARK, task_id_of

# What a record keeps in place of a wake copy on the Redis broker, where the task's backstop copy
# waits in the broker's store of due copies (``due_copies.py``) under the wait's run: its wake-up
# sends that stored message (``send_stored_copy.lua``), so no second copy waits in this Redis.
# The scripts keep it as they keep a copy (``WOKEN_COPY_MARK`` goes in front when it is woken).
# Short, as every parked task's record holds it (no serialized copy starts with "@"); records
# kept before it was shortened hold one of ``_LONGER_STORED_COPY_MARKS``, read the same.
STORED_COPY_MARK = "@"
_LONGER_STORED_COPY_MARKS = (b"@broker", b"stored-in-broker")
# In front of a kept copy (or its mark) whose task waits for its offer in its pool process when a
# slot should reach it within <ms> (``policy.stands_by``): a release may wake it ahead of its
# offer (claim_parked_waiter.lua, which spells it the same). A task that would not wait there
# (``semaphore_inline_wait = 0``) is never woken ahead: it would only park again.
AHEAD_COPY_MARK = "ahead:{}\n"
# What a line's deadlines key adds to its keys' base (an earlier release named records by it).
_DEADLINES_SUFFIX = SemaphoreKeys.of_base("").deadlines


def is_stored_mark(copy: bytes) -> bool:
    """Whether a record's copy (its marks off) is the mark of a copy stored in the broker."""
    return copy == STORED_COPY_MARK.encode() or copy in _LONGER_STORED_COPY_MARKS


def kept_copy(copy: bytes, stands_by_ms: int) -> bytes:
    """A parked task's copy as its record keeps it: marked when it may be woken ahead."""
    return AHEAD_COPY_MARK.format(stands_by_ms).encode() + copy if stands_by_ms > 0 else copy


def without_ahead_mark(copy: bytes) -> bytes:
    """A kept copy as it was given, its ``AHEAD_COPY_MARK`` (if any) taken off."""
    if copy.startswith(b"ahead:"):
        return copy.partition(b"\n")[2]
    return copy


# The records are split by entry into this many small hashes (``record_bucket``), so that each
# stays in Redis's compact encoding (a listpack: up to 128 entries of up to 64 bytes by default,
# hash-max-listpack-*) at 100,000 parked tasks, and each record keeps its own due time in front
# of its value: about 110 B a record, against about 300 B in one large hash and one large sorted
# set of due times, and 200 B in buckets of both (measured, docs/benchmarks.md). A bucket past
# those limits is stored as a large one is, no worse than before.
RECORD_BUCKETS = 1024


def record_bucket(entry: str) -> int:
    """The bucket of a record's entry: the first 32 bits of its SHA-1, as the scripts compute it
    (``redis.sha1hex``, claim_parked_waiter.lua)."""
    return bucket_of(entry, RECORD_BUCKETS)


class ParkedKeys(NamedTuple):
    """The keys of the parked-task records of a deployment (one hash tag: on a cluster, one slot
    for all, which the scripts on them need): the records, each with its due time, split into
    buckets (``bucket_records``) with an index of the buckets by when their first record is
    due at the earliest (``buckets``); the single hash and sorted set that an
    earlier release kept them in (``flat_records``, ``flat_due``: swept, taken and forgotten,
    never written) and those of a release before it (``OldParkedRecord``, likewise); the lines
    with parked waiters and who ticks them this round (lines_to_tick.lua)."""

    buckets: bytes
    flat_due: bytes
    flat_records: bytes
    old_due: bytes
    old_copies: bytes
    old_waiters: bytes
    lines: bytes
    tick_round: bytes

    @property
    def leases(self) -> bytes:
        """The leases of the records a wake-up took (entry -> when the lease ends), beside the
        bucket index and named from it by the scripts (claim_parked.lua)."""
        return self.buckets.removesuffix(b"record-buckets") + b"record-leases"

    def bucket_records(self, bucket: int) -> bytes:
        return self.flat_records + b":" + str(bucket).encode()

    def parking(self, entry: str) -> list[bytes]:
        """park.lua's keys for the record under ``entry``."""
        bucket = record_bucket(entry)
        return [self.bucket_records(bucket), self.lines, self.buckets]

    def forgetting(self, entry: str) -> list[bytes]:
        """park.lua's keys to forget the record under ``entry`` wherever a release kept it."""
        return [*self.parking(entry), self.flat_due, self.flat_records, *self.old]

    @property
    def old(self) -> list[bytes]:
        return [self.old_due, self.old_copies, self.old_waiters]

    @property
    def claims(self) -> list[bytes]:
        """claim_parked.lua's and claim_parked_waiter.lua's keys: the bucket index (the buckets'
        own keys are named from it), the earlier release's and the release before it's."""
        return [self.buckets, self.flat_due, self.flat_records, *self.old]

    @property
    def ticks(self) -> list[bytes]:
        """lines_to_tick.lua's keys."""
        return [self.lines, self.tick_round]


def parked_keys(prefix: str) -> ParkedKeys:
    base = f"{prefix}:{{parked-tasks}}"
    names = ("record-buckets", "record-due", "records", "due", "copies", "waiters", "lines", "tick-round")
    return ParkedKeys(*(f"{base}:{name}".encode() for name in names))


def prefix_of(semaphore: FairSemaphore | MultiSemaphore) -> str:
    return home_of(semaphore).prefix


def line_of(semaphore: FairSemaphore | MultiSemaphore) -> str:
    """The member naming a parked waiter's line for the ticks: its keys and the rules given in
    code (a MultiSemaphore parks on its first semaphore)."""
    home = home_of(semaphore)
    return parked_line(home.keys.base, home.rules.arg)


def record_entry(prefix: str, base: str, waiter: str) -> str:
    """A parked wait's record, as the records and their due times name it: its line and its
    waiter (``record_line``), which claim_parked_waiter.lua builds the same way (a waiter has one
    place in a line, so one record; the wait's run is in the record's header)."""
    return f"{record_line(prefix, base)}{RECORD_SEPARATOR}{waiter}"


def record_line(prefix: str, base: str) -> str:
    """A line as its records name it: the semaphore's name where its keys' base is
    ``"<prefix>:{<name>}"`` (every record of a long line repeats it twice, its entry and its due
    entry: 12 B fewer each for the default prefix), else its base, which starts with
    ``"<prefix>:{"`` (``SemaphoreKeys.of``; a family's ``"<prefix>:{<tag>}:<name>"``). A name
    that starts so is written as its base too, so that ``base_of_line`` reads either back."""
    name = name_of_base(prefix, base)
    return name if name != base and not name.startswith(f"{prefix}:{{") else base


def base_of_line(prefix: str, line: str) -> str:
    """The keys' base of a line a record names (``record_line``)."""
    head = f"{prefix}:{{"
    return line if line.startswith(head) else f"{head}{line}}}"


def entry_of(semaphore: FairSemaphore | MultiSemaphore, waiter: str) -> str:
    home = home_of(semaphore)
    return record_entry(home.prefix, home.keys.base, waiter)


def record_header(waiter: str, run: str) -> bytes:
    """What a record keeps in front of its copy: the wait's run, with no raw newline (the first
    newline of a record's value ends its header), never starting with a digit (a due time goes
    in front of it, park.lua) nor with ``TAKEN_RECORD_MARK``. A Celery task's run is
    "<task id>#<retries>#...", and its waiter the task id (written short, ``tokens.waiter_key``):
    then only the run's tail is kept, as it is (``#0#9f..``), the waiter being what follows the
    entry's last newline. Any other wait
    keeps both as JSON (``[waiter, run, 0]``), so that its entry splits into base and waiter
    whatever either holds. (A release before kept the tail as JSON too, ``["#0#9f.."]``: read the
    same.)"""
    head = _run_head(waiter)
    tail = run[len(head) :] if run.startswith(head) and RECORD_SEPARATOR not in waiter else None
    if tail is not None and tail.startswith("#") and RECORD_SEPARATOR not in tail:
        return tail.encode()
    fields: list[Any] = [tail] if tail is not None else [waiter, run, 0]
    return json.dumps(fields, separators=(",", ":")).encode()


def _run_head(waiter: str) -> str:
    """What the run of a Celery task waiting as ``waiter`` starts with: its task id."""
    return task_id_of(waiter) if waiter.startswith(SHORT_ID_MARK) else waiter


def record_value(waiter: str, run: str, kept: bytes) -> bytes:
    """A record's value: its header, a newline, and its copy as kept (``kept_copy``)."""
    return record_header(waiter, run) + RECORD_SEPARATOR.encode() + kept


def kept_of(value: bytes) -> bytes:
    """The copy a record's value keeps, as kept (marks in front), its due time, header and taken
    mark off."""
    return without_due(value).removeprefix(TAKEN_RECORD_MARK.encode()).partition(RECORD_SEPARATOR.encode())[2]


def split_due(value: bytes) -> tuple[int | None, bytes]:
    """A bucket's record as park.lua keeps it: its due time (server ms; None for a record of an
    earlier release, whose due time is in a sorted set of its own) and the rest of its value."""
    rest = value.lstrip(b"0123456789")
    due = value[: len(value) - len(rest)]
    return (int(due) if due else None), rest


def without_due(value: bytes) -> bytes:
    return split_due(value)[1]


class ParkedRecord(NamedTuple):
    """A parked Celery task's record as a sweep or a wake-up took it: everything a sweep needs
    to tell whether some copy of the wait asked, and the copy to send (``WOKEN_COPY_MARK`` in
    front once a wake copy was sent; the ``AHEAD_COPY_MARK`` taken off)."""

    base: str
    waiter: str
    run: str
    name: str
    copy: bytes
    line: str  # the line as its entry names it (record_line)

    @property
    def deadlines_key(self) -> str:
        return SemaphoreKeys.of_base(self.base).deadlines

    @property
    def runs_key(self) -> str:
        return SemaphoreKeys.of_base(self.base).runs

    @property
    def entry(self) -> str:
        return f"{self.line}{RECORD_SEPARATOR}{self.waiter}"

    @classmethod
    def read(cls, entry: str, value: bytes, prefix: str) -> ParkedRecord:
        """A record from its entry and its value as the scripts return them; ``prefix``: the
        deployment's, to name the semaphore from its keys' base. ValueError if unreadable."""
        value = without_due(value).removeprefix(TAKEN_RECORD_MARK.encode())
        header, separator, copy = value.partition(RECORD_SEPARATOR.encode())
        if not separator:
            raise ValueError(f"a parked record with no header: {entry!r}")
        fields = json.loads(header) if header.startswith(b"[") else [header.decode()]
        if len(fields) == 1:
            waiter = entry.rpartition(RECORD_SEPARATOR)[2]
            run = _run_head(waiter) + str(fields[0])
        else:
            waiter, run = str(fields[0]), str(fields[1])
        suffix = RECORD_SEPARATOR + waiter
        if not entry.endswith(suffix):
            raise ValueError(f"a parked record whose entry does not name its waiter: {entry!r}")
        line = entry[: -len(suffix)]
        base = base_of_line(prefix, line)
        return cls(base, waiter, run, name_of_base(prefix, base), copy, line)


def name_of_base(prefix: str, base: str) -> str:
    """A semaphore's name from its keys' base, ``"<prefix>:{<name>}"`` (the base itself if it
    is not one)."""
    head = f"{prefix}:{{"
    return base[len(head) : -1] if base.startswith(head) and base.endswith("}") else base


class OldParkedRecord(NamedTuple):
    """The record of an earlier release: its name is the JSON of these fields."""

    deadlines_key: str
    runs_key: str
    waiter: str
    run: str
    name: str

    @classmethod
    def of(cls, semaphore: FairSemaphore | MultiSemaphore, waiter: str, run: str) -> OldParkedRecord:
        """The record an earlier release kept of this wait (if it parked it)."""
        return cls(semaphore.keys.deadlines, semaphore.keys.runs, waiter, run, semaphore.name)

    def text(self) -> str:
        """Its name, as that release wrote it."""
        return json.dumps(list(self))

    def waiter_entry(self) -> str:
        """Its waiter's entry in that release's waiters index: the line's deadlines key, a
        newline and the waiter."""
        return f"{self.deadlines_key}{RECORD_SEPARATOR}{self.waiter}"

    @classmethod
    def read(cls, text: str) -> OldParkedRecord:
        deadlines_key, runs_key, waiter, run, name = json.loads(text)
        return cls(deadlines_key, runs_key, waiter, run, name)

    def as_record(self, copy: bytes, prefix: str) -> ParkedRecord:
        """The same wait as this release records it (ValueError if its keys are not a line's)."""
        if not self.deadlines_key.endswith(_DEADLINES_SUFFIX):
            raise ValueError(f"a parked record of no line: {self.deadlines_key!r}")
        base = self.deadlines_key[: -len(_DEADLINES_SUFFIX)]
        return ParkedRecord(base, self.waiter, self.run, self.name, copy, record_line(prefix, base))


def parked_line(base: str, rules: bytes) -> str:
    """The member of the parked tasks' lines set that names a line for the ticks: its keys' base
    and the rules given in code (``Rules.arg``; a bare limit is written as the number it always
    was, so a line is one member to workers of either version)."""
    text = rules.decode()
    return json.dumps([base, int(text) if text.isdigit() else text])


def read_parked_line(text: str) -> tuple[str, bytes]:
    base, rules = json.loads(text)
    return base, str(rules).encode()
