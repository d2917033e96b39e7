"""Train a small byte-level GPT, the reference workload scalemon is shown and tested on.

    # one process, CPU or GPU
    python demo_train/train.py --max-steps 50
    # two ranks (gloo on CPU, NCCL on GPU), monitored; then `scalemon snapshot` elsewhere
    torchrun --nproc-per-node 2 -- demo_train/train.py --monitor --max-steps 200
    # the techniques of the seed documents, one flag each
    torchrun --nproc-per-node 2 -- demo_train/train.py --amp fp16 --grad-accum 4 \\
        --activation-checkpointing --zero 3 --optimizer torch-fused
    # checkpoints every 5 steps, and a crash of rank 1 at step 7 that torchrun recovers from
    # (--resume-or-start: the first attempt has no checkpoint to resume from)
    torchrun --nproc-per-node 2 --max-restarts 1 -- demo_train/train.py --max-steps 20 \\
        --ckpt-dir runs/ckpt --ckpt-every 5 --resume-or-start --inject-crash 1:7
    # GPT-2 (124M) shapes on one GPU, bf16 and torch.compile
    python demo_train/train.py --preset gpt2-124m --amp bf16 --compile --batch-size 8

Rank 0 prints `step N loss X` for every logged step (--log-every: every step on CPU, every 10th
on CUDA, where reading the loss waits for the GPU). With --monitor every rank streams its own
loss (every step, without waiting for the GPU), tokens/s and MFU (measured between logged
steps; MFU where the GPU's peak is known), timings, memory and the memory estimate to the job's
scalemon hub. The flags are documented large-scale training techniques; each lives in a module:
precision.py (--amp), parallel.py (--zero, --optimizer, --compile, --grad-accum's no_sync),
checkpoint.py (--ckpt-*), memory.py (the estimate), faults.py (--inject-*).

--resume stops (exit code 1, one line) when there is no usable checkpoint, naming the ones set
aside as corrupt; --resume-or-start starts from step 0 then, saying so. A mistaken flag value
stops every rank before torch.distributed starts (exit code 2, said once per node).
"""

from __future__ import annotations

# first, before torch: in a worker torchrun restarted for a flag toggle, this applies the new
# value to the environment while torch can still read it at import (TORCH_CPP_LOG_LEVEL)
import scalemon.agent  # noqa: F401

# isort: split
import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn

from scalemon.demo_train.checkpoint import (
    Checkpointer,
    CheckpointError,
    IncompatibleCheckpoint,
    NoCheckpoint,
    TermSignal,
    TrainState,
)
from scalemon.demo_train.data import ByteBatches, load_corpus
from scalemon.demo_train.faults import Faults, rank_delay, rank_step
from scalemon.demo_train.memory import MemoryEstimate, estimate_memory
from scalemon.demo_train.model import GPT, PRESETS, GPTConfig, peak_flops
from scalemon.demo_train.parallel import (
    COMPILE_SCOPES,
    DEVICES,
    OPTIMIZERS,
    DeviceChoiceError,
    DistEnv,
    any_rank,
    build_optimizer,
    compile_scope,
    control_group,
    gradient_sync,
    rewrap_ddp,
    setup_distributed,
    wrap_model,
)
from scalemon.demo_train.precision import AMP_MODES, autocast, make_scaler, set_tf32
from scalemon.options import int_at_least, number

CANNOT_RESUME = 1  # exit code: --resume found nothing usable, or an incompatible checkpoint


