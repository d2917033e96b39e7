"""What torch tells of this process: the CUDA device it trains on, whether and how its
process group exists (NCCL or gloo), its rank when the environment does not say, and the NCCL
RAS port; read by `Run` (agent/run.py)."""

from __future__ import annotations

import os
from typing import Any

import torch

from scalemon import settings

from .env import RankEnv, rank_env_from_group
from .rings import group_uses_nccl
from .warn import Warnings


def cuda_device(model: Any, optimizer: Any = None) -> torch.device | None:
    """The CUDA device the model's params live on, else the optimizer's, else (neither given,
    or without params) the current device if CUDA is in use; None for a job on the CPU."""
    if not torch.cuda.is_available():
        return None
    param = _first_param(model, optimizer)
    if param is not None:
        return param.device if param.is_cuda else None
    if torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _first_param(model: Any, optimizer: Any) -> torch.Tensor | None:
    """The model's first param, else the optimizer's; None when neither has one (or either
    is not what it claims to be)."""
    try:
        param = next(model.parameters(), None) if model is not None else None
    except Exception:  # not an nn.Module
        param = None
    if param is None and optimizer is not None:
        try:
            param = next((p for g in optimizer.param_groups for p in g["params"]), None)
        except Exception:  # not an optimizer
            param = None
    return param if isinstance(param, torch.Tensor) else None


def identity_from_group(env: RankEnv, warnings: Warnings) -> RankEnv:
    """`env` (read from the environment), unless this process is a rank of an initialised
    process group that the environment does not describe (a `torch.multiprocessing.spawn`
    child, with no launcher's variables or with those of the one task that spawned it): then
    its rank and world size from the group, and a job id shared with the other ranks
    (`rank_env_from_group`). A multiprocessing child that the environment calls a world of
    one and that has no group yet is monitored as such, and told once what to change if it
    is a rank."""
    if dist_initialized():
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        if (rank, world) == (env.rank, env.world_size):
            return env
        return rank_env_from_group(env, rank, world, os.getppid())
    import multiprocessing

    if env.world_size == 1 and multiprocessing.parent_process() is not None:
        warnings.once("spawned-before-group",
                      "scalemon: this process was started by multiprocessing (mp.spawn?), its "
                      "environment names no other rank and it has no process group yet, so "
                      "it is monitored as a single process, a job of its own; if it is one "
                      "rank of a distributed job, call scalemon.agent.init() after "
                      "init_process_group(), or set RANK, WORLD_SIZE and SCALEMON_JOB_ID")
    return env


def direct_calls() -> Any:
    """CUDA calls that keep the GIL (cudart.py), unless SCALEMON_CUDA_DIRECT=0 or unavailable."""
    if settings.flag_off("SCALEMON_CUDA_DIRECT"):
        return None
    from .cudart import CudaDirect

    return CudaDirect.load()


def ras_port() -> int:
    """The port NCCL RAS listens on (NCCL_RAS_ADDR=host:port, default 28028)."""
    from .ras import RAS_PORT

    addr = os.environ.get("NCCL_RAS_ADDR", "")
    try:
        return int(addr.rsplit(":", 1)[1]) if ":" in addr else RAS_PORT
    except ValueError:
        return RAS_PORT


def dist_initialized() -> bool:
    """True once torch.distributed's default group exists."""
    try:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def uses_nccl() -> bool:
    """True when this process uses NCCL (or will: CUDA is there and no group exists yet)."""
    if dist_initialized():
        return group_uses_nccl()
    return torch.cuda.is_available()


def dist_backend() -> str | None:
    """The default process group's backend, or None outside torch.distributed."""
    try:
        import torch.distributed as dist

        return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None
