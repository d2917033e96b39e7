"""The demo trainer on a DeviceMesh (issue #36): tensor, sequence and pipeline parallelism with
data parallelism filling the rest. The unit tests check the pieces in one process (the stage
split, the flag checks, the layout's arithmetic); the integration tests run torchrun jobs of gloo
ranks on the CPU and check that each layout trains exactly as one rank does on the same global
batch, and that a pp x tp run resumes bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, kill_tree, torchrun_cmd
from scalemon.demo_train import train_flags
from scalemon.demo_train.layout import Layout
from scalemon.demo_train.memory import estimate_memory
from scalemon.demo_train.model import GPT, GPTConfig
from scalemon.demo_train.pipeline import (
    RankParts,
    loss_fn,
    pipeline_problem,
    split_stages,
    stage_layers,
)

RTOL = 1e-4  # the bound on the relative loss difference from the one-rank run


# -----------------------------------------------------------------------------
# units


def test_stage_layers_are_consecutive_and_as_equal_as_can_be() -> None:
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert stage_layers(2, 2) == [range(0, 1), range(1, 2)]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_the_stages_chained_compute_the_whole_model(schedule: str) -> None:
    """The stages of every pipeline rank, run in stage order in one process, give the whole
    model's logits; the parts of each rank keep the full model's parameter names."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("small")).eval()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        want, _ = model(x)
        per_rank = [split_stages(model, 2, r, schedule) for r in range(2)]
        order = sorted((s for stages in per_rank for s in stages),
                       key=lambda s: min(int(k) for k in s.transformer.h))
        h = x
        for stage in order:
            h = stage(h)
    assert torch.allclose(h, want, atol=1e-6)
    assert order[0].first and order[-1].last
    names = {n for stages in per_rank for n, _ in RankParts(stages).named_parameters()}
    full = {n for n, _ in model.named_parameters()}
    assert names - full == {"lm_head.weight"}  # the last stage's copy of the tied weight
    assert full <= names
    rank0 = {n for n, _ in RankParts(per_rank[0]).named_parameters()}
    assert "transformer.wte.weight" in rank0 and "lm_head.weight" not in rank0
    if schedule == "interleaved":  # stages 0 and 2 of 4 on rank 0: layers 0 and 2
        assert {n.split(".")[2] for n in rank0 if ".h." in n} == {"0", "2"}


def test_loss_fn_is_the_models_loss() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    x, y = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    logits, loss = model(x, y)
    assert torch.allclose(loss_fn(logits, y), loss)


def test_pipeline_problems() -> None:
    assert pipeline_problem(2, "1f1b", 2, 8, 1, 2) is None
    assert "4 layers" not in (pipeline_problem(2, "interleaved", 2, 8, 1, 4) or "")
    assert "2 x 2 virtual stages" in pipeline_problem(2, "interleaved", 2, 8, 1, 2)
    assert "must divide --batch-size" in pipeline_problem(2, "gpipe", 3, 8, 1, 2)
    assert "at least as many microbatches" in pipeline_problem(4, "1f1b", 2, 8, 1, 4)
    assert pipeline_problem(4, "1f1b", 2, 8, 2, 4) is None  # grad-accum adds microbatches


@pytest.mark.parametrize(("argv", "world", "says"), [
    (("--tp", "3"), 4, "does not divide the world size 4"),
    (("--tp", "4"), 4, "must divide the model's 2 attention heads"),
    (("--pp", "2", "--pp-schedule", "interleaved"), 2, "has 2 layers"),
    (("--microbatches", "2"), 2, "needs --pp 2 or more"),
    (("--sequence-parallel",), 2, "needs --tp 2 or more"),
    (("--tp", "2", "--sequence-parallel", "--block-size", "63"), 2, "multiple of 2"),
    (("--tp", "2", "--zero", "1"), 2, "--zero 1 with --tp 2 is not supported"),
    (("--pp", "2", "--amp", "fp16"), 2, "--amp fp16 with --pp 2 is not supported"),
    (("--pp", "2", "--compile"), 2, "--compile with --pp 2 is not supported"),
    (("--tp", "2", "--optimizer", "fused"), 2, "use --optimizer torch or torch-fused"),
])
def test_impossible_layouts_are_flag_errors(monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...],
                                            world: int, says: str) -> None:
    monkeypatch.setattr(train_flags, "flag_conflict", lambda args, world_size: None)
    args = train_flags.parse_args(["--device", "cpu", *argv])  # each value alone is valid
    monkeypatch.undo()
    problem = train_flags.flag_conflict(args, world)
    assert problem is not None and says in problem, problem


def test_a_pipeline_that_fits_is_no_flag_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = train_flags.parse_args(["--device", "cpu", "--pp", "2", "--tp", "2"])
    assert train_flags.flag_conflict(args, 4) is None
    assert args.microbatches == 2  # default: --pp


