"""On the Redis broker, a waiting task's due-later copies wait in the broker's Redis
(``_celery/due_copies.py``): stowed at once, moved to the wake queue when due by any process,
withdrawn when their run no longer needs them, all due at once when the semaphore's Redis
came back empty. Real Redis servers, real kombu publishing; no workers (the worker tests cover
the tasks' side)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery

from celery_semaphore._celery.config import forget_config
from celery_semaphore._celery.due_copies import (
    COPIES_KEY,
    FINISHED_KEY,
    MOVED_KEY,
    SENT_KEY,
    DueCopies,
    due_copies_for,
    send_copy,
    withdraw,
)
from celery_semaphore._celery.wait_headers import (
    COPY_ID_HEADER,
    DUE_IN_HEADER,
    MESSAGE_HEADER,
    QUEUE_HEADER,
    SENT_HEADER,
)
from celery_semaphore._celery.wake_queues import wake_aware, wake_queue
from tests.parked import stored_due
from tests.redis_server import RedisServer
from tests.waiting import wait_until

BACKSTOP_LIST = "celery.semaphore-backstop"
WAKE_LIST = "celery.semaphore-wake"


def untagged(message: bytes | str) -> dict[str, Any]:
    """A message as JSON, its delivery tag left out: each send of a copy makes its own."""
    fields: dict[str, Any] = json.loads(message)
    fields["properties"].pop("delivery_tag", None)
    return fields


@pytest.fixture
def servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    broker, semaphore = RedisServer().start(), RedisServer().start()
    yield broker, semaphore
    for server in (broker, semaphore):
        server.__exit__()


@dataclass
class Setup:
    app: Any
    client: Any  # the broker's Redis
    store: DueCopies


@pytest.fixture
def setup(servers: tuple[RedisServer, RedisServer]) -> Setup:
    app = _app(*servers)
    store = due_copies_for(app)
    assert isinstance(store, DueCopies)
    return Setup(app, servers[0].client(), store)


def _app(broker: RedisServer, semaphore: RedisServer) -> Any:
    app = Celery("due_copies_test", broker=broker.url, set_as_current=False)
    app.conf.semaphore_backend_url = semaphore.url
    forget_config(app)
    wake_aware(app)
    return app


def _copy(app: Any, run: str, due_in: float) -> Any:
    return app.signature(
        "due_copies_test.work",
        args=(run,),
        queue=BACKSTOP_LIST,
        headers={DUE_IN_HEADER: due_in, COPY_ID_HEADER: run, QUEUE_HEADER: "celery"},
    )


def test_a_copy_is_stowed_at_once_and_moved_to_the_wake_queue_when_due(setup: Setup) -> None:
    app, client, store = setup.app, setup.client, setup.store
    send_copy(app, _copy(app, "run-a", 0.5))
    # kept in the broker's Redis, in no list a worker reads, and not a countdown (no eta)
    assert client.llen(BACKSTOP_LIST) == 0
    assert client.llen(WAKE_LIST) == 0
    assert len(stored_due(client)) == 1
    stored = client.hget(COPIES_KEY, "run-a")
    assert stored is not None and stored.startswith(WAKE_LIST.encode() + b"\n")
    assert store.run(["celery"]).moved == 0  # not due yet
    started = time.monotonic()
    wait_until(lambda: store.run(["celery"]).moved or client.llen(WAKE_LIST), timeout=5, what="moved when due")
    assert time.monotonic() - started >= 0.3
    (message,) = client.lrange(WAKE_LIST, 0, -1)
    payload = json.loads(message)
    # routed as a message of the wake queue, so the worker takes it for a wake copy
    assert payload["properties"]["delivery_info"]["routing_key"] == WAKE_LIST
    assert payload["headers"]["eta"] is None
    assert payload["headers"]["argsrepr"] == "('run-a',)"
    assert len(stored_due(client)) == 0 and client.hlen(COPIES_KEY) == 0


def test_a_copy_an_earlier_release_sent_is_stowed_under_its_run_all_the_same(setup: Setup) -> None:
    """During a rolling deploy this release stows the copies an earlier one sent, which name
    their due time and run under the old header names (semaphore_due_in, semaphore_backstop)."""
    app, client = setup.app, setup.client
    old = {"semaphore_due_in": 60, "semaphore_backstop": "run-old", "semaphore_queue": "celery"}
    send_copy(app, app.signature("due_copies_test.work", args=("run-old",), queue=BACKSTOP_LIST, headers=old))
    assert sorted(stored_due(client)) == [b"run-old"]
    due_in_ms = float(stored_due(client).get(b"run-old") or 0) - client.time()[0] * 1000
    assert 50_000 < due_in_ms <= 61_000


def test_a_newer_copy_of_a_run_replaces_the_older_and_withdraw_forgets_it(setup: Setup) -> None:
    app, client, store = setup.app, setup.client, setup.store
    send_copy(app, _copy(app, "run-b", 60))
    send_copy(app, _copy(app, "run-b", 120))
    send_copy(app, _copy(app, "run-c", 60))
    assert len(stored_due(client)) == 2
    withdraw(app, "run-b")
    assert sorted(stored_due(client)) == [b"run-c"]
    assert client.hkeys(COPIES_KEY) == [b"run-c"]
    assert not store.granted("run-c", withdraw=True)  # granted without acks_late: withdrawn too
    assert len(stored_due(client)) == 0 and client.hlen(COPIES_KEY) == 0


def test_every_stored_copy_is_due_at_once_when_the_semaphore_redis_comes_back_empty(setup: Setup) -> None:
    app, client, store = setup.app, setup.client, setup.store
    for run in ("run-1", "run-2", "run-3"):
        send_copy(app, _copy(app, run, 600))
    first = store.run(["celery"], epoch="epoch-1")
    assert (first.moved, first.flushed) == (0, False)  # the first epoch seen: nothing to compare
    assert store.run(["celery"], epoch="epoch-1").moved == 0
    again = store.run(["celery"], epoch="epoch-2")  # another epoch: the Redis came back empty
    assert again.flushed and again.moved == 3
    assert client.llen(WAKE_LIST) == 3


def test_a_sender_killed_before_it_stowed_its_copy_loses_nothing(servers: tuple[RedisServer, RedisServer]) -> None:
    """The publish leaves the copy in the backstop list (in the broker): a process SIGKILLed
    right after it, before its stow, leaves it there, and the next run anywhere stows it."""
    broker, semaphore = servers
    code = f"""
