"""The agent's cost on the training thread, measured A/B inside one process.

Run under torchrun. Each rank builds two identical DDP models: A with torch's own Python
all-reduce comm hook, B with the same hook (`--mode control`) or watched by the scalemon agent
(`--mode agent`: its timed comm hook, optimizer and forward hooks, and `log()` every step). Blocks
of steps alternate between A and B, so both see the same process, cores and neighbours; the
agent's background threads run throughout and so cost both alike (bench/agent_overhead.py
measures whole jobs). Prints rank 0's median step time of A and B and their ratio.

    torchrun --nproc-per-node 2 -- bench/agent_ab.py --mode agent
    torchrun --nproc-per-node 2 -- bench/agent_ab.py --mode control
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from scalemon.agent.run import Run
from scalemon.demo_train.model import GPT, GPTConfig


def build() -> tuple[DDP, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    return DDP(model), torch.optim.AdamW(model.parameters())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("agent", "control"), default="agent")
    p.add_argument("--watch", choices=("all", "no-comm", "log-only"), default="all",
                   help="what the agent hooks on B: everything, all but the all-reduce (torch's "
                        "hook instead), or nothing (log() only)")
    p.add_argument("--blocks", type=int, default=24, help="blocks per model")
    p.add_argument("--block-steps", type=int, default=50)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ddp_a, opt_a = build()
    ddp_a.register_comm_hook(None, allreduce_hook)
    ddp_b, opt_b = build()
    run = None
    if args.mode == "agent":  # sends to a hub that is not there: messages are dropped, counted
        home = tempfile.mkdtemp(prefix="smab", dir="/tmp")
        hooked = args.watch != "log-only"
        run = Run(ddp_b if hooked else None, opt_b if hooked else None, job="ab",
                  hub=f"ipc://{home}/nohub", time_collectives=args.watch == "all")
        if args.watch != "all":
            ddp_b.register_comm_hook(None, allreduce_hook)
    else:
        ddp_b.register_comm_hook(None, allreduce_hook)
    x = torch.randint(0, 256, (8, 64))
    times: dict[str, list[float]] = {"A": [], "B": []}
    for _ in range(args.blocks):
        for name, ddp, opt in (("A", ddp_a, opt_a), ("B", ddp_b, opt_b)):
            for step in range(args.block_steps):
                t0 = time.perf_counter()
                _, loss = ddp(x, x)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if name == "B" and run is not None:
                    run.log(step, loss=loss.detach(), tokens=x.numel())
                times[name].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        skip = 2 * args.block_steps  # warm-up
        a, b = (statistics.median(times[k][skip:]) for k in ("A", "B"))
        agent = "" if run is None else (
            f"  agent {1e6 * run.agent_time_total_s / run.steps_logged:.1f} us/step")
        print(f"{args.mode}/{args.watch}: A {1e3 * a:.3f} ms  B {1e3 * b:.3f} ms  "
              f"B/A {b / a:.4f}{agent}")
    if run is not None:
        run.finish()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
