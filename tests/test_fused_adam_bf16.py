"""FusedAdamW's bf16 modes against torch.optim.AdamW (CPU, Triton interpreter).

``master_weights="lo16"`` keeps an exact fp32 master as (bf16 param, int16 low word), so its
master must follow fp32 AdamW; ``moment_dtype="bf16"`` must equal fp32 AdamW whose moments are
rounded to bf16 after every step (the kernel uses the unrounded ones within the step).
"""

from __future__ import annotations

import copy

import pytest
import torch

from scalemon.demo_train import adam_kernel
from scalemon.demo_train import fused_adam as fa

SHAPES = [(3,), (adam_kernel.INTERP_BLOCK + 7,), (), (5, 7)]  # a full block and tails
F32 = {"rtol": 1e-5, "atol": 1e-6}
# tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported: the kernels here run
# in the interpreter, never skipped
assert fa.interpreted(), "triton was imported before TRITON_INTERPRET=1 was set"


def _bf16_params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).bfloat16().requires_grad_() for s in SHAPES]


def _fp32_twins(ps: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().float().requires_grad_() for p in ps]


def _round_moments(opt: torch.optim.Optimizer) -> None:
    """The reference for bf16 moments: round torch's fp32 moments to bf16 after a step."""
    for st in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            st[key].copy_(st[key].bfloat16().float())


def _run(ours: fa.FusedAdamW, ours_ps, ref: torch.optim.Optimizer, ref_ps, steps: int,
         seed: int, round_moments: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for o, r in zip(ours_ps, ref_ps, strict=True):
            g = torch.randn(o.shape, generator=gen).bfloat16()  # exact in every dtype
            o.grad, r.grad = g.to(o.dtype), g.to(r.dtype)
        ours.step()
        ref.step()
        if round_moments:
            _round_moments(ref)


def _assert_mostly_close(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """Within ``atol`` everywhere, and within fp32 tolerance for 99% of the elements."""
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    off = ~torch.isclose(got, want, **F32)
    assert off.float().mean() < 0.01, f"{int(off.sum())} of {off.numel()} elements differ"


def test_split_join_lo16_is_exact_and_nearest():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50000, generator=gen) * torch.exp(5 * torch.randn(50000, generator=gen))
    special = [0.0, -0.0, float("inf"), -float("inf"), 3.4028235e38, -1e-45, 1e-40, 1.00390625]
    x = torch.cat([x, torch.tensor(special)])
    ties = (torch.arange(256, dtype=torch.int32) << 16) | 0x8000  # exactly halfway
    x = torch.cat([x, ties.view(torch.float32)])
    hi, lo = fa.split_lo16(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert torch.equal(fa.join_lo16(hi, lo).view(torch.int32), x.view(torch.int32))
    finite = x.isfinite() & hi.float().isfinite()
    err = (hi.float() - x).abs()[finite]
    assert torch.all(err <= (x.bfloat16().float() - x).abs()[finite])  # as near as RNE
    assert torch.all(hi.float()[-256:].abs() >= x[-256:].abs())  # ties away from zero
    nan = torch.tensor([float("nan")])
    assert fa.join_lo16(*fa.split_lo16(nan)).isnan().all()


@pytest.mark.parametrize(("master", "moments", "bytes_"), [
    ("lo16", None, 26), ("lo16", "bf16", 18), ("fp32", "bf16", 20), (None, None, 28),
])
def test_bf16_modes_match_fp32_adamw(master, moments, bytes_):
    ours_ps = _bf16_params(seed=1)
    ref_ps = _fp32_twins(ours_ps)
    kw = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)}
    ours = fa.FusedAdamW(ours_ps, master_weights=master, moment_dtype=moments, **kw)
    ref = torch.optim.AdamW(ref_ps, foreach=False, **kw)
    _run(ours, ours_ps, ref, ref_ps, steps=12, seed=2, round_moments=moments == "bf16")
    moment_dtype = torch.bfloat16 if moments == "bf16" else torch.float32
    for o, r in zip(ours_ps, ref_ps, strict=True):
        st = ours.state[o]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == moment_dtype
        if moments == "bf16":  # a 1-ulp fp32 difference can round a moment the other way
            _assert_mostly_close(ours.fp32_master(o), r.detach(), atol=kw["lr"] * 2**-6)
            _assert_mostly_close(st["exp_avg"].float(), ref.state[r]["exp_avg"], atol=1e-2)
        else:
            torch.testing.assert_close(ours.fp32_master(o), r.detach(), **F32)
            torch.testing.assert_close(st["exp_avg"], ref.state[r]["exp_avg"], **F32)
        if master == "lo16":
            assert st["master_lo16"].dtype == torch.int16 and "master_param" not in st
            assert torch.equal(o.detach(), fa.split_lo16(ours.fp32_master(o))[0])
    mode = {None: "fp32"}.get(master, master)
    assert fa.bytes_per_param(torch.bfloat16, mode, moment_dtype) == bytes_


