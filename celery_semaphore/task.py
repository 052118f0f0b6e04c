"""SemaphoreTask: a Celery task that holds a semaphore slot while its body runs.

The slot is taken in the worker, right before the body, and given back in a ``finally``: so
every way out of the body (return, exception, the task's own ``retry``, ``Ignore``, ``Reject``,
a soft time limit, the ``SystemExit`` of ``revoke(terminate=True)``) releases it. What kills the
process outright (SIGKILL, OOM, a hard time limit) runs no ``finally``: the worker's parent
process then releases by task id (see ``worker.py``), and the lease is the last resort.

A task that finds no free slot is not run. It either waits a moment in-process for a release
(when its turn is near) or is re-sent with a countdown under the same task id, keeping its
ticket and so its place in line. Waiting is not retrying: ``request.retries`` and the task's
``max_retries`` are left alone; the wait count and the time of the first refusal travel in
message headers.
"""

from __future__ import annotations

import inspect
import logging
import re
import string
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Retry

from . import metrics, policy
from .backend import client_for
from .config import SemaphoreConfig, config_for, parse_countdown
from .errors import ConfigurationError, RedisUnavailable, SemaphoreError, SemaphoreUnavailable
from .semaphore import FairSemaphore, Granted, Lease, Waiting, default_label, new_token
from .validation import check_limit, check_name, check_seconds

logger = logging.getLogger("celery_semaphore")

# Message headers that carry a waiting task's history across re-sends.
WAITS_HEADER = "semaphore_waits"
FIRST_REFUSED_HEADER = "semaphore_first_refused"
TICKET_HEADER = "semaphore_ticket"

# A waiter away on a countdown keeps its place this much longer than the countdown, to cover
# the broker's delivery and a busy worker's delay in starting it.
AWAY_SLACK = 15.0

# Releasing when Redis is unreachable: tries in the background, the lease is the backstop.
RELEASE_TRIES = 5
RELEASE_PAUSE = 0.5

KeyFunction = Callable[[tuple[Any, ...], dict[str, Any]], str]


class _FromSettings:
    """Marks an option left to the app's ``semaphore_*`` setting (None has its own meaning)."""

    def __repr__(self) -> str:
        return "FROM_SETTINGS"


FROM_SETTINGS: Any = _FromSettings()


