"""Tasks with several semaphore keys and with weights, on real `celery worker` processes (prefork)
and a Redis broker: every limit holds, nobody deadlocks, heavy tasks keep their turn, and a
killed worker's slots all come back."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_semaphore import ConfigurationError, FairSemaphore, semaphore_for
from celery_semaphore._celery.catalogue import Catalogue, semaphore_for_call
from celery_semaphore._core.clients import client_for
from celery_semaphore._core.multi import MultiSemaphore

from ..celery_stack import CeleryStack
from ..waiting import wait_until
from ..workers import Worker

# real `celery worker` processes: `pytest -m "not workers"` leaves these out
pytestmark = pytest.mark.workers

QUEUE = "multi"


@pytest.fixture(scope="module")
def workers(celery_stack: CeleryStack) -> Iterator[list[Worker]]:
    env = {**celery_stack.env, "PROJ_QUEUE": QUEUE}
    group = [Worker(env, name=f"m{i}", concurrency=4) for i in (1, 2)]
    for worker in group:
        worker.start()
    yield group
    for worker in group:
        worker.stop()


@pytest.fixture
def proj(celery_stack: CeleryStack, workers: list[Worker]) -> Any:
    import tests.proj.app as proj

    return proj


def send(task: Any, *args: Any, **kwargs: Any) -> AsyncResult:
    return task.apply_async(args, kwargs or None, queue=QUEUE)


def holders(proj: Any, key: str) -> int:
    return FairSemaphore(client_for(proj.app.conf.semaphore_backend_url), key, 1).status().holder_count


def test_a_call_of_a_task_with_a_key_list_gets_one_semaphore_per_key(celery_stack: CeleryStack) -> None:
    """Each key of the list resolves its own limit: "crawl:*" from semaphore_limits (2), the
    total from the task's own semaphore_limit (3); the metrics family of each key is its template."""
    import tests.proj.app as proj

    semaphore = semaphore_for_call(proj.app.tasks["proj.crawl_multi"], ("h",), {"seconds": 0})
    assert isinstance(semaphore, MultiSemaphore)
    assert [(s.name, s.limit) for s in semaphore.semaphores] == [("crawl:h", 2), ("crawl-all", 3)]
    catalogue = Catalogue(proj.app)
    assert catalogue.family_for("crawl-all") == "crawl-all"
    weighted = semaphore_for_call(proj.app.tasks["proj.gpu"], (3, 0.1), {})
    assert isinstance(weighted, MultiSemaphore) and weighted.weight == 3
    with pytest.raises(ConfigurationError, match="above the limit 4"):
        semaphore_for_call(proj.app.tasks["proj.gpu"], (5, 0.1), {})


def test_per_host_and_total_limits_hold_together(proj: Any) -> None:
    """18 crawls over 3 hosts, at most 2 per host and 3 in all: neither peak passes its limit,
    the total is reached, every task runs once, and no slot is left."""
    hosts = ["mh1", "mh2", "mh3"]
    results = [send(proj.crawl_multi, hosts[i % 3], 0.3) for i in range(18)]
    assert sorted(r.get(timeout=120) for r in results) == sorted(hosts[i % 3] for i in range(18))
    assert proj.probe("crawl-all").maximum == 3
    for host in hosts:
        assert 1 <= proj.probe(f"crawl:{host}").maximum <= 2
    assert sum(proj.probe(f"crawl:{host}").entries for host in hosts) == 18
    wait_until(
        lambda: all(holders(proj, key) == 0 for key in ["crawl-all", *(f"crawl:{h}" for h in hosts)]),
        timeout=10,
        what="every slot released",
    )


def test_opposite_key_orders_under_load_all_finish_never_two_at_once(proj: Any) -> None:
    """Tasks listing the same two keys (limit 1) in opposite orders, 30 of them at once: all
    finish, and never two run together."""
    results = [send(proj.pair_xy if i % 2 else proj.pair_yx, 0.05) for i in range(30)]
    assert sorted(r.get(timeout=120) for r in results) == sorted("xy" if i % 2 else "yx" for i in range(30))
    assert proj.probe("pair").maximum == 1
    assert proj.probe("pair").entries == 30


