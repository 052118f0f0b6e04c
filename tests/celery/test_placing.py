"""Placing at send: a task that would wait takes its place in line as it is sent, and its one
delivery is the wake copy its turn sends. A task that would start now is sent as it is.

Real Redis for the semaphore and a real Redis broker; the queue of the first tests has no
worker, so what the sender left (the line, the broker's lists and store) is read as it is. The
last tests run real workers and count each task's deliveries in their logs (Celery logs every
message it receives).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_semaphore import semaphore_for
from celery_semaphore._celery.config import forget_config
from celery_semaphore._celery.due_copies import due_copies_for
from celery_semaphore._celery.parked_records import STORED_COPY_MARK, kept_of, parked_keys, without_ahead_mark
from celery_semaphore._celery.tokens import waiter_key

from ..celery_stack import CeleryStack
from ..parked import records, stored_due
from ..waiting import wait_until
from ..workers import ROOT, Worker, worker_group
from .test_due_copies import RoundTrips

IDLE_QUEUE = "placing-idle"  # no worker consumes it
QUEUE = "placing"


@pytest.fixture
def proj(celery_stack: CeleryStack) -> Any:
    import tests.proj.app as proj

    return proj


def broker(proj: Any) -> Any:
    store = due_copies_for(proj.app)
    assert store is not None, "the test app's broker is Redis"
    return store.client


def stored_runs(proj: Any, task_id: str) -> list[bytes]:
    store = due_copies_for(proj.app)
    assert store is not None
    return [run for run in store.client.hkeys(store.keys[1]) if run.startswith(task_id.encode())]


def in_line(proj: Any, semaphore_key: str, task_id: str) -> bool:
    return any(w.waiter == waiter_key(task_id) for w in semaphore_for(proj.app, semaphore_key).status().waiters)


def test_a_task_that_would_start_now_is_sent_holding_the_offer_of_its_start(proj: Any) -> None:
    """A free slot and nobody waiting: the message goes to its queue, carrying the ticket of the
    start it was offered; the offer counts as the slot taken, so the next task sent waits (its
    place behind the first, which its arrival claims)."""
    semaphore = semaphore_for(proj.app, "proj.handoff")
    assert semaphore.status().holder_count == 0
    client = broker(proj)
    client.delete(IDLE_QUEUE)
    first = proj.handoff.apply_async((0.1, "placing-free"), queue=IDLE_QUEUE)
    second = proj.handoff.apply_async((0.1, "placing-free"), queue=IDLE_QUEUE)
    try:
        assert client.llen(IDLE_QUEUE) == 1, "the first sent to its queue, the second parked"
        assert json.loads(client.lindex(IDLE_QUEUE, 0))["headers"]["id"] == first.id
        assert json.loads(client.lindex(IDLE_QUEUE, 0))["headers"]["csem_ticket"] is not None
        waiters = {w.waiter: w for w in semaphore.status().waiters}
        assert waiters[waiter_key(first.id)].offered, "the first holds the offer of its start"
        assert waiters[waiter_key(first.id)].position < waiters[waiter_key(second.id)].position
        assert stored_runs(proj, first.id) == []
        assert len(stored_runs(proj, second.id)) == 1
    finally:
        semaphore.leave(waiter_key(first.id))
        semaphore.leave(waiter_key(second.id))
        client.delete(IDLE_QUEUE, f"{IDLE_QUEUE}.semaphore-wake")


def every_slot_held(semaphore: Any) -> list[Any]:
    """Hold every slot of ``semaphore``, its hold time known: a line learns it from the releases
    it sees while somebody waits, so one waiter joins while a slot is held 30 ms and released."""
    holders = [semaphore.acquire(timeout=5) for _ in range(semaphore.limit)]
    assert not semaphore.try_acquire(waiter="learning").granted
    time.sleep(0.03)  # the hold the line learns, not a wait for anything
    holders.pop().release()
    semaphore.leave("learning")
    return [*holders, semaphore.acquire(timeout=5)]


def test_a_task_that_would_wait_near_its_turn_is_sent_keeping_its_place(proj: Any) -> None:
    """Every slot held, its holds short (about 30 ms): the next three tasks sent (fewer than the
    limit ahead of each) go to their queue carrying the ticket of the place each took, present
    in line and stored nowhere: their deliveries stand by for their offers in their processes.
    The fourth, a whole round of releases back, is parked with its copy in the broker's store."""
    semaphore = semaphore_for(proj.app, "proj.hold")
    assert semaphore.limit == 3 and semaphore.status().holder_count == 0
    holders = every_slot_held(semaphore)
    client = broker(proj)
    client.delete(IDLE_QUEUE)
    sent = [proj.hold.apply_async((0.01,), queue=IDLE_QUEUE) for _ in range(4)]
    try:
        queued = [json.loads(message)["headers"] for message in client.lrange(IDLE_QUEUE, 0, -1)]
        queued_ids = sorted(headers["id"] for headers in queued)
        near = [result.id for result in sent[:3]]
        assert queued_ids == sorted(near), "the first three sent to their queue"
        tickets = [(headers["csem_ticket"] is not None, headers["csem_waits"]) for headers in queued]
        assert tickets == [(True, 0)] * 3, "each with the ticket of its place, no refusal yet"
        line = [waiter.waiter for waiter in semaphore.status().waiters]
        assert line == [waiter_key(result.id) for result in sent], "in line in the order sent"
        stored = [len(stored_runs(proj, result.id)) for result in sent]
        assert stored == [0, 0, 0, 1], "only the fourth parked, its copy stored"
    finally:
        for holder in holders:
            holder.release()
        for result in sent:
            semaphore.leave(waiter_key(result.id))
        client.delete(IDLE_QUEUE, f"{IDLE_QUEUE}.semaphore-wake")


