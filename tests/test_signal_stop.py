"""A job stopped by a signal is stopped, not crashed: SIGTERM, SIGINT and SIGHUP are how users,
torchrun and schedulers stop a job, so a rank whose agent says it ended by one of them did not
fail. A rank that failed otherwise first (an exception, a crash signal, gone before the stop)
is still the job's first failure; a rank's state reads plainly after its user's stop."""

from __future__ import annotations

import asyncio

import pytest
from test_hang_end import encoded, folded
from test_tui_app import cells, header, until

from scalemon.protocol import HUB_RANK, Message
from scalemon.reports.hangs import first_failure
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.snapshot_text import format_snapshot
from scalemon.tui.app import DashboardApp
from scalemon.tui.model import DashboardData
from scalemon.tui.sim import SimJob
from scalemon.tui.views.rank_detail import rank_detail
from scalemon.tui.views.rows import COLUMNS

STEPS = 5
STATE = [c.key for c in COLUMNS].index("state")


def signalled(code: int, ranks: tuple[int, ...] = (0, 1), first: list[Message] | None = None
              ) -> tuple[list[Message], float]:
    """Two ranks ran `STEPS` steps, then (after `first`, the messages of an earlier end) each
    of `ranks` said it ended by the signal of exit `code` (128 + its number), rank 0 first."""
    sim = SimJob(ranks=2, gpu=False, amp=False)
    end = sim.end_t(STEPS) + 1.0
    messages = sim.run(STEPS) + (first or [])
    messages += [sim.message(r, "exit", {"reason": "signal", "exit_code": code, "step": STEPS},
                             end + 0.01 * i) for i, r in enumerate(ranks)]
    return encoded(messages), end


@pytest.mark.parametrize(("code", "name"), [(143, "SIGTERM"), (130, "SIGINT"), (129, "SIGHUP")])
def test_a_job_whose_ranks_all_end_by_a_stop_signal_is_stopped_with_no_failure(code, name):
    messages, end = signalled(code)
    st = folded(messages)
    assert [v.state for v in st.ranks.values()] == ["exited", "exited"]
    assert st.state == "stopped" and st.failed() == [] and first_failure(st) is None
    how = f"ended by {name} (ranks 0,1, exit {code})"
    assert st.stop_text() == how
    as_json = snapshot_json(st, now=end + 5.0)
    assert as_json["state"] == "stopped" and as_json["first_failure"] is None
    assert as_json["end"] == how and as_json["attempts"][-1]["how"] == "stopped"
    text = format_snapshot(as_json)
    assert f"stopped: {how}" in text.splitlines()
    assert "failed first" not in text


def test_the_dashboard_of_a_job_stopped_by_sigterm_shows_no_first_failure():
    messages, end = signalled(143)
    data = DashboardData()
    data.apply_messages(messages)

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: end + 5.0)
        async with app.run_test(size=(120, 35)) as pilot:
            await until(pilot, lambda: len(cells(app)) == 2)
            assert {r: row[STATE] for r, row in cells(app).items()} == {
                0: "exited 143", 1: "exited 143"}  # the same signal: the same word
            text = " ".join(header(app).split())
            assert "ended by SIGTERM (ranks 0,1, exit 143)" in text, text
            assert "failed first" not in text and "crashed" not in text

    asyncio.run(scenario())


@pytest.mark.parametrize("before", ["exception", "sigsegv", "gone"])
def test_a_rank_that_failed_before_the_stop_is_still_the_first_failure(before):
    sim = SimJob(ranks=2, gpu=False, amp=False)
    t = sim.end_t(STEPS) + 0.5
    first = {"exception": sim.message(1, "exit", {"reason": "exception", "exit_code": 1,
                                                  "error": "ValueError: bad batch"}, t),
             "sigsegv": sim.message(1, "exit", {"reason": "signal", "exit_code": 139}, t),
             "gone": Message("rank_state", sim.job, HUB_RANK, 0, t, {
                 "target": 1, "state": "gone",
                 "reason": "process 101 ended without reporting an exit (killed?)"})}[before]
    messages, _ = signalled(143, ranks=(0,), first=[first])
    st = folded(messages)
    assert st.state == ("lost" if before == "gone" else "crashed")
    failure = first_failure(st)
    assert failure["rank"] == 1 and "failed first" in failure["text"]
    assert [v.rank for v in st.failed()] == [1]  # rank 0, stopped by SIGTERM, did not fail


def test_a_rank_that_only_lost_the_peer_the_stop_ended_did_not_fail():
    sim = SimJob(ranks=2, gpu=False, amp=False)
    end = sim.end_t(STEPS) + 1.0
    messages = encoded(sim.run(STEPS) + [
        sim.message(0, "exit", {"reason": "signal", "exit_code": 143}, end),
        sim.message(1, "exit", {"reason": "exception", "exit_code": 1,
                                "error": "RuntimeError: Connection closed by peer"}, end + 0.1)])
    st = folded(messages)
    assert st.ranks[1].peer_loss and st.state == "stopped" and first_failure(st) is None


def test_a_ranks_state_after_its_users_stop_reads_plainly():
    sim = SimJob(ranks=2, gpu=False, amp=False)
    t = sim.end_t(STEPS) + 1.0
    stop = Message("job_stop", sim.job, HUB_RANK, 0, t, {
        "reason": "scalemon demo: Ctrl-C", "user": "root", "host": "vm"})
    messages = encoded([*sim.run(STEPS), stop, *(
        sim.message(r, "exit", {"reason": "signal", "exit_code": 143}, t + 0.5) for r in (0, 1))])
    data = DashboardData()
    data.apply_messages(messages)
    plain = ("stopped by the user (scalemon demo: Ctrl-C, root@vm); ended by SIGTERM, exit 143")
    assert data.state.state == "stopped"
    facts = dict(rank_detail(data, 1, now=t + 2.0).facts)
    assert facts["state"] == plain
    text = format_snapshot(snapshot_json(data.state, now=t + 2.0), width=200)
    assert plain in text and "stopped (stopped" not in text
    assert data.state.stop_text() == "stopped by the user (scalemon demo: Ctrl-C, root@vm)"


@pytest.mark.parametrize(("key", "said"), [("ctrl+c", "Ctrl-C"), ("q", "q")])
def test_the_demo_records_ctrl_c_as_ctrl_c_and_q_as_q(key, said):
    from scalemon.cli.demo import SignalStop

    async def scenario() -> str:
        app = DashboardApp()
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press(key)
            await until(pilot, lambda: not app.is_running, timeout=10)
        stopper = SignalStop()
        stopper.app = app
        return stopper.reason

    assert asyncio.run(scenario()) == f"scalemon demo: {said}"
