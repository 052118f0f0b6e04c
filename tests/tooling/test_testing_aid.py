"""celery_semaphore.testing: the throwaway servers and the pytest plugin users get with the package."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

import celery_semaphore.testing
from celery_semaphore import FairSemaphore
from celery_semaphore.testing import RedisClusterSet, RedisSentinelSet, RedisServer

from ..redis_server import CLUSTER_BUS_OFFSET, free_cluster_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOYING = ROOT / "docs" / "deploying.md"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def test_server_stops_by_pid_and_leaves_no_directory() -> None:
    """A RedisServer runs on loopback under its own PID; closing it ends that PID and removes its dir."""
    server = RedisServer().start()
    pid = server.pid
    assert pid is not None and _alive(pid)
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    with server.client() as client:
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        assert client.config_get("save")["save"] == ""
    server.close()
    assert server.pid is None
    assert not _alive(pid)
    assert not Path(server.dir).exists()


def test_server_with_password_requires_it() -> None:
    """password= sets requirepass; the URL and client() carry it."""
    with RedisServer(password="pw") as server:
        assert server.url == f"redis://:pw@127.0.0.1:{server.port}/0"
        with server.client() as client:
            assert client.ping()
        with server.client(password=None) as anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()


def test_wait_until_returns_the_value_or_names_what_timed_out() -> None:
    """wait_until returns the first truthy value, and its timeout names the awaited condition."""
    calls = iter([None, 0, "ready"])
    assert wait_until(lambda: next(calls), 5, "three tries") == "ready"
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="the impossible"):
        wait_until(lambda: False, 0.2, "the impossible")
    assert time.monotonic() - started < 2


def test_wait_until_treats_redis_errors_as_not_yet() -> None:
    """A Redis error inside the condition means "not yet", and is reported at the timeout."""

    def refuse() -> bool:
        raise redis.ConnectionError("connection refused")

    with pytest.raises(TimeoutError, match="connection refused"):
        wait_until(refuse, 0.2, "a server")


def test_cluster_ports_leave_room_for_the_bus() -> None:
    """A cluster node port is at most 55535 and its bus port (+10000) is free too."""
    for _ in range(20):
        port = free_cluster_port()
        assert 1024 < port <= 65535 - CLUSTER_BUS_OFFSET


def test_cluster_needs_three_masters() -> None:
    """Fewer than 3 masters cannot elect a replica: refused before anything starts."""
    with pytest.raises(ValueError, match="at least 3 masters"):
        RedisClusterSet(masters=2)


# --- the plugin's fixtures, in this very suite --------------------------------------------


def test_semaphore_redis_url_fixture_is_an_empty_loopback_redis(semaphore_redis_url: str) -> None:
    """semaphore_redis_url is a loopback Redis with nothing in it, ready for a semaphore."""
    assert semaphore_redis_url.startswith("redis://127.0.0.1:")
    with redis.Redis.from_url(semaphore_redis_url) as client:
        assert client.dbsize() == 0
        semaphore = FairSemaphore(client, "aid", 1, lease=5)
        with semaphore.acquire(timeout=5):
            assert client.zcard(semaphore.keys.holders) == 1
        client.set("left-behind", "by this test")


def test_semaphore_redis_fixture_is_emptied_per_test(semaphore_redis: redis.Redis) -> None:
    """semaphore_redis is a client of the same session server, emptied before each test."""
    assert semaphore_redis.get("left-behind") is None
    semaphore_redis.set("left-behind", "again")


@pytest.mark.slow
def test_semaphore_redis_cluster_fixture(semaphore_redis_cluster: RedisClusterSet) -> None:
    """semaphore_redis_cluster is a ready 3-master cluster whose URL builds a working client."""
    from celery_semaphore._core.clients import client_for

    assert semaphore_redis_cluster.url.startswith("redis+cluster://127.0.0.1:")
    assert len(semaphore_redis_cluster.masters()) == 3
    client = client_for(semaphore_redis_cluster.url)
    assert client.dbsize() == 0
    FairSemaphore(client, "aid", 1, lease=5).acquire(timeout=5).release()


@pytest.mark.slow
def test_semaphore_redis_sentinel_fixture(semaphore_redis_sentinel: RedisSentinelSet) -> None:
    """semaphore_redis_sentinel is a ready Sentinel set whose URL builds a working client."""
    from celery_semaphore._core.clients import client_for

    assert semaphore_redis_sentinel.url.startswith("redis+sentinel://127.0.0.1:")
    client = client_for(semaphore_redis_sentinel.url)
    assert client.dbsize() == 0
    FairSemaphore(client, "aid", 1, lease=5).acquire(timeout=5).release()


# --- the plugin as a user gets it: a separate pytest run ----------------------------------

USER_TESTS = """
import redis
from celery import Celery

from celery_semaphore import FairSemaphore, SemaphoreTask

app = Celery("user_proj", broker="memory://")
app.conf.task_always_eager = True


