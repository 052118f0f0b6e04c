"""Story 1 from a web server: an async FastAPI endpoint that calls the paid API in the same line as
the ``call_api`` task (``tasks.py``).

A web request that needs the paid API must count against the same plan as the workers: its
calls at once and its quota are the account's, not the worker's. So ``POST /reports/{i}`` holds
a slot of the very semaphore the task holds, through ``AsyncFairSemaphore``: the same key, limit,
rate and prefix (read from the Celery app with ``semaphore_for``, the way the workers see them)
on the same Redis. A request and a task that ask for the API are served first come, first served
together, and never more than ``API_LIMIT`` of them call at once. A request that waits longer
than ``WAIT_S`` is answered 503 with ``Retry-After`` instead of hanging; one the API refuses all
the same (429) pauses the key for everyone, as the task does.

Run it beside a worker (``pip install -e '.[demo]'`` brings FastAPI and uvicorn):
``uvicorn example_project.asgi:app``. ``create_app`` takes another Redis URL or API port (the
tests pass throwaway ones).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio
from fastapi import FastAPI, Response

from celery_semaphore import AsyncFairSemaphore, SemaphoreUnavailable, semaphore_for

from . import tasks, web

#: How long a request waits for a slot before it is answered 503.
WAIT_S = 10.0


def create_app(redis_url: str | None = None, api_port: int | None = None) -> FastAPI:
    """The web app; ``redis_url`` and ``api_port`` default to the Celery app's settings."""
    workers_view = semaphore_for(tasks.app, tasks.call_api.name)  # no connection: its settings only
    client = redis.asyncio.Redis.from_url(redis_url or tasks.app.conf.semaphore_backend_url)
    semaphore = AsyncFairSemaphore(
        client,
        workers_view.name,
        workers_view.limit,
        rate=workers_view.rate,
        spacing=workers_view.spacing,
        lease=workers_view.lease,
        prefix=workers_view.prefix,
        hash_tag=workers_view.hash_tag,
    )
    port = api_port or tasks.app.conf.paid_api_port

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    api = FastAPI(title="celery-semaphore demo: the paid API from a web request", lifespan=lifespan)
    api.state.semaphore = semaphore

    @api.post("/reports/{i}")
    async def post_report(i: int, response: Response) -> dict[str, Any]:
        """Call the paid API for report ``i`` holding one of its slots; its HTTP status."""
        try:
            async with semaphore.acquire(timeout=WAIT_S, label=f"web report {i}"):
                # the demo's HTTP client blocks: run it off the event loop (use an async client
                # in your copy); the slot is held until it returns
                reply = await asyncio.to_thread(web.http_post, port, f"/v1/reports/{i}", tasks.HTTP_TIMEOUT)
        except SemaphoreUnavailable:
            response.status_code = 503
            response.headers["Retry-After"] = "1"
            return {"report": i, "api_status": None, "waited_out": True}
        if reply.status == 429:
            # the account is over its plan all the same: hold every caller, tasks included
            await semaphore.pause(reply.retry_after or tasks.RETRY_AFTER)
        return {"report": i, "api_status": reply.status}

    return api


app = create_app()
