"""A woken task reaches the next free pool process before the tasks its worker received ahead
of it (real prefork workers, Redis broker).

A parked task's wake copy carries a turn: its slot idles until the copy asks. A worker keeps
the tasks it received and has no free process for in line, first in, first out, in Celery's
semaphore of pool processes (``worker_pool_putlocks``, the default). The wake copy goes to the
front of that line (``woken_first.py``).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from celery_semaphore import semaphore_for
from celery_semaphore._celery.tokens import waiter_key

from ..celery_stack import CeleryStack
from ..waiting import wait_until
from ..workers import worker_group

BLOCKERS = 5


@pytest.mark.workers
def test_a_woken_task_starts_before_the_tasks_received_ahead_of_it(celery_stack: CeleryStack) -> None:
    """One worker of one process: a parked task is woken while its process runs another task and
    5 plain tasks wait in the worker's line; when the process frees, the woken task runs first
    (before the change it ran last, its slot idle meanwhile)."""
    import tests.proj.app as proj

    key = "woken-first"  # the probe's: the slot is the task's
    probe = proj.probe(key).client
    conf: dict[str, Any] = {"worker_prefetch_multiplier": 10}
    with (
        worker_group(celery_stack.env, queue="woken-holder", names=("woken-holder",), concurrency=1),
        worker_group(celery_stack.env, queue="woken", names=("woken",), concurrency=1, conf=conf) as waiters,
    ):
        holder = proj.gated_slot.apply_async((f"{key}-holder", key), queue="woken-holder")
        wait_until(lambda: probe.llen(f"probe:{key}:starts") == 1, timeout=30, what="the holder runs")
        # sent by name, as it is: its worker refuses and parks it (placed at send, its wake copy
        # would be its first delivery)
        waiter = proj.app.send_task(proj.gated_slot.name, ("", key), queue="woken")
        semaphore = semaphore_for(proj.app, "proj.gated_slot")
        wait_until(
            lambda: (
                any(w.waiter == waiter_key(waiter.id) for w in semaphore.status().waiters)
                and first_delivery_ended(waiters[0].log(), waiter.id)
            ),
            timeout=30,
            what="the waiter parked",
        )
        occupier = proj.gated.apply_async((f"{key}-occupier",), queue="woken")
        blockers = [proj.unlimited.apply_async((0.05, f"{key}-blockers"), queue="woken") for _ in range(BLOCKERS)]
        broker = celery_stack.broker.client()
        wait_until(
            lambda: broker.llen("woken") == 0 and received(waiters[0].log(), occupier.id, *(b.id for b in blockers)),
            timeout=30,
            what="the occupier and the blockers in the worker",
        )
        # the first delivery, then its backstop copy (a countdown: the worker holds it till due)
        wait_until(lambda: received(waiters[0].log(), waiter.id, times=2), timeout=30, what="the backstop copy")
        probe.rpush(f"gate:{key}-holder", 1)  # the holder ends: its slot is offered to the parked waiter
        assert holder.get(timeout=30) == holder.id
        wait_until(lambda: received(waiters[0].log(), waiter.id, times=3), timeout=30, what="the wake copy received")
        probe.rpush(f"gate:{key}-occupier", 1)  # the worker's one process frees
        assert waiter.get(timeout=60) == waiter.id
        for blocker in blockers:
            blocker.get(timeout=60)
        occupier.get(timeout=30)
        broker.close()
    started = {
        entry.split()[0].decode(): float(entry.split()[1]) for entry in probe.lrange(f"probe:{key}:starts", 0, -1)
    }
    blockers_started = [float(entry.split()[1]) for entry in probe.lrange(f"probe:{key}-blockers:starts", 0, -1)]
    assert len(blockers_started) == BLOCKERS
    assert started[waiter.id] < min(blockers_started), (
        f"the woken task started {sum(at < started[waiter.id] for at in blockers_started)} tasks late"
    )


def received(log: str, *task_ids: str, times: int = 1) -> bool:
    return all(len(re.findall(rf"\[{re.escape(task_id)}\] received", log)) >= times for task_id in task_ids)


def first_delivery_ended(log: str, task_id: str) -> bool:
    """Whether the task's first delivery ended (retried, done or ignored)."""
    return bool(re.search(rf"\[{re.escape(task_id)}\] (retry|succeeded|ignored)", log, re.IGNORECASE))


