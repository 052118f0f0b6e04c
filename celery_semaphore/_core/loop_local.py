"""One object per (running event loop, client): what the asyncio semaphore keeps per loop.

A batch sender, a wake-up reader and their futures belong to the loop that made them; a client
may be used from several loops (one per thread, or one ``asyncio.run`` after another). Both maps
are weak, so a closed loop or a dropped client takes its objects with it.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class LoopLocal(Generic[T]):
    """``get(client)``: the running loop's object for ``client``, made by ``make`` on first use."""

    def __init__(self, make: Callable[[Any], T]) -> None:
        self._make = make
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.WeakKeyDictionary[Any, T]] = (
            weakref.WeakKeyDictionary()
        )

    def get(self, client: Any) -> T:
        loop = asyncio.get_running_loop()
        per_client = self._by_loop.get(loop)
        if per_client is None:
            per_client = self._by_loop[loop] = weakref.WeakKeyDictionary()
        made = per_client.get(client)
        if made is None:
            made = per_client[client] = self._make(client)
        return made
