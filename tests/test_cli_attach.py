"""`scalemon attach --wait S`: a job that is not there yet is waited for, with a countdown."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
from test_cli_edges import typed_into_a_shell
from test_tui_demo import Tmux

from conftest import SCALEMON, FakeRank, HubProcess, wait_for
from scalemon.tui.attach import wait_for_job


class Terminal(io.StringIO):
    """An `out` that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def later(seconds: float, start: Callable[[], object]) -> threading.Thread:
    """Run `start` on a thread after `seconds`."""
    thread = threading.Thread(target=lambda: (time.sleep(seconds), start()), daemon=True)
    thread.start()
    return thread


def test_wait_for_job_returns_as_soon_as_the_jobs_hub_appears(
        home: Path, start_hub: Callable[..., HubProcess]):
    out = io.StringIO()
    began = time.monotonic()
    starter = later(1.0, lambda: start_hub("late1"))
    assert wait_for_job("late1", 60.0, home=home, out=out, poll_s=0.1)
    took = time.monotonic() - began
    starter.join(timeout=60)
    assert 1.0 <= took < 50, took
    assert out.getvalue().splitlines()[0] == (
        "scalemon attach: waiting for job late1's hub: 60 s left (Ctrl-C to stop)")


def test_without_a_job_id_it_waits_for_the_first_live_job(
        home: Path, start_hub: Callable[..., HubProcess]):
    out = io.StringIO()
    starter = later(1.0, lambda: start_hub("first"))
    assert wait_for_job(None, 60.0, home=home, out=out, poll_s=0.1)
    starter.join(timeout=60)
    assert out.getvalue().startswith("scalemon attach: waiting for a live job: 60 s left")


def test_a_job_that_is_there_or_a_bad_id_needs_no_wait(
        home: Path, start_hub: Callable[..., HubProcess]):
    start_hub("here")
    out = io.StringIO()
    assert wait_for_job("here", 60.0, home=home, out=out)
    assert wait_for_job("no/such", 60.0, home=home, out=out)  # make_app says what is wrong
    assert wait_for_job("tcp://127.0.0.1:9", 60.0, home=home, out=out)
    assert out.getvalue() == ""
    assert not wait_for_job("nosuch", 0.0, home=home, out=out)


def test_on_a_terminal_the_countdown_updates_in_place_and_is_cleared(home: Path):
    out = Terminal()
    began = time.monotonic()
    assert not wait_for_job("never", 2.5, home=home, out=out, poll_s=0.1)
    assert time.monotonic() - began >= 2.5
    text = out.getvalue()
    assert "\n" not in text
    assert text.startswith("\r") and text.endswith("\r\x1b[K")  # cleared at the end
    shown = [part.removesuffix("\x1b[K") for part in text.split("\r")[1:-1]]
    expected = [f"scalemon attach: waiting for job never's hub: {s} s left (Ctrl-C to stop)"
                for s in (3, 2, 1)]
    assert shown[0] == expected[0]
    assert all(line in expected for line in shown) and len(set(shown)) == len(shown) >= 2


def attach(*args: str, home: Path) -> subprocess.Popen:
    """`scalemon attach ARGS` with its stderr piped, and Ctrl-C delivered as on a terminal
    (a test run started in the background, `pytest &`, hands its children SIGINT ignored)."""
    return subprocess.Popen([SCALEMON, "attach", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SCALEMON_HOME": str(home)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_attach_waits_the_time_given_then_exits_2_saying_why(home: Path):
    """On a terminal: without one the dashboard is refused, so there is nothing to wait for."""
    shown, took = typed_into_a_shell(f"{SCALEMON} attach --wait 3 nosuch", home, timeout=60)
    assert took >= 3
    assert "\rscalemon attach: waiting for job nosuch's hub: 3 s left (Ctrl-C to stop)\x1b[K" \
        in shown
    assert shown.endswith("\r\x1b[Kscalemon attach: no live hub and no history for job "
                          "'nosuch' (live jobs: none) (waited 3 s)\r\nRC=2\r\n"), shown


def test_attach_wait_0_fails_at_once(home: Path):
    proc = attach("--wait", "0", "nosuch", home=home)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err == ("scalemon attach: no live hub and no history for job 'nosuch' "
                   "(live jobs: none)\n")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_ctrl_c_stops_the_wait(home: Path):
    cmd = (f"env SCALEMON_HOME={home} {SCALEMON} attach --wait 120 nosuch; "
           "echo ATTACH-EXIT=$?; sleep 60")
    tmux = Tmux(f"smctrlcwait-{os.getpid()}")
    try:
        tmux.run("new-session", "-d", "-s", tmux.session, "-x", "120", "-y", "40", cmd)
        wait_for(lambda: "waiting for job nosuch's hub: 1" in tmux.screen(), timeout=60,
                 interval=0.3)
        tmux.run("send-keys", "-t", tmux.session, "C-c")
        wait_for(lambda: "ATTACH-EXIT=" in tmux.screen(), timeout=30, interval=0.3)
        lines = [line for line in tmux.screen().splitlines() if line.strip()]
        assert lines[-2:] == ["scalemon attach: stopped waiting", "ATTACH-EXIT=130"], lines
        assert "s left" not in tmux.screen()  # the countdown line was cleared
    finally:
        tmux.kill()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_attach_started_before_the_job_shows_a_countdown_then_the_dashboard(
        home: Path, start_hub: Callable[..., HubProcess], zctx: zmq.Context):
    job = f"early{os.getpid()}"
    cmd = (f"env SCALEMON_HOME={home} {SCALEMON} attach --wait 120 {job}; "
           "echo ATTACH-EXIT=$?; sleep 60")
    tmux = Tmux(f"smattach-{os.getpid()}")
    try:
        tmux.run("new-session", "-d", "-s", tmux.session, "-x", "120", "-y", "40", cmd)
        wait_for(lambda: f"waiting for job {job}'s hub:" in tmux.screen(), timeout=60,
                 interval=0.3)
        first = tmux.screen()
        assert "s left (Ctrl-C to stop)" in first and "ATTACH-EXIT" not in first
        hub = start_hub(job)
        FakeRank(zctx, hub.address, job, 0).hello(world_size=1)
        wait_for(lambda: f"job {job}" in tmux.screen() and "hub connected" in tmux.screen(),
                 timeout=60, interval=0.3)
        assert "waiting for job" not in tmux.screen()
        tmux.run("send-keys", "-t", tmux.session, "q")
        wait_for(lambda: "ATTACH-EXIT=0" in tmux.screen(), timeout=60, interval=0.3)
    finally:
        print(tmux.screen())
        tmux.kill()
