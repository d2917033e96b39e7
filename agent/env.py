"""Who this process is in the job: rank, world size, local rank and job id, from the
environment that torchrun (or SLURM's srun) sets, else from the process group a process
started otherwise (`torch.multiprocessing.spawn`) joined before `init()`."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from scalemon import settings


@dataclass(frozen=True)
class RankEnv:
    """Identity of one training process."""

    rank: int
    world_size: int
    local_rank: int
    job: str
    restart_count: int
    host: str
    launcher: str  # "torchrun", "slurm", "spawn" (rank from the process group) or "single"
    node_rank: int = 0
    """This node's index in the job (torchrun's GROUP_RANK, SLURM_NODEID); rank 0 is on 0."""
    nodes: int = 1
    """How many nodes the job spans (torchrun's GROUP_WORLD_SIZE, SLURM_NNODES)."""

    @property
    def multi_node(self) -> bool:
        """True when the job spans more than one node."""
        return self.nodes > 1


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


def siblings_job_id(env: Mapping[str, str], host: str, parent_pid: int) -> str:
    """The job id that the processes one parent started on a node derive alike: the host,
    the parent's pid and the rendezvous port."""
    return f"{host.split('.')[0]}-{parent_pid}-{env.get('MASTER_PORT', '0')}"


def clean_job_id(job: str) -> str:
    """`job` as a job id: letters, digits, `.`, `_` and `-` (others become `-`), 100 at most."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", job)[:100]


def job_id_from_env(env: Mapping[str, str], host: str, launcher: str) -> str:
    """A job id every rank of the job derives alike, without talking to the others."""
    explicit = settings.raw("SCALEMON_JOB_ID", env)
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
    if launcher == "torchrun" and env.get("GROUP_WORLD_SIZE", "1") not in ("", "1"):
        # several nodes, default run id: only the rendezvous' master is common to all
        master = re.sub(r"[^A-Za-z0-9]", "", env.get("MASTER_ADDR", "").split(".")[0])[:40]
        return f"{master or 'master'}-{env.get('MASTER_PORT', '0')}"
    if launcher == "torchrun":
        # static rendezvous with the default run id: the local torchrun agent is our parent
        return siblings_job_id(env, host, os.getppid())
    return f"{host.split('.')[0]}-{os.getpid()}"


def read_rank_env(env: Mapping[str, str] | None = None) -> RankEnv:
    """Read the identity from torchrun's variables, else SLURM's, else a single process."""
    env = os.environ if env is None else env
    host = settings.node_name(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
        rank = _int(env, "RANK", default=0)
        world = _int(env, "WORLD_SIZE", default=1)
        local = _int(env, "LOCAL_RANK", default=0)
        per_node = max(1, _int(env, "LOCAL_WORLD_SIZE", default=world))
        node_rank = _int(env, "GROUP_RANK", default=0)
        nodes = _int(env, "GROUP_WORLD_SIZE", default=-(-world // per_node))
    elif "SLURM_PROCID" in env:
        launcher = "slurm"
        rank = _int(env, "SLURM_PROCID", default=0)
        world = _int(env, "SLURM_NTASKS", default=1)
        local = _int(env, "SLURM_LOCALID", default=0)
        node_rank = _int(env, "SLURM_NODEID", default=0)
        nodes = _int(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1)
    else:
        launcher, rank, world, local, node_rank, nodes = "single", 0, 1, 0, 0, 1
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}: check RANK/WORLD_SIZE")
    job = clean_job_id(job_id_from_env(env, host, launcher))
    restarts = _int(env, "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", default=0)
    return RankEnv(rank, world, local, job, restarts, host, launcher, node_rank, max(1, nodes))


def rank_env_from_group(env: RankEnv, rank: int, world_size: int, parent_pid: int,
                        environ: Mapping[str, str] | None = None) -> RankEnv:
    """The identity of rank `rank` of an initialised process group of `world_size` whose
    environment says otherwise: a process started by `torch.multiprocessing.spawn` (or by
    hand with `init_process_group(rank=, world_size=)`), as PyTorch's DDP tutorial and the
    pytorch/examples scripts do, which inherits no RANK/WORLD_SIZE, or those of the one
    launcher task that spawned it (an `srun` task per node, `torchrun --nproc-per-node 1`).

    Under a launcher, the job id, node index and node count stay the launcher's (the same on
    every node) and the local rank is the rank modulo the ranks per node. Without one, every
    rank of the node derives the same job id without talking: the spawning parent's pid and
    the rendezvous port (SCALEMON_JOB_ID wins), and the job is taken to be on one node, the
    local rank LOCAL_RANK where set, else the rank."""
    environ = os.environ if environ is None else environ
    if not 0 <= rank < world_size:
        raise ValueError(f"process group rank {rank} is outside its world size {world_size}")
    if env.launcher != "single":
        per_node = world_size // env.nodes if world_size % env.nodes == 0 else world_size
        return RankEnv(rank, world_size, rank % per_node, env.job, env.restart_count,
                       env.host, "spawn", env.node_rank, env.nodes)
    job = clean_job_id(settings.raw("SCALEMON_JOB_ID", environ)
                       or siblings_job_id(environ, env.host, parent_pid))
    local = _int(environ, "LOCAL_RANK", default=rank)
    return RankEnv(rank, world_size, local, job, env.restart_count, env.host, "spawn")


def max_restarts(env: Mapping[str, str] | None = None) -> int | None:
    """The launcher's restart budget (torchrun's `--max-restarts`, as
    TORCHELASTIC_MAX_RESTARTS), None where the launcher says none or it is not a number."""
    value = (os.environ if env is None else env).get("TORCHELASTIC_MAX_RESTARTS", "")
    try:
        count = int(value)
    except ValueError:
        return None
    return count if count >= 0 else None
