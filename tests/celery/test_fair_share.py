"""Who goes first in a key's line, with real workers on a Redis broker: tenants
(``semaphore_fair_by``), priority (``semaphore_priority``) and a full line
(``semaphore_max_waiters`` with ``semaphore_on_full``).

A customer floods a key of limit 1; a second customer's tasks, sent later, start within about
one slot's turn of arriving, not behind the flood. The order is decided by the acquire script
when each task first asks, and kept by its ticket through parking and re-sending.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from celery_semaphore import ConfigurationError, SemaphoreTask, semaphore_for

from ..celery_stack import CeleryStack
from ..waiting import wait_until
from ..workers import Worker, worker_group

QUEUE = "fair"


@pytest.fixture(scope="module")
def workers(celery_stack: CeleryStack) -> Iterator[list[Worker]]:
    with worker_group(celery_stack.env, queue=QUEUE, names=("f1", "f2")) as group:
        yield group


@pytest.fixture
def proj(celery_stack: CeleryStack, workers: list[Worker]) -> Any:
    import tests.proj.app as proj

    return proj


def started_ids(proj: Any, key: str) -> list[str]:
    return [entry.split()[0].decode() for entry in proj.probe(key).client.lrange(f"probe:{key}:starts", 0, -1)]


def send_and_wait_in_line(
    proj: Any,
    key: str,
    customer: str,
    count: int,
    in_line: int,
    first_holds: float = 0.2,
    *,
    task: str = "fair",
    **call: str,
) -> list[AsyncResult]:
    """Send ``count`` tasks of ``customer`` (the first holding ``first_holds`` seconds, the
    rest 0.2) and wait until ``in_line`` tasks wait for the key. ``task``: the proj task's
    name; ``call``: more keyword arguments (its fair_by templates read them)."""
    sent = getattr(proj, task)
    kwargs = {"customer": customer, "key": key, **call}
    results = [sent.apply_async((first_holds,), kwargs, queue=QUEUE)]
    if first_holds > 0.2:  # it must be the one that runs while the line is built
        wait_until(lambda: results[0].id in started_ids(proj, key), timeout=30, what="the long one to start")
    results += [sent.apply_async((0.2,), kwargs, queue=QUEUE) for _ in range(count - 1)]
    semaphore = semaphore_for(proj.app, sent.name)
    wait_until(lambda: semaphore.status().waiter_count >= in_line, timeout=30, what=f"{in_line} tasks in line")
    return results


@pytest.mark.workers
def test_a_second_customer_is_served_soon_not_after_the_first_ones_flood(proj: Any) -> None:
    """Customer A sends 10 tasks to a key of limit 1 (one runs, 9 wait), then customer B sends
    3: B's first starts within the next 2 starts, and B's last before A's last. (First come,
    first served would run all of A's first.) Every task runs once, never two at once."""
    key = "fair-flood"
    # the first holds 5 s, so that the whole line is built while it runs
    a_results = send_and_wait_in_line(proj, key, "A", 10, 9, first_holds=5)
    b_results = send_and_wait_in_line(proj, key, "B", 3, 12)
    for result in a_results + b_results:
        result.get(timeout=120)
    started = started_ids(proj, key)
    assert sorted(started) == sorted(r.id for r in a_results + b_results), "each ran once"
    b_ids = {r.id for r in b_results}
    b_places = [place for place, task_id in enumerate(started) if task_id in b_ids]
    # place 0 is the task running when B arrived; then A's head of line, then B's first
    assert b_places[0] <= 3, started
    assert b_places[-1] < max(place for place, task_id in enumerate(started) if task_id not in b_ids)
    assert proj.probe(key).maximum == 1


