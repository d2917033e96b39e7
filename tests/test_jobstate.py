"""The `JobState` reducer on its own: seq gaps, rank and job state changes, what a step keeps."""

from __future__ import annotations

import math

import pytest

from scalemon.protocol import HUB_RANK, Message
from scalemon.reports.hangs import job_hang
from scalemon.reports.snapshot import snapshot_json
from scalemon.state import alerts
from scalemon.state.jobstate import JobState


def msg(mtype: str, rank: int, seq: int, body: dict, t: float = 1.0) -> Message:
    return Message(mtype, "j", rank, seq, t, body)


def hello(rank: int, world: int = 2, seq: int = 0) -> Message:
    return msg("hello", rank, seq, {"host": "h", "pid": 100 + rank, "world_size": world,
                                    "local_rank": rank})


def test_seq_gaps_count_missing_messages_not_late_ones():
    state = JobState()
    state.apply(hello(0, 1))
    state.apply(msg("step", 0, 1, {"step": 1}))
    state.apply(msg("step", 0, 3, {"step": 2}))  # seq 2 dropped by the agent, or late
    assert state.ranks[0].seq_gaps == 1
    state.apply(msg("heartbeat", 0, 2, {"phase": "x", "dropped": 0}))  # it was late
    assert state.ranks[0].seq_gaps == 0
    state.apply(msg("step", 0, 7, {"step": 3}))
    assert state.ranks[0].seq_gaps == 3 and state.ranks[0].last_seq == 7
    state.apply(hello(0, 1, seq=0))  # a restarted process numbers from 0 again
    assert state.ranks[0].seq_gaps == 0 and state.ranks[0].seq_seen == 1


def test_rank_and_job_states_follow_hellos_losses_and_exits():
    state = JobState()
    assert state.state == "waiting"
    state.apply(hello(0))
    assert state.state == "running" and state.world_size == 2
    state.apply(hello(1))
    state.apply(msg("rank_state", HUB_RANK, 1, {"target": 1, "state": "lost",
                                                "reason": "no message for 5.1 s"}))
    assert state.ranks[1].state == "silent"  # a hub before 1.12 said lost: nothing looked
    assert state.ranks[1].state_reason == "no message for 5.1 s"
    assert state.state == "degraded"
    state.apply(msg("step", 1, 1, {"step": 1}))  # it speaks again
    assert state.ranks[1].state == "running" and state.ranks[1].state_reason is None
    assert state.state == "running"
    state.apply(msg("exit", 0, 2, {"reason": "exception", "exit_code": 1, "error": "boom",
                                   "dropped": 4}))
    assert state.ranks[0].state == "exited" and state.ranks[0].exit_code == 1
    assert state.ranks[0].error == "boom" and state.ranks[0].metrics["dropped"] == 4
    assert state.state == "degraded"
    state.apply(msg("exit", 1, 2, {"reason": "finished", "exit_code": 0}))
    assert state.state == "crashed"  # all stopped, the first failure a rank's own error
    state.apply(hello(0, seq=0))  # rank 0 restarted by torchrun
    assert state.ranks[0].state == "running" and state.ranks[0].error is None
    state.apply(msg("exit", 0, 1, {"reason": "finished", "exit_code": 0}))
    assert state.state == "finished"


def test_a_step_replaces_every_step_value_and_extras_keep_their_last_value():
    state = JobState()
    state.apply(msg("step", 0, 0, {"step": 1, "loss": 2.0, "loss_scale": 1024.0,
                                   "extra": {"lr": 0.1, "mfu": 0.3}}))
    state.apply(msg("step", 0, 1, {"step": 2, "loss": 1.5, "extra": {"lr": 0.2}}))
    view = state.ranks[0]
    assert view.step == 2 and view.steps_received == 2
    assert view.metrics["loss"] == 1.5 and view.metrics["loss_scale"] is None  # not stale
    assert view.extra == {"lr": 0.2, "mfu": 0.3} and view.value("mfu") == 0.3


def test_messages_of_a_newer_minor_type_change_nothing_but_bookkeeping():
    state = JobState()
    state.apply(msg("future_thing", 0, 0, {"anything": 1}))
    view = state.ranks[0]
    assert view.seq_seen == 1 and view.step is None and state.messages == 1


