"""How a job ends, told truly, with real processes: Ctrl-C quits the dashboard as q does;
SIGTERM or SIGHUP (its terminal gone) to `scalemon demo` stops its torchrun, ranks and hub, and
the job reads `stopped`; a rank ended by SIGTERM reads so (exit 143), not gone or "killed?"; a
job killed while hung keeps its hang and its culprit, which is its first failure."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from test_lifecycle import job_env, scalemon, snapshot, strict_json
from test_tui_app import until
from test_tui_demo import Tmux, ranks_on

from conftest import SCALEMON, job_processes, kill_tree, torchrun_cmd, wait_for
from scalemon.tui.app import DashboardApp

HANG_AFTER_S = 3.0


def test_ctrl_c_quits_the_dashboard_as_q_does():
    async def scenario() -> None:
        app = DashboardApp()
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("ctrl+c")
            await until(pilot, lambda: not app.is_running, timeout=10)

    asyncio.run(scenario())


def demo_process(job: str) -> psutil.Process | None:
    """The `scalemon demo --job JOB` process (its environment does not name the job)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "demo" in cmdline and job in cmdline:
            return proc
    return None


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGHUP"])
def test_a_signal_to_scalemon_demo_stops_its_job_and_the_job_reads_stopped(home: Path, how):
    job = f"sig{how.lower()}{os.getpid()}"
    cmd = (f"env SCALEMON_HOME={home} OMP_NUM_THREADS=1 {SCALEMON} demo --job {job} "
           f"--step-delay 0.05; echo DEMO-EXIT=$? > {home}/exit; sleep 60")
    tmux = Tmux(f"smsig-{how}-{os.getpid()}")
    try:
        tmux.run("new-session", "-d", "-s", tmux.session, "-x", "120", "-y", "40", cmd)
        wait_for(lambda: (r := ranks_on(tmux.screen())) and len(r) == 2
                 and min(s for s, _ in r.values()) >= 3, timeout=180, interval=0.5)
        demo = demo_process(job)
        assert demo is not None and len(job_processes(job)) >= 4  # torchrun, 2 ranks, hub
        if how == "SIGTERM":
            demo.send_signal(signal.SIGTERM)  # `timeout 5 scalemon demo`, `kill`
        else:
            tmux.kill()  # the terminal goes away: SIGHUP
        try:
            wait_for(lambda: not job_processes(job), timeout=45, interval=0.5)  # no orphan
        except AssertionError:
            left = [(p.pid, p.status(), " ".join(p.cmdline())[:120]) for p in job_processes(job)]
            log = home / "demo" / f"{job}.log"
            raise AssertionError(f"left running: {left}; the demo's log ends: "
                                 f"{log.read_text()[-1500:] if log.exists() else None}") from None
        if how == "SIGTERM":
            assert wait_for(lambda: (home / "exit").exists() and (home / "exit").read_text(),
                            timeout=30) == "DEMO-EXIT=143\n"
        log = (home / "demo" / f"{job}.log").read_text()
        assert f"scalemon demo: stopped job {job} on {how} (SIGTERM); torchrun ended: " in log
        done = scalemon(home, "snapshot", job, "--json")  # replayed: the hub has gone
        state = strict_json(done.stdout)
        assert state["state"] == "stopped" and state["first_failure"] is None, done.stdout
        assert state["stop"]["reason"] == f"scalemon demo: {how}"
        for rank in state["ranks"]:
            assert rank["state"] == "stopped" and rank["exit_code"] == 143, rank
            assert rank["state_reason"].startswith(f"stopped by the user (scalemon demo: {how}, ")
            assert rank["state_reason"].endswith("); ended by SIGTERM, exit 143"), rank
    finally:
        tmux.kill()
        for proc in job_processes(job):
            proc.kill()


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_ctrl_c_while_the_demo_stops_its_job_says_the_time_left_and_leaves_no_orphan(
        home: Path):
    job = f"ctrlcstop{os.getpid()}"
    cmd = (f"env SCALEMON_HOME={home} OMP_NUM_THREADS=1 {SCALEMON} demo --job {job} "
           f"--step-delay 0.05; echo DEMO-EXIT=$? > {home}/exit; sleep 60")
    tmux = Tmux(f"smctrlc-{os.getpid()}")
    stuck: list[psutil.Process] = []
    try:
        tmux.run("new-session", "-d", "-s", tmux.session, "-x", "120", "-y", "40", cmd)
        wait_for(lambda: (r := ranks_on(tmux.screen())) and len(r) == 2
                 and min(s for s, _ in r.values()) >= 3, timeout=180, interval=0.5)
        stuck = [p for p in job_processes(job) if p.environ().get("LOCAL_RANK") == "1"
                 and any(a.endswith("train.py") for a in p.cmdline())]
        assert len(stuck) == 1
        stuck[0].suspend()  # a rank that ignores torchrun's SIGTERM: the stop takes ~15 s
        tmux.run("send-keys", "-t", tmux.session, "q")
        wait_for(lambda: f"scalemon demo: stopping job {job}: torchrun, its 2 ranks and its "
                         "hub (up to 38 s)..." in tmux.joined(), timeout=30, interval=0.2)
        tmux.run("send-keys", "-t", tmux.session, "C-c")  # the impatient user
        wait_for(lambda: re.search(rf"scalemon demo: still stopping job {job}, up to \d+ s "
                                   r"left", tmux.joined()), timeout=10, interval=0.2)
        assert job_processes(job)  # the stop goes on
        wait_for(lambda: not job_processes(job), timeout=60, interval=0.5)  # no orphan
        assert wait_for(lambda: (home / "exit").exists() and (home / "exit").read_text(),
                        timeout=30) == "DEMO-EXIT=0\n"
        assert f"scalemon demo: stopped job {job} (log: " in tmux.joined()
        log = (home / "demo" / f"{job}.log").read_text()
        assert f"scalemon demo: stopped job {job} on quit (SIGTERM, then SIGKILL); " in log
    finally:
        tmux.kill()
        for proc in stuck + job_processes(job):
            with contextlib.suppress(psutil.Error):
                proc.kill()


