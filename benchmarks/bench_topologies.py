"""Acquires/s on one Redis node and on a 3-master Redis Cluster, in the same run.

Run as ``python -m benchmarks.bench_topologies`` (``--help`` for the flags). The script starts,
on free loopback ports and from the same redis-server binary, one plain Redis and a 3-master
cluster (no replicas), then measures uncontended ``acquire(timeout=0)`` + ``Lease.release()``
loops from ``--processes`` client processes, each cycling over the same ``--keys`` semaphores
(limit never reached, so nothing waits). The cluster's semaphores spread over its masters by
their hash tags (the key placement of every semaphore). Each repeat measures the node and then
the cluster for ``--seconds`` each, so noise on a shared host hits both alike; the table gives
acquires/s per topology and the cluster / node ratio, median with min - max over the repeats.

One acquire + release is two EVALSHA round trips on either topology; what differs is the
client (redis-py's cluster client routes each call by slot) and the servers (three processes
share the machine's cores with the clients).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import redis
import redis.cluster

from celery_semaphore import FairSemaphore
from tests.redis_server import RedisClusterSet, RedisServer, any_binary, binary_version

# Long enough that no lease is renewed nor expires within one measurement.
LEASE_S = 60.0


def _client(topology: str, ports: list[int]) -> Any:
    if topology == "node":
        return redis.Redis(host="127.0.0.1", port=ports[0])
    nodes = [redis.cluster.ClusterNode("127.0.0.1", port) for port in ports]  # type: ignore[no-untyped-call]
    return redis.cluster.RedisCluster(startup_nodes=nodes)


def _client_process(topology: str, ports: list[int], keys: int, seconds: float, barrier: Any, results: Any) -> None:
    client = _client(topology, ports)
    semaphores = [FairSemaphore(client, f"bench-{index}", 1000, lease=LEASE_S) for index in range(keys)]
    for semaphore in semaphores:  # scripts loaded, connections to every master open
        semaphore.acquire(timeout=0).release()
    barrier.wait(timeout=120)
    cycles = 0
    started = time.perf_counter()
    deadline = started + seconds
    while True:
        for semaphore in semaphores:
            semaphore.acquire(timeout=0).release()
        cycles += len(semaphores)
        if time.perf_counter() >= deadline:
            break
    results.put((cycles, time.perf_counter() - started))
    client.close()


def measure(topology: str, ports: list[int], processes: int, keys: int, seconds: float) -> float:
    """Acquires/s (each with its release) of ``processes`` client processes together."""
    ctx: Any = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    barrier = ctx.Barrier(processes)
    results = ctx.Queue()
    workers = [
        ctx.Process(target=_client_process, args=(topology, ports, keys, seconds, barrier, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    outcomes = [results.get(timeout=seconds + 180) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    return sum(cycles / elapsed for cycles, elapsed in outcomes)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f} - {max(values):,.0f})"


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--keys", type=int, default=100, help="semaphores cycled over (default 100)")
    parser.add_argument("--seconds", type=float, default=3.0, help="per topology per repeat (default 3)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats (default 5)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)

    binary = any_binary()
    node = RedisServer(binary).start()
    cluster = RedisClusterSet(masters=3, replicas=0, binary=binary).start()
    try:
        node_ports = [node.port]
        cluster_ports = [server.port for server in cluster.nodes]
        with cluster.client() as probe:
            owners = {
                probe.get_node_from_key(f"semaphore:{{bench-{index}}}:holders").name for index in range(args.keys)
            }
        rows: dict[str, list[float]] = {"node": [], "cluster": [], "ratio": []}
        for repeat in range(args.repeats):
            on_node = measure("node", node_ports, args.processes, args.keys, args.seconds)
            on_cluster = measure("cluster", cluster_ports, args.processes, args.keys, args.seconds)
            rows["node"].append(on_node)
            rows["cluster"].append(on_cluster)
            rows["ratio"].append(on_cluster / on_node)
            print(
                f"repeat {repeat + 1}/{args.repeats}: node {on_node:,.0f}/s, cluster {on_cluster:,.0f}/s, "
                f"ratio {on_cluster / on_node:.2f}",
                file=sys.stderr,
            )
        print(
            f"celery-semaphore {_commit()}, Redis {binary_version(binary)}, redis-py {redis.__version__}, "
            f"Python {platform.python_version()}, {os.cpu_count()} CPUs"
        )
        print(
            f"{args.processes} client processes, {args.keys} semaphores (on {len(owners)} cluster masters), "
            f"{args.seconds:g} s per topology x {args.repeats} interleaved repeats; median (min - max)"
        )
        print()
        print("| topology              | acquires/s (with release)  |")
        print("|-----------------------|----------------------------|")
        print(f"| one node              | {_spread(rows['node']):<26} |")
        print(f"| cluster, 3 masters    | {_spread(rows['cluster']):<26} |")
        ratios = rows["ratio"]
        ratio = f"{statistics.median(ratios):.2f} ({min(ratios):.2f} - {max(ratios):.2f})"
        print(f"| cluster / node        | {ratio:<26} |")
        if args.json:
            print(json.dumps({"processes": args.processes, "keys": args.keys, "seconds": args.seconds, **rows}))
    finally:
        cluster.close()
        node.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