def lost(rank: int, reason: str = "process 101 ended without reporting an exit (killed?)",
         seq: int = 1) -> Message:
    return msg("rank_state", HUB_RANK, seq, {"target": rank, "state": "gone", "reason": reason})


def two_ranks() -> JobState:
    state = JobState()
    state.apply(hello(0))
    state.apply(hello(1))
    return state


def test_ranks_that_end_after_the_users_stop_are_stopped_not_lost_or_failed():
    state = two_ranks()
    state.apply(msg("job_stop", HUB_RANK, 1, {"reason": "scalemon demo: quit (q)",
                                              "user": "ann", "host": "n1"}))
    assert state.state == "stopping"
    state.apply(lost(0))  # killed by the stop's SIGTERM: no exit of its own
    state.apply(msg("exit", 1, 1, {"reason": "signal", "exit_code": 143}))  # its agent told
    views = state.ranks
    assert [views[0].state, views[1].state] == ["stopped", "stopped"]
    assert views[0].state_reason == ("stopped by the user (scalemon demo: quit (q), ann@n1); "
                                     "process 101 ended without reporting an exit")  # no guess
    assert views[1].state_reason == ("stopped by the user (scalemon demo: quit (q), ann@n1); "
                                     "ended by SIGTERM, exit 143") and views[1].exit_code == 143
    assert state.state == "stopped" and state.failed() == [] and state.first_failure() is None
    as_json = snapshot_json(state, now=2.0)
    assert as_json["state"] == "stopped" and as_json["stop"]["user"] == "ann"
    state.apply(hello(0, seq=0))  # the job id runs again: the old stop no longer holds
    state.apply(lost(0))
    assert state.stop is None and state.ranks[0].state == "gone"


def test_crashed_lost_hung_and_stopped_are_distinct_job_states():
    crashed = two_ranks()
    crashed.apply(msg("exit", 1, 1, {"reason": "exception", "exit_code": 1,
                                     "error": "InjectedCrash: boom"}, t=5.0))
    crashed.apply(msg("exit", 0, 1, {"reason": "exception", "exit_code": 1, "error":
                                     "RuntimeError: Connection closed by peer"}, t=6.0))
    assert crashed.state == "crashed" and crashed.first_failure()["rank"] == 1
    gone = two_ranks()
    gone.apply(lost(1))  # kill -9; rank 0 then fails only because its peer went away
    gone.apply(msg("exit", 0, 1, {"reason": "exception", "exit_code": 1, "error":
                                  "RuntimeError: Connection closed by peer"}, t=9.0))
    assert gone.state == "lost" and gone.first_failure()["rank"] == 1
    hung = two_ranks()
    hung.apply(msg("step", 0, 1, {"step": 1}, t=10.0))
    assert snapshot_json(hung, now=11.0)["state"] == "running"
    assert snapshot_json(hung, now=10.0 + hung.hang_after_s + 1)["state"] == "hung"
    assert hung.state == "running"  # the property knows no time; the JSON and hang() do


def test_a_job_whose_every_monitor_switched_off_is_not_called_hung():
    state = two_ranks()
    state.apply(msg("step", 0, 1, {"step": 1}, t=10.0))
    late = 10.0 + state.hang_after_s + 1
    state.apply(msg("monitor_off", 0, 2, {"reason": "log: boom", "step": 1}, t=10.5))
    assert job_hang(state, now=late) is not None  # rank 1 still reports: its silence counts
    state.apply(msg("monitor_off", 1, 1, {"reason": "log: boom", "step": 0}, t=10.5))
    assert job_hang(state, now=late) is None
    assert snapshot_json(state, now=late)["state"] == "running"


def test_a_script_that_ends_without_finish_has_not_failed():
    state = two_ranks()
    for rank in (0, 1):  # what the agent's atexit sends: no exit code, no error
        state.apply(msg("exit", rank, 1, {"reason": "exit", "exit_code": None}, t=5.0))
    assert [state.ranks[r].state for r in (0, 1)] == ["exited", "exited"]
    assert state.first_failure() is None and state.state == "finished"
    state.apply(msg("exit", 1, 2, {"reason": "exception", "exit_code": 1,
                                   "error": "ValueError: bad batch"}, t=6.0))
    assert state.first_failure()["rank"] == 1 and state.state == "crashed"


def step(rank: int, seq: int, n: int, **body: object) -> Message:
    return msg("step", rank, seq, {"step": n, **body}, t=float(n))


