"""FusedAdamW(flat_buffers=True): params and grads in flat buffers, an O(1) host step.

Host work is checked without timing: torch ops per step() from the profiler, and whether the
step reads the param lists at all (a list that counts every read). Results are checked against
torch's AdamW through real autograd, including what happens when something outside the
optimizer replaces grads or params.
"""

from __future__ import annotations

import collections
import copy
import textwrap

import pytest
import torch
from fused_adam_support import LaunchStub, run_compiled, torch_ops_in

from scalemon.demo_train import fused_adam as fa
from scalemon.demo_train.flat_buffers import SPOT_CHECKS

F32 = {"rtol": 1e-5, "atol": 1e-6}
# tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported: the kernels here run
# in the interpreter, never skipped
assert fa.interpreted(), "triton was imported before TRITON_INTERPRET=1 was set"


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.LayerNorm(12), torch.nn.Linear(12, 3)
    )


def _groups(model: torch.nn.Module) -> list[dict]:
    """nanoGPT's split: decay on matrices only."""
    ps = list(model.parameters())
    return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]


def _backward(model: torch.nn.Module, seed: int) -> None:
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()


def _pair(**ours: object) -> tuple:
    """(torch model, torch AdamW, our model, FusedAdamW) starting from the same weights."""
    ref_model, our_model = _model(), _model()
    ref = torch.optim.AdamW(_groups(ref_model), lr=1e-2, foreach=False)
    opt = fa.FusedAdamW(_groups(our_model), lr=1e-2, flat_buffers=True, **ours)
    return ref_model, ref, our_model, opt


def _assert_same(ref_model: torch.nn.Module, our_model: torch.nn.Module) -> None:
    for r, o in zip(ref_model.parameters(), our_model.parameters(), strict=True):
        torch.testing.assert_close(o.detach(), r.detach(), **F32)


class _CountedList(list):
    """A param list that counts how often anything reads it."""

    reads = 0

    def __iter__(self):
        _CountedList.reads += 1
        return super().__iter__()

    def __len__(self) -> int:
        _CountedList.reads += 1
        return super().__len__()

    def __getitem__(self, i):
        _CountedList.reads += 1
        return super().__getitem__(i)


def _many(n: int) -> tuple[list[torch.Tensor], fa.FusedAdamW]:
    ps = [torch.randn(5, generator=torch.Generator().manual_seed(i)).requires_grad_()
          for i in range(n)]
    return ps, fa.FusedAdamW(ps, lr=1e-2, flat_buffers=True)


def _real_backward(ps: list[torch.Tensor], seed: int) -> None:
    torch.manual_seed(seed)
    sum((p * torch.randn(5)).sum() for p in ps).backward()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_step_runs_no_torch_op_and_never_reads_the_param_lists(monkeypatch, set_to_none):
    stub = LaunchStub(monkeypatch)
    ops, reads = [], []
    for n in (8, 300):
        ps, opt = _many(n)
        for i in range(3):  # the first step builds the tables
            opt.zero_grad(set_to_none=set_to_none)
            _real_backward(ps, i)
            opt.step()
        for group in opt.param_groups:
            group["params"] = _CountedList(group["params"])
        _CountedList.reads = 0
        opt.zero_grad(set_to_none=set_to_none)
        _real_backward(ps, 3)
        ops.append(sum(torch_ops_in(opt.step).values()))
        reads.append(_CountedList.reads)
        assert opt.flat_buffers.restored == 0
    assert ops == [0, 0]
    assert reads == [0, 0]  # the host work does not depend on the number of tensors
    assert stub.calls == 8


def test_zero_grad_keeps_grads_in_place_and_zeroes_them():
    ps, opt = _many(4)
    _real_backward(ps, 0)
    addrs = [p.grad.data_ptr() for p in ps]
    assert all(p.grad.abs().sum() > 0 for p in ps)
    opt.zero_grad(set_to_none=True)
    assert [p.grad.data_ptr() for p in ps] == addrs
    assert all(torch.count_nonzero(p.grad) == 0 for p in ps)
    _real_backward(ps, 1)  # autograd adds into the buffer
    assert [p.grad.data_ptr() for p in ps] == addrs
    bucket = opt.flat_buffers.buckets[0]
    assert all(p.untyped_storage()._cdata == bucket.storages()[0] for p in ps)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_matches_torch_adamw_through_autograd(set_to_none):
    ref_model, ref, our_model, opt = _pair()
    for i in range(6):
        for model, o in ((ref_model, ref), (our_model, opt)):
            o.zero_grad(set_to_none=set_to_none)
            _backward(model, i)
            o.step()
    _assert_same(ref_model, our_model)
    assert opt.flat_buffers.restored == 0


