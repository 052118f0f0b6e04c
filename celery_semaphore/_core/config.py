"""What a semaphore is, apart from the client that reaches it: its name, limit, rules, lease,
patience and keys, checked once.

Both semaphore classes, ``FairSemaphore`` (a blocking redis-py client) and ``AsyncFairSemaphore``
(a ``redis.asyncio`` client), take the same arguments and must agree on every key and every
value they send: a task and a coroutine stand in the same line. So the arguments are checked and
turned into keys and milliseconds here, in one place, and each class adds only its client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

from ..errors import ConfigurationError, SemaphoreUnavailable
from .attempts import Ask
from .rules import UNLIMITED, Rate, Rules, check_rate, check_spacing
from .script_calls import LineArgs
from .scripts import SemaphoreKeys
from .tenants import Shares, Tenant, check_share, check_tenant, check_tenants
from .validation import (
    check_limit,
    check_name,
    check_on_full,
    check_prefix,
    check_seconds,
    check_semaphore_name,
    priority_ms,
    to_ms,
)

ClientT = TypeVar("ClientT")


class SemaphoreConfig(Generic[ClientT]):
    """The checked arguments of a semaphore on a client of type ``ClientT``; a subclass checks
    the client (``_accept``) and makes what it needs of it (``_setup``)."""

    def __init__(
        self,
        client: ClientT,
        name: str,
        limit: int | None,
        *,
        rate: Rate | str | tuple[int, float] | None = None,
        spacing: float | None = None,
        lease: float = 60.0,
        prefix: str = "semaphore",
        patience: float = 5.0,
        hash_tag: str | None = None,
        shares: Mapping[str, float] | Shares | None = None,
        max_waiters: int | None = None,
        on_full: str = "reject",
        per_tenant: int | None = None,
    ) -> None:
        self.client: ClientT = self._accept(client)
        self.name = check_semaphore_name("name", name)
        self.rate = check_rate("rate", rate)
        self.spacing = check_spacing("spacing", spacing)
        if limit is None and self.rate is None and self.spacing is None:
            raise ConfigurationError("limit", limit, "a semaphore needs a limit, a rate or a spacing")
        self.limit = UNLIMITED if limit is None else check_limit("limit", limit)
        # most slots the calls of one tenant may hold (with two levels, one org's)
        self.per_tenant = None if per_tenant is None else check_limit("per_tenant", per_tenant)
        self.rules = Rules(self.limit, self.rate, self.spacing, self.per_tenant)
        self.lease = check_seconds("lease", lease)
        self.prefix = check_prefix("prefix", prefix)
        self.patience = check_seconds("patience", patience)
        self.hash_tag = None if hash_tag is None else check_name("hash_tag", hash_tag)
        self.keys = SemaphoreKeys.of(self.prefix, self.name, self.hash_tag)
        # already checked (the Celery settings' shares, shared by every semaphore of the app)
        self.shares = shares if isinstance(shares, Shares) else Shares("shares", shares)
        # what a new waiter that finds max_waiters in line does (see FULL_LINE_POLICIES)
        self.max_waiters = None if max_waiters is None else check_limit("max_waiters", max_waiters)
        self.on_full = check_on_full("on_full", on_full, self.max_waiters)
        self._lease_ms = to_ms(self.lease)
        self._patience_ms = to_ms(self.patience)
        self._setup()

    def _accept(self, client: ClientT) -> ClientT:
        """``client``, if it is of a kind this class can use; else a ConfigurationError."""
        raise NotImplementedError

    def _setup(self) -> None:
        """Made once the arguments are checked: the scripts on the client, the wake address."""

    def __repr__(self) -> str:
        rules = "".join(
            f" {name}={value}" for name, value in (("rate", self.rate), ("spacing", self.spacing)) if value is not None
        )
        limit = "none" if self.limit == UNLIMITED else self.limit
        return f"<{type(self).__name__} {self.name!r} limit={limit}{rules} lease={self.lease}>"

    @property
    def renewal_key(self) -> str:
        """Leases with equal renewal keys (and lease lengths, on one client) renew in one call."""
        return self.keys.holders

    def _line_args(self, ask: Ask) -> LineArgs | None:
        """How ``ask`` takes its place beyond its arrival (tenant, priority, a full line), or
        None for a plain ask (which then sends none of it)."""
        full = ""
        if ask.enqueue and (self.max_waiters is not None or self.on_full == "keep_latest"):
            full = f"{self.max_waiters or ''}|{self.on_full}|{ask.coalesce or ''}"
        if ask.tenant is None and not ask.priority and not full:
            return None
        priority = priority_ms("priority", ask.priority) if ask.priority else 0
        return LineArgs(self._tenant_arg(ask.tenant), priority, full)

    def _one_try_line(self, tenant: Tenant | None) -> LineArgs | None:
        """What a one-shot try sends of its tenant: only under a cap per tenant, which a try that
        takes no place in line must still respect."""
        if self.per_tenant is None or tenant is None:
            return None
        return LineArgs(self._tenant_arg(tenant))

    def _full_line_error(self, evicted: bool) -> SemaphoreUnavailable:
        """The error of a call its full line refused (LINE_FULL) or evicted (EVICTED)."""
        return SemaphoreUnavailable(
            self.name, self.limit, 0.0, max_waiters=self.max_waiters, evicted=self.on_full if evicted else None
        )

    def _tenant_arg(self, tenant: Tenant | None) -> str:
        """The acquire script's tenant argument for ``tenant`` (checked), "" for none."""
        return "" if tenant is None else self.shares.tenant_arg(check_tenants("tenant", tenant))

    def _share_override(self, tenant: str, share: float | None) -> tuple[str, str, str | None]:
        """What ``set_share`` stores: the key, the checked tenant and share (None: remove)."""
        checked = None if share is None else f"{check_share('share', share):.6g}"
        return self.keys.shares, check_tenant("tenant", tenant), checked
