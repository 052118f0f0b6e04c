"""AsyncFairSemaphore: what a loop's waiters cost the garbage collector, against real Redis.

A thousand coroutines of one event loop waiting in line each hold their wait's objects until their
turn; objects that form reference cycles are freed only by the cycle collector, and every object
a waiter keeps counts towards its next collection. A full collection of a large heap stalls the
loop, and every hand-off due meanwhile, for tens of milliseconds. So a hand-off, a cancelled wait
and a try that failed must leave nothing for the collector to find, and a sleeping waiter must
stay small.
"""

from __future__ import annotations

import asyncio
import gc
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import redis.asyncio

from celery_semaphore import AsyncFairSemaphore
from celery_semaphore._core import async_renewer

from ..redis_server import LOOPBACK, RedisServer
from .test_async import until


@contextmanager
def collector_off() -> Iterator[Callable[[], Counter[str]]]:
    """Within: no automatic collection; the function yielded collects and names, by type, every
    object that only the cycle collector could free (found since the block began)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)

    def garbage() -> Counter[str]:
        gc.collect()
        found = Counter(type(each).__qualname__ for each in gc.garbage)
        found.update("frame:" + each.f_code.co_qualname for each in gc.garbage if type(each).__name__ == "frame")
        found.update(
            "task:" + each.get_name() + repr(each.get_coro()) for each in gc.garbage if type(each).__name__ == "Task"
        )
        gc.garbage.clear()
        return found

    try:
        yield garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def run(redis_server: RedisServer, body: Callable[[AsyncFairSemaphore], Awaitable[None]], limit: int = 2) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis(host=LOOPBACK, port=redis_server.port)
        try:
            await body(AsyncFairSemaphore(client, "garbage", limit=limit))
        finally:
            await client.aclose()

    asyncio.run(main())


async def contend(semaphore: AsyncFairSemaphore, callers: int) -> None:
    """``callers`` coroutines at once, each holding a slot for a moment: most of them wait in line
    and are handed their slot by a release, through the loop's wake-up reader."""

    async def one() -> None:
        async with semaphore.acquire(timeout=30):
            await asyncio.sleep(0.001)

    await asyncio.gather(*(one() for _ in range(callers)))


def test_hand_offs_leave_no_garbage_for_the_cycle_collector(redis_server: RedisServer) -> None:
    async def body(semaphore: AsyncFairSemaphore) -> None:
        # the first run loads the scripts, opens the connections and subscribes (redis-py's
        # connection set-up leaves cycles of its own); what is measured is the steady state
        await contend(semaphore, 20)
        with collector_off() as garbage:
            await contend(semaphore, 200)
            found = garbage()
        assert not found, f"200 hand-offs left objects in reference cycles: {found.most_common()}"

    run(redis_server, body)


def test_cancelled_and_timed_out_waiters_leave_no_garbage(redis_server: RedisServer) -> None:
    async def body(semaphore: AsyncFairSemaphore) -> None:
        holders = [await semaphore.acquire(), await semaphore.acquire()]

        async def in_line() -> None:
            await semaphore.acquire(timeout=30)

        async def status_waiters() -> int:
            return (await semaphore.status(listed=0)).waiter_count

        async def cancel_and_time_out() -> None:
            line = [asyncio.ensure_future(in_line()) for _ in range(100)]
            await until(lambda: _at_least(status_waiters, 100), what="100 waiters in line")
            for waiter in line:
                waiter.cancel()
            await asyncio.gather(*line, return_exceptions=True)
            timed_out = await asyncio.gather(
                *(semaphore.acquire(timeout=0.05) for _ in range(20)), return_exceptions=True
            )
            assert all(isinstance(each, Exception) for each in timed_out)

        # the first round loads the scripts and opens the connections (redis-py's connection
        # set-up leaves cycles of its own); what is measured is the second
        await cancel_and_time_out()
        with collector_off() as garbage:
            await cancel_and_time_out()
            found = garbage()
        for lease in holders:
            await lease.release()
        assert not found, f"cancelled and timed-out waits left objects in reference cycles: {found.most_common()}"

    run(redis_server, body, limit=2)


def test_calls_refused_with_noscript_leave_no_garbage(redis_server: RedisServer) -> None:
    """After a restart (or SCRIPT FLUSH) every call of the loop's next batch comes back NOSCRIPT,
    a thousand errors for a thousand waiters: kept with their tracebacks, each error and the
    frames it was raised through formed a cycle. A server of its own: the flush must not reach
    other tests' scripts."""
    own_server = RedisServer(redis_server.binary).start()
    admin = own_server.client()

    async def body(semaphore: AsyncFairSemaphore) -> None:
        holder = await semaphore.acquire()

        async def refused_after_a_flush() -> None:
            admin.script_flush()
            tries = await asyncio.gather(*(semaphore.try_acquire() for _ in range(50)))
            assert not any(attempt.granted for attempt in tries)

        # the first round opens the connection the scripts are loaded on (redis-py's connection
        # set-up leaves cycles of its own); what is measured is the second
        await refused_after_a_flush()
        with collector_off() as garbage:
            await refused_after_a_flush()
            found = garbage()
        await holder.release()
        assert not found, f"a batch refused with NOSCRIPT left objects in reference cycles: {found.most_common()}"

    try:
        run(own_server, body, limit=1)
    finally:
        admin.close()
        own_server.close()


async def _at_least(count: Callable[[], Awaitable[int]], least: int) -> bool:
    return await count() >= least


def test_a_sleeping_waiter_keeps_few_objects(redis_server: RedisServer) -> None:
    """Each coroutine asleep in line keeps its frames, its task and what its wait needs; before
    the wait slept on a bare future (it took an asyncio.Event under asyncio.timeout, and its claim
    was a closure over the wait's locals) a waiter kept about 40 objects the collector tracks,
    now about 25 (this test's own task and coroutine included)."""

    async def body(semaphore: AsyncFairSemaphore) -> None:
        await contend(semaphore, 20)
        holder = await semaphore.acquire()

        async def in_line() -> None:
            async with semaphore.acquire(timeout=30):
                pass

        async def status_waiters() -> int:
            return (await semaphore.status(listed=0)).waiter_count

        gc.collect()
        before = len(gc.get_objects())
        line = [asyncio.ensure_future(in_line()) for _ in range(200)]
        await until(lambda: _at_least(status_waiters, 200), what="200 waiters in line")
        gc.collect()
        per_waiter = (len(gc.get_objects()) - before) / 200
        await holder.release()
        await asyncio.gather(*line)
        assert per_waiter < 32, f"each waiting coroutine keeps {per_waiter:.1f} tracked objects"

    run(redis_server, body, limit=1)


def test_a_grant_wakes_the_renewal_task_only_when_its_lease_is_due_first(redis_server: RedisServer) -> None:
    """Every hand-off ends in a grant; waking the loop's renewal task for each (a loop turn and a
    new timed wait) is wasted when the new lease falls due after the ones it sleeps for."""

    async def body(semaphore: AsyncFairSemaphore) -> None:
        first = await semaphore.acquire()
        renewer = async_renewer._renewers[asyncio.get_running_loop()]

        async def asleep() -> bool:
            return math.isfinite(renewer.wakes_at) and not renewer.changed.is_set()

        await until(asleep, what="the renewal task asleep until the first lease is due")
        second = await semaphore.acquire()  # granted in this step: the task has not run since
        assert second.renew_due >= renewer.wakes_at
        assert not renewer.changed.is_set(), "a lease due later woke the renewal task"
        await second.release()
        await first.release()

    run(redis_server, body)