def test_a_param_without_grad_is_stepped_as_torch_does_after_set_to_none_false():
    """torch steps a param whose grad was zeroed (not freed) with that zero grad."""
    ref_model, ref, our_model, opt = _pair()
    for i in range(4):
        for model, o in ((ref_model, ref), (our_model, opt)):
            o.zero_grad(set_to_none=False)
            x = torch.randn(16, 6, generator=torch.Generator().manual_seed(i))
            part = model if i == 0 else model[:3]  # then the last Linear gets no grad
            part(x).pow(2).mean().backward()
            o.step()
    _assert_same(ref_model, our_model)


def test_grads_set_to_none_by_the_model_are_put_back():
    """model.zero_grad() (set_to_none) frees the views: the next step notices, copies the
    new grads into the buffer, and the result is torch's."""
    ref_model, ref, our_model, opt = _pair()
    for i in range(5):
        ref_model.zero_grad()
        our_model.zero_grad()
        _backward(ref_model, i)
        _backward(our_model, i)
        ref.step()
        opt.step()
    _assert_same(ref_model, our_model)
    n = len(list(our_model.parameters()))
    assert opt.flat_buffers.restored == 5 * n  # every grad, at every step
    grad_storages = {b.storages()[1] for b in opt.flat_buffers.buckets}
    assert len(grad_storages) == 2  # a bucket per param group
    assert all(p.grad.untyped_storage()._cdata in grad_storages for p in our_model.parameters())


def test_a_grad_replaced_while_its_old_view_is_held_is_found_by_the_rotating_check():
    ps, opt = _many(2 * SPOT_CHECKS)
    _real_backward(ps, 0)
    opt.step()
    held = [p.grad for p in ps]  # keeps the views alive: use counts do not change
    before = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = torch.full((5,), 1.0)  # (held[i] still holds the old grads)
    opt.step()
    opt.step()  # SPOT_CHECKS params a step: every param checked by now
    assert opt.flat_buffers.restored == len(ps)
    assert all(torch.equal(p.grad, torch.full((5,), 1.0)) for p in ps)
    assert all(not torch.equal(p, b) for p, b in zip(ps, before, strict=True))
    del held


def test_a_param_given_new_storage_is_put_back_and_updated():
    ref_model, ref, our_model, opt = _pair()
    for model, o in ((ref_model, ref), (our_model, opt)):
        _backward(model, 0)
        o.step()
    w_ref, w_ours = ref_model[0].weight, our_model[0].weight
    for w in (w_ref, w_ours):
        w.data = w.data.clone() * 0.5  # e.g. a param replaced by hand
    for model, o in ((ref_model, ref), (our_model, opt)):
        o.zero_grad()
        _backward(model, 1)
        o.step()
    _assert_same(ref_model, our_model)
    bucket = opt.flat_buffers.buckets[0]
    assert w_ours.untyped_storage()._cdata == bucket.storages()[0]


def test_a_param_moved_to_another_dtype_is_refused_clearly():
    _, _, our_model, opt = _pair()
    _backward(our_model, 0)
    opt.step()
    our_model.double()
    our_model(torch.randn(4, 6, dtype=torch.float64)).sum().backward()
    with pytest.raises(ValueError, match="move the model first, then build the optimizer"):
        opt.step()


def test_frozen_params_are_refused():
    model = _model()
    model[0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="only params that require grad"):
        fa.FusedAdamW(model.parameters(), flat_buffers=True)


def test_buffers_are_aligned_and_keep_channels_last_strides():
    conv = torch.nn.Conv2d(3, 5, 3).to(memory_format=torch.channels_last)
    strides = conv.weight.stride()
    extra = torch.randn(3).requires_grad_()
    opt = fa.FusedAdamW([*conv.parameters(), extra], flat_buffers=True)
    assert conv.weight.stride() == strides
    assert all(p.data_ptr() % 64 == 0 for p in [*conv.parameters(), extra])
    ref_conv = copy.deepcopy(conv)
    ref = torch.optim.AdamW(ref_conv.parameters(), lr=1e-3, foreach=False)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    for model, o in ((conv, opt), (ref_conv, ref)):
        model(x).sum().backward()
        o.step()
    torch.testing.assert_close(conv.weight.detach(), ref_conv.weight.detach(), **F32)