def stored_message(proj: Any, run: bytes) -> bytes:
    """The message stored under ``run`` in the broker's store, as it goes to its queue."""
    store = due_copies_for(proj.app)
    assert store is not None
    stored = store.stored_message(run.decode())
    assert stored is not None
    return stored.encode()


def same_but_its_tag(sent: bytes, stored: bytes) -> bool:
    """Whether ``sent`` is the ``stored`` message under a delivery tag of its own (kombu's Redis
    transport keys its unacknowledged messages by the tag: two deliveries may not share one). A
    copy packed with its id makes its tag as it is sent, "<run>:<server time>" (the reader in
    Python writes "<run>:0"); any other keeps kombu's and is sent under "<tag>:w<time>"."""
    sent_fields, stored_fields = json.loads(sent), json.loads(stored)
    sent_tag = sent_fields["properties"].pop("delivery_tag")
    stored_tag = stored_fields["properties"].pop("delivery_tag")
    own = stored_tag.removesuffix(":0")
    return bool(sent_fields == stored_fields and sent_tag != stored_tag and sent_tag.startswith(own))


def parked_copies(proj: Any, semaphore: Any, task_id: str) -> list[bytes]:
    """What the parked records of ``task_id`` keep in place of a wake copy (behind the mark of
    a task that may be woken ahead, taken off)."""
    found = records(semaphore.client, parked_keys(proj.app.conf.get("semaphore_prefix", "semaphore")))
    return [
        without_ahead_mark(kept_of(value)) for entry, value in found.items() if waiter_key(task_id).encode() in entry
    ]


