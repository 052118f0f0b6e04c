"""What a semaphore allows besides its concurrency limit: a rate (at most N starts in any window
of P seconds) and a spacing (at least S seconds between two starts), checked in the same script
and on the same fair line as the limit (lua/_lib.lua, rules_in_force and gate_wait).

A paid API sells "5 at once and 500 per minute"; a crawler owes a host its robots.txt
``Crawl-delay``. Celery's own ``rate_limit`` is per worker, so it cannot say either across a
deployment. Rules are declared in code and sent with every call, packed in one argument
(``Rules.arg``): a semaphore with neither sends exactly what it sent before.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

from ..errors import NO_LIMIT, ConfigurationError
from .validation import check_seconds, to_ms

# A semaphore with a rate or a spacing and no concurrency limit: the scripts still compare the
# holder count with a limit, and this one is never reached.
UNLIMITED = NO_LIMIT

# Celery's ``rate_limit`` units, and the day for quotas sold per day.
_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_RATE_TEXT = re.compile(r"^\s*(\d+)\s*/\s*(\d*\.?\d*)\s*([smhd])\s*$")


@dataclass(frozen=True)
class Rate:
    """At most ``count`` starts in any window of ``period`` seconds (server time)."""

    count: int
    period: float

    def __str__(self) -> str:
        for unit, seconds in _PERIODS.items():
            if self.period == seconds:
                return f"{self.count}/{unit}"
        return f"{self.count}/{self.period:g}s"

    @property
    def arg(self) -> str:
        """As the scripts read it: ``<count>/<period ms>``."""
        return f"{self.count}/{to_ms(self.period)}"


def check_rate(setting: str, value: Any) -> Rate | None:
    """A rate as Celery writes one (``"30/m"``, ``"5/s"``, ``"500/h"``; also ``"10/30s"``, ten per
    thirty seconds, and ``"/d"``), a ``(count, seconds)`` pair, a Rate, or None for none."""
    if value is None or isinstance(value, Rate):
        return value
    if isinstance(value, str):
        match = _RATE_TEXT.match(value)
        if not match:
            raise ConfigurationError(
                setting, value, 'expected a rate such as "30/m", "5/s", "500/h", "10/30s" or a (count, seconds) pair'
            )
        count, times, unit = match.groups()
        period = (float(times) if times else 1.0) * _PERIODS[unit]
        return _checked(setting, value, int(count), period)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        count, period = value
        if isinstance(count, bool) or not isinstance(count, int):
            raise ConfigurationError(setting, value, "a rate's count must be an int of at least 1")
        return _checked(setting, value, count, check_seconds(setting, period))
    raise ConfigurationError(setting, value, 'expected a rate such as "30/m" or a (count, seconds) pair')


def _checked(setting: str, value: Any, count: int, period: float) -> Rate:
    if count < 1:
        raise ConfigurationError(setting, value, "a rate's count must be at least 1")
    if not math.isfinite(period) or period <= 0 or to_ms(period) < 1:
        raise ConfigurationError(setting, value, "a rate's period must be at least a millisecond")
    return Rate(count, period)


def check_spacing(setting: str, value: Any) -> float | None:
    """Seconds between two starts (robots.txt ``Crawl-delay``), above zero; or None for none."""
    if value is None:
        return None
    return check_seconds(setting, value)


@dataclass(frozen=True)
class Rules:
    """A semaphore's limit, rate and spacing as given in code (runtime overrides stored in Redis
    win over each, see ``FairSemaphore.set_limit``, ``set_rate``, ``set_spacing``, ``pause``)."""

    limit: int
    rate: Rate | None = None
    spacing: float | None = None
    per_tenant: int | None = None  # most slots one tenant's calls may hold (None: no cap)

    @functools.cached_property
    def arg(self) -> bytes:
        """The rules as every script reads them: ``<limit>``, or with a rate, a spacing or a cap
        per tenant ``<limit>/<rate count>/<rate ms>/<spacing ms>[/<per tenant>]`` (0 for none)."""
        if self.rate is None and self.spacing is None and self.per_tenant is None:
            return b"%d" % self.limit
        count, period_ms = (self.rate.count, to_ms(self.rate.period)) if self.rate is not None else (0, 0)
        spacing_ms = to_ms(self.spacing) if self.spacing is not None else 0
        arg = b"%d/%d/%d/%d" % (self.limit, count, period_ms, spacing_ms)
        return arg if self.per_tenant is None else arg + b"/%d" % self.per_tenant

    @property
    def gated(self) -> bool:
        return self.rate is not None or self.spacing is not None
