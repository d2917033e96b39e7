"""FusedAdamW's launch shape (elements per program x warps) swept on the GPU, beside torch fused.

For GPT-2 124M's tensor shapes, fp32 and bf16 params: FusedAdamW built with each launch shape
(`--configs`, BLOCKxWARPS or BLOCKxWARPSxITERS: ITERS blocks a program) in each of its modes
(fp32: the one; bf16: fp32 master, lo16 master + bf16 moments, fp32 master + bf16 moments), and
torch's AdamW(fused=True), all stepping the same shared params and grads, interleaved step by
step in rotating order (as bench/fused_adam.py), timed with CUDA events: median, p10 and p90 ms,
GB/s, % of a device-to-device copy. Prints a table per dtype and, per mode, the fastest shape;
saves bench/results/fused_adam_sweep_<gpu>.json.
The shape is set through adam_kernel.GPU_BLOCK and GPU_ITERS (read when an optimizer's plan is
built) and adam_plan.GPU_WARPS (read at each launch): a bench knob, not a product setting.

    python bench/fused_adam_sweep.py                       # the default shapes
    python bench/fused_adam_sweep.py --configs 2048x8 512x4x4 --iters 100
    python bench/fused_adam_sweep.py --best fp32           # also print "BLOCKxWARPS" of the
                                                           # fastest fp32 shape, last line alone

Needs CUDA (without it: says so, exits 2).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from fused_adam import HYPER, OURS_BF16, copy_gbps, gpt2_124m_shapes, header, percentile

RESULTS = Path(__file__).resolve().parent / "results"
# 2048x8 (the module's before this bench) needs 128 registers a thread on sm_90: 16 warps,
# two programs, an SM; the others need 46-80 (cuobjdump --dump-resource-usage on the cubin
# Triton builds here without a GPU, as tests/test_fused_adam.py's AOT test does)
DEFAULT_CONFIGS = ("2048x8", "1024x8", "2048x16", "1024x16", "512x4", "512x8", "4096x32")
BYTES = {"fp32": 28, "bf16 fp32-master": 28, "bf16 lo16+bf16m": 18, "bf16 fp32m+bf16m": 20,
         "bf16 pure-bf16": 14, "bf16 pure-bf16-sr": 14,
         "torch fused fp32": 28, "torch fused bf16": 14}


def parse_config(text: str) -> tuple[int, int, int]:
    """'8192x16' -> (8192, 16, 1), '512x4x4' -> (512, 4, 4); a clear error otherwise."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:x(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not BLOCKxWARPS or BLOCKxWARPSxITERS, e.g. 8192x16 or 512x4x4")
    block, warps, iters = int(m[1]), int(m[2]), int(m[3] or 1)
    if block & (block - 1) or warps & (warps - 1) or not 1 <= warps <= 32 or not iters >= 1:
        raise argparse.ArgumentTypeError(f"'{text}': BLOCK and WARPS must be powers of two, "
                                         "WARPS 1-32, ITERS 1 or more")
    return block, warps, iters


def config_name(shape: tuple[int, int, int]) -> str:
    """(512, 4, 1) -> '512x4', (512, 4, 4) -> '512x4x4'."""
    block, warps, iters = shape
    return f"{block}x{warps}" + (f"x{iters}" if iters > 1 else "")


class Shaped:
    """A FusedAdamW built and stepped with one launch shape."""

    def __init__(self, params: list[torch.Tensor], shape: tuple[int, int, int],
                 **kw: object) -> None:
        from scalemon.demo_train import adam_kernel, adam_plan
        from scalemon.demo_train.fused_adam import FusedAdamW

        self.kernel, self.plan, self.shape = adam_kernel, adam_plan, shape
        self.opt = FusedAdamW(params, **HYPER, **kw)
        self.step()  # the plan is built at the first step, with this BLOCK and ITERS

    def step(self) -> None:
        block, warps, iters = self.shape
        self.kernel.GPU_BLOCK, self.plan.GPU_WARPS, self.kernel.GPU_ITERS = block, warps, iters
        self.opt.step()


def modes(dtype: torch.dtype) -> dict[str, dict]:
    """Our modes for params of this dtype: name -> FusedAdamW options."""
    if dtype == torch.float32:
        return {"fp32": {}}
    return {"bf16 fp32-master": {}, **{
        "bf16 " + name.removeprefix("ours_"): kw for name, kw in OURS_BF16.items()}}


def time_all(steppers: dict, warmup: int, iters: int) -> dict[str, list[float]]:
    """CUDA-event ms per step of each stepper, interleaved in rotating order."""
    names = list(steppers)
    for _ in range(warmup):
        for name in names:
            steppers[name]()
    torch.cuda.synchronize()
    events: dict[str, list] = {n: [] for n in names}
    for i in range(iters):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            steppers[name]()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {n: [s.elapsed_time(e) for s, e in ev] for n, ev in events.items()}


