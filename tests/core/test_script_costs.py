"""What the scripts cost in Redis: calls per operation (INFO commandstats) and server time at a
line of 100,000 waiters, pinned so they cannot creep back."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from celery_semaphore import FairSemaphore, Granted, MultiSemaphore, Waiting
from celery_semaphore._core import renewer
from celery_semaphore._core.attempts import Ask, new_token
from celery_semaphore._core.scripts import SemaphoreKeys
from celery_semaphore.errors import SemaphoreUnavailable

from ..commandstats import command_calls, scripted
from ..conftest import FLAVOURS, emptied_server, servers_by_flavour
from ..redis_server import RedisServer
from ..waiting import wait_until


@pytest.fixture(scope="module")
def _servers_of_this_module() -> Iterator[dict[str, RedisServer]]:
    yield from servers_by_flavour()


@pytest.fixture(params=list(FLAVOURS))
def redis_server(request: pytest.FixtureRequest, _servers_of_this_module: dict[str, RedisServer]) -> RedisServer:
    """A Redis of each flavour that only this module knows. These tests count every command the
    server runs (INFO commandstats), so no background thread another test left in the process (a
    lease renewer, the sweeper of a Celery app's parked tasks) may run anything on it: a script
    of one of those landing in a measurement is the likely cause of a hand-off counted as 3
    scripts instead of 2, once, in a full CI run."""
    return emptied_server(_servers_of_this_module, request.param)


# Redis calls of one uncontended acquire + release, made inside the two scripts (EVALSHA itself
# not counted). Acquire: TIME, MGET limit and gate, ZCARD holders, ZCARD present, ZADD, HSET,
# 2 x PEXPIRE; release: ZREM, EXISTS, HDEL. The budget is 12; the first version made 34.
CYCLE_CALLS = 11
# With a rate, the acquire also reads the start leaving the window (LINDEX) and notes its own
# (LPUSH, PEXPIRE; an LTRIM once per rate-count starts). The budget with a rate is 14.
RATED_CYCLE_CALLS = 14


def evalsha_usec(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return int(stats["cmdstat_evalsha"]["usec"]) if "cmdstat_evalsha" in stats else 0


def test_an_uncontended_cycle_makes_eleven_redis_calls(redis_client: redis.Redis) -> None:
    """acquire(timeout=0) + release: 2 EVALSHA running 11 Redis calls, no PUBLISH, no PEXPIRE beyond
    the two keys it writes; the same again on a second cycle (nothing piles up)."""
    semaphore = FairSemaphore(redis_client, "cost", 3)
    semaphore.acquire(timeout=0).release()  # loads the scripts
    for _ in range(2):
        redis_client.config_resetstat()
        semaphore.acquire(timeout=0).release()
        counts = command_calls(redis_client)
        assert counts["evalsha"] == 2
        assert scripted(counts) == CYCLE_CALLS, counts
        assert "publish" not in counts
        assert counts["pexpire"] == 2


def test_an_uncontended_cycle_with_a_rate_makes_at_most_fourteen_calls(redis_client: redis.Redis) -> None:
    """With a rate, the cycle adds the window's check and the start's note: 14 calls, an LTRIM
    once per rate-count starts on top (counted here over 2 x 40 cycles, at most 1 per 20)."""
    semaphore = FairSemaphore(redis_client, "cost-rated", 3, rate="20/s")
    semaphore.acquire(timeout=0).release()
    redis_client.config_resetstat()
    semaphore.acquire(timeout=0).release()
    counts = command_calls(redis_client)
    assert counts["evalsha"] == 2
    assert scripted(counts) == RATED_CYCLE_CALLS, counts
    assert counts["lindex"] == 1 and counts["lpush"] == 1
    trimmed = 0
    for _ in range(2):
        redis_client.delete(semaphore.keys.starts)  # a fresh window: nothing waits for it
        redis_client.config_resetstat()
        for _ in range(20):
            semaphore.acquire(timeout=0).release()
        counts = command_calls(redis_client)
        trimmed += counts.get("ltrim", 0)
        assert scripted(counts) - counts.get("ltrim", 0) == 20 * RATED_CYCLE_CALLS, counts
    assert trimmed <= 2


def test_a_pause_set_and_cleared_leaves_the_uncontended_cycle_as_it_was(redis_client: redis.Redis) -> None:
    semaphore = FairSemaphore(redis_client, "cost-paused", 3)
    semaphore.pause(5)
    semaphore.resume()
    redis_client.config_resetstat()
    semaphore.acquire(timeout=0).release()
    assert scripted(command_calls(redis_client)) == CYCLE_CALLS


def test_a_tenant_costs_an_uncontended_cycle_nothing(redis_client: redis.Redis) -> None:
    """acquire(timeout=10, tenant=...) with a slot free: the same one round trip and 11 calls
    as without a tenant. A tenant's clock moves only when its call has to wait."""
    semaphore = FairSemaphore(redis_client, "cost-tenant", 3, shares={"big": 4})
    semaphore.acquire(timeout=10, tenant="big").release()
    redis_client.config_resetstat()
    semaphore.acquire(timeout=10, tenant="big").release()
    counts = command_calls(redis_client)
    assert counts["evalsha"] == 2
    assert scripted(counts) == CYCLE_CALLS, counts
    assert not redis_client.exists(semaphore.keys.tenants)


def test_a_blocking_acquire_uncontended_is_the_same_single_round_trip(redis_client: redis.Redis) -> None:
    """acquire(timeout=10) with a slot free tries first: one EVALSHA, no SUBSCRIBE, no PUBLISH,
    no connection opened for it."""
    semaphore = FairSemaphore(redis_client, "cost-blocking", 3)
    semaphore.acquire(timeout=10).release()
    redis_client.config_resetstat()
    connections = redis_client.info("stats")["total_connections_received"]
    semaphore.acquire(timeout=10).release()
    counts = command_calls(redis_client)
    assert counts["evalsha"] == 2
    assert scripted(counts) == CYCLE_CALLS, counts
    assert not {"subscribe", "publish"} & set(counts)
    assert redis_client.info("stats")["total_connections_received"] == connections


def test_a_contended_cycle_stays_bounded(redis_client: redis.Redis) -> None:
    """A refused try, the release that offers the slot, and the claim: a bounded number of calls
    (pinned loosely, so that a change that adds a scan or a loop shows up)."""
    semaphore = FairSemaphore(redis_client, "cost-line", 1, patience=30)
    holder = semaphore.acquire(timeout=0)
    redis_client.config_resetstat()
    assert isinstance(semaphore.try_acquire(waiter="w"), Waiting)
    refused = scripted(command_calls(redis_client))
    redis_client.config_resetstat()
    holder.release()
    release = scripted(command_calls(redis_client))
    redis_client.config_resetstat()
    claimed = semaphore.try_acquire(waiter="w")
    claim = scripted(command_calls(redis_client))
    assert isinstance(claimed, Granted)
    claimed.lease.release()
    assert refused <= 25, refused  # the first refusal also gives four new keys their expiry
    assert release <= 19, release
    assert claim <= 16, claim


def test_a_grant_beside_other_holders_makes_eight_calls_and_no_pexpire(redis_client: redis.Redis) -> None:
    """The two holder keys' expiry covers the next lease already: a PTTL each, no PEXPIRE, on
    every grant (PEXPIRE GT refused an equal deadline within one millisecond and then needed a
    PTTL as well: 10 calls, for most grants of a busy key)."""
    semaphore = FairSemaphore(redis_client, "cost-beside", 5)
    held = [semaphore.acquire(timeout=0)]
    for _ in range(2):
        redis_client.config_resetstat()
        held.append(semaphore.acquire(timeout=0))
        counts = command_calls(redis_client)
        assert scripted(counts) == 8, counts
        assert "pexpire" not in counts and counts["pttl"] == 2, counts
    for lease in held:
        lease.release()


def test_a_one_shot_try_refused_on_a_full_key_makes_eight_calls(redis_client: redis.Redis) -> None:
    """acquire(timeout=0) and try_acquire(enqueue=False) when every slot is held and none has
    lapsed: refused on the fast path (no purge), 8 calls (was 11); still granted when a holder's
    lease lapsed or when the try repeats a granted one."""
    semaphore = FairSemaphore(redis_client, "cost-full", 2, lease=30)
    held = [semaphore.acquire(timeout=0), semaphore.acquire(timeout=0)]
    redis_client.config_resetstat()
    with pytest.raises(SemaphoreUnavailable):
        semaphore.acquire(timeout=0)
    counts = command_calls(redis_client)
    assert scripted(counts) == 8, counts
    assert "zrangebyscore" not in counts, counts
    redis_client.config_resetstat()
    refused = semaphore.try_acquire(enqueue=False)
    assert isinstance(refused, Waiting) and (refused.free, refused.limit, refused.position) == (0, 2, 0)
    assert scripted(command_calls(redis_client)) == 8
    again = semaphore.try_acquire(token=held[0].token, enqueue=False)
    assert isinstance(again, Granted), "a repeat of a granted try is granted again"
    renewer.forget(again.lease)  # held[0] holds that slot (and releases it below)
    renewer.forget(held[1])
    redis_client.zadd(semaphore.keys.holders, {held[1].token: 1})  # its lease lapsed
    lapsed = semaphore.try_acquire(enqueue=False)
    assert isinstance(lapsed, Granted), "a lapsed lease's slot is taken"
    lapsed.lease.release()
    held[0].release()


def test_a_key_without_rules_never_touches_the_rule_keys(redis_client: redis.Redis) -> None:
    """No rate, spacing or pause: grants, refusals, a line, a hand-off and a claim read the gate
    only in the one MGET that reads the limit (none more than once per script), and nothing
    names the starts list: no list command runs, and the key never exists."""
    semaphore = FairSemaphore(redis_client, "cost-plain", 1, patience=30)
    semaphore.acquire(timeout=0).release()
    redis_client.config_resetstat()
    holder = semaphore.acquire(timeout=0)
    with pytest.raises(SemaphoreUnavailable):
        semaphore.acquire(timeout=0)
    assert isinstance(semaphore.try_acquire(waiter="w"), Waiting)
    holder.release()  # offered to w
    claimed = semaphore.try_acquire(waiter="w")
    assert isinstance(claimed, Granted)
    assert isinstance(semaphore.try_acquire(waiter="v"), Waiting)
    claimed.lease.release()
    assert isinstance(semaphore.try_acquire(waiter="v"), Granted)
    counts = command_calls(redis_client)
    assert not {"lindex", "lpush", "ltrim", "lrange", "llen", "get"} & set(counts), counts
    assert counts["mget"] <= counts["evalsha"], counts
    assert not redis_client.exists(semaphore.keys.starts)
    semaphore.reset()


def test_status_and_purge_stay_cheap_at_100000_waiters(redis_client: redis.Redis) -> None:
    """With 100,000 waiters in line, status counts them in O(log n) (exact count, well under a
    millisecond of Redis time without listing) and a purge of 100,000 lapsed waiters runs in
    bounded steps of 100 per script (each step well under a few ms)."""
    semaphore = FairSemaphore(redis_client, "crowd", 1, patience=300)
    keys = SemaphoreKeys.of(semaphore.prefix, semaphore.name)
    holder = semaphore.acquire(timeout=0)
    n = 100_000
    now_ms = int(redis_client.time()[0]) * 1000
    for first in range(0, n, 10_000):
        members = {f"w{i:06d}": now_ms * 1024 + i for i in range(first, first + 10_000)}
        pipe = redis_client.pipeline(transaction=False)
        pipe.zadd(keys.queue, members)
        pipe.zadd(keys.present, members)
        pipe.zadd(keys.deadlines, {w: now_ms + 300_000 for w in members})
        pipe.hset(keys.waiter_info, mapping={f"w:{w}": f"{now_ms}|" for w in members})
        pipe.execute()
    for key in (keys.queue, keys.present, keys.deadlines, keys.waiter_info):
        redis_client.pexpire(key, 600_000)

    redis_client.config_resetstat()
    status = semaphore.status(listed=0)
    counting_usec = evalsha_usec(redis_client)
    assert (status.holder_count, status.waiter_count) == (1, n)
    redis_client.config_resetstat()
    listed = semaphore.status()
    listing_usec = evalsha_usec(redis_client)
    assert listed.waiter_count == n and len(listed.waiters) == 1000
    assert [w.waiter for w in listed.waiters[:2]] == ["w000000", "w000001"]
    assert counting_usec < 1_000, f"status counted in {counting_usec} us"
    assert listing_usec < 50_000, f"status listed 1000 in {listing_usec} us"

    # every waiter lapses at once; each script then purges one bounded step
    redis_client.zadd(keys.deadlines, {f"w{i:06d}": now_ms - 1 for i in range(n)})
    redis_client.config_resetstat()
    assert isinstance(semaphore.try_acquire(waiter="late"), Waiting)
    step_usec = evalsha_usec(redis_client)
    assert redis_client.zcard(keys.queue) == n - 100 + 1
    assert step_usec < 5_000, f"one purge step took {step_usec} us"
    holder.release()
    semaphore.reset()


def _quiet(client: redis.Redis, seconds: float) -> bool:
    """No script ran for ``seconds`` (a window of observation, not a hope)."""
    client.config_resetstat()
    time.sleep(seconds)
    return command_calls(client).get("evalsha", 0) == 0


def _blocked(
    semaphore: FairSemaphore, leases: list[object], stop: threading.Event, errors: list[BaseException]
) -> None:
    try:
        lease = semaphore.acquire(timeout=120)
        leases.append(lease)
        stop.wait(120)
        lease.release()
    except BaseException as error:  # reported by the test
        errors.append(error)


@pytest.mark.parametrize("waiters", [1, 10, 50])
def test_a_release_costs_the_same_whatever_the_number_of_blocked_waiters(
    redis_client: redis.Redis, waiters: int
) -> None:
    """With N threads blocked, a release is one script that offers the slot to one waiter and
    publishes once; the woken waiter claims with one more script. Nobody else asks: 2 EVALSHA
    and 1 PUBLISH per hand-off at N = 1, 10 and 50 alike."""
    semaphore = FairSemaphore(redis_client, f"wake-one-{waiters}", 1, patience=90)
    holder = semaphore.acquire(timeout=0)
    leases: list[object] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=_blocked, args=(semaphore, leases, stop, errors), daemon=True) for _ in range(waiters)
    ]
    for thread in threads:
        thread.start()
    wait_until(lambda: semaphore.status(listed=0).waiter_count == waiters, timeout=30, what="every waiter in line")
    wake_ups, channel = semaphore._wake_address.get()
    wait_until(
        lambda: channel in wake_ups._channels and wake_ups._channels[channel].ready.is_set(),
        timeout=30,
        what="the waiters' channel to be subscribed",
    )
    # every waiter has made its second (post-subscription) ask
    wait_until(lambda: _quiet(redis_client, 0.3), timeout=30, what="the waiters to settle")
    redis_client.config_resetstat()
    holder.release()
    wait_until(lambda: len(leases) == 1, timeout=10, what="the oldest waiter to claim the slot")
    counts = command_calls(redis_client)
    try:
        assert counts["evalsha"] == 2, counts  # the release, the claim
        assert counts["publish"] == 1, counts
        assert not errors
    finally:
        stop.set()
        semaphore.set_limit(waiters + 1)
        for thread in threads:
            thread.join(timeout=30)
        semaphore.clear_limit()