positive_int = int_at_least(1)  # a job that trains nothing is a mistake to say
non_negative_int = int_at_least(0)


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are said once per node: under torchrun every rank
    parses the same flags, and only local rank 0 prints (every rank exits with code 2). The
    other ranks wait up to `QUIET_RANK_WAIT_S` first: torchrun ends every rank once one exits,
    and a quiet rank that exited first could have local rank 0 ended before it said why."""

    QUIET_RANK_WAIT_S = 10.0

    def error(self, message: str) -> NoReturn:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
            sys.stderr.flush()
        else:
            time.sleep(self.QUIET_RANK_WAIT_S)  # ended sooner by torchrun, once rank 0 said it
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags, grouped by what they control; every value checked here, before
    torch.distributed starts."""
    p = FlagParser(prog="train.py", description=__doc__,
                   formatter_class=argparse.RawTextHelpFormatter)
    # model and data
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size")
    p.add_argument("--data", help="a text file to train on (default: Python's own sources)")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="sequences per rank per forward pass (the micro-batch)")
    p.add_argument("--block-size", type=positive_int,
                   help="context length (default: the preset's)")
    p.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches per optimizer step (gradients synced on the last only)")
    # optimisation
    p.add_argument("--max-steps", type=positive_int, default=200,
                   help="train until this step (default 200)")
    p.add_argument("--lr", type=number(0.0, above=True), default=1e-3,
                   help="learning rate (> 0)")
    p.add_argument("--weight-decay", type=number(0.0), default=0.1,
                   help="AdamW's decoupled weight decay (>= 0)")
    p.add_argument("--optimizer", default="auto", choices=("auto", *OPTIMIZERS),
                   help="AdamW: fused (our Triton kernel), fused-flat (the same with params "
                        "and grads in flat buffers: a step's host work does not grow with the "
                        "number of tensors), torch, torch-fused "
                        "(auto: torch-fused on GPU, torch on CPU)")
    p.add_argument("--seed", type=int_at_least(0, 2**63 - 1), default=1337)
    # memory and speed techniques
    p.add_argument("--amp", default="auto", choices=("auto", *AMP_MODES),
                   help="mixed precision (auto: bf16 on a GPU that has it, else off)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                   help="0 DDP, 1 ZeroRedundancyOptimizer, 2/3 FSDP2 (3 reshards parameters)")
    p.add_argument("--python-comm-hook", action="store_true",
                   help="DDP with torch's Python all-reduce hook (the baseline of the monitor's "
                        "timed hook in bench/agent_overhead.py; ignored with --monitor)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward")
    p.add_argument("--compile", nargs="?", const="auto", choices=COMPILE_SCOPES,
                   help="torch.compile the whole model (as nanoGPT) or each block; bare "
                        "--compile is auto: the model, each block under FSDP2 (--zero 2/3)")
    p.add_argument("--tf32", default="on", choices=("on", "off"),
                   help="CUDA: fp32 matmuls on TF32 tensor cores (precision.py)")
    # checkpoints
    p.add_argument("--ckpt-dir", help="save checkpoints here (and on SIGTERM)")
    p.add_argument("--ckpt-every", type=non_negative_int, default=100,
                   help="steps between checkpoints (0: only at the end and on SIGTERM)")
    p.add_argument("--keep", type=non_negative_int, default=3, help="checkpoints kept (0: all)")
    p.add_argument("--resume", action="store_true",
                   help="start from the latest usable checkpoint; stop if there is none")
    p.add_argument("--resume-or-start", action="store_true",
                   help="as --resume, but start from step 0 when there is no usable "
                        "checkpoint (e.g. the first attempt of a job torchrun may restart)")
    # faults, for demonstrations and tests
    p.add_argument("--inject-hang", type=rank_step, metavar="RANK:STEP",
                   help="that rank stops before the collectives of that step")
    p.add_argument("--inject-crash", type=rank_step, metavar="RANK:STEP",
                   help="that rank raises before that step (first attempt only)")
    p.add_argument("--inject-overflow", type=positive_int, metavar="STEP",
                   help="inf gradients at that step, which GradScaler skips (needs --amp fp16)")
    p.add_argument("--slow-rank", type=rank_delay, metavar="RANK:SECONDS",
                   help="that rank sleeps before every backward: a planted straggler")
    p.add_argument("--inject-desync", type=rank_step, metavar="RANK:STEP",
                   help="that rank calls a mismatched all-reduce at that step; with "
                        "TORCH_DISTRIBUTED_DEBUG=DETAIL torch's check catches it (else skipped)")
    # system
    p.add_argument("--device", default="auto", choices=DEVICES,
                   help="auto: a GPU per rank where the node has GPUs, else the CPU; with fewer "
                        "GPUs than ranks on the node the job stops and says so")
    p.add_argument("--log-every", type=positive_int, metavar="N",
                   help="read the loss on the host, print it and measure tokens/s every N steps "
                        "(each read waits for the GPU; default 1 on CPU, 10 on CUDA)")
    p.add_argument("--monitor", action="store_true", help="stream metrics to scalemon")
    p.add_argument("--step-delay", type=number(0.0), default=0.0,
                   help="sleep this many seconds per step (slows the demo down to watch it)")
    p.add_argument("--stats-json", help="rank 0 writes per-step times, losses, ... here")
    args = p.parse_args(argv)
    problem = flag_conflict(args, int(os.environ.get("WORLD_SIZE", "1")))
    if problem:
        p.error(problem)
    return args


def flag_conflict(args: argparse.Namespace, world_size: int) -> str | None:
    """What is wrong with a combination of flags (each value alone is valid), or None."""
    if (args.resume or args.resume_or_start) and not args.ckpt_dir:
        flag = "--resume" if args.resume else "--resume-or-start"
        return f"{flag} needs --ckpt-dir (where the checkpoints are)"
    if args.inject_overflow is not None and args.amp != "fp16":
        return (f"--inject-overflow needs --amp fp16 (not {args.amp}): only fp16's GradScaler "
                "skips a step with inf gradients; without it they turn the weights and every "
                "later loss into NaN")
    for flag in ("inject_hang", "inject_crash", "slow_rank", "inject_desync"):
        planted = getattr(args, flag)
        if planted is not None and planted.rank >= world_size:
            return (f"--{flag.replace('_', '-')} {planted} names rank {planted.rank}, and this "
                    f"job has {world_size} rank(s)")
    try:
        compile_scope(args.compile, sharded=args.zero >= 2 and world_size > 1)
    except ValueError as e:
        return str(e)
    return None


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
    model: GPT  # holds the state (an FSDP module for --zero 2/3)
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
    overrides = {"block_size": args.block_size} if args.block_size else {}
    config = GPTConfig.preset(args.preset, **overrides)
    model = GPT(config, activation_checkpointing=args.activation_checkpointing).to(env.device)
    n_params, flops_per_token = model.num_params(non_embedding=False), model.flops_per_token()
    data = ByteBatches(load_corpus(args.data, config.block_size), config.block_size,
                       args.batch_size * args.grad_accum, rank=env.rank,
                       world_size=env.world_size, seed=args.seed)
    sharded = args.zero >= 2 and env.distributed  # FSDP2
    compiled = compile_scope(args.compile, sharded)
    module = wrap_model(model, env, args.zero, compiled,
                        python_comm_hook=args.python_comm_hook and not args.monitor)
    optimizer = build_optimizer(model, opt, args.zero, env, args.lr, args.weight_decay)
    scaler = make_scaler(amp, env.device, sharded)
    settings = run_config(args, env, amp, opt, config)
    zero = args.zero if env.distributed else 0  # one process: nothing to shard
    memory = estimate_memory(config, n_params, args.batch_size, amp=amp, zero=zero,
                             world_size=env.world_size,
                             activation_checkpointing=args.activation_checkpointing)
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    t = Trainer(
        args=args, env=env, amp=amp, model=model, module=module, optimizer=optimizer,
        scaler=scaler, data=data, state=TrainState(model, optimizer, data, scaler, settings),
        faults=Faults(env.rank, args.inject_hang, args.inject_crash, args.inject_overflow,
                      args.slow_rank, args.inject_desync),
        memory=memory, tokens_per_step=args.batch_size * args.grad_accum * config.block_size,
        flops_per_token=flops_per_token, peak_flops=peak_flops(device_name),
        log_every=args.log_every or (10 if env.device.type == "cuda" else 1),
        group=control_group(env),
    )
    print0(env, f"training {args.preset} ({model.num_params() / 1e6:.2f}M params) on "
                f"{env.world_size} rank(s), {env.device.type}: amp {amp}, ZeRO-{zero}, "
                f"optimizer {opt}, grad-accum {args.grad_accum}, activation checkpointing "
                f"{'on' if args.activation_checkpointing else 'off'}, compile "
                f"{compiled or 'off'}, tf32 {tf32}; "
                f"{t.tokens_per_step * env.world_size} tokens/step")
    print0(env, memory.describe())
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
                            on_new_communicator=lambda names: new_groups(t, names))
        if t.monitor is not None:
            t.monitor.info("memory_estimate", memory.as_dict())
    return t


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


