"""Child processes of the demo, and the signal handling that guarantees none outlives it.

The demo starts a ``redis-server`` and two ``celery worker`` process trees. A demo that leaves
those behind after Ctrl-C (or after an error) is worse than no demo, so:

* a SIGINT/SIGTERM/SIGHUP is only recorded by its handler, and acted on where the demo checks
  for it (:meth:`SignalGuard.check`), so it can never strike between ``Popen`` starting a child
  and the demo storing its handle: every child is known to the cleanup;
* each worker gets its own process group (and session), so Ctrl-C in the terminal reaches only
  the orchestrator, which then stops the workers in order, and SIGKILL of the group after a
  deadline reaches the pool processes too;
* during cleanup a further signal does not abort the cleanup: it only makes it hurry (skip
  straight to SIGKILL).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A signal asked the demo to stop. A BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalGuard:
    """Records SIGINT/SIGTERM/SIGHUP; :meth:`check` turns a recorded signal into
    :class:`Interrupted` at a point where the demo can stop cleanly.

    The handler itself never raises: an exception raised from a signal handler lands wherever
    the main thread happens to be, e.g. inside a ``__del__`` (where Python swallows it) or
    between ``Popen`` creating a child and the demo storing its handle (which would leak the
    child). The demo calls :meth:`check` at least every fraction of a second while it runs,
    so a signal still stops it promptly. During cleanup a signal only sets :attr:`hurry`.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.hurry = False
        self.cleaning = False
        self._saved: dict[int, Any] = {}

    def install(self) -> None:
        for signum in HANDLED_SIGNALS:
            self._saved[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self.cleaning:
            self.hurry = True

    def check(self) -> None:
        """Raise Interrupted if a signal arrived (and the cleanup has not begun)."""
        if self.received is not None and not self.cleaning:
            raise Interrupted(self.received)

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` that checks for a signal before and after."""
        self.check()
        time.sleep(seconds)
        self.check()

    def start_cleanup(self) -> None:
        """From here on, signals only hurry the cleanup along."""
        self.cleaning = True
        if self.received is not None:
            self.hurry = True


guard = SignalGuard()


def wait_exit(process: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` for the process to exit (sooner if the cleanup must hurry)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        if time.monotonic() > deadline or guard.hurry:
            return False
        time.sleep(0.05)
    return True


def kill_group(pgid: int) -> None:
    """SIGKILL every process of a group that we created; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


class WorkerProcess:
    """One ``celery worker`` (prefork) started by this process, in its own process group."""

    def __init__(self, name: str, *, app: str, queue: str, concurrency: int, env: dict[str, str], log_dir: Path):
        self.name = name
        self.app = app
        self.queue = queue
        self.concurrency = concurrency
        self.env = env
        self.logfile = log_dir / f"{name}.log"
        self.output = log_dir / f"{name}.out"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            self.app,
            "worker",
            "-P",
            "prefork",
            "-c",
            str(self.concurrency),
            "-n",
            f"{self.name}@%h",
            "-Q",
            self.queue,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel",
            "INFO",
            "--logfile",
            str(self.logfile),
        ]
        with self.output.open("wb") as output:
            self.process = subprocess.Popen(
                command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def log_tail(self, lines: int = 15) -> str:
        text = ""
        for path in (self.logfile, self.output):
            with contextlib.suppress(OSError):
                text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def request_stop(self) -> None:
        """Warm shutdown: the worker finishes what it runs, then exits with its pool."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def finish_stop(self, timeout: float) -> None:
        """Wait for the warm shutdown up to ``timeout``, then SIGKILL the whole group. The group
        is killed in any case: a pool process must not outlive its worker."""
        process = self.process
        if process is None:
            return
        wait_exit(process, timeout)
        kill_group(process.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