def test_the_uncontended_paths_return_before_the_rest_of_the_helpers_are_made() -> None:
    """Every EVALSHA makes the closures of the helpers its text defines before it reaches them;
    acquire and release return on their uncontended paths before the line's dozen helpers are
    defined (about 1 us of Redis time per run). Each script defines each helper exactly once."""
    import re

    from celery_semaphore._celery.parked_scripts import _NAMES as GLUE_NAMES
    from celery_semaphore._celery.parked_scripts import _PACKAGE as GLUE
    from celery_semaphore._core.scripts import _NAMES, REST_OF_LIB, built_script, script_source

    built = {name: script_source(name) for name in _NAMES} | {name: built_script(GLUE, name) for name in GLUE_NAMES}
    for name, source in built.items():
        defined = re.findall(r"^local function (\w+)", source, flags=re.MULTILINE)
        assert len(defined) == len(set(defined)), (name, defined)
        assert source.count(REST_OF_LIB) == 1, name
    for name, fast_return in (("acquire", "return granted(GRANTED, r)"), ("release", "return 1")):
        source = script_source(name)
        assert source.index(fast_return) < source.index(REST_OF_LIB) < source.index("local function hand_off")


def test_parking_and_sweeping_cost_a_few_calls_whatever_is_parked(redis_client: redis.Redis) -> None:
    """Every worker process sweeps the parked-task records once a second: a sweep with nothing
    due is TIME and four ZRANGEBYSCOREs (the leases of the records wake-ups took, the index of
    this release's buckets, and the keys of the two earlier releases), however many records wait
    (not yet due). Keeping a record is TIME, one HSET (the record, its due time in front, under
    its waiter's entry: a process whose offer went unheard finds it there), a ZREM of its lease
    (parked anew, a copy of its wait asked), ZADD LT of its bucket in the index, ZADD GT of its
    line for the ticks, and the three keys' expiries (on Redis 6.2, without PEXPIRE GT, each
    expiry reads the TTL first): no sorted set of due times beside the records. A tick round another
    process has taken costs a ZCARD and a SET; with no parked waiter anywhere, the ZCARD alone."""
    import json

    from celery_semaphore._celery.parked_records import record_value
    from celery_semaphore._celery.parked_scripts import parked_scripts_for
    from celery_semaphore._celery.parking import parked_keys

    def park(i: object, look_in_ms: int = 60_000) -> None:
        record = record_value(f"w{i}", f"w{i}#0#ab", b"c")
        scripts.park(keys, entry=f"cost:{{x}}\nw{i}", record=record, look_in_ms=look_in_ms, line=line)

    scripts = parked_scripts_for(redis_client)
    keys = parked_keys("cost")
    line = json.dumps(["cost:{x}", 1])
    park(0)  # loads the script
    for parked in (1, 1000):
        for i in range(parked):
            park(i)
        redis_client.config_resetstat()
        assert scripts.claim_parked(keys, prefix="cost", most=100) == []
        counts = command_calls(redis_client)
        assert scripted(counts) == 5, counts
        assert counts["zrangebyscore"] == 4
    redis_client.config_resetstat()
    # parked again, due later than every record before it, so the expiries move on (one due
    # within the same millisecond as the last would leave them as they are, at the cost of
    # reading their TTLs; so does the first record of a bucket, whose keys have none yet)
    park(999, look_in_ms=120_000)
    counts = command_calls(redis_client)
    major = int(redis_client.info("server")["redis_version"].split(".")[0])
    assert scripted(counts) <= (8 if major >= 7 else 11), counts
    assert counts["hset"] == 1, counts
    assert counts["zadd"] == 2, counts  # its bucket's due time in the index, its line
    assert {"zadd", "hset", "time"} <= set(counts)
    assert scripts.lines_to_tick(keys, round_ms=1000, most=100) == [line]
    redis_client.config_resetstat()
    assert scripts.lines_to_tick(keys, round_ms=1000, most=100) == []  # this round is taken
    assert scripted(command_calls(redis_client)) == 2
    idle = parked_keys("cost-idle")
    redis_client.config_resetstat()
    assert scripts.lines_to_tick(idle, round_ms=1000, most=100) == []
    assert scripted(command_calls(redis_client)) == 1
    assert redis_client.keys("cost-idle*") == []


