"""The base install's commands never import the training stack (in the style of harlequin's
import-hygiene test): `scalemon jobs`, `snapshot`, `hub` and `attach` run for real, each in a
subprocess under `python -X importtime`, against a real hub fed by fake ranks, and the modules
they imported are read back: no torch, no triton, nothing of the agent or the demo trainer (the
base install has none of them: pyproject.toml's extras), and no numpy once the dashboard is pure
Python.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

from conftest import FakeRank, HubProcess, wait_for
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir

OUTSIDE = Path(tempfile.gettempdir())
"""Where the commands run: outside the checkout, whose `scalemon/` folder would shadow an
installed (not editable) scalemon for `python -m scalemon` and `python -c` (README, "Run the
tests"); its modules, not the installed ones, would then be what the test sees imported."""

HEAVY = ("torch", "triton", "numpy", "scalemon.agent", "scalemon.demo_train")
"""What no command of the base install may import."""


def forbidden() -> tuple[str, ...]:
    return HEAVY


def imported(stderr: str) -> set[str]:
    """The modules a `python -X importtime` run reported on its stderr."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name and name != "imported package":
                names.add(name)
    return names


def heavy(names: set[str], prefixes: tuple[str, ...] | None = None) -> list[str]:
    """The names among `names` that are, or are inside, one of `prefixes` (default: forbidden)."""
    prefixes = forbidden() if prefixes is None else prefixes
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes))


def scalemon(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime -m scalemon ARGS`; the result and the modules it imported."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "scalemon", *args],
                         capture_output=True, text=True, timeout=timeout, cwd=OUTSIDE)
    return run, imported(run.stderr)


def feed(zctx: zmq.Context, address: HubAddress, job: str, steps: int = 5) -> list[FakeRank]:
    """Two fake ranks that said hello and made `steps` steps each."""
    ranks = [FakeRank(zctx, address, job, r) for r in range(2)]
    for rank in ranks:
        rank.hello(world_size=2)
    for step in range(1, steps + 1):
        for rank in ranks:
            rank.step(step, loss=2.0 / step)
            rank.heartbeat()
    return ranks


def hub_has_steps(job: str, steps: int) -> bool:
    """The hub of `job` folded `steps` steps of both ranks (asked as `scalemon snapshot`
    would, in this process)."""
    from scalemon.home.lookup import resolve_hub
    from scalemon.link.client import HubClient

    _, address = resolve_hub(job)
    state = HubClient(address, timeout_s=5).state()["state"]
    return len(state["ranks"]) == 2 and all(r.get("step") == steps for r in state["ranks"])


def test_the_heavy_list_reads_importtime_output():
    """The parser finds what a run that imports a heavy module reports (the test can fail)."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", "import json.decoder"],
                         capture_output=True, text=True, timeout=60)
    names = imported(run.stderr)
    assert "json.decoder" in names and "json" in names
    assert {"json", "json.decoder"} <= set(heavy(names, ("json",)))
    assert heavy({"torchvision", "torch_x"}, ("torch",)) == []  # whole names only


def test_jobs_and_snapshot_import_no_training_stack(
        start_hub, zctx: zmq.Context, home: Path):
    hub = start_hub("hyg1")
    feed(zctx, hub.address, "hyg1")
    wait_for(lambda: hub_has_steps("hyg1", 5), timeout=30, interval=0.2)

    jobs, names = scalemon("jobs")
    assert jobs.returncode == 0, jobs.stderr[-3000:]
    assert "hyg1" in jobs.stdout
    assert names, "no import list on stderr"
    assert not heavy(names), f"`scalemon jobs` imported {heavy(names)}"

    snap, names = scalemon("snapshot", "hyg1", "--json")
    assert snap.returncode == 0, snap.stderr[-3000:]
    state = json.loads(snap.stdout)
    assert state["job"] == "hyg1" and len(state["ranks"]) == 2
    assert not heavy(names), f"`scalemon snapshot` imported {heavy(names)}"
    # nor what other subcommands need: the hub's server, the dashboard, the metrics exporter
    other = ("scalemon.hub.server", "scalemon.tui", "textual", "prometheus_client")
    assert not heavy(names, other), f"`scalemon snapshot` imported {heavy(names, other)}"


def test_the_hub_imports_no_training_stack_while_it_folds_a_job(zctx: zmq.Context, home: Path):
    """`scalemon hub` started by hand, fed by two ranks until it folded their steps, then
    stopped: what it imported on the way, the lazy imports of folding included."""
    log = home / "hub-importtime.log"
    run_fed_hub([sys.executable, "-X", "importtime", "-m", "scalemon", "hub", "--job", "hyg2",
                 "--home", str(home)], "hyg2", home, zctx, log, steps=8, cwd=OUTSIDE)
    names = imported(log.read_text())
    assert "scalemon.hub.server" in names
    assert not heavy(names), f"`scalemon hub` imported {heavy(names)}"


