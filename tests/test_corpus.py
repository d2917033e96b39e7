"""The conformance corpus: training loops written the way well-known public scripts and
frameworks write theirs (tests/corpus/*.py, each listing its patterns), run for real (torchrun,
2 gloo ranks on the CPU, or one bare process) with the hub their ranks start, and compared with
`scalemon snapshot --json` and its table: every rank's step count, last step and last loss are
what the script logged, its scaler and collectives show, and its state is what it should be.
Then the agent's reading of scalers and of values it cannot read, in process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO, free_port, hub_messages, kill_tree, wait_for
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.settings import node_name

CORPUS = REPO / "tests" / "corpus"
JOBS: dict[str, tuple[str, tuple[str, ...], int]] = {  # name: script, its arguments, ranks
    "nanogpt": ("nanogpt_style.py", (), 2),
    "accelerate": ("accelerate_style.py", (), 2),
    "titan": ("titan_style.py", (), 2),
    "lightning": ("lightning_style.py", (), 2),
    "compile_outer": ("compile_ddp.py", ("outer",), 2),
    "compile_inner": ("compile_ddp.py", ("inner",), 2),
    "crash": ("crash.py", (), 2),
    "agent_fault": ("agent_fault.py", (), 2),
    "single": ("single_process.py", (), 1),
    "spawn": ("spawn_style.py", (), 2),
}
DIRECT = {"crash", "single"}
"""Jobs whose ranks are started as processes of their own with the rendezvous in their
environment, as `srun` starts them, not by torchrun (which would SIGTERM the other ranks of a
crash while they report it); "single" is one process without any of it."""
SPAWNING = {"spawn"}
"""Jobs started as one process that starts its ranks itself (`torch.multiprocessing.spawn`)."""
FAILING = {"crash"}
"""Jobs whose processes end with an error on purpose."""
LAUNCHES_AT_ONCE = 2
JOB_TIMEOUT_S = 240
PRINTED = re.compile(r"CORPUS (\{[^{}]*(?:\{[^{}]*\}[^{}]*)?\})")


@dataclass
class Outcome:
    """One corpus job: its exit status and output, what each rank printed that it logged,
    and the job as `scalemon snapshot --json` and the snapshot table show it."""

    returncode: int
    output: str
    printed: dict[int, dict[str, Any]]
    state: dict[str, Any]
    table: str


def job_env(home: Path, job: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RESTART_COUNT", "SCALEMON_HUB")
           and not k.startswith("SLURM_")}  # the suite run inside a SLURM job
    env.update(OMP_NUM_THREADS="1", SCALEMON_HOME=str(home), SCALEMON_JOB_ID=job,
               SCALEMON_HUB_ARGS="--linger 600", PYTHONWARNINGS="ignore")
    return env


def snapshot(home: Path, job: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalemon", "snapshot", job, *args],
                          env=job_env(home, job), capture_output=True, text=True, timeout=60)


def run_job(home: Path, name: str) -> Outcome:
    script, args, nproc = JOBS[name]
    env = job_env(home, name)
    if name in SPAWNING:
        cmd, envs = [sys.executable, str(CORPUS / script), *args], [env]
    elif name in DIRECT:
        cmd = [sys.executable, str(CORPUS / script), *args]
        port = str(free_port())
        envs = [{**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} if nproc > 1 else env
                for r in range(nproc)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), str(CORPUS / script), *args]
        envs = [env]
    outs = [home / f"{name}.{i}.out" for i in range(len(envs))]
    procs = []
    try:
        for out, proc_env in zip(outs, envs, strict=True):
            with open(out, "w") as log:
                procs.append(subprocess.Popen(cmd, env=proc_env, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        returncode = max(proc.wait(timeout=JOB_TIMEOUT_S) for proc in procs)
    finally:
        for proc in procs:
            kill_tree(proc)
    output = "".join(out.read_text() for out in outs)
    printed = {line["rank"]: line for line in map(json.loads, PRINTED.findall(output))}

    last: dict[str, Any] = {"ranks": []}

    def ended() -> bool:  # every rank's exit arrived: nothing is on the way
        nonlocal last
        done = snapshot(home, name, "--json")
        if done.returncode == 0:
            last = json.loads(done.stdout)
        return len(last["ranks"]) == nproc and all(
            r["state"] in ("exited", "finished", "gone", "silent") for r in last["ranks"])

    with contextlib.suppress(AssertionError):  # the tests say what is missing
        wait_for(ended, timeout=60, interval=0.5)
    table = snapshot(home, name).stdout
    hub_log = home / "run" / name / "hub.log"
    table += "\nhub.log:\n" + (hub_log.read_text()[-2000:] if hub_log.exists() else "none")
    return Outcome(returncode, output, printed, last, table)


def remove_home(home: Path) -> None:
    """Kill the hubs the jobs in `home` started, then remove it."""
    for job_file in jobs_dir(home).glob("*.json"):
        with contextlib.suppress(Exception):
            os.kill(JobFile.read(job_file).pid, signal.SIGKILL)
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def corpus() -> Any:
    """Every corpus job, run `LAUNCHES_AT_ONCE` at a time in one private SCALEMON_HOME; the
    hubs the ranks started are killed at the end."""
    home = Path(tempfile.mkdtemp(prefix="smc", dir="/tmp"))
    try:
        with ThreadPoolExecutor(LAUNCHES_AT_ONCE) as pool:
            futures = {name: pool.submit(run_job, home, name) for name in JOBS}
            outcomes = {name: future.result() for name, future in futures.items()}
        yield home, outcomes
    finally:
        remove_home(home)


def column_text(table: str, rank: int, heading: str) -> str:
    """The cell of `rank`'s row under `heading` in the snapshot table (cells are right-aligned
    under their headings)."""
    lines = table.splitlines()
    head = next(line for line in lines if line.startswith("rank step"))
    end = head.index(heading) + len(heading)
    row = next(line for line in lines if re.match(rf"\s*{rank} ", line))
    return row[:end].rsplit(" ", 1)[-1]


@pytest.mark.integration
@pytest.mark.parametrize("name", list(JOBS))
def test_the_snapshot_has_every_step_and_the_last_loss_the_script_logged(corpus, name):
    home, outcomes = corpus
    got = outcomes[name]
    nproc = JOBS[name][2]
    assert (got.returncode != 0) == (name in FAILING), got.output[-3000:]
    assert sorted(got.printed) == list(range(nproc)), got.output[-3000:]
    ranks = {r["rank"]: r for r in got.state["ranks"]}
    assert sorted(ranks) == list(range(nproc)), got.table
    assert sorted(got.state["info"]["config"]) == [str(r) for r in range(nproc)]  # hellos
    for rank, printed in got.printed.items():
        r = ranks[rank]
        where = f"{name} rank {rank}:\n{got.table}"
        assert r["steps_received"] == printed["steps"], where
        assert r["step"] == printed["step"], where
        assert r["loss"] == pytest.approx(printed["loss"], rel=1e-6), where
        assert r["seq_gaps"] == 0 and r["dropped"] == 0 and r["host"], where
        for key, value in printed["extra"].items():
            assert r["extra"][key] == pytest.approx(value, rel=1e-6), f"{where}: {key}"
        assert r["tokens"] == printed.get("tokens"), where
        if printed.get("optimizer_timed"):  # the optimizer it handed over was timed
            assert r["optimizer_time_s"] > 0, where


@pytest.mark.integration
@pytest.mark.parametrize("name", list(JOBS))
def test_each_rank_ends_in_the_state_it_should_with_its_scaler_and_collectives(corpus, name):
    home, outcomes = corpus
    got = outcomes[name]
    ranks = {r["rank"]: r for r in got.state["ranks"]}
    for rank, printed in got.printed.items():
        r = ranks[rank]
        where = f"{name} rank {rank}:\n{got.table}"
        assert r["state"] == printed["state"], where
        if "error" in printed:  # a crash: the exception's text, exit code 1
            assert r["exit_code"] == 1 and printed["error"] in r["error"], where
            assert r["state_reason"] == "exception", where
        elif r["state"] == "finished":
            assert r["exit_code"] == 0, where
        else:  # the process ended without finish(): nothing known against it
            assert r["exit_code"] is None and r["state_reason"] == "exit", where
        assert bool(r["monitor_off"]) == printed.get("monitor_off", False), where
        assert r["scaler"] == printed.get("scaler"), where
        assert r["loss_scale"] == printed.get("loss_scale"), where
        scale_cell = column_text(got.table, rank, "loss scale")
        assert scale_cell == {"off": "off", "on": f"{printed.get('loss_scale', 0):.0f}"}.get(
            printed.get("scaler"), "n/a"), where
    ops = {row["op"] for row in got.state["collectives"]}
    for printed in got.printed.values():
        assert set(printed["ops"]) <= ops, f"{name}: {sorted(ops)}"
    assert bool(ops) == any(p["ops"] for p in got.printed.values()), name


@pytest.mark.integration
def test_a_step_given_a_closure_shows_the_update_as_optimizer_time_not_the_whole_step(corpus):
    """Lightning's automatic optimization runs forward and backward inside `optimizer.step()`
    (tests/corpus/lightning_style.py: a closure with a FORWARD_S forward): the snapshot's
    optimizer time is the update's, a small part of the step, not the step's time again."""
    home, outcomes = corpus
    got = outcomes["lightning"]
    for r in got.state["ranks"]:
        forward_s = got.printed[r["rank"]]["forward_s"]
        where = f"rank {r['rank']}:\n{got.table}"
        assert r["step_time_s"] >= forward_s, where
        assert 0 < r["optimizer_time_s"] < forward_s / 3, where
        assert float(column_text(got.table, r["rank"], "opt ms")) < forward_s / 3 * 1000, where


SRUN_TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
             "SLURM_NTASKS": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1"}
"""The environment of the one `srun` task that spawns the ranks of its node."""


@pytest.mark.integration
@pytest.mark.parametrize("launcher", ["none", "srun task"])
def test_spawned_ranks_without_a_job_id_are_one_job_of_their_group_not_single_processes(
        launcher):
    """tests/corpus/spawn_style.py as the DDP tutorial runs it (mp.spawn, no RANK/WORLD_SIZE,
    no SCALEMON_JOB_ID), alone or as the one srun task of its node (the imagenet example on
    SLURM: each child inherits SLURM_PROCID=0, SLURM_NTASKS=1): both ranks share one job id
    (the spawning process and the port; SLURM's job), and `scalemon jobs` lists one job of
    world size 2 with both ranks in it (before, each rank was rank 0 of its own job of one,
    with a hub of its own)."""
    home = Path(tempfile.mkdtemp(prefix="smsp", dir="/tmp"))  # short: ipc paths are bounded
    env = job_env(home, "unused")
    del env["SCALEMON_JOB_ID"]
    env.update(SRUN_TASK if launcher == "srun task" else {})
    try:
        done = subprocess.run([sys.executable, str(CORPUS / "spawn_style.py")], env=env,
                              capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
        said = done.stdout[-2000:] + done.stderr[-3000:]
        assert done.returncode == 0, said
        printed = {line["rank"]: line for line in map(json.loads,
                                                      PRINTED.findall(done.stdout))}
        assert sorted(printed) == [0, 1], said
        expected = "slurm-4242.0" if launcher == "srun task" else (
            f"{node_name().split('.')[0]}-{printed[0]['parent_pid']}-{printed[0]['port']}")
        assert {p["job"] for p in printed.values()} == {expected}, said
        listed = json.loads(subprocess.run(
            [sys.executable, "-m", "scalemon", "jobs", "--json"], env=env, capture_output=True,
            text=True, timeout=60).stdout)
        assert [(j["job"], j["world_size"]) for j in listed] == [(printed[0]["job"], 2)]
        snap = snapshot(home, printed[0]["job"], "--json")
        ranks = json.loads(snap.stdout)["ranks"]
        assert [(r["rank"], r["steps_received"], r["state"]) for r in ranks] == [
            (0, 5, "finished"), (1, 5, "finished")]
    finally:
        remove_home(home)


def test_a_monitor_that_switches_itself_off_says_why_to_the_hub_first(corpus):
    """tests/corpus/agent_fault.py breaks rank 1's agent after step 3: the hub hears why
    before the steps stop, the snapshot says `monitor off` with the reason, rank 0 goes on."""
    home, outcomes = corpus
    got = outcomes["agent_fault"]
    r0, r1 = got.state["ranks"]
    assert r0["monitor_off"] is None and r0["steps_received"] == 6
    assert r1["monitor_off"].startswith("log: AttributeError") and r1["step"] == 3
    assert r1["error"] == r1["monitor_off"] and r1["state"] == "finished"
    row = next(line for line in got.table.splitlines() if re.match(r"\s*1 ", line))
    assert row.endswith(f"finished; monitor off: {r1['monitor_off']}")
    assert "monitor off" not in next(line for line in got.table.splitlines()
                                     if re.match(r"\s*0 ", line))
    assert "monitoring disabled on rank 1" in got.output
    job = JobFile.read(jobs_dir(home) / "agent_fault.json")
    messages = [m for m in hub_messages(_Hub(HubAddress.parse(job.address)), exits=2)
                if m.rank == 1]
    kinds = [m.type for m in messages]
    off = kinds.index("monitor_off")
    assert messages[off].body == {"reason": r1["monitor_off"], "step": 4}  # log(4) failed
    # steps logged before may still leave after it (they wait for their values), none after
    assert [m.body["step"] for m in messages if m.type == "step"] == [1, 2, 3]
    assert kinds[0] == "hello" and kinds[-1] == "exit"


@dataclass
class _Hub:
    address: HubAddress


def test_the_dashboard_shows_monitor_off_and_a_disabled_loss_scale(corpus):
    """The real dashboard attached to the corpus jobs' hubs: `mon. off` in the rank table
    with the reason in the rank's detail; `off`, not n/a, as a disabled scaler's loss scale."""
    from scalemon.tui.app import DashboardApp
    from scalemon.tui.feed import HubFeed
    from scalemon.tui.views.rank_detail import rank_detail
    from scalemon.tui.views.rows import COLUMNS, MONITOR_OFF
    from scalemon.tui.widgets.rank_table import RankTable

    home, outcomes = corpus
    col = {c.key: i for i, c in enumerate(COLUMNS)}

    async def table_of(job: str) -> tuple[dict[int, tuple[str, ...]], Any]:
        address = HubAddress.parse(JobFile.read(jobs_dir(home) / f"{job}.json").address)
        app = DashboardApp(HubFeed(address=address))
        async with app.run_test(size=(160, 40)) as pilot:
            for _ in range(200):
                cells = app.screen.query_one(RankTable).cells_by_rank(list(col))
                if len(cells) == 2 and all(row[col["step"]] != "n/a" for row in cells.values()):
                    break
                await pilot.pause(0.1)
            facts = dict(rank_detail(app.data, 1).facts)
            await pilot.press("q")
        return cells, facts

    cells, facts = asyncio.run(table_of("agent_fault"))
    assert cells[1][col["state"]] == MONITOR_OFF and cells[0][col["state"]] == "finished"
    reason = outcomes["agent_fault"].state["ranks"][1]["monitor_off"]
    assert facts["monitor off"] == f"{reason} (no steps since)"
    cells, _ = asyncio.run(table_of("nanogpt"))
    assert [row[col["loss_scale"]] for row in cells.values()] == ["off", "off"]


# --- in process: scalers and values the agent cannot read -----------------------------------


class DeepSpeedLike:
    """A scaler of another framework: the scale in a `loss_scale` property."""

    def __init__(self) -> None:
        self.cur_scale = 4096.0

    @property
    def loss_scale(self) -> float:
        return self.cur_scale


class Exploding:
    """A scaler-like object whose attributes raise when read."""

    @property
    def _scale(self) -> Any:
        raise RuntimeError("no scale for you")


class NoScale:
    """An object passed as a scaler that has no scale at all."""


def test_every_kind_of_scaler_is_read_or_said_off_and_none_raises(caplog):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from scalemon.agent.scaler import ScaleReader
    from scalemon.agent.warn import Warnings

    def reader(scaler: Any) -> ScaleReader:
        return ScaleReader(scaler, Warnings())

    off = reader(torch.amp.GradScaler(enabled=False))
    assert (off.state, off.read(), off.init_scale) == ("off", None, None)
    assert reader(ShardedGradScaler("cpu", enabled=False)).state == "off"
    if not torch.cuda.is_available():  # the old CUDA scaler disables itself without CUDA
        with pytest.warns(Warning):
            old = torch.cuda.amp.GradScaler()
        assert (reader(old).state, reader(old).read()) == ("off", None)
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    on = reader(scaler)
    assert (on.state, on.read(), on.init_scale) == ("on", None, 512.0)  # before scale()
    scaler.scale(torch.ones(()))
    assert float(on.read()) == 512.0
    sharded = reader(ShardedGradScaler("cpu", init_scale=8.0))
    assert sharded.state == "on" and sharded.init_scale == 8.0
    other = reader(DeepSpeedLike())
    assert (other.state, other.read()) == ("on", 4096.0)
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        for broken in (Exploding(), NoScale(), "not a scaler"):
            r = reader(broken)
            assert r.read() is None and r.state is None
    assert caplog.text.count("cannot be read") == 3 and "no scale for you" in caplog.text


def test_values_the_agent_cannot_read_cost_that_value_never_the_monitor(start_hub, caplog):
    """A step it cannot read is counted on, a loss or tokens it cannot read are left out, an
    unreadable scaler leaves the scale n/a; each said once; every step arrives."""
    from scalemon.agent.run import Run
    from scalemon.link.client import HubClient

    hub = start_hub("unreadable")
    with caplog.at_level(logging.WARNING, logger="scalemon.agent"):
        run = Run(torch.nn.Linear(2, 2), job="unreadable", hub=hub.address.base,
                  scaler=Exploding())
        run.log(1, loss=torch.ones(3), tokens="many")  # a loss of 3 elements, a str
        run.log(None, loss="low")  # no step at all: counted on from step 1
        run.log(torch.tensor(3), loss=torch.tensor([0.5]), tokens=torch.tensor(7))
        run.log(4, loss=torch.tensor(0.25))
        run.finish()
    assert not run.disabled
    steps = [m.body for m in hub_messages(hub) if m.type == "step"]
    assert [(b["step"], b["loss"], b["tokens"]) for b in steps] == [
        (1, None, None), (2, None, None), (3, 0.5, 7), (4, 0.25, None)]
    assert all(b["loss_scale"] is None and b["scaler"] is None for b in steps)
    for said in ("log(tokens=...) cannot be read", "log(step=...) cannot be read",
                 "loss given to log() cannot be read", "scaler given to init()"):
        assert caplog.text.count(said) == 1, said
    state = HubClient(hub.address).state()["state"]
    assert state["ranks"][0]["monitor_off"] is None and state["ranks"][0]["steps_received"] == 4


def test_an_optimizer_hook_that_fails_switches_the_monitor_off_loudly_not_the_step(start_hub):
    """The agent's optimizer hook fails inside `optimizer.step()`: the step still runs, the
    monitor switches itself off from inside the hook (its registry untouched while torch
    iterates it) and the hub hears why."""
    from scalemon.agent.run import Run

    hub = start_hub("hookfail")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = Run(model, opt, job="hookfail", hub=hub.address.base)
    for step in range(1, 5):
        if step == 3:
            run._opt_timer.events = "broken"  # an internal error of the agent, forced
        before = model.weight.detach().clone()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
        assert not torch.equal(before, model.weight), "the optimizer step did not run"
        run.log(step, loss=float(step))
    run.finish()
    assert run.disabled
    messages = hub_messages(hub)
    off = [m.body for m in messages if m.type == "monitor_off"]
    assert len(off) == 1 and off[0]["step"] == 2
    assert off[0]["reason"].startswith("optimizer hook (before step): AttributeError")
    assert [m.body["step"] for m in messages if m.type == "step"] == [1, 2]
    assert messages[-1].type == "exit" and messages[-1].body["error"] == off[0]["reason"]


def test_a_disabled_scaler_reads_off_and_a_missing_one_n_a_in_rank_and_node_rows():
    from scalemon import metrics
    from scalemon.text import display

    scale = metrics.BY_NAME["loss_scale"]
    assert display.metric_text(scale, {"loss_scale": None, "scaler": "off"}) == "off"
    assert display.metric_text(scale, {"loss_scale": None, "scaler": None}) == "n/a"
    assert display.metric_text(scale, {"loss_scale": None, "scaler": "on"}) == "n/a"
    assert display.metric_text(scale, {"loss_scale": 1024.0, "scaler": "on"}) == "1024"
    columns = tuple(c for c in display.node_columns() if c.metric is scale)
    off = [{"loss_scale": None, "scaler": "off"}] * 2
    mixed = [{"loss_scale": None, "scaler": "off"}, {"loss_scale": None, "scaler": None}]
    for values, text in ((off, "off"), (mixed, "n/a")):
        cells = display.node_cells(columns, "node0", ["running"] * 2, "running", [1, 1], values)
        assert cells == (text,) * len(columns)


_ENDS_BEFORE_ITS_HUB = """
import scalemon.agent as sm
sm.init()
for step in range(1, 4):
    sm.log(step, loss=float(step))
print("finishing", flush=True)
sm.finish()
"""


@pytest.mark.integration
def test_a_rank_that_ends_before_its_hub_started_still_reaches_it(home, start_hub):
    """A short job on a loaded machine: the rank is done before the hub (that rank 0 starts)
    listens. Its process waits for the hub a little at exit, so its steps are not lost."""
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
           "SCALEMON_JOB_ID": "slowhub", "OMP_NUM_THREADS": "1"}
    rank = subprocess.Popen([sys.executable, "-c", _ENDS_BEFORE_ITS_HUB], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "finishing"
        time.sleep(4.0)  # longer than the socket keeps unsent messages after its close
        hub = start_hub("slowhub")
        assert rank.wait(timeout=60) == 0
    finally:
        rank.kill()
        rank.wait()
    messages = hub_messages(hub)
    assert [m.body["step"] for m in messages if m.type == "step"] == [1, 2, 3]
    assert messages[0].type == "hello" and messages[-1].type == "exit"
