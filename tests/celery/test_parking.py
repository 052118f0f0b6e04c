"""Parking: the process that parked a waiting task sends it again when its turn comes, and a
sweep in any process sends it again when no copy of its wait asked in time (its backstop copy
was lost in the broker), even when the process that parked it is dead.

Real Redis for the semaphore and a real Redis broker: the wake copy is a real Celery message,
checked in the broker's queue; the dead parking process is a real process, SIGKILLed. The lost
backstop copy is played by not sending one: on the Redis broker that loss (a message popped by
the pending BRPOP of a worker being killed) cannot be produced on demand.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import redis
from celery import Celery

from celery_semaphore import FairSemaphore, Waiting
from celery_semaphore._celery.parked_records import kept_of, record_bucket
from celery_semaphore._celery.parking import Parking, parked_keys
from celery_semaphore._core.attempts import Ask
from celery_semaphore._core.storage import TAKEN_RECORD_MARK, WOKEN_COPY_MARK

from ..parked import due_times, records
from ..redis_server import RedisServer
from ..waiting import wait_until
from ..workers import ROOT

# The keys of these tests' semaphores and parked tasks: a sweeper left running in this process
# by another test (with its app and its broker) sweeps the default prefix, never this one.
PREFIX = "parking-tests"


def _app(server: RedisServer) -> Celery:
    app = Celery("parking", broker=f"redis://127.0.0.1:{server.port}/5", set_as_current=False)

    @app.task(name="parking.job", shared=False)
    def job(*args: object) -> None: ...

    return app


def _queued(server: RedisServer, queue: str) -> int:
    with server.client(db=5) as broker:
        return int(broker.llen(queue))


def test_an_offer_sends_the_wake_copy_at_once(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """A release that hands the parked waiter its turn makes this process send the wake copy."""
    app = _app(redis_server)
    semaphore = FairSemaphore(redis_client, "park-offer", 1, prefix=PREFIX)
    holder = semaphore.acquire(timeout=5)
    waiting = semaphore.try_acquire(token="t1:a", waiter="t1")
    assert isinstance(waiting, Waiting)
    parking = Parking()
    wake_copy = app.signature("parking.job", queue="q-offer.semaphore-wake")
    address = parking.park(semaphore, "t1", wake_copy, away_for=30, run="t1#0")
    semaphore._leave("t1", 30, address)
    assert _queued(redis_server, "q-offer.semaphore-wake") == 0
    holder.release()
    wait_until(lambda: _queued(redis_server, "q-offer.semaphore-wake") == 1, timeout=10, what="the wake copy sent")
    assert parking.parked_count() == 0


def test_the_releasing_process_sends_the_wake_copy_and_the_parked_one_does_not_send_it_again(
    redis_server: RedisServer, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process whose release offers a parked waiter its turn sends the wake copy itself (it
    is running; the parked task's process may be busy with another task). The parked process,
    told that the release took the record ("~<waiter>", lua/_lib.lua), forgets the wait and
    sends nothing: one copy, and no question of the parked process to Redis while the woken
    task starts (``_take_record`` is spied on: never called)."""
    from celery_semaphore._celery.parking import parking

    took: list[str] = []
    take_record = Parking._take_record
    monkeypatch.setattr(Parking, "_take_record", staticmethod(lambda p: took.append(p.waiter) or take_record(p)))

    app = _app(redis_server)
    prefix = f"{PREFIX}-releaser"
    releasing = parking()  # this process's, whose wake handler the release calls
    releasing.sweep(app, redis_client, prefix)  # as a worker's process: it knows the app
    try:
        semaphore = FairSemaphore(redis_client, "park-releaser", 1, prefix=prefix)
        holder = semaphore.acquire(timeout=5)
        assert isinstance(semaphore.try_acquire(token="t1:a", waiter="t1"), Waiting)
        parked = Parking()  # the parked task's process
        wake_copy = app.signature("parking.job", queue="q-releaser.semaphore-wake")
        semaphore._leave("t1", 30, parked.park(semaphore, "t1", wake_copy, away_for=30, run="t1#0"))
        holder.release()
        wait_until(lambda: parked.sent_elsewhere == 1, timeout=10, what="the parked process told, the copy sent")
        assert _queued(redis_server, "q-releaser.semaphore-wake") == 1
        assert parked.parked_count() == 0
        assert took == [], "told the record was taken, the parked process asks Redis nothing"
    finally:
        # no sweeping of this test's deployment for the rest of the session
        releasing._sweep_targets.pop((id(redis_client), prefix), None)


