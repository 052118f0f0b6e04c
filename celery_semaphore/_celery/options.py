"""The ``semaphore_*`` options of a task class: checked when the class is declared, resolved
against the app's settings when a call needs them.

Kept apart from the run-time hook (``task.py``) so that the worker's start check, the catalogue
and the CLI can read a task's options without importing the hook, and so that every option is
checked in one place, at declaration: a bad value never waits for the first task to fail.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from .._core.rules import check_rate, check_spacing
from .._core.tenants import Tenant, check_tenant
from .._core.validation import check_limit, check_on_full, check_seconds, priority_ms
from ..errors import ConfigurationError
from .config import SemaphoreConfig, parse_countdown
from .keys import KeyFunction, call_key, check_template

# Set on SemaphoreTask: how code that must not import the Celery hook (the catalogue, the
# worker's parent-side release) recognises a semaphore task.
MARKER = "__semaphore_task__"

# ``semaphore_key``: one key (a template or a key function) or a list of them
KeyOption: TypeAlias = str | KeyFunction | list[str | KeyFunction]
# ``semaphore_weight``: slots one execution takes of each of its keys
WeightFunction = Callable[[tuple[Any, ...], dict[str, Any]], int]


class _FromSettings:
    """Marks an option left to the app's ``semaphore_*`` setting (None has its own meaning)."""

    def __repr__(self) -> str:
        return "FROM_SETTINGS"


FROM_SETTINGS: Any = _FromSettings()


def is_semaphore_task(task: Any) -> bool:
    return bool(getattr(type(task), MARKER, False))


def _unbound(value: Any) -> Any:
    return value.__func__ if isinstance(value, staticmethod) else value


def key_option(cls: type) -> KeyOption | None:
    """The ``semaphore_key`` option as declared: a function stored on a class would otherwise
    come back bound, as a method of the task. A tuple comes back as a list."""
    key = _unbound(inspect.getattr_static(cls, "semaphore_key", None))
    if isinstance(key, (list, tuple)):
        return [_unbound(item) for item in key]
    return key  # type: ignore[no-any-return]


def weight_option(cls: type) -> int | WeightFunction | None:
    """The ``semaphore_weight`` option as declared (None: one slot)."""
    return _unbound(inspect.getattr_static(cls, "semaphore_weight", None))  # type: ignore[no-any-return]


