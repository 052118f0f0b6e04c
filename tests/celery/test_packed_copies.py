"""A stored copy is kept packed: its fills with the copy, its stencil once per task and queue,
put back together in Redis as the message kombu wrote (celery_semaphore/_celery/packing.py)."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kombu.utils.json import dumps

import celery_semaphore._celery.due_copies as due_copies
from celery_semaphore._celery.config import forget_config
from celery_semaphore._celery.due_copies import (
    COPIES_KEY,
    EARLIER_KEYS,
    STENCILS_KEPT_KEY,
    STENCILS_KEY,
    due_copies_for,
    send_copy,
    send_stored,
    withdraw,
)
from celery_semaphore._celery.internals import KOMBU_REDIS_SEPARATOR
from celery_semaphore._celery.packing import PACKED_MARK, pack, unpack
from celery_semaphore._celery.wake_queues import wake_aware
from tests.celery import test_due_copies
from tests.celery.test_due_copies import WAKE_LIST, Setup, _copy, untagged
from tests.parked import stored_due
from tests.redis_server import RedisServer
from tests.waiting import wait_until

servers, setup = test_due_copies.servers, test_due_copies.setup  # its fixtures, shared


def _stored_value(setup: Setup, run: str) -> bytes:
    value = setup.client.hget(COPIES_KEY, run)
    assert value is not None
    return bytes(value)


def test_a_copy_is_stored_packed_in_under_half_its_message_and_sent_as_kombu_wrote_it(setup: Setup) -> None:
    app, client, store = setup.app, setup.client, setup.store
    send_copy(app, _copy(app, "run-p", 0.3))
    value = _stored_value(setup, "run-p")
    message = store.stored_message("run-p")
    assert message is not None and value.startswith(WAKE_LIST.encode() + b"\n" + PACKED_MARK.encode())
    assert len(value) < 0.5 * len(message), (len(value), len(message))
    wait_until(lambda: store.run(["celery"]).moved, timeout=5, what="moved when due")
    (sent,) = client.lrange(WAKE_LIST, 0, -1)
    # Redis put it together as the reader in Python does, with a delivery tag made as it sent it
    assert untagged(sent) == untagged(message)
    assert json.loads(message)["properties"]["delivery_tag"] == "run-p:0"
    assert re.fullmatch(r"run-p:\d+\.\d+", json.loads(sent)["properties"]["delivery_tag"])
    payload = json.loads(sent)
    assert payload["headers"]["argsrepr"] == "('run-p',)"
    assert payload["headers"]["root_id"] == payload["headers"]["id"] == payload["properties"]["correlation_id"]


def test_the_copies_of_one_task_share_one_stencil(setup: Setup) -> None:
    app, client = setup.app, setup.client
    for number in range(30):
        send_copy(app, _copy(app, f"run-{number}", 60))
    assert client.hlen(COPIES_KEY) == 30 and client.hlen(STENCILS_KEY) == 1
    send_copy(app, app.signature("due_copies_test.other", args=(1,), options=_copy(app, "run-o", 60).options))
    assert client.hlen(STENCILS_KEY) == 2


def test_a_wake_up_sends_the_packed_copy_whole_and_keeps_it_as_the_backstop(setup: Setup) -> None:
    app, client, store = setup.app, setup.client, setup.store
    send_copy(app, _copy(app, "run-w", 60))
    assert send_stored(app, "run-w")
    (sent,) = client.lrange(WAKE_LIST, 0, -1)
    woken, stored = json.loads(sent), json.loads(store.stored_message("run-w") or "")
    assert woken["properties"].pop("delivery_tag") != stored["properties"].pop("delivery_tag")  # a tag of its own
    assert woken == stored
    assert stored_due(client).get(b"run-w") is not None


def test_a_message_that_cannot_be_packed_is_stored_whole(setup: Setup) -> None:
    """A value the stencil keeps that is itself the text of a hole (a shadow name of one NUL):
    packing cannot tell it from a hole, so the copy is stored whole, and sent all the same."""
    app, client, store = setup.app, setup.client, setup.store
    copy = _copy(app, "run-x", 0.2)
    copy.options["shadow"] = "\x00"
    send_copy(app, copy)
    assert _stored_value(setup, "run-x").startswith(WAKE_LIST.encode() + b"\n{")
    assert client.hlen(STENCILS_KEY) == 0
    wait_until(lambda: store.run(["celery"]).moved, timeout=5, what="moved when due")
    (sent,) = client.lrange(WAKE_LIST, 0, -1)
    assert json.loads(sent)["headers"]["shadow"] == "\x00"


def test_a_stencil_is_kept_while_a_copy_may_name_it_and_forgotten_after(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept past the due time of the last copy stowed with it and the keeping of the last one
    moved (times shortened here to a fraction of a second); then forgotten by a mover."""
    monkeypatch.setattr(due_copies, "STENCIL_KEEP_S", 0.5)
    monkeypatch.setattr(due_copies, "KEEP_MOVED_S", 0.5)
    app, client, store = setup.app, setup.client, setup.store
    send_copy(app, _copy(app, "run-s", 0.2))
    (short,) = client.hkeys(STENCILS_KEY)
    send_copy(app, app.signature("due_copies_test.long", args=(1,), options=_copy(app, "run-l", 60).options))
    assert client.hlen(STENCILS_KEY) == 2 and client.zcard(STENCILS_KEPT_KEY) == 2
    wait_until(lambda: store.run(["celery"]).moved, timeout=5, what="the short copy moved when due")
    assert client.hexists(STENCILS_KEY, short)  # its moved copy may be sent again
    wait_until(lambda: store.run(["celery"]) and client.hlen(STENCILS_KEY) == 1, timeout=5, what="forgotten")
    assert not client.hexists(STENCILS_KEY, short)
    assert store.stored_message("run-l") is not None  # the other copy's stencil is kept


