"""The demo trainer put together: `build()` makes the `Trainer` (model, data, parallel wrapping,
optimizer, loss scaler, checkpoints resumed, monitor attached, memory estimate) that the loop
(train_loop.py) runs, and `new_groups()` moves it to new process groups when the monitor
toggles a flag. How ranks share the work lives in parallel.py; this module only wires it."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .checkpoint import Checkpointer, NoCheckpoint, TermSignal, TrainState
from .data import ByteBatches, load_corpus
from .faults import Faults
from .layout import Layout, Mesh, build_mesh
from .memory import MemoryEstimate, estimate_memory
from .model import GPT, GPTConfig, peak_flops
from .moe import StepMeter, ddp_ignore_experts, moe_layers, shard_experts
from .parallel import (
    DistEnv,
    build_optimizer,
    compile_scope,
    control_group,
    rewrap_ddp,
    wrap_model,
)
from .parallel3d import Placed, place
from .precision import make_scaler, set_tf32


def print0(env: DistEnv, *args: Any) -> None:
    """Print on rank 0 only."""
    if env.rank == 0:
        print(*args, flush=True)


@dataclass
class Trainer:
    """Everything the training loop uses, built by `build()`."""

    args: argparse.Namespace
    env: DistEnv
    amp: str
    model: nn.Module  # holds the state: the GPT (an FSDP module for --zero 2/3), or
    # this rank's stages of it (parallel3d.Placed.parts)
    module: nn.Module  # what the step calls (DDP wrapper, or the model)
    optimizer: torch.optim.Optimizer
    scaler: Any
    data: ByteBatches
    state: TrainState
    faults: Faults
    memory: MemoryEstimate
    tokens_per_step: int  # per rank
    flops_per_token: int
    peak_flops: float | None
    log_every: int
    start_step: int = 0
    ckpt: Checkpointer | None = None
    term: TermSignal | None = None
    group: Any = None  # the CPU group for agreements
    monitor: Any = None
    mesh: Mesh | None = None  # the DeviceMesh of --pp/--tp/--ep (None: plain data parallel)
    placed: Placed | None = None  # the model cut and sharded over the mesh (--pp/--tp)
    moe: StepMeter | None = None  # the MoE figures of each step (--experts)

    @property
    def layout(self) -> Layout:
        return self.mesh.layout if self.mesh is not None else Layout(self.env.world_size)


def resolve_defaults(args: argparse.Namespace, device: torch.device) -> tuple[str, str]:
    """(amp, optimizer) with `auto` made concrete for this device."""
    cuda = device.type == "cuda"
    amp = args.amp
    if amp == "auto":
        amp = "bf16" if cuda and torch.cuda.is_bf16_supported() else "off"
    opt = args.optimizer
    if opt == "auto":
        opt = "torch-fused" if cuda else "torch"
    return amp, opt


def run_config(args: argparse.Namespace, env: DistEnv, amp: str, opt: str,
               config: GPTConfig) -> dict[str, Any]:
    """The run's settings as plain JSON values (sent to the monitor, kept in checkpoints)."""
    flags = {k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
             for k, v in vars(args).items()}
    return {**flags, "amp": amp, "optimizer": opt, "model": asdict(config),
            "world_size": env.world_size}


