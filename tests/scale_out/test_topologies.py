"""Clients built from redis+cluster:// and redis+sentinel:// URLs against real local servers:
they talk to the deployment, run hash-tagged Lua, and find the data again after a failover."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import redis
import redis.cluster

from celery_semaphore import FairSemaphore
from celery_semaphore._celery.broker_urls import backend_from_broker
from celery_semaphore._core.clients import client_for
from celery_semaphore._core.urls import parse_backend_url
from celery_semaphore.errors import ConfigurationError

from ..redis_server import (
    RedisClusterSet,
    RedisSentinelSet,
    RedisServer,
    TlsFiles,
    make_test_certificates,
    system_binary,
    wait_until,
)

pytestmark = pytest.mark.slow

# Two keys of one hash tag, so the script touches one slot (as every semaphore script does).
SWAP = """
local old = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[2], old or '')
redis.call('SET', KEYS[1], ARGV[1])
return old
"""


def _round_trip_and_script(client: redis.Redis | redis.cluster.RedisCluster, tag: str) -> None:
    assert client.ping()
    client.set(f"{{{tag}}}:a", "first")
    assert client.get(f"{{{tag}}}:a") == b"first"
    swap = client.register_script(SWAP)
    assert swap(keys=[f"{{{tag}}}:a", f"{{{tag}}}:b"], args=["second"]) == b"first"
    assert client.get(f"{{{tag}}}:a") == b"second"
    assert client.get(f"{{{tag}}}:b") == b"first"


# --- Redis Cluster ------------------------------------------------------------------------


def test_cluster_url_builds_a_cluster_client(redis_cluster: RedisClusterSet) -> None:
    """redis+cluster:// gives a RedisCluster that pings, round-trips a key and runs a script
    over two keys of one hash tag."""
    client = client_for(redis_cluster.url)
    assert isinstance(client, redis.cluster.RedisCluster)
    assert client is client_for(redis_cluster.url)
    _round_trip_and_script(client, "sem")


def test_cluster_one_startup_node_is_enough(redis_cluster: RedisClusterSet) -> None:
    """The client learns the whole cluster from any one node of the URL."""
    port = redis_cluster.nodes[-1].port
    client = client_for(f"redis+cluster://127.0.0.1:{port}")
    masters = {node.port for node in redis_cluster.masters()}
    assert {node.port for node in client.get_primaries()} == masters


def test_cluster_hash_tags_keep_a_semaphore_in_one_slot_and_spread_many(redis_cluster: RedisClusterSet) -> None:
    """The keys of one semaphore share a slot; 100 semaphores spread over all 3 masters."""
    client = client_for(redis_cluster.url)
    owners = set()
    for index in range(100):
        key = f"host-{index}.example"
        slots = {client.keyslot(f"semaphore:{{{key}}}:{suffix}") for suffix in ("holders", "queue", "ticket", "limit")}
        assert len(slots) == 1
        owners.add(redis_cluster.node_for_key(f"semaphore:{{{key}}}:holders").port)
    assert owners == {node.port for node in redis_cluster.masters()}


@pytest.mark.parametrize("name", ["reports", "crawl:{host}", "a{b}c", "{x}", "a}b", "{", "{}"])
def test_fair_semaphore_on_a_cluster_client(redis_cluster: RedisClusterSet, name: str) -> None:
    """FairSemaphore acquires and releases through a client_for cluster client, braces in the
    name included (the first '{' after the prefix opens the hash tag, the first '}' closes it)."""
    client = client_for(redis_cluster.url)
    semaphore = FairSemaphore(client, name, 1, lease=5)
    lease = semaphore.acquire(timeout=5)
    assert client.zcard(semaphore.keys.holders) == 1
    lease.release()
    assert client.zcard(semaphore.keys.holders) == 0


def test_a_semaphore_name_starting_with_closing_brace_is_refused() -> None:
    """A name starting with '}' would make the empty hash tag '{}', scattering the semaphore's keys
    over a cluster's slots: it is a ConfigurationError at once, naming the value."""
    client = redis.Redis(host="127.0.0.1", port=1)  # never used: the name is refused first
    with pytest.raises(ConfigurationError) as caught:
        FairSemaphore(client, "}lead", 1, lease=5)
    assert caught.value.setting == "name"
    assert caught.value.value == "}lead"


def test_cluster_with_a_password() -> None:
    """The URL's password reaches every node, including those the client discovers."""
    with RedisClusterSet(password="cluster-pw") as cluster:
        assert cluster.url.startswith("redis+cluster://:cluster-pw@")
        _round_trip_and_script(client_for(cluster.url), "pw")
        wrong = cluster.url.replace("cluster-pw", "wrong")
        with pytest.raises(redis.ConnectionError, match="invalid username-password"):
            client_for(wrong)


