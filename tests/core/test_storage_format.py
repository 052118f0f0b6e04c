"""The scripts and Python agree on the storage format. The codes and marks that ``_core/storage.py``
holds must be the ones in the storage-format block of ``lua/_lib.lua``, name by name. The scripts
must use those names, not bare codes or marks, and the Lua patterns must read what the Python
helpers write. The Celery glue's scripts (``_celery/lua``) are built on the same library and held
to the same rules. No Redis is needed: this test reads the Lua source as text.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from celery_semaphore._celery import parked_records, parked_scripts
from celery_semaphore._core import scripts, storage

LUA = Path(scripts.__file__).parent / "lua"
GLUE_LUA = Path(parked_scripts.__file__).parent / "lua"
LIB = (LUA / "_lib.lua").read_text(encoding="utf-8")
SCRIPTS = {path.stem: path.read_text(encoding="utf-8") for path in sorted(LUA.glob("*.lua")) if path.stem != "_lib"} | {
    name: (GLUE_LUA / f"{name}.lua").read_text(encoding="utf-8") for name in parked_scripts._NAMES
}
# Each script as Redis runs it: the library in front of its body.
BUILT = {name: scripts.script_source(name) for name in scripts._NAMES} | {
    name: scripts.built_script(parked_scripts._PACKAGE, name) for name in parked_scripts._NAMES
}
BLOCK_MARKER = "-- @storage-format"

# Python's only, and checked through the Lua patterns that contain them (see the pattern tests).
PYTHON_ONLY = {"WEIGHT_MARK", "SHARDED_MARK", "CLUSTER_MARK"}
# Scripts whose reply is a yes or no as 1 or 0, not a code (Python reads bool(int(reply))).
YES_OR_NO_REPLIES = {"release", "leave", "park", "remember_wait"}

_DECLARATION = re.compile(r"local ([A-Z][A-Z0-9_]*) = (\d+|'(?:[^'\\]|\\.)*')")


def lua_block() -> dict[str, tuple[int | str, str]]:
    """The block's constants: name -> (value, the literal as the source spells it)."""
    after_marker = LIB.split(BLOCK_MARKER, 1)[1]
    lines = after_marker.split("\n\n", 1)[0].splitlines()[1:]
    constants: dict[str, tuple[int | str, str]] = {}
    for line in lines:
        if line.startswith("--"):
            continue
        match = _DECLARATION.fullmatch(line)
        assert match, f"the storage-format block has one 'local NAME = value' per line, not {line!r}"
        name, literal = match.groups()
        assert name not in constants, f"{name} is declared twice"
        constants[name] = (int(literal) if literal.isdigit() else ast.literal_eval(literal), literal)
    return constants


BLOCK = lua_block()
PATTERNS = {name for name in BLOCK if name.endswith("_PATTERN")}


def code_of(lua: str) -> str:
    """Lua text without its comments (no string in these scripts holds "--")."""
    return "\n".join(line.split("--", 1)[0] for line in lua.splitlines())


def python_constants() -> dict[str, object]:
    return {name: value for name, value in vars(storage).items() if name.isupper() and not name.startswith("_")}


