"""A job that ended hung keeps its hang: the snapshot, the summary and the hang view tell the
hang the job was in (its culprit, where the others waited, for how long) and how it ended; its
first failure is the hang, not the first rank killed. And a rank ended by a signal reads so."""

from __future__ import annotations

import asyncio
import pickle

from test_tui_app import until
from test_tui_snapshots import screen_text

from scalemon import protocol
from scalemon.protocol import Message
from scalemon.reports.hangs import first_failure, job_hang, last_hang
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.snapshot_text import format_snapshot
from scalemon.reports.summary import run_records, summarize
from scalemon.reports.summary_text import summary_text
from scalemon.state.jobstate import JobState
from scalemon.tui.app import DashboardApp
from scalemon.tui.model import DashboardData
from scalemon.tui.screens.hang import HangScreen
from scalemon.tui.sim import SimJob
from scalemon.tui.views.hang import hang_view

STEPS = 20


def encoded(messages: list[Message]) -> list[Message]:
    """Each message through the wire format (checks it is a valid one)."""
    return [protocol.decode(protocol.encode(m.type, m.job, m.rank, m.seq, m.body, t=m.t))
            for m in messages]


def killed_while_hung(sim: SimJob, stuck_s: float = 35.0) -> tuple[list[Message], float]:
    """Three ranks ran `STEPS` steps, rank 1 never issued the next all-reduce (the others wait
    in it), and `stuck_s` after the last step torchrun got SIGTERM: each rank's agent said it
    ended by SIGTERM (exit 143), rank 0 first. Returns the messages and when rank 0 ended."""
    messages = sim.run(STEPS) + sim.hang(1, STEPS, stuck_s=stuck_s - 1.0)
    end = sim.end_t(STEPS) + stuck_s
    messages += [sim.message(r, "exit", {"reason": "signal", "exit_code": 143, "step": STEPS},
                             end + 0.01 * r) for r in (0, 2, 1)]
    return encoded(messages), end


def folded(messages: list[Message]) -> JobState:
    st = JobState()
    for m in messages:
        st.apply(m)
    return st


def test_a_rank_ended_by_a_signal_reads_as_ended_by_it_not_as_lost():
    sim = SimJob(ranks=2, gpu=False, amp=False)
    messages = sim.run(3) + [sim.message(1, "exit", {"reason": "signal", "exit_code": 143},
                                         sim.end_t(3) + 0.5)]
    st = folded(encoded(messages))
    view = st.ranks[1]
    assert (view.state, view.state_reason, view.exit_code) == (
        "exited", "ended by SIGTERM, exit 143", 143)
    assert st.first_failure()["text"] == "rank 1 failed first (step 3): ended by SIGTERM, exit 143"
    assert st.hang_end is None  # it ended right after a step: no hang to keep
    text = format_snapshot(snapshot_json(st, now=sim.end_t(3) + 1.0))
    assert "exited (ended by SIGTERM, exit 143)" in text and "killed?" not in text


def test_a_job_killed_while_hung_keeps_its_hang_and_its_culprit_in_snapshot_and_summary():
    sim = SimJob(ranks=3, gpu=False, amp=False)
    messages, end = killed_while_hung(sim)
    st = folded(messages)
    later = end + 60.0
    assert st.state == "crashed"  # every rank ended, by SIGTERM
    assert job_hang(st, later) is None  # no hang now: the job ended
    seq = sim.coll_seq + 1
    hang = last_hang(st)
    assert hang is not None and hang["culprits"] == [1] and hang["waiting"] == [0, 2]
    assert hang["step"] == STEPS and round(hang["since_s"]) == 35
    summary = (f"hung after step {STEPS} in all_reduce #{seq} of default_pg [0,1,2] (culprit "
               "rank 1) for 35 s, then ended by SIGTERM (ranks 0,1,2, exit 143)")
    assert hang["summary"] == summary
    failure = first_failure(st)  # the hang, not rank 0, the first one killed
    assert failure["rank"] == 1 and failure["state"] == "hung"
    assert failure["text"] == f"the job {summary}"

    as_json = snapshot_json(st, now=later)
    assert as_json["hang"] is None and as_json["last_hang"]["culprits"] == [1]
    assert as_json["first_failure"]["text"] == f"the job {summary}"
    text = format_snapshot(as_json)
    assert f"HUNG until the end: {summary}" in text
    assert f"rank 1 never issued all_reduce #{seq} of default_pg [0,1,2]" in text
    assert "failed first" not in text

    s = summarize(as_json, run_records(messages))
    assert s["hangs"]["last"]["culprits"] == [1] and s["hangs"]["stall_count"] == 1
    assert s["first_failure"]["rank"] == 1
    words = summary_text(s)
    assert f"HUNG until the end: {summary}" in words
    assert f"first failure: the job {summary}" in words
    assert f"after step {STEPS}" in words.split("stalls: 1")[1].splitlines()[0]

    seed = pickle.loads(pickle.dumps(st))  # what a dashboard attaching later is handed
    assert last_hang(seed)["summary"] == summary


