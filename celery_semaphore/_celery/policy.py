"""How a refused task waits: a short in-process wait, or a countdown retry of how long.

Two costs pull against each other. A refused task that waits in-process keeps a worker slot
busy doing nothing; one that is re-sent with a countdown frees the worker, but if its turn comes
while it sleeps in the broker, the semaphore's slot idles until the countdown ends (a fair line
lets nobody else take it). So a waiter whose turn is near waits in-process for the release
signal, and one whose turn is far away sleeps for most of its expected wait and comes back a
little early. The expected wait comes from the waiter's place in line, the free slots and the
recent average hold time that the semaphore reports.
"""

from __future__ import annotations

import math
import random

from .._core.attempts import Waiting
from .._core.rules import Rules

# Come back after this share of the expected wait, so the waiter is present when its turn comes.
EARLY = 0.8
# Spread of the countdown, so waiters refused together do not all come back together.
JITTER = 0.2
# With no hold time observed yet, waiters this many rounds of releases from their turn wait in
# the worker (see waits_in_process).
UNKNOWN_HOLD_ROUNDS = 2
# A countdown stays this far below the Redis broker's visibility_timeout: beyond it the broker
# would deliver the waiting message a second time.
VISIBILITY_MARGIN = 0.5
# A parked task's backstop copy kept in the broker (not held by a worker) is due this much later.
# Below RabbitMQ's default consumer_timeout (30 min), past which a copy a worker holds closes its
# channel; long enough that a waiting task costs next to nothing.
KEPT_APART_BACKSTOP_S = 300.0
# ... or, for a task far back in a long line, this many times its expected wait (so that it is
# not delivered, refused and parked again every few minutes while it waits its turn: a line of
# 10,000 under a rate of 20/s is 500 s long), up to this long: below the time a finished run is
# remembered after its grant (wait_runs.REMEMBER_SLACK, an hour, and more), so that a copy that
# missed its withdrawal and comes back when due still finds its run and is dropped.
BACKSTOP_PER_EXPECTED_WAIT = 2.0
BACKSTOP_MOST_S = 1800.0
# How many of the first parked waiters of a line with short holds (an average hold within the
# inline wait) a release wakes ahead of their offer (claim_parked_waiter.lua): each arrives and
# waits for its offer in a pool process, so that the hand-off is a publish, not a trip of its
# wake copy through the broker (about 9 ms measured). Such a waiter may wait in its process even
# where that leaves none of the worker's free, if its slot should come within STAND_BY_MOST_S
# (see stands_by).
WAKE_AHEAD = 2
STAND_BY_MOST_S = 0.5
# A start a rate, a spacing or a pause reserves further off than this parks its task as well as
# sending it for then: an operator's resume or looser rule may bring the start forward, and only
# a wake-up reaches a task away for a day. A nearer one comes back by its copy alone.
PARKED_START_AFTER_S = 2.0


def expected_wait(waiting: Waiting, *, among_present: bool = False) -> float | None:
    """Seconds until this waiter's turn, or None while no hold time has been observed.

    Counting every waiter ahead (``among_present=False``) gives when its turn comes if those
    away come back in time; counting only present ones gives how soon a slot can reach it."""
    position = waiting.turn if among_present and waiting.turn is not None else waiting.position
    releases_needed = position - waiting.free + 1
    if releases_needed <= 0:
        return 0.0
    if waiting.hold_time is None:
        return None
    return math.ceil(releases_needed / waiting.limit) * waiting.hold_time


def waits_in_process(waiting: Waiting, inline_wait: float, *, by_rules: float = 0.0) -> bool:
    """Whether to wait for a release signal in-process rather than be re-sent.

    Judged by the place among present waiters: waiters away on a countdown are passed by, so
    what keeps a freed slot from idling is enough waiters present to take it. ``by_rules``:
    when its start comes at the earliest by its line's rate and spacing (``start_by_rules``),
    which only the line's head is told (``retry_after``): a task 700th in line under 20/s,
    whose holds say a slot at once, would hold its pool process for the whole inline wait and
    be refused."""
    if inline_wait <= 0 or by_rules > inline_wait:
        return False
    if waiting.retry_after is not None:
        # its start is reserved for a known moment (a rate, a spacing or a pause): no guess
        return waiting.retry_after <= inline_wait
    if waiting.opens_in is not None and waiting.opens_in > inline_wait:
        # nobody starts before then: waiting here would only keep a pool process from a task
        # that can run (a paused task's copy coming back at the end of the pause, say)
        return False
    expected = expected_wait(waiting, among_present=True)
    if expected is None:
        # nothing observed yet (a burst meets a semaphore with no release behind it): the
        # waiters the next two rounds of releases serve stay, the rest make room. One round
        # is too few: the rest of a burst parks before the first release, and every later
        # grant then goes through a wake copy and the broker (measured: 1.06-1.07 x the
        # ideal makespan and 1.9 runs per task for 60 tasks at limit 3, against 1.03 and 1.0)
        turn = waiting.position if waiting.turn is None else waiting.turn
        return turn < UNKNOWN_HOLD_ROUNDS * waiting.limit
    return expected <= inline_wait