import os, signal
from celery import Celery
from celery_semaphore._celery.wake_queues import wake_aware
app = Celery("due_copies_test", broker={broker.url!r}, set_as_current=False)
app.conf.semaphore_backend_url = {semaphore.url!r}
wake_aware(app)
app.signature("due_copies_test.work", args=("run-k",), queue={BACKSTOP_LIST!r},
              headers={{{DUE_IN_HEADER!r}: 0.2, {COPY_ID_HEADER!r}: "run-k"}}).apply_async()
os.kill(os.getpid(), signal.SIGKILL)
"""
    finished = subprocess.run([sys.executable, "-c", code], timeout=60, env=dict(os.environ))
    assert finished.returncode == -signal.SIGKILL
    client = broker.client()
    assert client.llen(BACKSTOP_LIST) == 1  # in the broker, not lost with the process
    store = due_copies_for(_app(broker, semaphore))
    assert store is not None
    assert store.run(["celery"]).stowed == 1
    wait_until(lambda: store.run(["celery"]).moved, timeout=5, what="the orphaned copy moved when due")
    assert client.llen(WAKE_LIST) == 1


@pytest.mark.parametrize("packed", [False, True], ids=["whole", "packed"])
@pytest.mark.parametrize("killed", [False, True], ids=["two-racing", "one-sigkilled-mid-drain"])
def test_the_move_is_atomic_whoever_runs_it(
    servers: tuple[RedisServer, RedisServer], killed: bool, packed: bool
) -> None:
    """Two processes moving at once never move a copy twice or drop one; nor does a mover
    SIGKILLed in the middle of a drain (each script runs whole in Redis, whatever becomes of its
    caller): 200 copies due now, stowed (whole, from the backstop list, or packed by their
    sender) and moved one script at a time, arrive exactly once each after another process
    finishes the drain."""
    from celery_semaphore._celery.packing import pack

    broker, semaphore = servers
    app = _app(broker, semaphore)
    client = broker.client()
    store = due_copies_for(app)
    assert store is not None
    for index in range(200):
        message = {
            "body": "",
            "headers": {COPY_ID_HEADER: f"run-{index}", DUE_IN_HEADER: 0},
            "properties": {"delivery_info": {"exchange": "", "routing_key": BACKSTOP_LIST}},
        }
        packing = pack(message) if packed else None
        if packing is None:
            client.lpush(BACKSTOP_LIST, json.dumps(message))
        else:  # due in a moment: one due now would be moved by its stow
            store.stow(WAKE_LIST, f"run-{index}", 0.05, packing)
    if packed:
        wait_until(
            lambda: (
                sum(at <= client.time()[0] * 1000 + client.time()[1] // 1000 for at in stored_due(client).values())
                == 200
            ),
            timeout=5,
            what="every packed copy due",
        )
    code = f"""
