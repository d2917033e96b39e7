"""Params and grads in flat buffers that the optimizer owns (``FusedAdamW(flat_buffers=True)``).

Why: an optimizer that reads each param's grad every step does host work that grows with the
number of tensors (about 1 us a tensor in C-level passes), and with ``set_to_none=True`` autograd
hands it new grad addresses every step. Here every param becomes a view of one flat param buffer
per param group and (device, dtype), and its grad a view of a matching flat grad buffer, as in
Apex and DeepSpeed, so the addresses the optimizer's tables hold never change:

* ``zero_grad()`` zeroes the grad buffers (one memset each) whatever ``set_to_none`` says, so
  the grads stay put and autograd accumulates into them (``grad += new``, in place). A param
  that gets no grad in a step is updated with a zero grad, as torch's AdamW updates a param
  whose grad ``zero_grad(set_to_none=False)`` zeroed (torch skips one that never had a
  grad). Only params that require grad are taken.
* A step checks in O(1) that the buffers are still what the params and grads point at: the
  number of tensors that reference each buffer's storage (``torch._C._storage_Use_Count``) is
  what it was at the last checked step, and a few params, a different few each step, still
  point into the buffers. ``p.data = ...`` (``model.to()``), ``p.grad = None``
  (``model.zero_grad()``) or a new grad tensor drops a view and changes the count.
* When the check fails, :meth:`FlatBuffers.restore` (O(number of params), once) copies what was
  replaced back into the buffers and points the params and grads at them again, so every
  step updates the tensors the model uses. A param moved to another device or dtype is an
  error: build the optimizer after moving the model.

Costs: a memset of the grads per step, and the first backward of a step adds into zeroed
grads instead of handing them over (a read and a write more per grad element); the
construction copies the params once (the old storages are freed unless something else holds
them). Not caught: a replaced grad or param while some other tensor still references the
view that was replaced, in a param the rotating check has not reached yet (every param is
reached within ``len(params) / SPOT_CHECKS`` steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["ALIGN_BYTES", "SPOT_CHECKS", "FlatBuffers"]

#: Each param's slot starts on a multiple of this many bytes (vector loads, cache lines).
ALIGN_BYTES = 64
#: Params checked by address in each step's O(1) test.
SPOT_CHECKS = 2

# how many tensors hold a storage (private, but in torch since 2.0); without it every step
# takes the O(params) path, which is still correct
_use_count = getattr(torch._C, "_storage_Use_Count", None)


@dataclass
class _Bucket:
    """One param group's params of one (device, dtype): the flat param and grad buffers
    and each param's slot."""

    params: list[torch.Tensor]
    offsets: list[int]
    layouts: list[tuple[torch.Size, tuple[int, ...]]]
    flat_param: torch.Tensor
    flat_grad: torch.Tensor
    param_ptrs: list[int] = field(default_factory=list)
    grad_ptrs: list[int] = field(default_factory=list)

    def storages(self) -> tuple[int, int]:
        """The C addresses of the two storages (what ``_storage_Use_Count`` takes)."""
        return (self.flat_param.untyped_storage()._cdata,
                self.flat_grad.untyped_storage()._cdata)

    def slot(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Param i's view of ``flat`` with the shape and strides the param was adopted with."""
        shape, stride = self.layouts[i]
        return flat.as_strided(shape, stride, self.offsets[i])


class FlatBuffers:
    """The flat buffers of one optimizer: adopt params, check in O(1), restore, zero grads."""

    def __init__(self) -> None:
        self.buckets: list[_Bucket] = []
        self._expected: list[int] | None = None
        self._spots: list[tuple[torch.Tensor, int, int]] = []
        self._storages: list[int] = []
        self._cursor = 0
        #: Params or grads put back into the buffers by :meth:`restore` since construction.
        self.restored = 0

    def adopt(self, params: list[torch.Tensor]) -> None:
        """Move ``params`` (and zeroed grads) into new flat buffers, one per (device, dtype)."""
        frozen = [p for p in params if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"flat_buffers=True takes only params that require grad ({len(frozen)} do "
                "not): leave frozen params out of the optimizer"
            )
        if not all(map(_dense, params)):
            raise ValueError("flat_buffers=True needs dense params (contiguous or channels_last)")
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        seen: set[int] = set()
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                by_kind.setdefault((p.device, p.dtype), []).append(p)
        for (device, dtype), group in by_kind.items():
            self.buckets.append(_new_bucket(group, device, dtype))
        self._index()

    def intact(self) -> bool:
        """O(1): do the params and grads still live in the buffers, as at the last check?"""
        if self._expected is None or _use_count is None:
            return False
        if list(map(_use_count, self._storages)) != self._expected:
            return False
        spots = self._spots
        for _ in range(min(SPOT_CHECKS, len(spots))):
            p, pptr, gptr = spots[self._cursor]
            self._cursor = (self._cursor + 1) % len(spots)
            g = p.grad
            if g is None or g.data_ptr() != gptr or p.data_ptr() != pptr:
                return False
        return True

    def restore(self) -> int:
        """Point every param and grad at its slot again, copying values that were replaced
        (a missing grad becomes zeros); returns how many were put back. O(params)."""
        put_back = 0
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if p.data_ptr() != b.param_ptrs[i]:
                    _check_same_kind(p, b, i)
                    view = b.slot(b.flat_param, i)
                    view.copy_(p.detach())
                    p.data = view
                    put_back += 1
                g = p.grad
                if g is None or g.data_ptr() != b.grad_ptrs[i]:
                    view = b.slot(b.flat_grad, i)
                    if g is None:
                        view.zero_()
                    else:
                        view.copy_(g)
                    p.grad = view
                    put_back += 1
        self.restored += put_back
        self._expected = None
        return put_back

    def settle(self) -> None:
        """Remember the storages' use counts now that the params and grads were checked."""
        if _use_count is not None:
            self._expected = list(map(_use_count, self._storages))

    def zero_grads(self) -> None:
        """Zero every grad buffer (one memset per buffer)."""
        for b in self.buckets:
            b.flat_grad.zero_()

    def _index(self) -> None:
        """The rotating spot checks over every adopted param; forget the counts."""
        self._spots = [(p, pp, gp) for b in self.buckets
                       for p, pp, gp in zip(b.params, b.param_ptrs, b.grad_ptrs, strict=True)]
        self._storages = [c for b in self.buckets for c in b.storages()]
        self._cursor = 0
        self._expected = None


def _new_bucket(params: list[torch.Tensor], device: torch.device,
                dtype: torch.dtype) -> _Bucket:
    """Flat buffers for params of one device and dtype; the params and grads become views."""
    align = max(1, ALIGN_BYTES // dtype.itemsize)
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += -(-p.numel() // align) * align
    flat_param = torch.zeros(max(total, 1), dtype=dtype, device=device)
    flat_grad = torch.zeros_like(flat_param)
    layouts = [(p.shape, p.stride()) for p in params]
    bucket = _Bucket(params, offsets, layouts, flat_param, flat_grad)
    with torch.no_grad():
        for i, p in enumerate(params):
            view = bucket.slot(flat_param, i)
            view.copy_(p.detach())
            grad = bucket.slot(flat_grad, i)
            if p.grad is not None:
                grad.copy_(p.grad)
            p.data = view
            p.grad = grad
            bucket.param_ptrs.append(p.data_ptr())
            bucket.grad_ptrs.append(grad.data_ptr())
    return bucket


def _dense(p: torch.Tensor) -> bool:
    """True when p's elements fill exactly ``numel`` consecutive slots in some order."""
    formats = [torch.contiguous_format]
    formats += [torch.channels_last] if p.dim() == 4 else []
    formats += [torch.channels_last_3d] if p.dim() == 5 else []
    return any(p.is_contiguous(memory_format=f) for f in formats)


def _check_same_kind(p: torch.Tensor, b: _Bucket, i: int) -> None:
    """A replaced param must still fit its slot: same device, dtype and shape."""
    if p.device != b.flat_param.device or p.dtype != b.flat_param.dtype:
        raise ValueError(
            f"FusedAdamW(flat_buffers=True): a param moved from {b.flat_param.device}/"
            f"{b.flat_param.dtype} to {p.device}/{p.dtype} after the optimizer was built; "
            "move the model first, then build the optimizer"
        )
    shape = b.layouts[i][0]
    if p.shape != shape:
        raise ValueError(
            f"FusedAdamW(flat_buffers=True): a param of shape {tuple(shape)} was replaced by "
            f"one of shape {tuple(p.shape)}; build a new optimizer for the new params"
        )
