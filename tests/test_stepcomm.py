"""Each step's all-reduce time and count from the Flight Recorder (`agent/stepcomm.py`): the
attribution to steps with recorder entries shaped as torch writes them, the reducer and fold
that fill the step values, and real torchrun jobs whose all-reduces no comm hook sees."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import deque

import pytest
import torch
from test_collectives import FakeSource, entry, hello, msg, reader
from test_collectives_jobs import job_env, snapshot

from conftest import REPO, free_port, wait_for
from scalemon.home.history import history_path, read_messages
from scalemon.reports.snapshot import snapshot_json
from scalemon.state.fold import JobFold

PER_STEP = 3  # tests/jobs/step_allreduces.py


def marks_at(marks: deque, walls: list[tuple[int, float]]) -> None:
    """Append `log()` marks at Unix times `walls` as the training thread does (perf_counter)."""
    offset = time.time() - time.perf_counter()
    marks.extend((step, wall - offset) for step, wall in walls)


def nccl(rid: int, seq: int, t: float, ms: float | None, op: str = "all_reduce",
         numel: int = 1024) -> dict:
    state = {"state": "completed", "duration_ms": ms} if ms is not None else {"state": "started"}
    return entry(rid, seq, op, numel=numel, t=t, backend="nccl", **state)


def test_nccl_all_reduces_go_to_the_step_whose_log_interval_holds_their_issue_time():
    w = time.time() - 10.0
    source = FakeSource()
    marks: deque = deque()
    rec, sent = reader(source, step_marks=marks)
    source.entries = [
        nccl(0, 1, w + 0.2, 1.0), nccl(1, 2, w + 0.5, 2.0), nccl(2, 3, w + 0.9, 3.0),  # step 1
        nccl(3, 4, w + 1.5, 4.0), nccl(4, 5, w + 1.6, 9.0, "all_gather"),  # not an all-reduce
        nccl(5, 6, w + 1.7, None),  # step 2, still running on the device: held back
        nccl(6, 7, w + 2.5, 5.0, numel=2048),  # after the last log(): its step is not known yet
    ]
    marks_at(marks, [(1, w + 1.0), (2, w + 2.0)])
    rec.read_all(False)
    (body,) = [b for _, b in sent]
    assert body["steps"] == [[1, 3, 3, pytest.approx(0.006), 3 * 4096, pytest.approx(w + 0.2)]]
    source.entries[5] = nccl(5, 6, w + 1.7, 6.0)  # it completed
    rec.read_all(False)
    assert sent[-1][1]["steps"] == [[2, 2, 2, pytest.approx(0.010), 2 * 4096,
                                     pytest.approx(w + 1.5)]]
    marks_at(marks, [(3, w + 3.0)])
    rec.read_all(False)
    assert sent[-1][1]["steps"] == [[3, 1, 1, pytest.approx(0.005), 8192,
                                     pytest.approx(w + 2.5)]]
    rec.read_all(False)  # nothing new: nothing sent
    assert len(sent) == 3


def test_a_step_logged_after_the_read_began_waits_and_gloo_steps_wait_for_host_times():
    import torch.distributed as dist

    w = time.time() - 5.0
    source = FakeSource()
    marks: deque = deque()
    calls: deque = deque()
    rec, sent = reader(source, step_marks=marks, host_calls=calls)
    group = object()
    names = dist.distributed_c10d._world.pg_names
    names[group] = "0"
    try:
        source.entries = [entry(0, 1, t=w + 0.1), entry(1, 2, t=w + 0.2)]
        calls.extend([[group, 1, None, 0.003], [group, 2, None, None]])  # 2 not completed
        marks_at(marks, [(10, w + 0.5)])
        rec.read_all(False)
        assert "steps" not in sent[-1][1]  # step 10 waits for the host time of seq 2
        rec._host_calls["0", 2][3] = 0.004
        marks.append((11, time.perf_counter() + 60.0))  # a log() during the read
        rec.read_all(False)
        assert sent[-1][1]["steps"] == [[10, 2, 2, pytest.approx(0.007), 8192,
                                         pytest.approx(w + 0.1)]]
    finally:
        del names[group]


def test_without_marks_or_durations_the_steps_still_count():
    w = time.time() - 5.0
    source = FakeSource()
    rec, sent = reader(source)  # no step_marks: no per-step rows
    source.entries = [entry(0, 1, t=w)]
    rec.read_all(False)
    assert "steps" not in sent[-1][1]
    marks: deque = deque()
    rec, sent = reader(FakeSource(), step_marks=marks)  # gloo without the host timer
    rec.sources[0].entries = [entry(0, 1, t=w), entry(1, 2, t=w + 0.1)]
    marks_at(marks, [(1, w + 1.0)])
    rec.read_all(False)
    assert sent[-1][1]["steps"] == [[1, 2, 0, None, 8192, pytest.approx(w)]]


def test_overflowed_marks_and_overdue_durations_are_handled():
    from scalemon.agent.stepcomm import StepComm

    marks: deque = deque(maxlen=2)
    comm = StepComm(marks, give_up_s=5.0)
    w = time.time() - 20.0
    for k, t in enumerate((0.5, 1.5, 2.5, 3.5)):  # steps 1..4, one all-reduce each
        comm.add(w + t, 0.001 * (k + 1), 100, False)
    marks_at(marks, [(1, w + 1), (2, w + 2), (3, w + 3)])  # the training thread lost step 1's
    waiting = comm.add(w + 3.7, None, 100, True)  # step 4: its host time never comes
    rows = comm.rows(time.perf_counter(), None)
    # steps 2 and 3 remain; step 2's interval may hold lost steps: not sent
    assert [r[0] for r in rows] == [3] and rows[0][1:4] == [1, 1, pytest.approx(0.003)]
    assert comm.lost_marks == 1
    marks_at(marks, [(4, time.time() - 1.0)])
    assert comm.rows(time.perf_counter(), None) == []  # step 4 waits for the duration
    later = time.perf_counter() + 10.0
    assert comm.rows(later, None, now=later) == [[4, 2, 1, pytest.approx(0.004), 200,
                                                  pytest.approx(w + 3.5)]]
    assert waiting.waiting and comm.add(w + 3.8, 0.1, 1, False) is None and comm.late == 1


def step_body(step: int, **comm: object) -> dict:
    return {"step": step, "step_time_s": 0.1, "allreduce_time_s": None, "allreduce_count": 0,
            "allreduce_bytes": 0, "allreduce_issue_t": None, **comm}


def steps_body(rows: list) -> dict:
    return {"groups": {}, "stats": [], "issues": [], "step": rows[-1][0], "steps": rows}


def test_the_reducer_fills_each_steps_all_reduce_where_the_step_had_none():
    fold = JobFold()
    seq = iter(range(1, 100))
    for rank in (0, 1):
        fold.apply(next(seq), hello(rank, 2))
    for step in (1, 2):
        for rank in (0, 1):
            fold.apply(next(seq), msg("step", rank, next(seq), step_body(step)))
    for rank in (0, 1):
        rows = [[1, 3, 3, 0.010 * (rank + 1), 12288, 1000.0 + rank],
                [2, 3, 3, 0.020 * (rank + 1), 12288, 1001.0 + rank]]
        fold.apply(next(seq), msg("collectives", rank, next(seq), steps_body(rows)))
    ranks = {r["rank"]: r for r in snapshot_json(fold.state, now=1002.0)["ranks"]}
    assert ranks[1]["allreduce_time_s"] == pytest.approx(0.040)
    assert (ranks[1]["allreduce_count"], ranks[1]["allreduce_bytes"]) == (3, 12288)
    assert ranks[0]["allreduce_issue_t"] == 1001.0
    fold.apply(next(seq), msg("step", 0, next(seq), step_body(3)))  # its own: none yet
    assert fold.state.ranks[0].metrics["allreduce_time_s"] == pytest.approx(0.020)
    x, lo, hi, mean = fold.tracks[1].series["allreduce_time_s"].arrays()
    assert list(x) == [1.0, 2.0] and list(mean) == pytest.approx([0.020, 0.040])
    x, lo, hi, mean = fold.agg["allreduce_time_s"].arrays()
    assert list(x) == [1.0, 2.0] and list(lo) == pytest.approx([0.010, 0.020])
    assert list(hi) == pytest.approx([0.020, 0.040])


def test_a_big_jobs_rank_opened_later_gets_its_recorder_all_reduce_series():
    from scalemon.text.display import AGGREGATE_AT

    fold = JobFold()
    records = [hello(0, AGGREGATE_AT), msg("step", 0, 1, step_body(1)),
               msg("collectives", 0, 2, steps_body([[1, 3, 3, 0.25, 12288, 1000.0]]))]
    for seq, m in enumerate(records):
        fold.apply(seq, m)
    assert fold.needs_backfill(0) and "allreduce_time_s" not in fold.tracks[0].series
    fold.watch(0, records)
    x, _, _, mean = fold.tracks[0].series["allreduce_time_s"].arrays()
    assert list(x) == [1.0] and list(mean) == [0.25]


def test_the_comm_hooks_figures_win_and_bad_rows_are_counted():
    fold = JobFold()
    fold.apply(0, hello(0, 1))
    fold.apply(1, msg("step", 0, 1, step_body(1, allreduce_time_s=0.5, allreduce_count=2,
                                              allreduce_bytes=64)))
    fold.apply(2, msg("collectives", 0, 2, steps_body([[1, 9, 9, 0.9, 9, 1.0]])))
    assert fold.state.ranks[0].metrics["allreduce_count"] == 2
    assert list(fold.tracks[0].series["allreduce_time_s"].arrays()[3]) == [0.5]
    fold.apply(3, msg("collectives", 0, 3, steps_body([[1, "x", 0, None, 0, None]])))
    assert fold.state.bad_collectives == 1


# --- real jobs ---------------------------------------------------------------------------------

def step_rows(home, rank: int) -> dict[int, list]:
    """Rank `rank`'s `collectives.steps` rows in the job's history, by step."""
    messages, _ = read_messages(history_path(home.name, home))
    return {row[0]: row for _, m in messages if m.rank == rank and m.type == "collectives"
            for row in m.body.get("steps") or ()}


def run_job(home, nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "--",
           str(REPO / "tests" / "jobs" / "step_allreduces.py"), *args]
    done = subprocess.run(cmd, env=job_env(home), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def check_steps(home, ranks: list[int], steps: int, complete: int, timed_from: int = 1) -> None:
    """Every rank's steps 1..`complete` (at least) carry PER_STEP all-reduces, with a duration
    from step `timed_from` on (a later step may have none: the rank ended before its reader
    saw them finish, as on a loaded machine), and the hub's state shows the latest one's."""
    state = wait_for(lambda: (s := snapshot(home)) and len(s["ranks"]) == len(ranks) and all(
        r["state"] == "finished" for r in s["ranks"]) and s, timeout=30)
    for rank in ranks:
        rows = step_rows(home, rank)
        assert set(range(1, complete + 1)) <= set(rows) <= set(range(1, steps + 1)), rows
        for step, row in rows.items():
            if step < timed_from:
                assert row[1] == PER_STEP, (step, row)
                continue
            if step > complete and row[2] == 0:  # the job ended before the recorder's reader
                assert row[1] == PER_STEP and row[3] is None, (step, row)  # saw it: no time
                continue
            assert row[1:3] == [PER_STEP, PER_STEP] and row[3] > 0, (step, row)
            assert row[4] == PER_STEP * 16 * 1024 * 4
    for r in state["ranks"]:
        assert r["allreduce_count"] == PER_STEP and r["allreduce_time_s"] > 0, r
        assert r["allreduce_bytes"] == PER_STEP * 16 * 1024 * 4
    check_dashboard(home, state)


def check_dashboard(home, state: dict) -> None:
    """The dashboard, folding the same history, shows each rank's all-reduce time in its
    `allred` column and in the time plot."""
    from scalemon.tui.model import DashboardData
    from scalemon.tui.views import overview as views

    data = DashboardData()
    data.apply_batch(read_messages(history_path(home.name, home))[0])
    overview = views.overview(data, time.time())
    column = [c.key for c in overview.columns].index("allreduce_time_s")
    for row, r in zip(overview.rows, state["ranks"], strict=True):
        assert row.cells[column] == f"{r['allreduce_time_s'] * 1e3:.1f}", row.cells
    labels = [line.label for line in overview.plots["time"].lines]
    assert "all-red" in labels, labels


@pytest.mark.integration
def test_a_gloo_jobs_own_all_reduces_are_counted_and_host_timed_per_step(home):
    """No DDP, so no comm hook: the step messages carry no all-reduce, and the recorder's rows
    (host-timed on gloo) fill every step of both ranks."""
    run_job(home, 2, "--steps", "6")
    check_steps(home, [0, 1], 6, 6)


@pytest.mark.integration
def test_a_gloo_job_on_a_gpu_machine_that_starts_the_agent_first_is_monitored_as_gloo(home):
    """`init()` before `init_process_group` on a machine with CUDA (as Accelerate does) guesses
    NCCL; a gloo job must still get host-timed collectives once its group exists (before,
    on a GPU machine, its collectives had no durations). CUDA is pretended on the CPU."""
    run_job(home, 2, "--steps", "6", "--init-first", "--pretend-cuda")
    # step 1's collectives ran before its log() found the group: counted, not timed
    check_steps(home, [0, 1], 6, 6, timed_from=2)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
                    reason="needs CUDA and NCCL (the recorder's duration_ms)")
def test_an_nccl_jobs_all_reduces_get_the_recorders_durations_per_step(home):
    run_job(home, 1, "--backend", "nccl", "--steps", "8")
    check_steps(home, [0], 8, 7)
