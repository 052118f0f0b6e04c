"""The Celery and kombu internals the worker glue relies on hold with the installed versions,
and a worker says at start, once, which ones no longer hold and what falls back."""

from __future__ import annotations

from typing import Any

import pytest

from celery_semaphore._celery import internals
from celery_semaphore._celery.internals import INTERNALS, Internal, broken_internals, warn_if_broken


@pytest.mark.parametrize("internal", INTERNALS, ids=[entry.name for entry in INTERNALS])
def test_each_internal_holds_with_the_installed_celery_and_kombu(internal: Internal) -> None:
    """Fails on a Celery or kombu release that changed it: then update the glue that uses it
    (``used_by``) and the list."""
    assert not broken_internals((internal,)), f"{internal.name} no longer holds ({internals.installed_versions()})"


def test_the_list_names_every_module_that_reaches_into_celery_or_kombu() -> None:
    used_by = {module.strip() for entry in INTERNALS for module in entry.used_by.split(",")}
    assert used_by == {"woken_first", "handing_back", "due_copies", "stowing", "started", "child_exits"}


def _gone() -> bool:
    raise ImportError("moved in a later release")


def test_a_changed_internal_is_one_warning_naming_it_the_versions_and_the_fallback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # entries of our own stand in for an upgrade that broke them: no release to install does
    changed = (
        Internal("kombu Thing._gone", "woken_first", "woken tasks keep Celery's order", _gone),
        Internal("celery Other.attr", "handing_back", "copies come back at the close", lambda: False),
        Internal("still there", "started", "nothing", lambda: True),
    )
    with caplog.at_level("WARNING", logger="celery_semaphore"):
        broken = warn_if_broken(changed)
    assert [entry.name for entry in broken] == ["kombu Thing._gone", "celery Other.attr"]
    (record,) = caplog.records
    message = record.getMessage()
    assert "2 Celery/kombu internal(s)" in message
    assert "kombu Thing._gone (used by woken_first): woken tasks keep Celery's order" in message
    assert "celery Other.attr (used by handing_back): copies come back at the close" in message
    assert "still there" not in message
    assert "celery 5." in message and "kombu 5." in message  # the installed versions
    assert "tested with celery 5.3-5.7" in message


def test_nothing_is_logged_when_every_internal_holds(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="celery_semaphore"):
        assert warn_if_broken() == []
    assert not caplog.records


def test_a_worker_checks_the_internals_as_it_starts(monkeypatch: Any) -> None:
    # the start-time check is wired into the worker's bootstep, not left to the tests
    from celery_semaphore._celery import worker

    checked: list[bool] = []
    monkeypatch.setattr(internals, "warn_if_broken", lambda *a: checked.append(True) or [])

    class _Worker:
        app = None
        hostname = "w@h"
        concurrency = 1

    monkeypatch.setattr(worker, "check_app", lambda app: None)
    monkeypatch.setattr(worker.node_names, "begin", lambda app, hostname: None)
    worker.SemaphoreStep(_Worker())
    assert checked == [True]
