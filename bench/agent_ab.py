"""The agent's cost on the training thread, measured A/B inside one process.

Run under torchrun. Each rank builds two identical models: A not watched, B watched by the
scalemon agent (`--mode agent`: its hooks and `log()` every step) or not (`--mode control`: the
noise floor of the comparison). Blocks of steps alternate between A and B, so both see the same
process, device, clocks and neighbours; the agent's background threads (sender, heartbeat,
Flight Recorder reader) run throughout and so cost both alike (bench/agent_overhead.py measures
whole jobs). A block's time is its wall time with the device synced at both ends, so work the
host queued is counted where it ran. Prints the median time per step of A and B over blocks,
B/A, the per-block paired ratios' spread, and the agent's own measure of its training-thread
time per step (`--breakdown`: per function, from timers wrapped around the agent's pieces,
which add their own small cost).

    torchrun --nproc-per-node 2 -- bench/agent_ab.py --mode agent            # CPU, gloo
    torchrun --nproc-per-node 1 -- bench/agent_ab.py --device cuda --preset gpt2-124m \\
        --compile --amp bf16 --ddp --mode agent --breakdown                 # 1 GPU, NCCL

GPU form (issue #25): GPT-2 124M shapes, bf16 autocast, torch.compile then DDP (as nanoGPT),
torch's fused AdamW, over NCCL; the agent starts its hub as in a real job. Results are appended
to bench/results/agent_ab-<device>.json with the device named.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from machine import append_result, cpu_name
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from scalemon.demo_train.model import GPT, GPTConfig


def build(args: argparse.Namespace,
          device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One model (compiled, then DDP as nanoGPT does) and its optimizer."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.preset)).to(device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    if args.compile:
        model = torch.compile(model)
    if args.ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model, opt


TIMED = {  # what --breakdown wraps: (module, qualified name)
    "log": ("scalemon.agent.run", "Run.log"),
    "forward hook": ("scalemon.agent.run", "Run._on_forward"),
    "optimizer pre-hook": ("scalemon.agent.timing", "OptimizerTimer._pre"),
    "optimizer post-hook": ("scalemon.agent.timing", "OptimizerTimer._post"),
    "event record": ("scalemon.agent.timing", "EventPool.record"),
    "stage (loss noted, scale copied)": ("scalemon.agent.steps", "StepFinisher.stage"),
    "submit_deferred": ("scalemon.agent.transport", "Sender.submit_deferred"),
    "scale read": ("scalemon.agent.scaler", "ScaleReader.read"),
    "cuda memory": ("scalemon.agent.run", "cuda_memory"),
}


def instrument() -> dict[str, list[float]]:
    """Wrap the agent's training-thread pieces with timers (training thread only); returns
    the per-call seconds by piece."""
    import importlib
    import threading

    spent: dict[str, list[float]] = collections.defaultdict(list)
    main = threading.get_ident()
    for label, (module_name, qualname) in TIMED.items():
        module = importlib.import_module(module_name)
        owner_name, _, attr = qualname.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        original = getattr(owner, attr, None)
        if original is None:
            continue

        def timed(*a, __f=original, __label=label, **k):
            if threading.get_ident() != main:
                return __f(*a, **k)
            t0 = time.perf_counter()
            try:
                return __f(*a, **k)
            finally:
                spent[__label].append(time.perf_counter() - t0)

        functools.update_wrapper(timed, original)
        setattr(owner, attr, timed)
    return spent


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("agent", "control"), default="agent")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ddp", action="store_true", help="wrap both models in DDP (CPU: always)")
    p.add_argument("--amp", choices=("off", "bf16"), default="off")
    p.add_argument("--blocks", type=int, default=24, help="blocks per model")
    p.add_argument("--block-steps", type=int, default=50)
    p.add_argument("--breakdown", action="store_true",
                   help="time each agent piece on the training thread (adds its own cost)")
    p.add_argument("--label", default="", help="a note saved with the result")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)
        args.ddp = True
    dist.init_process_group("nccl" if cuda else "gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    spent = instrument() if args.breakdown else None
    model_a, opt_a = build(args, device)
    model_b, opt_b = build(args, device)
    if not cuda:  # gloo: torch's Python hook on A, and on B unless the agent times B's
        model_a.register_comm_hook(None, allreduce_hook)
        if args.mode == "control":
            model_b.register_comm_hook(None, allreduce_hook)
    run = None
    if args.mode == "agent":
        from scalemon.agent.run import Run

        if cuda:  # a real job: the agent starts the job's hub
            os.environ.setdefault("SCALEMON_HOME", tempfile.mkdtemp(prefix="smab", dir="/tmp"))
            run = Run(model_b, opt_b, job=f"ab-{os.getpid()}")
        else:  # as before: a hub that is not there (messages are dropped, counted)
            home = tempfile.mkdtemp(prefix="smab", dir="/tmp")
            run = Run(model_b, opt_b, job="ab", hub=f"ipc://{home}/nohub")
    block = args.block_size if not cuda or args.preset == "tiny" else 1024
    x = torch.randint(0, 256, (args.batch_size, block), device=device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda and args.amp == "bf16"
                else contextlib.nullcontext())
    step_no = {"B": 0}

    def one_step(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        with autocast:
            _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if name == "B" and run is not None:
            run.log(step_no["B"], loss=loss.detach(), tokens=x.numel())
            step_no["B"] += 1

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for name, model, opt in (("A", model_a, opt_a), ("B", model_b, opt_b)):  # compile, warm
        for _ in range(3):
            one_step(name, model, opt)
    if spent is not None:
        spent.clear()
    per_step: dict[str, list[float]] = {"A": [], "B": []}
    agent_before = run.agent_time_total_s if run is not None else 0.0
    steps_before = run.steps_logged if run is not None else 0
    for i in range(args.blocks):
        order = (("A", model_a, opt_a), ("B", model_b, opt_b))
        for name, model, opt in (order if i % 2 == 0 else order[::-1]):
            sync()
            t0 = time.perf_counter()
            for _ in range(args.block_steps):
                one_step(name, model, opt)
            sync()
            per_step[name].append((time.perf_counter() - t0) / args.block_steps)
    result = summarize(args, device, per_step, run, agent_before, steps_before, spent)
    if dist.get_rank() == 0:
        print_result(result)
        append_result("agent_ab", result)
    if run is not None:
        run.finish()
    dist.destroy_process_group()
    return 0


def summarize(args, device, per_step, run, agent_before, steps_before, spent) -> dict:
    """Medians, paired ratios and the agent's own figures, as saved."""
    skip = 1  # the first block of each model: allocator and clocks settle
    a, b = per_step["A"][skip:], per_step["B"][skip:]
    ratios = sorted(y / x for x, y in zip(a, b, strict=True))
    out = {
        "mode": args.mode, "label": args.label, "device": device_name(device),
        "torch": torch.__version__, "preset": args.preset, "compile": args.compile,
        "ddp": args.ddp, "amp": args.amp, "blocks": args.blocks, "block_steps": args.block_steps,
        "backend": dist.get_backend(), "world_size": dist.get_world_size(),
        "a_step_ms": 1e3 * statistics.median(a), "b_step_ms": 1e3 * statistics.median(b),
        "b_over_a": statistics.median(b) / statistics.median(a),
        "paired_ratio_median": statistics.median(ratios),
        "paired_ratio_p10_p90": [ratios[len(ratios) // 10], ratios[(9 * len(ratios)) // 10]],
        **paired_interval(ratios),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if run is not None:
        steps = run.steps_logged - steps_before
        out["agent_us_per_step"] = 1e6 * (run.agent_time_total_s - agent_before) / max(1, steps)
        # a cheap agent must still be a working one: it stayed on and its messages went out
        out["agent_health"] = {"disabled": run.disabled, "steps_logged": steps,
                               "sent": run.sender.sent, "dropped": run.sender.dropped}
    if spent:
        steps = max(1, (run.steps_logged - steps_before) if run is not None else 1)
        out["breakdown_us_per_step"] = {k: 1e6 * sum(v) / steps for k, v in spent.items()}
        out["breakdown_us_median_call"] = {k: 1e6 * statistics.median(v)
                                           for k, v in spent.items()}
    return out


RESOLVE = 0.01
"""The bench resolves a 1% cost when its 95% interval is at most this wide on either side."""


def paired_interval(ratios: list[float]) -> dict:
    """The geometric mean of the paired block ratios B/A with a 95% interval (normal
    approximation on the logs: adjacent blocks share the machine's drift, so their ratios are
    close to independent), and whether the interval resolves `RESOLVE`."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    lo, hi = math.exp(mean - half), math.exp(mean + half)
    return {"paired_ratio_geomean": math.exp(mean), "paired_ratio_ci95": [lo, hi],
            "resolves_1pct": hi - lo <= 2 * RESOLVE}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def print_result(r: dict) -> None:
    lo, hi = r["paired_ratio_p10_p90"]
    agent = f"  agent {r['agent_us_per_step']:.1f} us/step" if "agent_us_per_step" in r else ""
    print(f"{r['device']} {r['mode']}: A {r['a_step_ms']:.3f} ms  B {r['b_step_ms']:.3f} ms  "
          f"B/A {r['b_over_a']:.4f}  paired {r['paired_ratio_median']:.4f} "
          f"[p10 {lo:.4f} p90 {hi:.4f}]{agent}")
    c_lo, c_hi = r["paired_ratio_ci95"]
    print(f"  paired geometric mean {r['paired_ratio_geomean']:.4f}, 95% interval "
          f"[{c_lo:.4f}, {c_hi:.4f}]: " + ("resolves 1%" if r["resolves_1pct"] else
                                          "does NOT resolve 1% (more or shorter blocks)"))
    health = r.get("agent_health")
    if health:
        broken = health["disabled"] or not health["sent"] or not health["steps_logged"]
        print(f"  agent {'NOT WORKING: ' if broken else ''}disabled {health['disabled']}, "
              f"steps logged {health['steps_logged']}, messages sent {health['sent']}, "
              f"dropped {health['dropped']}")
    for key in ("breakdown_us_per_step", "breakdown_us_median_call"):
        if key in r:
            print(f"  {key}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(
                r[key].items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    sys.exit(main())
