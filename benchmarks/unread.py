"""Records a benchmark's workers send without waiting for the reply.

A record taken on a task's way to its body (its receipt in the worker's main process, its run in
a pool child) or inside the slot it holds would otherwise add a round trip to the very time it
measures: the hand-off, or the pace of a drain. The records are sent with the package's own
``SentAhead`` (which a woken task's run checks use): on a connection of the client's pool, held
until the replies are read, at the next send or by ``replies`` for a caller that needs them.
Each send reads the last one's replies first, so one sender's records reach Redis in order: a
later record that a benchmark waits for (a body's end) is never seen before the earlier ones.
A forked child drops what its parent left unread: that socket is not its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import redis

from celery_semaphore._celery.sent_ahead import SentAhead


class UnreadRecords:
    """Commands of one sender sent at once, in order, their replies read later."""

    def __init__(self, client_of: Callable[[], redis.Redis]) -> None:
        self._client_of = client_of
        self._pid = 0
        self._unread: SentAhead | None = None

    def send(self, *commands: tuple[Any, ...]) -> None:
        """Send ``commands`` (argument tuples) at once, after reading (and dropping) the replies
        of the last send, so that they never pile up in the socket."""
        self.replies()
        self._unread, self._pid = SentAhead(self._client_of(), commands), os.getpid()

    def replies(self) -> list[Any]:
        """The replies of the last ``send`` not read yet, waiting for them if need be."""
        unread, self._unread = self._unread, None
        if unread is None or self._pid != os.getpid():  # a forked child: its parent's socket is not its own
            return []
        return unread.replies()
