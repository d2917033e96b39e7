"""A monitored job whose loss turns NaN at a known step, then waits to be looked at.

    torchrun --nproc-per-node 2 tests/jobs/nan_loss.py NAN_STEP RELEASE_FILE

Every rank all-reduces a tensor and logs a finite loss each step; from step NAN_STEP on, rank
1's loss is NaN (what an fp32 run whose weights went NaN logs). After logging NAN_STEP both
ranks wait (at most 120 s) until RELEASE_FILE exists, so a test can look at the job right after
the step, then they finish.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import scalemon.agent as sm


def main() -> int:
    nan_step, release = int(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sm.init(config={"job": "nan_loss"})
    for step in range(1, nan_step + 1):
        x = torch.ones(1024)
        dist.all_reduce(x)
        loss = math.nan if rank == 1 and step >= nan_step else 3.0 / step
        sm.log(step=step, loss=loss)
        time.sleep(0.05)
    deadline = time.monotonic() + 120.0
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.barrier()
    sm.finish()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