def test_cluster_master_failover_keeps_the_client_working(own_redis_cluster: RedisClusterSet) -> None:
    """A master is killed; its replica is promoted and the same client reads the key again."""
    cluster = own_redis_cluster
    client = client_for(cluster.url)
    client.set("{failover}:k", "v")
    master = cluster.node_for_key("{failover}:k")
    replicas = cluster.replicas_of(master)
    with replicas[0].client() as replica:
        replica.execute_command("READONLY")
        wait_until(lambda: replica.get("{failover}:k") == b"v", 10, "the write replicated")
    cluster.kill(master)
    started = time.monotonic()
    new_master = cluster.wait_for_promotion(master, replicas)
    assert new_master in replicas
    assert wait_until(lambda: client.get("{failover}:k") == b"v", 30, "the client reading after failover")
    assert time.monotonic() - started < 30
    _round_trip_and_script(client, "failover")


def test_cluster_manual_failover(own_redis_cluster: RedisClusterSet) -> None:
    """CLUSTER FAILOVER (the helper) swaps master and replica; the client follows."""
    cluster = own_redis_cluster
    client = client_for(cluster.url)
    client.set("{manual}:k", "v")
    master = cluster.node_for_key("{manual}:k")
    new_master = cluster.failover(master)
    assert cluster.role(new_master) == "master"
    assert cluster.role(master) == "slave"
    assert wait_until(lambda: client.get("{manual}:k") == b"v", 30, "the client reading after failover")


# --- Sentinel -----------------------------------------------------------------------------


def test_sentinel_url_builds_a_master_client(redis_sentinel_set: RedisSentinelSet) -> None:
    """redis+sentinel:// gives a client of the current master: ping, a round trip, a script,
    and the write lands on the master the Sentinels name."""
    client = client_for(redis_sentinel_set.url)
    assert isinstance(client, redis.Redis)
    _round_trip_and_script(client, "sem")
    with redis_sentinel_set.master().client() as master:
        assert master.get("{sem}:a") == b"second"


def test_sentinel_url_db(redis_sentinel_set: RedisSentinelSet) -> None:
    """The /<db> after the service name selects the master's db."""
    client = client_for(redis_sentinel_set.url + "/4")
    client.set("in-db-4", "v")
    with redis_sentinel_set.master().client(db=4) as master:
        assert master.get("in-db-4") == b"v"


def test_kombu_sentinel_broker_default_reaches_the_master(redis_sentinel_set: RedisSentinelSet) -> None:
    """A Celery broker in kombu's Sentinel form gives a client of the same master."""
    broker = ";".join(f"sentinel://127.0.0.1:{sentinel.port}" for sentinel in redis_sentinel_set.sentinels)
    spec = backend_from_broker(broker, {"master_name": redis_sentinel_set.service_name})
    assert spec is not None
    client = client_for(spec)
    client.set("via-broker", "v")
    assert client_for(redis_sentinel_set.url).get("via-broker") == b"v"


def test_sentinel_with_passwords() -> None:
    """The URL's password reaches the master, sentinel_password the Sentinels."""
    with RedisSentinelSet(password="data-pw", sentinel_password="sentinel-pw") as sentinel_set:
        url = sentinel_set.url
        assert "sentinel_password=sentinel-pw" in url
        _round_trip_and_script(client_for(url), "pw")
        without_sentinel_password = url.split("?")[0]
        with pytest.raises(redis.RedisError):
            client_for(without_sentinel_password).ping()


def test_unknown_service_name_fails_at_first_command(redis_sentinel_set: RedisSentinelSet) -> None:
    """A service name no Sentinel monitors is reported by redis-py as MasterNotFoundError."""
    url = redis_sentinel_set.url.replace(f"/{redis_sentinel_set.service_name}", "/no-such-master")
    with pytest.raises(redis.sentinel.MasterNotFoundError):
        client_for(url).ping()


def test_sentinel_failover_keeps_the_client_working(own_redis_sentinel_set: RedisSentinelSet) -> None:
    """SENTINEL FAILOVER, then a killed master: each time the same client finds the new master."""
    sentinel_set = own_redis_sentinel_set
    client = client_for(sentinel_set.url)
    client.set("k", "1")
    old = sentinel_set.master()
    new = sentinel_set.failover()
    assert new is not old
    assert wait_until(lambda: client.set("k", "2") and client.get("k") == b"2", 30, "writes after failover")
    with new.client() as direct:
        assert direct.get("k") == b"2"
    sentinel_set.wait_settled()
    killed = sentinel_set.kill_master()
    newest = sentinel_set.wait_for_new_master(killed)
    assert newest is not killed
    assert wait_until(lambda: client.set("k", "3") and client.get("k") == b"3", 30, "writes after a crash")


