"""Where a waited task's runs are noted: which wait a first delivery began (so a redelivery
of that message continues it instead of beginning a second one), how long a finished run is
remembered. Apart from ``task.py``
so that the worker's main process can use them without the task hook."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .._core.multi import MultiSemaphore, home_of
from .._core.semaphore import FairSemaphore
from .._core.validation import to_ms
from .config import SemaphoreConfig, config_for
from .due_copies import reopen
from .options import WaitOptions, wait_options
from .parked_scripts import parked_scripts_for
from .policy import KEPT_APART_BACKSTOP_S
from .wait_headers import WaitHistory, message_nonce

logger = logging.getLogger("celery_semaphore")

# A finished run is remembered this much longer than any copy of it is due to arrive: the
# backstop's countdown, or a Redis broker's redelivery of a dead worker's unacked copy
# (visibility_timeout). A copy can still come later (a backlog, an hour without workers): with
# a result backend such a copy finds the task's SUCCESS there and is dropped all the same.
REMEMBER_SLACK = 3600.0

# A waiter away on a countdown keeps its place this much longer than the countdown, to cover
# the broker's delivery and a busy worker's delay in starting it.
AWAY_SLACK = 15.0


def _first_delivery_note(request: Any) -> str:
    """The field of the note, in the run records, of the wait a first delivery began: never a run
    id (a run id has no empty part). It names the message by its nonce, so that a later invocation
    reusing the task id, its first message redelivered, does not take the earlier invocation's
    wait for its own (and is not dropped as having run). A message without one (sent by a
    producer without this package) is noted by task id and retry only."""
    nonce = message_nonce(request)
    return f"{request.id}#{request.retries or 0}#" + (f"#{nonce}" if nonce else "")


def remember_wait(semaphore: FairSemaphore | MultiSemaphore, request: Any, wait_id: str, remember: float) -> None:
    home = home_of(semaphore)
    try:
        parked_scripts_for(home.client).remember_wait(
            home.keys, first_delivery=_first_delivery_note(request), wait_id=wait_id, remember_ms=to_ms(remember)
        )
    except Exception as error:  # Redis down: the copies still run once; a redelivery may wait twice
        logger.warning(
            "could not note the wait of %s[%s] (a redelivery of its message would wait anew): %s",
            getattr(request, "task", "?"),
            request.id,
            error,
        )


def begin_at_most_once(semaphore: FairSemaphore | MultiSemaphore, run: str, remember: float) -> None:
    """A copy of ``run`` was granted and its task has no acks_late: Celery runs it at most once,
    so the run counts as finished from now on, and no other copy of its wait may take it over,
    not even once this worker is dead and its lease has lapsed (a copy held by another worker
    on RabbitMQ, a wake copy in flight, a redelivery). For several keys or a weight: one more
    round trip at a waited grant; one key's grant records it itself (``Ask.at_most_once``)."""
    try:
        semaphore._finish_run(run, to_ms(remember))
    except Exception as error:  # Redis down just after the grant: as before, a lapsed lease lets a copy in
        logger.warning("could not mark run %s as begun at most once: %s", run, error)


def reopen_run(task: Any, semaphore: FairSemaphore | MultiSemaphore, history: WaitHistory, token: str) -> None:
    """The body of a waited ``task`` without acks_late, its run begun at most once, paused its
    key and sends its wait on: the copy for the end of the pause is that run going on, so the
    run is no longer finished (``begin_at_most_once``). ``token``: its slot's."""
    if not history.waits or task._acks_late():
        return
    config = config_for(task.app)
    home = home_of(semaphore)
    reopen(task.app, history.run_id(task.request))  # its grant told the broker's Redis it finished
    parked_scripts_for(home.client).remember_wait(
        home.keys,
        first_delivery=history.run_id(task.request),
        wait_id=token,
        remember_ms=to_ms(remember_for(wait_options(task, config), config)),
    )


def continued_wait(semaphore: FairSemaphore | MultiSemaphore, request: Any, history: WaitHistory) -> WaitHistory:
    """A redelivered first delivery whose first try began a wait (its worker died before the
    ack): that wait, so this delivery asks under its run (dropped if it ran, waiting while it
    runs, running it if nobody did). Otherwise the fresh history."""
    home = home_of(semaphore)
    try:
        wait_id = home._noted_run(_first_delivery_note(request))
    except Exception as error:
        logger.debug(
            "could not look up the wait of a redelivered %s[%s]: %s", getattr(request, "task", "?"), request.id, error
        )
        return history
    if not wait_id:
        return history
    logger.info(
        "%s[%s]: a redelivery of a message whose wait began already; it continues that wait",
        getattr(request, "task", "?"),
        request.id,
    )
    return dataclasses.replace(history, waits=1, run_part=wait_id)


def remember_for(options: WaitOptions, config: SemaphoreConfig) -> float:
    """How long a finished run of a waited task is remembered, to drop its late copies."""
    longest_away = max(options.countdown[1], KEPT_APART_BACKSTOP_S) + AWAY_SLACK
    return max(longest_away, config.visibility_timeout or 0.0) + REMEMBER_SLACK
