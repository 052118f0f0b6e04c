"""Fair share between tenants on one key's line, against real Redis servers.

Most tests build a line with one slot held and read its order from ``status()``: the order is
the acquire script's decision, made when each waiter joins, so reading it needs no timing. One
test runs real threads through ``acquire`` and checks the order in which they start.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio

from celery_semaphore import AsyncFairSemaphore, ConfigurationError, FairSemaphore, SemaphoreUnavailable
from celery_semaphore._core import explain, renewer
from celery_semaphore._core.attempts import Ask, Granted, new_token
from celery_semaphore._core.tenants import Tenant

from ..line_cost import line_cost
from ..redis_server import RedisServer
from ..waiting import wait_until


def join(semaphore: FairSemaphore, waiter: str, tenant: Tenant | None) -> None:
    """One waiter takes its place in the line (the slot is held, so it waits)."""
    attempt = semaphore._try(Ask(token=new_token(), waiter=waiter, tenant=tenant, patience=60))
    assert not attempt.granted


def line(semaphore: FairSemaphore) -> list[str]:
    return [waiter.waiter for waiter in semaphore.status().waiters]


@pytest.fixture
def held(redis_client: redis.Redis) -> FairSemaphore:
    """A key of limit 1 whose one slot is held, with the given shares."""
    semaphore = FairSemaphore(redis_client, "api", 1, shares={"big": 3, "gold:*": 2}, patience=60)
    semaphore.acquire(timeout=0)
    return semaphore


def test_a_second_tenant_is_not_queued_behind_the_first_ones_flood(held: FairSemaphore) -> None:
    """A queues 6, then B queues 3: B's calls go one for one with A's, not behind all six
    (first come, first served inside each tenant)."""
    for n in range(6):
        join(held, f"a{n}", "A")
    for n in range(3):
        join(held, f"b{n}", "B")
    # b0 ties with a1 (one step after the head): the earlier arrival goes first
    assert line(held) == ["a0", "a1", "b0", "a2", "b1", "a3", "b2", "a4", "a5"]


def test_without_tenants_the_line_is_first_come_first_served(held: FairSemaphore) -> None:
    for n in range(4):
        join(held, f"a{n}", None)
    join(held, "b0", None)
    assert line(held) == ["a0", "a1", "a2", "a3", "b0"]


def test_shares_split_the_line_in_proportion(held: FairSemaphore) -> None:
    """Share 3 against share 1: three places for one. A glob gives gold:eu its share of 2."""
    for n in range(8):
        join(held, f"s{n}", "small")
    for n in range(6):
        join(held, f"g{n}", "big")
    order = line(held)
    # after the head, the next eight places hold six of big's and two of small's
    following = order[1:9]
    assert sum(w.startswith("g") for w in following) == 6, order
    assert held.shares.share_of("gold:eu") == 2 and held.shares.share_of("other") == 1


def test_a_runtime_share_wins_over_the_settings_and_can_be_removed(held: FairSemaphore) -> None:
    held.set_share("small", 3)
    for n in range(4):
        join(held, f"b{n}", "big")  # share 3 from the settings
    for n in range(4):
        join(held, f"s{n}", "small")  # share 3 at run time: now equal
    order = line(held)
    assert order.index("s0") < order.index("b2") and order.index("s1") < order.index("b3"), order
    held.set_share("small", None)
    assert not held.client.hexists(held.keys.shares, "small")


def test_ties_break_by_arrival_not_by_name(held: FairSemaphore) -> None:
    """Two tenants one step after the head tie; the one that asked first goes first, whatever
    their names."""
    join(held, "head", "m")
    join(held, "from-z", "zzz")
    join(held, "from-a", "aaa")
    assert line(held) == ["head", "from-z", "from-a"]


def test_leaving_the_line_and_coming_back_saves_no_credit(held: FairSemaphore) -> None:
    """A queues 5 and leaves them all, then asks again: it comes back after its old clock, so
    a tenant that never left (C) goes first: leaving resets nothing."""
    join(held, "b0", "B")
    for n in range(5):
        join(held, f"a{n}", "A")
    for n in range(5):
        assert held.leave(f"a{n}")
    join(held, "a-again", "A")
    join(held, "c0", "C")
    assert line(held) == ["b0", "c0", "a-again"]


def test_an_idle_tenant_comes_back_at_the_lines_clock_with_no_credit_saved(held: FairSemaphore) -> None:
    """B waited once long ago; A then queues many. B comes back one step after the head, not
    ahead of every A call for the time it was idle."""
    join(held, "b-old", "B")
    held.leave("b-old")
    for n in range(6):
        join(held, f"a{n}", "A")
    for n in range(3):
        join(held, f"b{n}", "B")
    order = line(held)
    assert order[:2] == ["a0", "a1"] and order.index("b2") > order.index("a2"), order


def test_idle_tenants_are_forgotten_and_their_clocks_expire(held: FairSemaphore) -> None:
    """200 tenants each wait once and leave: the clocks behind the line's are dropped as the
    next tenant joins, so at most the newest stays, and it expires on its own."""
    for n in range(200):
        join(held, f"w{n}", f"tenant-{n}")
        held.leave(f"w{n}")
    assert held.client.zcard(held.keys.tenants) <= 2
    assert 0 < held.client.pttl(held.keys.tenants) <= 4_500_000  # an hour, and a quarter ahead


def test_reset_forgets_the_clocks_but_keeps_runtime_shares(held: FairSemaphore) -> None:
    held.set_share("A", 2)
    join(held, "a0", "A")
    join(held, "b0", ("org", "B"))
    levels = f"{held.keys.base}:levels"
    assert held.client.exists(levels)
    held.reset()
    assert not held.client.exists(held.keys.tenants)
    assert not held.client.exists(levels)
    assert held.client.hget(held.keys.shares, "A") == b"2"


@pytest.mark.parametrize(
    ("tenant", "reason"),
    [("", "non-empty"), ("a|b", '"|"'), ("x" * 201, "at most 200"), (7, "non-empty string")],
)
def test_a_bad_tenant_is_refused_naming_it(redis_client: redis.Redis, tenant: object, reason: str) -> None:
    semaphore = FairSemaphore(redis_client, "api", 1)
    with pytest.raises(ConfigurationError, match="tenant") as caught:
        semaphore.acquire(timeout=1, tenant=tenant)  # type: ignore[arg-type]
    assert reason in str(caught.value)


@pytest.mark.parametrize("shares", [{"*": 0}, {"*": -1}, {"*": 1001}, {"*": "2"}, {"*": True}, {"": 1}, ["*"]])
def test_bad_shares_are_refused_when_the_semaphore_is_made(redis_client: redis.Redis, shares: object) -> None:
    with pytest.raises(ConfigurationError, match="shares"):
        FairSemaphore(redis_client, "api", 1, shares=shares)  # type: ignore[arg-type]


def places_of_late_threads(redis_server: RedisServer, first: Tenant, late: Tenant) -> list[int]:
    """Real threads in acquire(): 12 calls of ``first`` to a key of limit 2 (10 wait), then 3 of
    ``late``. The late calls' places among the starts after they arrived; every call runs."""
    client = redis_server.client()
    semaphore = FairSemaphore(client, "threads", 2, patience=30)
    started: list[str] = []
    lock = threading.Lock()
    gate = threading.Event()

    def call(name: str, tenant: Tenant) -> None:
        with semaphore.acquire(timeout=60, tenant=tenant):
            with lock:
                started.append(name)
            gate.wait(30)  # the first two hold until the line is built
            time.sleep(0.02)

    threads = [threading.Thread(target=call, args=(f"a{n}", first)) for n in range(12)]
    for thread in threads:
        thread.start()
    wait_until(lambda: semaphore.status().waiter_count == 10, timeout=20, what="the first ten waiters in line")
    b_threads = [threading.Thread(target=call, args=(f"b{n}", late)) for n in range(3)]
    for thread in b_threads:
        thread.start()
    wait_until(lambda: semaphore.status().waiter_count == 13, timeout=20, what="the late three waiters in line")
    before_b = len(started)
    gate.set()
    for thread in threads + b_threads:
        thread.join(60)
    client.close()
    assert len(started) == 15
    # places among the starts after B arrived (thread names say nothing of the order in line)
    return [place for place, name in enumerate(started[before_b:]) if name.startswith("b")]


