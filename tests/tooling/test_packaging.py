"""The built wheel ships the Lua scripts and py.typed, and every script documents its interface."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LUA_DIR = ROOT / "celery_semaphore" / "_core" / "lua"
LUA_SCRIPTS = ("acquire.lua", "release.lua", "renew.lua", "leave.lua", "status.lua", "_lib.lua")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    """The wheel built from this checkout, without build isolation (no network needed)."""
    missing = [name for name in ("build", "hatchling") if importlib.util.find_spec(name) is None]
    assert not missing, f"building the wheel offline needs {missing} installed next to the tests"
    outdir = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(outdir), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"wheel build failed:\n{result.stdout}\n{result.stderr}"
    (path,) = outdir.glob("celery_semaphore-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def leading_comment(text: str) -> str:
    """The comment block a Lua file opens with: its first lines that start with ``--``."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        lines.append(line)
    return "\n".join(lines)


def test_wheel_ships_lua_scripts_and_py_typed(wheel: zipfile.ZipFile) -> None:
    """The wheel holds every Lua script the semaphore loads at run time and the py.typed marker."""
    names = set(wheel.namelist())
    expected = {f"celery_semaphore/_core/lua/{script}" for script in LUA_SCRIPTS} | {"celery_semaphore/py.typed"}
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"


def test_wheel_ships_every_lua_file_of_the_package(wheel: zipfile.ZipFile) -> None:
    """No Lua file of the source package is left out of the wheel, and the shipped text is the source text."""
    in_source = {path.name for path in LUA_DIR.glob("*.lua")}
    in_wheel = {Path(name).name for name in wheel.namelist() if name.startswith("celery_semaphore/_core/lua/")}
    assert in_source == in_wheel
    for name in in_source:
        assert wheel.read(f"celery_semaphore/_core/lua/{name}") == (LUA_DIR / name).read_bytes()


@pytest.mark.parametrize("script", sorted(path.name for path in LUA_DIR.glob("*.lua")))
def test_lua_script_opens_with_interface_header(script: str) -> None:
    """Each Lua file opens with a comment block naming its KEYS, ARGV and return values (_lib.lua: the key schema)."""
    header = leading_comment((LUA_DIR / script).read_text(encoding="utf-8"))
    assert header, f"{script} does not open with a comment block"
    for word in ("KEYS", "ARGV"):
        assert word in header, f"the header of {script} does not mention {word}"
    if script == "_lib.lua":
        assert "Key schema" in header
        for position in range(1, 7):
            assert re.search(rf"KEYS\[{position}\]\s+\w+", header), f"_lib.lua does not document KEYS[{position}]"
    else:
        assert "Return" in header, f"the header of {script} does not say what it returns"


