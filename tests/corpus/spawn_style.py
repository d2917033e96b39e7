"""A job written the way PyTorch's DDP tutorial and the pytorch/examples scripts start theirs
(our own code, their patterns): no torchrun and no SLURM, so no RANK or WORLD_SIZE in the
environment:

- the main process calls `torch.multiprocessing.spawn(fn, args=(world_size,),
  nprocs=world_size)`; each child sets MASTER_ADDR/MASTER_PORT in `os.environ` itself and calls
  `init_process_group("gloo", rank=rank, world_size=world_size)`;
- `init()` after the DDP wrap, so the agent learns the rank from the process group: both
  children are ranks of one job (not two single-process jobs of rank 0 each);
- SGD, `zero_grad()` first, the loss logged as a detached tensor, `finish()`, then
  `destroy_process_group()`.

    python tests/corpus/spawn_style.py
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from corpus_common import Logged, TinyLM, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import scalemon.agent as sm

WORLD_SIZE, STEPS = 2, 5


def setup(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def train(rank: int, world_size: int, port: int) -> None:
    setup(rank, world_size, port)
    model = DDP(TinyLM())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    run = sm.init(model=model, optimizer=optimizer, config={"style": "spawn"})
    logged = Logged()
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        _, loss = model(*batch(step, micro=rank))  # no RANK: batch() reads rank 0
        loss.backward()
        optimizer.step()
        sm.log(step, loss=loss.detach())
        logged.note(step, loss)
    sm.finish()
    logged.report("finished", ("all_reduce",), rank_=rank,
                  job=run.env.job if run is not None else None, parent_pid=os.getppid(),
                  port=port)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(train, args=(WORLD_SIZE, free_port()), nprocs=WORLD_SIZE, join=True)
