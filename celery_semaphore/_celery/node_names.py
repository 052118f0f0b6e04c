"""A worker restarted under its node name gives back, within seconds, the slots of the dead one.

A whole worker SIGKILLed (or killed by the OOM killer, or by a node's power) gives nothing back:
its slots wait for their leases (60 s by default), which in the chaos runs was most of the
makespan. systemd restarts ``celery@host`` under the same name, and a Kubernetes StatefulSet its
pod, within seconds. So each start of a worker's main process is an *instance* with a fresh id,
which beats once a second under the node name (``_core/nodes.py``, one thread here); the pool
processes it forks note in its index each semaphore they ask for a slot of, before they ask
(once a minute per semaphore and process), and carry its id in their holder tokens. An instance
starting under the name looks at each other instance recorded under it:

* one that ran on this host, in this PID namespace, whose main process still runs (the same PID
  and start time): alive, though silent (cut off from Redis, or stalled). Its slots stay;
* one that ran there whose main process is gone: dead, proven. Taken over at once;
* one elsewhere whose beat is older than ``STALE_S``: silent. Taken over, by a script that
  removes it only if it is still silent;
* one that beats again: a second live worker under the same name, started by mistake. Its slots
  stay, and a warning says so.

A taken-over instance's holders go back through ``release``, which offers each slot to the next
waiter (``nodes.NodeScripts.give_back`` says why no wake copy is sent from here).

A dead main process leaves no pool process running a body: Celery's prefork children die with
their parent (``PR_SET_PDEATHSIG``, set by ``celery.concurrency.prefork.process_initializer``,
checked with Celery 5.7), and the other pools run bodies in the main process itself. docs/design.md
argues the rule with a timeline of each case, the one it cannot tell included.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from typing import Any

from .._core.clients import client_for
from .._core.multi import MultiSemaphore
from .._core.nodes import INSTANCE_DIGITS, TAKEN_OVER, UNNAMED, Beating, NodeKeys, NodeScripts, Silent
from .._core.semaphore import FairSemaphore
from .._core.storage import as_text
from .config import config_for
from .pausing import members
from .tokens import set_instance

logger = logging.getLogger("celery_semaphore")

BEAT_EVERY_S = 1.0
# Silent this long (3 beats missed), an instance may be taken over by one starting under its name.
STALE_S = 3.0
# How long a node's records outlive its last beat: a worker restarted later than this finds
# nothing to take over (its predecessor's leases ran out long before).
RECORD_TTL_S = 86400.0
# How long a starting instance keeps looking at one that beat lately: until it is silent for
# STALE_S or beats again, which takes STALE_S at most; this bounds the look if Redis is down.
LOOK_FOR_S = 30.0
# A process notes a semaphore in the index again after this long: a Redis that lost its data (a
# restart without persistence) has the index back within a minute, for one round trip a minute.
NOTE_AGAIN_S = 60.0
# The main process reads its instance's index this often, to write it back should Redis lose it.
HELD_READ_EVERY_S = 5.0


class _Node:
    """This worker instance: set in the main process before the pool forks, inherited by it."""

    def __init__(self, app: Any, name: str) -> None:
        config = config_for(app)
        self.name, self.backend = name, config.backend
        self.keys = NodeKeys.of(config.prefix, name)
        self.instance = secrets.token_hex(INSTANCE_DIGITS // 2)
        self.where = _where(os.getpid())
        self.noted: dict[str, float] = {}  # semaphore base -> when this process put it in the index
        self.stopped = threading.Event()


_node: _Node | None = None
_scripts: weakref.WeakKeyDictionary[Any, NodeScripts] = weakref.WeakKeyDictionary()


def _scripts_for(client: Any) -> NodeScripts:
    scripts = _scripts.get(client)
    if scripts is None:
        scripts = _scripts[client] = NodeScripts(client)
    return scripts


def begin(app: Any, name: str) -> None:
    """Make this worker main process a new instance of node ``name`` (before its pool forks)."""
    global _node
    _node = _Node(app, name)
    set_instance(_node.instance)


def start() -> None:
    """Beat, and take over the silent instances of this node name, from a daemon thread."""
    node = _node
    if node is not None:
        threading.Thread(target=_run, args=(node,), name="celery-semaphore-node", daemon=True).start()


def stop() -> None:
    """At the end of a warm shutdown (every task has given its slot back): stop beating, and
    leave the name's record, so that nobody looks at this instance again."""
    node = _node
    if node is not None:
        node.stopped.set()


def note_held(semaphore: FairSemaphore | MultiSemaphore) -> None:
    """Before a worker's process first asks for a slot of ``semaphore``, put it in the instance's
    index, so that a worker restarted under the name finds the slot; once per process and
    semaphore a minute. A failure is not noted: the next ask tries again; the lease stays the bound."""
    node = _node
    if node is None:
        return
    now = time.monotonic()
    new = [
        (member.keys.base, member.rules.arg)
        for member in members(semaphore)
        if now - node.noted.get(member.keys.base, -NOTE_AGAIN_S) >= NOTE_AGAIN_S
    ]
    if not new:
        return
    try:
        _scripts_for(semaphore.client).note_held(
            node.keys, instance=node.instance, semaphores=new, ttl_ms=round(RECORD_TTL_S * 1000)
        )
    except Exception as error:
        logger.debug("could not note %r for the worker's node record: %s", semaphore.name, error)
        return
    node.noted.update((base, now) for base, _ in new)


