"""Wake-ups over sharded pub/sub on a Redis >= 7 cluster: the listener SSUBSCRIBEs each wake
channel on the master owning its slot and the scripts SPUBLISH, so a wake-up goes to one shard.
A 6.2 cluster, a single Redis (and Sentinel) keep classic PUBLISH/SUBSCRIBE.

Blocked callers here have a long patience (they ask again only every 20 s by themselves), so a
caller granted within a few seconds was woken by a wake-up, not by its own polling."""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.cluster

from celery_semaphore import FairSemaphore, Lease
from celery_semaphore._core.pubsub import ShardedSubscription
from celery_semaphore._core.storage import SHARDED_MARK
from celery_semaphore._core.wakeups import wake_ups_for

from ..redis_server import RedisClusterSet, RedisServer, binary_version
from ..waiting import wait_until

# long enough that a caller's own re-asks (every patience / 3) never pass for a wake-up
PATIENCE = 60.0
# a wake-up arrives well within this; a caller's own re-ask would take 20 s
WOKEN_WITHIN = 5.0


def _is_7(cluster: RedisClusterSet) -> bool:
    return int(binary_version(cluster.binary).split(".")[0]) >= 7


def _cmd(client: Any, *args: Any) -> Any:
    return client.execute_command(*args)


def _names(items: Any) -> list[str]:
    return sorted(item.decode() if isinstance(item, bytes) else str(item) for item in items)


@pytest.fixture
def cluster_client(redis_cluster: RedisClusterSet) -> Iterator[redis.cluster.RedisCluster]:
    client = redis_cluster.client()
    yield client
    client.close()


def _classic_channels(cluster: RedisClusterSet) -> set[str]:
    found: set[str] = set()
    for node in cluster.live_nodes():
        with node.client() as client:
            found.update(_names(client.pubsub_channels("semaphore:*")))
    return found


def _names_on_every_master(cluster: RedisClusterSet, per_master: int, stem: str) -> dict[int, list[str]]:
    """Semaphore names whose slots live on each master: port -> names."""
    found: dict[int, list[str]] = {node.port: [] for node in cluster.masters()}
    index = 0
    while any(len(names) < per_master for names in found.values()):
        name = f"{stem}-{index}"
        port = cluster.node_for_key(f"semaphore:{{{name}}}:holders").port
        if len(found[port]) < per_master:
            found[port].append(name)
        index += 1
    return found


class BlockedCaller:
    """A thread blocked in ``acquire`` until granted; records when."""

    def __init__(self, semaphore: FairSemaphore) -> None:
        self.semaphore = semaphore
        self.lease: Lease | None = None
        self.granted_at: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.lease = self.semaphore.acquire(timeout=60)
            self.granted_at = time.monotonic()
        except BaseException as error:  # reported by the test
            self.error = error

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert self.error is None, self.error
        assert self.lease is not None, "never granted"


def _wait_in_line(semaphore: FairSemaphore, waiters: int = 1) -> None:
    wait_until(lambda: semaphore.status().waiter_count >= waiters, timeout=10, what=f"{semaphore.name} waiters")


