"""SemaphoreTask with real `celery worker` processes (prefork) on a Redis broker.

Two workers of four pool processes each serve one queue of this module. Tasks record their
start and end in Redis through the concurrency probe, so each test checks the true number of
concurrent executions, not what the semaphore believes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery.result import AsyncResult

from celery_semaphore import FairSemaphore, SemaphoreUnavailable
from celery_semaphore._core.clients import client_for

from ..celery_stack import CeleryStack
from ..parked import due_times, records
from ..waiting import wait_until
from ..workers import Worker, worker_group

# real `celery worker` processes: `pytest -m "not workers"` leaves these out
pytestmark = pytest.mark.workers

QUEUE = "workers"


@pytest.fixture(scope="module")
def workers(celery_stack: CeleryStack) -> Iterator[list[Worker]]:
    with worker_group(celery_stack.env, queue=QUEUE, names=("w1", "w2")) as group:
        yield group


@pytest.fixture
def proj(celery_stack: CeleryStack, workers: list[Worker]) -> Any:
    import tests.proj.app as proj

    return proj


def send(task: Any, *args: Any, **options: Any) -> AsyncResult:
    return task.apply_async(args, queue=QUEUE, **options)


def semaphore(proj: Any, key: str, limit: int = 1) -> FairSemaphore:
    return FairSemaphore(client_for(proj.app.conf.semaphore_backend_url), key, limit)


def holders(proj: Any, key: str) -> int:
    return semaphore(proj, key).status().holder_count


def test_limit_holds_and_is_reached_with_40_tasks_on_two_workers(proj: Any) -> None:
    """40 tasks, limit 3, 2 workers x 4 children: at most 3 run at once, 3 do, each runs once,
    and no slot is held at the end."""
    key = "limit-40"
    results = [send(proj.hold, 0.2, key) for _ in range(40)]
    # hold's semaphore is its task name, limit 3 in code; `key` only names its probe
    ids = [r.get(timeout=120) for r in results]
    probe = proj.probe(key)
    assert sorted(ids) == sorted(r.id for r in results)
    assert probe.maximum == 3
    assert probe.entries == 40
    assert len({entry.split()[0] for entry in probe.client.lrange(f"probe:{key}:starts", 0, -1)}) == 40
    wait_until(lambda: holders(proj, "proj.hold") == 0, timeout=10, what="every slot released")


def test_a_pool_process_has_prometheus_client_before_its_first_task(proj: Any) -> None:
    """The worker imports prometheus_client before its pool forks: a pool process importing it
    at its first grant held that hand-off back by about 45 ms. A plain task (no grant, nothing
    of the library's in its call) finds it imported, in every pool process it reaches."""
    results = [send(proj.imported, "prometheus_client") for _ in range(16)]
    assert [result.get(timeout=60) for result in results] == [True] * 16


def test_waiting_by_countdown_leaves_retries_and_max_retries_alone(proj: Any) -> None:
    """A task with max_retries=0 that waits through countdown re-sends still succeeds, with
    request.retries untouched and the wait count carried in headers: the package's own, under
    their prefix (csem_), none under the prefix of the task options (semaphore_)."""
    results = [send(proj.no_retries, 0.3) for _ in range(4)]
    reports = [r.get(timeout=120) for r in results]
    assert all(report["retries"] == 0 for report in reports)
    assert max(report["waits"] or 0 for report in reports) >= 1, "some task waited by countdown"
    for report in reports:
        assert {"csem_sent", "csem_message"} <= set(report["headers"]), report
        assert not [name for name in report["headers"] if name.startswith("semaphore_")], report
        assert not report["waits"] or {"csem_waits", "csem_run", "csem_queue"} <= set(report["headers"]), report
    assert proj.probe("proj.no_retries").maximum == 1


@pytest.mark.parametrize(
    ("task_name", "args"),
    [("fail", ("boom",)), ("ignored", ()), ("rejected", ())],
)
def test_every_exit_of_the_body_releases_the_slot(proj: Any, task_name: str, args: tuple[Any, ...]) -> None:
    """An exception, Ignore and Reject each give the slot back at once."""
    task = getattr(proj, task_name)
    result = send(task, *args)
    wait_until(
        lambda: holders(proj, task.name) == 0 and _ran(proj, result), timeout=30, what=f"{task_name} to end and release"
    )
    second = send(task, *args)
    wait_until(lambda: _ran(proj, second), timeout=30, what="the next task to get the slot")
    assert holders(proj, task.name) == 0


def _ran(proj: Any, result: AsyncResult) -> bool:
    # Ignore and Reject store no state; the worker log is the witness then
    return result.state in {"SUCCESS", "FAILURE"} or any(
        f"[{result.id}] ignored" in line or f"[{result.id}] rejected" in line for line in _all_logs(proj)
    )


def _all_logs(proj: Any) -> list[str]:
    return [line for worker in proj._test_workers for line in worker.log().splitlines()]


@pytest.fixture(autouse=True)
def _expose_workers(proj: Any, workers: list[Worker]) -> None:
    proj._test_workers = workers


def test_the_tasks_own_retry_releases_and_runs_again(proj: Any) -> None:
    """self.retry() inside the body releases the slot; the retried run takes it again."""
    result = send(proj.own_retry)
    assert result.get(timeout=60) == "second time"
    wait_until(lambda: holders(proj, "proj.own_retry") == 0, timeout=10, what="release")


def test_a_soft_time_limit_releases_at_once(proj: Any) -> None:
    """SoftTimeLimitExceeded raised in the body gives the slot back through the finally."""
    result = send(proj.soft_limited)
    with pytest.raises(SoftTimeLimitExceeded):
        result.get(timeout=60)
    wait_until(lambda: holders(proj, "proj.soft_limited") == 0, timeout=10, what="the slot back")


def test_a_hard_time_limit_releases_through_the_worker_parent(proj: Any) -> None:
    """A child killed by its hard time limit runs no finally; the worker's parent releases by
    task id, long before the 60 s lease would."""
    result = send(proj.hard_limited)
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=60)
    wait_until(lambda: holders(proj, "proj.hard_limited") == 0, timeout=10, what="the slot back")


