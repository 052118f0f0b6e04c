"""``limit_concurrency``: the decorator form of ``base=SemaphoreTask``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from celery import shared_task

from .._core.rules import check_rate, check_spacing
from .._core.validation import check_limit
from .keys import check_template
from .options import KeyOption
from .task import SemaphoreTask


def limit_concurrency(
    limit: int | None = None,
    *,
    key: KeyOption | None = None,
    app: Any = None,
    rate: str | tuple[int, float] | None = None,
    spacing: float | None = None,
    **task_options: Any,
) -> Callable[[Callable[..., Any]], Any]:
    """Declare a Celery task that runs at most ``limit`` at once per semaphore key.

    ``@limit_concurrency(3, key="crawl:{host}", app=app)`` is ``@app.task(base=SemaphoreTask,
    semaphore_limit=3, semaphore_key="crawl:{host}")``; without ``app`` it is a ``shared_task``.
    ``limit=None`` takes the limit from ``semaphore_limits``. ``key`` may be a list
    (``key=["crawl:{host}", "crawl-total"]``): the task then holds a slot of every key, each
    with its own limit; ``semaphore_weight=3`` takes three slots of each. The limit and the key
    templates are checked here, at declaration: a template naming an argument the function
    lacks is an error now, not when the first task runs. ``rate`` ("500/m") and ``spacing``
    (seconds between starts) are ``semaphore_rate`` and ``semaphore_spacing``, checked here too.
    """
    if limit is not None:
        check_limit("limit", limit)
    check_rate("rate", rate)
    check_spacing("spacing", spacing)
    if rate is not None:
        task_options["semaphore_rate"] = rate
    if spacing is not None:
        task_options["semaphore_spacing"] = spacing

    def decorate(function: Callable[..., Any]) -> Any:
        name = task_options.get("name") or f"{function.__module__}.{function.__qualname__}"
        parameters = list(inspect.signature(function).parameters.values())
        if task_options.get("bind"):
            parameters = parameters[1:]
        for item in key if isinstance(key, (list, tuple)) else [key]:
            if isinstance(item, str):
                check_template(f"{name}.semaphore_key", item, parameters)
        options = {"base": SemaphoreTask, "semaphore_limit": limit, "semaphore_key": key, **task_options}
        if app is None:
            return shared_task(**options)(function)
        return app.task(**options)(function)

    return decorate
