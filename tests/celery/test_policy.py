"""The waiting policy: when to wait in-process, and how long a countdown to choose."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_semaphore._celery.policy import (
    STAND_BY_MOST_S,
    WAKE_AHEAD,
    countdown,
    expected_wait,
    sent_to_stand_by,
    stands_by,
    start_by_rules,
    waits_in_process,
)
from celery_semaphore._core.attempts import Waiting
from celery_semaphore._core.rules import Rate, Rules

waitings = st.builds(
    Waiting,
    position=st.integers(0, 10_000),
    free=st.integers(-5, 50),
    limit=st.integers(1, 50),
    hold_time=st.one_of(st.none(), st.floats(0.001, 3600)),
)
bounds = st.tuples(st.floats(1, 60), st.floats(0, 600)).map(lambda b: (b[0], b[0] + b[1]))


# Hypothesis warns when the global ``random`` state changes while it draws arguments. These
# strategies use no randomness of their own, but redis-py's retry backoff (jitter from the global
# ``random``) runs in background threads of earlier tests that reconnect to servers they stopped
# (wake-up listeners, the renewer): that is what changes it, not this test.
@pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
@given(waitings, bounds, st.integers(0, 100), st.one_of(st.none(), st.floats(2, 7200)))
def test_countdowns_are_whole_seconds_within_bounds_and_below_the_visibility_timeout(
    waiting: Waiting, bounds: tuple[float, float], waits: int, visibility: float | None
) -> None:
    """Always an int >= 1, within [min, max] (rounded), and at most half the visibility timeout."""
    value = countdown(waiting, bounds, waits=waits, visibility_timeout=visibility, rng=random.Random(0))
    assert isinstance(value, int)
    assert value >= 1
    assert value <= max(1, round(bounds[1]))
    if visibility is not None:
        assert value <= max(1, round(min(visibility * 0.5, bounds[1])))


def test_the_expected_wait_grows_with_the_place_in_line() -> None:
    """Each `limit` waiters ahead cost one average hold time."""
    assert expected_wait(Waiting(position=0, free=0, limit=3, hold_time=2.0)) == 2.0
    assert expected_wait(Waiting(position=5, free=0, limit=3, hold_time=2.0)) == 4.0
    assert expected_wait(Waiting(position=1, free=2, limit=3, hold_time=2.0)) == 0.0
    assert expected_wait(Waiting(position=4, free=0, limit=3, hold_time=None)) is None


def test_waiters_near_the_head_wait_in_process_the_rest_are_re_sent() -> None:
    """Short expected waits stay in-process; long ones, or inline_wait=0, go back to the broker."""
    near = Waiting(position=1, free=0, limit=3, hold_time=0.2)
    far = Waiting(position=60, free=0, limit=3, hold_time=0.2)
    assert waits_in_process(near, inline_wait=2.0)
    assert not waits_in_process(far, inline_wait=2.0)
    assert not waits_in_process(near, inline_wait=0)
    # no hold time observed yet: the next two rounds of releases (2 x limit waiters) stay
    for position in range(6):
        assert waits_in_process(Waiting(position=position, free=0, limit=3, hold_time=None), inline_wait=2.0)
    assert not waits_in_process(Waiting(position=6, free=0, limit=3, hold_time=None), inline_wait=2.0)
    assert not waits_in_process(Waiting(position=0, free=0, limit=3, hold_time=None), inline_wait=0)


def test_a_far_waiter_comes_back_before_its_turn() -> None:
    """The countdown is about 80% of the expected wait, so the waiter is back in time."""
    far = Waiting(position=29, free=0, limit=3, hold_time=1.0)  # 10 rounds of 1 s
    values = {countdown(far, (1, 60), rng=random.Random(seed)) for seed in range(50)}
    assert min(values) >= 6
    assert max(values) <= 10


def test_with_no_hold_time_known_countdowns_back_off() -> None:
    """Unknown hold times double the countdown with each refusal, up to the max."""
    unknown = Waiting(position=9, free=0, limit=3, hold_time=None)
    assert countdown(unknown, (1, 30), waits=0, rng=random.Random(1)) <= 2
    assert countdown(unknown, (1, 30), waits=3, rng=random.Random(1)) >= 6
    assert countdown(unknown, (1, 30), waits=20, rng=random.Random(1)) == 30


def test_a_parked_tasks_backstop_comes_at_the_upper_bound_below_the_visibility_timeout() -> None:
    """The backstop copy of a parked task only covers a lost wake-up: it comes at the countdown's
    upper bound, never past half the Redis broker's visibility timeout, whole seconds >= 1."""
    from celery_semaphore._celery.policy import backstop

    assert backstop((1.0, 30.0)) == 30
    assert backstop((1.0, 30.0), visibility_timeout=3600) == 30
    assert backstop((5.0, 30.0), visibility_timeout=20) == 10
    assert backstop((1.0, 1.0)) == 1
    assert backstop((1.0, 30.0), visibility_timeout=1) == 1