def test_a_bad_layout_stops_with_exit_code_2_and_one_line() -> None:
    env = {**os.environ, "WORLD_SIZE": "4", "LOCAL_RANK": "0"}
    done = subprocess.run([sys.executable, str(REPO / "demo_train" / "train.py"), "--device",
                           "cpu", "--pp", "3"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "train.py: error: --pp 3 x --tp 1 = 3 does not divide the world size 4: start a "
        "multiple of 3 ranks")


def test_layout_data_ranks() -> None:
    """Stages and tp ranks of one replica read the same data (the dp rank)."""
    layout = Layout(8, pp=2, tp=2)
    assert layout.dp == 2
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layout.coords(5) == {"pp": 1, "dp": 0, "tp": 1}


def test_memory_estimate_divides_by_tp_and_pipeline_stages() -> None:
    config = GPTConfig.preset("small")
    one = estimate_memory(config, 1000, 8)
    tp = estimate_memory(config, 1000, 8, tensor_parallel=2)
    pp = estimate_memory(config, 1000, 8, pipeline=(2, "1f1b", 4))
    assert tp.activations < one.activations
    assert pp.activations < one.activations  # half the layers, 2 of 4 microbatches in flight
    assert "pipeline 2 stages 1f1b" in pp.notes


# -----------------------------------------------------------------------------
# torchrun jobs


def run_job(tmp: Path, tag: str, *args: str, nproc: int, timeout: float = 300) -> list[float]:
    """Run the trainer (torchrun with `nproc` gloo ranks, or one plain process for nproc 0);
    returns rank 0's losses from --stats-json."""
    stats, out = tmp / f"{tag}.json", tmp / f"{tag}.out"
    argv = [*args, "--amp", "off", "--stats-json", str(stats)]
    cmd = (torchrun_cmd(*argv, nproc=nproc) if nproc else
           [sys.executable, str(REPO / "demo_train" / "train.py"), "--device", "cpu", *argv])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    with open(out, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            kill_tree(proc)
    assert code == 0, out.read_text()[-4000:]
    return json.loads(stats.read_text())["losses"]


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst < RTOL, (got, want)


_ONE: dict[tuple[str, ...], list[float]] = {}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory):
    """`one_rank(*flags)`: the losses of one plain process with these flags (cached)."""
    tmp = tmp_path_factory.mktemp("one_rank")
    return lambda *f: _ONE.setdefault(f, run_job(tmp, f"one{len(_ONE)}", *f, nproc=0))


STEPS = ("--max-steps", "6")


@pytest.mark.integration
def test_tp2_sequence_parallel_matches_one_rank(tmp_path: Path, one_rank) -> None:
    got = run_job(tmp_path, "tp2", *STEPS, "--tp", "2", "--sequence-parallel", nproc=2)
    assert_close(got, one_rank(*STEPS))


@pytest.mark.integration
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_pp2_matches_one_rank(tmp_path: Path, one_rank, schedule: str) -> None:
    """gpipe on the tiny model; interleaved needs 4 layers (2 x 2 virtual stages): small."""
    model = ("--preset", "small", "--batch-size", "4") if schedule == "interleaved" else ()
    got = run_job(tmp_path, schedule, *STEPS, *model, "--pp", "2", "--pp-schedule", schedule,
                  nproc=2)
    assert_close(got, one_rank(*STEPS, *model))


@pytest.mark.integration
def test_pp2_tp2_matches_one_rank_and_resumes_exactly(tmp_path: Path, one_rank) -> None:
    """pp 2 x tp 2 (4 ranks, 1F1B): the one-rank losses; resumed from its step-3 checkpoint
    (DCP: tp shards and stage parameters), steps 4-6 again bit for bit."""
    ckpt = tmp_path / "ckpt"
    mesh = ("--pp", "2", "--tp", "2", "--ckpt-dir", str(ckpt), "--ckpt-every", "3", "--keep",
            "0")
    straight = run_job(tmp_path, "straight", *STEPS, *mesh, nproc=4)
    assert_close(straight, one_rank(*STEPS))
    shutil.rmtree(ckpt / "step_000006")  # resume from step 3
    resumed = run_job(tmp_path, "resumed", *STEPS, *mesh, "--resume", nproc=4)
    assert resumed == straight[3:]


@pytest.mark.integration
def test_dp2_tp2_zero3_matches_dp2(tmp_path: Path) -> None:
    """dp 2 x tp 2 with FSDP2 on the dp sub-mesh over the tp DTensors, sequence parallel, and
    gradient accumulation: the losses of plain DDP on 2 ranks (the same global batch)."""
    accum = ("--grad-accum", "2")
    ddp = run_job(tmp_path, "dp2", *STEPS, *accum, nproc=2)
    got = run_job(tmp_path, "dp2tp2", *STEPS, *accum, "--tp", "2", "--zero", "3",
                  "--sequence-parallel", nproc=4)
    assert_close(got, ddp)
