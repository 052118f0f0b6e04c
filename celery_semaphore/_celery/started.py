"""Under ``task_track_started``, a semaphore task is STARTED once its body is about to run, not
as each of its messages arrives.

Celery's tracer stores STARTED before ``__call__``, for every delivery. A semaphore task's
delivery may end without running the body: refused (it waits; Celery stores RETRY), or dropped
as a copy of a run that has finished (``Ignore``, which stores nothing). The STARTED stored for
such a copy stayed: a task that had failed read STARTED from then on (result backends refuse to
overwrite only a SUCCESS). So a bound semaphore task tells the tracer not to track
(``track_started`` False) and stores STARTED itself, as the tracer would, once it holds its slot.
"""

from __future__ import annotations

import os
from typing import Any

from celery import states

try:
    from celery.app.task import get_actual_ignore_result
except ImportError:  # Celery before 5.3.1: no per-request ignore_result

    def get_actual_ignore_result(task: Any, req: Any) -> bool:
        return bool(task.ignore_result)


# The task class's own track_started (task_track_started where unset), kept as it is turned off.
_TRACKS_STARTED = "_semaphore_tracks_started"


def take_over_started(cls: Any) -> None:
    """Turn the tracer's STARTED off for a bound task class, keeping whether it wanted one (after
    ``Task.bind`` filled ``track_started`` from the settings; binding again changes nothing)."""
    setattr(cls, _TRACKS_STARTED, bool(cls.track_started) or bool(getattr(cls, _TRACKS_STARTED, False)))
    cls.track_started = False


def store_started(task: Any) -> None:
    """Store STARTED for the body about to run, where the tracer would have: a tracked task whose
    result is not ignored (never for an eager call, which does not get here)."""
    request = task.request
    if getattr(type(task), _TRACKS_STARTED, False) and not get_actual_ignore_result(task, request):
        meta = {"pid": os.getpid(), "hostname": request.hostname}
        task.backend.store_result(request.id, meta, states.STARTED, request=request)
