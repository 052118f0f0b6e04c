"""The wait headers a re-sent copy of a waiting task carries: what is taken from them, and what
is not (no worker needed: the headers are read from a request's fields, as the task reads them)."""

from __future__ import annotations

import logging
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
        del headers["semaphore_ticket_sig"]
    elif forge == "changed":
        headers["semaphore_ticket"] = 1  # the head of every line
    else:
        headers = continued(signer(url="redis://:another@127.0.0.1:1/0"), 123_456)
    history = WaitHistory.of(request(**headers)).checked(sign, request())
    assert history.ticket is None
    assert history.waits == 1  # the rest of the wait is kept: its run id, its first refusal
    assert "did not sign" in caplog.text


def test_hosts_reaching_the_same_redis_by_other_names_agree() -> None:
    sign = signer("redis://:secret@127.0.0.1:1/0")
    history = WaitHistory.of(request(**continued(sign, 42))).checked(signer("redis://:secret@localhost:2/0"), request())
    assert history.ticket == 42


@pytest.mark.parametrize(
    "headers",
    [
        {"semaphore_first_refused": "x", "semaphore_wait_of_retry": 0},
        {"semaphore_first_refused": 1.0, "semaphore_wait_of_retry": 0, "semaphore_ticket": "not a ticket"},
        {"semaphore_first_refused": 1.0, "semaphore_wait_of_retry": 0, "semaphore_ticket": -5},
        {
            "semaphore_first_refused": 1.0,
            "semaphore_wait_of_retry": 0,
            "semaphore_run": "../x",
            "semaphore_protocol": 2,
        },
        {"semaphore_first_refused": float("nan"), "semaphore_wait_of_retry": 0},
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
    the old release do, so the two still know each other during a rolling deploy."""
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
        "semaphore_waits": 1,
        "tenant": "a",
    }
    assert without_broker_headers(delivered) == {"semaphore_waits": 1, "tenant": "a"}
