"""The login node's install: the wheel, with no extras, in a fresh venv without torch (its
dependencies from PyPI). It installs no torch, triton or numpy, stays under 45 MB, and its
`scalemon` lists, snapshots, attaches to and serves a job on this machine (the job's hub and
ranks run from the test's own environment, on the same SCALEMON_HOME).

It needs PyPI (CI and these machines reach it): where the install cannot reach it, the test is
skipped with pip's error. It takes a minute or two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from test_import_hygiene import _ATTACH, feed, hub_has_steps, run_fed_hub, run_headless_attach
from test_packaging import build_wheel

from conftest import HubProcess, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.fresh_venv]

BASE_LIMIT_MB = 45
"""The issue's bound on the base install (textual, pyzmq, msgpack and psutil are ~38 MB)."""
VENV_TOOLS = {"pip", "setuptools", "wheel"}
"""What `python -m venv` puts in every venv: not part of scalemon's install."""
NETWORK_TROUBLE = ("NewConnectionError", "Temporary failure in name resolution",
                   "Max retries exceeded", "No matching distribution found",
                   "Could not find a version", "Network is unreachable", "ConnectionError",
                   "timed out", "ProxyError", "SSLError")
"""How pip says that it could not reach the package index."""

# each installed distribution's size on disk, from its RECORD (the .pyc files pip wrote too)
_SIZES = """
import importlib.metadata as md, json, os
sizes = {}
for dist in md.distributions():
    total = 0
    for f in dist.files or []:
        path = dist.locate_file(f)
        if os.path.isfile(path):
            total += os.path.getsize(path)
    sizes[dist.metadata["Name"].lower()] = total
print(json.dumps(sizes))
"""


def pip_install(python: Path, *what: str) -> None:
    """`pip install WHAT` in the fresh venv; skipped, with pip's error, when PyPI is out of
    reach (one retry, not pip's five: on a machine whose network drops packets each try waits
    for its timeout, and the module fixture's time counts against the first test's); any
    other failure fails."""
    run = subprocess.run([str(python), "-m", "pip", "install", "--quiet",
                          "--disable-pip-version-check", "--retries", "1", *what],
                         capture_output=True, text=True, timeout=600, env=fresh_env(None))
    if run.returncode == 0:
        return
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    error = [line for line in lines if line.startswith("ERROR")] or lines
    said = " | ".join(error[-3:]) or f"exit {run.returncode}"
    if any(mark in run.stderr for mark in NETWORK_TROUBLE):
        pytest.skip(f"pip could not install {' '.join(what)} from PyPI in the fresh venv "
                    f"(no network?): {said}")
    raise AssertionError(f"pip install {' '.join(what)} failed: {run.stderr[-3000:]}")


