"""A prefork worker notices a pool process that died at once, not up to 5 s later.

A slot held by a task whose pool process is killed (SIGKILL, the OOM killer) comes back when the
worker notices the death: Celery then fails the task with ``WorkerLostError``, the semaphore's
failure hook gives the slot back, and with ``acks_late`` and ``reject_on_worker_lost`` the
message goes back to its queue. Celery's prefork pool watches each process's sentinel (a pipe
the process holds open) and looks for exited processes when it reads end-of-file. But the kernel
closes a dying process's files a moment before the process can be reaped: the pool often looks
in that moment, finds nobody exited, stops watching the sentinel, and leaves the death to its
periodic maintenance, every 5 s. Measured on this project's test machine: of 8 SIGKILLed pool
processes, 4 were noticed 4.9-5.0 s late and 4 within 4 ms; so the slot idled for 5 s, and with
a broker ``visibility_timeout`` shorter than that, kombu's Redis transport restored the unacked
message before the worker requeued it (the restored copy, finding its run's slot still held, was
put off as the twin of a live run).

So when a sentinel fires and the pool keeps the process as alive, the worker's main process
looks again every few milliseconds, for a short while, until the process can be reaped, and then
has the pool maintained at once. It changes only when Celery's own maintenance runs; what that
maintenance does is Celery's. (Whoever looks first reaps: a look that finds the exit code has the
pool maintained there and then; the pool would otherwise notice the reaped process only at its
next maintenance.)
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("celery_semaphore")

# How often, and for how long, a sentinel that fired is followed by a look for the exit: a killed
# process is reapable within milliseconds; Celery's maintenance catches anything slower.
LOOK_EVERY_S = 0.01
LOOK_FOR_S = 1.0


def install(worker: Any) -> bool:
    """Make ``worker``'s prefork pool look again for a process whose sentinel fired before it
    could be reaped; whether it has such a pool."""
    pool: Any = getattr(getattr(worker, "pool", None), "_pool", None)
    on_exit = getattr(pool, "_event_process_exit", None)
    if pool is None or not callable(on_exit) or not callable(getattr(pool, "maintain_pool", None)):
        return False

    def event_process_exit(hub: Any, process: Any) -> None:
        on_exit(hub, process)
        if process in getattr(pool, "_pool", ()):  # the pool found nobody exited: not reapable yet
            _look_again(hub, pool, process, int(LOOK_FOR_S / LOOK_EVERY_S))

    pool._event_process_exit = event_process_exit
    return True


def _look_again(hub: Any, pool: Any, process: Any, looks_left: int) -> None:
    def look() -> None:
        if _reapable(process):
            pool.maintain_pool()  # the exit is reaped now: the pool fails its job and replaces it
        elif looks_left > 1:
            _look_again(hub, pool, process, looks_left - 1)

    hub.call_later(LOOK_EVERY_S, look)


def _reapable(process: Any) -> bool:
    """Whether the process has exited and can be reaped (looking reaps it)."""
    try:
        return process.exitcode is not None
    except Exception:  # already reaped elsewhere: the pool can only learn it from maintenance
        return True
