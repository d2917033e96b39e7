"""Fused Adam/AdamW in Triton: one kernel launch per ``step()`` for every parameter.

Host side: a constant number of torch ops per step
--------------------------------------------------
* **Pointer tables.** Params, grads and state stay ordinary tensors (``state_dict()`` has
  torch's layout). The kernel reads an int64 table with one row per tensor (``data_ptr()`` of
  param, exp_avg, exp_avg_sq, max_exp_avg_sq, master, step, optional lr tensor; numel; dtype
  codes; flags), a separate column of grad addresses, and a block table mapping each program to
  ``(tensor, element offset)``; addresses are cast with ``.to(tl.pointer_type(dtype))``.
* **Rebuilt only when the set of tensors changes.** A ``step()`` checks, with C-level ``map``
  calls and no torch op, that every group still holds the same param objects, that the same
  params have grads and that no param's storage moved; then it reads the grads' addresses. Same
  grads as last step (``zero_grad(set_to_none=False)``, DDP's ``gradient_as_bucket_view``, or a
  caching allocator that handed out the same blocks): **no torch op**. New grads
  (``set_to_none=True``): they are validated (dense, the param's strides, 16-byte alignment for
  the vectorised variant) and the grad column is uploaded: a fixed handful of torch ops (7
  profiler events on CPU) whatever the number of tensors. The full rebuild (state creation,
  block table) happens after a change of params, of which params have grads, of a group flag,
  and after ``load_state_dict``, ``add_param_group`` or ``invalidate_tables()``. The host still
  touches every param (``p.grad``, two ``data_ptr()``, a few attribute reads for new grads):
  below a microsecond per tensor, measured by ``bench/fused_adam.py --host``
  (docs/fused_adam.md); a CUDA graph (below) removes even that.
* **Flat buffers, when asked** (``flat_buffers=True``, ``flat_buffers.py``): the default above
  still touches every param each step (about 1 us a tensor) and uploads new grad addresses
  after ``set_to_none=True``. With flat buffers the params and grads become views of one flat
  buffer per (device, dtype), as in DeepSpeed and Apex; ``zero_grad`` zeroes the grads instead
  of freeing them, and a step checks in O(1) (storage use counts and two rotating addresses)
  that nothing was moved, so the host work of ``step()`` no longer depends on the number of
  tensors and no torch op runs. The price is a memset and an in-place add of the first
  micro-batch's grads per step, and that a param without a grad is stepped with a zero grad
  (torch's behaviour after ``set_to_none=False``). Not the default, as it changes what the
  caller's params are (views of a buffer).

CUDA graphs (``capturable=True``)
---------------------------------
Everything the kernel reads lives on the device: step counts (float32 tensors in the state),
bias corrections (computed in the kernel), hyperparameters (a float64 device table), lr (a
float32 tensor on the params' device is read through its pointer), ``grad_scale`` and
``found_inf``; nothing is read back to the host. While a stream is being captured, ``step()``
writes the grad addresses of that moment into a table of its own with small "poke" launches
(the addresses are kernel arguments, so the graph holds them) and launches the kernel on it;
eager steps before or after never touch that table. Capture after at least one eager step with
the same params (the tables and both kernels must exist; warm-up steps do this), change float
hyperparameters between replays only through ``sync_hyperparameters()`` (or use a tensor lr,
updated in place), and do not replace params or state after capturing. Without
``capturable=True`` a step under capture raises, as torch's optimizers do.

bf16 params: bytes per parameter and master weights
---------------------------------------------------
Per group, ``master_weights`` (None = automatic = "fp32" for half params) and ``moment_dtype``
("fp32" or "bf16"; None = fp32 when there is a master, else the param's dtype):

=========================================  =========  ======================================
bf16 params with                           B/param    master
=========================================  =========  ======================================
master "fp32", moments fp32 (default)      28         fp32 copy (exact fp32 AdamW)
master "lo16", moments fp32                26         exact fp32 (param + low 16 bits)
master "fp32", moments bf16                20         fp32 copy
master "lo16", moments bf16                18         exact fp32 (param + low 16 bits)
master False, moments bf16 (pure bf16)     14         none (torch's bf16 ``fused=True``)
=========================================  =========  ======================================

(read g, p or master, m, v; write p, master, m, v.) ``"lo16"`` keeps only the low 16 bits of
the fp32 master (state ``master_lo16``, int16): the param is the fp32 master rounded to nearest
with ties away from zero, so param and low bits together give back the fp32 master exactly
(``join_lo16``/``split_lo16``); the update is computed on it, as with a full master. bf16
moments are rounded to nearest even. ``bench/bf16_accuracy.py`` compares these modes with fp32
AdamW over a training run of the demo model.

Kernel
------
* **Device step counters and bias corrections.** Each program reads its tensor's float32 step,
  computes ``beta**t`` in float64 by squaring (multiplies only, a few fp64 ulps, like torch's
  ``1 - beta ** step`` in Python) and rounds the derived scalars to fp32 as torch's ops do. The
  last program of a tensor to finish (an acq_rel counter per tensor) writes the new step.
  lr and step are never constexpr. When ``found_inf`` is nonzero no program changes anything.
* **Mixed dtypes in one launch.** Rows carry dtype and master codes; when all rows agree the code
  is a constexpr (straight-line code), otherwise each program branches on its row's code.
* **Vector loads.** Full blocks take an unmasked path; when every address is 16-byte aligned
  (``ALIGNED``) the pointers carry ``tl.multiple_of`` hints, so sm_90 code uses 128-bit
  loads/stores (checked on PTX built without a GPU). Division and square root are IEEE-rounded.
* **Interpreter.** On CPU the kernels run under ``TRITON_INTERPRET=1`` (set it before triton is
  imported). The module imports without it; stepping CPU tensors then raises ``ValueError``.
  The interpreter uses 16384-element programs (GPU: 2048, 8 warps), rounds fp32 -> bf16 by
  hand, since its own cast truncates, and calls the device helpers without re-patching
  ``triton.language`` on every call (``_direct_device_calls``: about 3x faster on CPU).

Differences from torch: under GradScaler the grads are unscaled inside the kernel but not
written back; float64 and complex params, sparse grads and non-dense layouts are refused; a
float lr that changes (a scheduler) costs one small async host-to-device copy at the next step;
one stream at a time (the tables are updated in stream order).
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
from collections.abc import Callable, Iterable, Sequence
from functools import reduce
from itertools import chain
from typing import Any

import torch
import torch.optim.optimizer as _torch_optimizer
import triton
import triton.language as tl

from .flat_buffers import FlatBuffers

__all__ = [
    "FusedAdam",
    "FusedAdamW",
    "LAUNCH_COUNT",
    "POKE_COUNT",
    "bytes_per_param",
    "interpreted",
    "join_lo16",
    "launch_count",
    "split_lo16",
]

#: Number of fused kernel launches since import (tests check one per ``step()``).
LAUNCH_COUNT = 0
#: Number of table-writing launches (only while a CUDA graph is captured).
POKE_COUNT = 0

_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NCOL = 16  # int64 columns per tensor row
_HCOL = 8  # float64 columns per group row
_GPU_BLOCK, _GPU_WARPS = 2048, 8
_INTERP_BLOCK = 16384  # the interpreter pays per program, so use fewer, larger ones
_FLAG_AMSGRAD, _FLAG_MAXIMIZE, _FLAG_DECOUPLED = 1, 2, 4
_NO_MASTER, _FP32_MASTER, _LO16_MASTER = 0, 1, 2
_MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_POKES = 8  # (index, value) pairs per poke launch
_POKE_BIAS = 1 << 32  # added to every poke argument so that Triton types them all int64
_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


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
    """Cast an int64 address to a pointer of the dtype named by CODE (0 fp32, 1 bf16, 2 fp16,
    3 raw 16-bit words: bf16 bits and ``master_lo16``), with the 16-byte aligned hint."""
    if CODE == 0:
        ptr = addr.to(tl.pointer_type(tl.float32))
    elif CODE == 1:
        ptr = addr.to(tl.pointer_type(tl.bfloat16))
    elif CODE == 2:
        ptr = addr.to(tl.pointer_type(tl.float16))
    else:
        ptr = addr.to(tl.pointer_type(tl.uint16))
    if ALIGNED:  # on the pointer: a hint on the int64 does not survive the cast
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _ld(ptr, mask, EVEN: tl.constexpr):
    """Load a block; a full block (EVEN) needs no mask, so the compiler can vectorise."""
    if EVEN:  # noqa: SIM108 - a constexpr branch reads clearer than a ternary in a kernel
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=mask, other=0)
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
        x = _ld(_typed(addr, FIXED, AL) + offs, mask, EVEN).to(tl.float32)
    elif code == 0:
        x = _ld(_typed(addr, 0, AL) + offs, mask, EVEN).to(tl.float32)
    elif code == 1:
        x = _ld(_typed(addr, 1, AL) + offs, mask, EVEN).to(tl.float32)
    else:
        x = _ld(_typed(addr, 2, AL) + offs, mask, EVEN).to(tl.float32)
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
def _load_lo16(p_addr, lo_addr, offs, mask, EVEN: tl.constexpr, AL: tl.constexpr):
    """The fp32 master from the bf16 param (its high word, rounded) and the low 16 bits."""
    hi = _ld(_typed(p_addr, 3, AL) + offs, mask, EVEN).to(tl.uint32)
    lo = _ld(_typed(lo_addr, 3, AL) + offs, mask, EVEN).to(tl.uint32)
    hi = tl.where(lo >= 0x8000, hi - 1, hi)  # the param was rounded up: undo it
    return ((hi << 16) | lo).to(tl.float32, bitcast=True)


@triton.jit
def _store_lo16(p_addr, lo_addr, offs, x, mask, EVEN: tl.constexpr, AL: tl.constexpr):
    """Param = x rounded to nearest, ties away from zero (so the low word tells the rounding
    apart), low word = x's low 16 bits; a NaN stays a NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    hi = tl.where(x != x, (bits >> 16) | 0x40, (bits + 0x8000) >> 16)
    _st(_typed(p_addr, 3, AL) + offs, hi.to(tl.uint16), mask, EVEN)
    _st(_typed(lo_addr, 3, AL) + offs, (bits & 0xFFFF).to(tl.uint16), mask, EVEN)