def test_a_nan_loss_is_an_alert_on_the_very_message_that_carries_it():
    state = two_ranks()
    for n in range(1, 7):
        state.apply(step(0, n, n, loss=2.0))
        state.apply(step(1, n, n, loss=2.0))
    assert snapshot_json(state, now=7.0)["alerts"] == []
    state.apply(step(1, 7, 7, loss=float("nan")))
    (alert,) = snapshot_json(state, now=7.0)["alerts"]
    assert alert["kind"] == "loss_not_finite" and alert["ranks"] == [1]
    assert alert["since_step"] == 7 and alert["text"] == "loss is NaN on rank 1 since step 7"
    assert snapshot_json(state, now=7.0)["ranks"][1]["alerts"][0]["since_step"] == 7
    state.apply(step(0, 7, 7, loss=float("inf")))
    state.apply(step(1, 8, 8, loss=float("nan")))
    (alert,) = state.alerts()
    assert alert["ranks"] == [0, 1] and alert["since_step"] == 7  # where it began
    state.apply(step(0, 8, 8, loss=1.0))
    state.apply(step(1, 9, 9, loss=1.0))
    assert state.alerts() == []  # a finite loss again clears it
    assert state.state == "running"  # an alert is not a lifecycle state


@pytest.mark.parametrize("scales, since", [
    ([65536.0, 2.0, 1.0, 0.5, 0.25], 4),  # halved below the floor at step 4
    ([0.5], 1),
])
def test_a_loss_scale_below_its_floor_is_an_alert_from_the_step_it_fell(scales, since):
    state = two_ranks()
    for n, scale in enumerate(scales, start=1):
        state.apply(step(0, n, n, loss=1.0, loss_scale=scale))
    (alert,) = state.alerts()
    assert alert["kind"] == "loss_scale_floor" and alert["since_step"] == since
    assert alert["value"] == scales[-1] and alerts.SCALE_FLOOR == 1.0
    state.apply(step(0, 9, 9, loss=1.0, loss_scale=2.0))
    assert state.alerts() == []


def test_steps_skipped_in_a_row_are_an_alert_from_the_first_of_them():
    state = two_ranks()
    skipped = [False, True, False, True, True, True, True, False]
    for n, was in enumerate(skipped, start=1):
        state.apply(step(0, n, n, loss=1.0, loss_scale=1024.0, skipped=was))
        found = state.alerts()
        if n in (6, 7):  # the 3rd and 4th skipped in a row (steps 4..7)
            assert [a["kind"] for a in found] == ["skipped_steps"]
            assert found[0]["since_step"] == 4 and found[0]["value"] == n - 3
            assert found[0]["text"].startswith(f"{n - 3} optimizer steps skipped in a row")
        else:
            assert found == [], n
    assert alerts.SKIPPED_IN_A_ROW == 3


def test_a_restarted_rank_starts_without_alerts():
    state = two_ranks()
    state.apply(step(0, 1, 1, loss=math.nan))
    assert state.alerts()
    state.apply(hello(0, seq=0))
    assert state.alerts() == [] and state.ranks[0].alerts == {}


def test_tokens_per_s_is_the_scripts_own_else_its_steps_tokens_over_their_wall_time():
    from scalemon.metrics import derived_values
    from scalemon.state.fold import step_values

    state = two_ranks()
    state.apply(step(0, 1, 1, tokens=512))  # the first step of a process has no step time
    assert state.ranks[0].value("tokens_per_s") is None
    state.apply(step(0, 2, 2, tokens=512, step_time_s=0.25))
    assert state.ranks[0].value("tokens_per_s") == 2048.0
    state.apply(step(0, 3, 3, tokens=512, step_time_s=0.75))  # the window: both steps' time
    assert state.ranks[0].value("tokens_per_s") == 1024.0  # 1024 tokens over 1 s, not 682.7
    assert step_values({"step": 3, "tokens": 512, "step_time_s": 0.75},
                       derived_values({}, 1024.0))["tokens_per_s"] == 1024.0
    assert "tokens_per_s" not in step_values({"step": 2}, derived_values({}, None))
    state.apply(step(0, 4, 4, tokens=512, step_time_s=0.25, extra={"tokens_per_s": 1000.0}))
    assert state.ranks[0].value("tokens_per_s") == 1000.0  # what the script measured wins
    assert "tokens_per_s" not in state.ranks[0].derived  # and is never mixed with the steps'
    state.apply(step(0, 5, 5, tokens=512, step_time_s=0.25))  # a step it did not measure
    assert state.ranks[0].value("tokens_per_s") == 1000.0  # its last own value stands
    state.apply(hello(1, seq=0))
    state.apply(step(1, 1, 1, tokens=100, step_time_s=0.5))
    state.apply(hello(1, seq=2))  # a new process: no step of the old one in its window
    state.apply(step(1, 3, 1, tokens=100, step_time_s=0.1))
    assert state.ranks[1].value("tokens_per_s") == pytest.approx(1000.0)