BASE_SIZES: dict[str, int] = {}
"""The fresh venv's distributions right after the wheel's install (name -> bytes)."""


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the wheel installed, no extras: its bin folder. What the install brought is
    kept in BASE_SIZES before numpy is added for the commands that still import it."""
    tmp = tmp_path_factory.mktemp("fresh")
    wheel = build_wheel(tmp)
    venv = tmp / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                          text=True, timeout=300)
    if made.returncode != 0:  # e.g. Debian's python3 without python3-venv (no ensurepip)
        said = " | ".join(line for line in made.stdout.splitlines() + made.stderr.splitlines()
                          if line.strip())[-500:]
        pytest.skip(f"{sys.executable} -m venv cannot make a venv here: {said}")
    pip_install(venv / "bin" / "python", str(wheel))
    BASE_SIZES.clear()
    BASE_SIZES.update(installed(venv / "bin"))
    return venv / "bin"


def installed(bin_dir: Path) -> dict[str, int]:
    """The fresh venv's distributions: name -> bytes on disk."""
    run = subprocess.run([str(bin_dir / "python"), "-c", _SIZES], capture_output=True,
                         text=True, timeout=120, env=fresh_env(None))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def fresh_env(home: Path | None) -> dict[str, str]:
    """The environment of a program of the fresh venv (pip included): without PYTHONPATH
    (where scalemon is installed with `pip install --target`, PYTHONPATH names that install
    and its dependencies, which would be imported, or taken by pip as installed, instead of the
    fresh venv's own) and the user's site-packages; SCALEMON_HOME at `home` when given."""
    env = {**os.environ, "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    if home is not None:
        env["SCALEMON_HOME"] = str(home)
    return env


def fresh(bin_dir: Path, *args: str, home: Path, timeout: float = 120,
          program: str = "scalemon") -> subprocess.CompletedProcess:
    """Run a program of the fresh venv outside the repo (its folders would shadow nothing
    there, but the check is of the install alone)."""
    return subprocess.run([str(bin_dir / program), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=home, env=fresh_env(home))


def test_the_base_install_has_no_training_stack_and_stays_small(fresh_venv: Path, home: Path):
    where = fresh(fresh_venv, "-c", "import scalemon; print(scalemon.__file__)", home=home,
                  program="python")
    assert where.stdout.startswith(str(fresh_venv.parent)), where  # the install, not the repo
    sizes = BASE_SIZES
    assert "scalemon" in sizes
    heavy = sorted({"torch", "triton", "numpy", "nvidia-ml-py"} & set(sizes))
    assert not heavy, f"the base install pulled {heavy}"
    ours = {name: size for name, size in sizes.items() if name not in VENV_TOOLS}
    total_mb = sum(ours.values()) / 1e6
    table = ", ".join(f"{n} {s / 1e6:.1f}" for n, s in sorted(ours.items(), key=lambda i: -i[1]))
    print(f"\nbase install: {total_mb:.1f} MB ({table})")
    assert total_mb < BASE_LIMIT_MB, f"the base install takes {total_mb:.1f} MB: {table}"


def test_its_commands_work_against_a_job_on_this_machine(
        fresh_venv: Path, start_hub, zctx: zmq.Context, home: Path):
    for command in ("attach", "hub", "jobs", "snapshot"):
        run = fresh(fresh_venv, command, "--help", home=home)
        assert run.returncode == 0, f"{command} --help: {run.stderr[-3000:]}"

    hub: HubProcess = start_hub("fresh1")  # from this (the full) environment
    ranks = feed(zctx, hub.address, "fresh1")
    wait_for(lambda: hub_has_steps("fresh1", 5), timeout=30, interval=0.2)
    jobs = fresh(fresh_venv, "jobs", home=home)
    assert jobs.returncode == 0, jobs.stderr[-3000:]
    assert "fresh1" in jobs.stdout
    snap = fresh(fresh_venv, "snapshot", "fresh1", "--json", home=home)
    assert snap.returncode == 0, snap.stderr[-3000:]
    state = json.loads(snap.stdout)
    assert len(state["ranks"]) == 2 and {r["step"] for r in state["ranks"]} == {5}

    # the dashboard, headless, until it shows both ranks (the ranks go on stepping)
    modules, _ = run_headless_attach([str(fresh_venv / "python"), "-c", _ATTACH, "fresh1"],
                                     ranks, cwd=home, env=fresh_env(home))
    assert "scalemon.tui.app" in modules


def test_its_hub_serves_a_job(fresh_venv: Path, zctx: zmq.Context, home: Path):
    run_fed_hub([str(fresh_venv / "scalemon"), "hub", "--job", "fresh2", "--home", str(home)],
                "fresh2", home, zctx, home / "fresh-hub.log", steps=4, cwd=home,
                env=fresh_env(home))


def test_the_heavy_commands_say_which_extra_they_need(fresh_venv: Path, home: Path):
    demo = fresh(fresh_venv, "demo", home=home)
    assert demo.returncode == 2, demo.stderr[-3000:]
    assert "pip install 'scalemon[demo]'" in demo.stderr
    assert "Traceback" not in demo.stderr
    agent = fresh(fresh_venv, "-c", "import scalemon.agent", home=home, program="python")
    assert agent.returncode == 1
    assert "ImportError: scalemon.agent needs torch" in agent.stderr
    assert "pip install 'scalemon[agent]'" in agent.stderr
