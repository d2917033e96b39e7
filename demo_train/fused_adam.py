"""Fused Adam/AdamW in Triton: one kernel launch per ``step()`` for every parameter.

Design
------
* **Pointer tables, not a flat buffer.** Parameters, grads and state stay ordinary tensors (so
  ``state_dict()`` has torch's layout). On a rebuild the host writes an int64 table with one
  row per tensor (``data_ptr()`` of param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, fp32
  master, step, optional lr tensor; numel; dtype codes; flags) and a block table mapping each
  program to ``(tensor index, element offset)``. The kernel casts the addresses with
  ``.to(tl.pointer_type(dtype))``. The tables are cached and rebuilt only when a pointer, dtype,
  group flag or the state epoch changes, so a steady-state ``step()`` walks the params once
  for a key and launches.
* **Step counters and bias corrections on the device, no sync.** The reference suggests fp64
  bias corrections on the host, which needs the step on the host (a sync, or a host shadow that
  drifts from a loaded state). Instead every program reads its tensor's float32 ``step``,
  computes ``t = step + 1`` and ``beta**t`` in float64 by exponentiation by squaring (only fp64
  multiplies, exact to a few fp64 ulps, like torch's ``1 - beta ** step`` in Python), and rounds
  the derived scalars to fp32 just as torch's ops do. The new step is written by the *last*
  program of that tensor to finish, found with an atomic counter per tensor (acq_rel), so no
  program can read a step that was already bumped. Hyperparameters sit in a float64 device
  table, re-uploaded (pinned, non-blocking) only when a group's values change; an lr given as a
  float32 tensor on the params' device is read through its pointer (CUDA-graph friendly).
  ``grad_scale`` and ``found_inf`` are read from device tensors; when ``found_inf`` is nonzero
  every program skips its update and no step is bumped. lr and step are never constexpr.
* **Mixed dtypes in one launch.** Each row carries dtype codes (fp32/bf16/fp16) for param, grad
  and state. If every tensor shares a code it is passed as a constexpr (straight-line code);
  otherwise the kernel branches per program on the runtime code, each branch with its own
  pointer cast. Half params get fp32 ``exp_avg``/``exp_avg_sq``/``master_param`` by default
  (``master_weights=None`` means automatic); the kernel updates the master in fp32 and writes
  the rounded half copy in the same pass (28 bytes moved per bf16 param, as for fp32).
* **Vector loads.** Full blocks take an unmasked path; when every address in the tables is
  16-byte aligned (``ALIGNED``) the pointers carry ``tl.multiple_of`` hints, so sm_90 code uses
  128-bit loads/stores (checked on PTX built without a GPU). Each tensor's tail block is masked.
  Division and square root are IEEE-rounded (``div_rn``/``sqrt_rn``) as in torch.
* **Interpreter.** On CPU the kernel runs under ``TRITON_INTERPRET=1`` (set it before triton is
  imported). The module imports without it; stepping CPU tensors then raises ``ValueError``.
  The interpreter uses 16384-element programs (GPU: 2048, 8 warps) and rounds fp32 -> bf16 by
  hand, since its own cast truncates.

Differences from torch: under GradScaler the grads are unscaled inside the kernel but not
written back; float64 and complex params, sparse grads and non-dense layouts are refused; a
float lr that changes (a scheduler) costs one small async host-to-device copy at the next step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["FusedAdam", "FusedAdamW", "LAUNCH_COUNT", "interpreted", "launch_count"]

#: Number of fused kernel launches since import (tests check one per ``step()``).
LAUNCH_COUNT = 0

_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NCOL = 16  # int64 columns per tensor row
_HCOL = 8  # float64 columns per group row
_GPU_BLOCK, _GPU_WARPS = 2048, 8
_INTERP_BLOCK = 16384  # the interpreter pays per program, so use fewer, larger ones
_FLAG_AMSGRAD, _FLAG_MAXIMIZE, _FLAG_DECOUPLED = 1, 2, 4
_FP32_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _interpret_requested() -> bool:
    """What ``@triton.jit`` below will see: is TRITON_INTERPRET on at import?"""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# The interpreter truncates fp32 -> bf16; round to nearest even by hand there (the GPU does).
_SOFT_BF16 = tl.constexpr(_interpret_requested())


@triton.jit
def _typed(addr, CODE: tl.constexpr, ALIGNED: tl.constexpr):
    """Cast an int64 address to a pointer of the dtype named by CODE (16-byte aligned hint)."""
    if CODE == 0:
        ptr = addr.to(tl.pointer_type(tl.float32))
    elif CODE == 1:
        ptr = addr.to(tl.pointer_type(tl.bfloat16))
    else:
        ptr = addr.to(tl.pointer_type(tl.float16))
    if ALIGNED:  # on the pointer: a hint on the int64 does not survive the cast
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _ld(ptr, mask, EVEN: tl.constexpr):
    """Load as fp32; a full block (EVEN) needs no mask, so the compiler can vectorise."""
    if EVEN:  # noqa: SIM108 - a constexpr branch reads clearer than a ternary in a kernel
        x = tl.load(ptr).to(tl.float32)
    else:
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _st(ptr, x, mask, EVEN: tl.constexpr):
    """Store (unmasked for a full block)."""
    if EVEN:
        tl.store(ptr, x)
    else:
        tl.store(ptr, x, mask=mask)


@triton.jit
def _load_f32(addr, offs, mask, code, FIXED: tl.constexpr, EVEN: tl.constexpr, AL: tl.constexpr):
    """Load a block as fp32; FIXED >= 0 is a compile-time dtype code, -1 means use ``code``."""
    if FIXED >= 0:
        x = _ld(_typed(addr, FIXED, AL) + offs, mask, EVEN)
    elif code == 0:
        x = _ld(_typed(addr, 0, AL) + offs, mask, EVEN)
    elif code == 1:
        x = _ld(_typed(addr, 1, AL) + offs, mask, EVEN)
    else:
        x = _ld(_typed(addr, 2, AL) + offs, mask, EVEN)
    return x


@triton.jit
def _to_bf16(x):
    """fp32 -> bf16 rounded to nearest even (native on GPU, by bits under the interpreter)."""
    if _SOFT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        y = tl.where(x != x, x.to(tl.bfloat16), y)
    else:
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def _store_f32(
    addr, offs, x, mask, code, FIXED: tl.constexpr, EVEN: tl.constexpr, AL: tl.constexpr
):
    """Store an fp32 block rounded to the dtype named by FIXED (or ``code`` when FIXED < 0)."""
    if FIXED == 0:
        _st(_typed(addr, 0, AL) + offs, x, mask, EVEN)
    elif FIXED == 1:
        _st(_typed(addr, 1, AL) + offs, _to_bf16(x), mask, EVEN)
    elif FIXED == 2:
        _st(_typed(addr, 2, AL) + offs, x.to(tl.float16), mask, EVEN)
    elif code == 0:
        _st(_typed(addr, 0, AL) + offs, x, mask, EVEN)
    elif code == 1:
        _st(_typed(addr, 1, AL) + offs, _to_bf16(x), mask, EVEN)
    else:
        _st(_typed(addr, 2, AL) + offs, x.to(tl.float16), mask, EVEN)


@triton.jit
def _powi(base, n):
    """``base ** n`` for an integer n >= 0 by squaring (multiplies only, any float dtype)."""
    acc = base * 0.0 + 1.0
    b = base
    while n > 0:
        acc = tl.where((n & 1) == 1, acc * b, acc)
        b = b * b
        n = n >> 1
    return acc


@triton.jit
def _scalars(hrow, lr_addr, step):
    """Per-tensor fp32 scalars from fp64 hyperparameters and the new (fp32) step count."""
    lr = tl.load(hrow)
    if lr_addr != 0:
        lr = tl.load(lr_addr.to(tl.pointer_type(tl.float32))).to(tl.float64)
    beta1 = tl.load(hrow + 1)
    beta2 = tl.load(hrow + 2)
    eps = tl.load(hrow + 3)
    wd = tl.load(hrow + 4)
    t = step.to(tl.int32)
    bc1 = 1.0 - _powi(beta1, t)
    bc2 = 1.0 - _powi(beta2, t)
    return (
        (1.0 - lr * wd).to(tl.float32),
        (1.0 - beta1).to(tl.float32),
        beta2.to(tl.float32),
        (1.0 - beta2).to(tl.float32),
        wd.to(tl.float32),
        eps.to(tl.float32),
        (-(lr / bc1)).to(tl.float32),
        tl.sqrt(bc2).to(tl.float32),
    )


@triton.jit
def _lerp(m, g, w):
    """torch.lerp(m, g, w) with torch's two-sided formula."""
    return tl.where(w < 0.5, m + w * (g - m), g - (g - m) * (1.0 - w))