def test_waiting_threads_of_a_second_tenant_start_soon_after_they_arrive(redis_server: RedisServer) -> None:
    """Tenant A sends 12 calls to a key of limit 2 (10 wait), then B sends 3. B's first call is
    among the next 4 starts, its last among the next 8 (first come, first served would put them
    at 10 to 12)."""
    b_places = places_of_late_threads(redis_server, "A", "B")
    # limit 2: the head's wave of two, then B's first (first come, first served: places 10-12)
    assert b_places[0] <= 3, b_places
    assert b_places[-1] <= 7, b_places


# -- priority ----------------------------------------------------------------------------------


def join_with_priority(semaphore: FairSemaphore, waiter: str, priority: float, tenant: str | None = None) -> None:
    attempt = semaphore._try(Ask(token=new_token(), waiter=waiter, patience=60, priority=priority, tenant=tenant))
    assert not attempt.granted


def test_a_priority_places_a_call_as_if_it_had_asked_that_much_earlier(held: FairSemaphore) -> None:
    """w0 asks; 0.5 s later w1 asks, then p with priority 0.3 s: p goes before w1 (asked less
    than 0.3 s before it) and after w0 (asked more than 0.3 s before it). Then low, priority
    -0.3 s, goes after w2 that asks just after it."""
    join(held, "w0", None)
    first_asked = time.monotonic()
    wait_until(lambda: time.monotonic() - first_asked > 0.5, timeout=5, what="half a second")
    join(held, "w1", None)
    join_with_priority(held, "p", 0.3)
    join_with_priority(held, "low", -0.3)
    join(held, "w2", None)
    assert line(held) == ["w0", "p", "w1", "w2", "low"]