@triton.jit
def _load_param(p_addr, m_addr, offs, mask, p_code, kind, P_CODE: tl.constexpr,
                KIND: tl.constexpr, EVEN: tl.constexpr, AL: tl.constexpr):
    """The fp32 value the update starts from: master, param + low bits, or the param."""
    if KIND == 1:
        p = _load_f32(m_addr, offs, mask, 0, 0, EVEN, AL)
    elif KIND == 2:
        p = _load_lo16(p_addr, m_addr, offs, mask, EVEN, AL)
    elif KIND == 0:
        p = _load_f32(p_addr, offs, mask, p_code, P_CODE, EVEN, AL)
    elif kind == 1:
        p = _load_f32(m_addr, offs, mask, 0, 0, EVEN, AL)
    elif kind == 2:
        p = _load_lo16(p_addr, m_addr, offs, mask, EVEN, AL)
    else:
        p = _load_f32(p_addr, offs, mask, p_code, P_CODE, EVEN, AL)
    return p


@triton.jit
def _store_param(p_addr, m_addr, offs, p, mask, p_code, kind, P_CODE: tl.constexpr,
                 KIND: tl.constexpr, EVEN: tl.constexpr, AL: tl.constexpr):
    """Write the updated value back: master and rounded param, param + low bits, or param."""
    if KIND == 1:
        _store_f32(m_addr, offs, p, mask, 0, 0, EVEN, AL)
        _store_f32(p_addr, offs, p, mask, p_code, P_CODE, EVEN, AL)
    elif KIND == 2:
        _store_lo16(p_addr, m_addr, offs, p, mask, EVEN, AL)
    elif KIND == 0:
        _store_f32(p_addr, offs, p, mask, p_code, P_CODE, EVEN, AL)
    elif kind == 1:
        _store_f32(m_addr, offs, p, mask, 0, 0, EVEN, AL)
        _store_f32(p_addr, offs, p, mask, p_code, P_CODE, EVEN, AL)
    elif kind == 2:
        _store_lo16(p_addr, m_addr, offs, p, mask, EVEN, AL)
    else:
        _store_f32(p_addr, offs, p, mask, p_code, P_CODE, EVEN, AL)


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
    p_code, g_code, s_code, kind = codes
    decay, w1, b2, omb2, wd, eps, neg_step, bc2_sqrt = sc
    g = _load_f32(g_addr, offs, mask, g_code, G_CODE, EVEN, AL)
    if HAS_SCALE:
        g = g * tl.div_rn(1.0, tl.load(scale_ptr))
    if (flags & 2) != 0:  # maximize
        g = -g
    p = _load_param(p_addr, master_addr, offs, mask, p_code, kind, P_CODE, MASTER, EVEN, AL)
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
    _store_param(p_addr, master_addr, offs, p, mask, p_code, kind, P_CODE, MASTER, EVEN, AL)


