"""A stored copy kept as what sets it apart from its task's other messages: its stencil apart.

A waiting task's stored copy (``due_copies.py``) is the message kombu writes, about 1.5 KB, of
which most is the same for every task sent to one queue: the key names, the task's name, the
routing, the content type. A store of 100,000 waiting tasks held 100,000 copies of that text.

Here the message is split into its *stencil*, the JSON text with a hole where each value of its
own goes, kept once in the store under a digest of its text, and its *fills*: the JSON text of each
of those values, kept with the copy. The scripts that send a copy (``lua/_packed.lua``) put the
two back together in Redis, so that a copy still goes to its queue in one atomic step, as the
exact message kombu decodes. What goes in the stencil is what repeats: the message's keys, the
values named in ``STENCIL_HEADERS`` and ``STENCIL_PROPERTIES`` and any None, True, False or empty
value; every other value, including any header this module does not know, is a fill. A fill equal
to an earlier one (the task id as the root id and the correlation id) is kept as a reference.

Two fills of a Celery copy need not be kept at all: its run's id, which the store keeps it under
(the ``csem_backstop`` header), and its delivery tag, which each send had better make anew (two
deliveries under one tag share one entry of kombu's unacknowledged index). Given the copy's id,
``pack`` writes a mark for each (``COPY_ID_MARK``, ``OWN_TAG_MARK``), and the scripts write
``"<id>"`` and ``"<id>:<server time>"`` there as they send the copy. Such a copy ends in one more
fill, ``MARKED``: a reader of an earlier release counts a fill more than its stencil's holes and
leaves the copy stored, unread, rather than send the marks as they are.

A message this cannot split with certainty (a hole that would be read twice) is stored whole.
"""

from __future__ import annotations

import hashlib
import json
import re
from json.encoder import encode_basestring_ascii
from typing import Any, NamedTuple

from kombu.utils.json import dumps

# Marks a stored copy that is packed (its message's first byte: a message kombu writes is JSON).
PACKED_MARK = "\x01"
# Between a packed copy's stencil digest and its fills, and where a fill goes in a stencil: no
# JSON text holds a raw NUL (it is written \u0000).
HOLE = "\x00"
# A fill that repeats fill <n> (1-based), written "\x02<n>": no JSON text starts with it.
REPEAT_MARK = "\x02"
# A fill the copy's own id stands in for, and one a delivery tag of its own made at each send
# stands in for; and the last fill of a copy that holds either: no JSON text starts with them.
COPY_ID_MARK = "\x03"
OWN_TAG_MARK = "\x04"
MARKED = "\x05"
_HOLE_TEXT = json.dumps(HOLE)
# An id the scripts may write between quotes as it is: printable ASCII that JSON needs no escape for.
_PLAIN_ID = re.compile(r"[ !#-\[\]-~]+")

# Values of a message's headers and properties that are the same for a task's messages to one
# queue: the stencil keeps them. Whatever else a message holds is a fill.
STENCIL_HEADERS = frozenset(
    {"lang", "task", "shadow", "retries", "timelimit", "replaced_task_nesting", "csem_protocol", "csem_queue"}
)
STENCIL_PROPERTIES = frozenset({"delivery_mode", "delivery_info", "priority", "body_encoding"})
# The message's own keys whose values are the same for every message kombu writes.
STENCIL_FIELDS = frozenset({"content-encoding", "content-type"})
_SECTIONS = {"headers": STENCIL_HEADERS, "properties": STENCIL_PROPERTIES}
# Hex digits of the stencil's digest that name it (80 bits).
DIGEST_CHARS = 20


class Packed(NamedTuple):
    """A message as the store keeps it: its stencil's digest and text, and its fills joined by
    ``HOLE`` (the copy's value after ``PACKED_MARK``, digest and ``HOLE``)."""

    digest: str
    stencil: str
    fills: str