def test_bf16_params_with_lo16_master_match_the_unflattened_optimizer():
    flat_model, plain_model = _model().bfloat16(), _model().bfloat16()
    flat = fa.FusedAdamW(flat_model.parameters(), lr=1e-2, master_weights="lo16",
                         moment_dtype="bf16", flat_buffers=True)
    plain = fa.FusedAdamW(plain_model.parameters(), lr=1e-2, master_weights="lo16",
                          moment_dtype="bf16")
    for i in range(4):
        for model, o in ((flat_model, flat), (plain_model, plain)):
            o.zero_grad()
            x = torch.randn(16, 6, generator=torch.Generator().manual_seed(i)).bfloat16()
            model(x).float().pow(2).mean().backward()
            o.step()
    for a, b in zip(flat_model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(flat.fp32_master(a), plain.fp32_master(b))


def test_state_dict_round_trips_into_a_plain_optimizer_and_back():
    _, _, our_model, opt = _pair()
    for i in range(3):
        opt.zero_grad()
        _backward(our_model, i)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    twin_model = copy.deepcopy(our_model)
    plain = fa.FusedAdamW(_groups(twin_model), lr=1e-2)
    plain.load_state_dict(saved)
    again = fa.FusedAdamW(_groups(our_model), lr=1e-2, flat_buffers=True)
    again.load_state_dict(copy.deepcopy(plain.state_dict()))  # no shared moments
    for model, o in ((twin_model, plain), (our_model, again)):
        o.zero_grad()
        _backward(model, 9)
        o.step()
    for a, b in zip(our_model.parameters(), twin_model.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), **F32)


def test_added_param_groups_get_buffers_of_their_own():
    ps, opt = _many(3)
    late = torch.randn(5).requires_grad_()
    opt.add_param_group({"params": [late], "lr": 1e-3})
    assert len(opt.flat_buffers.buckets) == 2
    assert late.grad is not None and torch.count_nonzero(late.grad) == 0
    _real_backward([*ps, late], 0)
    opt.step()
    assert opt.flat_buffers.restored == 0


def test_host_op_counts_are_the_same_flat_or_not_with_stable_grads(monkeypatch):
    """Side by side with the default mode: with new grads every step the default uploads the
    grad column (a few ops), flat buffers none."""
    LaunchStub(monkeypatch)
    counts = collections.Counter()
    for flat in (False, True):
        ps = [torch.randn(5).requires_grad_() for _ in range(16)]
        opt = fa.FusedAdamW(ps, flat_buffers=flat)
        for i in range(3):
            opt.zero_grad(set_to_none=True)
            _real_backward(ps, i)
            keep = [p.grad for p in ps]  # new grads get new addresses in the default mode
            opt.step()
        opt.zero_grad(set_to_none=True)
        _real_backward(ps, 3)
        counts[flat] = sum(torch_ops_in(opt.step).values())
        del keep
    assert counts[True] == 0 < counts[False]


CUDA_FLAT = textwrap.dedent(
    """
    import torch
    from scalemon.demo_train import fused_adam as fa
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)).cuda()
    ref_model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 64)).cuda()
    ref_model.load_state_dict(model.state_dict())
    opt = fa.FusedAdamW(model.parameters(), lr=1e-3, flat_buffers=True, capturable=True)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(32, 64, device="cuda")
    def train(m, o):
        o.zero_grad(set_to_none=True)
        m(x).pow(2).mean().backward()
        o.step()
    for _ in range(3):
        train(model, opt); train(ref_model, ref)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model(x).pow(2).mean().backward()  # warm the backward on the side stream
        opt.zero_grad()
        with torch.cuda.graph(g):
            opt.step()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        g.replay()
        train(ref_model, ref)
    torch.cuda.synchronize()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert opt.flat_buffers.restored == 0
    print("ok")
    """
)


def test_the_cuda_flat_script_is_python():
    """It runs only on a GPU: here at least it must compile."""
    compile(CUDA_FLAT, "CUDA_FLAT", "exec")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flat_buffers_step_in_a_cuda_graph():
    run_compiled(CUDA_FLAT)
