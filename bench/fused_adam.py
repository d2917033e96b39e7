"""Benchmark FusedAdamW (one Triton launch per step) against torch.optim.AdamW.

Protocol (shared/REFERENCE.md, "Fused AdamW"): baselines torch AdamW with foreach=False,
foreach=True and fused=True on the same params and grads; workloads GPT-2 124M tensor shapes,
1000 x 4096, 10000 x 64 and 1 x 1G elements; fp32, and bf16 (ours: bf16 params with fp32
master/moments; torch: bf16 params and state); >= 20 warm-up and >= 100 timed steps per
implementation, interleaved, timed with CUDA events; median and p10/p90; GB/s from bytes moved
and as % of a measured device-to-device copy; time relative to fused=True.

    python bench/fused_adam.py            # full run, saves bench/results/fused_adam_<gpu>.{json,md}
    python bench/fused_adam.py --quick    # fewer workloads and steps, no 1G case
    python bench/fused_adam.py --skip-1g  # leave out the 1G-element case

Without CUDA it runs a tiny sanity check under the Triton interpreter and saves nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
IMPLS = ("ours", "torch_foreach=False", "torch_foreach=True", "torch_fused=True")
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def gpt2_124m_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of GPT-2 small (tied lm_head): 148 tensors, 124,439,808 elements."""
    d, layer = 768, []
    layer += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]  # ln_1, attn.c_attn, attn.c_proj
    layer += [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # ln_2, mlp.c_fc, mlp.c_proj
    return [(50257, d), (1024, d)] + layer * 12 + [(d,), (d,)]


def workloads(quick: bool, with_1g: bool) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(name, shapes) of each workload."""
    out = [("gpt2-124m", gpt2_124m_shapes()), ("1000x4096", [(4096,)] * 1000)]
    if not quick:
        out.append(("10000x64", [(64,)] * 10000))
        if with_1g:
            out.append(("1x1G", [(1 << 30,)]))
    return out


def bytes_per_param(impl: str, dtype: torch.dtype) -> int:
    """Bytes moved per parameter: read p,g,m,v and write p,m,v (ours bf16: fp32 master)."""
    if dtype == torch.float32:
        return 28
    if impl == "ours":
        return 2 + 4 * 3 + 2 + 4 * 3  # read g, master, m, v; write p, master, m, v
    return 2 * 7


def bytes_needed(numel: int, dtype: torch.dtype) -> int:
    """Device memory for shared params/grads, the state of all four implementations and
    torch foreach's temporaries (about three param-sized buffers)."""
    size = torch.tensor([], dtype=dtype).element_size()
    ours = 12 if dtype != torch.float32 else 8
    return numel * (2 * size + ours + 3 * 2 * size + 3 * size)


def make_optimizers(params: list[torch.Tensor]) -> dict[str, torch.optim.Optimizer]:
    """The four implementations on the same (shared) params; each keeps its own state."""
    from scalemon.demo_train.fused_adam import FusedAdamW

    return {
        "ours": FusedAdamW(params, **HYPER),
        "torch_foreach=False": torch.optim.AdamW(params, foreach=False, **HYPER),
        "torch_foreach=True": torch.optim.AdamW(params, foreach=True, **HYPER),
        "torch_fused=True": torch.optim.AdamW(params, fused=True, **HYPER),
    }


def time_interleaved(opts: dict, warmup: int, iters: int) -> dict[str, dict[str, list[float]]]:
    """Per implementation: GPU ms (CUDA events) and host us per step, in rotating order."""
    names = list(opts)
    for _ in range(warmup):
        for name in names:
            opts[name].step()
    torch.cuda.synchronize()
    events: dict[str, list] = {n: [] for n in names}
    host: dict[str, list[float]] = {n: [] for n in names}
    for i in range(iters):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            opts[name].step()
            end.record()
            host[name].append((time.perf_counter() - t0) * 1e6)
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {n: {"ms": [s.elapsed_time(e) for s, e in events[n]], "host_us": host[n]} for n in names}


def copy_gbps(nbytes: int = 1 << 31, iters: int = 50) -> float:
    """Device-to-device copy bandwidth (read + write bytes) in GB/s, median of ``iters``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (statistics.median(times) * 1e-3) / 1e9


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    ys = sorted(xs)
    pos = (len(ys) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def summarize(raw: dict, numel: int, dtype: torch.dtype, copy: float) -> list[dict[str, Any]]:
    """One row per implementation with median/p10/p90, GB/s, % of copy, ratio to fused."""
    rows = []
    fused = statistics.median(raw["torch_fused=True"]["ms"])
    for name, r in raw.items():
        med = statistics.median(r["ms"])
        gbps = numel * bytes_per_param(name, dtype) / (med * 1e-3) / 1e9
        rows.append(
            {
                "impl": name,
                "median_ms": med,
                "p10_ms": percentile(r["ms"], 10),
                "p90_ms": percentile(r["ms"], 90),
                "host_us": statistics.median(r["host_us"]),
                "bytes_per_param": bytes_per_param(name, dtype),
                "gbps": gbps,
                "pct_of_copy": 100 * gbps / copy,
                "time_vs_fused": med / fused,
            }
        )
    return rows


def run_case(shapes: list, dtype: torch.dtype, args: argparse.Namespace, copy: float) -> dict:
    """Build shared params/grads, time the four optimizers, free everything."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(dtype) * 1e-2
    numel = sum(p.numel() for p in params)
    opts = make_optimizers(params)
    raw = time_interleaved(opts, args.warmup, args.iters)
    rows = summarize(raw, numel, dtype, copy)
    del opts, params
    torch.cuda.empty_cache()
    return {"numel": numel, "tensors": len(shapes), "rows": rows}


def driver_version() -> str:
    """NVIDIA driver version, or 'n/a'."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # missing NVML is a value, not an error
        return "n/a"


def header() -> dict[str, str]:
    """What the numbers were measured on."""
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_memory_gib": f"{props.total_memory / 2**30:.1f}",
        "driver": driver_version(),
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def markdown(head: dict, copy: float, results: list[dict]) -> str:
    """The results as a markdown table."""
    lines = [f"# FusedAdamW benchmark on {head['gpu']}", ""]
    lines += [", ".join(f"{k} {v}" for k, v in head.items()), ""]
    lines += [f"Device-to-device copy: {copy:.0f} GB/s (read + write).", ""]
    lines.append(
        "| workload | dtype | impl | median ms | p10 ms | p90 ms | host us | B/param "
        "| GB/s | % of copy | time vs fused |"
    )
    lines.append("|" + "---|" * 11)
    for res in results:
        for r in res["rows"]:
            lines.append(
                f"| {res['workload']} | {res['dtype']} | {r['impl']} | {r['median_ms']:.3f} "
                f"| {r['p10_ms']:.3f} | {r['p90_ms']:.3f} | {r['host_us']:.0f} "
                f"| {r['bytes_per_param']} | {r['gbps']:.0f} | {r['pct_of_copy']:.1f} "
                f"| {r['time_vs_fused']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def save(head: dict, copy: float, results: list[dict], quick: bool) -> Path:
    """Write JSON and markdown under bench/results/, named after the GPU."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", head["gpu"]).strip("-").lower()
    stem = RESULTS / f"fused_adam_{slug}{'_quick' if quick else ''}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"header": head, "copy_gbps": copy, "hyper": HYPER, "results": results}
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(head, copy, results))
    return stem


