"""Parity of FusedAdamW with torch.optim.AdamW/Adam (CPU, Triton interpreter).

The CUDA checks (kernel count with torch.profiler, no host sync, parity on the GPU) run in a
subprocess without the interpreter and are skipped when there is no GPU; building the kernel
for sm_90 needs no GPU and is checked everywhere the Triton NVIDIA backend is installed.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from fused_adam_support import run_compiled

from scalemon.demo_train import adam_kernel, adam_plan
from scalemon.demo_train import fused_adam as fa

SHAPES = [(1,), (3,), (4097,), (65537,), ()]
SMALL = [(1,), (3,), (257,), ()]
F32 = {"rtol": 1e-5, "atol": 1e-6}
# tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported: the kernels here run
# in the interpreter, never skipped
assert fa.interpreted(), "triton was imported before TRITON_INTERPRET=1 was set"
_adam = functools.partial(fa.FusedAdamW, weight_decay=0.0, decoupled=False)
"""torch.optim.Adam's counterpart: L2 weight decay added to the grad, default 0."""


def _params(shapes, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def _twins(params: list[torch.Tensor], dtype=None) -> list[torch.Tensor]:
    return [p.detach().to(dtype or p.dtype, copy=True).requires_grad_() for p in params]


def _set_grads(gen, *param_lists, skip=()) -> None:
    """The same fresh random grad for the i-th param of every list (None where i in skip),
    rounded through every list's dtype so that all lists see the same values."""
    for i, ps in enumerate(zip(*param_lists, strict=True)):
        g = torch.randn(ps[0].shape, generator=gen)
        for p in ps:
            g = g.to(p.dtype).float()
        for p in ps:
            p.grad = None if i in skip else g.to(p.dtype)


def _run(ref_opt, our_opt, ref_ps, our_ps, steps=20, seed=1, skip=()) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _set_grads(gen, ref_ps, our_ps, skip=skip)
        ref_opt.step()
        our_opt.step()


def _train(opt, ps, steps, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _set_grads(gen, ps)
        opt.step()


def _assert_same(ref_ps, our_ps, **tol) -> None:
    for r, o in zip(ref_ps, our_ps, strict=True):
        torch.testing.assert_close(o.detach().float(), r.detach().float(), **(tol or F32))


def _groups(ps: list[torch.Tensor]) -> list[dict]:
    return [
        {"params": ps[:2], "lr": 1e-2, "weight_decay": 0.1},
        {"params": ps[2:4], "lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0},
        {
            "params": ps[4:],
            "lr": 2e-2,
            "betas": (0.3, 0.95),  # beta1 < 0.5: the other side of torch's lerp formula
            "amsgrad": True,
            "maximize": True,
            "weight_decay": 0.05,
        },
    ]


@pytest.mark.parametrize(
    ("ref_cls", "our_cls"),
    [(torch.optim.AdamW, fa.FusedAdamW), (torch.optim.Adam, _adam)],
)
def test_parity_all_sizes_and_groups(ref_cls, our_cls):
    ref_ps = _params(SHAPES + [(5, 7)])
    our_ps = _twins(ref_ps)
    ref = ref_cls(_groups(ref_ps), foreach=False)
    ours = our_cls(_groups(our_ps))
    _run(ref, ours, ref_ps, our_ps)
    _assert_same(ref_ps, our_ps)
    for r, o in zip(ref_ps, our_ps, strict=True):
        sr, so = ref.state[r], ours.state[o]
        assert so["step"].dtype == torch.float32 and so["step"].dim() == 0
        assert float(so["step"]) == float(sr["step"]) == 20.0
        torch.testing.assert_close(so["exp_avg"], sr["exp_avg"], **F32)
        torch.testing.assert_close(so["exp_avg_sq"], sr["exp_avg_sq"], **F32)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("decoupled", [False, True])
def test_parity_flags(amsgrad, maximize, decoupled):
    ref_ps = _params(SMALL, seed=2)
    our_ps = _twins(ref_ps)
    kw = {"lr": 5e-2, "weight_decay": 0.3, "amsgrad": amsgrad, "maximize": maximize}
    ref_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    ref = ref_cls(ref_ps, foreach=False, **kw)
    ours = fa.FusedAdamW(our_ps, decoupled=decoupled, **kw)
    _run(ref, ours, ref_ps, our_ps)
    _assert_same(ref_ps, our_ps)
    if amsgrad:
        for r, o in zip(ref_ps, our_ps, strict=True):
            torch.testing.assert_close(
                ours.state[o]["max_exp_avg_sq"], ref.state[r]["max_exp_avg_sq"], **F32
            )


def test_param_without_grad_is_skipped():
    ref_ps = _params(SMALL, seed=3)
    our_ps = _twins(ref_ps)
    before = our_ps[1].detach().clone()
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, foreach=False)
    ours = fa.FusedAdamW(our_ps, lr=1e-2)
    _run(ref, ours, ref_ps, our_ps, steps=5, skip=(1,))
    _assert_same(ref_ps, our_ps)
    assert torch.equal(our_ps[1].detach(), before)
    assert len(ours.state[our_ps[1]]) == 0


def test_lr_changes_and_tensor_lr():
    ref_ps = _params(SMALL, seed=4)
    our_ps = _twins(ref_ps)
    ref = torch.optim.AdamW(
        [{"params": ref_ps[:2]}, {"params": ref_ps[2:], "lr": torch.tensor(1e-2)}],
        lr=1e-2,
        foreach=False,
    )
    ours = fa.FusedAdamW(
        [{"params": our_ps[:2]}, {"params": our_ps[2:], "lr": torch.tensor(1e-2)}], lr=1e-2
    )
    gen = torch.Generator().manual_seed(5)
    for i in range(6):
        for opt in (ref, ours):
            opt.param_groups[0]["lr"] = 1e-2 * (0.7**i)  # a scheduler on a float lr
            opt.param_groups[1]["lr"].fill_(2e-2 / (i + 1))  # in-place update of a tensor lr
        _set_grads(gen, ref_ps, our_ps)
        ref.step()
        ours.step()
    _assert_same(ref_ps, our_ps)


def test_one_launch_per_step_and_tables_cached():
    ps = _params(SHAPES, seed=6) + _params([(9,)], torch.bfloat16) + _params([(4,)], torch.float16)
    opt = fa.FusedAdamW(_groups(ps))
    gen = torch.Generator().manual_seed(7)
    _set_grads(gen, ps)
    opt.step()
    plan, start = opt._plan, fa.launch_count()
    for _ in range(4):
        for p in ps:
            p.grad.copy_(torch.randn(p.shape, generator=gen))
        opt.step()
    assert fa.launch_count() - start == 4
    assert opt._plan is plan  # same pointers: tables reused
    old_grad = ps[0].grad
    ps[0].grad = torch.randn(ps[0].shape)  # a new allocation while the old one is alive
    opt.step()
    assert fa.launch_count() - start == 5
    assert old_grad.data_ptr() != ps[0].grad.data_ptr()
    assert opt._plan is plan and plan.gptrs[0] == ps[0].grad.data_ptr()  # only the column
    ps[1].grad = None  # which params have grads changed: rebuilt
    opt.step()
    assert opt._plan is not plan and len(opt._plan.params) == len(ps) - 1


def test_mixed_dtypes_with_master_weights_match_fp32():
    shapes = [(adam_kernel.INTERP_BLOCK + 5,), (3,), ()]  # a full block and a tail, per dtype
    ours_ps = (
        _params(shapes, torch.float32, 8)
        + _params(shapes, torch.bfloat16, 9)
        + _params(shapes, torch.float16, 10)
    )
    ref_ps = _twins(ours_ps, torch.float32)
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, weight_decay=0.1, foreach=False)
    ours = fa.FusedAdamW(ours_ps, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(11)
    start = fa.launch_count()
    for _ in range(20):
        _set_grads(gen, ours_ps, ref_ps)
        ref.step()
        ours.step()
    assert fa.launch_count() - start == 20
    assert ours._plan.consts["P_CODE"] == -1  # runtime dtype branches in one kernel
    for r, o in zip(ref_ps, ours_ps, strict=True):
        st = ours.state[o]
        master = st.get("master_param", o.detach())
        torch.testing.assert_close(master, r.detach(), **F32)
        torch.testing.assert_close(st["exp_avg"], ref.state[r]["exp_avg"], **F32)
        assert st["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(o.detach(), master.to(o.dtype), rtol=0, atol=0)


def test_programs_that_step_several_blocks_match_one_block_each(monkeypatch):
    """A program steps ITERS blocks one after the other (the GPU's launch shape): full blocks,
    a tensor's masked tail, and blocks past a tensor's end (skipped) give torch's result."""
    monkeypatch.setattr(adam_kernel, "INTERP_BLOCK", 64)
    monkeypatch.setattr(adam_kernel, "INTERP_ITERS", 3)
    shapes = [(64 * 3 * 2,), (64 * 3 + 70,), (5, 7), (64,), ()]  # whole spans, tails, one block
    ours_ps = _params(shapes, torch.float32, 21) + _params(shapes, torch.bfloat16, 22)
    ref_ps = _twins(ours_ps, torch.float32)
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, weight_decay=0.1, foreach=False)
    ours = fa.FusedAdamW(ours_ps, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(23)
    for _ in range(5):
        _set_grads(gen, ours_ps, ref_ps)
        ref.step()
        ours.step()
    assert (ours._plan.sub_block, ours._plan.iters, ours._plan.block) == (64, 3, 192)
    assert ours._plan.n_blocks == 2 * (2 + 2 + 1 + 1 + 1)  # per dtype: 384 -> 2 spans, 262 -> 2
    for r, o in zip(ref_ps, ours_ps, strict=True):
        master = ours.state[o].get("master_param", o.detach())
        torch.testing.assert_close(master, r.detach(), **F32)
        torch.testing.assert_close(ours.state[o]["exp_avg"], ref.state[r]["exp_avg"], **F32)
        assert float(ours.state[o]["step"]) == 5.0  # the last program of a tensor counted it


def test_bf16_without_master_matches_torch_fused_bf16():
    ref_ps = _params(SMALL, torch.bfloat16, 12)
    our_ps = _twins(ref_ps)
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, fused=True)
    ours = fa.FusedAdamW(our_ps, lr=1e-2, master_weights=False)
    _run(ref, ours, ref_ps, our_ps, steps=10)
    _assert_same(ref_ps, our_ps, rtol=1.6e-2, atol=1e-2)
    assert ours.state[our_ps[0]]["exp_avg"].dtype == torch.bfloat16
    assert "master_param" not in ours.state[our_ps[0]]


def _scaled_step(opt, scaler, params, grads, unscale_first=False) -> None:
    """backward of sum(p * g) through the scaler gives grads ``g * scale``, then step."""
    opt.zero_grad()
    loss = sum((p * g).sum() for p, g in zip(params, grads, strict=True))
    scaler.scale(loss).backward()
    if unscale_first:  # as before grad clipping: the step then gets found_inf but no scale
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def test_grad_scaler_unscales_and_skips_inf_steps():
    ref_ps = _params(SMALL, seed=13)
    our_ps = _twins(ref_ps)
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, foreach=False)
    ours = fa.FusedAdamW(our_ps, lr=1e-2)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    gen = torch.Generator().manual_seed(14)
    for step in range(7):
        grads = [torch.randn(p.shape, generator=gen) for p in ref_ps]
        if step == 3:
            grads[2].view(-1)[5] = float("inf")
            saved = copy.deepcopy(ours.state_dict()["state"])
            before = [p.detach().clone() for p in our_ps]
        for opt, scaler, ps in ((ref, scalers[0], ref_ps), (ours, scalers[1], our_ps)):
            _scaled_step(opt, scaler, ps, grads, unscale_first=step == 5)
        if step == 3:
            assert scalers[1].get_scale() == scalers[0].get_scale() == 2.0**9
            for p, b in zip(our_ps, before, strict=True):
                assert torch.equal(p.detach(), b)
            for i, p in enumerate(our_ps):
                for key, value in ours.state[p].items():
                    assert torch.equal(value, saved[i][key]), key
            assert float(ours.state[our_ps[0]]["step"]) == 3.0
        _assert_same(ref_ps, our_ps)
    assert float(ours.state[our_ps[0]]["step"]) == float(ref.state[ref_ps[0]]["step"]) == 6.0


def test_step_takes_grad_scale_and_found_inf_keywords():
    ps = _params(SMALL, seed=22)
    ref_ps = _twins(ps)
    ours, ref = fa.FusedAdamW(ps, lr=1e-2), torch.optim.AdamW(ref_ps, lr=1e-2, foreach=False)
    _set_grads(torch.Generator().manual_seed(23), ps, ref_ps)
    for p in ps:
        p.grad.mul_(8.0)
    ours.step(grad_scale=torch.tensor(8.0), found_inf=torch.tensor(0.0))
    ref.step()
    _assert_same(ref_ps, ps)
    before = [p.detach().clone() for p in ps]
    ours.step(grad_scale=torch.tensor(8.0), found_inf=torch.tensor(1.0))
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before, strict=True))