def test_a_priority_is_capped_at_600_seconds(held: FairSemaphore) -> None:
    join(held, "w0", None)
    join_with_priority(held, "urgent", 1e9)
    tickets = {waiter.waiter: waiter.ticket for waiter in held.status().waiters}
    assert 599_000 * 1024 < tickets["w0"] - tickets["urgent"] < 601_000 * 1024


def test_a_priority_with_a_tenant_moves_the_call_ahead_by_its_tenants_starts(held: FairSemaphore) -> None:
    """With a tenant, 3 s of priority is three starts of a share-1 tenant: A's fifth call with
    priority 3 goes three places earlier in A's turns (after a1, which asked first)."""
    for n in range(4):
        join(held, f"a{n}", "A")
    join_with_priority(held, "a-urgent", 3, tenant="A")
    assert line(held) == ["a0", "a1", "a-urgent", "a2", "a3"]


@pytest.mark.parametrize("priority", ["60", True, float("nan"), [1]])
def test_a_bad_priority_is_refused_naming_it(redis_client: redis.Redis, priority: object) -> None:
    semaphore = FairSemaphore(redis_client, "api", 1)
    semaphore.acquire(timeout=0)
    with pytest.raises(ConfigurationError, match="priority"):
        semaphore.acquire(timeout=1, priority=priority)  # type: ignore[arg-type]


# -- a full line -------------------------------------------------------------------------------


def test_a_full_line_refuses_a_newcomer_at_once_and_keeps_those_in_it(redis_client: redis.Redis) -> None:
    """max_waiters 2: with one slot held and two waiting, a third call is refused at once,
    taking no place (SemaphoreUnavailable naming max_waiters); the two in line still ask and
    keep their places, and once one of them is served a newcomer is let in."""
    semaphore = FairSemaphore(redis_client, "full", 1, max_waiters=2, patience=60)
    holder = semaphore.acquire(timeout=0)
    join(semaphore, "w0", None)
    join(semaphore, "w1", None)
    started = time.monotonic()
    with pytest.raises(SemaphoreUnavailable) as caught:
        semaphore.acquire(timeout=30)
    assert time.monotonic() - started < 5, "refused at once, not after the timeout"
    assert caught.value.max_waiters == 2 and "max_waiters" in str(caught.value)
    assert pickle.loads(pickle.dumps(caught.value)).max_waiters == 2
    assert line(semaphore) == ["w0", "w1"]
    join(semaphore, "w0", None)  # a waiter in line asks again: not a newcomer
    holder.release()
    granted = semaphore._try(Ask(token=new_token(), waiter="w0", patience=60))
    assert granted.granted
    join(semaphore, "w2", None)
    assert line(semaphore) == ["w1", "w2"]


def test_a_one_shot_try_on_a_full_line_is_refused_as_any_one_shot_try(redis_client: redis.Redis) -> None:
    semaphore = FairSemaphore(redis_client, "full-once", 1, max_waiters=1, patience=60)
    semaphore.acquire(timeout=0)
    join(semaphore, "w0", None)
    with pytest.raises(SemaphoreUnavailable) as caught:
        semaphore.acquire(timeout=0)
    assert caught.value.max_waiters is None  # it asked for no place: the ordinary refusal


def test_max_waiters_must_be_a_limit(redis_client: redis.Redis) -> None:
    with pytest.raises(ConfigurationError, match="max_waiters"):
        FairSemaphore(redis_client, "full", 1, max_waiters=0)


def test_tenants_reports_the_largest_backlogs_with_their_shares(held: FairSemaphore) -> None:
    """The backlog of a tenant is read from its clock: its calls waiting behind the head (an
    estimate when its share changed since they joined)."""
    assert held.tenants() == []
    held.set_share("B", 2)
    for n in range(6):
        join(held, f"a{n}", "A")
    for n in range(3):
        join(held, f"b{n}", "B")
    for n in range(4):
        join(held, f"g{n}", "big")
    report = held.tenants()
    assert [(t.tenant, t.backlog) for t in report] == [("A", 5), ("big", 4), ("B", 3)]
    assert [(t.share, t.runtime_share) for t in report] == [(1.0, False), (3.0, False), (2.0, True)]
    assert [t.tenant for t in held.tenants(most=1)] == ["A"]


