"""A training-like loop whose all-reduces are the script's own (no DDP, no comm hook), monitored.

    torchrun --nproc-per-node N tests/jobs/step_allreduces.py [--backend gloo|nccl] [--steps S]

Per step: `PER_STEP` all_reduce of 64 KiB and one all_gather (not an all-reduce: not counted
in the step's all-reduces), then `log(step)`. On NCCL the tensors are on the rank's GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import scalemon.agent as sm

PER_STEP = 3
NUMEL = 16 * 1024


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--init-first", action="store_true",
                   help="call sm.init() before init_process_group (as Accelerate does)")
    p.add_argument("--pretend-cuda", action="store_true",
                   help="torch.cuda.is_available() says True: a CPU job on a GPU machine")
    args = p.parse_args()
    if args.pretend_cuda:
        torch.cuda.is_available = lambda: True
    if args.init_first:
        sm.init(config={"job": "step_allreduces"})
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    world = dist.get_world_size()
    if not args.init_first:
        sm.init(config={"job": "step_allreduces"})
    for step in range(1, args.steps + 1):
        for _ in range(PER_STEP):
            x = torch.ones(NUMEL, device=device)
            dist.all_reduce(x)
        dist.all_gather_into_tensor(torch.empty(NUMEL * world, device=device),
                                    torch.ones(NUMEL, device=device))
        time.sleep(0.05)
        sm.log(step=step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        time.sleep(2.0)  # NCCL's watchdog marks the last collectives completed
    sm.finish()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