def _continue(opt_a, ps_a, opt_b, ps_b, steps=5) -> None:
    _run(opt_a, opt_b, ps_a, ps_b, steps=steps, seed=21)
    _assert_same(ps_a, ps_b)


@pytest.mark.parametrize("direction", ["ours_to_torch", "torch_to_ours"])
def test_state_dict_round_trip_fp32(direction):
    src_ps = _params(SMALL, seed=15)
    src_cls, dst_cls = (
        (fa.FusedAdamW, torch.optim.AdamW)
        if direction == "ours_to_torch"
        else (torch.optim.AdamW, fa.FusedAdamW)
    )
    kw = {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}
    src = src_cls(src_ps, **kw)
    _train(src, src_ps, steps=6, seed=16)
    dst_ps = _twins(src_ps)
    dst = dst_cls(dst_ps, **kw)
    sd = copy.deepcopy(src.state_dict())
    assert set(sd["state"][0]) >= {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert sd["state"][0]["step"].dtype == torch.float32
    dst.load_state_dict(sd)
    _continue(src, src_ps, dst, dst_ps)
    for a, b in zip(src_ps, dst_ps, strict=True):
        assert float(src.state[a]["step"]) == float(dst.state[b]["step"]) == 11.0


def test_state_dict_bf16_master_round_trips():
    ps = _params(SMALL, torch.bfloat16, 17)
    ours = fa.FusedAdamW(ps, lr=1e-2)
    _train(ours, ps, steps=4, seed=18)
    sd = copy.deepcopy(ours.state_dict())
    assert sd["state"][0]["master_param"].dtype == torch.float32
    ps2 = _twins(ps)
    ours2 = fa.FusedAdamW(ps2, lr=1e-2)
    ours2.load_state_dict(sd)
    for p, p2 in zip(ps, ps2, strict=True):
        for key in ("master_param", "exp_avg", "exp_avg_sq"):
            assert ours2.state[p2][key].dtype == torch.float32
            assert torch.equal(ours2.state[p2][key], ours.state[p][key]), key
    _continue(ours, ps, ours2, ps2)
    torch_ps = _twins(ps)
    ref = torch.optim.AdamW(torch_ps, lr=1e-2)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))  # torch casts state to bf16
    assert ref.state[torch_ps[0]]["exp_avg"].dtype == torch.bfloat16


