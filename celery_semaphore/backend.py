"""One redis-py client per semaphore backend URL and process.

redis-py's connection pool notices a fork and opens new connections in the child, so a client
made in a Celery worker's parent is safe to use in its prefork children.
"""

from __future__ import annotations

import threading

import redis

_clients: dict[str, redis.Redis] = {}
_lock = threading.Lock()


def client_for(url: str) -> redis.Redis:
    """The shared client of ``url`` (TLS, password and ACL user come from the URL)."""
    with _lock:
        client = _clients.get(url)
        if client is None:
            client = _clients[url] = redis.Redis.from_url(url, health_check_interval=30)
        return client
