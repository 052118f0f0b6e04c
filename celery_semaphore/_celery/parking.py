"""Refused tasks that come back when their turn comes, not when a timer ends.

A refused task leaves the worker: it is re-sent with a countdown (the *backstop* copy, which
survives anything the semaphore's Redis or this process may lose) and it *parks*: it stays
offerable in the line, its wake address this process's channel, and its wake copy is kept in
Redis too (``park.lua``). When a script (a release, anywhere) hands it the slot, the task is sent
again at once (the *wake* copy), to the wake queue that every worker consumes next to its own, so
the copy does not queue behind a backlog of fresh tasks. Two processes may send it, and the one
that takes the record first does (``claim_parked_waiter.lua``): the process whose script made the
offer, which is running and free (it just gave a slot back), and this one, told on its channel,
which covers a caller with no Celery here. Sent by this process alone, the copy went out 15-60 ms
late under load: its listener and sender threads wait for the interpreter lock while its main
thread runs another task. Whichever copy of the task asks first claims the slot; the acquire
script's run record drops the other one (see ``task.py``).

On the Redis broker, the task's backstop copy already waits in the broker's store of due copies
(``due_copies.py``), and it is the same message: there the record keeps a mark instead of a
second copy, and sending the "wake copy" pushes that stored message to the wake queue now
(``send_stored_copy.lua``, one script in the broker's Redis), leaving it stored as the backstop.
The semaphore's Redis then keeps only a waiting task's place and its record's indexes.

If the offer finds this process gone, nobody hears it, and the process that made it sends the
copy. An offer nobody acted on (told to a process that died before sending) lapses after its
claim window; the script that purges it reports the waiter again and its caller sends the copy
from the record, if still there. Else the backstop copy rejoins the line at its old ticket when
its countdown ends. A delay, never a loss.

The other way round, a lost backstop copy (on the Redis broker, a message popped by the pending
``BRPOP`` of a worker being killed is gone) is caught by a *sweep*. The wake copy is kept in
Redis as well (``park.lua``): a record per wait, due when the task's time is up (its countdown
plus slack). Every worker process that runs tasks sweeps: once a second it takes the records
now due (``claim_parked.lua``, each taken by one process only) and sends the wake copy of each
wait no copy has asked for meanwhile (its place in line lapsed and its run was never granted).
A wait whose place has not lapsed yet is put back, due when it would (the task's step away is
recorded after its park, and a copy that asked and went away again moves its place on): taken
and dropped, its record could never be swept again, and a backstop copy lost after that would
be lost for good. So a waiting task survives the loss of its message even when the worker that
parked it died with it. A copy the app's serializer cannot write stays in this process only,
swept here.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from redis.cluster import RedisCluster

from .._core.explain import WaitState, wait_state
from .._core.hand_offs import ReleaseFollower, on_release, on_to_wake
from .._core.multi import MultiSemaphore, home_of
from .._core.scripts import SemaphoreKeys
from .._core.semaphore import FairSemaphore
from .._core.wakeups import WakeHandle, wake_ups_for
from . import parked_sends
from .parked_records import STORED_COPY_MARK, kept_copy, parked_keys, prefix_of, read_parked_line
from .parked_scripts import parked_scripts_for, records_claimed
from .parked_sends import send_claimed, send_stored_copy, send_wake_copy, sent_again, sweep_records
from .pausing import members
from .policy import WAKE_AHEAD
from .wake_copies import serialized

logger = logging.getLogger("celery_semaphore")

# How long a first park in this process waits for its wake-up channel to be subscribed: an
# offer published before that is lost (the backstop copy covers it, later).
SUBSCRIBE_WAIT_S = 1.0


# How often the sender thread looks for parked tasks whose time is up.
SWEEP_EVERY_S = 1.0
# Most lines one tick looks at (lines_to_tick.lua).
TICK_BATCH = 100


@dataclass(frozen=True)
class _SweepTarget:
    client: Any
    prefix: str
    app: Any


@dataclass(frozen=True)
class _Offered:
    """Waiters a script offered a slot, to wake from the sender thread (``wake_offered``)."""

    semaphore: FairSemaphore | MultiSemaphore
    waiters: tuple[str, ...]


@dataclass
class _Parked:
    handle: WakeHandle
    wake_copy: Any  # the Celery signature to send when the offer comes
    expires: float  # monotonic: by then a copy of the wait should have asked again
    semaphore: FairSemaphore | MultiSemaphore  # a MultiSemaphore parks on its first semaphore's keys
    waiter: str
    run: str  # the run id every copy of this wait asks under
    name: str = field(default="")
    recorded: bool = False  # also kept in Redis: the sweep of any process sends it if need be
    stored_in_broker: bool = False  # its one message waits in the broker's store: that is what is sent


class Parking:
    """The tasks this process parked, and the thread that sends their wake copies (never the
    wake-up listener itself: a send may wait on the broker) and sweeps the parked-task records
    of every deployment this process parked on or was told to sweep."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked: dict[tuple[int, str], _Parked] = {}
        self._to_send: queue.SimpleQueue[_Parked | _Offered | None] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._sweep_targets: dict[tuple[int, str], _SweepTarget] = {}
        # deployments this process wakes parked tasks of, without sweeping them (wake_from)
        self._wake_targets: dict[tuple[int, str], _SweepTarget] = {}
        # wake-ups heard here whose copy another process sent (it took the record first)
        self.sent_elsewhere = 0

    def park(
        self,
        semaphore: FairSemaphore | MultiSemaphore,
        waiter: str,
        wake_copy: Any,
        *,
        away_for: float,
        run: str,
        stored_in_broker: bool = False,
        stands_by_ms: int = 0,
    ) -> str:
        """Register ``wake_copy`` to be sent when ``waiter`` is offered a slot of ``semaphore``
        (within ``away_for`` seconds), or when that time is up and no copy of the wait (run
        ``run``) has asked; returns the wake address to park the waiter under. With
        ``stored_in_broker``, the wait's copy is (about to be) stored in the broker's Redis under
        ``run``: the record in Redis keeps a mark, not a second copy (see ``record``).
        ``stands_by_ms``: a slot that should reach the task within that long is waited for in
        its pool process, so a release may wake it ahead of its offer (``policy.stands_by_ms``)."""
        wake_ups = wake_ups_for(semaphore.client)
        channel = semaphore.keys.wake_address(wake_ups.listener_id)
        key = (id(semaphore.client), f"{channel}\n{waiter}")
        entry: _Parked | None = None

        def woken(taken: bool = False) -> None:
            with self._lock:
                parked = self._parked.pop(key) if self._parked.get(key) is entry else None
                # "taken": the release took the record and sends the copy; forgotten, Redis not asked
                forgotten = parked is not None and taken and parked.recorded
                self.sent_elsewhere += forgotten
            if parked is not None and forgotten:
                parked.handle.close()
            elif parked is not None:
                self._to_send.put(parked)

        script_run = self.record_run(semaphore, waiter, run, wake_copy, away_for, stored_in_broker, stands_by_ms)
        if script_run is not None:
            script, keys, args = script_run
            script(keys=keys, args=args)
            self.sweep_from_here(semaphore, wake_copy.app)
        recorded = script_run is not None
        handle = wake_ups.on_wake(channel, waiter, woken, on_taken=lambda: woken(taken=True))
        entry = _Parked(
            handle,
            wake_copy,
            time.monotonic() + away_for,
            semaphore,
            waiter,
            run,
            name=semaphore.name,
            recorded=recorded,
            stored_in_broker=stored_in_broker,
        )
        with self._lock:
            old = self._parked.pop(key, None)
            self._parked[key] = entry
            self._start()
        if old is not None:
            old.handle.close()
        handle.subscribe(SUBSCRIBE_WAIT_S)
        return channel

    def unpark(self, semaphore: FairSemaphore | MultiSemaphore, waiter: str, run: str) -> None:
        """Forget a parked wait that was given up (its backstop copy could not be sent, and the
        task failed): no wake-up and no sweep may bring it back."""
        channel = semaphore.keys.wake_address(wake_ups_for(semaphore.client).listener_id)
        with self._lock:
            parked = self._parked.pop((id(semaphore.client), f"{channel}\n{waiter}"), None)
        if parked is not None:
            parked.handle.close()
        try:
            parked_scripts_for(semaphore.client).forget_wait(semaphore, waiter=waiter, run=run)
        except Exception as error:  # Redis down, as it likely was for the send that failed
            logger.warning(
                "could not forget the parked record of a task that gave up waiting for %r (a sweep "
                "may send it again once its time is up): %s",
                semaphore.name,
                error,
            )

    def sweep(self, app: Any, client: Any, prefix: str) -> None:
        """Sweep the parked-task records of the deployment at ``client`` and ``prefix`` from now
        on, sending what is due as tasks of ``app`` (a worker process does this as it starts,
        so that a dead worker's parked tasks are swept though no task here has parked yet)."""
        with self._lock:
            self._sweep_targets.setdefault((id(client), prefix), _SweepTarget(client, prefix, app))
            self._start()

    def wake_from(self, app: Any, client: Any, prefix: str) -> None:
        """Send, from this process, the wake copies of the parked tasks that its scripts offer a
        slot in the deployment at ``client`` and ``prefix``, as tasks of ``app``; sweep nothing.
        For ``celery semaphore``: its resume may offer the start to a task whose own process is
        gone (recycled), which nobody else would wake before its backstop."""
        with self._lock:
            self._wake_targets.setdefault((id(client), prefix), _SweepTarget(client, prefix, app))

    def record_run(
        self,
        semaphore: FairSemaphore | MultiSemaphore,
        waiter: str,
        run: str,
        wake_copy: Any,
        away_for: float,
        stored_in_broker: bool,
        stands_by_ms: int = 0,
    ) -> tuple[Any, list[bytes], list[Any]] | None:
        """The script run that keeps the wake copy in Redis, due when ``away_for`` is up (any
        process's sweep sends it then, if no copy of the wait asked); None where it cannot be
        kept there. Run alone (``park``) or in one round trip with another script (``placing.py``);
        then ``sweep_from_here``.

        With ``stored_in_broker`` (the Redis broker: the wait's copy waits in the broker's store
        under ``run``, ``due_copies.py``), the record keeps a mark instead: a wake-up or a sweep
        sends that stored message now. One message per waiting task, not two: a second copy
        here was the largest part of a waiting task's memory in the semaphore's Redis."""
        copy = STORED_COPY_MARK.encode() if stored_in_broker else serialized(wake_copy)
        if copy is None:
            return None
        kept, look_in_ms = kept_copy(copy, stands_by_ms), round(away_for * 1000)
        return parked_scripts_for(semaphore.client).park_run(
            semaphore, waiter=waiter, run=run, kept=kept, look_in_ms=look_in_ms
        )

    def sweep_from_here(self, semaphore: FairSemaphore | MultiSemaphore, app: Any) -> None:
        prefix = prefix_of(semaphore)
        with self._lock:
            self._sweep_targets.setdefault((id(semaphore.client), prefix), _SweepTarget(semaphore.client, prefix, app))

    def _start(self) -> None:
        if self._sender is None or not self._sender.is_alive():
            self._sender = threading.Thread(target=self._run, name="celery-semaphore-wake-sender", daemon=True)
            self._sender.start()

    def _sweep_here(self) -> None:
        """Parked tasks of this process whose time is up: dropped, and, unless kept in Redis
        (swept there) or some copy of their wait asked meanwhile, sent again. One still in line
        stays parked (a wake-up still finds it) until its place would lapse."""
        now = time.monotonic()
        with self._lock:
            due = [(key, parked) for key, parked in self._parked.items() if parked.expires < now]
        for key, parked in due:
            state: WaitState | None = None
            if not parked.recorded:
                try:
                    state = wait_state(
                        parked.semaphore.client,
                        parked.semaphore.keys.deadlines,
                        parked.semaphore.keys.runs,
                        parked.waiter,
                        parked.run,
                    )
                except Exception as error:  # Redis down: the backstop copy is the better bet
                    logger.debug("sweep of %r could not read the line: %s", parked.name, error)
            with self._lock:
                if self._parked.get(key) is not parked:
                    continue  # woken meanwhile, or parked again
                if state is not None and not state.granted and state.left_ms is not None:
                    parked.expires = time.monotonic() + state.left_ms / 1000 + parked_sends.LOOK_AGAIN_SLACK_S
                    continue
                del self._parked[key]
            parked.handle.close()
            if state is None or state.granted:
                continue
            sent_again(parked.name)
            send_wake_copy(parked.wake_copy, parked.name)

    def _sweep_records(self) -> None:
        with self._lock:
            targets = list(self._sweep_targets.values())
        sweep_records(targets)

    def _tick_lines(self) -> None:
        """Once a round (a second), one process of each deployment swept here ticks the lines
        with parked waiters: a slot freed by a lapsed lease (its holder's worker was killed)
        reaches the head of such a line within a second, though no script runs there."""
        with self._lock:
            targets = list(self._sweep_targets.values())
        for target in targets:
            scripts = parked_scripts_for(target.client)
            try:
                lines = scripts.lines_to_tick(
                    parked_keys(target.prefix), round_ms=round(SWEEP_EVERY_S * 1000), most=TICK_BATCH
                )
            except Exception as error:  # Redis down: the next round
                logger.debug("could not list the lines to tick: %s", error)
                continue
            for line in lines:
                try:
                    base, rules = read_parked_line(line)
                    keys = SemaphoreKeys.of_base(base)
                    to_wake = scripts.tick(keys, rules=rules)
                except Exception as error:
                    logger.debug("could not tick a line with parked waiters (%s): %s", line, error)
                    continue
                if to_wake:
                    self._wake(target.client, target.prefix, [keys.base], to_wake, target.app)

    def wake_offered(
        self, semaphore: FairSemaphore | MultiSemaphore, waiters: tuple[str, ...], *, later: bool = False
    ) -> None:
        """A script this process ran offered ``waiters`` a slot of ``semaphore``: parked waiters
        (their own process may be busy, or gone), and any other waiter nobody heard. Send their
        wake copies from here, now, so that each claims its offer in milliseconds; with
        ``later``, from the sender thread (for a caller that must never wait on a broker: the
        renewer, whose stall would let leases lapse while their bodies run).

        Only from a process that knows the deployment's app (a worker's processes: they sweep
        it; ``celery semaphore``: ``wake_from``): a copy is sent through the app it is read back
        into, and Celery's current app, in another process, may have another broker. Taken and
        then lost, the wait's record could not be sent by its own process either. Elsewhere, the
        parked task's process sends it, or a worker's tick once the offer lapses."""
        if later:
            with self._lock:
                self._start()
            self._to_send.put(_Offered(semaphore, waiters))
            return
        lines = members(semaphore)
        first = home_of(semaphore)
        target = self._target_for(first.client, first.prefix)
        if target is not None:
            self._wake(first.client, first.prefix, [line.keys.base for line in lines], waiters, target.app)

    def _target_for(self, client: Any, prefix: str) -> _SweepTarget | None:
        """The deployment at ``client`` and ``prefix`` as this process sweeps or wakes it, if it does."""
        with self._lock:
            key = (id(client), prefix)
            return self._sweep_targets.get(key) or self._wake_targets.get(key)

    def _wake(self, client: Any, prefix: str, bases: list[str], waiters: tuple[str, ...], app: Any) -> None:
        """Send the wake copies of ``waiters`` parked in the lines whose keys start with
        ``bases``. A script over several semaphores reports the waiters of all of their lines,
        each parked under the first line of its own task (a task with one of those keys, or with
        them in another order): each line is looked in until one holds the waiter's record."""
        scripts, lease_ms = parked_scripts_for(client), round(parked_sends.WOKEN_LEASE_S * 1000)
        left = list(waiters)
        for base in bases:  # one round trip per line, for all its waiters
            if not left:
                break
            claimed = scripts.claim_parked_waiters(
                parked_keys(prefix), prefix=prefix, base=base, waiters=left, lease_ms=lease_ms
            )
            woken = {send_claimed(app, record) for record in claimed}
            left = [waiter for waiter in left if waiter not in woken]
        for waiter in left:
            # parked here only (its copy cannot be serialized), or not a parked task at all (a
            # blocked caller asks again by itself), or another process took it
            self._send_parked_here(bases, waiter)

    def release_follower(self, semaphore: Any) -> ReleaseFollower | None:
        """For a release of ``semaphore`` from this process, where it can send wake copies (see
        ``wake_offered``), on a single Redis: the claim of the records of the line's parked
        waiters offered a slot, in the release's round trip, and the sending of their copies."""
        cluster = isinstance(getattr(semaphore, "client", None), RedisCluster)
        target = self._target_for(semaphore.client, semaphore.prefix) if isinstance(semaphore, FairSemaphore) else None
        if target is None or cluster:
            return None
        app = target.app
        plain = semaphore.rules.arg.isdigit()  # no rate, spacing or cap per tenant in code
        run = parked_scripts_for(semaphore.client).claim_offered_run(
            parked_keys(semaphore.prefix),
            semaphore.keys,
            lease_ms=round(parked_sends.WOKEN_LEASE_S * 1000),
            ahead=WAKE_AHEAD if plain else 0,
            limit=semaphore.rules.limit,
        )

        def woke(reply: Any) -> list[str]:
            if isinstance(reply, Exception):
                raise reply
            return [send_claimed(app, record) for record in records_claimed(reply, semaphore.prefix) if record]

        return ReleaseFollower(run, woke, takes_parked=True)

    def _send_parked_here(self, bases: list[str], waiter: str) -> None:
        with self._lock:
            found = [
                (key, parked)
                for key, parked in self._parked.items()
                if parked.waiter == waiter and parked.semaphore.keys.base in bases
            ]
            for key, _ in found:
                del self._parked[key]
        for _, parked in found:
            parked.handle.close()
            _send_parked(parked)

    def _run(self) -> None:
        # a round every SWEEP_EVERY_S, quiet or not: a busy deployment has no quiet second, and
        # lost wake copies would never be sent again, nor lines ticked
        next_round = time.monotonic() + SWEEP_EVERY_S
        while True:
            try:
                parked: _Parked | _Offered | None = self._to_send.get(timeout=max(0.0, next_round - time.monotonic()))
                got = True
            except queue.Empty:
                parked, got = None, False
            if time.monotonic() >= next_round:
                self._sweep_here()
                self._sweep_records()
                self._tick_lines()
                next_round = time.monotonic() + SWEEP_EVERY_S
            if not got:
                continue
            if parked is None:
                return
            if isinstance(parked, _Offered):
                self._wake_offered_now(parked)
                continue
            parked.handle.close()
            if parked.recorded and not self._take_record(parked):
                self.sent_elsewhere += 1  # the process that made the offer took the record and sent it
                continue
            _send_parked(parked)

    def _wake_offered_now(self, offered: _Offered) -> None:
        try:
            self.wake_offered(offered.semaphore, offered.waiters)
        except Exception as error:  # Redis or the broker down: their backstop copies still come
            logger.warning("could not wake the tasks offered a slot of %r: %s", offered.semaphore.name, error)

    @staticmethod
    def _take_record(parked: _Parked) -> bool:
        """Take the record kept in Redis of a wait this process was told to wake; False when
        another process took it first (the one whose script made the offer sends the wake copy
        too, see notify in lua/_lib.lua): one of the two sends. True if Redis cannot say: a
        second copy is dropped by its run, a missing one would wait for its backstop."""
        semaphore = parked.semaphore
        try:
            taken = parked_scripts_for(semaphore.client).claim_parked_waiter(
                parked_keys(prefix_of(semaphore)),
                prefix=prefix_of(semaphore),
                base=home_of(semaphore).keys.base,
                waiter=parked.waiter,
                lease_ms=round(parked_sends.WOKEN_LEASE_S * 1000),
            )
        except Exception as error:
            logger.debug("could not take the parked record of a wait of %r: %s", parked.name, error)
            return True
        return taken is not None

    def parked_count(self) -> int:
        with self._lock:
            return len(self._parked)


def _send_parked(parked: _Parked) -> None:
    """Send a wait parked here: its message stored in the broker, else its wake copy."""
    if parked.stored_in_broker:
        send_stored_copy(parked.wake_copy.app, parked.run, parked.name)
    else:
        send_wake_copy(parked.wake_copy, parked.name)


_parking = Parking()


def parking() -> Parking:
    """This process's parking (a forked child starts with an empty one: threads and parked
    tasks belong to the process that parked them)."""
    return _parking


def _after_fork_in_child() -> None:
    global _parking
    _parking = Parking()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _wake_offered(semaphore: FairSemaphore | MultiSemaphore, waiters: tuple[str, ...], later: bool) -> None:
    parking().wake_offered(semaphore, waiters, later=later)


on_to_wake(_wake_offered)
on_release(lambda semaphore: parking().release_follower(semaphore))
