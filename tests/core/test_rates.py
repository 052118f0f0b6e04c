"""Rates, spacings and pauses on the fair line (FairSemaphore and MultiSemaphore), against real
Redis servers. Start times are read from Redis itself (the grant's server time that status and
``holder_info`` keep), so the windows checked here are the server-time windows the rules are
defined on: no client clock and no scheduling delay can make a test pass or fail."""

from __future__ import annotations

import itertools
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from celery_semaphore import ConfigurationError, FairSemaphore, Granted, MultiSemaphore, SemaphoreUnavailable, Waiting
from celery_semaphore._core.rules import UNLIMITED, Rate, Rules, check_rate
from celery_semaphore._core.storage import HOLDER_FIELD, INFO_SEPARATOR

from ..redis_server import RedisServer
from ..waiting import wait_until


def granted_ms(client: redis.Redis, semaphore: FairSemaphore, token: str) -> int:
    """When Redis granted ``token`` its slot (server ms), as the script wrote it."""
    info = client.hget(semaphore.keys.holder_info, f"{HOLDER_FIELD}{token}")
    assert info is not None, token
    return int(info.decode().split(INFO_SEPARATOR)[0])


def run_threads(semaphore: FairSemaphore, client: redis.Redis, threads: int, each: int, hold: float) -> list[int]:
    """``threads`` threads take ``each`` slots one after another, holding each ``hold`` s; the
    server-time grant moments, sorted."""
    starts: list[int] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(each):
            with semaphore.acquire(timeout=60) as lease:
                started = granted_ms(client, semaphore, lease.token)
                with lock:
                    starts.append(started)
                time.sleep(hold)

    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(work) for _ in range(threads)]:
            future.result()
    return sorted(starts)


def most_in_any_window(starts: list[int], window_ms: int) -> int:
    """The most starts in any half-open window [t, t + window_ms)."""
    most, first = 0, 0
    for last, started in enumerate(starts):
        while started - starts[first] >= window_ms:
            first += 1
        most = max(most, last - first + 1)
    return most


# -- declaring -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rate"),
    [("30/m", Rate(30, 60.0)), ("5/s", Rate(5, 1.0)), ("500/h", Rate(500, 3600.0)), ("10/30s", Rate(10, 30.0))],
)
def test_a_rate_reads_as_celery_writes_one(text: str, rate: Rate) -> None:
    assert check_rate("semaphore_rate", text) == rate
    assert check_rate("semaphore_rate", (rate.count, rate.period)) == rate


@pytest.mark.parametrize("bad", ["30", "30/x", "0/m", "-1/m", (0, 1), (3, 0), (True, 1), "ten/m", 5])
def test_a_bad_rate_is_refused_naming_the_setting(bad: object) -> None:
    with pytest.raises(ConfigurationError) as caught:
        check_rate("semaphore_rate", bad)
    assert "semaphore_rate" in str(caught.value)


def test_rules_are_sent_as_before_without_a_rate_or_a_spacing() -> None:
    """A semaphore with neither sends its bare limit, byte for byte what it sent before rates."""
    assert Rules(5).arg == b"5"
    assert Rules(5, Rate(30, 60.0), 2.5).arg == b"5/30/60000/2500"
    assert Rules(UNLIMITED, None, 1.0).arg == b"%d/0/0/1000" % UNLIMITED


def test_a_semaphore_needs_a_limit_a_rate_or_a_spacing(redis_client: redis.Redis) -> None:
    with pytest.raises(ConfigurationError, match="limit"):
        FairSemaphore(redis_client, "nothing", None)
    only_rate = FairSemaphore(redis_client, "only-rate", None, rate="3/s")
    assert only_rate.limit == UNLIMITED
    assert "rate=3/s" in repr(only_rate)
    for _ in range(3):  # the rate's count, held at once: no concurrency limit stops them
        only_rate.acquire(timeout=0)
    with pytest.raises(SemaphoreUnavailable, match="no concurrency limit"):
        only_rate.acquire(timeout=0)