def test_revoke_with_terminate_releases_at_once(proj: Any) -> None:
    """revoke(terminate=True) of a running holder frees its slot long before its 60 s lease."""
    key = "revoke-me"
    result = send(proj.sleepy, 120, key)
    wait_until(lambda: proj.probe(key).live == 1, timeout=30, what="the task to run")
    assert holders(proj, "proj.sleepy") == 1
    result.revoke(terminate=True, signal="SIGTERM")
    wait_until(lambda: holders(proj, "proj.sleepy") == 0, timeout=15, what="the slot back after revoke")


def test_a_second_copy_of_a_running_task_waits_for_the_first(proj: Any) -> None:
    """Two deliveries of one task id (as after a redelivery) never hold the slot together."""
    key = "duplicate"
    first = send(proj.sleepy, 1.0, key, task_id="same-id-twice")
    send(proj.sleepy, 1.0, key, task_id="same-id-twice")
    wait_until(
        lambda: proj.probe(key).entries == 2 and proj.probe(key).live == 0, timeout=60, what="both copies to run"
    )
    assert proj.probe(key).maximum == 1
    assert first.get(timeout=10) == "woke"


def test_per_key_limits_are_independent(proj: Any) -> None:
    """crawl:{host} keys each get their own limit of 2 (from the crawl:* glob)."""
    results = [send(proj.crawl, host, 0.3) for _ in range(6) for host in ("alpha", "beta")]
    for r in results:
        r.get(timeout=120)
    for host in ("alpha", "beta"):
        assert proj.probe(f"crawl:{host}").maximum == 2
        assert proj.probe(f"crawl:{host}").entries == 6


def test_a_limit_from_config_only(proj: Any) -> None:
    """A task with no limit in code takes it from semaphore_limits (2 here)."""
    results = [send(proj.config_only, 0.3) for _ in range(6)]
    for r in results:
        r.get(timeout=120)
    assert proj.probe("proj.config_only").maximum == 2


