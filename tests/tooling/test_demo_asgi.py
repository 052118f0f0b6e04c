"""The demo's FastAPI endpoint (example_project/asgi.py) served by uvicorn on loopback, against a
throwaway Redis and the demo's paid-API stand-in: a web request stands in the task's line."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from celery_semaphore import FairSemaphore, semaphore_for

from ..redis_server import LOOPBACK, RedisServer
from ..waiting import wait_until

pytest.importorskip("fastapi", reason="the web example needs the demo extra: pip install -e '.[demo]'")
uvicorn = pytest.importorskip("uvicorn", reason="the web example needs the demo extra: pip install -e '.[demo]'")

from example_project import asgi, tasks, web  # noqa: E402
from example_project.demo.servers import PaidApiServer  # noqa: E402


@pytest.fixture
def paid_api() -> Iterator[PaidApiServer]:
    server = PaidApiServer(tasks.API_LIMIT, 0.0, quota=tasks.API_QUOTA)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def web_port(redis_server: RedisServer, paid_api: PaidApiServer) -> Iterator[int]:
    """The endpoint served by uvicorn on a free loopback port, until the test ends."""
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    config = uvicorn.Config(
        asgi.create_app(f"redis://{LOOPBACK}:{redis_server.port}/0", paid_api.port), log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="uvicorn serving")
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_the_endpoint_uses_the_workers_key_limit_and_rate() -> None:
    endpoint = asgi.create_app("redis://127.0.0.1:1/0", 1).state.semaphore
    workers_view = semaphore_for(tasks.app, tasks.call_api.name)
    assert (endpoint.keys, endpoint.rules) == (workers_view.keys, workers_view.rules)


def test_a_web_request_and_blocking_callers_share_one_line(
    redis_server: RedisServer, paid_api: PaidApiServer, web_port: int
) -> None:
    """Every slot held by blocking callers (a worker's view); a blocking caller joins the line,
    then a web request. A freed slot goes to the blocking caller, the next to the request, which
    only then calls the API."""
    blocking = FairSemaphore(redis_server.client(), tasks.call_api.name, tasks.API_LIMIT, rate=tasks.API_QUOTA)
    held = [blocking.acquire() for _ in range(tasks.API_LIMIT)]
    replies: dict[str, object] = {}

    def first_in_line() -> None:
        replies["blocking"] = blocking.acquire(timeout=30)

    def request() -> None:
        replies["web"] = web.http_post(web_port, "/reports/7", timeout=30)

    threads = [threading.Thread(target=first_in_line)]
    threads[0].start()
    wait_until(lambda: blocking.status().waiter_count == 1, what="the blocking caller in line")
    threads.append(threading.Thread(target=request))
    threads[1].start()
    wait_until(lambda: blocking.status().waiter_count == 2, what="the web request in line")
    assert paid_api.stats()["requests"] == 0

    held.pop().release()
    wait_until(lambda: "blocking" in replies, what="the blocking caller's slot")
    assert blocking.status().waiter_count == 1 and "web" not in replies  # still in line: no slot
    held.pop().release()
    wait_until(lambda: "web" in replies, what="the web request's answer")
    reply = replies["web"]
    assert isinstance(reply, web.Reply) and reply.status == 200
    assert json.loads(reply.body) == {"report": 7, "api_status": 200}
    stats = paid_api.stats()
    assert stats["requests"] == 1 and stats["rejected"] == 0
    wait_until(lambda: blocking.status().holder_count == tasks.API_LIMIT - 1, what="the request's slot back")
    for thread in threads:
        thread.join(10)
    for lease in [*held, replies["blocking"]]:
        lease.release()  # type: ignore[attr-defined]
