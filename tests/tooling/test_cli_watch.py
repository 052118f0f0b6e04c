"""``celery semaphore status --watch``: in a real terminal (tmux), on a pipe, and its argument.

The watch is the real ``celery`` program in a subprocess, on a Redis of this run; one Redis
flavour is enough, since the watch reads through ``status`` (tested on both in test_cli.py).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from celery.bin.celery import celery
from click.testing import CliRunner

from celery_semaphore import FairSemaphore, Lease
from celery_semaphore._cli.reports import Report
from celery_semaphore._cli.watch import FROM_HOLDERS, StartsSeen
from celery_semaphore._core.status import HolderInfo

from ..conftest import emptied_server
from ..redis_server import RedisServer
from ..waiting import wait_until
from .test_cli import CELERY, ROOT

TMUX = shutil.which("tmux")
KEY = "proj.hold"  # a fixed key of tests.proj.app, limit 3


@pytest.fixture
def server(redis_servers: dict[str, RedisServer]) -> RedisServer:
    return emptied_server(redis_servers, "path")


def celery_env(server: RedisServer) -> dict[str, str]:
    """The environment the test app reads its Redis URLs from."""
    semaphore_url = f"redis://127.0.0.1:{server.port}/1"
    env = {**os.environ, "PROJ_SEMAPHORE_URL": semaphore_url, "PROJ_BROKER_URL": server.url, "PROJ_CONF": "{}"}
    env.pop("APP", None)
    return env


def hold(server: RedisServer) -> Lease:
    return FairSemaphore(server.client(db=1), KEY, 3, lease=30).acquire(timeout=5, label="watched")


# -- in a terminal ------------------------------------------------------------------------------


class Tmux:
    """A tmux server of this test alone (its own socket), running one command in one pane that
    stays after the command ends, so its exit status and screen can be read."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        assert TMUX is not None
        self.socket = f"watch-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.env = env
        self.config = tmp_path / "tmux.conf"
        self.config.write_text("set -g remain-on-exit on\nset -g status off\n")

    def tmux(self, *args: str) -> str:
        command = [str(TMUX), "-L", self.socket, "-f", str(self.config), *args]
        return subprocess.run(command, env=self.env, capture_output=True, text=True, check=True, timeout=10).stdout

    def start(self, command: list[str]) -> None:
        self.tmux("new-session", "-d", "-s", "watch", "-x", "160", "-y", "40", "-c", str(ROOT), *command)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "watch")

    def screen_when(self, condition: Callable[[str], bool], what: str) -> str:
        """The screen, once ``condition`` holds for it."""

        def shown() -> str:
            screen = self.screen()
            return screen if condition(screen) else ""

        return wait_until(shown, timeout=20, what=what)

    def show(self, format: str) -> str:
        return self.tmux("display-message", "-p", "-t", "watch", format).strip()

    def kill(self) -> None:
        subprocess.run([str(TMUX), "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def tmux(tmp_path: Path, server: RedisServer) -> Iterator[Tmux]:
    if TMUX is None:
        pytest.skip("tmux is not installed: the terminal behaviour of --watch needs a real terminal")
    session = Tmux(tmp_path, celery_env(server))
    yield session
    session.kill()


def holders_line(screen: str) -> str | None:
    return next((line for line in screen.splitlines() if line.startswith("holders    ")), None)


# the watch under a shell that outlives it (Ctrl-C reaches the whole foreground group; `trap :`
# keeps the shell, and is not inherited as an ignored signal) and says how it ended, on the
# terminal's normal screen
SHELL_AROUND = 'trap : INT; "$@"; echo "watch ended: status $?"; exec sleep 60'


def test_watch_in_a_terminal_redraws_in_place_and_leaves_on_ctrl_c(tmux: Tmux, server: RedisServer) -> None:
    """On the alternate screen, one frame redrawn as the semaphore changes; Ctrl-C exits 0 and
    gives the terminal back (normal screen, cursor shown), with no traceback."""
    watch = [str(CELERY), "-A", "tests.proj.app", "semaphore", "status", KEY, "--watch", "0.2"]
    tmux.start(["sh", "-c", SHELL_AROUND, "sh", *watch])
    screen = tmux.screen_when(lambda screen: holders_line(screen) is not None, "a first frame")
    assert screen.splitlines()[0].endswith("every 0.2s: status proj.hold  (Ctrl-C to quit)")
    assert holders_line(screen) == "holders    0 of 3"
    assert "starts/min 0" in screen
    assert tmux.show("#{alternate_on} #{cursor_flag}") == "1 0"
    with hold(server):
        screen = tmux.screen_when(lambda screen: holders_line(screen) == "holders    1 of 3", "the holder on screen")
        assert "starts/min >=1" in screen
        assert "watched" in screen  # the holder's label, in the holders table
        assert screen.count("every 0.2s") == 1  # redrawn in place, not scrolled
    tmux.screen_when(lambda screen: holders_line(screen) == "holders    0 of 3", "the release on screen")
    tmux.tmux("send-keys", "-t", "watch", "C-c")
    screen = tmux.screen_when(lambda screen: "watch ended" in screen, "the watch to end")
    assert "watch ended: status 0" in screen
    assert tmux.show("#{alternate_on} #{cursor_flag}") == "0 1"
    assert "Traceback" not in screen and "Aborted" not in screen
    assert "every 0.2s" not in screen  # the frame went with the alternate screen


# -- on a pipe ----------------------------------------------------------------------------------


# Runs the command after it with SIGINT back to its default: a test run started in the background
# by a shell without job control (`bash -c '... &'`) has SIGINT ignored, and a child inherits
# that, so the watch would never hear the Ctrl-C these tests send (a terminal's foreground job
# has it at its default, which is what they stand for).
WITH_DEFAULT_SIGINT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])",
]


