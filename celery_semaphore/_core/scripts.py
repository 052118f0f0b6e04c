"""The Lua scripts of the semaphore: loaded from ``lua/``, registered once per client, and
called through typed wrappers.

Each operation is one script, so each costs one round trip and runs atomically: there is no
window between reading the holders and adding to them, and no lock around the semaphore.
``Script`` computes the SHA once and loads the script again by itself after ``NOSCRIPT`` (a
``SCRIPT FLUSH``, a restarted Redis, a promoted replica).

The contract of each script (its KEYS, its ARGV, its reply) is written once in the header of its
``.lua`` file and once in Python, as a function with keyword-only arguments and a named result
(here, or for the scripts the asyncio semaphores run too, in ``script_calls`` and
``script_calls_many``): a call site cannot pass two arguments in the wrong order, and nobody
unpacks a reply by position outside these modules. Milliseconds appear there and in Lua only;
callers speak seconds (see validation.to_ms). The codes in the replies, and the marks inside
what the scripts store, are ``storage``'s.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError, ResponseError

from . import fork_locks
from . import script_calls as calls
from . import script_calls_many as calls_many
from .script_calls import ScriptCall
from .storage import wake_address

R = TypeVar("R")
P = ParamSpec("P")

_NAMES = (
    "acquire",
    "release",
    "renew",
    "leave",
    "status",
    "set_limit",
    "reset",
    "acquire_many",
    "release_many",
    "renew_many",
    "leave_many",
    "set_gate",
)


# The package whose lua/ folder holds the library every script is built on, and the semaphore's scripts.
_LIBRARY = __name__.rpartition(".")[0]

# In lua/_lib.lua, the line that ends the helpers of the uncontended paths; in a script, where
# the rest of the helpers go (after its fast path). See the head of lua/_lib.lua.
REST_OF_LIB = "-- @rest-of-lib\n"


@functools.cache
def built_script(package: str, name: str) -> str:
    """The full text of script ``name`` of ``package``'s ``lua/`` folder as Redis runs it: this
    library's shared helpers (``lua/_lib.lua``, with ``lua/_tenants.lua`` at the head of its
    rest), then its body. The helpers after ``REST_OF_LIB``
    go where the body has that line, else in front of it. A package that drives the semaphore's
    keys with scripts of its own builds them here, on the same key schema and storage format."""
    library = importlib.resources.files(_LIBRARY) / "lua"
    first, rest = (library / "_lib.lua").read_text(encoding="utf-8").split(REST_OF_LIB)
    rest = (library / "_tenants.lua").read_text(encoding="utf-8") + "\n" + rest
    body = (importlib.resources.files(package) / "lua" / f"{name}.lua").read_text(encoding="utf-8")
    if REST_OF_LIB in body:
        return first + "\n" + body.replace(REST_OF_LIB, REST_OF_LIB + rest)
    return first + REST_OF_LIB + rest + "\n" + body


def script_source(name: str) -> str:
    """The full text of one of the semaphore's own scripts as Redis runs it."""
    return built_script(_LIBRARY, name)


