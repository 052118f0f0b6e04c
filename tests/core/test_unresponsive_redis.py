"""A Redis that stops answering (SIGSTOP: the process is there, its sockets accept, nothing
replies) while a lease is held: callers fail closed within about the socket timeout instead of
hanging, the renewer logs the lease it cannot keep as lost at its deadline, and a URL's
``socket_timeout`` reaches every connection the package's clients make.

Every test stops a server of its own and sends it SIGCONT in a ``finally`` (``stopped``); the
``own_redis`` fixture then stops it for good. A call that might hang runs in a thread joined with
a deadline (``ends_within``), so a regression fails the test rather than hanging the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_semaphore import FairSemaphore, RedisUnavailable
from celery_semaphore._core import clients as _clients
from celery_semaphore._core.clients import client_for
from celery_semaphore._core.urls import parse_backend_url
from celery_semaphore.errors import ConfigurationError

from ..redis_server import RedisServer
from ..waiting import wait_until

TIMEOUT = 0.5  # the socket timeout the tests give their clients: small, so the tests are fast
# "within about the timeout": one timed-out command, plus the line bookkeeping an acquire does
# on its way out (one more timed-out command), plus scheduling slack
WITHIN = 4 * TIMEOUT + 1.0


@contextlib.contextmanager
def stopped(server: RedisServer) -> Iterator[None]:
    """``server`` stopped with SIGSTOP inside the block, and always continued after it."""
    pid = server.pid
    assert pid is not None, "the server is not running"
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def ends_within(seconds: float, call: Callable[[], Any]) -> tuple[float, BaseException | None]:
    """Run ``call`` in a thread; how long it took and what it raised. Fails the test if it has
    not ended within ``seconds`` (the thread is left to end when the server is continued)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            call()
        except BaseException as error:  # reported to the test
            outcome["error"] = error
        outcome["took"] = time.monotonic() - started

    thread = threading.Thread(target=run, name="call-under-test", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"the call hung: still running after {seconds} s")
    return outcome["took"], outcome.get("error")


def a_name() -> str:
    return f"stopped-{uuid.uuid4().hex[:8]}"


# --- (a) callers fail closed, by default ---------------------------------------------------


def test_acquire_fails_closed_within_the_default_timeout_when_redis_stops_answering(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL with no timeout options gets the package's default socket timeout (made small here,
    to be fast): with a lease held and the server stopped, try_acquire and acquire raise
    RedisUnavailable (which the Celery layer treats as "wait") within about that timeout, and
    the held lease's release does too, rather than hanging."""
    monkeypatch.setattr(_clients, "SOCKET_TIMEOUT", TIMEOUT, raising=False)  # (absent: the test fails on the time)
    client = client_for(own_redis.url)
    semaphore = FairSemaphore(client, a_name(), 2, lease=30)
    held = semaphore.acquire(timeout=5)
    with stopped(own_redis):
        took, error = ends_within(10 * WITHIN, semaphore.try_acquire)
        assert isinstance(error, RedisUnavailable), error
        assert took < WITHIN
        took, error = ends_within(10 * WITHIN, lambda: semaphore.acquire(timeout=30))
        assert isinstance(error, RedisUnavailable), error  # not SemaphoreUnavailable after 30 s
        assert took < WITHIN
        took, error = ends_within(10 * WITHIN, held.release)
        assert isinstance(error, RedisUnavailable), error
        assert took < WITHIN


# --- (b) the renewer --------------------------------------------------------------------------


def _lost_lines(caplog: pytest.LogCaptureFixture, token: str) -> list[logging.LogRecord]:
    return [
        record for record in caplog.records
        if record.levelno >= logging.WARNING and token in record.getMessage() and "is lost" in record.getMessage()
    ]  # fmt: skip