@pytest.mark.workers
def test_a_late_user_of_an_org_is_served_soon_and_a_second_org_gets_its_half(proj: Any) -> None:
    """semaphore_fair_by=("{org}", "{user}"): user A of org acme sends 10 tasks to a key of
    limit 1 (one runs, 9 wait), then user B of acme sends 3 and org solo 6. Inside acme, B's
    first starts within A's next two, not behind A's backlog; between the orgs, solo takes
    every other start while both wait. Every task runs once, never two at once."""
    key = "fair-levels"
    a_results = send_and_wait_in_line(proj, key, "-", 10, 9, first_holds=5, task="fair_in_org", org="acme", user="A")
    b_results = send_and_wait_in_line(proj, key, "-", 3, 12, task="fair_in_org", org="acme", user="B")
    solo_results = send_and_wait_in_line(proj, key, "-", 6, 18, task="fair_in_org", org="solo", user="only")
    for result in a_results + b_results + solo_results:
        result.get(timeout=120)
    started = started_ids(proj, key)
    assert sorted(started) == sorted(r.id for r in a_results + b_results + solo_results), "each ran once"
    b_ids, solo_ids = {r.id for r in b_results}, {r.id for r in solo_results}
    acme = [task_id for task_id in started[1:] if task_id not in solo_ids]
    # inside acme, after the one running: A's head of line, then B's first (one for one)
    assert next(place for place, task_id in enumerate(acme) if task_id in b_ids) <= 2, started
    # while both orgs wait (the first twelve starts after the running one), half are solo's
    assert 5 <= sum(task_id in solo_ids for task_id in started[1:13]) <= 7, started
    assert proj.probe(key).maximum == 1


def intervals(proj: Any, key: str) -> list[tuple[float, float]]:
    """Each run of the probe ``key``: (start, end), in the probe's clock."""
    client = proj.probe(key).client
    starts = {e.split()[0]: float(e.split()[1]) for e in client.lrange(f"probe:{key}:starts", 0, -1)}
    ends = {e.split()[0]: float(e.split()[1]) for e in client.lrange(f"probe:{key}:ends", 0, -1)}
    return [(starts[task_id], ends[task_id]) for task_id in starts]


def most_at_once(runs: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in runs] + [(end, -1) for _, end in runs])
    most = running = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


@pytest.mark.workers
def test_a_customer_holds_at_most_its_cap_and_the_other_takes_the_free_slot(proj: Any) -> None:
    """semaphore_limits {"proj.fair_capped": {"limit": 3, "per_tenant": 2}}: customer A sends 8
    tasks, B then 2. A never runs more than 2 at once; B's tasks take the third slot while A's
    wait, so B's first starts before A's fourth; all 3 slots are used while both wait."""
    a_results = send_and_wait_in_line(proj, "cap-A", "A", 8, 6, first_holds=0.6, task="fair_capped")
    b_results = [proj.fair_capped.apply_async((0.6,), {"customer": "B", "key": "cap-B"}, queue=QUEUE) for _ in range(2)]
    for result in a_results + b_results:
        result.get(timeout=120)
    a_runs, b_runs = intervals(proj, "cap-A"), intervals(proj, "cap-B")
    assert len(a_runs) == 8 and len(b_runs) == 2, "each ran once"
    assert most_at_once(a_runs) <= 2
    assert most_at_once(a_runs + b_runs) == 3
    # B's first start passes A's backlog (with the cap and no passing-over, it would come after
    # A's last start, or never while A waits)
    assert min(start for start, _ in b_runs) < sorted(start for start, _ in a_runs)[3]


@pytest.mark.workers
def test_shares_from_the_settings_give_a_customer_three_starts_for_one(proj: Any) -> None:
    """semaphore_shares {"big:*": 3}: with both customers waiting, big:co gets three of every
    four starts."""
    key = "fair-shares"
    small = send_and_wait_in_line(proj, key, "small", 9, 8, first_holds=5)
    big = send_and_wait_in_line(proj, key, "big:co", 9, 17)
    for result in small + big:
        result.get(timeout=120)
    started = started_ids(proj, key)
    big_ids = {r.id for r in big}
    # after the running task and small's head of line, the next eight starts hold six of big's
    following = started[2:10]
    assert sum(task_id in big_ids for task_id in following) >= 5, started


