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
from celery_semaphore._core.attempts import Ask, Granted, new_token
from celery_semaphore.cli import duration

from ..redis_server import RedisServer, free_port
from ..waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
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
    # the app has tasks with a rate or a spacing, so the rule columns are shown
    header = ["KEY", "LIMIT", "SOURCE", "HOLDERS", "WAITERS", "RATE", "SPACING", "PAUSED", "NEXT", "START"]
    assert result.stdout.splitlines()[0].split() == [*header, "STARTS", "TASK"]
    no_rules = ["-", "-", "-", "now", "-"]
    assert rows["proj.hold"] == ["proj.hold", "3", "proj.hold.semaphore_limit", "1", "0", *no_rules, "proj.hold"]
    crawl = ["crawl:example.com", "2", "semaphore_limits['crawl:*']", "1", "0", *no_rules, "proj.crawl"]
    assert rows["crawl:example.com"] == crawl
    assert "no limit configured" in " ".join(rows["adhoc"])
    assert rows["proj.sleepy"][3:5] == ["0", "0"]  # idle, but its key is fixed: listed
    assert rows["proj.rated"][1] == "none"  # a rate and no concurrency limit
    assert rows["proj.rated"][5:10] == ["5/s", "-", "-", "now", "0/5"]
    assert rows["proj.spaced"][5:7] == ["-", "300ms"]


def test_a_list_without_rates_spacings_or_pauses_keeps_its_columns(proj: Proj) -> None:
    """The rule columns appear only when a listed key has a rate, a spacing or a pause."""
    plain = proj.cli("status", "--match", "proj.hold")
    assert plain.exit_code == 0, plain.output
    assert plain.stdout.splitlines()[0].split() == ["KEY", "LIMIT", "SOURCE", "HOLDERS", "WAITERS", "TASK"]
    assert proj.cli("pause", "proj.hold").exit_code == 0
    paused = proj.cli("status", "--match", "proj.hold").stdout.splitlines()
    assert "PAUSED" in paused[0].split()
    assert "until resumed" in paused[1]


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