def say_cannot_resume(env: DistEnv, exc: CheckpointError | IncompatibleCheckpoint) -> None:
    """Rank 0 says in one line why the run cannot resume (every rank has the same reason:
    the ranks decided together), then the ranks leave together."""
    if env.rank == 0:
        hint = ("; to start from step 0 instead, pass --resume-or-start"
                if isinstance(exc, NoCheckpoint) else "")
        print(f"train.py: cannot resume: {exc}{hint}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.barrier()  # nobody exits (and has torchrun stop the others) before it is said


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
    if t.args.zero != 0:
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


def forward_backward(t: Trainer, step: int) -> torch.Tensor:
    """Gradients of one step's batch, over --grad-accum micro-batches with the gradient
    all-reduce on the last only; returns the step's mean loss (detached)."""
    device, accum = t.env.device, t.args.grad_accum
    x, y = t.data.next_batch()  # batch_size * grad_accum sequences, cut into micro-batches
    if device.type == "cuda":  # from pinned memory the copies below do not wait for the GPU
        x, y = x.pin_memory(), y.pin_memory()
    total = torch.zeros((), device=device)
    for i, (xb, yb) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
        last = i == accum - 1
        with gradient_sync(t.module, enabled=last):
            with autocast(t.amp, device):
                _, loss = t.module(xb.to(device, non_blocking=True),
                                   yb.to(device, non_blocking=True))
            loss = loss / accum
            scaled = t.scaler.scale(loss) if t.scaler is not None else loss
            if last:
                scaled = t.faults.overflow(step, scaled)
                t.faults.before_backward()
            scaled.backward()
        total += loss.detach()
    return total


def optimizer_step(t: Trainer) -> None:
    """Update the weights (through the loss scaler, which skips a step with inf/NaN
    gradients and lowers the scale) and clear the gradients."""
    if t.scaler is not None:
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:
        t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)


