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
    # a mixture of experts: 4 experts per MLP, two on each rank (all_to_all dispatch)
    torchrun --nproc-per-node 2 -- demo_train/train.py --experts 4 --ep 2 --max-steps 50
    # pipeline x tensor parallel on one DeviceMesh (pp 2 x dp 1 x tp 2); data parallel fills
    # the rest of the world (8 ranks: dp 2); the losses are those of one rank
    torchrun --nproc-per-node 4 -- demo_train/train.py --pp 2 --tp 2 --sequence-parallel \\
        --pp-schedule 1f1b --microbatches 4
    # GPT-2 (124M) shapes on one GPU, bf16 and torch.compile
    python demo_train/train.py --preset gpt2-124m --amp bf16 --compile --batch-size 8

Rank 0 prints `step N loss X` for every logged step (--log-every: every step on CPU, every 10th
on CUDA, where reading the loss waits for the GPU). With --monitor every rank streams its own
loss (every step, without waiting for the GPU), its tokens (scalemon shows tokens/s: tokens
over the wall time between step ends) and MFU (measured between logged steps, where the GPU's
peak is known), timings, memory and the memory estimate to the job's scalemon hub. The flags
are documented large-scale training techniques; each lives in a module:
precision.py (--amp), parallel.py (--zero, --optimizer, --compile, --grad-accum's no_sync),
layout.py, parallel3d.py, pipeline.py and tensor_parallel.py (--pp, --tp, the mesh),
checkpoint.py (--ckpt-*), memory.py (the estimate), faults.py (--inject-*), moe.py
(--experts, --ep).

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
import os
import sys
import time

import torch.distributed as dist

from scalemon.demo_train import train_flags
from scalemon.demo_train.checkpoint import CheckpointError, IncompatibleCheckpoint, NoCheckpoint
from scalemon.demo_train.parallel import DeviceChoiceError, DistEnv, setup_distributed
from scalemon.demo_train.train_flags import FlagParser
from scalemon.demo_train.train_loop import train
from scalemon.demo_train.train_setup import build

# the trainer in parts: train_flags.py its flags; train_setup.py builds the Trainer (model,
# parallelism, optimizer, checkpoints, monitor); train_loop.py runs it; train_stats.py measures
CANNOT_RESUME = 1  # exit code: --resume found nothing usable, or an incompatible checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command-line flags (train_flags.py), with this module's docstring heading --help."""
    return train_flags.parse_args(argv, description=__doc__)


def say_cannot_resume(env: DistEnv, exc: CheckpointError | IncompatibleCheckpoint) -> None:
    """Rank 0 says in one line why the run cannot resume (every rank has the same reason:
    the ranks decided together), then the ranks leave together."""
    if env.rank == 0:
        hint = ("; to start from step 0 instead, pass --resume-or-start"
                if isinstance(exc, NoCheckpoint) else "")
        print(f"train.py: cannot resume: {exc}{hint}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.barrier()  # nobody exits (and has torchrun stop the others) before it is said


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