def lua_pattern(pattern: str) -> re.Pattern[str]:
    """A Lua pattern as a Python regex, for the items the storage patterns use: ``%`` escapes,
    ``%d``, one ``[...]`` set, anchors, captures and quantifiers."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "%":
            i += 1
            escaped = pattern[i]
            assert not escaped.isalpha() or escaped == "d", f"class %{escaped} is not translated here"
            out.append(r"\d" if escaped == "d" else re.escape(escaped))
        elif char == "[":
            end = pattern.index("]", i)
            assert "%" not in pattern[i:end], "a set with escapes is not translated here"
            out.append(pattern[i : end + 1])
            i = end
        elif char == "^" and i == 0:
            out.append(r"\A")
        elif char == "$" and i == len(pattern) - 1:
            out.append(r"\Z")
        elif char in "()*+?":
            out.append(char)
        elif char == "-":
            out.append("*?")
        else:
            out.append("." if char == "." else re.escape(char))
        i += 1
    return re.compile("".join(out), re.DOTALL)


def lua_match(name: str, text: str) -> str | None:
    """``string.match(text, <the pattern named name>)``, its first capture (or the whole match)."""
    pattern = BLOCK[name][0]
    assert isinstance(pattern, str)
    found = lua_pattern(pattern).search(text)
    if found is None:
        return None
    return found.group(1) if found.groups() else found.group(0)


def redis_glob(pattern: str) -> re.Pattern[str]:
    """A Redis MATCH pattern (``\\`` escapes, ``*``, ``?``) as a regex, to show what it matches."""
    out: list[str] = []
    chars = iter(pattern)
    for char in chars:
        if char == "\\":
            out.append(re.escape(next(chars)))
        elif char == "*":
            out.append(".*")
        elif char == "?":
            out.append(".")
        else:
            assert char not in "[]", "an unescaped set"
            out.append(re.escape(char))
    return re.compile("".join(out), re.DOTALL)


# -- Lua and Python hold the same values -------------------------------------------------------


def test_the_block_is_there_before_any_script_body_runs() -> None:
    """Every script's fast path may use the names, so the block is in the part of _lib.lua that
    scripts.script_source puts in front of every body."""
    assert BLOCK_MARKER in LIB
    assert LIB.index(BLOCK_MARKER) < LIB.index(scripts.REST_OF_LIB)
    for name, source in BUILT.items():
        assert source.index("local GRANTED = ") < source.index(SCRIPTS[name].splitlines()[0])


def test_each_lua_constant_has_the_value_storage_gives_it() -> None:
    python = python_constants()
    for name, (value, _) in BLOCK.items():
        if name in PATTERNS:
            continue
        assert name in python, f"lua/_lib.lua declares {name}, which _core/storage.py does not have"
        assert python[name] == value, f"{name}: Lua says {value!r}, Python says {python[name]!r}"


def test_each_storage_constant_is_declared_in_lua() -> None:
    missing = set(python_constants()) - PYTHON_ONLY - set(BLOCK)
    assert not missing, f"_core/storage.py has {sorted(missing)}, which lua/_lib.lua's block does not declare"


def test_no_script_declares_a_storage_name_again() -> None:
    """A script's own ``local GRANTED = ...`` would hide the block's without a word."""
    outside_block = LIB.replace(LIB.split(BLOCK_MARKER, 1)[1].split("\n\n", 1)[0], "")
    for script, text in [("_lib", outside_block), *SCRIPTS.items()]:
        for name in BLOCK:
            assert not re.search(rf"^\s*local\b[^=\n]*\b{name}\b", text, flags=re.MULTILINE), (script, name)


# -- the scripts use the names ----------------------------------------------------------------


def test_no_script_spells_out_a_stored_mark() -> None:
    """A mark or pattern of the block appears nowhere as a literal but in its declaration."""
    lib = code_of(LIB)
    for name, (value, literal) in BLOCK.items():
        if not isinstance(value, str):
            continue
        spellings = {literal, '"' + literal[1:-1] + '"'}
        assert sum(lib.count(spelling) for spelling in spellings) == 1, f"_lib.lua spells out {name}"
        for script, text in SCRIPTS.items():
            assert not any(spelling in code_of(text) for spelling in spellings), f"{script}.lua spells out {name}"


# a code as a bare number: answered, stored in a code or state variable, compared with one
_BARE_CODES = [
    re.compile(r"\breturn\s*\{?\s*-?\d"),
    re.compile(r"\b(?:code|state|outcome)\s*(?:==|~=|=|<=|>=|<|>)\s*-?\d"),
    re.compile(r"\bcodes\[[^\]]*\]\s*=\s*-?\d"),
    re.compile(r"\bgranted\(\s*-?\d"),
]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_script_answers_with_named_codes(script: str) -> None:
    """Each code of acquire, acquire_many, renew, renew_many and status comes from the block.
    Only the scripts that answer yes or no (1 or 0) may return a bare number."""
    text = code_of(SCRIPTS[script])
    for pattern in _BARE_CODES:
        if script in YES_OR_NO_REPLIES and pattern.pattern.startswith(r"\breturn"):
            continue
        found = pattern.search(text)
        assert found is None, f"{script}.lua: {found.group(0)!r} is a bare code where the block names one"


def test_the_yes_or_no_scripts_answer_only_one_or_zero() -> None:
    for script in YES_OR_NO_REPLIES:
        text = code_of(SCRIPTS[script])
        numbers = set(re.findall(r"\breturn\s*\{?\s*(-?\d+)", text))
        assert numbers and numbers <= {"0", "1"}, (script, numbers)


# -- what Python writes, the scripts read, and the other way round -----------------------------


@pytest.mark.parametrize("weight", [2, 3, 12])
def test_a_weighted_token_round_trip(weight: int) -> None:
    token = storage.weighted_token("tok", weight)
    assert token == f"tok*{weight}"
    assert storage.weighted_token(token, weight) == token  # written once
    assert lua_match("WEIGHTED_TOKEN_PATTERN", token) == str(weight)
    assert storage.ends_in_weight_mark(token)
    members = storage.slot_members(token)
    # slot_members in lua/_lib.lua: the token, then token .. EXTRA_SLOT_MARK .. k for k = 2..w
    assert members == [token] + [f"{token}{BLOCK['EXTRA_SLOT_MARK'][0]}{k}" for k in range(2, weight + 1)]
    assert [storage.is_extra_slot(member) for member in members] == [False] + [True] * (weight - 1)


def test_a_token_of_weight_one_carries_no_mark() -> None:
    assert storage.weighted_token("tok", 1) == "tok"
    assert storage.slot_members("tok") == ["tok"]
    assert lua_match("WEIGHTED_TOKEN_PATTERN", "tok") is None
    assert not storage.ends_in_weight_mark("tok") and not storage.ends_in_weight_mark("a*b")
    assert not storage.is_extra_slot("tok#2")  # "#" marks a slot only after a weight


@pytest.mark.parametrize("weight", [1, 3])
def test_a_weighted_waiter_round_trip(weight: int) -> None:
    waiter = storage.weighted_waiter(weight, "abc")
    assert waiter == f"*{weight}*abc"
    assert storage.is_weighted_waiter(waiter, weight)
    assert not storage.is_weighted_waiter(waiter, weight + 1)
    assert lua_match("WEIGHTED_WAITER_PATTERN", waiter) == str(weight)  # multi_weight in _lib.lua
    assert lua_match("WEIGHTED_WAITER_PATTERN", "abc") is None  # a plain waiter is offered slots


def test_an_offer_is_told_from_a_holder() -> None:
    assert storage.is_offer(storage.OFFER_MARK + "waiter")
    assert not storage.is_offer("token")


def test_a_wake_address_is_published_on_as_its_mark_says() -> None:
    """notify in lua/_lib.lua SPUBLISHes on a sharded listener's address, and never judges a
    cluster listener's unheard; a plain address is neither."""
    base = "semaphore:{crawl:example.org}"
    sharded = storage.wake_address(base, storage.SHARDED_MARK + "0123abcd")
    cluster = storage.wake_address(base, storage.CLUSTER_MARK + "0123abcd")
    plain = storage.wake_address(base, "0123abcd")
    assert lua_match("SHARDED_ADDRESS_PATTERN", sharded) is not None
    assert lua_match("CLUSTER_ADDRESS_PATTERN", cluster) is not None
    for address in (cluster, plain):
        assert lua_match("SHARDED_ADDRESS_PATTERN", address) is None
    for address in (sharded, plain):
        assert lua_match("CLUSTER_ADDRESS_PATTERN", address) is None


