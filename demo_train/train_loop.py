"""The demo trainer's loop: one step (forward and backward over the micro-batches, the
optimizer step through the loss scaler), the host reads on logged steps, the periodic and
SIGTERM checkpoints; it runs a `Trainer` that train_setup.py built."""

from __future__ import annotations

import time
from typing import Any

import torch

from scalemon import throughput

from .checkpoint import TermSignal
from .moe import sync_expert_grads
from .parallel import any_rank, gradient_sync
from .precision import autocast
from .train_setup import Trainer, print0
from .train_stats import SyncClock, finish


def forward_backward(t: Trainer, step: int) -> torch.Tensor | None:
    """Gradients of one step's batch, over --grad-accum micro-batches with the gradient
    all-reduce on the last only; returns the step's mean loss (detached), None on a pipeline
    rank without the last stage."""
    device, accum = t.env.device, t.args.grad_accum
    x, y = t.data.next_batch()  # batch_size * grad_accum sequences, cut into micro-batches
    if device.type == "cuda":  # from pinned memory the copies below do not wait for the GPU
        x, y = x.pin_memory(), y.pin_memory()
    if t.placed is not None and t.placed.pipeline is not None:
        return pipeline_forward_backward(t, x.to(device, non_blocking=True),
                                         y.to(device, non_blocking=True))
    total = torch.zeros((), device=device)
    for i, (xb, yb) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
        last = i == accum - 1
        with gradient_sync(t.module, enabled=last):
            if t.moe is not None:
                t.moe.begin()
            with autocast(t.amp, device):
                _, loss = t.module(xb.to(device, non_blocking=True),
                                   yb.to(device, non_blocking=True))
            if t.moe is not None:
                t.moe.end()
            loss = loss / accum
            scaled = t.scaler.scale(loss) if t.scaler is not None else loss
            if last:
                scaled = t.faults.overflow(step, scaled)
                t.faults.before_backward()
            scaled.backward()
        total += loss.detach()
    if t.mesh is not None and t.layout.ep > 1:  # the experts DDP left out (moe.py)
        sync_expert_grads(t.model, t.mesh.group("dp_rest"), t.layout.dp)
    if t.placed is not None:  # tp with data parallel: the dp all-reduce (FSDP2 did it)
        t.placed.sync_grads()
    return total


def pipeline_forward_backward(t: Trainer, x: torch.Tensor, y: torch.Tensor
                              ) -> torch.Tensor | None:
    """One schedule step over the whole batch (--grad-accum x --microbatches microbatches),
    then the tied embedding's and the data-parallel gradient sums; the mean loss on the rank
    holding the last stage, None elsewhere."""
    with autocast(t.amp, t.env.device):
        t.faults.before_backward()  # a slow rank: late into its forwards and sends
        loss = t.placed.pipeline.step(x, y)
    t.placed.sync_grads()
    return loss


def optimizer_step(t: Trainer) -> None:
    """Update the weights (through the loss scaler, which skips a step with inf/NaN
    gradients and lowers the scale) and clear the gradients."""
    if t.scaler is not None:
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:
        t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)