@pytest.mark.integration
def test_a_job_killed_with_sigterm_while_hung_reads_ended_by_sigterm_and_keeps_its_hang(
        home: Path, tmp_path: Path):
    job = "termhung"
    out = tmp_path / "job.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--max-steps", "300",
                         "--step-delay", "0.05", "--monitor", "--inject-hang", "1:5"),
            env=job_env(home, job, f"--linger 60 --hang-after {HANG_AFTER_S:g}"), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        hung = wait_for(lambda: (s := snapshot(home, job)) and s["hang"] and s, timeout=240,
                        interval=0.5)
        assert hung["hang"]["culprits"] == [1]
        os.kill(proc.pid, signal.SIGTERM)  # `kill -TERM` of torchrun: it stops its ranks
        proc.wait(timeout=60)
        state = wait_for(lambda: (s := snapshot(home, job)) and all(
            r["state"] != "running" for r in s["ranks"]) and s, timeout=30, interval=0.5)
        for rank in state["ranks"]:  # each said how it ended: no "gone", no "killed?"
            assert (rank["state"], rank["state_reason"], rank["exit_code"]) == (
                "exited", "ended by SIGTERM, exit 143", 143), rank
        assert state["state"] == "stopped", state["state"]  # stopped, not crashed: hang kept
        assert state["end"] == "ended by SIGTERM (ranks 0,1, exit 143)"
        assert state["hang"] is None  # no hang now: the job ended; the one it ended in stays
        last = state["last_hang"]
        assert last["culprits"] == [1] and last["step"] == 4, last
        assert last["summary"].startswith("hung after step 4 ")
        assert "(culprit rank 1)" in last["summary"]
        assert last["summary"].endswith(", then ended by SIGTERM (ranks 0,1, exit 143)")
        failure = state["first_failure"]  # the hang, not the first rank killed
        assert failure["rank"] == 1 and failure["state"] == "hung", failure
        text = scalemon(home, "snapshot", job).stdout
        assert f"HUNG until the end: {last['summary']}" in text and "killed?" not in text
        summary = scalemon(home, "summary", job)
        assert summary.returncode == 0, summary.stderr
        assert f"HUNG until the end: {last['summary']}" in summary.stdout
        assert f"first failure: the job {last['summary']}" in summary.stdout
        assert "stalls: 1 " in summary.stdout
    finally:
        kill_tree(proc)
        for p in job_processes(job):
            p.kill()


@pytest.mark.integration
def test_a_torchrun_killed_with_sigterm_reads_stopped_not_crashed(home: Path, tmp_path: Path):
    job = "termplain"
    with open(tmp_path / "job.out", "w") as log:
        proc = subprocess.Popen(
            torchrun_cmd("--preset", "tiny", "--batch-size", "2", "--max-steps", "300",
                         "--step-delay", "0.05", "--monitor"),
            env=job_env(home, job, "--linger 60"), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        wait_for(lambda: (s := snapshot(home, job)) and len(s["ranks"]) == 2 and all(
            (r["step"] or 0) >= 3 for r in s["ranks"]), timeout=240, interval=0.5)
        os.kill(proc.pid, signal.SIGTERM)  # `kill -TERM` of torchrun: it stops its ranks
        proc.wait(timeout=60)
        state = wait_for(lambda: (s := snapshot(home, job)) and all(
            r["state"] != "running" for r in s["ranks"]) and s, timeout=30, interval=0.5)
        assert [(r["state"], r["state_reason"]) for r in state["ranks"]] == [
            ("exited", "ended by SIGTERM, exit 143")] * 2
        assert state["state"] == "stopped" and state["first_failure"] is None, state["state"]
        text = scalemon(home, "snapshot", job).stdout
        assert "stopped: ended by SIGTERM (ranks 0,1, exit 143)" in text.splitlines(), text
        assert "failed first" not in text and "crashed" not in text
    finally:
        kill_tree(proc)
        for p in job_processes(job):
            p.kill()


def test_a_signal_stops_the_job_itself_where_the_dashboard_cannot_exit(monkeypatch):
    """Its terminal gone (SIGHUP), Textual's output thread dies on the write error and the app
    then blocks on its full queue: it never exits, and the demo never reached its stop (a
    fresh-clone CI run left the job running). The signal's thread stops the job itself."""
    import threading
    import time

    from scalemon.cli import demo as demo_cli

    class StuckApp:
        is_running = True

        def call_from_thread(self, _fn):
            threading.Event().wait()  # the app's loop never runs it

        exit = None

    stopped, ended = threading.Event(), []
    monkeypatch.setattr(demo_cli.SignalStop, "APP_EXIT_S", 0.5)
    monkeypatch.setattr(demo_cli.os, "_exit", lambda code: ended.append(code))
    stopper = demo_cli.SignalStop()
    with stopper:
        stopper.app = StuckApp()
        stopper.fallback = stopped.set
        os.kill(os.getpid(), signal.SIGHUP)
        assert stopped.wait(10), "the job was not stopped"
        end = time.monotonic() + 5
        while not ended and time.monotonic() < end:
            time.sleep(0.05)
    assert ended == [128 + signal.SIGHUP]
    assert stopper.reason == "scalemon demo: SIGHUP"