def test_status_names_a_cap_per_tenant_beside_the_limit(proj: Proj) -> None:
    """semaphore_limits {"proj.fair_capped": {"limit": 3, "per_tenant": 2}}: the limit line says
    the cap, and --json gives it as per_tenant; a key without one says nothing of it."""
    capped = {"crawl:*": 2, "proj.fair_capped": {"limit": 3, "per_tenant": 2}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(proj.app.conf, "semaphore_limits", capped)
        forget_config(proj.app)
        check_status_names_the_cap(proj)
    forget_config(proj.app)


def check_status_names_the_cap(proj: Proj) -> None:
    result = proj.cli("status", "proj.fair_capped")
    assert result.exit_code == 0, result.output
    assert "limit      3 (semaphore_limits['proj.fair_capped']), at most 2 per tenant" in result.stdout
    assert proj.status_json("proj.fair_capped")["per_tenant"] == 2
    assert proj.status_json("proj.hold")["per_tenant"] is None
    assert "per tenant" not in proj.cli("status", "proj.hold").stdout


def test_set_limit_and_unset_limit_change_the_limit_and_its_source(proj: Proj) -> None:
    """set-limit stores an override that status reports (and workers obey); unset-limit drops it."""
    result = proj.cli("set-limit", "proj.hold", "5")
    assert result.exit_code == 0, result.output
    assert "limit 5 (runtime override, kept until unset; configured: 3 from proj.hold.semaphore_limit)" in result.stdout
    data = proj.status_json("proj.hold")
    assert (data["limit"], data["source"]) == (5, "runtime override")
    assert data["override"] == {"limit": 5, "expires_in": None}
    assert data["configured"] == {"limit": 3, "source": "proj.hold.semaphore_limit", "rate": None, "spacing": None}
    assert FairSemaphore(proj.client, "proj.hold", 3).status().limit == 5

    result = proj.cli("unset-limit", "proj.hold")
    assert result.exit_code == 0, result.output
    assert "runtime limit removed; limit 3 (proj.hold.semaphore_limit)" in result.stdout
    data = proj.status_json("proj.hold")
    assert (data["limit"], data["source"], data["override"]) == (3, "proj.hold.semaphore_limit", None)
    assert "there was no runtime limit" in proj.cli("unset-limit", "proj.hold").stdout


def test_set_share_stores_a_runtime_share_and_none_removes_it(proj: Proj) -> None:
    """set-share stores a tenant's share where every worker's acquire reads it; none removes
    it; a bad share is refused with the value named, storing nothing."""
    sem = FairSemaphore(proj.client, "proj.hold", 3)
    result = proj.cli("set-share", "proj.hold", "acme", "4")
    assert result.exit_code == 0, result.output
    assert "'acme' has share 4" in result.stdout
    assert proj.client.hget(sem.keys.shares, "acme") == b"4"
    result = proj.cli("set-share", "proj.hold", "acme", "none")
    assert result.exit_code == 0 and "removed" in result.stdout
    assert not proj.client.hexists(sem.keys.shares, "acme")
    for bad in ("0", "lots", "5000"):
        result = proj.cli("set-share", "proj.hold", "acme", bad)
        assert result.exit_code != 0 and bad in result.output, result.output
    assert not proj.client.hexists(sem.keys.shares, "acme")


def test_status_of_a_key_lists_its_tenants_by_calls_waiting(proj: Proj) -> None:
    """A key whose calls name tenants: status KEY lists the tenants with the most calls waiting,
    their shares (big:* has 3 from semaphore_shares; a runtime share says so), text and JSON."""
    holder = proj.hold("proj.fair", 1)
    sem = FairSemaphore(proj.client, "proj.fair", 1, patience=60, shares={"big:*": 3})  # as the app's
    sem.set_share("acme", 2)
    for n, tenant in enumerate(["acme"] * 4 + ["big:co"] * 2 + ["solo"]):
        assert not sem._try(Ask(token=new_token(), waiter=f"w{n}", tenant=tenant, patience=60)).granted
    result = proj.cli("status", "proj.fair")
    assert result.exit_code == 0, result.output
    text = result.stdout[result.stdout.index("tenants (most waiting first):") :]
    assert [line.split()[0] for line in text.splitlines()[2:5]] == ["acme", "big:co", "solo"]
    assert "2 (runtime)" in text
    tenants = proj.status_json("proj.fair")["tenants"]
    assert [(t["tenant"], t["share"], t["backlog"]) for t in tenants] == [
        ("acme", 2.0, 3),
        ("big:co", 3.0, 2),
        ("solo", 1.0, 1),
    ]
    holder.release()


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
    assert "Invalid value for '[N]'" in result.stderr
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


# -- rates, spacings and pauses -------------------------------------------------------------


def granted(semaphore: FairSemaphore) -> Lease | None:
    """One try without a place in line: the lease if the rules and the limit allow a start now."""
    attempt = semaphore.try_acquire()
    return attempt.lease if isinstance(attempt, Granted) else None


def test_pause_for_refuses_starts_until_resume(proj: Proj) -> None:
    """pause --for stops every start (status shows the time left); resume lets the next one in at once."""
    semaphore = FairSemaphore(proj.client, "proj.hold", 3, lease=30)
    result = proj.cli("pause", "proj.hold", "--for", "5")
    assert result.exit_code == 0, result.output
    assert "proj.hold: paused for 5.0s; 0 holder(s) keep running, 0 waiter(s) keep their places" in result.stdout
    data = proj.status_json("proj.hold")
    assert data["paused"] is True
    assert 4 < data["paused_for"] <= 5
    assert 4 < data["next_start_in"] <= 5
    assert granted(semaphore) is None
    lines = proj.cli("status", "proj.hold").stdout.splitlines()
    assert any(line.startswith("paused     ") and line.endswith("s left") for line in lines), lines
    assert "rate       - (none)" in lines

    result = proj.cli("resume", "proj.hold")
    assert result.exit_code == 0, result.output
    assert "proj.hold: resumed; next start now" in result.stdout
    data = proj.status_json("proj.hold")
    assert (data["paused"], data["paused_for"], data["next_start_in"]) == (False, None, 0)
    lease = granted(semaphore)
    assert lease is not None
    lease.release()


def test_pause_without_for_lasts_until_resumed(proj: Proj) -> None:
    """pause KEY holds until resume: JSON says paused with no time left; resume twice says so."""
    with proj.hold("crawl:example.com", 2):
        result = proj.cli("pause", "crawl:example.com")
    assert result.exit_code == 0, result.output
    assert "paused until resumed; 1 holder(s) keep running" in result.stdout
    data = proj.status_json("crawl:example.com")
    assert (data["paused"], data["paused_for"], data["next_start_in"]) == (True, None, None)
    lines = proj.cli("status", "crawl:example.com").stdout.splitlines()
    assert "paused     until resumed" in lines
    assert "next start once resumed" in lines
    assert granted(FairSemaphore(proj.client, "crawl:example.com", 2)) is None
    assert "crawl:example.com: resumed" in proj.cli("resume", "crawl:example.com").stdout
    assert "crawl:example.com: was not paused" in proj.cli("resume", "crawl:example.com").stdout


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "soon"])
def test_a_bad_pause_length_is_a_usage_error_naming_the_value(proj: Proj, bad: str) -> None:
    """pause --for refuses a duration that is not a finite number of seconds above 0."""
    result = proj.cli("pause", "proj.hold", f"--for={bad}")
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--for'" in result.stderr
    assert bad in result.stderr
    assert proj.client.keys("*") == []


