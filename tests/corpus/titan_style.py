"""A loop written the way torchtitan's train.py is (our own code, its patterns):

- the run's configuration a dataclass (`asdict` of it: a path, a dtype, a tuple inside) given
  to `init(config=...)`;
- `init(model=...)` before the model is sharded: each block compiled (`torch.compile`, the
  `aot_eager` backend here to keep CI fast) and wrapped with FSDP2 `fully_shard`, then the
  root; the optimizer made after `init()` and handed over with `watch_optimizer`;
- `step` counted from 0 and raised at the top of each iteration; micro-batch losses detached,
  stacked and summed into a 0-dim tensor; `clip_grad_norm_` over DTensor parameters, which
  returns a DTensor; a warmup `LambdaLR`;
- metrics only every `LOG_FREQ` steps (and at step 1): the loss averaged over the ranks with an
  all-reduce first (a collective on the logging path), the grad norm passed to `log()` as the
  DTensor itself (the agent must read it without a collective) and as `full_tensor()`;
- no scaler (bf16 runs need none); no `finish()`: `destroy_process_group()` and the process
  simply ends, as torchtitan's does.

    torchrun --nproc-per-node 2 tests/corpus/titan_style.py
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from corpus_common import Logged, TinyLM, batch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import scalemon.agent as sm

STEPS, ACCUM, LOG_FREQ = 5, 2, 2


@dataclass
class Training:
    steps: int = STEPS
    dump_folder: Path = Path("./outputs")
    mixed_precision_param: torch.dtype = torch.bfloat16
    betas: tuple[float, float] = (0.9, 0.95)


@dataclass
class JobConfig:
    training: Training = field(default_factory=Training)


def main() -> None:
    dist.init_process_group("gloo")
    model = TinyLM(blocks=2)
    run = sm.init(model=model, config={"style": "torchtitan", **asdict(JobConfig())})
    # torchtitan builds its mesh with the device type it trains on: here the CPU (the default
    # mesh would be cuda wherever a GPU is seen, wrong for gloo ranks sharing one GPU)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="aot_eager")
        fully_shard(model.blocks[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 2))
    assert run is not None
    run.watch_optimizer(optimizer)
    logged = Logged()
    step = 0
    while step < STEPS:
        step += 1
        optimizer.zero_grad()
        losses = []
        for micro in range(ACCUM):
            _, loss = model(*batch(step, micro))
            (loss / ACCUM).backward()
            losses.append(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        scheduler.step()
        loss = torch.sum(torch.stack(losses)) / ACCUM
        if step == 1 or step % LOG_FREQ == 0:
            global_avg = loss.clone()
            dist.all_reduce(global_avg, op=dist.ReduceOp.AVG)
            norm = grad_norm.full_tensor()
            sm.log(step, global_avg, grad_norm=norm, grad_norm_dtensor=grad_norm)
            logged.note(step, global_avg, grad_norm=float(norm))
    logged.report("exited", ("all_gather", "all_reduce"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
