"""Fused Adam/AdamW in Triton: one kernel launch per ``step()`` for every parameter.

The optimizer (``FusedAdamW``) lives here; its per-param state (master weights, moment dtypes,
bytes per parameter, with the bf16 modes' table) in ``adam_state.py``; the kernels in
``adam_kernel.py``; the device tables they read, and when they are rewritten, in
``adam_plan.py``.

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

Differences from torch: under GradScaler the grads are unscaled inside the kernel but not
written back; float64 and complex params, sparse grads and non-dense layouts are refused; a
float lr that changes (a scheduler) costs one small async host-to-device copy at the next step;
one stream at a time (the tables are updated in stream order).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch
import torch.optim.optimizer as _torch_optimizer

from . import adam_plan
from .adam_kernel import FLAG_STOCHASTIC, block_for, interpreted
from .adam_plan import CODES, Plan, check_device, check_tensor, poke
from .adam_state import (
    FP32_MASTER,
    LO16_MASTER,
    bytes_per_param,
    check_modes,
    ensure_state,
    join_lo16,
    master_kind,
    split_lo16,
    stochastic_rounding,
)
from .flat_buffers import FlatBuffers

__all__ = [  # bytes_per_param, join_lo16 and split_lo16 are adam_state.py's
    "FusedAdamW",
    "bytes_per_param",
    "interpreted",
    "join_lo16",
    "launch_count",
    "split_lo16",
]

_FLAG_AMSGRAD, _FLAG_MAXIMIZE, _FLAG_DECOUPLED = 1, 2, 4


def launch_count() -> int:
    """Number of fused kernel launches since import."""
    return adam_plan.LAUNCH_COUNT


def _capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on the current stream of ``device``."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_profiler_enabled = torch.autograd._profiler_enabled
_GLOBAL_PRE_HOOKS: dict = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", {})
_GLOBAL_POST_HOOKS: dict = getattr(_torch_optimizer, "_global_optimizer_post_hooks", {})
"""torch's optimizer hooks for every optimizer (`register_optimizer_step_pre_hook`)."""


class FusedAdamW(torch.optim.Optimizer):
    """Drop-in ``torch.optim.AdamW`` whose ``step()`` is a single Triton launch.

    ``decoupled=False`` gives Adam with L2 weight decay (``g += wd * p``). Per group,
    ``master_weights`` (None = automatic = "fp32" for half params; True = "fp32"; "lo16" =
    the low 16 bits of an fp32 master next to bf16 params; False = none) and ``moment_dtype``
    (None = fp32 with a master, else the param's dtype; "fp32"; "bf16") choose the bytes moved
    per parameter (adam_state.py); ``stochastic_rounding=True`` rounds bf16 params without a
    master stochastically (unbiased: small updates are not lost), at the same bytes.
    ``capturable=True`` lets ``step()`` be captured in a CUDA
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
        stochastic_rounding: bool = False,
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
            "stochastic_rounding": stochastic_rounding,
            "capturable": capturable,
        }
        check_modes(defaults)
        self._plan: Plan | None = None
        self._graph_plans: list[Plan] = []
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
                        "stochastic_rounding", "decoupled_weight_decay", "capturable"):
                group.setdefault(key, self.defaults[key])
            if self.defaults["decoupled_weight_decay"]:
                group["decoupled_weight_decay"] = True
            check_modes(group)
        self.invalidate_tables()

    def invalidate_tables(self) -> None:
        """Force the pointer tables to be rebuilt at the next ``step()``."""
        self._plan = None
        self._epoch = getattr(self, "_epoch", 0) + 1

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, and invalidates the cached tables."""
        super().add_param_group(param_group)
        check_modes(self.param_groups[-1])
        if self._flat is not None:
            group = self.param_groups[-1]
            self._flat.adopt(group["params"])
            # every param is stepped (its grad is never None), so its state exists from the
            # start, as after a step
            for p in group["params"]:
                ensure_state(self.state[p], p, group)
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

    def _ready_flat(self) -> tuple[Plan, torch.Tensor] | None:
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

    def _ready(self) -> tuple[Plan, torch.Tensor] | None:
        """The plan and the grad table of this step, rebuilt or refreshed as needed (None
        when no param has a grad); flat buffers first get back what was moved out of them."""
        bufs = self._flat
        if bufs is None:
            return self._ready_polled()
        bufs.restore()
        ready = self._ready_polled()
        bufs.settle()
        return ready

    def _ready_polled(self) -> tuple[Plan, torch.Tensor] | None:
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

    def _captured(self, plan: Plan, ptrs: list[int], hyper: tuple) -> torch.Tensor:
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

    def _build(self, flat: list[torch.Tensor], group_key: tuple) -> Plan | None:
        """Validate, initialise state and write the tables for the params that have grads."""
        owners = [(gi, group) for gi, group in enumerate(self.param_groups)
                  for _ in group["params"]]
        with_grad = [i for i, p in enumerate(flat) if p.grad is not None]
        if not with_grad:
            return None
        device = flat[with_grad[0]].device
        check_device(device)
        rows: list[list[int]] = []
        refs: list[torch.Tensor] = []
        for i in with_grad:
            p = flat[i]
            if p.device != device:
                raise ValueError(f"FusedAdamW needs all params on one device: {device}, {p.device}")
            check_tensor(p, p.grad)
            rows.append(self._row(*owners[i], p, refs))
        grads = [flat[i].grad for i in with_grad]
        plan = Plan(flat, with_grad, rows, grads, group_key, len(self.param_groups), refs)
        if device.type == "cuda" and any(g["capturable"] for g in self.param_groups):
            poke(plan.grad_tab, [(0, plan.gptrs[0])])  # compile it now, not under capture
        return plan

    def _row(self, gi: int, group: dict, p: torch.Tensor, refs: list[torch.Tensor]) -> list[int]:
        """One int64 table row for param ``p`` (initialising or fixing its state); the
        tensors it names are appended to ``refs``."""
        st = ensure_state(self.state[p], p, group)
        kind = master_kind(p, group)
        flags = (
            _FLAG_AMSGRAD * bool(group["amsgrad"])
            + _FLAG_MAXIMIZE * bool(group["maximize"])
            + _FLAG_DECOUPLED * bool(group["decoupled_weight_decay"])
            + FLAG_STOCHASTIC * stochastic_rounding(p, group, kind)
        )
        vmax = st.get("max_exp_avg_sq") if group["amsgrad"] else None
        master = st.get({FP32_MASTER: "master_param", LO16_MASTER: "master_lo16"}.get(kind))
        lr = group["lr"] if _lr_by_pointer(group["lr"], p.device) else None
        named = (p, st["exp_avg"], st["exp_avg_sq"], vmax, master, st["step"], lr)
        refs.extend(t for t in named if t is not None)
        return [
            *(0 if t is None else t.data_ptr() for t in named),
            p.numel(),
            max(1, math.ceil(p.numel() / block_for(p.device))),
            gi,
            CODES[p.dtype],
            CODES[p.grad.dtype],
            CODES[st["exp_avg"].dtype],
            flags,
            kind,
            0,
        ]


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