from celery import Celery
from celery_semaphore._celery.due_copies import due_copies_for
app = Celery("due_copies_test", broker={broker.url!r}, set_as_current=False)
app.conf.semaphore_backend_url = {semaphore.url!r}
store = due_copies_for(app)
import time
for _ in range({400 if killed else 50}):
    store.run(["celery"], most={1 if killed else 7})
    time.sleep({0.005 if killed else 0})  # paced, so that the kill lands mid-drain
"""
    movers = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(1 if killed else 2)]
    if killed:
        wait_until(lambda: client.llen(WAKE_LIST) >= 50, timeout=60, what="the drain under way")
        movers[0].send_signal(signal.SIGKILL)
        assert movers[0].wait(timeout=60) == -signal.SIGKILL
        assert client.llen(WAKE_LIST) < 200, "killed before the end of its drain"
    else:
        for mover in movers:
            assert mover.wait(timeout=60) == 0
    while store.run(["celery"]).moved:
        pass
    moved = [json.loads(message)["headers"][COPY_ID_HEADER] for message in client.lrange(WAKE_LIST, 0, -1)]
    assert sorted(moved) == sorted(f"run-{index}" for index in range(200))
    assert client.llen(BACKSTOP_LIST) == 0 and len(stored_due(client)) == 0


def test_a_mover_sees_every_restart_of_the_semaphore_redis(servers: tuple[RedisServer, RedisServer]) -> None:
    """The semaphore Redis restarted empty twice, the same mover writing its epoch both times:
    each restart makes every stored copy due at once (a mover that wrote one value per life
    saw only the first)."""
    from celery_semaphore._celery.due_copies import Mover

    broker, semaphore = servers
    app = _app(broker, semaphore)
    store = due_copies_for(app)
    assert store is not None
    mover = Mover(app, store)
    mover.follow("celery")
    client = broker.client()
    mover.start()
    try:
        wait_until(lambda: semaphore.client().get("semaphore:epoch"), timeout=10, what="an epoch written")
        for restart in (1, 2):
            send_copy(app, _copy(app, f"run-r{restart}", 600))
            semaphore.restart()
            wait_until(
                lambda n=restart: client.llen(WAKE_LIST) == n, timeout=10, what=f"every copy sent at restart {restart}"
            )
            store.granted(f"run-r{restart}", withdraw=False)  # it arrived: the next restart sends it no more
    finally:
        mover.stop()


def test_a_copy_lost_in_flight_comes_back_when_the_semaphore_redis_restarts_empty(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    """The chaos run's lost task (tests/operations/test_chaos.py, seed 1): a parked task's backstop copy fell
    due, a mover sent it to the wake queue, and the BRPOP of the worker being SIGKILLed popped it
    (kombu's Redis transport records a message as unacked only after its BRPOP returns: such a
    message is gone). Its parked record would have been swept and sent again, but the semaphore's
    Redis restarted empty first. The moved copy is kept in the broker's Redis until a copy of its
    run asks again, and the restart sends it again."""
    from celery_semaphore._celery.due_copies import Mover

    broker, semaphore = servers
    app = _app(broker, semaphore)
    store = due_copies_for(app)
    assert store is not None
    client = broker.client()
    mover = Mover(app, store)
    mover.follow("celery")
    mover.start()
    try:
        wait_until(lambda: semaphore.client().get("semaphore:epoch"), timeout=10, what="an epoch written")
        for run in ("run-lost", "run-asked", "run-granted"):
            send_copy(app, _copy(app, run, 0.2))
        wait_until(lambda: client.llen(WAKE_LIST) == 3, timeout=10, what="the copies moved when due")
        assert client.zcard(MOVED_KEY) == 3 and len(stored_due(client)) == 0
        sent = {json.loads(message)["headers"][COPY_ID_HEADER]: message for message in client.lrange(WAKE_LIST, 0, -1)}
        client.delete(WAKE_LIST)  # each popped by a worker's BRPOP; run-lost's worker was killed there
        send_copy(app, _copy(app, "run-asked", 600))  # refused, parked again: a newer copy stored
        assert not store.granted("run-granted", withdraw=False)  # granted (acks_late): it arrived
        assert client.zrange(MOVED_KEY, 0, -1) == [b"run-lost"]
        semaphore.restart()  # empty: run-lost's parked record is gone, and nothing else would send it
        wait_until(lambda: client.llen(WAKE_LIST) == 2, timeout=10, what="the copies sent again at the restart")
        again = [json.loads(message)["headers"][COPY_ID_HEADER] for message in client.lrange(WAKE_LIST, 0, -1)]
        assert sorted(again) == ["run-asked", "run-lost"]  # the stored copy, and the lost one
        # as first moved, under a delivery tag of its own
        assert untagged(sent["run-lost"]) in [untagged(message) for message in client.lrange(WAKE_LIST, 0, -1)]
        assert len(stored_due(client)) == 0 and client.hlen(COPIES_KEY) == 0
    finally:
        mover.stop()


def test_a_moved_copy_is_kept_until_its_run_asks_withdraws_or_it_is_old(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a restart would send again stays bounded: a moved copy is forgotten when its run is
    withdrawn (started without acks_late, or finished), and after KEEP_MOVED_S (a copy dropped
    because its run had finished, which nothing withdraws)."""
    import celery_semaphore._celery.due_copies as due_copies

    app, client, store = setup.app, setup.client, setup.store
    for run in ("run-w", "run-o"):
        send_copy(app, _copy(app, run, 0))
    assert client.llen(WAKE_LIST) == 2 and client.zcard(MOVED_KEY) == 2  # due at once: moved by their stow
    withdraw(app, "run-w", remember_s=60)
    assert client.zrange(MOVED_KEY, 0, -1) == [b"run-o"] and client.hkeys(SENT_KEY) == [b"run-o"]
    monkeypatch.setattr(due_copies, "KEEP_MOVED_S", 0.05)
    wait_until(lambda: store.run(["celery"]) and client.zcard(MOVED_KEY) == 0, timeout=5, what="forgotten")
    assert client.hlen(SENT_KEY) == 0
    store.run(["celery"], epoch="epoch-1")
    assert store.run(["celery"], epoch="epoch-2") == due_copies.Moved(0, 0, None, True)  # nothing sent again


