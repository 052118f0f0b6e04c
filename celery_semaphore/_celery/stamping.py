"""Every task message is stamped as it is sent: when (``csem_sent``) and which message it is
(``csem_message``, a random nonce).

A broker's redelivery of a message carries its stamps unchanged, and every copy of a wait keeps
them, while a new invocation gets new ones even where it reuses a task id (a fixed id for a
nightly job). So a success in the result backend recorded before the send belongs to an earlier
invocation (``task.py``), and the note that ties a first delivery to the wait it began names the
one message (``wait_runs.py``): a message redelivered under a reused id never continues, nor is
dropped for, an earlier invocation's wait.

Stamped in ``before_task_publish``, not in ``SemaphoreTask.apply_async``, so that a message sent
by name (``app.send_task`` from an app that does not define the task) is stamped too. A publisher
cannot tell a semaphore task by its name: every message this process sends gets the two short
headers.
"""

from __future__ import annotations

from typing import Any

from celery import signals

from .._core.attempts import new_token
from .wait_headers import MESSAGE_HEADER, NONCE_CHARS, SENT_HEADER, epoch_ms


def stamp(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """Stamp a message about to be published (its headers are what is sent); a stamp it carries
    already (a copy of a wait, the task's own retry) is kept."""
    if headers is None:
        return
    headers.setdefault(SENT_HEADER, epoch_ms())
    headers.setdefault(MESSAGE_HEADER, new_token()[:NONCE_CHARS])


signals.before_task_publish.connect(stamp, weak=False, dispatch_uid="celery_semaphore.stamp")
