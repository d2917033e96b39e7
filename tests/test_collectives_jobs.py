"""Collectives, stragglers and hangs end to end: real torchrun jobs (gloo ranks on the CPU),
the hub the ranks start, and `scalemon snapshot --json` as users run it."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, free_port, kill_tree, torchrun_cmd, wait_for
from scalemon.collectives import bus_factor
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.link.client import HubClient

pytestmark = pytest.mark.integration


def job_env(home: Path) -> dict[str, str]:
    env = os.environ.copy()
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.update(OMP_NUM_THREADS="1", SCALEMON_HOME=str(home), SCALEMON_JOB_ID=home.name,
               SCALEMON_HUB_ARGS="--linger 60")
    return env


def snapshot(home: Path) -> dict | None:
    """`scalemon snapshot --json` of the job, None while it has no hub yet."""
    out = subprocess.run([sys.executable, "-m", "scalemon.cli", "snapshot", home.name, "--json"],
                         env=job_env(home), capture_output=True, text=True, timeout=30)
    return json.loads(out.stdout) if out.returncode == 0 else None


def hub_client(home: Path) -> HubClient:
    job_file = JobFile.read(jobs_dir(home) / f"{home.name}.json")
    return HubClient(HubAddress.parse(job_file.address))


def fsdp_group(state: dict) -> str:
    """The group FSDP2's reduce-scatters ran on: the default group, or (torch 2.11's CUDA build,
    seen on an H200) a group of all the ranks that the 1-D mesh made for itself. Asserts it
    is one group of every rank."""
    names = {r["group"] for r in state["collectives"] if r["op"] == "reduce_scatter"}
    assert len(names) == 1, f"reduce-scatters in groups {sorted(names)}"
    name = names.pop()
    world = list(range(len(state["ranks"])))
    assert name == "default_pg" or state["groups"][name]["ranks"] == world, state["groups"]
    return name


def rows_by(state: dict) -> dict[tuple[str, str], dict]:
    return {(r["group"], r["op"]): r for r in state["collectives"]}


def test_known_sizes_give_their_counts_bytes_and_bus_bandwidth(home, tmp_path):
    """tests/jobs/known_collectives.py issues fixed collectives in two groups and times its
    own calls: the snapshot has the same counts and bytes, and busbw = S / t * factor with t
    the ranks' own measured mean."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "--",
           str(REPO / "tests" / "jobs" / "known_collectives.py"), str(tmp_path)]
    done = subprocess.run(cmd, env=job_env(home), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    state = wait_for(lambda: (s := snapshot(home)) and all(
        r["state"] == "finished" for r in s["ranks"]) and len(s["ranks"]) == 2 and s,
        timeout=30)
    rows = rows_by(state)
    measured = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    def mean_s(key: str) -> float:
        return statistics.mean(t for m in measured for t in m[key])

    reduce = rows["default_pg", "all_reduce"]
    assert reduce["count"] == 15 and reduce["bytes"] == 10 * 64 * 1024 + 5 * 1024 * 1024
    sizes = {s["size_text"]: s for s in reduce["sizes"]}
    big = sizes["≤ 1 MiB"]
    assert big["count"] == 5 and big["bytes"] == 5 << 20 and big["timed"] == 10
    expected = (1 << 20) / mean_s("default:all_reduce:262144") * bus_factor("all_reduce", 2) / 1e9
    assert big["busbw_gbps"] == pytest.approx(expected, rel=0.25)
    gather = rows["default_pg", "all_gather"]
    assert gather["count"] == 3 and gather["bytes"] == 3 * 2 * 4 * 4096  # the gathered output
    expected = 2 * 4 * 4096 / mean_s("default:all_gather:4096") * 0.5 / 1e9
    assert gather["busbw_gbps"] == pytest.approx(expected, rel=0.25)
    user = rows["user_pg", "all_reduce"]  # the script's own group, under its name
    assert user["count"] == 4 and user["bytes"] == 4 * 4 * 64 * 1024
    assert state["groups"]["user_pg"]["ranks"] == [0, 1]
    assert all(r["recorder_lost"] == 0 and r["recorder_entries"] >= 22 for r in state["ranks"])


def test_zero3_shows_the_fsdp_gathers_and_reduce_scatters(home, tmp_path):
    cmd = torchrun_cmd("--preset", "tiny", "--batch-size", "4", "--max-steps", "6",
                       "--monitor", "--zero", "3")
    done = subprocess.run(cmd, env=job_env(home), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:]
    state = wait_for(lambda: (s := snapshot(home)) and len(s["ranks"]) == 2 and all(
        r["state"] == "finished" for r in s["ranks"]) and s, timeout=30)
    rows = rows_by(state)
    mesh = fsdp_group(state)  # default_pg, or the mesh's own group of every rank
    assert (mesh, "all_gather") in rows and (mesh, "reduce_scatter") in rows, (
        f"collective rows: {sorted(rows)}")
    gathers, scatters = rows[mesh, "all_gather"], rows[mesh, "reduce_scatter"]
    # per step: a gather per block in forward and again in backward (reshard), a
    # reduce-scatter per block in backward
    assert gathers["count"] >= 6 * 2 and scatters["count"] >= 6
    assert gathers["timed"] > 0 and scatters["busbw_gbps"] is not None


@pytest.mark.parametrize("nproc", [2, 4])
def test_an_injected_hang_is_named_with_its_culprit_within_15_s(home, tmp_path, nproc):
    out = tmp_path / "job.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--max-steps", "200",
                         "--monitor", "--inject-hang", "1:5", nproc=nproc),
            env=job_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "rank 1: injected hang before step 5" in out.read_text(), timeout=120)
        hung_at = time.monotonic()
        state = wait_for(lambda: (s := snapshot(home)) and s["hang"] and all(
            "(no stack yet" not in t for t in s["hang"]["stacks"].values()) and s,
            timeout=25, interval=0.5)
        assert time.monotonic() - hung_at <= 15.0, "the hang took too long to be named"
        hang = state["hang"]
        others = [r for r in range(nproc) if r != 1]
        assert hang["culprits"] == [1] and hang["waiting"] == others
        label = "default_pg " + ("[0,1]" if nproc == 2 else "[0-3]")  # runs of 4+: a range
        assert (hang["group"], hang["op"]) == (label, "all_reduce")
        assert hang["seq"] == state["ranks"][1]["groups"]["0"][0] + 1
        assert sorted(hang["stacks"]) == [str(r) for r in range(nproc)]
        assert "time.sleep(3600)" in hang["stacks"]["1"] and "before_step" in hang["stacks"]["1"]
        assert "backward" in hang["stacks"]["0"]  # waiting in DDP's gradient all-reduce
        assert re.match(rf"rank 1 never issued all_reduce #{hang['seq']} of {re.escape(label)} "
                        rf"\(in Python: faults\.py:\d+ in before_step\(\)\); "
                        rf"ranks? {','.join(map(str, others))} wait", hang["text"]), hang["text"]
        assert hang["ranks"]["1"]["phase"] == "injected-hang"  # the script's own phase stays
        assert {hang["ranks"][str(r)]["phase"] for r in others} == {"collective"}
        assert hang["since_s"] >= 10.0
        if nproc == 2:
            check_dashboard(home, hang["text"].split(";")[0])
            check_dump(home, nproc)
    except AssertionError as exc:  # say what the job printed (a failure under load, a port)
        raise AssertionError(f"{exc}\n--- the job's output ends:\n{out.read_text()[-3000:]}"
                             ) from exc
    finally:
        kill_tree(proc)