def test_a_task_that_would_wait_takes_its_place_as_it_is_sent_and_its_turn_sends_it(proj: Any) -> None:
    """Its only slot held: the task is in line (parked) before any worker saw it, its queue is
    empty, and its one message waits in the broker's store; its parked record keeps a mark, not
    a second copy. The release that makes its turn sends that stored message to the wake queue:
    one message, the very one stored (under a delivery tag of its own), which stays stored as the
    backstop until its run starts."""
    semaphore = semaphore_for(proj.app, "proj.handoff")
    holder = semaphore.acquire(timeout=5)
    wake_queue = f"{IDLE_QUEUE}.semaphore-wake"
    client = broker(proj)
    client.delete(IDLE_QUEUE, wake_queue)
    try:
        result = proj.handoff.apply_async((0.1, "placing-wait"), queue=IDLE_QUEUE)
        waiters = {w.waiter: w for w in semaphore.status().waiters}
        assert waiter_key(result.id) in waiters, "placed in line as it was sent"
        assert client.llen(IDLE_QUEUE) == 0, "not sent to its queue"
        runs = stored_runs(proj, result.id)
        assert len(runs) == 1, "its backstop copy is stored in the broker"
        message = stored_message(proj, runs[0])
        assert parked_copies(proj, semaphore, result.id) == [STORED_COPY_MARK.encode()], "a mark, no second copy"
    finally:
        holder.release()
    wait_until(lambda: client.llen(wake_queue) == 1, timeout=10, what="the stored copy sent by the release")
    assert client.llen(IDLE_QUEUE) == 0
    assert same_but_its_tag(client.lindex(wake_queue, 0), message), "the stored message itself"
    assert stored_message(proj, stored_runs(proj, result.id)[0]) == message, "still the backstop"
    client.delete(IDLE_QUEUE, wake_queue)
    semaphore.leave(waiter_key(result.id))


