"""The ``semaphore_*`` settings of a Celery app, parsed once into a frozen dataclass.

Celery finalizes its configuration on first access, so nothing here reads ``app.conf`` at import
or decoration time: ``config_for(app)`` parses on first use (the worker calls it at start, so a
bad value stops the worker before it takes any task) and caches the result on the app. Settings
are plain Celery settings, so Django's ``CELERY_SEMAPHORE_*`` works through Celery's namespace.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._core import urls as _urls
from .._core.masking import mask_url
from .._core.rules import Rate, check_rate, check_spacing
from .._core.tenants import Shares
from .._core.validation import check_limit, check_prefix, check_seconds
from ..errors import ConfigurationError
from .broker_urls import backend_from_broker

DEFAULT_PREFIX = "semaphore"
DEFAULT_LEASE = 60.0
DEFAULT_COUNTDOWN = (1.0, 30.0)
DEFAULT_INLINE_WAIT = 2.0
# RabbitMQ's default consumer_timeout (30 min)
DEFAULT_BROKER_CONSUMER_TIMEOUT = 1800.0


@dataclass(frozen=True)
class LimitRule:
    """The rules of one key and where they came from, for status output and error messages:
    a concurrency limit, a rate and a spacing, any of which may be absent (not all three)."""

    limit: int | None
    source: str
    rate: Rate | None = None
    spacing: float | None = None
    # a full-line policy from semaphore_limits, which wins over the task's options; None: the
    # task's own (semaphore_max_waiters, semaphore_on_full)
    full_line: tuple[int, str] | None = None
    # most slots one tenant's calls may hold (semaphore_limits' per_tenant); None: no cap
    per_tenant: int | None = None

    @property
    def full_line_setting(self) -> dict[str, Any]:
        """The full-line policy as the setting spells it, for messages."""
        if self.full_line is None:
            return {}
        return {"max_waiters": self.full_line[0], "on_full": self.full_line[1]}


@dataclass(frozen=True)
class KeyRules:
    """One entry of ``semaphore_limits``: an int is a limit; a mapping may name ``limit``,
    ``rate``, ``spacing``, and ``max_waiters`` with ``on_full``. What an entry leaves out, the
    task's own option supplies."""

    limit: int | None = None
    rate: Rate | None = None
    spacing: float | None = None
    full_line: tuple[int, str] | None = None  # (max_waiters, on_full)
    per_tenant: int | None = None
    names: frozenset[str] = frozenset({"limit"})  # the parts the entry gives


@dataclass(frozen=True)
class SemaphoreConfig:
    backend: _urls.BackendSpec  # checked once, at start: the hot path never parses a URL
    prefix: str = DEFAULT_PREFIX
    lease: float = DEFAULT_LEASE
    countdown: tuple[float, float] = DEFAULT_COUNTDOWN
    countdown_given: bool = False  # semaphore_countdown was set
    max_wait: float | None = None
    fail_open: bool = False
    inline_wait: float = DEFAULT_INLINE_WAIT
    exact_limits: Mapping[str, KeyRules] = field(default_factory=dict)
    glob_limits: tuple[tuple[str, KeyRules], ...] = ()
    # seconds after which the Redis broker redelivers an unacked message; None for other brokers
    visibility_timeout: float | None = None
    # the broker's Redis (plain or Sentinel), where waiting tasks' due-later copies are kept
    # (due_copies.py); None for other brokers
    broker_redis: _urls.BackendSpec | None = None
    # how long the broker lets a consumer hold a message unacknowledged (RabbitMQ's
    # consumer_timeout): a worker holds a waiting task's copy half as long at most (backstop.py)
    broker_consumer_timeout: float = DEFAULT_BROKER_CONSUMER_TIMEOUT
    # one Redis Cluster hash tag for every semaphore of the app (tasks with several keys need it
    # on a cluster); None: each semaphore in the slot of its own key
    hash_tag: str | None = None
    # semaphore_shares, checked: each tenant's share of a key's line (tenants.py)
    shares: Shares = field(default_factory=lambda: Shares("semaphore_shares", None))
    # a task that would wait takes its place as it is sent, and is delivered once (placing.py)
    place_at_send: bool = True

    def limit_for(self, key: str, task_name: str, task: Any | None) -> LimitRule | None:
        """The configured rules of one semaphore key: an exact key, the task name, a glob over
        the key, a glob over the task name, then the task's own options (``semaphore_limit``,
        ``semaphore_rate``, ``semaphore_spacing``) for what the entry leaves out. None when no
        limit, rate or spacing applies. (Runtime overrides stored in Redis win over all of these;
        the scripts apply them.)"""
        entry, source = self._entry_for(key, task_name)
        own_limit, own_rate, own_spacing = task_rules(task)
        limit = entry.limit if entry is not None and "limit" in entry.names else own_limit
        rate = entry.rate if entry is not None and "rate" in entry.names else own_rate
        spacing = entry.spacing if entry is not None and "spacing" in entry.names else own_spacing
        if limit is None and rate is None and spacing is None:
            return None
        full_line = entry.full_line if entry is not None else None
        per_tenant = entry.per_tenant if entry is not None else None
        return LimitRule(limit, source or f"{task_name}.semaphore_limit", rate, spacing, full_line, per_tenant)

    def _entry_for(self, key: str, task_name: str) -> tuple[KeyRules | None, str | None]:
        for name in (key, task_name):
            if name in self.exact_limits:
                return self.exact_limits[name], f"semaphore_limits[{name!r}]"
        for name in (key, task_name):
            for pattern, entry in self.glob_limits:
                if fnmatch.fnmatchcase(name, pattern):
                    return entry, f"semaphore_limits[{pattern!r}]"
        return None, None

    @property
    def backend_display(self) -> str:
        """The backend, password masked: for logs and messages."""
        return self.backend.masked_url


