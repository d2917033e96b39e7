"""AdamW choices of the trainer, measured A/B/C inside one process on one GPU.

One GPT model (the trainer's, `--preset`, bf16 autocast, `torch.compile` of the whole model as
nanoGPT does) and one optimizer per mode over the same params: torch's fused AdamW
(`torch-fused`, the trainer's default on a GPU), ours (`fused`, demo_train/fused_adam.py) and
ours with flat buffers (`fused-flat`). Blocks of steps rotate between the modes, so every mode
sees the same process, compiled graphs, clocks and neighbours; separate processes spread
several % on a shared machine. A block's first steps are not timed (a mode switch re-points
grads); the rest are timed together with the device synced at both ends. Prints the median
time per step of each mode over blocks and each mode's per-block paired ratio to torch's,
median and p10..p90; saves bench/results/optimizer_ab-<device>.json. Peak memory is not
compared here (the modes share one model and hold their states together): the trainer's runs
in bench/train_throughput.py measure it per mode.

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
    args = p.parse_args()
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

    for mode in MODES:  # compile, build every optimizer's state and tables
        for _ in range(3):
            step(mode)
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
    result = summarize(args, device, per_step)
    print_result(result)
    append_result("optimizer_ab", result)
    return 0


def summarize(args: argparse.Namespace, device: torch.device,
              per_step: dict[str, list[float]]) -> dict:
    base = per_step["torch-fused"]
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "preset": args.preset, "batch_size": args.batch_size,
           "compile": not args.no_compile, "blocks": args.blocks,
           "block_steps": args.block_steps, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
           "modes": {}}
    for mode, times in per_step.items():
        ratios = sorted(b / t for b, t in zip(base, times, strict=True))  # >1: faster than torch
        out["modes"][mode] = {
            "step_ms": 1e3 * statistics.median(times),
            "speed_vs_torch_fused": statistics.median(ratios),
            "p10_p90": [ratios[len(ratios) // 10], ratios[(9 * len(ratios)) // 10]],
        }
    return out


def print_result(r: dict) -> None:
    print(f"{r['device']}, torch {r['torch']}, {r['preset']} batch {r['batch_size']}, "
          f"compile {r['compile']}, {r['blocks']} blocks of {r['block_steps']} steps per mode")
    print(f"{'mode':<12} {'step ms':>9} {'speed vs torch-fused':>22} {'p10..p90':>16}")
    for mode, m in r["modes"].items():
        lo, hi = m["p10_p90"]
        print(f"{mode:<12} {m['step_ms']:>9.3f} {m['speed_vs_torch_fused']:>22.4f} "
              f"{lo:>7.4f}..{hi:.4f}")


if __name__ == "__main__":
    sys.exit(main())
