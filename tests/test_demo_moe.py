"""The demo trainer's MoE MLP (demo_train/moe.py): routing, capacity and dropped tokens, the
load-balancing loss, and expert parallelism over two gloo ranks equal to one process on the
same weights and tokens (forward, and backward into the experts each rank holds)."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import torchrun_cmd
from scalemon.demo_train.model import GPT, GPTConfig
from scalemon.demo_train.moe import MoE, StepMeter, moe_layers, route, shard_experts

N_EMBD, EXPERTS, TOKENS = 16, 4, 24


def layer(top_k: int = 2, capacity_factor: float = 1.25) -> MoE:
    torch.manual_seed(0)
    return MoE(N_EMBD, EXPERTS, top_k, capacity_factor)


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output token by token, with loops: each kept assignment's expert output
    times its gate, summed per token."""
    flat = x.reshape(-1, N_EMBD)
    r = route(moe.router(flat), moe.top_k, moe.capacity_factor)
    out = torch.zeros_like(flat)
    for a in range(r.token.numel()):
        if r.keep[a]:
            t, e = int(r.token[a]), int(r.expert[a])
            out[t] += r.gate[a] * moe.experts[str(e)](flat[t:t + 1])[0]
    return out.reshape(x.shape)


def overflowing(moe: MoE) -> None:
    """Route every token of positive inputs to expert 0 first (and expert 1 second)."""
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 2.0
        moe.router.weight[1] = 1.0


def test_routing_matches_a_token_by_token_reference() -> None:
    moe = layer()
    x = torch.randn(2, TOKENS // 2, N_EMBD)
    torch.testing.assert_close(moe(x), reference(moe, x), rtol=1e-5, atol=1e-6)


def test_tokens_over_capacity_are_dropped_counted_and_carried_by_nothing() -> None:
    moe = layer(top_k=1)
    overflowing(moe)
    x = torch.rand(TOKENS, N_EMBD) + 0.1  # positive: expert 0 wins every token
    r = route(moe.router(x), 1, moe.capacity_factor)
    capacity = math.ceil(1.25 * TOKENS * 1 / EXPERTS)
    assert r.capacity == capacity == 8
    assert r.routed.tolist() == [TOKENS, 0, 0, 0] and r.kept.tolist() == [capacity, 0, 0, 0]
    assert r.keep.tolist() == [True] * capacity + [False] * (TOKENS - capacity)
    y = moe(x)
    assert torch.all(y[capacity:] == 0)  # dropped: zero output, the residual carries them
    assert torch.all(y[:capacity].abs().sum(-1) > 0)
    meter = StepMeter(moe)
    meter.begin()
    moe(x)
    meter.end()
    figures = meter.take()
    assert int(figures["moe_dropped_tokens"]) == TOKENS - capacity
    assert float(figures["moe_imbalance"]) == pytest.approx(4.0)  # all on one of 4 experts
    assert meter.take() == {}  # taken: the next step starts empty


def test_first_choices_go_before_second_choices() -> None:
    moe = layer(top_k=2, capacity_factor=0.5)
    overflowing(moe)
    x = torch.rand(TOKENS, N_EMBD) + 0.1
    r = route(moe.router(x), 2, 0.5)
    capacity = math.ceil(0.5 * TOKENS * 2 / EXPERTS)
    # expert 0 (everyone's first choice) and expert 1 (everyone's second) keep the first
    # `capacity` tokens each
    assert r.kept.tolist() == [capacity, capacity, 0, 0]
    keep = r.keep.view(2, TOKENS)  # (choice, token)
    assert keep[:, :capacity].all() and not keep[:, capacity:].any()


def test_load_balancing_loss_is_one_when_balanced_and_larger_when_not() -> None:
    uniform = route(torch.zeros(8, EXPERTS), 1, 1.0)
    assert float(uniform.aux_loss) == pytest.approx(1.0)
    skewed = torch.zeros(8, EXPERTS)
    skewed[:, 0] = 5.0
    assert float(route(skewed, 1, 1.0).aux_loss) > 3.0


def test_gpt_with_experts_adds_the_aux_loss_and_trains() -> None:
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32, experts=4)
    model = GPT(config)
    assert len(moe_layers(model)) == 2
    idx = torch.randint(0, 256, (2, 16))
    _, loss = model(idx, idx)
    logits, _ = model(idx)
    ce = torch.nn.functional.cross_entropy(logits.view(-1, 256), idx.view(-1))
    aux = sum(m.aux_loss for m in moe_layers(model))
    torch.testing.assert_close(loss, ce + config.moe_aux_coef * aux)
    loss.backward()
    assert model.transformer.h[0].mlp.router.weight.grad is not None
    # FLOPs count the k = 2 experts a token runs through: one more MLP and the router per
    # block than the dense model
    dense = GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32))
    mlp = sum(p.numel() for p in dense.transformer.h[0].mlp.parameters())
    assert model.active_params() == dense.num_params() + 2 * (mlp + 32 * 4)