# `scalemon attach JOB` as the console script runs it, but the dashboard headless (Textual's
# run_test in place of the terminal) until it shows both ranks; then the modules it imported.
_ATTACH = """
import asyncio, json, sys, time
import scalemon.tui.attach as attach
from scalemon.cli.main import main

def headless(app):
    from scalemon.tui.widgets.rank_table import RankTable

    async def run():
        async with app.run_test(size=(140, 40)) as pilot:
            end = time.monotonic() + 60
            while time.monotonic() < end:
                tables = app.screen.query(RankTable)
                if tables and len(tables.first().cells_by_rank()) == 2:
                    return 0
                await pilot.pause(0.2)
            return 3
    return asyncio.run(run())

attach.run_app = headless
attach.not_a_terminal = lambda: None  # run headless under Pilot: no terminal needed
code = main(["attach", sys.argv[1]])
print(json.dumps(sorted(sys.modules)))
sys.exit(code)
"""


def test_attach_imports_no_training_stack(start_hub, zctx: zmq.Context, home: Path):
    hub: HubProcess = start_hub("hyg3")
    ranks = feed(zctx, hub.address, "hyg3")
    modules, err = run_headless_attach(
        [sys.executable, "-X", "importtime", "-c", _ATTACH, "hyg3"], ranks, cwd=OUTSIDE,
        env={**os.environ, "TERM": "xterm-256color"})
    assert "scalemon.tui.app" in modules  # the dashboard ran
    names = imported(err) | modules
    assert not heavy(names), f"`scalemon attach` imported {heavy(names)}"


def test_the_relay_imports_no_training_stack():
    """The node's relay (`python -m scalemon.relay`, started by rank 0's agent beside the
    job) is a process of its own on the training node: it stays light too."""
    run = subprocess.run([sys.executable, "-X", "importtime", "-m", "scalemon.relay",
                          "--help"], capture_output=True, text=True, timeout=120, cwd=OUTSIDE)
    assert run.returncode == 0, run.stderr[-3000:]
    names = imported(run.stderr)
    assert "scalemon.relay" in names  # (the relay itself runs as __main__)
    assert "scalemon.hub" not in names  # the relay imports only the core
    assert not heavy(names), f"the relay imported {heavy(names)}"


# Without an extra: its packages hidden (None in sys.modules: not found, not importable).
_HIDDEN = "import sys\nfor name in sys.argv[1].split(','):\n    sys.modules[name] = None\n"


def without(packages: str, code: str, *args: str) -> subprocess.CompletedProcess:
    """Run `code` in a python where `packages` (comma-separated) cannot be imported."""
    return subprocess.run([sys.executable, "-c", _HIDDEN + code, packages, *args],
                          capture_output=True, text=True, timeout=120, cwd=OUTSIDE)


def test_demo_without_its_extra_says_what_to_install():
    main = "from scalemon.cli.main import main\nsys.exit(main(sys.argv[2:]))"
    for args in (["demo"], ["demo", "--preset", "small", "--ranks", "1"]):
        run = without("torch,triton", main, *args)
        assert run.returncode == 2, run.stderr[-3000:]
        assert run.stderr == ("scalemon demo: the demo trainer needs torch, triton, which this "
                              "install of scalemon lacks: pip install 'scalemon[demo]'\n")
    run = without("torch,triton", main, "demo", "--ranks", "0")  # a bad option: said first
    assert run.returncode == 2 and "--ranks" in run.stderr, run.stderr[-3000:]


def test_the_agent_without_torch_says_what_to_install():
    run = without("torch", "import scalemon.agent")
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: scalemon.agent needs torch"), run.stderr[-3000:]
    assert "pip install 'scalemon[agent]'" in last
    run = without("torch", "import scalemon.agent.overrides")  # every way in stops there
    assert "pip install 'scalemon[agent]'" in run.stderr


def run_fed_hub(cmd: list[str], job: str, home: Path, zctx: zmq.Context, log: Path,
                steps: int, cwd: Path, env: dict[str, str] | None = None) -> None:
    """Run the hub command `cmd` (its stderr into `log`), feed it `steps` steps of fake ranks,
    wait until it folded them, then stop it with SIGTERM: it must exit 0."""
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=cwd, env=env)
    try:
        job_file = jobs_dir(home) / f"{job}.json"

        def ready() -> JobFile | None:
            assert proc.poll() is None, f"hub exited early:\n{log.read_text()[-3000:]}"
            return JobFile.read(job_file) if job_file.exists() else None

        address = HubAddress.parse(wait_for(ready, timeout=60).address)
        feed(zctx, address, job, steps=steps)
        wait_for(lambda: hub_has_steps(job, steps), timeout=30, interval=0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def run_headless_attach(cmd: list[str], ranks: list[FakeRank], cwd: Path,
                        env: dict[str, str]) -> tuple[set[str], str]:
    """Run `cmd` (python -c _ATTACH JOB) while `ranks` go on stepping, until the dashboard
    showed them; returns the modules it had imported and its stderr. It must exit 0."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env=env)
    step, end = 5, time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < end:
            step += 1
            for rank in ranks:
                rank.step(step)
            time.sleep(0.2)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, f"exit {proc.returncode} (3: ranks never shown)\n{err[-3000:]}"
    return set(json.loads(out.strip().splitlines()[-1])), err
