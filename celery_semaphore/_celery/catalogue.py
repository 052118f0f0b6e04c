"""Which semaphore, limit and metrics family apply to a task call or a semaphore key.

The one home of that question. The task hook asks it for every call, the worker's parent for a
killed child's call, the start check for every task, the CLI and the metrics collector for every
key they find in Redis, and user code for a key of its own (``semaphore_for(app, "crawl:h")``):
all get the same answer, in the order the workers apply limits: a runtime override stored in
Redis (applied by the acquire script), then ``semaphore_limits`` (exact key, task name, globs),
then the task's own ``semaphore_limit``.
"""

from __future__ import annotations

import fnmatch
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import redis

from .._core import fork_locks
from .._core.clients import client_for
from .._core.multi import MultiSemaphore
from .._core.semaphore import FairSemaphore
from .._core.storage import glob_escape
from ..errors import ConfigurationError, SemaphoreError
from .config import LimitRule, SemaphoreConfig, config_for
from .keys import call_key, is_fixed, literal_length, template_pattern
from .options import (
    full_line_of,
    is_semaphore_task,
    key_option,
    template_of,
    wait_options,
    weight_of_call,
    weight_option,
)

# The parts of a semaphore's keys whose presence means the semaphore exists: someone holds, waits,
# or an operator stored a limit, a rate, a spacing or a pause. (The bookkeeping keys never outlive
# these.)
_PRESENCE_PARTS = ("holders", "queue", "limit", "gate")

# Family of keys that no task's key (fixed or template) accounts for: FairSemaphore used outside
# Celery, or tasks whose key is a function. One bucket, so metrics stay bounded.
OTHER_FAMILY = "(other)"


def semaphore_tasks(app: Any) -> list[Any]:
    """The app's registered tasks that hold a semaphore, by name."""
    return sorted((task for task in app.tasks.values() if is_semaphore_task(task)), key=lambda task: str(task.name))


# A line cap acts on one key's line; a task holding several keys (or a weight) waits in each.
NO_CAP_ON_MANY = "max_waiters applies to a task of one key and no weight; this task holds several slots or keys"


def no_limit_error(task_name: str, key: str) -> ConfigurationError:
    return ConfigurationError(
        f"{task_name}.semaphore_limit",
        None,
        f"no limit, rate or spacing for semaphore key {key!r} in code or semaphore_limits",
    )


