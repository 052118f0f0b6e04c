"""The parts of Celery and kombu that are not public API and that the worker glue relies on.

Most of the glue uses Celery's documented surface: signals, bootsteps, ``Task`` and
``Request`` subclasses, ``add_task_queue``. A few places go further, because the behaviour they
add cannot be had otherwise; each is listed here once, with what it relies on and what the
package does when it is gone. A worker checks the list as it starts and logs one warning naming
every entry that no longer holds (an upgrade of Celery or kombu changed it) and what falls back;
``tests/celery/test_internals.py`` fails on an installed version that breaks one.

The checks read classes, never a live worker: they run before the worker has a consumer. Tested
with the versions in ``TESTED_WITH``.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

logger = logging.getLogger("celery_semaphore")

# the oldest and newest releases the suite ran against
TESTED_WITH = {"celery": ("5.3", "5.7"), "kombu": ("5.3", "5.7")}

# what stowing.py's channel calls of kombu's Redis channel
STOWING_CHANNEL_METHODS = ("_put", "_q_for_pri", "_get_message_priority")
# kombu's Redis transport's own defaults for naming a queue's priority lists (due_copies.py)
KOMBU_REDIS_SEPARATOR = "\x06\x16"
KOMBU_REDIS_PRIORITY_STEPS = (0, 3, 6, 9)


@dataclass(frozen=True)
class Internal:
    """One thing the glue relies on that Celery or kombu does not promise."""

    name: str
    used_by: str  # the module of this package that relies on it
    falls_back: str  # what the package does, and what users see, when it no longer holds
    holds: Callable[[], bool]


def _pool_semaphore_line() -> bool:
    from kombu.asynchronous.semaphore import LaxBoundedSemaphore

    semaphore = LaxBoundedSemaphore(1)
    return isinstance(getattr(semaphore, "_waiting", None), deque) and callable(getattr(semaphore, "_add_waiter", None))


def _blueprint_on_close() -> bool:
    from celery import bootsteps

    return "on_close" in inspect.signature(bootsteps.Blueprint.__init__).parameters and hasattr(
        bootsteps.Blueprint(on_close=None), "on_close"
    )


def _redis_pending_brpop() -> bool:
    from kombu.transport import redis as kombu_redis

    channel = kombu_redis.Channel
    return callable(getattr(channel, "_brpop_read", None)) and hasattr(channel, "_in_poll")


def _redis_list_names() -> bool:
    from kombu.transport import redis as kombu_redis

    channel = kombu_redis.Channel
    return (
        getattr(channel, "sep", None) == KOMBU_REDIS_SEPARATOR
        and tuple(getattr(channel, "priority_steps", ())) == KOMBU_REDIS_PRIORITY_STEPS
        and callable(getattr(channel, "_q_for_pri", None))
    )


def _redis_put() -> bool:
    from kombu.transport import redis as kombu_redis

    channel = kombu_redis.Channel
    return all(callable(getattr(channel, name, None)) for name in STOWING_CHANNEL_METHODS) and list(
        inspect.signature(channel._put).parameters
    )[:3] == ["self", "queue", "message"]


def _ignore_result_helper() -> bool:
    from celery.app import task as celery_task

    return callable(getattr(celery_task, "get_actual_ignore_result", None))


def _received_task_registers() -> bool:
    from celery.worker import state as worker_state

    return hasattr(worker_state, "active_requests") and hasattr(worker_state, "reserved_requests")


def _pool_process_exit_event() -> bool:
    from celery.concurrency.asynpool import AsynPool

    parameters = list(inspect.signature(AsynPool._event_process_exit).parameters)
    return parameters == ["self", "hub", "proc"] and callable(getattr(AsynPool, "maintain_pool", None))


INTERNALS: tuple[Internal, ...] = (
    Internal(
        "kombu LaxBoundedSemaphore._waiting and ._add_waiter (a prefork worker's line of received tasks)",
        "woken_first, handing_back",
        "a woken task waits behind fresh deliveries for a pool process, and a warm shutdown hands "
        "back its wake copies only when the connection closes",
        _pool_semaphore_line,
    ),
    Internal(
        "celery bootsteps.Blueprint.on_close (run first as a consumer stops)",
        "handing_back",
        "a stopping prefork worker returns the wake copies no process accepted only when its "
        "connection closes, after its running tasks end",
        _blueprint_on_close,
    ),
    Internal(
        "kombu Redis Channel._brpop_read and ._in_poll (the pending BRPOP)",
        "handing_back",
        "a wake copy popped by a stopping worker's last BRPOP comes back when its connection closes",
        _redis_pending_brpop,
    ),
    Internal(
        "kombu Redis transport's list names (sep, priority_steps, _q_for_pri)",
        "due_copies",
        "due copies are moved to the list names of kombu 5.3-5.7; if kombu names them otherwise, "
        "set broker_transport_options 'sep' and 'priority_steps' explicitly",
        _redis_list_names,
    ),
    Internal(
        "kombu Redis Channel._put(queue, message), _q_for_pri and _get_message_priority",
        "stowing",
        "a waiting task's copy is published, then stowed, in two round trips to the broker's Redis, not one",
        _redis_put,
    ),
    Internal(
        "celery.app.task.get_actual_ignore_result",
        "started",
        "a task with track_started stores no STARTED state of its own",
        _ignore_result_helper,
    ),
    Internal(
        "celery.worker.state.active_requests and reserved_requests",
        "handing_back",
        "a warm shutdown hands back its wake copies only when the connection closes",
        _received_task_registers,
    ),
    Internal(
        "celery AsynPool._event_process_exit(hub, proc) and maintain_pool",
        "child_exits",
        "a killed pool process may be noticed, and its slot given back, only at Celery's next "
        "pool maintenance, up to 5 s later",
        _pool_process_exit_event,
    ),
)


def broken_internals(internals: tuple[Internal, ...] = INTERNALS) -> list[Internal]:
    """The entries that no longer hold with the installed Celery and kombu."""
    broken = []
    for internal in internals:
        try:
            holds = internal.holds()
        except Exception:  # an import or a signature that moved: the entry is gone
            holds = False
        if not holds:
            broken.append(internal)
    return broken


def installed_versions() -> str:
    found = []
    for package in TESTED_WITH:
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} (not installed)")
    return ", ".join(found)


def warn_if_broken(internals: tuple[Internal, ...] = INTERNALS) -> list[Internal]:
    """Log one warning naming every entry that no longer holds and what falls back; return them."""
    broken = broken_internals(internals)
    if broken:
        tested = ", ".join(f"{name} {low}-{high}" for name, (low, high) in TESTED_WITH.items())
        lines = [f"- {entry.name} (used by {entry.used_by}): {entry.falls_back}" for entry in broken]
        logger.warning(
            "celery-semaphore: %d Celery/kombu internal(s) it relies on changed (installed: %s; "
            "tested with %s). The limit still holds; what falls back:\n%s",
            len(broken),
            installed_versions(),
            tested,
            "\n".join(lines),
        )
    return broken
