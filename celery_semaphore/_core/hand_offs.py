"""What a script's hand-off leaves to its caller: the waiters offered a slot that a script
could not tell itself, and a script of another layer run right after a release.

The semaphore offers a freed slot to the oldest present waiter and publishes the offer on the
waiter's wake-up channel. A waiter parked outside any process (a Celery task waiting in the
broker) or one whose listener is gone hears nothing: the scripts list those, and the layer that
parks them (``_celery/parking.py``) sends their wake copies. That layer may also ask for a script
of its own to run right after a release, in the same round trip, so that the records it needs
for those wake-ups are taken with the release instead of one round trip each after it.

This module imports neither Celery nor kombu."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

from .scripts import Script

logger = logging.getLogger("celery_semaphore")

# Told (semaphore, waiters) when a script offered a slot to parked waiters, or to waiters whose
# wake-up nobody heard (their process is gone): the Celery layer sends a parked task's wake copy
# itself (_celery/parking.py). Unset, a parked waiter's own process sends it, and an offer nobody
# heard lapses after its claim window and goes on to the next waiter. The third argument,
# "later": the caller must not wait for the wake-ups (the renewer: see tell_to_wake).
ToWakeHandler = Callable[[Any, "tuple[str, ...]", bool], None]
_to_wake_handler: ToWakeHandler | None = None


def on_to_wake(handler: ToWakeHandler | None) -> None:
    global _to_wake_handler
    _to_wake_handler = handler


def tell_to_wake(semaphore: Any, waiters: tuple[str, ...], *, later: bool = False) -> None:
    """Hand ``waiters`` (offered a slot of ``semaphore``: parked, or nobody heard) to the
    handler, if any; never raises: the release or try that found them has done its own work.
    ``later``: for the renewer, which must never wait on what a wake-up involves (a broker)."""
    handler = _to_wake_handler
    if handler is None or not waiters:
        return
    try:
        handler(semaphore, waiters, later)
    except Exception as error:
        logger.warning(
            "could not wake the waiters of %r that did not hear their turn (their offer lapses "
            "after its claim window): %s",
            getattr(semaphore, "name", semaphore),
            error,
        )


class ReleaseFollower(NamedTuple):
    """A script to run right after a release, in its round trip (``scripts.run_in_order``):
    ``run`` (the script, its keys and its arguments), and ``woke``, given that script's reply
    (or the error it raised), wakes whom it must and returns the waiters it woke, whom the
    release's own list then leaves out."""

    run: tuple[Script, list[bytes], list[Any]]
    woke: Callable[[Any], Collection[str]]
    # the script takes the records of the parked waiters the release offers a slot: the release
    # tells their processes so (lua/_lib.lua, notify) rather than have them race for the records
    takes_parked: bool = False


# Asked, before a release of a semaphore, for the script to run after it (None: none).
FollowerSource = Callable[[Any], "ReleaseFollower | None"]
_follower_source: FollowerSource | None = None


def on_release(source: FollowerSource | None) -> None:
    global _follower_source
    _follower_source = source


def follower_for(semaphore: Any) -> ReleaseFollower | None:
    """The script to run right after a release of ``semaphore``; None if there is none, or if
    the layer that gives it cannot say (the release goes alone then)."""
    source = _follower_source
    if source is None:
        return None
    try:
        return source(semaphore)
    except Exception as error:
        logger.debug("no script to follow the release of %r: %s", getattr(semaphore, "name", semaphore), error)
        return None


def woken_by(follower: ReleaseFollower, reply: Any) -> Collection[str]:
    """The waiters ``follower`` woke, given its script's reply; none if it failed (the release's
    own list then wakes them all, as without a follower)."""
    try:
        return follower.woke(reply)
    except Exception as error:
        logger.warning("could not wake the waiters offered a slot with the release: %s", error)
        return ()
