"""One process, no torchrun and no `init_process_group` (a notebook, a quick debug run), with
fp16 autocast on the CPU and an enabled `torch.amp.GradScaler("cpu")` whose scale grows while
it runs, the way mixed-precision examples write it:

- `scaler.scale(loss).backward()`, `unscale_` + `clip_grad_norm_`, `step`, `update`;
- `log()` called only every `LOG_EVERY` steps, the step given as a 0-dim tensor, the loss as a
  one-element tensor (shape [1]), `tokens` as a NumPy integer, and extras as tensors (the
  learning rate, the grad norm `clip_grad_norm_` returns);
- an LR scheduler (`OneCycleLR`); `finish()` at the end.

    python tests/corpus/single_process.py
"""

from __future__ import annotations

import numpy as np
import torch
from corpus_common import BATCH, SEQ, Logged, TinyLM, batch

import scalemon.agent as sm

STEPS, LOG_EVERY = 8, 2


def main() -> None:
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=STEPS)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    sm.init(model=model, optimizer=optimizer, scaler=scaler, config={"style": "single"})
    logged = Logged()
    for step in range(1, STEPS + 1):
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            _, loss = model(*batch(step))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            lr = torch.tensor(scheduler.get_last_lr()[0])
            sm.log(step=torch.tensor(step), loss=loss.detach().reshape(1),
                   tokens=np.int64(BATCH * SEQ), lr=lr, grad_norm=grad_norm)
            logged.note(step, loss, lr=float(lr), grad_norm=float(grad_norm))
    logged.report("finished", scaler="on",
                  loss_scale=scaler.get_scale(), tokens=BATCH * SEQ)
    sm.finish()


if __name__ == "__main__":
    main()
