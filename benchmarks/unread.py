"""Records a benchmark's workers send without waiting for the reply.

A record taken on a task's way to its body (its receipt in the worker's main process, its run in
a pool child) or inside the slot it holds would otherwise add a round trip to the very time it
measures: the hand-off, or the pace of a drain. The records go on a connection of their own, one
per process: Redis runs a connection's commands in the order it sent them, so a later record of
the same process that a benchmark waits for (a body's end) is never seen before them, and what
is sent is on its way at once (a write to the socket, no wait). The replies are read, and
dropped, at the next send, or returned by ``replies`` to a caller that needs them later.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import redis


class UnreadRecords:
    """Commands sent on a connection of this process's own, their replies read later."""

    def __init__(self, client_of: Callable[[], redis.Redis]) -> None:
        self._client_of = client_of
        self._pid = 0
        self._connection: Any = None
        self._unread = 0

    def send(self, *commands: tuple[Any, ...]) -> None:
        """Send ``commands`` (argument tuples) at once, after reading (and dropping) the replies
        of the last send, so that they never pile up in the socket."""
        self.replies()
        connection = self._connection_here()
        connection.send_packed_command(connection.pack_commands(commands))
        self._unread = len(commands)

    def replies(self) -> list[Any]:
        """The replies of the last ``send`` not read yet, waiting for them if need be."""
        if not self._unread or self._pid != os.getpid():
            self._unread = 0
            return []
        replies = [self._connection.read_response() for _ in range(self._unread)]
        self._unread = 0
        return replies

    def _connection_here(self) -> Any:
        if self._pid != os.getpid():  # a forked child: its parent's socket is not its own
            self._connection, self._pid, self._unread = None, os.getpid(), 0
        if self._connection is None:
            self._connection = self._client_of().connection_pool.make_connection()
            self._connection.connect()
        return self._connection