def test_limit_concurrency_takes_a_rate_and_a_spacing(redis_server: RedisServer) -> None:
    from celery import Celery

    from celery_semaphore import limit_concurrency, semaphore_for

    app = Celery("rated", broker=redis_server.url, set_as_current=False)
    app.conf.semaphore_backend_url = redis_server.url

    @limit_concurrency(5, rate="500/m", spacing=0.5, app=app, lazy=False, shared=False, name="rated.call")
    def call() -> None: ...

    semaphore = semaphore_for(app, "rated.call")
    assert (semaphore.limit, semaphore.rate, semaphore.spacing) == (5, Rate(500, 60.0), 0.5)
    with pytest.raises(ConfigurationError, match="rate"):
        limit_concurrency(5, rate="500 a minute")


def test_a_weight_above_the_rate_is_refused_at_declaration(redis_client: redis.Redis) -> None:
    api = FairSemaphore(redis_client, "api", 10, rate="3/s")
    with pytest.raises(ConfigurationError, match="rate"):
        MultiSemaphore([api], weight=4)


# -- the rules hold ------------------------------------------------------------------------


def test_no_window_holds_more_starts_than_the_rate(redis_server: RedisServer) -> None:
    """4 threads with a backlog against 10 starts per 0.5 s and no concurrency limit: no window of
    0.5 s (server time) ever holds more than 10 grants, and the rate is used in full."""
    client = redis_server.client()
    semaphore = FairSemaphore(client, "rated", None, rate=(10, 0.5), lease=30)
    starts = run_threads(semaphore, client, threads=4, each=10, hold=0.0)
    assert len(starts) == 40
    assert most_in_any_window(starts, 500) == 10
    # four full windows' worth: the last start comes in the fourth window, not later
    assert starts[-1] - starts[0] < 3 * 500 + 200


