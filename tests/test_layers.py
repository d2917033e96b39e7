"""Imports go one way (docs/architecture.md): the core's layers each import only the layers
below them; agent, hub, relay and tui import the core and never each other; the demo trainer
uses the core and the agent's public API, as any training script would; the CLI imports a
subcommand's layer inside the function that needs it, so `scalemon jobs` never loads the
dashboard, the hub or torch. And no module of ours takes part in a run-time import cycle."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the folders that install as packages (pyproject's [tool.setuptools.package-dir])
FOLDERS = {"scalemon": "scalemon", "hub": "scalemon.hub", "agent": "scalemon.agent",
           "relay": "scalemon.relay", "tui": "scalemon.tui", "demo_train": "scalemon.demo_train"}
TOP = "top"
"""The tables and rules at the top of scalemon/ (protocol, metrics, flags, policy, settings,
collectives, options): the lowest layer."""
CORE_PACKAGES = ("text", "home", "state", "reports", "link", "proc", "cli")
"""The core's subpackages, each a layer of its own (`scalemon.<name>`)."""
PROCESSES = ("hub", "agent", "relay", "tui", "demo_train")
"""The packages of the processes built on the core (`scalemon.<name>`)."""
CORE = {TOP, "text", "home", "state", "reports", "link", "proc"}
"""What a process may import: the core, without the CLI."""
# layer -> the layers it may import at module level
ALLOWED = {
    TOP: {TOP},
    "text": {TOP, "text"},
    "home": {TOP, "text", "home"},
    "state": {TOP, "text", "state"},
    "reports": {TOP, "text", "state", "proc", "reports"},
    "link": {TOP, "text", "home", "state", "link"},
    "proc": {TOP, "text", "proc"},
    "cli": CORE | {"cli"},
    "agent": CORE | {"agent"},
    "hub": CORE | {"hub"},
    "relay": CORE | {"relay"},
    "tui": CORE | {"tui"},
    "demo_train": CORE | {"demo_train", "agent"},
}
# ... and, inside a function (imported when a subcommand runs)
ALLOWED_LAZY = {**ALLOWED, "cli": ALLOWED["cli"] | set(PROCESSES)}


def layer_of(module: str) -> str | None:
    """The layer of a module named `scalemon.X...` (None for anything not ours)."""
    parts = module.split(".")
    if parts[0] != "scalemon":
        return None
    if len(parts) == 1:
        return TOP
    if parts[1] == "__main__":
        return "cli"
    if parts[1] in CORE_PACKAGES or parts[1] in PROCESSES:
        return parts[1]
    return TOP