def test_a_stored_copy_sent_by_a_wake_and_lost_in_flight_is_sent_again_after_its_lease(
    proj: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parked record of a woken task is leased: its stored message, sent to the wake queue
    and lost there (on the Redis broker, popped by the BRPOP of a worker being killed; played
    here by popping it), is sent again by a sweep once the lease is up. The lease is 1 s here
    (10 s by default); the sweep is run here, as a worker process runs it every second."""
    import types

    import celery_semaphore._celery.parked_sends as parked_sends

    monkeypatch.setattr(parked_sends, "WOKEN_LEASE_S", 1.0)
    semaphore = semaphore_for(proj.app, "proj.handoff")
    holder = semaphore.acquire(timeout=5)
    wake_queue = f"{IDLE_QUEUE}.semaphore-wake"
    client = broker(proj)
    client.delete(IDLE_QUEUE, wake_queue)
    result = proj.handoff.apply_async((0.1, "placing-lost"), queue=IDLE_QUEUE)
    try:
        message = stored_message(proj, stored_runs(proj, result.id)[0])
        holder.release()
        wait_until(lambda: client.llen(wake_queue) == 1, timeout=10, what="the stored copy sent by the release")
        first = client.rpop(wake_queue)  # lost in flight
        assert same_but_its_tag(first, message)
        prefix = proj.app.conf.get("semaphore_prefix", "semaphore")
        target = types.SimpleNamespace(client=semaphore.client, prefix=prefix, app=proj.app)

        def swept_again() -> bool:
            parked_sends.sweep_records([target])
            return bool(client.llen(wake_queue) == 1)

        wait_until(swept_again, timeout=15, what="the copy sent again after its lease", interval=0.2)
        again = client.lindex(wake_queue, 0)
        assert same_but_its_tag(again, message) and again != first, "sent again, under a tag of its own"
    finally:
        client.delete(IDLE_QUEUE, wake_queue)
        semaphore.leave(waiter_key(result.id))


def test_a_task_that_would_wait_costs_its_sender_three_round_trips(proj: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its place (the semaphore's Redis), its backstop copy published and stowed (the
    broker's), its parked record and its place parked (the semaphore's, one pipeline, in that
    order): three round trips; five before the publish and the stowing, and the record and the
    parking, went in one each."""
    semaphore = semaphore_for(proj.app, "proj.handoff")
    holder = semaphore.acquire(timeout=5)
    sent = []
    try:
        sent.append(proj.handoff.apply_async((0.1, "placing-cost"), queue=IDLE_QUEUE))  # connects
        trips = RoundTrips(monkeypatch)
        sent.append(proj.handoff.apply_async((0.1, "placing-cost"), queue=IDLE_QUEUE))
        assert trips.count == 3
        assert len(stored_runs(proj, sent[1].id)) == 1
        assert parked_copies(proj, semaphore, sent[1].id) == [STORED_COPY_MARK.encode()]
        assert [w.waiter for w in semaphore.status().waiters] == [waiter_key(result.id) for result in sent]
    finally:
        for result in sent:
            semaphore.leave(waiter_key(result.id))
        holder.release()
        broker(proj).delete(IDLE_QUEUE, f"{IDLE_QUEUE}.semaphore-wake")


# Redis's allocator gives a string of n bytes (a 3 B header and a NUL with it, under 256 B) the
# next of its size classes: ..., 192, 224, 256, 320, ... A stored copy of this test's task fits
# the 224 B class (at most 220 B; 194 B measured); written as the release before this one wrote
# it (232 B) it took the 256 B class, and the same copy under a longer queue name (the waiting
# benchmark's, 263 B) took 320 B where it now takes 224 B (214 B).
SMALL_COPY_BYTES = 220


def test_a_small_tasks_stored_copy_fits_one_224_byte_allocation(proj: Any) -> None:
    """What one waiting task costs the broker's Redis is mostly its stored copy. For a task of
    two small arguments the packed value (its target list, stencil digest and fills) stays
    within 220 B: the signature (16 digits), the nonce (12), the stencil's digest (16) and the
    two stamps (to the millisecond) are written short for it, and an empty ``kwargsrepr`` is the
    stencil's. Each size class a copy grows past costs every waiting task 32 or 64 B more."""
    semaphore = semaphore_for(proj.app, "proj.handoff")
    holder = semaphore.acquire(timeout=5)
    client = broker(proj)
    try:
        result = proj.handoff.apply_async((0.1, "placing-size"), queue=IDLE_QUEUE)
        (run,) = stored_runs(proj, result.id)
        store = due_copies_for(proj.app)
        assert store is not None
        value = store.client.hget(store.keys[1], run)
        assert value is not None and len(value) <= SMALL_COPY_BYTES, len(value)
        headers = json.loads(stored_message(proj, run))["headers"]
        assert len(headers["csem_ticket_sig"]) == 16 and len(headers["csem_message"]) == 12
        assert b'"{}"' not in value and headers["kwargsrepr"] == "{}"
        assert headers["csem_sent"] == round(headers["csem_sent"], 3)
        assert headers["csem_first_refused"] == round(headers["csem_first_refused"], 3)
    finally:
        holder.release()
        semaphore.leave(waiter_key(result.id))
        client.delete(IDLE_QUEUE, f"{IDLE_QUEUE}.semaphore-wake")


def test_a_task_sent_while_its_key_is_paused_is_parked_and_the_resume_sends_it(proj: Any) -> None:
    """A pause until resumed reserves the head's start a day off. The task sent then is parked,
    like any task that would wait (its stored copy due then, at the latest), not only sent for
    that moment: the resume offers it its start and sends it at once, and no reservation holds
    a slot for a day meanwhile."""
    semaphore = semaphore_for(proj.app, "proj.handoff")
    wake_queue = f"{IDLE_QUEUE}.semaphore-wake"
    client = broker(proj)
    client.delete(IDLE_QUEUE, wake_queue)
    semaphore.pause()
    try:
        result = proj.handoff.apply_async((0.1, "placing-paused"), queue=IDLE_QUEUE)
        waiters = {w.waiter: w for w in semaphore.status().waiters}
        assert waiter_key(result.id) in waiters, "placed in line as it was sent"
        assert parked_copies(proj, semaphore, result.id) == [STORED_COPY_MARK.encode()], "parked, with its record"
        store = due_copies_for(proj.app)
        assert store is not None
        (run,) = stored_runs(proj, result.id)
        due_in_s = stored_due(store.client, store.keys[0])[run] / 1000 - time.time()
        assert due_in_s > 3600, "its backstop: the reserved start, a day off"
        assert client.llen(wake_queue) == 0
    finally:
        semaphore.resume()
    wait_until(lambda: client.llen(wake_queue) == 1, timeout=10, what="the task sent by the resume")
    assert result.id.encode() in client.lindex(wake_queue, 0)
    client.delete(IDLE_QUEUE, wake_queue)
    semaphore.leave(waiter_key(result.id))


def test_a_task_id_sent_twice_is_placed_once_and_then_sent_as_it_is(proj: Any) -> None:
    """A task id already in line (a reused id, a message sent twice) takes no second place: the
    second send goes to its queue as it is, and its worker asks for it as for any delivery."""
    semaphore = semaphore_for(proj.app, "proj.handoff")
    holder = semaphore.acquire(timeout=5)
    client = broker(proj)
    client.delete(IDLE_QUEUE)
    task_id = f"placed-twice-{time.time()}"
    try:
        proj.handoff.apply_async((0.1, "placing-twice"), queue=IDLE_QUEUE, task_id=task_id)
        assert client.llen(IDLE_QUEUE) == 0
        proj.handoff.apply_async((0.1, "placing-twice"), queue=IDLE_QUEUE, task_id=task_id)
        assert client.llen(IDLE_QUEUE) == 1, "the second sent as it is"
        assert [w.waiter for w in semaphore.status().waiters].count(waiter_key(task_id)) == 1
        assert len(stored_runs(proj, task_id)) == 1, "one backstop copy: the first's"
    finally:
        holder.release()
        semaphore.leave(waiter_key(task_id))
        client.delete(IDLE_QUEUE, f"{IDLE_QUEUE}.semaphore-wake")


def test_placing_turned_off_sends_every_task_as_it_is(proj: Any) -> None:
    """``semaphore_place_at_send = False``: a task that would wait is sent to its queue, and
    waits there as before (its worker refuses it and parks it)."""
    semaphore = semaphore_for(proj.app, "proj.handoff")
    holder = semaphore.acquire(timeout=5)
    client = broker(proj)
    client.delete(IDLE_QUEUE)
    proj.app.conf.semaphore_place_at_send = False
    forget_config(proj.app)
    try:
        result = proj.handoff.apply_async((0.1, "placing-off"), queue=IDLE_QUEUE)
        assert client.llen(IDLE_QUEUE) == 1
        assert not in_line(proj, "proj.handoff", result.id)
    finally:
        holder.release()
        proj.app.conf.semaphore_place_at_send = True
        forget_config(proj.app)
        client.delete(IDLE_QUEUE)


def test_a_task_sent_with_a_countdown_is_sent_as_it_is(proj: Any) -> None:
    """A countdown is the caller's own delay: the task asks when it comes, not as it is sent."""
    semaphore = semaphore_for(proj.app, "proj.handoff")
    holder = semaphore.acquire(timeout=5)
    client = broker(proj)
    client.delete(IDLE_QUEUE)
    try:
        result = proj.handoff.apply_async((0.1, "placing-countdown"), queue=IDLE_QUEUE, countdown=60)
        assert client.llen(IDLE_QUEUE) == 1
        assert not in_line(proj, "proj.handoff", result.id)
    finally:
        holder.release()
        client.delete(IDLE_QUEUE)


@pytest.fixture(scope="module")
def workers(celery_stack: CeleryStack) -> Iterator[list[Worker]]:
    with worker_group(celery_stack.env, queue=QUEUE, names=("p1", "p2")) as group:
        yield group


def received(workers: list[Worker], task_id: str) -> int:
    """How many times the workers received a message of ``task_id`` (Celery logs each one)."""
    pattern = re.compile(rf"Task [\w.]+\[{re.escape(task_id)}\] received")
    return sum(len(pattern.findall(worker.log())) for worker in workers)


@pytest.mark.workers
def test_tasks_that_would_wait_are_delivered_once_each_and_start_in_the_order_sent(
    proj: Any, workers: list[Worker]
) -> None:
    """Eight tasks sent while the one slot is held: each one is delivered once (its wake copy),
    runs once, and they start in the order they were sent."""
    key = "placing-order"
    semaphore = semaphore_for(proj.app, "proj.handoff")
    holder = semaphore.acquire(timeout=5)
    try:
        results = [proj.handoff.apply_async((0.05, key), queue=QUEUE) for _ in range(8)]
        for result in results:
            assert in_line(proj, "proj.handoff", result.id)
    finally:
        holder.release()
    for result in results:
        assert result.get(timeout=60) == result.id
    entries = proj.probe(key).client.lrange(f"probe:{key}:starts", 0, -1)
    started = [entry.split()[0].decode() for entry in entries]
    assert started == [result.id for result in results]
    assert proj.probe(key).maximum == 1
    wait_until(
        lambda: all(received(workers, result.id) >= 1 for result in results), timeout=10, what="every receipt logged"
    )
    assert [received(workers, result.id) for result in results] == [1] * 8


@pytest.mark.workers
def test_tasks_sent_near_their_turn_and_parked_ones_run_once_each_in_the_order_sent(
    proj: Any, workers: list[Worker]
) -> None:
    """Every slot held and the hold time known: of six tasks sent, the first three go to their
    queue keeping their places (their deliveries stand by), the rest are parked. Once the slots
    come back, all six run once each, in the order sent, never more than three at once, each
    delivered once."""
    key = "placing-near"
    semaphore = semaphore_for(proj.app, "proj.hold")
    holders = every_slot_held(semaphore)
    try:
        results = [proj.hold.apply_async((0.05, key), queue=QUEUE) for _ in range(6)]
        stored = [len(stored_runs(proj, result.id)) for result in results]
        assert stored == [0, 0, 0, 1, 1, 1]
    finally:
        for holder in holders:
            holder.release()
    for result in results:
        assert result.get(timeout=60) == result.id
    entries = proj.probe(key).client.lrange(f"probe:{key}:starts", 0, -1)
    started = [entry.split()[0].decode() for entry in entries]
    sent = [result.id for result in results]
    # the three slots come back together, so each three start together: by threes, in order
    assert (sorted(started[:3]), sorted(started[3:])) == (sorted(sent[:3]), sorted(sent[3:]))
    assert proj.probe(key).maximum <= 3
    wait_until(
        lambda: all(received(workers, result.id) >= 1 for result in results), timeout=10, what="every receipt logged"
    )
    assert [received(workers, result.id) for result in results] == [1] * 6


@pytest.mark.workers
def test_tasks_sent_near_their_turn_each_run_once_through_a_restart_of_the_semaphore_redis(
    celery_stack: CeleryStack, proj: Any, workers: list[Worker]
) -> None:
    """Three tasks sent near their turn (no copy stored anywhere) stand by in their processes
    when the semaphore's Redis restarts empty: their places, the slots held and the probe are
    gone. Each task still runs once, and no slot stays held. (A task whose wait meets the
    restart may be sent again, as any waiting task is then: a delivery more, never a run more.)"""
    key = "placing-restart"
    semaphore = semaphore_for(proj.app, "proj.hold")
    holders = every_slot_held(semaphore)
    results = [proj.hold.apply_async((0.05, key), queue=QUEUE) for _ in range(3)]
    assert [len(stored_runs(proj, result.id)) for result in results] == [0, 0, 0]
    wait_until(
        lambda: all(received(workers, result.id) >= 1 for result in results), timeout=30, what="all three delivered"
    )
    celery_stack.semaphore.restart()  # the holders above hold nothing now
    for result in results:
        assert result.get(timeout=60) == result.id
    entries = proj.probe(key).client.lrange(f"probe:{key}:starts", 0, -1)
    assert sorted(entry.split()[0].decode() for entry in entries) == sorted(result.id for result in results)
    for holder in holders:
        holder.release()  # lost with the restart: nothing to give back
    wait_until(lambda: semaphore.status().holder_count == 0, timeout=30, what="no slot held at the end")


@pytest.mark.workers
def test_a_group_and_a_chain_placed_at_send_complete_with_their_results(proj: Any, workers: list[Worker]) -> None:
    """A group sends its tasks on one producer, with its group id and index; a chain sends its
    first task carrying the rest. Placed at send while the slot is held, both complete with the
    results Celery would give, each task delivered once."""
    from celery import chain, group

    key = "placing-canvas"
    semaphore = semaphore_for(proj.app, "proj.handoff")
    holder = semaphore.acquire(timeout=5)
    try:
        grouped = group(proj.handoff.s(0.05, key).set(queue=QUEUE) for _ in range(3)).apply_async()
        chained = chain(
            proj.handoff.si(0.05, key).set(queue=QUEUE), proj.handoff.si(0.05, key).set(queue=QUEUE)
        ).apply_async()
        placed = [child.id for child in grouped.results] + [chained.parent.id]
        for task_id in placed:
            assert in_line(proj, "proj.handoff", task_id), "placed in line as it was sent"
    finally:
        holder.release()
    assert grouped.get(timeout=60) == [child.id for child in grouped.results]
    assert chained.get(timeout=60) == chained.id
    wait_until(lambda: received(workers, chained.id) >= 1, timeout=10, what="the chain's second task logged")
    assert [received(workers, task_id) for task_id in placed] == [1] * 4


# A sender that places a task and dies at a step: run in a process of its own, which SIGKILLs
# itself where the step's next call would begin (the one fault here that a real kill cannot hit
# at a chosen moment on its own).
_DYING_SENDER = """
import os, signal, sys
import tests.proj.app as proj
from celery_semaphore._celery import placing

step, task_id, key, queue = sys.argv[1:5]

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

def park_then_die(self, *args, **kwargs):
    record_and_park(self, *args, **kwargs)
    die()

record_and_park = placing._ParkedAtSend._record_and_park
if step == "placed":  # its place taken, no copy sent yet
    placing.send_copy = die
elif step == "backstop":  # its backstop copy stored, no record of its wake copy, its place not parked
    placing._ParkedAtSend._record_and_park = die
elif step == "parked":  # its record kept and its place parked (one round trip), apply_async not returned
    placing._ParkedAtSend._record_and_park = park_then_die
proj.handoff.apply_async((0.05, key), queue=queue, task_id=task_id)
print("returned")
"""


def granted_lease(semaphore: Any) -> Any:
    """A one-shot try's lease, or None (refused)."""
    attempt = semaphore.try_acquire(enqueue=False)
    return attempt.lease if attempt.granted else None


@pytest.mark.workers
@pytest.mark.parametrize("step", ["placed", "backstop", "parked"])
def test_a_sender_killed_at_each_step_of_placing_loses_no_task_it_sent(
    proj: Any, workers: list[Worker], celery_stack: CeleryStack, step: str
) -> None:
    """The sender SIGKILLed after each step of placing a task that would wait, its slot held:
    killed before the backstop copy was sent, apply_async never returned (the task was not
    sent, as with a failed publish) and its place lapses, so the key is free again; killed
    after it, the task runs, exactly once, from whichever copy comes first."""
    key = f"placing-killed-{step}"
    semaphore = semaphore_for(proj.app, "proj.handoff")
    task_id = f"placing-killed-{step}-{time.time()}"
    holder = semaphore.acquire(timeout=5)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _DYING_SENDER, step, task_id, key, QUEUE],
            cwd=ROOT,
            env={**os.environ, **celery_stack.env},
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
        assert b"returned" not in done.stdout
        assert in_line(proj, "proj.handoff", task_id), "its place was taken before it died"
    finally:
        holder.release()
    starts = proj.probe(key).client
    if step == "placed":
        # never sent: nothing comes; its place lapses (5 s), and a one-shot try finds the key free
        lease = wait_until(lambda: granted_lease(semaphore), timeout=30, what="the key free of the dead place")
        lease.release()
        assert starts.llen(f"probe:{key}:starts") == 0
        return
    wait_until(lambda: starts.llen(f"probe:{key}:starts") >= 1, timeout=60, what="the task run by a copy of its wait")
    wait_until(
        lambda: not stored_runs(proj, task_id) and not in_line(proj, "proj.handoff", task_id),
        timeout=60,
        what="its backstop copy withdrawn and its place gone",
    )
    assert [entry.split()[0].decode() for entry in starts.lrange(f"probe:{key}:starts", 0, -1)] == [task_id]