def test_lo16_mixed_with_other_rows_in_one_launch():
    ps = _bf16_params(seed=3) + [torch.randn(9, requires_grad=True)]
    ref_ps = _fp32_twins(ps)
    groups = [{"params": ps[:2], "master_weights": "lo16"}, {"params": ps[2:]}]
    ours = fa.FusedAdamW(groups, lr=1e-2)
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, foreach=False)
    start = fa.launch_count()
    _run(ours, ps, ref, ref_ps, steps=6, seed=4)
    assert fa.launch_count() - start == 6
    assert ours._plan.consts["MASTER"] == -1  # lo16, fp32 master and none in one kernel
    for o, r in zip(ps, ref_ps, strict=True):
        torch.testing.assert_close(ours.fp32_master(o), r.detach(), **F32)


def test_lo16_beats_pure_bf16_on_small_updates():
    """lr so small that every update is below half a bf16 ulp of 1.0: pure bf16 state loses
    them all, the lo16 master keeps them (as fp32 AdamW does)."""
    make = lambda: torch.ones(64, dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    lo16, pure, ref = make(), make(), torch.ones(64, requires_grad=True)
    opts = [fa.FusedAdamW([lo16], lr=1e-3, weight_decay=0.0, master_weights="lo16"),
            fa.FusedAdamW([pure], lr=1e-3, weight_decay=0.0, master_weights=False),
            torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.0, foreach=False)]
    for _ in range(20):
        for p in (lo16, pure, ref):
            p.grad = torch.ones(64, dtype=p.dtype)
        for opt in opts:
            opt.step()
    assert torch.equal(pure.detach(), torch.ones(64, dtype=torch.bfloat16))  # stuck
    torch.testing.assert_close(opts[0].fp32_master(lo16), ref.detach(), **F32)
    assert float(lo16.detach()[0]) < 1.0


def test_state_dict_between_lo16_fp32_master_and_torch():
    ps = _bf16_params(seed=5)
    lo16 = fa.FusedAdamW(ps, lr=1e-2, master_weights="lo16", moment_dtype="bf16")
    ref_ps = _fp32_twins(ps)
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, foreach=False)
    _run(lo16, ps, ref, ref_ps, steps=4, seed=6, round_moments=True)
    sd = copy.deepcopy(lo16.state_dict())
    assert sd["state"][1]["master_lo16"].dtype == torch.int16
    assert sd["param_groups"][0]["master_weights"] == "lo16"
    # into a fresh lo16 optimizer: the int16 words survive torch's load (which casts to bf16)
    again_ps = [p.detach().clone().requires_grad_() for p in ps]
    again = fa.FusedAdamW(again_ps, lr=1e-2)
    again.load_state_dict(copy.deepcopy(sd))
    assert again.state[again_ps[1]]["master_lo16"].dtype == torch.int16
    # into an fp32-master optimizer: the master is joined exactly
    full_ps = [p.detach().clone().requires_grad_() for p in ps]
    full = fa.FusedAdamW(full_ps, lr=1e-2)
    sd_full = copy.deepcopy(sd)
    for g in sd_full["param_groups"]:
        g["master_weights"], g["moment_dtype"] = None, None
    full.load_state_dict(sd_full)
    _run(lo16, ps, full, full_ps, steps=1, seed=7)
    _run(again, again_ps, ref, ref_ps, steps=1, seed=7, round_moments=True)
    for p, f, a, r in zip(ps, full_ps, again_ps, ref_ps, strict=True):
        assert full.state[f]["master_param"].dtype == torch.float32
        torch.testing.assert_close(full.fp32_master(f), lo16.fp32_master(p), **F32)
        assert torch.equal(again.fp32_master(a), lo16.fp32_master(p))
        _assert_mostly_close(again.fp32_master(a), r.detach(), atol=1e-2 * 2**-6)
    # and an fp32 master split into lo16: exact
    back_ps = [p.detach().clone().requires_grad_() for p in full_ps]
    back = fa.FusedAdamW(back_ps, lr=1e-2, master_weights="lo16")
    sd_back = copy.deepcopy(full.state_dict())
    for g in sd_back["param_groups"]:
        g["master_weights"] = "lo16"
    back.load_state_dict(sd_back)
    for p in back_ps:
        p.grad = torch.zeros_like(p)
    back._ready()  # converts the state, launches nothing
    for b, f in zip(back_ps, full_ps, strict=True):
        assert torch.equal(back.fp32_master(b), full.fp32_master(f))


def test_bytes_per_param_table():
    bf16, f32 = torch.bfloat16, torch.float32
    assert fa.bytes_per_param(f32, None, f32) == 28
    assert fa.bytes_per_param(bf16, "fp32", f32) == 28
    assert fa.bytes_per_param(bf16, "lo16", f32) == 26
    assert fa.bytes_per_param(bf16, "fp32", bf16) == 20
    assert fa.bytes_per_param(bf16, "lo16", bf16) == 18
    assert fa.bytes_per_param(bf16, None, bf16) == 14


def test_refuses_bad_modes():
    with pytest.raises(ValueError, match="master_weights"):
        fa.FusedAdamW([torch.zeros(2, requires_grad=True)], master_weights="fp8")
    with pytest.raises(ValueError, match="moment_dtype"):
        fa.FusedAdamW([torch.zeros(2, requires_grad=True)], moment_dtype="fp16")
    h = torch.zeros(4, dtype=torch.float16, requires_grad=True)
    h.grad = torch.zeros_like(h)
    with pytest.raises(ValueError, match="bfloat16"):
        fa.FusedAdamW([h], master_weights="lo16").step()