@triton.jit
def _fused_adam_kernel(
    tensor_tab,
    grad_tab,
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
        tl.load(grad_tab + t),
        tl.load(row + 1),
        tl.load(row + 2),
        tl.load(row + 3),
        tl.load(row + 4),
    )
    step_addr, lr_addr = tl.load(row + 5), tl.load(row + 6)
    numel, nblocks, hrow = tl.load(row + 7), tl.load(row + 8), tl.load(row + 9)
    codes = (tl.load(row + 10), tl.load(row + 11), tl.load(row + 12), tl.load(row + 14))
    flags = tl.load(row + 13)
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


# the arguments of a poke: each is value + _POKE_BIAS, so never specialise on their values
_POKE_ARGS = [f"{k}{i}" for i in range(_POKES) for k in ("i", "v")]


@triton.jit(do_not_specialize=_POKE_ARGS)
def _poke_kernel(dst, i0, v0, i1, v1, i2, v2, i3, v3, i4, v4, i5, v5, i6, v6, i7, v7):
    """``dst[i] = v`` for eight (i, v) pairs passed as kernel arguments (for CUDA graphs)."""
    bias = 4294967296  # _POKE_BIAS
    tl.store(dst + (i0 - bias), v0 - bias)
    tl.store(dst + (i1 - bias), v1 - bias)
    tl.store(dst + (i2 - bias), v2 - bias)
    tl.store(dst + (i3 - bias), v3 - bias)
    tl.store(dst + (i4 - bias), v4 - bias)
    tl.store(dst + (i5 - bias), v5 - bias)
    tl.store(dst + (i6 - bias), v6 - bias)
    tl.store(dst + (i7 - bias), v7 - bias)


def _direct_device_calls() -> None:
    """Interpreter only: a device-function call re-patches ``triton.language`` every time
    (Triton 3.x ``InterpretedFunction.__call__``, ~0.15 ms: most of a program's time here),
    although the launch has patched it for this module already. Call the helpers' rewritten
    code directly instead (about 3x faster steps on CPU; same code, same results)."""
    helpers = [f for f in globals().values() if type(f).__name__ == "InterpretedFunction"]
    for fn in helpers:
        if fn in (_fused_adam_kernel, _poke_kernel) or not hasattr(fn, "rewrite"):
            continue
        fn.__class__ = type("_DirectInterpretedFunction", (type(fn),), {"__call__": _call})


