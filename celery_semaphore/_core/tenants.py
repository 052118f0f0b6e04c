"""Tenants and their shares: who a waiter waits for, and how much of the line that one is due.

One line is first come, first served between calls, which is unfair between the people behind
them: a customer who queues ten thousand calls makes everybody else wait behind all of them. A
call that names its ``tenant`` is placed instead by its tenant's virtual time (weighted fair
queueing, computed in the acquire script): each start moves a tenant's clock on by
``1 / share``, so between waiting tenants slots go in proportion to their shares, and first come,
first served still holds inside one tenant.

Shares are settings, so they are checked here once, when a semaphore is made: ``{glob: share}``
over tenant names (``{"enterprise:*": 4, "*": 1}``). A tenant's share is that of its exact name
if listed, else that of the first glob that matches it in the mapping's order, else 1. A runtime
override stored in Redis (``set_share``) wins over all of them.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError

# Shares outside this range would lose a whole step of virtual time to rounding (the script
# moves a clock by round(1000 / share) steps, at least 1).
SMALLEST_SHARE = 0.001
LARGEST_SHARE = 1000.0
# A tenant name goes into every waiter's ask and into a Redis sorted set: a bound keeps a
# mistaken template (a whole payload rendered as the tenant) from filling Redis.
LONGEST_TENANT = 200


def check_share(setting: str, value: Any) -> float:
    """A share: a number from 0.001 to 1000 (a bool is no number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigurationError(setting, value, "expected a number from 0.001 to 1000")
    if not SMALLEST_SHARE <= value <= LARGEST_SHARE:
        raise ConfigurationError(setting, value, "expected a number from 0.001 to 1000")
    return float(value)


def check_tenant(setting: str, value: Any) -> str:
    """A tenant name: a non-empty string of at most 200 characters, without "|" or a newline
    (the script splits its argument on the first "|")."""
    if not isinstance(value, str) or not value or len(value) > LONGEST_TENANT:
        raise ConfigurationError(setting, value, f"expected a non-empty string of at most {LONGEST_TENANT} characters")
    if "|" in value or "\n" in value:
        raise ConfigurationError(setting, value, 'a tenant name may not contain "|" or a newline')
    return value


# Whom a call is for: one tenant, or two levels, (org, user): orgs are fair between them, then
# the users of an org between them, so an org gains nothing by spreading its calls over more
# user names.
Tenant = str | tuple[str, str]


def check_tenants(setting: str, value: Any) -> Tenant:
    """A tenant name, or a pair of them (org, user)."""
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ConfigurationError(setting, value, "expected a tenant name or a pair (org, user)")
        return check_tenant(f"{setting}[0]", value[0]), check_tenant(f"{setting}[1]", value[1])
    return check_tenant(setting, value)


def user_share_name(org: str, user: str) -> str:
    """The name a user of ``org`` has in the shares: its glob and runtime share is looked up
    as "<org>/<user>" (shares between users matter only within their org)."""
    return f"{org}/{user}"


class Shares:
    """The checked ``{glob: share}`` mapping of one semaphore, and the share of a tenant."""

    def __init__(self, setting: str, shares: Mapping[str, float] | None) -> None:
        if shares is None:
            shares = {}
        if not isinstance(shares, Mapping):
            raise ConfigurationError(setting, shares, 'expected a mapping of tenant globs to shares, like {"*": 1}')
        self.exact: dict[str, float] = {}
        self.globs: list[tuple[str, float]] = []
        for pattern, share in shares.items():
            if not isinstance(pattern, str) or not pattern:
                raise ConfigurationError(f"{setting}[{pattern!r}]", pattern, "expected a tenant name or glob")
            checked = check_share(f"{setting}[{pattern!r}]", share)
            if any(mark in pattern for mark in "*?["):
                self.globs.append((pattern, checked))
            else:
                self.exact[pattern] = checked
        self._cache: dict[str, float] = {}

    def share_of(self, tenant: str) -> float:
        """The share ``tenant`` gets from these settings (a runtime override is the script's)."""
        share = self._cache.get(tenant)
        if share is None:
            share = self.exact.get(tenant)
            if share is None:
                share = next((value for glob, value in self.globs if fnmatch.fnmatchcase(tenant, glob)), 1.0)
            if len(self._cache) < 10_000:  # tenants may be many: the cache stays bounded
                self._cache[tenant] = share
        return share

    def tenant_arg(self, tenant: Tenant | None) -> str:
        """What the acquire script takes for ``tenant``: "<share>|<tenant>", or "" for none;
        for (org, user), "<org's share>|<org>|<user's share>|<user>"."""
        if tenant is None:
            return ""
        if isinstance(tenant, tuple):
            org, user = tenant
            return f"{self.share_of(org):.6g}|{org}|{self.share_of(user_share_name(org, user)):.6g}|{user}"
        return f"{self.share_of(tenant):.6g}|{tenant}"


@dataclass(frozen=True)
class TenantInfo:
    """One tenant of a key's line, as ``FairSemaphore.tenants()`` reports it."""

    tenant: str
    share: float  # in force: the runtime share if one is stored, else the settings'
    backlog: int  # its turns queued behind the head of the line: about its calls waiting there
    runtime_share: bool = False  # the share is a runtime override (set_share)


# how many clocks a report reads per tenant it lists: the furthest-ahead clocks are the largest
# backlogs at equal shares, and a wider read catches a high-share tenant with a shorter clock
READ_PER_LISTED = 10


def tenant_report(
    head: list[tuple[bytes, float]],
    clocks: list[tuple[bytes, float]],
    overrides: dict[bytes, bytes],
    shares: Shares,
    most: int,
) -> list[TenantInfo]:
    """The tenants with the largest backlogs, from the head of the line, the furthest-ahead
    clocks and the runtime shares. A tenant's backlog is how many of its steps its clock is
    ahead of the line's: each waiter it adds moves its clock one step, each start of one of
    its waiters moves the line's clock past one."""
    if not head:
        return []
    line_clock = int(head[0][1]) // 1024 * 1024
    report = []
    for member, clock in clocks:
        tenant = member.decode()
        override = overrides.get(member)
        share = float(override) if override is not None else shares.share_of(tenant)
        step = max(1, round(1000 / share)) * 1024
        backlog = max(0, math.ceil((clock - line_clock) / step))
        if backlog:
            report.append(TenantInfo(tenant, share, backlog, override is not None))
    report.sort(key=lambda info: (-info.backlog, info.tenant))
    return report[:most]
