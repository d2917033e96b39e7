"""The number of ranks a job's fold expects at each step (`JobFold._expected`: running ranks
that completed a step) is kept up to date as records change ranks' states, equal to a count over
every rank whatever the records (property-based, with hypothesis), without that count after
each change: a wave of rank states in a big job (a hub behind, a node lost) used to cost the
hub ranks x changes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scalemon.protocol import HUB_RANK, Message
from scalemon.state.fold import JobFold

RANKS = 4
STATES = ("lost", "silent", "running", "exited", "frozen", "unreachable", "gone")
ACTIONS = st.lists(st.one_of(
    st.tuples(st.just("hello"), st.integers(0, RANKS - 1)),
    st.tuples(st.just("step"), st.integers(0, RANKS - 1)),
    st.tuples(st.just("heartbeat"), st.integers(0, RANKS - 1)),
    st.tuples(st.just("exit"), st.integers(0, RANKS - 1), st.sampled_from((0, 1))),
    st.tuples(st.just("rank_state"), st.integers(0, RANKS - 1), st.sampled_from(STATES)),
    st.tuples(st.just("job_stop"), st.just(0)),
), max_size=60)


class Records:
    """Messages of a small job, numbered as a hub numbers them."""

    def __init__(self) -> None:
        self.seq = 0
        self.steps = [0] * RANKS
        self.t = 1000.0

    def make(self, action: tuple[Any, ...]) -> Message:
        kind, rank = action[0], action[1]
        self.seq += 1
        self.t += 0.1
        body: dict[str, Any]
        if kind == "hello":
            body = {"host": "n0", "pid": 100 + rank, "local_rank": rank, "world_size": RANKS}
        elif kind == "step":
            self.steps[rank] += 1
            body = {"step": self.steps[rank], "loss": 1.0, "step_time_s": 0.1}
        elif kind == "heartbeat":
            body = {"step": self.steps[rank]}
        elif kind == "exit":
            body = {"reason": "finished" if action[2] == 0 else "exit", "exit_code": action[2]}
        elif kind == "rank_state":
            body = {"target": rank, "state": action[2], "reason": "test"}
            rank = HUB_RANK
        else:
            body = {"reason": "test"}
            rank = HUB_RANK
        return Message(kind, "j", rank, self.seq, self.t, body)


@settings(max_examples=300, deadline=None)
@given(ACTIONS)
def test_the_ranks_expected_at_each_step_are_the_running_ranks_that_stepped(actions) -> None:
    fold, records = JobFold(job="j"), Records()
    for r in range(RANKS):  # every rank says hello first, as a rank's agent does
        fold.apply(records.seq, records.make(("hello", r)))
    for action in actions:
        fold.apply(records.seq, records.make(action))
        if action[0] == "step":
            assert fold._expected is not None  # a step needs it: counted then, kept after
        if fold._expected is not None:
            assert fold._expected == fold._running_ranks(), action


def test_a_wave_of_rank_states_between_steps_is_not_counted_over_every_rank_each_time(
        monkeypatch) -> None:
    fold, records = JobFold(job="j"), Records()
    for r in range(RANKS):
        fold.apply(records.seq, records.make(("hello", r)))
        fold.apply(records.seq, records.make(("step", r)))
    counts = []
    real = fold._running_ranks
    monkeypatch.setattr(fold, "_running_ranks", lambda: counts.append(1) or real())
    for _ in range(50):  # ranks 2 and 3 lost, then heard again; a step of rank 0 between
        for r in (2, 3):
            fold.apply(records.seq, records.make(("rank_state", r, "lost")))
        fold.apply(records.seq, records.make(("step", 0)))
        assert fold._expected == 2
        for r in (2, 3):
            fold.apply(records.seq, records.make(("heartbeat", r)))
        fold.apply(records.seq, records.make(("step", 0)))
        assert fold._expected == 4
    assert counts == []


def test_a_record_the_reducer_fails_on_leaves_the_count_to_be_made_again() -> None:
    fold, records = JobFold(job="j"), Records()
    for r in range(RANKS):
        fold.apply(records.seq, records.make(("hello", r)))
        fold.apply(records.seq, records.make(("step", r)))
    assert fold._expected == RANKS
    broken = Message("step", "j", 1, 99, 2000.0, {"loss": 1.0})  # no `step`: the reducer fails
    with pytest.raises(KeyError):
        fold.apply(records.seq, broken)
    assert fold._expected is None  # counted again at the next step, not trusted
    fold.apply(records.seq, records.make(("step", 0)))
    assert fold._expected == fold._running_ranks() == RANKS
