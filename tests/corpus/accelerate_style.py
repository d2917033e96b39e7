"""A loop written the way Hugging Face accelerate's examples and transformers'
`run_clm_no_trainer.py` are (our own code, their patterns):

- `init()` first, with nothing, even before `init_process_group` (as trackers are started at
  the top of a script), the model built, wrapped in DDP and
  its optimizer and scaler made afterwards, then handed over with `watch_model`,
  `watch_optimizer` and `watch_scaler`;
- gradient accumulation: micro-steps under `model.no_sync()`, the loss divided by their count;
- fp16 on the CPU with an enabled `ShardedGradScaler` (FSDP's scaler: it all-reduces inf
  checks itself), the `scale(loss).backward()` / `step` / `update` dance;
- the optimizer handed to the monitor is the prepared one, as `accelerator.prepare()` returns
  it: a `torch.optim.Optimizer` subclass that never runs `Optimizer.__init__` (no step hooks
  of its own) and keeps the real one in `.optimizer`; the script calls its `step()` and
  `zero_grad()` on every micro-step, and it steps the real one through the scaler (then
  updates the scale) only on the micro-step that syncs gradients;
- AdamW with a no-decay group (biases and LayerNorm weights), a linear warmup `LambdaLR`
  stepped with the optimizer, `optimizer.zero_grad()` with its defaults;
- `completed_steps` counted from 1; the loss given as a Python float (`loss.item()`), no
  `tokens`, extras `lr` (float) and `epoch` (int);
- batches from a `DataLoader` with worker processes (forked while the agent's threads run)
  and a `DistributedSampler` reshuffled each epoch;
- each epoch an eval under `torch.no_grad()` whose predictions are gathered from every rank
  and whose loss is averaged over them (collectives between steps), then `dist.barrier()`
  ("wait for everyone"); `destroy_process_group()`, then `finish()`.

    torchrun --nproc-per-node 2 tests/corpus/accelerate_style.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from corpus_common import BATCH, VOCAB, Logged, TinyLM, batch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import scalemon.agent as sm

EPOCHS, BATCHES, ACCUM, WARMUP = 2, 4, 2, 2


class PreparedOptimizer(torch.optim.Optimizer):
    """What accelerate's `AcceleratedOptimizer` is to the monitor: an Optimizer by type, the
    real one inside, steps skipped while gradients accumulate."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: ShardedGradScaler) -> None:
        self.optimizer = optimizer  # no super().__init__(), as accelerate does
        self.scaler = scaler
        self.sync_gradients = True

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: object = None) -> None:
        if self.sync_gradients:
            self.scaler.step(self.optimizer, closure)
            self.scaler.update()


def main() -> None:
    run = sm.init(config={"style": "accelerate"})
    dist.init_process_group("gloo")
    model = DDP(TinyLM())
    no_decay = ("bias", "0.weight")  # biases and the blocks' LayerNorm weights
    groups = [
        {"params": [p for n, p in model.named_parameters() if not n.endswith(no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n.endswith(no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=5e-3)
    total = EPOCHS * BATCHES // ACCUM
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / WARMUP, max(0.0, (total - s) / (total - WARMUP))))
    scaler = ShardedGradScaler("cpu", init_scale=256.0)
    assert run is not None
    run.watch_model(model)
    prepared = PreparedOptimizer(optimizer, scaler)
    run.watch_optimizer(prepared)
    run.watch_scaler(scaler)
    inputs, targets = batch(0, size=BATCH * BATCHES * dist.get_world_size())
    sampler = DistributedSampler(TensorDataset(inputs, targets), shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=BATCH, sampler=sampler,
                        num_workers=2)
    logged = Logged()
    completed_steps = 0
    for epoch in range(EPOCHS):
        model.train()
        sampler.set_epoch(epoch)
        for i, (inputs, targets) in enumerate(loader):
            sync = prepared.sync_gradients = (i + 1) % ACCUM == 0
            with torch.autocast("cpu", dtype=torch.float16):
                if sync:
                    _, loss = model(inputs, targets)
                    scaler.scale(loss / ACCUM).backward()
                else:
                    with model.no_sync():
                        _, loss = model(inputs, targets)
                        scaler.scale(loss / ACCUM).backward()
            prepared.step()
            prepared.zero_grad()
            if not sync:
                continue
            scheduler.step()
            completed_steps += 1
            lr = scheduler.get_last_lr()[0]
            sm.log(completed_steps, loss.item(), lr=lr, epoch=epoch)
            logged.note(completed_steps, loss.item(), lr=lr, epoch=epoch)
        model.eval()
        correct = torch.zeros(())
        eval_loss = torch.zeros(())
        for k in range(2):
            inputs, targets = batch(1000 + k)
            with torch.no_grad():
                logits, loss = model(inputs, targets)
            predictions = logits.argmax(dim=-1).contiguous()
            gathered = torch.empty(dist.get_world_size() * predictions.numel(),
                                   dtype=predictions.dtype)
            dist.all_gather_into_tensor(gathered, predictions.reshape(-1))
            everyone = torch.empty_like(gathered)
            dist.all_gather_into_tensor(everyone, targets.contiguous().reshape(-1))
            correct += (gathered == everyone).sum()
            eval_loss += loss
        dist.all_reduce(eval_loss, op=dist.ReduceOp.AVG)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: eval loss {float(eval_loss) / 2:.4f}, "
                  f"accuracy {float(correct) / gathered.numel() / 2:.3f} of {VOCAB} classes")
    dist.barrier()
    logged.report("finished", ("all_reduce", "all_gather", "barrier"), scaler="on",
                  loss_scale=scaler.get_scale(), optimizer_timed=True)
    dist.destroy_process_group()
    sm.finish()


if __name__ == "__main__":
    main()
