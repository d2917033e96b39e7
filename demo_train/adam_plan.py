"""The plan of FusedAdamW (demo_train/fused_adam.py): the device tables the kernel
(demo_train/adam_kernel.py) reads, built for one set of params and state, and the host copies
that tell when the grad column must be rewritten or the whole plan rebuilt (no torch op when
nothing changed)."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterable, Sequence
from functools import reduce
from itertools import chain

import torch

from .adam_kernel import (
    FLAG_STOCHASTIC,
    GPU_WARPS,
    HCOL,
    NCOL,
    POKE_BIAS,
    POKES,
    fused_adam_kernel,
    interpreted,
    launch_shape,
    poke_kernel,
)

#: Number of fused kernel launches since import (tests check one per ``step()``).
LAUNCH_COUNT = 0
#: Number of table-writing launches (only while a CUDA graph is captured).
POKE_COUNT = 0

CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The dtype codes of the tables' rows."""
_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


def check_device(device: torch.device) -> None:
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


def check_tensor(p: torch.Tensor, g: torch.Tensor) -> None:
    """Refuse params/grads the pointer tables cannot describe."""
    if g.layout is not torch.strided:
        raise ValueError("FusedAdamW does not support sparse gradients")
    if p.is_complex() or g.is_complex():
        raise TypeError("FusedAdamW does not support complex parameters")
    if p.dtype not in CODES or g.dtype not in CODES:
        raise TypeError(f"FusedAdamW supports float32/bfloat16/float16, got {p.dtype}/{g.dtype}")
    if g.device != p.device:
        raise ValueError(f"grad on {g.device} but its param on {p.device}")
    if g.shape != p.shape or not same_dense_layout(g, p):
        raise ValueError("FusedAdamW needs dense params and grads with the same shape and strides")


def same_dense_layout(t: torch.Tensor, p: torch.Tensor) -> bool:
    """True if ``t`` can be walked by the flat element index that walks ``p``."""
    if t.is_contiguous() and p.is_contiguous():
        return True
    formats = (torch.channels_last, torch.channels_last_3d)
    dense = any(
        p.dim() == (4 if f is torch.channels_last else 5) and p.is_contiguous(memory_format=f)
        for f in formats
    )
    return dense and t.stride() == p.stride()


def _write_ints(dst: torch.Tensor, values: Sequence[int]) -> None:
    """``dst[:] = values`` (int64) in stream order, without waiting for the device: the same
    few torch ops whatever the length (a pinned host buffer filled through numpy, a copy)."""
    src = torch.empty(len(values), dtype=torch.int64, pin_memory=dst.device.type == "cuda")
    src.numpy()[:] = values
    dst.copy_(src, non_blocking=True)


def poke(dst: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """Write (index, value) pairs into the int64 tensor ``dst`` with poke launches, whose
    arguments a captured CUDA graph keeps (a short last launch repeats its first pair)."""
    global POKE_COUNT
    on_device = torch.cuda.device(dst.device) if dst.is_cuda else contextlib.nullcontext()
    with on_device:  # Triton launches on the current device
        for k in range(0, len(pairs), POKES):
            chunk = list(pairs[k : k + POKES])
            chunk += [chunk[0]] * (POKES - len(chunk))
            args = [x + POKE_BIAS for pair in chunk for x in pair]
            poke_kernel[(1,)](dst, *args, num_warps=1)
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


class Plan:
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
        self.sub_block, self.iters = launch_shape(self.device)
        self.block = self.sub_block * self.iters  # a program's span (`block_for`)
        self._tables(rows)
        self.grad_tab = _upload(torch.tensor(self.gptrs, dtype=torch.int64), self.device)
        self.counters = torch.zeros(len(rows), dtype=torch.int32, device=self.device)
        self.hyper_tab = torch.zeros(n_groups, HCOL, dtype=torch.float64, device=self.device)
        self.hyper_key: tuple | None = None
        self.dummy = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.consts = {
            "P_CODE": _uniform(r[10] for r in rows),
            "G_CODE": _uniform(r[11] for r in rows),
            "S_CODE": _uniform(r[12] for r in rows),
            "MASTER": _uniform(r[14] for r in rows),
            "AMS": _uniform(int(r[3] != 0) for r in rows),
            "SR": int(any(r[13] & FLAG_STOCHASTIC for r in rows)),
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
            dense = all(map(same_dense_layout, grads, self.params))
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
        poke(tab, list(enumerate(ptrs)))
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
        fused_adam_kernel[(self.n_blocks,)](
            self.tensor_tab,
            grad_tab,
            self.block_tab,
            self.hyper_tab,
            self.counters,
            scale,
            inf,
            HAS_SCALE=grad_scale is not None,
            HAS_INF=found_inf is not None,
            NCOL=NCOL,
            HCOL=HCOL,
            BLOCK=self.sub_block,
            ITERS=self.iters,
            num_warps=GPU_WARPS,
            **self.consts,
        )
        LAUNCH_COUNT += 1
