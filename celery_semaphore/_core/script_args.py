"""Arguments to the scripts as redis-py sends them, made once: every argument sent costs the
client a trip through redis-py's encoder, and the same few values repeat on every call."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=4096)
def number(value: int) -> bytes:
    """An int argument as redis-py would send it, made once per distinct value (limits and
    lease lengths repeat on every call)."""
    return b"%d" % value
