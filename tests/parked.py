"""What a deployment's parked-task records hold, and which copies wait in the broker's store,
read across their buckets and the keys of an earlier release (``parked_records.ParkedKeys``,
``due_copies.due_keys_of``): for the tests, which look at every one."""

from __future__ import annotations

from typing import Any

from celery_semaphore._celery.due_copies import DUE_BUCKETS, DUE_KEY
from celery_semaphore._celery.parked_records import RECORD_BUCKETS, ParkedKeys, parked_keys, split_due, without_due


def _read_all(client: Any, names: list[bytes], command: str) -> dict[bytes, Any]:
    pipe = client.pipeline(transaction=False)
    for name in names:
        if command == "hgetall":
            pipe.hgetall(name)
        else:
            pipe.zrange(name, 0, -1, withscores=True)
    found: dict[bytes, Any] = {}
    for reply in pipe.execute():
        found.update(reply if command == "hgetall" else dict(reply))
    return found


def _bucket_values(client: Any, keys: ParkedKeys) -> dict[bytes, bytes]:
    return _read_all(client, [keys.bucket_records(bucket) for bucket in range(RECORD_BUCKETS)], "hgetall")


def records(client: Any, keys: ParkedKeys | str) -> dict[bytes, bytes]:
    """Every record kept, entry -> value (a bucket's with its due time off), wherever it is kept."""
    keys = parked_keys(keys) if isinstance(keys, str) else keys
    found = {entry: without_due(value) for entry, value in _bucket_values(client, keys).items()}
    return {**_read_all(client, [keys.flat_records], "hgetall"), **found}


def due_times(client: Any, keys: ParkedKeys | str) -> dict[bytes, float]:
    """Every record's due time (server ms), entry -> when, wherever it is kept: in front of a
    bucket's value (or the end of its lease, if sooner), or an earlier release's sorted set."""
    keys = parked_keys(keys) if isinstance(keys, str) else keys
    found = {entry: float(due) for entry, value in _bucket_values(client, keys).items() if (due := split_due(value)[0])}
    for entry, lease_ends in client.zrange(keys.leases, 0, -1, withscores=True):
        if entry in found:  # taken by a wake-up: due when its lease ends, if that comes first
            found[entry] = min(found[entry], lease_ends)
    return {**_read_all(client, [keys.flat_due], "zrange"), **found}


def stored_due(client: Any, due_key: str = DUE_KEY) -> dict[bytes, float]:
    """Every copy stored in the broker's Redis, copy id -> when it is due (server ms), from its
    bucket or from the release before's one sorted set (``due_copies.due_keys_of``)."""
    names = [*(f"{due_key}:{bucket}".encode() for bucket in range(DUE_BUCKETS)), due_key.encode()]
    return _read_all(client, names, "zrange")
