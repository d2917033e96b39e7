"""One tokens/s (`scalemon.throughput`): tokens over the wall time between step ends, per rank;
the job's the ranks' sum (a tp group and a pipeline once); the same figure in the dashboard,
`snapshot` (text and --json), `summary` and the demo trainer's printed line."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys

import pytest
from test_e2e import job_env, snapshot

from conftest import kill_tree, torchrun_cmd
from scalemon import throughput
from scalemon.protocol import Message
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.snapshot_text import format_snapshot
from scalemon.reports.summary import run_records, summarize
from scalemon.reports.summary_text import summary_text
from scalemon.state.jobstate import JobState
from scalemon.throughput import TokenWindow, counts_for_job, job_tokens_per_s
from scalemon.tui.model import DashboardData
from scalemon.tui.views.overview import overview


def msg(mtype: str, rank: int, seq: int, body: dict, t: float = 0.0) -> Message:
    return Message(mtype, "tp", rank, seq, t, body)


def hello(rank: int, world: int) -> Message:
    return msg("hello", rank, 0, {"host": "h", "pid": 100 + rank, "world_size": world,
                                  "local_rank": rank})


def test_a_window_is_its_steps_tokens_over_their_wall_time_between_step_ends():
    w = TokenWindow()
    assert w.rate() is None
    w.add(512, None)  # a process's first step: no step ended before it
    w.add(True, 0.1)  # not a count of tokens
    w.add(512, float("nan"))
    assert w.rate() is None
    w.add(512, 0.068)
    assert w.rate() == pytest.approx(512 / 0.068)  # 7.5k, whatever part of it was a sleep
    w.add(1024, 0.132)
    assert w.rate() == pytest.approx(1536 / 0.2)  # summed, not a mean of the steps' rates
    for _ in range(200):  # 20 s of steps: only the last 10 s are in the window
        w.add(100, 0.1)
    assert sum(s for _, s in w.steps) <= throughput.WINDOW_S + 1e-9
    assert w.rate() == pytest.approx(1000.0)
    w.add(50, 60.0)  # one long step is a window of its own
    assert list(w.steps) == [(50, 60.0)] and w.rate() == pytest.approx(50 / 60)
    for _ in range(throughput.WINDOW_STEPS + 10):
        w.add(1, 1e-4)
    assert len(w.steps) == throughput.WINDOW_STEPS
    assert throughput.tokens_per_s(10, 0.0) is None


def test_the_job_counts_a_tp_group_and_a_pipeline_once_and_every_data_parallel_rank():
    assert counts_for_job(None) and counts_for_job({"dp": 3})
    assert counts_for_job({"pp": 0, "dp": 1, "tp": 0})
    assert not counts_for_job({"dp": 0, "tp": 1}) and not counts_for_job({"pp": 1, "dp": 0})
    assert job_tokens_per_s([(1000.0, None), (2000.0, None), (None, None)]) == 3000.0
    assert job_tokens_per_s([(None, None)]) is None
    # dp 2 x tp 2: ranks 0,1 are one replica's tp group, 2,3 the other's
    mesh = [{"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]
    assert job_tokens_per_s(zip([1e3, 1e3, 2e3, 2e3], mesh, strict=True)) == 3e3


def fed_state(world: int, step_times: list[float], tokens: int = 512,
              extra: dict | None = None, mesh: list[dict] | None = None) -> JobState:
    state = JobState()
    for rank in range(world):
        state.apply(hello(rank, world))
        if mesh is not None:
            state.apply(msg("info", rank, 1, {"key": "mesh", "value": {
                "coords": mesh[rank], "shape": {"dp": 2, "tp": 2}}}))
        for n, step_time in enumerate(step_times, 1):
            body = {"step": n, "tokens": tokens, "step_time_s": step_time if n > 1 else None}
            if extra:
                body["extra"] = extra
            state.apply(msg("step", rank, 1 + n, body, t=float(n)))
    return state


def test_snapshot_json_and_text_carry_each_ranks_figure_and_the_jobs_their_sum():
    state = fed_state(2, [0.068] * 10)
    snap = snapshot_json(state, now=20.0)
    per_rank = [r["tokens_per_s"] for r in snap["ranks"]]
    assert per_rank == pytest.approx([512 / 0.068] * 2)
    assert [r["tokens_per_s_source"] for r in snap["ranks"]] == ["steps", "steps"]
    assert snap["tokens_per_s"] == pytest.approx(sum(per_rank))
    assert snap["tokens_per_s_source"] == "steps"
    text = format_snapshot(snap)
    assert "tokens/s 15.1k" in text.splitlines()[0]
    assert text.splitlines()[1].split()[-2:] == ["host", "state"] and " tok/s " in text
    tp = snapshot_json(fed_state(4, [0.1] * 5, mesh=[
        {"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]))
    assert [r["tokens_per_s"] for r in tp["ranks"]] == pytest.approx([5120.0] * 4)
    assert tp["tokens_per_s"] == pytest.approx(2 * 5120.0)  # the two replicas, tp peers once


def test_a_scripts_own_rate_is_shown_labelled_as_the_scripts():
    state = fed_state(2, [0.068] * 4, extra={"tokens_per_s": 42818.3})
    snap = snapshot_json(state, now=20.0)
    assert [r["tokens_per_s"] for r in snap["ranks"]] == [42818.3, 42818.3]
    assert snap["tokens_per_s_source"] == "script" and snap["tokens_per_s"] == 2 * 42818.3
    text = format_snapshot(snap)
    assert "tokens/s (script) 85.6k" in text.splitlines()[0]
    assert "tok/s (script)" in text.splitlines()[1]
    data = DashboardData()
    data.apply_messages([m for m in _messages(2, [0.068] * 4, {"tokens_per_s": 42818.3})])
    view = overview(data, now=20.0)
    assert view.summary.tokens_label == "tokens/s (script)"
    assert view.summary.tokens_per_s == pytest.approx(2 * 42818.3)
    assert "tok/s (script)" in [c.heading for c in view.columns]


def _messages(world: int, step_times: list[float], extra: dict | None = None) -> list[Message]:
    out = []
    for rank in range(world):
        out.append(hello(rank, world))
        for n, step_time in enumerate(step_times, 1):
            body = {"step": n, "tokens": 512, "step_time_s": step_time if n > 1 else None}
            if extra:
                body["extra"] = dict(extra)
            out.append(msg("step", rank, n, body, t=100.0 + n))
    return out


def test_dashboard_rows_add_up_to_its_header_and_match_the_snapshot_and_summary():
    times = [0.068 + 0.004 * (n % 3) for n in range(40)]  # some steps slower
    messages = _messages(2, times)
    data = DashboardData()
    data.apply_messages(messages)
    view = overview(data, now=200.0)
    at = [c.key for c in view.columns].index("tokens_per_s")
    state = JobState()
    for m in messages:
        state.apply(m)
    snap = snapshot_json(state, now=200.0)
    rates = [r["tokens_per_s"] for r in snap["ranks"]]
    assert rates == pytest.approx([512 * 39 / sum(times[1:])] * 2)  # all 2.8 s: one window
    assert [row.cells[at] for row in view.rows] == [f"{rates[0] / 1e3:.1f}k"] * 2
    assert view.summary.tokens_per_s == pytest.approx(snap["tokens_per_s"])
    assert view.summary.tokens_label == "tokens/s"
    s = summarize(snap, run_records(messages))
    assert s["tokens_per_s"]["source"] == "steps"
    assert s["tokens_per_s"]["job"]["median"] == pytest.approx(snap["tokens_per_s"], rel=0.02)
    assert s["tokens_per_s"]["per_rank"]["median"] == pytest.approx(rates[0], rel=0.02)
    assert s["tokens_per_s"]["job"]["samples"] == 39  # the first step has no time
    assert "tokens/s: job median" in summary_text(s)


@pytest.mark.integration
def test_demo_with_step_delay_shows_one_wall_tokens_per_s_everywhere(home):
    """`--step-delay 0.05` (issue 38): the snapshot's per-rank tokens/s is the step's tokens
    over its measured wall time (sleep included), the ranks add up to the job, and `summary`
    and the trainer's printed line say the same figure."""
    stats = home / "stats.json"
    proc = subprocess.Popen(
        torchrun_cmd("--monitor", "--preset", "tiny", "--step-delay", "0.05", "--max-steps",
                     "40", "--stats-json", str(stats)),
        env=job_env(home, "tps1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_tree(proc)
    assert proc.returncode == 0, out[-3000:]
    step_times = json.loads(stats.read_text())["step_times_s"]
    wall = statistics.median(step_times[1:])  # the trainer's own clock, per loop iteration
    assert wall > 0.05
    state = snapshot(home, "tps1")
    ranks = state["ranks"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["tokens_per_s_source"] == "steps" and "tokens_per_s" not in r["extra"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / wall, rel=0.15), (r, wall)
    assert state["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in ranks))
    summary = subprocess.run([sys.executable, "-m", "scalemon", "summary", "tps1", "--json"],
                             env=job_env(home, "unused"), capture_output=True, text=True,
                             timeout=120)
    assert summary.returncode == 0, summary.stderr
    tps = json.loads(summary.stdout)["tokens_per_s"]
    assert tps["job"]["median"] == pytest.approx(state["tokens_per_s"], rel=0.15)
    printed = re.search(r"^throughput: ([\d,]+) tokens/s per rank", out, re.M)
    assert printed, out[-2000:]
    per_rank = float(printed.group(1).replace(",", ""))
    assert per_rank == pytest.approx(ranks[0]["tokens_per_s"], rel=0.15)