def _run(node: _Node) -> None:
    scripts = _scripts_for(client_for(node.backend))
    ttl_ms, first, looked_at = round(RECORD_TTL_S * 1000), True, time.monotonic()
    others: dict[str, int | None] = {}  # instances still to look at -> how long silent when last seen
    # the instance's index as last read, written back at once should Redis lose it: a worker
    # killed before its processes note their semaphores again (a minute) would leave its slots
    # to their leases. Only ever added to: a read just after a loss finds nothing.
    held: dict[bytes, bytes] = {}
    read_at = -HELD_READ_EVERY_S
    while not node.stopped.is_set():
        try:
            beat = scripts.beat(node.keys, instance=node.instance, where=node.where, ttl_ms=ttl_ms)
            if first:
                others = {other: None for other in scripts.instances(node.keys) if other != node.instance}
            elif beat == UNNAMED:
                logger.warning(
                    "the semaphore's Redis lost the node records (restarted empty?): worker %s is recorded again, "
                    "with the %d semaphores its processes asked for",
                    node.name, len(held),
                )  # fmt: skip
                if held:
                    again = [(as_text(base), rules) for base, rules in held.items()]
                    scripts.note_held(node.keys, instance=node.instance, semaphores=again, ttl_ms=ttl_ms)
            elif beat == TAKEN_OVER:
                logger.error(
                    "worker %s (instance %s) was no longer recorded under its name: a worker started under the "
                    "name took it over after it was silent for %s s and gave its slots back (the limit may be "
                    "exceeded until its tasks end)",
                    node.name, node.instance, STALE_S,
                )  # fmt: skip
            first = False
            if time.monotonic() - read_at >= HELD_READ_EVERY_S:
                held.update(scripts.held(node.keys, instance=node.instance))
                read_at = time.monotonic()
            if others and time.monotonic() - looked_at < LOOK_FOR_S:
                _look(node, scripts, others)
        except Exception as error:  # Redis unreachable: the next beat
            logger.debug("node record of %s: %s", node.name, error)
        node.stopped.wait(BEAT_EVERY_S)
    try:
        scripts.forget(node.keys, instance=node.instance)
    except Exception as error:  # its record is taken over, with nothing to give back, or expires
        logger.debug("could not remove the node record of %s: %s", node.name, error)


def _look(node: _Node, scripts: NodeScripts, others: dict[str, int | None]) -> None:
    """One look at each instance recorded under the name: take over the silent ones."""
    for other, was_silent_ms in list(others.items()):
        where = scripts.instances(node.keys).get(other)
        if where is None:
            del others[other]  # taken over by another starting instance, or expired
            continue
        here = _runs_here(where)
        if here:
            del others[other]
            logger.warning(
                "another worker runs under the name %s on this host (instance %s): its slots stay", node.name, other
            )
            continue
        # its main process gone from this host is proof of death: no need to wait for its beat to go stale
        stale_ms = 0 if here is False else round(STALE_S * 1000)
        answer = scripts.take_over(node.keys, instance=other, stale_ms=stale_ms)
        if isinstance(answer, Beating):
            # a silent instance is a second more silent at the next look: less means it beat since
            if was_silent_ms is not None and answer.silent_ms < was_silent_ms + BEAT_EVERY_S * 500:
                del others[other]
                logger.warning(
                    "two live workers run under the name %s (instance %s and this one, %s): node names must be "
                    "unique; the other's slots stay",
                    node.name, other, node.instance,
                )  # fmt: skip
            else:
                others[other] = answer.silent_ms
            continue
        del others[other]
        if isinstance(answer, Silent):
            _give_back(node, scripts, other, answer)


def _give_back(node: _Node, scripts: NodeScripts, other: str, silent: Silent) -> None:
    given = 0
    for base, rules in silent.held.items():
        try:
            given += scripts.give_back(base, rules, other)
        except Exception as error:  # its lease stays the bound
            logger.warning("could not give back the slots of %s's dead instance on %s: %s", node.name, base, error)
    logger.info(
        "worker %s: took over its dead instance %s and gave back %d slot(s) on %d semaphore(s)",
        node.name, other, given, len(silent.held),
    )  # fmt: skip


def _where(pid: int) -> str:
    """Where process ``pid`` runs, as another process of this host can check it: the boot, the
    PID namespace, the PID and the process's start time (so a PID reused later is not it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
        return f"{boot_id}/{namespace}/{pid}/{_started_at(pid)}"
    except (OSError, IndexError):
        return ""  # not Linux: nothing another process could check


def _started_at(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
        fields = stat.read().rpartition(")")[2].split()
    if fields[0] in ("Z", "X"):  # a zombie runs nothing
        raise IndexError("exited")
    return fields[19]  # field 22 of proc(5): the start time, in clock ticks after boot


def _runs_here(where: str) -> bool | None:
    """Whether the process ``where`` names runs: True, alive whatever its beat says; False, it
    ran on this host and in this PID namespace and is gone; None, it ran elsewhere (on another
    host, or in another container), where nothing can be checked from here."""
    here = _where(os.getpid()).split("/")
    there = where.split("/")
    if len(there) != 4 or len(here) != 4 or there[:2] != here[:2]:
        return None
    try:
        return _started_at(int(there[2])) == there[3]
    except (OSError, IndexError, ValueError):
        return False
