"""The thresholds and classifications of `scalemon.policy`, and that the snapshot text and the
dashboard's node view classify the same ranks alike (both ask the policy)."""

from __future__ import annotations

import re

import pytest

from scalemon import policy
from scalemon.protocol import HUB_RANK, SILENT_RANK_STATES, Message
from scalemon.reports import snapshot_text
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.stragglers import stragglers_json
from scalemon.state.jobstate import VANISHED_STATES, JobState
from scalemon.text import display
from scalemon.tui.views import nodes as nodeview


@pytest.mark.parametrize(("median", "after"), [(None, 10.0), (0.5, 10.0), (2.0, 20.0)])
def test_stuck_after_is_ten_seconds_and_ten_median_steps(median, after):
    assert policy.stuck_after_s(median) == after


@pytest.mark.parametrize(("median", "bar"), [(None, 0.010), (0.05, 0.010), (0.2, 0.02)])
def test_the_straggler_bar_is_ten_ms_and_a_tenth_of_a_step(median, bar):
    assert policy.straggler_bar(median) == pytest.approx(bar)


@pytest.mark.parametrize(("state", "code", "phase", "since", "straggler", "status"), [
    ("running", None, "forward", 1.0, False, "running"),
    ("running", None, "forward", 1.0, True, "straggler"),
    ("running", None, "allreduce", 30.0, True, "stuck"),  # stuck wins over straggling
    ("running", None, None, 30.0, False, "running"),  # no phase: nothing to be stuck in
    ("restarting", None, "allreduce", 30.0, False, "restarting"),
    ("exited", 1, None, None, False, "failed"),
    ("exited", 0, None, None, False, "finished"),
    ("exited", None, None, None, False, "failed"),
    ("stopped", None, None, None, False, "finished"),
    ("finished", 0, None, None, False, "finished"),
    ("frozen", None, "allreduce", 30.0, False, "frozen"),
    ("gone", None, "allreduce", 30.0, False, "gone"),
    ("unreachable", None, None, None, False, "unreachable"),
    ("silent", None, None, None, False, "silent"),
    ("lost", None, "allreduce", 30.0, False, "silent"),  # a hub before 1.12: read as silent
])
def test_rank_status(state, code, phase, since, straggler, status):
    assert policy.rank_status(state, code, phase, since, straggler, 10.0) == status
    assert status in policy.NODE_STATES


def test_the_node_words_are_the_hubs_words_for_a_rank_that_stopped_sending():
    assert set(policy.GONE_KINDS) == set(VANISHED_STATES)
    assert {*policy.GONE_KINDS, "frozen"} == set(SILENT_RANK_STATES)
    assert set(policy.TROUBLE_KINDS) <= set(policy.NODE_STATES)
    assert "lost" not in policy.NODE_STATES
    for word in SILENT_RANK_STATES:
        assert policy.rank_kind(word, None) == word
    # a rank that failed or stopped sending puts its node first, whatever the word
    assert {display.node_order_key(kind, None, False, None, 0)[0]
            for kind in policy.TROUBLE_KINDS} == {0}


def test_snapshot_and_dashboard_classify_ranks_alike():
    st = JobState(job="j")
    seq = iter(range(1000))

    def apply(mtype: str, rank: int, body: dict) -> None:
        st.apply(Message(mtype, "j", rank, next(seq), 100.0, body))

    for r in range(5):
        apply("hello", r, {"host": f"h{r}", "pid": r, "world_size": 5, "local_rank": 0})
        apply("step", r, {"step": 1, "step_time_s": 0.1})
        apply("heartbeat", r, {"phase": "forward", "phase_since_s": 1.0, "dropped": 0})
    apply("heartbeat", 1, {"phase": "allreduce", "phase_since_s": 60.0, "dropped": 0})
    apply("exit", 2, {"reason": "exception", "exit_code": 1, "error": "boom"})
    apply("rank_state", HUB_RANK, {"target": 3, "state": "gone", "reason": "killed?"})
    apply("exit", 4, {"reason": "finished", "exit_code": 0})
    expected = {0: "running", 1: "stuck", 2: "failed", 3: "gone", 4: "finished"}
    stuck_after = policy.stuck_after_s(0.1)
    ranks = snapshot_json(st, now=101.0)["ranks"]
    snapshot = {r["rank"]: snapshot_text._snapshot_worst(r, {}, 0.01, stuck_after) for r in ranks}
    dashboard = {r: nodeview.rank_status(v, False, stuck_after) for r, v in st.ranks.items()}
    assert snapshot == dashboard == expected
    text = "\n".join(snapshot_text.node_snapshot_lines(ranks))
    for host, status in (("h1", "stuck"), ("h2", "failed"), ("h3", "gone")):
        assert any(line.startswith(host) and f" {status} " in line for line in text.splitlines())


def test_snapshot_text_names_stragglers_by_the_dashboards_measure_before_any_collective():
    """No rank has an arrival lateness yet: the text, like the dashboard and the JSON, ranks
    by compute time over the median rank's, with the same bar."""
    ranks = [{"rank": r, "state": "running", "host": f"h{r // 2}", "step": 3,
              "step_time_s": 0.1, "compute_over_median_s": 0.05 if r == 3 else 0.0,
              "arrival_lateness_s": None, "phase": "forward", "phase_since_s": 0.1}
             for r in range(4)]
    lines = snapshot_text.node_snapshot_lines(ranks)
    text = "\n".join(lines)
    assert "slowest ranks by compute time" in text and "a straggler from 10 ms" in text
    assert re.search(r"rank 3 +h1 +\+50\.0 ms  straggler", text), text
    assert [s["rank"] for s in stragglers_json(ranks)] == [3]
    assert any(line.startswith("h1 ") and " straggler " in line for line in lines), text
