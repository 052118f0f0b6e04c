"""Real `celery worker` processes for the integration tests.

Each worker is a separate process group started here with the test app (tests/proj/app.py),
configured through environment variables, and stopped by the PID this module started: warm
shutdown with SIGTERM, or SIGKILL of the parent and its pool children to play a crash.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent

# every worker this process started, so none outlives the test run whatever a test does
_started: list[Worker] = []


@atexit.register
def _kill_leftovers() -> None:
    for worker in _started:
        worker.kill()


class Worker:
    def __init__(
        self,
        env: dict[str, str],
        *,
        name: str,
        concurrency: int = 4,
        pool: str = "prefork",
        conf: dict[str, Any] | None = None,
        app: str = "tests.proj.app",
    ) -> None:
        self.env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        if conf is not None:
            merged = {**json.loads(env.get("PROJ_CONF", "{}")), **conf}
            self.env["PROJ_CONF"] = json.dumps(merged)
        self.name = name
        self.concurrency = concurrency
        self.pool = pool
        self.app = app
        self.logfile = Path(tempfile.mkdtemp(prefix="celery-semaphore-worker-")) / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *, wait_ready: bool = True) -> Worker:
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            self.app,
            "worker",
            "-P",
            self.pool,
            "-c",
            str(self.concurrency),
            "-n",
            f"{self.name}@127.0.0.1",
            "-Q",
            self.env.get("PROJ_QUEUE", "celery"),
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel",
            "INFO",
            "--logfile",
            str(self.logfile),
        ]
        self.output = self.logfile.with_suffix(".out")
        with self.output.open("wb") as output:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
            )
        _started.append(self)
        if wait_ready:
            wait_until(self._ready_or_dead, timeout=60, interval=0.05, what=f"worker {self.name} ready")
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited at start:\n{self.log()}")
        return self

    def _ready_or_dead(self) -> bool:
        return " ready." in self.log() or (self.process is not None and self.process.poll() is not None)

    def log(self) -> str:
        """What the worker logged, then what it printed (start-up errors go there)."""
        text = ""
        for path in (self.logfile, self.logfile.with_suffix(".out")):
            with contextlib.suppress(FileNotFoundError):
                text += path.read_text(errors="replace")
        return text

    def wait_exit(self, timeout: float = 60) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def children(self) -> list[int]:
        """PIDs of the pool processes (children of the worker process this module started)."""
        if self.process is None:
            return []
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        try:
            return [int(pid) for pid in path.read_text().split()]
        except FileNotFoundError:
            return []

    def stop(self, timeout: float = 30) -> None:
        """Warm shutdown: running tasks finish, then the worker exits."""
        if self.process is None or self.process.poll() is not None:
            return
        os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the worker and its pool children at once: a crash, no cleanup runs."""
        if self.process is None or self.process.poll() is not None:
            return
        for pid in [self.process.pid, *self.children()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=30)


@contextlib.contextmanager
def worker_group(
    env: dict[str, str],
    *,
    queue: str,
    names: Sequence[str],
    concurrency: int = 4,
    conf: dict[str, Any] | None = None,
    kill_at_end: bool = False,
) -> Iterator[list[Worker]]:
    """Workers of the test app consuming ``queue``, started together and stopped at the end (warm,
    or killed): those in the list then, so a test may add the workers it started meanwhile."""
    group = [Worker({**env, "PROJ_QUEUE": queue}, name=name, concurrency=concurrency, conf=conf) for name in names]
    try:
        for worker in group:
            worker.start()
        yield group
    finally:
        for worker in group:
            if kill_at_end:
                worker.kill()
            else:
                worker.stop()
