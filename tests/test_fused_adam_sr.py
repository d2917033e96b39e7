"""FusedAdamW's stochastic rounding of pure-bf16 params (CPU, Triton interpreter).

``stochastic_rounding=True`` with ``master_weights=False`` keeps bf16 params and bf16 moments
(14 bytes a param, as torch's bf16 ``fused=True``) but rounds each updated param up or down
to a bf16 neighbour of its fp32 value, up with probability (the fp32 value's low 16 bits) /
2**16: unbiased, so updates below half an ulp are not all lost.
"""

from __future__ import annotations

import pytest
import torch

from scalemon.demo_train import adam_kernel
from scalemon.demo_train import fused_adam as fa

PURE = {"master_weights": False, "moment_dtype": "bf16"}
assert fa.interpreted(), "triton was imported before TRITON_INTERPRET=1 was set"


def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below (or equal) and just above (or equal) each fp32 value."""
    bits = x.view(torch.int32)
    down = (bits & ~0xFFFF).view(torch.float32)  # truncation: toward zero
    up = ((bits & ~0xFFFF) + ((bits & 0xFFFF) != 0).to(torch.int32) * 0x10000).view(torch.float32)
    low, high = torch.where(x >= 0, down, up), torch.where(x >= 0, up, down)
    return low.bfloat16(), high.bfloat16()


def test_small_updates_move_the_params_on_average_where_rounding_to_nearest_loses_them():
    """lr 1e-3: every update is under half a bf16 ulp of 1.0 (2**-8). Rounded to nearest the
    params never move; rounded stochastically their mean follows fp32 AdamW."""
    n, steps = 8192, 30
    make = lambda: torch.ones(n, dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    nearest, stochastic, ref = make(), make(), torch.ones(n, requires_grad=True)
    opts = [fa.FusedAdamW([nearest], lr=1e-3, weight_decay=0.0, **PURE),
            fa.FusedAdamW([stochastic], lr=1e-3, weight_decay=0.0, stochastic_rounding=True,
                          **PURE),
            torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.0, foreach=False)]
    for _ in range(steps):
        for p in (nearest, stochastic, ref):
            p.grad = torch.ones(n, dtype=p.dtype)
        for opt in opts:
            opt.step()
    assert torch.equal(nearest.detach(), torch.ones(n, dtype=torch.bfloat16))  # stuck
    want = float(ref.detach().mean())
    got = stochastic.detach().float()
    assert want == pytest.approx(1 - steps * 1e-3, abs=1e-5)
    # each param is a sum of 30 independent roundings of spread <= ulp/2 (2**-9 below 1.0):
    # the mean of 8192 is within 0.001 of the truth by a wide margin (> 10 sigma)
    assert abs(float(got.mean()) - want) < 1e-3, (float(got.mean()), want)
    assert len(torch.unique(got)) > 3  # the params spread over several bf16 values


def test_each_param_lands_on_a_bf16_neighbour_of_its_fp32_update():
    """One step from bf16 params and grads: torch's fp32 AdamW on fp32 twins gives the exact
    update; ours stores one of its two bf16 neighbours, both directions taken."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(3,), (adam_kernel.INTERP_BLOCK + 7,), (), (5, 7)]  # a full block and tails
    ps = [torch.randn(s, generator=gen).bfloat16().requires_grad_() for s in shapes]
    twins = [p.detach().float().requires_grad_() for p in ps]
    for p, t in zip(ps, twins, strict=True):
        g = torch.randn(p.shape, generator=gen).bfloat16()
        p.grad, t.grad = g, g.float()
    fa.FusedAdamW(ps, lr=1e-2, stochastic_rounding=True, **PURE).step()
    torch.optim.AdamW(twins, lr=1e-2, foreach=False).step()
    ups = downs = 0
    for p, t in zip(ps, twins, strict=True):
        low, high = _neighbours(t.detach())
        got = p.detach()
        assert bool(((got == low) | (got == high)).all()), (got, low, high)
        exact = low == high
        ups += int(((got == high) & ~exact).sum())
        downs += int(((got == low) & ~exact).sum())
    assert ups > 1000 and downs > 1000, (ups, downs)


