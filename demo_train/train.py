"""Train a small byte-level GPT, the reference workload scalemon is shown and tested on.

    # one process, CPU or GPU
    python demo_train/train.py --max-steps 50
    # two ranks with DDP (gloo on CPU, NCCL on GPU), monitored
    torchrun --nproc-per-node 2 demo_train/train.py --monitor --max-steps 200
    # then, from another terminal
    scalemon snapshot

Rank 0 prints `step N loss X` for every step; with --monitor every rank streams its own loss,
timings and memory to the job's scalemon hub.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from scalemon.demo_train.data import ByteBatches, load_corpus
from scalemon.demo_train.model import GPT, PRESETS, GPTConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags, grouped by what they control."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    # model and data
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size")
    p.add_argument("--data", help="a text file to train on (default: Python's own sources)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, help="context length (default: the preset's)")
    # optimisation
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1337)
    # system
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--monitor", action="store_true", help="stream metrics to scalemon")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="sleep this many seconds per step (slows the demo down to watch it)")
    p.add_argument("--stats-json", help="rank 0 writes per-step wall times here (benchmarks)")
    return p.parse_args(argv)


def setup_distributed(device_arg: str) -> tuple[int, int, torch.device]:
    """Initialise the process group when launched by torchrun; returns (rank, world, device)."""
    use_cuda = torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if use_cuda else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=device
                            if use_cuda else None)
    return dist.get_rank(), dist.get_world_size(), device


def write_stats(path: str, step_times: list[float], monitor: object | None) -> None:
    """Per-step wall times and the agent's own cost, for bench/agent_overhead.py."""
    stats = {"step_times_s": step_times}
    if monitor is not None:
        stats["agent_time_total_s"] = monitor.agent_time_total_s
        stats["agent_steps"] = monitor.steps_logged
    with open(path, "w") as f:
        json.dump(stats, f)


def main(argv: list[str] | None = None) -> int:
    """Train; returns the process exit code."""
    args = parse_args(argv)
    rank, world, device = setup_distributed(args.device)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    overrides = {"block_size": args.block_size} if args.block_size else {}
    config = GPTConfig.preset(args.preset, **overrides)
    data = ByteBatches(load_corpus(args.data, config.block_size), config.block_size,
                       args.batch_size, rank=rank, world_size=world, seed=args.seed)
    model = GPT(config).to(device)
    ddp_model = DDP(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                  weight_decay=args.weight_decay)
    monitor = None
    if args.monitor:
        import scalemon.agent as sm

        monitor = sm.init(model=ddp_model, optimizer=optimizer,
                          config={**vars(args), "model": asdict(config), "world_size": world})
    tokens_per_step = args.batch_size * config.block_size
    if rank == 0:
        print(f"training {args.preset} ({model.num_params() / 1e6:.2f}M params) on {world} "
              f"rank(s), {device.type}, {tokens_per_step * world} tokens/step", flush=True)
    step_times: list[float] = []
    for step in range(1, args.max_steps + 1):
        t0 = time.perf_counter()
        x, y = (t.to(device, non_blocking=True) for t in data.next_batch())
        _, loss = ddp_model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if monitor is not None:
            monitor.log(step, loss=loss.detach(), tokens=tokens_per_step)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)
        step_times.append(time.perf_counter() - t0)
    if args.stats_json and rank == 0:
        write_stats(args.stats_json, step_times, monitor)
    if monitor is not None:
        monitor.finish()
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
