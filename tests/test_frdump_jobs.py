"""`scalemon dump` and the dashboard's `d` on real hung jobs: torchrun with gloo ranks on the
CPU (tests/jobs/fr_hang.py), the agent in each rank, the hub rank 0 starts, and the command as
users run it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_collectives_jobs import job_env, snapshot

from conftest import REPO, free_port, kill_tree, wait_for
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir


def start_job(home: Path, out: Path, nproc: int, mode: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "--",
           str(REPO / "tests" / "jobs" / "fr_hang.py"), str(out), mode]
    log = open(out / "job.out", "w")  # noqa: SIM115 - the job's output, closed with the test
    return subprocess.Popen(cmd, env=job_env(home), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def issued(out: Path, rank: int) -> dict[str, int]:
    """What the rank says it issued (the call it blocks in included)."""
    return json.loads((out / f"rank{rank}.json").read_text())


def wait_hung(home: Path, out: Path, nproc: int, culprit: int,
              waiting_in: dict[int, str]) -> dict[str, Any]:
    """Until the culprit sleeps, the others called what they block in, and the hub knows
    every rank; returns the hub's state."""
    def hung() -> bool:
        if not (out / f"rank{culprit}.sleeping").exists():
            return False
        return all((out / f"rank{r}.json").exists() for r in waiting_in)

    wait_for(hung, timeout=120, interval=0.5)
    return wait_for(lambda: (s := snapshot(home)) and len(s["ranks"]) == nproc and all(
        r["state"] == "running" for r in s["ranks"]) and s, timeout=60, interval=0.5)


def dump(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scalemon.cli", "dump", home.name, *args],
                          env=job_env(home), capture_output=True, text=True, timeout=timeout)


def status(report: dict[str, Any], label: str, rank: int) -> tuple[int, int]:
    group = next(g for g in report["groups"] if g["label"].split(" [")[0] == label)
    row = group["status"][str(rank)]
    return row["last_issued"], row["last_completed"]


@pytest.mark.integration
def test_dump_of_a_hung_2_rank_gloo_job_names_the_rank_that_never_issued(home, tmp_path):
    """Rank 1 sleeps in Python before step 4's all_reduce, rank 0 waits in it. Then the
    dashboard's `d` shows the same analysis; then rank 1 is stopped (SIGSTOP), gives no dump,
    and is still the culprit, named with the reason."""
    proc = start_job(home, tmp_path, 2, "pair")
    try:
        state = wait_hung(home, tmp_path, 2, culprit=1, waiting_in={0: "default"})
        done = dump(home, "--json")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        report = json.loads(done.stdout)
        assert report["read"] == [0, 1] and report["missing"] == {}
        assert report["culprit"]["culprits"] == [1] and report["culprit"]["waiting"] == [0]
        zero, one = issued(tmp_path, 0)["default"], issued(tmp_path, 1)["default"]
        assert zero == one + 1
        assert status(report, "default_pg", 0) == (zero, zero - 1)  # waits in #zero
        assert status(report, "default_pg", 1) == (one, one)
        assert report["culprit"]["seq"] == zero and report["culprit"]["op"] == "all_reduce"
        assert report["text"] == (f"rank 1 never issued all_reduce #{zero} of "
                                  f"default_pg [0,1]; rank 0 waits in all_reduce #{zero} of "
                                  "default_pg [0,1] for rank 1")
        assert Path(report["directory"], "rank_0").exists()
        for rank in (0, 1):  # each agent summed its own dump up beside it
            assert Path(report["directory"], f"rank_{rank}.summary").exists()

        text = dump(home)
        assert text.returncode == 0 and (f"culprit: rank 1 never issued all_reduce #{zero}"
                                         in text.stdout)

        check_dashboard_dump(home, f"rank 1 never issued all_reduce #{zero} of "
                                   "default_pg [0,1]")

        pid = next(r["pid"] for r in state["ranks"] if r["rank"] == 1)
        os.kill(pid, signal.SIGSTOP)  # alive, but neither it nor its agent answers: frozen
        try:
            wait_for(lambda: (s := snapshot(home)) and s["ranks"][1]["state"] == "frozen",
                     timeout=60, interval=0.5)
            done = dump(home, "--json")
        finally:
            os.kill(pid, signal.SIGCONT)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout)
        assert report["read"] == [0] and list(report["missing"]) == ["1"]
        assert report["missing"]["1"].startswith("frozen (")
        assert "its process exists but sends nothing" in report["missing"]["1"]
        assert done.stderr.strip().splitlines() == [
            f"scalemon dump: rank 1 gave no dump: {report['missing']['1']}"]
        assert report["culprit"]["culprits"] == [1] and report["culprit"]["waiting"] == [0]
        assert status(report, "default_pg", 0) == (zero, zero - 1)
    finally:
        kill_tree(proc)