def test_a_copy_whose_stencil_is_gone_is_kept_and_said(setup: Setup, caplog: pytest.LogCaptureFixture) -> None:
    app, client, store = setup.app, setup.client, setup.store
    send_copy(app, _copy(app, "run-g", 0.1))
    client.delete(STENCILS_KEY)
    assert not send_stored(app, "run-g")
    assert "no longer keeps" in caplog.text
    wait_until(lambda: store.run(["celery"]).unreadable, timeout=5, what="found due")
    assert client.llen(WAKE_LIST) == 0 and client.hexists(COPIES_KEY, "run-g")
    assert float(stored_due(client).get(b"run-g") or 0) > client.time()[0] * 1000 + 50_000  # looked at again later


def test_the_store_of_an_earlier_release_is_moved_sent_and_withdrawn(setup: Setup) -> None:
    """During a rolling deploy, copies an earlier release stored whole, in its own keys, are sent
    by this release's wake-ups, moved when due and forgotten as their runs start."""
    app, client, store = setup.app, setup.client, setup.store
    due_key, copies_key = EARLIER_KEYS[0], EARLIER_KEYS[1]
    message = {"body": "W10=", "headers": {"id": "t-1", "task": "due_copies_test.work"}, "properties": {}}
    now_ms = client.time()[0] * 1000
    for run, due_in_ms in (("run-e1", 60_000), ("run-e2", 60_000), ("run-e3", -1)):
        client.zadd(due_key, {run: now_ms + due_in_ms})
        client.hset(copies_key, run, f"{WAKE_LIST}\n{dumps({**message, 'run': run})}")
    assert store.run(["celery"]).moved == 1  # run-e3, due
    assert send_stored(app, "run-e1")
    assert [json.loads(sent)["run"] for sent in client.lrange(WAKE_LIST, 0, -1)] == ["run-e1", "run-e3"]
    withdraw(app, "run-e2")
    assert client.zrange(due_key, 0, -1) == [b"run-e1"] and client.hkeys(copies_key) == [b"run-e1"]


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@given(
    headers=st.dictionaries(st.sampled_from(["id", "root_id", "task", "lang", "shadow", "csem_run", "x"]), _values),
    body=st.text(),
    reply_to=_values,
)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_packed_message_is_put_back_together_to_the_same_message(
    setup: Setup, headers: dict[str, Any], body: str, reply_to: Any
) -> None:
    """Whatever a message holds: packed, then put back together by Python and by Redis, it is
    the same text, and it decodes to the message."""
    message = {
        "body": body,
        "content-encoding": "utf-8",
        "headers": {**headers, "csem_backstop": "run-h"},
        "properties": {"reply_to": reply_to, "delivery_info": {"routing_key": WAKE_LIST}},
    }
    packed = pack(message)
    if packed is None:  # a stencil value that reads as a hole: stored whole
        assert '"\\u0000"' in dumps(message)
        return
    whole = unpack(f"{packed.digest}\x00{packed.fills}", packed.stencil)
    assert json.loads(whole) == json.loads(dumps(message))
    setup.client.delete(WAKE_LIST)
    setup.store.stow("celery.semaphore-wake", "run-h", 0, packed)
    assert setup.client.lpop(WAKE_LIST).decode() == whole


