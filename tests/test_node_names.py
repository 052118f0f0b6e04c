"""The node records' scripts, on a real Redis of each flavour: the take-over removes only a silent
worker instance, atomically, and a silent instance's holders go back through ``release``
(weighted ones whole), offered to the next waiter; another instance's holder stays.
"""

from __future__ import annotations

import redis

from celery_semaphore import FairSemaphore, Granted, MultiSemaphore, Waiting
from celery_semaphore._core.nodes import Beating, NodeKeys, NodeScripts, Silent

from .waiting import wait_until

DAY_MS = 86_400_000
DEAD, ALIVE = "dead0001", "a11ve002"  # instance ids: 8 hex digits


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
        given = {base: scripts.give_back(base, rules, DEAD)[0] for base, rules in silent.held.items()}
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
    assert scripts.beat(keys, instance=ALIVE, where="x", ttl_ms=DAY_MS) is False
    scripts.note_held(keys, instance=ALIVE, semaphores=[("semaphore:{k}", b"1")], ttl_ms=DAY_MS)
    assert scripts.beat(keys, instance=ALIVE, where="x", ttl_ms=DAY_MS) is True
    answer = scripts.take_over(keys, instance=ALIVE, stale_ms=60_000)
    assert isinstance(answer, Beating) and answer.silent_ms < 60_000
    assert scripts.instances(keys) == {ALIVE: "x"}
    assert redis_client.hgetall(keys.held(ALIVE)) == {b"semaphore:{k}": b"1"}
    take_over_when_silent(scripts, keys, ALIVE)
    assert scripts.beat(keys, instance=ALIVE, where="x", ttl_ms=DAY_MS) is False, "it learns it was taken over"
    scripts.forget(keys, instance=ALIVE)
    assert scripts.instances(keys) == {}
