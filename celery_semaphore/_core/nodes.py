"""The records that let a worker starting under a node name give back the slots of a dead one.

A whole worker killed outright gives nothing back: its slots sit idle until their leases run out.
Yet a worker restarted under the same node name (systemd's ``celery@host``, a Kubernetes
StatefulSet pod) knows its predecessor is gone, if the predecessor has gone silent. So every
worker *instance* (one start of a worker's main process) beats once a second, in server time,
into its node name's record, and notes in an index of its own every semaphore its processes ask
for a slot of; its holder tokens carry its id. An instance starting under the name takes over
an instance whose beat has gone stale: one script removes it only if it is still silent, and
hands back its index, where the holders to give back are found and released through ``release``,
so a freed slot reaches the next waiter as any release's does. An instance that still beats is
alive (two workers started under one name by mistake): its slots stay. docs/design.md argues the
rule, with the timeline of each case.

Keys (all of one node name under one hash tag, so each script runs on one cluster slot):

* ``{prefix}:node:{<name>}`` HASH, instance id -> ``"<last beat ms>|<where>"``;
* ``{prefix}:node:{<name>}:held:<instance>`` HASH, semaphore base -> rules, the index.

This module speaks Redis only; the Celery glue (``_celery/node_names.py``) decides when.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .replies import hand_off_reply
from .scripts import Script, SemaphoreKeys, script_source
from .storage import INSTANCE_BEATING, INSTANCE_GONE, INSTANCE_TAKEN, WEIGHT_MARK, as_text, slot_members

# The hex digits of an instance id (a holder token carries them, see ``instance_tokens``).
INSTANCE_DIGITS = 8


@dataclass(frozen=True)
class NodeKeys:
    """The keys of one node name's records."""

    node: str

    @classmethod
    def of(cls, prefix: str, name: str) -> NodeKeys:
        # braces would end the hash tag early: a node name keeps its letters, not its braces
        return cls(f"{prefix}:node:{{{name.replace('{', '(').replace('}', ')')}}}")

    def held(self, instance: str) -> str:
        return f"{self.node}:held:{instance}"


@dataclass(frozen=True)
class Silent:
    """take_over's answer: the instance was taken over; ``held`` is its index (base -> rules)."""

    held: dict[str, bytes]


@dataclass(frozen=True)
class Beating:
    """take_over's answer: the instance beat ``silent_ms`` ago, within the staleness bound."""

    silent_ms: int


# What a beat says of the instance's record before it (beat.lua).
TAKEN_OVER, RECORDED, UNNAMED = 0, 1, 2


class NodeScripts:
    """The scripts of the node records, and the release a take-over gives slots back with."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._beat = Script(client, script_source("beat"))
        self._take_over = Script(client, script_source("take_over"))
        self._release = Script(client, script_source("release"))
        self._release_many = Script(client, script_source("release_many"))

    def beat(self, keys: NodeKeys, *, instance: str, where: str, ttl_ms: int) -> int:
        """One beat: RECORDED, TAKEN_OVER (the name recorded others, not the instance) or UNNAMED
        (the name recorded nobody: a first beat, or a Redis that lost its data); see beat.lua."""
        return int(self._beat(keys=[keys.node.encode(), keys.held(instance).encode()], args=[instance, where, ttl_ms]))

    def held(self, keys: NodeKeys, *, instance: str) -> dict[bytes, bytes]:
        """The instance's index as Redis has it (semaphore base -> rules)."""
        return dict(self.client.hgetall(keys.held(instance)))

    def note_held(self, keys: NodeKeys, *, instance: str, semaphores: list[tuple[str, bytes]], ttl_ms: int) -> None:
        """Add (semaphore base, rules) pairs to the instance's index: one round trip."""
        held = keys.held(instance)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(held, mapping=dict(semaphores))
        pipe.pexpire(held, ttl_ms)
        pipe.execute()

    def forget(self, keys: NodeKeys, *, instance: str) -> None:
        """Remove an instance that stopped cleanly (it holds nothing) from the name's record."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hdel(keys.node, instance)
        pipe.delete(keys.held(instance))
        pipe.execute()

    def instances(self, keys: NodeKeys) -> dict[str, str]:
        """Instance id -> ``where`` of every instance the name records."""
        return {
            as_text(instance): as_text(value).partition("|")[2]
            for instance, value in self.client.hgetall(keys.node).items()
        }

    def take_over(self, keys: NodeKeys, *, instance: str, stale_ms: int) -> Silent | Beating | None:
        """Take over ``instance`` if it is silent: Silent; Beating if it is not; None if the
        name no longer records it."""
        reply = self._take_over(keys=[keys.node.encode(), keys.held(instance).encode()], args=[instance, stale_ms])
        code = int(reply[0])
        if code == INSTANCE_TAKEN:
            pairs = reply[1:]
            return Silent({as_text(pairs[i]): bytes(pairs[i + 1]) for i in range(0, len(pairs), 2)})
        if code == INSTANCE_BEATING:
            return Beating(int(reply[1]))
        if code == INSTANCE_GONE:
            return None
        raise ValueError(f"take_over answered an unknown code {code!r}")

    def give_back(self, base: str, rules: bytes, instance: str) -> int:
        """Release every holder of ``instance`` on the semaphore ``base`` through its release
        script (a weighted one, all its entries, through release_many); how many slots went back.

        Each freed slot is offered to the next present waiter and told on its wake address
        (notify in lua/_lib.lua): a waiter whose process lives hears it and claims the slot. The
        waiters the reply names are not woken from here: one parked by a process that died with
        the instance has nobody listening, and its offer lapses after its claim window (2 s),
        when the purge reports it again and a worker's tick sends its wake copy."""
        keys = SemaphoreKeys.of_base(base)
        given = 0
        for token in list(instance_tokens(self.client, keys.holders, instance)):
            if WEIGHT_MARK in token.rpartition(":")[2]:
                if hand_off_reply(self._release_many(keys=keys.line_keys, args=[token, b"1", rules])).done:
                    given += len(slot_members(token))
                continue
            given += hand_off_reply(self._release(keys=keys.line_keys, args=[token, rules])).done
        return given


def instance_tokens(client: Any, holders: str, instance: str) -> Iterator[str]:
    """The holder tokens of ``instance`` in the holders key ``holders``: ``<task key>:`` then 32 hex
    digits of which the 17th to 24th are the instance (``_celery/tokens.py``), and a weight mark.
    Another instance's token, an offer or a weighted holder's extra slot never matches."""
    pattern = re.compile(rf".*:[0-9a-f]{{16}}{re.escape(instance)}[0-9a-f]{{8}}(\*\d+)?", re.DOTALL)
    for member, _ in client.zscan_iter(holders, match=f"*{instance}*"):
        token = as_text(member)
        if pattern.fullmatch(token):
            yield token
