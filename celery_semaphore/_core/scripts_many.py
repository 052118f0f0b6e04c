"""The scripts over several semaphores (``MultiSemaphore``): 10 keys each, semaphore after
semaphore, and on a cluster all in one hash slot. Their typed wrappers live apart from the
single-semaphore ones in ``scripts.py``, which mixes these in."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .replies import HandOffReply, Holder, ManyReply, RenewReply, hand_off_reply, renew_reply, waiters_of
from .script_args import number
from .storage import GRANTED, TOO_HEAVY, as_text

if TYPE_CHECKING:
    from .rules import Rules
    from .scripts import SemaphoreKeys


class ManyScripts:
    """The wrappers of acquire_many, release_many, renew_many and leave_many."""

    _scripts: dict[str, Any]

    def acquire_many(
        self,
        keys: list[SemaphoreKeys],
        *,
        token: str,
        waiter: str,
        rules: list[Rules],
        lease_ms: int,
        patience_ms: int,
        enqueue: bool,
        label: str,
        ticket: int | None,
        wake: str,
        run: str = "",
        remember_ms: int = 0,
        fresh: bool = False,
    ) -> ManyReply:
        mode = (b"2" if fresh else b"1") if enqueue else b"0"
        args: list[Any] = [
            token,
            waiter,
            number(lease_ms),
            number(patience_ms),
            mode,
            label,
            b"" if ticket is None else number(int(ticket)),
            wake,
            number(len(keys)),
            *(each.arg for each in rules),
        ]
        if run:
            args += [run, number(remember_ms)]
        reply = self._scripts["acquire_many"](keys=_many_keys(keys, with_runs=bool(run)), args=args)
        if not isinstance(reply, list):
            return ManyReply(int(reply), 0, 0, 0, 0, None)
        if int(reply[0]) == TOO_HEAVY:
            return ManyReply(TOO_HEAVY, 0, 0, int(reply[2]), int(reply[1]), None)
        if int(reply[0]) == GRANTED:  # a grant that handed slots on to waiters its caller wakes
            return ManyReply(GRANTED, 0, 0, 0, 0, None, to_wake=waiters_of(reply[1:]))
        outcome, position, free, limit, index, ticket_text, retry_ms = reply[:7]
        text = as_text(ticket_text)
        return ManyReply(
            int(outcome),
            int(position),
            int(free),
            int(limit),
            int(index),
            int(float(text)) if text else None,
            retry_ms=int(retry_ms),
            to_wake=waiters_of(reply[7:]),
        )

    def release_many(
        self, keys: list[SemaphoreKeys], *, token: str, rules: list[Rules], run: str = "", remember_ms: int = 0
    ) -> HandOffReply:
        args: list[Any] = [token, number(len(keys)), *(each.arg for each in rules)]
        if run:
            args += [run, number(remember_ms)]
        return hand_off_reply(self._scripts["release_many"](keys=_many_keys(keys, with_runs=bool(run)), args=args))

    def renew_many(
        self,
        keys: list[SemaphoreKeys],
        *,
        lease_ms: int,
        rules: list[Rules],
        reclaim: bool,
        holders: list[Holder],
    ) -> RenewReply:
        args: list[Any] = [lease_ms, int(reclaim), len(keys), *(each.arg for each in rules)]
        args += [part for holder in holders for part in holder]
        named = _many_keys(keys, with_runs=any(run for _, _, run in holders))
        return renew_reply(self._scripts["renew_many"](keys=named, args=args), len(holders))

    def leave_many(
        self,
        keys: list[SemaphoreKeys],
        *,
        waiter: str,
        rules: list[Rules],
        away_ms: int | None = None,
        wake: str = "",
    ) -> HandOffReply:
        args: list[Any] = [waiter, number(len(keys)), *(each.arg for each in rules)]
        if away_ms is not None:
            args += [number(away_ms), wake]
        return hand_off_reply(self._scripts["leave_many"](keys=_many_keys(keys), args=args))


def _many_keys(keys: list[SemaphoreKeys], *, with_runs: bool = False) -> list[bytes]:
    """10 keys per semaphore; with a run id, then the first semaphore's run records."""
    flat = [key for semaphore in keys for key in semaphore.line_keys]
    return flat + keys[0].encoded[10:12] if with_runs else flat