def _call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``InterpretedFunction.__call__`` without re-patching ``triton.language``."""
    return self.rewrite()(*args, **kwargs)


def interpreted() -> bool:
    """True when the kernel was built by the Triton interpreter (``TRITON_INTERPRET=1``)."""
    return type(_fused_adam_kernel).__name__ == "InterpretedFunction"


if interpreted():
    _direct_device_calls()


def launch_count() -> int:
    """Number of fused kernel launches since import."""
    return LAUNCH_COUNT


def bytes_per_param(param: torch.dtype, master: str | None, moments: torch.dtype) -> int:
    """Bytes one step moves per parameter: read grad, param or master, m, v; write them back
    (master "fp32": the rounded param too; "lo16": param and low word; None: the param)."""
    p, s = _itemsize(param), _itemsize(moments)
    weights = {None: 2 * p, "fp32": 4 + 4 + p, "lo16": 4 * 2}[master]
    return p + weights + 4 * s


def _itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def _capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on the current stream of ``device``."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
    if g.layout is not torch.strided:
        raise ValueError("FusedAdamW does not support sparse gradients")
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


def _signed16(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 65536) as the int16 with the same bits."""
    return torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)


def split_lo16(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 param, int16 low word) of an fp32 master, as the kernel stores them: the param
    is rounded to nearest with ties away from zero; ``join_lo16`` gives the master back."""
    bits = master.detach().float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = torch.where(master.isnan(), (bits >> 16) | 0x40, (bits + 0x8000) >> 16) & 0xFFFF
    return _signed16(hi).view(torch.bfloat16), _signed16(bits & 0xFFFF)


def join_lo16(param: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The exact fp32 master held by a bf16 param and its int16 low word."""
    hi = param.detach().contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    low = lo.detach().contiguous().to(torch.int64) & 0xFFFF
    bits = (((hi - (low >= 0x8000).long()) & 0xFFFF) << 16) | low
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return bits.to(torch.int32).view(torch.float32).reshape(param.shape)


def _write_ints(dst: torch.Tensor, values: Sequence[int]) -> None:
    """``dst[:] = values`` (int64) in stream order, without waiting for the device: the same
    few torch ops whatever the length (a pinned host buffer filled through numpy, a copy)."""
    src = torch.empty(len(values), dtype=torch.int64, pin_memory=dst.device.type == "cuda")
    src.numpy()[:] = values
    dst.copy_(src, non_blocking=True)


