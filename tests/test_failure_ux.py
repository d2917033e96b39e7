"""When things go wrong (issue #14 items 2 and 5): which rank failed first and which only lost a
peer, no scalemon frames in a rank's error, "hub down" instead of "stalled", the history file
after the hub's linger, no heartbeat age on ranks that ended."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_tui_app import until

from conftest import FakeRank, torchrun_cmd, wait_for
from scalemon.protocol import Message
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.snapshot_text import format_snapshot
from scalemon.state.failures import clean_error, is_peer_loss
from scalemon.state.jobstate import JobState
from scalemon.tui.app import DashboardApp
from scalemon.tui.feed import HubFeed
from scalemon.tui.model import DashboardData
from scalemon.tui.views.overview import overview
from scalemon.tui.views.rank_detail import rank_detail
from scalemon.tui.widgets.header import JobHeader

GLOO_PEER_ERROR = (
    "RuntimeError: Got the following error when running the callback: RuntimeError: "
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:34736. This is typically caused by a remote worker crashing.\n\nAt:\n"
    "  /opt/scalemon/agent/timing.py(209): _done\n"
    "  /opt/scalemon/agent/timing.py(192): <lambda>\n\n"
)


def _msg(mtype: str, rank: int, t: float, body: dict, seq: int = 0) -> Message:
    return Message(type=mtype, job="j", rank=rank, seq=seq, t=t, body=body)


def _crashed_job(peer_t: float = 100.0, crash_t: float = 100.5) -> JobState:
    """Rank 1 crashed on its own; rank 0 failed in its all-reduce, reported *earlier*."""
    st = JobState()
    for r in (0, 1):
        st.apply(_msg("hello", r, 90.0, {"host": "h", "pid": 10 + r, "world_size": 2,
                                         "local_rank": r}))
        st.apply(_msg("step", r, 95.0, {"step": 29}, seq=1))
    st.apply(_msg("exit", 0, peer_t, {"reason": "exception", "exit_code": 1,
                                      "error": clean_error(GLOO_PEER_ERROR,
                                                           (Path("/opt/scalemon/agent"),))},
                  seq=2))
    st.apply(_msg("exit", 1, crash_t, {"reason": "exception", "exit_code": 1,
                                       "error": "InjectedCrash: --inject-crash 1:30\n"}, seq=2))
    return st


def test_clean_error_keeps_the_cause_and_drops_scalemon_frames() -> None:
    cleaned = clean_error(GLOO_PEER_ERROR, (Path("/opt/scalemon/agent"),))
    assert cleaned.startswith("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo")
    assert "callback" not in cleaned and "timing.py" not in cleaned and "At:" not in cleaned
    other = "ValueError: bad\n\nAt:\n  /home/me/train.py(12): step\n"
    assert clean_error(other, (Path("/opt/scalemon/agent"),)) == other  # not ours: kept
    assert is_peer_loss(cleaned) and not is_peer_loss("InjectedCrash: --inject-crash 1:30")


def test_the_rank_with_a_cause_of_its_own_is_first_even_when_a_peer_reported_earlier() -> None:
    st = _crashed_job()
    failure = st.first_failure()
    assert failure is not None
    assert failure["rank"] == 1 and failure["peer_loss"] == [0]
    assert failure["text"] == ("rank 1 failed first (step 29): InjectedCrash: --inject-crash "
                               "1:30; rank 0 failed only because a peer went away")
    text = format_snapshot(snapshot_json(st, now=101.0))
    assert failure["text"] in text.splitlines()[1]
    assert "exited (exception), peer lost" in text
    # two ranks with causes of their own: the earlier one
    st.apply(_msg("exit", 0, 99.0, {"reason": "exception", "exit_code": 1,
                                    "error": "OSError: disk full\n"}, seq=3))
    assert st.first_failure()["rank"] == 0
    assert st.first_failure()["peer_loss"] == []


def test_dashboard_header_table_and_detail_name_the_first_failure() -> None:
    data = DashboardData()
    data.apply_messages(_crashed_job_messages())
    view = overview(data, now=200.0)
    assert view.summary.failure.startswith("rank 1 failed first: InjectedCrash")
    states = {row.rank: row.cells[1] for row in view.rows}
    assert states == {0: "peer lost", 1: "failed 1st"}
    facts = {r: dict(rank_detail(data, r, now=200.0).facts) for r in (0, 1)}
    assert facts[1]["state"] == "exited (exception), the first rank to fail"
    assert facts[0]["state"] == "exited (exception), only because a peer went away"


def _crashed_job_messages() -> list[Message]:
    out = []
    for r in (0, 1):
        out.append(_msg("hello", r, 90.0, {"host": "h", "pid": 10 + r, "world_size": 2,
                                           "local_rank": r}))
    out.append(_msg("exit", 0, 100.0, {"reason": "exception", "exit_code": 1,
                                       "error": "RuntimeError: Connection closed by peer"}))
    out.append(_msg("exit", 1, 100.5, {"reason": "exception", "exit_code": 1,
                                       "error": "InjectedCrash: --inject-crash 1:30"}))
    return out


def test_heartbeat_age_stops_counting_when_a_rank_ends() -> None:
    st = _crashed_job()
    st.apply(_msg("hello", 2, 90.0, {"host": "h", "pid": 12, "world_size": 3, "local_rank": 2}))
    st.apply(_msg("exit", 2, 101.0, {"reason": "finished", "exit_code": 0}, seq=1))
    st.apply(_msg("hello", 3, 100.0, {"host": "h", "pid": 13, "world_size": 4,
                                      "local_rank": 3}))
    assert st.ranks[2].value("heartbeat_age_s", 500.0) is None  # finished
    assert st.ranks[1].value("heartbeat_age_s", 500.0) is None  # exited
    assert st.ranks[3].value("heartbeat_age_s", 500.0) == 400.0  # running: counting


def test_hub_down_is_not_called_stalled() -> None:
    data = DashboardData()
    data.apply_messages([_msg("hello", 0, 100.0, {"host": "h", "pid": 1, "world_size": 1,
                                                  "local_rank": 0}),
                         _msg("step", 0, 100.0, {"step": 5, "step_time_s": 0.1}, seq=1)])
    data.set_conn("connected", "ipc:///x")
    assert overview(data, now=160.0, plots=False).summary.state == "stalled"  # hub answers
    data.set_conn("disconnected", "no answer from the hub at ipc:///x")
    summary = overview(data, now=160.0, plots=False).summary
    clock = time.strftime("%H:%M:%S", time.localtime(100.0))
    assert summary.state == "hub down"
    assert summary.state_text == f"hub down: no data since {clock} (60 s ago)"


def test_after_the_hubs_linger_the_dashboard_shows_the_history_file(start_hub, zctx,
                                                                    home: Path) -> None:
    """The hub lingers 1 s after the job ended and exits: the dashboard says why and shows the
    history file, instead of "disconnected, retrying" forever."""
    hub = start_hub("lingerjob", "--linger", "1")
    ranks = [FakeRank(zctx, hub.address, "lingerjob", r) for r in (0, 1)]

    async def scenario() -> None:
        app = DashboardApp(HubFeed(job="lingerjob", home=home, retry_s=0.2), home=home)
        async with app.run_test(size=(120, 40)) as pilot:
            for r in ranks:
                r.hello()
                r.step(1)
            await until(pilot, lambda: len(app.data.state.ranks) == 2)
            for r in ranks:
                r.step(2)
                r.send("exit", {"reason": "finished", "exit_code": 0})
            await until(pilot, lambda: app.data.conn.status == "offline", timeout=30)
            assert "the job finished (its hub exited at" in app.data.conn.detail
            assert "showing its history file" in app.data.conn.detail
            assert hub.proc.poll() is not None  # the hub is gone for good
            header = lambda: app.screen.query_one(JobHeader).render().plain  # noqa: E731
            await until(pilot, lambda: "hub offline (the job finished" in header())
            assert "disconnected" not in header()
            assert app.data.state.state == "finished"
            assert {v.step for v in app.data.state.ranks.values()} == {2}

    asyncio.run(scenario())


@pytest.mark.integration
def test_crashed_job_snapshot_names_the_first_rank_and_no_scalemon_frames(home: Path) -> None:
    """A real 2-rank gloo job where rank 1 crashes at step 30: rank 0 dies in its all-reduce
    (gloo: connection closed by peer) through scalemon's comm hook."""
    env = {**os.environ, "SCALEMON_JOB_ID": "crashfirst", "OMP_NUM_THREADS": "1"}
    cmd = torchrun_cmd("--monitor", "--max-steps", "60", "--inject-crash", "1:30")
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=240)
    assert proc.returncode != 0

    def snapshot() -> dict | None:
        out = subprocess.run([sys.executable, "-m", "scalemon", "snapshot", "crashfirst",
                              "--json"], env=env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            return None
        state = json.loads(out.stdout)
        return state if len([r for r in state["ranks"] if r["state"] == "exited"]) == 2 \
            else None

    state = wait_for(snapshot, timeout=60, interval=0.5)
    failure = state["first_failure"]
    assert failure["rank"] == 1, failure
    assert "InjectedCrash: --inject-crash 1:30" in failure["error"]
    assert failure["peer_loss"] == [0]
    rank0 = state["ranks"][0]
    assert rank0["peer_loss"] is True
    assert "Connection closed by peer" in rank0["error"]
    assert "timing.py" not in rank0["error"] and "callback" not in rank0["error"]


def test_tcp_errors_name_the_address_typed_and_its_ports(home: Path) -> None:
    from conftest import free_port
    from scalemon.home.keys import hub_keypair

    hub_keypair(home)  # a tcp client needs a server key (this home's hub key) to try at all
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "scalemon", "snapshot",
                          f"tcp://127.0.0.1:{port}", "--timeout", "0.5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert (f"no answer from the hub at tcp://127.0.0.1:{port} (requests go to its port "
            f"{port + 2}; a tcp hub listens on ports {port}-{port + 2}) within 0.5 s"
            in out.stderr)


