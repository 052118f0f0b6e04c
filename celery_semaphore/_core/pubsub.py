"""How a process hears pub/sub messages through redis-py, on any deployment the package supports.

Classic SUBSCRIBE on one connection (``Subscription``), or on a cluster whose masters all run
Redis >= 7 sharded SSUBSCRIBE on each master that owns a channel (``ShardedSubscription``); either
way the caller is told when a connection came back, since messages published meanwhile are lost.

Separate from :mod:`.wakeups` because this is the part that leans on redis-py's internals (its
``PubSub`` objects and their connect callbacks, the socket under a connection, a cluster's slot
map and per-node clients) and so changes when redis-py does; the waiter registry sees only
``subscribe``, ``unsubscribe``, ``next_message`` and ``close``. Only the wake-up listener thread
calls these (:mod:`.wakeups` says why).

A sharded listener holds one connection per master it has channels on and waits on all of them at
once (``selectors``, then reads only the ready ones without blocking), plus a local socket pair
through which waiters poke it instead of the control channel. When a channel's slot moves
(``CLUSTER FAILOVER``, a master replaced) Redis 7 unsubscribes it (an ``sunsubscribe`` nobody
asked for): the listener refreshes the cluster's slot map, subscribes again on the new owner, and
once that is confirmed wakes that channel's blocked callers to ask again; for a few seconds it
reads the map again every second, in case the first answer was still the old one. A broken connection to
any master resets the whole listener, as in the classic case.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import redis
import redis.cluster

from .storage import as_text

logger = logging.getLogger("celery_semaphore")

# The first Redis with sharded pub/sub (SSUBSCRIBE, SPUBLISH).
SHARDED_SINCE = 7
# After a slot moved, a sharded listener reads the slot map again this often, for this long, and
# moves any channel still subscribed on a node that no longer owns its slot: right after a
# failover a node may still report the old map (a replica of the shard still hears its wake-ups,
# but its master is where they belong).
RECHECK_EVERY_S = 1.0
RECHECK_FOR_S = 10.0


class Subscription:
    """The pub/sub connection, behind the few calls the listener needs. Only the listener thread
    calls these. (Sharded pub/sub on a Redis >= 7 cluster: ``ShardedSubscription``.)"""

    def __init__(self, client: Any, on_reconnect: Callable[[], None]) -> None:
        self._pubsub = client.pubsub()
        self._on_reconnect = on_reconnect
        self._watching: Any = None

    def subscribe(self, *channels: str) -> None:
        self._pubsub.subscribe(*channels)
        if self._watching is None and getattr(self._pubsub, "connection", None) is not None:
            # redis-py resubscribes by itself after a reconnect; messages published meanwhile
            # are lost, so the listener wants to know (registered after the first connect, so
            # only reconnects call it; redis-py keeps a weak reference to this bound method)
            self._watching = self._pubsub.connection
            self._watching.register_connect_callback(self._reconnected)

    def _reconnected(self, _connection: Any) -> None:
        self._on_reconnect()

    def unsubscribe(self, *channels: str) -> None:
        self._pubsub.unsubscribe(*channels)

    def next_message(self, timeout: float) -> dict[str, Any] | None:
        message: dict[str, Any] | None = self._pubsub.get_message(timeout=timeout)
        return message

    def close(self) -> None:
        try:
            if self._watching is not None:
                self._watching.deregister_connect_callback(self._reconnected)
            self._pubsub.close()
        except Exception:  # closing a broken connection may fail too; it is gone either way
            pass


def uses_sharded_pubsub(client: Any) -> bool:
    """True for a cluster client whose masters all run Redis >= 7 (asked once, when the listener
    is made). Anything else, or a cluster that cannot be asked now, gets classic pub/sub: PUBLISH
    reaches every node of any cluster, just less cheaply."""
    if not isinstance(client, redis.cluster.RedisCluster):
        return False
    try:
        versions = [
            _server_version(client.get_redis_connection(node))
            for node in client.get_primaries()  # type: ignore[no-untyped-call]
        ]
        return bool(versions) and all(int(version.split(".")[0]) >= SHARDED_SINCE for version in versions)
    except Exception as error:  # RedisClusterException is no RedisError; a version may not parse
        logger.info("could not read the cluster's Redis versions, wake-ups use classic pub/sub: %s", error)
        return False


def _server_version(node_client: Any) -> str:
    """The server's version from HELLO without arguments (in @connection, which the ACL rules of
    docs/deploying.md allow, where INFO is not; it changes nothing on the connection)."""
    reply = node_client.execute_command("HELLO")
    if isinstance(reply, dict):
        fields = {as_text(key): value for key, value in reply.items()}
    else:
        fields = {as_text(key): value for key, value in zip(reply[::2], reply[1::2], strict=False)}
    return as_text(fields["version"])


class ShardedSubscription:
    """Sharded pub/sub on a cluster, behind the same calls as ``Subscription``: each channel is
    SSUBSCRIBEd on the master owning its slot, over one connection per master, and
    ``next_message`` waits on all of them and on the poke socket at once. Only the listener
    thread calls these.

    redis-py's ``ClusterPubSub.get_sharded_message(timeout=t)`` would read the masters in turn,
    blocking up to ``t`` on each: a wake-up on one master would wait behind the others' timeouts.
    Here ``selectors`` tells which connections have data, and only those are read, without
    blocking. Messages come out as redis-py makes them (``ssubscribe``, ``smessage``), plus
    ``{"type": "lost", "channel": ...}`` for a channel the server unsubscribed by itself (its slot
    moved): the listener subscribes it again, here after a refresh of the slot map."""

    def __init__(
        self,
        client: Any,
        on_reconnect: Callable[[], None],
        pokes: socket.socket,
        *,
        refresh: bool,
    ) -> None:
        self._client = client
        self._on_reconnect = on_reconnect
        self._pokes = pokes
        self._nodes: dict[str, Any] = {}  # node name -> redis-py PubSub on that master
        self._where: dict[str, str] = {}  # channel -> node name it is SSUBSCRIBEd on
        self._leaving: dict[str, set[str]] = {}  # node name -> channels we SUNSUBSCRIBEd there
        self._ready: deque[dict[str, Any]] = deque()
        self._selector = selectors.DefaultSelector()
        self._stale = refresh  # refresh the slot map before the next SSUBSCRIBE
        self._recheck_until = time.monotonic() + RECHECK_FOR_S if refresh else 0.0
        self._next_recheck = 0.0

    def subscribe(self, *channels: str) -> None:
        if self._stale:
            self._stale = False
            self._client.nodes_manager.initialize()
        by_node: dict[str, list[str]] = {}
        for channel in channels:
            node = self._client.get_node_from_key(channel)
            old = self._where.get(channel)
            if old is not None and old != node.name:
                self._leave(old, [channel])
            if node.name not in self._nodes:
                self._nodes[node.name] = self._client.get_redis_connection(node).pubsub()
            by_node.setdefault(node.name, []).append(channel)
        for name, names in by_node.items():
            pubsub = self._nodes[name]
            new_connection = pubsub.connection is None
            pubsub.ssubscribe(*names)
            for channel in names:
                self._where[channel] = name
                self._leaving.get(name, set()).discard(channel)
            if new_connection:
                # as in Subscription: told of reconnects (redis-py resubscribes by itself, but
                # messages published meanwhile are lost)
                pubsub.connection.register_connect_callback(self._reconnected)

    def _reconnected(self, _connection: Any) -> None:
        self._on_reconnect()

    def unsubscribe(self, *channels: str) -> None:
        by_node: dict[str, list[str]] = {}
        for channel in channels:
            name = self._where.pop(channel, None)
            if name is not None:
                by_node.setdefault(name, []).append(channel)
        for name, names in by_node.items():
            self._leave(name, names)

    def _leave(self, name: str, channels: list[str]) -> None:
        for channel in channels:
            if self._where.get(channel) == name:
                del self._where[channel]
        if not any(where == name for where in self._where.values()):
            self._drop_node(name)  # nothing left there: close the connection instead
            return
        self._leaving.setdefault(name, set()).update(channels)
        self._nodes[name].sunsubscribe(*channels)

    def _drop_node(self, name: str) -> None:
        pubsub = self._nodes.pop(name, None)
        self._leaving.pop(name, None)
        if pubsub is not None:
            _close_pubsub(pubsub, self._reconnected)

    def next_message(self, timeout: float) -> dict[str, Any] | None:
        """A message, or None after ``timeout`` s or a poke. A poke taken in is never followed by
        a wait: it means a channel was added to the listener's table after the listener last read
        it, so the listener must read the table again first (waiting here instead lost the poke,
        and that channel's subscription, for a whole ``timeout``)."""
        poked = False
        if not self._ready:
            self._recheck()
            poked = self._read_ready()
        if not self._ready and not poked:
            if self._recheck_until:
                timeout = min(timeout, max(0.0, self._next_recheck - time.monotonic()))
            self._wait(timeout)
            self._read_ready()
        return self._ready.popleft() if self._ready else None

    def _recheck(self) -> None:
        """For a while after a slot moved: channels on a node that no longer owns their slot are
        reported lost, to be subscribed on the owner."""
        now = time.monotonic()
        if now >= self._recheck_until:
            self._recheck_until = 0.0
            return
        if now < self._next_recheck:
            return
        self._next_recheck = now + RECHECK_EVERY_S
        self._client.nodes_manager.initialize()
        for channel, name in list(self._where.items()):
            if self._client.get_node_from_key(channel).name != name:
                self._leave(name, [channel])
                self._ready.append({"type": "lost", "channel": channel})

    def _wait(self, timeout: float) -> None:
        """Block until the poke socket or any master's connection has data, or ``timeout`` s."""
        watched: dict[int, Any] = {}
        for name, pubsub in self._nodes.items():
            sock = _socket_of(pubsub.connection)
            if sock is not None and sock.fileno() >= 0:
                watched[sock.fileno()] = name
        try:
            self._selector.register(self._pokes, selectors.EVENT_READ)
            for fileno in watched:
                self._selector.register(fileno, selectors.EVENT_READ)
            self._selector.select(timeout)
        finally:
            for key in list(self._selector.get_map().values()):
                self._selector.unregister(key.fileobj)

    def _read_ready(self) -> bool:
        """Take in every poke and every message already arrived or buffered, blocking nowhere;
        True if there was a poke."""
        poked = False
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while self._pokes.recv(4096):
                poked = True
        for name in list(self._nodes):
            pubsub = self._nodes.get(name)
            try:
                while pubsub is not None and pubsub.connection is not None and pubsub.connection.can_read(timeout=0):
                    message = pubsub.handle_message(pubsub.parse_response(block=False, timeout=0))
                    if message is not None:
                        self._take(name, pubsub, message)
            except redis.exceptions.ResponseError as error:
                # an SSUBSCRIBE refused (MOVED: the slot is elsewhere): start over on that master
                logger.info("wake-up channels on %s to subscribe again: %s", name, error)
                self._lose_node(name)
        return poked

    def _take(self, name: str, pubsub: Any, message: dict[str, Any]) -> None:
        if message.get("type") != "sunsubscribe":
            self._ready.append(message)
            return
        channel = as_text(message.get("channel"))
        leaving = self._leaving.get(name, set())
        if channel in leaving:
            leaving.discard(channel)  # one we asked for
            return
        if self._where.get(channel) == name:
            # the server dropped it: its slot moved to another master (a failover)
            del self._where[channel]
            pubsub.shard_channels.pop(message.get("channel"), None)  # not to be resubscribed here
            self._lost(channel)

    def _lose_node(self, name: str) -> None:
        lost = [channel for channel, where in self._where.items() if where == name]
        for channel in lost:
            del self._where[channel]
            self._lost(channel)
        self._drop_node(name)
        self._stale = True

    def _lost(self, channel: str) -> None:
        self._ready.append({"type": "lost", "channel": channel})
        self._stale = True
        self._recheck_until = time.monotonic() + RECHECK_FOR_S

    def close(self) -> None:
        for name in list(self._nodes):
            self._drop_node(name)
        self._selector.close()


def _socket_of(connection: Any) -> socket.socket | None:
    """The socket under a redis-py connection (a client-side-cache proxy keeps it one level down)."""
    for candidate in (connection, getattr(connection, "_conn", None)):
        sock = getattr(candidate, "_sock", None)
        if sock is not None:
            return sock  # type: ignore[no-any-return]
    return None


def _close_pubsub(pubsub: Any, callback: Callable[[Any], None]) -> None:
    try:
        if pubsub.connection is not None:
            pubsub.connection.deregister_connect_callback(callback)
        pubsub.close()
    except Exception:  # closing a broken connection may fail too; it is gone either way
        pass