# Moved here from test_semaphore.py and test_multi.py: they count every command the server runs,
# so they need this module's own servers (see redis_server above).


def test_acquire_and_release_are_one_round_trip_each(redis_client: redis.Redis) -> None:
    """INFO commandstats: one EVALSHA per acquire and one per release, nothing else."""
    semaphore = FairSemaphore(redis_client, "trips", 1)
    semaphore.acquire(timeout=0).release()  # loads the scripts
    redis_client.config_resetstat()
    lease = semaphore.acquire(timeout=0)
    after_acquire = redis_client.info("commandstats")
    lease.release()
    after_release = redis_client.info("commandstats")
    assert after_acquire["cmdstat_evalsha"]["calls"] == 1
    assert after_release["cmdstat_evalsha"]["calls"] == 2
    assert "cmdstat_script" not in after_release
    assert "cmdstat_eval" not in after_release


def test_an_uncontended_multi_cycle_costs_per_semaphore_what_one_key_costs(redis_client: redis.Redis) -> None:
    """acquire(timeout=0) + release over n semaphores (any weight) makes 10 n + 1 Redis calls: 11
    for one, like FairSemaphore's cycle; 21 for two (no purge and no line touched on the fast path)."""
    sems = [FairSemaphore(redis_client, f"cost{i}", 5) for i in range(2)]
    for semaphores, weight, expected in [([sems[0]], 1, 11), ([sems[0]], 3, 11), (sems, 1, 21), (sems, 2, 21)]:
        multi = MultiSemaphore(semaphores, weight=weight)
        multi.acquire(timeout=0).release()  # loads the scripts
        redis_client.config_resetstat()
        multi.acquire(timeout=0).release()
        assert scripted(command_calls(redis_client)) == expected, (len(semaphores), weight)