def check_dashboard(home: Path, culprit_words: str) -> None:
    """A dashboard attached to the live hub switches to the hang view by itself and says the
    same in words, with the culprit's stack."""
    import asyncio

    from test_tui_app import until
    from test_tui_snapshots import screen_text

    from scalemon.tui.app import DashboardApp
    from scalemon.tui.feed import HubFeed
    from scalemon.tui.screens.hang import HangScreen

    job_file = JobFile.read(jobs_dir(home) / f"{home.name}.json")

    async def scenario() -> None:
        app = DashboardApp(HubFeed(address=HubAddress.parse(job_file.address)))
        async with app.run_test(size=(140, 60)) as pilot:
            def shown() -> bool:  # all of it in one drawn screen (it redraws as data comes)
                if not isinstance(app.screen, HangScreen):
                    return False
                text = screen_text(app)
                return all(words in text for words in
                           (culprit_words, "culprit", "time.sleep(3600)"))

            await until(pilot, shown, timeout=20)

    asyncio.run(scenario())


def check_dump(home: Path, nproc: int) -> None:
    """The dashboard's dump key: every rank writes its recorder, the hub analyses the
    directory (scalemon.reports.frtrace) and records the outcome."""
    from scalemon.link.control import Controller

    client = Controller(JobFile.read(jobs_dir(home) / f"{home.name}.json").hub_address())
    try:
        reply = client.command("dump_fr")  # steering: the control socket only
        directory = Path(reply["directory"])
        assert reply["ranks"] == list(range(nproc))
        state = wait_for(lambda: (s := snapshot(home)) and s["fr_dumps"] and s["fr_dumps"][-1][
            "state"] == "analysed" and s, timeout=60, interval=0.5)
    finally:
        client.close()
    dump = state["fr_dumps"][-1]
    assert dump["directory"] == str(directory) and dump["written"] == list(range(nproc))
    assert sorted(p.name for p in directory.iterdir()) == sorted([  # each dump, its summary
        "analysis.json", "context.json", *(f"rank_{r}" for r in range(nproc)),
        *(f"rank_{r}.summary" for r in range(nproc))])
    assert "rank 1 never issued all_reduce" in dump["analysis"] and dump["missing"] == []
    assert dump["report"]["culprit"]["culprits"] == [1]


def test_a_slowed_rank_arrives_last_and_is_named_the_straggler(home, tmp_path):
    out = tmp_path / "job.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--max-steps", "400",
                         "--monitor", "--slow-rank", "1:0.04"),
            env=job_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def late() -> dict | None:
            s = snapshot(home)
            if not s or len(s["ranks"]) < 2 or s["ranks"][1]["arrival_lateness_s"] is None:
                return None
            return s if s["ranks"][1]["steps_received"] >= 30 else None

        state = wait_for(late, timeout=120, interval=1.0)
        lateness = {r["rank"]: r["arrival_lateness_s"] for r in state["ranks"]}
        assert max(lateness, key=lateness.get) == 1, lateness
        assert lateness[1] >= 0.02 and lateness[0] < 0.01, lateness
        check_header_straggler(home, state)
    finally:
        kill_tree(proc)


def check_header_straggler(home: Path, state: dict) -> None:
    """The dashboard, folding the same history, names rank 1 first in its straggler line."""
    from scalemon.home.history import history_path, read_messages
    from scalemon.tui.model import DashboardData
    from scalemon.tui.views import overview as views

    data = DashboardData()
    data.apply_batch(read_messages(history_path(home.name, home))[0])
    summary = views.overview(data, time.time(), plots=False).summary
    assert summary.stragglers and summary.stragglers[0][0] == 1, summary.stragglers
    assert "arrival" in summary.straggler_basis
