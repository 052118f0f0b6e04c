"""Run ids: of several copies of one wait, exactly one runs, and a killed copy is taken over.

A Celery wait exists in two copies (the countdown backstop and the wake copy); both ask under
the same run id. These tests drive FairSemaphore directly against a real Redis.
"""

from __future__ import annotations

import redis

from celery_semaphore import FairSemaphore, Granted
from celery_semaphore._core.attempts import Ask, Duplicate

from ..waiting import wait_until


def test_a_second_copy_is_told_running_then_done(redis_client: redis.Redis) -> None:
    """While one copy of a run holds the slot, another is told it is running; once the first
    released normally, it is told the run is done; neither takes a slot."""
    semaphore = FairSemaphore(redis_client, "runs-a", 2)
    first = semaphore._try(Ask(token="t1:a", waiter="t1", run="t1#0", remember=60))
    assert isinstance(first, Granted)
    second = semaphore._try(Ask(token="t1:b", waiter="t1", run="t1#0", remember=60))
    assert isinstance(second, Duplicate) and second.running
    # the lease the twin holds (the default, 60 s) is what the copy waits out before it looks again
    assert 55 < second.twin_lease <= 60
    assert semaphore.status().holder_count == 1
    first.lease.release()
    third = semaphore._try(Ask(token="t1:c", waiter="t1", run="t1#0", remember=60))
    assert third == Duplicate(running=False)
    assert semaphore.status().holder_count == 0


def test_a_copy_takes_over_a_run_whose_holder_was_killed(redis_client: redis.Redis) -> None:
    """A holder released by task id from outside (the worker's parent after its child was
    killed) did not finish its run: a later copy (an acks_late redelivery) runs it."""
    semaphore = FairSemaphore(redis_client, "runs-b", 1)
    first = semaphore._try(Ask(token="t2:a", waiter="t2", run="t2#0", remember=60))
    assert isinstance(first, Granted)
    assert semaphore._release_holders_with_prefix("t2:") == 1  # as the worker's parent does
    again = semaphore._try(Ask(token="t2:b", waiter="t2", run="t2#0", remember=60))
    assert isinstance(again, Granted)
    again.lease.release()
    first.lease.released = True  # the killed process never releases; keep the renewer off it


def test_a_run_whose_lease_lapsed_before_a_normal_release_still_counts_as_done(redis_client: redis.Redis) -> None:
    """The body finished (its release ran) even though its lease had gone meanwhile: a later
    copy must not run it again."""
    semaphore = FairSemaphore(redis_client, "runs-c", 1)
    first = semaphore._try(Ask(token="t3:a", waiter="t3", run="t3#0", remember=60))
    assert isinstance(first, Granted)
    semaphore.reset()  # the lease is gone from Redis (a restart, a stall) while the body runs
    assert first.lease.release() is False  # nothing was held any more...
    late = semaphore._try(Ask(token="t3:b", waiter="t3", run="t3#0", remember=60))
    assert late == Duplicate(running=False)  # ...but the run is known to be done


def test_another_run_of_the_same_task_is_not_a_duplicate(redis_client: redis.Redis) -> None:
    """The task's own retry is another run (``<id>#1``): it gets a slot of its own."""
    semaphore = FairSemaphore(redis_client, "runs-d", 1)
    first = semaphore._try(Ask(token="t4:a", waiter="t4", run="t4#0", remember=60))
    assert isinstance(first, Granted)
    first.lease.release()
    retry = semaphore._try(Ask(token="t4:b", waiter="t4", run="t4#1", remember=60))
    assert isinstance(retry, Granted)
    retry.lease.release()