def pack(message: dict[str, Any], copy_id: str | None = None) -> Packed | None:
    """``message`` (a kombu message before it is written) as a stencil and its fills; None when
    it cannot be split with certainty (then it is stored whole). With ``copy_id`` (the id the
    store keeps the copy under), a fill that is that id and the delivery tag are written as
    marks, which the scripts fill in as they send the copy."""
    fills: list[str] = []
    id_text = _json_of(copy_id) if copy_id is not None and _PLAIN_ID.fullmatch(copy_id) else None

    def hole(value: Any, *, tag: bool = False) -> str:
        text = _json_of(value)
        if id_text is not None and (text == id_text or (tag and type(value) is str)):
            fills.append(COPY_ID_MARK if text == id_text else OWN_TAG_MARK)
        else:
            fills.append(f"{REPEAT_MARK}{fills.index(text) + 1}" if text in fills else text)
        return HOLE

    shaped: dict[str, Any] = {}
    for key, value in message.items():
        names = _SECTIONS.get(key)
        if names is not None and isinstance(value, dict):
            tags = key == "properties"
            shaped[key] = {
                name: item if _repeats(name, item, names) else hole(item, tag=tags and name == "delivery_tag")
                for name, item in value.items()
            }
        else:
            shaped[key] = value if _repeats(key, value, STENCIL_FIELDS) else hole(value)
    text = dumps(shaped)  # type: ignore[no-untyped-call]
    if not fills or HOLE in text or text.count(_HOLE_TEXT) != len(fills):
        return None  # (with no fill it is its stencil: stored whole, nothing to share)
    stencil = text.replace(_HOLE_TEXT, HOLE)
    digest = hashlib.sha1(stencil.encode(), usedforsecurity=False).hexdigest()[:DIGEST_CHARS]
    if COPY_ID_MARK in fills or OWN_TAG_MARK in fills:
        fills.append(MARKED)
    return Packed(digest, stencil, HOLE.join(fills))


def _json_of(value: Any) -> str:
    """``value`` as kombu's JSON writes it: strings and integers (most fills) without its
    encoder's call, which is most of what packing costs the sender."""
    if type(value) is str:
        return encode_basestring_ascii(value)
    if type(value) is int:
        return int.__repr__(value)
    return dumps(value)  # type: ignore[no-untyped-call,no-any-return]


def _repeats(name: str, value: Any, names: frozenset[str]) -> bool:
    """Whether the stencil keeps ``value``. Only a type's own emptiness is asked: a value of
    another type (one a custom serializer writes) is never compared, so never raises here."""
    if name in names or value is None or isinstance(value, bool):
        return True
    return type(value) in (str, list, dict) and not value


def unpack(packed: str, stencil: str, copy_id: str = "", stamp: str = "0") -> str:
    """The message a packed copy's text (what follows ``PACKED_MARK``) and its stencil make:
    what ``lua/_packed.lua`` builds in Redis, for the readers in Python; a marked copy's id is
    ``copy_id`` and its delivery tag ``"<copy_id>:<stamp>"`` (Redis writes its own time there)."""
    fills = packed.split(HOLE)[1:]
    marked = fills[-1:] == [MARKED]
    if marked:
        fills.pop()
    parts = stencil.split(HOLE)
    if len(parts) != len(fills) + 1:
        raise ValueError(f"a stencil of {len(parts) - 1} holes for {len(fills)} fills")
    stand_ins = {COPY_ID_MARK: json.dumps(copy_id), OWN_TAG_MARK: json.dumps(f"{copy_id}:{stamp}")} if marked else {}
    whole = [parts[0]]
    for fill, part in zip(fills, parts[1:], strict=True):
        text = fills[int(fill[1:]) - 1] if fill.startswith(REPEAT_MARK) else fill
        whole += [stand_ins.get(text, text), part]
    return "".join(whole)


def digest_of(packed: str) -> str:
    """The stencil digest a packed copy's text names."""
    return packed.partition(HOLE)[0]