def test_drop_oldest_evicts_the_oldest_waiter_which_learns_it_when_it_asks(redis_client: redis.Redis) -> None:
    """max_waiters 2, drop_oldest: a third call joins and the oldest waiter loses its place;
    asking again (with its ticket, as a re-sent task would) it is told so, and cannot rejoin."""
    semaphore = FairSemaphore(redis_client, "drop", 1, max_waiters=2, on_full="drop_oldest", patience=60)
    semaphore.acquire(timeout=0)
    first = semaphore._try(Ask(token=new_token(), waiter="w0", patience=60))
    join(semaphore, "w1", None)
    join(semaphore, "w2", None)
    assert line(semaphore) == ["w1", "w2"]
    with pytest.raises(SemaphoreUnavailable) as caught:
        semaphore._try(Ask(token=new_token(), waiter="w0", ticket=first.ticket, patience=60))  # type: ignore[union-attr]
    assert caught.value.evicted == "drop_oldest" and "dropped" in str(caught.value)
    assert line(semaphore) == ["w1", "w2"]


def test_a_blocked_waiter_dropped_from_its_line_is_told_at_once(redis_client: redis.Redis) -> None:
    """A thread waiting in acquire() whose place is dropped raises within a second (it is
    told, not left to find out at its next keep-alive ask, patience / 3 = 20 s)."""
    semaphore = FairSemaphore(redis_client, "drop-told", 1, max_waiters=1, on_full="drop_oldest", patience=60)
    holder = semaphore.acquire(timeout=0)
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            semaphore.acquire(timeout=60)
        except SemaphoreUnavailable as error:
            raised.append(error)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: semaphore.status().waiter_count == 1, timeout=10, what="the thread in line")
    join(semaphore, "newcomer", None)
    started = time.monotonic()
    thread.join(10)
    assert raised and time.monotonic() - started < 1.0, raised
    holder.release()


def test_keep_latest_gives_the_older_calls_place_to_the_newer_one_of_its_coalesce_key(
    redis_client: redis.Redis,
) -> None:
    """keep_latest: a refresh of "dash" while one waits takes its place (ahead of x that asked
    between them); the older one is told it was replaced. Other keys are untouched."""
    semaphore = FairSemaphore(redis_client, "coalesce", 1, on_full="keep_latest", patience=60)
    semaphore.acquire(timeout=0)
    older = semaphore._try(Ask(token=new_token(), waiter="dash-1", coalesce="dash", patience=60))
    semaphore._try(Ask(token=new_token(), waiter="x", coalesce="other", patience=60))
    semaphore._try(Ask(token=new_token(), waiter="dash-2", coalesce="dash", patience=60))
    assert line(semaphore) == ["dash-2", "x"]
    with pytest.raises(SemaphoreUnavailable) as caught:
        semaphore._try(Ask(token=new_token(), waiter="dash-1", ticket=older.ticket, coalesce="dash", patience=60))  # type: ignore[union-attr]
    assert caught.value.evicted == "keep_latest" and "newer" in str(caught.value)


def test_a_full_line_policy_is_checked_when_the_semaphore_is_made(redis_client: redis.Redis) -> None:
    with pytest.raises(ConfigurationError, match="on_full"):
        FairSemaphore(redis_client, "p", 1, max_waiters=3, on_full="newest")
    with pytest.raises(ConfigurationError, match="needs max_waiters"):
        FairSemaphore(redis_client, "p", 1, on_full="drop_oldest")


# -- the same from coroutines ------------------------------------------------------------------


def test_coroutines_take_tenant_priority_and_a_full_line_as_threads_do(redis_server: RedisServer) -> None:
    """AsyncFairSemaphore.acquire(tenant=..., priority=...) places coroutines in the same line
    as blocking callers, by the same rules: B's coroutine one for one with A's calls, the
    urgent one (priority 600) at the head. Its full line drops the oldest waiter, the urgent
    coroutine, which is told at once and raises."""
    blocking = FairSemaphore(redis_server.client(), "mixed", 1, patience=60, max_waiters=6, on_full="drop_oldest")
    holder = blocking.acquire(timeout=0)
    for n in range(3):
        join(blocking, f"A-{n}", "A")

    async def until_true(condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, "not within 10 s"
            await asyncio.sleep(0.01)

    async def main() -> None:
        client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port)
        sem = AsyncFairSemaphore(client, "mixed", 1, patience=60, max_waiters=6, on_full="drop_oldest")
        b = asyncio.ensure_future(sem.acquire(timeout=30, tenant="B"))
        await until_true(lambda: blocking.status().waiter_count == 4)
        urgent = asyncio.ensure_future(sem.acquire(timeout=30, priority=600))
        await until_true(lambda: blocking.status().waiter_count == 5)
        order = line(blocking)
        # coroutines' waiter ids are random hex: they are the places no "A-" call holds
        assert [place for place, waiter in enumerate(order) if not waiter.startswith("A-")] == [0, 3], order
        join(blocking, "A-3", "A")  # six in line: the next newcomer drops the oldest, the urgent one
        join(blocking, "A-4", "A")
        with pytest.raises(SemaphoreUnavailable) as caught:
            await asyncio.wait_for(urgent, 5)
        assert caught.value.evicted == "drop_oldest"
        b.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await b
        await client.aclose()

    asyncio.run(main())
    holder.release()