def _poke(dst: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """Write (index, value) pairs into the int64 tensor ``dst`` with poke launches, whose
    arguments a captured CUDA graph keeps (a short last launch repeats its first pair)."""
    global POKE_COUNT
    on_device = torch.cuda.device(dst.device) if dst.is_cuda else contextlib.nullcontext()
    with on_device:  # Triton launches on the current device
        for k in range(0, len(pairs), _POKES):
            chunk = list(pairs[k : k + _POKES])
            chunk += [chunk[0]] * (_POKES - len(chunk))
            args = [x + _POKE_BIAS for pair in chunk for x in pair]
            _poke_kernel[(1,)](dst, *args, num_warps=1)
            POKE_COUNT += 1


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


def _pick(indices: list[int]) -> Callable[[list], tuple]:
    """A C-level getter of ``indices`` from a list, always returning a tuple."""
    if not indices:
        return lambda xs: ()
    get = operator.itemgetter(*indices)
    return (lambda xs: (get(xs),)) if len(indices) == 1 else get


def _aligned(addrs: Iterable[int]) -> bool:
    """True when every address is a multiple of 16 bytes (128-bit vector access)."""
    return not reduce(operator.or_, addrs, 0) & 15


_profiler_enabled = torch.autograd._profiler_enabled
_GLOBAL_PRE_HOOKS: dict = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", {})
_GLOBAL_POST_HOOKS: dict = getattr(_torch_optimizer, "_global_optimizer_post_hooks", {})
"""torch's optimizer hooks for every optimizer (`register_optimizer_step_pre_hook`)."""


class _Plan:
    """Device tables for one set of params and state, and the host copies that tell when the
    grad column must be rewritten or the whole plan rebuilt."""

    def __init__(self, flat: list[torch.Tensor], with_grad: list[int], rows: list[list[int]],
                 grads: list[torch.Tensor], group_key: tuple, n_groups: int,
                 refs: list[torch.Tensor]):
        self.flat, self.group_key, self.refs = flat, group_key, refs
        self.params = [flat[i] for i in with_grad]
        self.every = len(with_grad) == len(flat) and with_grad == list(range(len(flat)))
        self.pick = _pick(with_grad)
        self.pick_rest = _pick(sorted(set(range(len(flat))) - set(with_grad)))
        self.pptrs = [r[0] for r in rows]
        self.gptrs = [g.data_ptr() for g in grads]
        self.gdtypes = [g.dtype for g in grads]
        self.contiguous = all(p.is_contiguous() for p in self.params)
        self.device = self.params[0].device
        self.block = _block_for(self.device)
        self._tables(rows)
        self.grad_tab = _upload(torch.tensor(self.gptrs, dtype=torch.int64), self.device)
        self.counters = torch.zeros(len(rows), dtype=torch.int32, device=self.device)
        self.hyper_tab = torch.zeros(n_groups, _HCOL, dtype=torch.float64, device=self.device)
        self.hyper_key: tuple | None = None
        self.dummy = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.consts = {
            "P_CODE": _uniform(r[10] for r in rows),
            "G_CODE": _uniform(r[11] for r in rows),
            "S_CODE": _uniform(r[12] for r in rows),
            "MASTER": _uniform(r[14] for r in rows),
            "AMS": _uniform(int(r[3] != 0) for r in rows),
            "ALIGNED": _aligned(chain((a for r in rows for a in r[:5]), self.gptrs)),
        }

    def _tables(self, rows: list[list[int]]) -> None:
        """The tensor table and the block table (program -> tensor, element offset)."""
        tab = torch.tensor(rows, dtype=torch.int64)
        nblocks = tab[:, 8]
        tensor_of_block = torch.repeat_interleave(torch.arange(len(rows)), nblocks)
        first = torch.cumsum(nblocks, 0) - nblocks
        offsets = (torch.arange(int(nblocks.sum())) - first[tensor_of_block]) * self.block
        blocks = torch.stack([tensor_of_block, offsets], dim=1).contiguous()
        self.n_blocks = blocks.shape[0]
        self.tensor_tab = _upload(tab, self.device)
        self.block_tab = _upload(blocks, self.device)

    def poll(self, flat: list[torch.Tensor], group_key: tuple) -> tuple[tuple, list[int]] | None:
        """(grads, their addresses) of the planned params, or None when the plan no longer
        fits: other param objects or group flags, a planned param without a grad (or the
        reverse), a sparse grad, a param whose storage moved. C-level passes, no torch op."""
        if group_key != self.group_key or len(flat) != len(self.flat):
            return None
        if not all(map(operator.is_, flat, self.flat)):
            return None
        if self.every:  # every param has a grad (the usual case): two passes fewer
            grads = list(map(_GRAD, flat))
            try:
                ptrs = list(map(_PTR, grads))
            except (TypeError, RuntimeError):  # a grad is None, or has no storage (sparse)
                return None
            if list(map(_PTR, flat)) != self.pptrs:
                return None
            return grads, ptrs
        all_grads = list(map(_GRAD, flat))
        if any(g is not None for g in self.pick_rest(all_grads)):
            return None
        grads = self.pick(all_grads)
        try:
            ptrs = list(map(_PTR, grads))
        except (TypeError, RuntimeError):  # a grad is None, or has no storage (sparse)
            return None
        if list(map(_PTR, self.params)) != self.pptrs:
            return None
        return grads, ptrs

    def fits(self, grads: Sequence[torch.Tensor], ptrs: list[int]) -> bool:
        """Can new grads (other addresses) take the planned ones' place: same dtypes, dense
        with their params' strides? (torch's ``.grad`` setter already checks device and
        shape.) Drops the aligned kernel variant if one of them is not 16-byte aligned."""
        if list(map(_DTYPE, grads)) != self.gdtypes:
            return False
        if self.contiguous:
            dense = all(map(_IS_CONTIGUOUS, grads))
        else:
            dense = all(map(_same_dense_layout, grads, self.params))
        if dense and self.consts["ALIGNED"] and not _aligned(ptrs):
            self.consts = {**self.consts, "ALIGNED": False}
        return dense

    def refresh_grads(self, ptrs: list[int]) -> None:
        """Eager: write the new grad addresses into the grad column (stream-ordered)."""
        _write_ints(self.grad_tab, ptrs)
        self.gptrs = ptrs

    def captured_grad_table(self, ptrs: list[int]) -> torch.Tensor:
        """Under capture: a grad table of the graph's own, filled by poke launches that the
        graph replays; the eager column is left alone."""
        tab = torch.empty(len(ptrs), dtype=torch.int64, device=self.device)
        _poke(tab, list(enumerate(ptrs)))
        return tab

    def refresh_hyper(self, hyper_key: tuple) -> None:
        """Re-upload group hyperparameters when their host values changed."""
        if hyper_key == self.hyper_key:
            return
        rows = [[0.0 if lr is None else lr, *rest, 0.0, 0.0, 0.0] for lr, *rest in hyper_key]
        host = torch.tensor(rows, dtype=torch.float64, pin_memory=self.device.type == "cuda")
        self.hyper_tab.copy_(host, non_blocking=True)  # async on CUDA: no sync
        self.hyper_key = hyper_key

    def launch(self, grad_tab: torch.Tensor, grad_scale: torch.Tensor | None,
               found_inf: torch.Tensor | None) -> None:
        """One kernel launch over every block of every tensor."""
        global LAUNCH_COUNT
        if self.device.type == "cuda" and self.device.index != torch.cuda.current_device():
            with torch.cuda.device(self.device):  # Triton launches on the current device
                return self.launch(grad_tab, grad_scale, found_inf)
        scale = _f32_on(grad_scale, self.device, self.dummy)
        inf = _f32_on(found_inf, self.device, self.dummy)
        _fused_adam_kernel[(self.n_blocks,)](
            self.tensor_tab,
            grad_tab,
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

    ``decoupled=False`` gives Adam with L2 weight decay (``g += wd * p``). Per group,
    ``master_weights`` (None = automatic = "fp32" for half params; True = "fp32"; "lo16" =
    the low 16 bits of an fp32 master next to bf16 params; False = none) and ``moment_dtype``
    (None = fp32 with a master, else the param's dtype; "fp32"; "bf16") choose the bytes moved
    per parameter (module docstring). ``capturable=True`` lets ``step()`` be captured in a CUDA
    graph. Loading a torch state: missing masters are created from the params; saved state
    keeps its dtype until the first step converts it to what the group asks for. Works with
    ``torch.amp.GradScaler`` (grads are unscaled in the kernel and a step with ``found_inf``
    set changes nothing). After editing ``optimizer.state`` by hand, call
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
        master_weights: bool | str | None = None,
        moment_dtype: str | None = None,
        capturable: bool = False,
        flat_buffers: bool = False,
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
            "moment_dtype": moment_dtype,
            "capturable": capturable,
        }
        _check_modes(defaults)
        self._plan: _Plan | None = None
        self._graph_plans: list[_Plan] = []
        self._epoch = 0
        self._flat = FlatBuffers() if flat_buffers else None
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Fill group keys a torch checkpoint lacks (as torch's Adam/AdamW do)."""
        super().__setstate__(state)
        self._graph_plans = getattr(self, "_graph_plans", [])
        self._flat = getattr(self, "_flat", None)
        for group in self.param_groups:
            for key in ("amsgrad", "maximize", "master_weights", "moment_dtype",
                        "decoupled_weight_decay", "capturable"):
                group.setdefault(key, self.defaults[key])
            if self.defaults["decoupled_weight_decay"]:
                group["decoupled_weight_decay"] = True
            _check_modes(group)
        self.invalidate_tables()

    def invalidate_tables(self) -> None:
        """Force the pointer tables to be rebuilt at the next ``step()``."""
        self._plan = None
        self._epoch = getattr(self, "_epoch", 0) + 1

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, and invalidates the cached tables."""
        super().add_param_group(param_group)
        _check_modes(self.param_groups[-1])
        if self._flat is not None:
            group = self.param_groups[-1]
            self._flat.adopt(group["params"])
            for p in group["params"]:  # every param is stepped (its grad is never None), so
                self._ensure_state(p, group)  # its state exists from the start, as after a step
        self.invalidate_tables()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; with ``flat_buffers=True`` the grad buffers are zeroed whatever
        ``set_to_none`` says, so that the grads stay where the tables point (O(1))."""
        flat = self._flat
        if flat is None:
            super().zero_grad(set_to_none)
            return
        if not flat.intact():
            flat.restore()
        flat.zero_grads()

    @property
    def flat_buffers(self) -> FlatBuffers | None:
        """The flat param and grad buffers (``flat_buffers=True``), else None."""
        return self._flat

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but state keeps its saved dtype (torch casts it to the param's): fp32
        moments and masters of half params stay exact, ``master_lo16`` stays int16."""
        saved_state = state_dict["state"]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for sid, p in zip(saved_ids, params, strict=True):
            for key, value in saved_state.get(sid, {}).items():
                mine = self.state[p].get(key)
                keep = key != "step" and torch.is_tensor(value) and torch.is_tensor(mine)
                if keep and mine.dtype != value.dtype:
                    self.state[p][key] = value.to(p.device, copy=True)
        self.invalidate_tables()

    def sync_hyperparameters(self) -> None:
        """Copy the groups' float hyperparameters to the device table now (async). A step
        does this by itself; call it between CUDA graph replays, which run no Python."""
        plan = self._plan
        if plan is not None:
            plan.refresh_hyper(self._hyper_key(plan.device))

    def fp32_master(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 value the optimizer updates for param ``p`` (its master, or the param)."""
        st = self.state.get(p, {})
        if "master_param" in st:
            return st["master_param"]
        if "master_lo16" in st:
            return join_lo16(p, st["master_lo16"])
        return p.detach().float()

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        """One update of every param with a grad; ``grad_scale``/``found_inf`` may also be
        set as attributes by ``GradScaler.step``.

        torch wraps an optimizer's step in a profiler range and its step hooks (about 20 us
        a step of the host's time); here that wrapper runs only while a profiler records or a
        step hook is registered (the monitor's agent registers some), else the step itself."""
        if (_profiler_enabled() or self._optimizer_step_pre_hooks
                or self._optimizer_step_post_hooks or _GLOBAL_PRE_HOOKS or _GLOBAL_POST_HOOKS):
            return self._hooked_step(closure, grad_scale=grad_scale, found_inf=found_inf)
        return self._step(closure, grad_scale=grad_scale, found_inf=found_inf)

    step.hooked = True  # type: ignore[attr-defined]  # torch: do not wrap it (see above)

    def _step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> Any:
        """The step: flat buffers' O(1) path when it holds (no torch op on a tensor that
        needs grad, so no no_grad context either), else the full path under no_grad."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = grad_scale if grad_scale is not None else getattr(self, "grad_scale", None)
        found_inf = found_inf if found_inf is not None else getattr(self, "found_inf", None)
        ready = self._ready_flat()
        if ready is None:
            with torch.no_grad():
                ready = self._ready()
        if ready is not None:
            plan, grad_tab = ready
            plan.launch(grad_tab, grad_scale, found_inf)
        return loss

    _hooked_step = torch.optim.Optimizer.profile_hook_step(_step)

    def _ready_flat(self) -> tuple[_Plan, torch.Tensor] | None:
        """O(1): the plan and grad table when flat buffers are intact and the groups' flags
        unchanged, else None (take the full path)."""
        bufs, plan = self._flat, self._plan
        if bufs is None or plan is None or not bufs.intact():
            return None
        if self._group_key() != plan.group_key:
            return None
        hyper = self._hyper_key(plan.device)
        if self._check_capture(plan.device):
            return plan, self._captured(plan, plan.gptrs, hyper)
        plan.refresh_hyper(hyper)
        return plan, plan.grad_tab

    def _ready(self) -> tuple[_Plan, torch.Tensor] | None:
        """The plan and the grad table of this step, rebuilt or refreshed as needed (None
        when no param has a grad); flat buffers first get back what was moved out of them."""
        bufs = self._flat
        if bufs is None:
            return self._ready_polled()
        bufs.restore()
        ready = self._ready_polled()
        bufs.settle()
        return ready

    def _ready_polled(self) -> tuple[_Plan, torch.Tensor] | None:
        """``_ready`` by reading every param's grad and addresses."""
        flat = list(chain.from_iterable(g["params"] for g in self.param_groups))
        if not flat:
            return None
        capturing = self._check_capture(flat[0].device)
        group_key = self._group_key()
        found = self._poll(flat, group_key)
        if found is None:
            if capturing:
                raise RuntimeError(
                    "FusedAdamW: the params, their grads or the state changed since the last "
                    "eager step(): run step() once outside the CUDA graph (a warm-up step) "
                    "with the same params having grads, then capture"
                )
            self._plan = self._build(flat, group_key)
            if self._plan is None:
                return None
            found = self._plan.poll(flat, group_key)
            if found is None:
                raise RuntimeError("FusedAdamW: the tables just built do not fit the params")
        plan, ptrs = self._plan, found[1]
        hyper = self._hyper_key(plan.device)
        if capturing:
            return plan, self._captured(plan, ptrs, hyper)
        if ptrs != plan.gptrs:
            plan.refresh_grads(ptrs)
        plan.refresh_hyper(hyper)
        return plan, plan.grad_tab

    def _poll(self, flat: list[torch.Tensor], group_key: tuple) -> tuple | None:
        """(grads, addresses) when the current plan still serves, else None (rebuild)."""
        plan = self._plan
        found = plan.poll(flat, group_key) if plan is not None else None
        if found is not None and found[1] != plan.gptrs and not plan.fits(*found):
            return None
        return found

    def _check_capture(self, device: torch.device) -> bool:
        """True while a CUDA graph is captured; raises unless every group is capturable."""
        if not _capturing(device):
            return False
        if not all(group["capturable"] for group in self.param_groups):
            raise RuntimeError(
                "FusedAdamW.step() during CUDA graph capture needs capturable=True"
            )
        return True

    def _captured(self, plan: _Plan, ptrs: list[int], hyper: tuple) -> torch.Tensor:
        """Under capture: the graph's own grad table; the plan is kept alive for the graph."""
        if hyper != plan.hyper_key:
            raise RuntimeError(
                "FusedAdamW: float hyperparameters changed since the last eager step(); "
                "call sync_hyperparameters() before capturing the CUDA graph"
            )
        if all(kept is not plan for kept in self._graph_plans):
            self._graph_plans.append(plan)  # the graph reads its tables after we move on
        return plan.captured_grad_table(ptrs)

    def _group_key(self) -> tuple:
        """What the tables depend on per group: flags, modes, a tensor lr's address; and the
        epoch (bumped by invalidate_tables)."""
        parts: list[Any] = [self._epoch]
        for group in self.param_groups:
            lr = group["lr"]
            parts.append(
                (
                    group["amsgrad"],
                    group["maximize"],
                    group["master_weights"],
                    group["moment_dtype"],
                    group["decoupled_weight_decay"],
                    lr.data_ptr() if torch.is_tensor(lr) else None,
                )
            )
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

    def _build(self, flat: list[torch.Tensor], group_key: tuple) -> _Plan | None:
        """Validate, initialise state and write the tables for the params that have grads."""
        owners = [(gi, group) for gi, group in enumerate(self.param_groups)
                  for _ in group["params"]]
        with_grad = [i for i, p in enumerate(flat) if p.grad is not None]
        if not with_grad:
            return None
        device = flat[with_grad[0]].device
        _check_device(device)
        rows: list[list[int]] = []
        refs: list[torch.Tensor] = []
        for i in with_grad:
            p = flat[i]
            if p.device != device:
                raise ValueError(f"FusedAdamW needs all params on one device: {device}, {p.device}")
            _check_tensor(p, p.grad)
            rows.append(self._row(*owners[i], p, refs))
        grads = [flat[i].grad for i in with_grad]
        plan = _Plan(flat, with_grad, rows, grads, group_key, len(self.param_groups), refs)
        if device.type == "cuda" and any(g["capturable"] for g in self.param_groups):
            _poke(plan.grad_tab, [(0, plan.gptrs[0])])  # compile it now, not under capture
        return plan

    def _row(self, gi: int, group: dict, p: torch.Tensor, refs: list[torch.Tensor]) -> list[int]:
        """One int64 table row for param ``p`` (initialising or fixing its state); the
        tensors it names are appended to ``refs``."""
        st = self._ensure_state(p, group)
        kind = _master_kind(p, group)
        flags = (
            _FLAG_AMSGRAD * bool(group["amsgrad"])
            + _FLAG_MAXIMIZE * bool(group["maximize"])
            + _FLAG_DECOUPLED * bool(group["decoupled_weight_decay"])
        )
        vmax = st.get("max_exp_avg_sq") if group["amsgrad"] else None
        master = st.get({_FP32_MASTER: "master_param", _LO16_MASTER: "master_lo16"}.get(kind))
        lr = group["lr"] if _lr_by_pointer(group["lr"], p.device) else None
        named = (p, st["exp_avg"], st["exp_avg_sq"], vmax, master, st["step"], lr)
        refs.extend(t for t in named if t is not None)
        return [
            *(0 if t is None else t.data_ptr() for t in named),
            p.numel(),
            max(1, math.ceil(p.numel() / _block_for(p.device))),
            gi,
            _CODES[p.dtype],
            _CODES[p.grad.dtype],
            _CODES[st["exp_avg"].dtype],
            flags,
            kind,
            0,
        ]

    def _ensure_state(self, p: torch.Tensor, group: dict) -> dict[str, Any]:
        """Create state lazily, or bring a loaded one to the layout the kernel expects."""
        st = self.state[p]
        kind = _master_kind(p, group)
        sdtype = _moment_dtype(p, group, kind)
        st["step"] = _as_step(st.get("step", 0.0), p.device)
        keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        for k in keys:
            st[k] = _like(st[k], p, sdtype) if k in st else torch.zeros_like(p, dtype=sdtype)
        _ensure_master(p, st, kind)
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
        master_weights: bool | str | None = None,
        moment_dtype: str | None = None,
        capturable: bool = False,
        flat_buffers: bool = False,
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
            moment_dtype=moment_dtype,
            capturable=capturable,
            flat_buffers=flat_buffers,
        )


def _ensure_master(p: torch.Tensor, st: dict[str, Any], kind: int) -> None:
    """Give ``st`` the master the group asks for, converting one it has (exactly)."""
    master, lo = st.pop("master_param", None), st.pop("master_lo16", None)
    if kind == _FP32_MASTER:
        if master is None:  # a torch checkpoint has none: start from the param
            master = join_lo16(p, lo) if lo is not None else p
        st["master_param"] = _like(master, p, torch.float32)
    elif kind == _LO16_MASTER:
        if lo is not None and master is None:
            st["master_lo16"] = _like(lo, p, torch.int16)
        elif master is None:  # the param is the master: low bits zero
            st["master_lo16"] = torch.zeros_like(p, dtype=torch.int16)
        else:  # split a full master: the param becomes its high word
            hi, low = split_lo16(master)
            with torch.no_grad():
                p.copy_(hi.reshape(p.shape))
            st["master_lo16"] = _like(low.reshape(p.shape), p, torch.int16)


def _master_kind(p: torch.Tensor, group: dict) -> int:
    """The master a param gets: none for fp32 params or ``master_weights=False``."""
    mode = group["master_weights"]
    if p.dtype == torch.float32 or mode is False:
        return _NO_MASTER
    if mode == "lo16":
        if p.dtype != torch.bfloat16:
            raise ValueError(f"master_weights='lo16' needs bfloat16 params, got {p.dtype}")
        return _LO16_MASTER
    return _FP32_MASTER


def _moment_dtype(p: torch.Tensor, group: dict, kind: int) -> torch.dtype:
    """exp_avg/exp_avg_sq dtype: the group's, else fp32 with a master, else the param's."""
    if group["moment_dtype"] is not None:
        return _MOMENT_DTYPES[group["moment_dtype"]]
    return torch.float32 if kind != _NO_MASTER else p.dtype


def _check_modes(group: dict) -> None:
    """Refuse unknown ``master_weights``/``moment_dtype`` values."""
    if group["master_weights"] not in (None, True, False, "fp32", "lo16"):
        raise ValueError(
            f"master_weights must be None, True, False, 'fp32' or 'lo16', "
            f"got {group['master_weights']!r}"
        )
    if group["moment_dtype"] not in (None, *_MOMENT_DTYPES):
        raise ValueError(
            f"moment_dtype must be None, 'fp32' or 'bf16', got {group['moment_dtype']!r}"
        )


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
