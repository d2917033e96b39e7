"""A monitored gloo job that hangs in a known way, for the hang root-cause tests.

    torchrun --nproc-per-node 3 tests/jobs/hang_scenarios.py SCENARIO OUT_DIR

Every rank runs `WARMUP` steps of collectives (each step logged), then at step `HANG_STEP`:

- default:  rank 1 stays in Python (`stall_in_python`) before the default group's all_reduce.
- chain:    groups default and user_pg {0,1}; each step ranks 0,1 all_gather in user_pg, then
            every rank all_reduces in the default group. Rank 1 stays in Python before the
            all_gather: rank 0 waits for it in user_pg, rank 2 in the default group.
- disjoint: 4 ranks, pair_a {0,1} and pair_b {2,3}; ranks 1 and 3 stay in Python before their
            pair's all_reduce: each pair has its own culprit.
- dead:     rank 1's process ends (`os._exit`) before the default all_reduce; a forked child
            keeps its sockets open, so the others wait instead of failing (as on NCCL, where
            nothing tells the peers). The child's pid is written to OUT_DIR/child.pid.
- desync:   rank 2 issues an all_gather where the others issue an all_reduce.
- teardown: ranks 0,1 finish (`scalemon.agent.finish`) and go on with work of their own,
            rank 2 waits in a final barrier only it calls.
- pipeline: a 3-stage send/recv pipeline (stage r = rank r, each step stage 0 sends to 1, 1
            receives and sends to 2, then an all_reduce of the default group): stage 0 stays
            in Python before its send: rank 1 waits in recv from 0, rank 2 in recv from 1.
- mesh_tp:  4 ranks on a 2x2 DeviceMesh (dp, tp): each step a tp all_reduce, then a dp one;
            rank 3 stays in Python before its tp all_reduce: rank 2 waits for it in tp [2,3],
            ranks 0,1 for rank 2 (and 3) in their dp groups.

Each rank prints "rank R: SCENARIO at step S" when it reaches the fault; stalls are bounded
(`STALL_S`) so that a forgotten job ends by itself.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import scalemon.agent as sm

WARMUP = 6
HANG_STEP = WARMUP + 1
STALL_S = 300.0
SCENARIOS = ("default", "chain", "disjoint", "dead", "desync", "teardown", "pipeline",
             "mesh_tp")


def stall_in_python() -> None:
    """Where a stalled rank sits: plain Python, in no collective."""
    time.sleep(STALL_S)


def keep_sockets_and_exit(out: Path) -> None:
    """End this process without its peers noticing: a child keeps its sockets open. First it
    waits (bounded) until the hub answers this rank's agent: on a loaded machine rank 0's hub
    can start after this rank's first steps, and what a process queued for a hub that is not
    there yet dies with it, so the hub would never learn of this rank and its pid."""
    deadline = time.monotonic() + 60.0
    sender = sm._run.sender if sm._run is not None else None
    while sender is not None and sender.clock_offset_s is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # the queued step messages go out behind the answered requests
    child = os.fork()
    if child == 0:
        time.sleep(STALL_S / 2)
        os._exit(0)
    (out / "child.pid").write_text(str(child))
    os._exit(0)


def step_collectives(scenario: str, rank: int, world: int, groups: dict, fault: bool,
                     out: Path) -> None:
    """One step's collectives, with the scenario's fault at `fault`."""
    x = torch.ones(256)
    if scenario == "chain":
        if rank in (0, 1):
            if fault and rank == 1:
                stall_in_python()
            dist.all_gather(list(torch.empty(512).chunk(2)), x, group=groups["user"])
        dist.all_reduce(x)
    elif scenario == "disjoint":
        pair = groups["a"] if rank < 2 else groups["b"]
        if fault and rank in (1, 3):
            stall_in_python()
        dist.all_reduce(x, group=pair)
        dist.all_reduce(x)
    elif scenario == "pipeline":
        if rank > 0:
            dist.recv(x, rank - 1)
        if fault and rank == 0:
            stall_in_python()
        if rank < world - 1:
            dist.send(x, rank + 1)
        dist.all_reduce(x)
    elif scenario == "mesh_tp":
        if fault and rank == 3:
            stall_in_python()
        dist.all_reduce(x, group=groups["mesh"]["tp"].get_group())
        dist.all_reduce(x, group=groups["mesh"]["dp"].get_group())
    elif scenario == "desync" and fault and rank == 2:
        dist.all_gather(list(torch.empty(256 * world).chunk(world)), x)
    else:
        if fault and scenario == "default" and rank == 1:
            stall_in_python()
        if fault and scenario == "dead" and rank == 1:
            keep_sockets_and_exit(out)
        dist.all_reduce(x)


def main() -> int:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    if scenario not in SCENARIOS:
        print(f"hang_scenarios.py: unknown scenario {scenario!r}; one of {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {}
    if scenario == "chain":
        groups["user"] = dist.new_group([0, 1], group_desc="user_pg")
    if scenario == "disjoint":
        groups["a"] = dist.new_group([0, 1], group_desc="pair_a")
        groups["b"] = dist.new_group([2, 3], group_desc="pair_b")
    if scenario == "mesh_tp":
        from torch.distributed.device_mesh import init_device_mesh

        groups["mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sm.init(config={"job": f"hang_{scenario}"})
    for step in range(1, HANG_STEP + 1):
        fault = step == HANG_STEP
        if fault:
            print(f"rank {rank}: {scenario} at step {step}", flush=True)
        if fault and scenario == "teardown":
            break
        step_collectives(scenario, rank, world, groups, fault, out)
        sm.log(step=step, loss=1.0 / step)
        time.sleep(0.3)
    if scenario == "teardown":
        if rank == 2:
            dist.barrier()  # a final barrier only this rank calls
        else:
            sm.finish()
            stall_in_python()  # work of its own after training: no collectives
    stall_in_python()
    return 0


if __name__ == "__main__":
    sys.exit(main())