# -- two levels: (org, user) ------------------------------------------------------------------


class Serving:
    """A key of limit 1 whose one slot is held, with waiters joined by hand: ``serve`` gives the
    slot back and has the waiter it is offered to claim it, start after start. Which waiter of
    an org takes the org's start is decided when the slot is handed on, so it is read here from
    the offers, not from the line's order."""

    def __init__(self, client: redis.Redis, shares: dict[str, float] | None = None) -> None:
        self.semaphore = FairSemaphore(client, "api", 1, shares=shares, patience=60)
        self.token = new_token()
        assert self.semaphore._try(Ask(token=self.token, waiter=new_token())).granted
        self.tenants: dict[str, Tenant | None] = {}

    def join(self, waiter: str, tenant: Tenant | None) -> None:
        self.tenants[waiter] = tenant
        join(self.semaphore, waiter, tenant)

    def serve(self, starts: int) -> list[str]:
        client = self.semaphore.client
        order = []
        for _ in range(starts):
            assert self.semaphore.release(self.token)
            holders: list[bytes] = client.zrange(self.semaphore.keys.holders, 0, -1)  # type: ignore[assignment]
            offered = [member.decode()[1:] for member in holders if member.startswith(b"!")]
            assert len(offered) == 1, offered
            waiter = offered[0]
            self.token = new_token()
            attempt = self.semaphore._try(
                Ask(token=self.token, waiter=waiter, tenant=self.tenants[waiter], patience=60)
            )
            assert attempt.granted, (waiter, attempt)
            order.append(waiter)
        return order


def test_an_org_gets_no_more_by_spreading_its_calls_over_more_user_names(redis_client: redis.Redis) -> None:
    """Org "one" queues 40 calls under one user; org "fifty" queues 2 calls under each of 50
    users. The starts alternate between the two orgs, whatever the number of names."""
    serving = Serving(redis_client)
    for n in range(40):
        serving.join(f"one-{n}", ("one", "u"))
    for n in range(100):
        serving.join(f"fifty-{n}", ("fifty", f"user-{n % 50}"))
    order = serving.serve(60)
    ones = sum(waiter.startswith("one-") for waiter in order)
    assert 29 <= ones <= 31, order
    # inside the org of one user, its calls in their order
    assert [w for w in order if w.startswith("one-")] == [f"one-{n}" for n in range(ones)]


def test_a_user_who_joins_an_orgs_backlog_late_is_served_next_not_behind_it(redis_client: redis.Redis) -> None:
    """Inside one org, user A queues 6 calls, then user B 3: the org's starts go one for one
    between A and B from B's arrival (first come, first served inside each user), although
    B's calls joined the line behind all of A's."""
    serving = Serving(redis_client)
    for n in range(6):
        serving.join(f"a{n}", ("org", "A"))
    for n in range(3):
        serving.join(f"b{n}", ("org", "B"))
    assert line(serving.semaphore) == ["a0", "a1", "a2", "a3", "a4", "a5", "b0", "b1", "b2"]
    # b0 ties with a1 (one step after the org's first): the earlier arrival goes first
    assert serving.serve(9) == ["a0", "a1", "b0", "a2", "b1", "a3", "b2", "a4", "a5"]


def test_users_split_their_orgs_starts_by_their_shares_and_orgs_stay_even(redis_client: redis.Redis) -> None:
    """A user's share is that of "<org>/<user>": 3 against 1 inside org "acme", whose starts
    stay one for one with org "solo"'s."""
    serving = Serving(redis_client, shares={"acme/ceo": 3})
    for n in range(8):
        serving.join(f"intern-{n}", ("acme", "intern"))
    for n in range(8):
        serving.join(f"ceo-{n}", ("acme", "ceo"))
    for n in range(16):
        serving.join(f"solo-{n}", ("solo", "only"))
    order = serving.serve(16)
    acme = [w for w in order if not w.startswith("solo-")]
    assert 7 <= len(acme) <= 9, order
    # after the first intern call (the org's first in line), three of the ceo's for one of the intern's
    assert sum(w.startswith("ceo-") for w in acme[1:]) >= 5, acme


