"""The `JobState` reducer on its own: seq gaps, rank and job state changes, what a step keeps."""

from __future__ import annotations

from scalemon.jobstate import JobState
from scalemon.protocol import HUB_RANK, Message


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
    assert state.ranks[1].state == "lost"
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
    assert state.state == "ended"  # all stopped, not all finished
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
