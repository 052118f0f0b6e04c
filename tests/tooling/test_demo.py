"""The demo (``python -m example_project``) end to end, as a user runs it: a subprocess on its
embedded Redis, with real ``celery worker`` subprocesses.

Besides its exit code and what it reports, each test checks that the demo leaves no process
behind. Two independent ways find the processes it caused: the demo writes the id of each one
it starts (Redis, worker parents, pool processes) to the file named by
``CELERY_SEMAPHORE_DEMO_PIDFILE``, and every descendant inherits a marker in its environment
that this test sets and then looks for in ``/proc/*/environ``.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

import celery_semaphore

from ..redis_server import RedisServer
from ..waiting import wait_until

pytest.importorskip("rich", reason="the demo needs the demo extra: pip install -e '.[demo]'")
pytest.importorskip("matplotlib", reason="the demo needs the demo extra: pip install -e '.[demo]'")

ROOT = Path(__file__).resolve().parents[2]
MARKER_VAR = "CELERY_SEMAPHORE_DEMO_TEST_MARKER"
PIDFILE_VAR = "CELERY_SEMAPHORE_DEMO_PIDFILE"
RUN_TIMEOUT = 240.0
HOSTS = ("alpha.test", "beta.test", "gamma.test")

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc"),
    pytest.mark.workers,  # the demo runs real `celery worker` processes
]


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (an exited child nobody reaped yet is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _marked(marker: str) -> set[int]:
    """Live processes whose environment carries this test's marker."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0") and _alive(int(entry.name)):
                found.add(int(entry.name))
    return found


@dataclass
class DemoRun:
    """One ``python -m example_project`` subprocess, its output and the processes it caused."""

    cwd: Path
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    process: subprocess.Popen[str] | None = None
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def pidfile(self) -> Path:
        return self.cwd / "demo-pids.txt"

    def env(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key not in ("REDIS_URL", "CELERY_SEMAPHORE_DEMO")}
        pythonpath = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        # TMPDIR: the demo's logs (kept when it fails) land in this test's own directory
        return {
            **env,
            "PYTHONPATH": pythonpath,
            MARKER_VAR: self.marker,
            PIDFILE_VAR: str(self.pidfile),
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(self.cwd),
            **self.extra_env,
        }

    def start(self, *args: str) -> DemoRun:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "example_project", *args],
            cwd=self.cwd,
            env=self.env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        assert self.process is not None
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        code = self.process.wait(timeout=timeout)
        self._close_output()
        return code

    def _close_output(self) -> None:
        """Let the reader drain the pipe, then close it (the demo and its children are gone)."""
        if self.reader is not None:
            self.reader.join(timeout=10)
        if self.process is not None and self.process.stdout is not None and not self.reader_alive:
            self.process.stdout.close()

    @property
    def reader_alive(self) -> bool:
        return self.reader is not None and self.reader.is_alive()

    def started_pids(self) -> set[int]:
        try:
            return {int(line) for line in self.pidfile.read_text().split()}
        except FileNotFoundError:
            return set()

    def leftovers(self) -> set[int]:
        """Processes the demo caused that are still alive."""
        return {pid for pid in self.started_pids() if _alive(pid)} | _marked(self.marker)

    def kill_leftovers(self) -> None:
        """After a failed test: SIGKILL what this run left, so one failure does not leak into
        the next test (only processes that carry this run's marker or that it recorded)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._close_output()


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoRun]:
    run = DemoRun(cwd=tmp_path)
    yield run
    run.kill_leftovers()


def _assert_nothing_left(run: DemoRun) -> None:
    assert run.started_pids(), f"the demo recorded no process ids:\n{run.output}"
    wait_until(
        lambda: not run.leftovers(),
        timeout=10,
        interval=0.1,
        what=f"every process of the demo to be gone (left: {sorted(run.leftovers())})",
    )


def _check(pattern: str, output: str) -> re.Match[str]:
    """The demo's line "check: <pattern> ... ok" (a regex), which must be there."""
    match = re.search(rf"^check: {pattern} \.\.\. ok$", output, re.M)
    assert match is not None, f"no check line matching {pattern!r} holds:\n{output}"
    return match