def test_a_runtime_share_of_a_user_is_stored_under_its_org(redis_client: redis.Redis) -> None:
    serving = Serving(redis_client)
    serving.semaphore.set_share("acme/ceo", 3)
    for n in range(4):
        serving.join(f"intern-{n}", ("acme", "intern"))
    for n in range(4):
        serving.join(f"ceo-{n}", ("acme", "ceo"))
    assert serving.serve(5) == ["intern-0", "ceo-0", "ceo-1", "ceo-2", "intern-1"]


def test_two_level_waiters_leave_nothing_behind_once_served(redis_client: redis.Redis) -> None:
    """The user tags live in the levels key only while their waiters are in line: it goes
    with the line, and the org under each waiter's info with the waiter."""
    serving = Serving(redis_client)
    for n in range(3):
        serving.join(f"a{n}", ("org", "A"))
        serving.join(f"b{n}", ("org", "B"))
    levels = f"{serving.semaphore.keys.base}:levels"
    assert redis_client.zcard(levels) == 12  # two entries a waiter
    assert 0 < redis_client.pttl(levels) <= 4_500_000
    serving.serve(6)
    assert not redis_client.exists(levels)
    fields: list[bytes] = redis_client.hkeys(serving.semaphore.keys.waiter_info)  # type: ignore[assignment]
    assert not [field for field in fields if field.startswith(b"t:")]


def test_plain_one_level_and_two_level_waiters_share_one_line(redis_client: redis.Redis) -> None:
    """Calls without a tenant, with one and with two levels on one key: each start goes to
    the head of the line as it stood, but for a two-level head, which may give its place to a
    user of its org further back."""
    serving = Serving(redis_client)
    serving.join("plain-0", None)
    serving.join("solo-0", "solo")
    serving.join("org-a0", ("org", "A"))
    serving.join("org-a1", ("org", "A"))
    serving.join("plain-1", None)
    serving.join("org-a2", ("org", "A"))
    serving.join("org-b0", ("org", "B"))
    before = line(serving.semaphore)
    order = serving.serve(7)
    assert sorted(order) == sorted(before)
    assert [w for w in order if not w.startswith("org-")] == [w for w in before if not w.startswith("org-")]
    # B joined the org behind A's three: one step after the org's first waiting call, where it
    # ties with a1, which asked first
    assert [w for w in before if w.startswith("org-")] == ["org-a0", "org-a1", "org-a2", "org-b0"]
    assert [w for w in order if w.startswith("org-")] == ["org-a0", "org-a1", "org-b0", "org-a2"]


@pytest.mark.parametrize(
    ("tenant", "reason"),
    [(("org",), "pair"), (("org", ""), "non-empty"), (("o|x", "u"), '"|"'), (("org", "u", "x"), "pair")],
)
def test_a_bad_pair_of_tenants_is_refused_naming_the_level(
    redis_client: redis.Redis, tenant: object, reason: str
) -> None:
    semaphore = FairSemaphore(redis_client, "api", 1)
    with pytest.raises(ConfigurationError, match="tenant") as caught:
        semaphore.acquire(timeout=1, tenant=tenant)  # type: ignore[arg-type]
    assert reason in str(caught.value)


def test_two_levels_hold_on_a_cluster_and_behind_sentinel(topology_client: Any) -> None:
    """The user tags' key is named from the semaphore's own keys, in their hash tag: every
    script that hands a slot on reaches it on the cluster slot of the rest."""
    serving = Serving(topology_client)
    for n in range(4):
        serving.join(f"a{n}", ("org", "A"))
    serving.join("b0", ("org", "B"))
    serving.join("solo-0", ("solo", "only"))
    order = serving.serve(6)
    assert order.index("b0") < order.index("a2"), order
    assert order.index("solo-0") <= 2, order


def test_waiting_threads_of_a_late_user_start_soon_inside_their_org(redis_server: RedisServer) -> None:
    """The same with every call of one org: user A's 12, then user B's 3. B's calls come one
    for one with A's from its arrival (first come, first served in the org would put them at 10
    to 12): the starts are handed on by releases, which choose B's waiters, and told."""
    b_places = places_of_late_threads(redis_server, ("org", "A"), ("org", "B"))
    assert b_places[0] <= 3, b_places
    assert b_places[-1] <= 7, b_places


