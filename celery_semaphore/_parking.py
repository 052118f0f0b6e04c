"""Refused tasks that come back when their turn comes, not when a timer ends.

A refused task leaves the worker: it is re-sent with a countdown (the *backstop* copy, which
survives anything the semaphore's Redis or this process may lose) and it *parks*: it stays
offerable in the line, its wake address this process's channel. When a release (anywhere) hands
it the slot, the offer is published on that channel, and this process sends the task again at
once (the *wake* copy), to the wake queue that every worker consumes next to its own, so the copy
does not queue behind a backlog of fresh tasks. Whichever copy asks first claims the slot; the
acquire script's run record drops the other one (see ``task.py``).

If this process dies before the offer comes, nobody sends the wake copy: the offer lapses after
its claim window, the slot goes on to the next waiter, and the backstop copy rejoins the line at
its old ticket when its countdown ends. A delay, never a loss.

The other way round, this process is the sweep for a lost backstop copy (on the Redis broker, a
message popped by the pending ``BRPOP`` of a worker being killed is gone): when a parked task's
time is up (its countdown plus slack) and no copy of its wait has asked meanwhile (its place in
line lapsed and its run was never granted), this process sends the wake copy anyway.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ._wakeups import WakeHandle, wake_ups_for
from .multi import MultiSemaphore
from .semaphore import FairSemaphore

logger = logging.getLogger("celery_semaphore")

# A wake queue is the task's queue with this suffix; workers consume it next to each queue.
WAKE_QUEUE_SUFFIX = ".semaphore-wake"
# How long a first park in this process waits for its wake-up channel to be subscribed: an
# offer published before that is lost (the backstop copy covers it, later).
SUBSCRIBE_WAIT_S = 1.0


def wake_queue(queue_name: str) -> str:
    return queue_name if queue_name.endswith(WAKE_QUEUE_SUFFIX) else queue_name + WAKE_QUEUE_SUFFIX


# How often the sender thread looks for parked tasks whose time is up.
SWEEP_EVERY_S = 1.0


@dataclass
class _Parked:
    handle: WakeHandle
    wake_copy: Any  # the Celery signature to send when the offer comes
    expires: float  # monotonic: by then a copy of the wait should have asked again
    semaphore: FairSemaphore | MultiSemaphore  # a MultiSemaphore parks on its first semaphore's keys
    waiter: str
    run: str  # the run id every copy of this wait asks under
    name: str = field(default="")


class Parking:
    """The tasks this process parked, and the thread that sends their wake copies (never the
    wake-up listener itself: a send may wait on the broker)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked: dict[tuple[int, str], _Parked] = {}
        self._to_send: queue.SimpleQueue[_Parked | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None

    def park(
        self, semaphore: FairSemaphore | MultiSemaphore, waiter: str, wake_copy: Any, *, away_for: float, run: str
    ) -> str:
        """Register ``wake_copy`` to be sent when ``waiter`` is offered a slot of ``semaphore``
        (within ``away_for`` seconds), or when that time is up and no copy of the wait (run
        ``run``) has asked; returns the wake address to park the waiter under."""
        wake_ups = wake_ups_for(semaphore.client)
        channel = semaphore.keys.wake_channel(wake_ups.process_id)
        key = (id(semaphore.client), f"{channel}\n{waiter}")
        entry: _Parked | None = None

        def woken() -> None:
            with self._lock:
                parked = self._parked.pop(key, None)
            if parked is not None and parked is entry:
                self._to_send.put(parked)

        handle = wake_ups.on_wake(channel, waiter, woken)
        entry = _Parked(handle, wake_copy, time.monotonic() + away_for, semaphore, waiter, run, name=semaphore.name)
        with self._lock:
            old = self._parked.pop(key, None)
            self._parked[key] = entry
            self._start()
        if old is not None:
            old.handle.close()
        handle.subscribe(SUBSCRIBE_WAIT_S)
        return channel

    def _start(self) -> None:
        if self._sender is None or not self._sender.is_alive():
            self._sender = threading.Thread(target=self._run, name="celery-semaphore-wake-sender", daemon=True)
            self._sender.start()

    def _sweep(self) -> None:
        """Parked tasks whose time is up: forgotten when a copy of their wait asked meanwhile,
        else sent again (their backstop copy was lost)."""
        now = time.monotonic()
        with self._lock:
            due = [key for key, parked in self._parked.items() if parked.expires < now]
            gone = [self._parked.pop(key) for key in due]
        for parked in gone:
            parked.handle.close()
            try:
                if copy_asked(parked.semaphore, parked.waiter, parked.run):
                    continue
            except Exception as error:  # Redis down: the backstop copy is the better bet
                logger.debug("sweep of %r could not read the line: %s", parked.name, error)
                continue
            logger.warning("no copy of a task waiting for %r asked in time (its countdown copy was lost?): "
                           "sending it again", parked.name)
            self._send(parked)

    def _run(self) -> None:
        while True:
            try:
                parked = self._to_send.get(timeout=SWEEP_EVERY_S)
            except queue.Empty:
                self._sweep()
                continue
            if parked is None:
                return
            parked.handle.close()
            self._send(parked)

    @staticmethod
    def _send(parked: _Parked) -> None:
        try:
            parked.wake_copy.apply_async()
        except Exception as error:  # the backstop copy still comes, at its countdown
            logger.warning("could not send the wake copy of a task waiting for %r (its countdown copy "
                           "still comes): %s", parked.name, error)

    def parked_count(self) -> int:
        with self._lock:
            return len(self._parked)


_parking = Parking()


def copy_asked(semaphore: FairSemaphore | MultiSemaphore, waiter: str, run: str) -> bool:
    """Whether some copy of a parked wait asked again: the waiter still has a place whose
    must-ask-by deadline is ahead (a copy asked, or it is still parked), or its run was granted."""
    keys = semaphore.keys
    pipe = semaphore.client.pipeline(transaction=False)
    pipe.time()
    pipe.zscore(keys.deadlines, waiter)
    pipe.hexists(keys.runs, run)
    (seconds, micros), deadline_ms, granted = pipe.execute()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    return bool(granted) or (deadline_ms is not None and float(deadline_ms) > now_ms)


def parking() -> Parking:
    """This process's parking (a forked child starts with an empty one: threads and parked
    tasks belong to the process that parked them)."""
    return _parking


def _after_fork_in_child() -> None:
    global _parking
    _parking = Parking()


os.register_at_fork(after_in_child=_after_fork_in_child)
