"""Checks that turn bad input into a ConfigurationError naming the setting and the value.

Shared by the semaphore (arguments) and the Celery layer (task options and settings), so that
the same mistake reads the same wherever it is made.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigurationError
from .storage import OFFER_MARK, WEIGHT_MARK, ends_in_weight_mark


def check_limit(setting: str, value: Any) -> int:
    """A limit is a whole number of slots, at least one; a bool is a mistake, not a 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(setting, value, "a limit must be an int of at least 1")
    if value < 1:
        raise ConfigurationError(setting, value, "a limit must be at least 1")
    return value


def check_seconds(setting: str, value: Any, *, allow_zero: bool = False) -> float:
    """A duration in seconds: a finite real number above zero (or zero where allowed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(setting, value, "expected a number of seconds")
    seconds = float(value)
    if not math.isfinite(seconds):
        raise ConfigurationError(setting, value, "expected a finite number of seconds")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        bound = "at least 0" if allow_zero else "above 0"
        raise ConfigurationError(setting, value, f"seconds must be {bound}")
    return seconds


# The most a priority moves a call: urgent work goes first, and low-priority work waits at most
# this much longer than it would have (see ``priority_ms``).
PRIORITY_CAP = 600.0


def priority_ms(setting: str, value: Any) -> int:
    """A priority in seconds (a call is placed as if it had asked that much earlier; negative:
    later), capped at +-600 s, as whole milliseconds for the acquire script."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigurationError(setting, value, "expected a number of seconds (at most 600 either way)")
    return round(max(-PRIORITY_CAP, min(PRIORITY_CAP, float(value))) * 1000)


# What a new waiter that finds its line full does: refused ("reject"), or the oldest waiter
# dropped to make room ("drop_oldest"), or, per coalesce key, the older waiter replaced
# ("keep_latest"; a full line with none to replace rejects).
FULL_LINE_POLICIES = ("reject", "drop_oldest", "keep_latest")


def check_on_full(setting: str, value: Any, max_waiters: int | None) -> str:
    """A full-line policy; "reject" and "drop_oldest" need a max_waiters to act on."""
    if value not in FULL_LINE_POLICIES:
        raise ConfigurationError(setting, value, f"expected one of {', '.join(map(repr, FULL_LINE_POLICIES))}")
    if value == "drop_oldest" and max_waiters is None:
        raise ConfigurationError(setting, value, "needs max_waiters: the number of waiters that makes a line full")
    return str(value)


def check_name(setting: str, value: Any) -> str:
    """A semaphore name or key: a non-empty string."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(setting, value, "expected a non-empty string")
    return value


def check_semaphore_name(setting: str, value: Any) -> str:
    """A semaphore's name is its keys' Redis Cluster hash tag, ``{<name>}``. One that starts with
    ``}`` makes the empty tag ``{}``, which Redis ignores: the keys would hash whole, land in
    different slots, and every script on a cluster would fail. (Braces elsewhere are fine: the
    tag ends at the first ``}``, the same for all the semaphore's keys.)"""
    check_name(setting, value)
    if value.startswith("}"):
        raise ConfigurationError(setting, value, "a semaphore name must not start with '}' (an empty hash tag)")
    return str(value)


def check_prefix(setting: str, value: Any) -> str:
    """A key prefix must not contain braces: the hash tag that keeps one semaphore's keys in one
    Redis Cluster slot is the first ``{...}`` of each key, and it must be the semaphore's name."""
    check_name(setting, value)
    if "{" in value or "}" in value:
        raise ConfigurationError(setting, value, "a key prefix must not contain '{' or '}'")
    return str(value)


def to_ms(seconds: float) -> int:
    """Seconds (the public unit) to whole milliseconds (the unit of the Lua scripts): the one
    place where the two meet. Rounds up so a lease is never shorter than asked."""
    return max(1, math.ceil(seconds * 1000))


def check_token(setting: str, value: Any) -> str:
    """A holder token: a non-empty string not starting with "!", which marks a slot offered to a
    waiter in the holders set (a token like that could claim somebody else's offer), and not
    ending in "*<digits>", which marks a weighted holder's slots."""
    check_name(setting, value)
    if value.startswith(OFFER_MARK):
        raise ConfigurationError(setting, value, "a holder token must not start with '!'")
    if ends_in_weight_mark(value):
        raise ConfigurationError(setting, value, "a holder token must not end in '*<digits>'")
    return str(value)


def check_waiter(setting: str, value: Any) -> str:
    """A waiter id: a non-empty string not starting with "*", which marks a waiter of several
    semaphores with its weight (``*<w>*<id>``): a plain waiter like that would never be offered
    a slot, and would hold up the line behind it for as long as it asked."""
    check_name(setting, value)
    if value.startswith(WEIGHT_MARK):
        raise ConfigurationError(setting, value, "a waiter id must not start with '*'")
    return str(value)
