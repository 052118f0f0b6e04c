"""Commands sent to a Redis now whose replies are read later, so that a second Redis is asked
meanwhile: two questions in two servers cost one round trip of waiting instead of two.

A woken copy's run is checked in the broker's Redis and in the result backend before its body
starts (``task.py``); asked one after the other, the second waited for the first's reply, about
a round trip of the hand-off on every waited copy. Redis runs what a connection sent whether or
not the client reads the reply yet, so the commands go out on a connection of the client's pool,
the other check runs, and the replies are read then. A connection whose replies were not all
read (an error, or a caller that never asked for them) is closed, never put back with replies
pending in it: the next command sent on it would read them as its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any

import redis


class SentAhead:
    """``commands`` (argument tuples) sent now on a connection of ``client``'s pool; ``replies``
    waits for their replies. Use it as a context manager, so that the connection goes back to
    its pool whatever happens between the two."""

    def __init__(self, client: redis.Redis, commands: Sequence[tuple[Any, ...]]) -> None:
        self._pool: Any = client.connection_pool
        self._count = len(commands)
        connection: Any = self._pool.get_connection()
        self._connection: Any = connection
        try:
            connection.send_packed_command(connection.pack_commands(commands))
        except BaseException:
            self._close(read=False)
            raise

    def replies(self) -> list[Any]:
        """The commands' replies, in order (raw, as Redis sent them; an error reply raises)."""
        if self._connection is None:
            raise RuntimeError("the replies of these commands were read or given up already")
        try:
            answers = [self._connection.read_response() for _ in range(self._count)]
        except BaseException:
            self._close(read=False)
            raise
        self._close(read=True)
        return answers

    def __enter__(self) -> SentAhead:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Give the replies up, if not read: the connection is closed and goes back to its pool."""
        if self._connection is not None:
            self._close(read=False)

    def _close(self, *, read: bool) -> None:
        connection, self._connection = self._connection, None
        if not read:
            connection.disconnect()  # its unread replies must never reach another command
        self._pool.release(connection)