def parse_countdown(setting: str, value: Any) -> tuple[float, float]:
    """Seconds, or a (min, max) pair; whole seconds >= 1, since RabbitMQ quorum queues deliver
    delays in whole seconds and a shorter countdown only spins the broker."""
    pair = (value, value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise ConfigurationError(setting, value, "expected seconds or a (min, max) pair of seconds")
    low, high = (check_seconds(setting, part) for part in pair)
    if low < 1:
        raise ConfigurationError(setting, value, "countdowns are at least 1 second")
    if high < low:
        raise ConfigurationError(setting, value, "the max countdown is below the min")
    return low, high


def parse_max_wait(setting: str, value: Any) -> float | None:
    return None if value is None else check_seconds(setting, value)


def parse_limits(value: Any) -> tuple[dict[str, KeyRules], tuple[tuple[str, KeyRules], ...]]:
    if value is None:
        return {}, ()
    if not isinstance(value, Mapping):
        raise ConfigurationError("semaphore_limits", value, "expected a mapping of task name or key to limit")
    exact: dict[str, KeyRules] = {}
    globs: list[tuple[str, KeyRules]] = []
    for name, rules in value.items():
        if not isinstance(name, str) or not name:
            # the entry is what is wrong, not the whole setting: name it, and show its value
            raise ConfigurationError(
                f"semaphore_limits[{name!r}]", rules, "the key must be a task name or a semaphore key (a non-empty str)"
            )
        entry = parse_key_rules(f"semaphore_limits[{name!r}]", rules)
        if any(char in name for char in "*?["):
            globs.append((name, entry))
        else:
            exact[name] = entry
    return exact, tuple(globs)


_RULE_NAMES = frozenset({"limit", "rate", "spacing", "max_waiters", "on_full", "per_tenant"})
# the full-line policies a setting may name: "keep_latest" needs the task's coalesce key
_SETTING_ON_FULL = ("reject", "drop_oldest")


def parse_key_rules(setting: str, value: Any) -> KeyRules:
    """An int (the concurrency limit), or a mapping of ``limit``, ``rate``, ``spacing``,
    ``max_waiters`` and ``on_full``, ``per_tenant``: each checked here, at start, and named in
    the error."""
    if not isinstance(value, Mapping):
        return KeyRules(limit=check_limit(setting, value))
    unknown = set(value) - _RULE_NAMES
    if unknown:
        raise ConfigurationError(
            setting,
            value,
            f"unknown part {sorted(map(str, unknown))[0]!r}: expected limit, rate, spacing, max_waiters, on_full"
            " and per_tenant",
        )
    if not set(value) & {"limit", "rate", "spacing"}:
        raise ConfigurationError(setting, value, "expected at least one of limit, rate and spacing")
    limit = value.get("limit")
    return KeyRules(
        limit=None if limit is None else check_limit(f"{setting}['limit']", limit),
        rate=check_rate(f"{setting}['rate']", value.get("rate")),
        spacing=check_spacing(f"{setting}['spacing']", value.get("spacing")),
        full_line=_full_line(setting, value),
        per_tenant=None if "per_tenant" not in value else check_limit(f"{setting}['per_tenant']", value["per_tenant"]),
        names=frozenset(value),
    )


def _full_line(setting: str, value: Mapping[str, Any]) -> tuple[int, str] | None:
    """An entry's ``max_waiters`` and ``on_full``: both or neither (a cap that waits caps
    nothing, and a policy needs a cap to act on)."""
    if "max_waiters" not in value and "on_full" not in value:
        return None
    if "max_waiters" not in value:
        raise ConfigurationError(f"{setting}['on_full']", value["on_full"], "needs max_waiters beside it")
    max_waiters = check_limit(f"{setting}['max_waiters']", value["max_waiters"])
    on_full = value.get("on_full")
    if on_full not in _SETTING_ON_FULL:
        raise ConfigurationError(
            f"{setting}['on_full']",
            on_full,
            'expected "reject" or "drop_oldest" beside max_waiters ("keep_latest" needs the task\'s '
            "semaphore_coalesce_by: set it on the task)",
        )
    return max_waiters, str(on_full)


def task_rules(task: Any | None) -> tuple[int | None, Rate | None, float | None]:
    """A task's own ``semaphore_limit``, ``semaphore_rate`` and ``semaphore_spacing`` (checked
    when its class was declared)."""
    if task is None:
        return None, None, None
    rate = getattr(task, "semaphore_rate", None)
    spacing = getattr(task, "semaphore_spacing", None)
    return (
        getattr(task, "semaphore_limit", None),
        check_rate(f"{task.name}.semaphore_rate", rate),
        check_spacing(f"{task.name}.semaphore_spacing", spacing),
    )


def parse_config(app: Any) -> SemaphoreConfig:
    """Read and check every ``semaphore_*`` setting of ``app``; raises ConfigurationError."""
    conf = app.conf
    transport_options = conf.get("broker_transport_options") or {}
    url = conf.get("semaphore_backend_url")
    broker = backend_from_broker(conf.broker_url, transport_options, use_ssl=conf.get("broker_use_ssl"))
    if url is None:
        if broker is None:
            raise ConfigurationError(
                "semaphore_backend_url",
                None,
                f"not set, and the broker URL {mask_url(_joined(conf.broker_url))!r} is not a Redis to default to",
            )
        backend = broker
    else:
        backend = _urls.parse_backend_url("semaphore_backend_url", url)
    fail_open = conf.get("semaphore_fail_open", False)
    if not isinstance(fail_open, bool):
        raise ConfigurationError("semaphore_fail_open", fail_open, "expected True or False")
    place_at_send = conf.get("semaphore_place_at_send", True)
    if not isinstance(place_at_send, bool):
        raise ConfigurationError("semaphore_place_at_send", place_at_send, "expected True or False")
    exact, globs = parse_limits(conf.get("semaphore_limits"))
    # a Redis broker (plain or Sentinel) redelivers an unacked message after this long
    visibility_timeout = float(transport_options.get("visibility_timeout", 3600)) if broker is not None else None
    return SemaphoreConfig(
        backend=backend,
        prefix=check_prefix("semaphore_prefix", conf.get("semaphore_prefix", DEFAULT_PREFIX)),
        lease=check_seconds("semaphore_lease", conf.get("semaphore_lease", DEFAULT_LEASE)),
        countdown=parse_countdown("semaphore_countdown", conf.get("semaphore_countdown", DEFAULT_COUNTDOWN)),
        countdown_given=conf.get("semaphore_countdown") is not None,
        max_wait=parse_max_wait("semaphore_max_wait", conf.get("semaphore_max_wait")),
        fail_open=fail_open,
        inline_wait=check_seconds(
            "semaphore_inline_wait", conf.get("semaphore_inline_wait", DEFAULT_INLINE_WAIT), allow_zero=True
        ),
        exact_limits=exact,
        glob_limits=globs,
        visibility_timeout=visibility_timeout,
        broker_redis=broker,
        broker_consumer_timeout=check_seconds(
            "semaphore_broker_consumer_timeout",
            conf.get("semaphore_broker_consumer_timeout", DEFAULT_BROKER_CONSUMER_TIMEOUT),
        ),
        hash_tag=_hash_tag(conf.get("semaphore_hash_tag")),
        shares=Shares("semaphore_shares", conf.get("semaphore_shares")),
        place_at_send=place_at_send,
    )


def _hash_tag(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or any(char in value for char in "{}"):
        raise ConfigurationError("semaphore_hash_tag", value, "expected a non-empty str without braces, or None")
    return value


_configs: weakref.WeakKeyDictionary[Any, SemaphoreConfig] = weakref.WeakKeyDictionary()


def config_for(app: Any) -> SemaphoreConfig:
    """The parsed settings of ``app``, parsed on first use and then cached."""
    try:
        return _configs[app]
    except KeyError:
        config = _configs[app] = parse_config(app)
        return config


def forget_config(app: Any) -> None:
    """Drop the cached settings (tests and long-lived shells that change ``app.conf``)."""
    _configs.pop(app, None)


def _joined(broker_url: Any) -> str:
    """A broker setting (a URL, a ``;``-joined string or a list) as one string, for messages."""
    return ";".join(str(url) for url in broker_url) if isinstance(broker_url, (list, tuple)) else str(broker_url)
