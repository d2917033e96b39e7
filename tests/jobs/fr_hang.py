"""A monitored gloo job that hangs on purpose, for `scalemon dump`.

    torchrun --nproc-per-node 2 tests/jobs/fr_hang.py OUT_DIR pair
    torchrun --nproc-per-node 3 tests/jobs/fr_hang.py OUT_DIR subgroup

pair: each step one all_reduce in the default group; before step HANG_STEP's, the last rank
sleeps in Python and the others wait in it.
subgroup: each step an all_reduce in the default group, then one in the group "pair" of ranks
1 and 2; at step HANG_STEP rank 2 sleeps before the pair's: rank 1 waits in the pair's
all_reduce, rank 0 in the default group's of the next step.

Each rank writes OUT_DIR/rank<r>.json ({"default": n, "pair": n}: the collectives it issued in
each group) before it blocks or sleeps.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import scalemon.agent as sm

HANG_STEP = 4


def main() -> int:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([1, 2], group_desc="pair") if mode == "subgroup" else None
    sm.init(config={"job": "fr_hang"})
    issued = {"default": 0, "pair": 0}

    def all_reduce(key: str, tensor: torch.Tensor, group: object = None) -> None:
        issued[key] += 1
        (out / f"rank{rank}.json").write_text(json.dumps(issued))  # the one it may block in
        dist.all_reduce(tensor, group=group)

    def hang() -> None:
        (out / f"rank{rank}.json").write_text(json.dumps(issued))
        (out / f"rank{rank}.sleeping").touch()
        time.sleep(3600)  # the culprit: in Python, never issuing what the others wait in

    for step in range(1, 1000):
        if mode == "pair" and step == HANG_STEP and rank == world - 1:
            hang()
        all_reduce("default", torch.ones(64))
        if pair is not None and rank in (1, 2):
            if step == HANG_STEP and rank == 2:
                hang()
            all_reduce("pair", torch.ones(8, 2), pair)
        sm.log(step=step, loss=1.0 / step)
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