def stands_by(waiting: Waiting, *, placed: bool = False, by_rules: float = 0.0) -> bool:
    """Whether a refused waiter waits for its slot in its pool process even where that takes the
    worker's last free one (``pool_room``): a slot should reach it within ``STAND_BY_MOST_S``
    (its hold time known), and it is among the next ``WAKE_AHEAD`` to be offered one (one
    woken ahead, or any so near its turn), or its sender sent it near its turn (``placed``, see
    ``sent_to_stand_by``). A hand-off to it is then a publish, and the process is taken that
    briefly, rather than a trip through the broker. With no hold time known, or longer holds,
    the worker's last process stays free (a task that may start now would wait behind the
    wait)."""
    if waiting.turn is None or waiting.opens_in is not None:
        return False
    if max(waiting.retry_after or 0.0, by_rules) > STAND_BY_MOST_S:
        # a rate, a spacing or a pause puts its start later (reserved, at the head, or by the
        # waiters ahead, ``by_rules``): nothing comes sooner, whatever the holds say (a task far
        # back under "20/s" with a limit never reached stood by for its whole inline wait, 2 s
        # of a pool process, and was refused, and the line's wake copies waited behind them)
        return False
    if waiting.turn >= WAKE_AHEAD and not placed:
        return False
    expected = expected_wait(waiting, among_present=True)
    return expected is not None and expected <= STAND_BY_MOST_S


def sent_to_stand_by(waiting: Waiting, inline_wait: float, *, by_rules: float = 0.0) -> bool:
    """Whether a task placed as it is sent and refused a start goes to its queue anyway, keeping
    the place it took, rather than be parked: it is within the next round of releases (fewer
    than ``limit`` waiters ahead of it, present or away), and a slot should reach it within
    ``STAND_BY_MOST_S`` and its own ``inline_wait``. Its delivery then stands by for its offer in
    a pool process (``stands_by``). Parked, it would cost its sender two round trips more, and
    its hand-off a trip of its wake copy through the broker: at that distance from the head, more
    than the wait. Further back, or with a start reserved for later, a pause, or no hold time
    known, it is parked: its delivery would only be refused. ``by_rules``: when its turn comes
    at the earliest by every rule of its line (``expected_start``): a rate that spaces the next
    starts 50 ms apart makes the 20th in line a second away, however short the holds."""
    if inline_wait <= 0 or waiting.retry_after is not None or waiting.opens_in is not None:
        return False
    if by_rules > min(STAND_BY_MOST_S, inline_wait):
        return False
    if waiting.position >= waiting.limit:
        return False
    expected = expected_wait(waiting)
    return expected is not None and expected <= min(STAND_BY_MOST_S, inline_wait)


def stands_by_ms(inline_wait: float) -> int:
    """Within how many ms a slot must reach a task with ``inline_wait`` for it to stand by for
    its offer in its pool process (``stands_by``); 0: it never does."""
    return round(min(inline_wait, STAND_BY_MOST_S) * 1000) if inline_wait > 0 else 0


def countdown(
    waiting: Waiting,
    bounds: tuple[float, float],
    *,
    waits: int = 0,
    visibility_timeout: float | None = None,
    rng: random.Random | None = None,
) -> int:
    """Whole seconds to wait before asking again, within ``bounds`` and below the broker's
    visibility timeout. ``waits`` counts earlier refusals: with no hold time known, the countdown
    doubles with each refusal, as a backoff."""
    low, high = bounds
    expected = expected_wait(waiting)
    base: float = low * 2.0 ** min(waits, 16) if expected is None else expected * EARLY
    base *= 1 + (rng or random).uniform(-JITTER, JITTER)
    if visibility_timeout is not None:
        high = min(high, visibility_timeout * VISIBILITY_MARGIN)
    return max(1, round(min(max(base, low), max(high, 1.0))))


def expected_start(waiting: Waiting, rules: Rules) -> float:
    """Seconds until this waiter's turn at the earliest, from its place in line and every rule
    declared: the hold times and the limit, the rate, the spacing (0 when none says more)."""
    return max(expected_wait(waiting) or 0.0, start_by_rules(waiting, rules))


def start_by_rules(waiting: Waiting, rules: Rules) -> float:
    """Seconds until this waiter's start at the earliest by its line's rate and spacing alone
    (0 with neither): every waiter ahead of it, present or away, takes a start first."""
    ahead = waiting.position
    by_rate = ahead * rules.rate.period / rules.rate.count if rules.rate is not None else 0.0
    by_spacing = ahead * rules.spacing if rules.spacing is not None else 0.0
    return max(by_rate, by_spacing)


def backstop(
    bounds: tuple[float, float],
    *,
    visibility_timeout: float | None = None,
    kept_apart: bool = False,
    bounds_given: bool = False,
    expected: float = 0.0,
) -> int:
    """The countdown of a parked task's backstop copy. Its hand-off brings a parked task back
    when its turn comes; the copy only covers a lost wake-up (its process died, Redis lost the
    line), and one that came back sooner would only be refused and sent again, over and over,
    while the line is long.

    ``kept_apart``: the copy waits in the broker's Redis or a backstop queue, where waiting costs
    nothing, so it is due after ``KEPT_APART_BACKSTOP_S``, or after the countdown's upper bound
    where the countdown was set (``bounds_given``: it keeps its meaning, the longest a waiting
    task stays away): a parked task is delivered again when a slot is offered to it, and
    otherwise once per backstop. Else it is a countdown message held by a worker: the upper
    bound, below the broker's visibility timeout. ``expected``: the task's expected wait
    (``expected_start``); a kept-apart copy of a task far back in line is due later still."""
    high = bounds[1]
    if kept_apart:
        if bounds_given:
            return max(1, round(high))
        longer = min(BACKSTOP_MOST_S, BACKSTOP_PER_EXPECTED_WAIT * expected)
        return max(1, round(max(KEPT_APART_BACKSTOP_S, longer)))
    if visibility_timeout is not None:
        high = min(high, visibility_timeout * VISIBILITY_MARGIN)
    return max(1, round(high))