@triton.jit
def _bump_step(counter, step_addr, new_step, nblocks, ok):
    """The last program of a tensor to arrive writes the new step and resets the counter."""
    old = tl.atomic_add(counter, 1, mask=ok)
    last = ok & (old == nblocks - 1)
    tl.store(step_addr.to(tl.pointer_type(tl.float32)), new_step, mask=last)
    tl.store(counter, 0, mask=last)


@triton.jit
def _update(
    addrs,
    codes,
    sc,
    flags,
    scale_ptr,
    offs,
    mask,
    HAS_SCALE: tl.constexpr,
    P_CODE: tl.constexpr,
    G_CODE: tl.constexpr,
    S_CODE: tl.constexpr,
    MASTER: tl.constexpr,
    AMS: tl.constexpr,
    EVEN: tl.constexpr,
    AL: tl.constexpr,
):
    """The Adam/AdamW math on one block, in fp32, in torch's order of operations."""
    p_addr, g_addr, m_addr, v_addr, vmax_addr, master_addr = addrs
    p_code, g_code, s_code = codes
    decay, w1, b2, omb2, wd, eps, neg_step, bc2_sqrt = sc
    g = _load_f32(g_addr, offs, mask, g_code, G_CODE, EVEN, AL)
    if HAS_SCALE:
        g = g * tl.div_rn(1.0, tl.load(scale_ptr))
    if (flags & 2) != 0:  # maximize
        g = -g
    if MASTER == 1:
        p = _load_f32(master_addr, offs, mask, 0, 0, EVEN, AL)
    elif MASTER == 0:
        p = _load_f32(p_addr, offs, mask, p_code, P_CODE, EVEN, AL)
    elif master_addr != 0:
        p = _load_f32(master_addr, offs, mask, 0, 0, EVEN, AL)
    else:
        p = _load_f32(p_addr, offs, mask, p_code, P_CODE, EVEN, AL)
    if (flags & 4) != 0:  # decoupled (AdamW)
        p = p * decay
    else:  # L2 (Adam)
        g = g + wd * p
    m = _lerp(_load_f32(m_addr, offs, mask, s_code, S_CODE, EVEN, AL), g, w1)
    v = _load_f32(v_addr, offs, mask, s_code, S_CODE, EVEN, AL) * b2 + omb2 * g * g
    src = v
    if AMS != 0:  # noqa: SIM102 - constexpr outer test compiles the branch out
        if vmax_addr != 0:
            vmax = _load_f32(vmax_addr, offs, mask, s_code, S_CODE, EVEN, AL)
            src = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)
            _store_f32(vmax_addr, offs, src, mask, s_code, S_CODE, EVEN, AL)
    denom = tl.div_rn(tl.sqrt_rn(src), bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step * m, denom)
    _store_f32(m_addr, offs, m, mask, s_code, S_CODE, EVEN, AL)
    _store_f32(v_addr, offs, v, mask, s_code, S_CODE, EVEN, AL)
    if MASTER == 1:
        _store_f32(master_addr, offs, p, mask, 0, 0, EVEN, AL)
    elif MASTER == -1:  # noqa: SIM102 - constexpr outer test
        if master_addr != 0:
            _store_f32(master_addr, offs, p, mask, 0, 0, EVEN, AL)
    _store_f32(p_addr, offs, p, mask, p_code, P_CODE, EVEN, AL)


