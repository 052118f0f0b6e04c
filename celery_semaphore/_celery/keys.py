"""Semaphore key templates: ``"crawl:{host}"`` filled from a task call's bound arguments.

The one place that parses a template, so the declaration check, the per-call key, the worker's
start check, the CLI's key-to-task lookup and the metrics family all read a template the same
way. A template is an ordinary ``str.format`` string over the task's arguments by name
(``{host}``) or position (``{0}``); attribute and index access (``{user.id}``) work as in
``format``.
"""

from __future__ import annotations

import functools
import inspect
import re
import string
from collections.abc import Callable
from typing import Any

from .._core.validation import check_name
from ..errors import ConfigurationError

KeyFunction = Callable[[tuple[Any, ...], dict[str, Any]], str]

_FIELD_NAME = re.compile(r"[^.\[]*")


def template_fields(template: str) -> list[str]:
    """The argument names (or positions, as digit strings; ``""`` for ``{}``) a template uses.

    Raises ValueError for a malformed template (an unclosed brace, say)."""
    names = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is not None:
            match = _FIELD_NAME.match(field)
            names.append(match.group(0) if match else field)
    return names


def is_fixed(template: str) -> bool:
    """Whether every call gets the same key (the template has no fields)."""
    return not template_fields(template)


def sample_key(template: str) -> str:
    """The template with every field filled by a placeholder, to test globs of
    ``semaphore_limits`` against keys of this shape."""
    parts = string.Formatter().parse(template)
    return "".join(literal + ("x" if field is not None else "") for literal, field, _, _ in parts)


def literal_length(template: str) -> int:
    """How much fixed text a template has: the more, the more specific a match against it."""
    return sum(len(literal) for literal, _, _, _ in string.Formatter().parse(template))


def template_pattern(template: str) -> re.Pattern[str]:
    """A regex matching every key the template can produce: literals as they are, any text
    where a field goes (a field's value is whatever the call's argument formats to)."""
    parts = []
    for literal, field, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append(".*")
    return re.compile("".join(parts), re.DOTALL)


def check_template(setting: str, template: str, parameters: list[inspect.Parameter]) -> None:
    """Every field of the template must name an argument of the task (or a valid position).

    A name the signature does not list is accepted only when the task takes ``**kwargs``; such
    a call that lacks it fails with :func:`render`'s clear error, not a bare KeyError."""
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


# A task's signature, read once: inspect builds it anew on every call (about 40 % of a call's
# key and semaphore lookup, measured on a template key; a task's signature does not change).
_signature_cached = functools.lru_cache(maxsize=1024)(inspect.signature)


def _signature_of(function: Callable[..., Any]) -> inspect.Signature:
    """``function``'s signature, from the cache when ``function`` can be a key of it: a bound
    method of a task class that defines ``__eq__`` without ``__hash__`` cannot, and is read
    anew (its call's TypeError would otherwise pass for a call that does not fit)."""
    try:
        return _signature_cached(function)
    except TypeError:
        return inspect.signature(function)


def render(
    setting: str, template: str, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    """The key of one call: the template filled from the call's bound arguments.

    Arguments gathered by ``**kwargs`` are offered by their own names too, so
    ``"t:{tenant}"`` works on ``def task(**options)``; a call that does not pass ``tenant``
    gets a ConfigurationError naming the template and the missing argument."""
    try:
        bound = _signature_of(function).bind(*args, **kwargs)
    except TypeError as error:
        raise ConfigurationError(setting, template, f"the call does not fit the task's signature: {error}") from error
    bound.apply_defaults()
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        parameter = bound.signature.parameters[name]
        if parameter.kind is parameter.VAR_KEYWORD:
            named.update(value)
        elif parameter.kind is not parameter.VAR_POSITIONAL:
            named[name] = value
    try:
        return check_name(setting, template.format(*bound.args, **named))
    except KeyError as error:
        raise ConfigurationError(
            setting, template, f"this call has no argument {error.args[0]!r} to fill the key with"
        ) from None
    except IndexError:
        raise ConfigurationError(
            setting, template, "this call has too few positional arguments to fill the key"
        ) from None


def call_key(
    setting: str, key: str | KeyFunction, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str:
    """The key of one call for a template or a key function (whose answer must be a non-empty str)."""
    if callable(key):
        return check_name(setting, key(args, kwargs))
    return render(setting, key, function, args, kwargs)
