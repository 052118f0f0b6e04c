"""The wait protocol in message headers: what a waiting task's copies carry from try to try.

A task that waits outside the worker exists as several messages over time (its wake copy, its
backstop copy, a broker's redelivery), each a new message: the wait's history (refusals so far,
the first refusal's time, the place in line and its signature, the run every copy asks under,
the queue it began in, the protocol version) travels in their headers. This module owns their
names and formats, reads them back defensively (a header this package did not write starts a
fresh wait, with a warning, never a crash) and signs tickets so that a copy takes back only a
place this deployment gave it. ``task.py`` drives the wait; this module only says what a message
carries.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from .._core.attempts import new_token
from .config import SemaphoreConfig

logger = logging.getLogger("celery_semaphore")

# The headers this package writes on a task's messages have a prefix of their own: ``semaphore_``
# is the prefix of the task options a user sets, and a header of the wait protocol is no option.
# Releases before this one wrote them under ``OLD_PREFIX``: a worker reads those names too (the new
# name first) until the next major version, so a rolling deploy loses no wait, and writes only
# the new ones (``without_broker_headers`` renames what a delivered message carries). A header a
# user sets on purpose for one call keeps its option's name (``options.PRIORITY_HEADER``).
PREFIX = "csem_"
OLD_PREFIX = "semaphore_"
# Message headers that carry a waiting task's history across re-sends.
WAITS_HEADER = "csem_waits"
FIRST_REFUSED_HEADER = "csem_first_refused"
TICKET_HEADER = "csem_ticket"
# request.retries when the wait began: a run whose retries differ is the task's own retry
WAIT_OF_RETRY_HEADER = "csem_wait_of_retry"
# the queue the task first came from: its copies go back there (the wake copy to its wake queue)
QUEUE_HEADER = "csem_queue"
# a random id of this wait, made at its first refusal: with the task id and the retry it names the
# run every copy of the wait asks under, unique per invocation even when task ids repeat
RUN_HEADER = "csem_run"
# a keyed digest of the ticket, the task id and the wait id (see TicketSigner)
TICKET_SIGNATURE_HEADER = "csem_ticket_sig"
# Hex digits of that digest a message carries: 64 bits, which a forger must guess with a task
# sent per try (the signature only keeps a copy from taking a place it was not given). Every
# waiting task's stored copy carries it: 16 digits fewer kept the packed copy of a small task
# within one allocation size class of Redis's allocator (256 B, not 320 B). Releases before
# this one wrote 32; they are still read.
SIGNATURE_CHARS = 16
_OLD_SIGNATURE_CHARS = 32
# the version of the wait protocol that wrote the headers above (see WaitHistory; the same number
# as worker.STATE_PROTOCOL, the version of the state in Redis). 3: a wait stands in line under
# its task id written short (tokens.waiter_key); a wait of protocol 2 keeps the id it began under.
PROTOCOL_HEADER = "csem_protocol"
PROTOCOL = 3
# when the task's message was first sent (epoch seconds, the sender's clock): a success in the
# result backend recorded since then belongs to this invocation, even for a redelivered message
# whose wait the semaphore's Redis forgot
SENT_HEADER = "csem_sent"
# a random nonce naming the task's message, stamped as it is first sent (stamping.py) and kept by a
# broker's redelivery: the note of the wait a first delivery began names it (wait_runs.py), so a
# later invocation that reuses the task id never continues the earlier invocation's wait
MESSAGE_HEADER = "csem_message"
# Hex digits of that nonce (48 bits): it tells apart only the invocations that reuse one task id,
# and every stored copy carries it. Releases before this one wrote 16; any 1 to 32 are read.
NONCE_CHARS = 12
# a backstop copy held by a worker on RabbitMQ: when it is due (epoch seconds, the sender's
# clock), and how many times it was handed back to the broker (backstop.py)
DUE_HEADER = "csem_due"
HANDED_BACK_HEADER = "csem_handed_back"
# a due copy stowed in the Redis broker: due in how many seconds, and the run it serves (its id
# there; due_copies.py, lua/move_due_copies.lua)
DUE_IN_HEADER = "csem_due_in"
COPY_ID_HEADER = "csem_backstop"
# the name each header above had before it had a prefix of its own -> its name now
_RENAMED: dict[str, str] = {
    OLD_PREFIX + value.removeprefix(PREFIX): value
    for name, value in dict(globals()).items()
    if name.endswith("_HEADER")
}
# Headers a broker adds to a message it dead-lettered or redelivered: a re-sent copy is a new
# message, and RabbitMQ quorum queues or delayed delivery may drop one that carries them (Celery
# strips them from its own retries for the same reason).
_BROKER_HEADERS = re.compile(r"x-(death|first-death-.*|last-death-.*|delivery-count)$")


def old_name(name: str) -> str:
    """The name a header of this package had in releases before its prefix of its own."""
    return OLD_PREFIX + name.removeprefix(PREFIX)


def header_in(headers: dict[str, Any] | None, name: str) -> Any:
    """Header ``name`` of a delivered message, under its name or, sent by an earlier release,
    under its old one."""
    headers = headers or {}
    value = headers.get(name)
    return headers.get(old_name(name)) if value is None else value


def renamed(headers: dict[str, Any] | None) -> dict[str, Any]:
    """A delivered message's headers with this package's under their names of now: a copy sent
    on carries what an earlier release wrote, but under the new names only (a new name's value
    wins over an old one's)."""
    headers = headers or {}
    out = {name: value for name, value in headers.items() if name not in _RENAMED}
    for old, new in _RENAMED.items():
        if old in headers:
            out.setdefault(new, headers[old])
    return out


def without_broker_headers(headers: dict[str, Any] | None) -> dict[str, Any]:
    """A delivered message's headers less those its broker added (dead-lettering, delivery
    counts): a copy re-sent with them may be dropped (RabbitMQ quorum queues, delayed delivery).
    This package's own come under their names of now (``renamed``)."""
    return {name: value for name, value in renamed(headers).items() if not _BROKER_HEADERS.match(name)}


@dataclass(frozen=True)
class WaitHistory:
    """What earlier tries of this wait left in the message headers.

    The headers carry ``PROTOCOL_HEADER``: a worker of another release reads what it knows of
    them. Headers without it were written before run ids had a per-wait part (protocol 1):
    their copies keep asking under the run id of that release, ``<task id>#<retries>``, so that
    old and new copies of one wait still know each other during a rolling deploy. Likewise a
    wait begun before protocol 3 keeps standing in line under its task id as it was, not
    written short (``short_waiter``), so that it keeps its place. Headers that
    do not parse (not written by this package) are ignored with a warning: the copy starts a
    fresh wait, never gets a place it did not earn, and never fails for it."""

    waits: int  # refusals so far
    first_refused: float  # epoch seconds of the first refusal (now, for a fresh wait)
    ticket: int | None  # the place in line to come back to
    run_part: str | None  # the wait's own part of its run id (None: protocol 1 headers)
    origin: str | None = None  # the queue the wait began in
    ticket_signature: str | None = None  # as the headers carry it, checked by ``checked``
    sent: float | None = None  # epoch seconds the task's message was first sent (None: not stamped)
    # the wait stands in line under its task id written short (protocol 3 on; tokens.waiter_key)
    short_waiter: bool = True

    @classmethod
    def of(cls, request: Any) -> WaitHistory:
        """The history of the wait this run continues, or a fresh one.

        Celery copies a request's headers into the task's own retry, so headers of a wait that
        belonged to an earlier retry (another ``request.retries``) describe a finished wait."""
        retries = request.retries or 0
        of_retry = _header(request, WAIT_OF_RETRY_HEADER)
        first_refused = _header(request, FIRST_REFUSED_HEADER)
        sent = _sent_at(request)
        if first_refused is None and of_retry is None:
            return cls.fresh(sent)
        try:
            if int(of_retry) != retries:
                return cls.fresh(sent)
            ticket = _header(request, TICKET_HEADER)
            history = cls(
                waits=int(_header(request, WAITS_HEADER) or 0),
                first_refused=float(first_refused),
                ticket=_ticket(ticket),
                run_part=_run_part(_header(request, RUN_HEADER), _header(request, PROTOCOL_HEADER)),
                origin=_queue_name(_header(request, QUEUE_HEADER)),
                ticket_signature=_header(request, TICKET_SIGNATURE_HEADER),
                sent=sent,
                short_waiter=int(_header(request, PROTOCOL_HEADER) or 1) >= 3,
            )
        except (TypeError, ValueError) as error:
            logger.warning(
                "%s[%s]: ignoring wait headers this package did not write (%s): a fresh wait begins",
                getattr(request, "task", "?"),
                getattr(request, "id", "?"),
                error,
            )
            return cls.fresh(sent)
        if history.waits < 0 or not math.isfinite(history.first_refused):
            logger.warning(
                "%s[%s]: ignoring wait headers this package did not write: a fresh wait begins",
                getattr(request, "task", "?"),
                getattr(request, "id", "?"),
            )
            return cls.fresh(sent)
        return history

    def checked(self, signer: TicketSigner, request: Any) -> WaitHistory:
        """This history, less a ticket that this deployment did not give out: a place in line
        is taken back only with a ticket signed here (a forged or foreign one would jump the
        line). Such a copy keeps waiting, from the back."""
        if self.ticket is None or (
            self.run_part is not None
            and signer.signs(self.ticket_signature, task_id=request.id, run_part=self.run_part, ticket=self.ticket)
        ):
            return self
        logger.warning(
            "%s[%s]: ignoring a wait ticket this deployment did not sign (another producer, or a "
            "release before protocol 2): it waits from the back of the line",
            getattr(request, "task", "?"),
            getattr(request, "id", "?"),
        )
        return dataclasses.replace(self, ticket=None, ticket_signature=None)

    @classmethod
    def fresh(cls, sent: float | None = None) -> WaitHistory:
        return cls(waits=0, first_refused=epoch_ms(), ticket=None, run_part=new_token()[:16], sent=sent)

    def since(self) -> float:
        """From when a success in the result backend is this invocation's: since its message was
        sent where the sender stamped it, else since this wait began. (A redelivered message
        whose wait the semaphore's Redis lost began a new wait later than the first one: a
        success between the two is still its own.)"""
        return self.first_refused if self.sent is None else min(self.sent, self.first_refused)

    def run_id(self, request: Any) -> str:
        """The run every copy of this wait asks under: one per invocation, even when task ids
        repeat (a fixed id for a nightly job), and one per retry of the task."""
        base = f"{request.id}#{request.retries or 0}"
        return base if self.run_part is None else f"{base}#{self.run_part}"

    def next(
        self, ticket: int | None, *, retries: int, signer: TicketSigner | None = None, task_id: str | None = None
    ) -> dict[str, Any]:
        """The headers of the re-sent message that continues this wait."""
        ticket = ticket if ticket is not None else self.ticket
        signature = None
        if ticket is not None and signer is not None and self.run_part is not None and task_id is not None:
            signature = signer.sign(task_id=task_id, run_part=self.run_part, ticket=ticket)
        return {
            WAITS_HEADER: self.waits + 1,
            FIRST_REFUSED_HEADER: self.first_refused,
            TICKET_HEADER: ticket,
            WAIT_OF_RETRY_HEADER: retries,
            **({RUN_HEADER: self.run_part, PROTOCOL_HEADER: PROTOCOL} if self.run_part is not None else {}),
            **({TICKET_SIGNATURE_HEADER: signature} if signature is not None else {}),
            **({SENT_HEADER: self.sent} if self.sent is not None else {}),
        }


class TicketSigner:
    """Signs the tickets that waiting tasks carry in their headers, so that a copy takes back
    only a place this deployment gave it. The key is made from what writing the semaphore's
    Redis takes (its user, password and database, and the prefix): whoever could forge a
    signature could rewrite the line itself. Hosts that reach the same Redis by other names
    still agree."""

    _by_config: ClassVar[dict[int, tuple[Any, TicketSigner]]] = {}

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def of(cls, config: SemaphoreConfig) -> TicketSigner:
        cached = cls._by_config.get(id(config))
        if cached is not None and cached[0] is config:
            return cached[1]
        backend: Any = config.backend
        material = backend if isinstance(backend, str) else f"{backend.username}|{backend.password}|{backend.db}"
        signer = cls(hashlib.sha256(f"celery-semaphore ticket|{material}|{config.prefix}".encode()).digest())
        cls._by_config[id(config)] = (config, signer)
        return signer

    def sign(self, *, task_id: str, run_part: str, ticket: int) -> str:
        return self._digest(task_id, run_part, ticket)[:SIGNATURE_CHARS]

    def signs(self, signature: Any, *, task_id: str, run_part: str, ticket: int) -> bool:
        """Whether ``signature`` is this deployment's, written by this release or by one that
        wrote ``_OLD_SIGNATURE_CHARS`` digits (a copy sent before a rolling deploy)."""
        if not isinstance(signature, str) or len(signature) not in (SIGNATURE_CHARS, _OLD_SIGNATURE_CHARS):
            return False
        return hmac.compare_digest(signature, self._digest(task_id, run_part, ticket)[: len(signature)])

    def _digest(self, task_id: str, run_part: str, ticket: int) -> str:
        return hmac.new(self._key, f"{task_id}|{run_part}|{ticket}".encode(), hashlib.sha256).hexdigest()


# tickets are server milliseconds * 1024 plus a counter: positive, exact in a float
_MOST_TICKET = 2**53


def _ticket(value: Any) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{TICKET_HEADER} {value!r}")
    ticket = int(value)
    if not 0 < ticket < _MOST_TICKET:
        raise ValueError(f"{TICKET_HEADER} {value!r} out of range")
    return ticket


def _run_part(value: Any, protocol: Any) -> str | None:
    if protocol is None and value is None:
        return None  # protocol 1
    if int(protocol) > PROTOCOL:
        logger.warning(
            "a task's wait headers are of protocol %s, newer than this worker's %d (a rolling deploy?): "
            "reading what this release knows of them",
            protocol,
            PROTOCOL,
        )
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{1,32}", value):
        raise ValueError(f"{RUN_HEADER} {value!r}")
    return value


def _queue_name(value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise TypeError(f"{QUEUE_HEADER} {value!r}")
    return value


def _sent_at(request: Any) -> float | None:
    value = _header(request, SENT_HEADER)
    try:
        sent = float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
    return sent if sent is not None and math.isfinite(sent) else None


def epoch_ms() -> float:
    """This host's time, in epoch seconds to the millisecond, rounded up: what the stamps of a
    wait carry (``SENT_HEADER``, ``FIRST_REFUSED_HEADER``). Every copy of a waiting task holds
    two; written to the microsecond each took 4 B more of every stored copy, for a precision
    no comparison with another host's clock has. Rounded up, a stamp is never earlier than the
    moment it marks, so a success recorded before it is never taken for this invocation's."""
    return math.ceil(time.time() * 1000) / 1000


def message_nonce(request: Any) -> str | None:
    """The nonce its sender stamped on the request's message; None where none was stamped (a
    producer without this package) or the header is not one this package wrote."""
    value = _header(request, MESSAGE_HEADER)
    return value if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{1,32}", value) else None


def _header(request: Any, name: str) -> Any:
    """Header ``name`` of a task's request, under its name, else under its old one."""
    for candidate in (name, old_name(name)):
        value = getattr(request, candidate, None)
        if value is None:
            value = (getattr(request, "headers", None) or {}).get(candidate)
        if value is not None:
            return value
    return None