def start_on_a_pipe(server: RedisServer, *args: str) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    """The watch with its output on a pipe; its lines arrive on the queue as they are printed."""
    command = [*WITH_DEFAULT_SIGINT, str(CELERY), "-A", "tests.proj.app", "semaphore", "status", *args]
    process = subprocess.Popen(
        command, cwd=ROOT, env=celery_env(server), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump(stream: IO[str]) -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=pump, args=(process.stdout,), daemon=True).start()
    return process, lines


class Output:
    """What a watch on a pipe has printed so far."""

    def __init__(self, lines: queue.Queue[str]) -> None:
        self.lines, self.text = lines, ""

    def until(self, condition: Any, what: str) -> str:
        def arrived() -> bool:
            while not self.lines.empty():
                self.text += self.lines.get()
            return bool(condition(self.text))

        wait_until(arrived, timeout=20, what=what)
        return self.text


def blocks(text: str) -> list[list[str]]:
    """The whole blocks of ``text`` (each ends with a blank line), as lines."""
    return [block.splitlines() for block in text.split("\n\n")[:-1]]


def holders_cell(block: list[str]) -> str:
    """The HOLDERS cell of a block's one row."""
    return block[-1].split()[3]


def interrupt(process: subprocess.Popen[str]) -> tuple[int, str]:
    """SIGINT, as Ctrl-C sends it, to the watch this test started; its exit status and stderr."""
    os.kill(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.stderr is not None
    return process.returncode, process.stderr.read()


def test_watch_on_a_pipe_prints_plain_blocks_and_ends_on_sigint(server: RedisServer) -> None:
    """No escape codes on a pipe: each refresh a block headed by the time, blocks apart by a blank
    line; a new holder shows in a later block; SIGINT ends it with exit status 0."""
    process, lines = start_on_a_pipe(server, "--match", KEY, "--watch", "0.2")
    output = Output(lines)
    try:
        output.until(lambda text: text.count("every 0.2s: status\n") >= 2, "two refreshes")
        with hold(server):
            output.until(lambda text: any(holders_cell(b) == "1" for b in blocks(text)), "a block with the holder")
    finally:
        code, errors = interrupt(process)
    assert code == 0, errors
    assert "Traceback" not in errors
    assert "\x1b" not in output.text
    printed = blocks(output.text)
    assert len(printed) >= 3
    for header, columns, row in printed:
        assert header.endswith("every 0.2s: status")
        assert columns.split()[-2:] == ["STARTS/MIN", "TASK"]
        assert row.split()[0] == KEY
    held = [block[-1].split() for block in printed if holders_cell(block) == "1"]
    assert held[0][-2] == ">=1"  # STARTS/MIN counts the holder it saw start


def test_watch_json_prints_one_document_a_line(server: RedisServer) -> None:
    """--json --watch: JSON lines, each a whole document with the time and starts per minute."""
    process, lines = start_on_a_pipe(server, KEY, "--watch", "0.2", "--json")
    output = Output(lines)
    try:
        output.until(lambda text: text.count("\n") >= 2, "two lines")
    finally:
        code, errors = interrupt(process)
    assert code == 0, errors
    documents = [json.loads(line) for line in output.text.splitlines()]
    assert len(documents) >= 2
    for document in documents:
        assert document["interval"] == 0.2 and document["at"]
        (semaphore,) = document["semaphores"]
        assert semaphore["key"] == KEY and semaphore["holders"] == []
        assert (semaphore["starts_per_minute"], semaphore["starts_per_minute_from"]) == (0, FROM_HOLDERS)


# -- the argument and the figures ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--watch", "0"], "Invalid value for '--watch': '0': seconds must be above 0"),
        (["--watch=-1"], "Invalid value for '--watch': '-1': seconds must be above 0"),
        (["--watch", "-0.5"], "Invalid value for '--watch': '-0.5': seconds must be above 0"),
        (["--watch", "soon"], "Invalid value for '--watch': 'soon' is not a number of seconds"),
        (["--watch", "inf"], "Invalid value for '--watch': 'inf': expected a finite number of seconds"),
        (["--watch", KEY], f"a KEY goes before --watch: status {KEY} --watch"),
    ],
)
def test_a_bad_interval_is_a_usage_error_naming_the_option_and_value(args: list[str], message: str) -> None:
    """Refused before the app's Redis is read (the test app's default URL has nothing behind it)."""
    result = CliRunner().invoke(celery, ["-A", "tests.proj.app", "semaphore", "status", *args])
    assert result.exit_code == 2
    assert message in result.stderr


def fake_report(holders: list[HolderInfo]) -> Report:
    fields: dict[str, Any] = {name: None for name in Report.__dataclass_fields__}
    fields.update(key="k", rate=None, holders=holders, starts_in_window=0)
    return Report(**fields)


def test_starts_per_minute_without_a_rate_counts_holders_granted_in_the_last_minute() -> None:
    """Each holder counts once, from the time it was granted, for a minute."""
    seen = StartsSeen()
    old, new = HolderInfo("t-old", "", held_for=90, expires_in=5), HolderInfo("t-new", "", held_for=10, expires_in=5)
    assert seen.per_minute(fake_report([old, new]), now=1000) == (1, FROM_HOLDERS)
    later = HolderInfo("t-later", "", held_for=1, expires_in=5)
    assert seen.per_minute(fake_report([later]), now=1030)[0] == 2  # t-new left, but started 40 s ago
    assert seen.per_minute(fake_report([]), now=1051)[0] == 1  # t-new started over a minute ago
