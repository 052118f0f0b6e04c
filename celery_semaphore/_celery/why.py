"""``why(app, task_id)``: is a task running, waiting, parked, done, or unknown, and why.

Read-only, and a bounded number of round trips whatever the length of the lines:

1. the result backend, once (``get_task_meta``; skipped without a result backend): whether the
   task is done, and, with ``result_extended``, its name and arguments, hence its keys;
2. the semaphore's Redis, once: one pipeline of ``lua/why.lua`` runs, one per key looked at
   (``_core/explain.py``);
3. the parked-task records, once, only for a parked task: when its record is due.

Which keys to look at: those given (``keys=``, the CLI's ``--key``); else the keys of the call
when the result backend knows its name and arguments; else every fixed key of the app's
semaphore tasks (a task whose key is its name or a fixed string), all in the one pipeline. A
task id alone cannot name a key built from the task's arguments (``"crawl:{host}"``): Redis
keeps no index from task ids to keys, and one would cost every acquire a write on another
cluster slot. Such a task is found with ``result_extended = True`` (once it has a result state:
it waited, started or ended), with ``--key``, or, parked (as a task that would wait is as it is
sent), by its parked record, which names its key: one scan of the parked records' index, made
only for a task found nowhere else. Otherwise it reads as unknown, and the answer says so.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from celery import states
from celery.backends.base import DisabledBackend

from .._core.explain import KeyView, Look, look
from .._core.multi import MultiSemaphore
from .._core.status import LONG_PAUSE_MS
from .._core.storage import RECORD_SEPARATOR, as_text, token_prefix_pattern, weighted_waiter
from .catalogue import Catalogue, semaphore_for_call
from .options import is_semaphore_task, key_option, weight_option
from .parked_records import (
    RECORD_BUCKETS,
    OldParkedRecord,
    ParkedKeys,
    ParkedRecord,
    base_of_line,
    name_of_base,
    parked_keys,
    record_bucket,
    record_entry,
    split_due,
)
from .pausing import members
from .tokens import task_key, waiter_key
from .wait_runs import AWAY_SLACK

logger = logging.getLogger("celery_semaphore")

RUNNING, WAITING, PARKED, DONE, UNKNOWN = "running", "waiting", "parked", "done", "unknown"

# The record of a parked waiter, and when a sweep looks at it: one read-only script on the
# parked-task keys (one hash tag), so one round trip.
# A record and its due time, from its bucket (KEYS[1], KEYS[2]) or an earlier release's keys.
_PARKED_RECORD = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local record = redis.call('HGET', KEYS[1], ARGV[1])
if record then
  return {now, record, redis.call('ZSCORE', KEYS[4], ARGV[1]) or false}
end
record = redis.call('HGET', KEYS[2], ARGV[1])
if record then
  return {now, record, redis.call('ZSCORE', KEYS[3], ARGV[1]) or false}
end
return {now, false, false}
"""


def why(app: Any, task_id: str, *, keys: list[str] | None = None) -> dict[str, Any]:
    """Where task ``task_id`` stands, as a JSON-ready dict: ``state`` is ``"running"``,
    ``"waiting"``, ``"parked"``, ``"done"`` or ``"unknown"``; while it waits (or is parked),
    ``keys`` has an entry per key it waits on, with its ``position`` and what it is
    ``blocked_by`` (``"limit"``, ``"rate"``, ``"spacing"``, ``"pause"``, ``"tenant_cap"`` or
    ``"line"``).
    ``keys``: the semaphore keys to look at, when the task's arguments name them."""
    app.loader.import_default_modules()
    catalogue = Catalogue(app)
    task_id = str(task_id)
    meta = _result_meta(app, task_id)
    looks, task_name, notes = _looks(catalogue, task_id, keys or [], meta)
    views = look(catalogue.client, looks)
    if not keys and not any(view.held or view.place is not None for view in views):
        # a task placed as it was sent has no result state yet: its parked record names its key
        parked_looks = [item for item in _parked_looks(catalogue, task_id) if item.key not in {i.key for i in looks}]
        if parked_looks:
            looks += parked_looks
            views += look(catalogue.client, parked_looks)
    answer: dict[str, Any] = {
        "task_id": task_id,
        "state": UNKNOWN,
        "task": task_name,
        "keys": [],
        "looked_at": sorted({item.key for item in looks}),
        "notes": notes,
    }
    if meta is not None:
        answer["result"] = {"state": meta.get("status"), "date_done": _text_or_none(meta.get("date_done"))}
    held = [(view, holding) for view in views for holding in view.held]
    waiting = [view for view in views if view.place is not None]
    found = [view.key for view, _ in held] + [view.key for view in waiting]
    if task_name is None and found:
        owner = catalogue.task_for(found[0])  # the task whose calls use the key it was found in
        answer["task"] = str(owner.name) if owner is not None else None
    if held:
        answer["state"] = RUNNING
        answer["slots"] = [
            {
                "key": view.key,
                "token": holding.token,
                "worker": holding.label,
                "held_for": round(holding.held_for, 3),
                "lease_left": round(holding.lease_left, 3),
            }
            for view, holding in held
        ]
    elif waiting:
        answer["keys"] = [_waiting_entry(view) for view in waiting]
        parked = [view for view in waiting if view.place is not None and view.place.parked]
        answer["state"] = PARKED if parked else WAITING
        if parked:
            answer["parked"] = _parked(catalogue, parked[0], looks)
    elif meta is not None and meta.get("status") in states.READY_STATES:
        answer["state"] = DONE
    elif not looks:
        notes.append("no semaphore key to look at: pass --key KEY")
    else:
        notes.append(
            "not holding or waiting in any key looked at; a task whose key comes from its "
            "arguments is found with --key KEY, or with result_extended = True once it has a result state"
        )
    return answer


