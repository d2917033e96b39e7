"""Resuming when checkpoints are bad (issue #14 item 3): a checkpoint that passes its checksums
but fails to load on one rank must change nothing anywhere; when nothing usable is left,
--resume stops with one line naming what was set aside (in that run and the next), and
--resume-or-start starts from step 0 exactly like a new run.

In-process tests use one rank; the others run torchrun jobs of two gloo ranks (as
tests/test_train.py) and compare losses with the uninterrupted run bit for bit."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_train import STEPS, Job, ckpt_args, run, straight_job
from test_train_units import steps, trainer

from scalemon.demo_train import train
from scalemon.demo_train.checkpoint import (
    Checkpointer,
    IncompatibleCheckpoint,
    NoCheckpoint,
    list_checkpoints,
)

# -----------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(Path(json.__file__).read_text() * 4)
    return path


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Job]:
    """`straight(*flags)`: the uninterrupted 12-step run (shared with tests/test_train.py)."""
    tmp = tmp_path_factory.mktemp("straight")
    return lambda *flags: straight_job(tmp, *flags)


def reseal(path: Path) -> None:
    """Rewrite meta.json's sizes and checksums to match the files: whatever was changed then
    passes verification, as a checkpoint whose problem checksums cannot see."""
    meta = json.loads((path / "meta.json").read_text())
    meta["files"] = {name: {"bytes": (path / name).stat().st_size,
                            "sha256": hashlib.sha256((path / name).read_bytes()).hexdigest()}
                     for name in meta["files"]}
    (path / "meta.json").write_text(json.dumps(meta))


def break_for_rank(path: Path, rank: int) -> None:
    """Make checkpoint `path` fail to load on `rank` only, after the model and optimizer
    state that every rank reads: its data position claims another batch size (the data
    loader refuses it). The checksums still match."""
    rank_file = path / f"rank{rank}.pt"
    state = torch.load(rank_file, weights_only=True)
    state["data"]["batch_size"] = 999
    torch.save(state, rank_file)
    reseal(path)


def flip_a_byte(path: Path) -> None:
    """Corrupt a file so that its checksum no longer matches."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def quiet(root: Path) -> Checkpointer:
    return Checkpointer(root, keep=0, log=lambda _m: None)


def worker_tracebacks(out: str) -> int:
    """Tracebacks printed by the ranks (torchrun prefixes their stderr with `[rankN]:`)."""
    return out.count("]: Traceback (most recent call last)")


# -----------------------------------------------------------------------------
# one rank, in this process


def test_a_checkpoint_that_fails_to_load_leaves_the_live_state_as_it_was(corpus, tmp_path):
    t = trainer(corpus)
    steps(t, 2)
    quiet(tmp_path).save(2, t.state)
    break_for_rank(tmp_path / "step_000002", 0)

    fresh, new = trainer(corpus), trainer(corpus)
    weights = {n: p.detach().clone() for n, p in fresh.model.named_parameters()}
    rng = torch.get_rng_state()
    messages: list[str] = []
    with pytest.raises(NoCheckpoint, match=r"1 set aside as corrupt \(step_000002.corrupt\)"):
        Checkpointer(tmp_path, log=messages.append).load_latest(fresh.state)
    assert any("step_000002 is corrupt (it failed to load on rank 0: ValueError: checkpoint "
               "data batch_size=999 differs" in m for m in messages), messages
    for name, p in fresh.model.named_parameters():  # not the checkpoint's weights
        assert torch.equal(p, weights[name]), name
    assert not fresh.optimizer.state and fresh.data.batches_served == 0
    assert torch.equal(torch.get_rng_state(), rng)
    torch.manual_seed(0)
    after_failure = steps(fresh, 3)
    torch.manual_seed(0)
    assert after_failure == steps(new, 3)  # it trains exactly like a new trainer