_celery_bodies = st.tuples(
    st.lists(_values, max_size=4),
    st.dictionaries(st.text(max_size=5), _values, max_size=3),
    st.dictionaries(st.sampled_from(["callbacks", "errbacks", "chain", "chord"]), st.none() | _values),
)


@given(parts=_celery_bodies, task_id=st.sampled_from(["t-1", "run-b#2", 'a"q']))
@example(parts=([1], {}, {}), task_id="t-1")  # bodies of 13, 14 and 15 bytes: each padding
@example(parts=([12], {}, {}), task_id="t-1")
@example(parts=([123], {}, {}), task_id="t-1")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_celery_copy_keeps_its_arguments_not_its_ids_and_is_sent_as_kombu_wrote_it(
    setup: Setup, parts: tuple[list[Any], dict[str, Any], dict[str, Any]], task_id: str
) -> None:
    """A JSON body (kombu writes it base64) is kept as its text with holes, only the arguments
    as fills, and the ids its copy's id "<task id>#<retries>#<run part>" holds (the task id as
    id, root id and correlation id; the run part) as marks. Put back together by Python and by
    Redis (which writes the ids and the base64), it is the text kombu wrote, byte for byte,
    whatever the arguments hold and whatever their length (each of the three base64 paddings);
    an id JSON would escape is kept as a fill, its body still split."""
    from celery_semaphore._celery.packing import HOLE, MORE_MARKED, RUN_PART_MARK, TASK_ID_MARK

    body = base64.b64encode(dumps(list(parts)).encode()).decode()
    run = f"{task_id}#0#ab12"
    message = {
        "body": body,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"id": task_id, "root_id": task_id, "csem_run": "ab12", "csem_backstop": run, "task": "t.work"},
        "properties": {"correlation_id": task_id, "body_encoding": "base64", "delivery_tag": "tag-1"},
    }
    packed = pack(message, copy_id=run)
    assert packed is not None
    fills = packed.fills.split(HOLE)
    assert fills[-1] == MORE_MARKED and body not in packed.fills and f'"{body}"' not in packed.stencil
    plain = '"' not in task_id
    if plain:  # neither id is kept: marks stand in for them
        assert TASK_ID_MARK in fills and RUN_PART_MARK in fills
        assert json.dumps(task_id) not in fills and '"ab12"' not in fills
    else:
        assert json.dumps(task_id) in fills and TASK_ID_MARK not in fills
    if all(value is None for value in parts[2].values()):
        assert dumps(parts[2]) in packed.stencil  # the options every call shares are the stencil's
    whole = unpack(f"{packed.digest}\x00{packed.fills}", packed.stencil, run, "7.5")
    tag = f"{run}:7.5" if plain else "tag-1"
    assert whole == dumps({**message, "properties": {**message["properties"], "delivery_tag": tag}})
    setup.client.delete(WAKE_LIST)
    setup.store.stow("celery.semaphore-wake", run, 0, packed)
    sent = setup.client.lpop(WAKE_LIST).decode()
    assert untagged(sent) == untagged(whole) and json.loads(sent)["body"] == body


def test_a_body_split_copy_is_left_stored_by_a_reader_that_knows_only_the_marks() -> None:
    """Its last fill is ``MORE_MARKED``: a reader of the release before, which
    takes only a last fill of ``MARKED`` for its own, counts one fill more than the stencil's
    holes and leaves the copy stored, never sends the body's JSON text as it is."""
    from celery_semaphore._celery.packing import HOLE, MARKED, MORE_MARKED

    body = base64.b64encode(dumps([[1, "x"], {}, {"callbacks": None}]).encode()).decode()
    message = {
        "body": body,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"id": "t1"},
        "properties": {"body_encoding": "base64"},
    }
    packed = pack(message)
    assert packed is not None
    fills = packed.fills.split(HOLE)
    assert fills == ['[1, "x"]', '"t1"', MORE_MARKED]
    assert len(fills) == packed.stencil.count(HOLE) + 1 and fills[-1] != MARKED
    # anything else than a JSON list of three that reads back to its own text is one fill
    for other in ([1, 2], {"a": 1}, [[], {}, {}, 4]):
        assert pack({**message, "body": base64.b64encode(dumps(other).encode()).decode()}).fills.split(HOLE)[0] == (
            f'"{base64.b64encode(dumps(other).encode()).decode()}"'
        )
    spaced = base64.b64encode(b"[[1],  {}, {}]").decode()  # not as kombu writes it
    assert pack({**message, "body": spaced}).fills.split(HOLE)[0] == f'"{spaced}"'
    assert pack({**message, "content-type": "application/x-python-serialize"}).fills.split(HOLE)[0] == f'"{body}"'


