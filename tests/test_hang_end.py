"""A job that ended hung keeps its hang: the snapshot, the summary and the hang view tell the
hang the job was in (its culprit, where the others waited, for how long) and how it ended; its
first failure is the hang, not the first rank killed. And a rank ended by a signal reads so."""

from __future__ import annotations

import asyncio
import pickle

import pytest
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
    assert st.first_failure() is None  # stopped, not failed
    assert st.hang_end is None  # it ended right after a step: no hang to keep
    text = format_snapshot(snapshot_json(st, now=sim.end_t(3) + 1.0))
    assert "exited (ended by SIGTERM, exit 143)" in text and "killed?" not in text


def test_a_job_killed_while_hung_keeps_its_hang_and_its_culprit_in_snapshot_and_summary():
    sim = SimJob(ranks=3, gpu=False, amp=False)
    messages, end = killed_while_hung(sim)
    st = folded(messages)
    later = end + 60.0
    assert st.state == "stopped"  # every rank ended, by SIGTERM: the hang is kept and told
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
    # the analysis as it stood when the job ended, each rank's state as of now: its end
    assert {row.rank: row.cells[2] for row in view.rows} == dict.fromkeys(range(3), "exited 143")
    assert culprit.rank == 1 and culprit.cells[3] == str(STEPS)


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
        "stopped by the user (scalemon demo: quit (q), ann@n1); ended by SIGTERM, exit 143"}
    hang = last_hang(st)
    assert hang is not None and hang["culprits"] == [1]
    assert hang["summary"].endswith(
        "for 21 s, then stopped by the user (scalemon demo: quit (q), ann@n1)")


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


def gone(sim: SimJob, rank: int, t: float, state: str = "gone") -> Message:
    """The hub's word that `rank` vanished at `t`."""
    why = ("process 101 ended without reporting an exit (killed?)" if state == "gone"
           else "no message for 5.0 s")
    return Message("rank_state", sim.job, protocol.HUB_RANK, 0, t,
                   {"target": rank, "state": state, "reason": why})


def test_a_job_that_exits_without_finish_after_a_long_final_save_keeps_no_hang():
    sim = SimJob(ranks=2, gpu=False, amp=False)
    messages = sim.run(STEPS)  # then a 30 s checkpoint save (heartbeats), then a plain exit
    t = sim.end_t(STEPS)
    messages += [sim.message(r, "heartbeat", sim.heartbeat(r, STEPS), t + k)
                 for k in range(1, 30, 2) for r in (0, 1)]
    messages += [sim.message(r, "exit", {"reason": "exit", "exit_code": None, "step": STEPS},
                             t + 30.0 + 0.01 * r) for r in (0, 1)]
    st = folded(encoded(messages))
    assert st.state == "finished" and st.hang_end is None
    assert last_hang(st) is None and first_failure(st) is None
    as_json = snapshot_json(st, now=t + 60.0)
    assert as_json["last_hang"] is None and as_json["first_failure"] is None
    assert "HUNG" not in format_snapshot(as_json)


def test_a_hung_job_whose_ranks_all_finish_after_the_users_stop_reads_finished_not_failed():
    sim = SimJob(ranks=3, gpu=False, amp=False)
    messages = sim.run(STEPS) + sim.hang(1, STEPS, stuck_s=20.0)
    t = sim.end_t(STEPS) + 21.0
    stop = Message("job_stop", sim.job, protocol.HUB_RANK, 0, t, {"reason": "quit (q)"})
    exits = [sim.message(r, "exit", {"reason": "finished", "exit_code": 0}, t + 0.5)
             for r in range(3)]  # the stalled step went through after all: every rank finished
    st = folded(encoded([*messages, stop, *exits]))
    assert st.state == "finished" and st.first_failure() is None
    assert last_hang(st) is None and first_failure(st) is None
    assert snapshot_json(st, now=t + 5.0)["last_hang"] is None