def test_the_previous_checkpoint_is_loaded_whole_after_one_fails(corpus, tmp_path):
    t = trainer(corpus)
    ck = quiet(tmp_path)
    for step in (1, 2):
        steps(t, 1)
        ck.save(step, t.state)
    want = steps(t, 2)  # steps 3 and 4 after step 2's checkpoint...
    break_for_rank(tmp_path / "step_000002", 0)
    fresh = trainer(corpus)
    assert quiet(tmp_path).load_latest(fresh.state) == 1
    assert fresh.data.batches_served == 1
    assert steps(fresh, 3)[1:] == want  # ...are steps 2 to 4 of a resume from step 1


@pytest.mark.parametrize(("flags", "says"), [
    (("--block-size", "32"), "resume with the same --preset and --block-size"),
    (("--seed", "7"), "--seed 1337 and this run has 7"),
    (("--batch-size", "2"), "4 sequences per rank per step"),
])
def test_a_checkpoint_of_other_settings_is_incompatible_not_corrupt(corpus, tmp_path, flags,
                                                                    says):
    t = trainer(corpus)
    steps(t, 1)
    quiet(tmp_path).save(1, t.state)
    other = trainer(corpus, *flags)
    with pytest.raises(IncompatibleCheckpoint, match=says):
        quiet(tmp_path).load_latest(other.state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]  # nothing renamed


def test_model_shapes_that_contradict_meta_json_are_refused_before_loading(corpus, tmp_path):
    """DCP state of another model under a meta.json whose settings say this one's: refused by
    the check before DCP's (collective) load, set aside as corrupt, the live model untouched."""
    other = trainer(corpus, "--block-size", "32")
    steps(other, 1)
    quiet(tmp_path).save(1, other.state)
    ours = trainer(corpus)
    path = tmp_path / "step_000001"
    meta = json.loads((path / "meta.json").read_text())
    meta["config"] = ours.state.config
    (path / "meta.json").write_text(json.dumps(meta))
    weights = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    messages: list[str] = []
    with pytest.raises(NoCheckpoint, match="1 set aside as corrupt"):
        Checkpointer(tmp_path, log=messages.append).load_latest(ours.state)
    assert any(re.search(r"step_000001 is corrupt \(it does not match its meta.json on rank 0: "
                         r"model tensor \S+ has shape \(32, \d+\) in the checkpoint, "
                         r"\(\d+, \d+\) in this run\)", m) for m in messages), messages
    for name, p in ours.model.named_parameters():
        assert torch.equal(p, weights[name]), name


def test_a_dcp_file_that_fails_to_read_is_set_aside_not_a_crash(corpus, tmp_path):
    """DCP raises CheckpointException, a BaseException: it used to escape load_latest."""
    t = trainer(corpus)
    steps(t, 1)
    quiet(tmp_path).save(1, t.state)
    shard = tmp_path / "step_000001" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    reseal(tmp_path / "step_000001")
    messages: list[str] = []
    with pytest.raises(NoCheckpoint, match="1 set aside as corrupt"):
        Checkpointer(tmp_path, log=messages.append).load_latest(trainer(corpus).state)
    assert any("it failed to load on rank 0: CheckpointException" in m for m in messages), \
        messages


def test_grad_accum_that_keeps_the_batch_resumes(corpus, tmp_path):
    t = trainer(corpus)  # --batch-size 4
    steps(t, 1)
    quiet(tmp_path).save(1, t.state)
    same_batch = trainer(corpus, "--batch-size", "2", "--grad-accum", "2")
    assert quiet(tmp_path).load_latest(same_batch.state) == 1


def run_main(corpus: Path, ckpt: Path, *flags: str) -> int:
    return train.main(["--preset", "tiny", "--data", str(corpus), "--batch-size", "4",
                       "--device", "cpu", "--max-steps", "2", "--ckpt-dir", str(ckpt), *flags])


