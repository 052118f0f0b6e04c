"""Hand-off and wake-ups: a freed slot is offered to the oldest present waiter, that waiter
alone is told, on one shared subscription per process; offers lapse to the next waiter."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import socket
import threading
import time
from typing import Any

import pytest
import redis

from celery_semaphore import ConfigurationError, FairSemaphore, Granted, MultiSemaphore, Waiting
from celery_semaphore._core import wakeups as wakeups_module
from celery_semaphore._core.attempts import Ask, Duplicate
from celery_semaphore._core.wakeups import WakeUps, wake_ups_for

from ..concurrency_probe import ConcurrencyProbe
from ..redis_server import RedisServer
from ..waiting import wait_until


def test_200_blocked_threads_share_one_client_without_running_out_of_connections(
    redis_server: RedisServer,
) -> None:
    """200 threads blocked on one client (redis-py's default pool of 100 connections): nobody
    sees "Too many connections", every release succeeds, the limit holds, and the whole
    process subscribes once."""
    client = redis_server.client()
    probe = ConcurrencyProbe(redis_server.client(db=1))
    semaphore = FairSemaphore(client, "crowd", 5, lease=30, patience=30)
    errors: list[BaseException] = []
    released: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(200)
    max_subscribers = 0

    def work() -> None:
        try:
            start.wait(timeout=30)
            lease = semaphore.acquire(timeout=120)
            probe.enter()
            time.sleep(0.005)
            probe.leave()
            ok = lease.release()
            with lock:
                released.append(ok)
        except BaseException as error:
            with lock:
                errors.append(error)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(200)]
    monitor = redis_server.client()
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
        # the process's one channel for this semaphore, listened to by one connection
        channels = monitor.pubsub_channels("semaphore:{crowd}:wake:*")
        listeners = sum(count for _, count in monitor.pubsub_numsub(*channels)) if channels else 0
        max_subscribers = max(max_subscribers, len(channels), listeners)
        time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=1)
    assert not errors, errors[:3]
    assert len(released) == 200 and all(released)
    assert probe.maximum <= 5
    assert probe.entries == 200
    assert max_subscribers <= 1
    assert client.connection_pool._created_connections <= 100  # type: ignore[attr-defined]
    client.close()
    monitor.close()


def test_an_unclaimed_offer_lapses_to_the_next_waiter_and_the_late_one_keeps_its_place(
    redis_client: redis.Redis,
) -> None:
    """A release offers the slot to the oldest present waiter; if it does not claim within the
    claim deadline (about 2 s) the slot goes on to the next present waiter, and the late one is
    still first in line when it asks again."""
    semaphore = FairSemaphore(redis_client, "lapse", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    assert isinstance(semaphore.try_acquire(waiter="sleepy"), Waiting)
    assert isinstance(semaphore.try_acquire(waiter="next"), Waiting)
    holder.release()
    status = semaphore.status()
    assert status.offered_count == 1
    assert [(w.waiter, w.offered) for w in status.waiters] == [("sleepy", True), ("next", False)]
    assert isinstance(semaphore.try_acquire(waiter="next"), Waiting), "the offer holds the slot for sleepy"
    started = time.monotonic()
    granted = wait_until(
        lambda: _granted(semaphore.try_acquire(waiter="next")), timeout=10, what="the offer to lapse to the next waiter"
    )
    assert time.monotonic() - started >= 1.0, "not before the claim deadline"
    back = semaphore.try_acquire(waiter="sleepy")
    assert isinstance(back, Waiting) and back.position == 0
    granted.release()
    assert isinstance(semaphore.try_acquire(waiter="sleepy"), Granted)
    semaphore._release_holders_with_prefix("")


def _granted(attempt: Granted | Waiting) -> Any:
    return attempt.lease if isinstance(attempt, Granted) else None


def test_hand_off_goes_in_ticket_order_whatever_the_order_of_asking(redis_client: redis.Redis) -> None:
    """Five present waiters asked in order w0..w4 and then ask again in scrambled order: each
    release offers the slot to the oldest of them, so they get it in ticket order."""
    semaphore = FairSemaphore(redis_client, "order", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    for i in range(5):
        assert isinstance(semaphore.try_acquire(waiter=f"w{i}"), Waiting)
    for i in (3, 1, 4, 0, 2):
        assert isinstance(semaphore.try_acquire(waiter=f"w{i}"), Waiting)
    lease = holder
    order = []
    for _ in range(5):
        lease.release()
        offered = [w.waiter for w in semaphore.status().waiters if w.offered]
        assert len(offered) == 1
        order.append(offered[0])
        attempt = semaphore.try_acquire(waiter=offered[0])
        assert isinstance(attempt, Granted)
        lease = attempt.lease
    lease.release()
    assert order == ["w0", "w1", "w2", "w3", "w4"]


def test_a_one_shot_try_does_not_pass_a_present_waiter(redis_client: redis.Redis) -> None:
    """acquire(timeout=0) while a present waiter holds an offer is refused, and the offer stands."""
    semaphore = FairSemaphore(redis_client, "one-shot", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    semaphore.try_acquire(waiter="first")
    holder.release()
    assert isinstance(semaphore.try_acquire(enqueue=False), Waiting)
    assert isinstance(semaphore.try_acquire(waiter="first"), Granted)
    semaphore._release_holders_with_prefix("")


def test_raising_the_limit_admits_blocked_waiters_at_once(redis_client: redis.Redis) -> None:
    """set_limit(4) offers the three new slots to the three blocked callers in the same script:
    they run within moments, not at their next keep-alive ask (10 s away here)."""
    semaphore = FairSemaphore(redis_client, "raise", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    granted = threading.Semaphore(0)
    stop = threading.Event()

    def wait() -> None:
        with semaphore.acquire(timeout=60):
            granted.release()
            stop.wait(60)

    threads = [threading.Thread(target=wait, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    wait_until(lambda: semaphore.status(listed=0).waiter_count == 3, what="three waiters in line")
    time.sleep(0.3)  # let each finish subscribing (its second ask), so only the wake-up can grant now
    started = time.monotonic()
    semaphore.set_limit(4)
    for _ in range(3):
        assert granted.acquire(timeout=5)
    assert time.monotonic() - started < 3
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    holder.release()
    semaphore.clear_limit()


def test_leaving_with_an_offer_passes_it_on(redis_client: redis.Redis) -> None:
    """A waiter that gives up (or steps away) while a slot is offered to it passes the slot to the
    next present waiter at once."""
    semaphore = FairSemaphore(redis_client, "pass-on", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    semaphore.try_acquire(waiter="a")
    semaphore.try_acquire(waiter="b")
    holder.release()
    assert semaphore.leave("a", away_for=30) is True
    assert [w.waiter for w in semaphore.status().waiters if w.offered] == ["b"]
    assert isinstance(semaphore.try_acquire(waiter="b"), Granted)
    back = semaphore.try_acquire(waiter="a")
    assert isinstance(back, Waiting) and back.position == 0
    semaphore._release_holders_with_prefix("")
    semaphore.reset()


def test_every_script_runs_again_after_script_flush(redis_client: redis.Redis) -> None:
    """Each script is reloaded by itself after SCRIPT FLUSH (redis-py's register_script)."""
    semaphore = FairSemaphore(redis_client, "flush-all", 1)
    operations = [
        lambda: semaphore.acquire(timeout=0),
        lambda: semaphore.try_acquire(waiter="w"),
        lambda: semaphore.leave("w"),
        lambda: semaphore.status(),
        lambda: semaphore.set_limit(2),
        lambda: semaphore.clear_limit(),
        lambda: semaphore._release_holders_with_prefix(""),
        lambda: semaphore.reset(),
    ]
    for operation in operations:
        redis_client.script_flush()
        operation()
    lease = semaphore.acquire(timeout=0)
    redis_client.script_flush()
    lease.renew()
    redis_client.script_flush()
    assert lease.release() is True


def test_a_token_starting_with_an_offer_mark_is_refused(redis_client: redis.Redis) -> None:
    """Offers are stored as "!<waiter>" among the holders: a token like that is a ConfigurationError."""
    with pytest.raises(ConfigurationError, match="token"):
        FairSemaphore(redis_client, "bang", 1).try_acquire(token="!w")


def _child_acquires(port: int, done: Any) -> None:  # pragma: no cover - runs in a forked child
    client = redis.Redis(host="127.0.0.1", port=port)
    semaphore = FairSemaphore(client, "fork", 1, patience=60)
    started = time.monotonic()
    with semaphore.acquire(timeout=30):
        done.put(time.monotonic() - started)


def test_a_forked_child_gets_its_own_wake_up_listener(redis_server: RedisServer) -> None:
    """The parent's listener thread does not survive fork: a child's blocked acquire starts its
    own, and a release in the parent wakes the child at once (not at its 20 s keep-alive)."""
    client = redis_server.client()
    semaphore = FairSemaphore(client, "fork", 1, patience=60)
    # make the parent's own listener exist before the fork
    holder = semaphore.acquire(timeout=0)
    parent_wait = threading.Thread(target=lambda: semaphore.acquire(timeout=30).release(), daemon=True)
    parent_wait.start()
    wait_until(lambda: semaphore.status(listed=0).waiter_count == 1, what="the parent's waiter")
    holder.release()
    parent_wait.join(timeout=10)
    holder = semaphore.acquire(timeout=5)
    context = multiprocessing.get_context("fork")
    done = context.Queue()
    child = context.Process(target=_child_acquires, args=(redis_server.port, done))
    child.start()
    try:
        wait_until(lambda: semaphore.status(listed=0).waiter_count == 1, what="the child in line")
        # the parent's channel (still subscribed while idle) and the child's own
        wait_until(lambda: len(client.pubsub_channels("semaphore:{fork}:wake:*")) == 2, what="the child's subscription")
        time.sleep(0.3)  # its post-subscription ask
        holder.release()
        waited = done.get(timeout=15)
        assert waited < 10
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    client.close()


def test_a_second_copy_of_a_run_is_told_it_is_a_duplicate(redis_client: redis.Redis) -> None:
    """Two copies of one wait (same run id, different tokens): the second copy to ask is told
    the run is running, then, after the release, that it ran; the first copy's own repeat is
    still a grant (idempotent)."""
    semaphore = FairSemaphore(redis_client, "runs", 2)
    first = semaphore._try(Ask(token="t1", waiter="task-1", run="task-1#0", remember=60))
    assert isinstance(first, Granted)
    twin = semaphore._try(Ask(token="t2", waiter="task-1", run="task-1#0", remember=60))
    assert isinstance(twin, Duplicate) and twin.running
    again = semaphore._try(Ask(token="t1", waiter="task-1", run="task-1#0", remember=60))
    assert isinstance(again, Granted)
    assert semaphore.status().holder_count == 1
    first.lease.release()
    again.lease.release()
    assert semaphore._try(Ask(token="t3", waiter="task-1", run="task-1#0", remember=60)) == Duplicate(running=False)
    assert isinstance(semaphore._try(Ask(token="t4", waiter="task-1", run="task-1#1", remember=60)), Granted)
    semaphore.release("t4")
    semaphore.reset()


def test_a_parked_waiter_is_offered_its_turn_and_told_on_its_address(redis_client: redis.Redis) -> None:
    """A waiter that steps away *parked* (away_for with a wake address) is offered the next slot
    like a present one; the offer is published on its address, where on_wake hears it, and its
    next try claims the slot."""
    semaphore = FairSemaphore(redis_client, "parked", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    assert isinstance(semaphore.try_acquire(waiter="task-9"), Waiting)
    wake_ups = wake_ups_for(redis_client)
    channel = semaphore.keys.wake_address(wake_ups.listener_id)
    woken = threading.Event()
    with wake_ups.on_wake(channel, "task-9", woken.set) as handle:
        assert handle.subscribe(5)
        assert semaphore._leave("task-9", 30, channel) is True
        assert isinstance(semaphore.try_acquire(waiter="newcomer"), Waiting)
        holder.release()
        assert woken.wait(5)
    assert [w.waiter for w in semaphore.status().waiters if w.offered] == ["task-9"]
    assert isinstance(semaphore.try_acquire(waiter="task-9"), Granted)
    semaphore._release_holders_with_prefix("")
    semaphore.reset()


def test_blocked_callers_ask_again_at_once_after_a_redis_restart(own_redis: RedisServer) -> None:
    """Redis restarted empty while a caller is blocked (offers published meanwhile would be
    lost): the wake-up listener reconnects, resubscribes and makes its waiters ask at once, not at
    their next keep-alive (10 s here). The empty Redis has a free slot, so the waiter gets it
    (the holder registers again at its next renewal: the documented restart case)."""
    client = own_redis.client()
    semaphore = FairSemaphore(client, "restart", 1, lease=30, patience=30)
    holder = semaphore.acquire(timeout=0)
    outcome: list[object] = []

    def wait() -> None:
        try:
            with semaphore.acquire(timeout=60):
                outcome.append("granted")
        except Exception as error:  # reported below
            outcome.append(error)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    wait_until(lambda: semaphore.status(listed=0).waiter_count == 1, what="the waiter in line")
    time.sleep(0.3)  # its post-subscription ask
    restarted_at = time.monotonic()
    own_redis.restart()
    thread.join(timeout=15)
    assert outcome == ["granted"]
    assert time.monotonic() - restarted_at < 5
    holder.release()
    client.close()


def test_an_uncontended_blocking_acquire_registers_nothing_with_the_listener(redis_client: redis.Redis) -> None:
    """acquire(timeout=10) with a slot free is one try: no wake-up registration, no listener
    thread started, nothing subscribed (the Redis side is pinned in test_script_costs)."""
    semaphore = FairSemaphore(redis_client, "quiet", 2)
    wake_ups = wake_ups_for(redis_client)
    for _ in range(3):
        semaphore.acquire(timeout=10).release()
    assert wake_ups._signals == {}
    assert wake_ups._channels == {}
    assert wake_ups._thread is None


def test_an_offer_told_between_a_refusal_and_the_registration_is_claimed_at_once(
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A blocked caller registers for wake-ups only after its first try was refused, so a release
    can tell it of an offer before it registered. The listener keeps that wake-up and the
    registration hands it over: the caller claims at once, not a keep-alive pause (here 10 s)
    later. The release is forced into that window by wrapping the registration (the interleaving
    cannot be produced reliably otherwise); the wake-up, the listener and Redis are real."""
    semaphore = FairSemaphore(redis_client, "window", 1, patience=30)
    wake_ups = wake_ups_for(redis_client)
    # the process already listens on the semaphore's channel (another caller waits on it)
    other = threading.Thread(target=lambda: semaphore.acquire(timeout=60).release(), daemon=True)
    holder = semaphore.acquire(timeout=0)
    other.start()
    wait_until(
        lambda: any(entry.ready.is_set() for entry in wake_ups._channels.values()),
        timeout=10,
        what="the channel to be subscribed",
    )
    registering = wake_ups.signal
    released: list[bool] = []

    def release_first(channel: str, waiter: str) -> Any:
        if waiter != "late" or released:
            return registering(channel, waiter)
        # the other caller asked first: the release offers the slot to it; its claim and
        # release offer it on to "late", which is refused and not yet registered
        released.append(holder.release())
        wait_until(
            lambda: (channel, "late") in wake_ups._unclaimed,
            timeout=10,
            what="the wake-up for the unregistered waiter to arrive",
        )
        return registering(channel, waiter)

    wait_until(lambda: semaphore.status().waiter_count == 1, timeout=10, what="the other caller to wait")
    monkeypatch.setattr(wake_ups, "signal", release_first)
    started = time.monotonic()
    attempt = semaphore._wait(Ask(token="late-token", waiter="late"), 8)
    assert isinstance(attempt, Granted), attempt
    assert time.monotonic() - started < 5, "claimed at once, not after the 10 s keep-alive pause"
    assert released == [True]
    attempt.lease.release()
    other.join(timeout=10)


def test_an_unclaimed_wake_up_is_kept_for_a_while_only(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wake-up for a waiter that never registers does not stay: after UNCLAIMED_S it is
    forgotten, and a later registration of that waiter is not woken by it."""
    import celery_semaphore._core.wakeups as wakeups_module

    monkeypatch.setattr(wakeups_module, "UNCLAIMED_S", 0.2)
    semaphore = FairSemaphore(redis_client, "stale", 1, patience=30)
    wake_ups = wake_ups_for(redis_client)
    channel = semaphore._wake_address.get()[1]
    with wake_ups.signal(channel, "listening") as handle:
        assert handle.subscribe(10)
        redis_client.publish(channel, "nobody")
        wait_until(lambda: (channel, "nobody") in wake_ups._unclaimed, timeout=10, what="the wake-up to be kept")
        redis_client.publish(channel, "fresh")
        wait_until(lambda: (channel, "fresh") in wake_ups._unclaimed, timeout=10, what="the second wake-up")
        with wake_ups.signal(channel, "fresh") as fresh:
            assert fresh.event.is_set(), "a wake-up kept for a moment is handed over"
        time.sleep(0.3)  # past UNCLAIMED_S (patched to 0.2 s): what is measured is that it is gone
        redis_client.publish(channel, "other")  # any arrival forgets the stale ones
        wait_until(lambda: (channel, "other") in wake_ups._unclaimed, timeout=10, what="the third wake-up")
        assert (channel, "nobody") not in wake_ups._unclaimed
        with wake_ups.signal(channel, "nobody") as late:
            assert not late.event.is_set()


def _with_an_idle_channel(semaphore: FairSemaphore) -> WakeUps:
    """One caller blocks on ``semaphore`` and is handed the slot: its process's listener is left
    with the channel subscribed and nobody waiting on it."""
    wake_ups = wake_ups_for(semaphore.client)
    holder = semaphore.acquire(timeout=0)
    waiter = threading.Thread(target=lambda: semaphore.acquire(timeout=30).release(), daemon=True)
    waiter.start()
    wait_until(
        lambda: any(entry.ready.is_set() for entry in wake_ups._channels.values()),
        timeout=10,
        what="the waiter's channel to be subscribed",
    )
    holder.release()
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    return wake_ups


def test_closing_a_client_nobody_waits_on_ends_its_listener_without_a_warning(
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An application closes its client when it is done with it, which also closes the wake-up
    listener's connection (still subscribed: its channel is kept a while for the next wait). With
    nobody waiting, that is no failure worth a warning, nor a reason to reconnect: the listener
    ends quietly, and a later wait on the same client starts a new one and is woken by it."""
    client = redis_server.client()
    semaphore = FairSemaphore(client, "closing", 1, patience=30)
    wake_ups = _with_an_idle_channel(semaphore)
    listener = wake_ups._thread
    assert listener is not None and listener.is_alive(), "the idle channel keeps the listener"

    with caplog.at_level(logging.DEBUG, logger="celery_semaphore"):
        client.close()
        wait_until(lambda: not listener.is_alive(), timeout=15, what="the listener to end")
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert warnings == []
    assert wake_ups._channels == {} and wake_ups._thread is None

    # the client is still usable (redis-py reconnects on use): the next wait listens again
    holder = semaphore.acquire(timeout=0)
    outcome: list[bool] = []
    again = threading.Thread(target=lambda: outcome.append(bool(semaphore.acquire(timeout=30).release())), daemon=True)
    started = time.monotonic()
    again.start()
    wait_until(lambda: semaphore.status().waiter_count == 1, timeout=10, what="the second waiter in line")
    holder.release()
    again.join(timeout=15)
    assert outcome == [True]
    assert time.monotonic() - started < 5, "woken by the new listener, not by a keep-alive try"
    client.close()


def test_after_a_redis_restart_with_nobody_waiting_the_next_blocked_caller_is_woken(
    own_redis: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis restarts (empty) while the listener holds only an idle channel. Nobody was waiting,
    so nothing is worth a warning, whether the listener notices (and ends) or redis-py reconnects
    under it. The limit holds across the restart: the slot held through it is registered again
    by its lease's renewal, a second caller is refused while it is held, and the holder's release
    hands it the slot at once (not at its keep-alive 10 s later). No slot stays held."""
    client = own_redis.client()
    semaphore = FairSemaphore(client, "restart-idle", 1, lease=3, patience=30)
    _with_an_idle_channel(semaphore)
    holder = semaphore.acquire(timeout=0)  # held across the restart
    outcome: list[bool] = []
    with caplog.at_level(logging.DEBUG, logger="celery_semaphore"):
        own_redis.restart()
        # the renewer registers the held slot again in the empty Redis (every lease / 3 = 1 s)
        wait_until(lambda: semaphore.status().holder_count == 1, timeout=10, what="the held slot registered again")
        assert not holder.lost
        second = threading.Thread(
            target=lambda: outcome.append(bool(semaphore.acquire(timeout=30).release())), daemon=True
        )
        second.start()
        wait_until(lambda: semaphore.status().waiter_count == 1, timeout=10, what="the second caller in line")
        assert semaphore.status().holder_count == 1, "never more than the limit"
        released_at = time.monotonic()
        assert holder.release()
        second.join(timeout=15)
    assert outcome == [True]
    assert time.monotonic() - released_at < 5, "woken by the listener, not by a keep-alive try"
    assert semaphore.status().holder_count == 0
    warnings = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert [message for message in warnings if "wake-up" in message] == []
    client.close()


def _socket_pair_listener(monkeypatch: pytest.MonkeyPatch) -> WakeUps:
    """A listener that is poked through a socket pair, as on a Redis >= 7 cluster (needing no
    cluster: the pair is made when the listener is, before it connects to anything)."""
    monkeypatch.setattr(wakeups_module, "uses_sharded_pubsub", lambda client: True)
    listener = WakeUps(object())
    assert listener._poke_in is not None and listener._poke_out is not None
    return listener


def test_a_listeners_socket_pair_is_closed_once_the_listener_is_collected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The listener closes its socket pair itself: left to the sockets' own finalizers, a pair
    still open when the interpreter shut down was reported as two "unclosed socket"
    ResourceWarnings after the test run's summary."""
    listener = _socket_pair_listener(monkeypatch)
    pair = [listener._poke_in, listener._poke_out]
    del listener
    gc.collect()
    assert [sock.fileno() for sock in pair if sock is not None] == [-1, -1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_closing_its_copy_of_the_socket_pair_leaves_the_parents_working(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefork child inherits the parent's listener and drops it (its registry starts afresh):
    the child closes its copies of the pair, and the parent's listener is still poked through it."""
    listener = _socket_pair_listener(monkeypatch)
    pid = os.fork()
    if pid == 0:  # the child: drop the inherited listener, as a Celery pool process does
        try:
            del listener
            gc.collect()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert listener._poke_in is not None and listener._poke_out is not None
    listener._poke_in.send(b"\0")
    assert wait_until(lambda: _received(listener._poke_out), timeout=5, what="the poke") == b"\0"


def _received(sock: socket.socket) -> bytes:
    try:
        return sock.recv(16)
    except BlockingIOError:
        return b""


@pytest.mark.parametrize("noticed_by", ["tick", "renewal"])
def test_a_parked_waiter_offered_a_slot_is_reported_to_the_caller_and_again_when_its_offer_lapses(
    redis_client: redis.Redis, noticed_by: str
) -> None:
    """A parked waiter's offer is published on its process's channel (heard here) and also
    reported to the script's caller, which just freed the slot and sends the wake copy at once
    (the parked process may be busy). If nobody acts on it (that process heard it and died
    before sending, and the caller had no way to send), the offer lapses, and the script that
    purges it reports the waiter again: a claim window late, not a backstop late. A periodic
    tick and a holder's renewal each purge."""
    from celery_semaphore._celery.parked_scripts import parked_scripts_for
    from celery_semaphore._core import hand_offs

    semaphore = FairSemaphore(redis_client, f"heard-{noticed_by}", 2, patience=30)
    keeper, holder = semaphore.acquire(timeout=0), semaphore.acquire(timeout=0)
    assert isinstance(semaphore.try_acquire(waiter="parked"), Waiting)
    address = semaphore.keys.wake_address("deaf")
    deaf = redis_client.pubsub()
    deaf.subscribe(address)  # hears the offer, never acts on it
    wait_until(lambda: redis_client.pubsub_numsub(address)[0][1] == 1, timeout=10, what="the deaf listener")
    assert semaphore._leave("parked", away_for=60, wake=address)
    told: list[tuple[str, ...]] = []
    later: list[bool] = []
    handler = hand_offs._to_wake_handler  # the Celery layer's, if imported: put back after
    hand_offs.on_to_wake(lambda _, waiters, not_now: (told.append(waiters), later.append(not_now)))
    try:
        assert holder.release()
        assert told == [("parked",)], "a parked waiter is the caller's to wake, heard or not"
        assert deaf.get_message(timeout=5) is not None  # the subscription's confirmation
        assert deaf.get_message(timeout=5)["data"] == b"parked"  # and the offer, published too
        told.clear()
        offered_at = time.monotonic()

        def reported() -> bool:
            if noticed_by == "tick":
                to_wake = parked_scripts_for(redis_client).tick(semaphore.keys, rules=semaphore.rules.arg)
                if to_wake:
                    told.append(to_wake)
            else:
                keeper.renew()  # raises LeaseLost if the keeper lost its slot
            return bool(told)

        wait_until(reported, timeout=10, what="the lapsed offer reported")
        assert time.monotonic() - offered_at >= 1.0, "not before the claim window ends"
        assert told == [("parked",)]
        if noticed_by == "renewal":
            assert later[-1] is True, "the renewer hands wake-ups on, never waits on a broker"
        granted = semaphore.try_acquire(waiter="parked")
        assert isinstance(granted, Granted), "the late waiter still heads the line"
        granted.lease.release()
    finally:
        hand_offs.on_to_wake(handler)
        deaf.close()
        keeper.release()
        semaphore._release_holders_with_prefix("")


def test_a_present_waiter_that_hears_its_offer_is_not_reported_to_the_caller(redis_client: redis.Redis) -> None:
    """A caller blocked in ``acquire`` hears its offer on its own listener and claims it: the
    releasing caller has nothing to send for it."""
    from celery_semaphore._core import hand_offs

    semaphore = FairSemaphore(redis_client, "heard-present", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    leases: list[Any] = []
    blocked = threading.Thread(target=lambda: leases.append(semaphore.acquire(timeout=30)), daemon=True)
    blocked.start()
    wait_until(lambda: semaphore.status().waiter_count == 1, timeout=10, what="the blocked caller in line")
    # its listener subscribes beside its first ask: until the server has the subscription, an
    # offer published to it is unheard (and rightly reported to the releasing caller)
    wait_until(
        lambda: bool(redis_client.pubsub_channels(f"{semaphore.keys.base}:wake:*")),
        timeout=10,
        what="the blocked caller's listener subscribed",
    )
    told: list[tuple[str, ...]] = []
    handler = hand_offs._to_wake_handler
    hand_offs.on_to_wake(lambda _, waiters, __: told.append(waiters))
    try:
        assert holder.release()
        blocked.join(timeout=30)
        assert leases and leases[0].release()
        assert told == []
    finally:
        hand_offs.on_to_wake(handler)
        semaphore._release_holders_with_prefix("")


def test_a_wake_address_is_kept_relative_to_its_line_and_a_whole_one_still_reaches_its_waiter(
    redis_client: redis.Redis,
) -> None:
    """waiter_info keeps an address of the line's own base as ":wake:<listener id>" (every
    waiter of a long line would repeat the base, 40-odd bytes each), and the scripts publish
    on the whole address: the offer reaches the waiter. An address another key's base starts
    (a MultiSemaphore's, its first key's) and one an earlier release stored whole are kept and
    read as they are."""
    semaphore = FairSemaphore(redis_client, "relative", 1, patience=30)
    other = FairSemaphore(redis_client, "relative-home", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    wake_ups = wake_ups_for(redis_client)
    channel = semaphore.keys.wake_address(wake_ups.listener_id)
    for waiter in ("kept-relative", "kept-whole", "elsewhere"):
        assert isinstance(semaphore.try_acquire(waiter=waiter), Waiting)
    assert semaphore._leave("kept-relative", 30, channel) is True
    assert semaphore._leave("elsewhere", 30, other.keys.wake_address("x")) is True
    info = {k.decode(): v.decode() for k, v in redis_client.hgetall(semaphore.keys.waiter_info).items()}
    assert info["w:kept-relative"].endswith(f"|>:wake:{wake_ups.listener_id}"), info
    assert info["w:elsewhere"].endswith(f"|>{other.keys.wake_address('x')}"), info
    # as an earlier release wrote it: the whole address
    first = info["w:kept-whole"].partition("|")[0]
    redis_client.hset(semaphore.keys.waiter_info, "w:kept-whole", f"{first}|{channel}")
    heard: list[str] = []
    done = threading.Event()

    def woken(waiter: str) -> Any:
        def tell() -> None:
            heard.append(waiter)
            done.set()

        return tell

    for waiter in ("kept-relative", "kept-whole"):
        with wake_ups.on_wake(channel, waiter, woken(waiter)) as handle:
            assert handle.subscribe(5)
            done.clear()
            holder.release()  # offered to the head of the line, told on its whole address
            assert done.wait(5), f"{waiter} was not told of its offer"
            claimed = semaphore.try_acquire(waiter=waiter)
            assert isinstance(claimed, Granted)
            holder = claimed.lease
    assert heard == ["kept-relative", "kept-whole"]
    holder.release()
    semaphore.reset()


def test_a_release_whose_caller_takes_the_parked_records_tells_their_process_so(redis_client: redis.Redis) -> None:
    """A release whose follower script takes the records of the parked waiters it offers a slot
    tells a parked waiter's process "~<waiter>", which the listener hands to the waiter's
    on_taken (nothing to ask Redis); a waiter of several keys (its record is under its first
    key) and a release without such a follower publish the waiter as before. A waiter whose own
    id begins with the mark still hears its plain wake-ups."""
    from celery_semaphore._core import hand_offs
    from celery_semaphore._core.hand_offs import ReleaseFollower

    semaphore = FairSemaphore(redis_client, "taken-records", 1, patience=30)
    wake_ups = wake_ups_for(redis_client)
    channel = semaphore.keys.wake_address(wake_ups.listener_id)
    heard: list[str] = []
    from celery_semaphore._core import script_calls

    status = script_calls.status(semaphore.keys, listed=0, rules=semaphore.rules)  # changes nothing
    noop = (semaphore._scripts._scripts["status"], status.keys, status.args)

    def follower(takes: bool) -> ReleaseFollower:
        return ReleaseFollower(noop, lambda _: (), takes)

    source = hand_offs._follower_source
    try:
        several = MultiSemaphore([semaphore])  # its waiters are "*<weight>*<id>"
        for asker, waiter, takes, expected in (
            (semaphore, "task-1", True, "taken task-1"),
            (semaphore, "task-2", False, "woken task-2"),
            (several, several.waiter_id("task-3"), True, "woken *1*task-3"),
            (semaphore, "~task-4", False, "woken ~task-4"),
        ):
            holder = semaphore.acquire(timeout=0)
            assert isinstance(asker.try_acquire(waiter=waiter), Waiting)
            handle = wake_ups.on_wake(
                channel,
                waiter,
                lambda w=waiter: heard.append(f"woken {w}"),
                on_taken=lambda w=waiter: heard.append(f"taken {w}"),
            )
            assert handle.subscribe(5)
            assert asker._leave(waiter, 30, channel) is True
            hand_offs.on_release(lambda _, takes=takes: follower(takes))
            assert holder.release()
            wait_until(lambda: len(heard) == 1, timeout=5, what=f"the wake-up of {waiter}")
            assert heard.pop() == expected
            handle.close()
            granted = asker.try_acquire(waiter=waiter)
            assert isinstance(granted, Granted)
            granted.lease.release()
    finally:
        hand_offs.on_release(source)
        semaphore._release_holders_with_prefix("")
        semaphore.reset()