@dataclass(frozen=True)
class SemaphoreKeys:
    """The Redis keys of one semaphore, in the KEYS order every script expects (lua/_lib.lua).

    All share the hash tag ``{<name>}``, so a script touching them all runs on one cluster slot;
    the wake-up channels live under the same tag (see ``wake_address``).
    """

    holders: str
    holder_info: str
    queue: str
    present: str
    deadlines: str
    waiter_info: str
    ticket: str
    limit: str
    starts: str
    gate: str
    runs: str
    run_expiry: str
    tenants: str
    shares: str
    evicted: str
    base: str  # "{prefix}:{<name>}", the common start of every key and channel (not a key)

    @classmethod
    def of(cls, prefix: str, name: str, hash_tag: str | None = None) -> SemaphoreKeys:
        # with a hash tag, semaphores of one family share a cluster slot: "{prefix}:{<tag>}:<name>"
        base = f"{prefix}:{{{name}}}" if hash_tag is None else f"{prefix}:{{{hash_tag}}}:{name}"
        return cls(
            holders=f"{base}:holders",
            holder_info=f"{base}:holder_info",
            queue=f"{base}:queue",
            present=f"{base}:present",
            deadlines=f"{base}:deadlines",
            waiter_info=f"{base}:waiter_info",
            ticket=f"{base}:ticket",
            limit=f"{base}:limit",
            starts=f"{base}:starts",
            gate=f"{base}:gate",
            runs=f"{base}:runs",
            run_expiry=f"{base}:run_expiry",
            tenants=f"{base}:tenants",
            shares=f"{base}:shares",
            evicted=f"{base}:evicted",
            base=base,
        )

    @property
    def ordered(self) -> list[str]:
        return [
            self.holders,
            self.holder_info,
            self.queue,
            self.present,
            self.deadlines,
            self.waiter_info,
            self.ticket,
            self.limit,
            self.starts,
            self.gate,
            self.runs,
            self.run_expiry,
        ]

    @functools.cached_property
    def encoded(self) -> list[bytes]:
        """``ordered`` as bytes, encoded once: redis-py then passes them through untouched, which
        matters on the hot path."""
        return [key.encode() for key in self.ordered]

    @functools.cached_property
    def line_keys(self) -> list[bytes]:
        """KEYS[1..10], for the scripts (and acquires without a run id) that never touch the run
        records: every key a script touches is declared, and no more is sent than that."""
        return self.encoded[:10]

    @functools.cached_property
    def tenant_keys(self) -> list[bytes]:
        """KEYS[1..14], for an acquire that names a tenant: the run records' keys, then the
        tenants' clocks and runtime shares."""
        return [*self.encoded, self.tenants.encode(), self.shares.encode()]

    @functools.cached_property
    def policy_keys(self) -> list[bytes]:
        """KEYS[1..15], for an acquire under a full-line policy: ``tenant_keys`` and the marks
        of evicted waiters."""
        return [*self.tenant_keys, self.evicted.encode()]

    @classmethod
    def of_base(cls, base: str) -> SemaphoreKeys:
        """The keys of the semaphore whose keys start with ``base`` (as a parked task's record
        names its line)."""
        return cls(**{name: f"{base}:{name}" for name in _KEY_NAMES}, base=base)

    def wake_address(self, listener_id: str) -> str:
        """The channel a process's waiters on this semaphore are told on: inside the hash tag,
        so that sharded pub/sub (SPUBLISH from the script) can serve it on a cluster. A sharded
        listener's ``listener_id`` starts with ``storage.SHARDED_MARK``, which makes this an
        address the scripts SPUBLISH on (lua/_lib.lua, notify)."""
        return wake_address(self.base, listener_id)


_KEY_NAMES = (
    "holders",
    "holder_info",
    "queue",
    "present",
    "deadlines",
    "waiter_info",
    "ticket",
    "limit",
    "starts",
    "gate",
    "runs",
    "run_expiry",
    "tenants",
    "shares",
    "evicted",
)


class Script:
    """One script on one client: EVALSHA by its SHA; after NOSCRIPT, SCRIPT LOAD and again.

    Not redis-py's ``register_script``: its ``Script.__call__`` copies keys and arguments into a
    new tuple and imports a module on every call, which the uncontended acquire + release pays
    twice (measured: about 2 us of the client's CPU per cycle), and in a pipeline it asks
    SCRIPT EXISTS first, one more round trip (``run_in_order`` queues the EVALSHA alone)."""

    __slots__ = ("_client", "_sha", "_source")

    def __init__(self, client: Any, source: str) -> None:
        self._client = client
        self._source = source
        self._sha = hashlib.sha1(source.encode("utf-8")).hexdigest()

    def __call__(self, keys: list[bytes], args: list[Any]) -> Any:
        try:
            return self._client.evalsha(self._sha, len(keys), *keys, *args)
        except NoScriptError:
            # the server lost its script cache: load it (on a cluster, into every master) and
            # run it once more; running twice is harmless, NOSCRIPT means it never ran
            self._client.script_load(self._source)
            return self._client.evalsha(self._sha, len(keys), *keys, *args)

    @property
    def client(self) -> Any:
        return self._client

    def queue_on(self, pipe: Any, keys: list[bytes], args: list[Any]) -> None:
        """Queue a run on ``pipe`` (a pipeline of this script's client): the caller's
        ``run_in_order`` sees to NOSCRIPT."""
        pipe.evalsha(self._sha, len(keys), *keys, *args)

    def load(self) -> None:
        self._client.script_load(self._source)