def _starts(proj: Any, key: str) -> list[tuple[str, int]]:
    entries = proj.probe(key).client.lrange(f"probe:{key}:starts", 0, -1)
    return [(task_id.decode(), int(gpus)) for task_id, _, gpus in (entry.split() for entry in entries)]


def test_weights_in_flight_never_pass_the_limit(proj: Any) -> None:
    """GPU tasks of weight 1 to 3 on 4 GPUs: the GPUs in use never pass 4, and 4 are used."""
    key = "gpu-mix"
    weights = [3, 1, 2, 1, 1, 3, 2, 1, 1, 2, 3, 1]
    results = [send(proj.gpu, w, 0.2, key=key) for w in weights]
    for result in results:
        result.get(timeout=120)
    assert proj.probe(key).maximum == 4
    assert sorted(w for _, w in _starts(proj, key)) == sorted(weights)
    wait_until(lambda: holders(proj, "gpu") == 0, timeout=10, what="every GPU released")


def test_a_heavy_task_sent_before_light_ones_starts_before_them(proj: Any) -> None:
    """With all 4 GPUs taken, a weight-3 task is sent, then three weight-1 tasks: as the GPUs
    free one by one, the light ones do not pass it; it starts first."""
    key = "gpu-order"
    semaphore = semaphore_for(proj.app, "gpu")
    blocker = send(proj.gpu, 4, 1.5, key=key)
    wait_until(lambda: semaphore.status().holder_count == 4, timeout=30, what="the blocker to hold 4")
    heavy = send(proj.gpu, 3, 0.3, key=key)
    wait_until(lambda: semaphore.status().waiter_count == 1, timeout=30, what="the heavy task in line")
    lights = []
    for n in range(3):
        lights.append(send(proj.gpu, 1, 0.1, key=key))
        wait_until(lambda n=n: semaphore.status().waiter_count == n + 2, timeout=30, what="a light task in line")
    for result in [blocker, heavy, *lights]:
        result.get(timeout=120)
    order = [task_id for task_id, _ in _starts(proj, key)]
    assert order[:2] == [blocker.id, heavy.id], order


def test_a_sigkilled_workers_multi_key_slots_all_come_back(celery_stack: CeleryStack) -> None:
    """A worker SIGKILLed while a task holds 2 slots of one key and... (weight 2 on "gpu"), and a
    crawl holds a slot of its host and of the total: every slot comes back within the 2 s lease."""
    import tests.proj.app as proj

    env = {**celery_stack.env, "PROJ_QUEUE": "multi-crash"}
    victim = Worker(env, name="multi-victim", concurrency=2, conf={"semaphore_lease": 2}).start()
    try:
        proj.gpu.apply_async((2, 30), {"key": "gpu-crash"}, queue="multi-crash")
        proj.crawl_multi.apply_async(("mkill", 30), queue="multi-crash")
        wait_until(
            lambda: holders(proj, "gpu") == 2 and holders(proj, "crawl:mkill") == 1 and holders(proj, "crawl-all") == 1,
            timeout=30,
            what="both tasks to hold their slots",
        )
        victim.kill()
        killed_at = time.monotonic()
        wait_until(
            lambda: holders(proj, "gpu") + holders(proj, "crawl:mkill") + holders(proj, "crawl-all") == 0,
            timeout=10,
            what="every slot to come back",
        )
        assert time.monotonic() - killed_at < 2 + 1.5
    finally:
        victim.kill()


