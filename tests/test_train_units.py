"""CPU unit tests of the demo trainer's parts, in this process (one rank, no process group):
the memory formula, gradients of the techniques, the loss scaler, faults, checkpoints."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (fused AdamW)

import json
from pathlib import Path

import pytest
import torch

from scalemon.demo_train import train
from scalemon.demo_train.checkpoint import (
    Checkpointer,
    CheckpointError,
    IncompatibleCheckpoint,
    list_checkpoints,
)
from scalemon.demo_train.faults import Faults, RankStep, rank_step
from scalemon.demo_train.memory import activation_bytes, estimate_memory
from scalemon.demo_train.model import GPTConfig
from scalemon.demo_train.parallel import DistEnv

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(Path(json.__file__).read_text() * 4)
    return path


def trainer(corpus: Path, *flags: str) -> train.Trainer:
    args = train.parse_args(["--preset", "tiny", "--data", str(corpus), "--batch-size", "4",
                             "--device", "cpu", *flags])
    return train.build(args, CPU)


def steps(t: train.Trainer, n: int) -> list[float]:
    out = []
    for _ in range(n):
        step = t.data.batches_served + 1
        loss = train.forward_backward(t, step)
        train.optimizer_step(t)
        out.append(loss.item())
    return out


def grads(t: train.Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in t.model.named_parameters()}


# -----------------------------------------------------------------------------
# memory estimate


def test_memory_formula_reproduces_the_seed_example() -> None:
    # seed 001: GPT-1 shapes, 147M params, s=512, mixed precision, attention scores stored
    cfg = GPTConfig(block_size=512, n_layer=12, n_head=12, n_embd=768)
    est = estimate_memory(cfg, 147_000_000, 1, amp="bf16", fused_attention=False)
    assert est.params == 294_000_000  # 2 bytes/param
    assert est.optimizer == 147_000_000 * (4 + 12)
    assert est.gradients == 294_000_000
    assert est.activations == 349_175_808  # 512*768*12*(10 + 24 + 5*12*512/768)
    assert est.total == 2_940_000_000 + 349_175_808
    batch64 = estimate_memory(cfg, 147_000_000, 64, amp="bf16", fused_attention=False)
    assert batch64.total / 1e9 == pytest.approx(25.3, abs=0.05)  # "~25.3G" in the seed


def test_memory_divided_by_zero_stage_and_checkpointing() -> None:
    cfg = GPTConfig.preset("tiny")
    s, b, h, L = cfg.block_size, 4, cfg.n_embd, cfg.n_layer
    n = 100_000
    plain = estimate_memory(cfg, n, b)
    assert (plain.params, plain.gradients, plain.optimizer) == (4 * n, 4 * n, 8 * n)
    assert plain.activations == s * b * h * L * 34 * 2  # fp32: twice the fp16 formula
    z = [estimate_memory(cfg, n, b, zero=k, world_size=2) for k in (1, 2, 3)]
    assert (z[0].params, z[0].gradients, z[0].optimizer) == (4 * n, 4 * n, 4 * n)
    assert (z[1].params, z[1].gradients, z[1].optimizer) == (4 * n, 2 * n, 4 * n)
    assert (z[2].params, z[2].gradients, z[2].optimizer) == (2 * n, 2 * n, 4 * n)
    assert all(e.activations == plain.activations for e in z)
    ckpt = activation_bytes(cfg, b, mixed_precision=True, activation_checkpointing=True,
                            fused_attention=True)
    assert ckpt == 2 * s * b * h * L + s * b * h * 34


def test_printed_estimate_is_the_formula(corpus, capsys) -> None:
    t = trainer(corpus, "--zero", "0")
    out = capsys.readouterr().out
    n = sum(p.numel() for p in t.model.parameters())
    cfg = t.model.config
    s, b, h, L = cfg.block_size, 4, cfg.n_embd, cfg.n_layer
    want = n * (4 + 4 + 8) + s * b * h * L * 34 * 2
    assert t.memory.total == want
    assert f"= {want / 2**20:.2f} MiB ({want} bytes; fp32, ZeRO-0 over 1 rank(s)" in out


# -----------------------------------------------------------------------------
# techniques: same gradients


def test_grad_accum_gives_the_gradients_of_the_full_batch(corpus) -> None:
    full = trainer(corpus)
    accum = trainer(corpus, "--batch-size", "1", "--grad-accum", "4")
    loss_full = train.forward_backward(full, 1)
    loss_accum = train.forward_backward(accum, 1)
    assert loss_accum.item() == pytest.approx(loss_full.item(), rel=1e-6)
    g_full, g_accum = grads(full), grads(accum)
    for name, g in g_full.items():
        torch.testing.assert_close(g_accum[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_activation_checkpointing_gives_the_same_gradients(corpus) -> None:
    plain = trainer(corpus)
    ckpt = trainer(corpus, "--activation-checkpointing")
    assert ckpt.model.activation_checkpointing
    train.forward_backward(plain, 1)
    train.forward_backward(ckpt, 1)
    g_plain, g_ckpt = grads(plain), grads(ckpt)
    for name, g in g_plain.items():
        torch.testing.assert_close(g_ckpt[name], g, rtol=0, atol=0, msg=name)


def test_fp16_overflow_is_skipped_and_halves_the_scale(corpus) -> None:
    t = trainer(corpus, "--amp", "fp16", "--inject-overflow", "2")
    assert isinstance(t.scaler, torch.amp.GradScaler)
    steps(t, 1)
    assert t.scaler.get_scale() == 65536.0
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    adam_steps = [s["step"].item() for s in t.optimizer.state.values()]
    steps(t, 1)  # step 2: inf gradients
    assert t.scaler.get_scale() == 32768.0
    for name, p in t.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert [s["step"].item() for s in t.optimizer.state.values()] == adam_steps
    steps(t, 1)
    assert t.scaler.get_scale() == 32768.0
    assert not torch.equal(t.model.lm_head.weight, before["transformer.wte.weight"])


# -----------------------------------------------------------------------------
# faults


def test_rank_step_parsing() -> None:
    assert rank_step("1:5") == RankStep(1, 5) and str(RankStep(1, 5)) == "1:5"
    for bad in ("5", "a:b", "1:0", "-1:3"):
        with pytest.raises(Exception, match="RANK:STEP|RANK >= 0"):
            rank_step(bad)


def test_crash_only_in_the_first_attempt(monkeypatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert Faults(1, crash=RankStep(1, 7)).crash_step == 7
    assert Faults(0, crash=RankStep(1, 7)).crash_step is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert Faults(1, crash=RankStep(1, 7)).crash_step is None
    with pytest.raises(RuntimeError, match="inject-crash 1:7"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
        Faults(1, crash=RankStep(1, 7)).before_step(7)


# -----------------------------------------------------------------------------
# checkpoints


@pytest.mark.parametrize("optimizer", ["torch", "fused"])
def test_checkpoint_round_trip_is_exact(corpus, tmp_path, optimizer) -> None:
    if optimizer == "fused":
        from scalemon.demo_train import fused_adam

        if not fused_adam.interpreted():
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    flags = ("--optimizer", optimizer, "--amp", "fp16")
    a = trainer(corpus, *flags)
    steps(a, 3)
    Checkpointer(tmp_path, log=lambda _m: None).save(3, a.state)
    want = steps(a, 2)
    b = trainer(corpus, *flags)
    assert Checkpointer(tmp_path, log=lambda _m: None).load_latest(b.state) == 3
    assert b.data.batches_served == 3
    assert b.scaler.get_scale() == a.scaler.get_scale()
    assert steps(b, 2) == want
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_keep_prunes_and_a_half_written_checkpoint_is_ignored(corpus, tmp_path) -> None:
    t = trainer(corpus)
    ck = Checkpointer(tmp_path, keep=2, log=lambda _m: None)
    for step in (1, 2, 3):
        steps(t, 1)
        ck.save(step, t.state)
    (tmp_path / "step_000004.tmp").mkdir()  # a save that crashed half way
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3, 2]
    meta = json.loads((tmp_path / "step_000003" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1 and meta["optimizer_layout"] == "dcp"
    assert set(meta["files"]) == {".metadata", "__0_0.distcp", "rank0.pt"}
    assert meta["config"]["preset"] == "tiny"
    fresh = trainer(corpus)
    assert Checkpointer(tmp_path, log=lambda _m: None).load_latest(fresh.state) == 3
    steps(t, 1)
    ck.save(4, t.state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]


def test_a_corrupt_checkpoint_is_reported_and_the_previous_one_used(corpus, tmp_path) -> None:
    t = trainer(corpus)
    messages: list[str] = []
    ck = Checkpointer(tmp_path, keep=0, log=messages.append)
    for step in (1, 2, 3):
        steps(t, 1)
        ck.save(step, t.state)
    (tmp_path / "step_000003" / "rank0.pt").write_bytes(b"garbage")
    (tmp_path / "step_000002" / "meta.json").unlink()
    fresh = trainer(corpus)
    messages.clear()
    assert Checkpointer(tmp_path, log=messages.append).load_latest(fresh.state) == 1
    assert any("step_000003 is corrupt (rank0.pt has 7 bytes" in m for m in messages)
    assert any("step_000002 is corrupt (meta.json is missing)" in m for m in messages)
    assert (tmp_path / "step_000003.corrupt").is_dir()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]


def test_no_usable_or_incompatible_checkpoints_are_clear_errors(corpus, tmp_path) -> None:
    t = trainer(corpus)
    quiet = Checkpointer(tmp_path, log=lambda _m: None)
    assert quiet.load_latest(t.state) is None  # nothing there: start from step 0
    steps(t, 1)
    quiet.save(1, t.state)
    meta_path = tmp_path / "step_000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "world_size": 4}))
    with pytest.raises(IncompatibleCheckpoint, match="written by 4 rank"):
        quiet.load_latest(t.state)
    (tmp_path / "step_000001" / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        quiet.load_latest(t.state)

