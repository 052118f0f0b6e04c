"""MultiSemaphore: slots of several semaphores and weights, taken all at once or not at all,
against real Redis servers (single server of each flavour, and a 3-master cluster)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
import redis
import redis.cluster

from celery_semaphore import ConfigurationError, FairSemaphore, Granted, MultiSemaphore, SemaphoreUnavailable, Waiting
from celery_semaphore._core.attempts import Ask, Duplicate, new_token
from celery_semaphore._core.clients import client_for

from ..redis_server import RedisClusterSet, RedisServer
from ..waiting import wait_until

_ENTER = """
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


class WeightProbe:
    """Slots in use of one resource, counted outside the semaphore: live sum and its peak."""

    def __init__(self, client: redis.Redis, name: str) -> None:
        self.client = client
        self.keys = [f"probe:{name}:live", f"probe:{name}:max"]
        self._enter = client.register_script(_ENTER)

    def enter(self, weight: int = 1) -> None:
        self._enter(keys=self.keys, args=[weight])

    def leave(self, weight: int = 1) -> None:
        self.client.decrby(self.keys[0], weight)

    @property
    def maximum(self) -> int:
        return int(self.client.get(self.keys[1]) or 0)


def run_threads(targets: list[Callable[[], None]], *, timeout: float = 30.0) -> None:
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as error:  # reported below
                errors.append(error)

        return run

    threads = [threading.Thread(target=guarded(target), daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "some acquirers never finished"
    assert not errors, errors


def test_per_host_and_total_limits_hold_together(redis_client: redis.Redis) -> None:
    """Crawls capped at 2 per host and 4 in total: neither peak ever passes its limit, and the
    total is reached (the per-host lines do not serialize the total)."""
    total = FairSemaphore(redis_client, "crawl-total", 4, lease=10)
    hosts = {host: FairSemaphore(redis_client, f"crawl:{host}", 2, lease=10) for host in "abc"}
    probes = {name: WeightProbe(redis_client, name) for name in [*hosts, "total"]}

    def crawl(host: str) -> Callable[[], None]:
        def run() -> None:
            with MultiSemaphore([hosts[host], total]).acquire(timeout=30):
                probes[host].enter()
                probes["total"].enter()
                time.sleep(0.02)
                probes["total"].leave()
                probes[host].leave()

        return run

    run_threads([crawl("abc"[i % 3]) for i in range(60)])
    assert probes["total"].maximum == 4
    for host in hosts:
        assert 1 <= probes[host].maximum <= 2
    assert all(s.status().holder_count == 0 for s in [total, *hosts.values()])


def test_opposite_key_orders_never_deadlock(redis_client: redis.Redis) -> None:
    """Two kinds of callers listing the same two semaphores (limit 1 each) in opposite orders,
    under load: all finish, and never two run at once."""
    x = FairSemaphore(redis_client, "x", 1, lease=10)
    y = FairSemaphore(redis_client, "y", 1, lease=10)
    probe = WeightProbe(redis_client, "xy")

    def worker(order: list[FairSemaphore]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(5):
                with MultiSemaphore(order).acquire(timeout=30):
                    probe.enter()
                    time.sleep(0.002)
                    probe.leave()

        return run

    run_threads([worker([x, y] if i % 2 else [y, x]) for i in range(16)])
    assert probe.maximum == 1


def test_weights_in_flight_never_pass_the_limit(redis_client: redis.Redis) -> None:
    """GPU jobs of weight 3 and 1 on 4 GPUs: the weights held at once never pass 4, and 4 is used."""
    gpus = FairSemaphore(redis_client, "gpus", 4, lease=10)
    probe = WeightProbe(redis_client, "gpus")

    def job(weight: int) -> Callable[[], None]:
        def run() -> None:
            with MultiSemaphore([gpus]).acquire(timeout=30, weight=weight):
                probe.enter(weight)
                time.sleep(0.01)
                probe.leave(weight)

        return run

    run_threads([job(3 if i % 3 == 0 else 1) for i in range(45)])
    assert probe.maximum == 4
    assert gpus.status().holder_count == 0


def test_a_heavy_waiter_is_not_passed_by_light_ones(redis_client: redis.Redis) -> None:
    """A weight-3 waiter that asked before light ones (plain FairSemaphore callers and weight-1
    MultiSemaphore callers) gets its slots first: the slots freed one by one wait for it."""
    gpus = FairSemaphore(redis_client, "gpus", 3, lease=10, patience=3)
    held = [gpus.acquire(timeout=0) for _ in range(3)]
    started: list[str] = []
    heavy_lease: list[object] = []

    def heavy() -> None:
        lease = MultiSemaphore([gpus]).acquire(timeout=20, weight=3)
        started.append("heavy")
        heavy_lease.append(lease)

    def light(name: str, multi: bool) -> Callable[[], None]:
        def run() -> None:
            lease = MultiSemaphore([gpus]).acquire(timeout=20) if multi else gpus.acquire(timeout=20)
            started.append(name)
            lease.release()

        return run

    threads = [threading.Thread(target=heavy, daemon=True)]
    threads[0].start()
    wait_until(lambda: gpus.status().waiter_count == 1, what="the heavy waiter in line")
    for i, multi in enumerate([False, True, False]):
        threads.append(threading.Thread(target=light(f"light{i}", multi), daemon=True))
        threads[-1].start()
        wait_until(lambda n=i: gpus.status().waiter_count == n + 2, what="a light waiter in line")
    held[0].release()
    held[1].release()
    # two slots are free, yet nobody behind the heavy waiter took them (nor an offer of them)
    status = gpus.status()
    assert (status.holder_count, status.offered_count, started) == (1, 0, [])
    held[2].release()
    wait_until(lambda: started, what="the heavy waiter to start")
    assert started == ["heavy"]
    assert [h.weight for h in gpus.status().holders] == [3]
    heavy_lease[0].release()  # type: ignore[attr-defined]
    for thread in threads:
        thread.join(20)
    assert started[0] == "heavy" and sorted(started[1:]) == ["light0", "light1", "light2"]


def test_a_waiter_holds_nothing_while_it_waits(redis_client: redis.Redis) -> None:
    """A waiter for two semaphores, one of them full, takes no slot of the other meanwhile;
    it gets both at once when the full one frees."""
    a = FairSemaphore(redis_client, "a", 1, lease=10)
    b = FairSemaphore(redis_client, "b", 1, lease=10)
    holder = b.acquire(timeout=0)
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(MultiSemaphore([a, b]).acquire(timeout=10)), daemon=True)
    thread.start()
    wait_until(lambda: b.status().waiter_count == 1, what="the waiter in line")
    assert a.status().holder_count == 0
    assert isinstance(MultiSemaphore([a]).try_acquire(), Waiting)  # a's line has it at its head
    holder.release()
    thread.join(10)
    assert (a.status().holder_count, b.status().holder_count) == (1, 1)
    result[0].release()  # type: ignore[attr-defined]
    assert (a.status().holder_count, b.status().holder_count) == (0, 0)


def test_a_weight_above_a_limit_fails_loudly(redis_client: redis.Redis) -> None:
    """A weight above a limit in code is refused at once; above a runtime override, the try is
    refused at once too and leaves no place in line, instead of waiting forever."""
    a = FairSemaphore(redis_client, "a", 4)
    b = FairSemaphore(redis_client, "b", 2)
    with pytest.raises(ConfigurationError, match="above the limit 2 of 'b'"):
        MultiSemaphore([a, b], weight=3)
    a.set_limit(1)
    with pytest.raises(ConfigurationError, match="in force for 'a'"):
        MultiSemaphore([a, b]).acquire(timeout=5, weight=2)
    assert a.status().waiter_count == b.status().waiter_count == 0
    with pytest.raises(ConfigurationError, match="listed twice"):
        MultiSemaphore([a, FairSemaphore(redis_client, "a", 4)])


def test_timeout_leaves_every_line(redis_client: redis.Redis) -> None:
    """A multi acquire that times out leaves no place in any line behind it."""
    a = FairSemaphore(redis_client, "a", 1)
    b = FairSemaphore(redis_client, "b", 1)
    holder = a.acquire(timeout=0)
    with pytest.raises(SemaphoreUnavailable):
        MultiSemaphore([a, b]).acquire(timeout=0.3)
    assert a.status().waiter_count == b.status().waiter_count == 0
    holder.release()
    MultiSemaphore([a, b]).acquire(timeout=0).release()


def test_renewal_and_reclaim_cover_every_slot(redis_client: redis.Redis) -> None:
    """Renewing a weighted multi lease extends all its entries on every semaphore; after a reset
    the renewer registers all of them again."""
    a = FairSemaphore(redis_client, "a", 3, lease=2)
    b = FairSemaphore(redis_client, "b", 2, lease=2)
    multi = MultiSemaphore([a, b])
    lease = multi.acquire(timeout=0, weight=2)
    before = dict(redis_client.zrange(b.keys.holders, 0, -1, withscores=True))
    time.sleep(0.1)
    lease.renew()
    after = dict(redis_client.zrange(b.keys.holders, 0, -1, withscores=True))
    assert len(after) == 2 and all(after[member] >= before[member] + 100 for member in before)
    a.reset()
    b.reset()
    assert multi._renew_many([(lease.token, "x", "")], reclaim=True) == [2]
    assert (a.status().holder_count, b.status().holder_count) == (2, 2)
    # the background renewer keeps it held past its 2 s lease
    time.sleep(2.5)
    assert (a.status().holder_count, b.status().holder_count) == (2, 2)
    assert lease.release()
    assert (a.status().holder_count, b.status().holder_count) == (0, 0)


def test_release_by_task_id_prefix_frees_every_weighted_slot(redis_client: redis.Redis) -> None:
    """A worker's parent releases a killed child's slots by the task-id prefix of its token: all
    entries of a weighted grant match it."""
    a = FairSemaphore(redis_client, "a", 3)
    MultiSemaphore([a], weight=3).try_acquire(token="task-1:abc")
    assert a.status().holder_count == 3
    assert a._release_holders_with_prefix("task-1:") == 3
    assert a.status().holder_count == 0


_HOLDER = """
import sys, time, redis
from celery_semaphore import FairSemaphore, MultiSemaphore
client = redis.Redis(port=int(sys.argv[1]))
sems = [FairSemaphore(client, name, 2, lease=1) for name in ("a", "b")]
MultiSemaphore(sems).acquire(timeout=5, weight=2)
print("held", flush=True)
time.sleep(60)
"""


def test_a_killed_holders_slots_all_come_back(own_redis: RedisServer) -> None:
    """A process SIGKILLed while holding weight 2 of two semaphores: every slot comes back when
    its lease ends, and a waiter gets them."""
    # as a context manager, the pipe of the holder's output is closed too (else it is left to the
    # garbage collector, a ResourceWarning)
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(own_redis.port)], stdout=subprocess.PIPE, text=True, env={**os.environ}
    ) as process:
        try:
            assert process.stdout is not None and process.stdout.readline().strip() == "held"
            client = own_redis.client()
            sems = [FairSemaphore(client, name, 2, lease=1) for name in ("a", "b")]
            assert [s.status().holder_count for s in sems] == [2, 2]
            process.send_signal(signal.SIGKILL)
            started = time.monotonic()
            lease = MultiSemaphore(sems).acquire(timeout=10, weight=2)
            assert time.monotonic() - started < 5
            assert [s.status().holder_count for s in sems] == [2, 2]
            lease.release()
        finally:
            process.kill()