@pytest.mark.parametrize(
    ("waiter", "run", "header"),
    [
        ("task-1", "task-1#0#ab", b"#0#ab"),  # a Celery task's run starts with its waiter
        ("*2*task-1", "task-1#0#ab", b'["*2*task-1","task-1#0#ab",0]'),  # a weighted waiter
        ("odd\nid", "odd\nid#0", b'["odd\\nid","odd\\nid#0",0]'),  # a newline in the waiter
    ],
)
def test_a_parked_record_round_trip(waiter: str, run: str, header: bytes) -> None:
    """A record is kept under "<line>\n<waiter>" (the line: the semaphore's name), which the
    scripts build from the line's base and the waiter the same way; its value is the header (the
    run's tail as it is, or the run and the waiter as JSON when the entry's last newline cannot
    tell them), a newline, and its copy: the scripts find the copy after the first newline,
    which neither form writes raw. Read back, taken or not, its due time in front or not, or
    with the JSON header of the release before, it gives the same wait, and the semaphore's name
    from its base."""
    base = "semaphore:{x:y}"
    entry = parked_records.record_entry("semaphore", base, waiter)
    assert entry == "x:y" + BLOCK["RECORD_SEPARATOR"][0] + waiter
    assert parked_records.record_header(waiter, run) == header
    value = parked_records.record_value(waiter, run, b"woken\nthe copy\n")
    assert value == header + b"\n" + b"woken\nthe copy\n"
    earlier = b'["' + header + b'"]' + value[len(header) :] if header.startswith(b"#") else value  # JSON before
    due = b"1796590208377"  # in front of a bucket's value (park.lua)
    for kept in (value, storage.TAKEN_RECORD_MARK.encode() + value, due + value, due + b"~" + value, earlier):
        record = parked_records.ParkedRecord.read(entry, kept, "semaphore")
        assert record == parked_records.ParkedRecord(base, waiter, run, "x:y", b"woken\nthe copy\n", "x:y")
        assert record.entry == entry
        assert parked_records.kept_of(kept) == b"woken\nthe copy\n"
    assert (record.deadlines_key, record.runs_key) == (f"{base}:deadlines", f"{base}:runs")
    assert "line .. RECORD_SEPARATOR .. waiter" in SCRIPTS["claim_parked_waiter"]