def test_coroutines_take_two_levels_as_threads_do(redis_server: RedisServer) -> None:
    """AsyncFairSemaphore places an (org, user) call by the same script: a late user's
    coroutine is served before the backlog of its org's first user, its start handed on by
    a release and told."""
    blocking = FairSemaphore(redis_server.client(), "async-levels", 1, patience=60)
    holder = blocking.acquire(timeout=0)

    async def main() -> list[str]:
        client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port)
        sem = AsyncFairSemaphore(client, "async-levels", 1, patience=60)
        started: list[str] = []

        async def call(name: str, user: str) -> None:
            async with sem.acquire(timeout=30, tenant=("org", user)):
                started.append(name)

        async def until_waiting(count: int) -> None:
            deadline = time.monotonic() + 10
            while blocking.status().waiter_count != count:
                assert time.monotonic() < deadline, f"{count} waiters not within 10 s"
                await asyncio.sleep(0.01)

        calls = []
        for n in range(4):
            calls.append(asyncio.ensure_future(call(f"a{n}", "A")))
            await until_waiting(n + 1)
        calls.append(asyncio.ensure_future(call("b0", "B")))
        await until_waiting(5)
        holder.release()
        await asyncio.wait_for(asyncio.gather(*calls), 30)
        await client.aclose()
        return started

    started = asyncio.run(main())
    assert started.index("b0") < started.index("a2"), started


# -- a cap per tenant ---------------------------------------------------------------------------


class Capped:
    """A key of limit 3 with a cap of 2 slots per tenant, its three slots held by plain
    holders, and waiters joined by hand; ``free_one`` gives one plain slot back and reports
    who the hand-off offered it to."""

    def __init__(self, client: redis.Redis, shares: dict[str, float] | None = None) -> None:
        self.semaphore = FairSemaphore(client, "capped", 3, per_tenant=2, shares=shares, patience=60)
        self.plain = [new_token() for _ in range(3)]
        for token in self.plain:
            assert self.semaphore._try(Ask(token=token, waiter=new_token())).granted
        self.client = client

    def join(self, waiter: str, tenant: Tenant | None) -> None:
        join(self.semaphore, waiter, tenant)

    def offered(self) -> set[str]:
        holders: list[bytes] = self.client.zrange(self.semaphore.keys.holders, 0, -1)  # type: ignore[assignment]
        return {member.decode()[1:] for member in holders if member.startswith(b"!")}

    def free_one(self) -> set[str]:
        before = self.offered()
        assert self.semaphore.release(self.plain.pop())
        return self.offered() - before

    def claim(self, waiter: str, tenant: Tenant | None) -> str:
        token = new_token()
        assert self.semaphore._try(Ask(token=token, waiter=waiter, tenant=tenant, patience=60)).granted
        return token


def test_a_tenant_at_its_cap_is_passed_over_for_the_next_tenant_in_line(redis_client: redis.Redis) -> None:
    """Share 10 puts A's six calls before B's two; the cap (2) gives A the first two freed
    slots, and the third to B's first call, not to A's third: no slot idles while B waits."""
    capped = Capped(redis_client, shares={"A": 10})
    for n in range(6):
        capped.join(f"a{n}", "A")
    for n in range(2):
        capped.join(f"b{n}", "B")
    assert line(capped.semaphore)[:3] == ["a0", "a1", "a2"]
    assert capped.free_one() == {"a0"}
    assert capped.free_one() == {"a1"}
    assert capped.free_one() == {"b0"}
    # A's two offers are claimed: its holders stay at the cap, its next call waits on
    a0 = capped.claim("a0", "A")
    capped.claim("a1", "A")
    capped.claim("b0", "B")
    # a holder of A gives its slot back: A is below its cap again, and its next call comes first
    assert capped.semaphore.release(a0)
    assert capped.offered() == {"a2"}


def test_a_cap_leaves_a_slot_free_only_while_no_other_tenant_waits(redis_client: redis.Redis) -> None:
    """Only A waits: its third call waits though a slot is free (the cap holds), and a call of
    B that comes then takes the free slot at once; so does a call without a tenant."""
    capped = Capped(redis_client)
    for n in range(3):
        capped.join(f"a{n}", "A")
    assert capped.free_one() == {"a0"}
    assert capped.free_one() == {"a1"}
    assert capped.free_one() == set()  # A holds its cap: the slot stays free
    assert capped.offered() == {"a0", "a1"}  # the two slots A holds (offered, not claimed yet)
    b = capped.semaphore._try(Ask(token=new_token(), waiter="b0", tenant="B", patience=60))
    assert b.granted
    # a one-shot try of A is refused by the cap too, though it takes no place in line
    with pytest.raises(SemaphoreUnavailable):
        capped.semaphore.acquire(timeout=0, tenant="A")


def test_a_one_shot_try_respects_the_cap(redis_client: redis.Redis) -> None:
    semaphore = FairSemaphore(redis_client, "one-shot-cap", 5, per_tenant=1)
    first = semaphore.acquire(timeout=0, tenant="A")
    with pytest.raises(SemaphoreUnavailable):
        semaphore.acquire(timeout=0, tenant="A")
    other = semaphore.acquire(timeout=0, tenant="B")
    plain = semaphore.acquire(timeout=0)
    first.release()
    again = semaphore.acquire(timeout=0, tenant="A")  # A's holder gave its slot back
    for lease in (other, plain, again):
        lease.release()