def _hand_offs(semaphore: FairSemaphore, rounds: int) -> list[float]:
    """Two threads pass one slot back and forth ``rounds`` times; each time the holder waits
    until the other is blocked in line, then releases: the figure is release start -> the other's
    acquire returning (the release, the wake-up, and the woken caller's claim)."""
    released_at = [0.0]
    latencies: list[float] = []
    errors: list[BaseException] = []
    first = semaphore.acquire(timeout=5)

    def side(parity: int) -> None:
        # turn h is held by side h % 2; the holder of turn h < rounds hands the slot on
        held = first if parity == 0 else None
        try:
            for turn in range(parity, rounds + 1, 2):
                if held is None:
                    held = semaphore.acquire(timeout=30)
                    latencies.append(time.perf_counter() - released_at[0])
                if turn < rounds:
                    _wait_in_line(semaphore)
                    released_at[0] = time.perf_counter()
                held.release()
                held = None
        except BaseException as error:
            errors.append(error)
            if held is not None:
                held.release()

    threads = [threading.Thread(target=side, args=(parity,), daemon=True) for parity in (1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors[:2]
    return latencies


# --- which pub/sub --------------------------------------------------------------------------


def test_a_single_redis_keeps_classic_pubsub(redis_server: RedisServer) -> None:
    """One Redis (of either flavour): no mark in the listener's id, the waiter's channel is a
    classic one."""
    client = redis_server.client()
    try:
        wake_ups = wake_ups_for(client)
        assert not wake_ups.sharded
        assert not wake_ups.listener_id.startswith(SHARDED_MARK)
        semaphore = FairSemaphore(client, "plain", 1, lease=30, patience=PATIENCE)
        holder = semaphore.acquire(timeout=0)
        caller = BlockedCaller(semaphore)
        _wait_in_line(semaphore)
        channel = semaphore.keys.wake_address(wake_ups.listener_id)
        wait_until(lambda: _names(client.pubsub_channels(channel)) == [channel], what="the classic subscription")
        started = time.monotonic()
        holder.release()
        caller.join(WOKEN_WITHIN)
        assert caller.granted_at is not None and caller.granted_at - started < WOKEN_WITHIN
        caller.lease.release()  # type: ignore[union-attr]
    finally:
        client.close()


@pytest.mark.slow
def test_the_listener_is_sharded_on_a_redis_7_cluster_only(
    redis_cluster: RedisClusterSet, cluster_client: redis.cluster.RedisCluster
) -> None:
    wake_ups = wake_ups_for(cluster_client)
    assert wake_ups.sharded is _is_7(redis_cluster)
    assert wake_ups.listener_id.startswith(SHARDED_MARK) is _is_7(redis_cluster)


# --- wake-ups reach the caller ------------------------------------------------------------


@pytest.mark.slow
def test_blocked_callers_on_every_master_are_woken(
    redis_cluster: RedisClusterSet, cluster_client: redis.cluster.RedisCluster
) -> None:
    """Two semaphores on each of the 3 masters, a caller blocked on each: every release wakes
    its caller within seconds (not its own re-ask 20 s later). On Redis 7 each master lists the
    wake channels of its own semaphores as shard channels and no node has a classic one; on 6.2
    they are classic channels."""
    sharded = _is_7(redis_cluster)
    wake_ups = wake_ups_for(cluster_client)
    by_master = _names_on_every_master(redis_cluster, 2, "spread")
    semaphores = {
        port: [FairSemaphore(cluster_client, name, 1, lease=30, patience=PATIENCE) for name in names]
        for port, names in by_master.items()
    }
    everyone = [semaphore for group in semaphores.values() for semaphore in group]
    holders = [semaphore.acquire(timeout=0) for semaphore in everyone]
    callers = [BlockedCaller(semaphore) for semaphore in everyone]
    for semaphore in everyone:
        _wait_in_line(semaphore)
    masters = {node.port: node for node in redis_cluster.masters()}
    if sharded:
        for port, group in semaphores.items():
            mine = {semaphore.keys.wake_address(wake_ups.listener_id) for semaphore in group}
            with masters[port].client() as node:
                wait_until(
                    lambda node=node, mine=mine: (
                        mine <= set(_names(_cmd(node, "PUBSUB", "SHARDCHANNELS", "semaphore:*")))
                    ),
                    what=f"shard channels on {port}",
                )
        assert _classic_channels(redis_cluster) == set()
    else:
        # ClusterPubSub SUBSCRIBEs on a node of its choosing: the channels are somewhere
        channels = {semaphore.keys.wake_address(wake_ups.listener_id) for semaphore in everyone}
        wait_until(lambda: channels <= _classic_channels(redis_cluster), what="classic channels")
    started = time.monotonic()
    for holder in holders:
        holder.release()
    for caller in callers:
        caller.join(WOKEN_WITHIN + 5)
    slowest = max(caller.granted_at or 0.0 for caller in callers) - started
    assert slowest < WOKEN_WITHIN, f"slowest caller granted after {slowest:.2f} s"
    for caller in callers:
        caller.lease.release()  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_new_channel_is_subscribed_at_once_on_another_master(
    redis_cluster: RedisClusterSet, cluster_client: redis.cluster.RedisCluster
) -> None:
    """While the listener waits on one master's channel, a waiter needing a channel on another
    master pokes it: the subscription is confirmed in well under the listener's 5 s read timeout."""
    wake_ups = wake_ups_for(cluster_client)
    names = _names_on_every_master(redis_cluster, 1, "poke")
    first, *others = [names[port][0] for port in sorted(names)]
    channel = FairSemaphore(cluster_client, first, 1).keys.wake_address(wake_ups.listener_id)
    with wake_ups.signal(channel, "w0") as handle:
        assert handle.subscribe(10)
        time.sleep(0.2)  # the listener is now blocked waiting for messages
        for index, name in enumerate(others):
            other = FairSemaphore(cluster_client, name, 1).keys.wake_address(wake_ups.listener_id)
            with wake_ups.signal(other, f"w{index + 1}") as second:
                started = time.monotonic()
                assert second.subscribe(10)
                assert time.monotonic() - started < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("redis_cluster", ["path"], indirect=True)
def test_a_poke_taken_in_right_before_the_wait_is_not_waited_out(
    cluster_client: redis.cluster.RedisCluster,
) -> None:
    """A poke means "a channel was added: read the table again". One that arrives after the
    listener read the table, but before it starts to wait, is taken in by the read that comes
    before the wait; the call must then return at once, so that the listener reads the table,
    not wait out its whole timeout with the new channel unsubscribed (seen: a second channel
    subscribed 5 s late, one run in ten of this module). Writing the poke before the call puts it
    in that window every time; the subscription, its socket pair and the cluster are real."""
    pokes_out, pokes_in = socket.socketpair()
    pokes_out.setblocking(False)
    subscription = ShardedSubscription(cluster_client, lambda: None, pokes_out, refresh=False)
    try:
        pokes_in.send(b"\0")
        started = time.monotonic()
        assert subscription.next_message(5.0) is None
        assert time.monotonic() - started < 2.0, "the poke was taken in, then the timeout waited out"
    finally:
        subscription.close()
        pokes_out.close()
        pokes_in.close()


@pytest.mark.slow
def test_hand_off_latency_on_a_cluster(
    redis_cluster: RedisClusterSet, cluster_client: redis.cluster.RedisCluster
) -> None:
    """200 hand-offs between two threads of one process: release -> the blocked caller's
    acquire returning. Redis 7: over sharded pub/sub, 6.2: classic. The listener also listens on
    a channel on each other master (on Redis 7, one connection per master: a wake-up must not
    wait behind the quiet ones). The figures are printed (pytest -s); p99 under 100 ms on a
    loaded 2-core machine, and no hand-off left to a re-ask."""
    wake_ups = wake_ups_for(cluster_client)
    semaphore = FairSemaphore(cluster_client, "latency", 1, lease=30, patience=PATIENCE)
    owner = redis_cluster.node_for_key(semaphore.keys.holders).port
    quiet = [names[0] for port, names in _names_on_every_master(redis_cluster, 1, "quiet").items() if port != owner]
    handles = [
        wake_ups.signal(FairSemaphore(cluster_client, name, 1).keys.wake_address(wake_ups.listener_id), "idle")
        for name in quiet
    ]
    try:
        for handle in handles:
            assert handle.subscribe(10)
        latencies = _hand_offs(semaphore, 210)[10:]  # the first ones subscribe
        if wake_ups.sharded:  # the listener was on every master throughout
            for master in redis_cluster.masters():
                with master.client() as node:
                    assert _names(_cmd(node, "PUBSUB", "SHARDCHANNELS", f"*:wake:{wake_ups.listener_id}"))
    finally:
        for handle in handles:
            handle.close()
    latencies.sort()
    p50 = statistics.median(latencies) * 1000
    p99 = latencies[int(len(latencies) * 0.99) - 1] * 1000
    kind = "sharded" if wake_ups.sharded else "classic"
    print(
        f"\nhand-off on a {binary_version(redis_cluster.binary)} cluster ({kind}), {len(latencies)} hand-offs: "
        f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {latencies[-1] * 1000:.2f} ms"
    )
    assert p99 < 100, f"p99 {p99:.1f} ms"
    assert latencies[-1] < 2.0


# --- the wake-up goes to one shard ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("redis_cluster", ["path"], indirect=True)
def test_a_wake_up_is_sharded(redis_cluster: RedisClusterSet, cluster_client: redis.cluster.RedisCluster) -> None:
    """Redis 7: the wake channel is a shard channel of the master owning the semaphore's slot;
    classic SUBSCRIBErs of that channel name, on that master and on the others, hear nothing
    of the release that wakes the blocked caller."""
    if not _is_7(redis_cluster):
        pytest.skip("sharded pub/sub needs Redis >= 7")
    wake_ups = wake_ups_for(cluster_client)
    semaphore = FairSemaphore(cluster_client, "sharded", 1, lease=30, patience=PATIENCE)
    channel = semaphore.keys.wake_address(wake_ups.listener_id)
    assert channel.endswith(f":wake:{wake_ups.listener_id}") and wake_ups.listener_id.startswith(SHARDED_MARK)
    owner = redis_cluster.node_for_key(semaphore.keys.holders)
    holder = semaphore.acquire(timeout=0)
    caller = BlockedCaller(semaphore)
    _wait_in_line(semaphore)
    with owner.client() as node:
        wait_until(lambda: channel in _names(_cmd(node, "PUBSUB", "SHARDCHANNELS")), what="the shard channel")
        assert channel not in _names(node.pubsub_channels())
    eavesdroppers = []
    for master in redis_cluster.masters():
        client = master.client()
        pubsub = client.pubsub()
        pubsub.subscribe(channel)
        assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
        eavesdroppers.append((client, pubsub))
    for master in redis_cluster.masters():
        if master.port != owner.port:
            with master.client() as node:
                assert channel not in _names(_cmd(node, "PUBSUB", "SHARDCHANNELS"))
    started = time.monotonic()
    holder.release()
    caller.join(WOKEN_WITHIN)
    assert (caller.granted_at or 0.0) - started < WOKEN_WITHIN
    time.sleep(0.2)  # a broadcast PUBLISH would have reached every node by now
    try:
        for _client, pubsub in eavesdroppers:
            assert pubsub.get_message(timeout=0.1) is None
    finally:
        for client, pubsub in eavesdroppers:
            pubsub.close()
            client.close()
    caller.lease.release()  # type: ignore[union-attr]


# --- failover -----------------------------------------------------------------------------


@pytest.mark.slow
def test_wake_ups_keep_working_through_a_cluster_failover(own_redis_cluster: RedisClusterSet) -> None:
    """A caller is blocked on a semaphore; its master is failed over (CLUSTER FAILOVER). Redis 7
    unsubscribes the wake channel from the demoted master; the listener subscribes it on the new
    master, and releases there wake blocked callers within seconds, hand-off after hand-off."""
    cluster = own_redis_cluster
    if not _is_7(cluster):
        pytest.skip("sharded pub/sub needs Redis >= 7")
    client = cluster.client()
    try:
        wake_ups = wake_ups_for(client)
        assert wake_ups.sharded
        semaphore = FairSemaphore(client, "moving", 1, lease=30, patience=PATIENCE)
        channel = semaphore.keys.wake_address(wake_ups.listener_id)
        old_master = cluster.node_for_key(semaphore.keys.holders)
        holder = semaphore.acquire(timeout=0)
        caller = BlockedCaller(semaphore)
        _wait_in_line(semaphore)
        with old_master.client() as node:
            wait_until(lambda: channel in _names(_cmd(node, "PUBSUB", "SHARDCHANNELS")), what="the shard channel")
        new_master = cluster.failover(old_master)
        assert cluster.node_for_key(semaphore.keys.holders).port == new_master.port
        with new_master.client() as node:
            wait_until(
                lambda: channel in _names(_cmd(node, "PUBSUB", "SHARDCHANNELS")),
                timeout=15,
                what="the shard channel on the new master",
            )
        started = time.monotonic()
        holder.release()
        caller.join(WOKEN_WITHIN + 5)
        assert (caller.granted_at or 0.0) - started < WOKEN_WITHIN
        caller.lease.release()  # type: ignore[union-attr]
        latencies = _hand_offs(semaphore, 20)
        assert max(latencies) < WOKEN_WITHIN, latencies
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.parametrize("redis_cluster", ["path"], indirect=True)
def test_an_acl_user_of_the_documented_rules_gets_sharded_wake_ups(redis_cluster: RedisClusterSet) -> None:
    """The ACL rule set of docs/deploying.md (no INFO) is enough to tell the version (HELLO),
    SSUBSCRIBE and SPUBLISH from the scripts: the caller is woken by a release."""
    if not _is_7(redis_cluster):
        pytest.skip("sharded pub/sub needs Redis >= 7")
    rule = [
        "on",
        ">sharded-pw",
        "resetkeys",
        "~semaphore:*",
        "resetchannels",
        "&*",
        "-@all",
        "+@read",
        "+@write",
        "+@scripting",
        "+@pubsub",
        "+@connection",
        "+time",
        "+cluster|slots",
    ]
    for node in redis_cluster.live_nodes():
        with node.client() as admin:
            _cmd(admin, "ACL", "SETUSER", "sharded-user", "reset", *rule)
    nodes = [redis.cluster.ClusterNode("127.0.0.1", node.port) for node in redis_cluster.nodes]  # type: ignore[no-untyped-call]
    client = redis.cluster.RedisCluster(startup_nodes=nodes, username="sharded-user", password="sharded-pw")
    try:
        assert wake_ups_for(client).sharded
        semaphore = FairSemaphore(client, "acl", 1, lease=30, patience=PATIENCE)
        holder = semaphore.acquire(timeout=0)
        caller = BlockedCaller(semaphore)
        _wait_in_line(semaphore)
        wait_until(
            lambda: (
                wake_ups_for(client)._channels
                and all(entry.ready.is_set() for entry in wake_ups_for(client)._channels.values())
            ),
            what="the subscription",
        )
        started = time.monotonic()
        holder.release()
        caller.join(WOKEN_WITHIN)
        assert (caller.granted_at or 0.0) - started < WOKEN_WITHIN
        caller.lease.release()  # type: ignore[union-attr]
    finally:
        client.close()
        for node in redis_cluster.live_nodes():
            with node.client() as admin:
                _cmd(admin, "ACL", "DELUSER", "sharded-user")


@pytest.mark.slow
def test_wake_ups_come_back_after_the_owning_master_is_killed(own_redis_cluster: RedisClusterSet) -> None:
    """The master of a semaphore with a blocked caller is SIGKILLed: the listener's connection
    breaks, it starts over on the slot map of the promoted replica, and a release there wakes
    the caller within seconds."""
    cluster = own_redis_cluster
    if not _is_7(cluster):
        pytest.skip("sharded pub/sub needs Redis >= 7")
    client = cluster.client()
    try:
        wake_ups = wake_ups_for(client)
        semaphore = FairSemaphore(client, "killed", 1, lease=30, patience=PATIENCE)
        channel = semaphore.keys.wake_address(wake_ups.listener_id)
        old_master = cluster.node_for_key(semaphore.keys.holders)
        replicas = cluster.replicas_of(old_master)
        holder = semaphore.acquire(timeout=0)
        with replicas[0].client() as replica:
            _cmd(replica, "READONLY")
            wait_until(lambda: replica.zcard(semaphore.keys.holders) == 1, what="the grant replicated")
        caller = BlockedCaller(semaphore)
        _wait_in_line(semaphore)
        with old_master.client() as node:
            wait_until(lambda: channel in _names(_cmd(node, "PUBSUB", "SHARDCHANNELS")), what="the shard channel")
        cluster.kill(old_master)
        new_master = cluster.wait_for_promotion(old_master, replicas)
        with new_master.client() as node:
            wait_until(
                lambda: channel in _names(_cmd(node, "PUBSUB", "SHARDCHANNELS")),
                timeout=30,
                what="the shard channel on the promoted replica",
            )
        _wait_in_line(semaphore)
        started = time.monotonic()
        holder.release()
        caller.join(WOKEN_WITHIN + 5)
        assert (caller.granted_at or 0.0) - started < WOKEN_WITHIN
        caller.lease.release()  # type: ignore[union-attr]
    finally:
        client.close()
