"""PoolRoom: a task may wait in-process only while another process (or thread) of its worker is
free. The worker test (test_stranded_waiters -k pool_process_free) shows the effect with real
workers; these pin the bookkeeping, forked processes included."""

from __future__ import annotations

from billiard.process import current_process

from celery_semaphore._celery.pool_room import PoolRoom


def test_outside_a_worker_there_is_always_room() -> None:
    assert PoolRoom().leaves_one_free()


def test_a_thread_pool_counts_its_busy_tasks() -> None:
    room = PoolRoom()
    room.prepare(2, prefork=False)
    with room.busy():
        assert room.leaves_one_free()  # one of two busy: the other is free
        with room.busy():
            assert not room.leaves_one_free()
        assert room.leaves_one_free()


def test_pool_processes_keep_one_flag_each_by_index() -> None:
    """A prefork worker's processes share the flags (mapped before the fork; the worker test
    shows it across real pool processes). Flags follow the process index, so the process that
    replaces a killed one clears the flag the killed one left set."""
    room = PoolRoom()
    room.prepare(2, prefork=True)
    process = current_process()
    try:
        process.index = 0
        stuck = room.busy()
        stuck.__enter__()  # pool process 0 is killed mid-task: its flag stays set
        process.index = 1
        with room.busy():
            assert not room.leaves_one_free()
        assert list(room._flags) == [1, 0]
        process.index = 0  # its replacement runs a task: the flag is its own again
        with room.busy():
            pass
        assert list(room._flags) == [0, 0]
    finally:
        del process.index
