"""On the Redis broker, a waiting task's copies that are due later wait in the broker's Redis.

A task that waits outside the worker sends a copy of itself that is due later: its backstop
(should its wake-up be lost), or the copy that comes back for a start a rate, a spacing or a
pause reserved. Sent as a Celery countdown, that copy was fetched at once by some worker and held
there, unacknowledged, in its prefetch window until due: a long backlog under a quota moved out of
the broker into the workers' memory, ``worker_eta_task_limit`` stalled the wake-ups behind held
copies, and each parked task came back every 30 s to be refused again.

Here the process that sends the copy *stows* it at once, built by kombu's code and packed
(``stowing.py``, ``packing.py``: the values of its own, with its stencil kept once per task and
queue), into a sorted set of the broker's Redis (due when its header says, by that server's
clock, under the id of its wait's run: a newer copy of one wait replaces the older); once due,
``move_due_copies.lua`` moves it to the wake queue of its queue, put back together and routed as
that queue's message. A copy that cannot be packed is published whole to
``<queue>.semaphore-backstop``, a list no worker consumes, and stowed from there by the same
script. Each worker's main process runs the script on a timer of its own (as soon as the next
copy is due, at least once a second), so whichever worker is alive moves what is due. Every step
is one script in the broker's Redis: a process killed at any point leaves each copy in exactly
one place (the list, the store or its queue), and the next run of any worker carries on from
there. A copy is *withdrawn* when its run no longer needs it (``withdraw``): no copy outlives
its task. A parked task's wake-up sends the stored message to its queue (``send_stored``) and
leaves it stored as the backstop: no second copy of a waiting task is kept anywhere.

The script also watches the semaphore Redis's epoch (a random value it keeps under
``<prefix>:epoch``): one that came back empty (a restart without persistence) has a new one, and
then every stored copy is due at once, since nothing is left there to wake a parked task. So is
every copy moved lately that no copy of its run has asked since (it is kept, *sent*, until one
asks: stowed anew, granted, or withdrawn): kombu's Redis transport loses a message popped by the
``BRPOP`` of a worker being killed, and only the parked record, in the semaphore Redis, would
have sent that copy again.

Relies on kombu's Redis transport naming its lists ``<global_keyprefix><queue>`` and
``<queue><sep><priority>`` (``priority_steps``), and writing messages as JSON with the
routing key in ``properties.delivery_info``: unchanged from kombu 5.3 to 5.7 (``internals.py``).
"""

from __future__ import annotations

import importlib.resources
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis

from .._core import fork_locks
from .._core.clients import client_for
from .._core.storage import as_text, bucket_of
from .config import config_for
from .internals import KOMBU_REDIS_PRIORITY_STEPS, KOMBU_REDIS_SEPARATOR
from .packing import PACKED_MARK, Packed, digest_of, unpack
from .stowing import StowingUnavailable, stowing_producer
from .wake_queues import (
    BACKSTOP_QUEUE_SUFFIX,
    backstop_queue,
    is_derived_queue,
    is_wake_queue,
    origin_of_derived,
    wake_queue,
)

logger = logging.getLogger("celery_semaphore")

# The store's keys (behind kombu's global_keyprefix). Its copies are packed (``packing.py``)
# where their sender could pack them, against the stencils kept under STENCILS_KEY.
DUE_KEY = "semaphore-backstops:packed:due"
COPIES_KEY = "semaphore-backstops:packed:copies"
EPOCH_KEY = "semaphore-backstops:packed:epoch"
FINISHED_KEY = "semaphore-backstops:finished"
MOVED_KEY = "semaphore-backstops:packed:moved"
SENT_KEY = "semaphore-backstops:packed:sent"
STENCILS_KEY = "semaphore-backstops:packed:stencils"
STENCILS_KEPT_KEY = "semaphore-backstops:packed:stencils-kept"
# The store of earlier releases, which keep whole messages only and whose scripts would send a
# packed copy as it is: what they stored is still moved, sent and withdrawn from there, so that
# a rolling deploy strands nothing; this release stores nothing new in it.
EARLIER_KEYS = tuple(f"semaphore-backstops:{name}" for name in ("due", "copies", "epoch", "finished", "moved", "sent"))

