"""``why(app, task_id)`` and ``celery semaphore why``, with a real worker (Redis broker): a task
running, waiting for a slot, a rate, a spacing, a pause, behind others in line, parked, done and
unknown; and the cost of an answer, the same round trips and commands with 5 or 500 waiters."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery.bin.celery import celery
from click.testing import CliRunner

from celery_semaphore import Granted, Waiting, semaphore_for, why
from celery_semaphore._celery.config import forget_config
from celery_semaphore._celery.tokens import waiter_key
from celery_semaphore._core.attempts import Ask

from ..celery_stack import CeleryStack
from ..commandstats import command_calls
from ..redis_server import RedisServer
from ..waiting import wait_until
from ..workers import Worker, worker_group

pytestmark = pytest.mark.workers

QUEUE = "why"


@pytest.fixture(scope="module")
def proj(celery_stack: CeleryStack) -> Any:
    import tests.proj.app as proj

    forget_config(proj.app)
    return proj


@pytest.fixture(scope="module")
def worker(proj: Any, celery_stack: CeleryStack) -> Iterator[Worker]:
    # killed at the end: tasks still waiting in-process for a minute-long rule need not finish
    with worker_group(celery_stack.env, queue=QUEUE, names=("why",), concurrency=10, kill_at_end=True) as group:
        yield group[0]


def answer_when(proj: Any, task_id: str, state: str, blocked_by: str | None = None) -> dict[str, Any]:
    """why() of ``task_id`` once it reads ``state`` (and, waiting, ``blocked_by`` on its key)."""

    def read() -> dict[str, Any]:
        answer = why(proj.app, task_id)
        if answer["state"] != state:
            return {}
        if blocked_by is not None and answer["keys"][0]["blocked_by"] != blocked_by:
            return {}
        return answer

    return wait_until(read, timeout=30, interval=0.1, what=f"{task_id} {state} {blocked_by or ''}")


def open_gate(proj: Any, gate: str, times: int) -> None:
    proj.probe(gate).client.rpush(f"gate:{gate}", *["open"] * times)


def cli(*args: str) -> Any:
    return CliRunner().invoke(celery, ["-A", "tests.proj.app", "semaphore", "why", *args])


def as_is(task: Any, *args: Any) -> Any:
    """Sent by name, as it is: its worker asks and waits in-process (a task placed at send
    waits parked, before any worker sees it)."""
    return task.app.send_task(task.name, args, queue=QUEUE)


def test_running_waiting_for_a_slot_behind_the_line_then_done(proj: Any, worker: Worker) -> None:
    gate = f"why-{uuid.uuid4().hex[:8]}"
    first = proj.why_waits.apply_async((gate,), queue=QUEUE)
    running = answer_when(proj, first.id, "running")
    (slot,) = running["slots"]
    assert slot["key"] == "proj.why_waits" and first.id in slot["worker"] and slot["lease_left"] > 0
    second = as_is(proj.why_waits, gate)
    waiting = answer_when(proj, second.id, "waiting", "limit")
    (entry,) = waiting["keys"]
    assert entry["key"] == "proj.why_waits" and entry["position"] == 0 and entry["free"] == 0
    assert entry["present"] and not entry["parked"]
    assert [first.id in holder["worker"] for holder in entry["holders_ahead"]] == [True]
    third = as_is(proj.why_waits, gate)
    behind = answer_when(proj, third.id, "waiting", "line")
    assert behind["keys"][0]["position"] == 1

    text = cli(third.id)
    assert text.exit_code == 0, text.output
    assert f"task {third.id} (proj.why_waits): waiting" in text.stdout
    assert "place 2 of 2 in line, held back by the line ahead of it" in text.stdout
    as_json = cli(third.id, "--json")
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout)["keys"][0]["blocked_by"] == "line"

    open_gate(proj, gate, 3)
    for result in (first, second, third):
        result.get(timeout=30)
    done = why(proj.app, first.id)
    assert done["state"] == "done" and done["result"]["state"] == "SUCCESS"
    assert "done" in cli(first.id).stdout


def test_parked_waiters_say_when_they_come_back(proj: Any, worker: Worker) -> None:
    gate = f"why-{uuid.uuid4().hex[:8]}"
    holder = proj.why_parks.apply_async((gate,), queue=QUEUE)
    answer_when(proj, holder.id, "running")
    head = proj.why_parks.apply_async((gate,), queue=QUEUE)
    parked = answer_when(proj, head.id, "parked", "limit")
    assert parked["keys"][0]["parked"] and parked["keys"][0]["position"] == 0
    assert 0 < parked["parked"]["backstop_due_in"] <= 300
    assert parked["parked"]["record_due_in"] is not None
    behind = proj.why_parks.apply_async((gate,), queue=QUEUE)
    answer_when(proj, behind.id, "parked", "line")
    text = cli(behind.id)
    assert "parked" in text.stdout and "backstop copy due in" in text.stdout
    open_gate(proj, gate, 3)
    for result in (holder, head, behind):
        result.get(timeout=30)


def test_waiting_for_the_rate_and_for_the_spacing(proj: Any, worker: Worker) -> None:
    for task, rule in ((proj.why_rated, "rate"), (proj.why_spaced, "spacing")):
        task.apply_async(queue=QUEUE).get(timeout=30)
        second = task.apply_async(queue=QUEUE)
        # a start reserved a minute off: parked from its sender, so that a looser rule wakes it
        answer = answer_when(proj, second.id, "parked", rule)
        (entry,) = answer["keys"]
        assert entry["slot_offered"]  # its start is reserved for it, a minute after the first
        assert 30 < entry["estimated_start_in"] <= 60
        assert entry["rules"][f"{rule}_opens_in"] > 30


def test_waiting_for_a_pause(proj: Any, worker: Worker) -> None:
    semaphore = semaphore_for(proj.app, "proj.why_paused")
    semaphore.pause(60)
    try:
        paused = as_is(proj.why_paused)
        answer = answer_when(proj, paused.id, "waiting", "pause")
        assert answer["keys"][0]["rules"]["paused"]
        assert "held back by the key is paused" in cli(paused.id).stdout
    finally:
        semaphore.resume()
    paused.get(timeout=30)


def test_an_unknown_task_id(proj: Any, celery_stack: CeleryStack) -> None:
    task_id = str(uuid.uuid4())
    answer = why(proj.app, task_id)
    assert answer["state"] == "unknown" and answer["keys"] == []
    assert "proj.why_waits" in answer["looked_at"]
    result = cli(task_id, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["state"] == "unknown"
    text = cli(task_id)
    assert text.exit_code == 0 and f"task {task_id}: unknown" in text.stdout


def test_a_key_given_finds_a_task_whose_key_comes_from_its_arguments(proj: Any, celery_stack: CeleryStack) -> None:
    semaphore = semaphore_for(proj.app, "crawl:why.example")  # 2 at once (crawl:*)
    holder = semaphore.acquire(timeout=5)
    running = semaphore._try(Ask(token="why-run:x", waiter="why-run", label="box:1 proj.crawl[why-run]"))
    try:
        assert isinstance(running, Granted)
        answer = why(proj.app, "why-run", keys=["crawl:why.example"])
        assert answer["state"] == "running" and answer["slots"][0]["worker"] == "box:1 proj.crawl[why-run]"
        assert isinstance(semaphore._try(Ask(token="why-crawl:x", waiter="why-crawl", patience=30)), Waiting)
        assert why(proj.app, "why-crawl")["state"] == "unknown"
        answer = why(proj.app, "why-crawl", keys=["crawl:why.example"])
        assert answer["state"] == "waiting" and answer["keys"][0]["blocked_by"] == "limit"
        result = CliRunner().invoke(
            celery, ["-A", "tests.proj.app", "semaphore", "why", "why-crawl", "--key", "crawl:why.example", "--json"]
        )
        assert json.loads(result.stdout)["keys"][0]["position"] == 0
    finally:
        semaphore._leave("why-crawl", None, "")
        holder.release()
        if isinstance(running, Granted):
            running.lease.release()


def test_a_task_placed_at_send_is_found_by_its_parked_record_without_its_key(
    proj: Any, celery_stack: CeleryStack
) -> None:
    """A task whose key comes from its arguments, placed in line as it is sent: no result state
    yet, no --key, yet why() finds it parked in its key's line, from its parked record."""
    semaphore = semaphore_for(proj.app, "crawl:why-placed.example")  # 2 at once (crawl:*)
    holders = [semaphore.acquire(timeout=5) for _ in range(2)]
    placed = proj.crawl.apply_async(("why-placed.example", 0.1), queue="why-placed-idle")  # no worker
    try:
        answer = why(proj.app, placed.id)
        assert answer["state"] == "parked", answer
        assert answer["keys"][0]["key"] == "crawl:why-placed.example"
        assert "crawl:why-placed.example" in answer["looked_at"]
        assert answer["parked"]["record_due_in"] is not None
    finally:
        for holder in holders:
            holder.release()
        semaphore._leave(waiter_key(placed.id), None, "")
        broker = celery_stack.broker.client()
        broker.delete("why-placed-idle", "why-placed-idle.semaphore-wake")
        broker.close()


