"""A loop written the way PyTorch Lightning's automatic optimization runs a LightningModule
(our own code, its patterns):

- the script never calls backward itself: the optimizer is stepped with a closure,
  `optimizer.step(closure=closure)`, and the step calls it first, so forward, zero_grad and
  backward (each rank's gradient all-reduce included) run inside `optimizer.step()`, and the
  gradients are clipped at the closure's end (Lightning clips in the closure it hands the
  step), before the update; the closure's forward here takes
  `FORWARD_S` more (a heavy model), which must not be counted as the optimizer's time;
- bf16-mixed: `torch.autocast("cpu", dtype=torch.bfloat16)` around the training step, no
  scaler (`init()` gets none);
- `init()` from a callback's `on_train_start`, after the strategy wrapped the model in DDP;
  `log()` from `on_train_batch_end` with `trainer.global_step` (1 after the first step) and
  the step's output loss, detached; an LR scheduler stepped every step (`interval="step"`);
- a validation pass at each epoch's end under `torch.no_grad()` / `eval()`, its loss
  all-reduced as `self.log(..., sync_dist=True)` does; `finish()` in `on_train_end`.

    torchrun --nproc-per-node 2 tests/corpus/lightning_style.py
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from corpus_common import Logged, TinyLM, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import scalemon.agent as sm

EPOCHS, BATCHES, FORWARD_S = 2, 3, 0.15


class Trainer:
    """The parts of Lightning's fit loop that decide what the monitor sees."""

    def __init__(self) -> None:
        self.global_step = 0
        self.logged = Logged()

    def on_train_start(self, model: DDP, optimizer: torch.optim.Optimizer) -> None:
        sm.init(model=model, optimizer=optimizer, config={"style": "lightning"})

    def on_train_batch_end(self, loss: torch.Tensor, lr: float) -> None:
        sm.log(self.global_step, loss=loss, lr=lr)
        self.logged.note(self.global_step, loss, lr=lr)

    def fit(self) -> None:
        model = DDP(TinyLM())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        self.on_train_start(model, optimizer)
        for epoch in range(EPOCHS):
            model.train()
            for i in range(BATCHES):
                inputs, targets = batch(epoch * BATCHES + i)
                output: dict[str, torch.Tensor] = {}
                closure = self.closure(model, optimizer, inputs, targets, output)
                optimizer.step(closure=closure)  # runs the closure, clips, then updates
                self.global_step += 1
                scheduler.step()
                self.on_train_batch_end(output["loss"], scheduler.get_last_lr()[0])
            self.validate(model)
        sm.finish()

    def closure(self, model: DDP, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                targets: torch.Tensor, output: dict[str, torch.Tensor]) -> Callable[[], Any]:
        def step_and_backward() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(inputs, targets)
            time.sleep(FORWARD_S)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            output["loss"] = loss.detach()
            return loss

        return step_and_backward

    @torch.no_grad()
    def validate(self, model: DDP) -> None:
        model.eval()
        _, loss = model(*batch(1000))
        dist.all_reduce(loss)
        model.train()


def main() -> None:
    dist.init_process_group("gloo")
    trainer = Trainer()
    trainer.fit()
    trainer.logged.report("finished", ("all_reduce",), forward_s=FORWARD_S)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