# The due times are kept in this many small sorted sets, ``<due key>:<n>`` by the copy id's
# SHA-1, with an index ``<due key>-buckets`` (lua/_due_buckets.lua): each stays in Redis's compact
# encoding (a listpack: 128 entries of 64 bytes by default) at 100,000 stored copies, about 70 B a
# due time against about 150 B in one large sorted set. The due key itself is the release
# before's, still moved from and withdrawn from.
DUE_BUCKETS = 1024


def due_keys_of(due_key: str, copy_id: str) -> tuple[str, str]:
    """Where a copy's due time may be kept: its bucket (as the scripts name it), and the due key
    of the release before."""
    return f"{due_key}:{bucket_of(copy_id, DUE_BUCKETS)}", due_key


# Most copies one script run stows per list and moves.
BATCH = 100
# A worker's mover runs at least this often, and sooner when a copy falls due sooner.
MOVE_EVERY_S = 1.0
# ... but never more often than this (a run takes a fraction of a millisecond).
MOVE_AT_MOST_EVERY_S = 0.005
# A worker looks at the semaphore Redis's epoch this often.
EPOCH_EVERY_S = 1.0
# A moved copy no copy of its run asked for since is sent again by a restart of the semaphore
# Redis this long after its move. A copy reaches a pool process within seconds; one that does not
# was lost, and its parked record's sweep sends it again a countdown plus AWAY_SLACK (15 s) after
# it parked, unless a restart lost that record first. The few minutes cover a slow restart; what
# stays that long is only a copy dropped because its run had finished (a restart sends it again,
# and its run's finish, remembered in the broker or the result backend, drops it again).
KEEP_MOVED_S = 300.0
# A stencil is kept this long past the due time of the last copy stowed with it (and past the
# keeping of the last one moved): a copy is moved within seconds of being due while any worker
# runs, and a stencil costs about a kilobyte once per task and queue, not per copy.
STENCIL_KEEP_S = 86400.0

_STORING_TRANSPORTS = frozenset({"redis", "rediss", "sentinel"})


@dataclass(frozen=True)
class _Naming:
    """How kombu's Redis transport names the lists of a queue, from the broker settings."""

    prefix: str
    separator: str
    priority_steps: tuple[int, ...]

    def lists_of(self, queue: str) -> list[str]:
        return [self.prefix + (f"{queue}{self.separator}{step}" if step else queue) for step in self.priority_steps]


def _naming_of(app: Any) -> _Naming:
    options = app.conf.get("broker_transport_options") or {}
    steps = options.get("priority_steps") or KOMBU_REDIS_PRIORITY_STEPS
    return _Naming(
        prefix=str(options.get("global_keyprefix") or ""),
        separator=str(options.get("sep") or KOMBU_REDIS_SEPARATOR),
        priority_steps=tuple(sorted({int(step) for step in steps})),
    )


_LUA = importlib.resources.files("celery_semaphore._celery") / "lua"
_SCRIPT_TEXT = (_LUA / "move_due_copies.lua").read_text(encoding="utf-8")
_PACKED_TEXT = (_LUA / "_packed.lua").read_text(encoding="utf-8")
_DUE_BUCKETS_TEXT = (_LUA / "_due_buckets.lua").read_text(encoding="utf-8")
_SCRIPT_TEXT = _PACKED_TEXT + _DUE_BUCKETS_TEXT + _SCRIPT_TEXT
_SEND_NOW_TEXT = _PACKED_TEXT + (_LUA / "send_stored_copy.lua").read_text(encoding="utf-8")
_STOW_TEXT = _PACKED_TEXT + _DUE_BUCKETS_TEXT + (_LUA / "stow_copy.lua").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Moved:
    """What one run of the script did."""

    moved: int  # copies moved to their queues
    stowed: int  # copies taken from backstop lists into the store
    next_due_in: float | None  # seconds until the next stored copy is due; None: none stored
    flushed: bool  # the semaphore Redis was found restarted: every stored and kept moved copy was made due
    unreadable: int = 0  # copies whose stencil is not kept (left stored, due again in a minute)


