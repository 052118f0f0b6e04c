"""Sending a parked task's copy from its record: the wake copy kept there, or, on the Redis
broker, the task's stored message (``due_copies.py``); and the sweep of the records whose time
is up (``parking.py`` keeps the records and sends the wake-ups)."""

from __future__ import annotations

import logging
from typing import Any

from .._core.explain import WaitState, wait_states
from .._core.storage import WOKEN_COPY_MARK
from .due_copies import send_stored
from .parked_records import ParkedRecord, is_stored_mark, parked_keys, record_value
from .parked_scripts import parked_scripts_for
from .wake_copies import deserialized

logger = logging.getLogger("celery_semaphore")

# Most records one sweep takes at once (the rest wait for the next sweep, or another process).
SWEEP_BATCH = 100
# A wait whose place in line has not lapsed yet is looked at again this long after it would.
LOOK_AGAIN_SLACK_S = 1.0
# A wait whose wake copy was sent keeps its record this long (claim_parked_waiter.lua): should
# no copy of it be granted by then, a sweep sends the wake copy again.
WOKEN_LEASE_S = 10.0


def sweep_records(targets: list[Any]) -> None:
    """The parked-task records now due, anywhere in the deployments swept here: each wait
    that no copy asked for is sent again, from here, whichever process parked it (and those an
    earlier release recorded, kept again, if need be, as this release records them)."""
    for target in targets:
        scripts = parked_scripts_for(target.client)
        try:
            claimed = scripts.claim_parked(parked_keys(target.prefix), prefix=target.prefix, most=SWEEP_BATCH)
        except Exception as error:  # Redis down: the records wait for the next sweep
            logger.debug("could not sweep the parked tasks: %s", error)
            continue
        states = _states_of(target.client, claimed)
        for record, state in zip(claimed, states, strict=True):
            if record is None or state is None or state.granted:
                continue
            try:
                _sweep_one(target, record, state)
            except Exception as error:
                logger.warning("could not sweep a parked task (%s): its backstop copy is its only way back", error)


def _states_of(client: Any, claimed: list[ParkedRecord | None]) -> list[WaitState | None]:
    """Where the wait of each record taken stands, read in one round trip; None for a record
    with no copy left (nothing to send) or one that could not be read."""
    waits: list[tuple[str, str, str, str]] = []
    places: list[int | None] = []
    for record in claimed:
        if record is None or not record.copy.removeprefix(WOKEN_COPY_MARK.encode()):
            places.append(None)
            continue
        places.append(len(waits))
        waits.append((record.deadlines_key, record.runs_key, record.waiter, record.run))
    if not waits:
        return [None] * len(claimed)
    try:
        states = wait_states(client, waits)
    except Exception as error:
        logger.warning(
            "could not sweep %d parked tasks (%s): their backstop copies are their only way back", len(waits), error
        )
        return [None] * len(claimed)
    return [None if place is None else states[place] for place in places]


def _sweep_one(target: Any, record: ParkedRecord, state: WaitState) -> None:
    """Send again the copy of a wait that no copy asked for, taken by a sweep with ``state``."""
    run, name = record.run, record.name
    woken = record.copy.startswith(WOKEN_COPY_MARK.encode())
    copy = record.copy.removeprefix(WOKEN_COPY_MARK.encode())
    if woken:
        # its wake copy was sent a lease ago and no copy was granted since: lost in flight
        # (popped by a worker that died), or still waiting for a pool process. Sent again,
        # leased again; a second copy that arrives is dropped by its run. A stored copy the
        # broker no longer keeps ends it
        wake_copy = None if is_stored_mark(copy) else deserialized(copy, target.app)
        sent_again(name)
        if wake_copy is None and not send_stored_copy(target.app, run, name):
            return
        keep_again(target, record, WOKEN_COPY_MARK.encode() + copy, look_in_ms=round(WOKEN_LEASE_S * 1000))
        if wake_copy is not None:
            send_wake_copy(wake_copy, name)
        return
    if state.left_ms is not None:  # still in line: look again once its place would lapse
        keep_again(target, record, copy, look_in_ms=state.left_ms + round(LOOK_AGAIN_SLACK_S * 1000))
        return
    sent_again(name)
    if is_stored_mark(copy):
        send_stored_copy(target.app, run, name)
        return
    send_wake_copy(deserialized(copy, target.app), name)


def keep_again(target: Any, record: ParkedRecord, copy: bytes, *, look_in_ms: int) -> None:
    """Put back a record a sweep took, with ``copy``, due in ``look_in_ms``: unless the task
    parked again meanwhile (its newer record stays)."""
    parked_scripts_for(target.client).park(
        parked_keys(target.prefix),
        entry=record.entry,
        record=record_value(record.waiter, record.run, copy),
        only_if_absent=True,
        look_in_ms=look_in_ms,
    )


def send_claimed(app: Any, record: ParkedRecord) -> str:
    """Send the copy of a parked task whose record this caller took to wake it; its waiter. Its
    record's lease sends it again should this one fail (a stored copy not stowed yet, a broker
    down)."""
    if is_stored_mark(record.copy):
        send_stored_copy(app, record.run, record.name)
        return record.waiter
    try:
        wake_copy = deserialized(record.copy, app)
    except Exception as error:
        logger.warning("could not wake a parked task (%s): its backstop copy is its way back", error)
        return record.waiter
    send_wake_copy(wake_copy, record.name)
    return record.waiter


def send_stored_copy(app: Any, run: str, name: str) -> bool:
    """Send the wait's copy stored in the broker now; whether the broker kept one."""
    try:
        if send_stored(app, run):
            return True
    except Exception as error:  # its lease or sweep tries again
        logger.warning("could not wake a task waiting for %r (its broker's Redis: %s)", name, error)
        return False
    logger.warning(
        "no copy of a task waiting for %r is kept in the broker's Redis (run %s): lost with the broker's "
        "data, or not stowed yet (its record's lease looks again)",
        name,
        run,
    )
    return False


def send_wake_copy(wake_copy: Any, name: str) -> None:
    try:
        wake_copy.apply_async()
    except Exception as error:  # the backstop copy still comes, at its countdown
        logger.warning("could not send the wake copy of a task waiting for %r (its backstop comes): %s", name, error)


def sent_again(name: str) -> None:
    logger.warning("no copy of a task waiting for %r asked in time (backstop copy lost?): sending it again", name)