@pytest.mark.slow
def test_cluster_multi_acquire_with_a_shared_hash_tag(redis_cluster: RedisClusterSet) -> None:
    """On a 3-master cluster, semaphores sharing a hash tag are acquired together in one script;
    without a shared tag the MultiSemaphore is refused with a clear error."""
    client = client_for(redis_cluster.url)
    assert isinstance(client, redis.cluster.RedisCluster)
    names = [f"crawl:{host}" for host in "abcdef"]
    untagged = [FairSemaphore(client, name, 1) for name in names]
    slots = {client.keyslot(s.keys.holders) for s in untagged}
    assert len(slots) > 1
    with pytest.raises(ConfigurationError, match="same hash_tag"):
        MultiSemaphore(untagged)
    tagged = [FairSemaphore(client, name, 2, hash_tag="crawl") for name in names]
    total = FairSemaphore(client, "crawl-total", 2, hash_tag="crawl")
    multi = MultiSemaphore([tagged[0], total])
    lease = multi.acquire(timeout=0)
    assert (tagged[0].status().holder_count, total.status().holder_count) == (1, 1)
    heavy = MultiSemaphore([tagged[1], total]).acquire(timeout=0)
    with pytest.raises(SemaphoreUnavailable):
        MultiSemaphore([tagged[2], total]).acquire(timeout=0.3)
    lease.release()
    heavy.release()
    MultiSemaphore([tagged[2], total]).acquire(timeout=5, weight=2).release()
    assert total.status().holder_count == 0