def weight_of_call(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The slots one call takes of each of its keys; ConfigurationError for a bad answer."""
    weight = weight_option(type(task))
    if weight is None:
        return 1
    if callable(weight):
        weight = weight(args, kwargs)
    return check_limit(f"{task.name}.semaphore_weight", weight)


def text_option(cls: type, option: str) -> str | KeyFunction | None:
    """A template-or-function option as declared (``semaphore_fair_by``,
    ``semaphore_coalesce_by``): a function stored on a class would otherwise come back bound."""
    return _unbound(inspect.getattr_static(cls, option, None))  # type: ignore[no-any-return]


FairBy = str | KeyFunction


def fair_by_option(cls: type) -> FairBy | tuple[FairBy, FairBy] | None:
    """The ``semaphore_fair_by`` option as declared (None: one first-come line; a pair: two
    levels, org then user)."""
    declared = _unbound(inspect.getattr_static(cls, "semaphore_fair_by", None))
    if isinstance(declared, tuple):
        return tuple(_unbound(level) for level in declared)
    return declared  # type: ignore[no-any-return]


def _text_of_call(task: Any, option: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """A template-or-function option filled in for one call (None without the option)."""
    declared = text_option(type(task), option)
    if declared is None:
        return None
    return call_key(f"{task.name}.{option}", declared, task.run, args, kwargs)


def tenant_of_call(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tenant | None:
    """The tenant one call waits for, from ``semaphore_fair_by`` (None without the option); with
    two levels, (org, user)."""
    declared = fair_by_option(type(task))
    setting = f"{task.name}.semaphore_fair_by"
    if declared is None:
        return None
    if isinstance(declared, tuple):
        org, user = (
            check_tenant(f"{setting}[{level}]", call_key(f"{setting}[{level}]", part, task.run, args, kwargs))
            for level, part in enumerate(declared)
        )
        return org, user
    return check_tenant(setting, call_key(setting, declared, task.run, args, kwargs))


# the message header a caller sets to give one call its own priority (the option's name, so that
# ``send_task(..., headers={"semaphore_priority": 60})`` works too)
PRIORITY_HEADER = "semaphore_priority"
PriorityFunction = Callable[[tuple[Any, ...], dict[str, Any]], float]


def priority_option(cls: type) -> float | PriorityFunction | None:
    """The ``semaphore_priority`` option as declared (None: none)."""
    return _unbound(inspect.getattr_static(cls, "semaphore_priority", None))  # type: ignore[no-any-return]


def priority_of_call(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """Seconds one call is placed earlier in line: the message's ``semaphore_priority`` header
    (set per call), else the task's option (a number, or a function of the arguments), else 0.
    Checked here, so a bad header or function answer fails the task naming where it came from."""
    header = getattr(task.request, PRIORITY_HEADER, None)
    if header is not None:
        return priority_ms(f"{task.name}: header {PRIORITY_HEADER}", header) / 1000
    option = priority_option(type(task))
    if option is None:
        return 0.0
    value = option(args, kwargs) if callable(option) else option
    return priority_ms(f"{task.name}.semaphore_priority", value) / 1000


def full_line_of(task: Any) -> tuple[int | None, str]:
    """The task's ``semaphore_max_waiters`` and ``semaphore_on_full`` as the semaphore takes
    them: (None, "reject") when the line is not capped ("wait", the default)."""
    on_full = getattr(task, "semaphore_on_full", "wait")
    if on_full == "wait":
        return None, "reject"
    return getattr(task, "semaphore_max_waiters", None), str(on_full)


def coalesce_of_call(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The coalesce key of one call (with ``semaphore_on_full="keep_latest"``), else None."""
    return _text_of_call(task, "semaphore_coalesce_by", args, kwargs)


def _check_full_line(name: str, cls: type, parameters: list[inspect.Parameter] | None) -> None:
    """``semaphore_max_waiters``, ``semaphore_on_full`` and ``semaphore_coalesce_by``: a policy
    with what it needs ("reject" and "drop_oldest" a cap, "keep_latest" a coalesce key), and
    no cap without a policy (a cap that only waits would cap nothing)."""
    options = cls.__dict__
    max_waiters = options.get("semaphore_max_waiters")
    on_full = options.get("semaphore_on_full", "wait")
    coalesce = text_option(cls, "semaphore_coalesce_by")
    if max_waiters is not None:
        check_limit(f"{name}.semaphore_max_waiters", max_waiters)
    if on_full != "wait":
        check_on_full(f"{name}.semaphore_on_full", on_full, max_waiters)
    if on_full == "reject" and max_waiters is None:
        raise ConfigurationError(f"{name}.semaphore_on_full", on_full, "needs semaphore_max_waiters")
    if on_full == "wait" and max_waiters is not None:
        raise ConfigurationError(
            f"{name}.semaphore_max_waiters",
            max_waiters,
            'needs semaphore_on_full: "reject", "drop_oldest" or "keep_latest" (a cap that waits caps nothing)',
        )
    if (on_full == "keep_latest") != (coalesce is not None):
        raise ConfigurationError(
            f"{name}.semaphore_coalesce_by", coalesce, 'goes with semaphore_on_full="keep_latest", and it with this'
        )
    if isinstance(coalesce, str) and parameters is not None:
        check_template(f"{name}.semaphore_coalesce_by", coalesce, parameters)
    if on_full != "wait" and (isinstance(key_option(cls), list) or weight_option(cls) is not None):
        raise ConfigurationError(
            f"{name}.semaphore_on_full", on_full, "works on a task of one semaphore_key and no semaphore_weight"
        )


def _check_fair_by(name: str, cls: type, parameters: list[inspect.Parameter] | None) -> None:
    """``semaphore_fair_by``: a template over the task's arguments or a function of them; on a
    task of one key and one slot (the tenant orders one line: a call over several keys waits
    in several lines at once, in first-ask order)."""
    fair_by = fair_by_option(cls)
    setting = f"{name}.semaphore_fair_by"
    if isinstance(fair_by, tuple):
        if len(fair_by) != 2:
            raise ConfigurationError(setting, fair_by, "two levels are a pair (org, user) of templates or callables")
        for level, part in enumerate(fair_by):
            _check_one_fair_by(f"{setting}[{level}]", part, parameters)
    elif fair_by is not None:
        _check_one_fair_by(setting, fair_by, parameters)
    if fair_by is not None and (isinstance(key_option(cls), list) or weight_option(cls) is not None):
        raise ConfigurationError(setting, fair_by, "works on a task of one semaphore_key and no semaphore_weight")


def _check_one_fair_by(setting: str, fair_by: Any, parameters: list[inspect.Parameter] | None) -> None:
    if callable(fair_by):
        return
    if not isinstance(fair_by, str) or not fair_by:
        raise ConfigurationError(setting, fair_by, "expected a format string or a callable (args, kwargs)")
    if parameters is not None:
        check_template(setting, fair_by, parameters)


def template_of(task: Any) -> str:
    """The task's key as a template: its ``semaphore_key`` string, else its name. A key
    function has no template; the task name stands for it (metrics, status). Several keys:
    their templates joined by "+"."""
    key = key_option(type(task))
    if isinstance(key, list):
        return "+".join(item if isinstance(item, str) else str(task.name) for item in key)
    return key if isinstance(key, str) else str(task.name)


def _run_parameters(cls: type) -> list[inspect.Parameter] | None:
    run = cls.__dict__.get("run")
    if run is None:
        return None
    if isinstance(run, staticmethod):
        return list(inspect.signature(run.__func__).parameters.values())
    parameters = list(inspect.signature(run).parameters.values())
    return parameters[1:]  # drop self


def check_task_options(cls: type) -> None:
    """Check the semaphore options a task class declares; ConfigurationError on the first bad one."""
    name = cls.__dict__.get("name") or cls.__name__
    options = cls.__dict__
    if options.get("semaphore_limit") is not None:
        check_limit(f"{name}.semaphore_limit", options["semaphore_limit"])
    rate = check_rate(f"{name}.semaphore_rate", options.get("semaphore_rate"))
    check_spacing(f"{name}.semaphore_spacing", options.get("semaphore_spacing"))
    for option in ("semaphore_lease", "semaphore_inline_wait"):
        if options.get(option) is not None:
            check_seconds(f"{name}.{option}", options[option], allow_zero=option == "semaphore_inline_wait")
    if options.get("semaphore_max_wait") not in (None, FROM_SETTINGS):
        check_seconds(f"{name}.semaphore_max_wait", options["semaphore_max_wait"])
    if options.get("semaphore_countdown") is not None:
        parse_countdown(f"{name}.semaphore_countdown", options["semaphore_countdown"])
    weight = options.get("semaphore_weight")
    if weight is not None and not callable(weight) and not isinstance(weight, staticmethod):
        check_limit(f"{name}.semaphore_weight", weight)
        limit = options.get("semaphore_limit")
        if limit is not None and weight > limit:
            raise ConfigurationError(
                f"{name}.semaphore_weight", weight, f"above the task's semaphore_limit {limit}: it would wait forever"
            )
        if rate is not None and weight > rate.count:
            raise ConfigurationError(
                f"{name}.semaphore_weight", weight, f"above the task's semaphore_rate {rate}: it would wait forever"
            )
    # the key may be inherited from a base class: check it against every class that has a run
    key = key_option(cls)
    keys = key if isinstance(key, list) else [key]
    if isinstance(key, list) and not key:
        raise ConfigurationError(f"{name}.semaphore_key", key, "an empty list of keys")
    parameters = _run_parameters(cls)
    for item in keys:
        if item is None or callable(item):
            if item is None and isinstance(key, list):
                raise ConfigurationError(f"{name}.semaphore_key", key, "None in a list of keys")
            continue
        if not isinstance(item, str) or not item:
            raise ConfigurationError(
                f"{name}.semaphore_key",
                item,
                "expected a format string or a callable (args, kwargs), or a list of these",
            )
        if parameters is not None:
            check_template(f"{name}.semaphore_key", item, parameters)
    _check_fair_by(name, cls, parameters)
    _check_full_line(name, cls, parameters)
    priority = priority_option(cls)
    if priority is not None and not callable(priority):
        priority_ms(f"{name}.semaphore_priority", priority)


@dataclass(frozen=True)
class WaitOptions:
    """How one task holds and waits, its own options over the app's settings."""

    lease: float
    countdown: tuple[float, float]
    max_wait: float | None
    inline_wait: float
    # the countdown was set (task option or app setting): it also bounds a parked task's backstop
    countdown_given: bool = False


def wait_options(task: Any, config: SemaphoreConfig) -> WaitOptions:
    """The task's options, each one left unset taking the app's ``semaphore_*`` setting."""
    countdown = task.semaphore_countdown
    max_wait = task.semaphore_max_wait
    return WaitOptions(
        lease=config.lease if task.semaphore_lease is None else float(task.semaphore_lease),
        countdown=config.countdown
        if countdown is None
        else parse_countdown(f"{task.name}.semaphore_countdown", countdown),
        max_wait=config.max_wait if max_wait is FROM_SETTINGS else max_wait,
        inline_wait=config.inline_wait if task.semaphore_inline_wait is None else float(task.semaphore_inline_wait),
        countdown_given=countdown is not None or config.countdown_given,
    )
