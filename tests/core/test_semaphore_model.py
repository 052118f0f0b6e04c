"""Model-based test: random sequences of tries, releases and departures against a real Redis,
checked step by step against a small Python model of the fair semaphore with hand-off."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from celery_semaphore import FairSemaphore, Granted, Lease, Waiting

from ..redis_server import RedisServer

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
    """The model: holders, waiters in first-ask order (each present or away), and offers: a slot
    freed while present waiters wait is offered to the oldest present one, which alone may
    claim it; giving up or stepping away passes the offer on."""

    def __init__(self) -> None:
        super().__init__()
        assert _server is not None
        self.client: redis.Redis = _server.client()
        self.client.flushall()
        self.semaphore = FairSemaphore(self.client, "model", LIMIT, lease=60, patience=60)
        self.held: dict[str, Lease] = {}  # waiter -> lease
        self.line: list[str] = []  # waiters in ticket order
        self.away: set[str] = set()
        self.offered: set[str] = set()

    def _present(self) -> list[str]:
        return [w for w in self.line if w not in self.away and w not in self.offered]

    def _hand_off(self, asking: str | None = None) -> bool:
        """Offer free slots to the oldest present waiters; True if ``asking`` is among them
        (it is then granted directly, not offered)."""
        free = LIMIT - len(self.held) - len(self.offered)
        chosen = False
        for waiter in self._present()[: max(free, 0)]:
            if waiter == asking:
                chosen = True
            else:
                self.offered.add(waiter)
        return chosen

    @rule(waiter=st.sampled_from(WAITERS))
    def ask(self, waiter: str) -> None:
        if waiter in self.held:
            return
        attempt = self.semaphore.try_acquire(waiter=waiter)
        if waiter in self.offered:
            expected = True
            self.offered.discard(waiter)
        else:
            self.away.discard(waiter)
            if waiter not in self.line:
                self.line.append(waiter)
            expected = self._hand_off(asking=waiter)
        assert isinstance(attempt, Granted) == expected, (waiter, self.line, self.away, self.offered, list(self.held))
        if isinstance(attempt, Granted):
            self.held[waiter] = attempt.lease
            self.line.remove(waiter)
        else:
            assert isinstance(attempt, Waiting)
            assert attempt.position == self.line.index(waiter)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        waiter = data.draw(st.sampled_from(sorted(self.held)))
        assert self.held.pop(waiter).release() is True
        self._hand_off()

    @precondition(lambda self: bool(self.line))
    @rule(data=st.data())
    def give_up(self, data: st.DataObject) -> None:
        waiter = data.draw(st.sampled_from(self.line))
        assert self.semaphore.leave(waiter) is True
        self.line.remove(waiter)
        self.away.discard(waiter)
        if waiter in self.offered:
            self.offered.discard(waiter)
            self._hand_off()

    @precondition(lambda self: bool(self.line))
    @rule(data=st.data())
    def step_away(self, data: st.DataObject) -> None:
        waiter = data.draw(st.sampled_from(self.line))
        self.semaphore.leave(waiter, away_for=60)
        self.away.add(waiter)
        if waiter in self.offered:
            self.offered.discard(waiter)
            self._hand_off()

    @precondition(lambda self: bool(self.line))
    @rule(data=st.data())
    def park(self, data: st.DataObject) -> None:
        """Step away *parked* (a Celery task with a wake address): still offered its turn."""
        waiter = data.draw(st.sampled_from(self.line))
        assert self.semaphore._leave(waiter, 60, "model-wake") is True
        if waiter not in self.offered:
            self.away.discard(waiter)
            self._hand_off()

    @invariant()
    def redis_agrees(self) -> None:
        status = self.semaphore.status()
        assert status.holder_count == len(self.held)
        assert status.offered_count == len(self.offered)
        assert status.holder_count + status.offered_count <= LIMIT
        assert [w.waiter for w in status.waiters] == self.line
        assert {w.waiter for w in status.waiters if not w.present} == self.away
        assert {w.waiter for w in status.waiters if w.offered} == self.offered

    def teardown(self) -> None:
        for lease in self.held.values():
            lease.release()
        self.client.close()


FairSemaphoreModel.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_fair_semaphore_matches_its_model = FairSemaphoreModel.TestCase
