"""Not a training pattern: a run whose agent fails inside, on rank 1 only, to see that the
monitor says so instead of switching itself off silently. After `BREAK_AFTER` steps the test
breaks one of the agent's own parts on rank 1 (its optimizer span timer), so the next `log()`
raises inside the agent; training goes on to the end and finishes.

    torchrun --nproc-per-node 2 tests/corpus/agent_fault.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from corpus_common import Logged, TinyLM, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import scalemon.agent as sm

STEPS, BREAK_AFTER = 6, 3


def main() -> None:
    dist.init_process_group("gloo")
    model = DDP(TinyLM())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = sm.init(model=model, optimizer=optimizer, config={"style": "agent-fault"})
    assert run is not None
    broken = dist.get_rank() == 1
    logged = Logged()
    for step in range(1, STEPS + 1):
        _, loss = model(*batch(step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if broken and step == BREAK_AFTER + 1:
            run._opt_timer = None  # an internal error of the agent, forced
        sm.log(step, loss.detach())
        if not (broken and step > BREAK_AFTER):
            logged.note(step, loss)
    logged.report("finished", ("all_reduce",), monitor_off=broken)
    sm.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