class SemaphoreTask(Task):  # type: ignore[misc]
    """A task that runs only while it holds a slot of its semaphore.

    Options (class attributes, or ``app.task(base=SemaphoreTask, semaphore_limit=5, ...)``):
    ``semaphore_limit``, ``semaphore_key``, ``semaphore_lease``, ``semaphore_countdown``,
    ``semaphore_max_wait``, ``semaphore_inline_wait``; each one left unset takes the app's
    ``semaphore_*`` setting.
    """

    semaphore_limit: ClassVar[int | None] = None
    semaphore_key: ClassVar[str | KeyFunction | None] = None
    semaphore_lease: ClassVar[float | None] = None
    semaphore_countdown: ClassVar[float | tuple[float, float] | None] = None
    semaphore_max_wait: ClassVar[float | None] = FROM_SETTINGS
    semaphore_inline_wait: ClassVar[float | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_task_options(cls)

    @classmethod
    def bind(cls, app: Any) -> Any:
        bound = super().bind(app)
        from .worker import install

        install(app)
        return bound

    # -- what this execution is limited by --------------------------------------------------

    def semaphore_key_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The semaphore key of one call: the task name, a template filled from the bound
        arguments, or what the key function returns."""
        key = key_option(type(self))
        if key is None:
            return str(self.name)
        if callable(key):
            return check_name(f"{self.name}.semaphore_key", key(args, kwargs))
        bound = inspect.signature(self.run).bind(*args, **kwargs)
        bound.apply_defaults()
        return key.format(*bound.args, **bound.arguments)

    def semaphore_family(self) -> str:
        """A bounded name for metrics: the key template (``crawl:{host}``), not each key."""
        key = key_option(type(self))
        if isinstance(key, str):
            return key
        return str(self.name)

    def semaphore_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> FairSemaphore:
        """The semaphore one call of this task must hold; ConfigurationError if no limit applies."""
        config = config_for(self.app)
        key = self.semaphore_key_for(args, kwargs)
        rule = config.limit_for(key, self.name, self.semaphore_limit)
        if rule is None:
            raise ConfigurationError(
                f"{self.name}.semaphore_limit", None, f"no limit for semaphore key {key!r} in code or semaphore_limits"
            )
        return FairSemaphore(
            client_for(config.backend_url),
            key,
            rule.limit,
            lease=self._option("semaphore_lease", config.lease),
            prefix=config.prefix,
        )

    def countdown_bounds(self, config: SemaphoreConfig) -> tuple[float, float]:
        if self.semaphore_countdown is None:
            return config.countdown
        return parse_countdown(f"{self.name}.semaphore_countdown", self.semaphore_countdown)

    def max_wait(self, config: SemaphoreConfig) -> float | None:
        value = self.semaphore_max_wait
        return config.max_wait if value is FROM_SETTINGS else value

    def _option(self, name: str, default: float) -> float:
        value = getattr(self, name)
        return default if value is None else float(value)

    # -- the hook ------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            # a plain function call, outside Celery: not limited
            return super().__call__(*args, **kwargs)
        semaphore = self.semaphore_for(args, kwargs)
        if request.is_eager:
            lease: Lease | None = self._acquire_eagerly(semaphore)
        else:
            lease = self._acquire_in_worker(semaphore, args, kwargs)
        request.semaphore_lease = lease
        try:
            return super().__call__(*args, **kwargs)
        finally:
            if lease is not None:
                release_in_background_on_failure(lease)

    def _label(self) -> str:
        return f"{default_label()} {self.name}[{self.request.id}]"

    def _acquire_eagerly(self, semaphore: FairSemaphore) -> Lease:
        """Eager mode runs a retry at once and recursively, ignoring its countdown, so a refused
        eager task waits for its slot here instead (bounded by the max wait)."""
        started = time.monotonic()
        lease = semaphore.acquire(timeout=self.max_wait(config_for(self.app)), label=self._label())
        lease.family = self.semaphore_family()
        metrics.acquired(lease.family, time.monotonic() - started)
        return lease

    def _acquire_in_worker(
        self, semaphore: FairSemaphore, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Lease | None:
        config = config_for(self.app)
        request = self.request
        waits = int(_header(request, WAITS_HEADER) or 0)
        first_refused = _header(request, FIRST_REFUSED_HEADER)
        ticket = _header(request, TICKET_HEADER)
        token, waiter = f"{request.id}:{new_token()}", str(request.id)
        asked_at = time.time()
        try:
            attempt = semaphore.try_acquire(
                token=token, waiter=waiter, label=self._label(), ticket=int(ticket) if ticket else None
            )
            inline_wait = self._option("semaphore_inline_wait", config.inline_wait)
            if isinstance(attempt, Waiting) and policy.waits_in_process(attempt, inline_wait):
                attempt = semaphore.wait_for_slot(
                    token=token, waiter=waiter, timeout=inline_wait, label=self._label(), ticket=attempt.ticket
                )
        except RedisUnavailable as error:
            if config.fail_open:
                logger.warning("%s[%s] runs WITHOUT its semaphore %r (fail open): %s", self.name, request.id,
                               semaphore.name, error)
                return None
            logger.warning("%s[%s] waits: Redis unavailable for %r: %s", self.name, request.id, semaphore.name, error)
            attempt = Waiting(position=0, free=0, limit=semaphore.limit)
        now = time.time()
        first_refused = float(first_refused) if first_refused is not None else asked_at
        waited = max(0.0, now - first_refused)
        if isinstance(attempt, Granted):
            attempt.lease.family = self.semaphore_family()
            metrics.acquired(attempt.lease.family, waited)
            return attempt.lease
        metrics.refused(self.semaphore_family())
        max_wait = self.max_wait(config)
        if max_wait is not None and waited >= max_wait:
            _leave_quietly(semaphore, waiter)
            raise SemaphoreUnavailable(semaphore.name, attempt.limit, waited)
        countdown = policy.countdown(
            attempt, self.countdown_bounds(config), waits=waits, visibility_timeout=config.visibility_timeout
        )
        if max_wait is not None:
            countdown = max(1, min(countdown, round(max_wait - waited + 0.5)))
        # Step away while asleep in the broker: a waiter that is not asking must not hold up
        # those behind it. It keeps its place (and shows in status); should the place lapse, its
        # ticket travels in the headers and puts it back where it was.
        _leave_quietly(semaphore, waiter, away_for=countdown + AWAY_SLACK)
        headers = {
            **(request.headers or {}),
            WAITS_HEADER: waits + 1,
            FIRST_REFUSED_HEADER: first_refused,
            TICKET_HEADER: attempt.ticket if attempt.ticket is not None else ticket,
        }
        signature = self.signature_from_request(request, args, kwargs, countdown=countdown, headers=headers)
        try:
            signature.apply_async()
        except Exception as error:
            raise SemaphoreError(f"could not re-send {self.name}[{request.id}] to wait for {semaphore.name!r}: "
                                 f"{error}", key=semaphore.name) from error
        raise Retry(
            f"waiting for a slot of {semaphore.name!r}: place {attempt.position} in line, retry in {countdown} s",
            when=countdown,
            sig=signature,
        )


def key_option(cls: type) -> str | KeyFunction | None:
    """The ``semaphore_key`` option as declared: a function stored on a class would otherwise
    come back bound, as a method of the task."""
    key = inspect.getattr_static(cls, "semaphore_key", None)
    if isinstance(key, staticmethod):
        key = key.__func__
    return key  # type: ignore[no-any-return]


def _header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


def _leave_quietly(semaphore: FairSemaphore, waiter: str, *, away_for: float | None = None) -> None:
    try:
        semaphore.leave(waiter, away_for=away_for)
    except SemaphoreError as error:
        logger.warning("could not leave the line of %r (it lapses by itself): %s", semaphore.name, error)


def release_in_background_on_failure(lease: Lease) -> None:
    """Release now; if Redis is unreachable, keep trying briefly in a daemon thread, so the
    task's result is not held up. The lease expiring is the backstop."""
    try:
        if not lease.release() and lease.lost:
            logger.warning("%r: the lease had been lost before the task ended", lease)
        return
    except RedisUnavailable as error:
        logger.warning("release of %r failed, retrying in the background: %s", lease, error)

    def retry() -> None:
        for attempt in range(RELEASE_TRIES):
            time.sleep(RELEASE_PAUSE * (attempt + 1))
            try:
                lease.semaphore.release(lease.token)
                return
            except RedisUnavailable:
                continue
        logger.error("%r could not be released; its slot comes back when the lease ends", lease)

    threading.Thread(target=retry, name="celery-semaphore-release", daemon=True).start()


# -- declaration-time checks ------------------------------------------------------------------

_FIELD_NAME = re.compile(r"[^.\[]*")


def template_fields(template: str) -> list[str]:
    """The argument names (or positions) a key template refers to."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            match = _FIELD_NAME.match(field)
            names.append(match.group(0) if match else field)
    return names


def sample_key(template: str) -> str:
    """The template with every field filled by a placeholder, to test globs against."""
    parts = string.Formatter().parse(template)
    return "".join(literal + ("x" if field is not None else "") for literal, field, _, _ in parts)


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
    for option in ("semaphore_lease", "semaphore_inline_wait"):
        if options.get(option) is not None:
            check_seconds(f"{name}.{option}", options[option], allow_zero=option == "semaphore_inline_wait")
    if options.get("semaphore_max_wait") not in (None, FROM_SETTINGS):
        check_seconds(f"{name}.semaphore_max_wait", options["semaphore_max_wait"])
    if options.get("semaphore_countdown") is not None:
        parse_countdown(f"{name}.semaphore_countdown", options["semaphore_countdown"])
    # the key may be inherited from a base class: check it against every class that has a run
    key = key_option(cls)
    if key is None or callable(key):
        return
    if not isinstance(key, str) or not key:
        raise ConfigurationError(f"{name}.semaphore_key", key, "expected a format string or a callable (args, kwargs)")
    parameters = _run_parameters(cls)
    if parameters is None:
        return
    check_template(f"{name}.semaphore_key", key, parameters)


def check_template(setting: str, template: str, parameters: list[inspect.Parameter]) -> None:
    """Every field of the template must name an argument of the task (or a valid position)."""
    try:
        fields = template_fields(template)
    except ValueError as error:
        raise ConfigurationError(setting, template, f"not a valid format string: {error}") from error
    names = {p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
    any_positional = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    for field in fields:
        if field == "" or field.isdigit():
            index = int(field) if field else 0
            if not (any_positional or index < len(positional)):
                raise ConfigurationError(setting, template, f"positional field {{{field}}} is not an argument")
        elif field not in names and not any_keyword:
            raise ConfigurationError(
                setting, template, f"names argument {field!r}, which the task does not take ({sorted(names)})"
            )
