"""`scalemon demo`'s job: stopped cleanly on quit, and a job that dies shows the end of its log
on the dashboard (as text, never as markup)."""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from test_tui_app import until
from test_tui_snapshots import screen_text

from conftest import job_processes, wait_for
from scalemon.cli import demo as demo
from scalemon.tui.app import DashboardApp
from scalemon.tui.screens.job_exit import JobExitScreen, last_lines
from scalemon.tui.screens.overview import OverviewScreen


def demo_args(**changes: object) -> argparse.Namespace:
    """What `scalemon demo` parses by default, with `changes`."""
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


@pytest.mark.integration
def test_quitting_stops_the_job_and_its_log_ends_with_a_line_not_a_traceback(home: Path):
    job = "stopjob"
    proc, log = demo.start_job(demo_args(step_delay=0.05), job)
    try:
        # rank 0 prints every step on the CPU (gloo), every 10th on GPUs (NCCL, a GPU a rank)
        wait_for(lambda: re.search(r"^step \d+ loss", log.read_text(), re.M), timeout=180,
                 interval=0.5)
        ranks = psutil.Process(proc.pid).children()  # torchrun's workers
        assert len(ranks) == 2
        demo.stop_job(proc, job, log_path=log)
        assert not any(r.is_running() for r in ranks)
        text = log.read_text()
        assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
        assert text.rstrip().splitlines()[-1] == (
            f"scalemon demo: stopped job {job} on quit (SIGTERM); torchrun ended: exit code "
            "143")
        wait_for(lambda: not job_processes(job), timeout=30, interval=0.5)  # ranks and hub
    finally:
        for p in job_processes(job):
            p.kill()


@pytest.mark.parametrize(("ranks", "gpus", "device"), [
    (2, 0, "cpu"),  # no GPU (or no NVML): gloo on the CPU
    (2, 1, "cpu"),  # the default 2 ranks on a 1-GPU machine: NCCL would need a GPU each
    (1, 1, "auto"),  # --ranks 1 on a 1-GPU machine: the GPU, with NCCL
    (8, 8, "auto"),
    (9, 8, "cpu"),
])
def test_the_demo_job_gets_the_gpus_only_when_there_is_one_for_every_rank(ranks, gpus, device):
    assert demo.demo_device(ranks, gpus) == device
    command = demo.job_command(demo_args(ranks=ranks), device)
    assert command[command.index("--device") + 1] == device
    assert command[command.index("--nproc-per-node") + 1] == str(ranks)


@pytest.mark.parametrize(("installed", "env", "visible"), [
    (8, None, 8),
    (8, "", 0),  # an empty value hides every GPU
    (8, "0,1", 2),
    (8, "3", 1),
    (2, "0,1,5", 2),  # CUDA stops at the first index it does not have
    (8, "1,-1,2", 1),  # and at -1
    (8, "0,1,0", 0),  # a repeated one hides them all
    (8, "1gpu,2", 2),  # CUDA reads the number an entry starts with
    (8, "GPU-8f2c,GPU-77aa", 2),
    (8, "GPU-8f2c,3", 1),
    (0, "0,1", 0),
])
def test_the_demo_counts_only_the_gpus_cuda_visible_devices_leaves_visible(installed, env,
                                                                          visible):
    assert demo.visible_gpus(installed, env) == visible


def test_last_lines_are_the_end_of_the_log_without_escapes(tmp_path: Path):
    log = tmp_path / "job.log"
    log.write_text("".join(f"line {i}\n" for i in range(30)) + "\x1b[31mred\x1b[0m\ttab\n\n")
    lines = last_lines(log)
    assert lines == [f"line {i}" for i in range(16, 30)] + ["red tab"]
    assert last_lines(tmp_path / "missing.log") == []


FAILING_JOB = r"""
import sys
for i in range(20):
    print(f"output line {i}")
print("[bold red]not markup[/] [link=x]either[/link] $variable")
print("RuntimeError: rank 1 fell over", flush=True)
sys.exit(3)
"""


def test_a_job_that_dies_shows_its_last_lines_and_the_dashboard_stays_usable(
        tmp_path: Path):
    async def scenario() -> None:
        log = tmp_path / "job.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-c", FAILING_JOB], stdout=out,
                                    stderr=subprocess.STDOUT)
        app = DashboardApp(job_process=proc, job_log=log)
        async with app.run_test(size=(140, 40)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, JobExitScreen), timeout=30)
            await until(pilot, lambda: "Esc: back to the dashboard" in screen_text(app))
            text = screen_text(app)
            assert "The job ended: exit code 3" in text
            assert f"The last 15 lines of its log, {log}:" in text
            assert "[bold red]not markup[/] [link=x]either[/link] $variable" in text  # literal
            assert "RuntimeError: rank 1 fell over" in text
            assert "output line 7" in text and "output line 6" not in text  # the last 15
            assert "Esc: back to the dashboard" in text
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            assert any("the job ended: exit code 3" in str(n.message)
                       for n in app._notifications)
            await pilot.press("question_mark")  # the keys still work
            await until(pilot, lambda: not isinstance(app.screen, OverviewScreen))
            await pilot.press("escape")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            assert not isinstance(app.screen, JobExitScreen)  # shown once, not again
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running)

    asyncio.run(scenario())


def test_q_on_the_job_exit_screen_quits(tmp_path: Path):
    async def scenario() -> None:
        log = tmp_path / "job.log"
        log.write_text("")
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(5)"])
        app = DashboardApp(job_process=proc, job_log=log)
        async with app.run_test(size=(120, 30)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, JobExitScreen), timeout=30)
            await until(pilot, lambda: f"Its log ({log}) holds no output." in screen_text(app))
            await pilot.press("q")
            await until(pilot, lambda: not app.is_running)

    asyncio.run(scenario())


def test_a_job_that_finishes_gets_a_toast_and_no_screen(tmp_path: Path):
    async def scenario() -> None:
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        app = DashboardApp(job_process=proc, job_log=tmp_path / "job.log")
        async with app.run_test(size=(120, 30)) as pilot:
            await until(pilot, lambda: app._job_exit_reported, timeout=30)
            await pilot.pause(0.3)
            assert isinstance(app.screen, OverviewScreen)
            assert any("the job finished (exit code 0)" in str(n.message)
                       for n in app._notifications)

    asyncio.run(scenario())
