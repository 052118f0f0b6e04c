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

The body is most of what is left: kombu writes it base64, so a task's arguments and the options
every call shares (``{"callbacks": null, ...}``) are one fill of 120 B or more. A JSON body that
reads back to its own text is kept as that text with holes of its own (``BODY_MARK`` around it in
the stencil): only the arguments are fills, and the scripts write the body base64 as they send
the copy. Such a copy ends in ``MARKED`` with ``BODY_MARK`` after it, which a reader of an
earlier release, base64 unknown to it, does not take for its own mark: it leaves the copy stored.

A message this cannot split with certainty (a hole that would be read twice) is stored whole.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
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
# Around a body kept as its JSON text (in the stencil): the scripts write what is between the two
# marks base64. No JSON text holds a raw one.
BODY_MARK = "\x06"
# The fills a Celery copy's id, "<task id>#<retries>#<run part>" (``WaitHeaders.run_id``), stands
# in for too: its task id (the message's id, root id and correlation id) and its run part (the
# ``csem_run`` header): 53 B of a small task's copy.
TASK_ID_MARK = "\x07"
RUN_PART_MARK = "\x08"
_RUN_ID = re.compile(r"(.+)#[0-9]+#([^#]+)", re.DOTALL)
# The last fill of a copy with marks the release before this one does not know (a body kept as
# its text, TASK_ID_MARK, RUN_PART_MARK): that release takes only MARKED for its own, so it
# counts a fill more than the stencil's holes and leaves the copy stored, unread.
MORE_MARKED = MARKED + BODY_MARK
_HOLE_TEXT = json.dumps(HOLE)
_BODY_TEXT = json.dumps(BODY_MARK)
# An id the scripts may write between quotes as it is: printable ASCII that JSON needs no escape for.
_PLAIN_ID = re.compile(r"[ !#-\[\]-~]+")

# Values of a message's headers and properties that are the same for a task's messages to one
# queue: the stencil keeps them. Whatever else a message holds is a fill. The sending process's
# name (``origin``) and its thread's reply queue (``reply_to``, Celery's ``thread_oid``) are the
# same for every message one producer thread sends, so they go in the stencil too: a stencil
# per task, queue and sending thread, against 52 B more in every copy.
STENCIL_HEADERS = frozenset(
    {"lang", "task", "shadow", "retries", "timelimit", "replaced_task_nesting", "csem_protocol", "csem_queue", "origin"}
)
STENCIL_PROPERTIES = frozenset({"delivery_mode", "delivery_info", "priority", "body_encoding", "reply_to"})
# The message's own keys whose values are the same for every message kombu writes.
STENCIL_FIELDS = frozenset({"content-encoding", "content-type"})
_SECTIONS = {"headers": STENCIL_HEADERS, "properties": STENCIL_PROPERTIES}
# Hex digits of the stencil's digest that name it (64 bits: the stencils one store keeps at once,
# one per task, queue and sending thread, are far too few to meet at that width). Every stored
# copy starts with it; releases before this one wrote 20, which the scripts read the same, as
# they split a copy at its holes, whatever the digest's length.
DIGEST_CHARS = 16
# The texts of an empty argument list and keyword dict as Celery writes them in a message's
# ``argsrepr`` and ``kwargsrepr``: the same for most calls of a task, so the stencil keeps them
# (a stencil for calls with no keyword arguments, another for the rest) and no copy does.
_EMPTY_REPRS = frozenset({"()", "[]", "{}"})


class Packed(NamedTuple):
    """A message as the store keeps it: its stencil's digest and text, and its fills joined by
    ``HOLE`` (the copy's value after ``PACKED_MARK``, digest and ``HOLE``)."""

    digest: str
    stencil: str
    fills: str