def test_a_finished_run_is_remembered_and_no_copy_of_it_is_stored_after(setup: Setup) -> None:
    """A run that finished is withdrawn and remembered in the broker's Redis (which outlives a
    semaphore Redis restarted empty): a copy of it stored later (its sender, refused as another
    copy ran, sent it after that copy finished) is dropped, and a granted copy learns it until the
    memory lapses."""
    app, client, store = setup.app, setup.client, setup.store
    send_copy(app, _copy(app, "run-f", 60))
    withdraw(app, "run-f", remember_s=0.5)
    assert len(stored_due(client)) == 0
    assert store.granted("run-f", withdraw=False) and not store.granted("run-g", withdraw=False)
    send_copy(app, _copy(app, "run-f", 60))  # late: not stored
    assert len(stored_due(client)) == 0 and client.hlen(COPIES_KEY) == 0
    wait_until(lambda: store.run(["celery"]) and client.zcard(FINISHED_KEY) == 0, timeout=5, what="forgotten")
    send_copy(app, _copy(app, "run-f", 60))  # forgotten: stored again
    assert len(stored_due(client)) == 1


class RoundTrips:
    """Counts the requests the thread that made it writes to any Redis server (redis-py writes a
    command, or a whole pipeline, at once), to pin how many round trips a step costs. Other
    threads' are not counted: the ticks and sweeps of parked lines run in threads of their own,
    every second, whatever step is being counted. Subscriptions are not counted either: a Redis
    result backend subscribes to the result of every task sent (Celery's ``on_task_call``), a
    copy of a wait's too, and unsubscribes as its AsyncResult goes; that is Celery's per send,
    waits for no reply, and is not the semaphore's doing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import redis.connection

        self.count = 0
        send = redis.connection.AbstractConnection.send_packed_command
        counting = threading.get_ident()

        def counted(connection: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
            head = bytes(command[0] if isinstance(command, list | tuple) else command)[:32]
            if b"SUBSCRIBE" not in head and threading.get_ident() == counting:
                self.count += 1
            return send(connection, command, *args, **kwargs)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)


def round_trips_of_a_copy(setup: Setup, monkeypatch: pytest.MonkeyPatch, run: str) -> int:
    """The round trips that send one copy of ``run`` once the producers are connected; the
    copy is stored, not left in the backstop list."""
    send_copy(setup.app, _copy(setup.app, f"{run}-warm", 60))  # connects the producers
    trips = RoundTrips(monkeypatch)
    send_copy(setup.app, _copy(setup.app, run, 60))
    count = trips.count
    assert setup.client.llen(BACKSTOP_LIST) == 0 and stored_due(setup.client).get(run.encode()) is not None
    return count


def test_a_copy_is_published_and_stowed_in_one_round_trip_as_kombu_writes_it(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy goes through kombu's own producer, whose channel packs it and runs the stowing
    script: one round trip (the app's producer, then the script, took two), and the stored
    message is the one kombu pushes to the list for the same call, but for its delivery tag and
    the routing key of the queue it goes to when due."""
    app, client = setup.app, setup.client
    assert round_trips_of_a_copy(setup, monkeypatch, "run-b") == 1
    stored = json.loads(setup.store.stored_message("run-b") or "")
    assert stored["properties"]["delivery_info"]["routing_key"] == wake_queue("celery")
    # the same call through the app's producer, to the backstop list (nothing stows it here)
    _copy(app, "run-b", 60).apply_async(task_id=stored["headers"]["id"])
    pushed = json.loads(client.lpop(BACKSTOP_LIST))
    for message in (stored, pushed):
        message["properties"].pop("delivery_tag")
        message["properties"]["delivery_info"].pop("routing_key")
        for stamp in (SENT_HEADER, MESSAGE_HEADER):  # each publish's own, where the stamping is on
            message["headers"].pop(stamp, None)
    assert stored == pushed


def test_a_kombu_whose_channel_lacks_what_stowing_calls_publishes_and_stows_apart(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kombu release whose Redis channel no longer has a method the stowing channel calls
    (stood in for by a name no release has): the copy is published by the app's producer and
    stowed after, two round trips, as before; it is stored all the same."""
    from celery_semaphore._celery import stowing

    monkeypatch.setattr(stowing, "STOWING_CHANNEL_METHODS", (*stowing.STOWING_CHANNEL_METHODS, "_not_in_any_kombu"))
    assert round_trips_of_a_copy(setup, monkeypatch, "run-apart") == 2
