"""The parked-task records split into buckets (``parked_records.RECORD_BUCKETS``): each bucket
small enough for Redis's compact encoding, found by the scripts as Python names it, swept through
its index, and the records an earlier release kept in one hash still woken, swept and forgotten."""

from __future__ import annotations

import redis

from celery_semaphore._celery.parked_records import (
    RECORD_BUCKETS,
    parked_keys,
    record_bucket,
    record_header,
    record_value,
)
from celery_semaphore._celery.parked_scripts import parked_scripts_for

from ..parked import due_times, records


def _park(client: redis.Redis, prefix: str, waiters: list[str], look_in_ms: int = 60_000) -> dict[str, str]:
    """Park a record of each waiter in line ``line`` of ``prefix``; entry -> waiter."""
    scripts, keys = parked_scripts_for(client), parked_keys(prefix)
    entries = {}
    for waiter in waiters:
        entry = f"line\n{waiter}"
        record = record_value(waiter, f"{waiter}#0#ab", b"@")
        assert scripts.park(keys, entry=entry, look_in_ms=look_in_ms, record=record)
        entries[entry] = waiter
    return entries


def test_the_scripts_find_each_record_in_the_bucket_python_names(redis_client: redis.Redis) -> None:
    """A wake-up computes a record's bucket in Lua (claim_parked_waiter.lua, from the entry's
    SHA-1) for waiters Python parked: every one is found and taken, whatever its bytes (non-ASCII,
    a newline, the marks a task key may carry), and each sits in the bucket Python named."""
    prefix = "bucket-find"
    waiters = [f"w{i}" for i in range(300)] + ["ünï-cödé", "with\nnewline", "~!odd", "*2*w"]
    entries = _park(redis_client, prefix, waiters)
    keys = parked_keys(prefix)
    for entry in entries:
        assert redis_client.hexists(keys.bucket_records(record_bucket(entry)), entry), entry
    assert len({record_bucket(entry) for entry in entries}) > 200, "spread over the buckets"
    scripts = parked_scripts_for(redis_client)
    claimed = scripts.claim_parked_waiters(keys, prefix=prefix, base="line", waiters=waiters, lease_ms=60_000)
    assert sorted(record.waiter for record in claimed) == sorted(waiters)
    assert scripts.claim_parked_waiters(keys, prefix=prefix, base="line", waiters=waiters, lease_ms=60_000) == []


def test_a_bucket_stays_compact_and_a_record_keeps_its_due_time_in_it(redis_client: redis.Redis) -> None:
    """20,000 parked records (about 20 a bucket): every bucket keeps Redis's compact encoding, and
    a record, its due time in front of its value, takes at most 110 B of the buckets (MEMORY
    USAGE, every element counted; a sorted set of due times beside them added about 70 B, one
    hash and one sorted set for all, as an earlier release kept them, about 300 B). No other key
    holds its due time."""
    prefix = "bucket-size"
    entries = _park(redis_client, prefix, [f"{i:08d}-aaaa-bbbb-cccc-dddddddddddd" for i in range(20_000)])
    keys = parked_keys(prefix)
    names = [keys.bucket_records(bucket) for bucket in range(RECORD_BUCKETS)]
    assert sum(redis_client.hlen(keys.bucket_records(bucket)) for bucket in range(RECORD_BUCKETS)) == len(entries)
    encodings = {redis_client.object("encoding", name) for name in names if redis_client.exists(name)}
    assert encodings <= {b"listpack", b"ziplist"}, encodings
    used = sum(int(redis_client.memory_usage(name, samples=0) or 0) for name in names)
    assert used / len(entries) <= 110, used / len(entries)
    assert set(due_times(redis_client, keys)) == {entry.encode() for entry in entries}
    assert not [name for name in redis_client.scan_iter(match=f"{prefix}:*") if b"record-due" in name]


def test_a_sweep_takes_the_due_records_of_every_bucket_a_batch_at_a_time(redis_client: redis.Redis) -> None:
    """250 records due at once, in some 200 buckets: a sweep takes 100, the next 100, then the
    last 50, each once; then no bucket is left in the index (each re-scored to its next due time
    as it was swept, and dropped once empty), and a record not yet due stays."""
    prefix = "bucket-sweep"
    scripts, keys = parked_scripts_for(redis_client), parked_keys(prefix)
    due = _park(redis_client, prefix, [f"due{i}" for i in range(250)], look_in_ms=0)
    later = _park(redis_client, prefix, ["later"], look_in_ms=60_000)
    taken: list[str] = []
    for batch in (100, 100, 50, 0):
        claimed = scripts.claim_parked(keys, prefix=prefix, most=100)
        assert len(claimed) == batch
        taken += [record.waiter for record in claimed if record is not None]
    assert sorted(taken) == sorted(due.values())
    (bucket,) = redis_client.zrange(keys.buckets, 0, -1)
    assert int(bucket) == record_bucket(next(iter(later))), "only the bucket of the record not yet due"
    assert list(records(redis_client, keys)) == [entry.encode() for entry in later]


