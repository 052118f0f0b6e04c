"""No waiter is stranded when processes come and go (real workers, Redis broker).

A parked task is woken on its pool process's channel. When that process is gone (recycled by
``worker_max_tasks_per_child``, OOM-killed, its worker SIGKILLed), nobody hears the offer: the
process that made it sends the task's wake copy itself, from the record kept in Redis. And when
a holder's worker dies, its lease lapses with no script running on a line of parked waiters: a
tick, once a second from one worker process, hands the slot on.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_semaphore import semaphore_for
from celery_semaphore._celery.tokens import waiter_key

from ..celery_stack import CeleryStack
from ..waiting import wait_until
from ..workers import worker_group

pytestmark = pytest.mark.workers


@pytest.fixture
def proj(celery_stack: CeleryStack) -> Any:
    import tests.proj.app as proj

    return proj


def runs(proj: Any, key: str, which: str = "starts") -> list[tuple[str, int, float]]:
    entries = proj.probe(key).client.lrange(f"probe:{key}:{which}", 0, -1)
    return [(task_id.decode(), int(pid), float(at)) for task_id, pid, at in (entry.split() for entry in entries)]


def hand_offs(proj: Any, key: str) -> list[tuple[float, float]]:
    """(seconds from each body's end to the next body's start, that end), in order."""
    starts = sorted(at for _, _, at in runs(proj, key))
    ends = sorted(at for _, _, at in runs(proj, key, "ends"))
    return [(start - end, end) for end, start in zip(ends, starts[1:], strict=False)]


def makespan(proj: Any, queue: str, count: int) -> float:
    """Seconds from sending ``count`` 0.5 s tasks of limit 1 to the last result."""
    started = time.monotonic()
    results: list[AsyncResult] = [proj.recycled.apply_async((0.5,), queue=queue) for _ in range(count)]
    for result in results:
        assert result.get(timeout=120) == result.id
    return time.monotonic() - started


def test_worker_max_tasks_per_child_strands_no_waiter(proj: Any, celery_stack: CeleryStack) -> None:
    """6 tasks of 0.5 s at limit 1, concurrency 3, every refused task parked (its pool process
    recycled right after parking): no task waits out its 30 s backstop, so the run ends within
    half of one backstop (at e612df5: one start per backstop, 121.5 s). Prints the makespan
    against the same run without recycling: typically 1.1-1.25 x here, but the pool's respawn of
    a child per task can hold a received task for seconds (10.7 s once in CI), so the 2 x of the
    issue is reported, not asserted."""
    with worker_group(celery_stack.env, queue="steady", names=("steady",), concurrency=3):
        baseline = makespan(proj, "steady", 6)
    with worker_group(
        celery_stack.env, queue="recycling", names=("recycling",), concurrency=3, conf={"worker_max_tasks_per_child": 1}
    ) as group:
        recycled = makespan(proj, "recycling", 6)
        log = group[0].log()
    print(
        f"makespan: {recycled:.2f} s with worker_max_tasks_per_child=1, {baseline:.2f} s without "
        f"({recycled / baseline:.2f} x)"
    )
    assert recycled < 30 / 2, log[-4000:]
    assert proj.probe("recycled").client.get("probe:recycled:max") in (None, b"1")


def test_a_slot_whose_holders_worker_was_killed_reaches_a_parked_waiter_within_the_lease(
    proj: Any,
    celery_stack: CeleryStack,
) -> None:
    """Limit 1, a 3 s lease: the holder's whole worker is SIGKILLed; the task parked on another
    worker starts within the lease + 2 s of the kill, not at its 30 s backstop."""
    key = "short_lease"
    with (
        worker_group(
            celery_stack.env, queue="lease-holder", names=("lease-holder",), concurrency=1, kill_at_end=True
        ) as holders,
        worker_group(celery_stack.env, queue="lease-waiter", names=("lease-waiter",), concurrency=1) as waiters,
    ):
        holder = proj.short_lease.apply_async((60,), queue="lease-holder")
        wait_until(lambda: any(run[0] == holder.id for run in runs(proj, key)), timeout=30, what="the holder runs")
        waiter = proj.short_lease.apply_async((0.1,), queue="lease-waiter")
        semaphore = semaphore_for(proj.app, "proj.short_lease")
        wait_until(
            lambda: any(w.waiter == waiter_key(waiter.id) and w.present for w in semaphore.status().waiters),
            timeout=30,
            what="the waiter parked",
        )
        killed_at = time.time()
        holders[0].kill()
        assert waiter.get(timeout=60) == waiter.id, waiters[0].log()[-4000:]
        ((_, _, started_at),) = [run for run in runs(proj, key) if run[0] == waiter.id]
        print(f"the parked waiter started {started_at - killed_at:.2f} s after the holder's worker was killed")
        assert started_at - killed_at <= 3 + 2


def test_under_a_hard_time_limit_the_next_body_starts_only_once_the_killed_one_stopped(
    proj: Any,
    celery_stack: CeleryStack,
) -> None:
    """A body that ignores the SIGTERM of its hard time limit runs on until the SIGKILL that
    follows; its slot must not go to the next task before then. Each body beats in Redis every
    5 ms (an independent probe): the second body starts after the first one's last beat."""
    key = "stubborn"
    with worker_group(celery_stack.env, queue="stubborn", names=("stubborn",), concurrency=2):
        first = proj.stubborn.apply_async(queue="stubborn")
        wait_until(lambda: any(run[0] == first.id for run in runs(proj, key)), timeout=30, what="the first runs")
        second = proj.after_stubborn.apply_async(queue="stubborn")
        assert second.get(timeout=30) == second.id
        with pytest.raises(Exception, match=r"(?i)time ?limit"):
            first.get(timeout=30)
    alive = {
        task_id.decode(): float(at) for task_id, at in proj.probe(key).client.hgetall(f"probe:{key}:alive").items()
    }
    ((_, _, second_started),) = [run for run in runs(proj, key) if run[0] == second.id]
    print(f"the second body started {second_started - alive[first.id]:+.3f} s after the first one's last beat")
    assert second_started > alive[first.id]