def test_max_wait_fails_the_task_with_semaphore_unavailable(proj: Any) -> None:
    """Past semaphore_max_wait a waiting task fails, visibly, with SemaphoreUnavailable, and
    forgets its parked record: no sweep may send it again once its place lapses."""
    from celery_semaphore._celery.due_copies import due_copies_for
    from celery_semaphore._celery.parking import parked_keys
    from celery_semaphore._celery.tokens import waiter_key

    impatient = semaphore(proj, "proj.impatient")
    blocker = impatient.acquire(timeout=0)
    try:
        result = send(proj.impatient)
        with pytest.raises(SemaphoreUnavailable):
            result.get(timeout=60)
        assert result.state == "FAILURE"
        keys, waiter = parked_keys(impatient.prefix), waiter_key(result.id).encode()
        assert not [entry for entry in due_times(impatient.client, keys) if entry.endswith(b"\n" + waiter)]
        assert not [entry for entry in records(impatient.client, keys) if entry.endswith(b"\n" + waiter)]
        # nor may a copy of its wait come back to fail it again (after a semaphore Redis restart,
        # a kept moved copy is sent again): none is stored or kept, and its run is remembered over
        store = due_copies_for(proj.app)
        assert store is not None
        copies, finished, sent = store.keys[1], store.keys[3], store.keys[5]
        of_task = [
            (name, run)
            for name in (copies, sent)
            for run in store.client.hkeys(name)
            if run.startswith(result.id.encode())
        ]
        assert not of_task
        assert [run for run in store.client.zrange(finished, 0, -1) if run.startswith(result.id.encode())]
    finally:
        blocker.release()


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_a_long_task_keeps_its_slot_past_its_lease(celery_stack: CeleryStack, pool: str) -> None:
    """A task running 3x its 2 s lease keeps the slot: the renewer in the pool process renews it
    (prefork child, threads pool, solo pool). (A 1 s lease was lost once on a loaded 2-core
    machine: a renewal every third of a second leaves little room for a starved thread.)"""
    import tests.proj.app as proj

    queue = f"long-{pool}"
    env = {**celery_stack.env, "PROJ_QUEUE": queue}
    concurrency = 1 if pool == "solo" else 2
    worker = Worker(env, name=queue, concurrency=concurrency, pool=pool, conf={"semaphore_lease": 2}).start()
    try:
        key = f"long-task-{pool}"
        results = [proj.sleepy.apply_async((6, key), queue=queue) for _ in range(2)]
        wait_until(lambda: proj.probe(key).live == 1, timeout=30, what="the first to run")
        for r in results:
            assert r.get(timeout=60) == "woke"
        assert proj.probe(key).maximum == 1
        assert "was lost" not in worker.log()
    finally:
        worker.stop()


