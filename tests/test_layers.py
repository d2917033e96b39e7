"""Imports go one way (README "Layers"): the core imports nothing of ours above it; agent, hub
and tui import the core and never each other; the demo trainer uses the core and the agent's
public API, as any training script would; the CLI imports a subcommand's layer inside the
function that needs it, so `scalemon jobs` never loads the dashboard, the hub or torch."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the folders that install as packages (pyproject's [tool.setuptools.package-dir])
FOLDERS = {"scalemon": "scalemon", "hub": "scalemon.hub", "agent": "scalemon.agent",
           "tui": "scalemon.tui", "demo_train": "scalemon.demo_train"}
# layer -> the layers it may import at module level
ALLOWED = {
    "core": {"core"},
    "agent": {"core", "agent"},
    "hub": {"core", "hub"},
    "tui": {"core", "tui"},
    "demo_train": {"core", "demo_train", "agent"},
    "cli": {"core", "cli"},
}
# ... and, inside a function (imported when a subcommand runs)
ALLOWED_LAZY = {**ALLOWED, "cli": {"core", "cli", "hub", "tui", "agent", "demo_train"}}


def layer_of(module: str) -> str | None:
    """The layer of a module named `scalemon.X...` (None for anything not ours)."""
    parts = module.split(".")
    if parts[0] != "scalemon":
        return None
    if len(parts) == 1:
        return "core"
    if parts[1] in ("hub", "agent", "tui", "demo_train"):
        return parts[1]
    if parts[1] in ("cli", "__main__") or parts[1].startswith("cli_"):
        return "cli"
    return "core"


@dataclass(frozen=True)
class Import:
    source: str  # path:line
    module: str  # what it imports, absolute
    lazy: bool  # inside a function


def _imports(path: Path, module: str) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = module.split(".")
                    if path.name != "__init__.py":
                        pkg = pkg[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([child.module] if child.module else []))
                names = [base] + [f"{base}.{a.name}" for a in child.names]
            found.extend(Import(f"{path.relative_to(REPO)}:{child.lineno}", n, lazy)
                         for n in names)
            visit(child, inner)

    visit(tree, False)
    return found


def _modules() -> list[tuple[Path, str]]:
    out = []
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(REPO / folder).with_suffix("").parts
                     if p != "__init__"]
            out.append((path, ".".join([package, *parts])))
    return out


def layer_violations() -> list[str]:
    """Every import of ours that crosses the layers the wrong way, as `path:line: a -> b`."""
    bad = []
    for path, module in _modules():
        own = layer_of(module)
        assert own is not None
        seen: set[tuple[str, str]] = set()  # one report per statement and layer
        for imp in _imports(path, module):
            target = layer_of(imp.module)
            if target is None or (imp.source, target) in seen:
                continue
            seen.add((imp.source, target))
            allowed = (ALLOWED_LAZY if imp.lazy else ALLOWED)[own]
            if target not in allowed:
                how = "inside a function" if imp.lazy else "at module level"
                bad.append(f"{imp.source}: {own} imports {imp.module} ({target}) {how}")
    return sorted(set(bad))


def test_imports_go_one_way():
    assert layer_violations() == []


def test_the_check_sees_a_wrong_way_import(tmp_path, monkeypatch):
    """The check itself: a core module importing the dashboard, and the CLI importing the hub at
    module level, are both reported."""
    core = tmp_path / "scalemon"
    core.mkdir()
    (core / "bad.py").write_text("from scalemon.tui.app import DashboardApp\n")
    (core / "cli_bad.py").write_text("import scalemon.hub.server\n"
                                     "def run():\n    from scalemon.tui import attach\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    monkeypatch.setitem(globals(), "FOLDERS", {"scalemon": "scalemon"})
    found = layer_violations()
    assert len(found) == 2, found
    assert "scalemon/bad.py:1: core imports scalemon.tui.app (tui) at module level" in found
    assert any(f.startswith("scalemon/cli_bad.py:1: cli imports scalemon.hub.server")
               for f in found)


@pytest.mark.parametrize("path", sorted((REPO / "bench").glob("*.py")), ids=lambda p: p.name)
def test_benches_use_the_installed_package(path):
    """A bench imports `scalemon` as installed; it does not put the checkout on sys.path."""
    assert "sys.path" not in path.read_text(), f"{path.name} edits sys.path"


HEAVY = ("torch", "triton", "numpy", "textual", "rich")


def test_the_core_is_pure_python():
    """The core never imports torch, triton, numpy or textual, not even inside a function."""
    bad = [f"{imp.source}: {imp.module}"
           for path, module in _modules() if layer_of(module) == "core"
           for imp in _imports(path, module) if imp.module.split(".")[0] in HEAVY]
    assert bad == []
