"""The check a granted copy of a wait makes of its run before its body starts: in the broker's
Redis, sent ahead of the result backend's question and read after it (``_celery/run_checks.py``,
``_celery/sent_ahead.py``), so that the start waits for one round trip, not two. Real Redis
servers (broker, semaphore, result backend in the broker's db 1), real kombu; no workers."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from celery import states

from celery_semaphore import SemaphoreTask
from celery_semaphore._celery.due_copies import FINISHED_KEY, send_copy
from celery_semaphore._celery.run_checks import GrantedAhead, RunInBroker
from celery_semaphore._celery.sent_ahead import SentAhead
from celery_semaphore._celery.wait_headers import WaitHistory
from tests.celery.test_due_copies import Setup, _app, _copy, servers, setup  # noqa: F401 (fixtures)
from tests.parked import stored_due
from tests.redis_server import RedisServer
from tests.waiting import wait_until


def test_the_grant_commands_run_before_their_reply_is_read(setup: Setup) -> None:  # noqa: F811
    """Sent ahead, the broker's Redis runs them while the caller asks elsewhere: the copy is
    withdrawn and the run remembered before anything is read; the answer comes after."""
    app, client = setup.app, setup.client
    send_copy(app, _copy(app, "run-a", 60))
    assert len(stored_due(client)) == 1
    with GrantedAhead(app, "run-a", at_most_once=True, remember_s=60) as asked:
        wait_until(
            lambda: len(stored_due(client)) == 0 and client.zscore(FINISHED_KEY, "run-a") is not None,
            timeout=5,
            what="the grant's commands run in the broker's Redis, their reply not read yet",
        )
        answer = asked.answer()
    assert answer == RunInBroker(finished=False, remembered=True)
    with GrantedAhead(app, "run-a", at_most_once=True, remember_s=60) as again:
        assert again.answer() == RunInBroker(finished=True, remembered=True)  # a later copy: dropped
    with GrantedAhead(app, "run-b", at_most_once=False, remember_s=60) as acks_late:
        assert acks_late.answer() == RunInBroker(finished=False, remembered=False)
    assert client.zscore(FINISHED_KEY, "run-b") is None  # with acks_late the run is remembered at its end


def test_replies_given_up_never_reach_the_next_command(setup: Setup) -> None:  # noqa: F811
    """A connection whose replies were not read is closed, not put back with them in it: the
    pool's next command reads its own reply. One read to the end goes back open, reused (the
    server names a connection by its CLIENT ID)."""
    client = setup.store.client
    with SentAhead(client, [("SET", "k", "v"), ("GET", "k")]):
        pass  # never read
    assert client.get("k") == b"v" and client.incr("n") == 1
    ids = set()
    for expected in range(2, 7):
        with SentAhead(client, [("INCR", "n"), ("CLIENT", "ID")]) as sent:
            count, connection_id = sent.replies()
        assert count == expected
        ids.add(connection_id)
    assert len(ids) == 1, ids  # read to the end: the same connection each time
    with SentAhead(client, [("CLIENT", "ID")]):
        pass  # given up: that connection is closed
    with SentAhead(client, [("CLIENT", "ID")]) as sent:
        assert sent.replies()[0] not in ids  # a new connection, not the one with a reply in it
    given_up = SentAhead(client, [("PING",)])
    given_up.close()
    with pytest.raises(RuntimeError):
        given_up.replies()


def test_an_error_reply_closes_the_connection_and_the_check_says_not_finished(setup: Setup) -> None:  # noqa: F811
    app, client = setup.app, setup.store.client
    client.set("a-string", "x")
    with SentAhead(client, [("ZSCORE", "a-string", "m"), ("PING",)]) as sent, pytest.raises(redis.ResponseError):
        sent.replies()
    assert client.ping() and client.get("a-string") == b"x"  # the unread PING reply went with it
    client.set(FINISHED_KEY, "not a sorted set")
    with GrantedAhead(app, "run-c", at_most_once=True, remember_s=60) as asked:
        assert asked.answer() == RunInBroker(finished=False, remembered=False)
    assert client.get(FINISHED_KEY) == b"not a sorted set"


class _Trace:
    """The order in which this thread sends to and reads from each Redis server (by port)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import redis.connection

        self.events: list[tuple[str, int, bytes]] = []
        here = threading.get_ident()
        send, read = (
            redis.connection.AbstractConnection.send_packed_command,
            redis.connection.AbstractConnection.read_response,
        )

        def traced_send(connection: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == here:
                head = bytes(command[0] if isinstance(command, list | tuple) else command)
                self.events.append(("send", connection.port, head[:64]))
            return send(connection, command, *args, **kwargs)

        def traced_read(connection: Any, *args: Any, **kwargs: Any) -> Any:
            reply = read(connection, *args, **kwargs)
            if threading.get_ident() == here:
                self.events.append(("read", connection.port, b""))
            return reply

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", traced_send)
        monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", traced_read)


def test_a_granted_copy_asks_the_broker_and_the_result_backend_in_one_wait(
    servers: tuple[RedisServer, RedisServer],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The task's check of a granted copy: the broker's commands go out first, the result
    backend's GET next, and the broker's reply is read only after the backend's: the two
    questions are in flight together. A success stored after the wait began says it ran."""
    broker, _ = servers
    app = _app(*servers)
    backend = RedisServer().start()
    app.conf.result_backend = backend.url

    @app.task(base=SemaphoreTask, name="run_checks_test.work", bind=True, semaphore_limit=1)
    def work(self: Any) -> None:
        raise AssertionError("never run here")

    history = WaitHistory.fresh()
    work.push_request(id="task-1", retries=0, delivery_info={})
    try:
        work.backend.get_task_meta("task-1")  # connects the backend, as a worker's first task did
        send_copy(app, _copy(app, "run-d", 60))  # connects the broker's store
        trace = _Trace(monkeypatch)
        assert not work._ran_already("run-d", history, 60.0)
        on_broker = [(i, kind) for i, (kind, port, _) in enumerate(trace.events) if port == broker.port]
        on_backend = [(i, kind) for i, (kind, port, _) in enumerate(trace.events) if port == backend.port]
        sends = [i for i, kind in on_broker if kind == "send"]
        reads = [i for i, kind in on_broker if kind == "read"]
        assert sends and reads and on_backend, trace.events
        # the broker's question is in flight through the whole of the backend's
        assert max(sends) < min(i for i, _ in on_backend) and max(i for i, _ in on_backend) < min(reads), trace.events
        monkeypatch.undo()
        work.backend.store_result("task-1", None, states.SUCCESS)
        assert work._ran_already("run-e", history, 60.0)  # its success is newer than the wait
    finally:
        work.pop_request()
        backend.__exit__()
