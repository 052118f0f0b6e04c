"""The wait headers a re-sent copy of a waiting task carries: what is taken from them, and what
is not (no worker needed: the headers are read from a request's fields, as the task reads them)."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_semaphore._celery.config import config_for
from celery_semaphore._celery.wait_headers import TicketSigner, WaitHistory


def request(**headers: Any) -> Any:
    return SimpleNamespace(id="task-1", retries=0, task="proj.t", headers=headers)


def signer(url: str = "redis://:secret@127.0.0.1:1/0", prefix: str = "semaphore") -> TicketSigner:
    app = Celery("headers", broker="memory://", set_as_current=False)
    app.conf.update(semaphore_backend_url=url, semaphore_prefix=prefix)
    return TicketSigner.of(config_for(app))


def continued(sign: TicketSigner, ticket: int) -> dict[str, Any]:
    """The headers of a copy of a wait that was refused with ``ticket``."""
    return WaitHistory.fresh().next(ticket, retries=0, signer=sign, task_id="task-1")


def test_a_ticket_this_deployment_signed_keeps_its_place() -> None:
    sign = signer()
    history = WaitHistory.of(request(**continued(sign, 123_456))).checked(sign, request())
    assert history.ticket == 123_456
    assert history.waits == 1


@pytest.mark.parametrize("forge", ["unsigned", "changed", "other deployment"])
def test_a_forged_or_foreign_ticket_is_ignored_with_a_warning(forge: str, caplog: pytest.LogCaptureFixture) -> None:
    """A ticket lower than everyone's would jump the line: a copy takes back only a place this
    deployment gave it, and otherwise waits from the back (it is not failed, and not dropped)."""
    caplog.set_level(logging.WARNING, logger="celery_semaphore")  # whatever an earlier test set
    sign = signer()
    headers = continued(sign, 123_456)
    if forge == "unsigned":
        del headers["csem_ticket_sig"]
    elif forge == "changed":
        headers["csem_ticket"] = 1  # the head of every line
    else:
        headers = continued(signer(url="redis://:another@127.0.0.1:1/0"), 123_456)
    history = WaitHistory.of(request(**headers)).checked(sign, request())
    assert history.ticket is None
    assert history.waits == 1  # the rest of the wait is kept: its run id, its first refusal
    assert "did not sign" in caplog.text


def test_a_signature_is_16_digits_and_an_earlier_releases_32_are_still_read() -> None:
    """Every waiting task's stored copy carries its signature: 16 hex digits (64 bits) now. A
    copy a release before this one signed (the first 32 digits of the same digest) keeps its
    place through a rolling deploy; any other length, or a wrong digest of either, does not."""
    sign = signer()
    headers = continued(sign, 123_456)
    short = headers["csem_ticket_sig"]
    assert len(short) == 16
    full = sign._digest("task-1", headers["csem_run"], 123_456)
    assert full.startswith(short)
    for written, kept in [(full[:32], True), (short, True), (full[:24], False), (full, False)]:
        history = WaitHistory.of(request(**{**headers, "csem_ticket_sig": written})).checked(sign, request())
        assert (history.ticket == 123_456) is kept, written
    forged = ("0" if full[0] != "0" else "1") + full[1:32]
    assert WaitHistory.of(request(**{**headers, "csem_ticket_sig": forged})).checked(sign, request()).ticket is None


def test_the_stamps_of_a_wait_are_whole_milliseconds_never_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """``csem_sent`` and ``csem_first_refused`` are written to the millisecond (4 B fewer each in
    every stored copy), rounded up: a stamp never names a moment before the one it marks, so a
    success recorded before the send is never taken for this invocation's. (The clock is set by
    hand: the rounding of a given instant is what is asserted.)"""
    from celery_semaphore._celery import stamping, wait_headers

    monkeypatch.setattr(wait_headers.time, "time", lambda: 1796295395.3951001)
    headers: dict[str, Any] = {}
    stamping.stamp(headers=headers)
    history = WaitHistory.fresh(headers["csem_sent"])
    assert repr(headers["csem_sent"]) == repr(history.first_refused) == "1796295395.396"
    assert history.since() >= 1796295395.3951001
    monkeypatch.setattr(wait_headers.time, "time", lambda: 1796295395.396)
    assert wait_headers.epoch_ms() == 1796295395.396


def test_a_message_nonce_is_12_digits_and_an_earlier_releases_16_are_still_read() -> None:
    """The nonce tells apart invocations that reuse one task id; every stored copy carries it,
    so it is written with 12 hex digits (48 bits). A message an earlier release stamped (16) is
    still named by its nonce, so a redelivery of it continues its own wait."""
    from celery_semaphore._celery import stamping, wait_headers

    headers: dict[str, Any] = {}
    stamping.stamp(headers=headers)
    assert re.fullmatch(r"[0-9a-f]{12}", headers["csem_message"]), headers
    for written in (headers["csem_message"], "0123456789abcdef"):
        assert wait_headers.message_nonce(request(csem_message=written)) == written
    assert wait_headers.message_nonce(request(csem_message="not hex")) is None


def test_hosts_reaching_the_same_redis_by_other_names_agree() -> None:
    sign = signer("redis://:secret@127.0.0.1:1/0")
    history = WaitHistory.of(request(**continued(sign, 42))).checked(signer("redis://:secret@localhost:2/0"), request())
    assert history.ticket == 42


@pytest.mark.parametrize(
    "headers",
    [
        {"csem_first_refused": "x", "csem_wait_of_retry": 0},
        {"csem_first_refused": 1.0, "csem_wait_of_retry": 0, "csem_ticket": "not a ticket"},
        {"csem_first_refused": 1.0, "csem_wait_of_retry": 0, "csem_ticket": -5},
        {
            "csem_first_refused": 1.0,
            "csem_wait_of_retry": 0,
            "csem_run": "../x",
            "csem_protocol": 2,
        },
        {"csem_first_refused": float("nan"), "csem_wait_of_retry": 0},
    ],
)
def test_headers_that_do_not_parse_start_a_fresh_wait(
    headers: dict[str, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_semaphore")
    history = WaitHistory.of(request(**headers))
    assert (history.waits, history.ticket) == (0, None)
    assert "ignoring wait headers" in caplog.text


def test_headers_of_a_release_before_protocol_2_keep_their_run_id() -> None:
    """Copies written before per-wait run ids ask under "<task id>#<retries>", as their twins of
    the old release do, so the two still know each other during a rolling deploy. (Those
    releases wrote the headers under their old names.)"""
    history = WaitHistory.of(request(semaphore_first_refused=1.0, semaphore_wait_of_retry=0, semaphore_waits=2))
    assert history.run_id(request()) == "task-1#0"
    assert history.waits == 2


def test_a_re_sent_copy_leaves_the_brokers_headers_behind() -> None:
    """A copy re-sent with the dead-lettering headers of the message it came in (as Celery strips
    them from its own retries) may be dropped by RabbitMQ quorum queues or delayed delivery."""
    from celery_semaphore._celery.wait_headers import without_broker_headers

    delivered = {
        "x-death": [{"count": 1}],
        "x-first-death-queue": "q",
        "x-last-death-reason": "rejected",
        "x-delivery-count": 2,
        "csem_waits": 1,
        "tenant": "a",
    }
    assert without_broker_headers(delivered) == {"csem_waits": 1, "tenant": "a"}


# What a waiting task's copy carried when an earlier release sent it: the same headers, under the
# prefix of the task options.
_OLD_HEADERS = {
    "semaphore_waits": 2,
    "semaphore_first_refused": 1.5,
    "semaphore_ticket": 123_456,
    "semaphore_wait_of_retry": 0,
    "semaphore_queue": "crawl",
    "semaphore_run": "ab12",
    "semaphore_protocol": 2,
    "semaphore_sent": 1.25,
    "semaphore_message": "cafe01",
    "semaphore_due": 9.5,
    "semaphore_handed_back": 1,
}


def _delivered(headers: dict[str, Any]) -> Any:
    """A task message with ``headers``, published and received through kombu (its in-memory
    transport), and the request the worker makes of it, as a task's body sees it."""
    from celery.app.task import Context
    from celery.worker.request import Request
    from kombu import Connection, Queue

    app = Celery("old-release", broker="memory://", set_as_current=False)

    @app.task(name="old_release.t", shared=False)  # this app alone: no other app gets it
    def task() -> None: ...

    message = app.amqp.as_task_v2("task-1", task.name, args=(), kwargs={})
    queue = Queue("old-release", routing_key="old-release")
    with Connection("memory://") as connection:
        connection.Producer().publish(
            message.body,
            routing_key="old-release",
            declare=[queue],
            headers={**message.headers, **headers},
            serializer="json",
            **message.properties,
        )
        received = connection.SimpleQueue(queue).get(timeout=5)
        received.ack()
    return received, Context(Request(received, app=app, task=task).request_dict)