def _trainer_stderr_until(env: dict, text: str, steps: int = 400) -> tuple[str, bool]:
    """Run a 1-rank monitored demo job until its stderr shows `text` (or it ends): (stderr so
    far, whether the job was still running when `text` appeared)."""
    cmd = torchrun_cmd("--monitor", "--max-steps", str(steps), "--step-delay", "0.05",
                       nproc=1)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    seen, running = "", False
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            seen += line
            if text in line:
                running = proc.poll() is None
                break
    finally:
        from conftest import kill_tree

        kill_tree(proc)
    return seen, running


@pytest.mark.integration
def test_a_dead_scalemon_hub_is_reported_within_seconds_naming_the_variable(home: Path) -> None:
    from conftest import free_port
    from scalemon.home.keys import hub_keypair

    hub_keypair(home)  # the agent's server key for a tcp hub: this home's hub key
    address = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "SCALEMON_HUB": address, "SCALEMON_JOB_ID": "deadhub",
           "OMP_NUM_THREADS": "1"}
    seen, running = _trainer_stderr_until(env, "nothing is being received")
    assert running, seen[-2000:]  # said while training, not at its end (400 steps >= 20 s)
    assert re.search(rf"the hub at {re.escape(address)} \(set by SCALEMON_HUB\) has not "
                     r"answered for [5-9] s", seen), seen[-2000:]
    assert "unset SCALEMON_HUB" in seen


def test_a_garbage_scalemon_hub_is_named(home: Path) -> None:
    env = {**os.environ, "SCALEMON_HUB": "garbage", "SCALEMON_JOB_ID": "garbagehub",
           "OMP_NUM_THREADS": "1"}
    seen, _ = _trainer_stderr_until(env, "SCALEMON_HUB='garbage'", steps=3)
    assert "SCALEMON_HUB='garbage' is not a hub address" in seen, seen[-2000:]


def test_a_crashed_dashboard_gives_a_non_zero_exit_code(home: Path) -> None:
    """`scalemon attach` returned 0 after a traceback; run_app now returns the app's code."""
    import functools

    from scalemon.tui.app import run_app

    class Crashing(DashboardApp):
        def on_mount(self) -> None:
            raise RuntimeError("boom")

    app = Crashing(HubFeed(job="nojob", home=home), home=home)
    app.run = functools.partial(app.run, headless=True)  # no terminal in the test
    assert run_app(app) == 1
