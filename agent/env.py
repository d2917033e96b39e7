"""Who this process is in the job: rank, world size, local rank and job id, from the
environment that torchrun (or SLURM's srun) sets."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RankEnv:
    """Identity of one training process."""

    rank: int
    world_size: int
    local_rank: int
    job: str
    restart_count: int
    host: str
    launcher: str  # "torchrun", "slurm" or "single"


def _int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                msg = f"environment variable {name}={value!r} is not an integer"
                raise ValueError(msg) from None
    return default


def job_id_from_env(env: Mapping[str, str], host: str, launcher: str) -> str:
    """A job id every rank of the job derives alike, without talking to the others."""
    explicit = env.get("SCALEMON_JOB_ID")
    if explicit:
        return explicit
    if launcher == "slurm" or (env.get("SLURM_JOB_ID") and launcher != "torchrun"):
        step = env.get("SLURM_STEP_ID")
        return f"slurm-{env['SLURM_JOB_ID']}" + (f".{step}" if step else "")
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if launcher == "torchrun" and run_id != "none":
        return "tr-" + re.sub(r"[^A-Za-z0-9]", "", run_id)[:12]
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    if launcher == "torchrun":
        # static rendezvous with the default run id: the local torchrun agent is our parent
        return f"{host.split('.')[0]}-{os.getppid()}-{env.get('MASTER_PORT', '0')}"
    return f"{host.split('.')[0]}-{os.getpid()}"


def read_rank_env(env: Mapping[str, str] | None = None) -> RankEnv:
    """Read the identity from torchrun's variables, else SLURM's, else a single process."""
    env = os.environ if env is None else env
    host = socket.gethostname()
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
        rank = _int(env, "RANK", default=0)
        world = _int(env, "WORLD_SIZE", default=1)
        local = _int(env, "LOCAL_RANK", default=0)
    elif "SLURM_PROCID" in env:
        launcher = "slurm"
        rank = _int(env, "SLURM_PROCID", default=0)
        world = _int(env, "SLURM_NTASKS", default=1)
        local = _int(env, "SLURM_LOCALID", default=0)
    else:
        launcher, rank, world, local = "single", 0, 1, 0
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}: check RANK/WORLD_SIZE")
    job = re.sub(r"[^A-Za-z0-9._-]", "-", job_id_from_env(env, host, launcher))[:100]
    restarts = _int(env, "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", default=0)
    return RankEnv(rank, world, local, job, restarts, host, launcher)