def test_set_limit_rate_is_shown_and_obeyed_then_dropped_by_none(proj: Proj) -> None:
    """set-limit KEY --rate stores a runtime rate that status reports and the semaphore obeys;
    --rate none drops it. The limit is left alone."""
    result = proj.cli("set-limit", "proj.hold", "--rate", "2/s")
    assert result.exit_code == 0, result.output
    assert result.stdout == "proj.hold: rate 2/s (runtime override; none configured)\n"
    semaphore = FairSemaphore(proj.client, "proj.hold", 3, lease=30)
    leases = [granted(semaphore), granted(semaphore)]
    try:
        assert None not in leases
        assert granted(semaphore) is None  # a free slot, but a third start within the second
        data = proj.status_json("proj.hold")
        assert data["rate"] == {"count": 2, "period": 1.0}
        assert (data["rate_source"], data["starts_in_window"]) == ("runtime override", 2)
        assert 0 < data["next_start_in"] <= 1
        assert (data["limit"], data["override"]) == (3, None)
        assert "starts     2 of 2 in the last 1.0s" in proj.cli("status", "proj.hold").stdout.splitlines()
    finally:
        for lease in leases:
            if lease is not None:
                lease.release()
    result = proj.cli("set-limit", "proj.hold", "--rate", "none")
    assert result.exit_code == 0, result.output
    assert "proj.hold: rate - (none)" in result.stdout
    assert proj.status_json("proj.hold")["rate"] is None


def test_set_limit_over_a_configured_rate_names_both(proj: Proj) -> None:
    """A task's own rate shows with its source; a runtime rate says what it replaces, and its
    --ttl makes it lapse back to the configured one."""
    data = proj.status_json("proj.rated")
    assert (data["limit"], data["rate"]) == (None, {"count": 5, "period": 1.0})
    assert data["rate_source"] == data["configured"]["source"]
    result = proj.cli("set-limit", "proj.rated", "--rate", "1/m", "--ttl", "0.5")
    assert result.exit_code == 0, result.output
    assert f"proj.rated: rate 1/m (runtime override; configured: 5/s from {data['source']})" in result.stdout
    assert proj.status_json("proj.rated")["rate"] == {"count": 1, "period": 60.0}
    wait_until(lambda: proj.status_json("proj.rated")["rate"]["count"] == 5, what="the runtime rate to lapse")
    assert proj.status_json("proj.rated")["rate_source"] == data["source"]


def test_set_limit_spacing_and_limit_together_then_unset_limit_keeps_the_spacing(proj: Proj) -> None:
    """N and --spacing in one command store both; unset-limit drops the limit only, and
    --spacing none drops the spacing."""
    result = proj.cli("set-limit", "proj.hold", "5", "--spacing", "0.5")
    assert result.exit_code == 0, result.output
    assert "proj.hold: limit 5 (runtime override" in result.stdout
    assert "proj.hold: spacing 500ms (runtime override; none configured)" in result.stdout
    semaphore = FairSemaphore(proj.client, "proj.hold", 3, lease=30)
    lease = granted(semaphore)
    assert lease is not None
    try:
        assert granted(semaphore) is None  # within half a second of the last start
        data = proj.status_json("proj.hold")
        assert (data["limit"], data["spacing"], data["spacing_source"]) == (5, 0.5, "runtime override")
        assert 0 < data["next_start_in"] <= 0.5
    finally:
        lease.release()
    assert proj.cli("unset-limit", "proj.hold").exit_code == 0
    data = proj.status_json("proj.hold")
    assert (data["limit"], data["spacing"]) == (3, 0.5)
    assert proj.cli("set-limit", "proj.hold", "--spacing", "NONE").exit_code == 0
    assert proj.status_json("proj.hold")["spacing"] is None


def test_set_limit_needs_a_rule_to_set(proj: Proj) -> None:
    """set-limit KEY alone, or --ttl with nothing but drops, is a usage error; nothing is stored."""
    result = proj.cli("set-limit", "proj.hold")
    assert result.exit_code == 2, result.output
    assert "give N, --rate or --spacing" in result.stderr
    result = proj.cli("set-limit", "proj.hold", "--rate", "none", "--ttl", "5")
    assert result.exit_code == 2, result.output
    assert "--ttl" in result.stderr
    assert proj.client.keys("*") == []


@pytest.mark.parametrize(
    ("option", "bad"),
    [
        *(("--rate", bad) for bad in ("3/x", "0/s", "abc", "5", "2/0s")),
        *(("--spacing", bad) for bad in ("0", "-1", "nan", "inf", "soon")),
    ],
)
def test_a_bad_rate_or_spacing_is_a_usage_error_naming_the_value(proj: Proj, option: str, bad: str) -> None:
    """set-limit refuses a --rate that is not a rate, and a --spacing that is not a finite number
    of seconds above 0, naming the option and the value, before touching Redis."""
    result = proj.cli("set-limit", "proj.hold", f"{option}={bad}")
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.stderr
    assert repr(bad) in result.stderr
    assert proj.client.keys("*") == []


def test_pause_on_a_key_nobody_knows_warns(proj: Proj) -> None:
    """A pause for a key no task, setting or live semaphore knows is stored with a note about typos."""
    result = proj.cli("pause", "crwal:example.com", "--for", "60")
    assert result.exit_code == 0, result.output
    assert "storing the pause anyway (check the key for typos)" in result.stderr
    assert proj.status_json("crwal:example.com")["paused"] is True


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