def _assert_checks_hold(output: str) -> None:
    """Every check the demo prints holds, and says what the servers saw: the API's limit and
    quota kept, its maintenance 429 the only one, no call during the pause it asked for and the
    paused call first after it; on every host no violation, each Crawl-delay read from
    robots.txt and honoured; the customer who comes after another's flood served within two
    waves of the key's slots (at most 8 of the flood's waiting calls, and not all, before its
    first), and its last before the flood's last; all work done."""
    contrast = re.search(r"^check: paid-api \(no semaphore\), the contrast: (\d+) answered 429", output, re.M)
    assert contrast is not None, output
    assert int(contrast.group(1)) > 0, output
    for key in (r"demo\.call_api", r"demo\.export_report"):
        _check(rf"{key}: concurrency never over the limit: peak [0-4] of limit 4, 0 answered 429 for it", output)
        _check(rf"{key}: (\d+)/\1 calls served", output)
    quota = _check(
        r"demo\.call_api: API quota never exceeded: max (\d+) calls in any 10 s \(quota 20; a call may come "
        r"0\.1 s early\), 0 answered 429 except the maintenance window's 1",
        output,
    )
    assert 0 < int(quota.group(1)) <= 20, output
    pause = _check(
        r"demo\.call_api: pause: report 0 heard 429, Retry-After 2 s \(maintenance\); no call for (\d+\.\d+) s, "
        r"then report 0 first(?: \(report \d+ came \d+ ms before it\))?",
        output,
    )
    assert float(pause.group(1)) >= 2.0, output
    delays = set()
    for host in HOSTS:
        key = re.escape(f"crawl:{host}")
        read = re.search(rf" {re.escape(host)}: robots\.txt says \d+ at once, Crawl-delay ([\d.]+) s;", output)
        assert read is not None, output
        delay = float(read.group(1))
        delays.add(delay)
        _check(rf"{key}: 0 violations, peak \d+ of limit \d+", output)
        gap = _check(
            rf"{key}: Crawl-delay {read.group(1)} s honoured: min gap (\d+\.\d+) s between (\d+) page requests, "
            r"0 more than 0\.1 s early",
            output,
        )
        assert float(gap.group(1)) >= delay - 0.1, output
        _check(rf"{key}: (\d+)/\1 pages crawled", output)
    assert len(delays) == len(HOSTS), f"every host has its own Crawl-delay: {delays}"
    _check(
        r"demo\.export_report: API quota never exceeded: max \d+ calls in any 10 s \(quota 20; [^)]*\), 0 answered 429",
        output,
    )
    fair = _check(
        r"demo\.export_report: fair share: globex came with (\d+) of acme's calls waiting; its first started "
        r"(\d+\.\d+) s later \(a call takes [\d.]+ s\), after (\d+) of them, and its last before (\d+) of them",
        output,
    )
    assert int(fair.group(3)) <= min(8, int(fair.group(1)) - 1), output
    assert int(fair.group(4)) > 0, output
    assert re.search(r" starts in order \(a: acme, G: globex, \|: globex comes\): a+\|[aG]*G", output), output
    _check(r"task failures: 0", output)


def test_quick_demo_passes_every_check_and_leaves_nothing_behind(demo: DemoRun) -> None:
    """The quick demo exits 0: with the semaphore the API's limit and quota hold (its one 429
    the maintenance window's, which pauses every worker), and every host's Crawl-concurrency
    and Crawl-delay from robots.txt; it writes its chart into the cwd and leaves no process
    behind."""
    code = demo.start("--quick", "--no-live").wait(timeout=RUN_TIMEOUT)
    output = demo.output
    assert code == 0, output
    assert "embedded redis-server" in output
    _assert_checks_hold(output)
    chart = demo.cwd / "demo-concurrency.png"
    assert f"chart: {chart}" in output
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert chart.stat().st_size > 10_000
    _assert_nothing_left(demo)


def _all_keys(server: RedisServer) -> dict[int, list[bytes]]:
    """Every key of the first 16 databases (the demo uses the URL's db; it must touch no other)."""
    keys = {}
    for db in range(16):
        with server.client(db=db) as client:
            keys[db] = sorted(client.keys())
    return keys


