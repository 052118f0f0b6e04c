"""AsyncMultiSemaphore: coroutines taking slots of several keys (or several slots of one) all or
nothing, in the same lines as blocking MultiSemaphore callers, against real Redis.

Coroutines run under ``asyncio.run`` inside plain tests; every wait is on a condition with a
deadline (``until``), never a sleep that hopes something happened meanwhile.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis.asyncio

from celery_semaphore import (
    AsyncFairSemaphore,
    AsyncGranted,
    AsyncLease,
    AsyncMultiSemaphore,
    ConfigurationError,
    FairSemaphore,
    MultiSemaphore,
    SemaphoreUnavailable,
    Waiting,
)

from ..redis_server import LOOPBACK, RedisServer
from .test_async import (
    _later,
    blocking_and_coroutine_in_line,
    offer_to_a_cancelled_waiter_goes_on,
    time_to_empty_the_line,
    until,
)


def async_client(server: RedisServer) -> redis.asyncio.Redis:
    return redis.asyncio.Redis(host=LOOPBACK, port=server.port)


def members(
    client: redis.asyncio.Redis, limits: tuple[int, int] = (1, 1), **options: float
) -> list[AsyncFairSemaphore]:
    return [
        AsyncFairSemaphore(client, name, limit, **options)
        for name, limit in zip(("host", "total"), limits, strict=True)
    ]


def blocking_multi(server: RedisServer, limits: tuple[int, int] = (1, 1), **options: float) -> MultiSemaphore:
    client = server.client()
    return MultiSemaphore(
        [FairSemaphore(client, name, limit, **options) for name, limit in zip(("host", "total"), limits, strict=True)]
    )


async def counts(semaphores: list[AsyncFairSemaphore]) -> list[tuple[int, int]]:
    """(holder slots, waiters) of each key."""
    return [((s := await sem.status(listed=0)).holder_count, s.waiter_count) for sem in semaphores]


def test_acquire_holds_every_key_and_weight_w_takes_w_slots(redis_server: RedisServer) -> None:
    async def main() -> None:
        client = async_client(redis_server)
        keys = members(client, (3, 4))
        multi = AsyncMultiSemaphore(keys)
        async with multi.acquire(timeout=1) as lease:
            assert isinstance(lease, AsyncLease)
            assert await counts(keys) == [(1, 0), (1, 0)]
            holders = [(await sem.status()).holders for sem in keys]
            assert all(any(h.token == lease.token for h in listed) for listed in holders)
        assert await counts(keys) == [(0, 0), (0, 0)]
        lease = await multi.acquire(timeout=1, weight=3)
        assert await counts(keys) == [(3, 0), (3, 0)]
        assert await multi.renew(lease.token)
        assert await lease.release() and not await lease.release()
        assert await counts(keys) == [(0, 0), (0, 0)]
        heavy = AsyncMultiSemaphore(keys, weight=2)
        attempt = await heavy.try_acquire()
        assert isinstance(attempt, AsyncGranted)
        assert await counts(keys) == [(2, 0), (2, 0)]
        assert await heavy.release(attempt.lease.token)
        assert await counts(keys) == [(0, 0), (0, 0)]
        with pytest.raises(ConfigurationError):
            AsyncMultiSemaphore(keys, weight=4)  # above the limit 3 of "host": it would wait forever
        with pytest.raises(ConfigurationError):
            AsyncMultiSemaphore([keys[0], FairSemaphore(redis_server.client(), "other", 1)])  # type: ignore[list-item]
        await client.aclose()

    asyncio.run(main())


def test_all_or_nothing_under_coroutines_and_blocking_threads(redis_server: RedisServer) -> None:
    """Coroutines and blocking threads take host (limit 2) and total (limit 3) together, some
    coroutines two slots of total alone: each holder finds its token in both keys (never one
    without the other), and neither key is ever over its limit."""
    limits = (2, 3)
    lock = threading.Lock()
    held = {"host": 0, "total": 0}
    most = {"host": 0, "total": 0}
    runs = []

    def hold(weights: dict[str, int], sign: int) -> None:
        with lock:
            for name, weight in weights.items():
                held[name] += sign * weight
                most[name] = max(most[name], held[name])
            if sign > 0:
                runs.append(weights)

    multi = blocking_multi(redis_server, limits)

    def blocking_caller() -> None:
        for _ in range(6):
            with multi.acquire(timeout=30) as lease:
                hold({"host": 1, "total": 1}, 1)
                for sem in multi.semaphores:
                    assert lease.token in {h.token for h in sem.status().holders}
                hold({"host": 1, "total": 1}, -1)

    threads = [threading.Thread(target=blocking_caller) for _ in range(3)]
    for thread in threads:
        thread.start()

    async def main() -> None:
        client = async_client(redis_server)
        keys = members(client, limits)
        both = AsyncMultiSemaphore(keys)
        total_twice = AsyncMultiSemaphore([keys[1]], weight=2)

        async def caller(sem: AsyncMultiSemaphore, weights: dict[str, int]) -> None:
            for _ in range(3):
                async with sem.acquire(timeout=30) as lease:
                    hold(weights, 1)
                    for member in sem.semaphores:
                        assert lease.token in {h.token for h in (await member.status()).holders}
                    await asyncio.sleep(0)
                    hold(weights, -1)

        await asyncio.gather(
            *(caller(both, {"host": 1, "total": 1}) for _ in range(12)),
            *(caller(total_twice, {"total": 2}) for _ in range(4)),
        )
        await client.aclose()

    asyncio.run(main())
    for thread in threads:
        thread.join(30)
    assert len(runs) == 3 * 6 + 12 * 3 + 4 * 3
    assert most["host"] <= limits[0] and most["total"] <= limits[1]
    assert held == {"host": 0, "total": 0}


@pytest.mark.parametrize("coroutine_first", [True, False])
def test_fifo_between_a_blocking_multi_caller_and_a_coroutine(redis_server: RedisServer, coroutine_first: bool) -> None:
    blocking = blocking_multi(redis_server)

    async def main() -> list[str]:
        client = async_client(redis_server)
        keys = members(client)
        multi = AsyncMultiSemaphore(keys)
        order = await blocking_and_coroutine_in_line(multi, blocking, lambda n: _all_waiting(keys, n), coroutine_first)
        assert await counts(keys) == [(0, 0), (0, 0)]
        await client.aclose()
        return order

    assert asyncio.run(main()) == (["coroutine", "blocking"] if coroutine_first else ["blocking", "coroutine"])


def test_cancelled_waiters_leave_every_line_at_once(redis_server: RedisServer) -> None:
    """Cancelled waiters (light and heavy) are out of both lines as they are cancelled, not
    when their places lapse after ``patience`` (5 s); the bound is 1 s for a loaded machine."""

    async def main() -> float:
        client = async_client(redis_server)
        keys = members(client, (2, 2))
        multi = AsyncMultiSemaphore(keys)
        holder = await multi.acquire(weight=2)
        waiters = [asyncio.ensure_future(multi.acquire(timeout=60)) for _ in range(20)]  # type: ignore[arg-type]
        waiters += [asyncio.ensure_future(multi.acquire(timeout=60, weight=2)) for _ in range(5)]  # type: ignore[arg-type]
        took = await time_to_empty_the_line(waiters, lambda n: _all_waiting(keys, n))
        assert await counts(keys) == [(2, 0), (2, 0)]
        await holder.release()
        await client.aclose()
        return took

    assert asyncio.run(main()) < 1.0


async def _all_waiting(keys: list[AsyncFairSemaphore], count: int) -> bool:
    return all(waiters == count for _, waiters in await counts(keys))


def test_an_offer_to_a_cancelled_waiter_goes_on_to_the_next(redis_server: RedisServer) -> None:
    async def main() -> None:
        client = async_client(redis_server)
        keys = members(client)
        await offer_to_a_cancelled_waiter_goes_on(AsyncMultiSemaphore(keys), lambda n: _all_waiting(keys, n))
        assert await counts(keys) == [(0, 0), (0, 0)]
        await client.aclose()

    asyncio.run(main())


def test_a_lease_is_renewed_by_the_loop(redis_server: RedisServer) -> None:
    async def main() -> None:
        client = async_client(redis_server)
        keys = members(client, lease=0.3)
        multi = AsyncMultiSemaphore(keys)
        async with multi.acquire() as lease:
            await until(lambda: _later(0.7), what="over two leases' time")
            for sem in keys:
                status = await sem.status()
                assert [h.token for h in status.holders] == [lease.token] and status.holders[0].expires_in > 0
            assert not lease.lost
            # and held for real: nobody else gets in
            with pytest.raises(SemaphoreUnavailable):
                await multi.acquire(timeout=0)
        assert await counts(keys) == [(0, 0), (0, 0)]
        await client.aclose()

    asyncio.run(main())


def test_timeout_raises_what_the_blocking_class_raises(redis_server: RedisServer) -> None:
    blocking = blocking_multi(redis_server)
    held = blocking.acquire()
    with pytest.raises(SemaphoreUnavailable) as blocking_error:
        blocking.acquire(timeout=0.1)

    async def main() -> None:
        client = async_client(redis_server)
        keys = members(client)
        multi = AsyncMultiSemaphore(keys)
        with pytest.raises(SemaphoreUnavailable) as error:
            await multi.acquire(timeout=0.2)
        assert type(error.value) is type(blocking_error.value)
        with pytest.raises(SemaphoreUnavailable):
            await multi.acquire(timeout=0)
        assert await counts(keys) == [(1, 0), (1, 0)]  # a waiter that gave up left both lines
        attempt = await multi.try_acquire(waiter="w1")
        assert isinstance(attempt, Waiting) and attempt.position == 0
        await asyncio.to_thread(held.release)
        granted = await multi.try_acquire(waiter="w1")
        assert isinstance(granted, AsyncGranted)
        await granted.lease.release()
        assert await counts(keys) == [(0, 0), (0, 0)]
        await client.aclose()

    asyncio.run(main())
