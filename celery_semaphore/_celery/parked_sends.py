"""Sending a parked task's copy from its record: the wake copy kept there, or, on the Redis
broker, the task's stored message (``due_copies.py``); and the sweep of the records whose time
is up (``parking.py`` keeps the records and sends the wake-ups)."""

from __future__ import annotations

import logging
from typing import Any

from .._core.explain import wait_state
from .._core.storage import WOKEN_COPY_MARK
from .due_copies import send_stored
from .parked_records import STORED_COPY_MARK, ParkedRecord, parked_keys
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
    that no copy asked for is sent again, from here, whichever process parked it."""
    for target in targets:
        try:
            claimed = parked_scripts_for(target.client).claim_parked(parked_keys(target.prefix), most=SWEEP_BATCH)
        except Exception as error:  # Redis down: the records wait for the next sweep
            logger.debug("could not sweep the parked tasks: %s", error)
            continue
        for record, copy in claimed:
            try:
                deadlines, runs, waiter, run, name = ParkedRecord.read(record)
                woken = copy.startswith(WOKEN_COPY_MARK.encode())
                copy = copy.removeprefix(WOKEN_COPY_MARK.encode())
                if not copy:
                    continue
                state = wait_state(target.client, deadlines, runs, waiter, run)
                if state.granted:
                    continue
                if woken:
                    # its wake copy was sent a lease ago and no copy was granted since: lost
                    # in flight (popped by a worker that died), or still waiting for a pool
                    # process. Sent again, leased again; a second copy that arrives is
                    # dropped by its run. A stored copy the broker no longer keeps ends it
                    wake_copy = None if copy == STORED_COPY_MARK.encode() else deserialized(copy, target.app)
                    sent_again(name)
                    if wake_copy is None and not send_stored_copy(target.app, run, name):
                        continue
                    parked_scripts_for(target.client).park(
                        parked_keys(target.prefix),
                        record=record,
                        copy=WOKEN_COPY_MARK.encode() + copy,
                        only_if_absent=True,
                        look_in_ms=round(WOKEN_LEASE_S * 1000),
                    )
                    if wake_copy is not None:
                        send_wake_copy(wake_copy, name)
                    continue
                if state.left_ms is not None:  # still in line: look again once its place would lapse
                    parked_scripts_for(target.client).park(
                        parked_keys(target.prefix),
                        record=record,
                        copy=copy,
                        only_if_absent=True,
                        look_in_ms=state.left_ms + round(LOOK_AGAIN_SLACK_S * 1000),
                    )
                    continue
                if copy == STORED_COPY_MARK.encode():
                    sent_again(name)
                    send_stored_copy(target.app, run, name)
                    continue
                wake_copy = deserialized(copy, target.app)
            except Exception as error:
                logger.warning("could not sweep a parked task (%s): its backstop copy is its only way back", error)
                continue
            sent_again(name)
            send_wake_copy(wake_copy, name)


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
