"""Counts concurrent holders in Redis, independently of the semaphore under test.

Entering increments a counter and raises a high-water mark in one script; leaving decrements.
The high-water mark is the true maximum of concurrent holders, whatever the semaphore believes.
"""

from __future__ import annotations

import redis

_ENTER = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
redis.call('INCR', KEYS[3])
return n
"""


class ConcurrencyProbe:
    def __init__(self, client: redis.Redis, name: str = "probe") -> None:
        self.client = client
        self.keys = [f"{name}:live", f"{name}:max", f"{name}:entries"]
        self._enter = client.register_script(_ENTER)

    def enter(self) -> int:
        return int(self._enter(keys=self.keys))

    def leave(self) -> None:
        self.client.decr(self.keys[0])

    @property
    def maximum(self) -> int:
        return int(self.client.get(self.keys[1]) or 0)

    @property
    def entries(self) -> int:
        return int(self.client.get(self.keys[2]) or 0)

    @property
    def live(self) -> int:
        return int(self.client.get(self.keys[0]) or 0)