def pack(message: dict[str, Any], copy_id: str | None = None, *, split_body: bool = True) -> Packed | None:
    """``message`` (a kombu message before it is written) as a stencil and its fills; None when
    it cannot be split with certainty (then it is stored whole). With ``copy_id`` (the id the
    store keeps the copy under), a fill that is that id and the delivery tag are written as
    marks, which the scripts fill in as they send the copy. A JSON body is kept as its text
    with holes (``_body_parts``) unless ``split_body`` is false."""
    fills: list[str] = []
    id_text = _json_of(copy_id) if copy_id is not None and _PLAIN_ID.fullmatch(copy_id) else None
    stand_ins = _stand_ins(copy_id) if id_text is not None and copy_id is not None else {}

    def hole(value: Any, *, tag: bool = False, text: str | None = None, marks: bool = True) -> str:
        text = _json_of(value) if text is None else text
        if marks and tag and id_text is not None and type(value) is str:
            fills.append(OWN_TAG_MARK)
        elif marks and text in stand_ins:
            fills.append(stand_ins[text])
        else:
            fills.append(f"{REPEAT_MARK}{fills.index(text) + 1}" if text in fills else text)
        return HOLE

    body_text, body_parts = _body_parts(message) if split_body else ("", None)
    body_stencil = ""
    shaped: dict[str, Any] = {}
    for key, value in message.items():
        names = _SECTIONS.get(key)
        if key == "body" and body_parts is not None:
            shaped[key] = BODY_MARK
            first = len(fills)
            # the parts are what json.loads read: its own dumps writes them as kombu's does
            body_stencil = json.dumps(
                [part if kept else hole(part, text=json.dumps(part), marks=False) for part, kept in body_parts]
            )
            if _filled(body_stencil, fills, first) != body_text:  # never a body that reads otherwise
                return pack(message, copy_id, split_body=False)
        elif names is not None and isinstance(value, dict):
            tags = key == "properties"
            shaped[key] = {
                name: item if _repeats(name, item, names) else hole(item, tag=tags and name == "delivery_tag")
                for name, item in value.items()
            }
        else:
            shaped[key] = value if _repeats(key, value, STENCIL_FIELDS) else hole(value)
    text = dumps(shaped)  # type: ignore[no-untyped-call]
    if body_parts is not None:
        if BODY_MARK in text or BODY_MARK in body_stencil or text.count(_BODY_TEXT) != 1:
            return pack(message, copy_id, split_body=False)  # a value that reads as the body's mark
        text = text.replace(_BODY_TEXT, f'"{BODY_MARK}{body_stencil}{BODY_MARK}"')
    if not fills or HOLE in text or text.count(_HOLE_TEXT) != len(fills):
        return None  # (with no fill it is its stencil: stored whole, nothing to share)
    stencil = text.replace(_HOLE_TEXT, HOLE)
    digest = hashlib.sha1(stencil.encode(), usedforsecurity=False).hexdigest()[:DIGEST_CHARS]
    if body_parts is not None or TASK_ID_MARK in fills or RUN_PART_MARK in fills:
        fills.append(MORE_MARKED)
    elif COPY_ID_MARK in fills or OWN_TAG_MARK in fills:
        fills.append(MARKED)
    return Packed(digest, stencil, HOLE.join(fills))


def _stand_ins(copy_id: str) -> dict[str, str]:
    """The JSON texts of the copy's id and of its parts (a Celery run id's task id and run
    part), each with the mark the scripts write it for."""
    texts = {_json_of(copy_id): COPY_ID_MARK}
    parts = _RUN_ID.fullmatch(copy_id)
    if parts is not None:
        texts.setdefault(_json_of(parts[1]), TASK_ID_MARK)
        texts.setdefault(_json_of(parts[2]), RUN_PART_MARK)
    return texts