def test_the_same_step_draws_the_same_bits_and_the_next_step_others():
    """The random bits hash (offset, tensor, step): two optimizers on equal params round
    alike (a resumed run repeats its draws); a param's rounding differs from step to step."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(4096, generator=gen).bfloat16()
    grads = [torch.randn(4096, generator=gen).bfloat16() for _ in range(2)]
    a, b = (start.clone().requires_grad_() for _ in range(2))
    opt_a = fa.FusedAdamW([a], lr=1e-2, stochastic_rounding=True, **PURE)
    opt_b = fa.FusedAdamW([b], lr=1e-2, stochastic_rounding=True, **PURE)
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        assert torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16))
    # the same fp32 updates at another step, or in another tensor: other bits. With betas
    # (0, 0) the update does not depend on the step (no bias correction is left), so one
    # optimizer at step 1 and one at step 2 compute the same fp32 values
    first, second, twin = (start.clone().requires_grad_() for _ in range(3))
    hyper = {"betas": (0.0, 0.0), "weight_decay": 0.0, "stochastic_rounding": True, **PURE}
    at_one = fa.FusedAdamW([first, twin], lr=1e-2, **hyper)
    at_two = fa.FusedAdamW([second], lr=0.0, **hyper)
    second.grad = torch.zeros_like(second)
    at_two.step()  # lr 0, grad 0: the param stays, the step count becomes 1
    assert torch.equal(second.detach(), start)
    at_two.param_groups[0]["lr"] = 1e-2
    for p in (first, second, twin):
        p.grad = grads[0].clone()
    at_one.step()
    at_two.step()
    assert torch.equal(at_two.state[second]["step"], torch.tensor(2.0))
    differ_by_step = int((first.detach() != second.detach()).sum())
    differ_by_tensor = int((first.detach() != twin.detach()).sum())
    assert 100 < differ_by_step < 4096 and 100 < differ_by_tensor < 4096, (
        differ_by_step, differ_by_tensor)


def test_nan_stays_nan_and_fp32_params_in_the_group_are_plain_adamw():
    p = torch.tensor([1.0, float("nan"), -2.0], dtype=torch.bfloat16, requires_grad=True)
    p.grad = torch.ones_like(p)
    w = torch.randn(9, requires_grad=True)
    ref = w.detach().clone().requires_grad_()
    w.grad = torch.randn(9)
    ref.grad = w.grad.clone()
    opt = fa.FusedAdamW([p, w], lr=1e-2, stochastic_rounding=True, **PURE)
    opt.step()
    torch.optim.AdamW([ref], lr=1e-2, foreach=False).step()
    assert torch.isnan(p.detach()[1]) and not torch.isnan(p.detach()[[0, 2]]).any()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    assert opt._plan.consts["SR"] == 1


def test_mixed_with_lo16_and_fp32_master_groups_in_one_launch():
    gen = torch.Generator().manual_seed(2)
    ps = [torch.randn(100, generator=gen).bfloat16().requires_grad_() for _ in range(3)]
    groups = [{"params": ps[:1], "stochastic_rounding": True, **PURE},
              {"params": ps[1:2], "master_weights": "lo16"}, {"params": ps[2:]}]
    opt = fa.FusedAdamW(groups, lr=1e-2)
    start = fa.launch_count()
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(100, generator=gen).bfloat16()
        opt.step()
    assert fa.launch_count() - start == 3
    assert opt._plan.consts["SR"] == 1 and opt._plan.consts["MASTER"] == -1
    saved = opt.state_dict()["param_groups"]
    assert [g["stochastic_rounding"] for g in saved] == [True, False, False]


def test_refuses_stochastic_rounding_where_it_has_no_meaning():
    mastered = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    mastered.grad = torch.zeros_like(mastered)
    with pytest.raises(ValueError, match="master_weights=False"):
        fa.FusedAdamW([mastered], stochastic_rounding=True).step()  # automatic fp32 master
    half = torch.zeros(4, dtype=torch.float16, requires_grad=True)
    half.grad = torch.zeros_like(half)
    with pytest.raises(ValueError, match="bf16 params"):
        fa.FusedAdamW([half], stochastic_rounding=True, master_weights=False).step()
    with pytest.raises(ValueError, match="stochastic_rounding must be True or False"):
        fa.FusedAdamW([torch.zeros(2, requires_grad=True)], stochastic_rounding="yes")