def test_sentinel_client_leaves_a_demoted_master_within_the_check_interval(
    own_redis_sentinel_set: RedisSentinelSet,
) -> None:
    """After SENTINEL FAILOVER the old master accepts writes until a Sentinel demotes it (~10 s);
    a client_for client with a connection open to it moves to the new master within about
    SENTINEL_CHECK_INTERVAL instead, so its writes are not lost with the old master's data."""
    from celery_semaphore._core.clients import SENTINEL_CHECK_INTERVAL

    assert SENTINEL_CHECK_INTERVAL <= 1.0
    sentinel_set = own_redis_sentinel_set
    client = client_for(sentinel_set.url)
    client.set("k", "before")  # a connection to the old master is now open in the pool
    old = sentinel_set.master()
    with sentinel_set.sentinels[0].client() as sentinel:
        sentinel.execute_command("SENTINEL", "FAILOVER", sentinel_set.service_name)
    new = sentinel_set.wait_for_new_master(old)
    moved_at = time.monotonic()
    with new.client() as direct:

        def written_to_new_master() -> bool:
            client.set("k", "after")
            return direct.get("k") == b"after"

        wait_until(written_to_new_master, 5, "writes reaching the new master")
    # redis-py alone keeps writing to the old master until it is demoted, ~10 s after this
    assert time.monotonic() - moved_at < 3.0


def _tls_binary_or_skip(tmp_path: Path) -> tuple[str, TlsFiles]:
    binary = system_binary()
    if binary is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server on PATH and openssl")
    files = make_test_certificates(tmp_path / "tls")
    try:
        RedisServer(binary, tls=files).start().close()
    except RuntimeError:
        pytest.skip("redis-server on PATH is built without TLS")
    return binary, files


def test_sentinel_over_tls(tmp_path: Path) -> None:
    """rediss+sentinel:// with ssl_ca_certs reaches TLS Sentinels and a TLS master (the CA
    verifies both), and follows a failover to the new master's TLS port."""
    binary, files = _tls_binary_or_skip(tmp_path)
    with RedisSentinelSet(binary=binary, tls=files, password="pw") as sentinel_set:
        assert sentinel_set.url.startswith("rediss+sentinel://")
        client = client_for(sentinel_set.url)
        _round_trip_and_script(client, "tls")
        new = sentinel_set.failover()
        assert sentinel_set.master_address()[1] == new.tls_port
        assert wait_until(lambda: client.set("k", "v") and client.get("k") == b"v", 10, "writes after failover")
        with new.client() as direct:
            assert direct.get("k") == b"v"


def test_cluster_over_tls(tmp_path: Path) -> None:
    """rediss+cluster:// with ssl_ca_certs reaches every node over TLS (discovered nodes too)
    and follows a master failover."""
    binary, files = _tls_binary_or_skip(tmp_path)
    with RedisClusterSet(replicas=1, binary=binary, tls=files, password="pw") as cluster:
        assert cluster.url.startswith("rediss+cluster://")
        client = client_for(cluster.url)
        _round_trip_and_script(client, "tls")
        assert {node.port for node in client.get_nodes()} <= {node.tls_port for node in cluster.nodes}
        master = cluster.node_for_key("{tls}:a")
        replicas = cluster.replicas_of(master)
        cluster.kill(master)
        cluster.wait_for_promotion(master, replicas)
        assert wait_until(lambda: client.get("{tls}:a") == b"second", 30, "the client reading after failover")


def test_malformed_sentinel_url_never_reaches_a_server() -> None:
    """A Sentinel URL without a service name fails in parsing, before any connection."""
    with pytest.raises(ConfigurationError, match="no service name"):
        parse_backend_url("semaphore_backend_url", "redis+sentinel://127.0.0.1:1")


@pytest.mark.slow
def test_a_cluster_whose_master_died_is_unavailable_not_an_error() -> None:
    """With the master of a semaphore's slot dead and no replica to take over, every try is
    RedisUnavailable (callers wait, fail closed), whatever redis-py raises on the way (a dropped
    connection, CLUSTERDOWN, no node for the slot), never a plain SemaphoreError."""
    from celery_semaphore import RedisUnavailable

    with RedisClusterSet(replicas=0, node_timeout=500) as cluster:
        semaphore = FairSemaphore(client_for(cluster.url), "orphan", 1, lease=5)
        semaphore.acquire(timeout=5).release()
        cluster.kill(cluster.node_for_key("{orphan}:x"))
        for _ in range(3):
            with pytest.raises(RedisUnavailable):
                semaphore.try_acquire()
