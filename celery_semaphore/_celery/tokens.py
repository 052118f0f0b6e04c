"""The names a task stands and holds under: its waiter id and its holder tokens.

A task's waiter id is its task id, escaped so that no id reads as a mark of the line's own
(an offer, a weight), and written short when it is a UUID as Celery makes them (``waiter_key``).
Its holder token adds which host and process hold the slot, so that the worker's main process
can give back exactly the slot of a child it lost (it knows the task id and the child's pid, not
the token's random part), never one another copy of the task holds.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import socket
import uuid
from typing import Any

from .._core.attempts import new_token
from .._core.multi import MultiSemaphore
from .._core.storage import OFFER_MARK, WEIGHT_MARK

# In front of a waiter id that is a task id written short (``waiter_key``); a task id that starts
# with it is escaped (``task_key``), so that the two never meet.
SHORT_ID_MARK = "="
_CELERY_TASK_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_SHORT_ID = re.compile(r"=[A-Za-z0-9_-]{22}")


def task_key(task_id: Any) -> str:
    """A task id as it appears in holder tokens and long waiter ids. Ids starting with "!" or
    "*" would read as the marks of an offer or of a weighted waiter: those (and "~", so that no
    two ids meet, and ``SHORT_ID_MARK``) get a "~" in front."""
    text = str(task_id)
    return "~" + text if text[:1] in (OFFER_MARK, WEIGHT_MARK, "~", SHORT_ID_MARK) else text


def waiter_key(task_id: Any, *, short: bool = True) -> str:
    """The waiter id a task stands in line under. A task id as Celery makes it (a UUID written
    in lower case, 36 characters) is written as ``SHORT_ID_MARK`` and its 16 bytes in base64url,
    23 characters: a waiting task's id is in four keys of its line (the queue, the present and
    the deadlines sorted sets, waiter_info) and its parked record, where 36 characters take
    Redis's 48-byte allocation and 23 its 32-byte one, 80 B less per waiting task (measured,
    docs/benchmarks.md). Any other id is ``task_key``'s. ``short=False``: the id a wait begun
    by a release before this one stands under (``WaitHistory.short_waiter``)."""
    text = str(task_id)
    if short and len(text) == 36 and _CELERY_TASK_ID.fullmatch(text):
        return SHORT_ID_MARK + base64.urlsafe_b64encode(uuid.UUID(text).bytes).decode().rstrip("=")
    return task_key(text)


def task_id_of(waiter_id: str) -> str:
    """The task id a task's waiter id (``waiter_key``, not weighted) was made from."""
    if _SHORT_ID.fullmatch(waiter_id):
        try:
            return str(uuid.UUID(bytes=base64.urlsafe_b64decode(waiter_id[1:] + "==")))
        except (binascii.Error, ValueError):
            return waiter_id
    return waiter_id[1:] if waiter_id.startswith("~") else waiter_id


def shown_waiter(waiter_id: str) -> str:
    """A waiter id as people read it: a task's id written short shown as its task id, behind a
    weight mark if it has one (``"*2*<task id>"``); any other id as it is."""
    weight, _, rest = waiter_id.rpartition(WEIGHT_MARK) if waiter_id.startswith(WEIGHT_MARK) else ("", "", waiter_id)
    if not _SHORT_ID.fullmatch(rest):
        return waiter_id
    return f"{weight}{WEIGHT_MARK if weight else ''}{task_id_of(rest)}"


# A task's holder token is "<task key>:<host><pid><random>" (8, 8 and 16 hex digits; a weight
# mark may follow): the worker's main process, which knows the task id and the pid of a child it
# lost but not the random part, gives back exactly that child's slot, never the slot another copy
# of the same task holds in another process (a wake copy and its backstop, a redelivery). In a
# worker the random part starts with the worker instance's id (8 hex digits, node_names.py), so
# that a worker restarted under the node name finds the slots of the dead instance.
_HOST_PART = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_instance = ""  # set in the worker's main process before it forks its pool: children inherit it


def set_instance(instance: str) -> None:
    global _instance
    _instance = instance


def process_token() -> str:
    """The part of a task's holder token after "<task key>:", for this process."""
    return f"{_HOST_PART}{os.getpid() & 0xFFFFFFFF:08x}{_instance}{new_token()[: 16 - len(_instance)]}"


def token_rest_of(pid: int) -> re.Pattern[str]:
    """What follows "<task key>:" in the tokens of process ``pid`` of this host."""
    return re.compile(rf"{_HOST_PART}{pid & 0xFFFFFFFF:08x}[0-9a-f]{{16}}({re.escape(WEIGHT_MARK)}\d+)?")


def waiter_of(semaphore: Any, request: Any, *, short: bool = True) -> str:
    """The id a task's wait stands in line under: its task id as ``waiter_key`` writes it (with
    the weight in front for a MultiSemaphore, whose lines read it from there)."""
    key = waiter_key(request.id, short=short)
    return semaphore.waiter_id(key) if isinstance(semaphore, MultiSemaphore) else key