@triton.jit
def _fused_adam_kernel(
    tensor_tab,
    block_tab,
    hyper_tab,
    counters,
    scale_ptr,
    inf_ptr,
    HAS_SCALE: tl.constexpr,
    HAS_INF: tl.constexpr,
    P_CODE: tl.constexpr,
    G_CODE: tl.constexpr,
    S_CODE: tl.constexpr,
    MASTER: tl.constexpr,
    AMS: tl.constexpr,
    ALIGNED: tl.constexpr,
    NCOL: tl.constexpr,
    HCOL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One Adam/AdamW update of block ``program_id`` of the tensor the tables name."""
    pid = tl.program_id(0).to(tl.int64)
    t = tl.load(block_tab + 2 * pid)
    start = tl.multiple_of(tl.load(block_tab + 2 * pid + 1), BLOCK)
    row = tensor_tab + t * NCOL
    addrs = (
        tl.load(row),
        tl.load(row + 1),
        tl.load(row + 2),
        tl.load(row + 3),
        tl.load(row + 4),
        tl.load(row + 5),
    )
    step_addr, lr_addr = tl.load(row + 6), tl.load(row + 7)
    numel, nblocks, hrow = tl.load(row + 8), tl.load(row + 9), tl.load(row + 10)
    codes = (tl.load(row + 11), tl.load(row + 12), tl.load(row + 13))
    flags = tl.load(row + 14)
    ok = pid >= 0
    if HAS_INF:
        ok = tl.load(inf_ptr) == 0.0  # GradScaler found inf/nan: change nothing
    if ok:
        step = tl.load(step_addr.to(tl.pointer_type(tl.float32))) + 1.0
        sc = _scalars(hyper_tab + hrow * HCOL, lr_addr, step)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < numel
        # fmt: off
        if start + BLOCK <= numel:
            _update(addrs, codes, sc, flags, scale_ptr, offs, mask, HAS_SCALE,
                    P_CODE, G_CODE, S_CODE, MASTER, AMS, True, ALIGNED)
        else:
            _update(addrs, codes, sc, flags, scale_ptr, offs, mask, HAS_SCALE,
                    P_CODE, G_CODE, S_CODE, MASTER, AMS, False, False)
        # fmt: on
        _bump_step(counters + t, step_addr, step, nblocks, ok)


def interpreted() -> bool:
    """True when the kernel was built by the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return type(_fused_adam_kernel).__name__ == "InterpretedFunction"


def launch_count() -> int:
    """Number of fused kernel launches since import."""
    return LAUNCH_COUNT


def _block_for(device: torch.device) -> int:
    """Elements per program: large under the interpreter, which pays per program."""
    return _INTERP_BLOCK if device.type == "cpu" else _GPU_BLOCK


def _check_device(device: torch.device) -> None:
    """Refuse devices the kernel cannot run on in this process."""
    if device.type == "cpu" and not interpreted():
        raise ValueError(
            "FusedAdamW got CPU tensors but Triton is not in interpreter mode: set "
            "TRITON_INTERPRET=1 before triton is imported, or move the model to CUDA"
        )
    if device.type == "cuda" and interpreted():
        raise ValueError(
            "FusedAdamW cannot run CUDA tensors under TRITON_INTERPRET=1 (the interpreter "
            "cannot follow device pointer tables): unset it, or use CPU tensors"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"FusedAdamW supports CUDA (or CPU under the interpreter), got {device}")


def _check_tensor(p: torch.Tensor, g: torch.Tensor) -> None:
    """Refuse params/grads the pointer tables cannot describe."""
    if p.is_complex() or g.is_complex():
        raise TypeError("FusedAdamW does not support complex parameters")
    if p.dtype not in _CODES or g.dtype not in _CODES:
        raise TypeError(f"FusedAdamW supports float32/bfloat16/float16, got {p.dtype}/{g.dtype}")
    if g.device != p.device:
        raise ValueError(f"grad on {g.device} but its param on {p.device}")
    if g.shape != p.shape or not _same_dense_layout(g, p):
        raise ValueError("FusedAdamW needs dense params and grads with the same shape and strides")


def _same_dense_layout(t: torch.Tensor, p: torch.Tensor) -> bool:
    """True if ``t`` can be walked by the flat element index that walks ``p``."""
    if t.is_contiguous() and p.is_contiguous():
        return True
    formats = (torch.channels_last, torch.channels_last_3d)
    dense = any(
        p.dim() == (4 if f is torch.channels_last else 5) and p.is_contiguous(memory_format=f)
        for f in formats
    )
    return dense and t.stride() == p.stride()


def _as_step(step: Any, device: torch.device) -> torch.Tensor:
    """A float32 0-d step tensor on ``device`` (torch keeps it on CPU unless fused)."""
    if not torch.is_tensor(step):
        return torch.tensor(float(step), dtype=torch.float32, device=device)
    if step.dtype == torch.float32 and step.device == device and step.dim() == 0:
        return step
    return step.detach().reshape(()).to(device=device, dtype=torch.float32, copy=True)


def _like(t: torch.Tensor, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` if it already matches p's device/layout and ``dtype``, else a converted copy."""
    if (
        t.device == p.device
        and t.dtype == dtype
        and t.shape == p.shape
        and _same_dense_layout(t, p)
    ):
        return t
    out = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)
    return out.copy_(t.detach().reshape(p.shape))


def _upload(cpu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host table to ``device`` without blocking the host."""
    if device.type == "cpu":
        return cpu
    return cpu.pin_memory().to(device, non_blocking=True)


def _f32_on(t: torch.Tensor | None, device: torch.device, dummy: torch.Tensor) -> torch.Tensor:
    """A float32 tensor on ``device`` for grad_scale/found_inf (``dummy`` when absent)."""
    if t is None:
        return dummy
    if t.dtype == torch.float32 and t.device == device:
        return t
    return t.to(device=device, dtype=torch.float32, non_blocking=True)


def _uniform(codes: Iterable[int]) -> int:
    """The shared code, or -1 when the codes differ (branch at run time)."""
    found = set(codes)
    return found.pop() if len(found) == 1 else -1


class _Plan:
    """Device tables for one set of params/grads/state pointers."""

    def __init__(self, key: tuple, device: torch.device, rows: list[list[int]], n_groups: int):
        self.key = key
        self.device = device
        self.block = _block_for(device)
        tab = torch.tensor(rows, dtype=torch.int64)
        nblocks = tab[:, 9]
        tensor_of_block = torch.repeat_interleave(torch.arange(len(rows)), nblocks)
        first = torch.cumsum(nblocks, 0) - nblocks
        offsets = (torch.arange(int(nblocks.sum())) - first[tensor_of_block]) * self.block
        blocks = torch.stack([tensor_of_block, offsets], dim=1).contiguous()
        self.n_blocks = blocks.shape[0]
        self.tensor_tab = _upload(tab, device)
        self.block_tab = _upload(blocks, device)
        self.counters = torch.zeros(len(rows), dtype=torch.int32, device=device)
        self.hyper_tab = torch.zeros(n_groups, _HCOL, dtype=torch.float64, device=device)
        self.hyper_key: tuple | None = None
        self.dummy = torch.zeros(1, dtype=torch.float32, device=device)
        self.consts = {
            "P_CODE": _uniform(r[11] for r in rows),
            "G_CODE": _uniform(r[12] for r in rows),
            "S_CODE": _uniform(r[13] for r in rows),
            "MASTER": _uniform(int(r[5] != 0) for r in rows),
            "AMS": _uniform(int(r[4] != 0) for r in rows),
            "ALIGNED": all(addr % 16 == 0 for r in rows for addr in r[:6]),
        }

    def refresh_hyper(self, hyper_key: tuple) -> None:
        """Re-upload group hyperparameters when their host values changed."""
        if hyper_key == self.hyper_key:
            return
        rows = [[0.0 if lr is None else lr, *rest, 0.0, 0.0, 0.0] for lr, *rest in hyper_key]
        host = torch.tensor(rows, dtype=torch.float64)
        if self.device.type == "cuda":
            host = host.pin_memory()  # an async host-to-device copy, no sync
        self.hyper_tab.copy_(host, non_blocking=True)
        self.hyper_key = hyper_key

    def launch(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """One kernel launch over every block of every tensor."""
        global LAUNCH_COUNT
        if self.device.type == "cuda" and self.device.index != torch.cuda.current_device():
            with torch.cuda.device(self.device):  # Triton launches on the current device
                return self.launch(grad_scale, found_inf)
        scale = _f32_on(grad_scale, self.device, self.dummy)
        inf = _f32_on(found_inf, self.device, self.dummy)
        _fused_adam_kernel[(self.n_blocks,)](
            self.tensor_tab,
            self.block_tab,
            self.hyper_tab,
            self.counters,
            scale,
            inf,
            HAS_SCALE=grad_scale is not None,
            HAS_INF=found_inf is not None,
            NCOL=_NCOL,
            HCOL=_HCOL,
            BLOCK=self.block,
            num_warps=_GPU_WARPS,
            **self.consts,
        )
        LAUNCH_COUNT += 1


class FusedAdamW(torch.optim.Optimizer):
    """Drop-in ``torch.optim.AdamW`` whose ``step()`` is a single Triton launch.

    ``decoupled=False`` gives Adam with L2 weight decay (``g += wd * p``). ``master_weights``
    (per group; None = automatic) keeps fp32 ``master_param``/``exp_avg``/``exp_avg_sq`` for
    bf16/fp16 params. Loading a torch state: missing masters are created from the params and
    half moments are upcast; loading ours keeps fp32 moments/masters at full precision.
    Works with ``torch.amp.GradScaler`` (grads are unscaled in the kernel and a step with
    ``found_inf`` set changes nothing). After editing ``optimizer.state`` by hand, call
    :meth:`invalidate_tables`.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled: bool = True,
        master_weights: bool | None = None,
    ) -> None:
        _check_hyper(lr, betas, eps, weight_decay)
        defaults = {
            "lr": lr,
            "betas": (float(betas[0]), float(betas[1])),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "decoupled_weight_decay": decoupled,
            "master_weights": master_weights,
        }
        self._plan: _Plan | None = None
        self._epoch = 0
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Fill group keys a torch checkpoint lacks (as torch's Adam/AdamW do)."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key in ("amsgrad", "maximize", "master_weights", "decoupled_weight_decay"):
                group.setdefault(key, self.defaults[key])
            if self.defaults["decoupled_weight_decay"]:
                group["decoupled_weight_decay"] = True
        self.invalidate_tables()

    def invalidate_tables(self) -> None:
        """Force the pointer tables to be rebuilt at the next ``step()``."""
        self._plan = None
        self._epoch = getattr(self, "_epoch", 0) + 1

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, and invalidates the cached tables."""
        super().add_param_group(param_group)
        self.invalidate_tables()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but fp32 moments/masters of half params are kept at full precision."""
        saved_state = state_dict["state"]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [(p, g) for g in self.param_groups for p in g["params"]]
        for sid, (p, group) in zip(saved_ids, params, strict=True):
            src = saved_state.get(sid)
            if src is not None and _wants_master(p, group):
                for key in _FP32_KEYS:
                    if torch.is_tensor(src.get(key)):
                        self.state[p][key] = src[key].to(p.device, torch.float32, copy=True)
        self.invalidate_tables()

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        """One update of every param with a grad; ``grad_scale``/``found_inf`` may also be
        set as attributes by ``GradScaler.step``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = grad_scale if grad_scale is not None else getattr(self, "grad_scale", None)
        found_inf = found_inf if found_inf is not None else getattr(self, "found_inf", None)
        items = [
            (gi, group, p)
            for gi, group in enumerate(self.param_groups)
            for p in group["params"]
            if p.grad is not None
        ]
        if not items:
            return loss
        key = self._key(items)
        if self._plan is None or self._plan.key != key:
            self._plan = self._build(items, key)
        self._plan.refresh_hyper(self._hyper_key(self._plan.device))
        self._plan.launch(grad_scale, found_inf)
        return loss

    def _key(self, items: list[tuple[int, dict, torch.Tensor]]) -> tuple:
        """What the cached tables depend on: pointers, dtypes, sizes, group flags, epoch."""
        parts: list[Any] = [self._epoch]
        for gi, group in enumerate(self.param_groups):
            lr = group["lr"]
            parts.append(
                (
                    gi,
                    group["amsgrad"],
                    group["maximize"],
                    group["master_weights"],
                    group["decoupled_weight_decay"],
                    lr.data_ptr() if torch.is_tensor(lr) else None,
                )
            )
        grads = [p.grad for _, _, p in items]
        if any(g.layout is not torch.strided for g in grads):
            raise ValueError("FusedAdamW does not support sparse gradients")
        parts += [
            (gi, p.data_ptr(), g.data_ptr(), p.dtype, g.dtype, p.numel())
            for (gi, _, p), g in zip(items, grads, strict=True)
        ]
        return tuple(parts)

    def _hyper_key(self, device: torch.device) -> tuple:
        """Host values of the group hyperparameters (None for an lr read through a pointer)."""
        out = []
        for group in self.param_groups:
            lr = group["lr"]
            if torch.is_tensor(lr):
                lr = None if _lr_by_pointer(lr, device) else float(lr)
            b1, b2 = group["betas"]
            out.append(
                (lr, float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]))
            )
        return tuple(out)

    def _build(self, items: list[tuple[int, dict, torch.Tensor]], key: tuple) -> _Plan:
        """Validate, initialise state and write the tables for ``items``."""
        device = items[0][2].device
        _check_device(device)
        rows = []
        for gi, group, p in items:
            if p.device != device:
                raise ValueError(f"FusedAdamW needs all params on one device: {device}, {p.device}")
            _check_tensor(p, p.grad)
            rows.append(self._row(gi, group, p))
        plan = _Plan(key, device, rows, len(self.param_groups))
        return plan

    def _row(self, gi: int, group: dict, p: torch.Tensor) -> list[int]:
        """One int64 table row for param ``p`` (initialising or fixing its state)."""
        st = self._ensure_state(p, group)
        flags = (
            _FLAG_AMSGRAD * bool(group["amsgrad"])
            + _FLAG_MAXIMIZE * bool(group["maximize"])
            + _FLAG_DECOUPLED * bool(group["decoupled_weight_decay"])
        )
        vmax = st.get("max_exp_avg_sq") if group["amsgrad"] else None
        master = st.get("master_param")
        lr = group["lr"]
        return [
            p.data_ptr(),
            p.grad.data_ptr(),
            st["exp_avg"].data_ptr(),
            st["exp_avg_sq"].data_ptr(),
            0 if vmax is None else vmax.data_ptr(),
            0 if master is None else master.data_ptr(),
            st["step"].data_ptr(),
            lr.data_ptr() if _lr_by_pointer(lr, p.device) else 0,
            p.numel(),
            max(1, math.ceil(p.numel() / _block_for(p.device))),
            gi,
            _CODES[p.dtype],
            _CODES[p.grad.dtype],
            _CODES[st["exp_avg"].dtype],
            flags,
            0,
        ]

    def _ensure_state(self, p: torch.Tensor, group: dict) -> dict[str, Any]:
        """Create state lazily, or bring a loaded one to the layout the kernel expects."""
        st = self.state[p]
        master = _wants_master(p, group)
        if "exp_avg" in st:
            sdtype = torch.float32 if master else st["exp_avg"].dtype
        else:
            sdtype = torch.float32 if master else p.dtype
        if sdtype not in _CODES:
            raise TypeError(f"FusedAdamW state dtype {sdtype} is not supported")
        st["step"] = _as_step(st.get("step", 0.0), p.device)
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        for k in keys:
            st[k] = _like(st[k], p, sdtype) if k in st else torch.zeros_like(p, dtype=sdtype)
        if master:  # a torch checkpoint has no master: start it from the param
            st["master_param"] = _like(st.get("master_param", p), p, torch.float32)
        else:
            st.pop("master_param", None)
        return st


class FusedAdam(FusedAdamW):
    """Drop-in ``torch.optim.Adam`` (L2 weight decay added to the grad, default 0)."""

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        master_weights: bool | None = None,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            decoupled=False,
            master_weights=master_weights,
        )


def _wants_master(p: torch.Tensor, group: dict) -> bool:
    """fp32 master copy for half params unless the group turned it off."""
    return p.dtype in (torch.bfloat16, torch.float16) and group["master_weights"] is not False


def _lr_by_pointer(lr: Any, device: torch.device) -> bool:
    """True if the kernel reads lr through the tensor's pointer; False to read it on the host.

    A float32 one-element tensor on the params' device is read in the kernel (no sync, CUDA
    graph friendly); a CPU tensor with CUDA params is read on the host (no sync either).
    """
    if not torch.is_tensor(lr):
        return False
    if lr.device == device and lr.dtype == torch.float32 and lr.numel() == 1:
        return True
    if lr.device.type == "cpu":
        return False
    raise ValueError("a Tensor lr must be float32 with one element on the params' device, or CPU")


def _check_hyper(lr: Any, betas: tuple, eps: float, weight_decay: float) -> None:
    """The argument checks torch.optim.Adam does."""
    if torch.is_tensor(lr) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    for i in (0, 1):
        if not 0.0 <= betas[i] < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