def test_with_redis_url_the_demo_deletes_its_own_keys_and_nothing_else(demo: DemoRun, own_redis: RedisServer) -> None:
    """Given REDIS_URL, the demo runs on that Redis under a prefix of its own and at the end has
    deleted every key it wrote while the keys already there are untouched."""
    with own_redis.client(db=0) as users, own_redis.client(db=1) as jobs:
        users.set("users:precious", "keep")
        jobs.set("jobs:precious", "keep")
    before = _all_keys(own_redis)
    demo.extra_env = {"REDIS_URL": f"redis://127.0.0.1:{own_redis.port}/0"}
    code = demo.start("--quick", "--no-live").wait(timeout=RUN_TIMEOUT)
    assert code == 0, demo.output
    assert "(REDIS_URL), every key of this run under celery-semaphore-demo:" in demo.output
    _assert_checks_hold(demo.output)
    after = _all_keys(own_redis)
    assert after == before
    _assert_nothing_left(demo)


@pytest.mark.parametrize(
    ("trigger", "signum"),
    [
        pytest.param("paid API on http://", signal.SIGINT, id="SIGINT-while-workers-start"),
        pytest.param("calls with the semaphore", signal.SIGINT, id="SIGINT-while-tasks-run"),
        pytest.param("Story 2: polite crawler", signal.SIGTERM, id="SIGTERM-while-crawling"),
    ],
)
def test_a_signal_stops_the_demo_promptly_and_leaves_nothing_behind(
    demo: DemoRun, trigger: str, signum: signal.Signals
) -> None:
    """A signal in the middle of a run makes the demo stop its workers and Redis and exit with
    128 + the signal number within seconds, leaving no process behind."""
    demo.start("--quick", "--no-live")
    wait_until(
        lambda: trigger in demo.output or demo.process is None or demo.process.poll() is not None,
        timeout=RUN_TIMEOUT,
        interval=0.02,
        what=f"the demo to print {trigger!r}",
    )
    assert demo.process is not None
    assert demo.process.poll() is None, f"the demo ended before the signal:\n{demo.output}"
    demo.process.send_signal(signum)
    sent = time.monotonic()
    code = demo.wait(timeout=30)
    took = time.monotonic() - sent
    assert code == 128 + signum, demo.output
    assert "interrupted" in demo.output, demo.output
    assert took < 15, f"took {took:.1f} s to stop:\n{demo.output}"
    _assert_nothing_left(demo)


def test_the_ideal_makespan_is_the_earliest_start_of_every_call() -> None:
    """The summary's "ideal": each call as soon as the limit, the rate, the spacing and the pause
    allow, the call told to pause counting as a start."""
    from example_project.demo.report import ideal_makespan

    assert ideal_makespan(8, 1.0, 4) == 2.0
    assert ideal_makespan(3, 0.1, 3, spacing=0.5) == pytest.approx(1.1)
    # 5 at once, then the window: the 6th starts 10 s after the 1st
    assert ideal_makespan(6, 0.5, 5, rate=(5, 10.0)) == 10.5
    # the told call starts at 0 (and counts for the rate), the next call when the 2 s pause ends;
    # the 5th start comes 10 s after the told one
    assert ideal_makespan(4, 0.5, 4, rate=(4, 10.0), pause=2.0) == 10.5
    assert ideal_makespan(3, 0.5, 4, rate=(4, 10.0), pause=2.0) == 2.5


# -- the example a user copies ----------------------------------------------------------------