def test_a_wait_kept_in_its_process_only_is_sent_from_there_when_told_its_record_was_taken(
    redis_server: RedisServer, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A parked wait whose record could not be kept in Redis (its copy lives in its process
    only: played by ``serialized`` giving nothing, a fault a real copy cannot be made to show)
    is still sent by its own process when the release says the record was taken: the release
    took nothing, and only that process holds the copy."""
    from celery_semaphore._celery import parking as parking_module

    app = _app(redis_server)
    prefix = f"{PREFIX}-kept-here"
    releasing = parking_module.parking()
    releasing.sweep(app, redis_client, prefix)
    try:
        semaphore = FairSemaphore(redis_client, "park-kept-here", 1, prefix=prefix)
        holder = semaphore.acquire(timeout=5)
        assert isinstance(semaphore.try_acquire(token="t1:a", waiter="t1"), Waiting)
        parked = Parking()
        wake_copy = app.signature("parking.job", queue="q-kept-here.semaphore-wake")
        monkeypatch.setattr(parking_module, "serialized", lambda copy: None)
        semaphore._leave("t1", 30, parked.park(semaphore, "t1", wake_copy, away_for=30, run="t1#0"))
        monkeypatch.undo()
        assert records(redis_client, prefix) == {}, "no record kept in Redis"
        holder.release()
        wait_until(
            lambda: _queued(redis_server, "q-kept-here.semaphore-wake") == 1, timeout=10, what="the wake copy sent"
        )
        assert parked.sent_elsewhere == 0 and parked.parked_count() == 0
    finally:
        releasing._sweep_targets.pop((id(redis_client), prefix), None)


def test_the_release_takes_the_parked_record_in_its_own_round_trip(
    redis_server: RedisServer, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a single Redis, the releasing process takes the record of the parked waiter its
    release offered the slot in the release's own round trip (the claim follows the release in
    one pipeline), not in a second one; and it sends the wake copy, once. What each write of the
    releasing thread holds is read off the connection (redis-py writes a pipeline at once); the
    parked task's own listener, in this process too here, takes the record in a thread of its
    own (and finds it taken)."""
    import hashlib
    import threading

    import redis.connection

    from celery_semaphore._celery.parked_scripts import _PACKAGE, preload
    from celery_semaphore._celery.parking import parking
    from celery_semaphore._core.scripts import built_script, script_source

    app = _app(redis_server)
    prefix = f"{PREFIX}-one-trip"
    releasing = parking()
    releasing.sweep(app, redis_client, prefix)
    try:
        semaphore = FairSemaphore(redis_client, "park-one-trip", 1, prefix=prefix)
        holder = semaphore.acquire(timeout=5)
        assert isinstance(semaphore.try_acquire(token="t1:a", waiter="t1"), Waiting)
        wake_copy = app.signature("parking.job", queue="q-one-trip.semaphore-wake")
        semaphore._leave("t1", 30, Parking().park(semaphore, "t1", wake_copy, away_for=30, run="t1#0"))
        preload(redis_client)  # as a worker does at start: no NOSCRIPT and second run to count
        writes: list[bytes] = []
        releaser = threading.current_thread()
        send = redis.connection.AbstractConnection.send_packed_command

        def noted(connection: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is releaser:
                parts = command if isinstance(command, list | tuple) else [command]
                writes.append(b"".join(bytes(part) for part in parts))
            return send(connection, command, *args, **kwargs)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", noted)
        holder.release()
        monkeypatch.undo()
        release = hashlib.sha1(script_source("release").encode()).hexdigest().encode()
        claim = hashlib.sha1(built_script(_PACKAGE, "claim_parked_waiter").encode()).hexdigest().encode()
        claims = [write for write in writes if claim in write]
        assert len(claims) == 1, "one claim"
        assert release in claims[0], "in the release's own write"
        assert sum(release in write for write in writes) == 1
        wait_until(
            lambda: _queued(redis_server, "q-one-trip.semaphore-wake") == 1, timeout=10, what="the wake copy sent"
        )
        taken = [value.startswith(TAKEN_RECORD_MARK.encode()) for value in records(redis_client, prefix).values()]
        assert taken == [True], "the record taken"
    finally:
        releasing._sweep_targets.pop((id(redis_client), prefix), None)


def test_a_wake_up_handed_on_later_is_sent_from_the_sender_thread(
    redis_server: RedisServer, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renewer hands the waiters its renewal offered a slot on with ``later``: their wake
    copies go out from the parking's sender thread, never from the calling thread, which must
    not wait on a broker (its stall would let leases lapse while their bodies run). The send
    is observed by wrapping this project's own ``send_wake_copy``; the message is real."""
    import threading

    app = _app(redis_server)
    prefix = f"{PREFIX}-later"
    semaphore = FairSemaphore(redis_client, "park-later", 1, prefix=prefix)
    holder = semaphore.acquire(timeout=5)
    assert isinstance(semaphore.try_acquire(token="t1:a", waiter="t1"), Waiting)
    wake_copy = app.signature("parking.job", queue="q-later.semaphore-wake")
    semaphore._leave("t1", 30, Parking().park(semaphore, "t1", wake_copy, away_for=30, run="t1#0"))
    import celery_semaphore._celery.parked_sends as parked_sends

    senders: list[threading.Thread] = []
    send = parked_sends.send_wake_copy

    def noted_send(copy: object, name: str) -> None:
        senders.append(threading.current_thread())
        send(copy, name)

    monkeypatch.setattr(parked_sends, "send_wake_copy", noted_send)
    waker = Parking()
    waker.sweep(app, redis_client, prefix)
    waker.wake_offered(semaphore, ("t1",), later=True)
    wait_until(lambda: _queued(redis_server, "q-later.semaphore-wake") == 1, timeout=10, what="the wake copy sent")
    assert senders and senders[0] is not threading.current_thread()
    holder.release()


def test_a_wait_whose_copies_never_asked_is_sent_again(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """When a parked task's time is up and no copy of its wait asked meanwhile, the wake copy is
    sent anyway; a task whose copy did ask is left alone."""
    app = _app(redis_server)
    semaphore = FairSemaphore(redis_client, "park-sweep", 1, prefix=PREFIX)
    holder = semaphore.acquire(timeout=5)
    parking = Parking()
    for waiter in ("lost", "asked"):
        assert isinstance(semaphore.try_acquire(token=f"{waiter}:a", waiter=waiter), Waiting)
        wake_copy = app.signature("parking.job", queue=f"q-{waiter}.semaphore-wake")
        address = parking.park(semaphore, waiter, wake_copy, away_for=0.5, run=f"{waiter}#0")
        semaphore._leave(waiter, 0.5, address)
    # the backstop copy of "asked" arrives and asks again (it is refused: the slot is held)
    assert isinstance(semaphore._try(Ask(token="asked:b", waiter="asked", run="asked#0", remember=60)), Waiting)
    wait_until(lambda: _queued(redis_server, "q-lost.semaphore-wake") == 1, timeout=10, what="the lost wait sent again")
    wait_until(lambda: parking.parked_count() == 0, timeout=10, what="both parked entries swept")
    assert _queued(redis_server, "q-asked.semaphore-wake") == 0
    holder.release()


def _parked_then_away(
    redis_server: RedisServer, redis_client: redis.Redis, name: str, parking: Parking
) -> tuple[FairSemaphore, float]:
    """Parks waiter "late" of ``name`` for 0.3 s, then steps it away for 2.5 s, as a task does
    whose park waited for its wake-up subscription: its record is due before its place lapses.
    Returns the semaphore and the server time (s) at which the place lapses."""
    app = _app(redis_server)
    semaphore = FairSemaphore(redis_client, name, 1, prefix=PREFIX)
    assert isinstance(semaphore.try_acquire(token="late:a", waiter="late"), Waiting)
    wake_copy = app.signature("parking.job", queue=f"q-{name}.semaphore-wake")
    address = parking.park(semaphore, "late", wake_copy, away_for=0.3, run="late#0")
    semaphore._leave("late", 2.5, address)
    lapses_at = float(redis_client.zscore(semaphore.keys.deadlines, "late") or 0) / 1000
    return semaphore, lapses_at


def _server_time(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def test_a_record_due_before_its_place_lapses_is_swept_when_it_lapses(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """A sweep that finds a due record whose waiter still has its place puts the record back,
    due when the place would lapse, and sends the wake copy then: taken and dropped, the record
    could never be swept again, and a backstop copy lost afterwards would be lost for good."""
    parking = Parking()
    holder = FairSemaphore(redis_client, "park-late", 1, prefix=PREFIX).acquire(timeout=5)
    semaphore, lapses_at = _parked_then_away(redis_server, redis_client, "park-late", parking)

    # the first sweep after 0.3 s finds the place alive: the record is back, due after 2.5 s
    def put_back() -> bool:
        due = list(due_times(redis_client, PREFIX).values())
        return len(due) == 1 and due[0] / 1000 > lapses_at

    wait_until(put_back, timeout=10, what="the record put back, due after the place lapses")
    assert _queued(redis_server, "q-park-late.semaphore-wake") == 0
    wait_until(
        lambda: _queued(redis_server, "q-park-late.semaphore-wake") == 1,
        timeout=15,
        what="the wake copy sent once the place lapsed",
    )
    assert _server_time(redis_client) >= lapses_at
    wait_until(lambda: due_times(redis_client, PREFIX) == {}, timeout=5, what="the record gone")
    assert _queued(redis_server, "q-park-late.semaphore-wake") == 1
    holder.release()
    del semaphore


def test_a_wait_kept_in_this_process_only_is_swept_when_its_place_lapses(
    redis_server: RedisServer, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for a wake copy the app's serializer cannot write, kept in the process that
    parked it. (Such a copy is played by making ``serialized`` refuse a plain one: the send must
    still work, which a copy that truly cannot be serialized would not.)"""
    import celery_semaphore._celery.parking as parking_module

    monkeypatch.setattr(parking_module, "serialized", lambda wake_copy: None)
    parking = Parking()
    holder = FairSemaphore(redis_client, "park-here", 1, prefix=PREFIX).acquire(timeout=5)
    _, lapses_at = _parked_then_away(redis_server, redis_client, "park-here", parking)
    assert due_times(redis_client, PREFIX) == {}, "not kept in Redis"
    wait_until(
        lambda: _queued(redis_server, "q-park-here.semaphore-wake") == 1,
        timeout=15,
        what="the wake copy sent once the place lapsed",
    )
    assert _server_time(redis_client) >= lapses_at
    assert parking.parked_count() == 0
    holder.release()


# Parks a waiter of "park-dead" (its wake copy for queue "q-dead") for 0.5 s, says so, and
# waits to be killed: the process that parked it dies without sending anything.
_PARK_AND_WAIT = """
import sys, time
import redis
from celery import Celery
from celery_semaphore import FairSemaphore, Waiting
from celery_semaphore._celery.parking import parking
port = int(sys.argv[1])
PREFIX = "parking-tests"
app = Celery("parking", broker=f"redis://127.0.0.1:{port}/5", set_as_current=False)
semaphore = FairSemaphore(redis.Redis(port=port), "park-dead", 1, prefix=PREFIX)
assert isinstance(semaphore.try_acquire(token="gone:a", waiter="gone"), Waiting)
wake_copy = app.signature("parking.job", (7,), queue="q-dead.semaphore-wake", headers={"csem_waits": 3})
address = parking().park(semaphore, "gone", wake_copy, away_for=0.5, run="gone#0")
semaphore._leave("gone", 0.5, address)
print("parked", flush=True)
time.sleep(120)
"""


def test_a_wait_parked_by_a_dead_process_is_sent_again_by_one_sweep_elsewhere(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """The process that parked a waiting task is SIGKILLed and its backstop copy never comes:
    when the task's time is up, the sweep of another process sends the wake copy, as it was
    (task, arguments, queue, headers), and of two processes sweeping, exactly one sends it."""
    app = _app(redis_server)
    holder = FairSemaphore(redis_client, "park-dead", 1, prefix=PREFIX).acquire(timeout=5)
    parker = subprocess.Popen(
        [sys.executable, "-c", _PARK_AND_WAIT, str(redis_server.port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert parker.stdout is not None
        assert parker.stdout.readline().strip() == b"parked"
    finally:
        os.kill(parker.pid, signal.SIGKILL)
        parker.wait(timeout=30)
        if parker.stdout is not None:
            parker.stdout.close()
    assert len(due_times(redis_client, PREFIX)) == 1, "the parked task is kept in Redis"
    sweepers = [Parking(), Parking()]
    for sweeper in sweepers:
        sweeper.sweep(app, redis_client, PREFIX)
    wait_until(
        lambda: _queued(redis_server, "q-dead.semaphore-wake") >= 1, timeout=15, what="the wake copy sent by a sweep"
    )
    wait_until(lambda: due_times(redis_client, PREFIX) == {}, timeout=5, what="the record taken")
    with redis_server.client(db=5) as broker:
        (message,) = broker.lrange("q-dead.semaphore-wake", 0, -1)
    sent = json.loads(message)
    assert sent["headers"]["task"] == "parking.job"
    assert sent["headers"]["csem_waits"] == 3
    assert json.loads(base64.b64decode(sent["body"]))[0] == [7]
    holder.release()


def test_a_wait_given_up_is_not_swept(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """A parked task whose backstop copy could not be sent fails, and unparks: neither its
    wake-up nor a sweep brings it back."""
    app = _app(redis_server)
    semaphore = FairSemaphore(redis_client, "park-given-up", 1, prefix=PREFIX)
    holder = semaphore.acquire(timeout=5)
    assert isinstance(semaphore.try_acquire(token="up:a", waiter="up"), Waiting)
    parking = Parking()
    address = parking.park(
        semaphore, "up", app.signature("parking.job", queue="q-up.semaphore-wake"), away_for=0.3, run="up#0"
    )
    semaphore._leave("up", 0.3, address)
    parking.unpark(semaphore, "up", "up#0")
    assert parking.parked_count() == 0
    assert due_times(redis_client, PREFIX) == {}
    holder.release()  # would offer the slot to "up", were it still parked
    semaphore.acquire(timeout=5).release()
    assert _queued(redis_server, "q-up.semaphore-wake") == 0


def test_a_record_put_back_never_overwrites_a_newer_park(redis_client: redis.Redis) -> None:
    """A sweep puts a record back only if the task has not parked it again meanwhile: the newer
    copy (its headers count one more wait) and its due time stay."""
    from celery_semaphore._celery.parked_scripts import parked_scripts_for

    scripts, keys = parked_scripts_for(redis_client), parked_keys("nx")
    entry = "nx:{x}\nw"
    assert scripts.park(keys, entry=entry, look_in_ms=60_000, record=b"[]\nnewer")
    assert not scripts.park(keys, entry=entry, look_in_ms=1_000, record=b"[]\nolder", only_if_absent=True)
    assert records(redis_client, keys) == {entry.encode(): b"[]\nnewer"}
    due_in_ms = due_times(redis_client, keys)[entry.encode()] - redis_client.time()[0] * 1000
    assert due_in_ms > 50_000
    bucket = record_bucket(entry)
    redis_client.delete(keys.bucket_records(bucket), *keys)
    assert scripts.park(keys, entry=entry, look_in_ms=1_000, record=b"[]\nolder", only_if_absent=True)
    assert records(redis_client, keys) == {entry.encode(): b"[]\nolder"}
    for key in (keys.bucket_records(bucket), keys.buckets):
        assert redis_client.pttl(key) > 0, "the put-back record's keys expire"


def test_a_wake_copy_lost_in_flight_is_sent_again_after_its_lease(
    redis_server: RedisServer, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record of a woken wait is leased, not dropped: its wake copy lost in flight (on the
    Redis broker, popped by the pending BRPOP of a worker being killed; played here by popping
    it) is sent again by a sweep once the lease is up, and again after that, until a copy of
    its run is granted; then the record is dropped and nothing more is sent. The lease is
    shortened to 1 s (default 10 s) to keep the test short."""
    import celery_semaphore._celery.parked_sends as parked_sends

    monkeypatch.setattr(parked_sends, "WOKEN_LEASE_S", 1.0)
    app = _app(redis_server)
    prefix = f"{PREFIX}-lease"
    queue = "q-lease.semaphore-wake"
    semaphore = FairSemaphore(redis_client, "park-lease", 1, prefix=prefix)
    holder = semaphore.acquire(timeout=5)
    assert isinstance(semaphore.try_acquire(token="t1:a", waiter="t1"), Waiting)
    parked = Parking()
    wake_copy = app.signature("parking.job", queue=queue)
    semaphore._leave("t1", 300, parked.park(semaphore, "t1", wake_copy, away_for=300, run="t1#0"))
    sweeper = Parking()
    sweeper.sweep(app, redis_client, prefix)
    holder.release()
    wait_until(lambda: _queued(redis_server, queue) >= 1, timeout=10, what="the wake copy sent")
    with redis_server.client(db=5) as broker:
        for lost in (1, 2):
            # every copy sent so far lost in flight (more than one when this process stalled past
            # a lease under load: each lease sends once more, which is the point)
            assert broker.delete(queue) == 1
            wait_until(lambda: _queued(redis_server, queue) >= 1, timeout=10, what=f"sent again after loss {lost}")
        # a copy of the run is granted (the acquire script records it): the next sweep drops the
        # record, and with it anything that could send the copy again
        redis_client.hset(semaphore.keys.runs, "t1#0", "t1:a")
    wait_until(lambda: due_times(redis_client, prefix) == {}, timeout=10, what="the record dropped once granted")
    assert records(redis_client, prefix) == {}


def test_a_busy_sender_still_sweeps(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """The sender thread's rounds (sweeps, ticks) come every second even while wake-ups keep it
    busy without a quiet second: a deployment that sends wake copies all the time must still send
    a lost wait's copy again. Played by handing the thread a wake-up (of nobody) every 0.2 s."""
    app = _app(redis_server)
    semaphore = FairSemaphore(redis_client, "park-busy", 1, prefix=PREFIX)
    holder = semaphore.acquire(timeout=5)
    parking = Parking()
    assert isinstance(semaphore.try_acquire(token="busy:a", waiter="busy"), Waiting)
    wake_copy = app.signature("parking.job", queue="q-busy.semaphore-wake")
    semaphore._leave("busy", 0.5, parking.park(semaphore, "busy", wake_copy, away_for=0.5, run="busy#0"))

    def swept_while_busy() -> bool:
        parking.wake_offered(semaphore, (), later=True)
        time.sleep(0.2)  # the pace of the wake-ups that keep the thread busy, not a wait on a race
        return _queued(redis_server, "q-busy.semaphore-wake") == 1

    wait_until(swept_while_busy, timeout=10, what="the lost wait sent again while the sender is busy")
    holder.release()


def test_a_sweep_reads_where_its_records_stand_in_one_round_trip(
    redis_server: RedisServer, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep takes up to a hundred due records at once and reads where each wait stands (its
    place, its run) in one round trip for all, not one each: 6 records, 3 of waits whose run
    was granted meanwhile (left alone) and 3 of waits whose place lapsed with no copy asking
    (sent again). The grants are written as the acquire script records one (run -> token)."""
    import redis.connection

    from celery_semaphore._celery.parked_records import entry_of, record_value
    from celery_semaphore._celery.parked_scripts import parked_scripts_for
    from celery_semaphore._celery.parked_sends import sweep_records
    from celery_semaphore._celery.parking import _SweepTarget
    from celery_semaphore._celery.wake_copies import serialized

    app = _app(redis_server)
    prefix = f"{PREFIX}-batch"
    semaphore = FairSemaphore(redis_client, "park-batch", 1, prefix=prefix)
    holder = semaphore.acquire(timeout=5)
    scripts = parked_scripts_for(redis_client)
    for i in range(6):
        waiter = f"w{i}"
        assert isinstance(semaphore.try_acquire(token=f"{waiter}:a", waiter=waiter), Waiting)
        copy = serialized(app.signature("parking.job", queue=f"q-batch-{i}.semaphore-wake"))
        assert copy is not None
        record = record_value(waiter, f"{waiter}#0", copy)
        assert scripts.park(parked_keys(prefix), entry=entry_of(semaphore, waiter), record=record, look_in_ms=1)
        assert semaphore._leave(waiter, 0.2, "") is not None
        if i % 2:
            redis_client.hset(semaphore.keys.runs, f"{waiter}#0", f"{waiter}:b")
    lapse = max(float(score) for _, score in redis_client.zrange(semaphore.keys.deadlines, 0, -1, withscores=True))
    wait_until(lambda: _server_time(redis_client) * 1000 > lapse, timeout=10, what="every place lapsed")
    reads = 0
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(connection: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal reads
        parts = command if isinstance(command, list | tuple) else [command]
        reads += b"HEXISTS" in b"".join(bytes(part) for part in parts)
        return send(connection, command, *args, **kwargs)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    sweep_records([_SweepTarget(redis_client, prefix, app)])
    monkeypatch.undo()
    assert reads == 1, "one round trip reads where all six stand"
    assert [_queued(redis_server, f"q-batch-{i}.semaphore-wake") for i in range(6)] == [1, 0, 1, 0, 1, 0]
    assert due_times(redis_client, prefix) == {}
    holder.release()


def _woken_ahead_setup(
    redis_server: RedisServer, redis_client: redis.Redis, name: str, stands_by: int, **semaphore_options: Any
) -> tuple[Celery, FairSemaphore, Any]:
    """A line of ``name`` whose one slot is held, with 4 parked waiters w0..w3 (their records
    kept in Redis, their wake copies for queue q-<name>-<i>, each of a task that stands by for
    a slot coming within ``stands_by`` ms: 0, never), seen from a process that sweeps the
    deployment (this process's parking, as a worker's). Returns the app, the semaphore and the
    holder's lease."""
    from celery_semaphore._celery.parking import parking

    app = _app(redis_server)
    parking().sweep(app, redis_client, f"{PREFIX}-{name}")
    semaphore = FairSemaphore(redis_client, name, 1, prefix=f"{PREFIX}-{name}", **semaphore_options)
    holder = semaphore.acquire(timeout=5)
    for i in range(4):
        waiter = f"w{i}"
        assert isinstance(semaphore.try_acquire(token=f"{waiter}:a", waiter=waiter), Waiting)
        wake_copy = app.signature("parking.job", queue=f"q-{name}-{i}.semaphore-wake")
        address = Parking().park(semaphore, waiter, wake_copy, away_for=30, run=f"{waiter}#0", stands_by_ms=stands_by)
        semaphore._leave(waiter, 30, address)
    return app, semaphore, holder


def _sent(redis_server: RedisServer, name: str) -> list[int]:
    return [_queued(redis_server, f"q-{name}-{i}.semaphore-wake") for i in range(4)]


@pytest.mark.parametrize("rules", ["short holds", "long holds", "a rate", "tasks that never wait in a worker"])
def test_a_release_wakes_the_next_parked_waiters_ahead_of_their_offer(
    redis_server: RedisServer, redis_client: redis.Redis, rules: str
) -> None:
    """On a line whose holds are short (a slot should reach the next two within 0.5 s, and
    within the inline wait) and which has no rate, spacing or pause, the release that offers the head its slot also
    wakes the next two (``WAKE_AHEAD``) parked waiters, in its round trip: their copies arrive before
    their offer and wait for it in a pool process, so the hand-off is a publish. Their records
    are leased as woken (a sweep sends a lost copy again). With longer holds, a rate, or tasks
    that would not wait for their offer in a pool process (``semaphore_inline_wait = 0``: they
    would only park again), only the head is woken."""
    from celery_semaphore._celery.parking import parking
    from celery_semaphore._core.storage import WOKEN_COPY_MARK

    name = f"ahead-{rules.split()[0]}-{len(rules)}"
    options: dict[str, Any] = {"rate": "100/s"} if rules == "a rate" else {}
    stands_by = 0 if rules == "tasks that never wait in a worker" else 500
    _, semaphore, holder = _woken_ahead_setup(redis_server, redis_client, name, stands_by, **options)
    try:
        if rules == "long holds":
            time.sleep(0.7)  # a hold beyond the 0.5 s a woken-ahead wait stands by for: a length, not a race
        holder.release()
        woken = 1 + (2 if rules == "short holds" else 0)  # the head, and the next two
        # sent by the release itself, before it returns (an offer nobody claims would lapse in
        # 2 s and go on to the next waiter: not what is measured here)
        assert _sent(redis_server, name) == [1] * woken + [0] * (4 - woken)
        kept = [kept_of(value) for value in records(redis_client, f"{PREFIX}-{name}").values()]
        marked = [copy.startswith(WOKEN_COPY_MARK.encode()) for copy in kept]
        assert sorted(marked) == [False] * (4 - woken) + [True] * woken, "the woken ones leased, not dropped"
    finally:
        parking()._sweep_targets.pop((id(redis_client), f"{PREFIX}-{name}"), None)
        semaphore._release_holders_with_prefix("")


def _old_record(
    client: redis.Redis, prefix: str, semaphore: FairSemaphore, waiter: str, copy: bytes, due_in_ms: int
) -> str:
    """Keep a record as the earlier release's park.lua did: named by the JSON of its fields, in
    its due set, its copies and its waiters' index (parked_records.OldParkedRecord)."""
    keys = parked_keys(prefix)
    record = json.dumps([semaphore.keys.deadlines, semaphore.keys.runs, waiter, f"{waiter}#0", semaphore.name])
    now_ms = int(_server_time(client) * 1000)
    client.zadd(keys.old_due, {record: now_ms + due_in_ms})
    client.hset(keys.old_copies, record, copy)
    client.hset(keys.old_waiters, f"{semaphore.keys.deadlines}\n{waiter}", record)
    return record


def test_the_records_an_earlier_release_kept_are_woken_and_swept(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """A rolling deploy: the records that workers of the earlier release kept (named by their
    JSON, under the old keys) are still this release's to wake and to sweep. An offer to such a
    waiter sends its copy from the old record, leased as woken there; a due record of a wait
    whose place lapsed is sent again by a sweep; one whose place is alive is kept again, as this
    release keeps records; one given up is forgotten there too. Nothing is written under the old
    keys but the lease."""
    from celery_semaphore._celery.parked_sends import sweep_records
    from celery_semaphore._celery.parking import _SweepTarget, parking
    from celery_semaphore._celery.wake_copies import serialized

    app = _app(redis_server)
    prefix = f"{PREFIX}-old"
    keys = parked_keys(prefix)
    semaphore = FairSemaphore(redis_client, "park-old", 1, prefix=prefix)
    holder = semaphore.acquire(timeout=5)
    parking().sweep(app, redis_client, prefix)  # this process's, as a worker's: it wakes what it offers
    try:
        copies = {}
        for waiter in ("offered", "lapsed", "alive"):
            assert isinstance(semaphore.try_acquire(token=f"{waiter}:a", waiter=waiter), Waiting)
            copy = serialized(app.signature("parking.job", queue=f"q-old-{waiter}.semaphore-wake"))
            assert copy is not None
            copies[waiter] = copy
        # "offered" is parked at the head of the line; its offer comes with the release
        record = _old_record(redis_client, prefix, semaphore, "offered", copies["offered"], 60_000)
        assert semaphore._leave("offered", 60, semaphore.keys.wake_address("gone")) is not None
        holder.release()
        wait_until(lambda: _queued(redis_server, "q-old-offered.semaphore-wake") == 1, what="the old record woken")
        assert redis_client.hget(keys.old_copies, record) == WOKEN_COPY_MARK.encode() + copies["offered"]
        assert not redis_client.hexists(keys.old_waiters, f"{semaphore.keys.deadlines}\noffered"), "taken once"
        assert records(redis_client, keys) == {}

        # "lapsed" steps away for a moment and never asks again; "alive" keeps its place a minute
        _old_record(redis_client, prefix, semaphore, "lapsed", copies["lapsed"], 1)
        _old_record(redis_client, prefix, semaphore, "alive", copies["alive"], 1)
        assert semaphore._leave("lapsed", 0.2, "") is not None
        assert semaphore._leave("alive", 60, "") is not None
        lapse = float(redis_client.zscore(semaphore.keys.deadlines, "lapsed") or 0)
        wait_until(lambda: _server_time(redis_client) * 1000 > lapse, what="the place lapsed")
        # a sweep (this call, or this process's own, once a second) sends it again
        wait_until(
            lambda: (
                sweep_records([_SweepTarget(redis_client, prefix, app)]) is None
                and _queued(redis_server, "q-old-lapsed.semaphore-wake") == 1
            ),
            timeout=5,
            what="sent again by the sweep",
        )
        assert _queued(redis_server, "q-old-alive.semaphore-wake") == 0
        kept = records(redis_client, keys).get(b"park-old\nalive")  # named by its semaphore's name
        assert kept is not None and kept_of(kept) == copies["alive"], "kept again as this release keeps it"
        assert redis_client.hexists(keys.bucket_records(record_bucket("park-old\nalive")), "park-old\nalive")
        assert b"park-old\nalive" in due_times(redis_client, keys)
        assert redis_client.zcard(keys.old_due) == 1, "only the woken one's lease is left there"

        # a wait the earlier release parked that a worker of this release gives up is forgotten
        # there too: no sweep may send it again
        given_up = _old_record(redis_client, prefix, semaphore, "given-up", copies["alive"], 60_000)
        parking().unpark(semaphore, "given-up", "given-up#0")
        assert redis_client.zscore(keys.old_due, given_up) is None
        assert not redis_client.hexists(keys.old_copies, given_up)
        assert not redis_client.hexists(keys.old_waiters, f"{semaphore.keys.deadlines}\ngiven-up")
    finally:
        parking()._sweep_targets.pop((id(redis_client), prefix), None)
        semaphore._release_holders_with_prefix("")


@pytest.mark.parametrize("hash_tag", [None, "family"])
def test_a_wake_up_finds_the_record_under_the_name_python_gave_it(
    redis_client: redis.Redis, hash_tag: str | None
) -> None:
    """A record is named by its semaphore's name (a family's key, in a hash tag of its own, by
    its keys' base), which Python writes and claim_parked_waiter.lua builds from the base on its
    own: both must name it alike, or a wake-up finds no record and the task waits for its
    backstop. Parked as a worker parks it, then taken as a release takes it."""
    from celery_semaphore._celery.parked_records import entry_of, record_value
    from celery_semaphore._celery.parked_scripts import parked_scripts_for

    prefix = f"{PREFIX}-named"
    semaphore = FairSemaphore(redis_client, "crawl:{host}.example", 1, prefix=prefix, hash_tag=hash_tag)
    scripts, keys = parked_scripts_for(redis_client), parked_keys(prefix)
    entry = entry_of(semaphore, "t-1")
    assert entry.startswith("crawl:{host}.example\n" if hash_tag is None else f"{semaphore.keys.base}\n")
    assert scripts.park(keys, entry=entry, record=record_value("t-1", "t-1#0#ab", b"@"), look_in_ms=60_000)
    record = scripts.claim_parked_waiter(keys, prefix=prefix, base=semaphore.keys.base, waiter="t-1", lease_ms=5000)
    assert record is not None, "the wake-up found no record under the name Python gave it"
    assert (record.entry, record.base, record.run, record.copy) == (entry, semaphore.keys.base, "t-1#0#ab", b"@")