def check_dashboard_dump(home: Path, finding: str) -> None:
    """The real app on the live hub: h opens the hang view, d asks for a dump, and the view
    shows the analysis (the finding, the group's table), no traceback."""
    from test_tui_app import until
    from test_tui_snapshots import screen_text

    from scalemon.home.address import HubAddress
    from scalemon.tui.app import DashboardApp
    from scalemon.tui.feed import HubFeed
    from scalemon.tui.screens.hang import HangScreen

    job_file = JobFile.read(jobs_dir(home) / f"{home.name}.json")

    async def scenario() -> None:
        app = DashboardApp(HubFeed(address=HubAddress.parse(job_file.address)))
        async with app.run_test(size=(150, 70)) as pilot:
            await pilot.pause(1.0)
            if not isinstance(app.screen, HangScreen):
                await pilot.press("h")
            await until(pilot, lambda: isinstance(app.screen, HangScreen), timeout=30)
            await pilot.press("d")
            await until(pilot, lambda: "dump requested: 2 ranks -> " in screen_text(app),
                        timeout=30)
            directory = app.dump_status.split(" -> ")[1]

            def analysed() -> bool:
                text = screen_text(app)
                return f"{directory} (analysed)" in text and f"culprit: {finding}" in text

            await until(pilot, analysed, timeout=60)
            text = screen_text(app)
            assert "default_pg [0,1] (group name 0, 2 ranks)" in text
            assert "last issued" in text and "last completed" in text
            assert "Traceback" not in text and "tabulate" not in text

    asyncio.run(scenario())


@pytest.mark.integration
def test_dump_of_a_3_rank_job_with_a_subgroup(home, tmp_path):
    """Rank 2 sleeps before the "pair" group's all_reduce (ranks 1 and 2): rank 1 waits in
    it, rank 0 in the default group's next all_reduce, which ranks 1 and 2 never reach."""
    proc = start_job(home, tmp_path, 3, "subgroup")
    try:
        wait_hung(home, tmp_path, 3, culprit=2, waiting_in={0: "default", 1: "pair"})
        done = dump(home, "--json")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        report = json.loads(done.stdout)
        assert report["read"] == [0, 1, 2] and report["missing"] == {}
        groups = {g["label"].split(" [")[0]: g for g in report["groups"]}
        assert sorted(groups) == ["default_pg", "pair"]
        assert groups["pair"]["ranks"] == [1, 2] and groups["default_pg"]["ranks"] == [0, 1, 2]
        pair = groups["pair"]["finding"]
        one, two = issued(tmp_path, 1), issued(tmp_path, 2)
        assert (pair["culprits"], pair["waiting"], pair["seq"]) == ([2], [1], one["pair"])
        assert status(report, "pair", 1) == (one["pair"], one["pair"] - 1)
        assert status(report, "pair", 2) == (two["pair"], two["pair"])
        zero = issued(tmp_path, 0)["default"]
        assert status(report, "default_pg", 0) == (zero, zero - 1)
        assert status(report, "default_pg", 1) == (one["default"], one["default"])
        assert zero == one["default"] + 1 == two["default"] + 1
        default = groups["default_pg"]["finding"]
        assert default["culprits"] and set(default["culprits"]) <= {1, 2}  # stopped early
        assert default["waiting"] == [0]
        # across groups: rank 0 waits for 1 in default_pg, 1 waits for 2 in pair; 2 is the end
        assert report["culprit"]["culprits"] == [2]
        assert report["culprit"]["causes"] == {"2": {"cause": "python"}}
        assert report["culprit"]["chains"] == [[0, 1, 2]]
        # the headline says who waits in what for whom, as the live hang view does
        text = report["text"]
        assert text.startswith("rank 2 never issued "), text
        assert (f"rank 0 waits in all_reduce #{zero} of default_pg [0,1,2] for ranks 1,2"
                in text), text
        assert f"#{one['pair']} of pair [1,2] for rank 2" in text, text
        # in the default group rank 1 is behind only because it waits in pair: not a culprit
        assert groups["default_pg"]["behind"] == {"1": next(
            f"waits in {w['op']} #{w['seq']} of pair [1,2]"
            for w in report["culprit"]["waits"] if w["ranks"] == [1])}
    finally:
        kill_tree(proc)


def test_dump_without_a_hub_says_so_in_one_line(home):
    done = subprocess.run([sys.executable, "-m", "scalemon.cli", "dump", "nojob"],
                          env=job_env(home), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == "scalemon dump: no live hub for job 'nojob' (live jobs: none)\n"
    done = subprocess.run([sys.executable, "-m", "scalemon.cli", "dump", "tcp://127.0.0.1:5555"],
                          env=job_env(home), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1  # steered over tcp
    assert "no server key for tcp://127.0.0.1:5557" in done.stderr, done.stderr  # with a key
    assert "SCALEMON_HUB_KEY" in done.stderr