class SyncClock:
    """Throughput between host sync points. Without a sync the host runs ahead of the GPU, so
    only the time from one logged step's loss read to the next measures work; --step-delay
    sleeps are not work and are left out."""

    def __init__(self, step: int, now: float) -> None:
        self.step, self.t, self.paused = step, now, 0.0
        self.intervals: list[tuple[int, int, float]] = []  # (logged step, steps, seconds)

    def pause(self, seconds: float) -> None:
        """Leave `seconds` (a sleep) out of the current interval."""
        self.paused += seconds

    def lap(self, step: int, now: float) -> tuple[int, float]:
        """Close the interval at logged step `step` (right after its sync): (steps, seconds)."""
        steps, seconds = step - self.step, max(1e-9, now - self.t - self.paused)
        self.intervals.append((step, steps, seconds))
        self.step, self.t, self.paused = step, now, 0.0
        return steps, seconds

    def tokens_per_s(self, tokens_per_step: int) -> float | None:
        """Over the whole run, without the first interval (warm-up, compilation) when there
        are others."""
        measured = self.intervals[1:] or self.intervals
        seconds = sum(s for _, _, s in measured)
        return tokens_per_step * sum(n for _, n, _ in measured) / seconds if measured else None


def train(t: Trainer) -> int:
    """The loop; returns the exit code (non-zero after saving on SIGTERM).

    Host values (the loss, the loss scale) are read only on logged steps, every --log-every:
    each read waits for the GPU, so reading every step would sync every step (nanoGPT's log
    interval). tokens/s and MFU are measured between those reads, on every rank, and go to the
    monitor with the logged step; the monitor gets the loss of every step without a sync."""
    args, env = t.args, t.env
    stats: dict[str, list] = {"steps": [], "step_times_s": [], "losses": [], "loss_scales": [],
                              "agent_totals_s": []}  # finish() adds the clock's intervals
    scale = t.scaler.get_scale() if t.scaler is not None and env.rank == 0 else None
    clock = SyncClock(t.start_step, time.perf_counter())
    if t.start_step >= args.max_steps:
        print0(env, f"nothing to train: resumed at step {t.start_step}, --max-steps is "
                    f"{args.max_steps}")
    for step in range(t.start_step + 1, args.max_steps + 1):
        t0 = time.perf_counter()
        t.faults.before_step(step, t.monitor)
        t.faults.desync(step, t.group, env.rank)
        loss = forward_backward(t, step)
        optimizer_step(t)
        logged = step % t.log_every == 0 or step == args.max_steps
        measured: dict[str, float] = {}
        if logged:
            value = read_loss(loss)  # a sync point
            steps, seconds = clock.lap(step, time.perf_counter())
            tokens_per_s = t.tokens_per_step * steps / seconds
            measured["tokens_per_s"] = tokens_per_s
            if t.peak_flops is not None:
                measured["mfu"] = t.flops_per_token * tokens_per_s / t.peak_flops
        if t.monitor is not None:
            t.monitor.log(step, loss=loss, tokens=t.tokens_per_step, **measured)
            stats["agent_totals_s"].append(t.monitor.agent_time_total_s)  # for bench/
        if logged and env.rank == 0:
            print(f"step {step} loss {value:.4f}", flush=True)
            scale = report_loss_scale(t, step, scale)
            stats["steps"].append(step)
            stats["losses"].append(value)
            stats["loss_scales"].append(scale)
        if args.step_delay:
            slept = time.perf_counter()
            time.sleep(args.step_delay)
            clock.pause(time.perf_counter() - slept)
        stats["step_times_s"].append(time.perf_counter() - t0)
        if t.ckpt is not None:
            stop = any_rank(t.term.received, t.group)
            due = args.ckpt_every > 0 and step % args.ckpt_every == 0
            if (due or stop or step == args.max_steps) and t.ckpt.last_saved != step:
                t.ckpt.save(step, t.state, "SIGTERM" if stop else "periodic")
            if stop:
                print0(env, f"SIGTERM: stopped after step {step} with a checkpoint")
                finish(t, stats, clock, TermSignal.EXIT_CODE)
                return TermSignal.EXIT_CODE
    finish(t, stats, clock, 0)
    return 0


