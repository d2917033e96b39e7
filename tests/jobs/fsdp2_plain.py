"""A plain FSDP2 job, monitored: `fully_shard` on each of `--layers` Linear layers and on the
root, `--steps` steps, gloo ranks on the CPU (issue #37: its collectives counted exactly).

    torchrun --nproc-per-node 2 tests/jobs/fsdp2_plain.py [--layers 4] [--steps 30]

Each step's backward reduce-scatters every layer's gradients once (FSDP2's `foreach_reduce`
calls `dist.reduce_scatter_tensor`): `layers x steps` reduce-scatters per rank in all, which
is what the monitor must count. The script calls `scalemon.agent` as a user's does: init after
the process group, log every step, finish at the end.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import scalemon.agent as sm

WIDTH = 64


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(args.layers)))
    # a CPU mesh, named: fully_shard's default mesh is on cuda wherever a GPU is seen, and two
    # gloo ranks on a one-GPU machine then fail with "invalid device ordinal"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    # the root: no parameters of its own, so no collectives of its own
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sm.init(model=model, optimizer=optimizer, config={"job": "fsdp2_plain"})
    for step in range(1, args.steps + 1):
        loss = model(torch.randn(16, WIDTH)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sm.log(step=step, loss=loss.detach())
    sm.finish()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