def test_consecutive_starts_are_never_closer_than_the_spacing(redis_server: RedisServer) -> None:
    """A robots.txt Crawl-delay of 0.1 s with a concurrency limit of 3 and short bodies: the
    limit alone would let starts follow each other at once; the spacing keeps them apart, and
    each start comes soon after its allowed moment (a delayed offer, not a guess)."""
    client = redis_server.client()
    semaphore = FairSemaphore(client, "host", 3, spacing=0.1, lease=30)
    starts = run_threads(semaphore, client, threads=4, each=4, hold=0.01)
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    assert min(gaps) >= 100
    # within a loose bound of the allowed moment (the benchmark measures the real figures)
    assert sorted(gaps)[len(gaps) // 2] < 100 + 50


def test_a_refused_head_is_told_when_its_start_comes(redis_client: redis.Redis) -> None:
    """The head of the line refused by a spacing holds the next start (a delayed offer): its
    refusal says when, a waiter behind it is not told any moment, and a newcomer's one-shot try
    cannot take that start from it even once the moment has come."""
    semaphore = FairSemaphore(redis_client, "spaced", 5, spacing=0.3, lease=30)
    first = semaphore.try_acquire(waiter="first")
    assert isinstance(first, Granted)
    head = semaphore.try_acquire(waiter="head")
    behind = semaphore.try_acquire(waiter="behind")
    assert isinstance(head, Waiting) and isinstance(behind, Waiting)
    assert head.retry_after is not None and 0.2 < head.retry_after <= 0.3
    assert behind.retry_after is None
    deadline = time.monotonic() + head.retry_after
    wait_until(lambda: time.monotonic() >= deadline, timeout=2)
    assert not isinstance(semaphore.try_acquire(), Granted)
    assert isinstance(semaphore.try_acquire(waiter="head"), Granted)
    # and the next start, 0.3 s later, is already reserved for "behind"
    again = semaphore.try_acquire(waiter="behind")
    assert isinstance(again, Waiting) and again.retry_after is not None and again.retry_after > 0.2


def test_a_newcomer_cannot_take_the_start_reserved_for_the_head(redis_client: redis.Redis) -> None:
    """The head, alone in line, holds a delayed offer for the next allowed start; once that
    moment has come and before the head claims it, a newcomer's one-shot try (the uncontended
    fast path) is refused: the start is the head's."""
    semaphore = FairSemaphore(redis_client, "reserved", 5, spacing=0.2, lease=30)
    assert isinstance(semaphore.try_acquire(), Granted)
    head = semaphore.try_acquire(waiter="head")
    assert isinstance(head, Waiting) and head.retry_after is not None
    allowed_at = time.monotonic() + head.retry_after
    wait_until(lambda: time.monotonic() >= allowed_at, timeout=2)
    assert isinstance(semaphore.try_acquire(), Waiting)
    assert isinstance(semaphore.try_acquire(waiter="late"), Waiting)
    assert isinstance(semaphore.try_acquire(waiter="head"), Granted)


def test_starts_under_a_rate_follow_the_order_of_first_asks(redis_client: redis.Redis) -> None:
    """Six waiters queued one after another while a rate of 1 per 0.3 s holds them back start in
    the order they first asked."""
    semaphore = FairSemaphore(redis_client, "fifo", None, rate=(1, 0.3), lease=30)
    assert isinstance(semaphore.try_acquire(), Granted)
    order: list[int] = []
    lock = threading.Lock()

    def waiter(index: int) -> None:
        lease = semaphore.acquire(timeout=30)
        with lock:
            order.append(index)
        lease.release()

    threads = []
    for index in range(6):
        thread = threading.Thread(target=waiter, args=(index,))
        thread.start()
        threads.append(thread)
        queued = index + 1
        # each one stands in line (or has started) before the next asks
        wait_until(lambda queued=queued: semaphore.status().waiter_count + len(order) >= queued, timeout=5)
    for thread in threads:
        thread.join(30)
    assert order == list(range(6))


def test_a_pause_holds_every_start_and_the_head_goes_first(redis_client: redis.Redis) -> None:
    """pause(0.4): nobody starts for 0.4 s (server time), holders keep their slots, and the
    waiter at the head starts first, right when the pause ends."""
    semaphore = FairSemaphore(redis_client, "api", 2, lease=30)
    holder = semaphore.acquire(timeout=0)
    semaphore.pause(0.4)
    paused_at = int(redis_client.time()[0]) * 1000 + int(redis_client.time()[1]) // 1000
    status = semaphore.status()
    assert status.paused_for is not None and 0.3 < status.paused_for <= 0.4
    assert status.rules_source == "override"
    assert isinstance(semaphore.try_acquire(), Waiting)
    results: dict[str, int] = {}

    def take(name: str) -> None:
        with semaphore.acquire(timeout=10) as lease:
            results[name] = granted_ms(redis_client, semaphore, lease.token)

    first = threading.Thread(target=take, args=("first",))
    first.start()
    wait_until(lambda: semaphore.status().waiter_count == 1, timeout=5)
    second = threading.Thread(target=take, args=("second",))
    second.start()
    first.join(10)
    second.join(10)
    assert results["first"] >= paused_at + 400 - 5  # server ms; the pause began before paused_at
    assert results["first"] <= results["second"]
    assert results["first"] - paused_at < 400 + 100
    assert semaphore.renew(holder.token)  # the holder kept its slot through the pause
    holder.release()


def assert_resume_lets_the_head_start_at_once(semaphore: FairSemaphore) -> None:
    """Paused until resumed, a blocked waiter does not start; resume() lets it start at once."""
    semaphore.pause()  # until resumed
    assert semaphore.status().paused_for == math.inf
    granted: list[float] = []

    def take() -> None:
        with semaphore.acquire(timeout=10):
            granted.append(time.monotonic())

    thread = threading.Thread(target=take)
    thread.start()
    wait_until(lambda: semaphore.status().waiter_count == 1, timeout=5)
    assert not granted
    resumed = time.monotonic()
    semaphore.resume()
    thread.join(10)
    assert granted and granted[0] - resumed < 0.5
    assert semaphore.status().paused_for is None


def test_resume_lets_the_head_start_at_once(redis_client: redis.Redis) -> None:
    assert_resume_lets_the_head_start_at_once(FairSemaphore(redis_client, "api", 2, lease=30))


def test_a_runtime_rate_wins_and_lapses_with_its_ttl(redis_client: redis.Redis) -> None:
    semaphore = FairSemaphore(redis_client, "quota", 10, rate="100/s", lease=30)
    semaphore.set_rate((1, 5.0), ttl=0.5)
    status = semaphore.status()
    assert status.rate == Rate(1, 5.0) and status.rules_source == "override"
    assert isinstance(semaphore.try_acquire(), Granted)
    assert isinstance(semaphore.try_acquire(), Waiting)
    wait_until(lambda: semaphore.status().rate == Rate(100, 1.0), timeout=3)
    assert isinstance(semaphore.try_acquire(), Granted)
    semaphore.set_spacing(1.0)
    assert semaphore.status().spacing == 1.0
    semaphore.set_spacing(None)
    assert semaphore.status().spacing is None


def test_a_weighted_acquire_takes_its_weight_of_the_rate(redis_client: redis.Redis) -> None:
    """weight 2 against 4 starts per 0.3 s: two grants fill a window, the third waits for it."""
    api = FairSemaphore(redis_client, "api", None, rate=(4, 0.3), lease=30)
    heavy = MultiSemaphore([api], weight=2)
    started = time.monotonic()
    for _ in range(3):
        heavy.acquire(timeout=5).release()
    assert time.monotonic() - started >= 0.25
    assert most_in_any_window(sorted(int(stamp) for stamp in redis_client.lrange(api.keys.starts, 0, -1)), 300) <= 4


def test_the_starts_kept_stay_bounded(redis_client: redis.Redis) -> None:
    """At most twice the rate's count of start times are kept, however many starts there were."""
    semaphore = FairSemaphore(redis_client, "bounded", None, rate=(5, 0.05), lease=30)
    for _ in range(40):
        semaphore.acquire(timeout=5).release()
    assert redis_client.llen(semaphore.keys.starts) <= 10
    wait_until(lambda: redis_client.exists(semaphore.keys.starts) == 0, timeout=5)


def test_without_rules_nothing_is_kept_for_them(redis_client: redis.Redis) -> None:
    semaphore = FairSemaphore(redis_client, "plain", 2, lease=30)
    semaphore.acquire(timeout=0).release()
    assert redis_client.keys("*") == []


def test_a_weighted_waiter_held_back_by_a_rate_keeps_its_place_past_its_patience(redis_client: redis.Redis) -> None:
    """A MultiSemaphore waiter at the head of its line, refused only by the rate, is told when
    to come back; its place lasts until then even when that is past its patience."""
    api = FairSemaphore(redis_client, "api", None, rate=(2, 1.0), lease=30, patience=0.3)
    heavy = MultiSemaphore([api], weight=2)
    assert isinstance(heavy.try_acquire(), Granted)
    refused = heavy.try_acquire(waiter="heavy")
    assert isinstance(refused, Waiting) and refused.retry_after is not None and refused.retry_after > 0.5
    past_patience = time.monotonic() + 0.5  # past its patience (0.3 s), before its start
    wait_until(lambda: time.monotonic() >= past_patience, timeout=2)
    assert api.status().waiter_count == 1
    assert isinstance(api.try_acquire(waiter="light"), Waiting)  # nobody passes it meanwhile
    wait_until(lambda: isinstance(heavy.try_acquire(waiter="heavy"), Granted), timeout=3)