def test_resume_from_nothing_stops_with_one_line(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert run_main(corpus, tmp_path / "ckpt", "--resume") == train.CANNOT_RESUME
    out, err = capsys.readouterr()
    assert err == (f"train.py: cannot resume: no checkpoint in {tmp_path / 'ckpt'}; to start "
                   "from step 0 instead, pass --resume-or-start\n")
    assert "step 1 loss" not in out

    assert run_main(corpus, tmp_path / "ckpt", "--resume-or-start") == 0
    out, err = capsys.readouterr()
    assert out.count(f"checkpoint: no checkpoint in {tmp_path / 'ckpt'}; starting from step 0 "
                     "(--resume-or-start)") == 1
    assert "step 1 loss" in out and "step 2 loss" in out and err == ""
    assert [s for s, _ in list_checkpoints(tmp_path / "ckpt")] == [2]


# -----------------------------------------------------------------------------
# two ranks under torchrun


@pytest.mark.integration
def test_newest_fails_on_rank_1_so_every_rank_resumes_from_the_previous(straight, tmp_path):
    ref = straight().losses()
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, "a", "--max-steps", "6", *ckpt_args(ckpt, 3))
    assert first.code == 0, first.out[-3000:]
    break_for_rank(ckpt / "step_000006", 1)
    job = run(tmp_path, "b", "--max-steps", str(STEPS), "--resume", *ckpt_args(ckpt, 3))
    assert job.code == 0, job.out[-3000:]
    assert job.out.count(f"{ckpt / 'step_000006'} is corrupt (it failed to load on rank 1: "
                         "ValueError: checkpoint data batch_size=999 differs") == 1
    assert f"resumed from {ckpt / 'step_000003'} (step 3); newer ones set aside as corrupt: " \
           "step_000006.corrupt" in job.out
    assert job.losses() == {s: ref[s] for s in range(4, STEPS + 1)}  # bit for bit


@pytest.mark.integration
def test_only_checkpoint_fails_on_rank_1_and_resume_or_start_is_a_new_run(straight,
                                                                          tmp_path):
    """The issue's case: rank 0 read the whole checkpoint, rank 1 failed on its own file;
    before, rank 0 went on from the step-6 weights and data position, saying 'step 0'."""
    ref = straight().losses()
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, "a", "--max-steps", "6", *ckpt_args(ckpt, 6))
    assert first.code == 0, first.out[-3000:]
    break_for_rank(ckpt / "step_000006", 1)
    job = run(tmp_path, "b", "--max-steps", str(STEPS), "--resume-or-start",
              *ckpt_args(ckpt, 6))
    assert job.code == 0, job.out[-3000:]
    assert job.out.count("failed to load on rank 1") == 1
    assert job.out.count(f"checkpoint: no usable checkpoint in {ckpt}: 1 set aside as corrupt "
                         "(step_000006.corrupt); starting from step 0 (--resume-or-start)") == 1
    assert job.losses() == ref  # steps 1-12 exactly as a new run's, not step 7's loss at 1


@pytest.mark.integration
def test_when_every_checkpoint_is_corrupt_resume_says_so_once_now_and_next_time(straight,
                                                                                tmp_path):
    ref = straight().losses()
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, "a", "--max-steps", "6", *ckpt_args(ckpt, 3))
    assert first.code == 0, first.out[-3000:]
    flip_a_byte(ckpt / "step_000006" / "__0_0.distcp")  # its checksum tells
    break_for_rank(ckpt / "step_000003", 1)  # only loading tells
    refusal = (f"train.py: cannot resume: no usable checkpoint in {ckpt}: 2 set aside as "
               "corrupt (step_000006.corrupt, step_000003.corrupt); to start from step 0 "
               "instead, pass --resume-or-start")

    for attempt in ("b", "c"):  # this run sets them aside; the next one still says so
        job = run(tmp_path, attempt, "--max-steps", str(STEPS), "--resume", *ckpt_args(ckpt, 3))
        assert job.code != 0, job.out[-3000:]
        assert job.out.count(refusal) == 1, job.out[-3000:]
        assert worker_tracebacks(job.out) == 0, job.out[-3000:]
        assert "step 1 loss" not in job.out and job.stats is None
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000003.corrupt",
                                                       "step_000006.corrupt"]

    job = run(tmp_path, "d", "--max-steps", str(STEPS), "--resume-or-start",
              *ckpt_args(ckpt, 3))
    assert job.code == 0, job.out[-3000:]
    assert job.out.count("starting from step 0 (--resume-or-start)") == 1
    assert job.losses() == ref


