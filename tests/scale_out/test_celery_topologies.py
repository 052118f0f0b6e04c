"""The Celery layer with its semaphore on a Redis Cluster and on a Sentinel-managed master:
real workers, real topologies on loopback, the same behaviours as on a single Redis.

Each topology is started once for this module (a 3-master cluster with a replica each; a master,
a replica and 3 Sentinels), and two workers point their ``semaphore_backend_url`` at it
(``redis+cluster://`` / ``redis+sentinel://``). The failover tests fail the topology over while
tasks run and wait: every task must still finish exactly once, within the limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_semaphore import semaphore_for
from celery_semaphore._celery.config import forget_config

from ..celery.test_celery_handoff import inversions, sent_in_order, starts
from ..celery_stack import CeleryStack
from ..redis_server import RedisClusterSet, RedisSentinelSet
from ..waiting import wait_until
from ..workers import ROOT, Worker

pytestmark = pytest.mark.slow


@dataclass
class Topology:
    name: str
    servers: RedisClusterSet | RedisSentinelSet
    env: dict[str, str]
    queue: str
    workers: list[Worker]

    def send(self, task: Any, *args: Any) -> AsyncResult:
        return task.apply_async(args, queue=self.queue)

    def failover(self) -> None:
        """A planned failover (replication caught up): every grant survives it."""
        if isinstance(self.servers, RedisClusterSet):
            master = self.servers.node_for_key("{proj.handoff_faults}:x")
            self.servers.failover(master)
        else:
            self.servers.failover()


@pytest.fixture(scope="module", params=["cluster", "sentinel"])
def topology(request: pytest.FixtureRequest, celery_stack: CeleryStack) -> Iterator[Topology]:
    import tests.proj.app as proj

    servers: RedisClusterSet | RedisSentinelSet
    servers = RedisClusterSet(replicas=1) if request.param == "cluster" else RedisSentinelSet()
    servers.start()
    queue = f"topology-{request.param}"
    env = {
        **celery_stack.env,
        "PROJ_QUEUE": queue,
        "PROJ_SEMAPHORE_URL": servers.url,
        "PROJ_CONF": json.dumps({"task_acks_late": True}),
    }
    saved = proj.app.conf.semaphore_backend_url
    proj.app.conf.semaphore_backend_url = servers.url
    forget_config(proj.app)
    workers = [Worker(env, name=f"{request.param}{i}", concurrency=3) for i in (1, 2)]
    try:
        for worker in workers:
            worker.start()
        yield Topology(request.param, servers, env, queue, workers)
    finally:
        for worker in workers:
            worker.stop()
        proj.app.conf.semaphore_backend_url = saved
        forget_config(proj.app)
        servers.close()


@pytest.fixture
def proj(topology: Topology) -> Any:
    import tests.proj.app as proj

    return proj


def test_tasks_hold_the_limit_and_start_in_first_ask_order(
    topology: Topology, proj: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """12 tasks waiting outside the worker for a slot of limit 1, placed in line as they are
    sent: never two at once, each once, in the order sent, woken by hand-off through the
    topology's pub/sub. Each placed task's record and parked place are kept as it is sent (on a
    cluster one call each: its pipeline refuses EVALSHA): the sender warns of nothing."""
    key = f"topology-order-{topology.name}"
    with caplog.at_level("WARNING", logger="celery_semaphore"):
        results, asked = sent_in_order(lambda: topology.send(proj.handoff, 0.05, key), 12)
    assert not [record.getMessage() for record in caplog.records if record.name == "celery_semaphore"]
    for result in results:
        assert result.get(timeout=120) == result.id
    ids = {r.id for r in results}
    started = [task_id for task_id, _ in starts(proj, key)]
    assert sorted(started) == sorted(ids)
    assert inversions(started, asked, resolution=0.0) == []
    assert proj.probe(key).maximum == 1
    wait_until(
        lambda: semaphore_for(proj.app, "proj.handoff").status().holder_count == 0, timeout=10, what="no slot held"
    )


def test_the_cli_lists_semaphores_on_every_master(topology: Topology, proj: Any) -> None:
    """``celery semaphore status`` (and the metrics collector) find the per-host semaphores
    wherever they live: on a cluster their hash tags spread them over the masters, and every
    master is scanned."""
    hosts = [f"{topology.name}-h{i}.example" for i in range(12)]
    leases = [semaphore_for(proj.app, f"crawl:{host}").acquire(timeout=5) for host in hosts]
    try:
        if isinstance(topology.servers, RedisClusterSet):
            homes = {topology.servers.node_for_key(f"{{crawl:{host}}}:x").port for host in hosts}
            assert len(homes) >= 2, "the keys spread over several masters"
        env = {**os.environ, **topology.env, "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.proj.app",
                "semaphore",
                "status",
                "--json",
                "--match",
                f"crawl:{topology.name}-*",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        listed = {entry["key"]: entry for entry in json.loads(out.stdout)["semaphores"]}
        assert set(listed) == {f"crawl:{host}" for host in hosts}
        assert all(entry["holder_count"] == 1 for entry in listed.values())
        # the metrics collector reads the same catalogue: every holder counted, in one family
        from celery_semaphore.metrics import family_counts

        assert family_counts(proj.app)["crawl:{host}"][0] >= len(hosts)
    finally:
        for lease in leases:
            lease.release()


# After a planned Sentinel failover the old master accepts writes until a Sentinel demotes it,
# then discards them; the client leaves it within about a second (see docs/deploying.md). Grants
# and run records written there in that window are lost, so a copy of a task may run again. So
# are writes not yet replicated when the failover began: SENTINEL FAILOVER, unlike CLUSTER
# FAILOVER, does not wait for the replica to catch up.
SENTINEL_WINDOW_S = 5.0
REPLICATION_LAG_S = 1.0


def test_a_planned_failover_mid_run_loses_no_task(topology: Topology, proj: Any) -> None:
    """A failover of the semaphore's master while tasks hold and wait: the workers reconnect by
    themselves and every task finishes. On a cluster (the replica takes over only once it has
    every write) each task runs exactly once and the limit holds. On Sentinel, a task runs twice
    only if its first run was granted around the failover (not yet replicated when it began, or
    on the old master until the client left it: lost), never otherwise."""
    key = f"topology-failover-{topology.name}"
    results = [topology.send(proj.handoff_faults, 0.2, key) for _ in range(16)]
    wait_until(lambda: proj.probe(key).entries >= 3, timeout=60, what="some tasks ran")
    failover_at = time.time()
    topology.failover()
    failed_over_at = time.time()
    for result in results:
        assert result.get(timeout=180) == result.id
    runs = starts(proj, key)
    ends = [entry.split()[0].decode() for entry in proj.probe(key).client.lrange(f"probe:{key}:ends", 0, -1)]
    assert set(ends) == {r.id for r in results}, "every task finished"
    if isinstance(topology.servers, RedisClusterSet):
        assert sorted(ends) == sorted(r.id for r in results), "each exactly once"
        assert proj.probe(key).maximum == 1
    else:
        first_run: dict[str, float] = {}
        for task_id, started_at in runs:
            if task_id in first_run:
                assert failover_at - REPLICATION_LAG_S <= first_run[task_id] <= failed_over_at + SENTINEL_WINDOW_S, (
                    "ran twice, yet its first grant was not made in the failover window"
                )
            first_run.setdefault(task_id, started_at)