def run_dtype(dtype: torch.dtype, configs: list[tuple[int, int, int]], args: argparse.Namespace,
              copy: float) -> list[dict]:
    """Every mode x shape of this dtype and torch fused, on shared params; rows."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = gpt2_124m_shapes()
    params = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(dtype) * 1e-2
    numel = sum(p.numel() for p in params)
    tag = "fp32" if dtype == torch.float32 else "bf16"
    steppers = {f"torch fused {tag}": torch.optim.AdamW(params, fused=True, **HYPER).step}
    t0 = time.perf_counter()
    for mode, kw in modes(dtype).items():
        for shape in configs:
            steppers[f"{mode} {config_name(shape)}"] = Shaped(params, shape, **kw).step
    print(f"{tag}: {len(steppers) - 1} kernels built in {time.perf_counter() - t0:.1f} s",
          flush=True)
    times = time_all(steppers, args.warmup, args.iters)
    rows = []
    for name, ms in times.items():
        mode = name.rsplit(" ", 1)[0] if not name.startswith("torch") else name
        med = statistics.median(ms)
        gbps = numel * BYTES[mode] / (med * 1e-3) / 1e9
        rows.append({"impl": name, "mode": mode, "dtype": tag, "median_ms": med,
                     "p10_ms": percentile(ms, 10), "p90_ms": percentile(ms, 90),
                     "bytes_per_param": BYTES[mode], "gbps": gbps,
                     "pct_of_copy": 100 * gbps / copy})
    del steppers, params
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    """Rows as a markdown table, with each row's median against torch fused's p10 and median."""
    torch_row = next(r for r in rows if r["impl"].startswith("torch"))
    lines = ["| impl | median ms | p10 ms | p90 ms | B/param | GB/s | % of copy "
             "| vs torch median | vs torch p10 |", "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['median_ms']:.3f} | {r['p10_ms']:.3f} "
                     f"| {r['p90_ms']:.3f} | {r['bytes_per_param']} | {r['gbps']:.0f} "
                     f"| {r['pct_of_copy']:.1f} | {r['median_ms'] / torch_row['median_ms']:.3f} "
                     f"| {r['median_ms'] / torch_row['p10_ms']:.3f} |")
    return "\n".join(lines)


def best_by_mode(rows: list[dict]) -> dict[str, str]:
    """Per mode of ours, the shape with the lowest median."""
    out: dict[str, tuple[float, str]] = {}
    for r in rows:
        if r["impl"].startswith("torch"):
            continue
        shape = r["impl"].rsplit(" ", 1)[1]
        if r["mode"] not in out or r["median_ms"] < out[r["mode"]][0]:
            out[r["mode"]] = (r["median_ms"], shape)
    return {mode: shape for mode, (_, shape) in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", type=parse_config,
                    default=[parse_config(c) for c in DEFAULT_CONFIGS],
                    help="launch shapes BLOCKxWARPS[xITERS]: ITERS blocks a program "
                         f"(default 1; default shapes: {' '.join(DEFAULT_CONFIGS)})")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=60, help="timed steps per implementation")
    ap.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    ap.add_argument("--best", choices=sorted({m for d in ("fp32", "bf16")
                                              for m in modes(getattr(torch, "float32" if d ==
                                                   "fp32" else "bfloat16"))}),
                    help="print the fastest shape of this mode alone on the last line")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_adam_sweep.py needs a CUDA GPU (none here): nothing measured")
        return 2
    head = header()
    print("  ".join(f"{k}={v}" for k, v in head.items()))
    copy = copy_gbps()
    print(f"device-to-device copy: {copy:.0f} GB/s", flush=True)
    rows: list[dict] = []
    for tag in args.dtypes:
        dtype = torch.float32 if tag == "fp32" else torch.bfloat16
        mine = run_dtype(dtype, args.configs, args, copy)
        print(table(mine), flush=True)
        rows += mine
    best = best_by_mode(rows)
    print("fastest shape per mode: " + ", ".join(f"{m} {s}" for m, s in best.items()))
    if not args.no_save:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", head["gpu"]).strip("-").lower()
        path = RESULTS / f"fused_adam_sweep_{slug}.json"
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"header": head, "copy_gbps": copy, "hyper": HYPER,
                                    "iters": args.iters, "rows": rows, "best": best},
                                   indent=2) + "\n")
        print(f"saved {path}")
    if args.best:
        print(best[args.best])
    return 0


if __name__ == "__main__":
    sys.exit(main())
