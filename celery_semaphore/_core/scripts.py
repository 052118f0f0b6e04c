"""The Lua scripts of the semaphore: loaded from ``lua/``, registered once per client, and
called through typed wrappers.

Each operation is one script, so each costs one round trip and runs atomically: there is no
window between reading the holders and adding to them, and no lock around the semaphore.
``_Script`` computes the SHA once and loads the script again by itself after ``NOSCRIPT`` (a
``SCRIPT FLUSH``, a restarted Redis, a promoted replica).

The contract of each script (its KEYS, its ARGV, its reply) is written once in the header of its
``.lua`` file and once here, as a function with keyword-only arguments and a named result: a call
site cannot pass two arguments in the wrong order, and nobody unpacks a reply by position outside
this module. Milliseconds appear here and in Lua only; callers speak seconds (see validation.to_ms).
The codes in the replies, and the marks inside what the scripts store, are ``storage``'s.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from .replies import (
    BARE_REPLIES,
    AcquireReply,
    GateReply,
    GateState,
    HandOffReply,
    Holder,
    ListedHolder,
    ListedWaiter,
    RenewReply,
    StatusReply,
    hand_off_reply,
    renew_reply,
    waiters_of,
)
from .rules import Rules
from .script_args import number
from .scripts_many import ManyScripts
from .storage import (
    CLAIMED,
    GRANTED,
    INFO_SEPARATOR,
    RUNNING,
    as_text,
    parked_waiter_entry,
    wake_address,
)

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
    "park",
    "claim_parked",
    "claim_parked_waiter",
    "tick",
    "lines_to_tick",
    "remember_wait",
    "set_gate",
)


# In lua/_lib.lua, the line that ends the helpers of the uncontended paths; in a script, where
# the rest of the helpers go (after its fast path). See the head of lua/_lib.lua.
REST_OF_LIB = "-- @rest-of-lib\n"


@functools.cache
def script_source(name: str) -> str:
    """The full text of one script as Redis runs it: the shared helpers, then its body. The
    helpers after ``REST_OF_LIB`` go where the body has that line, else in front of it."""
    lua = importlib.resources.files("celery_semaphore._core") / "lua"
    first, rest = (lua / "_lib.lua").read_text(encoding="utf-8").split(REST_OF_LIB)
    body = (lua / f"{name}.lua").read_text(encoding="utf-8")
    if REST_OF_LIB in body:
        return first + "\n" + body.replace(REST_OF_LIB, REST_OF_LIB + rest)
    return first + REST_OF_LIB + rest + "\n" + body


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
)


class _Script:
    """One script on one client: EVALSHA by its SHA; after NOSCRIPT, SCRIPT LOAD and again.

    Not redis-py's ``register_script``: its ``Script.__call__`` copies keys and arguments into a
    new tuple and imports a module on every call, which the uncontended acquire + release pays
    twice (measured: about 2 us of the client's CPU per cycle, with nothing gained here: these
    scripts never run in a pipeline)."""

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


class Scripts(ManyScripts):
    """The registered scripts of one Redis client, one typed method per script."""

    def __init__(self, client: Any) -> None:
        self._scripts: dict[str, _Script] = {name: _Script(client, script_source(name)) for name in _NAMES}

    def acquire(
        self,
        keys: SemaphoreKeys,
        *,
        token: str,
        waiter: str,
        rules: Rules,
        lease_ms: int,
        patience_ms: int,
        enqueue: bool,
        fresh: bool,
        label: str,
        ticket: int | None,
        wake: str,
        run: str = "",
        remember_ms: int = 0,
    ) -> AcquireReply:
        encoded = token.encode()
        args: list[Any] = [
            encoded,
            encoded if waiter is token else waiter.encode(),
            _settings(rules.arg, lease_ms, patience_ms, enqueue, fresh, label),
        ]
        # trailing arguments that are empty are not sent (the script reads them as ""): the
        # uncontended acquire of a blocked caller or a one-shot try sends three
        if run:
            args += [b"" if ticket is None else number(int(ticket)), wake, run, number(remember_ms)]
        elif wake:
            args += [b"" if ticket is None else number(int(ticket)), wake]
        elif ticket is not None:
            args.append(number(int(ticket)))
        reply = self._scripts["acquire"](keys=keys.encoded if run else keys.line_keys, args=args)
        if not isinstance(reply, list):
            return BARE_REPLIES.get(int(reply)) or AcquireReply(int(reply), 0, 0, 0, -1, None, 0)
        code = int(reply[0])
        if code == RUNNING:  # with the lease left of the copy that runs
            return AcquireReply(code, 0, 0, 0, -1, None, 0, twin_lease_ms=int(reply[1]))
        if code in (GRANTED, CLAIMED):  # a grant that handed slots to waiters its caller wakes
            return AcquireReply(code, 0, 0, 0, -1, None, 0, to_wake=waiters_of(reply[1:]))
        outcome, position, free, limit, hold_ms, ticket_text, turn, retry_ms, opens_ms = reply[:9]
        text = as_text(ticket_text)
        return AcquireReply(
            outcome=int(outcome),
            position=int(position),
            free=int(free),
            limit=int(limit),
            hold_ms=int(hold_ms),
            ticket=int(float(text)) if text else None,
            turn=int(turn),
            to_wake=waiters_of(reply[9:]),
            retry_ms=int(retry_ms),
            opens_ms=int(opens_ms),
        )

    def release(
        self, keys: SemaphoreKeys, *, token: str, rules: Rules, run: str = "", remember_ms: int = 0
    ) -> HandOffReply:
        if run:
            reply = self._scripts["release"](keys=keys.encoded, args=[token, rules.arg, run, number(remember_ms)])
        else:
            reply = self._scripts["release"](keys=keys.line_keys, args=[token, rules.arg])
        return hand_off_reply(reply)

    def renew(
        self, keys: SemaphoreKeys, *, lease_ms: int, rules: Rules, reclaim: bool, holders: list[Holder]
    ) -> RenewReply:
        args: list[Any] = [lease_ms, rules.arg, int(reclaim), *(part for holder in holders for part in holder)]
        named = keys.encoded if any(run for _, _, run in holders) else keys.line_keys  # runs: their records too
        return renew_reply(self._scripts["renew"](keys=named, args=args), len(holders))

    def leave(
        self, keys: SemaphoreKeys, *, waiter: str, away_ms: int | None, rules: Rules, wake: str = ""
    ) -> HandOffReply:
        args = [waiter, "" if away_ms is None else away_ms, rules.arg, wake]
        return hand_off_reply(self._scripts["leave"](keys=keys.line_keys, args=args))

    def status(self, keys: SemaphoreKeys, *, listed: int, rules: Rules) -> StatusReply:
        now, override, ttl, holder_count, offered_count, waiter_count, holders, waiters, gate = self._scripts["status"](
            keys=keys.line_keys, args=[listed, rules.arg]
        )
        listed_holders = []
        for i in range(0, len(holders), 3):
            granted, _, label = as_text(holders[i + 2]).partition(INFO_SEPARATOR)
            listed_holders.append(
                ListedHolder(
                    token=as_text(holders[i]),
                    deadline_ms=int(float(holders[i + 1])),
                    granted_ms=int(granted) if granted else None,
                    label=label,
                )
            )
        listed_waiters = []
        for i in range(0, len(waiters), 5):
            first = as_text(waiters[i + 3])
            listed_waiters.append(
                ListedWaiter(
                    waiter=as_text(waiters[i]),
                    ticket=int(float(waiters[i + 1])),
                    must_ask_by_ms=int(float(waiters[i + 2])),
                    first_ask_ms=int(first) if first else None,
                    state=int(waiters[i + 4]),
                )
            )
        return StatusReply(
            now_ms=int(now),
            override=int(override) if override else None,
            override_ttl_ms=int(ttl),
            holder_count=int(holder_count),
            offered_count=int(offered_count),
            waiter_count=int(waiter_count),
            holders=listed_holders,
            waiters=listed_waiters,
            gate=GateState(
                rate_count=int(gate[0]),
                rate_ms=int(gate[1]),
                spacing_ms=int(gate[2]),
                paused_ms=int(gate[3]),
                next_start_ms=int(gate[4]),
                starts_in_window=int(gate[5]),
                override=as_text(gate[6]) if gate[6] else None,
            ),
        )

    def set_limit(self, keys: SemaphoreKeys, *, override: int | None, ttl_ms: int | None, rules: Rules) -> int:
        args = ["" if override is None else override, "" if ttl_ms is None else ttl_ms, rules.arg]
        return int(self._scripts["set_limit"](keys=keys.line_keys, args=args))

    def set_gate(self, keys: SemaphoreKeys, *, kind: str, value: str, ttl_ms: int | None, rules: Rules) -> GateReply:
        """Store (``value``) or clear (``""``) one runtime rule: ``kind`` "r" a rate ``<count>/<ms>``,
        "s" a spacing ``<ms>``, "p" a pause ``<ms>`` from now ("0": until resumed)."""
        args = [kind, value, "" if ttl_ms is None else ttl_ms, rules.arg]
        reply = self._scripts["set_gate"](keys=keys.line_keys, args=args)
        limit, rate_count, rate_ms, spacing_ms, paused_ms = (int(value) for value in reply[:5])
        return GateReply(limit, rate_count, rate_ms, spacing_ms, paused_ms, to_wake=waiters_of(reply[5:]))

    def reset(self, keys: SemaphoreKeys) -> int:
        return int(self._scripts["reset"](keys=keys.encoded, args=[]))  # the run records too

    def park(
        self,
        keys: list[bytes],
        *,
        record: str,
        look_in_ms: int,
        copy: bytes,
        only_if_absent: bool = False,
        line: str = "",
    ) -> bool:
        """Keep (or, with an empty ``copy``, forget) a parked task's record; ``keys`` are
        ``_parking.parked_keys``. With ``only_if_absent``, a record that exists is left as it is
        (and False returned). ``line``: the member naming the waiter's line for the ticks."""
        args: list[Any] = [record, look_in_ms, copy, b"nx" if only_if_absent else b"", line]
        return bool(self._scripts["park"](keys=keys[:4], args=args))

    def claim_parked(self, keys: list[bytes], *, most: int) -> list[tuple[str, bytes]]:
        """The parked-task records now due, (record, copy) each, taken by this caller alone."""
        reply = self._scripts["claim_parked"](keys=keys[:3], args=[most])
        return [(as_text(reply[i]), bytes(reply[i + 1])) for i in range(0, len(reply), 2)]

    def claim_parked_waiter(
        self, keys: list[bytes], *, deadlines_key: str, waiter: str, lease_ms: int
    ) -> tuple[str, bytes] | None:
        """The parked-task record of ``waiter`` of the line with ``deadlines_key``, taken now by
        this caller alone and leased for ``lease_ms`` (a sweep sends its copy again after that,
        unless its run was granted); None when it has none (or another caller took it)."""
        reply = self._scripts["claim_parked_waiter"](
            keys=keys[:3], args=[parked_waiter_entry(deadlines_key, waiter), number(lease_ms)]
        )
        return (as_text(reply[0]), bytes(reply[1])) if reply else None

    def lines_to_tick(self, keys: list[bytes], *, round_ms: int, most: int) -> list[str]:
        """The lines with parked waiters to tick this round, or [] when another process has it."""
        return [as_text(line) for line in self._scripts["lines_to_tick"](keys=keys[3:5], args=[round_ms, most])]

    def remember_wait(self, keys: SemaphoreKeys, *, first_delivery: str, wait_id: str, remember_ms: int) -> None:
        """Note the wait a first delivery began (lua/remember_wait.lua)."""
        self._scripts["remember_wait"](keys=keys.encoded, args=[first_delivery, wait_id, number(remember_ms)])

    def tick(self, keys: SemaphoreKeys, *, rules: bytes) -> tuple[str, ...]:
        """Purge a line one step and hand freed slots on; the waiters the caller must wake
        (offered a slot: parked, or nobody heard; see notify in lua/_lib.lua).
        ``rules``: as ``Rules.arg`` (a parked line's record carries them as text)."""
        return waiters_of(self._scripts["tick"](keys=keys.line_keys, args=[rules]))


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
            _registered[client] = Scripts(client)
        return _registered[client]


@functools.lru_cache(maxsize=1024)
def _settings(rules: bytes, lease_ms: int, patience_ms: int, enqueue: bool, fresh: bool, label: str) -> bytes:
    """acquire's ARGV[3]: the arguments that rarely change between calls, packed once (see
    lua/acquire.lua): every argument sent costs the client a trip through redis-py's encoder."""
    return b"%s|%d|%d|%d%d|%s" % (rules, lease_ms, patience_ms, enqueue, fresh, label.encode())


def preload(client: Any) -> None:
    """Load every script into the server's script cache now (on a cluster, into every master),
    so that a process's first acquire is one EVALSHA, not NOSCRIPT, SCRIPT LOAD and a retry."""
    for name in _NAMES:
        client.script_load(script_source(name))
