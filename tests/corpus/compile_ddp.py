"""`torch.compile` and DDP, in both orders scripts use, with several optimizers:

- `outer`: `torch.compile(DDP(model))` (DDP's graph split at bucket boundaries by dynamo),
  `init(model=...)` given that; `inner`: `DDP(torch.compile(model, fullgraph=True))`, as
  nanoGPT does, with `init(model=...)` given the bare model before both (its forward hook is
  then traced into the compiled graph, which must neither break nor fail);
- two optimizers stepped one after the other (the body with AdamW, the head with SGD, as
  scripts pairing Muon with Adam do), each with its own scheduler (cosine, step), both
  watched (`init(optimizer=...)`, then `watch_optimizer`);
- the loss a 0-dim tensor, `tokens` an int, steps from 1; `dist.barrier()` every step (a
  collective outside DDP); `finish()` at the end.

    torchrun --nproc-per-node 2 tests/corpus/compile_ddp.py outer|inner
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from corpus_common import BATCH, SEQ, Logged, TinyLM, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import scalemon.agent as sm

STEPS = 4


def main() -> None:
    order = sys.argv[1]
    dist.init_process_group("gloo")
    raw = TinyLM()
    head = list(raw.head.parameters())
    body = [p for p in raw.parameters() if all(p is not h for h in head)]
    opt_body = torch.optim.AdamW(body, lr=1e-2)
    opt_head = torch.optim.SGD(head, lr=0.1, momentum=0.9)
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(opt_body, STEPS),
                  torch.optim.lr_scheduler.StepLR(opt_head, step_size=2, gamma=0.5)]
    config = {"style": f"compile-{order}"}
    if order == "outer":
        model = torch.compile(DDP(raw), backend="aot_eager")
        run = sm.init(model=model, optimizer=opt_body, config=config)
    else:
        run = sm.init(model=raw, optimizer=opt_body, config=config)
        model = DDP(torch.compile(raw, backend="aot_eager", fullgraph=True))
    assert run is not None
    run.watch_optimizer(opt_head)
    logged = Logged()
    for step in range(1, STEPS + 1):
        _, loss = model(*batch(step))
        loss.backward()
        for opt in (opt_body, opt_head):
            opt.step()
        for opt in (opt_body, opt_head):
            opt.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()
        dist.barrier()
        sm.log(step, loss.detach(), tokens=BATCH * SEQ)
        logged.note(step, loss)
    logged.report("finished", ("all_reduce", "barrier"), tokens=BATCH * SEQ)
    sm.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
