"""What the scripts and Python must agree on about the semaphore's state in Redis: the codes the
scripts answer with, and the marks inside members, fields and values.

Both sides read and write the same state. The scripts answer a try with a code and write members
such as an offer ``!<waiter>``, a weighted holder ``<token>*<w>`` with its extra slots
``<token>#<k>``, and a weighted waiter ``*<w>*<id>``. Python reads those answers, and builds and
parses those members. A code or mark that changes on one side only breaks the semaphore quietly,
so each value lives in two places and nowhere else: here for Python, and in the storage-format
block at the head of ``lua/_lib.lua`` for the scripts, under the same names. The scripts cannot
import Python. ``tests/core/test_storage_format.py`` reads that block and the scripts' text, and fails
when the two sides differ or when a script answers with a bare number where a name exists.

The key names themselves are ``scripts.SemaphoreKeys``'s business, and the key schema is in the
head of ``lua/_lib.lua``.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

# What acquire and acquire_many answer.
WAIT = 0  # refused: the try stands in line (or, one-shot, took nothing)
GRANTED = 1
CLAIMED = 2  # granted by claiming the slot a release offered this waiter
RUNNING = 3  # another copy of this run holds its slot now
RAN = 4  # another copy of this run held its slot and gave it back: the run is over
TOO_HEAVY = 5  # acquire_many: the weight is above a limit in force (the try would wait forever)
LINE_FULL = 6  # acquire: a new waiter found max_waiters in line and took no place
EVICTED = 7  # acquire: this waiter's place went to another (drop_oldest, keep_latest)
FREE = 8  # acquire, placing: a newcomer would be granted now, so nothing was placed

# What renew and renew_many answer, one code per token.
RENEW_LOST = 0
RENEW_RENEWED = 1
RENEW_REGISTERED_AGAIN = 2

# What take_over answers about the instance it was asked to take over.
INSTANCE_GONE = 0  # the node name records no such instance (taken over already, or expired)
INSTANCE_BEATING = 1  # it beat recently: alive, so its slots stay
INSTANCE_TAKEN = 2  # silent: taken over, its index handed to the caller

# A waiter's state in the listing of status.
AWAY = 0
PRESENT = 1
OFFERED = 2

OFFER_MARK = "!"  # holders: "!<waiter>" is a slot offered to that waiter and not yet claimed
WEIGHT_MARK = "*"  # "<token>*<w>" holds w slots; "*<w>*<id>" waits for w slots (lua: in patterns)
EXTRA_SLOT_MARK = "#"  # holders: "<token>#<k>" is slot k (2..w) of a weighted holder
HOLDER_FIELD = "h:"  # holder_info: "h:<token>" -> "<granted ms>|<label>"
WAITER_FIELD = "w:"  # waiter_info: "w:<waiter>" -> "<first ask ms>|<wake address>"
TENANT_FIELD = "t:"  # waiter_info: "t:<waiter>" -> its tenant (the org of two levels), kept for a
# two-level waiter and, on a key with a per_tenant cap, for every waiter with a tenant
HELD_FIELD = "held:"  # holder_info: "held:<tenant>" -> a JSON list of its slots (tokens, "!<waiter>")
PARKED_MARK = ">"  # waiter_info: "<first ask ms>|><wake address>" is a parked waiter's
HOLD_FIELD = "hold"  # waiter_info: the moving average of hold times (ms)
INFO_SEPARATOR = "|"  # between the parts of a holder_info or waiter_info value
RECORD_SEPARATOR = "\n"  # the parked tasks' records: "<line>\n<waiter>" -> "<header>\n<copy>"
# (the parked tasks' keys are the Celery glue's, _celery/parked_records.py; their marks are here
# because the glue's scripts are built on lua/_lib.lua and read them from its block)
# copies: "woken\n<copy>" is the copy of a wait whose wake copy was sent (claim_parked_waiter):
# leased, not dropped, so that a sweep sends it again if that copy is lost before it is granted
WOKEN_COPY_MARK = "woken\n"
# records: a record whose copy a wake-up took (claim_parked_waiter) has this in front, so that no
# second wake-up takes it; a sweep or a new park of the wait makes it takeable again. A wake-up
# "~<waiter>" says the same to a parked waiter's process: the script's caller took its record and
# sends its copy (lua/_lib.lua, notify), and the process forgets the wait (wakeups.py, parking.py)
TAKEN_RECORD_MARK = "~"
# A wake address is "<base>:wake:<listener id>". A mark in front of the listener id tells the
# scripts how to publish on it (lua/_lib.lua, notify; in Lua the marks live inside patterns).
SHARDED_MARK = "s."  # a sharded listener (SSUBSCRIBE): the scripts SPUBLISH, to one shard only
# A listener on a cluster without sharded pub/sub. There a script's PUBLISH counts the subscribers
# of one node only, so a wake-up on such an address is never judged unheard.
CLUSTER_MARK = "c."

_GLOB_SPECIALS = re.compile(r"([*?\[\]\\])")
_WEIGHT_AT_END = re.compile(r"\*\d+$")
# Used with match(), as they always were: ".*" stops at a newline in a token, where the search()
# of _WEIGHT_AT_END and Lua's string.match do not.
_TOKEN_WEIGHT = re.compile(r".*\*(\d+)$")
_EXTRA_SLOT = re.compile(r".*\*\d+#\d+$")


def glob_escape(text: str) -> str:
    """``text`` with Redis's glob specials escaped, so SCAN or ZSCAN MATCH takes it literally."""
    return _GLOB_SPECIALS.sub(r"\\\1", text)