def test_sigkill_of_a_worker_frees_its_slot_within_the_lease_and_the_task_reruns(
    celery_stack: CeleryStack,
) -> None:
    """A worker SIGKILLed while holding a slot (acks_late): its slot comes back within the 2 s
    lease and the task is delivered again and completes."""
    import tests.proj.app as proj

    env = {**celery_stack.env, "PROJ_QUEUE": "crash"}
    conf = {
        "semaphore_lease": 2,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # redeliver unacked messages of a dead worker after 4 s, sweeping every second
        "broker_transport_options": {
            "visibility_timeout": 4,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
    }
    victim = Worker(env, name="victim", concurrency=1, conf=conf).start()
    rescuer = Worker(env, name="rescuer", concurrency=1, conf=conf)
    try:
        key = "crash"
        result = proj.sleepy.apply_async((3, key), queue="crash", acks_late=True)
        wait_until(lambda: proj.probe(key).live == 1, timeout=30, what="the task to hold its slot")
        victim.kill()
        killed_at = time.monotonic()
        wait_until(lambda: holders(proj, "proj.sleepy") == 0, timeout=10, what="the lease to expire")
        assert time.monotonic() - killed_at < 2 + 1.5
        rescuer.start()
        assert result.get(timeout=90) == "woke"
        assert proj.probe(key).entries == 2, "run once before the crash and once after"
        assert "visibility_timeout (4.0 s)" in victim.log(), "warned: default countdowns reach it"
    finally:
        victim.kill()
        rescuer.stop()


def test_fail_closed_when_the_semaphore_redis_is_down(celery_stack: CeleryStack, proj: Any) -> None:
    """With the semaphore's Redis down the task does not run; once Redis is back, it does. The
    outage is logged once per pool process, and its end once, not on every refused try."""
    key = "redis-down"

    def count(text: str) -> int:
        return sum(text in line for line in _all_logs(proj))

    down_before, back_before = count("semaphore Redis unavailable"), count("semaphore Redis is back")
    celery_stack.semaphore.stop()
    try:
        result = send(proj.sleepy, 0.1, key)
        # a second refused try while Redis stays down (each try spends a while in redis-py's
        # own connection retries first)
        wait_until(
            lambda: count(f"{result.id}] retry: waiting") >= 2, timeout=120, interval=0.2, what="two refused tries"
        )
        assert proj.probe(key).entries == 0
    finally:
        celery_stack.semaphore.start()
    assert result.get(timeout=120) == "woke"
    assert proj.probe(key).entries == 1
    down = count("semaphore Redis unavailable") - down_before
    assert 1 <= down <= sum(w.concurrency for w in proj._test_workers), down
    assert count("semaphore Redis is back") - back_before <= down
    assert count("could not leave the line of 'proj.sleepy'") == 0


def test_a_tasks_own_retry_starts_a_fresh_wait(proj: Any) -> None:
    """A task that waited, ran and retried itself is not failed by its max wait when its retry
    waits again: the retry's wait starts afresh (Celery copies the old wait's headers into it)."""
    key = "proj.waits_then_retries"
    holder = semaphore(proj, key).acquire(timeout=5)
    result = send(proj.waits_then_retries, 0.1)
    try:
        # refused once: its first refusal is now, and the run and the 2 s retry delay follow it
        wait_until(lambda: semaphore(proj, key).status().waiter_count >= 1, timeout=30, what="the task waiting")
    finally:
        holder.release()
    wait_until(lambda: proj.probe(key).entries >= 1, timeout=30, what="the first run")
    holder = semaphore(proj, key).acquire(timeout=30)  # the retry (countdown 2 s) finds the slot taken
    try:
        wait_until(lambda: semaphore(proj, key).status().waiter_count >= 1, timeout=30, what="the retry waiting")
    finally:
        holder.release()
    assert result.get(timeout=60)["retries"] == 1
    assert proj.probe(key).entries == 2


def test_fail_open_runs_the_task_unprotected_with_a_warning(celery_stack: CeleryStack) -> None:
    """With semaphore_fail_open and no Redis at the semaphore URL, the task runs, and the worker
    logs that it ran without its semaphore."""
    import tests.proj.app as proj

    from ..redis_server import free_port

    env = {
        **celery_stack.env,
        "PROJ_QUEUE": "fail-open",
        "PROJ_SEMAPHORE_URL": f"redis://127.0.0.1:{free_port()}/1",  # nothing listens there
    }
    worker = Worker(env, name="fail-open", concurrency=1, conf={"semaphore_fail_open": True}).start()
    try:
        result = proj.sleepy.apply_async((0.1, "fail-open"), queue="fail-open")
        assert result.get(timeout=60) == "woke"
        assert "WITHOUT its semaphore" in worker.log()
    finally:
        worker.stop()


def test_a_semaphore_redis_restart_mid_run_loses_no_task_and_leaves_no_slot(
    celery_stack: CeleryStack, proj: Any
) -> None:
    """The semaphore's Redis restarts empty while 24 tasks run and wait: every task still runs
    exactly once and no slot stays held. (Over-admission during the restart window is the
    documented data-loss case, so the maximum is not asserted here.)"""
    key = "restart"
    results = [send(proj.crawl, key, 0.3) for _ in range(24)]
    wait_until(lambda: proj.probe(f"crawl:{key}").entries >= 4, timeout=60, what="the run under way")
    celery_stack.semaphore.restart()
    for result in results:
        assert result.get(timeout=180) == key
    starts = proj.probe(f"crawl:{key}").client.lrange(f"probe:crawl:{key}:starts", 0, -1)
    assert sorted(entry.split()[0] for entry in starts) == sorted(r.id.encode() for r in results)
    wait_until(
        lambda: semaphore(proj, f"crawl:{key}").status().holder_count == 0, timeout=30, what="no slot held at the end"
    )


def test_the_worker_warns_when_redis_may_evict_lease_keys(celery_stack: CeleryStack) -> None:
    """A semaphore Redis with a memory limit and an evicting maxmemory-policy draws a warning at start."""
    client = celery_stack.semaphore.client()
    client.config_set("maxmemory", "1gb")
    client.config_set("maxmemory-policy", "allkeys-lru")
    worker = Worker({**celery_stack.env, "PROJ_QUEUE": "evict"}, name="evict", concurrency=1, pool="solo")
    try:
        worker.start()
        assert "maxmemory-policy allkeys-lru" in worker.log()
        # and no false alarm from the start's check of Celery's internals (internals.py)
        assert "internal(s) it relies on changed" not in worker.log()
    finally:
        worker.stop()
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", "0")