def _body_parts(message: dict[str, Any]) -> tuple[str, list[tuple[Any, bool]] | None]:
    """A Celery body's text and its three parts (arguments, keyword arguments, the options
    every call shares), each with whether the stencil keeps it (empty, or options that are all
    None), when the body is base64 of ASCII JSON; None otherwise (another serializer, protocol
    or encoding: the body is one fill). ``pack`` keeps the parts only if they write back to the
    same text, so that the scripts, writing them and the base64, send the bytes kombu wrote."""
    properties, body = message.get("properties"), message.get("body")
    if not (
        isinstance(properties, dict)
        and properties.get("body_encoding") == "base64"
        and message.get("content-type") == "application/json"
        and message.get("content-encoding") == "utf-8"
        and type(body) is str
    ):
        return "", None
    try:
        raw = base64.b64decode(body, validate=True)
        text = raw.decode("ascii")
        parts = json.loads(text)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return "", None
    if type(parts) is not list or len(parts) != 3 or base64.b64encode(raw).decode() != body:
        return "", None  # (and a base64 that is not the one its bytes make)
    shared = parts[2]
    kept = [
        _repeats("", parts[0], frozenset()),
        _repeats("", parts[1], frozenset()),
        isinstance(shared, dict) and all(value is None for value in shared.values()),
    ]
    return text, list(zip(parts, kept, strict=True))


def _filled(stencil_json: str, fills: list[str], first: int) -> str:
    """The text ``stencil_json`` (holes as JSON text) makes with ``fills[first:]`` in its holes."""
    pieces = stencil_json.split(_HOLE_TEXT)
    if len(pieces) != len(fills) - first + 1:
        return ""
    whole = [pieces[0]]
    for fill, piece in zip(fills[first:], pieces[1:], strict=True):
        whole += [fills[int(fill[1:]) - 1] if fill.startswith(REPEAT_MARK) else fill, piece]
    return "".join(whole)


def _json_of(value: Any) -> str:
    """``value`` as kombu's JSON writes it: strings, integers and finite floats (most fills)
    without its encoder's call, which is most of what packing costs the sender."""
    if type(value) is str:
        return encode_basestring_ascii(value)
    if type(value) is int:
        return int.__repr__(value)
    if type(value) is float and math.isfinite(value):
        return float.__repr__(value)
    return dumps(value)  # type: ignore[no-untyped-call,no-any-return]


def _repeats(name: str, value: Any, names: frozenset[str]) -> bool:
    """Whether the stencil keeps ``value``. Only a type's own emptiness is asked: a value of
    another type (one a custom serializer writes) is never compared, so never raises here."""
    if name in names or value is None or isinstance(value, bool):
        return True
    if type(value) is str and value in _EMPTY_REPRS:
        return True
    return type(value) in (str, list, dict) and not value


def unpack(packed: str, stencil: str, copy_id: str = "", stamp: str = "0") -> str:
    """The message a packed copy's text (what follows ``PACKED_MARK``) and its stencil make:
    what ``lua/_packed.lua`` builds in Redis, for the readers in Python; a marked copy's id is
    ``copy_id`` and its delivery tag ``"<copy_id>:<stamp>"`` (Redis writes its own time there);
    a body kept as its text is written base64, as kombu wrote it."""
    fills = packed.split(HOLE)[1:]
    marked = fills[-1:] in ([MARKED], [MORE_MARKED])
    more = marked and fills.pop() == MORE_MARKED
    parts = stencil.split(HOLE)
    if len(parts) != len(fills) + 1:
        raise ValueError(f"a stencil of {len(parts) - 1} holes for {len(fills)} fills")
    stand_ins = {mark: text for text, mark in _stand_ins(copy_id).items()} if marked else {}
    if marked:
        stand_ins[OWN_TAG_MARK] = json.dumps(f"{copy_id}:{stamp}")
    whole = [parts[0]]
    for fill, part in zip(fills, parts[1:], strict=True):
        text = fills[int(fill[1:]) - 1] if fill.startswith(REPEAT_MARK) else fill
        whole += [stand_ins.get(text, text), part]
    if not more or BODY_MARK not in stencil:
        return "".join(whole)
    head, body_text, tail = "".join(whole).split(BODY_MARK)
    return head + base64.b64encode(body_text.encode()).decode() + tail


def digest_of(packed: str) -> str:
    """The stencil digest a packed copy's text names."""
    return packed.partition(HOLE)[0]