def semaphore_for_call(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FairSemaphore | MultiSemaphore:
    """The semaphore one call of ``task`` must hold; ConfigurationError if no limit applies.

    A task with several keys (``semaphore_key`` a list) or a weight gets a MultiSemaphore over
    its keys' semaphores, each key's limit resolved as for a single key; a weight above one of
    them is a ConfigurationError here, when the task asks (never a wait that cannot end).

    Cheap enough for every call: the settings are parsed once per app and the client is
    shared per URL; no index of the app's tasks is built."""
    config = config_for(task.app)
    key_setting = f"{task.name}.semaphore_key"
    key_option_value = key_option(type(task))
    lease = wait_options(task, config).lease
    if key_option_value is None:
        keys = [str(task.name)]
    elif isinstance(key_option_value, list):
        keys = [call_key(key_setting, item, task.run, args, kwargs) for item in key_option_value]
    else:
        keys = [call_key(key_setting, key_option_value, task.run, args, kwargs)]
    semaphores = []
    rules = []
    for key in keys:
        rule = config.limit_for(key, str(task.name), task)
        if rule is None:
            raise no_limit_error(str(task.name), key)
        rules.append(rule)
        semaphores.append(_semaphore(config, key, rule, lease, *(rule.full_line or full_line_of(task))))
    if len(semaphores) == 1 and weight_option(type(task)) is None:
        return semaphores[0]
    capped = next((rule for rule in rules if rule.full_line is not None), None)
    if capped is not None:
        raise ConfigurationError(capped.source, capped.full_line_setting, NO_CAP_ON_MANY)
    return MultiSemaphore(semaphores, weight=weight_of_call(task, args, kwargs))


def _semaphore(
    config: SemaphoreConfig,
    key: str,
    rule: LimitRule,
    lease: float,
    max_waiters: int | None = None,
    on_full: str = "reject",
) -> FairSemaphore:
    """The semaphore of ``key`` under ``rule``: built once, then the same object for every call
    with the same settings (a FairSemaphore holds its settings only, set as it is built, and its
    wake address looks its process up again after a fork). Built anew per call, it was about a
    quarter of a millisecond of each hand-off on the waiter's side (``python -m
    benchmarks.bench_celery --only handoff``, measured in the pool processes)."""
    cache_key = (key, rule, lease, max_waiters, on_full)
    with _built_lock:
        built = _built.get(id(config))
        if built is None or built[0] is not config:
            built = _built[id(config)] = (config, OrderedDict())
            while len(_built) > CONFIGS_KEPT:
                _built.popitem(last=False)  # an app's settings parsed again (tests, shells) build anew
        else:
            _built.move_to_end(id(config))
        semaphore = built[1].get(cache_key)
        if semaphore is not None:
            built[1].move_to_end(cache_key)
            return semaphore
    semaphore = FairSemaphore(
        client_for(config.backend),
        key,
        rule.limit,
        rate=rule.rate,
        spacing=rule.spacing,
        lease=lease,
        prefix=config.prefix,
        hash_tag=config.hash_tag,
        shares=config.shares,
        max_waiters=max_waiters,
        on_full=on_full,
        per_tenant=rule.per_tenant,
    )
    with _built_lock:
        cached = built[1]
        cached[cache_key] = semaphore
        while len(cached) > BUILT_PER_CONFIG:
            cached.popitem(last=False)  # the least lately used: keys made per call (a host, a user) come and go
    return semaphore


# Semaphores kept built per app's settings (by the settings' identity: a new config builds anew),
# for the settings of the last few apps. About 2.7 KB each (tracemalloc, 1,000 keys of a
# template): 256 keep a pool process's hot keys in 0.7 MB; a longer tail of keys made per call
# (a crawler's hosts) builds its semaphores as every call did before.
BUILT_PER_CONFIG = 256
CONFIGS_KEPT = 8
_built: OrderedDict[int, tuple[SemaphoreConfig, OrderedDict[tuple[Any, ...], FairSemaphore]]] = OrderedDict()
_built_lock = fork_locks.reset_in_child()


@dataclass(frozen=True)
class _Template:
    pattern: re.Pattern[str]
    literal_length: int  # the more literal text a template has, the more specific its match
    task: Any
    template: str = ""


class Catalogue:
    """The semaphore tasks of one app, indexed to answer: whose key is this, what limit applies
    to it, and which metrics family counts it? Built from ``app.tasks`` at the time of the call,
    so build a new one when tasks may have been registered since (the metrics collector does
    so on every scrape)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.config: SemaphoreConfig = config_for(app)
        self.fixed: dict[str, Any] = {}
        templates: list[_Template] = []
        self.families: dict[str, str] = {}  # fixed key or template -> its family, for list keys
        for task in semaphore_tasks(app):
            option = key_option(type(task))
            for key in option if isinstance(option, list) else [option]:
                if key is None:
                    self.fixed.setdefault(str(task.name), task)
                elif isinstance(key, str) and is_fixed(key):
                    self.fixed.setdefault(key.format(), task)
                    self.families.setdefault(key.format(), key)
                elif isinstance(key, str):
                    templates.append(_Template(template_pattern(key), literal_length(key), task, key))
        # most specific first: "crawl:{host}" must win over "{anything}" for "crawl:example.com"
        self.templates = sorted(templates, key=lambda template: -template.literal_length)

    @property
    def client(self) -> Any:
        return client_for(self.config.backend)

    @property
    def backend(self) -> str:
        """The backend URL with any password masked, for messages."""
        return self.config.backend_display

    def task_for(self, key: str) -> Any | None:
        """The task whose calls use ``key``: a fixed key first, then the most specific template.
        None when no task accounts for it (a key function, or a semaphore used outside Celery)."""
        task = self.fixed.get(key)
        if task is not None:
            return task
        for template in self.templates:
            if template.pattern.fullmatch(key):
                return template.task
        return None

    def family_for(self, key: str) -> str:
        """The bounded name metrics use for ``key``: the task's key template or name (for a
        task of several keys, the one of its templates that ``key`` matches)."""
        task = self.task_for(key)
        if task is None:
            return OTHER_FAMILY
        if isinstance(key_option(type(task)), list):
            if key in self.fixed:
                return self.families.get(key, key)
            for template in self.templates:
                if template.pattern.fullmatch(key):
                    return template.template
        return template_of(task)

    def configured_limit(self, key: str, task: Any | None = None) -> LimitRule | None:
        """The limit the settings and code give ``key`` (the runtime override aside)."""
        task = self.task_for(key) if task is None else task
        if task is None:
            return self.config.limit_for(key, key, None)
        return self.config.limit_for(key, str(task.name), task)

    def semaphore(self, key: str, *, placeholder_limit: bool = False) -> FairSemaphore:
        """The semaphore of ``key`` as the app's workers use it: its limit and lease.

        ConfigurationError if no limit applies; with ``placeholder_limit`` such a key gets a
        limit of 1 instead, for reading and steering it (status, set_limit, clear_limit and
        reset never use the limit; only acquiring does)."""
        task = self.task_for(key)
        rule = self.configured_limit(key, task)
        if rule is None and not placeholder_limit:
            raise no_limit_error(str(task.name) if task is not None else key, key)
        lease = wait_options(task, self.config).lease if task is not None else self.config.lease
        return _semaphore(self.config, key, rule or LimitRule(1, "placeholder"), lease)

    def scan(self, match: str | None = None) -> set[str]:
        """Every semaphore key that has holders, waiters or a runtime limit in Redis (keys
        matching the glob ``match`` only, if given). On a Redis Cluster every master is scanned."""
        tag = self.config.hash_tag
        if tag is None:
            head, tail, end = f"{self.config.prefix}:{{", "}:*", "}:"
        else:  # "{prefix}:{<tag>}:<name>:<part>" (see SemaphoreKeys.of)
            head, tail, end = f"{self.config.prefix}:{{{tag}}}:", ":*", ":"
        pattern = f"{glob_escape(head)}{match if match is not None else '*'}{tail}"
        keys = set()
        try:
            for raw in self.client.scan_iter(match=pattern, count=1000):
                name = raw.decode() if isinstance(raw, bytes) else str(raw)
                body, _, part = name.rpartition(end)
                if part in _PRESENCE_PARTS and body.startswith(head):
                    keys.add(body[len(head) :])
        except (redis.RedisError, redis.exceptions.RedisClusterException) as error:
            raise SemaphoreError(f"listing semaphores in {self.backend}: {error}") from error
        return keys

    def known_keys(self, match: str | None = None) -> list[str]:
        """The keys found in Redis plus the fixed keys of the app's tasks, sorted."""
        fixed = {key for key in self.fixed if match is None or fnmatch.fnmatchcase(key, match)}
        return sorted(self.scan(match) | fixed)


def semaphore_for(app: Any, key: str) -> FairSemaphore:
    """The semaphore that ``app``'s workers use for ``key``, with its configured limit and lease.

    For user code that steers or inspects a key the way the workers see it (a crawler storing a
    host's allowance with ``set_limit``, a dashboard reading ``status()``). ConfigurationError if
    no limit applies to the key anywhere."""
    return Catalogue(app).semaphore(key)