def test_a_rank_silent_in_a_long_stall_that_speaks_again_leaves_no_hang_behind():
    sim = SimJob(ranks=2, gpu=False, amp=False)
    messages = sim.run(STEPS)  # a 15 s stall; rank 1's node goes quiet, then it speaks again
    t = sim.end_t(STEPS)
    messages += [sim.message(r, "heartbeat", sim.heartbeat(r, STEPS), t + 12.0) for r in (0, 1)]
    st = folded(encoded([*messages, gone(sim, 1, t + 17.0, "silent")]))
    assert st.hang_end is not None  # it vanished past the hang threshold: kept, for now
    st.apply(sim.message(1, "heartbeat", sim.heartbeat(1, STEPS), t + 18.0))
    assert st.ranks[1].state == "running" and st.hang_end is None

    st = folded(encoded([*messages, gone(sim, 1, t + 17.0, "silent")]))
    sim.start_t += 20.0  # the stall ends: training goes on for 5 steps, then rank 0 raises
    later = [m for m in sim.run(STEPS + 5) if m.type == "step" and m.body["step"] > STEPS]
    st.apply(later[0])  # rank 0's next step, while rank 1 still reads silent: no hang then
    assert st.ranks[1].state == "silent" and st.hang_end is None
    for m in [*later[1:], sim.message(0, "exit", {"reason": "exception", "exit_code": 1,
                                                 "error": "ValueError: bad batch",
                                                 "step": STEPS + 5},
                                      sim.end_t(STEPS + 5) + 0.2)]:
        st.apply(m)
    assert st.hang_end is None and last_hang(st) is None
    assert first_failure(st)["rank"] == 0 and first_failure(st)["state"] == "exited"
    assert first_failure(st)["error"] == "ValueError: bad batch"


def attempt(sim: SimJob, messages: list[Message], count: int) -> list[Message]:
    """`messages` of torchrun's attempt `count` (of 3 restarts): their hellos say so."""
    return [sim.message(m.rank, "hello", {**m.body, "restart_count": count, "max_restarts": 3},
                        m.t) if m.type == "hello" else m for m in messages]


def test_a_torchrun_restart_forgets_the_kept_hang_and_keeps_the_next_attempts_own():
    sim = SimJob(ranks=3, gpu=False, amp=False)
    messages, end = killed_while_hung(sim)  # attempt 0 hangs on rank 1, which aborts (NCCL's
    messages = [sim.message(1, "exit", {**m.body, "exit_code": 134}, m.t)  # watchdog), then
                if m.type == "exit" and m.rank == 1 else m for m in messages]  # the rest stop
    st = folded(encoded(attempt(sim, messages, 0)))
    assert st.state == "restarting" and last_hang(st)["culprits"] == [1]

    sim.start_t = end + 5.0  # attempt 1 runs its steps: no hang now, and none kept
    st_next = pickle.loads(pickle.dumps(st))
    run = encoded(attempt(sim, sim.run(STEPS, finish=True), 1))
    for m in run[:3]:  # its hellos open the attempt: the last one's hang is not this one's
        st_next.apply(m)
    assert st_next.state == "running" and st_next.hang_end is None
    for m in run[3:]:
        st_next.apply(m)
    assert st_next.state == "finished" and st_next.hang_end is None
    assert last_hang(st_next) is None and first_failure(st_next) is None
    assert snapshot_json(st_next, now=end + 60.0)["last_hang"] is None

    sim.start_t = end + 5.0  # attempt 1 hangs too, for 15 s: its own hang is kept
    again, end2 = killed_while_hung(sim, stuck_s=15.0)
    for m in encoded(attempt(sim, again, 1)):
        st.apply(m)
    hang = last_hang(st)
    assert hang is not None and hang["ended_t"] == end2 and round(hang["since_s"]) == 15
    assert hang["culprits"] == [1] and first_failure(st)["state"] == "hung"


@pytest.mark.parametrize("waiting", [False, True], ids=["no_heartbeat", "waiting_for_it"])
def test_a_rank_killed_before_the_others_hang_stays_the_first_failure(waiting):
    sim = SimJob(ranks=3, gpu=False, amp=False)
    messages = sim.run(STEPS)  # rank 1 OOM-killed right after its last step, found gone 3 s
    t = sim.end_t(STEPS)  # later; ranks 0 and 2 wait in the next all-reduce, SIGTERMed at 60 s
    messages.append(gone(sim, 1, t + 3.0))
    if waiting:
        messages += [m for m in sim.hang(1, STEPS, stuck_s=59.0) if m.rank != 1]
    messages += [sim.message(r, "exit", {"reason": "signal", "exit_code": 143, "step": STEPS},
                             t + 60.0 + 0.01 * r) for r in (0, 2)]
    st = folded(encoded(messages))
    assert st.state == "lost"
    failure = first_failure(st)
    assert (failure["rank"], failure["state"]) == (1, "gone")
    assert failure["text"].startswith("rank 1 failed first (step 20): process 101 ended")
    hang = last_hang(st)  # the others did hang on it: kept, with rank 1 its culprit where told
    assert hang is not None and hang["culprits"] == ([1] if waiting else [])
    as_json = snapshot_json(st, now=t + 90.0)
    assert as_json["first_failure"]["rank"] == 1 and as_json["first_failure"]["state"] == "gone"

