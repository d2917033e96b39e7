"""CPU tests for the demo trainer's model and data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import scalemon.demo_train.model as model_mod
from scalemon.demo_train.data import (
    ByteBatches,
    default_corpus_files,
    load_corpus,
    train_val_split,
)
from scalemon.demo_train.model import GPT, PRESETS, GPTConfig, peak_flops


def tiny_model(seed: int = 0, **kwargs: object) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny"), **kwargs)


def random_batch(cfg: GPTConfig, batch: int = 4, seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


# -----------------------------------------------------------------------------
# model


def test_presets() -> None:
    assert set(PRESETS) >= {"tiny", "small", "gpt2-124m"}
    big = GPTConfig.preset("gpt2-124m")
    assert (big.n_layer, big.n_head, big.n_embd, big.block_size) == (12, 12, 768, 1024)
    assert big.vocab_size == 256
    assert GPTConfig.preset("gpt2-124m", vocab_size=50304).vocab_size == 50304
    assert PRESETS["gpt2-124m"].vocab_size == 256  # overrides do not leak into the preset
    with pytest.raises(ValueError, match="unknown preset"):
        GPTConfig.preset("nope")


def test_forward_shape_and_initial_loss() -> None:
    model = tiny_model()
    x, y = random_batch(model.config)
    logits, loss = model(x, y)
    assert logits.shape == (4, model.config.block_size, 256)
    assert loss is not None
    assert abs(loss.item() - math.log(256)) < 0.1
    _, no_loss = model(x)
    assert no_loss is None


def test_causal() -> None:
    model = tiny_model().eval()
    x, _ = random_batch(model.config, batch=2)
    changed = x.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 256
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(changed)
    assert torch.allclose(a[:, :40], b[:, :40], atol=1e-6)
    assert not torch.allclose(a[:, 40:], b[:, 40:])


def test_tied_weights() -> None:
    model = tiny_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = {id(p) for p in model.parameters()}
    assert len(ids) == len(list(model.parameters()))  # counted once


def test_residual_projection_init_is_scaled() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("small"))
    std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    expected = 0.02 / math.sqrt(2 * model.config.n_layer)
    assert abs(std - expected) / expected < 0.1


def test_activation_checkpointing_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_checkpoint = model_mod.checkpoint

    def counting_checkpoint(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(model_mod, "checkpoint", counting_checkpoint)
    model = tiny_model()
    x, y = random_batch(model.config)

    def loss_and_grads(ckpt: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.activation_checkpointing = ckpt
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss_plain, grads_plain = loss_and_grads(False)
    assert not calls
    loss_ckpt, grads_ckpt = loss_and_grads(True)
    assert len(calls) == model.config.n_layer
    assert torch.allclose(loss_plain, loss_ckpt)
    for a, b in zip(grads_plain, grads_ckpt, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    # no checkpointing when there is no backward to save memory for
    model.eval()
    with torch.no_grad():
        model(x)
    assert len(calls) == model.config.n_layer


def test_flops_per_token_tiny() -> None:
    model = tiny_model()
    # tiny: vocab 256, block 64, 2 layers, 2 heads, 64 embd, biases on
    C = 64
    per_block = sum(
        [
            2 * C,  # ln_1
            C * 3 * C + 3 * C,  # c_q, c_k, c_v
            C * C + C,  # attn c_proj
            2 * C,  # ln_2
            C * 4 * C + 4 * C,  # c_fc
            4 * C * C + C,  # mlp c_proj
        ]
    )
    n = 2 * per_block + 256 * C + 2 * C  # blocks, wte (= lm_head), ln_f
    assert model.num_params() == n == 116480
    assert model.num_params(non_embedding=False) == n + 64 * C
    assert model.flops_per_token() == 6 * n + 12 * 2 * 2 * 32 * 64 == 797184


def test_peak_flops() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("cpu") is None


# -----------------------------------------------------------------------------
# data


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(256, (10_000,), generator=g, dtype=torch.uint8)


def test_batches_shape_and_shift(corpus: torch.Tensor) -> None:
    x, y = ByteBatches(corpus, block_size=16, batch_size=3).next_batch()
    assert x.shape == y.shape == (3, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batches_deterministic_and_sharded(corpus: torch.Tensor) -> None:
    def first(rank: int, seed: int = 7, n: int = 3) -> list[torch.Tensor]:
        b = ByteBatches(corpus, 16, 4, rank=rank, world_size=2, seed=seed)
        return [b.next_batch()[0] for _ in range(n)]

    a, again = first(0), first(0)
    assert all(torch.equal(p, q) for p, q in zip(a, again, strict=True))
    other_rank, other_seed = first(1), first(0, seed=8)
    assert not any(torch.equal(p, q) for p, q in zip(a, other_rank, strict=True))
    assert not any(torch.equal(p, q) for p, q in zip(a, other_seed, strict=True))
    assert not torch.equal(a[0], a[1])  # successive batches differ


def test_batches_resume_exactly(corpus: torch.Tensor) -> None:
    run = ByteBatches(corpus, 16, 4, rank=1, world_size=2, seed=3)
    for _ in range(5):
        run.next_batch()
    state = run.state_dict()
    assert state["batches_served"] == 5
    expected = [run.next_batch() for _ in range(3)]

    resumed = ByteBatches(corpus, 16, 4, rank=1, world_size=2, seed=3)
    resumed.load_state_dict(state)
    for (ex, ey), (rx, ry) in zip(expected, [resumed.next_batch() for _ in range(3)], strict=True):
        assert torch.equal(ex, rx) and torch.equal(ey, ry)

    with pytest.raises(ValueError, match="seed"):
        ByteBatches(corpus, 16, 4, seed=4).load_state_dict(state)


def test_batches_reject_bad_args(corpus: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="rank"):
        ByteBatches(corpus, 16, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="block_size"):
        ByteBatches(corpus[:10], 16, 4)
    with pytest.raises(ValueError, match="uint8"):
        ByteBatches(corpus.long(), 16, 4)


def test_train_val_split(corpus: torch.Tensor) -> None:
    train, val = train_val_split(corpus, 0.1)
    assert len(train) == 9000 and len(val) == 1000
    assert torch.equal(torch.cat([train, val]), corpus)


def test_load_corpus_file(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_bytes(b"hello world")
    data = load_corpus(str(f), block_size=4)
    assert data.dtype == torch.uint8
    assert bytes(data.tolist()) == b"hello world"


def test_load_corpus_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        load_corpus(str(tmp_path / "missing.txt"))
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    with pytest.raises(ValueError, match="block_size"):
        load_corpus(str(short), block_size=64)


def test_default_corpus() -> None:
    files = default_corpus_files(max_bytes=200_000)
    assert files
    assert all(f.suffix == ".py" for f in files)
    assert not any(part in {"site-packages", "test", "tests"} for f in files for part in f.parts)
    assert files == default_corpus_files(max_bytes=200_000)
    assert sum(f.stat().st_size for f in files) <= 200_000
    data = load_corpus(None, block_size=64)
    assert 100_000 < len(data) <= 4_100_000