@dataclass(frozen=True)
class Import:
    source: str  # path:line
    module: str  # what it imports, absolute
    lazy: bool  # inside a function
    base: bool = False  # X of `from X import a`, imported for the names after it


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def _imports(path: Path, module: str) -> list[Import]:
    """Every import of `path` that runs (those under `if TYPE_CHECKING:` left out), each
    statement as the module it names and, for `from X import a`, `X.a` too (a module or not)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            inner = lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            names: list[str] = []
            base = ""
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
            found.extend(Import(f"{path.relative_to(REPO)}:{child.lineno}", n, lazy,
                                base=n == base and i == 0)
                         for i, n in enumerate(names))
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


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports when it runs (at module level or inside a
    function): for `from X import a`, `X.a` where that is a module of ours, else `X`."""
    modules = {m: p for p, m in _modules()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        statements: dict[str, list[Import]] = {}
        for imp in _imports(path, module):
            statements.setdefault(imp.source, []).append(imp)
        for imports in statements.values():
            names = [imp.module for imp in imports if not imp.base]
            targets = [n for n in names if n in modules]
            bases = [imp.module for imp in imports if imp.base and imp.module in modules]
            if bases and len(targets) < len(names):  # `from X import a`, a not a module: X
                targets.extend(bases)
            graph[module].update(t for t in targets if t != module)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def test_imports_go_one_way():
    assert layer_violations() == []


def test_no_run_time_import_cycle():
    assert import_cycles(import_graph()) == []


def test_every_package_of_ours_is_a_known_layer():
    """A new subpackage of the core must be given its place in the layers here first."""
    packages = {p.parent.name for p in (REPO / "scalemon").glob("*/__init__.py")}
    assert packages == set(CORE_PACKAGES)
    assert {folder for folder in FOLDERS if folder != "scalemon"} == set(PROCESSES)


def test_the_check_sees_a_wrong_way_import(tmp_path, monkeypatch):
    """The check itself: the state importing a report, a core module importing the dashboard
    and the CLI importing the hub at module level are reported; the CLI importing the
    dashboard inside a function and a TYPE_CHECKING import are not."""
    core = tmp_path / "scalemon"
    (core / "state").mkdir(parents=True)
    (core / "cli").mkdir()
    (core / "bad.py").write_text("from scalemon.tui.app import DashboardApp\n")
    (core / "state" / "model.py").write_text(
        "from typing import TYPE_CHECKING\nfrom scalemon.reports.hangs import job_hang\n"
        "if TYPE_CHECKING:\n    from scalemon.link.client import HubClient\n")
    (core / "cli" / "bad.py").write_text("import scalemon.hub.server\n"
                                         "def run():\n    from scalemon.tui import attach\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    monkeypatch.setitem(globals(), "FOLDERS", {"scalemon": "scalemon"})
    found = layer_violations()
    assert len(found) == 3, found
    assert "scalemon/bad.py:1: top imports scalemon.tui.app (tui) at module level" in found
    assert ("scalemon/state/model.py:2: state imports scalemon.reports.hangs (reports) at "
            "module level") in found
    assert any(f.startswith("scalemon/cli/bad.py:1: cli imports scalemon.hub.server")
               for f in found)


def test_the_check_sees_a_cycle_also_through_a_function(tmp_path, monkeypatch):
    """a -> b at module level, b -> c inside a function, c -> a: one cycle; a TYPE_CHECKING
    import back is none."""
    pkg = tmp_path / "scalemon"
    pkg.mkdir()
    (pkg / "a.py").write_text("from scalemon import b\nfrom scalemon.d import thing\n")
    (pkg / "b.py").write_text("def f():\n    from scalemon.c import g\n")
    (pkg / "c.py").write_text("import scalemon.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nthing = 1\n"
                              "if TYPE_CHECKING:\n    from scalemon.a import x\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    monkeypatch.setitem(globals(), "FOLDERS", {"scalemon": "scalemon"})
    assert import_cycles(import_graph()) == [["scalemon.a", "scalemon.b", "scalemon.c"]]


MAX_LINES = 600
MAX_TOP_MODULES = 12


def test_the_top_of_the_core_stays_small_and_no_module_is_long():
    top = sorted(p.name for p in (REPO / "scalemon").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    long = {str(path.relative_to(REPO)): n for path, _ in _modules()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.parametrize("path", sorted((REPO / "bench").glob("*.py")), ids=lambda p: p.name)
def test_benches_use_the_installed_package(path):
    """A bench imports `scalemon` as installed; it does not put the checkout on sys.path."""
    assert "sys.path" not in path.read_text(), f"{path.name} edits sys.path"


HEAVY = ("torch", "triton", "numpy", "textual", "rich")


def test_the_core_is_pure_python():
    """The core never imports torch, triton, numpy or textual, not even inside a function."""
    bad = [f"{imp.source}: {imp.module}"
           for path, module in _modules() if layer_of(module) in CORE
           for imp in _imports(path, module) if imp.module.split(".")[0] in HEAVY]
    assert bad == []


def test_the_architecture_page_names_every_package():
    """docs/architecture.md names each core subpackage and each process's package, so a new
    one cannot land without its line there."""
    text = (REPO / "docs" / "architecture.md").read_text()
    for name in CORE_PACKAGES:
        assert f"scalemon/{name}/" in text, f"docs/architecture.md does not name scalemon/{name}/"
    for name in PROCESSES:
        assert f"`{name}/`" in text, f"docs/architecture.md does not name {name}/"