def build(args: argparse.Namespace, env: DistEnv) -> Trainer:
    """Model, data, parallelism, optimizer, scaler, checkpoint (resumed), monitor, estimate."""
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    amp, opt = resolve_defaults(args, env.device)
    tf32 = set_tf32(args.tf32 == "on", env.device)
    overrides: dict[str, Any] = {"block_size": args.block_size} if args.block_size else {}
    if args.experts:  # moe.py
        overrides.update(experts=args.experts, moe_top_k=args.moe_top_k,
                         capacity_factor=args.capacity_factor, moe_aux_coef=args.moe_aux_coef)
    config = GPTConfig.preset(args.preset, **overrides)
    model = GPT(config, activation_checkpointing=args.activation_checkpointing).to(env.device)
    n_params, flops_per_token = model.num_params(non_embedding=False), model.flops_per_token()
    n_params_model = model.num_params()
    layout = Layout(env.world_size, args.pp, args.tp, getattr(args, "ep", 1))
    mesh = (build_mesh(layout, env.device.type)
            if env.distributed and max(layout.pp, layout.tp, layout.ep) > 1 else None)
    # stages and tp ranks of one replica read the same batches: data by the dp rank
    data = ByteBatches(load_corpus(args.data, config.block_size), config.block_size,
                       args.batch_size * args.grad_accum, rank=layout.dp_rank(env.rank),
                       world_size=layout.dp, seed=args.seed)
    if mesh is not None and layout.ep > 1:  # moe.py: keep this rank's experts, out of DDP
        shard_experts(model, mesh.group("ep"))
        ddp_ignore_experts(model)
        n_params = model.num_params(non_embedding=False)
    placed = None
    if mesh is not None and max(layout.pp, layout.tp) > 1:  # parallel3d.py
        placed = place(model, mesh, args, env.device)
        model, module, compiled, sharded = placed.parts, placed.module, None, placed.zero >= 2
        n_params = placed.n_params
        zero_used = placed.zero
    else:
        sharded = args.zero >= 2 and env.distributed  # FSDP2
        compiled = compile_scope(args.compile, sharded)
        module = wrap_model(model, env, args.zero, compiled,
                            python_comm_hook=args.python_comm_hook and not args.monitor)
        zero_used = args.zero
    optimizer = build_optimizer(model, opt, zero_used, env, args.lr, args.weight_decay)
    scaler = make_scaler(amp, env.device, sharded)
    settings = run_config(args, env, amp, opt, config)
    zero = zero_used if env.distributed else 0  # one process: nothing to shard
    memory = estimate_memory(config, n_params, args.batch_size, amp=amp, zero=zero,
                             world_size=layout.dp, tensor_parallel=layout.tp,
                             pipeline=(layout.pp, args.pp_schedule, args.microbatches),
                             activation_checkpointing=args.activation_checkpointing)
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    t = Trainer(
        args=args, env=env, amp=amp, model=model, module=module, optimizer=optimizer,
        scaler=scaler, data=data, state=TrainState(model, optimizer, data, scaler, settings,
                                                    pipeline=layout.pp > 1),
        faults=Faults(env.rank, args.inject_hang, args.inject_crash, args.inject_overflow,
                      args.slow_rank, args.inject_desync, args.inject_freeze),
        memory=memory, tokens_per_step=args.batch_size * args.grad_accum * config.block_size,
        # a tp or pp rank does 1 / (tp x pp) of a replica's work on its tokens
        flops_per_token=flops_per_token // (layout.tp * layout.pp),
        peak_flops=peak_flops(device_name),
        log_every=args.log_every or (10 if env.device.type == "cuda" else 1),
        group=control_group(env), mesh=mesh, placed=placed,
        moe=StepMeter(model) if moe_layers(model) else None,
    )
    print0(env, f"training {args.preset} ({n_params_model / 1e6:.2f}M params) on "
                f"{env.world_size} rank(s){describe_mesh(t)}, {env.device.type}: amp {amp}, "
                f"ZeRO-{zero}, "
                f"optimizer {opt}, grad-accum {args.grad_accum}, activation checkpointing "
                f"{'on' if args.activation_checkpointing else 'off'}, compile "
                f"{compiled or 'off'}, tf32 {tf32}; "
                f"{t.tokens_per_step * layout.dp} tokens/step")
    print0(env, memory.describe())
    if t.moe is not None:
        print0(env, f"moe: {args.experts} experts per MLP, top-{args.moe_top_k}, capacity "
                    f"factor {args.capacity_factor}, {args.experts // layout.ep} per rank (ep "
                    f"{layout.ep}), load-balancing loss x {args.moe_aux_coef}")
    import scalemon.agent as sm

    if args.ckpt_dir:
        t.ckpt = Checkpointer(args.ckpt_dir, args.keep, t.group, log=lambda m: print0(env, m))
        restarted_at = sm.restart_step() if args.monitor else None
        if restarted_at is not None:
            print0(env, f"restarted by torchrun for a flag toggle after step {restarted_at}")
        if args.resume or args.resume_or_start or restarted_at is not None:
            t.start_step = resume(t)
        t.term = TermSignal()
    if args.monitor:  # after resuming, so the loss scaler's restored scale is the baseline
        checkpoint = None
        if t.ckpt is not None:
            def checkpoint(step: int) -> None:
                if t.ckpt.last_saved != step:
                    t.ckpt.save(step, t.state, "flag toggle restart")

        t.monitor = sm.init(model=module, optimizer=optimizer, scaler=scaler, config=settings,
                            checkpoint=checkpoint,
                            on_new_communicator=lambda names: new_groups(t, names),
                            mesh=mesh.device_mesh if mesh is not None else None)
        if t.monitor is not None:
            t.monitor.info("memory_estimate", memory.as_dict())
            describe_pipeline(t)
    return t


