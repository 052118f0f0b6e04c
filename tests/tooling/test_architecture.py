"""The layers of the package hold: ``scripts/check_architecture.py`` passes, and fails on a
breach of each rule it checks (a core module importing Celery, an import cycle, a module over
its line budget), shown on a throwaway copy of the package."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from celery_semaphore import FairSemaphore, MultiSemaphore

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_architecture.py"


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts" / "check_architecture.py")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def copy_of_the_package(tmp_path: Path) -> Path:
    shutil.copytree(
        ROOT / "celery_semaphore", tmp_path / "celery_semaphore", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "check_architecture.py")
    return tmp_path


def test_the_package_passes_and_the_graph_is_printed() -> None:
    result = check(ROOT)
    assert result.returncode == 0, result.stderr
    assert "celery_semaphore._core.semaphore" in result.stdout
    assert "-> celery_semaphore._core.scripts" in result.stdout


def test_a_core_module_importing_celery_fails(tmp_path: Path) -> None:
    root = copy_of_the_package(tmp_path)
    module = root / "celery_semaphore" / "_core" / "rules.py"
    module.write_text(module.read_text() + "\n\ndef late() -> None:\n    import kombu  # noqa\n")
    result = check(root)
    assert result.returncode == 1
    assert "celery_semaphore._core.rules imports kombu" in result.stderr


def test_a_core_module_importing_the_glue_fails(tmp_path: Path) -> None:
    root = copy_of_the_package(tmp_path)
    module = root / "celery_semaphore" / "_core" / "rules.py"
    module.write_text("from .._celery import policy  # noqa\n" + module.read_text())
    result = check(root)
    assert result.returncode == 1
    assert "the core may import only itself and errors" in result.stderr


def test_an_import_cycle_fails(tmp_path: Path) -> None:
    root = copy_of_the_package(tmp_path)
    module = root / "celery_semaphore" / "_core" / "validation.py"
    module.write_text(module.read_text() + "\nfrom . import rules  # noqa\n")  # rules imports validation
    result = check(root)
    assert result.returncode == 1
    assert "import cycle" in result.stderr


def test_a_module_over_its_budget_fails(tmp_path: Path) -> None:
    root = copy_of_the_package(tmp_path)
    module = root / "celery_semaphore" / "_core" / "rules.py"
    module.write_text(module.read_text() + "\n" * 700)
    result = check(root)
    assert result.returncode == 1
    assert "celery_semaphore._core.rules" in result.stderr and "lines, over" in result.stderr


def test_a_core_module_only_the_glue_uses_fails(tmp_path: Path) -> None:
    """Celery's code lives in _celery: a core module that only the glue imports is moved there."""
    root = copy_of_the_package(tmp_path)
    (root / "celery_semaphore" / "_core" / "templates.py").write_text('"""Key templates."""\n')
    glue = root / "celery_semaphore" / "_celery" / "options.py"
    glue.write_text("from .._core import templates  # noqa\n" + glue.read_text())
    result = check(root)
    assert result.returncode == 1
    assert "celery_semaphore._core.templates is used only by the Celery glue" in result.stderr


@pytest.mark.parametrize(
    ("folder", "named_by_the_core", "fails"),
    [("_core", False, True), ("_celery", False, False), ("_core", True, False)],
    ids=["core-script-only-the-glue-runs", "glue-script", "core-script-the-core-runs-too"],
)
def test_a_core_lua_script_only_the_glue_runs_fails(
    tmp_path: Path, folder: str, named_by_the_core: bool, fails: bool
) -> None:
    """A script only the Celery glue runs is Celery's: it lives in _celery/lua, built on the
    core's library, and the core's lua/ holds the semaphore's own scripts alone."""
    root = copy_of_the_package(tmp_path)
    (root / "celery_semaphore" / folder / "lua" / "fold.lua").write_text("return 1\n")
    for module, named in (("_celery/parked_scripts.py", True), ("_core/nodes.py", named_by_the_core)):
        path = root / "celery_semaphore" / module
        path.write_text(path.read_text() + ('\nFOLD = built_script(_PACKAGE, "fold")\n' if named else ""))
    result = check(root)
    assert result.returncode == int(fails), result.stderr
    assert ("celery_semaphore/_core/lua/fold.lua is run only by the Celery glue" in result.stderr) == fails


def test_a_lua_script_over_its_budget_fails(tmp_path: Path) -> None:
    root = copy_of_the_package(tmp_path)
    script = root / "celery_semaphore" / "_core" / "lua" / "renew.lua"
    script.write_text(script.read_text() + "\n" * 600)
    result = check(root)
    assert result.returncode == 1
    assert "celery_semaphore/_core/lua/renew.lua: " in result.stderr and "lines, over" in result.stderr


@pytest.mark.parametrize("semaphore_class", [FairSemaphore, MultiSemaphore])
def test_public_methods_take_at_most_four_keyword_arguments(semaphore_class: type) -> None:
    """A public argument is a promise to users: what only the Celery glue needs (a ticket, a
    wake address, a run id) travels in an ``Ask`` to the underscored methods instead."""
    too_many = {}
    for name, method in inspect.getmembers(semaphore_class, inspect.isfunction):
        if name.startswith("_"):
            continue
        parameters = [
            p
            for p in inspect.signature(method).parameters.values()
            if p.name != "self" and p.kind is not inspect.Parameter.POSITIONAL_ONLY
        ]
        if len(parameters) > 4:
            too_many[name] = [p.name for p in parameters]
    assert not too_many


def test_the_private_protocol_is_spoken_by_both_semaphore_classes() -> None:
    """The Celery glue drives either class through the same underscored methods."""
    protocol = {"_try", "_wait", "_leave", "_release", "_finish_run", "_release_holders_with_prefix", "_renew_many"}
    for semaphore_class in (FairSemaphore, MultiSemaphore):
        assert protocol <= set(dir(semaphore_class)), semaphore_class


def test_the_design_docs_module_map_names_every_module() -> None:
    """docs/design.md's code layout is how a newcomer finds a module: a module it leaves out is
    a module nobody finds. Each module must appear there by its path under the package."""
    package = Path(__file__).resolve().parents[2] / "celery_semaphore"
    layout = (package.parent / "docs" / "design.md").read_text(encoding="utf-8").split("## Redis keys")[0]
    missing = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if path.name != "__init__.py" and str(path.relative_to(package)) not in layout
    ]
    assert not missing, f"add them to docs/design.md's code layout: {missing}"