def train(t: Trainer) -> int:
    """The loop; returns the exit code (non-zero after saving on SIGTERM).

    Host values (the loss, the loss scale) are read only on logged steps, every --log-every:
    each read waits for the GPU, so reading every step would sync every step (nanoGPT's log
    interval). MFU is measured between those reads (tokens/s by scalemon's definition: wall
    time between step ends, `SyncClock`), on every rank, and goes to the monitor with the
    logged step, which derives tokens/s itself from each step's tokens and time; the monitor
    gets the loss of every step without a sync."""
    args, env = t.args, t.env
    stats: dict[str, list] = {"steps": [], "step_times_s": [], "losses": [], "loss_scales": [],
                              "agent_totals_s": []}  # finish() adds the clock's intervals
    scale = t.scaler.get_scale() if t.scaler is not None and env.rank == 0 else None
    clock = SyncClock(t.start_step, time.perf_counter())
    if t.start_step >= args.max_steps:
        print0(env, f"nothing to train: resumed at step {t.start_step}, --max-steps is "
                    f"{args.max_steps}")
    for step in range(t.start_step + 1, args.max_steps + 1):
        t0 = time.perf_counter()
        t.faults.before_step(step, t.monitor)
        t.faults.desync(step, t.group, env.rank)
        loss = forward_backward(t, step)
        optimizer_step(t)
        logged = step % t.log_every == 0 or step == args.max_steps
        measured: dict[str, float] = {}
        if logged and t.placed is not None and t.placed.pipeline is not None:
            # the last stage has the loss: every stage gets it on logged steps (a collective
            # of the pp group; other steps a stage without it logs loss None)
            loss = t.placed.pipeline.share_loss(loss, env.device)
        if logged:
            value = read_loss(loss)  # a sync point
            steps, seconds = clock.lap(step, time.perf_counter())
            rate = throughput.tokens_per_s(t.tokens_per_step * steps, seconds)
            if t.peak_flops is not None and rate is not None:
                measured["mfu"] = t.flops_per_token * rate / t.peak_flops
        moe = t.moe.take() if t.moe is not None else {}  # tensors: read on logged steps only
        if t.monitor is not None:
            t.monitor.log(step, loss=loss, tokens=t.tokens_per_step, **measured, **moe)
            stats["agent_totals_s"].append(t.monitor.agent_time_total_s)  # for bench/
        if logged and env.rank == 0:
            print(f"step {step} loss {value:.4f}", flush=True)
            scale = report_loss_scale(t, step, scale)
            stats["steps"].append(step)
            stats["losses"].append(value)
            stats["loss_scales"].append(scale)
            if moe:
                report_moe(moe, stats)
        if args.step_delay:
            time.sleep(args.step_delay)
        stats["step_times_s"].append(time.perf_counter() - t0)
        if t.ckpt is not None:
            stop = any_rank(t.term.received, t.group)
            due = args.ckpt_every > 0 and step % args.ckpt_every == 0
            if (due or stop or step == args.max_steps) and t.ckpt.last_saved != step:
                t.ckpt.save(step, t.state, "SIGTERM" if stop else "periodic")
            if stop:
                print0(env, f"SIGTERM: stopped after step {step} with a checkpoint")
                finish(t, stats, clock, TermSignal.EXIT_CODE)
                return TermSignal.EXIT_CODE
    finish(t, stats, clock, 0)
    return 0


def report_moe(moe: dict[str, Any], stats: dict[str, list]) -> None:
    """Print rank 0's MoE figures of a logged step and keep them for --stats-json (each read
    waits for the GPU: logged steps only)."""
    imbalance, dropped = float(moe["moe_imbalance"]), int(moe["moe_dropped_tokens"])
    aux = float(moe["moe_aux_loss"])
    print(f"moe: imbalance {imbalance:.2f}, dropped {dropped} tokens, aux loss {aux:.3f}",
          flush=True)
    for key, value in (("moe_imbalance", imbalance), ("moe_dropped_tokens", dropped),
                       ("moe_aux_loss", aux)):
        stats.setdefault(key, []).append(value)


def read_loss(loss: torch.Tensor) -> float:
    """The step's loss on the host: a sync point (it waits for the GPU to finish the step)."""
    return loss.item()


def report_loss_scale(t: Trainer, step: int, previous: float | None) -> float | None:
    """Print when the AMP loss scale went down since the last logged step (steps with inf/NaN
    gradients were skipped); returns the scale now. Reading it is a sync: logged steps only."""
    if t.scaler is None:
        return None
    scale = t.scaler.get_scale()
    if previous is not None and scale < previous:
        if t.log_every == 1:
            print(f"amp: step {step} skipped (inf/NaN gradients), loss scale {previous:g} -> "
                  f"{scale:g}", flush=True)
        else:
            print(f"amp: loss scale {previous:g} -> {scale:g} by step {step}: steps with inf/NaN "
                  "gradients were skipped", flush=True)
    return scale