def test_a_message_an_earlier_release_sent_is_read_under_the_old_names() -> None:
    """During a rolling deploy, a worker of this release receives copies an earlier one sent:
    their wait (refusals, first refusal, place in line, run, queue, send stamp, nonce) and a held
    backstop's due time are read from the old names, as from the new ones."""
    from celery_semaphore._celery.backstop import due_in
    from celery_semaphore._celery.wait_headers import message_nonce

    message, request = _delivered(_OLD_HEADERS)
    history = WaitHistory.of(request)
    assert (history.waits, history.first_refused, history.ticket) == (2, 1.5, 123_456)
    assert (history.run_part, history.origin, history.sent) == ("ab12", "crawl", 1.25)
    assert message_nonce(request) == "cafe01"
    assert due_in(message.headers, now=9.0) == 0.5


def test_a_copy_sent_on_carries_the_package_headers_under_the_new_names_only() -> None:
    """A copy re-sent from a message an earlier release wrote keeps its values (its send stamp
    and nonce above all: re-stamped, it would be taken for another invocation), under the new
    names only; where both names are there, the new one's value is the one kept."""
    from celery_semaphore._celery.wait_headers import PREFIX, without_broker_headers

    message, _ = _delivered({**_OLD_HEADERS, "csem_waits": 3, "tenant": "a", "semaphore_priority": 60})
    sent_on = without_broker_headers(message.headers)
    # the user's per-call option keeps its name; none of the package's own is left under the old
    assert [name for name in sent_on if name.startswith("semaphore_")] == ["semaphore_priority"]
    assert sent_on["csem_waits"] == 3 and sent_on["tenant"] == "a"
    assert {f"{PREFIX}{name.removeprefix('semaphore_')}": value for name, value in _OLD_HEADERS.items()} == {
        name: value for name, value in sent_on.items() if name.startswith(PREFIX) and name != "csem_waits"
    } | {"csem_waits": 2}


def test_new_wait_headers_carry_only_the_new_prefix() -> None:
    """What a refusal writes on the next copy, and the stamp of a message as it is sent."""
    from celery_semaphore._celery.stamping import stamp

    headers = continued(signer(), 42)
    stamp(headers)
    assert headers and all(name.startswith("csem_") for name in headers), headers