def run_in_order(runs: list[tuple[Script, list[bytes], list[Any]]]) -> list[Any]:
    """Run several scripts of one client, in order, in one round trip; their replies, or the
    error each raised (a script's error; a lost connection raises). Should the server have lost
    a script (NOSCRIPT), every script is loaded and all run again, in order: the scripts run
    this way must bear a second run. A cluster client's pipeline refuses EVALSHA: there, one
    call each, in order."""
    client = runs[0][0].client
    replies: list[Any] = []
    if isinstance(client, RedisCluster):
        for script, keys, args in runs:
            try:
                replies.append(script(keys=keys, args=args))
            except ResponseError as error:
                replies.append(error)
        return replies
    for _ in range(2):
        pipe = client.pipeline(transaction=False)
        for script, keys, args in runs:
            script.queue_on(pipe, keys, args)
        replies = pipe.execute(raise_on_error=False)
        if not any(isinstance(reply, NoScriptError) for reply in replies):
            break
        for script, _, _ in runs:
            script.load()
    return replies


def _blocking(build: Callable[P, ScriptCall[R]]) -> Callable[Concatenate[Scripts, P], R]:
    """A method of ``Scripts`` made from a call builder: run the call, return its parsed reply."""

    def method(self: Scripts, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.run(build(*args, **kwargs))

    method.__doc__ = build.__doc__
    return method


class Scripts:
    """The registered scripts of one Redis client, one typed method per script."""

    def __init__(self, client: Any) -> None:
        self._scripts: dict[str, Script] = {name: Script(client, script_source(name)) for name in _NAMES}

    def run(self, call: ScriptCall[R]) -> R:
        """Run one call (``script_calls``) and parse its reply."""
        return call.parse(self._scripts[call.name](keys=call.keys, args=call.args))

    def run_after(self, first: tuple[Script, list[bytes], list[Any]], call: ScriptCall[R]) -> tuple[Any, R]:
        """Run ``first`` (another script of this client, with its keys and arguments), then
        ``call``, in one round trip: ``first``'s reply, or the error it raised, and ``call``'s
        parsed reply. Raises what ``call`` raised."""
        reply, first_reply = self._run_beside(call, first, call_first=False)
        return first_reply, reply

    def run_before(self, call: ScriptCall[R], then: tuple[Script, list[bytes], list[Any]]) -> tuple[R, Any]:
        """Run ``call``, then ``then`` (another script of this client, with its keys and
        arguments), in one round trip: ``call``'s parsed reply, and ``then``'s reply or the
        error it raised. Raises what ``call`` raised."""
        return self._run_beside(call, then, call_first=True)

    def _run_beside(
        self, call: ScriptCall[R], other: tuple[Script, list[bytes], list[Any]], *, call_first: bool
    ) -> tuple[R, Any]:
        """``call`` and ``other`` in one round trip, in the order asked: ``call``'s parsed reply
        (raising what it raised) and ``other``'s reply or error."""
        own = (self._scripts[call.name], call.keys, call.args)
        replies = run_in_order([own, other] if call_first else [other, own])
        reply, other_reply = replies if call_first else replies[::-1]
        if isinstance(reply, Exception):
            raise reply
        return call.parse(reply), other_reply

    acquire = _blocking(calls.acquire)
    release = _blocking(calls.release)
    renew = _blocking(calls.renew)
    leave = _blocking(calls.leave)
    status = _blocking(calls.status)
    set_limit = _blocking(calls.set_limit)
    set_gate = _blocking(calls.set_gate)
    reset = _blocking(calls.reset)
    acquire_many = _blocking(calls_many.acquire_many)
    release_many = _blocking(calls_many.release_many)
    renew_many = _blocking(calls_many.renew_many)
    leave_many = _blocking(calls_many.leave_many)


_registered: weakref.WeakKeyDictionary[Any, Scripts] = weakref.WeakKeyDictionary()
_registering = fork_locks.reset_in_child()


def scripts_for(client: Any) -> Scripts:
    """The scripts registered on ``client``, registering them the first time it is seen."""
    try:
        return _registered[client]
    except KeyError:
        pass
    with _registering:
        if client not in _registered:
            _registered[client] = Scripts(client)
        return _registered[client]


def preload(client: Any) -> None:
    """Load every script of the semaphore's into the server's script cache now (on a cluster, into every master),
    so that a process's first acquire is one EVALSHA, not NOSCRIPT, SCRIPT LOAD and a retry."""
    for name in _NAMES:
        client.script_load(script_source(name))
