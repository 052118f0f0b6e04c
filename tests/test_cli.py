"""``celery -A tests.proj.app semaphore ...`` against real Redis servers, through Celery's own CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.bin.celery import celery
from click.testing import CliRunner, Result

from celery_semaphore import FairSemaphore, Lease
from celery_semaphore._celery.catalogue import Catalogue
from celery_semaphore._celery.config import forget_config
from celery_semaphore._core.attempts import Ask, new_token
from celery_semaphore.cli import duration

from .redis_server import RedisServer, free_port
from .waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
CELERY = Path(sys.executable).parent / "celery"
LABEL = "box:4242 proj.hold[task-1]"


@dataclass
class Proj:
    """The test app pointed at this test's Redis, and a client on the semaphore database."""

    app: Any
    url: str
    client: redis.Redis

    def cli(self, *args: str, input: str | None = None) -> Result:
        return CliRunner().invoke(celery, ["-A", "tests.proj.app", "semaphore", *args], input=input)

    def status_json(self, *args: str) -> Any:
        result = self.cli("status", "--json", *args)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    def hold(self, key: str, limit: int, label: str = LABEL) -> Lease:
        return FairSemaphore(self.client, key, limit, lease=30).acquire(timeout=5, label=label)


@pytest.fixture
def proj(redis_server: RedisServer) -> Iterator[Proj]:
    from tests.proj.app import app

    url = f"redis://127.0.0.1:{redis_server.port}/1"
    client = redis_server.client(db=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(app.conf, "semaphore_backend_url", url)
        patch.setitem(app.conf, "semaphore_limits", {"crawl:*": 2})
        forget_config(app)
        yield Proj(app, url, client)
    forget_config(app)
    client.close()


def test_status_lists_live_semaphores_and_fixed_key_tasks(proj: Proj) -> None:
    """The list shows keys found in Redis (with their task and limit source) and idle fixed-key tasks."""
    with proj.hold("proj.hold", 3), proj.hold("crawl:example.com", 2), proj.hold("adhoc", 1):
        result = proj.cli("status")
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
    assert result.stdout.splitlines()[0].split() == ["KEY", "LIMIT", "SOURCE", "HOLDERS", "WAITERS", "TASK"]
    assert rows["proj.hold"] == ["proj.hold", "3", "proj.hold.semaphore_limit", "1", "0", "proj.hold"]
    crawl = ["crawl:example.com", "2", "semaphore_limits['crawl:*']", "1", "0", "proj.crawl"]
    assert rows["crawl:example.com"] == crawl
    assert "no limit configured" in " ".join(rows["adhoc"])
    assert rows["proj.sleepy"][3:5] == ["0", "0"]  # idle, but its key is fixed: listed


def test_status_match_narrows_the_list(proj: Proj) -> None:
    """--match keeps only the keys matching a glob, live or fixed."""
    with proj.hold("crawl:a.example", 2), proj.hold("crawl:b.example", 2):
        data = proj.status_json("--match", "crawl:*")
    assert [entry["key"] for entry in data["semaphores"]] == ["crawl:a.example", "crawl:b.example"]
    assert {entry["family"] for entry in data["semaphores"]} == {"crawl:{host}"}


def test_status_of_a_key_shows_holders_and_waiters(proj: Proj) -> None:
    """status KEY lists each holder's label, age and lease left, and each waiter's place and wait."""
    semaphore = FairSemaphore(proj.client, "proj.hold", 1, lease=30)
    with semaphore.acquire(timeout=5, label=LABEL):
        for waiter in ("waiter-a", "waiter-b"):
            semaphore._try(Ask(token=new_token(), waiter=waiter, patience=60))
        result = proj.cli("status", "proj.hold")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "semaphore  proj.hold" in lines
    assert "limit      3 (proj.hold.semaphore_limit)" in lines
    assert "holders    1 of 3" in lines
    holder = next(line for line in lines if LABEL in line)
    age, lease_left = holder.split()[-2:]
    assert age.endswith(("ms", "s"))
    assert lease_left.endswith("s")
    waiters = [line.split() for line in lines if "waiter-" in line]
    assert [(row[0], row[1]) for row in waiters] == [("0", "waiter-a"), ("1", "waiter-b")]


def test_status_json_details_for_scripts(proj: Proj) -> None:
    """status KEY --json gives the limit, its source and every holder with label and timings."""
    with proj.hold("crawl:example.com", 2):
        data = proj.status_json("crawl:example.com")
    assert data["task"] == "proj.crawl"
    assert data["family"] == "crawl:{host}"
    assert (data["limit"], data["source"], data["override"]) == (2, "semaphore_limits['crawl:*']", None)
    assert data["holder_count"] == 1
    [holder] = data["holders"]
    assert holder["label"] == LABEL
    assert 0 <= holder["held_for"] < 30 < holder["held_for"] + holder["expires_in"] + 1


def test_a_key_no_task_or_setting_covers_says_no_limit_configured(proj: Proj) -> None:
    """A key that neither a task nor semaphore_limits accounts for has no limit, and says so."""
    result = proj.cli("status", "nobody:knows")
    assert result.exit_code == 0, result.output
    assert "limit      - (no limit configured)" in result.stdout
    assert "task       - (no task of this app uses this key)" in result.stdout


def test_set_limit_and_unset_limit_change_the_limit_and_its_source(proj: Proj) -> None:
    """set-limit stores an override that status reports (and workers obey); unset-limit drops it."""
    result = proj.cli("set-limit", "proj.hold", "5")
    assert result.exit_code == 0, result.output
    assert "limit 5 (runtime override, kept until unset; configured: 3 from proj.hold.semaphore_limit)" in result.stdout
    data = proj.status_json("proj.hold")
    assert (data["limit"], data["source"]) == (5, "runtime override")
    assert data["override"] == {"limit": 5, "expires_in": None}
    assert data["configured"] == {"limit": 3, "source": "proj.hold.semaphore_limit"}
    assert FairSemaphore(proj.client, "proj.hold", 3).status().limit == 5

    result = proj.cli("unset-limit", "proj.hold")
    assert result.exit_code == 0, result.output
    assert "runtime limit removed; limit 3 (proj.hold.semaphore_limit)" in result.stdout
    data = proj.status_json("proj.hold")
    assert (data["limit"], data["source"], data["override"]) == (3, "proj.hold.semaphore_limit", None)
    assert "there was no runtime limit" in proj.cli("unset-limit", "proj.hold").stdout


def test_set_limit_with_ttl_expires_by_itself(proj: Proj) -> None:
    """--ttl makes the override lapse on its own; status shows the time it has left."""
    assert proj.cli("set-limit", "crawl:example.com", "4", "--ttl", "30").exit_code == 0
    data = proj.status_json("crawl:example.com")
    assert data["limit"] == 4
    assert 0 < data["override"]["expires_in"] <= 30
    assert proj.cli("set-limit", "crawl:example.com", "4", "--ttl", "0.2").exit_code == 0
    wait_until(lambda: proj.status_json("crawl:example.com")["override"] is None, what="the override to lapse")
    assert proj.status_json("crawl:example.com")["source"] == "semaphore_limits['crawl:*']"


def test_set_limit_on_a_key_nobody_knows_warns(proj: Proj) -> None:
    """An override for a key no task, setting or live semaphore knows is stored with a note about typos."""
    result = proj.cli("set-limit", "crwal:example.com", "2")
    assert result.exit_code == 0, result.output
    assert "check the key for typos" in result.stderr
    assert proj.client.get("semaphore:{crwal:example.com}:limit") == b"2"


@pytest.mark.parametrize("bad", ["0", "-2", "abc", "2.5", ""])
def test_a_bad_limit_is_a_usage_error_naming_the_value(proj: Proj, bad: str) -> None:
    """set-limit refuses a limit that is not a whole number >= 1, naming it, before touching Redis."""
    result = proj.cli("set-limit", "proj.hold", "--", bad)
    assert result.exit_code == 2, result.output
    assert "Invalid value for 'N'" in result.stderr
    assert repr(bad) in result.stderr
    assert proj.client.keys("*") == []


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_ttl_is_a_usage_error_naming_the_value(proj: Proj, bad: str) -> None:
    """set-limit --ttl refuses a duration that is not a finite number of seconds above 0."""
    result = proj.cli("set-limit", "proj.hold", "2", f"--ttl={bad}")
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--ttl'" in result.stderr
    assert bad in result.stderr
    assert proj.client.keys("*") == []


def test_reset_asks_first_then_empties_the_semaphore(proj: Proj) -> None:
    """reset asks for confirmation (no means no change); yes forgets every holder and waiter but the limit."""
    semaphore = FairSemaphore(proj.client, "proj.hold", 1, lease=30)
    with semaphore.acquire(timeout=5, label=LABEL) as holder:
        semaphore._try(Ask(token=new_token(), waiter="waiter-a", patience=60))
        semaphore.set_limit(1)

        refused = proj.cli("reset", "proj.hold", input="n\n")
        assert refused.exit_code == 1
        assert "Forget 1 holder(s) and 1 waiter(s) of 'proj.hold'?" in refused.output
        assert semaphore.status().holder_count == 1

        confirmed = proj.cli("reset", "proj.hold", input="y\n")
        assert confirmed.exit_code == 0, confirmed.output
        assert "forgot 1 holder(s) and 1 waiter(s)" in confirmed.stdout
        status = semaphore.status()
        assert (status.holder_count, status.waiter_count, status.limit_source) == (0, 0, "override")
        assert not holder.release()  # its slot was already gone


def test_reset_yes_skips_the_question(proj: Proj) -> None:
    """reset -y (or --yes) resets without asking, for scripts."""
    semaphore = FairSemaphore(proj.client, "proj.hold", 1, lease=30)
    with semaphore.acquire(timeout=5):
        result = proj.cli("reset", "-y", "proj.hold")
        assert result.exit_code == 0, result.output
        assert "?" not in result.output
        assert semaphore.status().holder_count == 0


def test_match_with_a_key_is_a_usage_error(proj: Proj) -> None:
    """--match narrows a list, so combining it with KEY is refused rather than ignored."""
    result = proj.cli("status", "proj.hold", "--match", "crawl:*")
    assert result.exit_code == 2
    assert "--match" in result.stderr


def test_unreachable_redis_is_a_one_line_error(proj: Proj) -> None:
    """With the backend Redis down, a command fails with exit code 1 and a message, not a traceback."""
    proj.app.conf.semaphore_backend_url = f"redis://127.0.0.1:{free_port()}/1"
    forget_config(proj.app)
    result = proj.cli("status", "proj.hold")
    assert result.exit_code == 1
    assert "Redis unavailable" in result.stderr
    assert "Traceback" not in result.output


def test_keys_are_matched_to_the_most_specific_task(proj: Proj) -> None:
    """A key belongs to the task with that fixed key, else to the template that matches it."""
    catalogue = Catalogue(proj.app)
    assert catalogue.task_for("proj.hold").name == "proj.hold"
    assert catalogue.task_for("crawl:a:b.example").name == "proj.crawl"
    assert catalogue.family_for("crawl:") == "crawl:{host}"
    assert catalogue.task_for("crawl") is None
    assert catalogue.family_for("adhoc") == "(other)"


def test_durations_read_as_an_operator_expects() -> None:
    """Ages and leases print in the largest fitting units."""
    assert [duration(s) for s in (0.25, 12.34, 245, 7380, 273600)] == ["250ms", "12.3s", "4m05s", "2h03m", "3d04h"]


def test_the_installed_celery_command_shows_a_live_holder(proj: Proj, redis_server: RedisServer) -> None:
    """The real `celery` program finds the sub-command through the entry point and shows a holder."""
    env = {**os.environ, "PROJ_SEMAPHORE_URL": proj.url, "PROJ_BROKER_URL": redis_server.url, "PROJ_CONF": "{}"}
    env.pop("APP", None)
    with proj.hold("proj.hold", 3):
        done = subprocess.run(
            [str(CELERY), "-A", "tests.proj.app", "semaphore", "status", "proj.hold"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    assert "holders    1 of 3" in done.stdout
    assert LABEL in done.stdout
