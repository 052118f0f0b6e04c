"""The scripts on a ``redis.asyncio`` client: the same calls as the blocking ``Scripts``
(``script_calls`` builds them and parses their replies), sent in batches.

Why batches: a thousand coroutines waiting in one event loop each ask again now and then, and a
release, a cancel or a start of many of them at once asks many times in the same instant. Sent
one by one, each call would take a connection of its own from the client's pool (asyncio's pool
opens as many as there are calls in flight): a thousand waiters, a thousand connections. Here one
sender per event loop and client takes every call queued since its last round trip and sends them
together, in one write, as a pipeline does (not a transaction: each script is atomic on its
own, and they run in the order they were asked), on a pool connection the sender holds while it
has calls to send (``_on_connection`` says why not redis-py's pipeline). So a loop holds one
command connection however many coroutines ask, and a burst costs one round trip, not one per
caller. (On a Redis Cluster, whose asyncio
pipeline refuses EVALSHA, a batch's calls go one after another: still one connection per node.)

A call whose caller was cancelled before it was sent is dropped: it never runs. One already sent
runs; its caller learns nothing of the reply (see ``AsyncFairSemaphore`` for what it undoes).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, TypeVar

import redis.asyncio
from redis.exceptions import NoScriptError

from .loop_local import LoopLocal
from .script_calls import ScriptCall
from .scripts import script_source

R = TypeVar("R")

# The scripts the asyncio semaphores run (the builders of ``script_calls`` and ``script_calls_many``).
_ASYNC_NAMES = (
    *("acquire", "release", "renew", "leave", "status", "set_limit", "set_gate", "reset"),
    *("acquire_many", "release_many", "renew_many", "leave_many"),
)
# Keep-alive asks sent in one batch at most (after every urgent call queued).
LATER_PER_BATCH = 64
_Pending = tuple[ScriptCall[Any], "asyncio.Future[Any]"]


class AsyncScripts:
    """The scripts of one asyncio client in one event loop: ``await run(call)`` with a call of
    ``script_calls`` (``run(script_calls.release(keys, ...))``), queued and sent in the next batch."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._cluster = isinstance(client, redis.asyncio.RedisCluster)
        self._sources = {name: script_source(name) for name in _ASYNC_NAMES}
        self._shas = {name: hashlib.sha1(source.encode("utf-8")).hexdigest() for name, source in self._sources.items()}
        self._queue: list[_Pending] = []  # urgent calls: releases, claims, leaves, first tries
        self._later: list[_Pending] = []  # keep-alive asks: they must not hold a hand-off up
        self._sender: asyncio.Task[None] | None = None
        # the pool's connection the sender holds while it has batches to send (see _replies)
        self._connection: Any = None

    async def run(self, call: ScriptCall[R], *, urgent: bool = True) -> R:
        """Queue one call for the next batch and wait for its parsed reply. A call not
        ``urgent`` (a waiter's keep-alive ask) goes after the urgent ones, at most
        ``LATER_PER_BATCH`` a batch: a thousand keep-alives falling due together must not hold
        up the release or the claim of a hand-off behind them."""
        return call.parse(await self.submit(call, urgent=urgent))

    def submit(self, call: ScriptCall[Any], *, urgent: bool = True) -> asyncio.Future[Any]:
        """Queue one call now, without yielding, and return the future of its raw reply (``run``
        without the wait and the parse). Why not only ``run``: the wake-up reader queues a
        waiter's claim from its own turn as it hears the offer, so the claim can leave in the
        very next batch rather than one event-loop turn later, once the waiter has woken.
        Cancelling the future before the call is sent drops the call."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        (self._queue if urgent else self._later).append((call, future))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send(), name="celery-semaphore-scripts")
        return future

    async def _send(self) -> None:
        """Send what is queued, batch after batch, until the queue is empty."""
        try:
            while self._queue or self._later:
                later, self._later = self._later[:LATER_PER_BATCH], self._later[LATER_PER_BATCH:]
                # a call whose caller was cancelled before it was sent is never sent
                batch = [pending for pending in (*self._queue, *later) if not pending[1].done()]
                self._queue = []
                if batch:
                    await self._send_batch(batch)
        finally:
            self._sender = None
            connection, self._connection = self._connection, None
            if connection is not None:
                await self._client.connection_pool.release(connection)
            if self._queue or self._later:  # queued while the last batch was being answered, or left by a failure
                self._sender = asyncio.create_task(self._send(), name="celery-semaphore-scripts")

    async def _send_batch(self, batch: list[_Pending]) -> None:
        calls = [call for call, _ in batch]
        try:
            replies = await self._replies(calls)
            missing = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if missing:
                # the server lost its script cache (or never had it): load each missing script
                # once (on a cluster, into every master) and run those calls again, together;
                # NOSCRIPT means they never ran
                for name in dict.fromkeys(calls[index].name for index in missing):
                    await self._client.script_load(self._sources[name])
                again = await self._replies([calls[index] for index in missing])
                for index, reply in zip(missing, again, strict=True):
                    replies[index] = reply
        except Exception as error:  # the whole batch failed (connection lost, say): every caller sees it
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        for (_, future), reply in zip(batch, replies, strict=True):
            if future.done():
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _replies(self, calls: list[ScriptCall[Any]]) -> list[Any]:
        """Run ``calls`` in one round trip (on a cluster, one after another): each one's reply,
        or the error of that call alone."""
        if self._cluster:
            # redis-py's asyncio cluster pipeline refuses EVALSHA: one after another there
            return [await self._evalsha_or_error(call) for call in calls]
        if self._client.connection is None:  # not a single-connection client: see _on_connection
            return await self._on_connection(calls)
        if len(calls) == 1:
            return [await self._evalsha_or_error(calls[0])]
        pipe = self._client.pipeline(transaction=False)
        for call in calls:
            pipe.evalsha(self._shas[call.name], len(call.keys), *call.keys, *call.args)
        return list(await pipe.execute(raise_on_error=False))

    async def _on_connection(self, calls: list[ScriptCall[Any]]) -> list[Any]:
        """Write ``calls`` at once on the connection the sender holds and read their replies.

        Why not a redis-py pipeline: the event loop of a thousand coroutines is mostly busy, and
        every hand-off waits in its queue twice (the release, then the claim), so the loop's
        CPU per batch is hand-off latency. A pipeline takes a connection from the pool and
        gives it back for every batch (a lock, connection checks, metrics and events each way)
        and builds its command stack; here the connection is taken once per busy spell (the
        sender gives it back when its queue is empty, so a loop that ends leaks nothing) and a
        batch costs one write and its reads. A failed write or read disconnects it (redis-py
        does), and the pool reconnects it next time."""
        connection = self._connection
        if connection is None:
            connection = self._connection = await self._client.connection_pool.get_connection()
        else:
            await connection.connect()  # a no-op unless the client was closed meanwhile
        await connection.send_packed_command(
            connection.pack_commands(
                [("EVALSHA", self._shas[call.name], len(call.keys), *call.keys, *call.args) for call in calls]
            )
        )
        replies: list[Any] = []
        for _ in calls:
            try:
                replies.append(await connection.read_response())
            except redis.ResponseError as error:  # that call's error alone (the reply was read)
                # without its traceback: it and the frames it holds would form a cycle (each
                # frame holds the error), garbage for the cycle collector, a NOSCRIPT per call
                # of the first batch after a restart
                replies.append(error.with_traceback(None))
        return replies

    async def _evalsha_or_error(self, call: ScriptCall[Any]) -> Any:
        try:
            return await self._client.evalsha(self._shas[call.name], len(call.keys), *call.keys, *call.args)
        except (redis.RedisError, redis.exceptions.RedisClusterException) as error:
            return error.with_traceback(None)  # this caller's failure only, as in a pipeline (see above)


_per_loop: LoopLocal[AsyncScripts] = LoopLocal(AsyncScripts)


def async_scripts_for(client: Any) -> AsyncScripts:
    """The scripts of ``client`` in the running event loop, made on first use there (a batch
    belongs to one loop: its futures do)."""
    return _per_loop.get(client)
