"""The demo trainer's command-line flags: the parser, the check of every value and of their
combinations, all before torch.distributed starts (a mistake stops every rank with exit code 2,
said once per node)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NoReturn

from scalemon.options import int_at_least, number

from .faults import rank_delay, rank_step
from .model import PRESETS
from .parallel import COMPILE_SCOPES, DEVICES, OPTIMIZERS, compile_scope
from .precision import AMP_MODES

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