def read_loss(loss: torch.Tensor) -> float:
    """The step's loss on the host: a sync point (it waits for the GPU to finish the step)."""
    return loss.item()


def report_loss_scale(t: Trainer, step: int, previous: float | None) -> float | None:
    """Print when the AMP loss scale went down since the last logged step (steps with inf/NaN
    gradients were skipped); returns the scale now. Reading it is a sync: logged steps only."""
    if t.scaler is None:
        return None
    scale = t.scaler.get_scale()
    if previous is not None and scale < previous:
        if t.log_every == 1:
            print(f"amp: step {step} skipped (inf/NaN gradients), loss scale {previous:g} -> "
                  f"{scale:g}", flush=True)
        else:
            print(f"amp: loss scale {previous:g} -> {scale:g} by step {step}: steps with inf/NaN "
                  "gradients were skipped", flush=True)
    return scale


def finish(t: Trainer, stats: dict[str, list], clock: SyncClock, code: int) -> None:
    """Throughput summary, measured memory (GPU), stats file, monitor exit."""
    env = t.env
    tokens_per_s = clock.tokens_per_s(t.tokens_per_step)
    stats["intervals"] = [list(interval) for interval in clock.intervals]
    summary: dict[str, Any] = {"tokens_per_s_per_rank": tokens_per_s}
    if tokens_per_s is not None:
        mfu = (f", MFU {100 * t.flops_per_token * tokens_per_s / t.peak_flops:.1f}%"
               if t.peak_flops else ", MFU n/a (device peak unknown)")
        print0(env, f"throughput: {tokens_per_s:,.0f} tokens/s per rank, "
                    f"{tokens_per_s * env.world_size:,.0f} in all{mfu}")
    if env.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(env.device)
        summary["mem_peak_bytes"] = peak
        print0(env, f"memory: estimate {t.memory.total / 2**20:.1f} MiB, measured peak "
                    f"{peak / 2**20:.1f} MiB allocated ({peak / t.memory.total:.2f}x)")
        if t.monitor is not None:
            t.monitor.info("memory_measured", {"peak_allocated": peak,
                                               "estimate": t.memory.total})
    if t.args.stats_json and env.rank == 0:
        write_stats(t, stats, summary)
    if t.monitor is not None:
        t.monitor.finish(code)


