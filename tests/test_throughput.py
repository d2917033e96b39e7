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
from scalemon.throughput import TokenWindow, counted, job_tokens_per_s
from scalemon.tui.model import DashboardData
from scalemon.tui.views.overview import overview
from scalemon.tui.views.rank_detail import rank_detail


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
    mesh = {"a": None, "b": {"dp": 3}, "c": {"pp": 0, "dp": 1, "tp": 0},
            "d": {"dp": 0, "tp": 1}, "e": {"pp": 1, "dp": 1, "tp": 0}}
    assert counted(mesh.items()) == ["a", "b", "c", "d"]  # e: c's pipeline
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
    snap = snapshot_json(state, now=10.5)  # half a second after the last step
    per_rank = [r["tokens_per_s"] for r in snap["ranks"]]
    assert per_rank == pytest.approx([512 / 0.068] * 2)
    assert [r["tokens_per_s_source"] for r in snap["ranks"]] == ["steps", "steps"]
    assert snap["tokens_per_s"] == pytest.approx(sum(per_rank))
    assert snap["tokens_per_s_source"] == "steps"
    text = format_snapshot(snap)
    assert "tokens/s 15.1k" in text.splitlines()[0]
    assert text.splitlines()[1].split()[-2:] == ["host", "state"] and " tok/s " in text
    tp = snapshot_json(fed_state(4, [0.1] * 5, mesh=[
        {"dp": 0, "tp": 0}, {"dp": 0, "tp": 1}, {"dp": 1, "tp": 0}, {"dp": 1, "tp": 1}]),
        now=5.5)
    assert [r["tokens_per_s"] for r in tp["ranks"]] == pytest.approx([5120.0] * 4)
    assert tp["tokens_per_s"] == pytest.approx(2 * 5120.0)  # the two replicas, tp peers once


def test_a_scripts_own_rate_is_shown_labelled_as_the_scripts():
    state = fed_state(2, [0.068] * 4, extra={"tokens_per_s": 42818.3})
    snap = snapshot_json(state, now=4.5)
    assert [r["tokens_per_s"] for r in snap["ranks"]] == [42818.3, 42818.3]
    assert snap["tokens_per_s_source"] == "script" and snap["tokens_per_s"] == 2 * 42818.3
    text = format_snapshot(snap)
    assert "tokens/s (script) 85.6k" in text.splitlines()[0]
    assert "tok/s (script)" in text.splitlines()[1]
    data = DashboardData()
    data.apply_messages([m for m in _messages(2, [0.068] * 4, {"tokens_per_s": 42818.3})])
    view = overview(data, now=104.5)
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
    view = overview(data, now=140.5)  # half a second after the last step
    at = [c.key for c in view.columns].index("tokens_per_s")
    state = JobState()
    for m in messages:
        state.apply(m)
    snap = snapshot_json(state, now=140.5)
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


def _views(messages: list[Message], now: float) -> tuple[dict, object, DashboardData]:
    """(snapshot --json, the dashboard's overview, its data) of `messages` at `now`."""
    state = JobState()
    for m in messages:
        state.apply(m)
    data = DashboardData()
    data.apply_messages(messages)
    return snapshot_json(state, now=now), overview(data, now=now), data


def _tokens_fact(data: DashboardData, rank: int, now: float) -> str:
    detail = rank_detail(data, rank, now)
    assert detail is not None
    return dict(detail.facts)["steps/s  tokens/s"].split()[-1]