def _text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _result_meta(app: Any, task_id: str) -> dict[str, Any] | None:
    """The result backend's record of the task (one round trip), or None: no backend, no record
    (PENDING is what a backend says of an id it never heard of), or the backend cannot say."""
    backend = app.backend
    if isinstance(backend, DisabledBackend):
        return None
    try:
        meta = backend.get_task_meta(task_id)
    except Exception as error:
        logger.debug("could not ask the result backend about %s: %s", task_id, error)
        return None
    if not meta or meta.get("status") == states.PENDING:
        return None
    return dict(meta)


def _decoded(backend: Any, value: Any) -> Any:
    """Extended result arguments, decoded if the backend stored them encoded."""
    if isinstance(value, (bytes, str)):
        try:
            return backend.decode(value)
        except Exception:
            return None
    return value


def _waiter_of(task: Any, key_of_task: str, args: tuple[Any, ...] | None, kwargs: dict[str, Any] | None) -> str:
    """The waiter id the task's calls stand in line under (the weight in front for a task of
    several keys or a weight: ``MultiSemaphore.waiter_id``)."""
    if task is None or (not isinstance(key_option(type(task)), list) and weight_option(type(task)) is None):
        return key_of_task
    weight = weight_option(type(task))
    if callable(weight):
        if args is None:
            return weighted_waiter(1, key_of_task)  # a guess: the weight depends on the arguments
        weight = weight(args, kwargs or {})
    return weighted_waiter(int(weight or 1), key_of_task)


def _looks(
    catalogue: Catalogue, task_id: str, keys: list[str], meta: dict[str, Any] | None
) -> tuple[list[Look], str | None, list[str]]:
    """The keys to look at, and the waiter id and holder tokens to look for in each."""
    app, notes = catalogue.app, list[str]()
    key_of_task = waiter_key(task_id)
    tokens = token_prefix_pattern(f"{task_key(task_id)}:")
    name = meta.get("name") if meta else None
    task = app.tasks.get(name) if name else None
    looks: list[Look] = []
    if keys:
        for key in keys:
            semaphore = catalogue.semaphore(key, placeholder_limit=True)
            waiter = _waiter_of(catalogue.task_for(key), key_of_task, None, None)
            looks.append(Look(key, semaphore.keys, waiter, tokens, semaphore.rules.arg))
        return looks, name, notes
    if task is not None and is_semaphore_task(task) and meta is not None and meta.get("args") is not None:
        args = tuple(_decoded(app.backend, meta.get("args")) or ())
        kwargs = dict(_decoded(app.backend, meta.get("kwargs")) or {})
        try:
            call = semaphore_for_call(task, args, kwargs)
        except Exception as error:  # a key that no longer resolves (settings changed): look wider
            notes.append(f"the keys of the call could not be computed: {error}")
        else:
            waiter = call.waiter_id(key_of_task) if isinstance(call, MultiSemaphore) else key_of_task
            for member in members(call):
                looks.append(Look(member.name, member.keys, waiter, tokens, member.rules.arg))
            return looks, name, notes
    for key, owner in sorted(catalogue.fixed.items()):
        if task is not None and owner is not task:
            continue
        semaphore = catalogue.semaphore(key, placeholder_limit=True)
        looks.append(Look(key, semaphore.keys, _waiter_of(owner, key_of_task, None, None), tokens, semaphore.rules.arg))
    return looks, name, notes


def _parked_looks(catalogue: Catalogue, task_id: str) -> list[Look]:
    """The keys whose lines hold ``task_id`` parked, read from the parked-task records (one scan
    of them, and of an earlier release's waiters' index, for a task found nowhere else): a task
    placed as it was sent is parked before the result backend has anything of it, and a key
    built from its arguments (``"crawl:{host}"``) is named by its record alone."""
    key_of_task = waiter_key(task_id)
    keys, prefix = parked_keys(catalogue.config.prefix), catalogue.config.prefix
    pattern = "*" + RECORD_SEPARATOR + "".join(f"\\{char}" if char in "*?[]\\" else char for char in key_of_task)
    tokens = token_prefix_pattern(f"{task_key(task_id)}:")
    looks: list[Look] = []
    names: list[str] = []
    try:
        for entry in _entries_matching(catalogue.client, keys, pattern):
            line = as_text(entry)[: -len(RECORD_SEPARATOR + key_of_task)]
            names.append(name_of_base(prefix, base_of_line(prefix, line)))
        for _, record in catalogue.client.hscan_iter(keys.old_waiters, match=pattern, count=1000):
            names.append(OldParkedRecord.read(as_text(record)).name)
    except Exception as error:  # the answer stays "unknown", with the keys it looked at
        logger.debug("could not read the parked records of %s: %s", task_id, error)
        return looks
    for name in dict.fromkeys(names):
        try:
            semaphore = catalogue.semaphore(name, placeholder_limit=True)
        except Exception as error:  # a key no longer known
            logger.debug("could not read a parked record of %s: %s", task_id, error)
            continue
        waiter = _waiter_of(catalogue.task_for(name), key_of_task, None, None)
        looks.append(Look(name, semaphore.keys, waiter, tokens, semaphore.rules.arg))
    return looks


