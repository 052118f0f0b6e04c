"""A worker restarted under its node name gives back the dead one's slots; a live one keeps them.

The scripts first (a real Redis of each flavour): the take-over removes only a silent instance,
atomically, and a silent instance's holders go back through ``release`` (weighted ones whole),
offered to the next waiter. Then real workers (prefork, Redis broker, the default 60 s lease): a
whole worker SIGKILLed and restarted under its name, and two live workers under one name.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from celery_semaphore import FairSemaphore, Granted, MultiSemaphore, Waiting
from celery_semaphore._celery.node_names import STALE_S
from celery_semaphore._core.clients import client_for
from celery_semaphore._core.nodes import RECORDED, TAKEN_OVER, UNNAMED, Beating, NodeKeys, NodeScripts, Silent

from ..celery_stack import CeleryStack
from ..waiting import wait_until
from ..workers import Worker

DAY_MS = 86_400_000
DEAD, ALIVE, TAKER = "dead0001", "a11ve002", "7a4e0003"  # instance ids: 8 hex digits


def token_of(instance: str, task: str) -> str:
    """A task's holder token as a worker instance makes it (``_celery/tokens.py``)."""
    return f"{task}:{'0' * 16}{instance}{'f' * 8}"


def take_over_when_silent(scripts: NodeScripts, keys: NodeKeys, instance: str) -> Silent:
    answer = wait_until(
        lambda: (found := scripts.take_over(keys, instance=instance, stale_ms=200)) and not isinstance(found, Beating)
        and found,
        timeout=5,
        what="the instance to go silent",
    )  # fmt: skip
    assert isinstance(answer, Silent)
    return answer


def test_a_silent_instance_is_taken_over_once_and_only_its_holders_go(redis_client: redis.Redis) -> None:
    """A dead instance's holders, on each semaphore of its index (a weighted holder of a key list
    included), go back, and a waiter is offered the freed slot; another instance's holder stays.
    While it beats it is not taken over; once taken over, nobody takes it over again."""
    scripts, keys = NodeScripts(redis_client), NodeKeys.of("semaphore", "w1@host")
    single = FairSemaphore(redis_client, "single", 2)
    pair = [FairSemaphore(redis_client, name, 2, hash_tag="pair") for name in ("a", "b")]
    dead_single = single.try_acquire(token=token_of(DEAD, "t1"), enqueue=False)
    alive_single = single.try_acquire(token=token_of(ALIVE, "t2"), enqueue=False)
    heavy = MultiSemaphore(pair, weight=2).try_acquire(token=token_of(DEAD, "t3"), enqueue=False)
    leases = [attempt.lease for attempt in (dead_single, alive_single, heavy) if isinstance(attempt, Granted)]
    assert len(leases) == 3
    waiting = single.try_acquire(waiter="next")
    assert isinstance(waiting, Waiting)
    try:
        held = [(each.keys.base, each.rules.arg) for each in (single, *pair)]
        scripts.note_held(keys, instance=DEAD, semaphores=held, ttl_ms=DAY_MS)
        scripts.beat(keys, instance=DEAD, where="", ttl_ms=DAY_MS)
        assert isinstance(scripts.take_over(keys, instance=DEAD, stale_ms=60_000), Beating)

        silent = take_over_when_silent(scripts, keys, DEAD)
        assert silent.held == {base: rules for base, rules in held}
        given = {base: scripts.give_back(base, rules, DEAD) for base, rules in silent.held.items()}
        assert given == {single.keys.base: 1, pair[0].keys.base: 2, pair[1].keys.base: 2}
        assert [holder.token for holder in single.status().holders] == [token_of(ALIVE, "t2")]
        assert single.status().offered_count == 1, "the freed slot is offered to the waiter"
        assert isinstance(single.try_acquire(waiter="next"), Granted)
        assert all(each.status().holder_count == 0 for each in pair)
        assert scripts.take_over(keys, instance=DEAD, stale_ms=0) is None
        assert not redis_client.exists(keys.held(DEAD))
    finally:
        for lease in leases:
            lease.release()
        for each in (single, *pair):
            each.reset()


def test_a_beat_keeps_an_instance_from_being_taken_over(redis_client: redis.Redis) -> None:
    """An instance beating within the staleness bound keeps its record and its index; the beat
    says whether the name still recorded it (not on its first beat, nor after a take-over)."""
    scripts, keys = NodeScripts(redis_client), NodeKeys.of("semaphore", "w{2}@host")
    assert scripts.beat(keys, instance=ALIVE, where="x", ttl_ms=DAY_MS) == UNNAMED  # its first beat
    scripts.note_held(keys, instance=ALIVE, semaphores=[("semaphore:{k}", b"1")], ttl_ms=DAY_MS)
    assert scripts.beat(keys, instance=ALIVE, where="x", ttl_ms=DAY_MS) == RECORDED
    assert scripts.held(keys, instance=ALIVE) == {b"semaphore:{k}": b"1"}
    answer = scripts.take_over(keys, instance=ALIVE, stale_ms=60_000)
    assert isinstance(answer, Beating) and answer.silent_ms < 60_000
    assert scripts.instances(keys) == {ALIVE: "x"}
    assert redis_client.hgetall(keys.held(ALIVE)) == {b"semaphore:{k}": b"1"}
    scripts.beat(keys, instance=TAKER, where="y", ttl_ms=DAY_MS)  # a worker starting under the name beats first
    take_over_when_silent(scripts, keys, ALIVE)
    assert scripts.beat(keys, instance=ALIVE, where="x", ttl_ms=DAY_MS) == TAKEN_OVER, "it learns it was taken over"
    scripts.forget(keys, instance=ALIVE)
    scripts.forget(keys, instance=TAKER)
    assert scripts.instances(keys) == {}