def test_a_hung_job_reads_0_tokens_per_s_and_an_ended_one_none_everywhere():
    """Review of issue 38: a job whose steps stopped 35 s ago (its heartbeats going on) and
    the same job after it crashed showed its full earlier rate in the header and --json."""
    rate = 512 / 0.068
    steps = _messages(2, [0.068] * 10)  # steps end at t=101..110
    beats = [msg("heartbeat", r, 20 + k, {}, t=111.0 + k) for k in range(35) for r in (0, 1)]
    snap, view, _ = _views(steps + beats, now=114.0)  # 4 s without a step: still its rate
    assert snap["tokens_per_s"] == pytest.approx(2 * rate)
    assert view.summary.tokens_per_s == pytest.approx(2 * rate)
    for now in (115.5, 145.0):  # 5.5 s and 35 s without a step, heartbeats all along
        snap, view, data = _views(steps + beats, now=now)
        at = [c.key for c in view.columns].index("tokens_per_s")
        assert snap["tokens_per_s"] == 0.0 and view.summary.tokens_per_s == 0.0
        assert [r["tokens_per_s"] for r in snap["ranks"]] == [0.0, 0.0]
        assert [row.cells[at] for row in view.rows] == ["0.0", "0.0"]
        assert _tokens_fact(data, 1, now) == "0.0"
        assert snap["last_tokens_per_s"] == pytest.approx(2 * rate)  # what it did before
        assert "tokens/s 0.0" in format_snapshot(snap).splitlines()[0]
    crashed = steps + beats + [msg("exit", r, 90, {"reason": "error", "exit_code": 1},
                                   t=146.0) for r in (0, 1)]
    snap, view, data = _views(crashed, now=146.5)  # ended half a second after its last step
    at = [c.key for c in view.columns].index("tokens_per_s")
    assert snap["tokens_per_s"] is None and view.summary.tokens_per_s is None
    assert [r["tokens_per_s"] for r in snap["ranks"]] == [None, None]
    assert [row.cells[at] for row in view.rows] == ["n/a", "n/a"]
    assert _tokens_fact(data, 0, 146.5) == "n/a"
    assert "tokens/s" not in format_snapshot(snap).splitlines()[0]
    assert [r["last_tokens_per_s"] for r in snap["ranks"]] == pytest.approx([rate, rate])
    assert snap["last_tokens_per_s"] == pytest.approx(2 * rate)
    assert snap["tokens_per_s_source"] == "steps"


def test_slow_steps_keep_their_live_figure_for_three_step_times():
    slow = fed_state(1, [20.0] * 3)  # its last step at t=3 took 20 s
    assert snapshot_json(slow, now=3.0 + 50)["tokens_per_s"] == pytest.approx(512 / 20)
    assert snapshot_json(slow, now=3.0 + 61)["tokens_per_s"] == 0.0
    assert snapshot_json(fed_state(1, [0.5] * 3), now=3.0 + 4)["tokens_per_s"] == 1024.0
    assert snapshot_json(fed_state(1, [0.5] * 3), now=3.0 + 6)["tokens_per_s"] == 0.0


def test_the_openmetrics_gauge_is_the_live_figure_0_when_stalled_and_absent_once_ended():
    """A scrape of a stalled job said its earlier full rate (the gauge read the last value)."""
    from scalemon.hub.openmetrics import families

    def gauge(state: JobState, now: float) -> list[float]:
        found = {f.name: f for f in families(state, "j", now=now)}["scalemon_tokens_per_second"]
        return [s.value for s in found.samples]

    state = fed_state(1, [0.5] * 3)  # its last step ended at t=3
    assert gauge(state, 4.0) == [1024.0]
    assert gauge(state, 9.0) == [0.0]  # 6 s without a step
    state.apply(msg("exit", 0, 9, {"reason": "error", "exit_code": 1}, t=9.5))
    assert gauge(state, 10.0) == []


def _mesh_messages(mesh: list[dict], logs_tokens: list[bool]) -> list[Message]:
    """Ranks at `mesh` coordinates, 6 steps of 0.1 s; the ones `logs_tokens` log 512 tokens."""
    shape = {dim: 1 + max(c[dim] for c in mesh) for dim in mesh[0]}
    out = []
    for rank, coords in enumerate(mesh):
        out += [hello(rank, len(mesh)),
                msg("info", rank, 1, {"key": "mesh", "value": {"coords": coords, "shape": shape}})]
        for n in range(1, 7):
            body: dict = {"step": n, "step_time_s": 0.1 if n > 1 else None}
            if logs_tokens[rank]:
                body["tokens"] = 512
            out.append(msg("step", rank, 1 + n, body, t=100.0 + n))
    return out