def test_copies_of_one_run_take_the_slots_once(redis_client: redis.Redis) -> None:
    """Two copies of one Celery wait (same run id) asking a multi acquire: the second is told
    the first is running, and once it released, that the run is done."""
    a = FairSemaphore(redis_client, "a", 2)
    b = FairSemaphore(redis_client, "b", 2)
    multi = MultiSemaphore([a, b], weight=2)
    first = multi._try(Ask(token="t1:x", waiter="t1", run="t1#0", remember=30))
    assert isinstance(first, Granted)
    twin = multi._try(Ask(token="t1:y", waiter="t1", run="t1#0", remember=30))
    assert isinstance(twin, Duplicate) and twin.running
    first.lease.release()
    assert multi._try(Ask(token="t1:z", waiter="t1", run="t1#0", remember=30)) == Duplicate(running=False)
    assert (a.status().holder_count, b.status().holder_count) == (0, 0)


def test_a_renewed_multi_run_outlives_the_time_its_record_is_remembered(redis_client: redis.Redis) -> None:
    """The run record of a multi grant (on its first semaphore) lives as long as the lease each
    renewal extends: a copy asking after the remembered time is told the run is still running."""
    multi = MultiSemaphore([FairSemaphore(redis_client, "ra", 2), FairSemaphore(redis_client, "rb", 2)])
    seconds, micros = redis_client.time()
    asked_at_ms = seconds * 1000 + micros / 1000
    first = multi._try(Ask(token="t2:x", waiter="t2", run="t2#0", remember=0.2))
    assert isinstance(first, Granted)
    first.lease.renew()  # the record now lives as long as the lease (60 s)

    def server_ms() -> float:
        seconds, micros = redis_client.time()
        return seconds * 1000 + micros / 1000

    wait_until(lambda: server_ms() > asked_at_ms + 500, timeout=5, what="the 0.2 s remembered gone by")
    late = multi._try(Ask(token="t2:y", waiter="t2", run="t2#0", remember=0.2))
    assert isinstance(late, Duplicate) and late.running
    first.lease.release()


