"""Import shape: pure modules load only what they need; runtime modules import no cycle."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import chatlane

HEAVY = ("chatlane.runtime.engine", "starlette", "uvicorn")
PURE = (
    "chatlane.runtime.busy",
    "chatlane.runtime.settings",
    "chatlane.identity",
    "chatlane.context",
    "chatlane.config",
)
PACKAGE = Path(chatlane.__file__).parent
MOVED = {"chatlane.server": "chatlane.hub"}
"""Old module paths kept as re-exports, and where their names live now."""


@pytest.mark.parametrize("module", PURE)
def test_a_pure_module_loads_no_engine_and_no_server(module: str) -> None:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(run.stdout))
    assert not {name for name in loaded if name.split(".")[0] in HEAVY or name in HEAVY}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_at_load(path: Path) -> set[str]:
    """Modules of chatlane that ``path`` imports when it loads (not for type checking)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("chatlane"):
            found.add(node.module or "")
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("chatlane"))
    return found


def _runtime_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in (PACKAGE / "runtime").glob("*.py")}
    return {
        name: {dep for dep in _imports_at_load(path) if dep in modules and dep != name}
        for name, path in modules.items()
    }


def test_runtime_modules_import_no_cycle() -> None:
    graph = _runtime_graph()
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, f"import cycle: {' -> '.join([*trail, name])}"
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, (*trail, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())


@pytest.mark.parametrize(("old", "new"), MOVED.items())
def test_a_moved_module_still_exports_every_public_name(old: str, new: str) -> None:
    before, after = importlib.import_module(old), importlib.import_module(new)
    defined = {
        name
        for name, value in vars(after).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == new
    }
    assert defined <= set(before.__all__)
    assert all(getattr(before, name) is getattr(after, name) for name in before.__all__)