def test_the_hang_view_keeps_the_hang_after_the_job_ended():
    sim = SimJob(ranks=3, gpu=False, amp=False)
    messages, end = killed_while_hung(sim)
    data = DashboardData()
    data.apply_messages(messages)
    view = hang_view(data, now=end + 23.0)
    assert view.hung and view.ended
    assert view.text.startswith(f"hung after step {STEPS} in all_reduce")
    assert "(culprit rank 1) for 35 s, then ended by SIGTERM" in view.text
    assert not view.text.startswith("no hang")
    culprit = next(row for row in view.rows if row.role == "culprit")
    assert culprit.rank == 1 and culprit.cells[2] == "running"  # as it stood when it ended


def test_a_user_stop_of_a_hung_job_keeps_the_hang_and_says_the_user_stopped_it():
    sim = SimJob(ranks=3, gpu=False, amp=False)
    messages = sim.run(STEPS) + sim.hang(1, STEPS, stuck_s=20.0)
    t = sim.end_t(STEPS) + 21.0
    stop = Message("job_stop", sim.job, protocol.HUB_RANK, 0, t, {
        "reason": "scalemon demo: quit (q)", "user": "ann", "host": "n1"})
    exits = [sim.message(r, "exit", {"reason": "signal", "exit_code": 143}, t + 0.5)
             for r in range(3)]
    st = folded(encoded([*messages, stop, *exits]))
    assert st.state == "stopped"
    assert {v.state_reason for v in st.ranks.values()} == {
        "stopped by user (scalemon demo: quit (q); ann@n1; ended by SIGTERM, exit 143)"}
    hang = last_hang(st)
    assert hang is not None and hang["culprits"] == [1]
    assert hang["summary"].endswith("for 21 s, then stopped by its user (scalemon demo: quit (q))")


def test_a_job_that_ends_without_hanging_keeps_no_hang():
    sim = SimJob(ranks=2, gpu=False, amp=False)
    st = folded(encoded(sim.run(STEPS, finish=True)))
    assert st.state == "finished" and last_hang(st) is None and first_failure(st) is None


def test_a_rank_killed_outright_and_found_gone_late_is_the_first_failure_not_a_hang():
    sim = SimJob(ranks=2, gpu=False, amp=False)
    messages = sim.run(STEPS)  # rank 1 killed (-9) right after its last step; the hub found
    gone = Message("rank_state", sim.job, protocol.HUB_RANK, 0, sim.end_t(STEPS) + 20.0, {
        "target": 1, "state": "gone",  # it gone 20 s later, past the hang threshold
        "reason": "process 101 ended without reporting an exit (killed?)"})
    st = folded(encoded([*messages, gone]))
    assert st.hang_end is None and last_hang(st) is None
    assert first_failure(st)["rank"] == 1 and first_failure(st)["state"] == "gone"


def test_the_hang_screen_says_the_job_ended_hung_with_its_culprit():
    sim = SimJob(ranks=3, gpu=False, amp=False)
    messages, end = killed_while_hung(sim)
    data = DashboardData()
    data.apply_messages(messages)

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: end + 23.0)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("h")
            await until(pilot, lambda: isinstance(app.screen, HangScreen)
                        and "JOB ENDED HUNG" in screen_text(app))
            text = " ".join(screen_text(app).split())
            assert f"hung after step {STEPS} in all_reduce" in text
            assert "(culprit rank 1) for 35 s, then ended by SIGTERM (ranks 0,1,2, exit 143)" \
                in text
            assert "no hang" not in text

    asyncio.run(scenario())
