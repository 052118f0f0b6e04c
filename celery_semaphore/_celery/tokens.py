"""The names a task stands and holds under: its waiter id and its holder tokens.

A task's waiter id is its task id, escaped so that no id reads as a mark of the line's own
(an offer, a weight). Its holder token adds which host and process hold the slot, so that the
worker's main process can give back exactly the slot of a child it lost (it knows the task id
and the child's pid, not the token's random part), never one another copy of the task holds.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
from typing import Any

from .._core.attempts import new_token
from .._core.multi import MultiSemaphore
from .._core.storage import OFFER_MARK, WEIGHT_MARK


def task_key(task_id: Any) -> str:
    """A task id as it appears in waiter ids and holder tokens. Ids starting with "!" or "*"
    would read as the marks of an offer or of a weighted waiter: those (and "~", so that no two
    ids meet) get a "~" in front."""
    text = str(task_id)
    return "~" + text if text[:1] in (OFFER_MARK, WEIGHT_MARK, "~") else text


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


def waiter_of(semaphore: Any, request: Any) -> str:
    """The id a task's wait stands in line under: its task id (with the weight in front for a
    MultiSemaphore, whose lines read it from there)."""
    key = task_key(request.id)
    return semaphore.waiter_id(key) if isinstance(semaphore, MultiSemaphore) else key
