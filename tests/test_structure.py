"""The map stays honest: no import circle anywhere, no module past ~300 lines.

Imports are read from the source (ast), TYPE_CHECKING-only ones included: a circle hidden
behind TYPE_CHECKING still says a concept is split in the wrong place.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("services", "shared", "kvmesh", "loadtest")
MAX_MODULE_LINES = 300


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "pb" in path.relative_to(ROOT).parts:  # generated protobuf code
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The project modules this one imports (`from a.b import c` is a.b.c when that is a
    module of ours, else a.b)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                imported.add(submodule if submodule in known else node.module)
    return {name for name in imported if name in known}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path of module names, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = 2
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_no_import_circle_in_services_shared_and_the_cli() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert _circle(graph) is None, " -> ".join(_circle(graph) or [])


def test_the_circle_finder_finds_one() -> None:  # the check above could not pass vacuously
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_over_300_lines() -> None:
    long = {
        name: lines
        for name, path in _modules().items()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split by concept (docs/structure.md): {long}"


def test_no_assert_guards_at_run_time() -> None:
    """`python -O` strips asserts: code that serves raises typed errors instead."""
    found = [
        f"{name}:{node.lineno}"
        for name, path in _modules().items()
        if not name.startswith("loadtest")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Assert)
    ]
    assert not found, f"raise a KvmeshError or a ValueError instead: {found}"


def test_every_module_has_a_line_in_the_structure_page() -> None:
    """docs/design/structure.md names each module by its path within its section (a kernel's
    launcher by the kernel's name): a module added or moved without its line fails here."""
    page = (ROOT / "docs" / "design" / "structure.md").read_text(encoding="utf-8")
    unlisted = []
    for name, path in _modules().items():
        if path.name == "__init__.py":
            continue
        parts = path.relative_to(ROOT).parts
        within = "/".join(parts[2:] if parts[0] == "services" else parts[1:])
        names = (f"`{within}`", f"`{'/'.join(parts)}`", f"`{path.stem}`")
        if not any(n in page for n in names):
            unlisted.append(name)
    assert not unlisted, f"add a line to docs/design/structure.md: {unlisted}"


def test_services_never_import_each_other() -> None:
    modules = _modules()
    for name, path in modules.items():
        if not name.startswith("services."):
            continue
        own = name.split(".")[1]
        others = {
            target.split(".")[1]
            for target in _imports(path, modules)
            if target.startswith("services.") and target.split(".")[1] != own
        }
        assert not others, f"{name} imports services {others}"


def test_the_cli_package_never_imports_the_benchmarks() -> None:
    """`kvmesh` is what users install and run; `loadtest` builds on it (`kvmesh bench` runs
    `loadtest.bench_cli` as a module by name)."""
    modules = _modules()
    found = {
        name: sorted(t for t in _imports(path, modules) if t.startswith("loadtest"))
        for name, path in modules.items()
        if name.startswith("kvmesh")
    }
    assert not {name: targets for name, targets in found.items() if targets}