def token_prefix_pattern(prefix: str) -> str:
    """The ZSCAN MATCH pattern of every holders member that starts with ``prefix``. A task id may
    hold ``*`` or ``[``, and it must match only itself."""
    return glob_escape(prefix) + "*"


def is_offer(member: str) -> bool:
    return member.startswith(OFFER_MARK)


def weighted_token(token: str, weight: int) -> str:
    """``token`` as the token of a holder of ``weight`` slots. A weight above 1 is written at its
    end, and only once. The scripts read it from there (lua/_lib.lua, slot_members)."""
    mark = f"{WEIGHT_MARK}{weight}"
    return token + mark if weight > 1 and not token.endswith(mark) else token


def ends_in_weight_mark(token: str) -> bool:
    """Whether ``token`` ends in ``*<digits>``, the way a weighted holder's token ends."""
    # the cheap test first: every blocked try checks its token
    return WEIGHT_MARK in token and _WEIGHT_AT_END.search(token) is not None


def slot_members(token: str) -> list[str]:
    """The holders members of a token: the token, then its extra slots if it is weighted. This
    is the same list as slot_members in lua/_lib.lua."""
    match = _TOKEN_WEIGHT.match(token)
    weight = int(match.group(1)) if match else 1
    return [token] + [f"{token}{EXTRA_SLOT_MARK}{k}" for k in range(2, weight + 1)]


def is_extra_slot(member: str) -> bool:
    """Whether a holders member is a weighted holder's slot 2..w (status shows it as the weight
    of the token, not as a holder of its own)."""
    return _EXTRA_SLOT.match(member) is not None


def weighted_waiter(weight: int, unique: str) -> str:
    """The id under which a waiter of acquire_many waits for ``weight`` slots. The weight goes in
    front, even a weight of 1: the lines read it from there (lua/_lib.lua, multi_weight)."""
    return f"{WEIGHT_MARK}{weight}{WEIGHT_MARK}{unique}"


def is_weighted_waiter(waiter: str, weight: int) -> bool:
    return waiter.startswith(f"{WEIGHT_MARK}{weight}{WEIGHT_MARK}")


def wake_address(base: str, listener_id: str) -> str:
    """The wake address of one listener's waiters on the semaphore whose keys start with
    ``base``. It is inside the hash tag, so the scripts may publish on it."""
    return f"{base}:wake:{listener_id}"


def as_text(value: Any) -> str:
    """A member, field or reply element as Redis returned it (bytes, or str on a client that
    decodes responses), as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def bucket_of(name: str, buckets: int) -> int:
    """Which of ``buckets`` small keys holds ``name``, where a large hash or sorted set is split
    so that each part keeps Redis's compact encoding: the first 32 bits of its SHA-1, as the
    scripts compute it with ``redis.sha1hex`` (the glue's parked records and stored due times)."""
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) % buckets