@pytest.mark.slow
def test_a_rolling_restart_strands_no_waiter(proj: Any, celery_stack: CeleryStack) -> None:
    """200 contended tasks of 0.1 s at limit 1 on two workers, one of them warm-restarted every
    10 s (its pool processes, with the tasks they parked, go away each time): every release
    reaches the next start within 2.5 s. Prints the hand-off times outside the restarts (the
    benchmark, not this test, holds them to their targets)."""
    import threading

    key, count = "rolling", 200
    with worker_group(celery_stack.env, queue="rolling", names=("steady", "restarted"), concurrency=4) as group:
        restarts: list[tuple[float, float]] = []
        done = threading.Event()

        def restart_every_10_s() -> None:
            while not done.wait(10):
                began = time.time()
                group[1].stop()
                group[1] = group[1].__class__(group[1].env, name=group[1].name, concurrency=4).start()
                restarts.append((began, time.time()))

        restarter = threading.Thread(target=restart_every_10_s, daemon=True)
        results = [proj.rolling.apply_async((0.1,), queue="rolling") for _ in range(count)]
        restarter.start()
        try:
            for result in results:
                assert result.get(timeout=300) == result.id
        finally:
            done.set()
            restarter.join(timeout=60)
    assert len(runs(proj, key)) == len(runs(proj, key, "ends")) == count
    gaps = hand_offs(proj, key)
    worst = max(gap for gap, _ in gaps)
    outside = sorted(gap for gap, at in gaps if not any(a - 1 <= at <= b + 1 for a, b in restarts))
    p50, p90, p99 = (outside[int(q * (len(outside) - 1))] * 1000 for q in (0.5, 0.9, 0.99))
    print(
        f"{len(restarts)} restarts; release to next start: max {worst:.3f} s; outside the restarts p50 "
        f"{p50:.1f} ms, p90 {p90:.1f} ms, p99 {p99:.1f} ms ({len(outside)} samples)"
    )
    origin = min(at for _, _, at in runs(proj, key))
    slowest = sorted(gaps, reverse=True)[:3]
    print(
        "restarts at "
        + ", ".join(f"{a - origin:.2f}-{b - origin:.2f} s" for a, b in restarts)
        + "; slowest hand-offs after the releases at "
        + ", ".join(f"{at - origin:.2f} s ({gap:.3f} s)" for gap, at in slowest)
    )
    assert restarts, "the test restarted nothing"
    assert worst <= 2.5