def _imports_of_the_library(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every ``celery_semaphore`` import of a file (name "" for ``import x``)."""

    def ours(module: str | None) -> bool:
        return module is not None and module.split(".")[0] == "celery_semaphore"

    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if ours(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and ours(node.module):
            found += [(str(node.module), alias.name) for alias in node.names]
    return found


def test_the_example_uses_public_names_only() -> None:
    """Every file of example_project imports the library through its facade (names in
    ``celery_semaphore.__all__``) or its public test aid, never a module of its own."""
    files = sorted((ROOT / "example_project").rglob("*.py"))
    imports = {path.relative_to(ROOT): _imports_of_the_library(path) for path in files}
    assert imports[Path("example_project/tasks.py")], "tasks.py should use the library"
    for path, names in imports.items():
        for module, name in names:
            assert module in ("celery_semaphore", "celery_semaphore.testing"), f"{path}: imports {module}"
            if module == "celery_semaphore":
                assert name in celery_semaphore.__all__, f"{path}: imports {name}, not a public name"


def test_the_crawler_reads_robots_txt_again_before_what_it_read_lapses(
    own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host's Crawl-delay is a runtime override that lapses after ``ROBOTS_TTL``: the crawler
    reads the host's robots.txt again before that (on a page scheduled once ``ROBOTS_REREAD``
    has passed), so a long crawl keeps each host's own delay instead of falling back, for good,
    to the default of ``crawl:*``."""
    from example_project import tasks

    assert getattr(tasks, "ROBOTS_REREAD", tasks.ROBOTS_TTL) < tasks.ROBOTS_TTL, "read again before the lapse"
    robots_read: list[tuple[str, str]] = []
    crawled: list[tuple[str, str]] = []
    monkeypatch.setattr(tasks, "fetch_robots", SimpleNamespace(delay=lambda *call: robots_read.append(call)))
    monkeypatch.setattr(tasks, "crawl", SimpleNamespace(delay=lambda *call: crawled.append(call)))
    monkeypatch.setattr(tasks, "ROBOTS_REREAD", 0.3, raising=False)  # seconds, for the test only
    monkeypatch.setitem(tasks.app.conf, "crawl_frontier_url", own_redis.url)
    tasks.frontier.cache_clear()
    try:
        pages = (f"/page/{i}" for i in range(1_000_000))
        assert tasks.schedule("a.test", next(pages))
        assert tasks.schedule("a.test", next(pages))
        assert tasks.schedule("b.test", next(pages))
        assert [host for host, _ in robots_read] == ["a.test", "b.test"], "robots.txt first, once"
        assert [host for host, _ in crawled] == ["a.test"]
        wait_until(
            lambda: tasks.schedule("a.test", next(pages)) and len(robots_read) == 3,
            timeout=5,
            what="robots.txt of a.test read again",
        )
        assert robots_read[2][0] == "a.test"
    finally:
        tasks.frontier.cache_clear()


def test_the_tasks_module_loads_none_of_the_demo_harness() -> None:
    """``example_project.tasks`` stands apart from the demo: importing it loads neither the
    orchestrator nor what only the demo needs (rich, matplotlib, the HTTP servers)."""
    probe = (
        "import sys, example_project.tasks\n"
        "heavy = ['rich', 'matplotlib', 'example_project.demo.orchestrator', 'example_project.demo.servers',"
        " 'example_project.demo.wiring']\n"
        "print(sorted(name for name in heavy if name in sys.modules))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "CELERY_SEMAPHORE_DEMO"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["cluster", "sentinel"])
def test_the_demo_runs_its_semaphore_on_a_cluster_or_sentinel(demo: DemoRun, topology: str) -> None:
    """With REDIS_URL a ``redis+cluster://`` or ``redis+sentinel://`` URL, the semaphore lives
    there (the broker on an embedded Redis), every check holds, and no key is left behind."""
    from ..redis_server import RedisClusterSet, RedisSentinelSet

    servers: RedisClusterSet | RedisSentinelSet = RedisClusterSet() if topology == "cluster" else RedisSentinelSet()
    with servers:
        demo.extra_env = {"REDIS_URL": servers.url}
        code = demo.start("--quick", "--no-live").wait(timeout=RUN_TIMEOUT)
        assert code == 0, demo.output
        assert "(REDIS_URL) under celery-semaphore-demo:" in demo.output
        _assert_checks_hold(demo.output)
        if isinstance(servers, RedisClusterSet):
            client = servers.client()
            assert client.keys("celery-semaphore-demo:*") == []
        else:
            with servers.master().client() as master:
                assert master.keys("celery-semaphore-demo:*") == []
    _assert_nothing_left(demo)