@pytest.mark.integration
def test_max_steps_minus_5_is_refused_once_before_the_ranks_start(tmp_path):
    job = run(tmp_path, "neg", "--max-steps", "-5")
    assert job.code != 0 and job.stats is None
    assert job.out.count("train.py: error: argument --max-steps: must be at least 1, "
                         "not -5") == 1, job.out[-3000:]
    assert "training tiny" not in job.out and "exitcode  : 2" in job.out


# -----------------------------------------------------------------------------
# mixed checkpoints (issue #26 item 9): a rank file of another step, checksums resealed


def mix_in(ckpt: Path, into: str, source: str, rank: int) -> None:
    """Put `rank`'s file of checkpoint `source` into checkpoint `into`, and reseal `into`: only
    the rank file's own step tells (before, rank 1 went on from the older step and the ranks
    hung at their first collective out of step)."""
    (ckpt / into / f"rank{rank}.pt").write_bytes((ckpt / source / f"rank{rank}.pt").read_bytes())
    reseal(ckpt / into)


def exit_codes(out: str) -> dict[int, int]:
    """Each failed rank's exit code, from torchrun's failure summary."""
    return {int(r): int(c) for r, c in
            re.findall(r"rank\s*:\s*(\d+) \(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", out)}


@pytest.mark.integration
def test_a_rank_file_of_another_step_is_set_aside_and_the_previous_resumed(straight, tmp_path):
    ref = straight().losses()
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, "a", "--max-steps", "9", *ckpt_args(ckpt, 3))
    assert first.code == 0, first.out[-3000:]
    mix_in(ckpt, "step_000009", "step_000006", 1)
    job = run(tmp_path, "b", "--max-steps", str(STEPS), "--resume", *ckpt_args(ckpt, 3))
    assert job.code == 0, job.out[-3000:]
    assert job.out.count(f"{ckpt / 'step_000009'} is corrupt (it does not match its meta.json "
                         "on rank 1: rank1.pt is of step 6, meta.json says step 9)") == 1
    assert f"resumed from {ckpt / 'step_000006'} (step 6)" in job.out
    assert job.losses() == {s: ref[s] for s in range(7, STEPS + 1)}  # bit for bit


@pytest.mark.integration
def test_a_mixed_only_checkpoint_stops_every_rank_at_once_with_one_reason(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, "a", "--max-steps", "6", *ckpt_args(ckpt, 3))
    assert first.code == 0, first.out[-3000:]
    mix_in(ckpt, "step_000006", "step_000003", 1)
    shutil.rmtree(ckpt / "step_000003")  # nothing older to fall back on
    started = time.monotonic()
    # torchrun looks at its workers every 3 s, not 0.1 s: a rank that leaves a moment after
    # the other is seen exiting by itself, not killed by torchrun's SIGTERM (exit code -15)
    job = run(tmp_path, "b", "--max-steps", str(STEPS), "--resume", *ckpt_args(ckpt, 3),
              extra=("--monitor-interval", "3"),
              timeout=120)  # a hang fails here (TimeoutExpired), not at the suite's limit
    assert time.monotonic() - started < 120
    # both ranks: CANNOT_RESUME, after a barrier; a rank whose teardown ends a little after
    # the other's may still be caught by one of torchrun's looks between the two, which stops
    # it with SIGTERM (-15): the job stopped at once all the same, with one reason (below)
    codes = exit_codes(job.out)
    assert codes in ({0: 1, 1: 1}, {0: 1, 1: -15}, {0: -15, 1: 1}), job.out[-3000:]
    assert job.out.count(f"{ckpt / 'step_000006'} is corrupt (it does not match its "
                         "meta.json on rank 1: rank1.pt is of step 3, meta.json says step "
                         "6)") == 1, job.out[-3000:]
    assert job.out.count(f"train.py: cannot resume: no usable checkpoint in {ckpt}: 1 set "
                         "aside as corrupt (step_000006.corrupt)") == 1, job.out[-3000:]
    assert worker_tracebacks(job.out) == 0, job.out[-3000:]
    assert "step 1 loss" not in job.out and "step 4 loss" not in job.out
