"""The demo trainer's command-line flags: the parser, the check of every value and of their
combinations, all before torch.distributed starts (a mistake stops every rank with exit code 2,
said once per node)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NoReturn

from scalemon.options import Parser, int_at_least, number

from .faults import rank_delay, rank_step
from .layout import layout_problem
from .model import PRESETS
from .parallel import COMPILE_SCOPES, DEVICES, OPTIMIZERS, compile_scope
from .pipeline import SCHEDULES, pipeline_problem
from .precision import AMP_MODES
from .tensor_parallel import check_divisible

positive_int = int_at_least(1)  # a job that trains nothing is a mistake to say
non_negative_int = int_at_least(0)


class FlagParser(Parser):
    """scalemon's parser (no abbreviated options, the closest option to an unknown one) whose
    mistakes are said once per node: under torchrun every rank parses the same flags, and only
    local rank 0 prints (every rank exits with code 2). The other ranks wait up to
    `QUIET_RANK_WAIT_S` first: torchrun ends every rank once one exits, and a quiet rank that
    exited first could have local rank 0 ended before it said why."""

    QUIET_RANK_WAIT_S = 10.0

    def error(self, message: str) -> NoReturn:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
            sys.stderr.flush()
        else:
            time.sleep(self.QUIET_RANK_WAIT_S)  # ended sooner by torchrun, once rank 0 said it
        sys.exit(2)


def parse_args(argv: list[str] | None = None, description: str | None = None
               ) -> argparse.Namespace:
    """Command-line flags, grouped by what they control; every value checked here, before
    torch.distributed starts. `description` heads --help (train.py passes its docstring)."""
    p = FlagParser(prog="train.py", description=description,
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
    # the DeviceMesh: world = pp x dp x tp (layout.py); data parallel fills what is left
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor parallel ranks: attention heads and MLP columns split over them")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: LayerNorms and dropout on a slice of the sequence each")
    p.add_argument("--pp", type=positive_int, default=1,
                   help="pipeline stages (consecutive layers each, torch.distributed.pipelining)")
    p.add_argument("--pp-schedule", default="1f1b", choices=SCHEDULES,
                   help="the pipeline schedule (interleaved: 2 virtual stages per rank)")
    p.add_argument("--microbatches", type=positive_int,
                   help="microbatches per --batch-size in the pipeline (default: --pp)")
    # mixture of experts (moe.py): expert parallel ranks are a split of the data parallel ones
    p.add_argument("--experts", type=non_negative_int, default=0,
                   help="experts per MoE MLP (0: the dense MLP)")
    p.add_argument("--ep", type=positive_int, default=1,
                   help="expert parallel ranks: the experts spread over them, tokens sent to "
                        "their expert's rank by all_to_all (divides the data parallel size)")
    p.add_argument("--moe-top-k", type=positive_int, default=2,
                   help="experts each token is routed to (default 2)")
    p.add_argument("--capacity-factor", type=number(0.0, above=True), default=1.25,
                   help="expert capacity = ceil(factor x tokens x top-k / experts) per rank; "
                        "tokens past it are dropped (the residual carries them) and counted")
    p.add_argument("--moe-aux-coef", type=number(0.0), default=0.01,
                   help="weight of the load-balancing loss added to the loss (default 0.01)")
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
    p.add_argument("--inject-freeze", type=rank_step, metavar="RANK:STEP",
                   help="that rank blocks for ever in native code holding the GIL before "
                        "that step\n(first attempt only): no thread of it runs, the "
                        "monitor's included")
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
    for flag in ("inject_hang", "inject_crash", "inject_freeze", "slow_rank",
                 "inject_desync"):
        planted = getattr(args, flag)
        if planted is not None and planted.rank >= world_size:
            return (f"--{flag.replace('_', '-')} {planted} names rank {planted.rank}, and this "
                    f"job has {world_size} rank(s)")
    problem = mesh_conflict(args, world_size) or moe_conflict(args)
    if problem:
        return problem
    try:
        compile_scope(args.compile, sharded=args.zero >= 2 and world_size > 1)
    except ValueError as e:
        return str(e)
    return None


def mesh_conflict(args: argparse.Namespace, world_size: int) -> str | None:
    """What is wrong with the --pp/--tp layout and its combination with the other flags, or
    None; fills in --microbatches (default: --pp)."""
    if args.microbatches is None:
        args.microbatches = args.pp
    elif args.pp == 1:
        return "--microbatches is for a pipeline: it needs --pp 2 or more"
    if args.sequence_parallel and args.tp == 1:
        return "--sequence-parallel needs --tp 2 or more (it splits what tensor parallel repeats)"
    experts, ep = getattr(args, "experts", 0) or 0, getattr(args, "ep", 1) or 1
    problem = layout_problem(world_size, args.pp, args.tp, ep, experts)
    if problem or (args.pp == 1 and args.tp == 1):
        return problem
    config = PRESETS[args.preset]
    block_size = args.block_size or config.block_size
    if args.tp > 1:
        problem = check_divisible(config.n_head, config.n_embd, args.tp)
        if problem:
            return problem
        if args.sequence_parallel and block_size % args.tp:
            return (f"--sequence-parallel splits the {block_size} positions of a sequence "
                    f"over --tp {args.tp} ranks: make --block-size a multiple of {args.tp}")
    if args.pp > 1:
        problem = pipeline_problem(args.pp, args.pp_schedule, args.microbatches,
                                   args.batch_size, args.grad_accum, config.n_layer)
        if problem:
            return problem
    what = " and ".join(f"--{n} {getattr(args, n)}" for n in ("pp", "tp") if getattr(args, n) > 1)
    if experts:
        return f"--experts with {what} is not supported: MoE runs with data parallel ranks"
    if args.zero == 1:
        return (f"--zero 1 with {what} is not supported (ZeroRedundancyOptimizer wants DDP and "
                "plain tensors): use --zero 0, 2 or 3")
    if args.amp == "fp16":
        return (f"--amp fp16 with {what} is not supported (GradScaler would skip steps on some "
                "stages or shards only): use --amp bf16 or off")
    if args.compile:
        return f"--compile with {what} is not supported: leave it out"
    if args.tp > 1 and args.optimizer.startswith("fused"):
        return (f"--optimizer {args.optimizer} needs plain tensors, and --tp makes the sharded "
                "parameters DTensors: use --optimizer torch or torch-fused")
    return None


def moe_conflict(args: argparse.Namespace) -> str | None:
    """What is wrong with the MoE flags and their combination with the others, or None (the
    sizes against the world are layout_problem's)."""
    if not args.experts:
        moe_flags = [f for f, default in (("moe_top_k", 2), ("capacity_factor", 1.25),
                                          ("moe_aux_coef", 0.01)) if getattr(args, f) != default]
        if moe_flags:
            return f"--{moe_flags[0].replace('_', '-')} needs --experts (a MoE model)"
        return None
    if args.moe_top_k > args.experts:
        return (f"--moe-top-k {args.moe_top_k} routes each token to more experts than "
                f"--experts {args.experts}")
    if args.ep > 1 and args.zero:
        return (f"--zero {args.zero} with --ep {args.ep} is not supported (ZeRO and FSDP2 shard "
                "over every data parallel rank, and the experts differ per rank): use --zero 0")
    if args.ep > 1 and args.amp == "fp16":
        return (f"--amp fp16 with --ep {args.ep} is not supported (GradScaler would skip steps on "
                "the ranks whose own experts overflowed only): use --amp bf16 or off")
    if args.ep > 1 and args.compile:
        return f"--compile with --ep {args.ep} is not supported (all_to_all with split sizes)"
    return None