@pytest.mark.parametrize("client_timeout", ["url", "none"])
def test_the_renewer_logs_a_lease_it_cannot_keep_as_lost_at_its_deadline(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture, client_timeout: str
) -> None:
    """With the server stopped, no renewal gets through: once the lease's deadline passes the
    lease is marked lost and an error names the semaphore and the holder (token and label), with
    why. That holds with a client whose calls time out ("url") and with one handed in without
    any timeout ("none"), whose renewal call hangs until the server is continued: the renewer
    thread is stuck in it, and the deadline is still kept. Once the server answers again, the
    next renewal gets through and the lease is no longer lost."""
    caplog.set_level(logging.WARNING, logger="celery_semaphore")
    if client_timeout == "url":
        client: Any = client_for(f"{own_redis.url}?socket_timeout={TIMEOUT}")
    else:
        client = own_redis.client(socket_timeout=None, socket_connect_timeout=None)
    name = a_name()
    lease_s = 1.5
    semaphore = FairSemaphore(client, name, 1, lease=lease_s)
    lease = semaphore.acquire(timeout=5, label="holder-7")
    try:
        with stopped(own_redis):
            records = wait_until(
                lambda: _lost_lines(caplog, lease.token), timeout=lease_s + 10, what="the lost lease logged"
            )
            assert time.monotonic() >= lease.acquired_at + lease_s  # at its deadline, not before
            assert lease.lost
            message = records[0].getMessage()
            assert name in message and "holder-7" in message, message
            assert records[0].levelno == logging.ERROR
            assert len(_lost_lines(caplog, lease.token)) == 1  # logged once, not at every retry
        wait_until(lambda: not lease.lost, timeout=10, what="the lease kept again once Redis answers")
    finally:
        with contextlib.suppress(RedisUnavailable):
            lease.release()
        if client_timeout == "none":
            client.close()


# --- (c) a URL's socket_timeout reaches every connection ---------------------------------------


def test_a_url_socket_timeout_is_used_by_the_data_connection(own_redis: RedisServer) -> None:
    """``?socket_timeout=0.5``: a command to the stopped server times out after about 0.5 s
    (the package's default is ten times longer)."""
    client = client_for(f"{own_redis.url}?socket_timeout={TIMEOUT}")
    client.ping()
    with stopped(own_redis):
        took, error = ends_within(10 * WITHIN, client.ping)
    assert isinstance(error, redis.TimeoutError), error
    assert TIMEOUT * 0.8 < took < WITHIN


@pytest.mark.parametrize("query", [f"socket_timeout={TIMEOUT}", f"sentinel_socket_timeout={TIMEOUT}"])
def test_a_url_socket_timeout_is_used_by_the_sentinel_connections(own_redis: RedisServer, query: str) -> None:
    """A redis+sentinel:// URL whose only Sentinel has stopped answering (a plain server stands
    in for it: stopped, it is as silent as a stopped Sentinel): the Sentinel connections take
    the URL's ``socket_timeout`` (or its ``sentinel_socket_timeout``), and are not retried, so
    the first command fails closed within about that timeout. (redis-py would otherwise give
    the Sentinel connections no timeout before version 8, and 11 tries of 5 s from 8 on.)"""
    client = client_for(f"redis+sentinel://127.0.0.1:{own_redis.port}/mymaster?{query}")
    semaphore = FairSemaphore(client, a_name(), 1, lease=30)
    with stopped(own_redis):
        took, error = ends_within(30 * WITHIN, semaphore.try_acquire)
    assert isinstance(error, RedisUnavailable), error
    assert took < WITHIN


