"""A loop written the way nanoGPT's train.py is (our own code, its patterns):

- one loop for fp16/bf16/fp32: `GradScaler(enabled=dtype == "float16")`, here bf16, so the
  scaler is disabled (rank 0: `torch.amp.GradScaler`, rank 1: the old `torch.cuda.amp` one)
  and passed to `init(scaler=...)` all the same;
- `torch.autocast(device_type=..., dtype=..., enabled=...)`;
- gradient accumulation by setting DDP's `require_backward_grad_sync` on the last micro-step,
  the loss divided by the micro-steps; `scaler.scale(loss).backward()`, `scaler.unscale_` and
  `clip_grad_norm_`, `scaler.step`, `scaler.update`, `zero_grad(set_to_none=True)`;
- two param groups (decayed and not), the learning rate set by hand in every group each step;
- `iter_num` starting at 0; `loss.item()` read only every `log_interval` iterations;
- an eval under `torch.no_grad()` / `model.eval()` on the master process only, between steps;
- `init()` after the DDP wrap; `destroy_process_group()` at the end, no `finish()`.

    torchrun --nproc-per-node 2 tests/corpus/nanogpt_style.py
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
from corpus_common import Logged, TinyLM, batch
from torch.nn.parallel import DistributedDataParallel as DDP

import scalemon.agent as sm

MAX_ITERS, ACCUM, LOG_INTERVAL, EVAL_INTERVAL, LR = 6, 2, 2, 3, 1e-2


def get_lr(it: int) -> float:
    return LR * 0.5 * (1.0 + math.cos(math.pi * it / MAX_ITERS))


@torch.no_grad()
def estimate_loss(model: torch.nn.Module, ctx: torch.autocast) -> float:
    model.eval()
    losses = torch.zeros(2)
    for k in range(2):
        with ctx:
            _, loss = model(*batch(1000, k))
        losses[k] = loss.item()
    model.train()
    return float(losses.mean())


def main() -> None:
    dist.init_process_group("gloo")
    master = dist.get_rank() == 0
    dtype = "bfloat16"
    ctx = torch.autocast(device_type="cpu", dtype=torch.bfloat16, enabled=dtype != "float32")
    if master:
        scaler = torch.amp.GradScaler(enabled=(dtype == "float16"))
    else:
        with warnings.catch_warnings():  # torch.cuda.amp.GradScaler is deprecated
            warnings.simplefilter("ignore")
            scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))
    model = TinyLM()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    model = DDP(model)
    sm.init(model=model, optimizer=optimizer, scaler=scaler, config={"style": "nanogpt"})
    logged = Logged()
    iter_num = 0
    while True:
        lr = get_lr(iter_num)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % EVAL_INTERVAL == 0 and master:
            print(f"step {iter_num}: val loss {estimate_loss(model, ctx):.4f}")
        for micro in range(ACCUM):
            model.require_backward_grad_sync = micro == ACCUM - 1
            with ctx:
                _, loss = model(*batch(iter_num, micro))
                loss = loss / ACCUM
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step_loss = loss.detach() * ACCUM  # a 0-dim tensor: log() never syncs it
        sm.log(step=iter_num, loss=step_loss, lr=lr)
        logged.note(iter_num, step_loss, lr=lr)
        if iter_num % LOG_INTERVAL == 0 and master:
            print(f"iter {iter_num}: loss {loss.item() * ACCUM:.4f}")
        iter_num += 1
        if iter_num > MAX_ITERS:
            break
    logged.report("exited", ("all_reduce",), scaler="off")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