def write_stats(t: Trainer, stats: dict[str, list], summary: dict[str, Any]) -> None:
    """Rank 0's per-step record, for tests and bench/ (step_times_s as before)."""
    out: dict[str, Any] = {**stats, **summary}
    out.update(
        world_size=t.env.world_size, tokens_per_step=t.tokens_per_step,
        flops_per_token=t.flops_per_token, peak_flops=t.peak_flops,
        memory_estimate=t.memory.as_dict(), config=t.state.config,
        device=torch.cuda.get_device_name(t.env.device) if t.env.device.type == "cuda" else "cpu",
    )
    if t.monitor is not None:  # the agent's own cost, for bench/agent_overhead.py
        out["agent_time_total_s"] = t.monitor.agent_time_total_s
        out["agent_steps"] = t.monitor.steps_logged
        recorder = getattr(t.monitor, "recorder", None)  # its background thread's reads
        out["recorder_read_s"] = recorder.read_s if recorder is not None else None
        out["recorder_entries"] = recorder.entries if recorder is not None else None
    with open(t.args.stats_json, "w") as f:
        json.dump(out, f)


def build_and_train(args: argparse.Namespace, env: DistEnv) -> int:
    """Build the trainer and train; returns the exit code. A run that cannot resume stops
    before training with one line (CANNOT_RESUME)."""
    try:
        trainer = build(args, env)
    except (CheckpointError, IncompatibleCheckpoint) as exc:
        say_cannot_resume(env, exc)
        return CANNOT_RESUME
    try:
        return train(trainer)
    finally:
        if trainer.term is not None:
            trainer.term.restore()


def main(argv: list[str] | None = None) -> int:
    """Build, train, close; returns the process exit code."""
    args = parse_args(argv)
    try:
        env = setup_distributed(args.device)
    except DeviceChoiceError as exc:
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once per node, not once per rank
            print(f"train.py: {exc}", file=sys.stderr, flush=True)
        else:  # as FlagParser.error: a quiet rank that exited first could have torchrun end
            time.sleep(FlagParser.QUIET_RANK_WAIT_S)  # local rank 0 before it said why
        return 2
    code = build_and_train(args, env)
    # free DDP and ZeroRedundancyOptimizer before their process group (build_and_train's
    # trainer is gone now): left to interpreter shutdown, ZeRO-1 with gloo sometimes aborts
    # ("terminate called without an active exception") after training finished
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