def test_a_packed_copy_goes_to_the_list_kombu_names_for_its_prefix_and_priority(
    servers: tuple[RedisServer, RedisServer],
) -> None:
    """With kombu's ``global_keyprefix`` and a priority, the copy is stored under the prefixed
    keys and sent to the wake queue's list of its priority, named as kombu names it."""
    broker, semaphore = servers
    app = Celery("due_copies_test", broker=broker.url, set_as_current=False)
    app.conf.broker_transport_options = {"global_keyprefix": "gk:"}
    app.conf.semaphore_backend_url = semaphore.url
    forget_config(app)
    wake_aware(app)
    store = due_copies_for(app)
    assert store is not None
    client = broker.client()
    copy = _copy(app, "run-q", 0.2)
    copy.options["priority"] = 3
    send_copy(app, copy)
    assert client.hexists(f"gk:{COPIES_KEY}", "run-q") and client.hlen(f"gk:{STENCILS_KEY}") == 1
    wait_until(lambda: store.run(["celery"]).moved, timeout=5, what="moved when due")
    (sent,) = client.lrange(f"gk:{WAKE_LIST}{KOMBU_REDIS_SEPARATOR}3", 0, -1)
    assert json.loads(sent)["headers"]["argsrepr"] == "('run-q',)"


def test_a_message_with_no_value_of_its_own_is_stored_whole() -> None:
    """Nothing to share: such a message is its stencil, so it is stored as it is."""
    assert pack({"body": "", "content-type": "application/json", "headers": {"lang": "py"}, "properties": {}}) is None
    assert pack({"body": "W10=", "headers": {"lang": "py"}}) is not None


def test_a_copy_keeps_neither_its_run_id_nor_a_delivery_tag_and_each_send_makes_its_own(setup: Setup) -> None:
    """The store keeps a copy under its run's id, and that id is also its ``csem_backstop``
    header; its delivery tag had better be new at each send. So neither is kept with the copy: a
    mark stands in for each, and Redis writes them as it sends the copy. Two sends (a wake-up,
    then the move when due) give one message under two tags of their own."""
    from celery_semaphore._celery.packing import COPY_ID_MARK, HOLE, MARKED, OWN_TAG_MARK

    app, client, store = setup.app, setup.client, setup.store
    run = "7f1d5a9e-2b4c-4e8a-9d6f-0a1b2c3d4e5f#0#9f8e7d6c5b4a3f2e"
    send_copy(app, _copy(app, run, 0.5))
    value = _stored_value(setup, run).decode()
    fills = value.partition("\n")[2].split(HOLE)
    assert f'"{run}"' not in fills, "the run's id is not kept with the copy (its arguments name it too)"
    assert fills[-1].startswith(MARKED) and COPY_ID_MARK in fills and OWN_TAG_MARK in fills
    assert send_stored(app, run)  # a wake-up: sent now, still stored
    wait_until(lambda: store.run(["celery"]).moved, timeout=5, what="moved when due")
    woken, moved = (json.loads(message) for message in reversed(client.lrange(WAKE_LIST, 0, -1)))
    for sent in (woken, moved):
        assert sent["headers"]["csem_backstop"] == run
        assert sent["properties"]["delivery_tag"].startswith(f"{run}:")
    assert woken["properties"]["delivery_tag"] != moved["properties"]["delivery_tag"]
    assert untagged(json.dumps(woken)) == untagged(json.dumps(moved))