def test_a_backstop_kept_in_the_broker_comes_after_minutes_unless_the_countdown_was_set() -> None:
    """Kept apart from the workers (the broker's Redis, a RabbitMQ backstop queue), a parked
    task's backstop costs nothing while it waits: it comes after KEPT_APART_BACKSTOP_S, not
    capped by the visibility timeout, or at the countdown's upper bound where that was set."""
    from celery_semaphore._celery.policy import KEPT_APART_BACKSTOP_S, backstop

    assert backstop((1.0, 30.0), visibility_timeout=20, kept_apart=True) == KEPT_APART_BACKSTOP_S
    assert backstop((1.0, 30.0), visibility_timeout=20, kept_apart=True, bounds_given=True) == 30
    assert backstop((1.0, 4.0), kept_apart=True, bounds_given=True) == 4


def test_a_backstop_kept_in_the_broker_comes_after_twice_the_expected_wait_of_a_long_line() -> None:
    """Far back in a long line, a backstop due after 5 minutes would deliver the task, refuse
    it and park it again every 5 minutes while it waits: it is due after twice its expected
    wait instead (by the rate, the spacing, or the hold times and the limit), at most 30
    minutes (a finished run is remembered longer, so a copy that missed its withdrawal is still
    dropped), and never sooner than 5 minutes; a countdown that was set keeps its meaning."""
    from celery_semaphore._celery.policy import BACKSTOP_MOST_S, KEPT_APART_BACKSTOP_S, backstop, expected_start
    from celery_semaphore._celery.wait_runs import AWAY_SLACK, REMEMBER_SLACK
    from celery_semaphore._core.rules import Rate, Rules

    far_back = Waiting(position=9_999, free=0, limit=1000, hold_time=0.005)
    by_rate = expected_start(far_back, Rules(1000, Rate(20, 1.0)))
    assert by_rate == pytest.approx(9_999 / 20)
    assert backstop((1.0, 30.0), kept_apart=True, expected=by_rate) == round(2 * 9_999 / 20)
    assert expected_start(far_back, Rules(1000, None, 3.0)) == pytest.approx(3 * 9_999)
    assert backstop((1.0, 30.0), kept_apart=True, expected=3 * 9_999) == BACKSTOP_MOST_S
    by_holds = expected_start(Waiting(position=400, free=0, limit=4, hold_time=2.0), Rules(4))
    assert by_holds == pytest.approx(101 * 2.0)
    assert backstop((1.0, 30.0), kept_apart=True, expected=by_holds) == 404
    near = expected_start(Waiting(position=10, free=0, limit=4, hold_time=2.0), Rules(4))
    assert backstop((1.0, 30.0), kept_apart=True, expected=near) == KEPT_APART_BACKSTOP_S
    assert backstop((1.0, 30.0), kept_apart=True, bounds_given=True, expected=by_rate) == 30
    assert BACKSTOP_MOST_S + AWAY_SLACK < REMEMBER_SLACK


def test_the_next_waiters_to_be_offered_stand_by_in_their_process() -> None:
    """The waiters a release may have woken ahead (the first ``WAKE_AHEAD`` present) of a line
    whose slots come back within ``STAND_BY_MOST_S`` wait for their offer in their pool process,
    even where it is the worker's last free one; the rest do not: one further back, one whose
    line's hold time is unknown or long, one whose start nobody may take before a known moment."""
    assert WAKE_AHEAD >= 1

    def waiting(turn: int, hold: float | None = 0.1, **more: float) -> Waiting:
        return Waiting(position=turn, free=0, limit=4, turn=turn, hold_time=hold, **more)

    assert all(stands_by(waiting(turn)) for turn in range(WAKE_AHEAD))
    assert not stands_by(waiting(WAKE_AHEAD))
    assert not stands_by(Waiting(position=0, free=0, limit=4, hold_time=0.1))  # its turn unknown
    assert not stands_by(waiting(0, hold=None))
    assert not stands_by(waiting(0, hold=STAND_BY_MOST_S * 2))
    assert not stands_by(waiting(0, opens_in=30.0))