@pytest.mark.slow
def test_a_worker_in_a_long_warm_shutdown_hands_back_its_wake_copy_at_once(
    proj: Any, celery_stack: CeleryStack
) -> None:
    """Two workers, limit 1, 60 contended tasks of 0.1 s, all parked after the first second, so
    wake copies are all the workers fetch. One worker is warm-shut-down while a 6 s task (no
    semaphore) keeps it busy: the wake copy its pending BRPOP took as it stopped consuming goes
    back to the broker at once (handing_back.py), not when its connection closes 6 s later, so
    every release reaches the next start within 1.5 s (before: a claim window and a tick, 2.6 s
    measured; the hand-off steps at the stop are printed)."""
    key, count = "hand-back", 60
    probe = proj.probe(key).client
    with worker_group(celery_stack.env, queue="hand-back", names=("steady", "stopping"), concurrency=4) as group:
        results = [proj.rolling.apply_async((0.1, key), queue="hand-back") for _ in range(count)]
        wait_until(lambda: probe.llen(f"probe:{key}:starts") >= 10, timeout=60, what="10 tasks ran")
        proj.app.control.add_consumer("hand-back-long", destination=["stopping@127.0.0.1"], reply=True)
        long_task = proj.unlimited.apply_async((6.0, f"{key}-long"), queue="hand-back-long")
        wait_until(lambda: probe.llen(f"probe:{key}-long:starts") == 1, timeout=30, what="the long task runs")
        stopped_at = time.time()
        group[1].stop()
        stop_took = time.time() - stopped_at
        assert long_task.get(timeout=30) == long_task.id
        for result in results:
            assert result.get(timeout=120) == result.id
        stopping_log = group[1].log()
    gaps = hand_offs(proj, key)
    near_the_stop = [f"{gap * 1000:.0f}" for gap, at in gaps if stopped_at - 0.5 <= at <= stopped_at + stop_took]
    handed_back = "handed 1 woken task" in stopping_log or "for queue 'hand-back.semaphore-wake'" in stopping_log
    print(
        f"the stop took {stop_took:.1f} s; hand-offs during it (ms): {', '.join(near_the_stop)}; "
        f"the stopping worker handed a wake copy back: {handed_back}"
    )
    assert stop_took >= 5, "the stop did not wait for the long task"
    assert handed_back, "the stopping worker held no wake copy: the test saw nothing to hand back"
    assert max(gap for gap, _ in gaps) <= 1.5


def makespan_of(sender: Any, queue: str, count: int, seconds: float) -> float:
    """Seconds from sending ``count`` proj.recycled tasks of ``seconds`` (limit 1) to the last result."""
    started = time.monotonic()
    results: list[AsyncResult] = [sender.send_task("proj.recycled", (seconds,), queue=queue) for _ in range(count)]
    for result in results:
        assert result.get(timeout=180) == result.id
    return time.monotonic() - started