def test_a_marked_copy_is_one_fill_longer_than_its_stencil_for_an_earlier_reader() -> None:
    """A reader of an earlier release puts a copy together only when its fills are as many as
    its stencil's holes, and otherwise leaves it stored, unread: a marked copy has one more (its
    ``MARKED`` end), so no earlier release sends a mark as it is. A copy with no id to stand for
    (or one JSON would have to escape) is packed as before, without marks."""
    from celery_semaphore._celery.packing import HOLE, MARKED, MORE_MARKED

    message = {
        "body": "W10=",
        "headers": {"id": "t1", "csem_backstop": "t1#0#ab"},
        "properties": {"delivery_tag": "9d3c", "correlation_id": "t1", "delivery_info": {"routing_key": "q"}},
    }
    marked = pack(message, copy_id="t1#0#ab")
    assert marked is not None
    fills = marked.fills.split(HOLE)
    assert fills[-1] == MORE_MARKED and len(fills) == marked.stencil.count(HOLE) + 1  # "t1": its task id
    only_own = pack({**message, "headers": {"csem_backstop": "copy-7"}}, copy_id="copy-7")
    assert only_own is not None and only_own.fills.split(HOLE)[-1] == MARKED  # the marks that reader knows
    for copy_id in (None, 'a"quote', "é"):
        plain = pack(message, copy_id=copy_id)
        assert plain is not None and plain.fills.split(HOLE)[-1] not in (MARKED, MORE_MARKED)
        assert len(plain.fills.split(HOLE)) == plain.stencil.count(HOLE)
    whole = unpack(f"{marked.digest}\x00{marked.fills}", marked.stencil, "t1#0#ab", "12.5")
    expected = json.loads(dumps(message))
    expected["properties"]["delivery_tag"] = "t1#0#ab:12.5"
    assert json.loads(whole) == expected


def test_a_stencil_is_named_by_16_digits_and_an_earlier_releases_20_still_send(setup: Setup) -> None:
    """Every stored copy begins with its stencil's digest: 16 hex digits. A copy an earlier
    release stored under a 20-digit digest (its stencil kept under that name) is put back
    together by the same script, byte for byte: the scripts split a copy at its holes, whatever
    the digest's length."""
    from celery_semaphore._celery.packing import DIGEST_CHARS

    app, client, store = setup.app, setup.client, setup.store
    send_copy(app, _copy(app, "run-d", 60))
    value = _stored_value(setup, "run-d")
    digest = value.partition(b"\n")[2][len(PACKED_MARK) :].partition(b"\x00")[0]
    assert DIGEST_CHARS == 16 and re.fullmatch(rb"[0-9a-f]{16}", digest), digest
    message = {
        "body": "e30=",
        "content-encoding": "utf-8",
        "headers": {"task": "t.old", "argsrepr": "(1,)", "csem_backstop": "run-old"},
        "properties": {"delivery_info": {"routing_key": WAKE_LIST}},
    }
    packed = pack(message)
    assert packed is not None and len(packed.digest) == 16
    whole = unpack(f"{packed.digest}\x00{packed.fills}", packed.stencil)
    longer = packed._replace(digest=packed.digest + "beef")
    client.delete(WAKE_LIST)
    store.stow("celery.semaphore-wake", "run-old", 0, longer)
    assert client.lpop(WAKE_LIST).decode() == whole


@pytest.mark.parametrize(("kwargs", "in_stencil"), [({}, True), ({"page": 2}, False)])
def test_a_stencil_keeps_the_text_of_empty_keyword_arguments(
    setup: Setup, kwargs: dict[str, Any], in_stencil: bool
) -> None:
    """Celery writes ``kwargsrepr`` as ``"{}"`` for every call without keyword arguments: the
    stencil keeps that text, so no copy does (5 B of each). A call with keyword arguments keeps
    its own as a fill. Either is sent as kombu wrote it."""
    app, client, store = setup.app, setup.client, setup.store
    copy = _copy(app, "run-k", 0.2)
    copy.kwargs.update(kwargs)
    send_copy(app, copy)
    value = _stored_value(setup, "run-k")
    (stencil,) = client.hvals(STENCILS_KEY)
    assert (b'"kwargsrepr": "{}"' in stencil) is in_stencil, stencil
    assert (b'"{}"' in value) is False
    assert (repr(kwargs).encode() in value) is not in_stencil
    wait_until(lambda: store.run(["celery"]).moved, timeout=5, what="moved when due")
    (sent,) = client.lrange(WAKE_LIST, 0, -1)
    assert json.loads(sent)["headers"]["kwargsrepr"] == repr(kwargs)
    assert json.loads(base64.b64decode(json.loads(sent)["body"]))[1] == kwargs
