"""A job's lifecycle told truthfully, with real processes: quit from the demo is "stopped by
user" (live and replayed from the history after the hub has gone); a finished job is finished
at once while its hub lingers, and is not live; crashed, lost and hung jobs keep their own
states. And NaN losses are alerts the moment they arrive."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from test_cli_demo import demo_args

from conftest import REPO, FakeRank, free_port, job_processes, kill_tree, torchrun_cmd, wait_for
from scalemon.cli import demo as demo
from scalemon.home.jobfile import JobFile
from scalemon.home.lookup import resolve_hub
from scalemon.home.paths import jobs_dir

pytestmark = pytest.mark.integration


def scalemon(home: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`scalemon ARGS` as users run it, in `home`."""
    env = {**os.environ, "SCALEMON_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "scalemon.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def strict_json(text: str) -> dict:
    """Parse `text`, refusing the non-standard NaN/Infinity literals."""
    def refuse(name: str) -> None:
        raise AssertionError(f"invalid JSON literal {name}")
    return json.loads(text, parse_constant=refuse)


def snapshot(home: Path, job: str | None = None) -> dict | None:
    """`scalemon snapshot [JOB] --json`, None while it fails."""
    done = scalemon(home, "snapshot", *([job] if job else []), "--json")
    return strict_json(done.stdout) if done.returncode == 0 else None


def job_env(home: Path, job: str, hub_args: str = "--linger 60") -> dict[str, str]:
    env = os.environ.copy()
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.update(OMP_NUM_THREADS="1", SCALEMON_HOME=str(home), SCALEMON_JOB_ID=job,
               SCALEMON_HUB_ARGS=hub_args)
    return env


def test_a_demo_job_quit_from_the_dashboard_is_stopped_by_user_also_when_replayed(home: Path):
    job = "quitjob"
    proc, log = demo.start_job(demo_args(step_delay=0.05), job)
    try:
        wait_for(lambda: "step 3 loss" in log.read_text(), timeout=180, interval=0.5)
        live = wait_for(lambda: (s := snapshot(home, job)) and len(s["ranks"]) == 2 and s,
                        timeout=30, interval=0.5)
        assert live["state"] == "running" and live["stop"] is None
        demo.stop_job(proc, job, log_path=log)  # what the dashboard's q leads to
        wait_for(lambda: not job_processes(job), timeout=30, interval=0.5)  # ranks and hub
        job_file = JobFile.read(jobs_dir(home) / f"{job}.json")
        assert job_file.state == "stopped" and job_file.hub_stopped is not None
        assert not job_file.is_alive() and not job_file.serving()
        done = scalemon(home, "snapshot", job, "--json")  # replayed: the hub has gone
        assert done.returncode == 0, done.stderr
        assert "the job was stopped by its user or a stop signal (its hub exited at" in done.stderr
        assert "replaying" in done.stderr
        state = strict_json(done.stdout)
        assert state["state"] == "stopped" and state["first_failure"] is None
        assert state["stop"]["reason"] == demo.QUIT_REASON
        for rank in state["ranks"]:
            assert rank["state"] == "stopped", rank
            assert rank["state_reason"].startswith(
                f"stopped by the user ({demo.QUIT_REASON}, "), rank["state_reason"]
            # its agent said how it ended (torchrun's SIGTERM): no "(killed?)" guess
            assert rank["state_reason"].endswith("); ended by SIGTERM, exit 143"), rank
            assert rank["exit_code"] == 143
        text = scalemon(home, "snapshot", job).stdout
        assert "state stopped" in text.splitlines()[0]
        assert text.splitlines()[1].startswith("stopped by ") and "failed" not in text
    finally:
        for p in job_processes(job):
            p.kill()


def test_a_finished_job_is_finished_at_once_while_its_hub_lingers_and_never_live(
        home: Path, start_hub, zctx):
    done_job = "donejob"
    run = subprocess.run(torchrun_cmd("--preset", "tiny", "--batch-size", "2",
                                      "--max-steps", "3", "--monitor"),
                         env=job_env(home, done_job, "--linger 120"), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    path = jobs_dir(home) / f"{done_job}.json"
    finished = wait_for(lambda: (j := JobFile.read(path)).state == "finished" and j,
                        timeout=30, interval=0.2)
    assert finished.serving() and not finished.is_alive()  # its hub lingers: ended, not live
    assert finished.ended is not None and finished.hub_stopped is None
    served = scalemon(home, "snapshot", done_job, "--json")  # by the lingering hub
    assert served.returncode == 0 and "replaying" not in served.stderr, served.stderr
    assert strict_json(served.stdout)["state"] == "finished"
    assert resolve_hub(None)[0] == done_job  # no live job: the one ended job still served

    hub = start_hub("livejob", "--lost-after", "600", "--hang-after", "600")  # a live job next
    # to it (its fake rank stays silent after one step: it must turn neither lost nor hung
    # while the test looks; the CLI calls below took over the default 10 s on a loaded machine)
    rank = FakeRank(zctx, hub.address, "livejob", 0)
    rank.hello(world_size=1)
    rank.step(1)
    wait_for(lambda: (s := snapshot(home, "livejob")) and s["ranks"], timeout=30)
    listed = scalemon(home, "jobs").stdout.splitlines()
    (done_line,) = [line for line in listed if line.startswith(done_job)]
    (live_line,) = [line for line in listed if line.startswith("livejob")]
    assert done_line.split()[1] == "finished" and "hub lingers" in done_line
    assert live_line.split()[1] == "running" and "hub lingers" not in live_line
    as_json = {j["job"]: j for j in json.loads(scalemon(home, "jobs", "--json").stdout)}
    assert as_json[done_job]["live"] is False and as_json["livejob"]["live"] is True
    assert resolve_hub(None)[0] == "livejob"  # not "several live jobs"
    picked = snapshot(home)  # `scalemon snapshot` without a job
    assert picked is not None and picked["job"] == "livejob" and picked["state"] == "running"

    from scalemon.tui.app import DashboardApp
    from scalemon.tui.attach import make_app

    app = make_app(None, home)  # `scalemon attach` without a job
    assert isinstance(app, DashboardApp) and app.feed is not None
    assert app.feed.job == "livejob"  # type: ignore[attr-defined]


def rank_process(job: str, local_rank: int) -> psutil.Process | None:
    found = [p for p in job_processes(job)
             if p.environ().get("LOCAL_RANK") == str(local_rank)]
    return found[0] if found else None


@pytest.mark.parametrize("case", ["crashed", "lost", "hung"])
def test_crashed_lost_and_hung_jobs_keep_their_own_states(home: Path, tmp_path: Path, case):
    job = f"{case}job"
    flags = {"crashed": ("--inject-crash", "1:5"), "hung": ("--inject-hang", "1:5"),
             "lost": ()}[case]
    out = tmp_path / "job.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--max-steps", "300",
                         "--step-delay", "0.05", "--monitor", *flags),
            env=job_env(home, job, "--linger 60 --hang-after 3"), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (s := snapshot(home, job)) and len(s["ranks"]) == 2
                 and min(r["step"] or 0 for r in s["ranks"]) >= 2, timeout=180, interval=0.5)
        if case == "lost":
            victim = rank_process(job, 1)
            assert victim is not None
            victim.kill()
        state = wait_for(lambda: (s := snapshot(home, job)) and s["state"] == case and s,
                         timeout=60, interval=0.5)
        if case == "crashed":
            assert state["ranks"][1]["state"] == "exited"
            assert state["first_failure"]["rank"] == 1
            assert "InjectedCrash" in state["first_failure"]["error"]
        elif case == "lost":
            assert state["ranks"][1]["state"] == "gone"  # killed: its process ended
            assert state["first_failure"]["state"] == "gone"
        else:
            assert state["hang"] is not None and state["hang"]["culprits"] == [1]
            assert [r["state"] for r in state["ranks"]] == ["running", "running"]
        assert state["stop"] is None and "stopped" not in json.dumps(state["ranks"])
        text = scalemon(home, "snapshot", job).stdout.splitlines()[0]
        assert f"state {'HUNG' if case == 'hung' else case}" in text
        if case != "hung":  # ended: `jobs` lists it as such at once, not as live
            line = wait_for(lambda: [ln for ln in scalemon(home, "jobs").stdout.splitlines()
                                     if ln.startswith(job)], timeout=10, interval=0.3)
            assert line[0].split()[1] == case
    finally:
        kill_tree(proc)