class DueCopies:
    """The store of one app's due-later copies in its broker's Redis."""

    def __init__(self, app: Any) -> None:
        config = config_for(app)
        if config.broker_redis is None:
            raise ValueError("the broker is not a Redis")
        client = client_for(config.broker_redis)
        if not isinstance(client, redis.Redis):  # kombu's Redis transports: a server or a Sentinel set
            raise ValueError("the broker's Redis is not a single server")
        self.client: redis.Redis = client
        self.naming = _naming_of(app)
        # one epoch record per semaphore deployment: apps of several deployments share a broker
        deployment = f"{config.prefix}@{config.backend_display}"
        names = (DUE_KEY, COPIES_KEY, f"{EPOCH_KEY}:{deployment}", FINISHED_KEY, MOVED_KEY, SENT_KEY)
        self.keys = [self.naming.prefix + key for key in names]
        self.stencil_keys = [self.naming.prefix + key for key in (STENCILS_KEY, STENCILS_KEPT_KEY)]
        due, copies, epoch, finished, moved, sent = EARLIER_KEYS
        earlier = (due, copies, f"{epoch}:{deployment}", finished, moved, sent)
        self.earlier_keys = [self.naming.prefix + key for key in earlier]
        self._script: Any = self.client.register_script(_SCRIPT_TEXT)
        self._send_now: Any = self.client.register_script(_SEND_NOW_TEXT)
        self._stow: Any = self.client.register_script(_STOW_TEXT)

    def run(self, origins: list[str] | tuple[str, ...], *, epoch: str = "", most: int = BATCH) -> Moved:
        """Stow what was published to the backstop lists of ``origins``, and move what is due,
        from this store and from an earlier release's (``EARLIER_KEYS``), in one round trip."""
        keys, args = self._script_call(origins, epoch, most)
        earlier = [*self.earlier_keys, *self.stencil_keys]
        earlier_args: list[Any] = [most, epoch, round(KEEP_MOVED_S * 1000), ""]
        pipe = self.client.pipeline(transaction=False)
        # EVALSHA, not the registered script: redis-py's pipeline asks SCRIPT EXISTS first
        pipe.evalsha(self._script.sha, len(keys), *keys, *args)
        pipe.evalsha(self._script.sha, len(earlier), *earlier, *earlier_args)
        replies = pipe.execute(raise_on_error=False)
        if any(isinstance(reply, Exception) for reply in replies):  # NOSCRIPT: the server lost its cache
            replies = [self._script(keys=keys, args=args), self._script(keys=earlier, args=earlier_args)]
        (moved, stowed, next_in_ms, flushed, unreadable), (moved_before, _, next_before_ms, flushed_before, _) = replies
        due_in = [int(ms) for ms in (next_in_ms, next_before_ms) if int(ms) >= 0]
        return Moved(
            int(moved) + int(moved_before),
            int(stowed),
            min(due_in) / 1000 if due_in else None,
            bool(int(flushed) or int(flushed_before)),
            int(unreadable),
        )

    def stow(self, target_list: str, run: str, due_in_s: float, packed: Packed) -> bool:
        """Store a copy, packed by its sender, due in ``due_in_s`` under ``run``, bound for
        ``target_list`` (named as kombu names it): one script, so that the copy is stored (or,
        due now, sent on) or this raises. False when its run had finished (the copy is dropped)."""
        due, copies, _, finished, moved, sent = self.keys
        keys = [due, copies, finished, moved, sent, *self.stencil_keys]
        args = [
            run,
            round(due_in_s * 1000),
            self.naming.prefix + target_list,
            *packed,
            round(STENCIL_KEEP_S * 1000),
            round(KEEP_MOVED_S * 1000),
        ]
        return bool(int(self._stow(keys=keys, args=args)))

    def stored_message(self, run: str) -> str | None:
        """The message stored for ``run``, as it goes to its queue (None: none stored), but for
        the delivery tag of a marked copy, which each send makes anew (``packing.unpack``)."""
        stored = self.client.hget(self.keys[1], run)
        if stored is None:
            return None
        message = as_text(stored).partition("\n")[2]
        if not message.startswith(PACKED_MARK):
            return message
        packed = message[len(PACKED_MARK) :]
        stencil = self.client.hget(self.stencil_keys[0], digest_of(packed))
        return None if stencil is None else unpack(packed, as_text(stencil), run)

    def push_and_stow(self, backstop_list: str, message: str, origin: str) -> None:
        """Push ``message`` to ``backstop_list`` (the list of ``origin``'s backstop queue that
        kombu would push it to, named as kombu names it) and stow it, in one round trip: for a
        message ``packing.py`` cannot pack. Raises what the push raises; a failed stow is left to
        the movers (the copy is listed)."""
        keys, args = self._script_call([origin], "", BATCH)
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(self.naming.prefix + backstop_list, message)
        # EVALSHA, not the registered script: redis-py's pipeline asks SCRIPT EXISTS first
        pipe.evalsha(self._script.sha, len(keys), *keys, *args)
        _, stowed = pipe.execute(raise_on_error=False)
        if not isinstance(stowed, Exception):
            return
        try:
            self._script(keys=keys, args=args)  # NOSCRIPT: the server lost its cache
        except Exception as error:
            logger.warning("a waiting task's copy waits in %s until a worker stows it: %s", backstop_list, error)

    def _script_call(self, origins: list[str] | tuple[str, ...], epoch: str, most: int) -> tuple[list[str], list[Any]]:
        keys = [*self.keys, *self.stencil_keys]
        names: list[str] = []
        for origin in origins:
            sources = self.naming.lists_of(backstop_queue(origin))
            targets = self.naming.lists_of(wake_queue(origin))
            for source, target in zip(sources, targets, strict=True):
                keys += [source, target]
                names += [json.dumps(backstop_queue(origin)), json.dumps(wake_queue(origin))]
        return keys, [most, epoch, round(KEEP_MOVED_S * 1000), round(STENCIL_KEEP_S * 1000), *names]

    def send_now(self, run: str) -> int:
        """Send a copy of ``run``'s stored copy to its queue now (a parked task's wake-up),
        leaving the stored one as its backstop: 1 sent from the store, 2 from the copies kept
        as moved, 0 none kept, -1 its stencil is not kept (nothing sent)."""
        keys = [self.keys[1], self.keys[5], self.stencil_keys[0], self.earlier_keys[1], self.earlier_keys[5]]
        return int(self._send_now(keys=keys, args=[run]))

    def withdraw(self, run: str, *, remember_s: float = 0.0) -> None:
        """Forget the stored copy of ``run``: the run has started (and Celery runs it at most
        once) or finished, and no copy of it may come back. With ``remember_s``, the run
        finished: for that long no copy of it is stored, and ``granted`` says so (this
        survives a semaphore Redis restarted empty, which forgets its run records)."""
        pipe = self.client.pipeline(transaction=True)
        self._forget(pipe, run)
        if remember_s > 0:  # until when, by this host's clock: its skew only shifts the forgetting
            pipe.zadd(self.keys[3], {run: round((time.time() + remember_s) * 1000)})
        pipe.execute()

    def granted(self, run: str, *, withdraw: bool, remember_s: float = 0.0) -> bool:
        """A copy of ``run`` was granted its slot: whether the broker's Redis remembers the run
        finished; with ``withdraw``, its stored copy is forgotten in the same round trip, and
        with ``remember_s`` the run is remembered as finished from now (it runs at most once:
        begun is as good as finished). Its moved copy is forgotten either way: a copy of the
        run arrived, and with acks_late its message comes back from the broker should this
        worker die."""
        pipe: Any = self.client.pipeline(transaction=False)  # redis-py's execute_command is untyped
        for command in self.grant_commands(run, withdraw=withdraw, remember_s=remember_s):
            pipe.execute_command(*command)
        return pipe.execute()[0] is not None

    def grant_commands(self, run: str, *, withdraw: bool, remember_s: float = 0.0) -> list[tuple[Any, ...]]:
        """What ``granted`` sends, the run's finish asked first: for a caller that sends them
        ahead of another question and reads the first reply later (``sent_ahead.py``)."""
        commands: list[tuple[Any, ...]] = [("ZSCORE", self.keys[3], run)]
        for keys in (self.keys, self.earlier_keys):
            if withdraw:
                commands += [*(("ZREM", key, run) for key in due_keys_of(keys[0], run)), ("HDEL", keys[1], run)]
            commands += [("ZREM", keys[4], run), ("HDEL", keys[5], run)]
        if remember_s > 0:  # until when, by this host's clock: its skew only shifts the forgetting
            commands.append(("ZADD", self.keys[3], round((time.time() + remember_s) * 1000), run))
        return commands

    def reopen(self, run: str) -> None:
        """Forget that ``run`` finished: it goes on in a copy (a body that paused its key)."""
        self.client.zrem(self.keys[3], run)

    def _forget(self, pipe: Any, run: str) -> None:
        """Queue on ``pipe`` the forgetting of ``run``'s stored copy and of its moved one, in this
        store and in an earlier release's."""
        for keys in (self.keys, self.earlier_keys):
            for zset in (*due_keys_of(keys[0], run), keys[4]):
                pipe.zrem(zset, run)
            pipe.hdel(keys[1], run)
            pipe.hdel(keys[5], run)