def test_a_release_that_does_not_finish_the_run_lets_another_copy_run_it(redis_client: redis.Redis) -> None:
    """A body that raised Reject(requeue=True), or was stopped by a cold shutdown with acks_late:
    its slot goes back but its run is not finished, so the requeued copy runs it."""
    semaphore = FairSemaphore(redis_client, "runs-e", 1)
    first = semaphore._try(Ask(token="t5:a", waiter="t5", run="t5#0#ab", remember=60))
    assert isinstance(first, Granted)
    assert first.lease.release(finished=False) is True
    again = semaphore._try(Ask(token="t5:b", waiter="t5", run="t5#0#ab", remember=60))
    assert isinstance(again, Granted)
    again.lease.release()
    assert semaphore._try(Ask(token="t5:c", waiter="t5", run="t5#0#ab", remember=60)) == Duplicate(running=False)


def test_a_run_marked_finished_from_outside_drops_every_later_copy(redis_client: redis.Redis) -> None:
    """The worker's main process marks the run of a lost child finished where Celery will not
    deliver the task again (no acks_late): a later copy of the wait is dropped, not run."""
    semaphore = FairSemaphore(redis_client, "runs-f", 1)
    first = semaphore._try(Ask(token="t6:a", waiter="t6", run="t6#0#cd", remember=60))
    assert isinstance(first, Granted)
    assert semaphore._release_holders_with_prefix("t6:") == 1
    semaphore._release("", "t6#0#cd", 60_000)  # as worker._release_by_task_id does
    late = semaphore._try(Ask(token="t6:b", waiter="t6", run="t6#0#cd", remember=60))
    assert late == Duplicate(running=False)
    first.lease.released = True


def test_a_renewed_run_outlives_the_time_its_record_is_remembered(redis_client: redis.Redis) -> None:
    """A body that runs longer than its run record is remembered from the grant: each renewal of
    its lease keeps the record, so a copy asking later is still told running, never granted."""
    semaphore = FairSemaphore(redis_client, "runs-renewed", 2)
    asked_at = _server_ms(redis_client)
    first = semaphore._try(Ask(token="t9:a", waiter="t9", run="t9#0", remember=0.2))
    assert isinstance(first, Granted)
    first.lease.renew()  # the record now lives as long as the lease (60 s)
    wait_until(lambda: _server_ms(redis_client) > asked_at + 500, timeout=5, what="the 0.2 s remembered gone by")
    late = semaphore._try(Ask(token="t9:b", waiter="t9", run="t9#0", remember=0.2))
    assert isinstance(late, Duplicate) and late.running
    first.lease.release()
    assert semaphore._try(Ask(token="t9:c", waiter="t9", run="t9#0", remember=60)) == Duplicate(running=False)


def _server_ms(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds * 1000 + micros / 1000


def test_a_run_granted_at_most_once_is_never_taken_over_and_a_repeat_of_its_grant_is_granted(
    redis_client: redis.Redis,
) -> None:
    """``at_most_once`` (a Celery task without acks_late): the grant itself records the run
    finished, in the same script run. Its holder released by task id from outside (its worker
    killed), a later copy is told the run is done, not handed it (compare the take-over above).
    The same token asking again while it holds the slot (a reply lost and the call retried) is
    a repeat of its own grant: granted, not dropped."""
    semaphore = FairSemaphore(redis_client, "runs-once", 1)
    first = semaphore._try(Ask(token="t9:a", waiter="t9", run="t9#0", remember=60, at_most_once=True))
    assert isinstance(first, Granted)
    assert redis_client.hget(semaphore.keys.runs, "t9#0") == b"", "finished from its grant"
    again = semaphore._try(Ask(token="t9:a", waiter="t9", run="t9#0", remember=60, at_most_once=True))
    assert isinstance(again, Granted)
    assert semaphore.status().holder_count == 1
    assert semaphore._release_holders_with_prefix("t9:") == 1  # as a killed child's parent does
    late = semaphore._try(Ask(token="t9:b", waiter="t9", run="t9#0", remember=60, at_most_once=True))
    assert late == Duplicate(running=False)
    assert semaphore.status().holder_count == 0
    first.lease.released = again.lease.released = True  # keep the renewer off the released slot
