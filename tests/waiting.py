"""Waiting on conditions with a deadline, instead of sleeping and hoping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.01, what: str = "") -> T:
    """Return the first truthy value of ``condition()``; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(interval)
