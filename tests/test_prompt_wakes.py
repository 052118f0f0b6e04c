"""A waiter is brought back by the operation that frees its start, not by its backstop copy
(real workers, Redis broker): the worker's release of a killed weighted holder."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from celery_semaphore import semaphore_for
from celery_semaphore._celery.tokens import task_key

from .celery_stack import CeleryStack
from .waiting import wait_until
from .workers import worker_group

pytestmark = pytest.mark.workers


@pytest.fixture
def proj(celery_stack: CeleryStack) -> Any:
    import tests.proj.app as proj

    return proj


def started_at(proj: Any, key: str, task_id: str) -> float | None:
    """When the body of ``task_id`` started (the probe's "starts" of ``key``), None before."""
    for entry in proj.probe(key).client.lrange(f"probe:{key}:starts", 0, -1):
        fields = entry.decode().split()
        if fields[0] == task_id:
            return float(fields[-1])
    return None


def pid_of(proj: Any, key: str, task_id: str) -> int | None:
    for entry in proj.probe(key).client.lrange(f"probe:{key}:starts", 0, -1):
        fields = entry.decode().split()
        if fields[0] == task_id:
            return int(fields[1])
    return None


def test_a_killed_weighted_holder_gives_back_all_its_slots_at_once(proj: Any, celery_stack: CeleryStack) -> None:
    """Weight 3 of limit 4: the pool process of the holder is SIGKILLed; its worker gives back
    all three slots in one release, and the next weight-3 task starts within 10 s of the kill,
    not when the 60 s lease or the 60 s backstop ends. (Celery's main process notices the lost
    child about 5 s after the kill here; the slots go back within 50 ms of that.)"""
    key = "heavy"
    semaphore = semaphore_for(proj.app, key)
    with worker_group(celery_stack.env, queue="heavy", names=("heavy",), concurrency=2) as group:
        holder = proj.heavy.apply_async((60,), queue="heavy")
        pid = wait_until(lambda: pid_of(proj, key, holder.id), timeout=30, what="the holder runs")
        waiter = proj.heavy.apply_async((0.1,), queue="heavy")
        wait_until(
            lambda: any(w.waiter.endswith(task_key(waiter.id)) and w.present for w in semaphore.status().waiters),
            timeout=30,
            what="the next weight-3 task parked",
        )
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        assert waiter.get(timeout=120) == waiter.id, group[0].log()[-4000:]
        log = group[0].log()
    assert f"released 3 slot(s) of proj.heavy[{holder.id}] for a killed child" in log, log[-4000:]
    started = started_at(proj, key, waiter.id)
    assert started is not None
    print(f"the next weight-3 task started {started - killed_at:.2f} s after its holder's process was killed")
    assert started - killed_at < 10