class _RoundTrips:
    """Counts what this thread sends to Redis: round trips, and commands in them. (Only this
    thread: a wake-up listener or a lease renewer an earlier test left running in the process
    sends its own, and was once counted here: 7 round trips instead of 2.)"""

    def __init__(self, patch: pytest.MonkeyPatch) -> None:
        self.round_trips = self.commands = 0
        counting = threading.get_ident()
        send: Any
        pack: Any
        pack_many: Any
        send, pack, pack_many = (
            redis.connection.Connection.send_packed_command,
            redis.connection.Connection.pack_command,
            redis.connection.Connection.pack_commands,
        )

        def counted_send(conn: Any, command: Any, check_health: bool = True) -> None:
            self.round_trips += threading.get_ident() == counting
            send(conn, command, check_health)

        def counted_pack(conn: Any, *args: Any) -> Any:
            self.commands += threading.get_ident() == counting
            return pack(conn, *args)

        def counted_pack_many(conn: Any, commands: Any) -> Any:
            self.commands += len(commands) if threading.get_ident() == counting else 0
            return pack_many(conn, commands)

        patch.setattr(redis.connection.Connection, "send_packed_command", counted_send)
        patch.setattr(redis.connection.Connection, "pack_command", counted_pack)
        patch.setattr(redis.connection.Connection, "pack_commands", counted_pack_many)


