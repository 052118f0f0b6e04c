"""The due times of the copies stored in the broker's Redis, split into buckets
(``due_copies.DUE_BUCKETS``, lua/_due_buckets.lua): each bucket compact, named alike by Python and
the scripts, moved from a batch at a time through its index, and the one sorted set the release
before kept still moved from and withdrawn from."""

from __future__ import annotations

from celery_semaphore._celery.due_copies import COPIES_KEY, DUE_BUCKETS, DUE_KEY, due_keys_of, send_copy, withdraw

from ..commandstats import NOT_SCRIPTED, command_calls
from ..parked import stored_due
from ..waiting import wait_until
from .test_due_copies import WAKE_LIST, Setup, _copy, servers, setup  # noqa: F401 (fixtures)

INDEX_KEY = f"{DUE_KEY}-buckets"


def test_each_due_time_is_in_the_bucket_python_names_and_the_buckets_stay_compact(setup: Setup) -> None:  # noqa: F811
    """3,000 copies stored (about 3 a bucket): each due time sits in the bucket ``due_keys_of``
    names (withdraw and a grant find it there), every bucket keeps Redis's compact encoding,
    and a due time costs at most 110 B of the buckets (MEMORY USAGE, every element counted;
    about 150 B in one large sorted set)."""
    app, client = setup.app, setup.client
    runs = [f"{i:08d}-aaaa-bbbb-cccc-dddddddddddd#0#0123456789abcdef" for i in range(3_000)]
    for run in runs:
        send_copy(app, _copy(app, run, 600))
    for run in runs[:50]:
        assert client.zscore(due_keys_of(DUE_KEY, run)[0], run) is not None, run
    names = [f"{DUE_KEY}:{bucket}" for bucket in range(DUE_BUCKETS)]
    assert sum(client.zcard(name) for name in names) == len(runs)
    assert {client.object("encoding", name) for name in names if client.exists(name)} <= {b"listpack", b"ziplist"}
    used = sum(int(client.memory_usage(name, samples=0) or 0) for name in names)
    assert used / len(runs) <= 110, used / len(runs)
    assert client.zcard(INDEX_KEY) == len({due_keys_of(DUE_KEY, run)[0] for run in runs})
    withdraw(app, runs[0])
    assert setup.store.granted(runs[1], withdraw=True) is False
    assert runs[0].encode() not in stored_due(client) and runs[1].encode() not in stored_due(client)
    assert not client.hexists(COPIES_KEY, runs[0])


def test_copies_due_in_many_buckets_are_moved_a_batch_at_a_time(setup: Setup) -> None:  # noqa: F811
    """250 copies due at once, in some 200 buckets: a move takes 100, the next 100, the next 50,
    each once; then no bucket is left in the index, and the next due time reported is the copy
    still due later."""
    app, client, store = setup.app, setup.client, setup.store
    for i in range(250):
        send_copy(app, _copy(app, f"run-{i}", 0.05))
    send_copy(app, _copy(app, "run-later", 600))
    due_by = max(at for run, at in stored_due(client).items() if run != b"run-later")

    def server_ms() -> float:
        seconds, micros = client.time()
        return seconds * 1000 + micros / 1000

    wait_until(lambda: server_ms() > due_by, timeout=5, what="the 250 due by the server's clock")
    moved = [store.run(["celery"]).moved for _ in range(4)]
    assert moved == [100, 100, 50, 0]
    assert client.llen(WAKE_LIST) == 250
    assert list(stored_due(client)) == [b"run-later"]
    (bucket,) = client.zrange(INDEX_KEY, 0, -1)
    assert f"{DUE_KEY}:{bucket.decode()}" == due_keys_of(DUE_KEY, "run-later")[0]
    next_due = store.run(["celery"]).next_due_in
    assert next_due is not None and 590 < next_due <= 600


def test_a_copy_the_release_before_stored_unsplit_is_moved_withdrawn_or_replaced(setup: Setup) -> None:  # noqa: F811
    """A rolling deploy from the release that kept every due time in one sorted set: its copy
    due there is moved when due; one withdrawn goes from there; and one stored anew by this
    release leaves that set, so it is moved once, when the newer copy is due."""
    app, client, store = setup.app, setup.client, setup.store
    for run in ("run-old-due", "run-old-withdrawn", "run-old-replaced"):
        send_copy(app, _copy(app, run, 600))
    now_ms = int(client.time()[0]) * 1000
    for run, due_at in (
        ("run-old-due", now_ms - 1),
        ("run-old-withdrawn", now_ms + 600_000),
        ("run-old-replaced", now_ms - 1),
    ):
        # as the release before kept them: in the one sorted set, not in a bucket
        client.zrem(due_keys_of(DUE_KEY, run)[0], run)
        client.zadd(DUE_KEY, {run: due_at})
    withdraw(app, "run-old-withdrawn")
    assert client.zscore(DUE_KEY, "run-old-withdrawn") is None
    send_copy(app, _copy(app, "run-old-replaced", 600))  # stored anew: due in ten minutes
    assert client.zscore(DUE_KEY, "run-old-replaced") is None
    assert store.run(["celery"]).moved == 1
    assert [message for message in client.lrange(WAKE_LIST, 0, -1) if b"run-old-due" in message]
    assert client.zcard(DUE_KEY) == 0
    assert sorted(stored_due(client)) == [b"run-old-replaced"]


def test_a_move_with_nothing_due_costs_the_same_however_many_copies_wait(setup: Setup) -> None:  # noqa: F811
    """Every worker's mover runs at least once a second: with nothing due, a run reads the index
    of the buckets, never a bucket, so 3,000 copies waiting cost it what 3 do (INFO commandstats:
    the script's own commands, both stores' runs)."""
    app, client, store = setup.app, setup.client, setup.store

    def idle_run_calls() -> dict[str, int]:
        store.run(["celery"])  # loads the scripts
        client.config_resetstat()
        assert store.run(["celery"]).moved == 0
        return {name: n for name, n in command_calls(client).items() if name not in NOT_SCRIPTED}

    for i in range(3):
        send_copy(app, _copy(app, f"few-{i}", 600))
    few = idle_run_calls()
    for i in range(3_000):
        send_copy(app, _copy(app, f"many-{i}", 600))
    assert idle_run_calls() == few
    # each store's run (this one's and the earlier release's): TIME; the moved copies kept too
    # long; the finished runs; the index of the buckets and the release before's set; the first
    # due time of each of the two; and in this store's, one RPOP per backstop list (kombu's four
    # priority lists of the queue) and the stencils to forget
    assert few == {"time": 2, "zrangebyscore": 7, "zrange": 4, "zremrangebyscore": 2, "rpop": 4}, few
