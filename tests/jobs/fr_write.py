"""Writes each rank's Flight Recorder as torch does, no monitor: known collectives, then the
dumps (pickle and JSON), for the parser's tests.

    torchrun --nproc-per-node 2 tests/jobs/fr_write.py OUT_DIR

Default group: 3 all_reduce of [4, 3] float32, 1 all_gather_into_tensor, 1 broadcast of [5]
int64, a send/recv pair (rank 0 to 1); group "side" (new_group, both ranks): 2 all_reduce of
[2] float32; then a barrier. Writes OUT_DIR/pickle/rank_<r> (`_dump_fr_trace`) and
OUT_DIR/json/rank_<r> (`_dump_fr_trace_json`), without stack traces.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist


def main() -> int:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side = dist.new_group([0, 1], group_desc="side")
    for _ in range(3):
        dist.all_reduce(torch.ones(4, 3))
    dist.all_gather_into_tensor(torch.empty(8, 3), torch.ones(4, 3))
    dist.broadcast(torch.arange(5), src=0)
    if rank == 0:
        dist.send(torch.ones(2), dst=1)
    else:
        dist.recv(torch.empty(2), src=0)
    for _ in range(2):
        dist.all_reduce(torch.ones(2), group=side)
    dist.barrier()
    time.sleep(1.0)  # gloo counts a collective completed a moment after it returned
    # no stack traces in the pickle (torch's default includes them): on a machine with CUDA
    # (H100, torch 2.11) a gloo job whose generic ring was read with them died with SIGSEGV at
    # interpreter exit, every run (issue #25, agent/recorder.py); the JSON dump has no option
    pickled = functools.partial(c10d._dump_fr_trace, includeStackTraces=False)
    for kind, dump in (("pickle", pickled), ("json", c10d._dump_fr_trace_json)):
        (out / kind).mkdir(parents=True, exist_ok=True)
        data = dump(includeCollectives=True, onlyActive=False)
        (out / kind / f"rank_{rank}").write_bytes(data if isinstance(data, bytes) else
                                                  data.encode())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
