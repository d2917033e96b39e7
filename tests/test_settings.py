"""One settings table (`scalemon.settings`): every `SCALEMON_*` variable the code names is in it,
only that module reads the environment for them, and docs/settings.md and `scalemon --help`
are made from it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from scalemon import settings

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("scalemon", "hub", "agent", "tui", "demo_train")


def _sources() -> list[Path]:
    return [p for folder in SOURCES for p in sorted((REPO / folder).rglob("*.py"))]


def test_every_variable_the_code_names_is_in_the_table():
    named = {name for path in _sources()
             for name in re.findall(r"""["'](SCALEMON_[A-Z0-9_]+)["']""", path.read_text())}
    assert named, "the scan found no variable at all"
    assert named <= set(settings.SETTINGS), named - set(settings.SETTINGS)


def environment_readers(paths: list[Path]) -> dict[str, list[str]]:
    """Module path -> each place it reads a SCALEMON_* variable from an environment mapping
    itself (`os.environ.get("SCALEMON_X")`, `env["SCALEMON_X"]`, `os.getenv(X_ENV)` with
    `X_ENV = "SCALEMON_X"`), instead of through `scalemon.settings`."""
    found: dict[str, list[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text())
        names = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant)
                 and str(node.value.value).startswith("SCALEMON_")
                 for t in node.targets if isinstance(t, ast.Name)}

        def is_variable(arg: ast.expr, names: set[str] = names) -> bool:
            return ((isinstance(arg, ast.Constant) and str(arg.value).startswith("SCALEMON_"))
                    or (isinstance(arg, ast.Name) and arg.id in names))

        for node in ast.walk(tree):
            key = None
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("get", "getenv", "pop") and node.args):
                key = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                key = node.slice
            if key is not None and is_variable(key):
                where = path.relative_to(REPO if REPO in path.parents else path.parents[1])
                found.setdefault(str(where), []).append(
                    f"line {node.lineno}")
    return found


def test_only_the_settings_module_reads_the_variables():
    assert environment_readers(_sources()) == {}


def test_the_check_sees_a_module_that_reads_a_variable_itself(tmp_path: Path):
    (tmp_path / "pkg").mkdir()
    bad = tmp_path / "pkg" / "bad.py"
    bad.write_text('import os\nX_ENV = "SCALEMON_X"\na = os.environ.get("SCALEMON_HOME")\n'
                   'b = os.getenv(X_ENV)\nc = dict(os.environ)["SCALEMON_NODE"]\n'
                   'env = {}\nenv["SCALEMON_JOB_ID"] = "written, not read"\n')
    assert environment_readers([bad]) == {"pkg/bad.py": ["line 3", "line 4", "line 5"]}


def test_docs_table_is_made_from_the_settings():
    # the checkout's docs (an installed package has no docs/ beside it)
    text = (Path(__file__).resolve().parents[1] / "docs" / "settings.md").read_text()
    assert settings.render_docs(text) == text, (
        "docs/settings.md is out of date: run `python -m scalemon.settings`")
    for name in settings.SETTINGS:
        assert f"`{name}`" in text


def test_help_text_has_every_variable_with_its_default():
    text = settings.help_text()
    for s in settings.SETTINGS.values():
        assert re.search(rf"^  {s.name}\s", text, re.M), s.name
    assert "(default: ~/.scalemon)" in " ".join(text.split())


def test_typed_readers_and_their_defaults(tmp_path: Path):
    env = {"SCALEMON_HOME": str(tmp_path), "SCALEMON_HANG_AFTER": "2.5", "SCALEMON_NODE": "",
           "SCALEMON_HUB_ARGS": " --linger 60  --lost-after 10 ", "SCALEMON_CUDA_DIRECT": "0"}
    assert settings.scalemon_home(env) == tmp_path
    assert settings.scalemon_home({}) == Path.home() / ".scalemon"
    assert settings.hang_after_s(env) == 2.5
    for bad in ("0", "-1", "nan", "inf", "ten", ""):
        assert settings.hang_after_s({"SCALEMON_HANG_AFTER": bad}) == settings.HANG_AFTER_S
    assert settings.raw("SCALEMON_NODE", env) is None  # empty reads as unset
    assert settings.node_name(env) == settings.node_name({})
    assert settings.words("SCALEMON_HUB_ARGS", env) == ["--linger", "60", "--lost-after", "10"]
    assert settings.flag_off("SCALEMON_CUDA_DIRECT", env)
    assert not settings.flag_off("SCALEMON_CUDA_DIRECT", {})


def test_a_name_outside_the_table_is_refused():
    with pytest.raises(KeyError, match="SCALEMON_HOEM is not a scalemon setting"):
        settings.raw("SCALEMON_HOEM")
