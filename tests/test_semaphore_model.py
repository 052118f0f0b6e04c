"""Model-based test: random sequences of tries, releases and departures against a real Redis,
checked step by step against a small Python model of the fair semaphore."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from celery_semaphore import FairSemaphore, Granted, Lease, Waiting

from .redis_server import RedisServer

LIMIT = 2
WAITERS = [f"w{i}" for i in range(6)]

_server: RedisServer | None = None


@pytest.fixture(scope="module", autouse=True)
def model_server() -> Iterator[None]:
    global _server
    _server = RedisServer().start()
    yield
    _server.__exit__()
    _server = None


class FairSemaphoreModel(RuleBasedStateMachine):
    """The model: holders, and waiters in first-ask order, each present or away."""

    def __init__(self) -> None:
        super().__init__()
        assert _server is not None
        self.client: redis.Redis = _server.client()
        self.client.flushall()
        self.semaphore = FairSemaphore(self.client, "model", LIMIT, lease=60, patience=60)
        self.held: dict[str, Lease] = {}  # waiter -> lease
        self.line: list[str] = []  # waiters in ticket order
        self.away: set[str] = set()

    def _expected_grant(self, waiter: str) -> bool:
        free = LIMIT - len(self.held)
        present = [w for w in self.line if w not in self.away or w == waiter]
        if waiter not in present:
            present.append(waiter)  # a newcomer joins at the back
        return present.index(waiter) < free

    @rule(waiter=st.sampled_from(WAITERS))
    def ask(self, waiter: str) -> None:
        if waiter in self.held:
            return
        expected = self._expected_grant(waiter)
        attempt = self.semaphore.try_acquire(waiter=waiter)
        assert isinstance(attempt, Granted) == expected, (waiter, self.line, self.away, list(self.held))
        self.away.discard(waiter)
        if isinstance(attempt, Granted):
            self.held[waiter] = attempt.lease
            if waiter in self.line:
                self.line.remove(waiter)
        else:
            assert isinstance(attempt, Waiting)
            if waiter not in self.line:
                self.line.append(waiter)
            assert attempt.position == self.line.index(waiter)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        waiter = data.draw(st.sampled_from(sorted(self.held)))
        assert self.held.pop(waiter).release() is True

    @precondition(lambda self: bool(self.line))
    @rule(data=st.data())
    def give_up(self, data: st.DataObject) -> None:
        waiter = data.draw(st.sampled_from(self.line))
        assert self.semaphore.leave(waiter) is True
        self.line.remove(waiter)
        self.away.discard(waiter)

    @precondition(lambda self: bool(self.line))
    @rule(data=st.data())
    def step_away(self, data: st.DataObject) -> None:
        waiter = data.draw(st.sampled_from(self.line))
        self.semaphore.leave(waiter, away_for=60)
        self.away.add(waiter)

    @invariant()
    def redis_agrees(self) -> None:
        status = self.semaphore.status()
        assert status.holder_count == len(self.held) <= LIMIT
        assert [w.waiter for w in status.waiters] == self.line
        assert {w.waiter for w in status.waiters if not w.present} == self.away

    def teardown(self) -> None:
        for lease in self.held.values():
            lease.release()
        self.client.close()


FairSemaphoreModel.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_fair_semaphore_matches_its_model = FairSemaphoreModel.TestCase