def test_the_worker_refuses_a_task_whose_key_has_no_limit() -> None:
    """A task with a key list where one key has no limit anywhere fails the start check, naming
    the key; a weight above a configured limit fails it too."""
    from celery import Celery

    from celery_semaphore import SemaphoreTask
    from celery_semaphore._celery.config import config_for, forget_config
    from celery_semaphore._celery.worker import check_limits

    def check_app(app: Any) -> None:
        forget_config(app)
        for task in [app.tasks[name] for name in ("t.api", "t.heavy") if name in app.tasks]:
            check_limits(task, config_for(app))

    app = Celery("multi-check", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.semaphore_backend_url = "redis://127.0.0.1:1/1"
    app.conf.semaphore_limits = {"tenant:*": 2}

    @app.task(base=SemaphoreTask, semaphore_key=["tenant:{tenant}", "api-global"], name="t.api", shared=False)
    def api(tenant: str) -> None: ...

    with pytest.raises(ConfigurationError, match="'api-global'"):
        check_app(app)
    app.conf.semaphore_limits = {"tenant:*": 2, "api-global": 10}
    check_app(app)

    @app.task(base=SemaphoreTask, semaphore_key="tenant:{tenant}", semaphore_weight=3, name="t.heavy", shared=False)
    def heavy(tenant: str) -> None: ...

    with pytest.raises(ConfigurationError, match="above the limit 2"):
        check_app(app)


def test_a_weight_above_the_tasks_own_limit_is_refused_at_declaration() -> None:
    """semaphore_weight=5 with semaphore_limit=4 fails when the task is declared."""
    from celery import Celery

    from celery_semaphore import limit_concurrency

    app = Celery("multi-decl", broker="redis://127.0.0.1:1/0", set_as_current=False)

    def too_heavy() -> None: ...

    decorate = limit_concurrency(
        4, key="gpu", app=app, semaphore_weight=5, name="t.too_heavy", shared=False, lazy=False
    )
    with pytest.raises(ConfigurationError, match="above the task's semaphore_limit 4"):
        decorate(too_heavy)


def test_status_and_metrics_show_each_limit_of_a_multi_key_task_and_the_weights_held(
    redis_server: Any,
) -> None:
    """`celery semaphore status` lists each key of a multi-key task with its own limit and
    source, a weighted holder shows its slots, and the metrics count slots per key template."""
    from celery.bin.celery import celery
    from click.testing import CliRunner

    from celery_semaphore._celery.config import forget_config
    from celery_semaphore.metrics import family_counts
    from tests.proj.app import app

    url = f"redis://127.0.0.1:{redis_server.port}/1"
    client = redis_server.client(db=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(app.conf, "semaphore_backend_url", url)
        patch.setitem(app.conf, "semaphore_limits", {"crawl:*": 2})
        forget_config(app)
        sems = [FairSemaphore(client, "crawl:st.example", 2), FairSemaphore(client, "crawl-all", 3)]
        with MultiSemaphore(sems, weight=2).acquire(timeout=5, label="box:1 proj.crawl_multi[t-1]"):
            listing = CliRunner().invoke(celery, ["-A", "tests.proj.app", "semaphore", "status", "--json"])
            detail = CliRunner().invoke(celery, ["-A", "tests.proj.app", "semaphore", "status", "crawl-all"])
            counts = family_counts(app)
        forget_config(app)
    client.close()
    assert listing.exit_code == 0, listing.output
    rows = {row["key"]: row for row in json.loads(listing.stdout)["semaphores"]}
    assert (rows["crawl:st.example"]["limit"], rows["crawl:st.example"]["source"]) == (2, "semaphore_limits['crawl:*']")
    assert (rows["crawl-all"]["limit"], rows["crawl-all"]["source"]) == (3, "proj.crawl_multi.semaphore_limit")
    assert rows["crawl-all"]["holder_count"] == rows["crawl:st.example"]["holder_count"] == 2
    assert (rows["crawl-all"]["family"], rows["crawl:st.example"]["family"]) == ("crawl-all", "crawl:{host}")
    assert detail.exit_code == 0, detail.output
    assert "holders    2 of 3 slots" in detail.stdout
    holder_row = next(line for line in detail.stdout.splitlines() if "proj.crawl_multi[t-1]" in line)
    assert holder_row.split()[2] == "2"  # LABEL (two words), SLOTS
    assert counts["crawl-all"][0] == 2
    assert counts["crawl:{host}"][0] >= 2


@pytest.mark.slow
def test_multi_key_tasks_on_a_redis_cluster_with_the_apps_hash_tag(celery_stack: CeleryStack) -> None:
    """On a 3-master cluster, semaphore_hash_tag puts every semaphore of the app in one slot:
    tasks listing two keys in opposite orders all run, never two at once, and status finds the
    tagged keys; without the tag a multi-key call is refused with a clear error."""
    import tests.proj.app as proj
    from celery_semaphore._celery.config import forget_config
    from celery_semaphore.testing import RedisClusterSet

    cluster = RedisClusterSet().start()
    saved = dict(proj.app.conf.items())
    queue = "multi-cluster"
    env = {
        **celery_stack.env,
        "PROJ_QUEUE": queue,
        "PROJ_SEMAPHORE_URL": cluster.url,
        "PROJ_CONF": json.dumps({"semaphore_hash_tag": "proj"}),
    }
    worker = Worker(env, name="multi-cluster", concurrency=4)
    try:
        proj.app.conf.semaphore_backend_url = cluster.url
        forget_config(proj.app)
        with pytest.raises(ConfigurationError, match="semaphore_hash_tag"):
            semaphore_for_call(proj.app.tasks["proj.pair_xy"], (0.1,), {})
        proj.app.conf.semaphore_hash_tag = "proj"
        forget_config(proj.app)
        worker.start()
        before = proj.probe("pair").entries
        results = [(proj.pair_xy if i % 2 else proj.pair_yx).apply_async((0.05,), queue=queue) for i in range(16)]
        assert sorted(r.get(timeout=120) for r in results) == sorted("xy" if i % 2 else "yx" for i in range(16))
        assert proj.probe("pair").maximum == 1
        assert proj.probe("pair").entries == before + 16
        held = semaphore_for(proj.app, "pair-x").acquire(timeout=5)
        assert "pair-x" in Catalogue(proj.app).scan()
        held.release()
    finally:
        worker.stop()
        proj.app.conf.semaphore_backend_url = saved["semaphore_backend_url"]
        proj.app.conf.semaphore_hash_tag = None
        forget_config(proj.app)
        cluster.close()


def test_eager_multi_key_weighted_tasks_hold_every_limit(redis_server: Any) -> None:
    """Eager calls of a task with two keys and a weight, from 6 threads: weights in flight never
    pass either limit, every call runs, and nothing is left in Redis."""
    from concurrent.futures import ThreadPoolExecutor

    from celery import Celery

    from celery_semaphore import limit_concurrency

    from ..concurrency_probe import ConcurrencyProbe

    app = Celery("eager-multi", broker=redis_server.url, set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        task_eager_propagates=True,
        semaphore_backend_url=redis_server.url,
        semaphore_limits={"team:*": 2, "all": 3},
    )
    probe = ConcurrencyProbe(redis_server.client(db=1))

    @limit_concurrency(
        key=["team:{team}", "all"], app=app, lazy=False, shared=False, semaphore_weight=lambda args, kwargs: args[1]
    )
    def work(team: str, weight: int) -> int:
        for _ in range(weight):
            probe.enter()
        try:
            time.sleep(0.03)
        finally:
            for _ in range(weight):
                probe.leave()
        return weight

    calls = [("a", 1), ("b", 2), ("a", 2), ("b", 1), ("a", 1), ("b", 1)] * 2
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda c: work.delay(*c).get(disable_sync_subtasks=False), calls))
    assert results == [w for _, w in calls]
    assert probe.maximum == 3
    assert redis_server.client().keys("*") == []


def test_a_parked_weighted_task_is_brought_back_by_the_release_not_its_countdown(proj: Any) -> None:
    """A weight-2 task refused while 4 GPUs are held waits outside the worker (countdown 5 s);
    the release brings it back at once: it starts well before its countdown would."""
    key = "gpu-handoff"
    semaphore = semaphore_for(proj.app, "gpu")
    blocker = send(proj.gpu, 4, 1.0, key=key)
    wait_until(lambda: semaphore.status().holder_count == 4, timeout=30, what="the blocker to hold 4")
    waiting = send(proj.gpu, 2, 0.1, key=key)
    wait_until(lambda: semaphore.status().waiter_count == 1, timeout=30, what="the task in line")
    blocker.get(timeout=60)
    ended = float(proj.probe(key).client.lrange(f"probe:{key}:starts", 0, 0)[0].split()[1]) + 1.0
    waiting.get(timeout=60)
    started = float(proj.probe(key).client.lrange(f"probe:{key}:starts", 1, 1)[0].split()[1])
    assert started - ended < 2.5, f"started {started - ended:.2f} s after the release"