def describe_mesh(t: Trainer) -> str:
    """` (mesh pp 2 x dp 1 x tp 2, ...)` for the startup line, "" without a mesh."""
    if t.mesh is None:
        return ""
    dims = " x ".join(f"{n} {s}" for n, s in t.mesh.layout.dims)
    more = []
    if t.args.tp > 1 and t.args.sequence_parallel:
        more.append("sequence parallel")
    pipe = t.placed.pipeline if t.placed is not None else None
    if pipe is not None:
        v = f", {pipe.virtual} virtual stages per rank" if pipe.virtual > 1 else ""
        more.append(f"pipeline {pipe.name}, {pipe.microbatches} microbatches{v}")
    return f" (mesh {dims}{''.join(', ' + m for m in more)})"


def describe_pipeline(t: Trainer) -> None:
    """Tell the monitor the pipeline's schedule (its theoretical bubble), once."""
    pipe = t.placed.pipeline if t.placed is not None else None
    if pipe is None:
        return
    describe = getattr(t.monitor, "describe_pipeline", None)  # the agent may predate it
    if describe is not None:
        describe(schedule=pipe.name, stages=pipe.stages, microbatches=pipe.microbatches,
                 virtual_stages=pipe.virtual)


def resume(t: Trainer) -> int:
    """The step to go on from: the newest usable checkpoint's (loaded into the trainer), or 0
    with --resume-or-start when there is none. Raises NoCheckpoint otherwise (and
    IncompatibleCheckpoint, CheckpointError: see Checkpointer.load_latest)."""
    try:
        return t.ckpt.load_latest(t.state)
    except NoCheckpoint as exc:
        if not t.args.resume_or_start:
            raise
        print0(t.env, f"checkpoint: {exc}; starting from step 0 (--resume-or-start)")
        return 0


def new_groups(t: Trainer, names: list[str]) -> str:
    """Move the trainer's work to new process groups, which read the flags `names` changed
    (a collective, called by the monitor on every rank at the same step boundary); returns
    what moved, in words."""
    env = t.env
    if not env.distributed:
        return "one process: no process group to rebuild"
    t.group = dist.new_group(backend="gloo")  # the CPU group of the per-step agreements
    if t.ckpt is not None:
        t.ckpt.group = t.group
    kind = type(t.group._get_backend(torch.device("cpu"))).__name__
    moved = [f"agreements and checkpoints on a new gloo group ({kind})"]
    detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
    if t.mesh is not None:
        moved.append("the mesh keeps its groups")
    elif t.args.zero != 0:
        moved.append(f"ZeRO-{t.args.zero} keeps its groups")
    elif detail:
        # torch 2.13 segfaults building DDP on a group wrapped for DETAIL (checked on CPU/gloo)
        moved.append("DDP kept on its group: building DDP on a DETAIL-wrapped group crashes "
                     "torch")
    else:
        t.module = rewrap_ddp(t.model, env, dist.new_group())
        if t.monitor is not None:
            t.monitor.watch_model(t.module)
        moved.append("DDP rebuilt on a new group")
    text = "; ".join(moved)
    print0(env, f"flags {','.join(names)}: {text}")
    return text