def test_an_answer_costs_the_same_with_5_or_500_waiters(proj: Any, celery_stack: CeleryStack) -> None:
    """The same round trips and commands from here, and the same commands run by the server
    (INFO commandstats of a Redis of its own), whatever the length of the line."""
    server = RedisServer().start()
    client = server.client(db=1)
    costs = []
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(proj.app.conf, "semaphore_backend_url", f"redis://127.0.0.1:{server.port}/1")
            forget_config(proj.app)
            semaphore = semaphore_for(proj.app, "proj.why_parks")
            for waiters in (5, 500):
                client.flushdb()
                semaphore.acquire(timeout=5)
                for i in range(waiters - 1):
                    semaphore._try(Ask(token=f"w{i}:x", waiter=f"w{i}", patience=60))
                semaphore._try(Ask(token="target:x", waiter="target", patience=60))
                why(proj.app, "target")  # the script loaded, the backend connected
                client.config_resetstat()
                with pytest.MonkeyPatch.context() as counting:
                    sent = _RoundTrips(counting)
                    answer = why(proj.app, "target")
                stats = command_calls(client)
                server_side = sum(n for name, n in stats.items() if name not in ("config|resetstat", "info"))
                assert answer["state"] == "waiting" and answer["keys"][0]["position"] == waiters - 1
                costs.append((sent.round_trips, sent.commands, server_side))
    finally:
        forget_config(proj.app)
        client.close()
        server.__exit__()
    print(f"why() with 5 and 500 waiters: (round trips, commands sent, commands run by the server) {costs}")
    assert costs[0] == costs[1]
    assert costs[0][0] <= 2  # the result backend, then one pipeline to the semaphore's Redis