def cpu_sanity() -> int:
    """No CUDA: check a few interpreter steps against torch and save nothing."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from scalemon.demo_train.fused_adam import FusedAdamW

    print("No CUDA device: the benchmark needs a GPU. Running a CPU interpreter sanity check;")
    print("interpreter timings mean nothing and are not saved.")
    ref_ps = [torch.randn(s, requires_grad=True) for s in [(3,), (4097,), ()]]
    our_ps = [p.detach().clone().requires_grad_() for p in ref_ps]
    ref, ours = torch.optim.AdamW(ref_ps, **HYPER), FusedAdamW(our_ps, **HYPER)
    for _ in range(3):
        for r, o in zip(ref_ps, our_ps, strict=True):
            r.grad = torch.randn_like(r)
            o.grad = r.grad.clone()
        ref.step()
        ours.step()
    err = max((r - o).abs().max().item() for r, o in zip(ref_ps, our_ps, strict=True))
    print(f"max |ours - torch.optim.AdamW| after 3 steps: {err:.2e}")
    return 0 if err < 1e-5 else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer workloads/steps, no 1G case")
    ap.add_argument("--skip-1g", action="store_true", help="leave out the 1G-element workload")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 20)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 100)")
    ap.add_argument("--no-save", action="store_true", help="print only")
    args = ap.parse_args(argv)
    args.warmup = args.warmup or (5 if args.quick else 20)
    args.iters = args.iters or (20 if args.quick else 100)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or the CPU sanity check) and print/save the table."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        return cpu_sanity()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: unset it to benchmark compiled kernels on the GPU.")
        return 2
    head = header()
    print("  ".join(f"{k}={v}" for k, v in head.items()))
    copy = copy_gbps()
    print(f"device-to-device copy: {copy:.0f} GB/s")
    free = torch.cuda.mem_get_info()[0]
    results = []
    for name, shapes in workloads(args.quick, not args.skip_1g):
        for dtype in (torch.float32, torch.bfloat16):
            numel = sum(torch.Size(s).numel() for s in shapes)
            if bytes_needed(numel, dtype) > 0.85 * free:
                print(f"skip {name} {dtype}: needs {bytes_needed(numel, dtype) / 2**30:.0f} GiB")
                continue
            res = run_case(shapes, dtype, args, copy)
            res.update(workload=name, dtype=str(dtype).replace("torch.", ""))
            results.append(res)
            print("\n".join(markdown(head, copy, [res]).splitlines()[-4:]), flush=True)
    print(markdown(head, copy, results))
    if not args.no_save:
        print(f"saved {save(head, copy, results, args.quick)}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
