"""`scalemon demo` as a person runs it: in a real terminal (tmux), watch, press q."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import SCALEMON, job_processes, wait_for

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]

ROW = re.compile(r"^\s*(\d+)\s+running\s+(\d+)\s+(\d+\.\d{4})\s", re.M)


class Tmux:
    """One session on a private tmux server (its own socket), killed at the end."""

    def __init__(self, name: str) -> None:
        self.server = name
        self.session = name

    def run(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-L", self.server, *args], capture_output=True,
                             text=True, timeout=30)
        return out.stdout

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", self.session)

    def joined(self) -> str:
        """The screen with the lines the terminal wrapped joined again."""
        return self.run("capture-pane", "-p", "-J", "-t", self.session)

    def kill(self) -> None:
        self.run("kill-session", "-t", self.session)
        self.run("kill-server")


def ranks_on(screen: str) -> dict[int, tuple[int, str]]:
    """rank -> (step, loss) from the table on a captured screen."""
    return {int(r): (int(step), loss) for r, step, loss in ROW.findall(screen)}


def test_scalemon_demo_in_tmux_shows_two_ranks_advancing_and_quits_cleanly(home: Path):
    job = f"tuidemo{os.getpid()}"
    scalemon = SCALEMON
    cmd = (f"env SCALEMON_HOME={home} OMP_NUM_THREADS=1 {scalemon} demo --job {job} "
           f"--step-delay 0.05; echo DEMO-EXIT=$?; sleep 60")
    tmux = Tmux(f"smtest-{os.getpid()}")
    try:
        tmux.run("new-session", "-d", "-s", tmux.session, "-x", "120", "-y", "40", cmd)
        first = wait_for(lambda: (r := ranks_on(tmux.screen())) and len(r) == 2
                         and min(s for s, _ in r.values()) >= 3 and r, timeout=180,
                         interval=0.5)
        later = wait_for(lambda: (r := ranks_on(tmux.screen())) and len(r) == 2
                         and min(s for s, _ in r.values()) > max(s for s, _ in first.values())
                         and r, timeout=60, interval=0.5)
        screen = tmux.screen()
        assert sorted(later) == [0, 1]
        assert later[0][1] != first[0][1]  # the loss moves with the steps
        assert f"job {job}" in screen and "world 2" in screen and "hub connected" in screen
        assert "loss" in screen and "n/a" in screen  # CPU ranks: no GPU memory
        assert sum(0x2800 < ord(ch) <= 0x28FF for ch in screen) > 30, "no plot drawn"
        assert job_processes(job), "the job should be running"
        tmux.run("send-keys", "-t", tmux.session, "q")
        wait_for(lambda: "DEMO-EXIT=0" in tmux.screen(), timeout=60, interval=0.5)
        wait_for(lambda: not job_processes(job), timeout=30, interval=0.5)
        log = (home / "demo" / f"{job}.log").read_text()
        assert "Traceback" not in log, log[-3000:]  # torchrun's SignalException is not there
        assert log.rstrip().splitlines()[-1] == (
            f"scalemon demo: stopped job {job} on quit (SIGTERM); torchrun ended: exit code 143")
        assert (f"scalemon demo: stopped job {job} (log: {home / 'demo' / job}.log); "
                f"`scalemon snapshot {job}` replays its history") in tmux.joined()
        replay = subprocess.run([scalemon, "snapshot", job, "--json"], capture_output=True,
                                text=True, timeout=60, env={**os.environ,
                                                            "SCALEMON_HOME": str(home)})
        state = json.loads(replay.stdout)  # q told the hub first: stopped by user, not lost
        assert state["state"] == "stopped", replay.stdout[-3000:]
        assert [r["state"] for r in state["ranks"]] == ["stopped", "stopped"]
        assert "the job was stopped by its user or a stop signal" in replay.stderr
    finally:
        print(tmux.screen())
        tmux.kill()
        for proc in job_processes(job):
            proc.kill()


def test_scalemon_demo_whose_job_dies_shows_its_last_lines_and_exits_with_its_code(home: Path):
    job = f"tuidie{os.getpid()}"
    scalemon = SCALEMON
    cmd = (f"env SCALEMON_HOME={home} OMP_NUM_THREADS=1 {scalemon} demo --job {job} "
           f"--step-delay 0.05; echo DEMO-EXIT=$?; sleep 60")
    tmux = Tmux(f"smdie-{os.getpid()}")
    try:
        tmux.run("new-session", "-d", "-s", tmux.session, "-x", "120", "-y", "40", cmd)
        wait_for(lambda: (r := ranks_on(tmux.screen())) and len(r) == 2
                 and min(s for s, _ in r.values()) >= 3, timeout=180, interval=0.5)
        (rank1,) = [p for p in job_processes(job) if p.environ().get("LOCAL_RANK") == "1"]
        rank1.kill()  # the job fails: torchrun stops rank 0 and exits 1
        killed = f"Signal 9 (SIGKILL) received by PID {rank1.pid}"

        def exit_box() -> str | None:
            """The screen once the box and its lines are there (a capture can catch the
            terminal between two of its writes)."""
            screen = tmux.screen()
            return screen if "The job ended: exit code 1" in screen and killed in screen else None

        screen = wait_for(exit_box, timeout=60, interval=0.5)
        assert f"The last 15 lines of its log, {home / 'demo' / job}.log:" in screen
        assert killed in screen
        assert "Esc: back to the dashboard" in screen
        time.sleep(3)
        assert "The job ended" in tmux.screen()  # it stays until dismissed
        tmux.run("send-keys", "-t", tmux.session, "Escape")
        wait_for(lambda: "The job ended" not in tmux.screen(), timeout=30, interval=0.5)
        assert "DEMO-EXIT" not in tmux.screen()  # the dashboard is still there
        tmux.run("send-keys", "-t", tmux.session, "q")
        wait_for(lambda: "DEMO-EXIT=1" in tmux.screen(), timeout=60, interval=0.5)
        said = tmux.joined()  # what it printed once the dashboard was gone
        assert (f"scalemon demo: job {job} failed: exit code 1; `scalemon snapshot {job}` "
                f"replays its history; the last 15 lines of its log, "
                f"{home / 'demo' / job}.log:\n") in said
        assert f"Signal 9 (SIGKILL) received by PID {rank1.pid}" in said
        wait_for(lambda: not job_processes(job), timeout=30, interval=0.5)
    finally:
        print(tmux.screen())
        tmux.kill()
        for proc in job_processes(job):
            proc.kill()