# -----------------------------------------------------------------------------
# expert parallelism on two gloo ranks


def tokens(rank: int, overflow: bool) -> torch.Tensor:
    """Rank `rank`'s tokens: positive ones (which all prefer expert 0) when `overflow`."""
    torch.manual_seed(100 + rank)
    return torch.rand(TOKENS, N_EMBD) + 0.1 if overflow else torch.randn(2, TOKENS // 2, N_EMBD)


def _ep_worker(rank: int, world: int, store: str, out_dir: str, overflow: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        moe = layer(top_k=1 if overflow else 2)
        if overflow:
            overflowing(moe)
        torch.manual_seed(7)
        w = torch.randn(tokens(0, overflow).shape)  # a loss that weighs every output element
        # one process: the whole layer on each rank's tokens, gradients summed over the ranks
        ref = copy.deepcopy(moe)
        ref_outs = []
        for r in range(world):
            y = ref(tokens(r, overflow))
            (y * w).sum().backward()
            ref_outs.append(y.detach())
        ref_grads = dict(ref.named_parameters())
        # expert parallel: this rank's tokens, two experts here
        x = tokens(rank, overflow).requires_grad_()
        shard_experts(moe, dist.group.WORLD)
        meter = StepMeter(moe)
        meter.begin()
        y = moe(x)
        meter.end()
        (y * w).sum().backward()
        figures = meter.take()
        result = {
            "out": torch.allclose(y, ref_outs[rank], rtol=1e-5, atol=1e-6),
            "experts": sorted(moe.experts),
            "grads": [torch.allclose(p.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-6)
                      for name, p in moe.named_parameters() if name.startswith("experts.")],
            "dropped": int(figures["moe_dropped_tokens"]),
            "imbalance": float(figures["moe_imbalance"]),
            "input_grad": bool(x.grad.abs().sum() > 0),
        }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.parametrize("overflow", [False, True], ids=["balanced", "overflowing"])
def test_expert_parallel_equals_one_process(tmp_path: Path, overflow: bool) -> None:
    """Two gloo ranks with two experts each give the outputs of the whole layer run on each
    rank's tokens, and each rank's experts get the gradients summed over both ranks' tokens
    (the all_to_all backward); on tokens built to overflow, the dropped count is each rank's
    tokens past capacity and the imbalance is the load all on rank 0 (max/mean = 2)."""
    world = 2
    mp.spawn(_ep_worker, args=(world, str(tmp_path / "store"), str(tmp_path), overflow),
             nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert [r["experts"] for r in results] == [["0", "1"], ["2", "3"]]
    for r in results:
        assert r["out"] and r["input_grad"] and len(r["grads"]) == 8 and all(r["grads"]), r
    if overflow:
        capacity = math.ceil(1.25 * TOKENS / EXPERTS)
        assert [r["dropped"] for r in results] == [TOKENS - capacity] * world
        assert [r["imbalance"] for r in results] == [pytest.approx(2.0)] * world


# -----------------------------------------------------------------------------
# the trainer's flags and torchrun jobs


@pytest.mark.parametrize(("flags", "world_size", "says"), [
    (("--ep", "2"), 2, "--ep needs --experts (a MoE model to spread over ranks)"),
    (("--experts", "4", "--ep", "3"), 2, "--ep 3 must divide the data-parallel size 2"),
    (("--experts", "3", "--ep", "2"), 2, "--experts 3 must be a multiple of --ep 2"),
    (("--moe-top-k", "1"), 1, "--moe-top-k needs --experts (a MoE model)"),
    (("--experts", "2", "--moe-top-k", "3"), 1,
     "--moe-top-k 3 routes each token to more experts than --experts 2"),
    (("--experts", "4", "--ep", "2", "--zero", "2"), 2, "--zero 2 with --ep 2 is not supported"),
    (("--experts", "4", "--ep", "2", "--amp", "fp16"), 2,
     "--amp fp16 with --ep 2 is not supported"),
    (("--experts", "4", "--capacity-factor", "0"), 1,
     "argument --capacity-factor: must be more than 0, not 0"),
])
def test_impossible_moe_flags_are_refused_in_one_line(flags, world_size, says, capsys,
                                                       monkeypatch) -> None:
    from scalemon.demo_train import train

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(list(flags))
    assert exit_.value.code == 2
    assert f"train.py: error: {says}" in capsys.readouterr().err


STEPS = 4
_jobs: dict[tuple[str, ...], dict] = {}


def run_job(tmp_path: Path, *flags: str) -> dict:
    """A 2-rank torchrun job of the tiny MoE model; rank 0's --stats-json with its output
    under "out" (one run per flags, cached for the module)."""
    if flags in _jobs:
        return _jobs[flags]
    stats = tmp_path / f"stats{len(_jobs)}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    done = subprocess.run(torchrun_cmd("--preset", "tiny", "--batch-size", "4", "--experts", "4",
                                       *flags, "--stats-json", str(stats)),
                          env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    result = {**json.loads(stats.read_text()), "out": out}
    _jobs[flags] = result
    return result


@pytest.mark.integration
def test_expert_parallel_job_trains_as_replicated_experts_do(tmp_path: Path) -> None:
    """`--experts 4 --ep 2` (two experts a rank, all_to_all) gives the losses and dropped
    tokens of `--experts 4` on the same two ranks with every expert replicated (DDP): the
    routing and capacity are per rank in both, and the expert gradients are averaged alike.
    Rank 0 prints its MoE figures and --stats-json keeps them per logged step."""
    ep = run_job(tmp_path, "--ep", "2", "--max-steps", str(STEPS))
    replicated = run_job(tmp_path, "--max-steps", str(STEPS))
    assert "(ep 2)" in ep["out"] and "2 per rank" in ep["out"]
    assert ep["steps"] == list(range(1, STEPS + 1))
    for a, b in zip(ep["losses"], replicated["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert ep["moe_dropped_tokens"] == replicated["moe_dropped_tokens"]
    assert len(ep["moe_imbalance"]) == STEPS and all(v >= 1.0 for v in ep["moe_imbalance"])
    assert all(0.9 < v < 4.0 for v in ep["moe_aux_loss"])
    assert ep["out"].count("moe: imbalance ") == STEPS


@pytest.mark.integration
def test_expert_parallel_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    """Each rank saves its own experts (their names carry the global expert index, so DCP
    keeps every one); resuming gives the uninterrupted run's next losses bit for bit."""
    whole = run_job(tmp_path, "--ep", "2", "--max-steps", str(STEPS))
    ckpt = str(tmp_path / "ckpt")
    run_job(tmp_path, "--ep", "2", "--max-steps", "2", "--ckpt-dir", ckpt)
    resumed = run_job(tmp_path, "--ep", "2", "--max-steps", str(STEPS), "--ckpt-dir", ckpt,
                      "--resume")
    assert "resumed from" in resumed["out"]
    assert resumed["steps"] == list(range(3, STEPS + 1))
    assert resumed["losses"] == whole["losses"][2:]