def test_a_task_placed_near_its_turn_is_sent_to_stand_by_the_rest_are_parked() -> None:
    """At send, a task refused a start goes to its queue keeping its place only within the next
    round of releases (fewer than ``limit`` ahead of it, away ones counted) and a slot expected
    within half a second and its own inline wait; the rest are parked: further back, a hold
    time unknown or long, a start reserved for later or a pause, or no waiting in process at
    all."""

    def waiting(position: int, hold: float | None = 0.1, **more: float) -> Waiting:
        return Waiting(position=position, free=0, limit=4, turn=0, hold_time=hold, ticket=1, **more)

    assert all(sent_to_stand_by(waiting(position), 2.0) for position in range(4))
    assert not sent_to_stand_by(waiting(4), 2.0)  # a round of releases further back
    assert not sent_to_stand_by(waiting(0, hold=None), 2.0)
    assert not sent_to_stand_by(waiting(0, hold=0.6), 2.0)  # beyond half a second
    assert not sent_to_stand_by(waiting(0, hold=0.3), 0.2)  # beyond its own inline wait
    assert not sent_to_stand_by(waiting(0), 0)  # it never waits in process
    assert not sent_to_stand_by(waiting(0, retry_after=1.0), 2.0)
    assert not sent_to_stand_by(waiting(0, opens_in=30.0), 2.0)
    # a rate on a limit never reached: the holds say at once, the rate says later
    assert sent_to_stand_by(waiting(0), 2.0, by_rules=STAND_BY_MOST_S)
    assert not sent_to_stand_by(waiting(0), 2.0, by_rules=STAND_BY_MOST_S + 0.01)
    assert not sent_to_stand_by(waiting(0, hold=0.005), 0.2, by_rules=0.3)  # beyond its own inline wait


def test_a_delivery_sent_to_stand_by_stands_by_beyond_the_next_two() -> None:
    """Its delivery may take the worker's last free process for its offer wherever it stands
    among those present, as long as a slot should reach it within half a second; a delivery its
    sender did not place stands by only among the next ``WAKE_AHEAD``."""

    def waiting(turn: int, hold: float = 0.05) -> Waiting:
        return Waiting(position=turn, free=0, limit=4, turn=turn, hold_time=hold)

    assert stands_by(waiting(WAKE_AHEAD + 3), placed=True)
    assert not stands_by(waiting(WAKE_AHEAD + 3))
    assert not stands_by(waiting(40), placed=True)  # ceil(41 / 4) x 50 ms: beyond half a second
    assert not stands_by(waiting(0, hold=STAND_BY_MOST_S * 2), placed=True)


def test_a_waiter_whose_start_is_reserved_for_later_does_not_stand_by() -> None:
    """Under a rate, a spacing or a pause its start is reserved for a known moment: it stands by
    only if that is within half a second, however short the line's holds (a rate on a limit never
    reached: a task 722nd in line under 20/s, holds of 5 ms, its start 36 s away, stood by for its
    whole inline wait and was refused, and the next deliveries waited behind it)."""

    def waiting(turn: int, retry_after: float) -> Waiting:
        return Waiting(position=turn, free=0, limit=1000, turn=turn, hold_time=0.005, retry_after=retry_after)

    assert not stands_by(waiting(722, 36.1), placed=True)
    assert not stands_by(waiting(0, 36.1))
    assert not stands_by(waiting(0, STAND_BY_MOST_S + 0.01), placed=True)
    assert stands_by(waiting(0, STAND_BY_MOST_S))
    assert stands_by(waiting(30, 0.2), placed=True)


def test_a_waiter_far_back_under_a_rate_does_not_wait_in_its_process() -> None:
    """Only the head of a line is told its reserved start (``retry_after``); the rest are told
    when the next start comes (``opens_in``) and their place. By the holds alone (5 ms, a limit
    never reached) each would wait in its process, the 700th of a line under 20/s too: 35 s
    off, it held its pool process for the whole inline wait and was refused. Its place and the
    rate put its start off, and it neither waits in its process nor stands by."""
    rules = Rules(1000, Rate(20, 1.0))

    def waiting(position: int, opens_in: float | None = 0.9) -> Waiting:
        return Waiting(position=position, free=0, limit=1000, turn=position, hold_time=0.005, opens_in=opens_in)

    assert start_by_rules(waiting(700), rules) == pytest.approx(35.0)
    assert start_by_rules(waiting(700), Rules(1000)) == 0.0  # no rate, no spacing: the holds decide
    assert start_by_rules(waiting(4), Rules(3, None, 0.3)) == pytest.approx(1.2)  # a spacing
    far, near = waiting(700), waiting(10)
    assert waits_in_process(far, 2.0)  # by the holds alone
    assert not waits_in_process(far, 2.0, by_rules=start_by_rules(far, rules))
    assert waits_in_process(near, 2.0, by_rules=start_by_rules(near, rules))  # half a second off
    # (a line whose next start the rate allows now: it tells nobody when it opens)
    far, near, further = waiting(700, None), waiting(10, None), waiting(11, None)
    assert stands_by(far, placed=True)  # by the holds alone
    assert not stands_by(far, placed=True, by_rules=start_by_rules(far, rules))
    assert stands_by(near, placed=True, by_rules=start_by_rules(near, rules))
    assert not stands_by(further, placed=True, by_rules=start_by_rules(further, rules))