@pytest.mark.slow
@pytest.mark.parametrize("broker", ["redis", pytest.param("amqp", marks=pytest.mark.rabbitmq)])
def test_worker_eta_task_limit_strands_no_waiter(proj: Any, celery_stack: CeleryStack, broker: str) -> None:
    """100 tasks of 0.1 s at limit 1, concurrency 2, every refused task parked with a 30 s
    backstop, with ``worker_eta_task_limit=8`` and without: within 1.2 x. At e612df5 the backstop
    copies, held as countdown messages, filled the prefetch window at the limit and no wake copy
    was fetched (2 tasks every 30 s). On RabbitMQ they wait in backstop queues, held by the main
    process outside that window; on the Redis broker in the broker's Redis (due_copies.py: it
    ran 2 tasks every 30 s there until then)."""
    from celery import Celery
    from kombu import Connection

    from .test_rabbitmq import amqp_url_or_skip

    url = amqp_url_or_skip() if broker == "amqp" else celery_stack.env["PROJ_BROKER_URL"]
    env = {**celery_stack.env, "PROJ_BROKER_URL": url}
    sender = Celery("sender", broker=url, backend=celery_stack.env["PROJ_RESULT_URL"], set_as_current=False)
    free, capped = f"celery-semaphore-eta-free-{time.time_ns()}", f"celery-semaphore-eta-capped-{time.time_ns()}"
    try:
        with worker_group(env, queue=free, names=("eta_free",), concurrency=2):
            baseline = makespan_of(sender, free, 100, 0.1)
        with worker_group(
            env, queue=capped, names=("eta_capped",), concurrency=2, conf={"worker_eta_task_limit": 8}
        ) as group:
            limited = makespan_of(sender, capped, 100, 0.1)
            log = group[0].log()
    finally:
        with Connection(url) as connection:
            for queue in (free, capped) if broker == "amqp" else ():
                for name in (queue, f"{queue}.semaphore-wake", f"{queue}.semaphore-backstop"):
                    try:
                        connection.channel().queue_delete(name)
                    except Exception as error:  # never declared: nothing to delete
                        print(f"could not delete {name}: {error}")
    print(
        f"makespan: {limited:.2f} s with worker_eta_task_limit=8, {baseline:.2f} s without ({limited / baseline:.2f} x)"
    )
    assert limited <= 1.2 * baseline, log[-4000:]
    assert proj.probe("recycled").client.get("probe:recycled:max") in (None, b"1")


def moments(proj: Any, key: str, which: str = "starts") -> list[float]:
    """When bodies of ``key`` started (or ended), as ``_held`` records them ("<task id> <time>")."""
    return [float(entry.split()[1]) for entry in proj.probe(key).client.lrange(f"probe:{key}:{which}", 0, -1)]


def test_a_worker_keeps_a_pool_process_free_of_waiting_tasks(proj: Any, celery_stack: CeleryStack) -> None:
    """Concurrency 2, limit 1: one process holds the slot for 2 s; the refused task behind it,
    whose turn is next, would wait in the other process (semaphore_inline_wait) and leave none
    for a task that can run now. It parks instead: a plain task sent meanwhile starts at once,
    and the parked one still starts right after the release."""
    key = "room"
    with worker_group(celery_stack.env, queue="room", names=("room",), concurrency=2):
        holder = proj.sleepy.apply_async((2.0, key), queue="room")
        wait_until(lambda: len(moments(proj, key)) == 1, timeout=30)
        waiter = proj.sleepy.apply_async((0.1, key), queue="room")
        wait_until(lambda: semaphore_for(proj.app, "proj.sleepy").status().waiter_count == 1, timeout=30)
        sent = time.time()
        plain = proj.unlimited.apply_async((0.1, "room-plain"), queue="room")
        plain.get(timeout=30)
        started_plain = moments(proj, "room-plain")[0]
        holder.get(timeout=30)
        waiter.get(timeout=30)
    assert started_plain - sent < 1.0, f"the plain task started {started_plain - sent:.2f} s after it was sent"
    assert moments(proj, key)[1] - moments(proj, key, "ends")[0] < 0.5