def test_fair_by_is_checked_at_declaration() -> None:
    """A template naming no argument, a tuple of other than two levels, a bad level and a task
    of several keys are refused when the task is declared, naming the option (and the level);
    a pair of templates is taken."""
    app = Celery("fair-check", set_as_current=False)
    with pytest.raises(ConfigurationError, match="semaphore_fair_by"):

        @app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_fair_by="{tenant}", shared=False, lazy=False)
        def no_such_argument(customer: str) -> None: ...

    with pytest.raises(ConfigurationError, match="pair"):

        @app.task(
            base=SemaphoreTask, semaphore_limit=1, semaphore_fair_by=("{a}", "{b}", "{c}"), shared=False, lazy=False
        )
        def three_levels(a: str, b: str, c: str) -> None: ...

    with pytest.raises(ConfigurationError, match=r"semaphore_fair_by\[1\]"):

        @app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_fair_by=("{org}", "{usr}"), shared=False, lazy=False)
        def misspelt_user(org: str, user: str) -> None: ...

    @app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_fair_by=("{org}", "{user}"), shared=False, lazy=False)
    def two_levels(org: str, user: str) -> None: ...

    with pytest.raises(ConfigurationError, match="semaphore_priority"):

        @app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_priority="high", shared=False, lazy=False)
        def bad_priority() -> None: ...

    with pytest.raises(ConfigurationError, match="semaphore_on_full"):

        @app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_max_waiters=5, shared=False, lazy=False)
        def cap_without_policy() -> None: ...

    with pytest.raises(ConfigurationError, match="semaphore_coalesce_by"):

        @app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_on_full="keep_latest", shared=False, lazy=False)
        def keep_latest_without_a_key() -> None: ...

    with pytest.raises(ConfigurationError, match="one semaphore_key"):

        @app.task(
            base=SemaphoreTask,
            semaphore_limit=1,
            semaphore_key=["a", "b"],
            semaphore_fair_by="{customer}",
            shared=False,
            lazy=False,
        )
        def several_keys(customer: str) -> None: ...