def test_a_parked_multi_waiter_keeps_heading_its_lines(redis_client: redis.Redis) -> None:
    """A multi waiter that steps away parked keeps its places and holds back those behind it;
    stepping away unparked lets them pass; leaving gives the places up."""
    a = FairSemaphore(redis_client, "a", 1)
    b = FairSemaphore(redis_client, "b", 1)
    holder = b.acquire(timeout=0)
    multi = MultiSemaphore([a, b])
    assert isinstance(multi.try_acquire(waiter="w"), Waiting)
    assert multi._leave("w", 30, "some-channel")
    assert isinstance(a.try_acquire(enqueue=False), Waiting)  # the parked waiter heads a's line
    assert multi.leave("w", away_for=30)
    lease = a.try_acquire(enqueue=False)
    assert isinstance(lease, Granted)
    lease.lease.release()
    assert a.status().waiter_count == 1
    assert multi.leave("w")
    assert a.status().waiter_count == b.status().waiter_count == 0
    holder.release()


def test_a_waiter_asking_from_another_process_is_told_there(redis_client: redis.Redis) -> None:
    """A multi waiter that asks again with a new wake address (a re-sent copy in another worker
    process) is told on the new one, in every line, keeping its first-ask time."""
    a = FairSemaphore(redis_client, "a", 1)
    b = FairSemaphore(redis_client, "b", 1)
    holder = a.acquire(timeout=0)
    multi = MultiSemaphore([a, b])
    assert isinstance(multi._try(Ask(token=new_token(), waiter="w", wake="chan-1")), Waiting)
    first = [redis_client.hget(s.keys.waiter_info, "w:*1*w") for s in (a, b)]
    assert isinstance(multi._try(Ask(token=new_token(), waiter="w", wake="chan-2")), Waiting)
    now = [redis_client.hget(s.keys.waiter_info, "w:*1*w") for s in (a, b)]
    assert [v.rsplit(b"|", 1) for v in now] == [[f.split(b"|")[0], b"chan-2"] for f in first]
    multi.leave("w")
    holder.release()


def test_a_multi_waiter_freed_between_its_refusal_and_its_park_is_told_when_it_parks(
    redis_client: redis.Redis,
) -> None:
    """The release that frees a multi waiter's slots lands after its refusal and before its park:
    it tells an address nobody listens on yet. Parking then tells the waiter at once (it heads
    every line and its weight fits), instead of leaving every line it heads idle until its
    backstop copy comes."""
    a = FairSemaphore(redis_client, "a", 1)
    b = FairSemaphore(redis_client, "b", 1)
    holder = b.acquire(timeout=0)
    multi = MultiSemaphore([a, b])
    assert isinstance(multi.try_acquire(waiter="w"), Waiting)  # refused, not parked yet
    holder.release()  # tells nobody: the waiter has no address yet
    listener = redis_client.pubsub()
    listener.subscribe("park-channel")
    wait_until(lambda: listener.get_message(timeout=0.1), timeout=5, what="subscribed")
    assert multi._leave("w", 30, "park-channel")
    told = wait_until(lambda: listener.get_message(timeout=0.1), timeout=5, what="the parked waiter told")
    assert told["data"] == b"*1*w"
    granted = multi.try_acquire(waiter="w")
    assert isinstance(granted, Granted)
    granted.lease.release()
    listener.close()
