"""A long history's summary from its checkpoint (`scalemon.link.checkpoint`): the same figures
as every record replayed, and a later summary folds only the records after the checkpoint."""

from __future__ import annotations

import math
import random

import pytest

from scalemon import protocol
from scalemon.home import history_read
from scalemon.home.history import History, ReadStats, history_path, read_messages
from scalemon.link.checkpoint import catch_up
from scalemon.reports.snapshot import snapshot_json
from scalemon.reports.summary import run_records, summarize
from scalemon.state.fold import JobFold
from scalemon.state.runfigures import ALPHA, Quantiles, exact_quantile
from scalemon.tui.sim import SimJob


def write_job(path, steps: int, ranks: int = 8, seal_bytes: int = 20_000, start: int = 1,
              history: History | None = None, settle: bool = True) -> History:
    """A simulated job's hellos and step records, sealed every `seal_bytes` (with `settle`,
    every seal written at the end: the sealing thread's pace does not matter)."""
    job = "jobD"
    sim = SimJob(job=job, ranks=ranks)
    history = history or History(path, seal_bytes=seal_bytes)
    if start == 1:
        for r in range(ranks):
            history.append(protocol.encode("hello", job, r, 0, sim.hello(r), t=sim.start_t))
    for step in range(start, start + steps):
        t = sim.start_t + step + (400 if step > 150 else 0)  # a stall after step 150
        for rank, body in enumerate(sim.step_bodies(step, t)):
            if rank == 0 and step % 50 == 0:
                body["loss"] = math.nan
            history.append(protocol.encode("step", job, rank, step, body, t + rank * 1e-3))
        history.flush()
    if settle:
        history.settle()
    return history


def exact_summary(path, state: dict) -> dict:
    """The summary from every record replayed, with `state` (the fold's state as JSON holds
    the wall clock: both summaries take the same)."""
    messages, _ = read_messages(path, "jobD")
    fold = JobFold(job="jobD")
    for seq, msg in messages:
        fold.apply(seq, msg)
    assert fold.next_seq == max(seq for seq, _ in messages) + 1
    assert [r["step"] for r in snapshot_json(fold.state)["ranks"]] == [
        r["step"] for r in state["ranks"]]
    return summarize(state, run_records(m for _, m in messages))


def test_the_digest_gives_the_summary_that_every_record_replayed_gives(tmp_path):
    path = history_path("jobD", tmp_path)
    path.parent.mkdir(parents=True)
    write_job(path, 300).close()
    checkpoint = catch_up(path, "jobD")
    figures = checkpoint.digest.figures()
    assert figures.exact
    state = snapshot_json(checkpoint.fold.state)
    digested = summarize(state, figures)
    exact = exact_summary(path, state)
    assert digested["hangs"]["stall_count"] == exact["hangs"]["stall_count"] == 1
    assert digested["loss"]["nonfinite"] == 6
    _same(digested, exact)


