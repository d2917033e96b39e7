"""A plain gloo job that torchrun restarts once: rank 1 raises before step `--crash-at` in the
first attempt (TORCHELASTIC_RESTART_COUNT == 0), every rank resumes from its own checkpoint.

    torchrun --nproc-per-node 2 --max-restarts 1 tests/jobs/restart_gloo.py CKPT_DIR \\
        [--monitor] [--steps 10] [--crash-at 5] [--torchrun-store]

A small DDP model on the CPU; each rank saves its own `rank<R>.pt` (step, model, optimizer)
after every step, written to a temporary file and renamed, so a crash never leaves half a
file. With --monitor the script uses scalemon.agent (init, log every step, finish) as a user's
script would. Each rank prints `rank R: done at step S` at the end; `bench/restart_success.py`
and tests/test_restart_jobs.py run it.

The process group's rendezvous keys are private to the torchrun attempt (`attempt_store`), as
the demo trainer's are: torchrun's static rendezvous (`--master-port`, its default) keeps one
TCPStore for all attempts, without a prefix per attempt, so a restarted worker can read the
gloo address of the previous attempt's dead peer and fail in init_process_group ("Gloo
connectFullMesh failed ... Connection refused"), or hang there for good (each side of the pair
compared its address with a stale one and both wait for the other to connect): a race, lost in
about half the runs on a 2-core machine. --torchrun-store calls `init_process_group("gloo")`
as a plain script does, to show that (bench/restart_success.py --torchrun-store).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def attempt_store() -> dist.Store | None:
    """torchrun's store under a prefix of this attempt (TORCHELASTIC_RESTART_COUNT), where
    torchrun's agent hosts it; None (plain env:// rendezvous) elsewhere."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False,
                          timeout=timedelta(minutes=5))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"restart_gloo/attempt_{attempt}", store)


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The step this rank's checkpoint is of (its state loaded), 0 without one."""
    if not path.exists():
        return 0
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return int(saved["step"])


def save(path: Path, step: int, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer) -> None:
    """Write this rank's checkpoint atomically (a temporary file, then a rename)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "model": model.state_dict(),
                "optimizer": optimizer.state_dict()}, tmp)
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt_dir", type=Path)
    p.add_argument("--monitor", action="store_true", help="use scalemon.agent")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--crash-at", type=int, default=5)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--step-s", type=float, default=0.05, help="sleep per step")
    p.add_argument("--torchrun-store", action="store_true",
                   help="rendezvous in torchrun's store as it is (no prefix per attempt)")
    args = p.parse_args()
    sm = None
    if args.monitor:
        import scalemon.agent as sm
    store = None if args.torchrun_store else attempt_store()
    if store is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = args.ckpt_dir / f"rank{rank}.pt"
    start = load(path, model, optimizer)
    if sm is not None:
        sm.init(model=model, optimizer=optimizer, config={"job": "restart_gloo"})
    print(f"rank {rank}: attempt {attempt} starts after step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        if attempt == 0 and rank == args.crash_rank and step == args.crash_at:
            raise RuntimeError(f"rank {rank}: planted crash before step {step}")
        x = torch.randn(32, 64)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        save(path, step, model, optimizer)
        if sm is not None:
            sm.log(step=step, loss=loss.detach())
        time.sleep(args.step_s)
    if sm is not None:
        sm.finish()
    dist.destroy_process_group()
    print(f"rank {rank}: done at step {args.steps}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