@pytest.mark.parametrize(
    ("base", "line"),
    [
        ("semaphore:{x:y}", "x:y"),  # the semaphore's name
        ("semaphore:{}", ""),
        ("semaphore:{a}b}", "a}b"),
        ("semaphore:{tag}:name", "semaphore:{tag}:name"),  # a family's key: its base
        ("semaphore:{semaphore:{x}}", "semaphore:{semaphore:{x}}"),  # a name that reads as a base
    ],
)
def test_a_records_line_is_its_semaphores_name_and_reads_back_to_its_base(base: str, line: str) -> None:
    """Its records name a line by the semaphore's name where they can (12 B fewer in each of
    its two entries, at the default prefix), else by its keys' base; either reads back to the
    base, whatever the name holds."""
    assert parked_records.record_line("semaphore", base) == line
    assert parked_records.base_of_line("semaphore", line) == base


def test_an_earlier_releases_record_reads_as_this_releases() -> None:
    """An earlier release named a record by the JSON of its fields; a sweep or a wake-up of
    this release reads it as its own (and keeps it again, if need be, as its own)."""
    text = json.dumps(["semaphore:{x}:deadlines", "semaphore:{x}:runs", "task-1", "task-1#0#ab", "x"])
    record = parked_records.OldParkedRecord.read(text).as_record(b"copy", "semaphore")
    assert record == parked_records.ParkedRecord("semaphore:{x}", "task-1", "task-1#0#ab", "x", b"copy", "x")
    with pytest.raises(ValueError, match="of no line"):
        parked_records.OldParkedRecord.read(json.dumps(["k", "r", "w", "w#0", "x"])).as_record(b"copy", "semaphore")
    assert "(fields[1] .. RECORD_SEPARATOR .. fields[3])" in SCRIPTS["claim_parked"]


def test_a_parked_line_round_trip() -> None:
    # a bare limit is stored as the number it always was: one member for workers of either version
    line = parked_records.parked_line("semaphore:{x}", b"3")
    assert json.loads(line) == ["semaphore:{x}", 3]
    assert parked_records.read_parked_line(line) == ("semaphore:{x}", b"3")
    gated = parked_records.parked_line("semaphore:{x}", b"3/30/60000/0")
    assert parked_records.read_parked_line(gated) == ("semaphore:{x}", b"3/30/60000/0")


@pytest.mark.parametrize("special", ["*", "?", "[", "]", "\\"])
def test_a_glob_special_in_a_token_prefix_matches_only_itself(special: str) -> None:
    prefix = f"job{special}1:"
    assert storage.glob_escape(prefix) == f"job\\{special}1:"
    pattern = redis_glob(storage.token_prefix_pattern(prefix))
    assert pattern.fullmatch(prefix + "0123abcd")
    assert not pattern.fullmatch("jobX1:0123abcd")
    assert not pattern.fullmatch("job1:0123abcd")


def test_a_plain_prefix_pattern_is_the_prefix_and_a_star() -> None:
    assert storage.token_prefix_pattern("task-1:") == "task-1:*"
    assert storage.glob_escape("a*b?c[d]e\\f") == "a\\*b\\?c\\[d\\]e\\\\f"


def test_a_stored_copys_mark_is_short_and_the_longer_one_before_it_reads_the_same() -> None:
    """Every parked task's record on the Redis broker holds the mark of its stored copy: short,
    so that the record stays in a smaller allocation; a record kept with the longer mark of the
    release before reads the same, and no serialized copy (content type in front) is a mark."""
    assert parked_records.STORED_COPY_MARK == "@"
    for mark in (b"@", b"@broker", b"stored-in-broker"):
        assert parked_records.is_stored_mark(mark)
    assert not parked_records.is_stored_mark(b"application/json\nutf-8\n{}")
    value = parked_records.record_value("t-1", "t-1#0#9f8e7d6c5b4a3f2e", parked_records.kept_copy(b"@", 500))
    assert value == b"#0#9f8e7d6c5b4a3f2e\nahead:500\n@", "in a bucket's listpack, each byte counts"