def _same(a, b, where="") -> bool:
    """Equal, floats to 1e-12 relative (sums taken in another order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        return all(_same(a[k], b[k], f"{where}.{k}") for k in a)
    if isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        return all(_same(x, y, f"{where}[{i}]")
                   for i, (x, y) in enumerate(zip(a, b, strict=True)))
    if isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-12, nan_ok=True), where
        return True
    assert a == b, where
    return True


def test_a_later_summary_folds_only_the_records_after_the_checkpoint(tmp_path):
    path = history_path("jobD", tmp_path)
    path.parent.mkdir(parents=True)
    history = write_job(path, 199)
    write_job(path, 1, start=200, history=history, settle=False)  # a step left in the tail
    first = ReadStats()
    catch_up(path, "jobD", stats=first)
    assert first.records == len(history)  # no checkpoint yet: everything, once
    saved = history_read.sealed_count(path)  # the checkpoint is at the end of the sealed
    assert 0 < saved < len(history)
    write_job(path, 100, start=201, history=history).close()
    later = ReadStats()
    checkpoint = catch_up(path, "jobD", stats=later)
    assert later.records == len(history) - saved  # the records after the checkpoint only
    assert later.chunks_skipped > 0
    state = snapshot_json(checkpoint.fold.state)
    digested = summarize(state, checkpoint.digest.figures())
    _same(digested, exact_summary(path, state))
    assert digested["steps"]["last"] == 300


def test_a_checkpoint_of_another_history_or_a_damaged_one_is_not_used(tmp_path):
    path = history_path("jobD", tmp_path)
    path.parent.mkdir(parents=True)
    write_job(path, 100).close()
    catch_up(path, "jobD")
    digest_file = path.with_name(path.name + ".digest")
    digest_file.write_bytes(digest_file.read_bytes()[:100])  # damaged
    stats = ReadStats()
    checkpoint = catch_up(path, "jobD", stats=stats)
    assert stats.records == checkpoint.next_seq  # folded from record 0 again
    path.with_name(path.name + ".id").write_text("another\n")
    again = ReadStats()
    catch_up(path, "jobD", stats=again)
    assert again.records == checkpoint.next_seq


def test_bucketed_quantiles_stay_within_their_relative_error():
    rng = random.Random(1)
    values = [rng.lognormvariate(0, 1) for _ in range(20_000)] + [0.0, -3.0]
    sketch = Quantiles()
    for v in values:
        sketch.add(v)
    assert not sketch.exact and sketch.n == len(values)
    for q in (0.0, 0.1, 0.5, 0.9, 0.99, 1.0):
        assert sketch.quantile(q) == pytest.approx(exact_quantile(values, q), rel=2 * ALPHA)
    small = Quantiles()
    for v in values[:100]:
        small.add(v)
    assert small.exact and small.quantile(0.5) == exact_quantile(values[:100], 0.5)


def test_scalemon_summary_of_a_long_history_reads_its_checkpoint_then_the_tail(tmp_path):
    import json
    import os
    import subprocess
    import sys

    path = history_path("jobD", tmp_path)
    path.parent.mkdir(parents=True)
    history = write_job(path, 200)
    history.settle()
    history.close()
    env = {**os.environ, "SCALEMON_HOME": str(tmp_path)}

    def summary() -> dict:
        out = subprocess.run([sys.executable, "-m", "scalemon", "summary", "jobD", "--json"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    first, second = summary(), summary()
    assert first["source"]["digest"]["records_folded"] == 8 + 200 * 8  # everything, once
    assert second["source"]["digest"]["records_folded"] < 8 * 40  # the tail only
    for s in (first, second):
        assert s["steps"]["last"] == 200 and s["source"]["digest"]["exact"]
    assert second["step_time"] == first["step_time"] and second["loss"] == first["loss"]


def test_the_digest_of_a_3d_parallel_job_gives_its_bubble_over_the_run():
    """The mesh of this synthetic job is said after its steps: the job's tokens/s of the
    digest counts ranks as the mesh stood when each step came (every rank, here) and says it
    is not exact; every other figure is the exact one."""
    from test_summary_parallel3d import pipeline_run
    from test_tui_parallel3d import mesh_messages, p2p_messages, with_bubbles

    from scalemon.link.checkpoint import Checkpoint
    from scalemon.state.digest import RunDigest

    state, exact = pipeline_run()
    sim = SimJob(ranks=4, gpu=False, amp=False)
    messages = with_bubbles(sim.run(10))
    messages += mesh_messages(sim, sim.end_t(10)) + p2p_messages(sim, sim.end_t(10))
    checkpoint = Checkpoint(None, 0, 0, JobFold(), RunDigest())
    for seq, msg in enumerate(messages):
        checkpoint.take(seq, msg)
    figures = checkpoint.digest.figures()
    digested = summarize(state, figures, {"kind": "history", "where": "x"})
    assert not figures.exact  # counted all 4 ranks' tokens/s, the mesh came later
    assert digested["pipeline"]["measured_bubble_run"]["samples"] == 40
    _same({k: v for k, v in digested.items() if k != "tokens_per_s"},
          {k: v for k, v in exact.items() if k != "tokens_per_s"})


def test_the_checkpoint_process_a_hub_may_start_after_a_seal(tmp_path):
    import subprocess
    import sys

    path = history_path("jobD", tmp_path)
    path.parent.mkdir(parents=True)
    history = write_job(path, 100)
    sealed: list[int] = []
    history.on_sealed = sealed.append
    write_job(path, 50, start=101, history=history)
    history.settle()
    assert sealed and sealed[-1] == history_read.sealed_count(path)
    out = subprocess.run([sys.executable, "-m", "scalemon.link.checkpoint", str(path), "jobD"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    stats = ReadStats()
    catch_up(path, "jobD", save=False, stats=stats)
    assert stats.records == len(history) - sealed[-1]  # the tail only: the rest was saved
    history.close()