def test_a_nan_loss_shows_in_alerts_right_after_the_step_that_logs_it(home: Path,
                                                                      tmp_path: Path):
    job, nan_step, release = "nanjob", 5, tmp_path / "release"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "--", str(REPO / "tests" / "jobs" / "nan_loss.py"),
           str(nan_step), str(release)]
    out = tmp_path / "job.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(cmd, env=job_env(home, job), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # the job pauses right after step k: what the snapshot shows now, step k brought
        state = wait_for(lambda: (s := snapshot(home, job)) and len(s["ranks"]) == 2
                         and all(r["step"] == nan_step for r in s["ranks"]) and s,
                         timeout=180, interval=0.3)
        (alert,) = state["alerts"]
        assert alert["kind"] == "loss_not_finite" and alert["ranks"] == [1]
        assert alert["since_step"] == nan_step and alert["value"] is None  # NaN: null
        assert alert["text"] == f"loss is NaN on rank 1 since step {nan_step}"
        rank1 = state["ranks"][1]
        assert rank1["loss"] is None and rank1["alerts"][0]["since_step"] == nan_step
        assert state["ranks"][0]["alerts"] == []
        text = scalemon(home, "snapshot", job).stdout
        assert f"ALERT: loss is NaN on rank 1 since step {nan_step}" in text
        release.touch()
        assert proc.wait(timeout=60) == 0, out.read_text()[-2000:]
    finally:
        kill_tree(proc)