def _tenant_cycle_usec(client: redis.Redis, name: str, tenants: int, waiters: int = 100_000) -> dict[str, float]:
    """Median Redis server time (us) of a tenant's join, a release and the head's claim, on a
    line of ``waiters`` spread over ``tenants`` tenants (the line and the clocks written
    directly, as the acquire script would have left them)."""
    semaphore = FairSemaphore(client, name, 1, patience=600)
    keys = semaphore.keys
    holder = semaphore.acquire(timeout=0)
    base = int(client.time()[0]) * 1000 * 1024
    for first in range(0, waiters, 10_000):
        members = {f"w{i:06d}": base + i * 1024 for i in range(first, first + 10_000)}
        pipe = client.pipeline(transaction=False)
        pipe.zadd(keys.queue, members)
        pipe.zadd(keys.present, members)
        pipe.zadd(keys.deadlines, {w: base // 1024 + 600_000 for w in members})
        pipe.execute()
    client.zadd(keys.tenants, {f"t{j}": base + (waiters + j) * 1024 for j in range(tenants)})
    for key in (keys.queue, keys.present, keys.deadlines, keys.tenants):
        client.pexpire(key, 600_000)
    spent: dict[str, list[int]] = {"join": [], "release": [], "claim": []}
    for n in range(30):
        client.config_resetstat()
        semaphore._try(Ask(token=new_token(), waiter=f"new{n}", tenant=f"t{(n * 7919) % tenants}", patience=600))
        spent["join"].append(evalsha_usec(client))
        client.config_resetstat()
        holder.release()
        spent["release"].append(evalsha_usec(client))
        client.config_resetstat()
        attempt = semaphore._try(Ask(token=new_token(), waiter=f"w{n:06d}", patience=600))
        spent["claim"].append(evalsha_usec(client))
        assert isinstance(attempt, Granted)
        holder = attempt.lease
    holder.release()
    return {op: sorted(usec)[len(usec) // 2] for op, usec in spent.items()}


def test_a_grant_stays_logarithmic_in_tenants(redis_client: redis.Redis) -> None:
    """100,000 waiters: with 10,000 tenants a join, a release and a claim cost the Redis server
    at most twice what they cost with 10 tenants (medians of 30, plus 30 us for timer noise)."""
    few = _tenant_cycle_usec(redis_client, "tenants-few", 10)
    many = _tenant_cycle_usec(redis_client, "tenants-many", 10_000)
    for op in few:
        assert many[op] <= 2 * few[op] + 30, (op, few, many)
