"""FusedAdamW's host side: torch ops per step(), when tables are rebuilt, CUDA graph capture.

Op counts come from torch.profiler with the kernel launch stubbed (the Triton interpreter does
torch work of its own); wall times are for bench/fused_adam.py --host, never for tests. The
capture path is exercised on CPU by pretending a stream is being captured; the real CUDA graph
check runs in a subprocess and is skipped without a GPU.
"""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
from fused_adam_support import LaunchStub, run_compiled, torch_ops_in
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile

from scalemon.demo_train import adam_plan
from scalemon.demo_train import fused_adam as fa

F32 = {"rtol": 1e-5, "atol": 1e-6}
# tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported: the kernels here run
# in the interpreter, never skipped
assert fa.interpreted(), "triton was imported before TRITON_INTERPRET=1 was set"


def _params(n: int, seed: int = 0, shape: tuple[int, ...] = (5,)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for _ in range(n)]


def _twins(ps: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in ps]


def _grad_sets(ps: list[torch.Tensor], k: int, seed: int) -> list[list[torch.Tensor]]:
    """k sets of grads, all alive at once, so that every set has its own addresses."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in ps] for _ in range(k)]


def _assign(ps: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(ps, grads, strict=True):
        p.grad = g


def _ops_per_step(n: int, mode: str) -> tuple[int, int]:
    """(torch ops in the 4th step, plans built in 4 steps) for n tensors and a grad mode:
    ``same`` grads every step, ``new`` grads (two live sets, alternating: new addresses every
    step), ``set_to_none`` (zero_grad(set_to_none=True), then fresh grads)."""
    ps = _params(n)
    opt = fa.FusedAdamW(ps, lr=1e-2)
    sets = _grad_sets(ps, 2, seed=1)
    builds = []
    build = opt._build
    opt._build = lambda *a: builds.append(1) or build(*a)

    def grads(i: int) -> None:
        if mode == "new" or i == 0:
            _assign(ps, sets[i % 2])
        elif mode == "set_to_none":
            opt.zero_grad(set_to_none=True)
            _assign(ps, [torch.randn(p.shape) for p in ps])

    for i in range(3):
        grads(i)
        opt.step()
    grads(3)
    ops = torch_ops_in(opt.step)
    return sum(ops.values()), len(builds)


@pytest.mark.parametrize("mode", ["same", "new", "set_to_none"])
def test_host_ops_per_step_do_not_grow_with_tensors(monkeypatch, mode):
    stub = LaunchStub(monkeypatch)
    few, few_builds = _ops_per_step(8, mode)
    many, many_builds = _ops_per_step(300, mode)
    assert few == many, (few, many)
    assert few_builds == many_builds == 1  # the tables are built once
    assert stub.calls == 8  # one launch per step
    if mode == "same":
        assert few == 0
    if mode == "new":
        assert 0 < few <= 8  # only the grad column is uploaded


def test_host_ops_same_with_and_without_set_to_none(monkeypatch):
    LaunchStub(monkeypatch)
    new = _ops_per_step(64, "new")[0]
    assert _ops_per_step(64, "set_to_none")[0] in (0, new)  # 0: the allocator gave the same
    assert _ops_per_step(64, "same")[0] == 0


def test_step_hooks_and_the_profiler_range_still_work_without_torchs_wrapper(monkeypatch):
    """torch's own wrapper (a profiler range and the step hooks around every step) runs only
    while a profiler records or a hook is registered; the hooks the monitor's agent uses
    still run, in torch's order, and a profile still shows the step's range."""
    LaunchStub(monkeypatch)
    ps = _params(4)
    opt = fa.FusedAdamW(ps, lr=1e-2)
    _assign(ps, _grad_sets(ps, 1, seed=1)[0])
    ranges = []
    real = torch.autograd.profiler.record_function
    monkeypatch.setattr(torch.autograd.profiler, "record_function",
                        lambda name, *a: ranges.append(name) or real(name, *a))
    opt.step()
    assert ranges == []  # no hook, no profiler: the step alone
    assert not hasattr(fa.FusedAdamW.step, "__wrapped__")  # torch did not wrap it again
    calls = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
    post = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))
    glob = register_optimizer_step_post_hook(
        lambda o, args, kwargs: calls.append(("global post", o)))
    try:
        opt.step()
    finally:
        glob.remove()
    assert calls == [("pre", opt), ("post", opt), ("global post", opt)]
    assert ranges == ["Optimizer.step#FusedAdamW.step"]
    pre.remove()
    post.remove()
    ranges.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    assert ranges == ["Optimizer.step#FusedAdamW.step"]
    assert any(e.name == "Optimizer.step#FusedAdamW.step" for e in prof.events())


def test_new_grads_each_step_match_torch():
    ref_ps = _params(6, seed=2, shape=(257,))
    our_ps = _twins(ref_ps)
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, weight_decay=0.1, foreach=False)
    ours = fa.FusedAdamW(our_ps, lr=1e-2, weight_decay=0.1)
    sets = _grad_sets(ref_ps, 3, seed=3)
    for i in range(9):
        _assign(ref_ps, sets[i % 3])
        _assign(our_ps, [g.clone() for g in sets[(i % 3)]])  # new addresses every step
        ref.step()
        ours.step()
        assert ours._plan.gptrs == [p.grad.data_ptr() for p in our_ps]
    for r, o in zip(ref_ps, our_ps, strict=True):
        torch.testing.assert_close(o, r, **F32)


def test_rebuilt_when_a_param_moves_and_updates_its_new_storage():
    ps = _params(3, seed=4)
    opt = fa.FusedAdamW(ps, lr=1e-1)
    _assign(ps, [torch.ones(5) for _ in ps])
    opt.step()
    plan = opt._plan
    old = ps[1].detach()
    ps[1].data = ps[1].detach().clone()  # as model.to() does
    before_old, before_new = old.clone(), ps[1].detach().clone()
    opt.step()
    assert opt._plan is not plan
    assert torch.equal(old, before_old)  # the old storage is left alone
    assert not torch.equal(ps[1].detach(), before_new)


def test_rebuilt_when_group_params_or_grads_change():
    ps = _params(4, seed=5)
    opt = fa.FusedAdamW([{"params": ps[:2]}, {"params": ps[2:]}], lr=1e-2)
    _assign(ps, [torch.ones(5) for _ in ps])
    opt.step()
    plan = opt._plan
    extra = _params(1, seed=6)[0]
    extra.grad = torch.ones(5)
    opt.param_groups[1]["params"][1] = extra  # edited in place: same list, same length
    opt.step()
    assert opt._plan is not plan and opt._plan.params[-1] is extra
    plan = opt._plan
    opt.param_groups[0]["amsgrad"] = True
    opt.step()
    assert opt._plan is not plan and "max_exp_avg_sq" in opt.state[ps[0]]


def test_new_grad_with_other_layout_is_refused():
    p = torch.randn(3, 4, requires_grad=True)
    opt = fa.FusedAdamW([p], lr=1e-2)
    p.grad = torch.ones(3, 4)
    opt.step()
    p.grad = torch.ones(4, 3).t()  # same shape, other strides: torch's setter allows it
    with pytest.raises(ValueError, match="strides"):
        opt.step()


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="torch without grad_dtype")
def test_new_grad_with_other_dtype_rebuilds():
    q = torch.randn(6, dtype=torch.bfloat16, requires_grad=True)
    q.grad_dtype = None  # torch >= 2.10: a grad of another dtype is allowed
    ref = torch.optim.AdamW([r := q.detach().float().requires_grad_()], lr=1e-2, foreach=False)
    ours = fa.FusedAdamW([q], lr=1e-2)
    q.grad, r.grad = torch.ones(6, dtype=torch.bfloat16), torch.ones(6)
    ours.step()
    ref.step()
    q.grad, r.grad = torch.full((6,), 0.5), torch.full((6,), 0.5)  # fp32 grad now: rebuilt
    ours.step()
    ref.step()
    assert ours._plan.consts["G_CODE"] == 0
    torch.testing.assert_close(ours.fp32_master(q), r.detach(), **F32)


@pytest.fixture
def capturing(monkeypatch):
    """Pretend that a CUDA graph is being captured (the CPU runs the pokes at once)."""
    state = {"on": False}
    monkeypatch.setattr(fa, "_capturing", lambda device: state["on"])
    return state


def test_capture_needs_capturable(capturing):
    ps = _params(2, seed=7)
    opt = fa.FusedAdamW(ps)
    _assign(ps, [torch.ones(5) for _ in ps])
    opt.step()
    capturing["on"] = True
    with pytest.raises(RuntimeError, match="capturable=True"):
        opt.step()


def test_capture_writes_its_own_grad_table_with_pokes(capturing):
    ref_ps = _params(11, seed=8)
    our_ps = _twins(ref_ps)
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, foreach=False)
    ours = fa.FusedAdamW(our_ps, lr=1e-2, capturable=True)
    sets = _grad_sets(ref_ps, 2, seed=9)
    for i in range(4):
        _assign(ref_ps, sets[i % 2])
        _assign(our_ps, [g.clone() for g in sets[i % 2]])
        capturing["on"] = i >= 2  # warm-up, then "capture" with grads the warm-up never saw
        pokes, eager = adam_plan.POKE_COUNT, ours._plan.grad_tab.clone() if ours._plan else None
        ref.step()
        ours.step()
        if capturing["on"]:
            assert adam_plan.POKE_COUNT - pokes == 2  # 11 addresses, 8 a launch
            assert torch.equal(ours._plan.grad_tab, eager)  # the eager column is untouched
            assert ours._graph_plans == [ours._plan]
    for r, o in zip(ref_ps, our_ps, strict=True):
        torch.testing.assert_close(o, r, **F32)


def test_capture_refuses_what_it_cannot_record(capturing):
    ps = _params(2, seed=10)
    opt = fa.FusedAdamW(ps, lr=1e-2, capturable=True)
    capturing["on"] = True
    _assign(ps, [torch.ones(5) for _ in ps])
    with pytest.raises(RuntimeError, match="warm-up"):
        opt.step()  # no eager step yet: no tables
    capturing["on"] = False
    opt.step()
    opt.param_groups[0]["lr"] = 5e-3
    capturing["on"] = True
    with pytest.raises(RuntimeError, match="sync_hyperparameters"):
        opt.step()
    capturing["on"] = False
    opt.sync_hyperparameters()
    assert opt._plan.hyper_tab[0, 0].item() == 5e-3
    capturing["on"] = True
    opt.step()


def test_poke_writes_pairs():
    dst = torch.zeros(20, dtype=torch.int64)
    pairs = [(i, (1 << 47) + 13 * i) for i in range(11)] + [(19, 0), (18, 1)]
    adam_plan.poke(dst, pairs)
    want = torch.zeros(20, dtype=torch.int64)
    for i, v in pairs:
        want[i] = v
    assert torch.equal(dst, want)


def _trained(opt: torch.optim.Optimizer, ps: list[torch.Tensor], steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _assign(ps, [torch.randn(p.shape, generator=gen) for p in ps])
        opt.step()


@pytest.mark.parametrize("dst_capturable", [True, False])
def test_capturable_state_dict_round_trips(dst_capturable):
    ps = _params(3, seed=11, shape=(33,))
    src = fa.FusedAdamW(ps, lr=1e-2, amsgrad=True, capturable=True)
    _trained(src, ps, steps=4, seed=12)
    sd = copy.deepcopy(src.state_dict())
    assert sd["param_groups"][0]["capturable"] is True
    assert sd["state"][0]["step"].dtype == torch.float32 and sd["state"][0]["step"].dim() == 0
    ps2 = _twins(ps)
    dst = fa.FusedAdamW(ps2, lr=1e-2, amsgrad=True, capturable=dst_capturable)
    dst.load_state_dict(sd)
    assert dst.param_groups[0]["capturable"] is True  # the saved group wins, as in torch
    _trained(src, ps, steps=3, seed=13)
    _trained(dst, ps2, steps=3, seed=13)
    for a, b in zip(ps, ps2, strict=True):
        assert torch.equal(a, b)
        assert float(src.state[a]["step"]) == float(dst.state[b]["step"]) == 7.0
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert torch.equal(src.state[a][key], dst.state[b][key]), key


def test_capturable_state_dict_to_and_from_torch():
    ps = _params(3, seed=14, shape=(33,))
    ours = fa.FusedAdamW(ps, lr=1e-2, capturable=True)
    _trained(ours, ps, steps=4, seed=15)
    ref_ps = _twins(ps)
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, foreach=False)
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    ref.param_groups[0]["capturable"] = False  # torch refuses capturable on CPU
    _trained(ours, ps, steps=3, seed=16)
    _trained(ref, ref_ps, steps=3, seed=16)
    for a, b in zip(ps, ref_ps, strict=True):
        torch.testing.assert_close(a, b, **F32)
    back_ps = _twins(ref_ps)
    back = fa.FusedAdamW(back_ps, lr=1e-2, capturable=True)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    back.param_groups[0]["capturable"] = True
    _trained(back, back_ps, steps=2, seed=17)
    _trained(ref, ref_ps, steps=2, seed=17)
    for a, b in zip(back_ps, ref_ps, strict=True):
        torch.testing.assert_close(a, b, **F32)
        assert float(back.state[a]["step"]) == 9.0


CUDA_GRAPH = textwrap.dedent(
    """
    import torch
    from torch.profiler import ProfilerActivity, profile
    from scalemon.demo_train import fused_adam as fa
    assert not fa.interpreted()
    torch.manual_seed(0)

    def model_and_opt(cls, **kw):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).cuda()
        lr = torch.tensor(1e-2, device="cuda")
        return m, cls(m.parameters(), lr=lr, weight_decay=0.1, capturable=True, **kw)

    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 64, device="cuda")
    ref_m, ref = model_and_opt(torch.optim.AdamW, foreach=False)
    m, opt = model_and_opt(fa.FusedAdamW)
    sx, sy = x.clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's recipe: warm up on a side stream
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(m(sx), sy).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # grads are allocated inside the graph
    with torch.cuda.graph(graph):
        torch.nn.functional.mse_loss(m(sx), sy).backward()
        opt.step()
    for _ in range(3):
        ref.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ref_m(x), y).backward()
        ref.step()
    for i in range(6):
        xi, yi = torch.randn(32, 64, device="cuda"), torch.randn(32, 64, device="cuda")
        sx.copy_(xi)
        sy.copy_(yi)
        graph.replay()
        ref.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ref_m(xi), yi).backward()
        ref.step()
        if i == 2:  # a tensor lr changed in place is seen by the replays
            opt.param_groups[0]["lr"].fill_(5e-3)
            ref.param_groups[0]["lr"].fill_(5e-3)
    torch.cuda.synchronize()
    for a, b in zip(m.parameters(), ref_m.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert float(opt.state[next(m.parameters())]["step"]) == 9.0

    # eager, set_to_none=True: no sync, one kernel and a constant number of host ops
    ps = [torch.randn(64, device="cuda", requires_grad=True) for _ in range(300)]
    o = fa.FusedAdamW(ps, lr=1e-3)
    def fresh():
        for p in ps:
            p.grad = torch.randn_like(p)
    for _ in range(3):
        fresh(); o.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    fresh(); o.step()
    torch.cuda.set_sync_debug_mode(0)
    fresh()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        o.step()
    ops = [e.name for e in prof.events() if e.name.startswith("aten::")]
    assert len(ops) <= 12, ops

    # bf16 params, lo16 master and bf16 moments on the GPU: the master is exact
    hp = torch.randn(5000, device="cuda").bfloat16().requires_grad_()
    fp = hp.detach().float().requires_grad_()
    o1 = fa.FusedAdamW([hp], lr=1e-2, master_weights="lo16")
    o2 = torch.optim.AdamW([fp], lr=1e-2, foreach=False)
    for _ in range(10):
        g = torch.randn(5000, device="cuda").bfloat16()
        hp.grad, fp.grad = g, g.float()
        o1.step(); o2.step()
    torch.testing.assert_close(o1.fp32_master(hp), fp.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(hp.detach(), fa.split_lo16(o1.fp32_master(hp))[0])
    print("ok")
    """
)


def test_the_cuda_graph_script_is_python():
    """The script runs only on a GPU: here at least it must compile (a line of it once slipped
    to column 0, so that dedent left it indented: an IndentationError on every GPU run)."""
    compile(CUDA_GRAPH, "CUDA_GRAPH", "exec")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_capture_set_to_none_and_lo16():
    run_compiled(CUDA_GRAPH)
