"""The crash of issue #14 in a real terminal: a two-rank gloo job of the demo trainer whose rank 1
raises before step 30 (`--inject-crash 1:30`), so rank 0 fails with gloo's "Connection closed by
peer", whose text holds "[/__w/pytorch/.../pair.cc:553]" (it used to stop the dashboard with a
MarkupError). `scalemon attach` runs in a detached tmux session; Enter on every rank of the
table shows that rank's detail with its error as the rank sent it, and the dashboard stays up
until `q`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import kill_tree, torchrun_cmd, wait_for
from scalemon.home.address import HubAddress
from scalemon.home.jobfile import JobFile
from scalemon.home.paths import jobs_dir
from scalemon.link.client import HubClient

JOB = "crash14"
RANKS = 2
WAIT_S = 60.0
"""Longest wait for the dashboard to show something (2 slow cores, other tests beside)."""
EXITED = "dashboard exited with"

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


class NotShown(AssertionError):
    """What was waited for did not show in time (the dashboard still runs)."""


def job_env(home: Path) -> dict[str, str]:
    env = os.environ.copy()
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    env.update(SCALEMON_HOME=str(home), SCALEMON_JOB_ID=JOB, OMP_NUM_THREADS="1",
               SCALEMON_HUB_ARGS="--linger 600")
    return env


def crashed_job(home: Path) -> list[dict[str, Any]]:
    """Run the job to its end (rank 1 crashes at step 30); returns the ranks as its hub has
    them once both exited (their errors included)."""
    out = home / f"{JOB}.out"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            torchrun_cmd("--monitor", "--preset", "tiny", "--batch-size", "4",
                         "--inject-crash", "1:30"),
            env=job_env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert proc.wait(timeout=300) != 0, out.read_text()[-3000:]
    finally:
        kill_tree(proc)
    address = HubAddress.parse(JobFile.read(jobs_dir(home) / f"{JOB}.json").address)

    def exited() -> list[dict[str, Any]] | None:
        client = HubClient(address, timeout_s=10)
        try:
            ranks = client.state()["state"]["ranks"]
        finally:
            client.close()
        done = len(ranks) == RANKS and all(r["state"] == "exited" and r["error"] for r in ranks)
        return ranks if done else None

    return wait_for(exited, timeout=WAIT_S, interval=0.5)


class Tmux:
    """A tmux server of its own (its socket named after this test) with one detached session
    of `width` x `height` running `command`."""

    def __init__(self, command: str, width: int = 120, height: int = 40) -> None:
        self.socket = f"smt{os.getpid()}-{time.monotonic_ns()}"
        self.tmux("new-session", "-d", "-s", "dash", "-x", str(width), "-y", str(height),
                  command)

    def tmux(self, *args: str) -> str:
        """Run a tmux command on this server; its output. The server gets os.environ: the
        process's C environment may hold COLUMNS=80 and LINES=24 (readline exports them when
        imported without a terminal), which an app in the pane would take for its size."""
        done = subprocess.run(["tmux", "-u", "-f", "/dev/null", "-L", self.socket, *args],
                              capture_output=True, text=True, timeout=30, check=True,
                              env=dict(os.environ))
        return done.stdout

    def screen(self) -> str:
        """What the terminal shows now."""
        return self.tmux("capture-pane", "-p", "-t", "dash")

    def history(self) -> str:
        """The terminal with what scrolled off it (a traceback)."""
        return self.tmux("capture-pane", "-p", "-S", "-500", "-t", "dash")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "dash", *keys)

    def until(self, predicate: Callable[[str], object], what: str,
              timeout: float = WAIT_S) -> str:
        """The screen once `predicate(screen)` holds; fails with the screen after `timeout`."""
        end = time.monotonic() + timeout
        while True:
            text = self.screen()
            if predicate(text):
                return text
            assert EXITED not in text, f"the dashboard exited, waiting for {what}:\n" \
                                       f"{self.history()}"
            if time.monotonic() > end:
                raise NotShown(f"not on screen within {timeout} s: {what}\n{text}")
            time.sleep(0.2)

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=30, check=False)


@pytest.fixture
def dashboard(home: Path) -> Iterator[Callable[[str], Tmux]]:
    """`dashboard(job)`: `scalemon attach job` in a tmux session; the server is killed after."""
    sessions: list[Tmux] = []

    def start(job: str) -> Tmux:
        env = {"SCALEMON_HOME": str(home), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "TERM": "xterm-256color", "COLORTERM": "truecolor"}
        attach = " ".join(shlex.quote(a) for a in (
            "env", "-u", "COLUMNS", "-u", "LINES", *(f"{k}={v}" for k, v in env.items()),
            sys.executable, "-m", "scalemon", "attach", job))
        session = Tmux(f"cd {shlex.quote(str(home))}; {attach}; echo {EXITED} $?; sleep 600")
        sessions.append(session)
        return session

    yield start
    for session in sessions:
        session.kill()


SCROLLBAR = re.compile(r"[▁▂▃▄▅▆▇█]+\s*$", re.M)
"""The vertical scroll bar's thumb at the end of a line."""


def squeezed(text: str) -> str:
    """`text` without whitespace and scroll bar: the error wraps in its column of the facts
    table, next to the scroll bar."""
    return re.sub(r"\s+", "", SCROLLBAR.sub("", text))


def title(rank: int) -> Callable[[str], bool]:
    """The detail screen of `rank` is up (its title line)."""
    return lambda text: any(line.lstrip().startswith(f"rank {rank}  ·")
                            for line in text.splitlines())


def open_rank(tmux: Tmux, rank: int) -> str:
    """Enter on the highlighted row until the rank's detail shows (the table fills in once the
    history arrived); returns the screen."""
    end = time.monotonic() + WAIT_S
    while True:
        tmux.keys("Enter")
        try:
            return tmux.until(title(rank), f"the detail of rank {rank}", timeout=5)
        except NotShown:
            if time.monotonic() > end:
                raise


def test_enter_on_every_rank_of_the_crashed_job_shows_its_error_verbatim(home, dashboard):
    ranks = crashed_job(home)
    errors = {r["rank"]: r["error"].strip() for r in ranks}
    assert "InjectedCrash: --inject-crash 1:30" in errors[1]
    assert "Connection closed by peer" in errors[0] and "[/" in errors[0], errors[0]
    tmux = dashboard(JOB)
    tmux.until(lambda text: f"job {JOB}" in text, "the overview of the job")
    for rank in range(RANKS):
        if rank:
            tmux.keys("Down")
        open_rank(tmux, rank)
        expected = squeezed(errors[rank])
        text = tmux.until(lambda text: expected in squeezed(text),  # noqa: B023
                          f"rank {rank}'s error {errors[rank]!r}")
        assert title(rank)(text) and "exit code / error" in text
        tmux.keys("Escape")
        tmux.until(lambda text: f"job {JOB}" in text and "rank " not in text.splitlines()[0],
                   "back to the overview")
    assert tmux.tmux("list-panes", "-t", "dash", "-F", "#{pane_dead}").strip() == "0"
    tmux.keys("q")
    text = tmux.until(lambda text: EXITED in text, "the dashboard quitting on q")
    assert f"{EXITED} 0" in text and "Traceback" not in text, text
