"""A normal install, as users get it: the wheel holds every module, and an install of it outside
the repo imports and runs without the source tree.

The test environment has scalemon installed in editable mode, whose import hook would quietly
find a module the wheel lacks in the repo. So the installed copy is run with `python -S` (no
site-packages processing, hence no editable hook) and the dependencies' site-packages on
PYTHONPATH behind the install target.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

# source folder -> the package it installs as (pyproject.toml [tool.setuptools.package-dir])
PACKAGE_DIRS = {"scalemon": "scalemon", "agent": "scalemon/agent", "hub": "scalemon/hub",
                "relay": "scalemon/relay", "tui": "scalemon/tui",
                "demo_train": "scalemon/demo_train"}
MODULES = ["scalemon.tui.app", "scalemon.tui.screens.overview", "scalemon.tui.widgets.plot",
           "scalemon.agent", "scalemon.agent.run", "scalemon.hub.main", "scalemon.relay.main",
           "scalemon.demo_train.fused_adam", "scalemon.demo_train.train", "scalemon.cli.main"]


def source_modules() -> set[str]:
    """Every .py file of the source folders, as its path inside the wheel."""
    found = set()
    for folder, package in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                found.add(f"{package}/{path.relative_to(REPO / folder).as_posix()}")
    return found


SETUPTOOLS_NEEDED = 77
"""pyproject.toml's build-system: setuptools>=77 (its `license` is a PEP 639 expression)."""


def build_backend_problem() -> str | None:
    """Why this Python cannot build the wheel without build isolation (no network), or None:
    no setuptools, or one older than pyproject.toml's build-system asks (a cluster image's)."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return "setuptools is not installed"
    try:
        major = int(version.split(".")[0])
    except ValueError:
        return None  # a version we cannot read: let the build say
    if major < SETUPTOOLS_NEEDED:
        return (f"setuptools {version} is older than pyproject.toml's "
                f"setuptools>={SETUPTOOLS_NEEDED}")
    return None


def build_wheel(tmp: Path) -> Path:
    """The wheel built under `tmp` from a copy of the source tree (nothing written into the
    repo), without build isolation (no network); skipped, saying why, where this Python's
    setuptools cannot build it (pip install 'setuptools>=77')."""
    problem = build_backend_problem()
    if problem:
        pytest.skip(f"cannot build scalemon's wheel with {sys.executable}: {problem} "
                    f"(pip install 'setuptools>={SETUPTOOLS_NEEDED}')")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
        ".ruff_cache", "runs"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    wheels = list((tmp / "dist").glob("scalemon-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built once for the module's tests."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_every_source_module(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(source_modules() - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    assert any(n.endswith("entry_points.txt") for n in names)


def test_installed_outside_the_repo_it_imports_and_runs(wheel: Path, tmp_path: Path):
    target = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--target",
         str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), *dependency_paths()])}
    env.pop("PYTHONHOME", None)
    check = ("import importlib, sys\n"
             f"for name in {MODULES!r}:\n"
             "    module = importlib.import_module(name)\n"
             f"    assert module.__file__.startswith({str(target)!r}), module.__file__\n"
             "print('imported', len(sys.modules))\n")
    run = subprocess.run([sys.executable, "-S", "-c", check], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    script = target / "bin" / "scalemon"
    assert script.exists(), sorted(p.name for p in (target / "bin").iterdir())
    help_run = subprocess.run([sys.executable, "-S", str(script), "--help"], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert help_run.returncode == 0, help_run.stderr[-3000:]
    for command in ("snapshot", "attach", "demo", "jobs", "hub"):
        assert command in help_run.stdout


def dependency_paths() -> list[str]:
    """Where this Python finds scalemon's dependencies without site processing (`python -S`):
    its site-packages, and what PYTHONPATH adds (a cluster image's torch may sit in
    dist-packages, and pyzmq or textual in a folder of their own given by PYTHONPATH)."""
    import site

    paths = [sysconfig.get_paths()["purelib"], *site.getsitepackages(),
             *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return list(dict.fromkeys(p for p in paths if p))


def requirements(wheel: Path) -> dict[str, set[str]]:
    """The wheel's Requires-Dist by extra ("" for the base install): extra -> project names."""
    meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
    by_extra: dict[str, set[str]] = {}
    for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line.removeprefix("Requires-Dist:").partition(";")
        name = re.split(r"[<>=!~\[ ]", spec.strip(), maxsplit=1)[0].lower()
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        by_extra.setdefault(extra.group(1) if extra else "", set()).add(name)
    return by_extra


def test_the_base_install_leaves_the_training_stack_to_the_extras(wheel: Path):
    needs = requirements(wheel)
    assert needs[""] == {"textual", "pyzmq", "msgpack", "psutil", "prometheus_client", "py-spy"}
    assert {"torch", "nvidia-ml-py"} <= needs["agent"]
    assert {"torch", "triton", "numpy"} <= needs["demo"]