def test_state_dict_torch_bf16_into_ours_creates_master():
    ps = _params(SMALL, torch.bfloat16, 19)
    ref = torch.optim.AdamW(ps, lr=1e-2, foreach=False)
    _train(ref, ps, steps=4, seed=20)
    sd = ref.state_dict()
    ours_ps, f32_ps = _twins(ps), _twins(ps, torch.float32)
    ours = fa.FusedAdamW(ours_ps, lr=1e-2)
    ours.load_state_dict(copy.deepcopy(sd))
    f32 = torch.optim.AdamW(f32_ps, lr=1e-2, foreach=False)
    f32.load_state_dict(copy.deepcopy(sd))  # torch upcasts the bf16 moments to fp32
    _run(f32, ours, f32_ps, ours_ps, steps=3, seed=21)
    for p, r in zip(ours_ps, f32_ps, strict=True):
        st = ours.state[p]
        assert st["exp_avg"].dtype == st["master_param"].dtype == torch.float32
        assert float(st["step"]) == 7.0
        torch.testing.assert_close(st["master_param"], r.detach(), **F32)


def test_refuses_unsupported_inputs(monkeypatch):
    p = torch.zeros(4, requires_grad=True)
    p.grad = torch.sparse_coo_tensor([[0]], [1.0], (4,), check_invariants=True)
    with pytest.raises(ValueError, match="sparse"):
        fa.FusedAdamW([p]).step()
    c = torch.zeros(4, dtype=torch.complex64, requires_grad=True)
    c.grad = torch.zeros_like(c)
    with pytest.raises(TypeError, match="complex"):
        fa.FusedAdamW([c]).step()
    d = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    d.grad = torch.zeros_like(d)
    with pytest.raises(TypeError, match="float32"):
        fa.FusedAdamW([d]).step()
    a, m = torch.zeros(4, requires_grad=True), torch.zeros(4, device="meta", requires_grad=True)
    a.grad, m.grad = torch.zeros_like(a), torch.zeros_like(m)
    with pytest.raises(ValueError, match="one device"):
        fa.FusedAdamW([a, m]).step()
    q = torch.zeros(3, 2, requires_grad=True)
    q.grad = torch.zeros(2, 3).t()
    with pytest.raises(ValueError, match="strides"):
        fa.FusedAdamW([q]).step()
    with pytest.raises(ValueError, match="learning rate"):
        fa.FusedAdamW([a], lr=-1.0)
    monkeypatch.setattr(adam_plan, "interpreted", lambda: False)  # what check_device reads
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fa.FusedAdamW([a]).step()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_imports_without_interpreter_and_fails_only_on_step():
    code = textwrap.dedent(
        """
        import torch
        from scalemon.demo_train import fused_adam as fa
        assert not fa.interpreted()
        p = torch.zeros(3, requires_grad=True); p.grad = torch.ones(3)
        try:
            fa.FusedAdamW([p]).step()
        except ValueError as e:
            assert "TRITON_INTERPRET=1" in str(e) and "CUDA" in str(e), e
        else:
            raise AssertionError("no error")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


CUDA_CHECK = textwrap.dedent(
    """
    import torch
    from torch.profiler import ProfilerActivity, profile
    from scalemon.demo_train import fused_adam as fa
    assert not fa.interpreted()
    torch.manual_seed(0)
    shapes = [(1,), (3,), (4097,), (65537,), (), (768, 3072)]
    ref_ps = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes]
    our_ps = [p.detach().clone().requires_grad_() for p in ref_ps]
    half = [torch.randn(5000, device="cuda").bfloat16().requires_grad_()]
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, weight_decay=0.1, foreach=False)
    ours = fa.FusedAdamW([{"params": our_ps}, {"params": half, "lr": 1e-3}], lr=1e-2,
                         weight_decay=0.1)
    def grads():
        for r, o in zip(ref_ps, our_ps):
            g = torch.randn_like(r); r.grad = g; o.grad = g.clone()
        half[0].grad = torch.randn_like(half[0])
    for _ in range(20):
        grads(); ref.step(); ours.step()
    for r, o in zip(ref_ps, our_ps):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
    assert ours._plan.consts["P_CODE"] == -1 and ours._plan.consts["ALIGNED"]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    ours.step()
    torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            ours.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    assert len(kernels) == 3, [e.name for e in kernels]

    hp = torch.randn(5000, device="cuda").bfloat16().requires_grad_()
    fp = hp.detach().float().requires_grad_()
    o1, o2 = fa.FusedAdamW([hp], lr=1e-2), torch.optim.AdamW([fp], lr=1e-2, foreach=False)
    for _ in range(10):
        g = torch.randn(5000, device="cuda").bfloat16()
        hp.grad, fp.grad = g, g.float()
        o1.step(); o2.step()
    master = o1.state[hp]["master_param"]
    torch.testing.assert_close(master, fp.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(hp.detach(), master.bfloat16())
    before = hp.detach().clone()
    one = torch.ones((), device="cuda")
    o1.step(grad_scale=one, found_inf=one)
    assert torch.equal(hp.detach(), before) and float(o1.state[hp]["step"]) == 10.0
    print("ok")
    """
)


def test_the_cuda_check_script_is_python():
    """It runs only on a GPU: here at least it must compile."""
    compile(CUDA_CHECK, "CUDA_CHECK", "exec")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_one_kernel_per_step_no_sync_and_parity():
    run_compiled(CUDA_CHECK)


AOT_COMPILE = textwrap.dedent(
    """
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from scalemon.demo_train import adam_kernel as k
    assert not k.interpreted()
    target = GPUTarget("cuda", 90, 32)
    sig = {"tensor_tab": "*i64", "grad_tab": "*i64", "block_tab": "*i64", "hyper_tab": "*fp64",
           "counters": "*i32", "scale_ptr": "*fp32", "inf_ptr": "*fp32"}
    fixed = dict(P_CODE=0, G_CODE=0, S_CODE=0, MASTER=0, AMS=0, HAS_SCALE=False, HAS_INF=False,
                 SR=0)
    mixed = dict(P_CODE=-1, G_CODE=-1, S_CODE=-1, MASTER=-1, AMS=-1, HAS_SCALE=True, HAS_INF=True,
                 SR=1)
    bf16 = dict(P_CODE=1, G_CODE=1, S_CODE=1, MASTER=2, AMS=0, HAS_SCALE=False, HAS_INF=False,
                SR=0)
    pure_sr = dict(P_CODE=1, G_CODE=1, S_CODE=1, MASTER=0, AMS=0, HAS_SCALE=False,
                   HAS_INF=False, SR=1)  # stochastic rounding: still vectorised, IEEE math
    for consts in (fixed, mixed, bf16, pure_sr):
        consts = dict(consts, ALIGNED=True, NCOL=k.NCOL, HCOL=k.HCOL, BLOCK=k.GPU_BLOCK,
                      ITERS=4)  # a program of several blocks: still vectorised
        src = ASTSource(k.fused_adam_kernel, {**sig, **{k: "constexpr" for k in consts}},
                        constexprs=consts)
        ptx = triton.compile(src, target=target, options={"num_warps": k.GPU_WARPS}).asm["ptx"]
        # 4 elements a thread (GPU_BLOCK / 32 / GPU_WARPS): 16-byte accesses for fp32, 8-byte
        # ones for 16-bit values
        wide = "v4" if consts["P_CODE"] == 0 else "v2"
        assert f"ld.global.{wide}" in ptx and f"st.global.{wide}" in ptx, (
            "full blocks not vectorised")
        assert "div.full" not in ptx and "sqrt.approx" not in ptx, "approximate fp32 math"
    poke = {"dst": "*i64", **{name: "i64" for name in k.POKE_ARGS}}
    triton.compile(ASTSource(k.poke_kernel, poke), target=target, options={"num_warps": 1})
    print("compiled")
    """
)


def test_kernel_compiles_for_sm90_without_a_gpu():
    """Triton can build PTX/cubin for sm_90 here (bundled ptxas), so GPU codegen is checked."""
    pytest.importorskip("triton.backends.nvidia")
    run_compiled(AOT_COMPILE, timeout=300)
