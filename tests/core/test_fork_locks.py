"""Locks a forked child gets free: a prefork worker forks a new pool process from its main thread
while a thread of its own may hold one of the package's locks (fork_locks.py).

Each test forks a real child with a thread of the parent inside the lock, and the child reports
through its exit code whether it could take the lock within a second.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from celery_semaphore import metrics
from celery_semaphore._celery import due_copies, outages, parked_scripts, wake_queues
from celery_semaphore._core import clients, fork_locks, scripts


@contextmanager
def held_by_a_thread(lock: Any, seconds: float = 0.3, during: Callable[[], None] = lambda: None) -> Iterator[None]:
    """A thread of this process holds ``lock`` for ``seconds`` (calling ``during`` inside);
    the block runs once the lock is held."""
    taken = threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            time.sleep(seconds)  # the section the fork lands in; not a wait for a race
            during()

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(5)
    try:
        yield
    finally:
        thread.join(10)


def fork_and_report(child: Callable[[], bool]) -> bool:
    """Fork; the child runs ``child`` and exits 0 if it returned True, 1 otherwise."""
    pid = os.fork()
    if pid == 0:
        try:
            ok = child()
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def takes_within_a_second(lock: Any) -> Callable[[], bool]:
    def child() -> bool:
        taken = bool(lock.acquire(timeout=1))
        if taken:
            lock.release()
        return taken

    return child


def test_a_lock_reset_in_the_child_is_free_there_though_a_parent_thread_holds_it() -> None:
    lock = fork_locks.reset_in_child()
    with held_by_a_thread(lock):
        assert fork_and_report(takes_within_a_second(lock))
        assert lock.locked(), "the parent's thread still holds it in the parent"


def test_a_plain_lock_held_by_a_parent_thread_stays_held_in_the_child() -> None:
    """The hazard itself, so the tests above and below show a difference: without the reset the
    child's lock is held for ever."""
    lock = threading.Lock()
    with held_by_a_thread(lock):
        assert not fork_and_report(takes_within_a_second(lock))


def test_a_lock_held_over_fork_lets_the_section_in_progress_finish_first() -> None:
    """The fork waits for the section: the child sees its whole effect, and the lock free."""
    lock = fork_locks.held_over_fork()
    state: list[str] = []
    with held_by_a_thread(lock, during=lambda: state.extend(["first half", "second half"])):
        assert fork_and_report(lambda: takes_within_a_second(lock)() and state == ["first half", "second half"])
    assert not lock.locked()


@pytest.mark.parametrize(
    ("where", "lock"),
    [
        ("clients", lambda: clients._lock),
        ("scripts", lambda: scripts._registering),
        ("parked_scripts", lambda: parked_scripts._registering),
        ("wake_queues", lambda: wake_queues._lock),
        ("due_copies", lambda: due_copies._lock),
        ("outages", lambda: outages.outages._lock),
        ("metrics", lambda: metrics._lock),
    ],
)
def test_every_lock_a_worker_thread_shares_with_its_pool_is_free_in_a_forked_child(
    where: str, lock: Callable[[], Any]
) -> None:
    """The locks a worker's parent takes from its threads (giving a killed process's slot back,
    moving due copies) and its pool processes take too."""
    the_lock = lock()
    with held_by_a_thread(the_lock, seconds=0.1 if where == "metrics" else 0.3):
        assert fork_and_report(takes_within_a_second(the_lock)), where