def test_a_cap_counts_an_orgs_slots_whatever_its_users(redis_client: redis.Redis) -> None:
    """With two levels the cap is the org's: two users of one org share its two slots."""
    capped = Capped(redis_client, shares={"big": 10})
    capped.join("u0", ("big", "u"))
    capped.join("v0", ("big", "v"))
    capped.join("w0", ("big", "w"))
    capped.join("s0", ("small", "s"))
    offers = capped.free_one() | capped.free_one() | capped.free_one()
    assert offers == {"u0", "v0", "s0"}, offers


def test_a_lapsed_holder_no_longer_counts_against_its_tenants_cap(redis_server: RedisServer) -> None:
    """The slots of a tenant are counted from the holders themselves: a holder whose process
    died without a release (its renewals stopped) stops counting when its lease lapses, and the
    tenant's next call gets the slot."""
    client = redis_server.client()
    semaphore = FairSemaphore(client, "lapse-cap", 5, per_tenant=1, lease=1, patience=60)
    attempt = semaphore._try(Ask(token=new_token(), waiter=new_token(), tenant="A"))
    assert isinstance(attempt, Granted)
    renewer.forget(attempt.lease)  # what a killed process does: no more renewals
    join(semaphore, "a1", "A")  # waits: A holds its cap
    wait_until(
        lambda: semaphore._try(Ask(token=new_token(), waiter="a1", tenant="A", patience=60)).granted,
        timeout=10,
        what="A's next call to get the slot of its lapsed holder",
    )
    client.close()


# -- cost ---------------------------------------------------------------------------------------


def _costs_measured_twice_if_apart(client: Any, few: Callable[[int], Any], many: Callable[[int], Any]) -> Any:
    """The cost of a line of 100,000 over ``few`` tenants and over ``many``, measured again (both)
    once if the second is beyond 2x the first: one measurement on a shared 2-core host gave
    2.08x, its Redis calls the same, and a line whose cost grew with its tenants would be
    hundreds of times dearer in both."""
    for _ in range(2):
        low = line_cost(client, "cost", 100_000, few)
        high = line_cost(client, "cost", 100_000, many)
        if high.join_us <= 2 * low.join_us and high.cycle_us <= 2 * low.cycle_us:
            break
    return low, high


@pytest.mark.slow
def test_a_line_of_100000_waiters_costs_the_same_over_10000_tenants_as_over_10(own_redis: RedisServer) -> None:
    """100,000 waiters over 10 tenants, then over 10,000 tenants, then over 10,000 users of 100
    orgs (two levels) against 10 users of 10 orgs: a join, and a release handing the slot on
    with its claim, stay within 2x of the server time with 10 (median of 5 rounds of 100), and
    a hand-off cycle makes the same Redis calls whatever the number of tenants."""
    client = own_redis.client()
    ten, many = _costs_measured_twice_if_apart(client, lambda n: f"t{n % 10}", lambda n: f"t{n % 10_000}")
    assert many.join_us <= 2 * ten.join_us, (ten, many)
    assert many.cycle_us <= 2 * ten.cycle_us, (ten, many)
    assert many.cycle_calls == ten.cycle_calls, (ten, many)
    few_users, many_users = _costs_measured_twice_if_apart(
        client, lambda n: (f"o{n % 10}", f"u{n % 10}"), lambda n: (f"o{n % 100}", f"u{(n // 100) % 100}")
    )
    assert many_users.join_us <= 2 * few_users.join_us, (few_users, many_users)
    assert many_users.cycle_us <= 2 * few_users.cycle_us, (few_users, many_users)
    client.close()


def test_why_says_a_waiter_is_held_back_by_its_tenants_cap(redis_client: redis.Redis) -> None:
    """A waiter of a tenant at its cap, with a slot free: the read-only look says the cap holds it
    back, with the tenant and its slots, where it would say "line" for the head of the line."""
    capped = Capped(redis_client)
    for n in range(3):
        capped.join(f"a{n}", "A")
    assert capped.free_one() | capped.free_one() | capped.free_one() == {"a0", "a1"}  # and a free slot
    keys, rules = capped.semaphore.keys, capped.semaphore.rules.arg
    [a2] = explain.look(redis_client, [explain.Look("capped", keys, "a2", "none:*", rules)])
    assert a2.blocked_by() == explain.TENANT_CAP
    assert a2.place is not None and (a2.place.tenant, a2.place.tenant_slots, a2.per_tenant) == ("A", 2, 2)
    assert a2.free == 1
