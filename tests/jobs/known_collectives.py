"""A job that issues collectives of known sizes, monitored, and writes what it measured.

    torchrun --nproc-per-node 2 tests/jobs/known_collectives.py OUT_DIR

Default group: 10 all_reduce of 64 KiB, 5 of 1 MiB (float32), 3 all_gather_into_tensor of
16 KiB per rank; a second group made with `new_group(group_desc="user_pg")`: 4 all_reduce of
256 KiB. Each rank times its own synchronous calls and writes them to OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import scalemon.agent as sm

PLAN = [  # (group, op, float32 elements per rank, times)
    ("default", "all_reduce", 16 * 1024, 10),
    ("default", "all_reduce", 256 * 1024, 5),
    ("default", "all_gather", 4 * 1024, 3),
    ("user", "all_reduce", 64 * 1024, 4),
]


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    user = dist.new_group(list(range(world)), group_desc="user_pg")
    sm.init(config={"job": "known_collectives"})
    measured: dict[str, list[float]] = {}
    for group_name, op, numel, times in PLAN:
        group = user if group_name == "user" else None
        for _ in range(times):
            x = torch.ones(numel)
            t0 = time.perf_counter()
            if op == "all_reduce":
                dist.all_reduce(x, group=group)
            else:
                dist.all_gather_into_tensor(torch.empty(numel * world), x, group=group)
            measured.setdefault(f"{group_name}:{op}:{numel}", []).append(
                time.perf_counter() - t0)
            sm.log(step=sum(len(v) for v in measured.values()))
    (out / f"rank{rank}.json").write_text(json.dumps(measured))
    sm.finish()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