def test_a_pipeline_counts_the_stage_that_logs_tokens_and_tp_axes_of_any_name():
    """Review of issue 38: a pipeline that logs tokens on its last stage only had no job
    figure, and a mesh named data x tensor counted its tensor peers each."""
    pp = [{"dp": 0, "pp": 0}, {"dp": 0, "pp": 1}, {"dp": 1, "pp": 0}, {"dp": 1, "pp": 1}]
    messages = _mesh_messages(pp, [False, True, False, True])
    snap, view, _ = _views(messages, now=106.5)
    assert [r["tokens_per_s"] for r in snap["ranks"]] == [None, 5120.0, None, 5120.0]
    assert snap["tokens_per_s"] == pytest.approx(2 * 5120.0)  # the two pipelines' last stages
    assert view.summary.tokens_per_s == pytest.approx(2 * 5120.0)
    s = summarize(snap, run_records(messages))
    assert s["tokens_per_s"]["job"]["median"] == pytest.approx(2 * 5120.0)
    every = _mesh_messages(pp, [True] * 4)  # every stage logs: the first stages' rows add up
    assert _views(every, now=106.5)[0]["tokens_per_s"] == pytest.approx(2 * 5120.0)
    named = [{"data": 0, "tensor": 0}, {"data": 0, "tensor": 1},
             {"data": 1, "tensor": 0}, {"data": 1, "tensor": 1}]
    snap, view, _ = _views(_mesh_messages(named, [True] * 4), now=106.5)
    assert snap["tokens_per_s"] == pytest.approx(2 * 5120.0)  # tensor peers once
    assert view.summary.tokens_per_s == pytest.approx(2 * 5120.0)
    pipe = [{"pipe": p, "model": m} for p in (0, 1) for m in (0, 1)]  # one model replica
    assert _views(_mesh_messages(pipe, [True] * 4), now=106.5)[0]["tokens_per_s"] == \
        pytest.approx(5120.0)


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
    for r in ranks:  # finished: no live rate, the last one as last_tokens_per_s
        assert r["tokens_per_s_source"] == "steps" and "tokens_per_s" not in r["extra"]
        assert r["tokens_per_s"] is None
        assert r["last_tokens_per_s"] == pytest.approx(r["tokens"] / wall, rel=0.15), (r, wall)
    assert state["tokens_per_s"] is None
    assert state["last_tokens_per_s"] == pytest.approx(
        sum(r["last_tokens_per_s"] for r in ranks))
    summary = subprocess.run([sys.executable, "-m", "scalemon", "summary", "tps1", "--json"],
                             env=job_env(home, "unused"), capture_output=True, text=True,
                             timeout=120)
    assert summary.returncode == 0, summary.stderr
    tps = json.loads(summary.stdout)["tokens_per_s"]
    assert tps["job"]["median"] == pytest.approx(state["last_tokens_per_s"], rel=0.15)
    printed = re.search(r"^throughput: ([\d,]+) tokens/s per rank", out, re.M)
    assert printed, out[-2000:]
    per_rank = float(printed.group(1).replace(",", ""))
    assert per_rank == pytest.approx(ranks[0]["last_tokens_per_s"], rel=0.15)


def test_a_token_window_pickles_as_two_arrays_and_reads_the_slots_form_too() -> None:
    import pickle
    from array import array
    from collections import deque

    from scalemon.throughput import TokenWindow

    window = TokenWindow()
    for tokens, seconds in ((8192, 0.5), (2**63 + 5, 0.25), (100, 0.125)):
        window.add(tokens, seconds)
    window.add(None, 0.3)  # a step without tokens: its time only
    state = window.__getstate__()
    assert isinstance(state[0], array) and state[0].typecode == "Q"
    again = pickle.loads(pickle.dumps(window, protocol=5))
    assert list(again.steps) == list(window.steps) and again.rate() == window.rate()
    assert (again.tokens, again.seconds, again.last_step_s) == (
        window.tokens, window.seconds, 0.3)
    older = TokenWindow()  # a checkpoint written before: the slots' (None, dict) form
    older.__setstate__((None, {"steps": deque([(8, 1.0)]), "tokens": 8, "seconds": 1.0,
                               "last_step_s": 1.0}))
    assert older.rate() == 8.0 and list(older.steps) == [(8, 1.0)]