def test_the_core_loads_no_celery_kombu_or_click() -> None:
    """``from celery_semaphore import FairSemaphore`` in a fresh interpreter loads the core only:
    a process that never touches Celery does not pay for it, and the core cannot grow a
    dependency on it unnoticed."""
    code = (
        "import sys\n"
        "from celery_semaphore import FairSemaphore, SemaphoreError\n"
        "print(' '.join(sorted(n for n in ('celery', 'kombu', 'click') if n in sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == ""


def test_every_public_name_resolves() -> None:
    """Every name in ``__all__`` loads from the facade, and nothing else is offered there."""
    import celery_semaphore

    for name in celery_semaphore.__all__:
        assert getattr(celery_semaphore, name) is not None
    with pytest.raises(AttributeError):
        celery_semaphore.not_a_public_name  # noqa: B018


def test_what_the_user_docs_recommend_is_public() -> None:
    """The URL masking and the request class the docs tell users to reuse load from the facade,
    and are the very objects the package itself uses."""
    from celery.utils.imports import symbol_by_name

    import celery_semaphore
    from celery_semaphore import SemaphoreRequest, SemaphoreTask, mask_url
    from celery_semaphore._celery.worker import SemaphoreRequest as private_request
    from celery_semaphore._core.masking import mask_url as private_mask_url

    assert {"SemaphoreRequest", "mask_url"} <= set(celery_semaphore.__all__)
    assert mask_url is private_mask_url
    assert mask_url("redis://user:s3cret@h:6379/0") == "redis://user:***@h:6379/0"
    assert SemaphoreRequest is private_request is symbol_by_name(SemaphoreTask.Request)


@pytest.mark.slow
def test_a_bare_install_runs_a_worker_on_a_redis_broker(wheel: zipfile.ZipFile, tmp_path: Path) -> None:
    """A venv with nothing but the wheel and its declared dependencies (what ``pip install
    celery-semaphore`` gives a new user) runs a worker on a Redis broker and a limited task in it."""
    from ..redis_server import RedisServer

    assert wheel.filename is not None
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", wheel.filename], capture_output=True, text=True, timeout=600, check=False
    )
    assert install.returncode == 0, install.stderr
    (tmp_path / "bareapp.py").write_text(
        "import os\n"
        "from celery import Celery\n"
        "from celery_semaphore import limit_concurrency\n"
        "app = Celery('bareapp', broker=os.environ['BROKER'], backend=os.environ['BROKER'])\n"
        "@limit_concurrency(1, app=app, name='bare.add')\n"
        "def add(a, b):\n"
        "    return a + b\n"
    )
    with RedisServer() as server:
        env = {"PATH": os.environ.get("PATH", ""), "BROKER": server.url, "PYTHONPATH": str(tmp_path)}
        worker = subprocess.Popen(
            [
                python,
                "-m",
                "celery",
                "-A",
                "bareapp",
                "worker",
                "-P",
                "solo",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel",
                "WARNING",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            client = subprocess.run(
                [python, "-c", "import bareapp; print(bareapp.add.delay(2, 3).get(timeout=60))"],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
        finally:
            worker.terminate()
            output = worker.communicate(timeout=60)[0].decode(errors="replace")
        assert client.stdout.strip() == "5", f"{client.stderr}\nworker:\n{output}"
        assert "ModuleNotFoundError" not in output


def _declared_redis_floor() -> str:
    """The lowest redis-py the package declares (``redis>=X`` in pyproject.toml)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'"redis>=([0-9.]+)"', text)
    assert match, "pyproject.toml declares no redis>= floor"
    return match.group(1)


@pytest.mark.slow
def test_the_core_works_on_the_lowest_redis_py_it_declares(wheel: zipfile.ZipFile, tmp_path: Path) -> None:
    """With exactly the declared redis-py floor installed, the semaphore works on one Redis and
    on a Redis Cluster: acquire, hand-off to a blocked caller, status, set_limit, clear_limit and
    reset (the operator calls once failed on a cluster with older redis-py pipelines)."""
    from celery_semaphore.testing import RedisClusterSet

    from ..redis_server import RedisServer

    assert wheel.filename is not None
    floor = _declared_redis_floor()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", f"redis=={floor}"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert install.returncode == 0, install.stderr
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", wheel.filename],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert install.returncode == 0, install.stderr
    script = (
        "import os, sys, threading, redis\n"
        "from celery_semaphore import FairSemaphore\n"
        "from celery_semaphore._core.clients import client_for\n"
        "assert redis.__version__.startswith(os.environ['FLOOR']), redis.__version__\n"
        "for url in sys.argv[1:]:\n"
        "    sem = FairSemaphore(client_for(url), 'floor', 1, lease=10)\n"
        "    held = sem.acquire(timeout=5)\n"
        "    got = []\n"
        "    waiter = threading.Thread(target=lambda: got.append(sem.acquire(timeout=10)))\n"
        "    waiter.start()\n"
        "    while sem.status().waiter_count < 1: pass\n"
        "    held.release(); waiter.join(15)\n"
        "    assert got, url\n"
        "    sem.set_limit(2); assert sem.status().limit == 2\n"
        "    sem.clear_limit(); sem.reset(); assert sem.status().holder_count == 0\n"
        "    got[0].release()\n"
        "print('ok', redis.__version__)\n"
    )
    with RedisServer() as server, RedisClusterSet() as cluster:
        result = subprocess.run(
            [python, "-c", script, server.url, cluster.url],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
            env={"PATH": os.environ.get("PATH", ""), "FLOOR": floor},
        )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(f"ok {floor}")