def test_bad_shares_stop_the_app_with_the_entry_named() -> None:
    app = Celery("fair-shares-check", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.semaphore_shares = {"enterprise:*": 0}

    @app.task(base=SemaphoreTask, semaphore_limit=1, semaphore_fair_by="{customer}", shared=False)
    def export(customer: str) -> None: ...

    with pytest.raises(ConfigurationError, match=r"semaphore_shares\['enterprise:\*'\]"):
        semaphore_for(app, "export")


@pytest.mark.workers
def test_a_priority_from_the_option_or_a_header_starts_a_task_before_those_that_asked_after_it(proj: Any) -> None:
    """Limit 1: one task runs, four wait; then one with urgency 60 (the option's function), and
    one sent with the header semaphore_priority=120: they start right after the running one,
    the header's first, ahead of the four that asked up to a few seconds before them."""
    key = "ranked"
    semaphore = semaphore_for(proj.app, "proj.ranked")
    # the first holds 4 s, and starts before the others are sent: they all join the line while it runs
    plain = [proj.ranked.apply_async((4,), {"key": key}, queue=QUEUE)]
    wait_until(lambda: started_ids(proj, key) == [plain[0].id], timeout=30, what="the long one to start")
    plain += [proj.ranked.apply_async((0.2,), {"key": key}, queue=QUEUE) for _ in range(4)]
    wait_until(lambda: semaphore.status().waiter_count >= 4, timeout=30, what="four tasks in line")
    urgent = proj.ranked.apply_async((0.2,), {"key": key, "urgency": 60}, queue=QUEUE)
    wait_until(lambda: semaphore.status().waiter_count >= 5, timeout=30, what="the urgent task in line")
    most_urgent = proj.ranked.apply_async((0.2,), {"key": key}, queue=QUEUE, headers={"semaphore_priority": 120})
    wait_until(lambda: semaphore.status().waiter_count >= 6, timeout=30, what="the most urgent task in line")
    assert started_ids(proj, key) == [plain[0].id], "all joined the line while the first ran"
    for result in [*plain, urgent, most_urgent]:
        result.get(timeout=120)
    started = started_ids(proj, key)
    assert started[1:3] == [most_urgent.id, urgent.id], started
    assert sorted(started) == sorted(r.id for r in [*plain, urgent, most_urgent])


@pytest.mark.workers
@pytest.mark.parametrize("task_name", ["capped", "capped_by_settings"])
def test_a_task_that_finds_its_line_full_fails_at_once_and_the_others_run_once(proj: Any, task_name: str) -> None:
    """max_waiters 2 with on_full "reject" (the task's options, or its entry in
    semaphore_limits): one task runs, two wait, a fourth fails at once with SemaphoreUnavailable
    naming max_waiters (FAILURE, not lost, not run); the two waiting ones run once each."""
    key = task_name
    task = getattr(proj, task_name)
    semaphore = semaphore_for(proj.app, task.name)
    running = task.apply_async((3,), {"key": key}, queue=QUEUE)
    wait_until(lambda: started_ids(proj, key) == [running.id], timeout=30, what="the first to run")
    waiting = [task.apply_async((0.1,), {"key": key}, queue=QUEUE) for _ in range(2)]
    wait_until(lambda: semaphore.status().waiter_count == 2, timeout=30, what="two in line")
    refused = task.apply_async((0.1,), {"key": key}, queue=QUEUE)
    with pytest.raises(Exception, match="max_waiters") as caught:
        refused.get(timeout=30)
    assert type(caught.value).__name__ == "SemaphoreUnavailable"
    assert refused.state == "FAILURE"
    assert started_ids(proj, key) == [running.id], "the refused task never ran"
    for result in [running, *waiting]:
        result.get(timeout=60)
    assert sorted(started_ids(proj, key)) == sorted(r.id for r in [running, *waiting])


def _fails_with(result: AsyncResult, match: str) -> None:
    with pytest.raises(Exception, match=match) as caught:
        result.get(timeout=60)
    assert type(caught.value).__name__ == "SemaphoreUnavailable"
    assert result.state == "FAILURE"


@pytest.mark.workers
def test_drop_oldest_fails_the_oldest_waiting_task_and_runs_the_others_once(proj: Any) -> None:
    """max_waiters 2, drop_oldest: one runs, two wait (parked); a fourth comes, so the oldest
    waiting one fails with SemaphoreUnavailable (dropped) and never runs; the rest run once."""
    key = "dropping"
    semaphore = semaphore_for(proj.app, "proj.dropping")
    running = proj.dropping.apply_async((3,), {"key": key}, queue=QUEUE)
    wait_until(lambda: started_ids(proj, key) == [running.id], timeout=30, what="the first to run")
    oldest = proj.dropping.apply_async((0.1,), {"key": key}, queue=QUEUE)
    wait_until(lambda: semaphore.status().waiter_count == 1, timeout=30, what="the oldest in line")
    second = proj.dropping.apply_async((0.1,), {"key": key}, queue=QUEUE)
    wait_until(lambda: semaphore.status().waiter_count == 2, timeout=30, what="two in line")
    newest = proj.dropping.apply_async((0.1,), {"key": key}, queue=QUEUE)
    _fails_with(oldest, "dropped")
    for result in (running, second, newest):
        result.get(timeout=60)
    assert sorted(started_ids(proj, key)) == sorted(r.id for r in (running, second, newest)), "each once"


@pytest.mark.workers
def test_keep_latest_replaces_the_waiting_refresh_and_runs_the_newer_in_its_place(proj: Any) -> None:
    """keep_latest by dashboard: a refresh of "sales" waits, one of "ops" waits behind it, then
    a newer refresh of "sales" comes: the older fails (replaced) and never runs, the newer runs
    once, in the older one's place (before "ops"); nothing else is lost or run twice."""
    key = "refresh"
    semaphore = semaphore_for(proj.app, "proj.refresh")
    running = proj.refresh.apply_async((3,), {"dashboard": "home", "key": key}, queue=QUEUE)
    wait_until(lambda: started_ids(proj, key) == [running.id], timeout=30, what="the first to run")
    older = proj.refresh.apply_async((0.1,), {"dashboard": "sales", "key": key}, queue=QUEUE)
    wait_until(lambda: semaphore.status().waiter_count == 1, timeout=30, what="the older refresh in line")
    ops = proj.refresh.apply_async((0.1,), {"dashboard": "ops", "key": key}, queue=QUEUE)
    wait_until(lambda: semaphore.status().waiter_count == 2, timeout=30, what="ops in line")
    newer = proj.refresh.apply_async((0.1,), {"dashboard": "sales", "key": key}, queue=QUEUE)
    _fails_with(older, "newer call")
    for result in (running, ops, newer):
        result.get(timeout=60)
    assert started_ids(proj, key) == [running.id, newer.id, ops.id]