def test_the_dashboard_turns_a_rank_with_a_nan_loss_red_with_its_step(start_hub, zctx):
    from test_tui_app import COL, cells, header, until

    from scalemon.tui.app import DashboardApp
    from scalemon.tui.feed import HubFeed
    from scalemon.tui.widgets.rank_table import RankTable

    hub = start_hub("nandash")
    ranks = [FakeRank(zctx, hub.address, "nandash", r) for r in range(2)]

    async def scenario() -> None:
        app = DashboardApp(HubFeed(address=hub.address))
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause(0.5)
            for r in ranks:
                r.hello()
            for step in range(1, 7):
                for r in ranks:
                    r.step(step, loss=float("nan") if r.rank == 1 and step >= 4 else 2.0)
            await until(pilot, lambda: (c := cells(app)) and len(c) == 2
                        and all(row[COL["step"]] == "6" for row in c.values()))
            table = app.screen.query_one(RankTable)
            assert cells(app)[1][COL["state"]] == "NaN loss@4"
            assert table.rows[1].style == "alert" and table.rows[0].style == ""
            assert "ALERT: loss is NaN on rank 1 since step 4" in header(app)
            for r in ranks:
                r.step(7, loss=1.0)
            await until(pilot, lambda: cells(app)[1][COL["state"]] == "running")
            assert "ALERT" not in header(app)

    asyncio.run(scenario())


def test_the_dashboard_says_stopped_by_user_and_colours_the_stopped_ranks():
    from scalemon.protocol import HUB_RANK, Message
    from scalemon.tui.model import DashboardData
    from scalemon.tui.sim import SimJob
    from scalemon.tui.views.overview import overview
    from scalemon.tui.widgets.header import STATE_STYLES

    sim = SimJob(ranks=2, gpu=False, amp=False)
    data = DashboardData()
    data.apply_messages(sim.run(5))
    t = sim.end_t(5)
    data.apply_messages([
        Message("job_stop", sim.job, HUB_RANK, 1, t, {"reason": demo.QUIT_REASON,
                                                     "user": "ann", "host": "n1"}),
        *(Message("rank_state", sim.job, HUB_RANK, 2 + r, t + 1, {
            "target": r, "state": "lost", "reason": "process gone"}) for r in (0, 1))])
    view = overview(data, now=t + 2, plots=False)
    assert view.summary.state == "stopped" and STATE_STYLES["stopped"] == "bold cyan"
    assert view.summary.state_text == "stopped by the user (scalemon demo: q, ann@n1)"
    assert view.summary.failure == "" and view.summary.alert == ""
    assert [row.style for row in view.rows] == ["stopped", "stopped"]
