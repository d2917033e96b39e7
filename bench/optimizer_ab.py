"""AdamW choices of the trainer, measured A/B/C inside one process on one GPU.

One GPT model (the trainer's, `--preset`, bf16 autocast, `torch.compile` of the whole model as
nanoGPT does) and one optimizer per mode over the same params: torch's fused AdamW
(`torch-fused`, the trainer's default on a GPU), ours (`fused`, demo_train/fused_adam.py) and
ours with flat buffers (`fused-flat`). Blocks of steps rotate between the modes, so every mode
sees the same process, compiled graphs, clocks and neighbours; separate processes spread
several % on a shared machine. A block's first steps are not timed (a mode switch re-points
grads); the rest are timed together with the device synced at both ends. Prints the median
time per step of each mode over blocks and each mode's per-block paired ratio to torch's,
median and p10..p90; saves bench/results/optimizer_ab-<device>.json. Memory per mode: what
building its state and tables added (`state MiB`, at its first step, after a forward and
backward that took compile's and the libraries' workspaces) and what a step() allocates beyond
what is allocated when it starts (`step peak +MiB`); the trainer's whole-run peaks are
bench/train_throughput.py's.

    python bench/optimizer_ab.py                          # 1 GPU: gpt2-124m, 8 blocks each
    TRITON_INTERPRET=1 python bench/optimizer_ab.py --device cpu --preset tiny --blocks 2
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
from machine import append_result

from scalemon.demo_train.fused_adam import FusedAdamW
from scalemon.demo_train.model import GPT, GPTConfig

MODES = ("torch-fused", "fused", "fused-flat")


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--blocks", type=int, default=8, help="blocks per mode")
    p.add_argument("--block-steps", type=int, default=12)
    p.add_argument("--untimed", type=int, default=2, help="steps at a block's start not timed")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--adam-shape", metavar="BLOCKxWARPS[xITERS]", default=None,
                   help="our kernels' launch shape (elements a block x warps [x blocks a "
                        "program]), e.g. 512x4x4, as bench/fused_adam_sweep.py names them "
                        "(default: the module's)")
    args = p.parse_args()
    if args.adam_shape:
        set_adam_shape(p, args.adam_shape)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    config = GPTConfig.preset(args.preset)
    model = GPT(config).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = dict(lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    optimizers = {  # flat first: it moves the params into its buffers (the others follow them)
        "fused-flat": FusedAdamW(params, flat_buffers=True, **decay),
        "fused": FusedAdamW(params, **decay),
        "torch-fused": torch.optim.AdamW(params, fused=cuda, **decay),
    }
    compiled = model if args.no_compile else torch.compile(model)
    block = config.block_size
    x = torch.randint(0, config.vocab_size, (args.batch_size, block), device=device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda
                else contextlib.nullcontext())

    def step(mode: str) -> None:
        opt = optimizers[mode]
        with autocast:
            _, loss = compiled(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def allocated_mib() -> float:
        return torch.cuda.memory_allocated(device) / 2**20 if cuda else 0.0

    with autocast:  # compile, and the libraries' workspaces, before any optimizer's state
        _, loss = compiled(x, x)
    loss.backward()
    for param in params:
        param.grad = None
    memory: dict[str, dict[str, float]] = {}
    for mode in MODES:  # build every optimizer's state and tables: what each one adds
        sync()
        before = allocated_mib()
        step(mode)
        sync()
        memory[mode] = {"state_mib": allocated_mib() - before}
        for _ in range(2):
            step(mode)
    for mode in MODES:  # what a step() needs beyond what is allocated when it starts
        with autocast:
            _, loss = compiled(x, x)
        loss.backward()
        sync()
        base = allocated_mib()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        optimizers[mode].step()
        sync()
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else base
        memory[mode]["step_peak_extra_mib"] = peak - base
        optimizers[mode].zero_grad(set_to_none=True)
    per_step: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.blocks):
        order = MODES[i % len(MODES):] + MODES[:i % len(MODES)]
        for mode in order:
            for _ in range(args.untimed):
                step(mode)
            sync()
            t0 = time.perf_counter()
            for _ in range(args.block_steps - args.untimed):
                step(mode)
            sync()
            per_step[mode].append((time.perf_counter() - t0) / (args.block_steps - args.untimed))
    result = summarize(args, device, per_step, memory)
    print_result(result)
    append_result("optimizer_ab", result)
    return 0


def set_adam_shape(parser: argparse.ArgumentParser, text: str) -> None:
    """Point our kernels at this launch shape (read when a plan is built and at each launch)."""
    from fused_adam_sweep import parse_config

    from scalemon.demo_train import adam_kernel, adam_plan

    try:
        adam_kernel.GPU_BLOCK, adam_plan.GPU_WARPS, adam_kernel.GPU_ITERS = parse_config(text)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--adam-shape: {exc}")


def adam_shape() -> str:
    """Our kernels' launch shape in use, BLOCKxWARPS[xITERS]."""
    from fused_adam_sweep import config_name

    from scalemon.demo_train import adam_kernel, adam_plan

    return config_name((adam_kernel.GPU_BLOCK, adam_plan.GPU_WARPS, adam_kernel.GPU_ITERS))


def summarize(args: argparse.Namespace, device: torch.device,
              per_step: dict[str, list[float]], memory: dict[str, dict[str, float]]) -> dict:
    base = per_step["torch-fused"]
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "preset": args.preset, "batch_size": args.batch_size,
           "compile": not args.no_compile, "blocks": args.blocks,
           "block_steps": args.block_steps, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "adam_shape": adam_shape(), "modes": {}}
    for mode, times in per_step.items():
        ratios = sorted(b / t for b, t in zip(base, times, strict=True))  # >1: faster than torch
        out["modes"][mode] = {
            "step_ms": 1e3 * statistics.median(times),
            "speed_vs_torch_fused": statistics.median(ratios),
            "p10_p90": [ratios[len(ratios) // 10], ratios[(9 * len(ratios)) // 10]],
            **memory[mode],
        }
    return out


def print_result(r: dict) -> None:
    print(f"{r['device']}, torch {r['torch']}, {r['preset']} batch {r['batch_size']}, "
          f"compile {r['compile']}, {r['blocks']} blocks of {r['block_steps']} steps per mode")
    print(f"{'mode':<12} {'step ms':>9} {'speed vs torch-fused':>22} {'p10..p90':>16} "
          f"{'state MiB':>10} {'step peak +MiB':>15}")
    for mode, m in r["modes"].items():
        lo, hi = m["p10_p90"]
        print(f"{mode:<12} {m['step_ms']:>9.3f} {m['speed_vs_torch_fused']:>22.4f} "
              f"{lo:>7.4f}..{hi:.4f} {m['state_mib']:>10.1f} {m['step_peak_extra_mib']:>15.1f}")


if __name__ == "__main__":
    sys.exit(main())
