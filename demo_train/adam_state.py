"""The state FusedAdamW keeps per param, and the bytes a step moves for it.

Per param: ``step`` (a float32 0-d tensor on the param's device), ``exp_avg``, ``exp_avg_sq``
(and ``max_exp_avg_sq`` with amsgrad), and a master copy of half params. ``ensure_state``
creates it lazily or brings a loaded one (a torch checkpoint, another mode) to the layout the
kernel reads; ``master_kind`` gives the master code a table row carries.

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
the same, ``stochastic_rounding=True``     14         none; the param rounded stochastically
=========================================  =========  ======================================

(read g, p or master, m, v; write p, master, m, v.) ``"lo16"`` keeps only the low 16 bits of
the fp32 master (state ``master_lo16``, int16): the param is the fp32 master rounded to nearest
with ties away from zero, so param and low bits together give back the fp32 master exactly
(``join_lo16``/``split_lo16``); the update is computed on it, as with a full master. bf16
moments are rounded to nearest even. ``stochastic_rounding`` (bf16 params without a master)
rounds the updated param up with probability (the fp32 value's low 16 bits) / 2**16: the
stored param equals the fp32 update on average, so updates under half a bf16 ulp, which
rounding to nearest drops every step, still move it (Gupta et al. 2015; Zamirai et al. 2020,
"Revisiting BFloat16 Training"). The random bits are a hash of the element's offset, the
tensor and the step: a resumed run draws the same ones. ``bench/bf16_accuracy.py`` compares
these modes with fp32 AdamW over a training run of the demo model.
"""

from __future__ import annotations

from typing import Any

import torch

from .adam_plan import same_dense_layout

NO_MASTER, FP32_MASTER, LO16_MASTER = 0, 1, 2  # the kernel's master codes (a row's `kind`)
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def bytes_per_param(param: torch.dtype, master: str | None, moments: torch.dtype) -> int:
    """Bytes one step moves per parameter: read grad, param or master, m, v; write them back
    (master "fp32": the rounded param too; "lo16": param and low word; None: the param)."""
    p, s = _itemsize(param), _itemsize(moments)
    weights = {None: 2 * p, "fp32": 4 + 4 + p, "lo16": 4 * 2}[master]
    return p + weights + 4 * s


def _itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


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
        and same_dense_layout(t, p)
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


def ensure_state(st: dict[str, Any], p: torch.Tensor, group: dict) -> dict[str, Any]:
    """Create param ``p``'s state ``st`` lazily, or bring a loaded one to the layout the kernel
    expects; returns ``st``."""
    kind = master_kind(p, group)
    sdtype = _moment_dtype(p, group, kind)
    st["step"] = _as_step(st.get("step", 0.0), p.device)
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
    for k in keys:
        st[k] = _like(st[k], p, sdtype) if k in st else torch.zeros_like(p, dtype=sdtype)
    _ensure_master(p, st, kind)
    return st


def _ensure_master(p: torch.Tensor, st: dict[str, Any], kind: int) -> None:
    """Give ``st`` the master the group asks for, converting one it has (exactly)."""
    master, lo = st.pop("master_param", None), st.pop("master_lo16", None)
    if kind == FP32_MASTER:
        if master is None:  # a torch checkpoint has none: start from the param
            master = join_lo16(p, lo) if lo is not None else p
        st["master_param"] = _like(master, p, torch.float32)
    elif kind == LO16_MASTER:
        if lo is not None and master is None:
            st["master_lo16"] = _like(lo, p, torch.int16)
        elif master is None:  # the param is the master: low bits zero
            st["master_lo16"] = torch.zeros_like(p, dtype=torch.int16)
        else:  # split a full master: the param becomes its high word
            hi, low = split_lo16(master)
            with torch.no_grad():
                p.copy_(hi.reshape(p.shape))
            st["master_lo16"] = _like(low.reshape(p.shape), p, torch.int16)


def master_kind(p: torch.Tensor, group: dict) -> int:
    """The master a param gets: none for fp32 params or ``master_weights=False``."""
    mode = group["master_weights"]
    if p.dtype == torch.float32 or mode is False:
        return NO_MASTER
    if mode == "lo16":
        if p.dtype != torch.bfloat16:
            raise ValueError(f"master_weights='lo16' needs bfloat16 params, got {p.dtype}")
        return LO16_MASTER
    return FP32_MASTER


def _moment_dtype(p: torch.Tensor, group: dict, kind: int) -> torch.dtype:
    """exp_avg/exp_avg_sq dtype: the group's, else fp32 with a master, else the param's."""
    if group["moment_dtype"] is not None:
        return MOMENT_DTYPES[group["moment_dtype"]]
    return torch.float32 if kind != NO_MASTER else p.dtype


def stochastic_rounding(p: torch.Tensor, group: dict, kind: int) -> bool:
    """Whether ``p`` is rounded stochastically: asked for, and a bf16 param without a master
    (fp32 params need no rounding; a master makes the param a rounded copy: refused)."""
    if not group.get("stochastic_rounding"):
        return False
    if p.dtype == torch.float32:
        return False
    if p.dtype != torch.bfloat16 or kind != NO_MASTER:
        raise ValueError(
            "stochastic_rounding=True rounds bf16 params that have no master copy; this group "
            f"has a {p.dtype} param with master_weights={group['master_weights']!r}: pass "
            "master_weights=False (pure bf16), or drop stochastic_rounding")
    return True


def check_modes(group: dict) -> None:
    """Refuse unknown ``master_weights``/``moment_dtype``/``stochastic_rounding`` values."""
    if group.get("stochastic_rounding", False) not in (True, False):
        raise ValueError(
            f"stochastic_rounding must be True or False, got {group['stochastic_rounding']!r}")
    if group["master_weights"] not in (None, True, False, "fp32", "lo16"):
        raise ValueError(
            f"master_weights must be None, True, False, 'fp32' or 'lo16', "
            f"got {group['master_weights']!r}"
        )
    if group["moment_dtype"] not in (None, *MOMENT_DTYPES):
        raise ValueError(
            f"moment_dtype must be None, 'fp32' or 'bf16', got {group['moment_dtype']!r}"
        )