_lock = fork_locks.reset_in_child()
_stores: dict[int, tuple[Any, DueCopies | None]] = {}


def stores_copies(app: Any) -> bool:
    """Whether ``app``'s due-later copies wait in its broker's Redis (the Redis broker)."""
    return due_copies_for(app) is not None


def due_copies_for(app: Any) -> DueCopies | None:
    """The store of ``app``'s due-later copies (one per app and process), None on other brokers."""
    with _lock:
        cached = _stores.get(id(app))
        if cached is not None and cached[0] is app:
            return cached[1]
    store: DueCopies | None = None
    try:
        with app.connection_for_write() as connection:  # never connected: it only names the transport
            driver = connection.transport.driver_type
    except Exception:
        driver = None
    if driver in _STORING_TRANSPORTS:
        try:
            store = DueCopies(app)
        except Exception as error:  # a setting the worker's start check reports
            logger.debug("due-later copies cannot be kept in the broker's Redis: %s", error)
    with _lock:
        _stores[id(app)] = (app, store)
    return store


def send_copy(app: Any, copy: Any) -> None:
    """Send ``copy`` (a signature); one bound for a backstop list is stowed at once, so that
    ``withdraw`` finds it, in the same round trip as its publish (``stowing.py``). Raises what
    the send raises; a failed stow is left to the movers."""
    queue = (copy.options or {}).get("queue")
    name = getattr(queue, "name", queue)
    store = due_copies_for(app) if isinstance(name, str) and name.endswith(BACKSTOP_QUEUE_SUFFIX) else None
    if store is None or not isinstance(name, str):
        copy.apply_async()
        return
    try:
        with stowing_producer(app, store) as producer:
            copy.apply_async(producer=producer)
        return
    except StowingUnavailable as error:  # published and stowed apart, as kombu's channel would
        logger.debug("a waiting task's copy is published and stowed apart: %s", error)
    copy.apply_async()
    try:
        store.run([origin_of_derived(name)])
    except Exception as error:
        logger.warning("a waiting task's copy waits in %s until a worker stows it: %s", name, error)