def test_a_bucket_whose_records_were_forgotten_leaves_the_index_at_the_next_sweep(redis_client: redis.Redis) -> None:
    """A record given up leaves its bucket's index entry as it was (an early bound, never a late
    one); the sweep that finds the bucket empty drops it from the index."""
    prefix = "bucket-forget"
    scripts, keys = parked_scripts_for(redis_client), parked_keys(prefix)
    (entry,) = _park(redis_client, prefix, ["gone"], look_in_ms=0)
    scripts.forget(keys, entry=entry, header=record_header("gone", "gone#0#ab"), old=("", ""))
    assert records(redis_client, keys) == {}
    assert redis_client.zcard(keys.buckets) == 1
    assert scripts.claim_parked(keys, prefix=prefix, most=100) == []
    assert redis_client.zcard(keys.buckets) == 0


def test_the_records_kept_unsplit_by_an_earlier_release_are_woken_swept_and_forgotten(
    redis_client: redis.Redis,
) -> None:
    """A rolling deploy from the release that kept every record in one hash and one sorted set:
    a wake-up takes such a record there (leased there, as woken); a sweep takes one due there;
    a wait given up is forgotten there; nothing new is written there."""
    prefix = "bucket-flat"
    scripts, keys = parked_scripts_for(redis_client), parked_keys(prefix)
    now_ms = int(redis_client.time()[0]) * 1000
    for waiter, due_in_ms in (("offered", 60_000), ("lapsed", -1), ("given-up", 60_000)):
        entry = f"line\n{waiter}"
        redis_client.zadd(keys.flat_due, {entry: now_ms + due_in_ms})
        redis_client.hset(keys.flat_records, entry, record_value(waiter, f"{waiter}#0#ab", b"@"))

    (woken,) = scripts.claim_parked_waiters(keys, prefix=prefix, base="line", waiters=["offered"], lease_ms=5_000)
    assert (woken.waiter, woken.run) == ("offered", "offered#0#ab")
    assert (redis_client.hget(keys.flat_records, "line\noffered") or b"").startswith(b"~"), "taken, leased there"
    lease = float(redis_client.zscore(keys.flat_due, "line\noffered") or 0)
    assert lease <= now_ms + 10_000

    (swept,) = [record for record in scripts.claim_parked(keys, prefix=prefix, most=100) if record is not None]
    assert swept.waiter == "lapsed"
    assert not redis_client.hexists(keys.flat_records, "line\nlapsed")

    header = record_header("given-up", "given-up#0#ab")
    scripts.forget(keys, entry="line\ngiven-up", header=header, old=("", ""))
    assert not redis_client.hexists(keys.flat_records, "line\ngiven-up")
    assert redis_client.zscore(keys.flat_due, "line\ngiven-up") is None
    assert set(records(redis_client, keys)) == {b"line\noffered"}
    assert set(due_times(redis_client, keys)) == {b"line\noffered"}


def test_a_sweep_finds_the_leases_of_woken_records_without_reading_their_buckets(redis_client: redis.Redis) -> None:
    """A drain wakes (and leases) a record per start: a sweep finds the 50 leases that are up
    among 20,000 parked records by the sorted set of leases, and takes each with one HGET and
    one HDEL, reading no bucket whole (HGETALL is a bucket's scan, about 10 ms of Redis for a
    sweep of 100 buckets of 100 records). A wait parked anew leaves its lease."""
    from tests.commandstats import command_calls

    prefix = "bucket-leases"
    scripts, keys = parked_scripts_for(redis_client), parked_keys(prefix)
    waiters = [f"{i:08d}-aaaa-bbbb-cccc-dddddddddddd" for i in range(20_000)]
    _park(redis_client, prefix, waiters)
    woken = waiters[:51]
    assert len(scripts.claim_parked_waiters(keys, prefix=prefix, base="line", waiters=woken, lease_ms=0)) == 51
    assert redis_client.zcard(keys.leases) == 51
    _park(redis_client, prefix, woken[-1:])  # parked anew: its lease is gone, its record due later
    assert redis_client.zcard(keys.leases) == 50
    redis_client.config_resetstat()
    taken = scripts.claim_parked(keys, prefix=prefix, most=100)
    counts = command_calls(redis_client)
    assert sorted(record.waiter for record in taken if record is not None) == sorted(woken[:50])
    assert counts.get("hgetall", 0) == 0, counts
    assert (counts["hget"], counts["hdel"]) == (50, 50), counts
    assert redis_client.zcard(keys.leases) == 0
    assert len(records(redis_client, keys)) == len(waiters) - 50
