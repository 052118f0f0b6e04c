"""A waiter is brought back by the operation that frees its start, not by its backstop copy
(real workers, Redis broker): an operator's resume, the release of a task with a key list when
the waiter's pool process is gone, and the worker's release of a killed weighted holder."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_semaphore import semaphore_for
from celery_semaphore._celery.tokens import waiter_key

from ..celery_stack import CeleryStack
from ..waiting import wait_until
from ..workers import ROOT, worker_group

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


def semaphore_cli(celery_stack: CeleryStack, *args: str) -> None:
    """``celery semaphore ...`` in a process of its own, as an operator runs it."""
    env = {**os.environ, **celery_stack.env, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "celery", "-A", "tests.proj.app", "semaphore", *args]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_resume_starts_the_head_of_the_line_at_once(proj: Any, celery_stack: CeleryStack) -> None:
    """Limit 1, a 30 s backstop: the key is paused (``celery semaphore pause``) and its holder
    ends meanwhile, so the waiter's wake copy is refused for a start after the pause; ``resume``
    starts it within 2 s."""
    key, probe = "proj.gated_slot", "paused-line"
    gate = f"resume-{uuid.uuid4().hex[:8]}"
    semaphore = semaphore_for(proj.app, key)
    retries = proj.probe(key).client
    with worker_group(celery_stack.env, queue="resume", names=("resume",), concurrency=2) as group:
        holder = proj.gated_slot.apply_async((gate,), {"key": probe}, queue="resume")
        wait_until(lambda: started_at(proj, probe, holder.id), timeout=30, what="the holder runs")
        waiter = proj.gated_slot.apply_async(("",), {"key": probe}, queue="resume")
        wait_until(
            lambda: any(w.waiter == waiter_key(waiter.id) and w.present for w in semaphore.status().waiters),
            timeout=30,
            what="the waiter parked",
        )
        semaphore_cli(celery_stack, "pause", key)
        proj.probe(gate).client.rpush(f"gate:{gate}", 1)
        assert holder.get(timeout=30) == holder.id
        # placed in line as it was sent, the waiter's only refusal is its wake copy's
        wait_until(
            lambda: retries.lrange(f"probe:{key}:retries", 0, -1).count(waiter.id.encode()) >= 1,
            timeout=30,
            what="the waiter's wake copy refused while paused",
        )
        semaphore_cli(celery_stack, "resume", key)
        resumed_at = time.time()
        assert waiter.get(timeout=120) == waiter.id, group[0].log()[-4000:]
    started = started_at(proj, probe, waiter.id)
    assert started is not None
    print(f"the head of the line started {started - resumed_at:.2f} s after the resume")
    assert started - resumed_at < 2


def hand_offs(proj: Any, key: str, task_ids: set[str]) -> list[float]:
    """Seconds from each body's end to the worker's receipt of the copy of the task whose body
    ran next (0 if it was there already): the semaphore's share of each hand-off, without the
    time a recycled pool takes to give the copy a process."""
    client = proj.probe(key).client

    def read(which: str) -> list[tuple[str, float]]:
        entries = (entry.decode().split() for entry in client.lrange(f"probe:{key}:{which}", 0, -1))
        return [(fields[0], float(fields[-1])) for fields in entries if fields[0] in task_ids]

    starts, ends, received = sorted(read("starts"), key=lambda e: e[1]), read("ends"), read("received")
    end_of = dict(ends)
    gaps = []
    for (before, _), (after, started) in itertools.pairwise(starts):
        arrived = max(at for task_id, at in received if task_id == after and at <= started)
        gaps.append(max(0.0, arrived - end_of[before]))
    return gaps


def test_a_key_list_hands_on_at_once_when_pool_processes_are_recycled(proj: Any, celery_stack: CeleryStack) -> None:
    """``worker_max_tasks_per_child=1``, limit 1, six tasks of 0.5 s with the key list
    ["z:a", "z:b"], each refused one parked and its pool process gone: the releasing process
    wakes the next task itself, as it does for one key, so every hand-off reaches the worker
    within 0.5 s (before: up to a tick later, 0.4-1.35 s). Prints the makespans of both, which a
    recycled pool's respawns make noisy (4-11 s for either on a loaded machine), and the one-key
    run's hand-offs."""
    conf = {"worker_max_tasks_per_child": 1}
    runs = {}
    for name, task in (("one_key", proj.one_key), ("two_keys", proj.two_keys)):
        queue = name.replace("_", "-")
        with worker_group(celery_stack.env, queue=queue, names=(queue,), concurrency=3, conf=conf) as group:
            begun = time.monotonic()
            results: list[AsyncResult] = [task.apply_async((0.5,), queue=queue) for _ in range(6)]
            for result in results:
                assert result.get(timeout=120) == result.id, group[0].log()[-4000:]
            runs[name] = (time.monotonic() - begun, hand_offs(proj, name, {result.id for result in results}))
    (one, one_gaps), (listed, listed_gaps) = runs["one_key"], runs["two_keys"]
    print(
        f"six tasks at limit 1: {listed:.2f} s with a key list, {one:.2f} s with one key ({listed / one:.2f} x); "
        f"hand-offs (s): {[round(gap, 3) for gap in listed_gaps]} with a key list, "
        f"{[round(gap, 3) for gap in one_gaps]} with one key"
    )
    assert len(listed_gaps) == 5
    assert max(listed_gaps) < 0.5, listed_gaps


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
            lambda: any(w.waiter.endswith(waiter_key(waiter.id)) and w.present for w in semaphore.status().waiters),
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


def test_a_raised_limit_starts_a_parked_waiter_at_once(proj: Any, celery_stack: CeleryStack) -> None:
    """Limit 1 held by a running task, a waiter parked outside the worker: ``set-limit KEY 2``
    from the CLI offers it the new slot at once (set_limit.lua hands it on), and the process
    that parked it hears the offer and sends its wake copy: it starts within a second."""
    key, probe = "proj.gated_slot", "raised-line"
    gate = f"raise-{uuid.uuid4().hex[:8]}"
    semaphore = semaphore_for(proj.app, key)
    with worker_group(celery_stack.env, queue="raise", names=("raise",), concurrency=2) as group:
        holder = proj.gated_slot.apply_async((gate,), {"key": probe}, queue="raise")
        wait_until(lambda: started_at(proj, probe, holder.id), timeout=30, what="the holder runs")
        waiter = proj.gated_slot.apply_async(("",), {"key": probe}, queue="raise")
        wait_until(
            lambda: any(w.waiter == waiter_key(waiter.id) and w.present for w in semaphore.status().waiters),
            timeout=30,
            what="the waiter parked outside the worker (as it was sent)",
        )
        try:
            # timed from the CLI's return, when the new limit is in Redis: the CLI's own start (a
            # Python process importing Celery, over a second on a loaded 2-core host) is no wake
            semaphore_cli(celery_stack, "set-limit", key, "2")
            raised_at = time.time()
            assert waiter.get(timeout=60) == waiter.id, group[0].log()[-4000:]
        finally:
            semaphore_cli(celery_stack, "unset-limit", key)
            proj.probe(gate).client.rpush(f"gate:{gate}", 1)
        assert holder.get(timeout=30) == holder.id
    started = started_at(proj, probe, waiter.id)
    assert started is not None
    print(f"the parked waiter started {started - raised_at:.2f} s after the limit was raised")
    assert started - raised_at < 1.5