@app.task(base=SemaphoreTask, semaphore_limit=1)
def build_report(name):
    return f"report {name}"


def test_a_limited_task_runs(semaphore_redis_url):
    app.conf.semaphore_backend_url = semaphore_redis_url
    assert build_report.delay("q3").get(timeout=10) == "report q3"


def test_the_semaphore_directly(semaphore_redis):
    semaphore = FairSemaphore(semaphore_redis, "reports", 2, lease=5)
    with semaphore.acquire(timeout=5):
        semaphore_redis.set("marker", 1)


def test_each_test_starts_empty(semaphore_redis):
    assert semaphore_redis.get("marker") is None


def test_no_fixture_no_server():
    pass
"""

# Fails any test that starts a server: proves a test without the fixtures starts nothing.
NO_START_CONFTEST = """
import pytest
import celery_semaphore.testing as testing

def _refuse(self, timeout=10.0):
    raise AssertionError("a server was started by a test that did not ask for one")

@pytest.fixture(autouse=True)
def _no_servers(request, monkeypatch):
    if "no_fixture" in request.node.name:
        monkeypatch.setattr(testing.RedisServer, "start", _refuse)
"""


def _run_pytest(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(directory), *args],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_plugin_is_loaded_from_the_entry_point(tmp_path: Path) -> None:
    """In a project of a user's own, the installed package's fixtures serve their tests: a
    limited eager task runs, each test starts empty, a test without them starts no server."""
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TESTS))
    (tmp_path / "conftest.py").write_text(textwrap.dedent(NO_START_CONFTEST))
    result = _run_pytest(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout


def test_plugin_fixtures_are_listed(tmp_path: Path) -> None:
    """pytest --fixtures lists the plugin's fixtures with their docstrings."""
    result = _run_pytest(tmp_path, "--fixtures")
    assert result.returncode in (0, 5), result.stdout + result.stderr
    for name in ("semaphore_redis_url", "semaphore_redis", "semaphore_redis_server", "semaphore_redis_cluster"):
        assert name in result.stdout


def test_servers_left_running_are_stopped_at_exit(tmp_path: Path) -> None:
    """A script that starts a server and ends with an exception leaves no server process."""
    script = tmp_path / "leaky.py"
    script.write_text(
        "from celery_semaphore.testing import RedisServer\n"
        "server = RedisServer().start()\n"
        "print(server.pid, flush=True)\n"
        "raise SystemExit('crashed without stopping it')\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    pid = int(result.stdout.split()[0])
    assert wait_until(lambda: not _alive(pid), 10, f"redis-server {pid} gone")


# --- what the docs show users ---------------------------------------------------------------


def test_the_public_names_are_the_ones_the_docs_import() -> None:
    """The plugin is imported into every pytest session of every user: its public names are the
    classes docs/deploying.md imports from it and the fixtures it documents, nothing else (the
    project's own fault injection and TLS harness live in tests/redis_server.py)."""
    shown = set()
    for names in re.findall(r"from celery_semaphore\.testing import ([\w, ]+)", DEPLOYING.read_text()):
        shown.update(name.strip() for name in names.split(","))
    assert sorted(shown) == sorted(celery_semaphore.testing.__all__)
    module = ast.parse(Path(celery_semaphore.testing.__file__).read_text())
    public = {name for name in _module_level_names(module.body) if not name.startswith("_")}
    fixtures = {"semaphore_redis_server", "semaphore_redis_url", "semaphore_redis", "semaphore_redis_cluster",
                "semaphore_redis_sentinel"}  # fmt: skip
    assert public == shown | fixtures


def _module_level_names(body: list[ast.stmt]) -> set[str]:
    """The names a module's own statements define (the plugin's fixtures sit in a try/else)."""
    names: set[str] = set()
    for statement in body:
        if isinstance(statement, ast.Try):
            names |= _module_level_names(statement.body + statement.orelse)
        elif isinstance(statement, ast.FunctionDef | ast.ClassDef):
            names.add(statement.name)
        elif isinstance(statement, ast.Assign | ast.AnnAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names - {"__all__"}


def _documented_files(heading: str) -> dict[str, str]:
    """The files of a docs/deploying.md section: each a ```python block after a `name.py`: line."""
    text = DEPLOYING.read_text()
    section = text.split(f"### {heading}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    return dict(re.findall(r"^`(\w+\.py)`[^\n]*\n\n```python\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL))


def test_the_documented_suite_with_a_celery_worker_passes(tmp_path: Path) -> None:
    """The docs' test suite on Celery's in-process worker (celery.contrib.pytest) and the plugin's
    Redis, written out as a user would have it and run by pytest: the task waits for the slot
    the test holds, and runs once it is given back."""
    files = _documented_files("Testing with a worker: Celery's pytest fixtures")
    assert sorted(files) == ["conftest.py", "reports.py", "test_reports.py"]
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    result = _run_pytest(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