@pytest.mark.parametrize("kind", ["redis", "unix", "sentinel"])
def test_every_client_has_timeouts_by_default_and_the_url_overrides_them(own_redis: RedisServer, kind: str) -> None:
    """The package passes its timeouts to redis-py itself (not relying on redis-py's defaults,
    which are none before version 8), and a URL's options override them, for the data
    connections and the Sentinel connections alike."""

    def url(query: str) -> str:
        if kind == "redis":
            return f"redis://127.0.0.1:{own_redis.port}/0{query}"
        if kind == "unix":
            return f"unix:///tmp/no-such-{uuid.uuid4().hex[:8]}.sock{query}"
        return f"redis+sentinel://127.0.0.1:{own_redis.port}/mymaster{query}"

    def timeouts(client: Any) -> list[tuple[Any, Any]]:
        pools = [client.connection_pool]
        if kind == "sentinel":
            pools += [sentinel.connection_pool for sentinel in client.connection_pool.sentinel_manager.sentinels]
        return [
            (pool.connection_kwargs.get("socket_timeout"), pool.connection_kwargs.get("socket_connect_timeout"))
            for pool in pools
        ]

    defaults = (_clients.SOCKET_TIMEOUT, _clients.SOCKET_CONNECT_TIMEOUT)
    assert set(timeouts(client_for(url("")))) == {defaults}
    assert set(timeouts(client_for(url("?socket_timeout=0.5&socket_connect_timeout=0.25")))) == {(0.5, 0.25)}
    assert set(timeouts(client_for(url("?socket_timeout=0.75")))) == {(0.75, _clients.SOCKET_CONNECT_TIMEOUT)}


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cr3t@127.0.0.1/0?socket_timeout=0",
        "redis://:s3cr3t@127.0.0.1/0?socket_timeout=-1",
        "redis://:s3cr3t@127.0.0.1/0?socket_connect_timeout=nan",
        "redis://:s3cr3t@127.0.0.1/0?socket_timeout=inf",
        "redis://:s3cr3t@127.0.0.1/0?socket_timeout=soon",
        "unix://:s3cr3t@/run/redis.sock?socket_timeout=0",
        "redis+cluster://:s3cr3t@127.0.0.1:7000?socket_connect_timeout=-0.5",
        "rediss+cluster://:s3cr3t@127.0.0.1:7000?socket_timeout=0",
        "redis+sentinel://:s3cr3t@127.0.0.1/m?socket_timeout=0",
        "redis+sentinel://:s3cr3t@127.0.0.1/m?sentinel_socket_timeout=-2",
        "redis+sentinel://:s3cr3t@127.0.0.1/m?sentinel_socket_connect_timeout=0",
    ],
)
def test_a_timeout_that_cannot_work_is_a_configuration_error(url: str) -> None:
    """0 (a non-blocking socket), a negative number, nan or inf would only fail at the first
    command, or wait for ever: each is refused when the URL is checked, naming the setting,
    the option, and never the password."""
    with pytest.raises(ConfigurationError) as caught:
        parse_backend_url("semaphore_backend_url", url)
    error = caught.value
    assert error.setting == "semaphore_backend_url"
    assert "timeout" in error.reason
    assert "s3cr3t" not in str(error) and "s3cr3t" not in repr(error.args)


# --- the wake-up listener with a socket timeout -----------------------------------------------


def test_an_idle_wake_up_listener_outlives_its_socket_timeout(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The listener's pub/sub connection has the client's socket timeout (0.2 s here), far
    shorter than the listener's wait for a message (5 s): a channel idle for many socket timeouts
    breaks nothing (the listener waits for data with select, and reads only what has arrived),
    and the wake-up then comes at once, not at the waiter's next keep-alive ask."""
    caplog.set_level(logging.WARNING, logger="celery_semaphore")
    client = client_for(f"{own_redis.url}?socket_timeout=0.2")
    semaphore = FairSemaphore(client, a_name(), 1, lease=30, patience=60)  # keep-alive asks every 20 s
    holder = semaphore.acquire(timeout=5)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(semaphore.acquire(timeout=30)), daemon=True)
    waiter.start()
    wait_until(lambda: semaphore.status().waiter_count == 1, timeout=5, what="the waiter in line")
    idle = 10 * 0.2  # the channel stays idle for ten socket timeouts: that is the test
    time.sleep(idle)
    released_at = time.monotonic()
    holder.release()
    waiter.join(10)
    assert got, "the waiter was not granted the slot"
    assert time.monotonic() - released_at < 2.0  # woken, not found by a keep-alive ask 20 s later
    got[0].release()
    assert not [record for record in caplog.records if "wake-up" in record.getMessage()]