def attempt_hello(rank: int, count: int, t: float) -> Message:
    return msg("hello", rank, 0, {"host": "h", "pid": 100 + rank + 10 * count, "world_size": 2,
                                  "local_rank": rank, "restart_count": count,
                                  "max_restarts": 1}, t=t)


def test_a_torchrun_restart_is_one_job_whose_attempts_keep_the_first_failure():
    state = JobState()
    for rank in (0, 1):
        state.apply(attempt_hello(rank, 0, t=1.0))
    state.apply(msg("step", 0, 1, {"step": 4}, t=2.0))
    state.apply(msg("step", 1, 1, {"step": 4}, t=2.0))
    state.apply(msg("exit", 1, 2, {"reason": "exception", "exit_code": 1,
                                   "error": "InjectedCrash: --inject-crash 1:5"}, t=3.0))
    state.apply(msg("rank_state", HUB_RANK, 1, {"target": 0, "state": "gone",
                                                "reason": "process 100 ended"}, t=3.5))
    # every rank of attempt 1 ended, and torchrun has a restart left: not crashed, restarting
    assert state.state == "restarting"
    assert state.hang_possible() is False
    for rank in (0, 1):
        state.apply(attempt_hello(rank, 1, t=5.0))
    assert state.state == "running" and state.ranks[1].error is None
    state.apply(msg("step", 0, 1, {"step": 12}, t=8.0))
    for rank in (0, 1):
        state.apply(msg("exit", rank, 2, {"reason": "finished", "exit_code": 0}, t=9.0))
    assert state.state == "finished" and state.first_failure() is None
    first, second = snapshot_json(state, now=10.0)["attempts"]
    assert first["attempt"] == 0 and first["how"] == "crashed" and first["end"] == 3.5
    assert first["start"] == 1.0 and first["last_step"] == 4
    assert first["first_failure"].startswith("rank 1 failed first (step 4): InjectedCrash")
    assert second == {"attempt": 1, "start": 5.0, "end": 9.0, "how": "finished",
                      "first_failure": None, "last_step": 12}
    # a crash in the last attempt is the job's end: crashed
    again = JobState()
    for count in (0, 1):
        for rank in (0, 1):
            again.apply(attempt_hello(rank, count, t=1.0 + count))
        for rank in (0, 1):
            again.apply(msg("exit", rank, 1, {"reason": "exception", "exit_code": 1,
                                              "error": "boom"}, t=1.5 + count))
    assert again.state == "crashed" and len(again.attempts_json()) == 2


def test_a_big_groups_members_come_from_its_first_rank_and_the_others_empty_lists_say_nothing():
    """At 16,384 ranks every rank listing the default group would send 16,384^2 numbers:
    above GROUP_LISTED_BY_ALL only the group's first rank lists them (agent/recorder.py)."""
    from scalemon.agent.recorder import GROUP_LISTED_BY_ALL, wire_group

    n = GROUP_LISTED_BY_ALL + 1
    group = {"desc": "default_pg", "ranks": list(range(n))}
    assert wire_group(group, 0) is group
    assert wire_group(group, 7) == {"desc": "default_pg", "ranks": [], "size": n}
    small = {"desc": "tp", "ranks": [4, 5]}
    assert wire_group(small, 5) is small  # a small group: every rank lists it, as before
    st = JobState()
    for rank in (7, 0):  # the first rank's list may come after others' empty ones
        st.apply(hello(rank, world=n))
        st.apply(msg("collectives", rank, 1, {"groups": {"0": wire_group(group, rank)},
                                              "stats": [], "issues": []}))
    assert st.groups["0"]["ranks"] == list(range(n))
    assert st.arrival.members["0"] == tuple(range(n))
