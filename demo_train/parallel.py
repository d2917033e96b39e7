"""How the model is spread over ranks: process group, DDP / ZeRO / FSDP2 wrapping, optimizer.

    --zero 0   DistributedDataParallel: everything replicated, gradients all-reduced
    --zero 1   DDP + ZeroRedundancyOptimizer: optimizer state sharded, parameters broadcast
    --zero 2   FSDP2 fully_shard(reshard_after_forward=False): parameters stay gathered from
               forward to backward, gradients reduce-scattered, optimizer state sharded
    --zero 3   FSDP2 fully_shard(reshard_after_forward=True): parameters re-gathered in backward
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .model import GPT

OPTIMIZERS = ("fused", "fused-flat", "torch", "torch-fused")
COMPILE_SCOPES = ("auto", "model", "blocks")
DEVICES = ("auto", "cpu", "cuda")


class DeviceChoiceError(RuntimeError):
    """This rank cannot have the device it asked for; the text says why and what to do."""


def choose_device(requested: str, local_rank: int, local_world_size: int,
                  gpus: int) -> torch.device:
    """The device of a rank: `cpu`; `cuda`: GPU `local_rank`; `auto`: a GPU per rank when this
    node has GPUs, else the CPU. NCCL needs one GPU per rank: with fewer visible GPUs than ranks
    on the node, `cuda` and `auto` raise DeviceChoiceError naming the fix, instead of rank
    `local_rank` failing on a GPU that does not exist."""
    if requested not in DEVICES:
        raise DeviceChoiceError(f"--device {requested!r}: choose one of {', '.join(DEVICES)}")
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return torch.device("cpu")
    if gpus == 0:
        raise DeviceChoiceError("--device cuda, but no CUDA GPU is visible: use --device cpu")
    if gpus < local_world_size:
        raise DeviceChoiceError(
            f"{local_world_size} ranks on this node but {gpus} visible GPU(s), and each rank "
            f"needs its own: use --device cpu (gloo), or start at most {gpus} rank(s) per node "
            f"(torchrun --nproc-per-node {gpus})")
    return torch.device("cuda", local_rank)


@dataclass(frozen=True)
class DistEnv:
    """Where this process runs."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def setup_distributed(device_arg: str = "auto") -> DistEnv:
    """Choose this rank's device (`choose_device`; raises DeviceChoiceError) and initialise
    the process group when launched by torchrun (gloo on CPU, NCCL on GPU)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = choose_device(device_arg, local_rank, local_world_size, gpus)
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        return DistEnv(0, 1, 0, device)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", store=attempt_store(),
                            rank=rank, world_size=world_size,
                            device_id=device if use_cuda else None)
    return DistEnv(rank, world_size, local_rank, device)


def attempt_store() -> dist.Store | None:
    """The rendezvous store, with keys private to this torchrun attempt.

    torchrun's static rendezvous (`--master-port`) keeps one TCPStore across worker restarts,
    so the workers of a restarted attempt would read the previous attempt's gloo/NCCL
    addresses and fail to connect; a prefix per TORCHELASTIC_RESTART_COUNT keeps them apart.
    None (plain env:// rendezvous) when torchrun's agent does not host the store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False,
                          timeout=timedelta(minutes=10))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"demo_train/attempt_{attempt}", store)


def control_group(env: DistEnv) -> dist.ProcessGroup | None:
    """A CPU (gloo) group for small host-side agreements that must never sync the GPU.
    On CPU jobs that is the default group (None)."""
    if not env.distributed or env.device.type == "cpu":
        return None
    return dist.new_group(backend="gloo")


def any_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """True when `flag` is set on at least one rank (a collective: every rank must call it)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def rewrap_ddp(model: nn.Module, env: DistEnv, group: dist.ProcessGroup) -> DDP:
    """DDP over `model` again, on `group` (a group created after a flag changed, so its
    communicator reads the new value); DDP broadcasts rank 0's parameters first."""
    return DDP(model, process_group=group,
               device_ids=[env.local_rank] if env.device.type == "cuda" else None)


