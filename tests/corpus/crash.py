"""A loop that crashes: every rank raises at the same step (a bad batch), uncaught.

- `init(model=...)` with the bare model, before it is wrapped in DDP (the pre-hook then fires
  inside DDP's forward); plain SGD, `zero_grad(set_to_none=True)`;
- the loss a 0-dim tensor, no `tokens`, steps from 1; `main` under torch elastic's `@record`
  (which writes the error file and re-raises, as torchtitan's does); no `finish()`: the
  exception ends the process, and the agent reports it.

    torchrun --nproc-per-node 2 tests/corpus/crash.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from corpus_common import Logged, TinyLM, batch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

import scalemon.agent as sm

CRASH_AT = 4
MESSAGE = "corpus: batch 4 holds token ids out of range"


@record
def main() -> None:
    dist.init_process_group("gloo")
    raw = TinyLM()
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1)
    sm.init(model=raw, optimizer=optimizer, config={"style": "crash"})
    model = DDP(raw)
    logged = Logged()
    for step in range(1, 10):
        if step == CRASH_AT:
            logged.report("exited", ("all_reduce",), error=MESSAGE)
            raise ValueError(MESSAGE)
        _, loss = model(*batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sm.log(step, loss.detach())
        logged.note(step, loss)


if __name__ == "__main__":
    main()
