"""Print the package's import graph and fail where the architecture is broken.

The package has two private layers: ``celery_semaphore/_core`` (the semaphore: Redis and Lua,
usable in any Python process) and ``celery_semaphore/_celery`` (the Celery glue, which drives
the core). What keeps that true is checked here, on the source (``ast``, nothing imported):

- a core module imports nothing from Celery, kombu or click, and nothing from the glue or the
  public modules but ``errors`` (imports inside functions count: they load the module all the
  same; imports under ``if TYPE_CHECKING:`` do not);
- no import cycle among the package's modules, counting only the imports that run when a module
  is loaded (module level, ``if TYPE_CHECKING:`` excluded): a function-level import is how a
  cycle is legitimately broken, so such a cycle is not reported;
- no core module that only the Celery glue or the CLI uses (``_celery``, ``_cli``, ``cli``): such
  a module is Celery's code and lives in ``_celery``, unless ``CORE_FOR_ANY_CALLER`` names it as
  generic with a reason;
- no Lua script in ``_core/lua`` that only the glue or the CLI runs: a script is run by the
  modules that name it (a string constant equal to its file's stem, as ``script_source("why")``
  or a table of script names), and one that only glue modules name is Celery's, kept in
  ``_celery/lua`` and built on the core's library with ``_core.scripts.built_script``;
- no module over 500 lines but the ones listed in ``OVERSIZE`` (each with the most lines it may
  have, to shrink over time), and none over 750; the Lua scripts count (``*.lua``, by path).

Usage: ``python scripts/check_architecture.py`` (prints the graph; exit status 1 on a breach).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "celery_semaphore"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
CORE = f"{PACKAGE}._core"
FORBIDDEN_IN_CORE = ("celery", "kombu", "click")
CORE_MAY_IMPORT = (CORE, f"{PACKAGE}.errors")
MOST_LINES = 500
HARD_LIMIT = 750
# Core modules that only the glue imports today, and why they are the semaphore's all the same.
CORE_FOR_ANY_CALLER: dict[str, str] = {
    f"{CORE}.clients": "a client per deployment from a URL: what any caller building a semaphore from a URL needs",
    f"{CORE}.explain": "where a waiter or holder stands on any semaphore; why() is its first reader",
    f"{CORE}.nodes": "instances under a stable name taking over a dead one's holders: any process group may use it",
}
GLUE = (f"{PACKAGE}._celery", f"{PACKAGE}._cli", f"{PACKAGE}.cli")
# Modules allowed over MOST_LINES for now, with their ceiling: lower a ceiling when a module
# shrinks, drop the entry when it is under MOST_LINES.
OVERSIZE: dict[str, int] = {
    # ceilings as `ruff format` lays the code out (one argument a line where a call is too long)
    "celery_semaphore/_core/lua/_lib.lua": 650,  # the key schema, storage format and shared steps
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.Module, module: str, is_package: bool) -> Iterator[tuple[str, bool]]:
    """(imported module, at load time?) for each import: at load time means at module level
    (not inside a function); imports under ``if TYPE_CHECKING:`` are left out."""

    def walk(node: ast.AST, at_load: bool) -> Iterator[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    yield from walk(other, at_load)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, at_load
            elif isinstance(child, ast.ImportFrom):
                base = resolve(child, module, is_package)
                for alias in child.names:
                    # "from . import x" imports the module x; "from .m import name" imports m
                    candidate = f"{base}.{alias.name}" if base else alias.name
                    yield (candidate if is_module(candidate) else base), at_load
            else:
                inner = at_load and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(child, inner)

    yield from walk(tree, True)


def resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts.pop()
    for _ in range(node.level - 1):
        parts.pop()
    return ".".join([*parts, node.module] if node.module else parts)


def is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    return (ROOT.parent / relative.with_suffix(".py")).exists() or (ROOT.parent / relative / "__init__.py").exists()


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among load-time imports, as the list of modules around it."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def glue_only_core_modules(importers: dict[str, set[str]]) -> list[str]:
    """Core modules whose every importer is the Celery glue or the CLI."""
    problems = []
    for module, users in sorted(importers.items()):
        if not module.startswith(f"{CORE}.") or module in CORE_FOR_ANY_CALLER:
            continue
        if users and all(user.startswith(GLUE) for user in users):
            problems.append(
                f"{module} is used only by the Celery glue or the CLI ({', '.join(sorted(users))}): "
                "move it to _celery, or list it in CORE_FOR_ANY_CALLER with the reason it is generic"
            )
    return problems


def glue_only_core_scripts(names: dict[str, set[str]]) -> list[str]:
    """Lua scripts of the core whose every module naming them is the Celery glue or the CLI
    (``names``: module -> the string constants in it)."""
    problems = []
    for path in sorted((ROOT / "_core" / "lua").glob("*.lua")):
        if path.stem.startswith("_"):  # the library every script is built on
            continue
        users = sorted(module for module, constants in names.items() if path.stem in constants)
        if users and all(user.startswith(GLUE) for user in users):
            problems.append(
                f"{path.relative_to(ROOT.parent)} is run only by the Celery glue or the CLI ({', '.join(users)}): "
                "move it to _celery/lua and build it with _core.scripts.built_script"
            )
    return problems


def oversized_lua() -> list[str]:
    """The Lua scripts under the same budget as the modules, named by path in ``OVERSIZE``."""
    problems = []
    for path in sorted(ROOT.rglob("*.lua")):
        name = str(path.relative_to(ROOT.parent))
        lines = path.read_text(encoding="utf-8").count("\n") + 1
        ceiling = OVERSIZE.get(name, MOST_LINES)
        print(f"{name} ({lines} lines)")
        if lines > HARD_LIMIT:
            problems.append(f"{name}: {lines} lines, over the hard limit of {HARD_LIMIT}")
        elif lines > ceiling:
            problems.append(f"{name}: {lines} lines, over its budget of {ceiling}")
    return problems


def main() -> int:
    graph: dict[str, set[str]] = {}
    importers: dict[str, set[str]] = {}
    names: dict[str, set[str]] = {}
    problems: list[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source, filename=str(path))
        internal: set[str] = set()
        for imported, at_load in imports(tree, module, path.name == "__init__.py"):
            top = imported.split(".")[0]
            if module.startswith(CORE):
                if top in FORBIDDEN_IN_CORE:
                    problems.append(f"{module} imports {imported}: the core must not depend on {top}")
                elif imported.startswith(PACKAGE) and not imported.startswith(CORE_MAY_IMPORT):
                    problems.append(f"{module} imports {imported}: the core may import only itself and errors")
            if imported.startswith(PACKAGE) and imported != module:
                internal.add(imported)
                importers.setdefault(imported, set()).add(module)
                if at_load:
                    graph.setdefault(module, set()).add(imported)
        if module == PACKAGE:  # the facade loads its public names by module path, on first use
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("._"):
                    importers.setdefault(PACKAGE + node.value, set()).add(module)
        graph.setdefault(module, set())
        names[module] = {
            node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
        }
        lines = source.count("\n") + 1
        ceiling = OVERSIZE.get(module, MOST_LINES)
        if lines > HARD_LIMIT:
            problems.append(f"{module}: {lines} lines, over the hard limit of {HARD_LIMIT}")
        elif lines > ceiling:
            problems.append(f"{module}: {lines} lines, over its budget of {ceiling}")
        print(f"{module} ({lines} lines)")
        for target in sorted(internal):
            print(f"    -> {target}{'' if target in graph[module] else ' (inside a function)'}")
    problems += glue_only_core_modules(importers)
    problems += glue_only_core_scripts(names)
    problems += oversized_lua()
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    for name, ceiling in OVERSIZE.items():
        if name not in graph and not (ROOT.parent / name).exists():
            problems.append(f"OVERSIZE lists {name}, which does not exist")
        elif ceiling > HARD_LIMIT:
            problems.append(f"OVERSIZE allows {name} {ceiling} lines, over the hard limit")
    for problem in problems:
        print(f"ERROR: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
