"""Parking: the process that parked a waiting task sends it again when its turn comes, and when
no copy of its wait asked in time (its countdown copy was lost in the broker).

Real Redis for the semaphore and a real Redis broker: the wake copy is a real Celery message,
checked in the broker's queue. The lost countdown copy is played by not sending one: on the
Redis broker that loss (a message popped by the pending BRPOP of a worker being killed) cannot
be produced on demand.
"""

from __future__ import annotations

import redis
from celery import Celery

from celery_semaphore import FairSemaphore, Waiting
from celery_semaphore._parking import Parking

from .redis_server import RedisServer
from .waiting import wait_until


def _app(server: RedisServer) -> Celery:
    app = Celery("parking", broker=f"redis://127.0.0.1:{server.port}/5", set_as_current=False)

    @app.task(name="parking.job", shared=False)
    def job() -> None: ...

    return app


def _queued(server: RedisServer, queue: str) -> int:
    with server.client(db=5) as broker:
        return int(broker.llen(queue))


def test_an_offer_sends_the_wake_copy_at_once(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """A release that hands the parked waiter its turn makes this process send the wake copy."""
    app = _app(redis_server)
    semaphore = FairSemaphore(redis_client, "park-offer", 1)
    holder = semaphore.acquire(timeout=5)
    waiting = semaphore.try_acquire(token="t1:a", waiter="t1")
    assert isinstance(waiting, Waiting)
    parking = Parking()
    wake_copy = app.signature("parking.job", queue="q-offer.semaphore-wake")
    address = parking.park(semaphore, "t1", wake_copy, away_for=30, run="t1#0")
    semaphore.leave("t1", away_for=30, wake=address)
    assert _queued(redis_server, "q-offer.semaphore-wake") == 0
    holder.release()
    wait_until(lambda: _queued(redis_server, "q-offer.semaphore-wake") == 1, timeout=10, what="the wake copy sent")
    assert parking.parked_count() == 0


def test_a_wait_whose_copies_never_asked_is_sent_again(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """When a parked task's time is up and no copy of its wait asked meanwhile, the wake copy is
    sent anyway; a task whose copy did ask is left alone."""
    app = _app(redis_server)
    semaphore = FairSemaphore(redis_client, "park-sweep", 1)
    holder = semaphore.acquire(timeout=5)
    parking = Parking()
    for waiter in ("lost", "asked"):
        assert isinstance(semaphore.try_acquire(token=f"{waiter}:a", waiter=waiter), Waiting)
        wake_copy = app.signature("parking.job", queue=f"q-{waiter}.semaphore-wake")
        address = parking.park(semaphore, waiter, wake_copy, away_for=0.5, run=f"{waiter}#0")
        semaphore.leave(waiter, away_for=0.5, wake=address)
    # the countdown copy of "asked" arrives and asks again (it is refused: the slot is held)
    assert isinstance(semaphore.try_acquire(token="asked:b", waiter="asked", run="asked#0", remember=60), Waiting)
    wait_until(lambda: _queued(redis_server, "q-lost.semaphore-wake") == 1, timeout=10,
               what="the lost wait sent again")
    wait_until(lambda: parking.parked_count() == 0, timeout=10, what="both parked entries swept")
    assert _queued(redis_server, "q-asked.semaphore-wake") == 0
    holder.release()
