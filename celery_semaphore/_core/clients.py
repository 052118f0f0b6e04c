"""One client per Redis deployment and process, built from a checked :class:`~.urls.BackendSpec`.

Separate from :mod:`.urls` because this is where the state and the redis-py machinery are: the
process-wide cache of clients, the Cluster and Sentinel client classes, the socket timeouts, the
Sentinel pool that follows a failover. Reading a URL needs none of it.

Every client built here has socket timeouts, :data:`SOCKET_TIMEOUT` and
:data:`SOCKET_CONNECT_TIMEOUT` unless the URL's ``socket_timeout`` / ``socket_connect_timeout``
say otherwise (a positive number of seconds). redis-py before 8 has none: a Redis that stops
answering (SIGSTOP, a frozen VM, a partition that drops packets) would hang every caller for
ever, the renewer thread included, while the leases it should renew run out in Redis. With a
timeout a stalled call raises ``redis.TimeoutError``, which the semaphore reports as
``RedisUnavailable`` (the Celery layer then waits: it fails closed). The Sentinels' own
connections take the same timeouts unless ``sentinel_socket_timeout`` /
``sentinel_socket_connect_timeout`` are given, and are not retried by redis-py: a silent
Sentinel is passed over for the next one at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from . import fork_locks
from .masking import MASK
from .urls import _TIMEOUT_OPTIONS, BackendSpec, parse_backend_url

__all__ = [
    "SENTINEL_CHECK_INTERVAL",
    "SOCKET_CONNECT_TIMEOUT",
    "SOCKET_TIMEOUT",
    "Client",
    "client_for",
]

HEALTH_CHECK_INTERVAL = 30
#: How often (seconds) a Sentinel-managed client asks the Sentinels where the master is, even
#: with its connections open: the bound on how long it keeps using a master demoted by a failover.
SENTINEL_CHECK_INTERVAL = 1.0
#: Seconds a client of this module waits for a reply before it raises ``redis.TimeoutError``
#: (``socket_timeout=`` in the URL overrides it). Every command the package sends is one short
#: script or command, answered in a millisecond or so by a healthy server: waiting 5 s means the
#: server is not answering (stopped, partitioned, stuck in a ``BUSY`` script), not that it is
#: slow. It is also well inside the default 60 s lease, whose renewal comes every 20 s: a
#: renewal round that times out is tried again long before the lease runs out. (redis-py 8
#: chose the same default; before 8 there was none, and a silent server hung its callers.)
SOCKET_TIMEOUT = 5.0
#: Seconds a client of this module waits to open a connection (``socket_connect_timeout=``
#: overrides it): a connect, TLS handshake included, takes milliseconds on a working network;
#: an unanswered SYN (a host that vanished) would otherwise wait for the kernel's retries,
#: about two minutes on Linux.
SOCKET_CONNECT_TIMEOUT = 5.0

#: What :func:`client_for` returns: a Sentinel-managed master is a ``redis.Redis`` too.
Client = redis.Redis | RedisCluster

_clients: dict[BackendSpec, Client] = {}
_lock = fork_locks.reset_in_child()


def client_for(url_or_spec: str | BackendSpec) -> Client:
    """The shared client of a deployment: one per URL (or spec) and process.

    A ``redis.Redis`` for ``redis://``, ``rediss://`` and ``unix://``; a
    ``redis.cluster.RedisCluster`` for ``+cluster``; for ``+sentinel`` a ``redis.Redis`` whose
    pool asks the Sentinels for the current master (``Sentinel(...).master_for(...)``), so it
    follows a failover.

    Safe across fork: every redis-py pool notes the PID that made it and opens new connections
    in a child, so a client made in a Celery worker's parent serves its prefork children.

    A string is parsed (and checked) under the setting name ``semaphore_backend_url``.
    Building a cluster client connects to the cluster at once (to learn its slots); when that
    fails, the error is a ``redis.ConnectionError`` and nothing is cached, so a later call tries
    again. The other clients connect at their first command.
    """
    if isinstance(url_or_spec, BackendSpec):
        spec = url_or_spec
    else:
        spec = parse_backend_url("semaphore_backend_url", url_or_spec)
    with _lock:
        client = _clients.get(spec)
        if client is None:
            client = _clients[spec] = _build(spec)
        return client


def _timeouts(options: Mapping[str, Any]) -> dict[str, Any]:
    """The socket timeouts of a client built from ``options``: the URL's, else the defaults
    (:data:`SOCKET_TIMEOUT`, :data:`SOCKET_CONNECT_TIMEOUT`). Given explicitly, not left to
    redis-py, whose defaults are none before version 8."""
    return {
        "socket_timeout": options.get("socket_timeout", SOCKET_TIMEOUT),
        "socket_connect_timeout": options.get("socket_connect_timeout", SOCKET_CONNECT_TIMEOUT),
    }


def _sentinel_kwargs(spec: BackendSpec) -> dict[str, Any]:
    """The connection options of the Sentinels themselves.

    Timeouts: the ``sentinel_socket_*`` ones if the URL gives either, else the master's (the
    URL's ``socket_*`` or the defaults), so that one ``socket_timeout=`` bounds every wait of
    the client. Not retried: redis-py 8 retries a ``Redis`` 10 times on a timeout by default, so
    a silent Sentinel would hold up every lookup of the master (and with it the acquire or
    renewal that asked, every :data:`SENTINEL_CHECK_INTERVAL`) for 11 timeouts before the next
    Sentinel is tried; asking the next Sentinel is the retry.
    """
    own = spec.sentinel_options
    source = own if any(name in own for name in _TIMEOUT_OPTIONS) else spec.options
    return {**_timeouts(source), "retry": Retry(NoBackoff(), 0), **own}


def _build(spec: BackendSpec) -> Client:
    if spec.kind == "redis":
        if spec.url is not None:
            # the URL's own socket_* options (in spec.options too) win over these keywords
            return redis.Redis.from_url(
                spec.url, health_check_interval=HEALTH_CHECK_INTERVAL, **_timeouts(spec.options)
            )
        host, port = spec.nodes[0]
        return redis.Redis(
            host=host, port=port, db=spec.db, username=spec.username, password=spec.password, ssl=spec.tls,
            **{"health_check_interval": HEALTH_CHECK_INTERVAL, **_timeouts(spec.options), **spec.options},
        )  # fmt: skip
    if spec.kind == "cluster":
        options: dict[str, Any] = {**_timeouts(spec.options), **spec.options, **spec.cluster_options}
        if spec.tls:
            options["ssl"] = True
        try:
            return RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in spec.nodes],  # type: ignore[no-untyped-call]
                username=spec.username,
                password=spec.password,
                **options,
            )
        except RedisClusterException as error:
            # The cluster client connects as it is made, and its failure is not a RedisError:
            # re-raised as one, so callers that fail closed on RedisError catch it too.
            detail = str(error).replace(spec.password, MASK) if spec.password else str(error)
            raise redis.ConnectionError(f"Redis Cluster {spec.masked_url}: {detail}") from error
    assert spec.service_name is not None
    data_options: dict[str, Any] = {
        "health_check_interval": HEALTH_CHECK_INTERVAL,
        **_timeouts(spec.options),
        **spec.options,
    }
    if spec.tls:
        data_options["ssl"] = True
    sentinel_kwargs = _sentinel_kwargs(spec)
    sentinel = Sentinel(list(spec.nodes), sentinel_kwargs=sentinel_kwargs, **data_options)  # type: ignore[no-untyped-call,unused-ignore]
    master = sentinel.master_for(  # type: ignore[no-untyped-call,unused-ignore]
        spec.service_name,
        connection_pool_class=_RecheckedSentinelPool,
        db=spec.db,
        username=spec.username,
        password=spec.password,
    )
    return cast(redis.Redis, master)


class _RecheckedSentinelPool(SentinelConnectionPool):
    """A Sentinel pool that asks the Sentinels where the master is at least every second.

    redis-py's pool asks only when it opens a connection. After a planned failover (``SENTINEL
    FAILOVER``) the old master stays up and keeps accepting writes until a Sentinel next
    inspects it and turns it into a replica, about 10 s later, and then discards them: measured,
    a client writing all along lost every write of those ~11 s (docs/deploying.md). Asking
    again every :data:`SENTINEL_CHECK_INTERVAL` seconds, and dropping a connection that points
    elsewhere than the named master, bounds that window by the interval, for one Sentinel round
    trip per interval.
    """

    def __init__(self, service_name: str, sentinel_manager: Sentinel, **kwargs: Any) -> None:
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        self._next_check = 0.0
        self._check_lock = threading.Lock()

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        connection = super().get_connection(*args, **kwargs)
        now = time.monotonic()
        if now >= self._next_check and self._check_lock.acquire(blocking=False):
            try:
                self._next_check = now + SENTINEL_CHECK_INTERVAL
                master = self.get_master_address()  # type: ignore[no-untyped-call]
            except (redis.RedisError, OSError):
                master = None  # no answer is no news: the connection's own errors will tell
            finally:
                self._check_lock.release()
            if master is not None and connection.host is not None and (connection.host, connection.port) != master:
                connection.disconnect()  # type: ignore[no-untyped-call]  # reconnects to the named master
        return connection
