"""Locks that a forked process gets free, whatever a thread of its parent was doing.

A prefork Celery worker forks a new pool process whenever one exits (killed, out of memory, over
its time limit, ``worker_max_tasks_per_child``), from its main thread, while threads of its own
may be inside a lock of this package: the one that gives a killed process's slot back, the
mover of due copies. A child gets every lock as it was at the fork, and a lock held there by a
thread that does not exist in the child is held for ever. Seen in this project's tests: a hard
time limit killed a pool process; the parent's give-back thread was creating the metrics
instruments when the pool forked the replacement, which then took its first task's slot and
blocked for good on the metrics lock, under a lease its renewer kept alive.

Two kinds, by what the lock guards:

- ``reset_in_child``: a cache filled in one atomic step (a dict entry, a class swap). The child
  gets a new, free lock; at worst it builds again what the parent was building.
- ``held_over_fork``: state that a half-done critical section would leave broken in the child (a
  library's registry with a lock of its own). The fork waits for the section in progress and no
  section starts until the fork is done, so hold it only briefly and never across network I/O.
"""

from __future__ import annotations

import os
import threading


def reset_in_child() -> threading.Lock:
    """A lock that each forked child gets free, as the standard library's own locks do."""
    lock = threading.Lock()
    os.register_at_fork(after_in_child=lock._at_fork_reinit)  # type: ignore[attr-defined]
    return lock


def held_over_fork() -> threading.Lock:
    """A lock the forking thread takes before the fork and lets go of after it, in the parent
    and in the child: no section under it is ever half done in a child."""
    lock = threading.Lock()
    os.register_at_fork(before=lock.acquire, after_in_parent=lock.release, after_in_child=lock.release)
    return lock