def _entries_matching(client: Any, keys: ParkedKeys, pattern: str) -> list[bytes]:
    """The record entries matching ``pattern`` in every bucket and in an earlier release's
    records: one round trip for the first page of all (a bucket of the compact encoding is one
    page), then one per further page of a large one."""
    names = [*(keys.bucket_records(bucket) for bucket in range(RECORD_BUCKETS)), keys.flat_records]
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hscan(name, 0, match=pattern, count=1000)
    entries: list[bytes] = []
    for name, (cursor, found) in zip(names, pipe.execute(), strict=True):
        entries += found
        while cursor:
            cursor, found = client.hscan(name, cursor, match=pattern, count=1000)
            entries += found
    return entries


def _waiting_entry(view: KeyView) -> dict[str, Any]:
    place = view.place
    assert place is not None
    estimate = view.estimate()
    gate = view.gate
    return {
        "key": view.key,
        "position": place.position,
        "blocked_by": view.blocked_by(),
        "tenant": place.tenant,
        "tenant_slots": place.tenant_slots if view.per_tenant is not None else None,
        "per_tenant": view.per_tenant,
        "waiters_ahead": place.position,
        "waiter_count": view.waiter_count,
        "limit": view.limit if view.limit < 2**31 else None,
        "held": view.holder_count,
        "offered": view.offered_count,
        "free": view.free if view.limit < 2**31 else None,
        "present": place.present,
        "parked": place.parked,
        "slot_offered": place.offer_opens_in is not None,
        "waited": None if place.waited is None else round(place.waited, 3),
        "place_kept_for": round(place.must_ask_within, 3),
        "rules": {
            "paused_for": gate.paused_for if 0 < gate.paused_for < LONG_PAUSE_MS / 1000 else None,
            "paused": gate.paused_for > 0,
            "rate": f"{gate.rate_count}/{gate.rate_period:g}s" if gate.rate_count else None,
            "rate_opens_in": gate.rate_wait,
            "spacing": gate.spacing or None,
            "spacing_opens_in": gate.spacing_wait,
        },
        "hold_time": view.hold_time,
        "estimated_start_in": None if estimate is None or estimate == float("inf") else round(estimate, 3),
        "holders_ahead": [
            {"worker": h.label, "held_for": round(h.held_for, 3), "lease_left": round(h.lease_left, 3)}
            for h in view.holders
        ],
        "waiters_just_ahead": view.ahead,
    }


def _parked(catalogue: Catalogue, view: KeyView, looks: list[Look]) -> dict[str, Any]:
    """When a parked task comes back: its wake copy as soon as a slot is offered to it; its
    backstop copy when its countdown ends (its place is kept that long plus ``AWAY_SLACK``);
    and a sweep sends its wake copy when its record is due, should no copy have asked."""
    place = view.place
    assert place is not None
    item = next(item for item in looks if item.key == view.key)
    answer: dict[str, Any] = {
        "key": view.key,
        "wake": "offered a slot now: its wake copy is on its way"
        if place.offer_opens_in is not None
        else "its wake copy is sent when a slot is offered to it",
        "backstop_due_in": round(max(0.0, place.must_ask_within - AWAY_SLACK), 3),
        "record_due_in": None,
    }
    keys, prefix = parked_keys(catalogue.config.prefix), catalogue.config.prefix
    entry = record_entry(prefix, item.keys.base, item.waiter)
    try:
        bucket = record_bucket(entry)
        kept_in = (keys.bucket_records(bucket), keys.flat_records, keys.flat_due, keys.leases)
        now, record, due_at = catalogue.client.eval(_PARKED_RECORD, len(kept_in), *kept_in, entry)
    except Exception as error:
        logger.debug("could not read the parked record of %s: %s", item.waiter, error)
        return answer
    if record:
        due_in_value, _ = split_due(bytes(record))
        dues = [due for due in (due_in_value, int(float(due_at)) if due_at else None) if due is not None]
        due_ms = min(dues) if dues else None  # a bucket's due time, or its lease's end if sooner
        answer["record_due_in"] = round((due_ms - int(now)) / 1000, 3) if due_ms is not None else None
        with contextlib.suppress(ValueError, TypeError, IndexError):
            answer["run"] = ParkedRecord.read(entry, bytes(record), prefix).run
    return answer
