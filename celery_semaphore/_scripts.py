"""The Lua scripts of the semaphore, loaded from ``lua/`` and registered once per client.

Each operation is one script, so each costs one round trip and runs atomically: there is no
window between reading the holders and adding to them, and no lock around the semaphore.
``register_script`` computes the SHA once and reloads the script by itself after ``NOSCRIPT``
(a ``SCRIPT FLUSH`` or a restarted Redis).
"""

from __future__ import annotations

import functools
import importlib.resources
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from redis.commands.core import Script

# Scripts that change a semaphore share the helpers in _lib.lua; status writes nothing.
_WRITERS = ("acquire", "release", "renew", "leave")


@functools.cache
def script_source(name: str) -> str:
    """The full text of one script as Redis runs it (helpers included)."""
    lua = importlib.resources.files("celery_semaphore") / "lua"
    body = (lua / f"{name}.lua").read_text(encoding="utf-8")
    if name in _WRITERS:
        return (lua / "_lib.lua").read_text(encoding="utf-8") + "\n" + body
    return body


@dataclass(frozen=True)
class Scripts:
    """The registered scripts of one Redis client."""

    acquire: Script
    release: Script
    renew: Script
    leave: Script
    status: Script


_registered: weakref.WeakKeyDictionary[Any, Scripts] = weakref.WeakKeyDictionary()
_registering = threading.Lock()


def scripts_for(client: Any) -> Scripts:
    """The scripts registered on ``client``, registering them the first time it is seen."""
    try:
        return _registered[client]
    except KeyError:
        pass
    with _registering:
        if client not in _registered:
            _registered[client] = Scripts(
                **{name: client.register_script(script_source(name)) for name in (*_WRITERS, "status")}
            )
        return _registered[client]