def test_wake_copies_go_ahead_of_fresh_tasks_in_arrival_order_among_themselves() -> None:
    """The line itself (kombu's semaphore, as a prefork worker makes it): with no process free,
    fresh tasks and wake copies arrive mixed; they leave wake copies first, each kind in the
    order it came."""
    from types import SimpleNamespace

    from kombu.asynchronous.semaphore import LaxBoundedSemaphore

    from celery_semaphore._celery import woken_first

    line = LaxBoundedSemaphore(1)
    assert woken_first.install(SimpleNamespace(semaphore=line))
    started: list[str] = []

    def request(name: str, queue: str) -> Any:
        return SimpleNamespace(name=name, delivery_info={"routing_key": queue})

    line.acquire(lambda req: started.append(req.name), request("running", "q"))  # takes the one process
    for name, queue in [
        ("fresh1", "q"),
        ("woken1", "q.semaphore-wake"),
        ("fresh2", "q"),
        ("woken2", "q.semaphore-wake"),
    ]:
        line.acquire(lambda req: started.append(req.name), request(name, queue))
    for _ in range(4):
        line.release()
    assert started == ["running", "woken1", "woken2", "fresh1", "fresh2"]


def test_a_worker_without_a_line_of_that_shape_is_left_as_it_is() -> None:
    from types import SimpleNamespace

    from celery_semaphore._celery import woken_first

    assert not woken_first.install(SimpleNamespace(semaphore=None))  # thread, green and solo pools
    assert not woken_first.install(SimpleNamespace())


def test_a_stopping_worker_hands_back_the_wake_copies_no_process_accepted() -> None:
    """handing_back.py on the line itself (kombu's semaphore, as a prefork worker makes it) and
    on Celery's record of requests: a worker that stopped consuming rejects, with requeue, the
    wake copies it received that no pool process accepted (in its line, or in the pool's buffer),
    and takes them out of the line (a process freed during the shutdown must not run a copy the
    broker has back). Fresh tasks stay, for Celery to give back when its connection closes; a
    copy a process accepted runs; thread, green and solo pools hand back nothing of theirs."""
    from types import SimpleNamespace

    from celery.worker import state as worker_state
    from kombu.asynchronous.semaphore import LaxBoundedSemaphore

    from celery_semaphore._celery.handing_back import hand_back_before_close

    line = LaxBoundedSemaphore(1)
    started: list[str] = []
    rejected: list[tuple[str, bool]] = []

    class Request:
        def __init__(self, name: str, queue: str) -> None:
            self.id = self.name = name
            self.delivery_info, self.acknowledged = {"routing_key": queue}, False

        def reject(self, requeue: bool = False) -> None:
            rejected.append((self.name, requeue))
            self.acknowledged = True

    wake = "q.semaphore-wake"
    requests = {name: Request(name, queue) for name, queue in [("running", wake), ("fresh1", "q")]}
    requests.update((name, Request(name, wake)) for name in ("woken1", "woken2", "buffered", "accepted"))
    try:
        for request in requests.values():
            worker_state.task_reserved(request)
        worker_state.active_requests.add(requests["accepted"])
        line.acquire(lambda req: started.append(req.name), requests["running"])  # takes the one process
        worker_state.active_requests.add(requests["running"])
        for name in ("fresh1", "woken1", "woken2"):
            line.acquire(lambda req: started.append(req.name), requests[name])
        closed: list[bool] = []
        blueprint = SimpleNamespace(on_close=lambda: closed.append(True))
        consumer = SimpleNamespace(controller=SimpleNamespace(semaphore=line), blueprint=blueprint)
        hand_back_before_close(consumer, prefork=False)
        blueprint.on_close()
        assert (rejected, closed) == ([], [True])
        hand_back_before_close(consumer, prefork=True)
        hand_back_before_close(consumer, prefork=True)  # a consumer restarted wraps once
        blueprint.on_close()
        assert closed == [True, True]
        assert sorted(rejected) == [("buffered", True), ("woken1", True), ("woken2", True)]
        line.release()
        line.release()
        assert started == ["running", "fresh1"]
        blueprint.on_close()  # each once
        assert len(rejected) == 3
    finally:
        for request in requests.values():
            worker_state.reserved_requests.discard(request)
            worker_state.active_requests.discard(request)
            worker_state.requests.pop(request.name, None)