def send_stored(app: Any, run: str) -> bool:
    """Send the copy of ``run`` stored in ``app``'s broker to its queue now (its wake-up),
    leaving it stored: whether one was kept there (stored, or moved when due and not asked for
    since). Raises what the broker's Redis raises."""
    store = due_copies_for(app)
    sent = store.send_now(run) if store is not None else 0
    if sent < 0:
        logger.error("the stored copy of run %s names a stencil the broker's Redis no longer keeps", run)
    return sent > 0


def withdraw(app: Any, run: str | None, *, remember_s: float = 0.0) -> None:
    """Forget the stored copy of ``run`` (its run started without acks_late, or finished:
    then remembered as finished for ``remember_s``)."""
    store = due_copies_for(app) if run is not None else None
    if store is None or run is None:
        return
    try:
        store.withdraw(run, remember_s=remember_s)
    except Exception as error:  # it comes back when due, and its run record drops it
        logger.debug("could not withdraw the stored copy of run %s: %s", run, error)


def reopen(app: Any, run: str) -> None:
    """Forget that ``run`` finished, in the broker's Redis: the run goes on in a copy."""
    store = due_copies_for(app)
    if store is not None:
        store.reopen(run)


class Mover:
    """The timer of one worker's main process that moves due copies to their queues."""

    def __init__(self, app: Any, store: DueCopies) -> None:
        self.app = app
        self.store = store
        self.origins: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="celery-semaphore-due-copies", daemon=True)
        self._epoch = ""
        self._epoch_at = 0.0
        self.moved = 0

    def follow(self, origin: str) -> None:
        if not is_derived_queue(origin) and not is_wake_queue(origin) and origin not in self.origins:
            self.origins = [*self.origins, origin]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                moved = self.store.run(tuple(self.origins), epoch=self._semaphore_epoch())
            except Exception as error:
                if not failing:
                    logger.warning("could not move waiting tasks' due copies (trying every second): %s", error)
                failing = True
                self._stop.wait(MOVE_EVERY_S)
                continue
            failing = False
            self.moved += moved.moved
            if moved.flushed:
                logger.warning("the semaphore's Redis came back empty: every waiting task's stored copy is sent now")
            if moved.unreadable:
                logger.error(
                    "%d waiting tasks' stored copies name a stencil the broker's Redis no longer keeps "
                    "(kept, looked at again in a minute): was %s deleted?",
                    moved.unreadable,
                    self.store.stencil_keys[0],
                )
            if moved.moved >= BATCH or moved.stowed >= BATCH:
                continue  # more is due, or waiting to be stowed
            wait = MOVE_EVERY_S if moved.next_due_in is None else min(MOVE_EVERY_S, moved.next_due_in)
            self._stop.wait(max(MOVE_AT_MOST_EVERY_S, wait))

    def _semaphore_epoch(self) -> str:
        """The semaphore Redis's epoch, looked at once a second ("" in between): a random value
        the first worker to find none writes, so one that came back empty gets a new one."""
        now = time.monotonic()
        if now - self._epoch_at < EPOCH_EVERY_S:
            return ""
        self._epoch_at = now
        config = config_for(self.app)
        client = client_for(config.backend)
        key = f"{config.prefix}:epoch"
        try:
            # a fresh value each time: this worker may be the one to write it after every restart
            client.set(key, uuid.uuid4().hex, nx=True)
            value = client.get(key)
        except Exception as error:  # the semaphore Redis down: nothing to compare this round
            logger.debug("could not read the semaphore Redis's epoch: %s", error)
            return ""
        if value is None:
            return ""
        return value.decode() if isinstance(value, bytes) else str(value)