def compile_scope(choice: str | None, sharded: bool) -> str | None:
    """What --compile compiles: None (off), "model" or "blocks". "auto" is the whole model, as
    nanoGPT does (one graph: the residual adds, final norm, lm_head and loss fuse across block
    boundaries; under DDP dynamo splits it at the gradient buckets), and each block under FSDP2,
    whose hooks run between the blocks (`sharded`: FSDP2 is in use)."""
    if choice is None:
        return None
    if choice == "auto":
        return "blocks" if sharded else "model"
    if choice == "model" and sharded:
        raise ValueError("--compile model is not for FSDP2 (--zero 2/3), whose hooks run "
                         "between the blocks: use --compile (or --compile blocks)")
    return choice


def wrap_model(
    model: GPT, env: DistEnv, zero: int, compile: str | None = None,
    python_comm_hook: bool = False,
) -> nn.Module:
    """Compile (`compile`: "model", "blocks" or None; in place, so parameter names do not
    change) and wrap for `zero`. Returns the module to call in the training step; `model`
    itself stays the module whose state is checkpointed (FSDP2 turns it into an FSDP module in
    place).

    `python_comm_hook` gives DDP torch's own Python all-reduce hook instead of its built-in
    C++ one: the baseline for the monitor's timed hook (any Python hook changes DDP's timing)."""
    if compile == "model":
        model.compile()
    elif compile == "blocks":
        for block in model.transformer.h:
            block.compile()
    elif compile is not None:
        raise ValueError(f"compile must be 'model', 'blocks' or None, not {compile!r}")
    if not env.distributed:
        return model
    if zero <= 1:
        ddp = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
        if python_comm_hook:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            ddp.register_comm_hook(None, allreduce_hook)
        return ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, reshard_after_forward=zero >= 3)
    # the root (embeddings, tied lm_head, final norm) is needed again first in backward
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return model


@contextlib.contextmanager
def gradient_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Wrap a micro-step's forward and backward: with `enabled` False the gradients only
    accumulate locally (DDP `no_sync()`, FSDP2 `set_requires_gradient_sync(False)`)."""
    if enabled:
        yield
    elif isinstance(module, DDP):
        with module.no_sync():
            yield
    elif hasattr(module, "set_requires_gradient_sync"):  # an FSDP2 module
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    else:
        yield


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings only (nanoGPT's split)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def optimizer_class(kind: str, device: torch.device) -> tuple[type, dict]:
    """(class, extra kwargs) for --optimizer. `fused` is our Triton AdamW; on CPU it runs
    under the Triton interpreter, switched on here if triton was not imported yet."""
    if kind == "torch":
        return torch.optim.AdamW, {"foreach": None}
    if kind == "torch-fused":
        return torch.optim.AdamW, {"fused": True}
    if kind in ("fused", "fused-flat"):
        if device.type == "cpu":
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from .fused_adam import FusedAdamW

        return FusedAdamW, {"flat_buffers": True} if kind == "fused-flat" else {}
    raise ValueError(f"unknown optimizer {kind!r}; choose one of {OPTIMIZERS}")


def build_optimizer(
    model: nn.Module,
    kind: str,
    zero: int,
    env: DistEnv,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
) -> torch.optim.Optimizer:
    """AdamW of the chosen implementation; sharded by ZeroRedundancyOptimizer for --zero 1
    (FSDP2 shards it by itself for --zero 2/3, as its parameters are already shards)."""
    if kind.startswith("fused") and zero >= 2 and env.distributed:
        raise ValueError(f"--optimizer {kind} needs plain tensors, but FSDP2 (--zero 2/3) makes "
                         "parameters DTensors: use --optimizer torch or torch-fused, or --zero 0/1")
    cls, extra = optimizer_class(kind, env.device)
    groups = param_groups(model, weight_decay)
    if zero == 1 and env.distributed:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, lr=lr, betas=betas, **extra)
    return cls(groups, lr=lr, betas=betas, **extra)