def test_a_beat_tells_a_redis_that_lost_its_data_from_a_take_over(redis_client: redis.Redis) -> None:
    """A name recorded without the instance means another worker took it over (an error to
    report); a name recorded by nobody means the Redis lost its data (restarted empty): the
    instance's index went too, and its worker writes it back (node_names.py)."""
    scripts, keys = NodeScripts(redis_client), NodeKeys.of("semaphore", "w3@host")
    scripts.beat(keys, instance=ALIVE, where="x", ttl_ms=DAY_MS)
    scripts.note_held(keys, instance=ALIVE, semaphores=[("semaphore:{k}", b"1")], ttl_ms=DAY_MS)
    redis_client.delete(keys.node, keys.held(ALIVE))  # what a restart without persistence leaves
    assert scripts.beat(keys, instance=ALIVE, where="x", ttl_ms=DAY_MS) == UNNAMED
    assert scripts.held(keys, instance=ALIVE) == {}


# --- real workers -----------------------------------------------------------------------------


def semaphore(proj: Any, key: str, limit: int) -> FairSemaphore:
    return FairSemaphore(client_for(proj.app.conf.semaphore_backend_url), key, limit)


@pytest.mark.workers
def test_a_worker_killed_and_restarted_under_its_name_frees_its_slot_within_seconds(
    celery_stack: CeleryStack,
) -> None:
    """A whole worker SIGKILLed while its task holds the only slot (the default 60 s lease), then
    started again under its node name: a task waiting in another worker gets the slot within 5 s
    of the restart (before, it waited for the lease)."""
    import tests.proj.app as proj

    victim = Worker({**celery_stack.env, "PROJ_QUEUE": "node-victim"}, name="phoenix", concurrency=1).start()
    other = Worker({**celery_stack.env, "PROJ_QUEUE": "node-other"}, name="bystander", concurrency=1).start()
    try:
        proj.sleepy.apply_async((120, "node-held"), queue="node-victim")
        wait_until(lambda: proj.probe("node-held").live == 1, timeout=30, what="the task to hold the slot")
        waiting = proj.sleepy.apply_async((0.1, "node-waiting"), queue="node-other")
        line = semaphore(proj, "proj.sleepy", 1)
        wait_until(lambda: line.status().waiter_count == 1, timeout=30, what="the second task to wait")
        victim.kill()
        restarted_at = time.monotonic()
        victim = Worker(victim.env, name="phoenix", concurrency=1).start()
        assert waiting.get(timeout=90) == "woke"
        took = time.monotonic() - restarted_at
        assert took < 5, f"the slot reached the waiting task {took:.1f} s after the restart"
        assert "took over its dead instance" in victim.log()
        # the waiting task's result is stored before its slot is given back (task_postrun)
        wait_until(lambda: line.status().holder_count == 0, timeout=10, what="the woken task's slot back")
    finally:
        victim.kill()
        other.stop()


@pytest.mark.workers
def test_two_live_workers_under_one_name_keep_their_slots(celery_stack: CeleryStack) -> None:
    """A second worker started by mistake under the name of a live one that holds a slot: the
    first keeps its slot (its holder stays in Redis), the second's own holder too, and the second
    says so."""
    import tests.proj.app as proj

    # a queue each, so that each runs a task (a busy worker would prefetch the other's)
    first = Worker({**celery_stack.env, "PROJ_QUEUE": "node-twin-1"}, name="twin", concurrency=1).start()
    second = Worker({**celery_stack.env, "PROJ_QUEUE": "node-twin-2"}, name="twin", concurrency=1)
    slots = semaphore(proj, "proj.hold", 3)
    try:
        key = "node-twins"
        results = [proj.hold.apply_async((8, key), queue="node-twin-1")]
        wait_until(lambda: proj.probe(key).live == 1, timeout=30, what="the first worker's task to hold a slot")
        held = [holder.token for holder in slots.status().holders]
        second.start()
        results.append(proj.hold.apply_async((8, key), queue="node-twin-2"))
        wait_until(lambda: proj.probe(key).live == 2, timeout=30, what="the second worker's task to hold a slot")
        wait_until(lambda: "its slots stay" in second.log(), timeout=STALE_S + 10, what="the second to leave them")
        now_held = [holder.token for holder in slots.status().holders]
        assert set(held) < set(now_held) and len(now_held) == 2, "the first worker's holder kept its slot"
        results.append(proj.hold.apply_async((0.1, key), queue="node-twin-2"))
        assert all(result.get(timeout=90) for result in results)
        assert proj.probe(key).maximum == 2
        wait_until(lambda: slots.status().holder_count == 0, timeout=10, what="every slot back")
        logs = first.log() + second.log()
        assert "took over" not in logs and "no longer recorded" not in logs
    finally:
        first.stop()
        second.stop()
